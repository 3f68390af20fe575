"""A local stand-in for the Hugging Face Hub: one model repository, over HTTP.

``FakeHub(repo, directory)`` serves the files of ``directory`` as the
repository ``repo`` at one commit, answering the requests huggingface_hub's
``snapshot_download`` makes (repository info, the file tree, then a HEAD and
a GET per file under ``/<repo>/resolve/<commit>/``); point a process at it
with ``HF_ENDPOINT=hub.endpoint`` (and ``HF_HUB_DISABLE_XET=1``: plain HTTP
downloads). It records the paths asked for. Nothing leaves the machine.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repo: str, directory: str | Path):
        self.repo = repo
        self.files = {p.name: p.read_bytes() for p in Path(directory).iterdir() if p.is_file()}
        self.requests: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def size(self) -> int:
        return sum(len(data) for data in self.files.values())

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, *, body: bool) -> None:
                path = self.path.split("?")[0]
                hub.requests.append(f"{self.command} {path}")
                api = f"/api/models/{hub.repo}"
                if path in (api, f"{api}/revision/main"):
                    siblings = [{"rfilename": name} for name in hub.files]
                    return self._send(json.dumps({"id": hub.repo, "sha": COMMIT,
                                                  "siblings": siblings}).encode(), body)
                if path == f"{api}/tree/{COMMIT}":
                    tree = [{"type": "file", "path": name, "size": len(data),
                             "oid": hashlib.sha1(data).hexdigest()}
                            for name, data in hub.files.items()]
                    return self._send(json.dumps(tree).encode(), body)
                name = path.removeprefix(f"/{hub.repo}/resolve/{COMMIT}/")
                if name in hub.files:
                    data = hub.files[name]
                    return self._send(data, body, etag=hashlib.sha1(data).hexdigest())
                self._send(b"", body, status=404)

            def _send(self, data: bytes, body: bool, *, status: int = 200, etag: str = "") -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("X-Repo-Commit", COMMIT)
                if etag:
                    self.send_header("ETag", f'"{etag}"')
                self.end_headers()
                if body:
                    self.wfile.write(data)

        return Handler
