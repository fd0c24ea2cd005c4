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


def _load_packing_bench():
    spec = importlib.util.spec_from_file_location("bench_packing", os.path.join(ROOT, "tools", "bench", "packing.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_packing_benchmark_layouts():
    """tools/bench/packing.py: the sampled lengths have the asked mean (lognormal, before the cap)
    and the figures are those of the trainer's own plan: every sequence once, packed rows within
    the budget, real tokens the same in both layouts, packed never less efficient."""
    import numpy as np
    bench = _load_packing_bench()
    lengths = bench.sample_lengths(prompts=64, responses=16, prompt_len=10, mean=300, sigma=0.8, cap=10 ** 6, seed=1)
    resp = np.asarray(lengths) - 10
    assert abs(resp.mean() / 300 - 1) < 0.1 and resp.min() >= 1  # 1024 draws: sd of the mean ~3%
    capped = bench.sample_lengths(prompts=8, responses=4, prompt_len=5, mean=300, sigma=0.8, cap=100, seed=1)
    assert max(capped) <= 105
    res = bench.layouts(lengths, dp=4, max_tokens=2048, micro_batch_size=1, tp=2, cp=2, sp=True)
    for name, (plan, eff) in res.items():
        assert sorted(i for rank in plan for b in rank for i in b) == list(range(len(lengths))), name
        assert eff["real_tokens"] == sum(lengths)
    plan, eff = res["packed"]
    assert all(sum(lengths[i] for i in b) <= 2048 or len(b) == 1 for rank in plan for b in rank)
    assert eff["token_efficiency"] >= res["padded"][1]["token_efficiency"]
    assert bench.main(["--mean", "300", "--prompts", "4", "--responses", "4", "--dp", "2", "--max-tokens", "1024"]) == 0
