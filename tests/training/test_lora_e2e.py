"""A LoRA run the user's way (`hapo train` on 2 ranks at TP2, the HF engine, a KL term): only the
adapters train, the engine samples from the merged weights, the KL reference is the base model.

- ``actor/trainable_params`` counts the adapters (rank 4 on every linear layer of a 2-layer model
  of hidden 32, FFN 128 with the example's 4 heads and 4 groups), ``actor/total_params`` the model;
- with the adaptive temperature off, the engine's log-probs equal the actor's recomputed ones to
  float32 rounding at every step (``rollout/logprob_abs_diff``), after the adapters moved too: an
  export of the base weights alone (no merge) leaves the engine behind from step 2 on;
- ``rollout/weight_sync_bytes``: every step's sync handed the engine the whole merged model (float32,
  the HF model's parameter count x 4 bytes);
- step 1's KL to the reference is 0 (one update per step, computed at B = 0: the policy is the
  base model), later steps' is not (the reference stays the base model while the adapters train);
- the run saves its (adapter-only) step-2 checkpoint; a copy of the run directory without step 3's
  records resumes from it and writes step 3's metrics line exactly as the uninterrupted run did
  (timings aside), and a resume on another base model (one weight changed), even with
  ``--allow-config-change``, is refused in one line.
"""

import os
import shutil

from tests.distributed import run_distributed
from tests.training.tiny_setup import ROOT, tiny_overrides, train_main

CONFIG = os.path.join(ROOT, "examples", "cpu_tiny", "config.yaml")
# float32 log-probs of the same weights on two paths (engine vs actor): a few ulps of sums over
# hidden 32 / vocab ~100 per token, averaged; test_train_e2e bounds step 1 the same way
LOGPROB_DIFF = 1e-5
H, F, RANK, LAYERS = 32, 128, 4, 2


def test_lora_run_trains_adapters_serves_merged_weights_and_keeps_the_base_as_reference(tiny, tmp_path, capsys):
    from hapo_megatron.training.metrics.sinks import read_jsonl

    run_dir = str(tmp_path / "run")
    argv = ["--config", CONFIG, *tiny_overrides(tiny, run_dir, **{
        "parallel.tensor_model_parallel_size": 2, "trainer.total_steps": 3, "trainer.save_interval": 2,
        "trainer.sft_warmup_steps": 0, "trainer.val_at_end": "false", "algo.adaptive_temperature": "false",
        "algo.kl_loss_coef": 0.1, "model.lora.rank": RANK, "model.lora.alpha": 8, "optim.lr": 0.05,
        "optim.min_lr": 0.05, "optim.lr_warmup_steps": 0, "trainer.ppo_mini_batch_size": 8})]
    assert run_distributed(train_main, 2, argv, timeout=600) == [0, 0]
    recs = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "actor/trainable_params" in r]
    assert [r["step"] for r in recs] == [1, 2, 3]
    seen = [(r["step"], r["actor/trainable_params"], r["actor/total_params"], r["rollout/logprob_abs_diff"],
             r["loss/kl"]) for r in recs]
    per_layer = RANK * (4 * (H + H) + 2 * (H + F) + (F + H))  # q, k, v, o: 32 x 32 (4 heads, 4 groups)
    for r in recs:
        assert r["actor/trainable_params"] == LAYERS * per_layer, seen
        assert r["actor/total_params"] > 5 * r["actor/trainable_params"], seen
        assert r["rollout/logprob_abs_diff"] < LOGPROB_DIFF, seen
    assert recs[0]["loss/kl"] < 1e-6, seen
    assert recs[-1]["loss/kl"] > 1e-4, seen
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(tiny, "model"))
    assert [r["rollout/weight_sync_bytes"] for r in recs] == [4.0 * sum(p.numel() for p in hf.parameters())] * 3
    _resume_continues_exactly_and_refuses_another_base(tiny, tmp_path, run_dir, argv, capsys)


def _resume_continues_exactly_and_refuses_another_base(tiny, tmp_path, run_dir, argv, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    from hapo_megatron.train import main
    from hapo_megatron.training.metrics.sinks import read_jsonl, strip_timing
    copy = str(tmp_path / "resumed")
    shutil.copytree(run_dir, copy)
    shutil.rmtree(os.path.join(copy, "checkpoints", "step_000003"), ignore_errors=True)
    with open(os.path.join(copy, "checkpoints", "latest"), "w") as f:
        f.write("step_000002\n")
    again = [a.replace(run_dir, copy) for a in argv] + ["trainer.resume=auto"]
    other = str(tmp_path / "other_base")
    m = AutoModelForCausalLM.from_pretrained(os.path.join(tiny, "model"))
    with torch.no_grad():
        m.model.layers[0].mlp.up_proj.weight[0, 0] += 1.0
    m.save_pretrained(other)
    for name in os.listdir(os.path.join(tiny, "model")):  # the tokenizer and config files
        if not name.endswith(".safetensors") and not os.path.exists(os.path.join(other, name)):
            shutil.copy(os.path.join(tiny, "model", name), other)
    assert run_distributed(train_main, 2, again, timeout=600) == [0, 0]
    full = [strip_timing(r) for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if r.get("step") == 3]
    resumed = [strip_timing(r) for r in read_jsonl(os.path.join(copy, "metrics.jsonl")) if r.get("step") == 3]
    assert resumed == full and len(full) >= 1
    shutil.rmtree(os.path.join(copy, "checkpoints", "step_000003"), ignore_errors=True)  # resumable again, from step 2
    with open(os.path.join(copy, "checkpoints", "latest"), "w") as f:
        f.write("step_000002\n")
    environ = dict(os.environ)  # --check sets the world it would start
    capsys.readouterr()
    try:
        assert main(again + [f"model.hf_model_path={other}", f"data.tokenizer_path={other}", "--check",
                             "--nproc-per-node", "2", "--allow-config-change"]) == 2
    finally:
        os.environ.clear()
        os.environ.update(environ)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"hapo train: error: model.hf_model_path={other}: its weights"), err
