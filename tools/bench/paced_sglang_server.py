"""A stand-in SGLang server that emits tokens at a fixed rate: generation costs wall time, not CPU
(as on a GPU box, where the rollout GPUs work while the trainer's CPU waits).

    python tools/bench/paced_sglang_server.py --host 127.0.0.1 --port 30000 --tokens-per-s 200 --vocab 40

Every request decodes one token per ``1 / tokens_per_s`` seconds, all requests at once (a batched
decode). Answers like SGLang 0.5.23 for what the trainer uses: ``/health``, ``/generate`` (random
token ids in ``[3, vocab)``, seeded by the input and the row's ``sampling_seed``; log-prob ``-1.0``
each; ``meta_info.weight_version`` and ``weight_versions`` spans: the version each token was
emitted under), ``/pause_generation`` (no token is emitted until ``/continue_generation``; every
mode keeps the requests, ``abort`` included), ``/update_weights_from_*`` (takes
``weight_version``), ``/abort_request`` (every running request answers at once with finish reason
``abort`` and its tokens so far), every other POST ``{"success": true}``.

Heavy-tailed lengths (``--length-median M``): each response's length is drawn from a lognormal
(median ``M``, ``--length-sigma``), capped at its ``max_new_tokens``; shorter ones finish with
``stop``. An aborted response is remembered by its full text (input + tokens so far): a request
whose input is that text continues it, with the same tokens and total length it would have had.
Without ``--length-median`` every response runs to ``max_new_tokens``.

With ``$HAPO_TEST_STANDIN_DIR`` set, it appends one JSON line per request to ``paced_<port>.jsonl``:
path, wall-clock start and end, weight versions, finish reasons. ``--die-at-request N`` exits when
the N-th ``/generate`` arrives (a crashed server, for fault tests).
"""

import argparse
import json
import math
import os
import random
import threading
import time

from standin_base import StandinHandler, serve

p = argparse.ArgumentParser()
p.add_argument("--host", default="127.0.0.1")
p.add_argument("--port", type=int, required=True)
p.add_argument("--tokens-per-s", type=float, default=200.0)
p.add_argument("--vocab", type=int, default=40)
p.add_argument("--api-key", default=None)
p.add_argument("--die-at-request", type=int, default=0, help="exit (like a crash) when this /generate arrives")
p.add_argument("--length-median", type=float, default=0.0, help="lognormal response lengths (0 = max_new_tokens)")
p.add_argument("--length-sigma", type=float, default=1.0)
args, _ = p.parse_known_args()
RECORD_DIR = os.environ.get("HAPO_TEST_STANDIN_DIR")
_state = {"version": "default", "generates": 0, "aborts": 0}
_running = threading.Event()
_running.set()
_lock = threading.Lock()
_resumable = {}  # full text of an aborted response -> (its random stream, tokens still to come)


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


def start_row(ids, sp):
    """(random stream, tokens to emit, finish reason at the end) of one row."""
    budget = int(sp["max_new_tokens"])
    with _lock:
        resumed = _resumable.pop(tuple(ids), None)
    if resumed is not None:
        rng, left = resumed
    else:
        rng = random.Random(hash((tuple(ids), sp.get("sampling_seed"))))
        left = budget
        if args.length_median > 0:  # drawn first, so a resumed response keeps it
            left = max(1, int(math.exp(rng.gauss(math.log(args.length_median), args.length_sigma))))
    return rng, min(left, budget), ("stop" if left <= budget and args.length_median > 0 else "length"), left


def generate(rows):
    """One batched decode of ``rows`` = [(input_ids, sampling_params)], all rows in lockstep."""
    plans = [start_row(ids, sp) for ids, sp in rows]
    outs, versions = [[] for _ in rows], [[] for _ in rows]
    aborts_at_start = _state["aborts"]
    aborted = False
    deadline = time.monotonic()
    for t in range(max((n for _, n, _, _ in plans), default=0)):
        # token t is due (t + 1) / rate after the start, pauses excluded: a late wake-up (a busy
        # machine) does not slow the rate down, as it would not on a GPU
        deadline += 1.0 / args.tokens_per_s
        time.sleep(max(0.0, deadline - time.monotonic()))
        if not _running.is_set():  # paused: nothing is emitted
            paused_at = time.monotonic()
            _running.wait()
            deadline += time.monotonic() - paused_at
        if _state["aborts"] != aborts_at_start:
            aborted = True
            break
        for r, (rng, n, _, _) in enumerate(plans):
            if t < n:
                outs[r].append(rng.randrange(3, args.vocab))
                versions[r].append(_state["version"])
    answers = []
    for (ids, _), (rng, n, reason, left), out, ver in zip(rows, plans, outs, versions):
        if aborted and len(out) < n:
            reason = "abort"
            with _lock:
                _resumable[tuple(ids) + tuple(out)] = (rng, left - len(out))
        meta = {"finish_reason": {"type": reason}, "output_token_logprobs": [[-1.0, t, None] for t in out],
                "weight_version": ver[-1] if ver else _state["version"], "weight_versions": spans_of(ver)}
        answers.append({"output_ids": out, "meta_info": meta})
    return answers


class Handler(StandinHandler):
    api_key = args.api_key

    def post(self, path, body):
        body = body or {}
        t0 = time.time()
        if path == "/generate":
            _state["generates"] += 1
            if _state["generates"] == args.die_at_request:
                record(path="died", start=t0)
                os._exit(1)
            out = generate(list(zip(body["input_ids"], body["sampling_params"])))
            record(path=path, rows=len(out), start=t0, end=time.time(),
                   versions=[o["meta_info"]["weight_versions"] for o in out],
                   finish=[o["meta_info"]["finish_reason"]["type"] for o in out])
            self.send_json(200, out)
            return
        if path == "/pause_generation":
            _running.clear()
        elif path == "/continue_generation":
            _running.set()
        elif path == "/abort_request":
            _state["aborts"] += 1
        elif path.startswith("/update_weights") and body.get("weight_version") is not None:
            _state["version"] = str(body["weight_version"])
        record(path=path, start=t0, end=time.time(), version=_state["version"])
        self.send_json(200, {"success": True, "message": "ok"})


server = serve(Handler, args.host, args.port)
record(path="start", pid=os.getpid(), start=time.time())
server.serve_forever()
