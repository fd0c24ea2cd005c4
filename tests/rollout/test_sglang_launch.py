"""Process handling with real child processes (a tiny stand-in HTTP server, not SGLang)."""

import sys
import textwrap

import pytest

from hapo_megatron.rollout.sglang_client import SGLangHTTP, ServerDiedError
from hapo_megatron.rollout.sglang_launch import free_port, start_process, stop_process

FAKE_SERVER = textwrap.dedent("""
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class H(BaseHTTPRequestHandler):
        def _send(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200 if self.path == "/health" else 404, None)

        def do_POST(self):
            n = int(self.headers["Content-Length"])
            body = json.loads(self.rfile.read(n))
            self._send(200, {"echo": body})

        def log_message(self, *a):
            pass

    print("fake server up", flush=True)
    HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_start_health_request_stop(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    port = free_port()
    h = start_process([sys.executable, str(script), str(port)], f"http://127.0.0.1:{port}",
                      log_path=str(tmp_path / "server.log"))
    http = SGLangHTTP(timeout_s=10, max_retries=0)
    try:
        http.wait_healthy(h, timeout_s=60, poll_s=0.2)
        assert http.request(h, "/generate", {"x": 1}) == {"echo": {"x": 1}}
        http.check_alive(h)
    finally:
        stop_process(h, timeout_s=10)
    assert h.exit_code() is not None
    with pytest.raises(ServerDiedError, match="exited with code"):
        http.request(h, "/generate", {})
    assert "fake server up" in (tmp_path / "server.log").read_text()


def test_crashing_server_reports_its_log(tmp_path):
    code = "import sys; print('RuntimeError: no CUDA devices', flush=True); sys.exit(3)"
    h = start_process([sys.executable, "-c", code], "http://127.0.0.1:9", log_path=str(tmp_path / "s.log"))
    http = SGLangHTTP(timeout_s=5, max_retries=0)
    with pytest.raises(ServerDiedError, match="exited with code 3(.|\n)*no CUDA devices"):
        http.wait_healthy(h, timeout_s=60, poll_s=0.2)
