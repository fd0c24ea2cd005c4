"""Tests of hapo_megatron.analysis (token diagnostics, saved rollouts) against slow per-token
loops and hand cases."""

import math
import random
from collections import Counter

import pytest
import torch

from hapo_megatron.analysis import (
    ENTROPY_BIN_EDGES,
    NUM_ENTROPY_BINS,
    TokenDiagnostics,
    analyze_rollouts,
    diagnostics_from_records,
    entropy_histogram,
    entropy_pivot,
    format_report,
    read_rollouts,
    rollout_path,
    write_rollouts,
)
from hapo_megatron.analysis.cli import main
from tests.distributed import run_distributed
from hapo_megatron.algo.loss_config import PolicyLossConfig


def make_records(seed=0, n_resp=6, vocab=12):
    rng = random.Random(seed)
    recs = []
    for i in range(n_resp):
        L = rng.randint(1, 9)
        h = [rng.uniform(-1, 1) for _ in range(L)]
        a = rng.choice([-1.3, 0.0, 0.7])
        after = [a * (1 + hh) if rng.random() < 0.5 else a for hh in h]
        ratio = [rng.uniform(0.6, 1.5) for _ in range(L)]
        recs.append({
            "step": 3, "uid": f"g{i // 2}", "data_source": "arith", "reward": 1.0, "acc": True,
            "finish_reason": rng.choice(["stop", "length"]),
            "response_ids": [rng.randrange(vocab) for _ in range(L)],
            "entropy": [10 ** rng.uniform(-7, 1.5) for _ in range(L)],
            "h_hat": h, "adv_before": [a] * L, "adv_after": after, "ratio": ratio,
            "clip_low": [a < 0 and r < 0.8 for r in ratio],
            "clip_high": [a > 0 and r > 1.2 for r in ratio],
            "clip_dual": [a < 0 and r > 1.45 for r in ratio],
            "temperatures": [1.0 + 0.05 * hh for hh in h],
        })
    return recs


def loop_summary(recs):
    """Independent per-token loop computation of the main diagnostics."""
    tok = [(r, t) for r in recs for t in range(len(r["response_ids"]))]
    n = len(tok)
    out = {"entropy_mean": sum(r["entropy"][t] for r, t in tok) / n}
    high = [(r, t) for r, t in tok if r["h_hat"][t] > 0]
    low = [(r, t) for r, t in tok if r["h_hat"][t] <= 0]
    out["high_entropy_share"] = len(high) / n
    for side in ("low", "high", "dual"):
        out[f"clipfrac_{side}"] = sum(r["clip_" + side][t] for r, t in tok) / n
        for name, grp in (("high", high), ("low", low)):
            out[f"clipfrac_{side}_{name}"] = sum(r["clip_" + side][t] for r, t in grp) / len(grp)
    for name, grp in (("high", high), ("low", low)):
        ratios = [abs(r["adv_after"][t]) / abs(r["adv_before"][t]) for r, t in grp
                  if r["adv_before"][t] != 0]
        if ratios:
            out[f"adv_ratio_{name}"] = sum(ratios) / len(ratios)
        out[f"temperature_mean_{name}"] = sum(r["temperatures"][t] for r, t in grp) / len(grp)
    temps = [r["temperatures"][t] for r, t in tok]
    mt = sum(temps) / n
    out["temperature_mean"] = mt
    out["temperature_std"] = math.sqrt(sum((x - mt) ** 2 for x in temps) / n)
    out["temperature_min"], out["temperature_max"] = min(temps), max(temps)
    lens = [len(r["response_ids"]) for r in recs]
    ml = sum(lens) / len(lens)
    out["response_length_mean"] = ml
    out["response_length_std"] = math.sqrt(sum((x - ml) ** 2 for x in lens) / len(lens))
    out["response_length_max"], out["response_length_min"] = max(lens), min(lens)
    out["response_truncated_ratio"] = sum(r["finish_reason"] == "length" for r in recs) / len(recs)
    return out


def loop_histogram(values):
    counts = [0] * NUM_ENTROPY_BINS
    for v in values:
        i = 0
        while i < len(ENTROPY_BIN_EDGES) and v >= ENTROPY_BIN_EDGES[i]:
            i += 1
        counts[i] += 1
    return counts


