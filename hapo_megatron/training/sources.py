"""What a run reads before anything is built: the tokenizer, the HF config, the initial weights'
directory and the prompt datasets. Light (no Megatron import), so `hapo train`'s preflight and
`hapo doctor` use the same loaders as the trainer."""

from __future__ import annotations

import glob
import os
from typing import Optional

from hapo_megatron.data import PromptDataset


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def load_hf_config(path: str, max_position_embeddings: Optional[int]):
    """The model's HF config with ``model.max_position_embeddings`` applied (when given): the one
    config object the Megatron model, the HF engine and HF exports are built from."""
    from transformers import AutoConfig

    from hapo_megatron.training.context_length import apply_context_override
    return apply_context_override(AutoConfig.from_pretrained(path), max_position_embeddings)


def has_hf_weights(path: Optional[str]) -> bool:
    """True when ``path`` is a directory holding safetensors / bin weights."""
    if not path or not os.path.isdir(path):
        return False
    return bool(glob.glob(os.path.join(path, "*.safetensors")) or glob.glob(os.path.join(path, "*.bin")))


def initial_hf_weights(model_cfg) -> Optional[str]:
    """The HF directory the actor's weights start from (None: model.megatron_load_path or, asked
    for explicitly, a random initialisation). ValueError naming the fields when
    model.hf_model_path has no weights and nothing else was chosen: a silent random start would
    train noise and push it into SGLang servers that loaded the real weights."""
    if model_cfg.random_init or model_cfg.megatron_load_path:
        return None
    if has_hf_weights(model_cfg.hf_model_path):
        return model_cfg.hf_model_path
    raise ValueError(f"model.hf_model_path={model_cfg.hf_model_path!r} holds no weights (*.safetensors / *.bin) "
                     "and model.megatron_load_path is not set: point model.hf_model_path at a model with "
                     "weights, set model.megatron_load_path, or set model.random_init=true to train from "
                     "a random initialisation on purpose")


def build_datasets(cfg, tokenizer):
    """(train, val or None) PromptDatasets; malformed rows / long prompts raise ValueError here."""
    kw = dict(prompt_key=cfg.data.prompt_key, max_prompt_length=cfg.data.max_prompt_length,
              apply_chat_template=cfg.data.apply_chat_template, filter_overlong=cfg.data.filter_overlong_prompts)
    if not cfg.data.train_files:
        raise ValueError("data.train_files is empty: name at least one .parquet or .jsonl file")
    train = PromptDataset(cfg.data.train_files, tokenizer, **kw)
    val = PromptDataset(cfg.data.val_files, tokenizer, **kw) if cfg.data.val_files else None
    return train, val
