"""Asynchronous rollouts (`rollout.max_staleness >= 1`; docs/architecture.md, "Asynchronous
rollouts"): a producer thread on rank 0 keeps the SGLang servers generating prompt groups into a
`StalenessBuffer` while the trainer ranks train; the trainer takes each step's batch from it.

- Each group is one ``/generate`` call (``rollout.n`` rows), sent from a thread pool as soon as
  the buffer's lag rule admits it, scored, shaped and filtered (dynamic sampling: a filtered group
  frees its place and does not count towards a batch).
- Weight updates run between steps inside ``/pause_generation`` (``rollout.sglang.pause_mode``)
  and ``/continue_generation``, tagged with ``weight_version`` = the step just trained; SGLang then
  reports the version of every token (`Sample.weight_versions`). A group's lag is measured from
  its oldest token: the version of the batch it trains in minus that. Under ``pause_mode: abort``
  a group is one `RolloutEngine.generate_group` call, and the rows the pause aborts resume from
  their own tokens under the new weights (`AsyncRollout._generate_resuming`).
- Each group records the entropy statistics it was sampled with; the trainer recomputes the
  SGLang temperatures with them (`stages.recompute_temperatures`).
- State: the prompts admitted but not yet trained (in flight or finished) are checkpointed with
  the sampler's cursor (`snapshot`); a resume regenerates them first, so no prompt is lost or
  repeated.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import numpy as np

from hapo_megatron.rewards.counts import RewardCounts
from hapo_megatron.rollout.engine import Sample, SamplingParams
from hapo_megatron.rollout.sglang.engine import STOP_POLL_S, row_seeds
from hapo_megatron.training.metrics.host_cpu import thread_cpu_s
from hapo_megatron.training.asynchronous.buffer import BufferClosed, FinishedGroup, StalenessBuffer
from hapo_megatron.training.batches.rollout_batch import (DynamicSampler, RolloutBatch, build_batch,
                                                          rollout_metrics, shape_rewards)
from hapo_megatron.training.partial_rollouts import PartialGroup, PartialRow, group_samples, prefix_mask, row_requests
from hapo_megatron.training.rollout_protocol import RolloutAbandoned

#: how long the producer waits for the lag rule before looking at its stop flag again
_POLL_S = 0.05
# close(): a group that passed its stop check just before the abort sends its request after it;
# the abort is sent again this often until every group in flight is back, for at most _CLOSE_S
_ABORT_AGAIN_S = 1.0
_CLOSE_S = 10.0


class AsyncRollout:
    """The producer and its buffer (rank 0). ``start`` launches the thread; the trainer calls
    `take_step` (the step's batch), `paused` around its weight update, `close` at the end."""

    def __init__(self, rt, *, pending: Optional[list[int]] = None):
        cfg = rt.cfg
        self.rt = rt
        self.k = int(cfg.rollout.max_staleness)
        self.batch_groups = int(cfg.data.train_batch_size)
        version = int(rt.rl.step)
        self.buffer = StalenessBuffer(self.batch_groups, self.k, version=version,
                                      over_sampling=cfg.rollout.over_sampling)
        # over-sampling: a group passed over may train with tokens older than the bound
        self.mask_old_tokens = cfg.rollout.over_sampling > 1.0 and cfg.rollout.partial_mode == "mask_prefix"
        self.pause_mode = cfg.rollout.sglang.pause_mode
        self._lock = threading.Lock()  # the sampler cursor and the queue of drawn prompts
        self._queue: deque[int] = deque(pending or ())  # drawn (or from a checkpoint), not admitted
        self._score_lock = threading.Lock()
        self._settled = threading.Condition(self._score_lock)  # _in_flight went down
        self._stop = threading.Event()
        self._filter = DynamicSampler(enabled=cfg.algo.filter_groups, metric=cfg.algo.filter_groups_metric,
                                      max_num_gen_batches=cfg.algo.max_num_gen_batches)
        self._pool = ThreadPoolExecutor(max_workers=(self.k + 1) * self.batch_groups,
                                        thread_name_prefix="hapo-rollout")
        self._thread = threading.Thread(target=self._run, name="hapo-rollout-producer", daemon=True)
        self._busy_since: Optional[float] = None  # generation busy time (>= 1 group in flight)
        self._in_flight = 0
        self._busy_s = 0.0
        self._cpu_s = 0.0  # CPU seconds of the groups finished since the last take (their pool threads)
        self._thread_cpu_s = 0.0  # the producer thread's at the last take
        self._counts = RewardCounts()
        self._generated: list[RolloutBatch] = []  # every finished group since the last take (metrics)

    # ------------------------------------------------------------------ producer
    def start(self) -> "AsyncRollout":
        self.rt.engine.spread_calls(True)  # one call per group: start them on every server
        self._thread.start()
        return self

    def _next_prompt(self) -> int:
        """The next prompt to admit (under the lock): the queue, refilled from the sampler."""
        if not self._queue:
            self._queue.extend(self.rt.rl.sampler.next_indices())
        return self._queue[0]

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._lock:
                    idx = self._next_prompt()
                    ticket = self.buffer.admit(idx, timeout=0)
                    if ticket is not None:
                        self._queue.popleft()
                if ticket is None:
                    self.buffer.wait_admissible(timeout=_POLL_S)
                    continue
                self._busy(+1)
                future = self._pool.submit(self._group, ticket, idx)
                # cancelled by close() before it ran: its `finally` never counts it back
                future.add_done_callback(lambda f: f.cancelled() and self._busy(-1))
        except BufferClosed:
            return
        except BaseException as e:  # noqa: BLE001 - handed to the trainer, which raises it
            self.buffer.fail(e)

    def _busy(self, delta: int) -> None:
        with self._score_lock:
            now = time.monotonic()
            if self._in_flight == 0 and delta > 0:
                self._busy_since = now
            self._in_flight += delta
            if self._in_flight == 0 and self._busy_since is not None:
                self._busy_s += now - self._busy_since
                self._busy_since = None
            self._settled.notify_all()

    def _group(self, ticket: int, idx: int) -> None:
        """Generate, score, shape and filter one group; hand it to the buffer."""
        cpu0 = time.thread_time()
        try:
            if self._stop.is_set():
                return
            rt = self.rt
            record = rt.train_ds[idx]
            version, stats = self.buffer.version, rt.rl.rollout_entropy_stats
            params = SamplingParams.from_config(rt.cfg.rollout, rt.cfg.algo, entropy_stats=stats,
                                                seed=rt.sampling_seed(version, ticket), stop_token_ids=_stop_ids(rt))
            samples = (self._generate_resuming(record, params) if self.pause_mode == "abort"
                       else self.rt.engine.generate([record.prompt_ids], params))
            versions = [s.weight_versions if len(s.weight_versions) else np.full(1, version, np.int32)
                        for s in samples[0]]
            decode = lambda ids: rt.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
            with self._score_lock:
                scoring = rt.scorer.start([record], decode=decode)
                scoring.add(samples[0])
                batch = build_batch(samples, [record], scoring.results(samples, self._counts),
                                    group_offset=group_id(idx, ticket))
            batch = shape_rewards(batch, max_response_length=rt.cfg.rollout.max_response_length,
                                  overlong_buffer_enable=rt.cfg.reward.overlong_buffer_enable,
                                  overlong_buffer_len=rt.cfg.reward.overlong_buffer_len,
                                  overlong_penalty_factor=rt.cfg.reward.overlong_penalty_factor)
            kept = self._keeps(batch)
            with self._score_lock:
                self._generated.append(batch)
            self.buffer.finish(FinishedGroup(
                ticket=ticket, prompt_index=idx, payload=batch, kept=kept,
                min_version=int(min(int(v.min()) for v in versions)),
                max_version=int(max(int(v.max()) for v in versions)),
                sampling_stats=stats.to_dict() if stats is not None else None,
                extra={"versions": [_token_versions(smp, version) for smp in samples[0]]}
                if self.mask_old_tokens else {}))
        except BufferClosed:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the trainer, which raises it
            if not self._stop.is_set():
                self.buffer.fail(e)
        finally:
            cpu = time.thread_time() - cpu0
            with self._score_lock:
                self._cpu_s += cpu
            self._busy(-1)

    def _generate_resuming(self, record, params) -> list[list[Sample]]:
        """``pause_mode: abort`` (AReaL's interruptible generation): the pause before a weight
        update aborts the rows running; each keeps its tokens and resumes once the new weights
        are in, prompt + partial response as input with the rest of its budget, its seed and the
        entropy statistics the group started with. Every token keeps the version that sampled it
        (the servers' report, else the version held when the call started), so the group's lag
        counts from its oldest token and ``algo.rollout_is`` corrects with the behaviour
        log-probs of each token (docs/architecture.md, "Asynchronous rollouts")."""
        engine, n, budget = self.rt.engine, int(params.n), int(params.max_new_tokens)
        prompt = [int(t) for t in record.prompt_ids]
        seeds = row_seeds(params, range(n)) if engine.send_sampling_seed else [None] * n
        group = PartialGroup(0, 0, None, [PartialRow() for _ in range(n)])
        while True:
            version = self.buffer.version
            idx, rows = row_requests(group, prompt, budget, seeds)
            for k, res in zip(idx, engine.generate_group(rows, params)):
                group.rows[k].extend(res, version, budget)
                if res.token_ids and res.weight_versions:  # the servers' own account of each new token
                    group.rows[k].versions[-len(res.token_ids):] = list(res.weight_versions)
            if group.complete:
                return [group_samples(group, prompt)]
            if self._stop.is_set():
                raise BufferClosed("the producer stopped with rows aborted")
            self.buffer.wait_version_after(version, timeout=None, stop=self._stop)

    def _keeps(self, batch: RolloutBatch) -> bool:
        if not self._filter.enabled:
            return True
        with self._score_lock:
            self._filter.reset()
            self._filter.add(batch)
            return len(self._filter.buffer) > 0

    # ------------------------------------------------------------------ trainer side
    def take_step(self, step: int, stop_check: Optional[Callable[[], bool]] = None
                  ) -> tuple[RolloutBatch, dict[str, float], dict, list[Optional[dict]]]:
        """The step's batch (``train_batch_size`` kept groups), its metrics, the state to
        checkpoint (`snapshot`) and the entropy statistics each sequence was sampled with.
        ``stop_check`` is asked before the take and while it waits (as the synchronous rollout
        asks it): True gives the step up with `RolloutAbandoned`, the buffer untouched."""
        t0 = time.monotonic()
        got = None
        while got is None:
            if stop_check is not None and stop_check():
                raise RolloutAbandoned(f"stop requested while step {step} waited for its rollout batch")
            got = self.buffer.take(timeout=STOP_POLL_S if stop_check is not None else None)
        wait_s = time.monotonic() - t0
        kept = RolloutBatch.concat([g.payload for g in got])
        batch_version = self.buffer.taken - 1
        lags = [batch_version - g.min_version for g in got for _ in range(len(g.payload))]
        if self.mask_old_tokens:  # rollout.partial_mode: mask_prefix leaves out the tokens past the bound
            kept.token_mask = [prefix_mask(v, batch_version - self.k) for g in got for v in g.extra["versions"]]
        seq_stats = [g.sampling_stats for g in got for _ in range(len(g.payload))]
        with self._score_lock:
            generated, self._generated = self._generated, []
            busy = self._busy_s + (time.monotonic() - self._busy_since if self._busy_since is not None else 0.0)
            self._busy_s = 0.0
            if self._busy_since is not None:
                self._busy_since = time.monotonic()
            counts, self._counts = self._counts, RewardCounts()
            thread_cpu = thread_cpu_s(self._thread)
            cpu, self._cpu_s = self._cpu_s + thread_cpu - self._thread_cpu_s, 0.0
            self._thread_cpu_s = thread_cpu
            num_filtered, num_kept = self.buffer.num_filtered, self.buffer.num_kept
        rt = self.rt
        metrics = {**rollout_metrics(RolloutBatch.concat(generated) if generated else kept,
                                     max_response_length=rt.cfg.rollout.max_response_length),
                   **counts.metrics(),
                   **rt.engine.fault_metrics(),
                   "rollout/staleness_mean": float(np.mean(lags)) if lags else 0.0,
                   "rollout/staleness_max": float(max(lags)) if lags else 0.0,
                   "rollout/passed_over_groups": float(self.buffer.passed_over),
                   "rollout/kept_group_frac": num_kept / max(num_kept + num_filtered, 1),
                   "rollout/buffer_groups": float(self.buffer.num_live()),
                   "timing/trainer_wait_s": wait_s,
                   "timing/generation_busy_s": busy,  # time with a group in flight since the last take
                   "timing/producer_cpu_s": cpu,  # HTTP, parsing, scoring, shaping: the producer's CPU
                   # generation time that ran while the trainer did something else
                   "rollout/generation_overlap_frac": max(0.0, 1.0 - wait_s / busy) if busy > 0 else 0.0,
                   "batch/reward_mean": sum(kept.rewards) / max(len(kept), 1),
                   "batch/acc": sum(kept.accs) / max(len(kept), 1),
                   "batch/num_groups": float(len(got))}
        return kept, metrics, self.snapshot(), seq_stats

    def snapshot(self) -> dict[str, Any]:
        """``{"sampler": cursor, "pending": prompts}``, consistent: every prompt not yet trained
        is either pending (admitted, or drawn and queued) or after the cursor."""
        with self._lock:
            return {"sampler": self.rt.rl.sampler.state_dict(),
                    "pending": self.buffer.pending_prompts() + list(self._queue)}

    def paused(self, version: int):
        """Context manager around a weight update to ``version`` (see the module docstring)."""
        return _Paused(self, int(version))

    def close(self) -> None:
        """Stop the producer (SIGTERM, the end of the run, an error): no new request starts and
        the servers abort the requests in flight (their groups would never be trained, and the
        interpreter's exit waits for the threads that sent them), again until every group is
        back (at most ``_CLOSE_S``): a request may reach its server just after an abort."""
        self._stop.set()
        self.buffer.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + _CLOSE_S
        while True:
            with self._score_lock:
                if not self._in_flight or time.monotonic() >= deadline:
                    break
            self.rt.engine.abort_requests()
            with self._settled:
                self._settled.wait_for(lambda: self._in_flight == 0, timeout=_ABORT_AGAIN_S)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)


