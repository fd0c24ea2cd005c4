"""SGLang servers on every node of a torchrun job, routed together by rank 0 (how `hapo train`
launches its servers, on one node or many).

:func:`start_node_servers` is collective (every rank calls it):

1. the plan (:func:`placement.plan_servers`) from the torchrun layout: each node runs its share
   of the servers on its own GPUs;
2. each node's first rank (local rank 0) starts its node's servers, bound to the node's address
   (:func:`placement.server_host`: loopback on one node), and waits until they answer;
3. the URLs (or a node's start-up error, then raised on every rank) are all-gathered over the
   trainer's process group; rank 0 checks that it reaches every server and tells the others;
4. node leaders get a :class:`NodeServersEngine`, every other rank ``None``.

Rank 0's engine generates over every server (round-robin) and releases / resumes their memory
over HTTP. Weight sync:

- ``tensor`` (colocated): CUDA-IPC handles only open on their own node, so every node's leader
  sends its own copy of the weights (the export yields every tensor on every rank) to its node's
  servers, between two barriers of the leaders (after rank 0 resumed the servers' weights; before
  rank 0 generates again). Each bucket is serialised once per server TP rank (each rank's own
  CUDA-IPC reference, ``weight_sync.serialize_bucket_for_sglang``), all from the leader's GPU: the
  other local ranks hold no engine here, so a server's TP ranks on other GPUs map the bucket from
  the leader's GPU (peer access on the node; it lives until the server has answered);
- ``disk`` / ``distributed``: rank 0 updates every server, the other leaders only keep pace with
  the collective export (disk needs a directory every node sees: ``disk_sync_dir``).

A server that stops answering (``rollout/sglang/server_supervisor.py``): on one node, rank 0's engines
share one supervisor, which restarts it at once; it rejoins after a weight sync. On several
nodes, rank 0 only stops using it; in tensor mode its node's leader finds it failed at the next
sync and restarts it, and after each sync rank 0 learns which servers every node has in use.
"""

from __future__ import annotations

import atexit
import os
import time
from dataclasses import replace
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from hapo_megatron.parallel.collectives import all_gather_objects, broadcast_object, rank_and_world
from hapo_megatron.rollout.sglang import fp8_serving, placement
from hapo_megatron.rollout.sglang import launch as launcher
from hapo_megatron.rollout.engine import RowRequest, RowResult, Sample, SamplingParams, drain_weights
from hapo_megatron.rollout.sglang.client import SGLangError, SGLangHTTP, ServerHandle
from hapo_megatron.rollout.sglang.engine import SGLangEngine, agree_on_api_key, resolve_weight_sync

REACH_TIMEOUT_S = 60.0  # how long rank 0 tries to reach another node's healthy server


