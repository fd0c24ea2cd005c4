"""Rollout engines.

    engine          the interface: sampling parameters, samples, the protocol
    factory         `make_engine`: the engine a config names
    hf_engine       the embedded HF-transformers engine (CPU default, small GPU runs)
    sglang/         SGLang servers (its own package; see its docstring)
    fp8             blockwise FP8 quantisation in SGLang's block-FP8 format
    fp8_weights     which tensors an FP8 server holds in FP8, and their streams
    routed_experts  the experts a MoE engine routed each token to (routing replay)

Engine classes are imported lazily so that ``import hapo_megatron.rollout`` pulls in neither
transformers nor SGLang.
"""

from hapo_megatron.rollout.engine import RolloutEngine, Sample, SamplingParams
from hapo_megatron.rollout.factory import make_engine

_LAZY = {
    "HFRolloutEngine": "hapo_megatron.rollout.hf_engine",
    "SGLangEngine": "hapo_megatron.rollout.sglang.engine",
    "AdaptiveTemperatureProcessor": "hapo_megatron.rollout.sglang.processor",
    "bucket_named_tensors": "hapo_megatron.rollout.sglang.weight_sync",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hapo_megatron.rollout' has no attribute {name!r}")


__all__ = ["RolloutEngine", "Sample", "SamplingParams", "make_engine", *_LAZY]