class _Paused:
    def __init__(self, owner: AsyncRollout, version: int):
        self.owner, self.version = owner, version

    def __enter__(self):
        self.owner.rt.engine.pause_generation(self.owner.pause_mode)
        return self

    def __exit__(self, *exc):
        self.owner.rt.engine.continue_generation()
        if exc[0] is None:
            self.owner.buffer.set_version(self.version)
        return False


def _token_versions(sample: Sample, version: int) -> np.ndarray:
    """The weight version of each response token: the servers' report, else the version held
    when the group started (one per token either way, for `prefix_mask`)."""
    if len(sample.weight_versions) == len(sample.response_ids):
        return np.asarray(sample.weight_versions, dtype=np.int64)
    return np.full(len(sample.response_ids), version, dtype=np.int64)


def _stop_ids(rt) -> list[int]:
    eos = getattr(rt.tokenizer, "eos_token_id", None)
    return [int(eos)] if eos is not None else []





def group_id(prompt_index: int, ticket: int) -> int:
    """A group's id: unique within a step (the ticket; the same prompt may come twice across an
    epoch boundary) and naming its prompt (``id >> 32``, e.g. in saved rollouts' ``uid``)."""
    return (int(prompt_index) << 32) + int(ticket) % (1 << 32)


__all__ = ["AsyncRollout", "group_id"]
