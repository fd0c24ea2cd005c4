"""tools/bench/routes_volume.py: the formula on a hand case, and against the bytes of the parts the
trainer's share-out really makes (`--check`)."""

from tests.tools._load import load_tool


def test_volume_hand_case():
    bench = load_tool("bench/routes_volume")
    # 2 prompts x 2 responses of 3 + 5 tokens: 7 routed positions each, 4 layers x top-2 = 8 ids
    v = bench.volume([8] * 4, 3, responses=2, layers=4, top_k=2, experts=16, tp=2, pp=2, dp=2, mini_prompts=2,
                     budget=64)
    assert v["ids"] == 4 * 7 * 8 and v["rank0_host"] == 2 * 224 and v["sglang_http"] == 224 * 16 / 3
    # each DP rank holds 2 sequences (112 ids); before: 112 int16 ids to each of the 7 other ranks;
    # after: half the layers in one byte, to each of them
    assert v["sent_before"] == 7 * 112 * 2 and v["sent_after"] == 7 * 112 / 2
    assert v["rank_max_before"] == 224 and v["rank_max_after"] == 56


def test_formula_matches_the_real_share_out_parts(capsys):
    bench = load_tool("bench/routes_volume")
    assert bench.check() == 0
    assert "-> ok" in capsys.readouterr().out
