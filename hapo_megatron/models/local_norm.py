"""A torch RMSNorm for Megatron's local (no Transformer Engine) layer spec that works under
sequence parallelism, and `with_local_norm(spec)` that puts it into a spec.

WHY: Megatron's `WrappedTorchNorm` refuses `sequence_parallel` because a torch norm does not mark
its weight; under sequence parallelism every TP rank normalises a different slice of the sequence
with the same (replicated) weight, so the weight's gradient is a partial sum that
`finalize_model_grads` must all-reduce over TP, and it does so for parameters carrying
`sequence_parallel = True` (as TE's and Apex's norms set). MoE layers with TP > 1 need sequence
parallelism in training (`MoELayer.forward` refuses to train without it), so the local spec needs a
norm that marks its weight. The math is torch's RMSNorm, unchanged.
"""

from __future__ import annotations

import dataclasses

import torch


class SequenceParallelTorchNorm:
    """Builds `torch.nn.RMSNorm` (Megatron's norm signature) with `weight.sequence_parallel` set from
    the config. Only RMSNorm: the architectures supported here use nothing else."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelTorchNorm supports RMSNorm only, got {config.normalization!r}")
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        norm.weight.sequence_parallel = bool(config.sequence_parallel)
        return norm


def with_local_norm(spec):
    """A copy of a layer / block spec with every `WrappedTorchNorm` replaced by
    `SequenceParallelTorchNorm` (ModuleSpecs, their submodule dataclasses and lists, recursively)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def swap(node):
        if node is WrappedTorchNorm:
            return SequenceParallelTorchNorm
        if isinstance(node, (list, tuple)):
            return type(node)(swap(n) for n in node)
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            changes = {f.name: swap(getattr(node, f.name)) for f in dataclasses.fields(node)}
            return dataclasses.replace(node, **changes)
        return node

    return swap(spec)
