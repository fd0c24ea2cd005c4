"""Build the rollout engine a config names.

It sits above the interface (``engine``) and the implementations (``hf_engine``,
``sglang_engine``), which import only the interface: no import circle, and importing the
interface pulls in neither transformers nor SGLang.
"""

from __future__ import annotations

from typing import Any

import torch

from hapo_megatron.rollout.engine import RolloutEngine


def make_engine(rollout_cfg: Any, *, hf_config_or_path: Any, tokenizer: Any = None,
                device: Any = "cpu", dtype: torch.dtype = torch.float32, **kwargs: Any) -> RolloutEngine:
    """Build the engine named by ``rollout_cfg.engine``.

    Args:
        rollout_cfg: a ``RolloutConfig`` (``engine``, ``hf_max_batch_size``, ``sglang``, and for
            SGLang ``quantization`` / ``kv_cache_dtype``).
        hf_config_or_path: HF model directory (both engines) or a transformers config / model
            (``"hf"`` only: random weights until the first ``update_weights``).
        tokenizer: used for eos / pad ids (optional).
        device, dtype: where and in which dtype the HF engine keeps its model; for SGLang,
            ``dtype`` becomes the servers' ``--dtype``.
        kwargs: extra keyword arguments of the engine class.
    """
    engine = rollout_cfg.engine
    if engine == "hf":
        from hapo_megatron.rollout.hf_engine import HFRolloutEngine

        kwargs.setdefault("max_batch_size", int(rollout_cfg.hf_max_batch_size))
        return HFRolloutEngine(hf_config_or_path, tokenizer=tokenizer, device=device, dtype=dtype, **kwargs)
    if engine == "sglang":
        from hapo_megatron.rollout.sglang.engine import SGLangEngine

        if not isinstance(hf_config_or_path, str):
            raise ValueError("hf_config_or_path must be a model directory (str) for the sglang engine")
        kwargs.setdefault("quantization", rollout_cfg.quantization)
        kwargs.setdefault("kv_cache_dtype", rollout_cfg.kv_cache_dtype)
        return SGLangEngine.from_config(rollout_cfg.sglang, model_path=hf_config_or_path,
                                        tokenizer=tokenizer, dtype=dtype, **kwargs)
    raise ValueError(f"rollout_cfg.engine must be 'hf' or 'sglang', got {engine!r}")


__all__ = ["make_engine"]
