"""One micro-batch of the actor as a typed value: ``[b, s]`` tensors, batch first.

Two layouts: *padded* (one sequence per row, right-padded) and *packed* (``b == 1``: several
sequences concatenated in one row, padding-free up to what the kernels need; ``cu_seqlens`` holds
their boundaries, ``segment_ids`` says which sequence each position belongs to, positions restart
at every sequence). Per-token math is the same in both; what is per *sequence* goes through
`sequence_layout` (packed -> one row per sequence and back) or `tokens_of_sequences`.

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
from hapo_megatron.parallel.context_parallel import split_for_cp, split_for_cp_thd

#: per-sequence fields: ``[b]`` (one per row) padded, ``[n]`` (one per sequence) packed; besides
#: ``cu_seqlens``, every other tensor field is ``[b, s]``.
ROW_FIELDS = ("seq_index", "engine_temperatures")
_NOT_TOKEN_FIELDS = ROW_FIELDS + ("cu_seqlens",)
#: ``[b, s, L * k]``: per position, the experts of every layer (what the forward pass reads)
ROUTE_FIELD = "routed_experts"


@dataclass(frozen=True)
class SequenceLayout:
    """Where the sequences of a packed row lie: ``index`` ``[n, L]`` flat positions of sequence
    ``i``'s tokens in order (``L`` = the longest; 0 beyond a sequence's end), ``valid`` ``[n, L]``
    True where ``index`` is a real position. `to_rows` / `to_packed` move per-token tensors
    between the packed ``[1, T]`` row and one row per sequence ``[n, L]`` (both differentiable)."""

    index: torch.Tensor
    valid: torch.Tensor
    num_positions: int

    @staticmethod
    def from_segment_ids(segment_ids: torch.Tensor, num_sequences: int) -> "SequenceLayout":
        seg = segment_ids.reshape(-1).cpu()
        if seg.numel() and not bool((seg[1:] >= seg[:-1]).all()):
            raise ValueError("segment_ids must be non-decreasing (each sequence's tokens together)")
        counts = torch.bincount(seg, minlength=num_sequences)
        starts = torch.cumsum(counts, 0) - counts
        width = max(int(counts.max()) if counts.numel() else 0, 1)
        offs = torch.arange(width).unsqueeze(0)
        valid = offs < counts.unsqueeze(1)
        index = torch.where(valid, starts.unsqueeze(1) + offs, torch.zeros((), dtype=torch.long))
        return SequenceLayout(index=index.to(segment_ids.device), valid=valid.to(segment_ids.device),
                              num_positions=seg.numel())

    def to_rows(self, t: torch.Tensor) -> torch.Tensor:
        """``[1, T]`` -> ``[n, L]`` (zero / False beyond each sequence's end)."""
        rows = t.reshape(-1)[self.index]
        return torch.where(self.valid, rows, torch.zeros((), dtype=t.dtype, device=t.device))

    def to_packed(self, t: torch.Tensor) -> torch.Tensor:
        """``[n, L]`` -> ``[1, T]`` (inverse of `to_rows` on the valid entries)."""
        flat = t.new_zeros(self.num_positions)
        return flat.index_put((self.index[self.valid],), t[self.valid]).unsqueeze(0)


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
        cu_seqlens: packed only: ``[n + 1]`` int32 boundaries of the row's sequences (each one's
            span includes its padding) in the *full* row, also in a context-parallel shard (what
            Transformer Engine's THD attention and megatron-core's `PackedSeqParams` take).
        segment_ids: packed only: ``[1, s]`` int64, the sequence (0..n-1) of every position.
        padding_mask: ``[b, s]`` bool, True at the positions that are no token of a sequence
            (padding, every position of a filler): what the MoE routers leave out
            (`models.moe_padding`); None: every position is routed.
        routed_experts: MoE with routing replay: ``[b, s, L * k]`` int16, the ``k`` experts the
            engine chose in each of the ``L`` layers for the token at each position, -1 where it
            chose none (`models.routing_replay`); what the forward pass reads, not the loss.
        old_logprobs: ``[b, s]`` float32, the behaviour policy's log-probs the loss's ratio
            divides by (the recomputed ones, or the rollout's with ``old_logprob_source:
            rollout``); 0 where ``loss_mask`` is 0.
        old_entropy: ``[b, s]`` float32, the entropy of the policy before the update at T_base.
        recomputed_logprobs: ``[b, s]`` float32, the actor's own log-probs at T_base before the
            update (the same tensor as ``old_logprobs`` with ``old_logprob_source: recompute``).
        ref_logprobs: ``[b, s]`` float32, the KL reference's log-probs.
        proximal_logprobs: ``[b, s]`` float32, the actor's log-probs before the update under each
            token's sampling distribution (``softmax(z / T_t)``, the one ``rollout_logprobs`` are
            taken under); what the off-policy correction (``algo.rollout_is``) compares them with.
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
    cu_seqlens: Optional[torch.Tensor] = None
    segment_ids: Optional[torch.Tensor] = None
    padding_mask: Optional[torch.Tensor] = None
    routed_experts: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    old_entropy: Optional[torch.Tensor] = None
    recomputed_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    proximal_logprobs: Optional[torch.Tensor] = None
    updates: tuple[PolicyTokenFields, ...] = ()

    def __post_init__(self) -> None:
        shape = tuple(self.input_ids.shape)
        if len(shape) != 2:
            raise ValueError(f"MicroBatch.input_ids must be [b, s], got shape {shape}")
        if (self.cu_seqlens is None) != (self.segment_ids is None):
            raise ValueError("MicroBatch.cu_seqlens and segment_ids go together (a packed row)")
        if self.is_packed:
            if shape[0] != 1 or self.cu_seqlens.dim() != 1 or self.cu_seqlens.numel() < 2:
                raise ValueError(f"a packed MicroBatch is one row with cu_seqlens [n + 1], got shape "
                                 f"{shape} and cu_seqlens {tuple(self.cu_seqlens.shape)}")
        for name, t in self._tensors():
            if name == "cu_seqlens":
                continue
            want = (self.num_sequences,) if name in ROW_FIELDS else shape
            if name == ROUTE_FIELD:
                want = shape + tuple(t.shape[2:3]) if t.dim() == 3 else shape + (-1,)
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
    def is_packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def num_sequences(self) -> int:
        """Sequences (with fillers): rows when padded, ``len(cu_seqlens) - 1`` when packed."""
        return len(self.cu_seqlens) - 1 if self.is_packed else self.batch_size

    @property
    def max_seqlen(self) -> int:
        """The longest sequence span of a packed row (full row, before any CP split)."""
        if not self.is_packed:
            return self.seq_len
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())

    def sequence_layout(self) -> Optional[SequenceLayout]:
        """`SequenceLayout` of a packed row (of this shard), None when padded."""
        if not self.is_packed:
            return None
        return SequenceLayout.from_segment_ids(self.segment_ids, self.num_sequences)

    def tokens_of_sequences(self, values: torch.Tensor) -> torch.Tensor:
        """A per-sequence ``[n]`` value (e.g. ``engine_temperatures``) at each of its positions ``[b, s]``."""
        if self.is_packed:
            return values.to(self.segment_ids.device)[self.segment_ids]
        return values.unsqueeze(-1).expand(self.input_ids.shape)

    def unpacked(self) -> "MicroBatch":
        """A packed row as a padded micro-batch with one row per sequence (zeros beyond each
        sequence's span, ``updates`` included); ``self`` when already padded. For per-sequence
        consumers (diagnostics, saved rollouts)."""
        if not self.is_packed:
            return self
        lay = self.sequence_layout()
        cut = {name: t if name in ROW_FIELDS else lay.to_rows(t)
               for name, t in self._tensors() if name not in ("cu_seqlens", "segment_ids", ROUTE_FIELD)}
        if self.padding_mask is not None:  # beyond a sequence's span is padding too
            cut["padding_mask"] = ~lay.to_rows(~self.padding_mask)
        return replace(self, **cut, cu_seqlens=None, segment_ids=None, routed_experts=None,
                       updates=tuple(u.apply(lay.to_rows) for u in self.updates))

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
        if self.routed_experts is not None:
            raise ValueError("routing replay does not support context parallelism (MoE models train without it)")
        if self.is_packed:  # each sequence in 2 x CP chunks (TE's THD layout); cu_seqlens stay full
            cut = {name: t if name in _NOT_TOKEN_FIELDS else split_for_cp_thd(t, self.cu_seqlens, cp_size, cp_rank)
                   for name, t in self._tensors()}
            return replace(self, **cut, updates=())
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
        """The rows ``index`` of every field (a data-parallel or micro-batch split); padded only."""
        if self.is_packed:
            raise ValueError("MicroBatch.rows cuts padded micro-batches; a packed row is one row")
        return replace(self, **{name: t[index] for name, t in self._tensors()},
                       updates=tuple(u.apply(lambda t: t[index]) for u in self.updates))


__all__ = ["MicroBatch", "ROW_FIELDS", "SequenceLayout"]
