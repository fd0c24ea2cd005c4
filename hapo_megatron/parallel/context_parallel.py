"""Megatron's context-parallel (CP) sequence layout as pure index math.

Megatron-Core balances causal attention over `cp` ranks by cutting every sequence into
`2 * cp` equal chunks and giving rank `r` chunks `r` and `2 * cp - 1 - r` (an early, cheap
chunk and a late, expensive one). Labels are shifted *before* the split (position `t` holds
the token predicted at `t`), so each rank's labels line up with its own logits.

Nothing here communicates, except the optional convenience `all_gather_from_cp`, which takes
its process group as an argument.
"""

from __future__ import annotations

from typing import Sequence

import torch


def _check_layout(seq_len: int, cp_size: int, cp_rank: int | None = None) -> None:
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    if cp_rank is not None and not (0 <= cp_rank < cp_size):
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank!r}")
    if seq_len % (2 * cp_size) != 0 and cp_size > 1:
        raise ValueError(f"seq_len ({seq_len}) must be divisible by 2 * cp_size ({2 * cp_size}); "
                         f"pad it with cp_padded_length()")


def cp_padded_length(seq_len: int, cp_size: int) -> int:
    """Smallest length >= `seq_len` that splits into `2 * cp_size` equal chunks (`seq_len` if cp=1)."""
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if cp_size == 1:
        return seq_len
    m = 2 * cp_size
    return -(-seq_len // m) * m


def cp_chunk_indices(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.LongTensor:
    """Positions of a length-`seq_len` sequence held by `cp_rank`: `[seq_len / cp_size]`.

    Chunks `cp_rank` and `2*cp_size-1-cp_rank` of `2*cp_size` equal chunks, in that order
    (ascending positions). With `cp_size == 1` all positions.
    """
    _check_layout(seq_len, cp_size, cp_rank)
    if cp_size == 1:
        return torch.arange(seq_len, device=device)
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second_start = (2 * cp_size - 1 - cp_rank) * chunk
    second = torch.arange(second_start, second_start + chunk, device=device)
    return torch.cat([first, second])


def split_for_cp(t: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's CP shard of `t` along `dim` (e.g. `[b, s] -> [b, s / cp]`). A copy for cp > 1."""
    if cp_size == 1:
        return t
    dim = dim % t.dim()
    idx = cp_chunk_indices(t.shape[dim], cp_size, cp_rank, device=t.device)
    return t.index_select(dim, idx)


def gather_from_cp(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of `split_for_cp`: reassemble the full tensor from every rank's shard.

    `shards[r]` is rank r's shard `[..., s / cp, ...]`; returns `[..., s, ...]`.
    """
    cp_size = len(shards)
    if cp_size == 0:
        raise ValueError("shards must hold one tensor per CP rank, got none")
    if cp_size == 1:
        return shards[0]
    dim = dim % shards[0].dim()
    local = shards[0].shape[dim]
    if any(s.shape != shards[0].shape for s in shards):
        raise ValueError("shards must all have the same shape")
    if local % 2 != 0:
        raise ValueError(f"each shard must hold two equal chunks along dim {dim}, got length {local}")
    chunk = local // 2
    pieces: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for r, s in enumerate(shards):
        first, second = s.split(chunk, dim=dim)
        pieces[r] = first
        pieces[2 * cp_size - 1 - r] = second
    return torch.cat(pieces, dim=dim)  # type: ignore[arg-type]


def all_gather_from_cp(t: torch.Tensor, cp_group, dim: int = 1) -> torch.Tensor:
    """All-gather every CP rank's shard over `cp_group` and reassemble the full sequence."""
    import torch.distributed as dist

    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return t
    shards = [torch.empty_like(t) for _ in range(dist.get_world_size(cp_group))]
    dist.all_gather(shards, t.contiguous(), group=cp_group)
    return gather_from_cp(shards, dim=dim)
