"""The rollout manager: the asynchronous producer (`producer.AsyncRollout`: the servers' HTTP
traffic, response parsing, scoring, shaping, filtering and the staleness buffer) in a process of
its own, spawned by trainer rank 0 (``rollout.async_producer: process``; docs/architecture.md,
"Asynchronous rollouts"). Its threads then never hold the trainer's interpreter lock.

Trainer rank 0 holds a `RolloutManager`, which answers as `AsyncRollout` does (`take_step`,
`paused`, `snapshot`, `close`) by messages over a pipe:

    take k        -> beats (one a second while the buffer has no batch), then the batch: its
                     metrics, checkpoint state and sampling statistics, and the rows as arrays
                     (`transport`: raw buffers, no per-token Python object in the trainer)
    pause v, st   -> the manager's engine pauses generation (st: the entropy statistics the next
                     groups are sampled with)
    continue ok, in_use -> generation continues; ok: the servers hold version v. in_use: the
                     servers the trainer's engine has in use (a restarted server rejoins at a
                     weight sync, which the trainer runs: the manager follows it)
    close         -> the producer stops (requests in flight aborted); the process exits

With ``rollout.max_staleness: 0`` and ``rollout.sync_producer: process`` it runs no producer; the
synchronous loop's rank 0 asks for each step's rollout instead (`RolloutManager.rollout_step`):

    rollout k, cursor, st, in_use -> progress between generation rounds (passed on to the other
                     ranks), beats, then the batch: its metrics and the new sampler cursor, and the
                     rows as arrays (`stages.generate_step`, run from the trainer's cursor, entropy
                     statistics and servers in use)

The manager builds its runtime from a `ManagerSpec` (config, tokenizer, prompts, sampler cursor,
the servers' URLs); its engine is an `SGLangEngine` over the trainer's servers that launches and
restarts none (the trainer's engine owns their processes and weight syncs).

Failure: the process exiting, or sending nothing for ``rollout.async_manager_timeout_s`` (hung: it
is killed), ends the run at the next safe point with a one-line message and the last finished
step saved (``on_failure``: the trainer's `StopRequest.fail`); the trainer never waits on it
unboundedly. It ignores SIGINT/SIGTERM (the trainer stops it) and exits when the trainer's end
of the pipe closes.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Optional

from hapo_megatron.compat.processes import children_allowed
from hapo_megatron.rollout.engine import GenerationAborted
from hapo_megatron.training.asynchronous.producer import AsyncRollout
from hapo_megatron.training.asynchronous.transport import recv_batch, send_batch
from hapo_megatron.training.rollout_protocol import RolloutAbandoned

HEARTBEAT_S = 1.0  # the manager's sign of life while the trainer waits for a batch
_POLL_S = 0.1  # the trainer looks at its stop flag and the process this often while it waits
_START_S = 600.0  # building the manager's runtime (imports, tokenizer, engine) may take a while
_CLOSE_S = 30.0  # the producer's own close is bounded (producer._CLOSE_S); then the process is killed


_ABANDONED = (RolloutAbandoned, GenerationAborted)  # the trainer's stop reached the step (its beat saw the close)


class RolloutManagerFailed(RuntimeError):
    """The rollout manager process crashed, hung or reported an error (one line)."""


@dataclass
class ManagerSpec:
    """What the manager process builds its runtime from (pickled once, when it starts)."""

    cfg: Any
    tokenizer: Any
    train_ds: Any
    sampler_state: dict
    step: int
    entropy_stats: Any
    rollout_cfg: Any  # engine_settings' rollout section, server_urls = the trainer's servers
    dtype: Any
    api_key: Optional[str]
    send_sampling_seed: bool
    routing: str = "off"  # the actor's MoE routing mode: which steps fetch routes (stages.fetches_routes)
    asynchronous: bool = True  # the producer (max_staleness >= 1), else one `stages.generate_step` per ask


def spec_of(rt) -> ManagerSpec:
    """The `ManagerSpec` of trainer rank 0's runtime (its engine's servers, current state)."""
    import torch

    from hapo_megatron.rollout.sglang.node_servers import sglang_cluster
    from hapo_megatron.training.build import engine_settings
    cluster = sglang_cluster(rt.engine)
    rollout, dtype = engine_settings(rt.cfg, rt.hf_config, on_gpu=torch.cuda.is_available())
    sglang = dataclasses.replace(rollout.sglang, server_urls=[s.url for s in cluster.servers])
    return ManagerSpec(cfg=rt.cfg, tokenizer=rt.tokenizer, train_ds=rt.train_ds,
                       sampler_state=rt.rl.sampler.state_dict(), step=int(rt.rl.step),
                       entropy_stats=rt.rl.rollout_entropy_stats,
                       rollout_cfg=dataclasses.replace(rollout, sglang=sglang), dtype=dtype,
                       api_key=cluster.api_key, send_sampling_seed=bool(cluster.send_sampling_seed),
                       routing=str(rt.actor.routing), asynchronous=bool(rt.cfg.rollout.max_staleness))


class ManagerRuntime(SimpleNamespace):
    """The part of a `Runtime` the producer and `stages.generate_step` read (cfg, engine, train_ds,
    tokenizer, scorer, rl, actor.routing; memory: no moves here, the trainer makes them; control:
    the progress the trainer forwards to its other ranks)."""

    def sampling_seed(self, step: int, gen_index: int) -> int:
        from hapo_megatron.training.runtime import sampling_seed
        return sampling_seed(self.cfg, step, gen_index)


def build_runtime(spec: ManagerSpec) -> ManagerRuntime:
    """The manager's runtime (in the manager process)."""
    from hapo_megatron.data.sampler import PromptSampler
    from hapo_megatron.rewards.scoring import RewardScorer
    from hapo_megatron.rollout.sglang.engine import SGLangEngine
    from hapo_megatron.training.batches.rollout_batch import DynamicSampler
    from hapo_megatron.training.memory.engine_memory import EngineMemory
    cfg = spec.cfg
    sampler = PromptSampler(spec.train_ds, cfg.data.train_batch_size if cfg.rollout.generate_batch_size is None
                            else cfg.rollout.generate_batch_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    sampler.load_state_dict(spec.sampler_state)
    engine = SGLangEngine(spec.rollout_cfg.sglang, model_path=cfg.model.hf_model_path, tokenizer=spec.tokenizer,
                          dtype=spec.dtype, launch=False, wait_for_servers=False, api_key=spec.api_key,
                          send_sampling_seed=spec.send_sampling_seed,
                          quantization=spec.rollout_cfg.quantization, kv_cache_dtype=spec.rollout_cfg.kv_cache_dtype)
    dyn = DynamicSampler(enabled=cfg.algo.filter_groups, metric=cfg.algo.filter_groups_metric,
                         max_num_gen_batches=cfg.algo.max_num_gen_batches)
    return ManagerRuntime(cfg=cfg, engine=engine, train_ds=spec.train_ds, tokenizer=spec.tokenizer,
                          scorer=RewardScorer(cfg.reward), memory=EngineMemory(), control=None,
                          actor=SimpleNamespace(routing=spec.routing),
                          rl=SimpleNamespace(step=spec.step, sampler=sampler, dyn=dyn,
                                             rollout_entropy_stats=spec.entropy_stats))


def follow_servers(sup, in_use: list[int]) -> None:
    """The manager's engine's supervisor ``sup`` takes the trainer's servers in use: one the
    trainer restarted and synced is back, one it took out of use is out (a failure it found first)."""
    mine = set(sup.in_use())
    sup.rejoined([i for i in in_use if i not in mine])
    for i in sorted(mine - set(in_use)):
        sup.mark_unhealthy(i, "out of use in the trainer's engine")


# ---------------------------------------------------------------------- the manager process
class _ProgressToTrainer:
    """The manager runtime's ``control``: `stages.generate_step`'s progress between generation
    rounds goes to the trainer, which passes it on to its other ranks."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def send(self, kind: str, payload: Any) -> None:
        self.conn.send(("progress", kind, payload))


def _serve(conn, factory: Callable[..., Any], args: tuple, pending: Optional[list[int]],
           asynchronous: bool = True) -> None:
    """The manager process: build the runtime, start the producer (asynchronous) or generate one
    step per ``rollout`` message (synchronous), answer the trainer."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer stops it (close), whatever stops the trainer
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ar = None
    try:
        rt = factory(*args)
        rt.control = _ProgressToTrainer(conn)
        if asynchronous:
            ar = AsyncRollout(rt, pending=pending).start()
        conn.send(("ready", os.getpid()))
        last = [time.monotonic()]

        def beat() -> bool:  # asked while take_step waits: a sign of life for the trainer
            if time.monotonic() - last[0] >= HEARTBEAT_S:
                conn.send(("beat",))
                last[0] = time.monotonic()
            return conn.poll()  # the trainer gave the step up and sent close: stop waiting
        paused = None
        while True:
            msg = conn.recv()
            kind = msg[0]
            if kind == "rollout":
                try:
                    kept, metrics, state = _generate_step(rt, *msg[1:], stop_check=beat)
                except _ABANDONED:
                    continue  # the trainer gave the step up; the next message is close
                conn.send(("batch", metrics, state, rt.rl.partial_rollouts))  # the pool: kept by the trainer
                send_batch(conn, kept)
            elif kind == "take":
                try:
                    kept, metrics, snapshot, seq_stats = ar.take_step(int(msg[1]), stop_check=beat)
                except RolloutAbandoned:
                    continue  # the buffer is untouched; the next message is close
                conn.send(("batch", metrics, snapshot, seq_stats))
                send_batch(conn, kept)
            elif kind == "pause":
                rt.rl.rollout_entropy_stats = msg[2]
                paused = ar.paused(int(msg[1]))
                paused.__enter__()
                conn.send(("ok",))
            elif kind == "continue":
                if paused is not None:
                    failed = None if msg[1] else RuntimeError("the weight update failed")
                    paused.__exit__(type(failed) if failed else None, failed, None)
                    paused = None
                if msg[2] is not None:  # the trainer's servers in use (None: tests without servers)
                    follow_servers(rt.engine.supervisor, msg[2])
                conn.send(("ok",))
            elif kind == "snapshot":
                conn.send(("snapshot", ar.snapshot()))
            elif kind == "close":
                if ar is not None:
                    ar.close()
                    ar = None
                conn.send(("closed",))
                return
            else:
                raise ValueError(f"unknown message {kind!r}")
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the trainer is gone
    except BaseException as e:  # noqa: BLE001 - reported to the trainer in one line
        try:
            conn.send(("error", f"{type(e).__name__}: {_first_line(e)}"))
        except OSError:
            pass
    finally:
        if ar is not None:
            ar.close()


def _generate_step(rt, step: int, sampler_state: dict, entropy_stats: Any, partial_rollouts: Optional[dict],
                   in_use: Optional[list[int]], *, stop_check: Callable[[], bool]):
    """One synchronous step's rollout in the manager, from the trainer's sampler cursor, entropy
    statistics, pool of partial rollouts and servers in use: `stages.generate_step`, as trainer
    rank 0 runs it inline."""
    from hapo_megatron.training.stages import generate_step
    if in_use is not None:
        follow_servers(rt.engine.supervisor, in_use)
    rt.rl.step, rt.rl.rollout_entropy_stats = int(step), entropy_stats
    rt.rl.partial_rollouts = partial_rollouts
    rt.rl.sampler.load_state_dict(sampler_state)
    return generate_step(rt, int(step), stop_check)


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [""])[0][:500]


