"""Smoke test of tools/bench/oversampling.py at its tiny size (``--small``): both settings run in
one call against the heavy-tailed stand-in and report rollout time per step, trained tokens per
second and the trained-length distribution."""

from tests.tools._load import load_tool


def test_small_run_reports_both_settings(capsys):
    bench = load_tool("bench/oversampling")
    out = bench.main(["--small"])
    res = out["results"]
    assert sorted(res) == [1.0, 1.5]
    for r in res.values():
        assert r["steps"] == 2 and r["rollout_s_per_step"] > 0 and r["trained_tokens_per_s"] > 0
        assert 1 <= r["len_p50"] <= r["len_p90"] <= 16
    assert res[1.0]["aborted"] == res[1.0]["resumed"] == 0  # over-sampling off aborts nothing
    assert out["throughput_ratio"] > 0 and out["length_mean_ratio"] > 0
    printed = capsys.readouterr().out
    assert "trained tok/s" in printed and "ratio" in printed and "p90" in printed
