#!/usr/bin/env python
"""Benchmark: log-prob + entropy from hidden states (fused output layer) vs making the logits first.

For T tokens, hidden size H and a vocab shard of V/tp rows of the output weight it measures
forward + backward of `sum(grad_out * logprob)` (entropy computed, not differentiated, as in HAPO
training without an entropy bonus) down to `d hidden` and `d W`, for three variants:

- fused:    `hapo_megatron.parallel.linear_logprobs_entropy(hidden, W, ...)`, in vocab slices
            (the `[T, V/tp]` logits never exist);
- logits:   the output layer `hidden @ W^T`, then `vocab_parallel_logprobs_entropy` on the logits
            (chunked): what the trainer does with `model.fused_output_layer=false`;
- megatron: the output layer, then `megatron.core.tensor_parallel.vocab_parallel_cross_entropy`
            for the log-prob plus a separate vocab-parallel entropy pass (no_grad).

Each (variant, T, H, V/tp) runs in its own fresh subprocess (memory measured as in
`logprob_entropy.py`: CUDA allocator peak, or peak RSS on CPU, minus what was allocated before).
Time: the median wall time on CUDA; on CPU the smallest process CPU time of the repeats (use
--threads 1: on a shared machine wall time mostly measures the other processes). "extra" is the
peak beyond the gradients `d hidden` and `d W` that every variant returns; "logits" is the
`[T, V/tp]` shard that the fused path never holds (the logits path holds it and, in backward,
its gradient as well). Ratios are variant / logits.

    python tools/bench/linear_logprobs_entropy.py            # T {4k,16k} x H {1024,3584} x V/tp {32k,76k}
    python tools/bench/linear_logprobs_entropy.py --small    # quick CPU sizes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import logprob_entropy as base  # noqa: E402  (the memory probes and the separate entropy pass)

VARIANTS = ("fused", "logits", "megatron")
FULL = dict(tokens=(4096, 16384), hidden=(1024, 3584), vocab=(32768, 76032))
SMALL = dict(tokens=(1024, 2048), hidden=(256, 512), vocab=(8192, 19008))


def _loss_fn(variant, chunk_size):
    """`fn(hidden, weight, targets) -> (logprobs, entropy)` for one variant."""
    def fused(h, w, t):
        from hapo_megatron.parallel import linear_logprobs_entropy
        return linear_logprobs_entropy(h, w, t, chunk_size=chunk_size, temperature=1.0, sequence_parallel=False)

    def logits(h, w, t):
        from hapo_megatron.parallel import vocab_parallel_logprobs_entropy
        return vocab_parallel_logprobs_entropy(h @ w.t(), t, chunk_size=chunk_size, temperature=1.0)

    def megatron(h, w, t):
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
        x = h @ w.t()
        ent = base._vocab_parallel_entropy_no_grad(x, None)  # before the CE overwrites x in place
        return -vocab_parallel_cross_entropy(x, t), ent

    return {"fused": fused, "logits": logits, "megatron": megatron}[variant]


def _measure(opts: dict) -> dict:
    import torch

    if opts.get("threads"):
        torch.set_num_threads(opts["threads"])
    if opts["variant"] == "megatron":  # Megatron's cross entropy reads its TP group (one rank here)
        from hapo_megatron.compat import activate_cpu_shims
        from hapo_megatron.parallel.groups import initialize_parallel
        activate_cpu_shims()  # megatron-core on CPU (gloo); a no-op where CUDA is available
        initialize_parallel(tp=1)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    dtype = getattr(torch, opts["dtype"])
    T, H, V = opts["tokens"], opts["hidden"], opts["vocab"]
    gen = torch.Generator().manual_seed(1234)
    hidden = (torch.randn(T, H, generator=gen)).to(dev, dtype)
    weight = (torch.randn(V, H, generator=gen) * (3.0 / H ** 0.5)).to(dev, dtype)  # logits ~ N(0, 9)
    targets = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(7)).to(dev)
    grad_out = torch.randn(T, generator=torch.Generator().manual_seed(8)).to(dev)
    fn = _loss_fn(opts["variant"], opts["chunk_size"])

    def step():
        h, w = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
        lp, ent = fn(h, w, targets)
        (lp * grad_out).sum().backward()
        return lp.detach(), ent.detach(), h.grad, w.grad

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    lp, ent, dh, dw = step()  # warm-up (and the numbers the smoke test compares)
    sync()
    check = {"lp": base._probe(lp), "ent": base._probe(ent), "dh": base._probe(dh), "dw": base._probe(dw)}
    grads = dh.numel() * dh.element_size() + dw.numel() * dw.element_size()
    del lp, ent, dh, dw
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    else:
        base._reset_peak_rss()
        start = base._rss_bytes()
    times, cpu_times = [], []
    for _ in range(opts["repeats"]):
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        out = step()
        sync()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        del out
    peak = (torch.cuda.max_memory_allocated() if cuda else base._peak_rss_bytes()) - start
    shard = T * V * hidden.element_size()
    # On CPU the ratios use the process's CPU time: on a shared machine wall time mostly measures
    # the other processes (with --threads 1, CPU time is this variant's own work).
    cost = statistics.median(times) if cuda else min(cpu_times)
    return {"time_ms": 1e3 * cost, "wall_ms": 1e3 * statistics.median(times), "peak_bytes": max(peak, 0),
            "shard_bytes": shard, "extra_bytes": max(peak - grads, 0), "device": str(dev), "check": check}


def _run_one(opts: dict) -> dict:
    return base._run_one(opts, script=__file__)


HEADER = (f"{'T':>6} {'H':>5} {'V/tp':>6} {'variant':>9} {'fwd+bwd ms':>11} {'wall ms':>8} {'extra MiB':>9} "
          f"{'logits MiB':>10} {'extra/logits':>12} {'time/logits':>11} {'extra/logits-var':>16}")


def run_benchmark(tokens, hiddens, vocabs, *, dtype="float32", chunk_size=None, repeats=3,
                  variants=VARIANTS, threads=None, out=print) -> list:
    """Measure every (T, H, V/tp, variant); print the table; return the rows."""
    rows = []
    out(HEADER)
    for T in tokens:
        for H in hiddens:
            for V in vocabs:
                cs = chunk_size or max(1, T // 32)
                res = {v: _run_one(dict(variant=v, tokens=T, hidden=H, vocab=V, dtype=dtype, chunk_size=cs,
                                        repeats=repeats, threads=threads)) for v in variants}
                ref = res.get("logits", {})
                for v in variants:
                    r = res[v]
                    if "error" in r:
                        out(f"{T:>6} {H:>5} {V:>6} {v:>9}  FAILED {r['error'][:90]}")
                        continue
                    t_ratio = r["time_ms"] / ref["time_ms"] if "time_ms" in ref else float("nan")
                    m_ratio = r["extra_bytes"] / ref["extra_bytes"] if ref.get("extra_bytes") else float("nan")
                    out(f"{T:>6} {H:>5} {V:>6} {v:>9} {r['time_ms']:>11.1f} {r['wall_ms']:>8.0f} "
                        f"{base._fmt_mib(r['extra_bytes'])} {r['shard_bytes'] / 2**20:>10.0f} "
                        f"{r['extra_bytes'] / r['shard_bytes']:>12.3f} {t_ratio:>11.2f} {m_ratio:>16.3f}")
                    rows.append(dict(r, T=T, H=H, V=V, variant=v, chunk_size=cs))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", help="token counts T (default 4096 16384)")
    p.add_argument("--hidden", type=int, nargs="+", help="hidden sizes H (default 1024 3584)")
    p.add_argument("--vocab", type=int, nargs="+", help="vocab shard sizes V/tp (default 32768 76032)")
    p.add_argument("--small", action="store_true", help="quick sizes: T 1024/2048, H 256/512, V/tp 8192/19008")
    p.add_argument("--dtype", default="float32", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default T/32)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up (median)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print("RESULT " + json.dumps(_measure(json.loads(a.worker))), flush=True)
        return 0
    sizes = SMALL if a.small else FULL
    print(f"# dtype={a.dtype} repeats={a.repeats} chunk_size={a.chunk_size or 'T/32'} "
          f"threads={a.threads or 'default'}", flush=True)
    rows = run_benchmark(a.tokens or sizes["tokens"], a.hidden or sizes["hidden"], a.vocab or sizes["vocab"],
                         dtype=a.dtype, chunk_size=a.chunk_size, repeats=a.repeats, variants=a.variants,
                         threads=a.threads, out=lambda s: print(s, flush=True))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