# ---------------------------------------------------------------------- the trainer's side
class RolloutManager:
    """Trainer rank 0's handle on the manager process (the interface of `AsyncRollout`).

    ``factory(*args)`` builds the manager's runtime in the new process (`build_runtime` and a
    `ManagerSpec` in a run; tests pass their own). ``on_failure(message)``: called once when the
    manager fails, before `take_step` gives its step up (`RolloutAbandoned`); without it the
    failure raises `RolloutManagerFailed`. ``engine``: the trainer's engine (its fault metrics);
    ``servers_in_use()``: the indices of its servers in use, which the manager follows after each
    weight update (None: none to follow); ``entropy_stats()``: the statistics the next groups are
    sampled with. ``asynchronous=False``: no producer; `rollout_step` runs one synchronous step's
    rollout (``rollout.sync_producer: process``), ``on_progress(kind, payload)`` receiving the
    progress it reports between generation rounds."""

    def __init__(self, factory: Callable[..., Any], args: tuple = (), *, pending: Optional[list[int]] = None,
                 timeout_s: float = 300.0, on_failure: Optional[Callable[[str], None]] = None,
                 engine: Any = None, servers_in_use: Callable[[], Optional[list[int]]] = lambda: None,
                 entropy_stats: Callable[[], Any] = lambda: None, asynchronous: bool = True,
                 on_progress: Callable[[str, Any], None] = lambda kind, payload: None):
        self.timeout_s, self.on_failure = float(timeout_s), on_failure
        self.engine, self.servers_in_use, self.entropy_stats = engine, servers_in_use, entropy_stats
        self.on_progress = on_progress
        self.failure: Optional[str] = None
        ctx = multiprocessing.get_context("spawn")  # no copy of the trainer's torch / gloo state
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, factory, args, pending, asynchronous),
                                 name="hapo-rollout-manager")
        with children_allowed():  # trainer ranks spawned by tests are daemonic
            self._proc.start()
        child.close()
        self.pid = self._proc.pid
        self._recv("starting", timeout_s=max(self.timeout_s, _START_S))

    # ------------------------------------------------------------------ messages
    def _fail(self, what: str) -> None:
        if self.failure is None:
            self.failure = f"the rollout manager process (pid {self.pid}) {what}"
            self._kill()
            if self.on_failure is not None:
                self.on_failure(self.failure)
        raise RolloutManagerFailed(self.failure)

    def _recv(self, doing: str, *, stop_check: Optional[Callable[[], bool]] = None,
              timeout_s: Optional[float] = None) -> tuple:
        """The next message other than a beat; fails the manager if it exits, reports an error or
        sends nothing for ``timeout_s``; `RolloutAbandoned` when ``stop_check`` says so."""
        if self.failure is not None:
            raise RolloutManagerFailed(self.failure)
        limit = self.timeout_s if timeout_s is None else timeout_s
        last = time.monotonic()
        while True:
            if stop_check is not None and stop_check():
                raise RolloutAbandoned(f"stop requested while {doing}")
            try:
                ready = self._conn.poll(_POLL_S)
                msg = self._conn.recv() if ready else None
            except (EOFError, OSError):
                self._proc.join(timeout=5)
                self._fail(f"exited with code {self._proc.exitcode} while {doing}")
            if msg is None:
                if not self._proc.is_alive():
                    self._fail(f"exited with code {self._proc.exitcode} while {doing}")
                if time.monotonic() - last > limit:
                    self._fail(f"sent nothing for {limit:g} s while {doing} (hung; killed; "
                               "rollout.async_manager_timeout_s)")
                continue
            last = time.monotonic()
            if msg[0] == "beat":
                continue
            if msg[0] == "progress":
                self.on_progress(msg[1], msg[2])
                continue
            if msg[0] == "error":
                self._fail(f"failed while {doing}: {msg[1]}")
            return msg

    def _ask(self, msg: tuple, doing: str, **kw) -> tuple:
        if self.failure is not None:
            raise RolloutManagerFailed(self.failure)
        try:
            self._conn.send(msg)
        except OSError:
            self._proc.join(timeout=5)
            self._fail(f"exited with code {self._proc.exitcode} before {doing}")
        return self._recv(doing, **kw)

    # ------------------------------------------------------------------ AsyncRollout's interface
    def _batch(self, msg: tuple, step: int, stop_check: Optional[Callable[[], bool]]) -> tuple:
        """Ask ``msg``: (the batch, read as arrays by `transport`; its metrics, with the wait, the
        transport and the trainer's server restarts; the answer's fields after the metrics)."""
        t0 = time.monotonic()
        try:
            answer = self._ask(msg, f"step {step} waited for its batch", stop_check=stop_check)
            t1 = time.monotonic()
            try:
                kept = recv_batch(self._conn)
            except (EOFError, OSError, ValueError) as e:
                self._fail(f"failed while it sent step {step}'s batch ({type(e).__name__}: {_first_line(e)})")
        except RolloutManagerFailed as e:
            if self.on_failure is not None:  # the run stops at the next safe point, the last step saved
                raise RolloutAbandoned(str(e)) from None
            raise
        metrics = {**answer[1], "timing/trainer_wait_s": time.monotonic() - t0,
                   "timing/manager_transport_s": time.monotonic() - t1}
        if self.engine is not None:  # fault_metrics is part of the RolloutEngine protocol
            restarts = self.engine.fault_metrics().get("rollout/server_restarts")
            if restarts is not None:  # the trainer's engine restarts the servers, not the manager's
                metrics["rollout/server_restarts"] = restarts
        return kept, metrics, answer[2:]

    def take_step(self, step: int, stop_check: Optional[Callable[[], bool]] = None):
        """As `AsyncRollout.take_step`. A stop request gives the step up at once: the batch the
        manager may still send is never trained, and the checkpoint of the last finished step
        keeps its prompts pending (the snapshot taken with that step's batch)."""
        kept, metrics, (snapshot, seq_stats) = self._batch(("take", int(step)), step, stop_check)
        return kept, metrics, snapshot, seq_stats

    def rollout_step(self, step: int, sampler_state: dict, entropy_stats: Any, partial_rollouts: Optional[dict],
                     stop_check: Optional[Callable[[], bool]] = None):
        """As `stages.generate_step` (the synchronous loop), run in the manager from the trainer's
        sampler cursor, entropy statistics and pool of partial rollouts (over-sampling; None
        without): the kept batch, its metrics, the sampler state and the pool after the step,
        which the trainer keeps for its checkpoints (so a resumed run hands the manager its pool).
        A stop request gives the step up at once (`RolloutAbandoned`; the manager's engine aborts
        its requests when it sees the close that follows)."""
        msg = ("rollout", int(step), sampler_state, entropy_stats, partial_rollouts, self.servers_in_use())
        kept, metrics, (state, pool) = self._batch(msg, step, stop_check)
        return kept, metrics, state, pool

    def snapshot(self) -> dict[str, Any]:
        return self._ask(("snapshot",), "it took a snapshot")[1]

    def paused(self, version: int) -> "_Paused":
        return _Paused(self, int(version))

    def close(self) -> None:
        """Stop the producer and the process (bounded: killed after ``_CLOSE_S``)."""
        if self.failure is None and self._proc.is_alive():
            deadline = time.monotonic() + _CLOSE_S
            try:
                self._conn.send(("close",))
                while self._proc.is_alive() and time.monotonic() < deadline:
                    if self._conn.poll(_POLL_S):  # beats, or a batch sent before it saw the close: dropped
                        self._conn.recv_bytes()
            except (EOFError, OSError):
                self._proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()
        self._conn.close()

    def _kill(self) -> None:
        self._proc.join(timeout=1.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=10)


