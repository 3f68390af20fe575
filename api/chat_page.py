"""The browser chat page: ``GET /`` and its assets under ``GET /assets/<name>``.

``register_chat_page(app)`` adds the two routes. It receives the app and
reads the page's files from the ``api/static`` package folder once, at
registration; it emits them with their content type, an ``ETag`` (a 304
when the browser already has that version), ``Cache-Control: no-cache``
(the browser revalidates, so an upgraded server never runs stale script)
and a Content-Security-Policy that allows only this origin's own scripts,
styles and ``fetch`` calls. Only the files found there are served: a
request's path is looked up by name in that table, never joined to a
folder, so no path can reach another file. Everything the page does goes
through the public JSON API (``/v1/models``, ``/v1/chat/completions``),
by relative URLs, so the page also works behind a proxy under a sub-path.
The assets are under ``/assets/``, not ``/static/``: Quart's own static
route (the app's ``static_folder``) already answers ``/static/<filename>``.
"""

from __future__ import annotations

import hashlib
from importlib import resources

import attrs
from quart import Response, request
from werkzeug.exceptions import NotFound

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".png": "image/png",
    ".svg": "image/svg+xml",
    ".ico": "image/x-icon",
}

PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "Referrer-Policy": "no-referrer",
}


@attrs.frozen
class StaticFile:
    body: bytes
    content_type: str
    etag: str


def load_static_files(folder=None) -> dict[str, StaticFile]:
    """The servable files of ``folder`` (default ``api/static``; not its sub-folders), by name."""
    folder = folder if folder is not None else resources.files("api").joinpath("static")
    files = {}
    for entry in folder.iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if not entry.is_file() or suffix not in CONTENT_TYPES:
            continue
        body = entry.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
        files[entry.name] = StaticFile(body, CONTENT_TYPES[suffix], etag)
    return files


def static_response(file: StaticFile) -> Response:
    headers = {**PAGE_HEADERS, "ETag": file.etag}
    if file.etag in request.headers.get("If-None-Match", ""):
        return Response(b"", status=304, headers=headers)
    return Response(file.body, status=200, headers=headers, content_type=file.content_type)


def register_chat_page(app) -> None:
    """Serve the chat page at ``GET /`` and its assets at ``GET /assets/<name>``."""
    files = load_static_files()
    if "index.html" not in files:
        raise RuntimeError("the chat page's api/static/index.html is not installed")

    @app.get("/")
    async def chat_page():
        return static_response(files["index.html"])

    @app.get("/assets/<path:name>")
    async def chat_page_asset(name: str):
        file = files.get(name)
        if file is None:
            raise NotFound(f"no static file {name!r}")
        return static_response(file)
