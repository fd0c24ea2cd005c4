"""Routing replay for MoE policies (docs/moe.md, "Routing replay"): train on the experts the
rollout engine chose.

The engine samples a response with its own kernels and numerics; the actor, recomputing the same
sequence, may route some tokens to other experts, so its log-probs are those of another network.
Replay hands every MoE router, per micro-batch, the experts the engine chose for each token it
ran (`MicroBatch.routed_experts`): the router then weights those experts with its own scores
(gradients flow through the gathered scores as through its own top-k) and takes its own top-k
only where the engine gave none (the last token of a sequence, padding, fillers).

How it plugs into Megatron-Core: its `TopKRouter` asks ``router.router_replay.get_replay_topk(
scores, topk, num_groups, group_topk, default_compute_topk)`` for the top-k (megatron-core >=
0.16, `moe_utils.topk_routing_with_score_function`). `install_route_replay` puts a `RouteReplay`
there on each router of the model chunks; it never uses Megatron's process-wide list of routers,
which keeps the routers of every model ever built in the process. `RouteReplay` also counts how
often the actor's own top-k set differs from the engine's (`rollout/routing_mismatch`), replay or
not.

Token order: a router sees this rank's ``[s, b, h]`` hidden states flattened sequence-major
(token ``t * b + j``), under sequence parallelism only its TP rank's contiguous slice of ``s``;
`routes_for_router` cuts the micro-batch's ``[b, s, L * k]`` routes the same way.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Optional

import torch

NO_ROUTE = -1  # a position the engine gave no experts for: the router takes its own top-k


class RouteReplay:
    """One router's replay state (duck-types Megatron's ``RouterReplay.get_replay_topk``).

    ``replay``: use the engine's experts where given (else only measure the mismatch). Targets are
    queued per micro-batch in the order the schedule runs the forward passes; with activation
    recomputation a training pass queues them a second time for the recomputed forward in the
    backward pass (``recompute``), told apart by grad mode: Megatron's checkpointed forward runs
    under no_grad, its recomputation under enable_grad.
    """

    def __init__(self, *, replay: bool, recompute: bool) -> None:
        self.replay, self.recompute = bool(replay), bool(recompute)
        self.forward_targets: deque = deque()
        self.recompute_targets: deque = deque()
        self.counting = False  # on during the old-log-prob pass: the mismatch of the step's routing
        self.differing = 0
        self.compared = 0
        self.layer_number: Optional[int] = None  # megatron-core main sets it; ours comes from the router

    def push(self, target: Optional[torch.Tensor], *, training: bool) -> None:
        """Queue one micro-batch's ``[tokens, k]`` target (None: the router's own top-k)."""
        self.forward_targets.append(target)
        if training and self.recompute:
            self.recompute_targets.append(target)

    def pending(self) -> int:
        return len(self.forward_targets) + len(self.recompute_targets)

    def clear(self) -> None:
        self.forward_targets.clear()
        self.recompute_targets.clear()

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        own_scores, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        recomputing = self.recompute and torch.is_grad_enabled() and bool(self.recompute_targets)
        queue = self.recompute_targets if recomputing else self.forward_targets
        if not queue:
            raise RuntimeError("routing replay: a router ran without a queued micro-batch (forward calls "
                               "and queued micro-batches disagree)")
        target = queue.popleft()
        if target is None:
            return own_scores, own
        target = target.to(own.device)
        if tuple(target.shape) != tuple(own.shape):
            raise ValueError(f"routing replay: {tuple(target.shape)} routes for a router that routes "
                             f"{tuple(own.shape)} (tokens x top-k): is the token layout the actor's?")
        given = target[:, 0] != NO_ROUTE
        if self.counting and not recomputing:
            differs = (torch.sort(own, dim=-1).values != torch.sort(target, dim=-1).values).any(-1)
            self.differing += int((differs & given).sum())
            self.compared += int(given.sum())
        if not self.replay:
            return own_scores, own
        chosen = torch.where(given.unsqueeze(-1), target, own)
        # the router's own scores of the chosen experts: what its top-k values are for its own choice
        return scores.gather(1, chosen), chosen


def moe_routers(model_chunks) -> list:
    """Megatron's top-k routers of ``model_chunks`` (this pipeline stage), by layer."""
    routers = [m for chunk in model_chunks for m in chunk.modules() if type(m).__name__ == "TopKRouter"]
    return sorted(routers, key=lambda r: int(r.layer_number))


