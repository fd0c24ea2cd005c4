"""`fit(cfg)`: the RL loop, one line per stage of the data path (see docs/architecture.md).

Every rank runs `fit`; rank 0 also drives the rollout engine, the metric sinks and the summary.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

from hapo_megatron.config import HapoConfig
from hapo_megatron.training import stages
from hapo_megatron.training.metrics.diagnostics import token_diagnostics
from hapo_megatron.training.metrics.host_cpu import HostCpuMeter
from hapo_megatron.training.metrics.perf import ModelFlops, step_perf_metrics
from hapo_megatron.training.metrics.sinks import read_jsonl
from hapo_megatron.training.checkpointing.checkpoint import step_dir_name
from hapo_megatron.training.checkpointing.preemption import (RunFailed, RunStopped, StopRequest,
                                                             cpu_group_over_world, shield_checkpoint_writer)
from hapo_megatron.training.build import build_runtime, setup_reference
from hapo_megatron.training.rollout_protocol import RolloutAbandoned
from hapo_megatron.training.run_records import SUMMARY, write_json_atomic
from hapo_megatron.training.runtime import Runtime, StepSnapshot
from hapo_megatron.training.sft import run_sft
from hapo_megatron.training.asynchronous.manager import start_rollout_producer, stop_rollout_producer


class TrainingStopped(RuntimeError):
    """The run stopped itself (e.g. too many consecutive skipped steps); the message says why."""


def fit(cfg: HapoConfig, *, tokenizer=None, datasets=None) -> dict[str, Any]:
    """Train with ``cfg`` (a `HapoConfig`); returns the run summary (same on every rank)."""
    from hapo_megatron.parallel.groups import initialize_parallel
    p = cfg.parallel
    groups = initialize_parallel(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                                 cp=p.context_parallel_size, ep=p.expert_model_parallel_size,
                                 etp=p.expert_tensor_parallel_size, seed=cfg.trainer.seed,
                                 timeout_minutes=cfg.trainer.dist_timeout_minutes)
    t = cfg.trainer
    shield_checkpoint_writer(t.exit_signals)
    stop = StopRequest(signals=t.exit_signals, grace_s=t.exit_grace_s, exit_after_minutes=t.exit_after_minutes,
                       group=cpu_group_over_world(t.control_timeout_minutes)).install()
    rt = None
    try:
        rt = build_runtime(cfg, groups, tokenizer=tokenizer, datasets=datasets)
        return _fit(cfg, rt, stop)
    finally:
        if rt is not None:  # an error: no request of the producer outlives the run
            stop_rollout_producer(rt)
        stop.uninstall()


def _fit(cfg: HapoConfig, rt: Runtime, stop: StopRequest) -> dict[str, Any]:
    """The loop. ``stop.agreed()`` marks the safe points: before a step (the previous one is
    finished), inside and after the rollout and after the old-log-prob pass (the step is
    abandoned: the model is unchanged until the update, the state of the last finished step is
    ``before``). Inside the rollout rank 0 alone decides (`stages.rollout`'s ``stop_check``)."""
    rl, t0, start_eval, sft_s = rt.rl, time.time(), {}, 0.0
    if not rl.sft_done and rl.step == 0 and cfg.trainer.sft_warmup_steps > 0:
        sft = run_sft(rt)
        sft_s = time.time() - t0
        rt.logger.write(f"warm start: {sft['step']} steps in {sft_s:.0f} s, final loss {sft['sft/loss']:.3f}")
    rl.sft_done = True
    setup_reference(rt)  # KL reference (algo.kl_loss_coef > 0 only)
    stages.sync_weights(rt)  # the engine starts from the actor (fresh, after SFT, or resumed)
    # rollout.max_staleness >= 1: the producer starts generating (rank 0); rollout.sync_producer:
    # process starts the manager the rollouts run in. The rollout manager process's crash or hang
    # stops the run at the next safe point, the last finished step saved
    start_rollout_producer(rt, on_failure=stop.fail)
    if cfg.trainer.val_before_train and rl.step == 0:
        start_eval = stages.evaluate(rt, 0)
        rt.logger.log(0, start_eval, advance=False)
    flops = ModelFlops.of(rt.hf_config)  # the update's model FLOPs (perf/model_tflops_per_gpu)
    host = HostCpuMeter()  # perf/host_*: this process's CPU per step (where the busy time goes)
    try:
        _steps(cfg, rt, stop, flops, host)
    finally:
        host.close()
    _stop_if_agreed(rt, stop)  # a stop during the last step: no final evaluation
    return _finish(rt, t0, start_eval, sft_s)


def _steps(cfg: HapoConfig, rt: Runtime, stop: StopRequest, flops: ModelFlops, host: HostCpuMeter) -> None:
    rl, timer = rt.rl, rt.timer
    for step in range(rl.step + 1, cfg.trainer.total_steps + 1):
        _stop_if_agreed(rt, stop)
        before = rt.snapshot()
        rl.step, t_step = step, time.time()
        try:
            with timer("rollout"):
                batch, metrics = stages.rollout(rt, step, stop_check=stop.requested_here)
        except RolloutAbandoned:  # rank 0 had a stop request, so every rank agrees here
            _stop_if_agreed(rt, stop, before)
            raise
        _stop_if_agreed(rt, stop, before)
        if len(batch) == 0:
            _skip(rt, step, metrics, "dynamic sampling kept no group")
            continue
        with timer("advantages"):
            adv, adv_metrics = stages.advantages(rt, batch)
        with timer("layout"):
            minis, layout_metrics = stages.layout(rt, batch, adv)
        with timer("old_logprob"):
            minis, step_entropy_stats, ent_metrics = stages.old_logprob_pass(rt, minis)
        _stop_if_agreed(rt, stop, before)
        minis, eda_metrics = stages.edge_eda(rt, minis, batch.meta)  # EDGE-GRPO: advantages x mean_g P / P_i
        ent_metrics = {**ent_metrics, **eda_metrics}
        with timer("update"):
            minis, upd_metrics = stages.ppo_update(rt, minis, step_entropy_stats)
        with timer("diagnostics"):  # diag/* metrics; rollouts/ every logging.save_rollouts_interval
            diag_metrics = token_diagnostics(rt, minis, batch.meta, step_entropy_stats, step)
        rl.rollout_entropy_stats = step_entropy_stats  # the next rollout's adaptive temperature uses them
        with timer("sync"):
            sync_metrics = stages.sync_weights(rt)
        metrics.update({**sync_metrics, **adv_metrics, **layout_metrics, **ent_metrics, **diag_metrics, **upd_metrics})
        if upd_metrics["actor/skipped_updates"] > 0:
            _skip(rt, step, metrics, "non-finite loss or gradient", logged=False)
        else:
            rl.consecutive_skips = 0
        if cfg.trainer.eval_interval and step % cfg.trainer.eval_interval == 0:
            with timer("eval"):
                metrics.update(stages.evaluate(rt, step))
        tokens = int(batch.meta.num_tokens.sum())
        elapsed = time.time() - t_step
        timings = timer.pop()
        metrics.update({**timings, **rt.data_metrics(), "perf/step_time_s": elapsed,
                        "perf/tokens_per_s": tokens / max(elapsed, 1e-9),
                        **step_perf_metrics(flops, batch.meta.num_tokens, step_s=elapsed,
                                            update_s=timings["timing/update_s"], num_gpus=rt.world_size,
                                            epochs=cfg.trainer.ppo_epochs),
                        "actor/consecutive_skips": float(rl.consecutive_skips), **host.pop()})
        rt.logger.log(step, metrics)
        _check_skips(rt)
        if cfg.trainer.save_interval and step % cfg.trainer.save_interval == 0:
            rt.save_checkpoint()


def _stop_if_agreed(rt: Runtime, stop: StopRequest, before: Optional[StepSnapshot] = None) -> None:
    """At a safe point: when the ranks agree to stop, save the last finished step (``before``
    when the current step is abandoned, else the current state) unless it is saved, shut the
    rollout engine down and raise `RunStopped` (collective: every rank calls it here)."""
    why = stop.agreed()
    if why is None:
        return
    step = before.step if before is not None else rt.rl.step
    saved = _saved_path(rt, step)
    if step > rt.start_step and saved is None:
        saved = rt.save_checkpoint(before)
    rt.logger.write(f"stopping: {why}; " + (f"step {step} is saved in {saved}" if saved else
                                            "no step finished since the start, nothing to save"))
    rt.logger.close()
    stop_rollout_producer(rt)
    if rt.engine is not None:
        rt.engine.shutdown()
    raise (RunFailed if stop.failed else RunStopped)(
        f"{why}: stopped after step {step}" + (f", saved in {saved}; continue with --resume auto"
                                               if saved else " (nothing to save)"))


def _saved_path(rt: Runtime, step: int) -> Optional[str]:
    path = os.path.join(rt.ckpt.root, step_dir_name(step)) if rt.ckpt.root else None
    return path if path and os.path.isdir(path) else None


def _skip(rt: Runtime, step: int, metrics: dict, why: str, logged: bool = True) -> None:
    rt.rl.consecutive_skips += 1
    rt.logger.write(f"step {step}: update skipped ({why}); {rt.rl.consecutive_skips} in a row")
    if logged:
        rt.logger.log(step, {**metrics, "actor/consecutive_skips": float(rt.rl.consecutive_skips)})
        _check_skips(rt)


def _check_skips(rt: Runtime) -> None:
    limit = rt.cfg.trainer.max_consecutive_skips
    if limit and rt.rl.consecutive_skips >= limit:
        raise TrainingStopped(
            f"{rt.rl.consecutive_skips} consecutive steps were skipped (no usable group after "
            f"dynamic sampling, or a non-finite loss/gradient); trainer.max_consecutive_skips={limit}. "
            "Lower optim.lr, check the reward/data, or raise algo.max_num_gen_batches.")


def _finish(rt: Runtime, t0: float, start_eval: dict, sft_s: float) -> dict[str, Any]:
    """Final checkpoint and evaluation, then the summary (printed and saved by rank 0)."""
    cfg = rt.cfg
    step = rt.rl.step
    stop_rollout_producer(rt)  # nothing more to train on; the final evaluation needs the servers
    if step > rt.start_step and _saved_path(rt, step) is None:
        rt.save_checkpoint()
    end_eval = stages.evaluate(rt, step) if cfg.trainer.val_at_end else {}
    if end_eval:
        rt.logger.log(step, end_eval, advance=False)
    summary = {**summarize(rt.run_dir, step, time.time() - t0, start_eval, end_eval), "sft_time_s": sft_s}
    rt.logger.close()
    if rt.is_main:
        summary = carry_summary(summary, rt.previous_summary, rt.start_step)
        write_json_atomic(os.path.join(rt.run_dir, SUMMARY), summary)
        print(format_summary(summary), flush=True)
    if rt.engine is not None:
        rt.engine.shutdown()
    if rt.scorer is not None:
        rt.scorer.close()
    return summary


def carry_summary(summary: dict[str, Any], previous: Optional[dict], start_step: int) -> dict[str, Any]:
    """The summary of a run resumed at ``start_step``: what happened before it (the evaluation
    before RL, the warm start) comes from the summary it set aside (``previous``), or, for the
    evaluation, from the step-0 lines of metrics.jsonl; the wall time adds the previous one when
    that summary ended where this run resumed (an extension by trainer.total_steps)."""
    if start_step == 0:
        return summary
    out = dict(summary)
    previous = previous or {}
    if not out["eval_start"]:
        out["eval_start"] = previous.get("eval_start") or {
            k: v for r in read_jsonl(os.path.join(summary["run_dir"], "metrics.jsonl")) if r.get("step") == 0
            for k, v in r.items() if k.startswith("eval/")}
    if not out.get("sft_time_s"):
        out["sft_time_s"] = previous.get("sft_time_s", 0.0)
    if previous.get("steps") == start_step and previous.get("wall_time_s") is not None:
        out["wall_time_s"] = summary["wall_time_s"] + previous["wall_time_s"]
    out["resumed_at_step"] = start_step
    return out


def summarize(run_dir: str, steps: int, wall_s: float, start_eval: dict, end_eval: dict,
              k: int = 5) -> dict[str, Any]:
    """First-vs-last-k-steps reward/accuracy from ``<run_dir>/metrics.jsonl``, wall time, evals."""
    recs = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
            if r.get("rollout/reward_mean") is not None]
    k = max(1, min(k, len(recs) // 2)) if recs else 0

    def mean(rows, key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None
    return {"run_dir": run_dir, "steps": steps, "wall_time_s": wall_s, "k": k,
            "first_reward_mean": mean(recs[:k], "rollout/reward_mean") if k else None,
            "last_reward_mean": mean(recs[-k:], "rollout/reward_mean") if k else None,
            "first_acc": mean(recs[:k], "rollout/acc") if k else None,
            "last_acc": mean(recs[-k:], "rollout/acc") if k else None,
            "eval_start": start_eval, "eval_end": end_eval}


def _headline_eval(ev: dict) -> dict[str, float]:
    """avg@k with the largest k per data source (``all`` only when there are several sources)."""
    best: dict[str, tuple[int, str, float]] = {}
    for key, v in ev.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[2].startswith("avg@") and parts[2][4:].isdigit():
            k = int(parts[2][4:])
            if parts[1] not in best or k > best[parts[1]][0]:
                best[parts[1]] = (k, key, v)
    if len(best) == 2 and "all" in best:
        best.pop("all")
    return {key: v for _, key, v in sorted(best.values(), key=lambda t: t[1])}


def format_summary(s: dict[str, Any]) -> str:
    def f(v, pct=False):
        return "n/a" if v is None else (f"{100 * v:.1f}%" if pct else f"{v:+.3f}")
    lines = ["", "=" * 64, f"run: {s['run_dir']}   steps: {s['steps']}   wall time: {s['wall_time_s'] / 60:.1f} min"
             + (f" (warm start {s['sft_time_s'] / 60:.1f} min)" if s.get("sft_time_s") else ""),
             f"reward mean   first {s['k']} steps: {f(s['first_reward_mean'])}   last {s['k']} steps: "
             f"{f(s['last_reward_mean'])}",
             f"accuracy      first {s['k']} steps: {f(s['first_acc'], True)}   last {s['k']} steps: "
             f"{f(s['last_acc'], True)}"]
    for name, ev in (("eval before RL", s["eval_start"]), ("eval after RL ", s["eval_end"])):
        accs = _headline_eval(ev)
        if accs:
            lines.append(f"{name}: " + ", ".join(f"{k} = {100 * v:.1f}%" for k, v in accs.items()))
    lines.append("=" * 64)
    return "\n".join(lines)