class NodeServersEngine:
    """The rollout engine of one node leader (see the module docstring): rank 0 generates and
    manages memory through ``cluster`` (every server); each leader syncs its own node's servers
    through ``node_sync`` (tensor mode) and stops them at shutdown."""

    def __init__(self, *, ctx: placement.NodeContext, slots: Sequence[placement.ServerSlot],
                 own: Sequence[ServerHandle], cluster: Optional[SGLangEngine], node_sync: Optional[SGLangEngine],
                 weight_sync: str, leaders_group: Any, dtype: Any) -> None:
        self.ctx, self.slots, self.own = ctx, list(slots), list(own)
        self.cluster, self.node_sync = cluster, node_sync
        self.weight_sync, self.leaders_group = weight_sync, leaders_group
        self.dtype = dtype if isinstance(dtype, torch.dtype) else None  # export dtype (stages.sync_weights)
        atexit.register(self.shutdown)

    @property
    def servers(self) -> list[ServerHandle]:
        """Every server (rank 0) or this node's own."""
        return self.cluster.servers if self.cluster is not None else self.own

    def _rank0(self, what: str) -> SGLangEngine:
        if self.cluster is None:
            raise RuntimeError(f"{what} runs on global rank 0 (this is rank {self.ctx.rank})")
        return self.cluster

    @property
    def stop_check(self) -> Optional[Callable[[], bool]]:
        """Rank 0: the generating engine's stop check (SGLangEngine.stop_check)."""
        return self.cluster.stop_check if self.cluster is not None else None

    @stop_check.setter
    def stop_check(self, check: Optional[Callable[[], bool]]) -> None:
        if self.cluster is not None:
            self.cluster.stop_check = check

    @property
    def send_sampling_seed(self) -> bool:
        """Rank 0: whether the generating engine sends per-row seeds; False elsewhere."""
        return self.cluster.send_sampling_seed if self.cluster is not None else False

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 on_samples: Optional[Callable[[list[Sample]], None]] = None) -> list[list[Sample]]:
        return self._rank0("generation").generate(prompt_ids, params, on_samples)

    def generate_group(self, rows: Sequence[RowRequest], params: SamplingParams) -> list[RowResult]:
        """Rank 0 (over-sampling): one group's call, on the next server of every node's."""
        return self._rank0("generation").generate_group(rows, params)

    def abort_requests(self) -> None:
        """Rank 0: every server aborts what it runs."""
        self._rank0("aborting requests").abort_requests()

    def spread_calls(self, enabled: bool = True) -> None:
        """Rank 0 (asynchronous rollouts): successive calls start on successive servers."""
        self._rank0("generation").spread_calls(enabled)

    def check_health(self) -> None:
        self._rank0("the health check").check_health()

    def fault_metrics(self) -> dict[str, float]:
        """Rank 0: restarts and retried requests so far (restarts made on other nodes not included)."""
        return self._rank0("fault metrics").fault_metrics()

    def release_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Rank 0: every server's memory (HTTP reaches every node); no-op on the other leaders."""
        if self.cluster is not None:
            self.cluster.release_memory(tags)

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        if self.cluster is not None:
            self.cluster.resume_memory(tags)

    def pause_generation(self, mode: str = "retract") -> None:
        """Rank 0 (asynchronous rollouts): pause every server for a weight update."""
        self._rank0("pausing generation").pause_generation(mode)

    def continue_generation(self) -> None:
        self._rank0("continuing generation").continue_generation()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                       weight_version: Optional[int] = None, flush_cache: bool = True) -> None:
        """Collective over the node leaders (every leader calls it with the same stream).
        ``weight_version`` and ``flush_cache``: as `SGLangEngine.update_weights` (asynchronous
        rollouts tag every update and keep the cache of requests paused in place)."""
        self._leaders_barrier()  # rank 0 has resumed every server's weights before any node sends
        named = iter(named_tensors)
        tags = dict(weight_version=weight_version, flush_cache=flush_cache)
        if self.cluster is not None and self.cluster.lora_adapter is not None:  # adapters: HTTP from rank 0
            self.cluster.update_weights(named, **tags)
        elif self.weight_sync == "tensor" and self.node_sync is not None and self.node_sync.lora_adapter is None:
            self.node_sync.update_weights(named, **tags)
        elif self.weight_sync != "tensor" and self.cluster is not None:
            self.cluster.update_weights(named, **tags)
        drain_weights(named)  # the export runs collectives: keep pace with the ranks that send
        self._leaders_barrier()  # every node's servers hold the new weights before rank 0 generates
        if self.weight_sync == "tensor" and self.leaders_group is not None and not self._adapters():
            self._gather_servers_in_use()

    def _adapters(self) -> bool:
        """Adapter mode (LoRA adapters sent over HTTP by rank 0), the same on every leader."""
        engine = self.cluster if self.cluster is not None else self.node_sync
        return engine is not None and engine.lora_adapter is not None

    def _gather_servers_in_use(self) -> None:
        """Rank 0 uses again the servers that their node restarted and synced (several nodes)."""
        mine = [] if self.node_sync is None else [self.own[i].url for i in self.node_sync.supervisor.in_use()]
        in_use = {u for urls in all_gather_objects(mine, group=self.leaders_group) for u in urls}
        if self.cluster is not None:
            sup = self.cluster.supervisor
            sup.rejoined([i for i, h in enumerate(self.cluster.servers) if h.url in in_use])

    def _leaders_barrier(self) -> None:
        if self.leaders_group is not None:
            torch.distributed.barrier(group=self.leaders_group)

    def shutdown(self) -> None:
        """Stop this node's servers; idempotent."""
        for eng in (self.cluster, self.node_sync):
            if eng is not None:
                eng.shutdown()
        for h in self.own:
            launcher.stop_process(h)



