"""The HTTP routes, one module per concern, each a Quart blueprint made for one app."""
