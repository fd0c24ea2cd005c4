"""A stand-in for ``python -m sglang.launch_server`` (no model, starts in a fraction of a second).

Takes SGLang's command line, binds ``--host``/``--port`` and answers like a server: ``/health``,
``/generate`` (token ``p[0] + i + 1``, log-prob ``-0.1 * (i + 1)``), every other POST
``{"success": true}``. It appends what it saw to ``$HAPO_TEST_STANDIN_DIR/server_<port>.jsonl``:
a ``start`` line (argv, bound address, pid, parent pid) and one line per request.
``$HAPO_TEST_STANDIN_UPDATE_DELAY_S`` delays weight updates (to expose missing barriers).
``$HAPO_TEST_STANDIN_VOCAB`` keeps the generated token ids below it. A slow server:
``$HAPO_TEST_STANDIN_HOLD_AFTER=N`` holds every ``/generate`` after the first N until a
``/abort_request`` (then answered with finish reason ``abort``, as SGLang does), and the first held
request sends SIGUSR1 to the pid written in ``$HAPO_TEST_STANDIN_SIGNAL_PID_FILE`` (a stop signal
that arrives in the middle of a rollout).
Started with ``--api-key`` (as the trainer's servers are), it answers 401 to every request but
``/health`` that does not carry ``Authorization: Bearer <key>``, like SGLang.
"""

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("--host", required=True)
p.add_argument("--port", type=int, required=True)
p.add_argument("--api-key", default=None)
args, _ = p.parse_known_args()
RECORD = os.path.join(os.environ["HAPO_TEST_STANDIN_DIR"], f"server_{args.port}.jsonl")
DELAY_S = float(os.environ.get("HAPO_TEST_STANDIN_UPDATE_DELAY_S", "0"))
VOCAB = int(os.environ.get("HAPO_TEST_STANDIN_VOCAB", "0"))
HOLD_AFTER = os.environ.get("HAPO_TEST_STANDIN_HOLD_AFTER")
SIGNAL_PID_FILE = os.environ.get("HAPO_TEST_STANDIN_SIGNAL_PID_FILE")
# a held request that is never aborted is answered anyway after this: the test fails, not hangs
HOLD_BOUND_S = float(os.environ.get("HAPO_TEST_STANDIN_HOLD_BOUND_S", "600"))
_lock = threading.Lock()
_aborted = threading.Event()
_generate_calls = [0]


def record(**entry):
    with _lock, open(RECORD, "a") as f:
        f.write(json.dumps(entry) + "\n")


def generate(ids, sp):
    out = [ids[0] + i + 1 for i in range(sp["max_new_tokens"])]
    out = [t % VOCAB for t in out] if VOCAB else out
    triples = [[-0.1 * (i + 1), t, None] for i, t in enumerate(out)]
    return {"output_ids": out, "meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": triples}}


class Handler(BaseHTTPRequestHandler):
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
        if args.api_key and self.headers.get("Authorization") != f"Bearer {args.api_key}":
            record(path=self.path, refused=True)
            self._send(401, {"error": "Unauthorized"})
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null")
        if self.path == "/generate":
            record(path=self.path, rows=len(body["input_ids"]))
            if self._held():
                self._send(200, [{"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"},
                                                                  "output_token_logprobs": []}}
                                 for _ in body["input_ids"]])
                return
            self._send(200, [generate(i, sp) for i, sp in zip(body["input_ids"], body["sampling_params"])])
            return
        if self.path == "/abort_request":
            _aborted.set()
        if self.path.startswith("/update_weights") and DELAY_S:
            time.sleep(DELAY_S)
        record(path=self.path, body={k: v for k, v in (body or {}).items() if k != "input_ids"})
        self._send(200, {"success": True, "message": "ok"})

    def _held(self) -> bool:
        """Hold this /generate until /abort_request (True) when it comes after the first HOLD_AFTER."""
        if HOLD_AFTER is None:
            return False
        with _lock:
            _generate_calls[0] += 1
            n = _generate_calls[0]
        if n <= int(HOLD_AFTER):
            return False
        first_held = n == int(HOLD_AFTER) + 1
        record(path="held")
        if first_held and SIGNAL_PID_FILE:
            with open(SIGNAL_PID_FILE) as f:
                os.kill(int(f.read()), signal.SIGUSR1)
        return _aborted.wait(HOLD_BOUND_S)

    def log_message(self, *a):
        pass


server = ThreadingHTTPServer((args.host, args.port), Handler)
argv = [a.replace(args.api_key, "<key>") if args.api_key else a for a in sys.argv[1:]]  # FLAG=KEY too
record(path="start", argv=argv, bound=server.server_address[0], pid=os.getpid(), ppid=os.getppid())
server.serve_forever()
