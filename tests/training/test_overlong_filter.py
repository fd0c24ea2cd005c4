"""data.filter_overlong_prompts: a training file with prompts over data.max_prompt_length trains
(instead of being refused), and the dropped count is logged and in every step's metrics."""

import json
import os

from tests.distributed import run_distributed
from tests.training.tiny_setup import ROOT, tiny_overrides

CONFIG = os.path.join(ROOT, "examples", "cpu_tiny", "config.yaml")


def _train(rank, world, argv):
    import contextlib
    import io

    from hapo_megatron.train import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    return rc, out.getvalue()


def test_overlong_prompts_are_dropped_and_counted(tiny, tmp_path):
    rows = [json.loads(line) for line in open(os.path.join(tiny, "train.jsonl"))]
    for i in (3, 11, 17):  # three prompts far over the limit (data.max_prompt_length 96)
        rows[i]["prompt"] = [{"role": "user", "content": "1 + 1 = ? " * 40}]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = str(tmp_path / "run")
    argv = ["--config", CONFIG, *tiny_overrides(tiny, run_dir, **{
        "data.train_files": f"[{train}]", "data.filter_overlong_prompts": "true",
        "parallel.tensor_model_parallel_size": 1, "trainer.sft_warmup_steps": 0, "trainer.total_steps": 1,
        "trainer.val_at_end": "false"})]
    (rc, out), = run_distributed(_train, 1, argv, timeout=300)
    assert rc == 0, out[-3000:]
    assert ("data/train_overlong_filtered: dropped 3 prompt(s) longer than data.max_prompt_length=96 "
            "(data.filter_overlong_prompts)") in out
    recs = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in recs] == [1]
    assert recs[0]["data/train_overlong_filtered"] == 3.0 and recs[0]["data/val_overlong_filtered"] == 0.0