def test_bins_are_fixed_log_spaced():
    assert ENTROPY_BIN_EDGES[0] == pytest.approx(1e-6) and ENTROPY_BIN_EDGES[-1] == pytest.approx(10)
    ratios = [b / a for a, b in zip(ENTROPY_BIN_EDGES, ENTROPY_BIN_EDGES[1:])]
    assert all(r == pytest.approx(10 ** 0.25) for r in ratios)


def test_entropy_histogram_matches_loop_and_respects_mask():
    g = torch.Generator().manual_seed(0)
    ent = 10 ** (torch.rand(4, 50, generator=g, dtype=torch.float64) * 9 - 7.5)
    ent[0, 0] = 0.0
    ent[0, 1] = 1e-6  # exactly on an edge -> upper bin
    mask = torch.rand(4, 50, generator=g) > 0.3
    hist = entropy_histogram(ent, mask)
    assert hist.tolist() == loop_histogram(ent[mask].tolist())
    assert int(hist.sum()) == int(mask.sum())
    with pytest.raises(ValueError, match="mask"):
        entropy_histogram(ent, mask[:, :3])


def test_entropy_pivot_nearest_rank():
    ent = torch.tensor([5.0, 1.0, 4.0, 2.0, 3.0])
    assert entropy_pivot(ent, q=0.8) == pytest.approx(4.0)   # rank round(3.2) = 3
    assert entropy_pivot(ent, q=0.5) == pytest.approx(3.0)
    assert entropy_pivot(torch.tensor([1.0, 2.0]), q=0.25) == 1.0  # round(0.25) = 0
    assert math.isnan(entropy_pivot(ent, torch.zeros(5, dtype=torch.bool), q=PolicyLossConfig().entropy_pivot))
    with pytest.raises(ValueError, match="q"):
        entropy_pivot(ent, q=1.0)


def test_entropy_pivot_agrees_with_algo_stats():
    from hapo_megatron import algo

    g = torch.Generator().manual_seed(1)
    ent = torch.rand(3, 17, generator=g) * 3
    mask = torch.rand(3, 17, generator=g) > 0.2
    stats = algo.compute_entropy_stats(ent, mask, entropy_pivot=0.8)
    assert entropy_pivot(ent, mask, q=0.8) == pytest.approx(math.exp(stats.pivot), rel=1e-5)


def test_summary_matches_loop():
    recs = make_records()
    got = diagnostics_from_records(recs).summary(prefix="d")
    expected = loop_summary(recs)
    for k, v in expected.items():
        assert got[f"d/{k}"] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    hist = diagnostics_from_records(recs).entropy_hist.tolist()
    assert hist == loop_histogram([e for r in recs for e in r["entropy"]])


def test_update_tokens_with_mask_equals_flat_and_merge_is_additive():
    recs = make_records(seed=2)
    whole = diagnostics_from_records(recs)
    parts = diagnostics_from_records(recs[:2]).merge(diagnostics_from_records(recs[2:]))
    assert parts.summary() == pytest.approx(whole.summary())
    assert parts.clipped_low_tokens == whole.clipped_low_tokens

    # padded [B, T] with a mask == flat valid tokens
    B, T = len(recs), max(len(r["response_ids"]) for r in recs)
    def pad(name, dtype=torch.float64):
        out = torch.zeros(B, T, dtype=dtype)
        for i, r in enumerate(recs):
            out[i, : len(r[name])] = torch.tensor(r[name], dtype=dtype)
        return out
    mask = pad("response_ids") * 0
    for i, r in enumerate(recs):
        mask[i, : len(r["response_ids"])] = 1
    d = TokenDiagnostics().update_tokens(
        entropy=pad("entropy"), h_hat=pad("h_hat"), mask=mask.bool(),
        token_ids=pad("response_ids", torch.int64), clip_low=pad("clip_low", torch.bool),
        clip_high=pad("clip_high", torch.bool), clip_dual=pad("clip_dual", torch.bool),
        adv_before=pad("adv_before"), adv_after=pad("adv_after"),
        temperatures=pad("temperatures"))
    d.update_responses([len(r["response_ids"]) for r in recs],
                       [r["finish_reason"] == "length" for r in recs])
    assert d.summary() == pytest.approx(whole.summary())
    with pytest.raises(ValueError, match="h_hat"):
        TokenDiagnostics().update_tokens(entropy=torch.ones(3), h_hat=torch.ones(4))


