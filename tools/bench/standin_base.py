"""What the stand-in SGLang servers share (tools/bench/paced_sglang_server.py,
tests/rollout/standin_sglang_server.py): the JSON answers, ``/health``, SGLang's API-key check
(401 without ``Authorization: Bearer <key>``), a threading HTTP server. Each server subclasses
`StandinHandler` with its own ``post(path, body)``."""

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StandinHandler(BaseHTTPRequestHandler):
    """``api_key`` (class attribute): the key every request but ``/health`` must carry;
    ``refused(path)`` hears of a request without it."""

    api_key = None

    def send_json(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.send_json(200 if self.path == "/health" else 404, None)

    def do_POST(self):
        if self.api_key and self.headers.get("Authorization") != f"Bearer {self.api_key}":
            self.refused(self.path)
            self.send_json(401, {"error": "Unauthorized"})
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null")
        self.post(self.path, body)

    def refused(self, path):
        pass

    def post(self, path, body):
        raise NotImplementedError

    def log_message(self, *a):
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # a listen backlog like SGLang's (uvicorn: 2048), not socketserver's 5: the trainer opens one
    # connection per prompt group at once, and a full backlog drops connections (retried after 1 s)
    request_queue_size = 2048


def serve(handler, host, port):
    """A threading server on ``(host, port)`` (not yet serving: ``serve_forever``)."""
    return _Server((host, port), handler)
