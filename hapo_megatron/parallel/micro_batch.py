"""One micro-batch of the actor as a typed value: padded ``[b, s]`` tensors, batch first.

The fields say what exists at each point of a training step. `training.batching.collate` fills
the token layout (``input_ids``, ``position_ids``, ``labels``, ``loss_mask``) and, for RL, the
per-token ``advantages`` and what the rollout reported; the old-log-prob pass adds
``old_logprobs``, ``old_entropy``, ``recomputed_logprobs`` (and ``ref_logprobs`` with a KL
reference); each PPO epoch adds the loss's per-token view to ``updates``. A stage adds a field on
a returned copy (`with_`); the dataclass is frozen, so nothing is edited in place and a misspelt
field is an error, not a silent default.

Token layout: position ``t`` reads ``input_ids[:, t]`` and predicts ``labels[:, t]``; per-token
values sit at the position that predicts their token, so `split_for_cp` cuts every ``[b, s]``
field the same way and the shards stay aligned.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional, Union

import torch

from hapo_megatron.algo.loss import PolicyTokenFields
from hapo_megatron.parallel.context_parallel import split_for_cp

#: ``[b]`` fields (one value per row); every other tensor field is ``[b, s]``.
ROW_FIELDS = ("seq_index", "engine_temperatures")


@dataclass(frozen=True)
class MicroBatch:
    """Padded micro-batch; optional fields are None until the stage that makes them has run.

    Attributes:
        input_ids, position_ids, labels: ``[b, s]`` int64 (labels: the token predicted at each
            position; padding holds the pad id).
        loss_mask: ``[b, s]`` float32, 1 where the label is a response token.
        advantages: ``[b, s]`` float32, the sequence's advantage on its response positions.
        rollout_logprobs: ``[b, s]`` float32, the engine's log-prob of each sampled token.
        temperatures: ``[b, s]`` float32, the sampling temperature of each response token (1
            elsewhere): the engine's where it reported them, else recomputed by the trainer.
        seq_index: ``[b]`` int64, the row's index in the step's batch (-1: all-masked filler).
        engine_temperatures: ``[b]`` bool, True where the engine reported the row's temperatures.
        old_logprobs: ``[b, s]`` float32, the behaviour policy's log-probs the loss's ratio
            divides by (the recomputed ones, or the rollout's with ``old_logprob_source:
            rollout``); 0 where ``loss_mask`` is 0.
        old_entropy: ``[b, s]`` float32, the entropy of the policy before the update at T_base.
        recomputed_logprobs: ``[b, s]`` float32, the actor's own log-probs at T_base before the
            update (the same tensor as ``old_logprobs`` with ``old_logprob_source: recompute``).
        ref_logprobs: ``[b, s]`` float32, the KL reference's log-probs.
        updates: the loss's `PolicyTokenFields` of this micro-batch, full sequences, one per PPO
            epoch in order.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    advantages: Optional[torch.Tensor] = None
    rollout_logprobs: Optional[torch.Tensor] = None
    temperatures: Optional[torch.Tensor] = None
    seq_index: Optional[torch.Tensor] = None
    engine_temperatures: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    old_entropy: Optional[torch.Tensor] = None
    recomputed_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    updates: tuple[PolicyTokenFields, ...] = ()

    def __post_init__(self) -> None:
        shape = tuple(self.input_ids.shape)
        if len(shape) != 2:
            raise ValueError(f"MicroBatch.input_ids must be [b, s], got shape {shape}")
        for name, t in self._tensors():
            want = shape[:1] if name in ROW_FIELDS else shape
            if tuple(t.shape) != want:
                raise ValueError(f"MicroBatch.{name} must have shape {want}, got {tuple(t.shape)}")
        for u in self.updates:
            if tuple(u.ratio.shape) != shape:
                raise ValueError(f"MicroBatch.updates must hold [b, s] = {shape} fields, got {tuple(u.ratio.shape)}")

    def _tensors(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if torch.is_tensor(value):
                yield f.name, value

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    def with_(self, **changes) -> "MicroBatch":
        """A copy with ``changes`` (checked again); the original is left as it was."""
        return replace(self, **changes)

    def split_for_cp(self, cp_size: int, cp_rank: int) -> "MicroBatch":
        """This context-parallel rank's shard: every ``[b, s]`` field cut with
        `context_parallel.split_for_cp` (chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of
        the sequence), ``[b]`` fields kept. What the forward pass and the loss read; ``updates``
        (full-sequence results) are not carried over. ``cp_size == 1``: ``self``."""
        if cp_size == 1:
            return self
        cut = {name: t if name in ROW_FIELDS else split_for_cp(t, cp_size, cp_rank, dim=1)
               for name, t in self._tensors()}
        return replace(self, **cut, updates=())

    def to(self, device: Union[str, torch.device]) -> "MicroBatch":
        """The same micro-batch with every tensor on ``device`` (``self`` when already there)."""
        device = torch.device(device)
        if all(t.device == device for _, t in self._tensors()):
            return self
        return replace(self, **{name: t.to(device) for name, t in self._tensors()},
                       updates=tuple(u.apply(lambda t: t.to(device)) for u in self.updates))

    def rows(self, index: Union[slice, list[int], torch.Tensor]) -> "MicroBatch":
        """The rows ``index`` of every field (a data-parallel or micro-batch split)."""
        return replace(self, **{name: t[index] for name, t in self._tensors()},
                       updates=tuple(u.apply(lambda t: t[index]) for u in self.updates))


__all__ = ["MicroBatch", "ROW_FIELDS"]
