"""The 7B paper recipe exists once: examples/qwen2.5-math-7b-sglang/config.yaml is a variant of
examples/qwen2.5-math-7b/config.yaml for its own launcher and must resolve to the same settings,
run names aside (mutation: eval_interval 10 or no step-0 evaluation in the variant fails)."""

import os

from hapo_megatron.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = {("trainer", "experiment_name"), ("trainer", "run_dir"), ("logging", "wandb_run_name"),
         ("logging", "tensorboard_dir")}


def _flat(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict) and key != "reward_kwargs":
            yield from _flat(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def test_the_7b_variant_resolves_to_the_paper_recipe():
    paper = dict(_flat(load_config(os.path.join(ROOT, "examples/qwen2.5-math-7b/config.yaml")).to_dict()))
    variant = dict(_flat(load_config(os.path.join(ROOT, "examples/qwen2.5-math-7b-sglang/config.yaml")).to_dict()))
    differ = {k: (paper.get(k), variant.get(k)) for k in set(paper) | set(variant)
              if k[:2] not in NAMES and paper.get(k) != variant.get(k)}
    assert differ == {}
    assert paper[("trainer", "eval_interval")] == 20 and paper[("trainer", "val_before_train")] is True


def test_the_lora_recipe_is_the_paper_recipe_with_lora():
    """examples/qwen2.5-math-7b-lora differs from the 7B paper recipe only in the LoRA fields, the
    learning rate (10x, LoRA Without Regret) and its names (mutation: another batch size fails it)."""
    paper = dict(_flat(load_config(os.path.join(ROOT, "examples/qwen2.5-math-7b/config.yaml")).to_dict()))
    lora = dict(_flat(load_config(os.path.join(ROOT, "examples/qwen2.5-math-7b-lora/config.yaml")).to_dict()))
    differ = {k: (paper.get(k), lora.get(k)) for k in set(paper) | set(lora)
              if k[:2] not in NAMES and paper.get(k) != lora.get(k)}
    assert differ == {("model", "lora", "rank"): (0, 32), ("model", "lora", "target_modules"): (
        paper[("model", "lora", "target_modules")], ["all-linear"]), ("optim", "lr"): (1e-6, 1e-5)}
    assert lora[("model", "lora", "alpha")] == 32 and lora[("rollout", "sglang", "lora_sync")] == "merged"
