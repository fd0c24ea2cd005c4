"""tools/bench/packing.py at tiny sizes: its lengths and layouts are the trainer's own plan's."""

from tests.tools._load import load_tool


def test_packing_benchmark_layouts():
    """tools/bench/packing.py: the sampled lengths have the asked mean (lognormal, before the cap)
    and the figures are those of the trainer's own plan: every sequence once, packed rows within
    the budget, real tokens the same in both layouts, packed never less efficient."""
    import numpy as np
    bench = load_tool("bench/packing")
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
