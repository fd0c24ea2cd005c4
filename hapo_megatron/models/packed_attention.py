"""Packed (THD) rows for Megatron's local layer spec, which has no THD attention.

Megatron-Core's `DotProductAttention` asserts ``packed_seq_params is None``; Transformer Engine's
attention takes packed rows natively. `PackedDotProductAttention` is the local class with the
packed case added: the attention of a row of sequences with boundaries ``cu_seqlens`` under a
block-diagonal causal mask (`block_causal_mask`: a position sees the earlier positions of its own
sequence only). It is computed block by block, as TE does: the row's sequences become the rows of
an ordinary causal batch (``O(sum L_i^2)``, not ``O(T^2)`` as a dense masked product would be), and
the outputs go back to the packed row. Everything else of the packed path is megatron-core's own: `GPTModel`
squeezes the batch dimension for ``qkv_format="thd"`` and applies the rotary embedding per sequence
(`_apply_rotary_pos_emb_thd`: positions restart at every ``cu_seqlens`` boundary), so a CPU run
computes what the GPU (TE) path computes, the attention kernel aside.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


def block_causal_mask(cu_seqlens: torch.Tensor, device=None) -> torch.Tensor:
    """``[1, 1, T, T]`` bool, True where query ``q`` may NOT see key ``k`` (Megatron's
    `attention_mask_func` convention): ``k > q`` or ``k`` in another sequence than ``q``."""
    bounds = cu_seqlens.to(device=device, dtype=torch.long)
    total = int(bounds[-1])
    pos = torch.arange(total, device=device)
    seg = torch.bucketize(pos, bounds[1:], right=True)  # sequence of each position
    blocked = (seg.unsqueeze(1) != seg.unsqueeze(0)) | (pos.unsqueeze(0) > pos.unsqueeze(1))
    return blocked.view(1, 1, total, total)


def _sequence_rows(cu_seqlens: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``index`` ``[n, L]``: the row positions of sequence ``i`` (0 past its end), ``valid`` where real."""
    bounds = cu_seqlens.to(device=device, dtype=torch.long)
    starts, lengths = bounds[:-1], bounds[1:] - bounds[:-1]
    offs = torch.arange(int(lengths.max()), device=device).unsqueeze(0)
    valid = offs < lengths.unsqueeze(1)
    return torch.where(valid, starts.unsqueeze(1) + offs, torch.zeros_like(offs)), valid


class PackedDotProductAttention(DotProductAttention):
    """`DotProductAttention` that also takes a packed row (``packed_seq_params.qkv_format ==
    "thd"``, query/key/value ``[T, heads, head_dim]``) by masking block-diagonally; unpacked input
    goes to the parent unchanged. Context parallelism needs TE's THD attention (refused here)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed rows need qkv_format='thd', got {packed_seq_params.qkv_format!r}")
        if self.config.context_parallel_size > 1:
            raise NotImplementedError("context parallelism over packed rows needs Transformer Engine's "
                                      "THD attention (the local layer spec has none)")
        cu = packed_seq_params.cu_seqlens_q_padded
        cu = packed_seq_params.cu_seqlens_q if cu is None else cu
        if int(cu[-1]) != query.shape[0]:
            raise ValueError(f"cu_seqlens end at {int(cu[-1])} but the packed row holds {query.shape[0]} tokens")
        index, valid = _sequence_rows(cu, query.device)  # [n, L]

        def rows(t):  # [T, heads, d] -> [L, n, heads, d]: one sequence per batch row (sbhd)
            return t[index].transpose(0, 1).contiguous()

        # Causal within each row is the block-diagonal mask: a real query never reaches the
        # positions past its sequence's end (they come later), whose outputs are dropped below.
        out = super().forward(rows(query), rows(key), rows(value), None, attn_mask_type=attn_mask_type,
                              attention_bias=attention_bias)  # [L, n, heads * d]
        return out.transpose(0, 1)[valid].unsqueeze(1)  # [T, 1, heads * d] in row order


__all__ = ["PackedDotProductAttention", "block_causal_mask"]
