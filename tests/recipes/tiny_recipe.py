"""What every recipe run of tests/recipes shares: the GPU recipes found under examples/, the tiny
prompt set, the tiny model of each recipe's family, and the size overrides (the only changes to a
recipe besides the CPU counterparts of cpu_counterparts.py).

The tiny model is made from the recipe's own hf_config.json: the same model_type, architecture,
tying, RoPE, norms, biases and MoE settings, with every size shrunk (hidden 32, 2 layers, 4 heads
over 2 KV heads, 8 experts top-2, the character tokenizer's vocabulary). A random model never
writes "Answer: <n>", so the recipe's math reward would score every response -1, and its dynamic
sampling (the hapo preset's algo.filter_groups) would skip every step; the model is therefore
warm-started here (plain transformers, until its loss is near the floor: a few seconds) on
"Answer: 1" / "Answer: 2" at random for prompts whose truth is 1 or 2: about half the responses
of a group are right, so groups are kept and both RL steps train.
"""

from __future__ import annotations

import json
import os
import random

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")

#: recipes without an hf_config.json of their own run the tiny model of this recipe's family
#: (the async recipe trains Qwen/Qwen2.5-Math-7B, as qwen2.5-math-7b does)
HF_CONFIG_OF = {"qwen2.5-math-7b-async": "qwen2.5-math-7b", "qwen2.5-math-7b-sglang": "qwen2.5-math-7b"}

#: sizes of the tiny model (everything else comes from the recipe's hf_config.json)
TINY_MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4)  # 4 KV heads: TP 4 (qwen3-8b) splits them
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
HEAD_DIM = 8  # Qwen3 families set head_dim explicitly (128 in the recipes)


def gpu_recipes() -> list[str]:
    """Every recipe folder under examples/ with a config.yaml, except the CPU ones (cpu_*)."""
    return sorted(d for d in os.listdir(EXAMPLES)
                  if os.path.isfile(os.path.join(EXAMPLES, d, "config.yaml")) and not d.startswith("cpu_"))


def recipe_config_path(recipe: str) -> str:
    return os.path.join(EXAMPLES, recipe, "config.yaml")


def recipe_yaml(recipe: str) -> dict:
    """The recipe's config.yaml as written (no preset applied)."""
    with open(recipe_config_path(recipe)) as f:
        return yaml.safe_load(f)


def recipe_hf_config(recipe: str) -> dict:
    with open(os.path.join(EXAMPLES, HF_CONFIG_OF.get(recipe, recipe), "hf_config.json")) as f:
        return json.load(f)


def tiny_hf_config_dict(full: dict, tokenizer) -> dict:
    """``full`` (a recipe's hf_config.json) with every size shrunk and the tokenizer's ids."""
    cfg = {k: v for k, v in full.items() if k != "torch_dtype"}
    cfg.update(TINY_MODEL, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, torch_dtype="float32")
    if "head_dim" in full:
        cfg["head_dim"] = HEAD_DIM
    if "max_window_layers" in full:
        cfg["max_window_layers"] = TINY_MODEL["num_hidden_layers"]
    if "num_experts" in full:
        cfg.update(TINY_MOE)
    return cfg


# --------------------------------------------------------------------------- data
def _rows(n: int, seed: int, source: str) -> list[dict]:
    from hapo_megatron.data.rows import math_row

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        truth = rng.choice((1, 2))
        word = "".join(rng.choice("abcdefgh") for _ in range(4))
        rows.append(math_row(data_source=source, question=f"{word}: 1 or 2?", answer=truth,
                             extra_info={"index": i}))
    return rows


def write_tiny_data(out: str) -> tuple[dict, list[dict]]:
    """The tiny prompt set in the recipes' verl/DAPO parquet layout: train and one validation set.
    Returns their paths and the training rows."""
    from hapo_megatron.data.rows import write_rows

    paths = {"train": os.path.join(out, "train.parquet"), "val": os.path.join(out, "val.parquet")}
    train = _rows(64, 1, "tiny_math")
    write_rows(train, paths["train"])
    write_rows(_rows(2, 2, "tiny_math_val"), paths["val"])
    return paths, train


def _warm_start(model, tokenizer, rows: list[dict], steps: int = 100, lr: float = 1e-2, seed: int = 0,
                margin: float = 0.005) -> int:
    """A few Adam steps of next-token loss on each row's chat-formatted prompt followed by
    "Answer: 1" and, as another sequence, by "Answer: 2": the model learns the format and an even
    choice between the two, whatever the prompt. Stops once the loss is within ``margin`` of its
    floor (ln 2 on each sequence's digit, 0 elsewhere: the format learned, the choice even; the
    families get there in 25-60 steps instead of 100, ~10 s each on 2 loaded cores); returns the
    steps taken."""
    import math

    import torch

    torch.manual_seed(seed)
    seqs = []
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        for answer in ("Answer: 1", "Answer: 2"):
            seqs.append((p, tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]))
    width = max(len(p) + len(r) for p, r in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    labels = torch.full((len(seqs), width), -100)
    for i, (p, r) in enumerate(seqs):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p):len(p) + len(r)] = torch.tensor(r)
    floor = len(seqs) * math.log(2) / int((labels != -100).sum())  # the loss's mean is over label tokens
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for step in range(1, steps + 1):
        loss = model(input_ids=ids, attention_mask=(labels != -100) | (ids != tokenizer.pad_token_id),
                     labels=labels).loss
        if loss.item() < floor + margin:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return step


def write_tiny_model(out: str, full_hf_config: dict, rows: list[dict]) -> str:
    """The tiny model of ``full_hf_config``'s family with the character tokenizer under ``out``,
    warm-started on ``rows``; float32 weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hapo_megatron.data.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(out)
    cfg = tiny_hf_config_dict(full_hf_config, tok)
    config = AutoConfig.for_model(**cfg)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config).float()
    steps = _warm_start(model, tok, rows)
    print(f"{out}: warm-started in {steps} steps", flush=True)
    model.save_pretrained(out)
    return out


def prepare_family_models(out: str, recipes: list[str], rows: list[dict]) -> dict[str, str]:
    """One tiny model directory per distinct hf_config.json among ``recipes``: {recipe: model dir}."""
    dirs: dict[str, str] = {}
    for recipe in recipes:
        source = HF_CONFIG_OF.get(recipe, recipe)
        path = os.path.join(out, source)
        if not os.path.isdir(path):
            write_tiny_model(path, recipe_hf_config(recipe), rows)
        dirs[recipe] = path
    return dirs
