"""Smoke tests of tools/bench/ at tiny sizes (every variant in its own subprocess): each runs,
reports, and computes the same numbers as the others."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_bench():
    spec = importlib.util.spec_from_file_location(
        "bench_logprob_entropy", os.path.join(ROOT, "tools", "bench", "logprob_entropy.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_runs_and_variants_agree():
    """Ours (chunked), the naive all-gather and Megatron's CE + entropy pass: same log-probs,
    entropies and logits gradient (fixed random projections of each; float32 logits, so the
    comparison is tight)."""
    bench = _load_bench()
    lines = []
    rows = bench.run_benchmark([64], [512], dtype="float32", chunk_size=24, repeats=1, threads=1,
                               out=lines.append)
    assert [r["variant"] for r in rows] == list(bench.VARIANTS), lines
    ref = rows[1]["check"]  # naive: float32 log_softmax over the whole vocab
    assert set(ref) == {"lp", "ent", "grad"}
    for r in rows:
        assert r["time_ms"] > 0 and r["shard_bytes"] == 64 * 512 * 4
        for k, v in r["check"].items():
            assert abs(v - ref[k]) <= 1e-4 * (1 + abs(ref[k])), (r["variant"], k, v, ref[k])
    assert lines[0].split()[:3] == ["T", "V/tp", "variant"] and len(lines) == 4


def _load_linear_bench():
    spec = importlib.util.spec_from_file_location(
        "bench_linear_logprobs_entropy", os.path.join(ROOT, "tools", "bench", "linear_logprobs_entropy.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_linear_benchmark_runs_and_variants_agree():
    """Fused-from-hidden, logits-then-fused and Megatron's CE: same log-probs, entropies, d hidden
    and d W (fixed random projections of each), every variant in its own subprocess."""
    bench = _load_linear_bench()
    lines = []
    rows = bench.run_benchmark([48], [16], [256], repeats=1, threads=1, chunk_size=7, out=lines.append)
    assert [r["variant"] for r in rows] == list(bench.VARIANTS), lines
    ref = rows[1]["check"]  # logits
    for r in rows:
        assert r["time_ms"] > 0 and r["shard_bytes"] == 48 * 256 * 4
        for k, v in r["check"].items():
            assert abs(v - ref[k]) <= 1e-4 * (1 + abs(ref[k])), (r["variant"], k, v, ref[k])
    assert lines[0].split()[:4] == ["T", "H", "V/tp", "variant"] and len(lines) == 4
