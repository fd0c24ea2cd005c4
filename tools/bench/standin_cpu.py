"""The paced stand-in server's own CPU per step (`paced_sglang_server.py`, which `async_rollout.py`
runs): the async bench's request pattern, ``--groups`` concurrent ``/generate`` calls of ``--rows``
rows x ``--tokens`` tokens per step, at ``--tokens-per-s`` and at an unbounded rate. What is left at
the unbounded rate is the server's HTTP and JSON handling, which no pacing scheme removes; on a
2-core machine that CPU comes out of the trainer's cores (docs/architecture.md, "Where the
trainer's time goes under overlap").

    python tools/bench/standin_cpu.py --tokens-per-s 40 --steps 5

Prints, per rate, the server process's CPU seconds per step (user + system) and the wall seconds
per step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from async_rollout import start_servers, stop_servers  # noqa: E402

UNBOUNDED = 1e6  # tokens/s: no wait between tokens


def measure(tokens_per_s: float, *, steps: int, groups: int, rows: int, tokens: int) -> dict:
    """One server at ``tokens_per_s``: CPU and wall seconds per step of ``steps`` steps."""
    import psutil
    with tempfile.TemporaryDirectory() as record:
        procs, urls = start_servers(1, tokens_per_s, record)
        try:
            server = psutil.Process(procs[0].pid)

            def generate(g: int) -> int:
                body = {"input_ids": [[5, 6, g]] * rows,
                        "sampling_params": [{"max_new_tokens": tokens, "sampling_seed": k} for k in range(rows)]}
                req = urllib.request.Request(urls[0] + "/generate", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=120) as answer:
                    out = json.loads(answer.read())
                return sum(len(o["output_ids"]) for o in out)

            cpu0, t0 = sum(server.cpu_times()[:2]), time.monotonic()
            with ThreadPoolExecutor(groups) as pool:
                for _ in range(steps):
                    emitted = sum(pool.map(generate, range(groups)))
                    if emitted != groups * rows * tokens:
                        raise RuntimeError(f"the server emitted {emitted} tokens, expected {groups * rows * tokens}")
            return {"tokens_per_s": tokens_per_s, "cpu_s_per_step": (sum(server.cpu_times()[:2]) - cpu0) / steps,
                    "wall_s_per_step": (time.monotonic() - t0) / steps}
        finally:
            stop_servers(procs)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens-per-s", type=float, default=40.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--groups", type=int, default=16, help="concurrent /generate calls per step (prompt groups)")
    ap.add_argument("--rows", type=int, default=8, help="responses per group")
    ap.add_argument("--tokens", type=int, default=24, help="tokens per response")
    args = ap.parse_args(argv)
    size = dict(steps=args.steps, groups=args.groups, rows=args.rows, tokens=args.tokens)
    res = {"paced": measure(args.tokens_per_s, **size), "unbounded": measure(UNBOUNDED, **size)}
    print(f"{args.groups} calls x {args.rows} rows x {args.tokens} tokens per step, {args.steps} steps")
    print("| rate | server CPU s/step | wall s/step |\n|---|---|---|")
    for name, r in res.items():
        rate = f"{r['tokens_per_s']:g} tokens/s" if name == "paced" else "unbounded"
        print(f"| {rate} | {r['cpu_s_per_step']:.4f} | {r['wall_s_per_step']:.3f} |")
    return res


if __name__ == "__main__":
    main()
