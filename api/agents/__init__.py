"""The agent APIs: OpenAI Responses (Codex) and Anthropic Messages (Claude Code).

Both turn their request into a ``ChatTurn`` and generate through the same
Session, Detokenizer and prompt cache as chat completions. One module per
concern:

* ``blocks``: what both share (``ChatTurn``, ``open_session``, the
  ``BlockAssembler`` state machine, ``AgentRenderer``, ``sse_event``);
* ``responses_schema`` (request types), ``responses_input`` (request ->
  ``ChatTurn``), ``responses_store`` (finished responses for
  ``previous_response_id``), ``responses_render`` (the ``response`` object and
  its events), ``responses_routes`` (the blueprint);
* ``messages_schema``, ``messages_input``, ``messages_render``,
  ``messages_routes`` the same for Anthropic Messages, and
  ``messages_errors`` (errors in Anthropic's shape);
* ``openapi``: their part of ``/openapi.json``;
* ``routes``: ``register_agent_apis``, the hook ``api.server`` calls.
"""
