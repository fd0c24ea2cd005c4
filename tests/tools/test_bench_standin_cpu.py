"""tools/bench/standin_cpu.py at a tiny size: both rates measured, every token emitted, the paced
rate taking the wall time it asks for."""

from tests.tools._load import load_tool


def test_both_rates_are_measured(capsys):
    bench = load_tool("bench/standin_cpu")
    res = bench.main(["--steps", "1", "--groups", "2", "--rows", "2", "--tokens", "5", "--tokens-per-s", "50"])
    assert set(res) == {"paced", "unbounded"}
    for r in res.values():
        assert r["cpu_s_per_step"] >= 0 and r["wall_s_per_step"] > 0
    assert res["paced"]["wall_s_per_step"] >= 5 / 50  # 5 tokens at 50 tokens/s
    assert "server CPU s/step" in capsys.readouterr().out
