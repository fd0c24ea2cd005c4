"""Padding weighs nothing in an MoE layer (docs/moe.md, "Padding and fillers").

A micro-batch holds positions that are no token of any sequence: the right padding of a padded
row, the span padding of a packed row, and every position of an all-masked filler micro-batch
(`training.batching.equalize_micro_batch_counts`). Their outputs are never read, but a router
would still send them to experts: they would count in the load-balancing loss (and its gradient),
in the expert-load metrics. `MicroBatch.padding_mask` marks them (True =
padding, megatron-core's convention); the actor passes it to `GPTModel.forward`, which hands it
to every MoE router, and:

- megatron-core 0.16.1 leaves those positions out of the load-balancing (and z-) loss;
- `route_no_padding` gives their rows of the router's ``probs`` zero weight (a forward hook) and
  leaves the ``routing_map`` whole: every position goes to its top-k experts, as megatron-core's
  dispatcher assumes (dropless, it sizes the permuted tokens as ``tokens x topk`` while the
  all-to-all split sizes come from ``routing_map.sum()``; a cleared row breaks both on TE's fused
  permute, docs/moe.md "Padding and fillers"). A pad's expert output is scaled by 0, so it adds
  nothing to any output or gradient; the expert-load counts leave pads out with `real_rows`;
- the load-balancing loss of a micro-batch without any real token (a filler) divides 0 by 0
  tokens in megatron-core: `_token_count_at_least_one` makes that count 1, where every term of
  the sum is 0 too, so the loss and its gradient are exactly 0.
"""

from __future__ import annotations

from typing import Optional

import torch

from hapo_megatron.models.routing_replay import moe_routers


def stage_padding_mask(padding_mask: Optional[torch.Tensor], *, pre_process: bool, sequence_parallel: bool,
                       tp_rank: int, tp_size: int) -> Optional[torch.Tensor]:
    """The ``[b, s]`` mask this pipeline stage's `GPTModel.forward` takes. WHY: under sequence
    parallelism the first stage scatters it over TP with the embeddings, a later stage does not
    (megatron-core 0.16.1 `GPTModel._preprocess`), while its routers see only their TP slice."""
    if padding_mask is None or pre_process or not sequence_parallel or tp_size == 1:
        return padding_mask
    s = padding_mask.shape[1]
    if s % tp_size:
        raise ValueError(f"sequence length {s} is not a multiple of TP {tp_size} under sequence parallelism")
    return padding_mask.chunk(tp_size, dim=1)[tp_rank].contiguous()


def _keep_rows(router_inputs, rows: int, device) -> Optional[torch.Tensor]:
    """``[tokens, 1]`` bool, True at the real tokens of a router call (None: no padding mask).
    The router flattens its ``[s, b]`` mask sequence-major, as its tokens (`TopKRouter.routing`)."""
    padding = router_inputs[1] if len(router_inputs) > 1 else None
    if padding is None:
        return None
    keep = ~padding.reshape(-1, 1).to(device=device, dtype=torch.bool)
    if keep.shape[0] != rows:
        raise ValueError(f"padding mask of {keep.shape[0]} positions for a router of {rows} tokens")
    return keep


def real_rows(router_inputs, routing_map: torch.Tensor) -> torch.Tensor:
    """``routing_map`` of a router call with the padding rows cleared: what real tokens route
    (the expert-load counts; the dispatched map itself keeps them, see the module docstring)."""
    keep = _keep_rows(router_inputs, routing_map.shape[0], routing_map.device)
    return routing_map if keep is None else routing_map & keep


def _zero_padding_probs(router, inputs, output):
    """Forward hook of a router: padding rows weighted 0 in ``probs``; ``routing_map`` untouched,
    so it keeps exactly ``tokens x topk`` entries (the dispatcher's ``num_out_tokens``)."""
    probs, routing_map = output
    keep = _keep_rows(inputs, routing_map.shape[0], probs.device)
    if keep is None:
        return output
    return probs * keep, routing_map


def _token_count_at_least_one(original):
    def counts(routing_map, reduce_group, topk=None, with_padding_mask=False):
        per_expert, local, total = original(routing_map, reduce_group, topk=topk, with_padding_mask=with_padding_mask)
        if with_padding_mask:  # no real token in the reduce group: every term is 0, so is the loss
            total = total.clamp_min(1) if torch.is_tensor(total) else max(total, 1)
        return per_expert, local, total

    counts.hapo_original = original
    return counts


def _guard_empty_token_count() -> None:
    """Install `_token_count_at_least_one` in megatron-core's router module (once per process)."""
    from megatron.core.transformer.moe import router as router_module

    current = router_module.get_tokens_per_expert_and_token_count
    if not hasattr(current, "hapo_original"):
        router_module.get_tokens_per_expert_and_token_count = _token_count_at_least_one(current)


def route_no_padding(model) -> list:
    """`_zero_padding_probs` on every MoE router of ``model`` (a GPTModel or model chunks) and the empty
    micro-batch guard; returns the routers. Refuses the router z-loss, which megatron-core 0.16.1
    averages over the real tokens without such a guard (a filler would make it NaN)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    routers = moe_routers(chunks)
    for r in routers:
        if getattr(r.config, "moe_z_loss_coeff", None):
            raise ValueError("moe_z_loss_coeff: the router z-loss is not supported (an all-padding filler "
                             "micro-batch makes megatron-core's z-loss 0 / 0)")
        r.register_forward_hook(_zero_padding_probs)
    if routers:
        _guard_empty_token_count()
    return routers


__all__ = ["real_rows", "route_no_padding", "stage_padding_mask"]