def test_top_clipped_tokens_match_counter_and_decode():
    recs = make_records(seed=3, n_resp=20)
    d = diagnostics_from_records(recs)
    for side in ("low", "high"):
        c = Counter(tok for r in recs for tok, f in zip(r["response_ids"], r["clip_" + side]) if f)
        expected = sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
        rows = d.top_clipped_tokens(side, k=3)
        assert [(r["token_id"], r["count"]) for r in rows] == expected

    class Tok:
        def decode(self, ids):
            return "<%d>" % ids[0]

    rows = d.top_clipped_tokens("low", k=1, tokenizer=Tok())
    assert rows[0]["text"] == "<%d>" % rows[0]["token_id"]
    with pytest.raises(ValueError, match="side"):
        d.top_clipped_tokens("left")


def test_missing_optional_fields_are_skipped():
    recs = [{"step": 0, "uid": "a", "response_ids": [1, 2, 3], "entropy": [0.1, 0.2, 0.3]}]
    s = diagnostics_from_records(recs).summary()
    assert s["diag/entropy_mean"] == pytest.approx(0.2)
    assert s["diag/response_length_mean"] == 3
    assert not any("clipfrac" in k or "temperature" in k or "high_entropy" in k for k in s)


@pytest.mark.parametrize("suffix", ["jsonl", "jsonl.gz", "parquet"])
def test_rollout_file_roundtrip_and_report(tmp_path, suffix, capsys):
    recs = make_records(seed=4)
    path = rollout_path(str(tmp_path), 7, suffix)
    assert path.endswith(f"rollouts/step_000007.{suffix}")
    write_rollouts(path, recs)
    back = read_rollouts(path)
    assert [r["response_ids"] for r in back] == [r["response_ids"] for r in recs]
    report = analyze_rollouts(back, top_k=2, entropy_pivot_q=PolicyLossConfig().entropy_pivot)
    assert report["metrics"] == pytest.approx(
        {**diagnostics_from_records(recs).summary(),
         "diag/entropy_pivot": entropy_pivot(
             torch.tensor([e for r in recs for e in r["entropy"]], dtype=torch.float64),
                 q=PolicyLossConfig().entropy_pivot)})
    assert sum(r["count"] for r in report["histogram"]) == sum(len(r["entropy"]) for r in recs)
    assert "most clipped tokens, low side" in format_report(report)
    assert main(["rollouts", path, "--top-k", "2", "--json", str(tmp_path / "r.json")]) == 0
    assert "entropy histogram" in capsys.readouterr().out


def test_rollout_file_validation(tmp_path):
    bad = [{"step": 0, "uid": "a", "response_ids": [1, 2], "entropy": [0.1]}]
    with pytest.raises(ValueError, match="entropy"):
        write_rollouts(str(tmp_path / "x.jsonl"), bad)
    with pytest.raises(ValueError, match="uid"):
        write_rollouts(str(tmp_path / "x.jsonl"), [{"step": 0, "response_ids": [1]}])
    p = tmp_path / "y.jsonl"
    p.write_text('{"step": 0, "uid": "a", "response_ids": [1]}\nnot json\n')
    with pytest.raises(ValueError, match="line 2"):
        read_rollouts(str(p))


def _all_reduce_worker(rank, world_size):
    recs = make_records(seed=5, n_resp=8)
    mine = recs[rank::world_size]
    d = diagnostics_from_records(mine) if rank != 2 else TokenDiagnostics()  # rank 2: no tokens
    d.all_reduce()
    return d.summary(), dict(d.clipped_high_tokens), d.entropy_hist.tolist()


def test_all_reduce_equals_single_process():
    world = 3
    recs = make_records(seed=5, n_resp=8)
    used = [r for rank in (0, 1) for r in recs[rank::world]]
    ref = diagnostics_from_records(used)
    outs = run_distributed(_all_reduce_worker, world, timeout=120)
    for summary, clipped_high, hist in outs:
        assert summary == pytest.approx(ref.summary())
        assert clipped_high == dict(ref.clipped_high_tokens)
        assert hist == ref.entropy_hist.tolist()
