#!/usr/bin/env python
"""Benchmark: fused vocab-parallel log-prob + entropy vs the usual alternatives.

For T tokens and a vocab shard of V/tp logits per rank (bf16 by default) it measures forward +
backward of `sum(grad_out * logprob)` (entropy computed but, as in HAPO training without an
entropy bonus, not differentiated) for three variants:

- ours:     `hapo_megatron.parallel.vocab_parallel_logprobs_entropy` (chunked over tokens);
- naive:    (a) all-gather the vocab, float32 `log_softmax`, gather, entropy, autograd;
- megatron: (b) `megatron.core.tensor_parallel.vocab_parallel_cross_entropy` on a clone of the
            logits (it works in place) for the log-prob, plus a separate vocab-parallel entropy
            pass (under no_grad: the cheapest version of that pass).

Each (variant, T, V/tp) runs in its own fresh subprocess so peak memory is that variant's
alone. Memory: on CUDA `torch.cuda.max_memory_allocated` minus what was allocated before the
run (logits, targets); on CPU the peak RSS (`VmHWM`, reset just before the runs through
/proc/self/clear_refs) minus the RSS before the runs (large CPU tensors are mmap-ed, so RSS
follows live tensors; resolution a few MiB). "extra" is
the peak beyond the logits shard and its gradient, also given as a fraction of the shard.

    python tools/bench/logprob_entropy.py                 # T in {4k,16k} x V/tp in {32k,76k}
    python tools/bench/logprob_entropy.py --small         # quick CPU sizes
    python tools/bench/logprob_entropy.py --tp 2 --small  # 2 gloo/nccl ranks per variant
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

VARIANTS = ("ours", "naive", "megatron")
FULL_TOKENS, FULL_VOCAB = (4096, 16384), (32768, 76032)  # 76032 = Qwen2.5's 152064 / tp 2
SMALL_TOKENS, SMALL_VOCAB = (1024, 2048), (8192, 19008)


# ----------------------------------------------------------------------------- variants

def _naive(x, targets, tp_group):
    import torch
    import torch.distributed as dist

    full = x
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        full = _gather_vocab_fn().apply(x, tp_group)
    logp = torch.log_softmax(full.float(), dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


_GATHER_CLS = None


def _gather_vocab_fn():
    """Autograd all-gather over the vocab (built lazily: torch is imported in the worker only)."""
    global _GATHER_CLS
    if _GATHER_CLS is None:
        _GATHER_CLS = _make_gather()
    return _GATHER_CLS


def _make_gather():
    import torch
    import torch.distributed as dist

    class GatherVocab(torch.autograd.Function):
        """All-gather along the vocab; backward keeps this rank's slice (every rank has the same loss)."""

        @staticmethod
        def forward(ctx, x, group):
            ctx.group, ctx.width = group, x.shape[-1]
            parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, x.contiguous(), group=group)
            return torch.cat(parts, dim=-1)

        @staticmethod
        def backward(ctx, grad):
            r = dist.get_rank(ctx.group)
            return grad[..., r * ctx.width:(r + 1) * ctx.width].contiguous(), None

    return GatherVocab


