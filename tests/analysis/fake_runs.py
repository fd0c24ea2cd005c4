"""Run directories with a synthetic `metrics.jsonl` (and a seed in `config.yaml`) for the tests
of the run analysis."""

import json
import os


def write_run(path, steps=10, acc0=0.2, slope=0.02, eval_every=5, extra_lines=()):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for s in range(1, steps + 1):
            rec = {"step": s, "rollout/acc": acc0 + slope * s,
                   "rollout/reward_mean": 2 * (acc0 + slope * s) - 1,
                   "rollout/response_length_mean": 30.0 + s, "entropy/mean": 1.0 / s,
                   "loss/clipfrac_low": 0.01 * s, "loss/clipfrac_high": 0.02,
                   "timing/step_s": 1.0}
            if s % eval_every == 0:
                rec["eval/arith/avg@4"] = acc0 + 0.03 * s
                rec["eval/all/avg@4"] = acc0 + 0.03 * s
                rec["eval/all/avg@2"] = acc0
            f.write(json.dumps(rec) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return str(path)


def seeded_run(path, seed, **kw):
    run = write_run(path, **kw)
    with open(os.path.join(run, "config.yaml"), "w") as f:
        f.write(f"trainer:\n  seed: {seed}\n")
    return run