def install_route_replay(model_chunks, *, replay: bool, recompute: bool) -> list:
    """A `RouteReplay` on every MoE router of ``model_chunks`` (replaces what Megatron put there);
    returns the routers. Refuses routers whose top-k bypasses the replay hook (fused TE routing)."""
    import inspect

    from megatron.core.transformer.moe import moe_utils

    if "router_replay" not in inspect.signature(moe_utils.topk_routing_with_score_function).parameters:
        raise RuntimeError("routing replay needs megatron-core >= 0.16 (topk_routing_with_score_function "
                           "takes no router_replay in this version)")
    routers = moe_routers(model_chunks)
    for r in routers:
        if getattr(r.config, "moe_router_fusion", False):
            raise ValueError("routing replay: moe_router_fusion (TE's fused top-k) ignores the replayed "
                             "experts; turn it off")
        r.router_replay = RouteReplay(replay=replay, recompute=recompute)
    return routers


def routes_for_router(routes: torch.Tensor, layer: int, top_k: int, *, tp_rank: int = 0, tp_size: int = 1,
                      sequence_parallel: bool, first_layer: int = 0) -> torch.Tensor:
    """Layer ``layer``'s (0-based) ``[tokens, top_k]`` int64 routes in the order its router sees
    this rank's tokens, from a micro-batch's ``[b, s, L * top_k]`` routes of the layers from
    ``first_layer`` on (a pipeline stage's, `training.batches.route_share`)."""
    b, s, width = routes.shape
    if width % top_k:
        raise ValueError(f"routes carry {width} experts per position, not layers x top-{top_k}")
    if not 0 <= layer - first_layer < width // top_k:
        raise ValueError(f"routes of layers {first_layer}..{first_layer + width // top_k - 1} hold no layer {layer}")
    per_layer = routes.view(b, s, width // top_k, top_k)[:, :, layer - first_layer, :]
    tokens = per_layer.transpose(0, 1)  # [s, b, k]: the decoder's sequence-first layout
    if sequence_parallel and tp_size > 1:
        if s % tp_size:
            raise ValueError(f"sequence length {s} is not a multiple of TP {tp_size} under sequence parallelism")
        tokens = tokens.chunk(tp_size, dim=0)[tp_rank]
    return tokens.reshape(-1, top_k).long()


def queue_routes(routers: Iterable, routes: Optional[torch.Tensor], *, training: bool, tp_rank: int = 0,
                 tp_size: int = 1, sequence_parallel: bool, first_layer: int = 0) -> None:
    """Queue one micro-batch's routes (of the layers from ``first_layer`` on) on every router
    (None: each router its own top-k)."""
    for r in routers:
        target = None if routes is None else routes_for_router(
            routes, int(r.layer_number) - 1, int(r.topk), tp_rank=tp_rank, tp_size=tp_size,
            sequence_parallel=sequence_parallel, first_layer=first_layer)
        r.router_replay.push(target, training=training)


def check_consumed(routers: Iterable) -> None:
    """After a pass: every queued micro-batch reached its router (else the replay silently did
    not apply: a router that does not consult ``router_replay``)."""
    left = [int(r.layer_number) for r in routers if r.router_replay.pending()]
    for r in routers:
        r.router_replay.clear()
    if left:
        raise RuntimeError(f"routing replay: routers of layers {left} did not consume their routes")


def take_mismatch_counts(routers: Iterable) -> tuple[int, int]:
    """``(differing, compared)`` (token, layer) pairs counted since the last call; resets."""
    differing = compared = 0
    for r in routers:
        differing += r.router_replay.differing
        compared += r.router_replay.compared
        r.router_replay.differing = r.router_replay.compared = 0
    return differing, compared


__all__ = ["NO_ROUTE", "RouteReplay", "check_consumed", "install_route_replay", "moe_routers", "queue_routes",
           "routes_for_router", "take_mismatch_counts"]