class _Paused:
    """Generation paused in the manager around the trainer's weight update. A manager failure
    here raises nothing when ``on_failure`` is set: the update goes on and the run stops at the
    next safe point, with this step saved."""

    def __init__(self, owner: RolloutManager, version: int):
        self.owner, self.version = owner, version

    def _ask(self, msg: tuple, doing: str) -> None:
        try:
            self.owner._ask(msg, doing)
        except RolloutManagerFailed:
            if self.owner.on_failure is None:
                raise

    def __enter__(self):
        self._ask(("pause", self.version, self.owner.entropy_stats()), f"it paused for weight version {self.version}")
        return self

    def __exit__(self, *exc):
        self._ask(("continue", exc[0] is None, self.owner.servers_in_use()),
                  f"it continued at weight version {self.version}")
        return False


def start_manager(rt, *, pending: Optional[list[int]], on_failure: Optional[Callable[[str], None]]
                  ) -> RolloutManager:
    """Trainer rank 0: the manager process over ``rt``'s servers (``rollout.async_producer`` or,
    with ``rollout.max_staleness: 0``, ``rollout.sync_producer``: process)."""
    from hapo_megatron.rollout.sglang.node_servers import sglang_cluster
    from hapo_megatron.training.rollout_protocol import PROGRESS
    supervisor = sglang_cluster(rt.engine).supervisor
    spec = spec_of(rt)

    def forward_progress(kind: str, payload: Any) -> None:  # the other ranks' per-round progress
        assert kind == PROGRESS, kind
        rt.control.send(kind, payload)
    return RolloutManager(build_runtime, (spec,), pending=pending,
                          timeout_s=rt.cfg.rollout.async_manager_timeout_s, on_failure=on_failure,
                          engine=rt.engine, servers_in_use=supervisor.in_use,
                          entropy_stats=lambda: rt.rl.rollout_entropy_stats, asynchronous=spec.asynchronous,
                          on_progress=forward_progress)


