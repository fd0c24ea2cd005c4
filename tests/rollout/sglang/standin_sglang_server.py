"""A stand-in for ``python -m sglang.launch_server`` (no model, starts in a fraction of a second).

Takes SGLang's command line, binds ``--host``/``--port`` and answers like a server: ``/health``,
``/generate`` (token ``p[0] + i + 1``, log-prob ``-0.1 * (i + 1)``), every other POST
``{"success": true}``. It appends what it saw to ``$HAPO_TEST_STANDIN_DIR/server_<port>.jsonl``:
a ``start`` line (argv, bound address, pid, parent pid) and one line per request.
``$HAPO_TEST_STANDIN_UPDATE_DELAY_S`` delays weight updates (to expose missing barriers).
``$HAPO_TEST_STANDIN_VOCAB`` keeps the generated token ids below it. A slow server:
``$HAPO_TEST_STANDIN_HOLD_AFTER=N`` holds every ``/generate`` after the first N until an
``/abort_request`` that comes after it (then answered with finish reason ``abort``, as SGLang
does: an abort ends the requests it finds, not the later ones), and the first held
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

# the handler's shared part lives with the paced stand-in (tools/bench/standin_base.py)
_ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
sys.path.insert(0, os.path.join(_ROOT, "tools", "bench"))
from standin_base import StandinHandler, serve  # noqa: E402

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
_aborts = [0]  # /abort_request calls so far; a held request waits for one more than it saw
_abort_came = threading.Condition()
_generate_calls = [0]


def record(**entry):
    with _lock, open(RECORD, "a") as f:
        f.write(json.dumps(entry) + "\n")


def generate(ids, sp):
    out = [ids[0] + i + 1 for i in range(sp["max_new_tokens"])]
    out = [t % VOCAB for t in out] if VOCAB else out
    triples = [[-0.1 * (i + 1), t, None] for i, t in enumerate(out)]
    return {"output_ids": out, "meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": triples}}


class Handler(StandinHandler):
    api_key = args.api_key

    def refused(self, path):
        record(path=path, refused=True)

    def post(self, path, body):
        if path == "/generate":
            record(path=path, rows=len(body["input_ids"]))
            if self._held():
                self.send_json(200, [{"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"},
                                                                      "output_token_logprobs": []}}
                                     for _ in body["input_ids"]])
                return
            self.send_json(200, [generate(i, sp) for i, sp in zip(body["input_ids"], body["sampling_params"])])
            return
        if path == "/abort_request":
            with _abort_came:
                _aborts[0] += 1
                _abort_came.notify_all()
        if path.startswith("/update_weights") and DELAY_S:
            time.sleep(DELAY_S)
        record(path=path, body={k: v for k, v in (body or {}).items() if k != "input_ids"})
        self.send_json(200, {"success": True, "message": "ok"})

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
        with _abort_came:
            seen = _aborts[0]
        record(path="held")
        if first_held and SIGNAL_PID_FILE:
            with open(SIGNAL_PID_FILE) as f:
                os.kill(int(f.read()), signal.SIGUSR1)
        with _abort_came:
            return _abort_came.wait_for(lambda: _aborts[0] > seen, HOLD_BOUND_S)


server = serve(Handler, args.host, args.port)
argv = [a.replace(args.api_key, "<key>") if args.api_key else a for a in sys.argv[1:]]  # FLAG=KEY too
record(path="start", argv=argv, bound=server.server_address[0], pid=os.getpid(), ppid=os.getppid())
server.serve_forever()
