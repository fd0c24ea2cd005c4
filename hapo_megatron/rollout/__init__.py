"""Rollout engines: the interface (``engine``), the embedded HF-transformers engine
(``hf_engine``) and SGLang servers (``sglang_engine``, ``sglang_processor``).

Engine classes are imported lazily so that ``import hapo_megatron.rollout`` pulls in neither
transformers nor SGLang.
"""

from hapo_megatron.rollout.engine import RolloutEngine, Sample, SamplingParams
from hapo_megatron.rollout.factory import make_engine

_LAZY = {
    "HFRolloutEngine": "hapo_megatron.rollout.hf_engine",
    "SGLangEngine": "hapo_megatron.rollout.sglang_engine",
    "AdaptiveTemperatureProcessor": "hapo_megatron.rollout.sglang_processor",
    "bucket_named_tensors": "hapo_megatron.rollout.weight_sync",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hapo_megatron.rollout' has no attribute {name!r}")


__all__ = ["RolloutEngine", "Sample", "SamplingParams", "make_engine", *_LAZY]
