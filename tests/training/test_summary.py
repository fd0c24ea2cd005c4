"""The end-of-run summary: first vs last steps from metrics.jsonl, headline eval numbers."""

import json

from hapo_megatron.training.trainer import _headline_eval, format_summary, summarize


def test_summary_first_vs_last(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 0, "eval/x/avg@4": 0.5}) + "\n")
        for s in range(1, 21):
            f.write(json.dumps({"step": s, "rollout/reward_mean": s / 10, "rollout/acc": s / 20}) + "\n")
    s = summarize(str(tmp_path), 20, 61.0, {"eval/x/avg@4": 0.5}, {"eval/x/avg@4": 0.75})
    assert s["k"] == 5 and abs(s["first_reward_mean"] - 0.3) < 1e-12 and abs(s["last_reward_mean"] - 1.8) < 1e-12
    text = format_summary({**s, "sft_time_s": 30.0})
    assert "1.0 min" in text and "+0.300" in text and "+1.800" in text and "75.0%" in text


def test_headline_eval_picks_largest_k_per_source():
    ev = {"eval/all/avg@1": 0.1, "eval/all/avg@4": 0.2, "eval/a/avg@1": 0.3, "eval/a/avg@4": 0.4,
          "eval/a/pass@4": 0.9}
    assert _headline_eval(ev) == {"eval/a/avg@4": 0.4}
    ev["eval/b/avg@2"] = 0.5
    assert _headline_eval(ev) == {"eval/a/avg@4": 0.4, "eval/all/avg@4": 0.2, "eval/b/avg@2": 0.5}
