#!/usr/bin/env bash
# CI: a non-editable install serves. Builds the wheel, installs it into a fresh
# virtualenv outside the checkout, starts `mlx-trio-server` (the embedded demo
# model) from there and asks it one chat completion. An editable install hides
# a package or data file the wheel leaves out; this does not.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
server=""
cleanup() {
    if [ -n "$server" ]; then kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

python3 -m venv "$work/build-env"
"$work/build-env/bin/pip" wheel --no-deps -q -w "$work/dist" "$repo"
wheel="$(ls "$work"/dist/mlx_trio_server-*.whl)"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q "${wheel}[cpu]"

cd "$work"  # nothing of the checkout on the path
port="$("$work/venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$work/venv/bin/mlx-trio-server" --host 127.0.0.1 --port "$port" >"$work/server.log" 2>&1 &
server=$!
"$work/venv/bin/python" - "$port" "$work/server.log" <<'PY'
import json, sys, time, urllib.error, urllib.request

port, log = sys.argv[1], sys.argv[2]
base = f"http://127.0.0.1:{port}"
deadline = time.monotonic() + 300
while True:
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as reply:
            if reply.status == 200:
                break
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        pass
    if time.monotonic() > deadline:
        sys.exit("the wheel-installed server never became healthy:\n" + open(log).read())
    time.sleep(1)
body = json.dumps({"messages": [{"role": "user", "content": "What is 47 + 85?"}],
                   "max_tokens": 64}).encode()
request = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=120) as reply:
    answer = json.load(reply)
message = answer["choices"][0]["message"]
if not (message.get("content") or message.get("reasoning")):
    sys.exit(f"empty answer from the wheel-installed server: {answer}")
print("wheel install serves:", json.dumps(message["content"]))
PY
