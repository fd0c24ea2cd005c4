"""tools/bench/linear_logprobs_entropy.py at tiny sizes (every variant in its own subprocess): it
runs, reports, and its variants compute the same numbers."""

from tests.tools._load import load_tool


def test_linear_benchmark_runs_and_variants_agree():
    """Fused-from-hidden, logits-then-fused and Megatron's CE: same log-probs, entropies, d hidden
    and d W (fixed random projections of each), every variant in its own subprocess."""
    bench = load_tool("bench/linear_logprobs_entropy")
    lines = []
    rows = bench.run_benchmark([48], [16], [256], repeats=1, threads=1, chunk_size=7, out=lines.append)
    assert [r["variant"] for r in rows] == list(bench.VARIANTS), lines
    ref = rows[1]["check"]  # logits
    for r in rows:
        assert r["time_ms"] > 0 and r["shard_bytes"] == 48 * 256 * 4
        for k, v in r["check"].items():
            assert abs(v - ref[k]) <= 1e-4 * (1 + abs(ref[k])), (r["variant"], k, v, ref[k])
    assert lines[0].split()[:4] == ["T", "H", "V/tp", "variant"] and len(lines) == 4
