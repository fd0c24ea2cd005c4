"""A run whose steps keep being skipped (dynamic sampling keeps no group of an untrained model)
stops with a clear message after trainer.max_consecutive_skips."""

import json
import os

from tests.distributed import run_distributed
from tests.training.tiny_setup import ROOT, tiny_overrides

CONFIG = os.path.join(ROOT, "examples", "cpu_tiny", "config.yaml")


def _train(rank, world, argv):
    import contextlib
    import io

    from hapo_megatron.train import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, err.getvalue()


def test_consecutive_skips_stop_the_run(tiny, tmp_path):
    run_dir = str(tmp_path / "run")
    argv = ["--config", CONFIG, *tiny_overrides(tiny, run_dir, **{
        "parallel.tensor_model_parallel_size": 1, "trainer.sft_warmup_steps": 0, "trainer.total_steps": 6,
        "algo.filter_groups": "true", "algo.max_num_gen_batches": 1, "trainer.max_consecutive_skips": 2,
        "trainer.val_before_train": "false", "trainer.val_at_end": "false"})]
    (rc, err), = run_distributed(_train, 1, argv, timeout=300)
    assert rc == 1, err
    assert "2 consecutive steps were skipped" in err and "max_consecutive_skips=2" in err
    recs = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[-1]["actor/consecutive_skips"] == 2.0 and recs[-1]["batch/num_groups"] == 0.0