def start_rollout_producer(rt, on_failure: Optional[Callable[[str], None]] = None) -> None:
    """Rank 0, after the first weight sync. ``rollout.max_staleness >= 1``: start the producer
    (the servers hold version ``rt.rl.step``; a resume regenerates the checkpoint's pending prompts
    first), in the rollout manager process (``rollout.async_producer: process``) or here
    (``thread``). ``max_staleness: 0`` with ``rollout.sync_producer: process``: start the manager
    that runs each step's rollout. ``on_failure``: what the manager's crash or hang calls."""
    if not rt.is_main or rt.async_rollout is not None or rt.sync_manager is not None:
        return
    rollout = rt.cfg.rollout
    if not rollout.max_staleness:
        if rollout.sync_producer == "process":
            rt.sync_manager = start_manager(rt, pending=None, on_failure=on_failure)
        return
    if rollout.async_producer == "process":
        rt.async_rollout = start_manager(rt, pending=rt.rl.async_pending, on_failure=on_failure)
        return
    rt.async_rollout = AsyncRollout(rt, pending=rt.rl.async_pending).start()


def stop_rollout_producer(rt) -> None:
    """Stop the producer or the manager (idempotent; every rank may call it)."""
    if rt.async_rollout is not None:
        ar, rt.async_rollout = rt.async_rollout, None
        ar.close()
    if rt.sync_manager is not None:
        manager, rt.sync_manager = rt.sync_manager, None
        manager.close()


__all__ = ["ManagerRuntime", "ManagerSpec", "RolloutManager", "RolloutManagerFailed", "build_runtime",
           "follow_servers", "spec_of", "start_manager", "start_rollout_producer", "stop_rollout_producer"]
