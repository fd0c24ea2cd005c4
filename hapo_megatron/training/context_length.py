"""The model's context length against the run's longest sequence, and the one documented override.

A sequence is at most ``data.max_prompt_length + rollout.max_response_length`` tokens. The model
declares ``max_position_embeddings`` in its HF config (4096 for Qwen2.5-Math). A longer run fails
at start (`check_sequence_fits`) unless ``model.max_position_embeddings`` raises the context; that
override is applied to the same HF config object that builds the Megatron model and the HF rollout
engine and that HF exports write (`apply_context_override`), and launched SGLang servers get it as
``--json-model-override-args`` (`sglang_context_args`). RoPE itself is unchanged (same theta, no
scaling): positions past the pretrained context are extrapolated the same way in all three.
"""

from __future__ import annotations

import json
from typing import Optional

__all__ = ["model_context_length", "apply_context_override", "check_sequence_fits", "sglang_context_args",
           "longest_sequence"]

OVERRIDE_FLAGS = ("--json-model-override-args", "--context-length")


def model_context_length(hf_config) -> Optional[int]:
    """The positions the HF config declares (None when it declares none)."""
    n = getattr(hf_config, "max_position_embeddings", None)
    return int(n) if n else None


def longest_sequence(cfg) -> int:
    return int(cfg.data.max_prompt_length) + int(cfg.rollout.max_response_length)


def apply_context_override(hf_config, override: Optional[int]):
    """Set ``max_position_embeddings`` to ``override`` (in place; returns the config)."""
    if override is not None:
        hf_config.max_position_embeddings = int(override)
    return hf_config


def check_sequence_fits(hf_config, cfg, *, model_path: Optional[str] = None) -> None:
    """ValueError naming both numbers and the fields that change them when the run's longest
    sequence does not fit the model's context (after ``model.max_position_embeddings``)."""
    need, override = longest_sequence(cfg), cfg.model.max_position_embeddings
    have = override if override is not None else model_context_length(hf_config)
    if have is None or need <= have:
        return
    source = (f"model.max_position_embeddings={override}" if override is not None else
              f"max_position_embeddings in the HF config of {model_path or cfg.model.hf_model_path!r}")
    raise ValueError(
        f"sequences of up to {need} tokens (data.max_prompt_length={cfg.data.max_prompt_length} + "
        f"rollout.max_response_length={cfg.rollout.max_response_length}) do not fit the model's context of "
        f"{have} positions ({source}). Lower data.max_prompt_length / rollout.max_response_length, or set "
        f"model.max_position_embeddings={need} to extend the context with the model's unchanged RoPE "
        f"(applied to Megatron, the rollout engine and HF exports; see docs/configuration.md)")


def sglang_context_args(cfg, extra_server_args) -> list[str]:
    """The SGLang server arguments that apply ``model.max_position_embeddings``, appended to
    ``extra_server_args`` (which must not set them itself: one source of truth)."""
    override = cfg.model.max_position_embeddings
    args = list(extra_server_args)
    if override is None:
        return args
    clash = [a for a in args if a.split("=", 1)[0] in OVERRIDE_FLAGS]
    if clash:
        raise ValueError(f"rollout.sglang.extra_server_args sets {clash[0].split('=', 1)[0]} while "
                         f"model.max_position_embeddings={override} is set: drop it from extra_server_args "
                         "(the trainer passes the override to the servers itself)")
    return args + ["--json-model-override-args", json.dumps({"max_position_embeddings": int(override)}),
                   "--context-length", str(int(override))]
