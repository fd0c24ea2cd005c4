"""Where the trainer's SGLang servers run: one plan for the whole torchrun job (pure functions).

Every node runs its share of the servers on its own GPUs; the node's first rank (local rank 0)
starts them (``node_servers.start_node_servers``). Colocated servers use the trainer's GPUs
``0 .. ranks_per_node - 1``; separate servers the GPUs after them. A server never spans nodes
(SGLang's multi-node servers are not used), so ``server_tp_size`` must fit one node.

    plan_servers(num_servers=0, server_tp_size=2, num_nodes=2, ranks_per_node=8, colocate=True,
                 gpus_per_node=8, port_base=30000)
    -> node 0: servers 0..3 on GPUs (0,1) (2,3) (4,5) (6,7), ports 30000..30003
       node 1: servers 4..7 on GPUs (0,1) (2,3) (4,5) (6,7), ports 30004..30007

Ports are unique across the job (``port_base + server index``), so simulated nodes sharing one
machine do not collide and one firewall range covers every node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

#: environment variable: the address of this node that rank 0 reaches its servers at (and the
#: servers bind); default: this node's address toward MASTER_ADDR (loopback on one node)
NODE_ADDR_ENV = "HAPO_NODE_ADDR"


@dataclass(frozen=True)
class NodeContext:
    """This rank's place in a torchrun job of ``num_nodes`` nodes x ``ranks_per_node`` ranks."""

    rank: int
    node: int
    local_rank: int
    num_nodes: int
    ranks_per_node: int

    @property
    def is_node_leader(self) -> bool:
        """The rank that starts (and weight-syncs) its node's servers."""
        return self.local_rank == 0

    def leader_ranks(self) -> list[int]:
        """Global rank of every node's leader (torchrun numbers ranks node by node)."""
        return [n * self.ranks_per_node for n in range(self.num_nodes)]

    @classmethod
    def from_env(cls, rank: int, world_size: int, env: Optional[Mapping[str, str]] = None) -> "NodeContext":
        """From torchrun's ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` / ``GROUP_RANK`` (one node when unset)."""
        env = os.environ if env is None else env
        per_node = int(env.get("LOCAL_WORLD_SIZE", world_size))
        if per_node < 1 or world_size % per_node:
            raise ValueError(f"world size {world_size} is not a multiple of LOCAL_WORLD_SIZE={per_node}: "
                             "every node must run the same number of ranks (torchrun --nproc-per-node)")
        local = int(env.get("LOCAL_RANK", rank % per_node))
        node = int(env.get("GROUP_RANK", rank // per_node))
        if rank != node * per_node + local:
            raise ValueError(f"rank {rank} is not node {node} x {per_node} + local rank {local}: the servers' "
                             "placement needs torchrun's node-by-node rank order")
        return cls(rank=rank, node=node, local_rank=local, num_nodes=world_size // per_node, ranks_per_node=per_node)


@dataclass(frozen=True)
class ServerSlot:
    """One planned server: global ``index`` (the URL order rank 0 routes over), its node, the
    node-local GPUs it uses (``--base-gpu-id`` is the first; nominal for CPU servers) and port."""

    index: int
    node: int
    gpu_ids: tuple[int, ...]
    port: int


def servers_per_node(*, num_servers: int, server_tp_size: int, num_nodes: int, ranks_per_node: int,
                     colocate: bool, gpus_per_node: Optional[int]) -> list[int]:
    """How many servers each node runs (see :func:`plan_servers`); ValueError naming the fields
    when they do not fit."""
    tp = int(server_tp_size)
    if tp < 1 or num_nodes < 1 or ranks_per_node < 1 or num_servers < 0:
        raise ValueError(f"bad placement input: server_tp_size={tp}, num_nodes={num_nodes}, "
                         f"ranks_per_node={ranks_per_node}, num_servers={num_servers}")
    if colocate:
        room, where = ranks_per_node, f"the {ranks_per_node} training GPUs of a node (colocated)"
    elif gpus_per_node is None:  # CPU servers: no device to run out of
        room, where = None, ""
    else:
        room = gpus_per_node - ranks_per_node
        where = (f"the {max(room, 0)} GPUs of a node left after its {ranks_per_node} training ranks "
                 f"({gpus_per_node} GPUs, rollout.sglang.colocate=false)")
    if room is not None and tp > room:
        raise ValueError(f"one SGLang server needs rollout.sglang.server_tp_size={tp} GPUs but has only {where}; "
                         "a server does not span nodes: lower server_tp_size (or use colocate=true)")
    fill = max(1, ranks_per_node // tp) if room is None else room // tp
    if num_servers == 0:  # fill every node
        return [fill] * num_nodes
    if room is not None and num_servers > fill * num_nodes:
        raise ValueError(
            f"rollout.sglang.num_servers={num_servers} x server_tp_size={tp} needs {num_servers * tp} GPUs, but "
            f"{num_nodes} node(s) hold {fill} server(s) each in {where}: set num_servers <= {fill * num_nodes}, "
            "or 0 for one server per server_tp_size GPUs on every node")
    base, extra = divmod(num_servers, num_nodes)
    return [base + (n < extra) for n in range(num_nodes)]


def plan_servers(*, num_servers: int, server_tp_size: int, num_nodes: int, ranks_per_node: int,
                 colocate: bool, gpus_per_node: Optional[int], port_base: int) -> list[ServerSlot]:
    """Every server of the job, node by node.

    Args:
        num_servers: servers in total, spread as evenly as possible over the nodes (the first
            nodes take one more when it does not divide); 0: fill every node.
        server_tp_size: GPUs per server, all on one node.
        num_nodes, ranks_per_node: the torchrun layout (``--nnodes``, ``--nproc-per-node``).
        colocate: servers share the training GPUs (``0 .. ranks_per_node - 1``); else they use the
            GPUs after them (``ranks_per_node .. gpus_per_node - 1``).
        gpus_per_node: the node's visible GPUs (None: CPU servers, no limit when not colocated).
        port_base: server ``i`` listens on ``port_base + i``.
    """
    counts = servers_per_node(num_servers=num_servers, server_tp_size=server_tp_size, num_nodes=num_nodes,
                              ranks_per_node=ranks_per_node, colocate=colocate, gpus_per_node=gpus_per_node)
    tp, first = int(server_tp_size), (0 if colocate else ranks_per_node)
    if port_base < 1 or port_base + sum(counts) - 1 > 65535:
        raise ValueError(f"rollout.sglang.port_base={port_base} leaves no room for {sum(counts)} server ports "
                         "below 65536")
    slots: list[ServerSlot] = []
    for node, count in enumerate(counts):
        for i in range(count):
            gpu = first + i * tp
            slots.append(ServerSlot(index=len(slots), node=node, gpu_ids=tuple(range(gpu, gpu + tp)),
                                    port=int(port_base) + len(slots)))
    return slots


def server_host(num_nodes: int, env: Optional[Mapping[str, str]] = None, *, node_ip=None) -> str:
    """The address this node's servers bind and advertise: ``$HAPO_NODE_ADDR`` when set; the
    loopback address on one node (nothing else needs to reach them); else the node's address on
    the interface toward ``MASTER_ADDR`` (where rank 0, their only client, runs). Never 0.0.0.0:
    the servers run code sent by any client that reaches them (the custom logit processor)."""
    env = os.environ if env is None else env
    if env.get(NODE_ADDR_ENV):
        return env[NODE_ADDR_ENV]
    if num_nodes == 1:
        return "127.0.0.1"
    if node_ip is None:
        from hapo_megatron.rollout.sglang.launch import node_ip
    return node_ip(env.get("MASTER_ADDR") or None)


__all__ = ["NodeContext", "ServerSlot", "servers_per_node", "plan_servers", "server_host", "NODE_ADDR_ENV"]
