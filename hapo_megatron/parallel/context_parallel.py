"""Megatron's context-parallel (CP) sequence layout as pure index math.

Megatron-Core balances causal attention over `cp` ranks by cutting every sequence into
`2 * cp` equal chunks and giving rank `r` chunks `r` and `2 * cp - 1 - r` (an early, cheap
chunk and a late, expensive one). Labels are shifted *before* the split (position `t` holds
the token predicted at `t`), so each rank's labels line up with its own logits.

Packed rows (THD, several sequences in one row, see `parallel.micro_batch`) follow Transformer
Engine's convention instead (`thd_get_partitioned_indices`, which megatron-core's
`get_thd_batch_on_this_cp_rank` uses): *each sequence* is cut into `2 * cp` chunks and rank `r`
holds chunks `r` and `2 * cp - 1 - r` of every sequence, in sequence order (`thd_cp_indices`).

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


def thd_cp_indices(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.LongTensor:
    """Positions of a packed row held by `cp_rank` (TE's THD split): for every sequence
    `[cu_seqlens[i], cu_seqlens[i+1])`, its chunks `cp_rank` and `2*cp_size-1-cp_rank` of
    `2*cp_size` equal chunks; `[cu_seqlens[-1] / cp_size]`. Every sequence length must be a
    multiple of `2 * cp_size` (the packer pads each sequence that far)."""
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if cp_size == 1:
        return torch.arange(bounds[-1] - bounds[0]) + bounds[0]
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        _check_layout(end - start, cp_size, cp_rank)
        pieces.append(cp_chunk_indices(end - start, cp_size, cp_rank) + start)
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def split_for_cp_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int,
                     dim: int = 1) -> torch.Tensor:
    """This rank's THD shard of a packed row `t` along `dim` (`thd_cp_indices`)."""
    if cp_size == 1:
        return t
    return t.index_select(dim % t.dim(), thd_cp_indices(cu_seqlens, cp_size, cp_rank).to(t.device))


def gather_from_cp_thd(shards: Sequence[torch.Tensor], cu_seqlens: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Inverse of `split_for_cp_thd`: the full packed row from every rank's shard (`shards[r]`)."""
    cp_size = len(shards)
    if cp_size == 0:
        raise ValueError("shards must hold one tensor per CP rank, got none")
    if cp_size == 1:
        return shards[0]
    dim = dim % shards[0].dim()
    total = int(cu_seqlens[-1])
    shape = list(shards[0].shape)
    if shape[dim] * cp_size != total:
        raise ValueError(f"{cp_size} shards of length {shape[dim]} do not make the packed row of {total}")
    shape[dim] = total
    out = shards[0].new_empty(shape)
    for r, s in enumerate(shards):
        out.index_copy_(dim, thd_cp_indices(cu_seqlens, cp_size, r).to(s.device), s)
    return out


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


def all_gather_from_cp(t: torch.Tensor, cp_group, dim: int = 1, cu_seqlens=None) -> torch.Tensor:
    """All-gather every CP rank's shard over `cp_group` and reassemble the full sequence (a
    packed row's THD layout when `cu_seqlens` is given)."""
    import torch.distributed as dist

    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return t
    shards = [torch.empty_like(t) for _ in range(dist.get_world_size(cp_group))]
    dist.all_gather(shards, t.contiguous(), group=cp_group)
    if cu_seqlens is not None:
        return gather_from_cp_thd(shards, cu_seqlens, dim=dim)
    return gather_from_cp(shards, dim=dim)
