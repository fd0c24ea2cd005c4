"""Shared tiny CPU setup for the training tests: data, char tokenizer, tiny Llama (via the example's
prepare script) and a minimal config dict."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def prepare_tiny(out: str, n_train: int = 400, n_val: int = 8, *extra: str) -> str:
    """Data + tokenizer + random tiny model under ``out`` (cheap: hidden 32, 2 layers); ``extra``:
    more prepare.py arguments (``--arch qwen3_moe``)."""
    sys.path.insert(0, os.path.join(ROOT, "examples", "cpu_tiny"))
    try:
        import prepare
    finally:
        sys.path.pop(0)
    prepare.main(["--out", out, "--n-train", str(n_train), "--n-val", str(n_val), "--hidden", "32",
                  "--layers", "2", "--heads", "4", *extra])
    return out


def tiny_overrides(data: str, run_dir: str, **extra) -> list[str]:
    """Dotted overrides on top of examples/cpu_tiny/config.yaml for a seconds-long run."""
    kv = {
        "data.train_files": f"[{data}/train.jsonl]", "data.val_files": f"[{data}/val.jsonl]",
        "data.tokenizer_path": f"{data}/model", "model.hf_model_path": f"{data}/model",
        "data.train_batch_size": 8, "trainer.ppo_mini_batch_size": 4, "rollout.n": 4,
        "rollout.val_n": 2, "trainer.sft_warmup_steps": 3, "trainer.total_steps": 4,
        "trainer.save_interval": 2, "trainer.run_dir": run_dir, "logging.console": "false",
        "trainer.val_before_train": "false", "algo.max_num_gen_batches": 2, "algo.filter_groups": "false",
    }
    kv.update(extra)
    return [f"{k}={v}" for k, v in kv.items()]


def train_main(rank: int, world: int, argv: list[str]) -> int:
    """`hapo_megatron.train.main(argv)` on a rank spawned by `tests.distributed.run_distributed`."""
    from hapo_megatron.train import main
    return main(argv)
