"""A stand-in SGLang server that emits tokens at a fixed rate: generation costs wall time, not CPU
(as on a GPU box, where the rollout GPUs work while the trainer's CPU waits).

    python tools/bench/paced_sglang_server.py --host 127.0.0.1 --port 30000 --tokens-per-s 200 --vocab 40

Every request decodes one token per ``1 / tokens_per_s`` seconds, all requests at once (a batched
decode). Answers like SGLang 0.5.23 for what the trainer uses: ``/health``, ``/generate`` (random
token ids in ``[3, vocab)``, seeded by the prompt; log-prob ``-1.0`` each; ``meta_info.weight_version``
and ``weight_versions`` spans: the version each token was emitted under), ``/pause_generation``
(no token is emitted until ``/continue_generation``; every mode keeps the requests, ``abort``
included), ``/update_weights_from_*`` (takes ``weight_version``), every other POST ``{"success":
true}``. With ``$HAPO_TEST_STANDIN_DIR`` set, it appends one JSON line per request to
``paced_<port>.jsonl``: path, wall-clock start and end, weight versions. ``--die-at-request N``
exits when the N-th ``/generate`` arrives (a crashed server, for fault tests).
"""

import argparse
import json
import os
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("--host", default="127.0.0.1")
p.add_argument("--port", type=int, required=True)
p.add_argument("--tokens-per-s", type=float, default=200.0)
p.add_argument("--vocab", type=int, default=40)
p.add_argument("--api-key", default=None)
p.add_argument("--die-at-request", type=int, default=0, help="exit (like a crash) when this /generate arrives")
args, _ = p.parse_known_args()
RECORD_DIR = os.environ.get("HAPO_TEST_STANDIN_DIR")
_state = {"version": "default", "generates": 0}
_running = threading.Event()
_running.set()
_lock = threading.Lock()


def record(**entry):
    if RECORD_DIR:
        with _lock, open(os.path.join(RECORD_DIR, f"paced_{args.port}.jsonl"), "a") as f:
            f.write(json.dumps(entry) + "\n")


def spans_of(versions):
    spans = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


def generate(rows):
    """One batched decode of ``rows`` = [(input_ids, sampling_params)], all rows in lockstep."""
    rngs = [random.Random(hash((tuple(ids), sp.get("sampling_seed")))) for ids, sp in rows]
    lengths = [int(sp["max_new_tokens"]) for _, sp in rows]
    outs, versions = [[] for _ in rows], [[] for _ in rows]
    deadline = time.monotonic()
    for t in range(max(lengths, default=0)):
        # token t is due (t + 1) / rate after the start, pauses excluded: a late wake-up (a busy
        # machine) does not slow the rate down, as it would not on a GPU
        deadline += 1.0 / args.tokens_per_s
        time.sleep(max(0.0, deadline - time.monotonic()))
        if not _running.is_set():  # paused: nothing is emitted
            paused_at = time.monotonic()
            _running.wait()
            deadline += time.monotonic() - paused_at
        for r, rng in enumerate(rngs):
            if t < lengths[r]:
                outs[r].append(rng.randrange(3, args.vocab))
                versions[r].append(_state["version"])
    answers = []
    for out, ver in zip(outs, versions):
        meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-1.0, t, None] for t in out],
                "weight_version": ver[-1] if ver else _state["version"], "weight_versions": spans_of(ver)}
        answers.append({"output_ids": out, "meta_info": meta})
    return answers


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
            self._send(401, {"error": "Unauthorized"})
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null") or {}
        t0 = time.time()
        if self.path == "/generate":
            _state["generates"] += 1
            if _state["generates"] == args.die_at_request:
                record(path="died", start=t0)
                os._exit(1)
            out = generate(list(zip(body["input_ids"], body["sampling_params"])))
            record(path=self.path, rows=len(out), start=t0, end=time.time(),
                   versions=[o["meta_info"]["weight_versions"] for o in out])
            self._send(200, out)
            return
        if self.path == "/pause_generation":
            _running.clear()
        elif self.path == "/continue_generation":
            _running.set()
        elif self.path.startswith("/update_weights") and body.get("weight_version") is not None:
            _state["version"] = str(body["weight_version"])
        record(path=self.path, start=t0, end=time.time(), version=_state["version"])
        self._send(200, {"success": True, "message": "ok"})

    def log_message(self, *a):
        pass


ThreadingHTTPServer.daemon_threads = True
# a listen backlog like SGLang's (uvicorn: 2048), not socketserver's 5: the trainer opens one
# connection per prompt group at once, and a full backlog drops connections (retried after 1 s)
ThreadingHTTPServer.request_queue_size = 2048
server = ThreadingHTTPServer((args.host, args.port), Handler)
record(path="start", pid=os.getpid(), start=time.time())
server.serve_forever()
