"""hapo_megatron.analysis.run_tokens (`hapo analyze plot-tokens`): token summary by role (hand
case) and the plots from saved rollouts."""

import json
import os

import pytest

from hapo_megatron.analysis import rollout_path, run_tokens, write_rollouts
from hapo_megatron.algo.loss_config import PolicyLossConfig


def record(step, ids, entropy, h_hat, **extra):
    n = len(ids)
    return {"step": step, "uid": 0, "response_ids": ids, "entropy": entropy, "h_hat": h_hat,
            "adv_before": [1.0] * n, "adv_after": [1.0 + min(h, 0.0) for h in h_hat],
            "temperatures": [1.0 + 0.05 * h for h in h_hat], **extra}


def test_token_summary_hand_case():
    recs = [record(1, [1, 2, 3, 4], [0.01, 0.02, 1.0, 0.5], [-1.0, -0.5, 1.0, 0.2]),
            record(1, [1, 2], [0.03, 0.04], [-0.2, -0.1])]
    roles = {1: "format", 2: "format", 3: "result", 4: "result"}
    s = run_tokens.token_summary(recs, lambda r: [roles[i] for i in r["response_ids"]])
    assert s["num_tokens"] == 6 and s["share_above_pivot"] == pytest.approx(2 / 6)
    # sorted entropies .01 .02 .03 .04 .5 1.0: nearest rank round(0.8 * 5) = 4 -> 0.5
    assert s["entropy_quantiles"]["0.8"] == 0.5 and s["pivot_median_over_steps"] == 0.5
    res, fmt = s["roles"]["result"], s["roles"]["format"]
    assert res["share_of_tokens"] == pytest.approx(2 / 6) and res["entropy_mean"] == pytest.approx(0.75)
    assert res["share_above_pivot"] == 1.0 and res["share_of_above_pivot_tokens"] == 1.0
    assert fmt["share_above_pivot"] == 0.0 and fmt["entropy_mean"] == pytest.approx(0.025)


def test_token_diagnostics_writes_plots_and_numbers(tmp_path):
    from hapo_megatron.data import build_char_tokenizer

    tok = build_char_tokenizer(str(tmp_path / "tok"))
    run = tmp_path / "run"
    ids = tok("3 + 4 = 7\nAnswer: 7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    n = len(ids)
    ent = [0.01] * n
    ent[8] = ent[-2] = 1.0  # the result digit and the answer digit
    h = [1.0 if e > 0.5 else -0.5 for e in ent]
    write_rollouts(rollout_path(str(run), 10), [record(10, ids, ent, h)])
    with open(run / "metrics.jsonl", "w") as f:
        for step in (1, 2):
            f.write(json.dumps({"step": step, "loss/cliplow_low_entropy": 0.02 * step,
                                "loss/cliphigh_high_entropy": 0.1, "loss/cliplow_high_entropy": 0.0,
                                "loss/cliphigh_low_entropy": 0.0, "loss/adv_scale_high_entropy": 1.1,
                                "loss/adv_scale_low_entropy": 0.5}) + "\n")
    out = tmp_path / "out"
    result, paths = run_tokens.token_diagnostics({"hapo": [str(run)]}, str(out), roles="steps",
                                                 tokenizer=str(tmp_path / "tok"),
                                                     pivot_q=PolicyLossConfig().entropy_pivot)
    roles = result["tokens"]["hapo"]["roles"]
    assert roles["result"]["share_above_pivot"] == 1.0 and roles["answer"]["share_above_pivot"] == 1.0
    assert roles["format"]["share_above_pivot"] == 0.0 and roles["end"]["share_of_tokens"] == pytest.approx(1 / n)
    assert result["clip_side_by_entropy"]["hapo"]["loss/cliplow_low_entropy"] == pytest.approx(0.03)
    assert sorted(os.path.basename(p) for p in paths) == ["adv_scale.png", "clip_side_entropy.png",
                                                          "entropy_hist.png", "temperature_vs_entropy.png"]
    assert json.loads((out / "tokens.json").read_text())["tokens"]["hapo"]["num_tokens"] == n
    assert "| hapo | result | " in run_tokens.format_summary(result)
    with pytest.raises(ValueError, match="needs --tokenizer"):
        run_tokens.role_labeller("steps", None)
