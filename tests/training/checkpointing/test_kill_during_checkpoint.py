"""A SIGKILL while a checkpoint is being written leaves `latest` on the previous complete
checkpoint, and `--resume auto` continues from it to the end."""

import os
import signal
import time

import pytest

from tests.distributed import free_port, rank_context, rank_process, run_distributed
from tests.training.tiny_setup import ROOT, tiny_overrides, train_main

CONFIG = os.path.join(ROOT, "examples", "cpu_tiny", "config.yaml")


def _train_and_hang_in_save(rank, world, argv, hang_in, marker):
    """Train; when the model of checkpoint `hang_in` has been written, signal and hang (to be killed
    before the RNG states, the RL state, the completion marker and the rename)."""
    from hapo_megatron.training.actor import MegatronActor
    original = MegatronActor.save

    def save(self, path, *a, **kw):
        original(self, path, *a, **kw)
        if hang_in in path:
            open(marker, "w").close()
            time.sleep(3600)

    MegatronActor.save = save
    return train_main(rank, world, argv)


def test_sigkill_during_checkpoint_write_then_resume(tiny, tmp_path):
    from hapo_megatron.training.metrics.sinks import read_jsonl

    run_dir, marker = str(tmp_path / "run"), str(tmp_path / "in_save")
    argv = ["--config", CONFIG, *tiny_overrides(tiny, run_dir, **{
        "parallel.tensor_model_parallel_size": 1, "trainer.total_steps": 4, "trainer.save_interval": 2,
        "trainer.val_at_end": "false"})]
    results = rank_context().Queue()
    proc = rank_process(_train_and_hang_in_save, 0, 1, free_port(), (argv, "step_000004", marker), results)
    proc.start()
    deadline = time.time() + 600
    while not os.path.exists(marker) and proc.is_alive() and time.time() < deadline:
        time.sleep(0.2)
    if not os.path.exists(marker):
        proc.kill()
        pytest.fail("the run never reached the step-4 checkpoint: "
                    f"{results.get(timeout=5) if not results.empty() else ''}")
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    ckpts = os.path.join(run_dir, "checkpoints")
    assert open(os.path.join(ckpts, "latest")).read().strip() == "step_000002"
    assert not os.path.exists(os.path.join(ckpts, "step_000004"))  # only its unfinished .tmp- dir

    assert run_distributed(train_main, 1, argv + ["--resume", "auto"], timeout=600) == [0]
    assert open(os.path.join(ckpts, "latest")).read().strip() == "step_000004"
    assert not os.path.exists(os.path.join(ckpts, ".tmp-step_000004"))
    steps = [r["step"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "rollout/reward_mean" in r]
    assert steps == [1, 2, 3, 4]
