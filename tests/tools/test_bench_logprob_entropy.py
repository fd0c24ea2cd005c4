"""tools/bench/logprob_entropy.py at tiny sizes (every variant in its own subprocess): it runs,
reports, and its variants compute the same numbers."""

from tests.tools._load import load_tool


def test_logprob_entropy_benchmark_runs_and_variants_agree():
    """Ours (chunked), the naive all-gather and Megatron's CE + entropy pass: same log-probs,
    entropies and logits gradient (fixed random projections of each; float32 logits, so the
    comparison is tight)."""
    bench = load_tool("bench/logprob_entropy")
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