def sglang_cluster(engine: Any) -> SGLangEngine:
    """The `SGLangEngine` over every server of trainer rank 0's ``engine``: the engine itself, or
    a `NodeServersEngine`'s cluster (launched servers: their API key and supervisor are there).
    A rollout manager process talks to these servers (training/asynchronous/manager.py)."""
    if isinstance(engine, NodeServersEngine):
        return engine._rank0("the rollout manager")
    if isinstance(engine, SGLangEngine):
        return engine
    raise TypeError(f"the rollout manager needs an SGLang engine (rollout.engine=sglang), got {type(engine).__name__}")

def _launch_own(slots, *, ctx, host: str, model_path: str, cfg, dtype, device: str, log_dir: str,
                timeout_s: float, http: SGLangHTTP, api_key: Optional[str], quantization: str,
                kv_cache_dtype: str) -> tuple[list[ServerHandle], Optional[str]]:
    """Start this node's servers and wait for them; ``(handles, error or None)`` (all stopped on error).
    FP8 servers start from this node's own block-FP8 copy of ``model_path`` (docs/fp8.md)."""
    handles: list[ServerHandle] = []
    try:
        model_path = fp8_serving.serving_model_path(model_path, quantization, os.path.join(log_dir, f"node{ctx.node}"),
                                                    tp_size=cfg.server_tp_size)
        for slot in slots:
            handles.append(launcher.launch_server(
                model_path, port=slot.port, host=host, tp_size=cfg.server_tp_size, base_gpu_id=slot.gpu_ids[0],
                mem_fraction_static=cfg.mem_fraction_static, dtype=dtype, colocate=cfg.colocate,
                extra_args=list(cfg.extra_server_args), device=device,
                log_path=os.path.join(log_dir, f"sglang_server_{slot.index}.log"), api_key=api_key,
                quantization=quantization, kv_cache_dtype=kv_cache_dtype))
        for h in handles:
            http.wait_healthy(h, timeout_s)
    except Exception as e:  # noqa: BLE001 - reported to every rank, which all stop
        for h in handles:
            launcher.stop_process(h)
        return [], f"node {ctx.node}: {type(e).__name__}: {e}"
    return handles, None


def _unreachable(handles: Sequence[ServerHandle], http: SGLangHTTP, timeout_s: float) -> list[str]:
    """URLs among ``handles`` that do not answer ``/health`` within ``timeout_s``."""
    deadline, left = time.monotonic() + timeout_s, list(handles)
    while left:
        left = [h for h in left if not http.healthy(h, timeout_s=5.0)]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    return [h.url for h in left]