def _vocab_parallel_entropy_no_grad(x, tp_group):
    """Separate entropy pass as done next to Megatron's cross entropy (max, exp, two sums)."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        z = x.float()
        m = z.max(dim=-1).values
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
        z = z - m.unsqueeze(-1)
        e = torch.exp(z)
        sums = torch.stack([e.sum(-1), (e * z).sum(-1)], dim=-1)
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(sums, group=tp_group)
        return torch.log(sums[..., 0]) - sums[..., 1] / sums[..., 0]


def _megatron(x, targets, tp_group):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    lp = -vocab_parallel_cross_entropy(x.clone(), targets)
    return lp, _vocab_parallel_entropy_no_grad(x, tp_group)


def _ours(chunk_size):
    def run(x, targets, tp_group):
        from hapo_megatron.parallel import vocab_parallel_logprobs_entropy

        return vocab_parallel_logprobs_entropy(x, targets, tp_group=tp_group, chunk_size=chunk_size, temperature=1.0)

    return run


# ----------------------------------------------------------------------------- one measurement

def _probe(t) -> float:
    """A fixed random projection of a tensor: variants agree iff these agree (to rounding).
    Drawn and summed on the tensor's device, row block by row block: at T=16k x V=76k a float64
    copy on the host took minutes and 20 GB."""
    import torch
    g = torch.Generator(device=t.device).manual_seed(99)
    flat = t.detach().reshape(t.shape[0], -1) if t.dim() else t.detach().reshape(1, 1)
    total = 0.0
    for s in range(0, flat.shape[0], 1024):
        block = flat[s:s + 1024].double()
        total += float((block * torch.randn(block.shape, generator=g, dtype=torch.float64, device=t.device)).sum())
    return total


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) so earlier transients (imports) do not count."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    """VmHWM (peak RSS since the last reset); falls back to ru_maxrss (peak since start)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _measure(rank: int, tp: int, opts: dict) -> dict:
    """Run one variant on this rank; returns time and memory figures."""
    import torch
    import torch.distributed as dist

    from hapo_megatron.compat import activate_cpu_shims
    from hapo_megatron.parallel.groups import initialize_parallel

    activate_cpu_shims()  # megatron-core on CPU (gloo); a no-op where CUDA is available
    if opts.get("threads"):
        torch.set_num_threads(opts["threads"])
    g = initialize_parallel(tp=tp)
    tp_group = g.tp if tp > 1 else None
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, opts["dtype"])
    T, Vp = opts["tokens"], opts["vocab"]
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)  # drawn where they are used
    logits = torch.empty(T, Vp, dtype=dtype, device=dev)
    for s in range(0, T, 256):  # fill in row chunks: no full-size float32 transient
        logits[s:s + 256] = (torch.randn(min(256, T - s), Vp, generator=gen, device=dev) * 3).to(dtype)
    targets = torch.randint(0, Vp * tp, (T,), generator=torch.Generator().manual_seed(7)).to(dev)
    grad_out = torch.randn(T, generator=torch.Generator().manual_seed(8)).to(dev)
    fn = {"naive": _naive, "megatron": _megatron}.get(opts["variant"]) or _ours(opts["chunk_size"])

    def step():
        x = logits.detach().requires_grad_(True)
        lp, ent = fn(x, targets, tp_group)
        (lp * grad_out).sum().backward()
        return lp, ent, x.grad

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # Warm-up outside the measurement: first calls page in kernels' code and set up buffers
    # (and gives the numbers the variants must agree on).
    lp, ent, grad = step()
    sync()
    check = {"lp": _probe(lp), "ent": _probe(ent), "grad": _probe(grad)}
    del lp, ent, grad
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        _reset_peak_rss()
        base = _rss_bytes()
    times = []
    for _ in range(opts["repeats"]):
        if tp > 1:
            dist.barrier()
        sync()
        t0 = time.perf_counter()
        out = step()
        sync()
        times.append(time.perf_counter() - t0)
        del out
    peak = (torch.cuda.max_memory_allocated() if cuda else _peak_rss_bytes()) - base
    shard = T * Vp * logits.element_size()
    return {"time_ms": 1e3 * statistics.median(times), "peak_bytes": max(peak, 0), "shard_bytes": shard,
            "extra_bytes": max(peak - shard, 0), "device": str(dev), "check": check}


def _rank_entry(rank, tp, port, opts, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(tp), LOCAL_RANK=str(rank))
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    try:
        queue.put((rank, _measure(rank, tp, opts)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put((rank, {"error": repr(e)}))


def worker_main(opts: dict) -> None:
    """Subprocess entry: one variant, one size; prints one JSON line (worst rank)."""
    tp = opts["tp"]
    if tp == 1:
        res = _measure(0, 1, opts)
    else:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=_rank_entry, args=(r, tp, port, opts, q)) for r in range(tp)]
        for p in procs:
            p.start()
        by_rank = dict(q.get(timeout=3600) for _ in procs)
        for p in procs:
            p.join()
        outs = [by_rank[r] for r in range(tp)]
        errs = [o["error"] for o in outs if "error" in o]
        if errs:
            raise RuntimeError(errs[0])
        res = dict(max(outs, key=lambda o: o["peak_bytes"]))
        res["time_ms"] = max(o["time_ms"] for o in outs)
        res["check"] = outs[0]["check"]  # rank 0's log-probs, entropies and gradient shard
    print("RESULT " + json.dumps(res), flush=True)


