"""A :class:`~hapo_megatron.rollout.engine.RolloutEngine` on SGLang servers (production rollouts).

Servers: launched (``python -m sglang.launch_server ... --enable-custom-logit-processor``, one
per rollout GPU group of ``server_tp_size`` GPUs) or attached by URL. Requests are spread
round-robin over the servers.

Two ways to use it from a torchrun job:

- ``collective=False`` (default): only this process builds and calls the engine. Servers it
  launches start on its own node (GPUs ``s * tp ...``, after the trainer's GPUs when not
  colocated). The trainer does not launch through here: ``node_servers.start_node_servers``
  starts each node's servers on that node and hands rank 0 an engine over all of them (attached
  as handles); servers started beforehand (``python -m hapo_megatron.rollout.sglang.serve``) are
  attached by URL. Weight sync of a single engine: ``tensor`` (CUDA IPC) reaches
  only servers on rank 0's node; ``distributed`` (NCCL) needs servers on GPUs other than rank 0's;
  ``disk`` works everywhere the servers see the directory (``disk_sync_dir`` or the environment
  variable ``HAPO_SGLANG_SYNC_DIR``, e.g. on a shared file system).
- ``collective=True``: every rank builds the engine and calls every public method with the same
  arguments. Trainer rank ``r`` shares its GPU with TP rank ``r % tp`` of server ``r // tp`` (the
  first rank of each group launches it on its own node); rank 0 generates and broadcasts the
  samples; each rank sends CUDA-IPC handles of ITS copy of every bucket for its own server, so
  tensor sync scales to many nodes. ``update_weights`` must get the same HF-named tensors in the
  same order on every rank.

Weight sync (``weight_sync``):
- ``"tensor"`` (colocated): every rank serialises its copy of each bucket as CUDA-IPC handles (CPU
  tensors: pickled by value, see ``weight_sync.serialize_bucket_for_sglang``), the server's first
  rank gathers the ``tp`` strings and POSTs ``/update_weights_from_tensor``.
- ``"distributed"`` (separate GPUs): rank 0 forms a group with all server TP ranks
  (``/init_weights_update_group``; NCCL, or gloo with CPU buffers for CPU servers; its store hosted
  by rank 0 itself, ``sync_group.py``) and broadcasts each flattened bucket while POSTing
  ``/update_weights_from_distributed``.
- ``"disk"`` (fallback): rank 0 writes a safetensors checkpoint and POSTs
  ``/update_weights_from_disk`` (the servers must see the directory).
- ``"auto"``: tensor when colocated, distributed otherwise.

FP8 servers (``quantization="fp8"``, docs/fp8.md): launched ones start from a block-FP8 copy of
``model_path`` (``fp8_serving.serving_model_path``) with ``--quantization fp8``; at every sync the
attention / MLP / expert weights are quantised on the fly (``fp8_weights.quantize_named_tensors``:
each weight becomes the pair ``weight`` float8_e4m3fn + ``weight_scale_inv`` float32, the names of
an FP8 checkpoint, which SGLang's loader places into its FP8 parameters), in every mode; tensor and
NCCL buckets hold one dtype each (``fp8_weights.bucket_by_dtype``), a disk checkpoint gets the
``quantization_config`` in its config.json.

Tensor and distributed updates run inside a weight-update session (``POST /begin_weight_update``
... ``POST /end_weight_update``) on servers that have those endpoints (SGLang >= 0.5.23 requires
it and answers 400 otherwise); a server answering 404 to ``/begin_weight_update`` (older SGLang)
is remembered and updated without a session.

CPU servers (``device="cpu"``, or ``"auto"`` without a CUDA device): launched with SGLang's CPU
engine flags and the import-only stand-ins (``sglang_launch.server_command`` / ``server_env``);
``release_memory`` / ``resume_memory`` are no-ops (nothing to free, no memory saver on CPU).

Per-token temperatures: SGLang's custom logit processor runs inside the server and cannot return
data, and the temperature cannot be recovered from the returned log-probs. So ``Sample.temperatures``
is EMPTY with this engine; the trainer recomputes them from the old-policy entropy and the
statistics it sent (``T = T_base * (1 + tau * h_hat(H_old))``), exact up to the engine/trainer
numerical mismatch. ``rollout_logprobs`` are SGLang's: after the (adaptive) temperature, before
top-k/top-p renormalisation.
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import tempfile
import warnings
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from hapo_megatron.config.base import WEIGHT_SYNC_MODES
from hapo_megatron.config.sections import SGLangConfig
from hapo_megatron.parallel.collectives import all_gather_objects, broadcast_object, rank_and_world
from hapo_megatron.rollout.sglang import fp8_serving
from hapo_megatron.rollout import fp8_weights
from hapo_megatron.rollout.sglang import launch as launcher
from hapo_megatron.rollout.sglang.api_key import resolve_api_key
from hapo_megatron.rollout.engine import (GenerationAborted, RowRequest, RowResult, Sample, SamplingParams,
                                          check_prompt_ids, drain_weights)
from hapo_megatron.rollout.sglang.requests import (answer_samples, generate_payload, group_payload,
                                                   parse_generate_item, parse_row, row_sampling_params, row_seeds)
from hapo_megatron.rollout.sglang.server_supervisor import ServerPoolError, ServerSupervisor, first_line
from hapo_megatron.rollout.sglang.client import (EndpointNotFoundError, RequestRefusedError, SGLangError,
                                                 SGLangHTTP, ServerHandle)
from hapo_megatron.rollout.sglang import sync_group, weight_sync as ws

def resolve_weight_sync(mode: str, *, colocate: bool) -> str:
    """``"auto"`` -> ``"tensor"`` when colocated, else ``"distributed"``."""
    if mode not in WEIGHT_SYNC_MODES:
        raise ValueError(f"weight_sync must be one of {WEIGHT_SYNC_MODES}, got {mode!r}")
    if mode == "auto":
        return "tensor" if colocate else "distributed"
    if mode == "tensor" and not colocate:
        raise ValueError("weight_sync='tensor' (CUDA IPC) needs colocate=True")
    return mode


# --------------------------------------------------------------------------- the engine
def agree_on_api_key(api_key: Optional[str], key_file: Optional[str], *, create: bool, rank: int,
                     world_size: int) -> Optional[str]:
    """The servers' API key on every rank: rank 0 resolves it (``api_key``, else
    ``resolve_api_key(key_file, create)``) and, with ``world_size > 1``, broadcasts it over the
    job's own process group (other nodes need not see rank 0's key file). A failure is raised on
    every rank."""
    found: Any = None
    if rank == 0:
        try:
            found = (api_key or resolve_api_key(key_file, create=create), None)
        except (OSError, ValueError) as e:
            found = (None, f"rollout API key: {type(e).__name__}: {e}")
    if world_size > 1:
        found = broadcast_object(found)
    key, error = found
    if error:
        raise ValueError(error)
    return key


REQUESTS_PER_CALL = 64  # rows per /generate call
STOP_POLL_S = 0.5  # a generate() waiting on the servers asks its stop_check this often
CALLS_PER_SERVER = 8  # concurrent /generate calls per server


def generate_call_plan(num_rows: int, num_servers: int,
                       requests_per_call: int = REQUESTS_PER_CALL) -> tuple[int, int]:
    """``(calls, concurrent workers)`` of one :meth:`SGLangEngine.generate` over ``num_rows``
    rows: the calls run in ``ceil(calls / workers)`` waves, each as long as its slowest call."""
    calls = -(-int(num_rows) // int(requests_per_call))
    return calls, max(1, min(calls, CALLS_PER_SERVER * max(1, int(num_servers))))


class SGLangEngine:
    """Rollouts on SGLang servers; see the module docstring.

    Args:
        cfg: the ``rollout.sglang`` section (``SGLangConfig``): servers to attach to or launch, their
            TP size and memory, weight sync, timeouts, retries and restarts.
        model_path: HF model directory the servers load (and the config source for disk sync).
        servers: handles of servers started elsewhere (node_servers), in place of ``cfg.server_urls``.
        dtype: the servers' ``--dtype``.
        launch_timeout_s: how long a launched server may take to become healthy.
        requests_per_call: rows per ``/generate`` call; calls run concurrently.
        send_sampling_seed: pass per-row ``sampling_seed`` (needs a sampling backend that supports
            it, e.g. ``--sampling-backend pytorch``; SGLang 0.5.23 uses it only on servers started
            with ``--enable-deterministic-inference``, ``sampling_batch_info.py``, and ignores it
            otherwise).
        disk_sync_dir: directory for ``weight_sync="disk"`` (default: ``$HAPO_SGLANG_SYNC_DIR``, else a
            temporary directory on rank 0's node).
        log_dir: where launched servers write ``sglang_server_<i>.log``.
        collective: see the module docstring.
        wait_for_servers: attached servers: wait (up to ``launch_timeout_s``) until they are healthy.
        session: injectable HTTP transport (tests); ``launch=False`` never starts processes.
        device: where launched servers run: ``"cuda"``, ``"cpu"`` or ``"auto"`` (CUDA when visible).
        api_key, key_file: the servers' API key (``rollout/sglang/api_key.py``): ``api_key``, else
            ``$HAPO_ROLLOUT_API_KEY``, else the one in ``key_file`` (the trainer's:
            ``<run_dir>/rollout_api_key``); launching without one makes a new key (written to
            ``key_file`` when given). Every request carries it; launched servers require it.
        supervisor: the servers' :class:`ServerSupervisor`, shared by engines over the same
            handles (node_servers: rank 0's generating engine and its node's syncing one).
        quantization: ``"none"`` or ``"fp8"`` (module docstring; ``rollout.quantization``).
        kv_cache_dtype: launched servers' ``--kv-cache-dtype`` (``rollout.kv_cache_dtype``).
        lora_adapter: LoRA adapter mode (``rollout.sglang.lora_sync: adapter``, docs/lora.md): the
            peft ``adapter_config.json`` of the policy's adapters. `update_weights` then takes the
            adapters' peft-named A and B (not full weights) and loads them into every server with
            ``/load_lora_adapter_from_tensors`` under a new name per sync, unloading the previous
            one; every ``/generate`` names the current adapter (``lora_path``). The servers must run
            with ``--enable-lora`` (`lora_server_args`). None: full (or merged) weights.

    A server that stops answering is taken out of use, restarted when this process launched it,
    and used again after a weight sync (``rollout/sglang/server_supervisor.py``); its requests go to
    the others. One process only: with ``collective=True`` a failure raises as before.
    """

    def __init__(self, cfg: SGLangConfig, *, model_path: Optional[str] = None,
                 servers: Optional[Sequence[ServerHandle]] = None, tokenizer: Any = None,
                 dtype: Any = torch.bfloat16, launch_timeout_s: float = 900.0,
                 requests_per_call: int = REQUESTS_PER_CALL,
                 send_sampling_seed: bool = False, disk_sync_dir: Optional[str] = None,
                 log_dir: Optional[str] = None, collective: bool = False, wait_for_servers: bool = True,
                 session: Any = None, launch: bool = True, group_name: str = "hapo_weight_sync",
                 device: str = "auto", api_key: Optional[str] = None, key_file: Optional[str] = None,
                 supervisor: Optional[ServerSupervisor] = None,
                 quantization: str, kv_cache_dtype: str, lora_adapter: Optional[dict] = None) -> None:
        fp8_serving.check_choices(quantization, kv_cache_dtype)
        self.lora_adapter = None if lora_adapter is None else dict(lora_adapter)
        self._lora_name: Optional[str] = None  # the adapter the servers hold now (adapter mode)
        self._lora_syncs = itertools.count(1)
        self.quantization, self.kv_cache_dtype = quantization, kv_cache_dtype
        if int(requests_per_call) < 1:
            raise ValueError(f"requests_per_call must be >= 1, got {requests_per_call}")
        self.model_path, self.tokenizer, self.colocate = model_path, tokenizer, bool(cfg.colocate)
        self.weight_sync = resolve_weight_sync(cfg.weight_sync, colocate=self.colocate)
        self.bucket_bytes = int(cfg.bucket_size_mb) << 20
        self.tp = int(cfg.server_tp_size)
        self.requests_per_call = int(requests_per_call)
        self.send_sampling_seed = bool(send_sampling_seed)
        self.disk_sync_dir = disk_sync_dir or os.environ.get("HAPO_SGLANG_SYNC_DIR") or None
        self.group_name = group_name
        self.device = launcher.resolve_device(device)
        self._has_update_session: dict[str, bool] = {}  # server url -> has /begin_weight_update
        self.dtype = dtype if isinstance(dtype, torch.dtype) else None  # export dtype for the trainer
        self.collective = bool(collective)
        self.rank, self.world_size = rank_and_world() if self.collective else (0, 1)
        server_urls = list(cfg.server_urls) if servers is None else list(servers)
        self._api_key = agree_on_api_key(api_key, key_file, create=launch and not server_urls,
                                         rank=self.rank, world_size=self.world_size)
        self.http = SGLangHTTP(timeout_s=cfg.request_timeout_s, max_retries=cfg.max_retries, session=session,
                               api_key=self._api_key)
        self._nccl_group = None
        self._sync_store = None  # the weight-update group's store (hosted by rank 0, sync_group.host_store)
        self._sync_device = sync_group.sync_buffer_device(self.device)  # where broadcast buckets live
        self._server_groups: Optional[dict] = None
        if server_urls:
            self.servers = [u if isinstance(u, ServerHandle) else ServerHandle(url=u.rstrip("/"), tp_size=self.tp)
                            for u in server_urls]  # handles: servers started elsewhere (node_servers)
            if wait_for_servers and self.rank == 0:
                for srv in self.servers:
                    self.http.wait_healthy(srv, float(launch_timeout_s))
        elif not launch:
            raise ValueError("server_urls is empty and launch=False: nothing to talk to")
        else:
            if not model_path:
                raise ValueError("model_path is required to launch SGLang servers")
            self.servers = self._launch_servers(int(cfg.num_servers), cfg.mem_fraction_static, dtype,
                                                list(cfg.extra_server_args), int(cfg.port_base),
                                                float(launch_timeout_s), log_dir)
        self.supervisor = supervisor if supervisor is not None else ServerSupervisor(
            self.servers, http=self.http, max_restarts=cfg.max_restarts)
        # set by the trainer during a rollout: polled while generate() waits, True aborts the round
        # (training/stages.py; docs/troubleshooting.md, "Preemption")
        self.stop_check: Optional[Callable[[], bool]] = None
        self._aborted = threading.Event()
        self._failed_in_sync: set[int] = set()  # servers of the current weight sync that failed it
        self._joining: list[int] = []  # servers the current weight sync brings back into use
        self._weight_version: Optional[str] = None  # the tag of the update in progress (update_weights)
        self._unflushed_updates = 0  # updates that kept the servers' KV cache (update_weights)
        self._flush_cache = True  # whether the update in progress flushes the servers' KV cache
        # asynchronous rollouts send one small generate call per prompt group, from many threads:
        # spread, successive calls start on successive servers (else each call's chunks are spread
        # from server 0, as the synchronous loop always did): `spread_calls`
        self._spread = False
        self._call_keys = itertools.count()
        atexit.register(self.shutdown)  # launched servers run in their own sessions: never leave them behind
        if self.weight_sync == "tensor" and self.world_size > 1 and self.world_size != len(self.servers) * self.tp:
            raise ValueError(f"weight_sync='tensor' needs one trainer rank per server GPU: world size "
                             f"{self.world_size} != {len(self.servers)} servers x tp {self.tp}")

    @property
    def api_key(self) -> Optional[str]:
        """The key every request sends (a rollout manager's engine over these servers needs it)."""
        return self._api_key

    # ------------------------------------------------------------------ servers
    def _launch_servers(self, num_servers, mem_fraction, dtype, extra, port_base, timeout_s, log_dir):
        """Leader ranks launch their server; URLs are all-gathered so every rank knows all."""
        log_dir = log_dir or tempfile.mkdtemp(prefix="hapo_sglang_logs_")
        os.makedirs(log_dir, exist_ok=True)
        fp8_serving.check_launch(self.quantization, device=self.device, dtype=dtype)
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        multi_node = self.world_size > int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        # bind no wider than the job needs: loopback on one node, the node's address across nodes
        host = launcher.node_ip() if multi_node else "127.0.0.1"
        mine: list[tuple[int, ServerHandle]] = []
        if num_servers == 0:  # one per server_tp_size GPUs of this node (the trainer: node_servers)
            gpus = torch.cuda.device_count() if self.device == "cuda" and torch.cuda.is_available() else 0
            first = 0 if self.colocate else int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            num_servers = max(1, (gpus - first) // self.tp) if gpus else 1
        for s in range(num_servers):
            if self.colocate and self.world_size > 1:
                if self.rank != s * self.tp:
                    continue
                gpu = local_rank
            elif self.rank == 0:  # separate GPUs after the trainer's, or single process
                gpu = (0 if self.colocate else int(os.environ.get("LOCAL_WORLD_SIZE", 1))) + s * self.tp
            else:
                continue
            if torch.cuda.is_available() and gpu + self.tp > torch.cuda.device_count():
                raise ValueError(f"server {s} would need GPUs {gpu}..{gpu + self.tp - 1} but this node has "
                                 f"{torch.cuda.device_count()}: fewer num_servers, or start servers on the "
                                 "other nodes with `python -m hapo_megatron.rollout.sglang.serve` and attach by URL")
            if not mine:  # this rank's copy (ranks of one node may launch at once)
                serve_path = fp8_serving.serving_model_path(self.model_path, self.quantization,
                                                            os.path.join(log_dir, f"rank{self.rank}"), tp_size=self.tp)
            mine.append((s, launcher.launch_server(
                serve_path, port=port_base + s, host=host, tp_size=self.tp, base_gpu_id=gpu,
                mem_fraction_static=mem_fraction, dtype=dtype, colocate=self.colocate, extra_args=extra,
                device=self.device, log_path=os.path.join(log_dir, f"sglang_server_{s}.log"),
                api_key=self._api_key, quantization=self.quantization, kv_cache_dtype=self.kv_cache_dtype)))
        try:
            for _, h in mine:
                self.http.wait_healthy(h, timeout_s)
        except BaseException:  # no engine object will exist to shut them down later
            for _, h in mine:
                launcher.stop_process(h)
            raise
        urls = {s: h.url for s, h in mine}
        if self.world_size > 1:
            urls = {k: v for d in all_gather_objects(urls) for k, v in d.items()}
        local = dict(mine)
        return [local.get(s, ServerHandle(url=urls[s], tp_size=self.tp)) for s in range(num_servers)]

    def check_health(self) -> None:
        """Raise :class:`~hapo_megatron.rollout.sglang.client.ServerDiedError` naming a dead server in use."""
        for i in self.supervisor.in_use():
            self.http.check_alive(self.servers[i])

    def fault_metrics(self) -> dict[str, float]:
        """``rollout/server_restarts`` and ``rollout/requests_retried`` of the run so far."""
        return self.supervisor.metrics()

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 on_samples: Optional[Callable[[list[Sample]], None]] = None) -> list[list[Sample]]:
        """``params.n`` samples per prompt, prompt order (collective under torch.distributed);
        rank 0 hands ``on_samples`` each ``/generate`` call's samples as the call returns."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        out = self._generate_local(check_prompt_ids(prompt_ids), params, on_samples) if self.rank == 0 else None
        if self.world_size > 1:
            out = broadcast_object(out)
        return out

    def _generate_local(self, prompts: list[list[int]], params: SamplingParams,
                        on_samples: Optional[Callable[[list[Sample]], None]] = None) -> list[list[Sample]]:
        rows = [(p, k) for p in range(len(prompts)) for k in range(params.n)]
        chunks = [list(range(i, min(i + self.requests_per_call, len(rows))))
                  for i in range(0, len(rows), self.requests_per_call)]
        seeds = row_seeds(params, range(len(rows))) if self.send_sampling_seed else [None] * len(rows)
        base = next(self._call_keys) if self._spread else 0

        def run(ci: int) -> list:
            if self._aborted.is_set():
                return []  # the round was given up: send nothing more
            idx = chunks[ci]
            body = self._with_adapter(generate_payload([prompts[rows[i][0]] for i in idx], params,
                                                       seeds=[seeds[i] for i in idx]))
            # a server that fails hands the same body (same sampling seeds) to another
            answer = self.supervisor.request(base + ci, "/generate", body, rows=len(idx))
            done = answer_samples(answer, prompts, [rows[i] for i in idx], return_routes=params.return_routes)
            if on_samples is not None:
                on_samples(done)
            return done

        # as many calls at once as the servers in use take: the survivors of a failure get no more
        _, workers = generate_call_plan(len(rows), len(self.supervisor.in_use()), self.requests_per_call)
        self._aborted.clear()
        pool = ThreadPoolExecutor(max_workers=workers)
        futures = [pool.submit(run, ci) for ci in range(len(chunks))]
        aborted = False
        try:
            aborted = self._wait_or_abort(futures)
            if aborted:
                raise GenerationAborted(f"generation stopped by a stop request: {len(rows)} rows' requests aborted")
            results = [smp for f in futures for smp in f.result()]  # the first failure, in call order
        finally:  # aborted: the calls in flight end with the servers' abort, nothing waits for them
            pool.shutdown(wait=not aborted, cancel_futures=aborted)
        out: list[list[Sample]] = [[] for _ in prompts]
        for smp in results:  # rows are prompt-major, so each prompt's samples stay in order
            out[smp.prompt_index].append(smp)
        return out

    def generate_group(self, rows: Sequence[RowRequest], params: SamplingParams) -> list[RowResult]:
        """One ``/generate`` call with every row of a group (`RolloutEngine.generate_group`);
        successive calls start on successive servers in use, and a server that fails hands the
        same body to another (rollout/sglang/server_supervisor.py). Rank 0's call, never collective."""
        if self.world_size > 1:
            raise RuntimeError("generate_group is a call of one process (over-sampling runs on rank 0): "
                               "this engine is collective")
        answer = self.supervisor.request(next(self._call_keys), "/generate",
                                         self._with_adapter(group_payload(rows, params)), rows=len(rows))
        if not isinstance(answer, list) or len(answer) != len(rows):
            raise SGLangError(f"/generate returned {type(answer).__name__} for {len(rows)} rows")
        return [parse_row(item) for item in answer]

    def _with_adapter(self, body: dict) -> dict:
        """A ``/generate`` body naming the policy's current adapter (adapter mode; SGLang applies
        one name to every row, ``io_struct.GenerateReqInput._normalize_lora_paths``)."""
        if self._lora_name is None:
            return body
        return {**body, "lora_path": self._lora_name}

    def spread_calls(self, enabled: bool = True) -> None:
        """Successive `generate` calls start on successive servers (`RolloutEngine.spread_calls`)."""
        self._spread = bool(enabled)

    def _wait_or_abort(self, futures) -> bool:
        """Until every call is done or one failed (False), or ``stop_check`` asks to stop (True:
        the servers were told to abort every request in flight)."""
        pending = set(futures)
        while pending:
            if self.stop_check is not None and self.stop_check():
                self._aborted.set()
                self.abort_requests()
                return True
            done, pending = wait(pending, timeout=STOP_POLL_S if self.stop_check is not None else None,
                                 return_when=FIRST_EXCEPTION)
            if any(not f.cancelled() and f.exception() is not None for f in done):
                return False
        return False

    def abort_requests(self) -> None:
        """``POST /abort_request {"abort_all": true}`` to every server in use (SGLang's endpoint;
        best effort: a server that does not answer is about to be shut down anyway)."""
        for i in self.supervisor.in_use():
            try:
                self.http.request(self.servers[i], "/abort_request", {"abort_all": True}, retries=0, timeout_s=10.0)
            except Exception as e:  # noqa: BLE001 - reported, the stop goes on
                warnings.warn(f"SGLang server {self.servers[i].url}: abort_request failed ({first_line(e)})")

    # ------------------------------------------------------------------ weights
    def pause_generation(self, mode: str = "retract") -> None:
        """``POST /pause_generation`` on every server in use (SGLang 0.5.23: ``retract`` sends
        running requests back to the queue, ``in_place`` keeps them with their KV cache, ``abort``
        ends them); then a weight update may run while requests wait (asynchronous rollouts)."""
        from hapo_megatron.config.base import PAUSE_MODES
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._post_to_in_use("/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        """``POST /continue_generation`` on every server in use (after `pause_generation`)."""
        self._post_to_in_use("/continue_generation", {})

    def _post_to_in_use(self, path: str, body: dict) -> None:
        """``path`` on every server in use; one that has failed is taken out of use (restarted)
        and skipped, as in a weight sync: it rejoins at a later sync, unpaused and up to date."""
        for s in self.supervisor.in_use():
            try:
                self.http.request(self.servers[s], path, body, retries=0)
            except RequestRefusedError:
                raise
            except SGLangError as e:
                if not self.supervisor.is_failure_of_server(s, e):
                    raise
                self.supervisor.mark_unhealthy(s, first_line(e))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                       weight_version: Optional[int] = None, flush_cache: bool = True) -> None:
        """Stream HF-named tensors to every server in buckets of ``bucket_size_mb`` (collective).
        Every rank reads ``named_tensors`` to the end, also when the update fails.
        ``weight_version``: tag every update request with it (SGLang then reports, per request,
        which tokens each version generated: `Sample.weight_versions`). ``flush_cache=False``:
        keep the servers' KV cache (SGLang refuses to flush it, failing the update, while requests
        paused ``in_place`` are running). Then every ``/generate`` sent from now on goes to a radix
        cache namespace of its own (SGLang's ``cache_salt``): no new request reuses prefix KV that
        the old weights computed (docs/architecture.md, "Asynchronous rollouts")."""
        if self.lora_adapter is not None:
            return self._sync_lora_adapter(named_tensors)
        self._weight_version = None if weight_version is None else str(int(weight_version))
        self._flush_cache = bool(flush_cache)
        if not self._flush_cache:  # before the sync: requests queued during the pause use the new one
            self._unflushed_updates += 1
            self.supervisor.cache_salt = f"hapo-weights-{self._weight_version or 'u%d' % self._unflushed_updates}"
        sync = {"tensor": self._sync_tensor, "distributed": self._sync_distributed, "disk": self._sync_disk}
        named = iter(named_tensors)
        stream = fp8_weights.quantize_named_tensors(named) if self.quantization == "fp8" else named
        joining: list[int] = []
        self._failed_in_sync, self._joining = set(), joining
        try:
            if self.world_size == 1:  # restarted (or returned) servers that answer take this sync
                targets = self._one_process_targets(joining)
            else:
                targets = list(range(len(self.servers)))
            sync[self.weight_sync](stream, targets)
        finally:
            drain_weights(named)  # ranks without a part in this mode, and any rank after an error
        self._barrier()
        # only now: a server that failed during the sync is out of use (and restarting), one
        # that joined is used once it holds the whole new policy, never with stale weights
        self.supervisor.rejoined([i for i in joining if i not in self._failed_in_sync])

    def _one_process_targets(self, joining: list[int]) -> list[int]:
        """The servers a sync from one process reaches: those in use and the restarted (or
        returned) ones that answer, which it puts in ``joining``. None left is an error: nothing
        would hold the new weights, never a silent no-op."""
        joining[:] = self.supervisor.rejoin_candidates()
        targets = sorted(set(self.supervisor.in_use()) | set(joining))
        if not targets:
            raise ServerPoolError(f"weight sync: no SGLang server left in use ({self.supervisor.summary()})")
        return targets

    def _sync_lora_adapter(self, named_tensors: Iterable) -> None:
        """Adapter mode (``lora_adapter``): the stream's A and B (peft names) to every server in use
        as a new adapter, then the previous one unloaded; rank 0 sends, every rank reads the
        stream to the end. The tensors travel by value (host memory, megabytes): the same body
        for every server on any node."""
        from hapo_megatron.rollout.sglang.weight_sync import lora_adapter_name, lora_adapter_payload
        named = iter(named_tensors)
        try:
            if self.rank != 0:
                return
            tensors = [(n, t.detach().to("cpu").contiguous()) for n, t in named]
            name = lora_adapter_name(next(self._lora_syncs))
            body, _keep = lora_adapter_payload(tensors, self.lora_adapter, lora_name=name, num_ranks=self.tp)
            joining: list[int] = []
            self._failed_in_sync, self._joining = set(), joining
            serving = self.supervisor.in_use()
            # a restarted server holds the base weights it loaded at start: the new adapter is all it needs
            for s in self._one_process_targets(joining):
                self._post_update(s, "/load_lora_adapter_from_tensors", body)
            previous, self._lora_name = self._lora_name, name
            if previous is not None:  # no request uses it from now on (synchronous rollouts)
                for s in serving:
                    self._post_update(s, "/unload_lora_adapter", {"lora_name": previous})
            self.supervisor.rejoined([i for i in joining if i not in self._failed_in_sync])
        finally:
            drain_weights(named)

    def _post_update(self, s: int, path: str, body: dict) -> None:
        """One weight-update request to server ``s``. In one process, a server that fails here
        is taken out of use (restarted) and skipped for the rest of this sync; the others go on."""
        if s in self._failed_in_sync:
            return
        srv = self.servers[s]
        if path.startswith("/update_weights") and self._weight_version is not None:
            body = {**body, "weight_version": self._weight_version}
        try:
            _check_success(self.http.request(srv, path, body, retries=0), f"{srv.url} {path.lstrip('/')}")
        except EndpointNotFoundError:
            raise
        except SGLangError as e:
            if (self.world_size > 1 or self.weight_sync == "distributed" or isinstance(e, RequestRefusedError)
                    or not self.supervisor.is_failure_of_server(s, e)):
                raise
            self._failed_in_sync.add(s)
            self.supervisor.mark_unhealthy(s, f"{path} failed: {first_line(e)}", joining=s in self._joining)

    def _buckets(self, named: Iterable) -> Iterable[list]:
        """Update buckets of the stream; an FP8 stream alternates dtypes, so one bucket per dtype."""
        if self.quantization == "fp8":
            return fp8_weights.bucket_by_dtype(named, self.bucket_bytes)
        return ws.bucket_named_tensors(named, self.bucket_bytes)

    def _barrier(self, group: Any = None) -> None:
        if self.world_size > 1:
            torch.distributed.barrier(group=group)

    def _groups_for_tensor_sync(self) -> dict:
        """``server index -> (leader rank, process group or None)``; subgroups made collectively."""
        if self._server_groups is None:
            groups = {}
            for s in range(len(self.servers)):
                if self.world_size == 1:
                    groups[s] = (0, None)
                else:
                    ranks = list(range(s * self.tp, (s + 1) * self.tp))
                    groups[s] = (ranks[0], torch.distributed.new_group(ranks) if self.tp > 1 else None)
            self._server_groups = groups
        return self._server_groups

    @contextmanager
    def _update_session(self, indices: Sequence[int]):
        """Open a weight-update session on each server of ``indices`` that supports one, close it
        after (also when the update fails; then a failing close does not hide the first error)."""
        opened = [s for s in indices if self._begin_weight_update(s)]
        ok = False
        try:
            yield
            ok = True
        finally:
            for s in opened:
                try:
                    self._post_update(s, "/end_weight_update", {})
                except SGLangError:
                    if ok:
                        raise

    def _begin_weight_update(self, s: int) -> bool:
        """``POST /begin_weight_update``; False (remembered) when the server has no such endpoint."""
        url = self.servers[s].url
        if self._has_update_session.get(url) is False:
            return False
        try:
            self._post_update(s, "/begin_weight_update", {})
        except EndpointNotFoundError:
            self._has_update_session[url] = False
            return False
        if s in self._failed_in_sync:
            return False
        self._has_update_session[url] = True
        return True

    def _sync_tensor(self, named: Iterable, targets: Sequence[int]) -> None:
        groups = {s: g for s, g in self._groups_for_tensor_sync().items() if s in targets}
        mine = [s for s, (leader, _) in groups.items() if self.rank == leader]
        with self._update_session(mine):
            self._send_tensor_buckets(named, groups)

    def _send_tensor_buckets(self, named: Iterable, groups: dict) -> None:
        """One serialisation per server TP rank (weight_sync.serialize_bucket_for_sglang says why).

        Several trainer ranks (colocated, world_size > 1): server ``s``'s TP rank ``i`` runs on
        the GPU of trainer rank ``s * tp + i`` (the launch places it there), and that rank
        serialises its own copy of the bucket on its own GPU; the server's leader gathers them.
        One process (world_size == 1: `hapo doctor`, the per-node sync of node_servers.py) holds
        the only copy, so it serialises it ``tp`` times from its own GPU: each TP rank still gets
        its own CUDA-IPC reference (safe: the bucket lives until the server has answered and all
        ranks released theirs); TP ranks on other GPUs map it from this process's GPU."""
        per_server_rank = self.tp if self.world_size == 1 else 1
        for bucket, last in ws.with_last(self._buckets(named)):
            blobs, keepalive = ws.serialize_bucket_for_sglang(bucket, per_server_rank)
            for s, (leader, pg) in groups.items():
                if self.world_size > 1 and self.rank // self.tp != s:
                    continue
                if self.world_size == 1 or pg is None:
                    per_rank = blobs
                else:
                    per_rank = [None] * self.tp if self.rank == leader else None
                    torch.distributed.gather_object(blobs[0], per_rank, dst=leader, group=pg)
                if self.rank == leader:
                    self._post_update(s, "/update_weights_from_tensor",
                                      ws.tensor_update_payload(per_rank, flush_cache=last and self._flush_cache))
                self._barrier(pg)  # the server has read our IPC handle before we free it
            del keepalive

    def _init_nccl_group(self) -> None:
        """Rank 0 of the weight-update group with every server TP rank, on a store hosted here
        (``sync_group``: torchrun's agent-store setting must not make rank 0 a client)."""
        addr = launcher.node_ip()
        world = 1 + sum(s.tp_size for s in self.servers)
        offsets = [1 + sum(s.tp_size for s in self.servers[:i]) for i in range(len(self.servers))]
        backend = sync_group.sync_backend(self.device)
        self._sync_store = sync_group.host_store(addr, world)
        with ThreadPoolExecutor(max_workers=len(self.servers)) as pool:
            futs = [pool.submit(self.http.request, srv, "/init_weights_update_group",
                                ws.init_group_payload(master_address=addr, master_port=self._sync_store.port,
                                                      rank_offset=off, world_size=world, group_name=self.group_name,
                                                      backend=backend), retries=0)
                    for srv, off in zip(self.servers, offsets)]
            self._nccl_group = sync_group.open_group(self._sync_store, world_size=world, group_name=self.group_name,
                                                     backend=backend)
            for f in futs:
                _check_success(f.result(), "init_weights_update_group")

    def _sync_distributed(self, named: Iterable, targets: Sequence[int]) -> None:
        if self.rank != 0:
            return  # update_weights reads the rest
        if len(targets) != len(self.servers):
            raise SGLangError(f"weight_sync='distributed' cannot leave a server out of its NCCL group "
                              f"({self.supervisor.summary()}): use weight_sync tensor or disk to replace "
                              "failed servers (docs/multinode.md, fault tolerance)")
        if self._nccl_group is None:
            self._init_nccl_group()
        with self._update_session(range(len(self.servers))):
            self._broadcast_buckets(named)

    def _broadcast_buckets(self, named: Iterable) -> None:
        with ThreadPoolExecutor(max_workers=len(self.servers)) as pool:
            for bucket, last in ws.with_last(self._buckets(named)):
                flat, _ = ws.flatten_bucket(bucket)
                body = ws.distributed_update_payload(bucket, group_name=self.group_name,
                                                     flush_cache=last and self._flush_cache)
                if self._weight_version is not None:
                    body["weight_version"] = self._weight_version
                futs = [pool.submit(self.http.request, srv, "/update_weights_from_distributed", body, retries=0)
                        for srv in self.servers]
                torch.distributed.broadcast(flat.to(self._sync_device), group=self._nccl_group, group_src=0)
                for f in futs:
                    _check_success(f.result(), "update_weights_from_distributed")

    def _sync_disk(self, named: Iterable, targets: Sequence[int]) -> None:
        if self.rank != 0:
            return  # update_weights reads the rest
        path = self.disk_sync_dir or os.path.join(tempfile.gettempdir(), f"hapo_sglang_weights_{os.getpid()}")
        shutil.rmtree(path, ignore_errors=True)
        config_dir = self.model_path if self.model_path and os.path.isdir(self.model_path) else None
        ws.write_hf_checkpoint(named, path, shard_bytes=self.bucket_bytes, config_dir=config_dir)
        if config_dir is None and self.model_path:  # a hub name: its config from the local cache
            try:
                import transformers

                transformers.AutoConfig.from_pretrained(self.model_path, local_files_only=True).save_pretrained(path)
            except Exception as e:  # noqa: BLE001 - SGLang keeps its own config; only a warning
                warnings.warn(f"disk weight sync: no config.json for {self.model_path!r} in {path} ({e})")
        if self.quantization == "fp8" and os.path.isfile(os.path.join(path, "config.json")):
            fp8_weights.mark_fp8_config(path)  # a loadable FP8 checkpoint (transformers, tools)
        for s in targets:
            self._post_update(s, "/update_weights_from_disk", {"model_path": path, "flush_cache": self._flush_cache})

    # ------------------------------------------------------------------ memory and shutdown
    def _post_to_own_servers(self, path: str, body: dict) -> None:
        in_use = set(self.supervisor.in_use()) if self.world_size == 1 else set(range(len(self.servers)))
        for s, srv in enumerate(self.servers):
            leader = 0 if self.world_size == 1 or not self.colocate else s * self.tp
            if self.rank == leader and s in in_use:  # a restarting server never released its memory
                self.http.request(srv, path, body, retries=0)
        self._barrier()

    def release_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Colocated: free the servers' GPU memory (weights and KV cache, or ``tags``); CPU: no-op."""
        if self.colocate and self.device == "cuda":
            self._post_to_own_servers("/release_memory_occupation", {"tags": list(tags) if tags else None})

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Colocated: re-allocate what :meth:`release_memory` freed (call before ``update_weights``)."""
        if self.colocate and self.device == "cuda":
            self._post_to_own_servers("/resume_memory_occupation", {"tags": list(tags) if tags else None})

    def shutdown(self) -> None:
        """Stop the servers this process launched; attached servers keep running."""
        # requests still in flight (an asynchronous producer's) fail as their servers stop: a
        # stopping engine restarts none of them
        self.supervisor.restart = None
        for h in self.servers:
            launcher.stop_process(h)
        if self._nccl_group is not None:
            try:
                torch.distributed.destroy_process_group(self._nccl_group)
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
            self._nccl_group = self._sync_store = None


def _check_success(answer: Any, what: str) -> None:
    if isinstance(answer, dict) and answer.get("success") is False:
        raise SGLangError(f"{what} failed: {answer.get('message')}")


__all__ = ["SGLangEngine", "generate_call_plan", "row_sampling_params", "row_seeds", "generate_payload",
           "parse_generate_item", "resolve_weight_sync", "WEIGHT_SYNC_MODES"]