def start_node_servers(cfg: Any, *, model_path: str, tokenizer: Any = None, dtype: Any = torch.bfloat16,
                       device: str = "auto", log_dir: Optional[str] = None, disk_sync_dir: Optional[str] = None,
                       launch_timeout_s: float = 900.0, api_key: Optional[str] = None,
                       key_file: Optional[str] = None, quantization: str, kv_cache_dtype: str,
                       **engine_kwargs: Any) -> Optional[NodeServersEngine]:
    """Place ``cfg``'s servers (an ``SGLangConfig``) on every node and connect them; collective.

    Returns the engine on node leaders (rank 0's generates), ``None`` on the other ranks. Raises
    ValueError when the plan does not fit, SGLangError (on every rank) when a node's servers do
    not start or rank 0 cannot reach them. The servers require one API key (``rollout/sglang/api_key.py``:
    ``api_key``, else ``$HAPO_ROLLOUT_API_KEY``, else ``key_file``'s, else a new one written to
    ``key_file``), which every request carries. ``quantization`` / ``kv_cache_dtype``: the
    servers' (``rollout.quantization`` / ``rollout.kv_cache_dtype``, docs/fp8.md); the engines
    quantise every sync for FP8 servers. ``engine_kwargs`` go to the ``SGLangEngine`` objects.
    """
    rank, world = rank_and_world()
    ctx = placement.NodeContext.from_env(rank, world)
    device = launcher.resolve_device(device)
    fp8_serving.check_choices(quantization, kv_cache_dtype)
    fp8_serving.check_launch(quantization, device=device, dtype=dtype)
    slots = placement.plan_servers(
        num_servers=cfg.num_servers, server_tp_size=cfg.server_tp_size, num_nodes=ctx.num_nodes,
        ranks_per_node=ctx.ranks_per_node, colocate=cfg.colocate, port_base=cfg.port_base,
        gpus_per_node=torch.cuda.device_count() if device == "cuda" and torch.cuda.is_available() else None)
    mode = resolve_weight_sync(cfg.weight_sync, colocate=cfg.colocate)
    if mode == "disk" and ctx.num_nodes > 1 and not (disk_sync_dir or os.environ.get("HAPO_SGLANG_SYNC_DIR")):
        raise ValueError("weight_sync='disk' on several nodes needs a directory every node sees: "
                         "set HAPO_SGLANG_SYNC_DIR (the trainer uses <trainer.run_dir>/sglang_weights)")
    leaders_group = torch.distributed.new_group(ctx.leader_ranks()) if ctx.num_nodes > 1 else None
    key = agree_on_api_key(api_key, key_file, create=True, rank=rank, world_size=world)
    http = SGLangHTTP(timeout_s=30, max_retries=0, api_key=key)
    mine = [s for s in slots if s.node == ctx.node]
    own: list[ServerHandle] = []
    error = None
    if ctx.is_node_leader and mine:
        log_dir = log_dir or os.path.join(os.getcwd(), "sglang_logs")
        os.makedirs(log_dir, exist_ok=True)
        own, error = _launch_own(mine, ctx=ctx, host=placement.server_host(ctx.num_nodes), model_path=model_path,
                                 cfg=cfg, dtype=dtype, device=device, log_dir=log_dir, timeout_s=launch_timeout_s,
                                 http=http, api_key=key, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    reports = [r for r in all_gather_objects({"urls": [h.url for h in own], "error": error}) if r]
    errors = [r["error"] for r in reports if r["error"]]
    urls = [u for r in reports for u in r["urls"]]  # node by node: the plan's order
    if not errors and len(urls) != len(slots):
        errors = [f"{len(urls)} servers started for a plan of {len(slots)}"]
    local = {h.url: h for h in own}
    handles = [local.get(u) or ServerHandle(url=u, tp_size=cfg.server_tp_size) for u in urls]
    if rank == 0 and not errors:
        far = _unreachable([h for h in handles if h.url not in local], http, REACH_TIMEOUT_S)
        if far:
            errors = [f"rank 0 cannot reach {far}: each node's servers bind the address in "
                      f"${placement.NODE_ADDR_ENV} or the node's address toward MASTER_ADDR; set "
                      f"{placement.NODE_ADDR_ENV} on every node to an address node 0 reaches (docs/multinode.md)"]
    errors = broadcast_object(errors)
    if errors:
        for h in own:
            launcher.stop_process(h)
        raise SGLangError("SGLang servers did not start on every node: " + "; ".join(errors))
    if not ctx.is_node_leader:
        return None
    common = dict(model_path=model_path, tokenizer=tokenizer, dtype=dtype, launch=False, wait_for_servers=False,
                  launch_timeout_s=launch_timeout_s, device=device, api_key=key, quantization=quantization,
                  kv_cache_dtype=kv_cache_dtype, **engine_kwargs)
    cluster = node_sync = None
    if rank == 0:
        cluster = SGLangEngine(cfg, servers=handles, log_dir=log_dir, disk_sync_dir=disk_sync_dir, **common)
        if ctx.num_nodes > 1:  # each node's leader restarts its own servers (in its sync), never rank 0
            cluster.supervisor.restart = None
    if mode == "tensor" and own:  # one node: the same handles, one supervisor for both engines
        shared = cluster.supervisor if cluster is not None and ctx.num_nodes == 1 else None
        # the node's own servers, by CUDA IPC (mode "tensor": colocated, so the section allows it)
        node_sync = SGLangEngine(replace(cfg, weight_sync="tensor"), servers=own, supervisor=shared, **common)
    return NodeServersEngine(ctx=ctx, slots=slots, own=own, cluster=cluster, node_sync=node_sync, weight_sync=mode,
                             leaders_group=leaders_group, dtype=dtype)


__all__ = ["NodeServersEngine", "sglang_cluster", "start_node_servers", "REACH_TIMEOUT_S"]