# ----------------------------------------------------------------------------- driver

def _run_one(opts: dict, script: str = __file__) -> dict:
    """One measurement in a fresh process (``script --worker opts``; the linear variant's bench
    passes its own file): its RESULT line, or the error that ended it."""
    cmd = [sys.executable, os.path.abspath(script), "--worker", json.dumps(opts)]
    # A fixed mmap threshold stops glibc from keeping freed large blocks on its heap, so the
    # process RSS follows the live tensors (CPU memory measurement).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (proc.stderr or "").strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: " + (" | ".join(tail) or "killed (out of memory?)")}


def _fmt_mib(b):
    return f"{b / 2**20:9.0f}"


def run_benchmark(tokens, vocabs, *, tp=1, dtype="bfloat16", chunk_size=None, repeats=3,
                  variants=VARIANTS, threads=None, out=print) -> list:
    """Measure every (T, V/tp, variant); print the table; return the rows."""
    rows = []
    out(f"{'T':>6} {'V/tp':>6} {'variant':>9} {'fwd+bwd ms':>11} {'peak MiB':>9} {'extra MiB':>9} "
        f"{'extra/shard':>11} {'time/ours':>9} {'extra/ours':>10}")
    for T in tokens:
        for V in vocabs:
            cs = chunk_size or max(1, T // 16)
            res = {}
            for v in variants:
                opts = dict(variant=v, tokens=T, vocab=V, tp=tp, dtype=dtype, chunk_size=cs, repeats=repeats,
                            threads=threads)
                res[v] = _run_one(opts)
            ours = res.get("ours", {})
            for v in variants:
                r = res[v]
                if "error" in r:
                    out(f"{T:>6} {V:>6} {v:>9}  FAILED {r['error'][:90]}")
                    continue
                t_ratio = r["time_ms"] / ours["time_ms"] if "time_ms" in ours else float("nan")
                m_ratio = (r["extra_bytes"] / ours["extra_bytes"]
                           if ours.get("extra_bytes") else float("nan"))
                out(f"{T:>6} {V:>6} {v:>9} {r['time_ms']:>11.1f} {_fmt_mib(r['peak_bytes'])} "
                    f"{_fmt_mib(r['extra_bytes'])} {r['extra_bytes'] / r['shard_bytes']:>11.2f} "
                    f"{t_ratio:>9.2f} {m_ratio:>10.2f}")
                rows.append(dict(r, T=T, V=V, variant=v, chunk_size=cs))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", help="token counts T (default 4096 16384)")
    p.add_argument("--vocab", type=int, nargs="+", help="vocab shard sizes V/tp (default 32768 76032)")
    p.add_argument("--small", action="store_true", help="quick sizes: T 1024/2048, V/tp 8192/19008")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per measurement")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--chunk-size", type=int, default=None, help="ours: tokens per chunk (default T/16)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up (median)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per rank (default: torch's)")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker_main(json.loads(a.worker))
        return 0
    tokens = a.tokens or (SMALL_TOKENS if a.small else FULL_TOKENS)
    vocabs = a.vocab or (SMALL_VOCAB if a.small else FULL_VOCAB)
    print(f"# tp={a.tp} dtype={a.dtype} repeats={a.repeats} chunk_size={a.chunk_size or 'T/16'} "
          f"threads={a.threads or 'default'}", flush=True)
    rows = run_benchmark(tokens, vocabs, tp=a.tp, dtype=a.dtype, chunk_size=a.chunk_size,
                         repeats=a.repeats, variants=a.variants, threads=a.threads,
                         out=lambda s: print(s, flush=True))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
