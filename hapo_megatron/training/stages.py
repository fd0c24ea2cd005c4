"""The stages of one training step (one function each, in data-path order; see trainer.fit).

rollout (rank 0) -> sequences + advantages (every rank, same answer) -> micro-batch layout ->
old-log-prob pass + global entropy statistics -> PPO updates -> weight sync -> eval/checkpoint.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from hapo_megatron.training.actor import sum_metrics_across_ranks
from hapo_megatron.training.batching import build_rank_micro_batches, split_mini_batches
from hapo_megatron.training.rl_step import (RolloutBatch, rollout_metrics, score_samples, sequence_advantages,
                                            shape_rewards, to_sequences)
from hapo_megatron.training.runtime import Runtime, broadcast_object


def _stop_ids(rt: Runtime) -> list[int]:
    eos = getattr(rt.tokenizer, "eos_token_id", None)
    return [int(eos)] if eos is not None else []


def _generate_round(rt: Runtime, step: int, gen_index: int, group_offset: int) -> RolloutBatch:
    """One generation batch on rank 0: sample, score, shape."""
    from hapo_megatron.rollout.engine import SamplingParams
    cfg = rt.cfg
    records = rt.sampler.next_batch()
    params = SamplingParams.from_config(cfg.rollout, cfg.algo, entropy_stats=rt.entropy_stats,
                                        seed=rt.sampling_seed(step, gen_index), stop_token_ids=_stop_ids(rt))
    samples = rt.engine.generate([r.prompt_ids for r in records], params)
    batch = score_samples(samples, records, reward_fn=rt.reward_fn,
                          decode=lambda ids: rt.tokenizer.decode(ids, skip_special_tokens=True),
                          score_format=cfg.reward.score_format, group_offset=group_offset,
                          reward_kwargs=cfg.reward.reward_kwargs)
    return shape_rewards(batch, max_response_length=cfg.rollout.max_response_length,
                         overlong_buffer_enable=cfg.reward.overlong_buffer_enable,
                         overlong_buffer_len=cfg.reward.overlong_buffer_len,
                         overlong_penalty_factor=cfg.reward.overlong_penalty_factor)


def rollout(rt: Runtime, step: int) -> tuple[RolloutBatch, dict[str, float]]:
    """Generate, score and filter (dynamic sampling) until the step's batch is full; rank 0 works,
    every rank receives the kept batch. ``rollout/*`` metrics cover every generated response.

    Colocated, every rank first offloads its trainer state (`training.offload`) and reloads it
    after. The other ranks wait in `wait_for_rank0`, which rank 0 answers after every generation
    round, so no collective wait lasts longer than one round (trainer.dist_timeout_minutes)."""
    with trainer_offloaded(rt):
        if not rt.is_main:
            packed, metrics, sampler_state = wait_for_rank0(rt)
        else:
            try:
                packed, metrics, sampler_state = _rollout_rank0(rt, step)
            except BaseException as e:
                _tell_others(("error", f"{type(e).__name__}: {e}"))  # the others stop too
                raise
            broadcast_object(("done", (packed, metrics, sampler_state)))
    rt.sampler.load_state_dict(sampler_state)
    return RolloutBatch.unpack(packed), metrics


def _rollout_rank0(rt: Runtime, step: int):
    target = rt.cfg.data.train_batch_size
    resume_engine(rt)  # the KV cache (the weights came back in sync_weights)
    rt.dyn.reset()
    generated, offset = [], 0
    while True:
        b = _generate_round(rt, step, rt.dyn.num_gen_batches, offset)
        generated.append(b)
        offset += len(set(b.group_ids))
        rt.dyn.add(b)
        if not rt.dyn.needs_more(target):
            break
        broadcast_object(("progress", {"step": step, "round": rt.dyn.num_gen_batches}))  # heartbeat
    kept = rt.dyn.take(target)
    # colocated engines give the accelerator back to the actor; the weights go too unless the step
    # is skipped (no weight sync follows then, and released weights are not kept)
    release_engine(rt, None if len(kept) else [t for t in ENGINE_MEMORY_TAGS if t != "weights"])
    metrics = {**rollout_metrics(RolloutBatch.concat(generated),
                                 max_response_length=rt.cfg.rollout.max_response_length),
               **rt.dyn.metrics(),
               "batch/reward_mean": sum(kept.rewards) / max(len(kept), 1),
               "batch/acc": sum(kept.accs) / max(len(kept), 1),
               "batch/num_groups": float(len(set(kept.group_ids)))}
    return kept.pack(), metrics, rt.sampler.state_dict()


def wait_for_rank0(rt: Runtime):
    """Non-zero ranks: receive rank 0's heartbeats until its ("done", payload); its ("error", msg)
    raises here too, so a failed rollout (or evaluation) stops every rank instead of leaving them
    waiting."""
    while True:
        kind, body = broadcast_object(None)
        if kind == "done":
            return body
        if kind == "error":
            raise RuntimeError(f"rank 0 failed during the rollout or evaluation: {body}")


@contextmanager
def trainer_offloaded(rt: Runtime):
    """Every rank: the actor's state in host memory (when `rt.offloader` is set) and the caching
    allocator emptied, so the colocated servers can use the GPU; reloaded on exit."""
    off = rt.offloader
    if off is not None:
        off.offload()
    _empty_cache()
    if off is not None and dist.is_initialized():
        dist.barrier()  # every GPU is free before rank 0 resumes the servers' memory
    try:
        yield
    finally:
        if off is not None:
            off.reload()


ENGINE_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's memory-saver regions


def _takes_tags(method) -> bool:
    import inspect
    try:
        return "tags" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def release_engine(rt: Runtime, tags=None) -> None:
    """``engine.release_memory`` of ``tags`` (all when None or when the engine takes no tags),
    remembered in ``rt.engine_released`` so that `resume_engine` resumes exactly those (SGLang
    refuses to resume a region that is not released)."""
    tags = tuple(tags or ENGINE_MEMORY_TAGS)
    if not _takes_tags(rt.engine.release_memory) or set(tags) == set(ENGINE_MEMORY_TAGS):
        rt.engine.release_memory()
        rt.engine_released = set(ENGINE_MEMORY_TAGS)
        return
    todo = [t for t in tags if t not in rt.engine_released]
    if todo:
        rt.engine.release_memory(tags=todo)
        rt.engine_released |= set(todo)


def resume_engine(rt: Runtime, tags=None) -> None:
    """Resume the released regions among ``tags`` (None = all released ones); an engine without
    tags resumes everything at once."""
    want = set(ENGINE_MEMORY_TAGS if tags is None else tags) & rt.engine_released
    if not want:
        return
    if not _takes_tags(rt.engine.resume_memory):
        rt.engine.resume_memory()
        rt.engine_released = set()
        return
    rt.engine.resume_memory(tags=[t for t in ENGINE_MEMORY_TAGS if t in want])
    rt.engine_released -= want


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _pad_multiple(rt: Runtime) -> int:
    g, m = rt.groups, 1
    if rt.cfg.parallel.sequence_parallel and g.tp_size > 1:
        m = math.lcm(m, g.tp_size)
    if g.cp_size > 1:
        m = math.lcm(m, 2 * g.cp_size)
    return m


def layout(rt: Runtime, batch: RolloutBatch) -> tuple[list[list[dict]], dict[str, float]]:
    """Advantages from per-sequence (reward, length, group) and this rank's micro-batches of each
    PPO mini-batch (DP-balanced by token count; identical assignment on every rank)."""
    cfg, g = rt.cfg, rt.groups
    adv, metrics = sequence_advantages(batch.rewards, batch.response_lengths, batch.group_ids,
                                       adv_estimator=cfg.algo.adv_estimator,
                                       norm_adv_by_std=cfg.algo.norm_adv_by_std,
                                       fallback_threshold=cfg.algo.tlga_fallback_threshold)
    seqs = to_sequences(batch, adv)
    minis = split_mini_batches(list(dict.fromkeys(batch.group_ids)), batch.group_ids,
                               cfg.trainer.ppo_mini_batch_size)
    mbs = [build_rank_micro_batches([seqs[i] for i in idx], dp_rank=g.dp_rank, dp_size=g.dp_size,
                                    micro_batch_size=cfg.parallel.micro_batch_size,
                                    max_tokens_per_micro_batch=cfg.parallel.max_tokens_per_micro_batch,
                                    pad_multiple=_pad_multiple(rt)) for idx in minis]
    for mb in (mb for mini in mbs for mb in mini):  # rows whose engine reported temperatures (HF)
        mb["engine_reported_temperatures"] = torch.tensor(
            [i >= 0 and len(batch.temperatures[i]) > 0 for i in mb["seq_index"].tolist()], dtype=torch.bool)
    return mbs, metrics


def recompute_temperatures(rt: Runtime, micro_batches: list[dict]) -> dict[str, float]:
    """Per-token sampling temperatures, recomputed trainer-side for every engine (SGLang cannot
    report them): the engine's rule ``T = T_base * (1 + tau * h_hat(H))`` applied to the
    old-policy entropy at T_base (the rollout policy's weights) with the statistics the rollout
    used (``rt.entropy_stats``, the previous step's); plain ``T_base`` when the rollout was not
    adaptive. ``mb["temperatures"]`` keeps the engine's own values where it reported them (what was
    really used; HF engine) and gets the recomputed ones elsewhere (SGLang); returns token sums for
    the metrics, including the absolute difference between the two where both exist."""
    from hapo_megatron.algo import normalize_entropy
    from hapo_megatron.rollout.engine import SamplingParams
    params = SamplingParams.from_config(rt.cfg.rollout, rt.cfg.algo, entropy_stats=rt.entropy_stats)
    t_base = float(params.temperature)
    sums = {"t_n": 0.0, "t_sum": 0.0, "t_sq": 0.0, "t_diff": 0.0, "t_diff_n": 0.0}
    for mb in micro_batches:
        mask = mb["loss_mask"] != 0
        ent = mb["old_entropy"].float()
        temps = torch.full_like(ent, t_base)
        if params.uses_adaptive:
            h_hat = normalize_entropy(ent, params.entropy_stats, params.h_hat_mode)
            temps = t_base * (1.0 + params.temperature_tau * h_hat.float())
        temps = torch.where(mask, temps, torch.ones_like(temps))
        reported = mb.get("engine_reported_temperatures")
        if reported is not None:
            both = mask & reported.unsqueeze(-1)
            sums["t_diff"] += float(((temps - mb["temperatures"]).abs() * both).sum())
            sums["t_diff_n"] += float(both.sum())
            temps = torch.where(both, mb["temperatures"], temps)
        mb["temperatures"] = temps
        sums["t_n"] += float(mask.sum())
        sums["t_sum"] += float((temps * mask).sum())
        sums["t_sq"] += float((temps.double() ** 2 * mask).sum())
    return sums


def _temperature_metrics(tot: dict[str, float]) -> dict[str, float]:
    n = tot.get("t_n", 0.0)
    if not n:
        return {}
    mean = tot["t_sum"] / n
    out = {"rollout/temperature_mean": mean,
           "rollout/temperature_std": math.sqrt(max(tot["t_sq"] / n - mean ** 2, 0.0))}
    if tot.get("t_diff_n"):
        out["rollout/temperature_engine_abs_diff"] = tot["t_diff"] / tot["t_diff_n"]
    return out


def old_logprob_pass(rt: Runtime, minis: list[list[dict]]):
    """Old log-probs + entropies at T_base for every micro-batch, the exact global entropy
    statistics, and the rollout/training mismatch. Returns (EntropyStats, metrics)."""
    from hapo_megatron.algo import EntropyStats
    from hapo_megatron.parallel.stats import global_entropy_stats
    cfg, g = rt.cfg, rt.groups
    all_mbs = [mb for mini in minis for mb in mini]
    chunk = loss_config(rt).logprob_chunk_size
    rt.actor.compute_logprobs_entropy(all_mbs, temperature=cfg.rollout.temperature, chunk_size=chunk)
    if rt.reference is not None:
        rt.actor.compute_logprobs_entropy(all_mbs, temperature=cfg.rollout.temperature, model=rt.reference,
                                          keys=("ref_logprobs", "ref_entropy"), chunk_size=chunk)
    sums: dict[str, float] = {}
    stats = None
    if g.is_pipeline_last:
        ent = torch.cat([mb["old_entropy"].reshape(-1) for mb in all_mbs])
        mask = torch.cat([mb["loss_mask"].reshape(-1) for mb in all_mbs])
        # the actor gathered the CP chunks: every CP rank holds whole sequences, so the token set
        # is spread over DP only (reducing over DP x CP would count each token cp_size times)
        stats = global_entropy_stats(ent, mask, group=g.dp, entropy_pivot=cfg.algo.entropy_pivot)
        diff = sum(float(((mb["old_logprobs"] - mb["rollout_logprobs"]).abs() * mb["loss_mask"]).sum())
                   for mb in all_mbs)
        sums = {"n": float(mask.sum()), "ent": float((ent * mask).sum()), "diff": diff,
                **recompute_temperatures(rt, all_mbs)}
        if cfg.algo.old_logprob_source == "rollout":
            for mb in all_mbs:  # keep the recomputed ones: the diagnostics' first-update ratio
                mb["recomputed_logprobs"] = mb["old_logprobs"]
                mb["old_logprobs"] = mb["rollout_logprobs"] * mb["loss_mask"]
    if g.pp_size > 1:  # the rollout (rank 0, first stage) needs the statistics
        last = dist.get_global_rank(g.pp, g.pp_size - 1)
        stats = broadcast_object(stats.to_dict() if stats is not None else None, src=last, group=g.pp)
        stats = EntropyStats.from_dict(stats)
    tot = sum_metrics_across_ranks(sums, contribute=rt.contributes_metrics and g.is_pipeline_last)
    n = max(tot.get("n", 0.0), 1.0)
    metrics = {"entropy/mean": tot.get("ent", 0.0) / n, "rollout/logprob_abs_diff": tot.get("diff", 0.0) / n,
               **{f"entropy/{k}": float(v) for k, v in stats.to_dict().items()}, **_temperature_metrics(tot)}
    return stats, metrics


def micro_batch_token_fields(mb: dict, stats, algo) -> dict[str, torch.Tensor]:
    """Per-token HAPO quantities of one micro-batch after the old-log-prob pass, all `[b, s]`:
    `ratio` and `h_hat`, `adv_after`, `clip_low/high/dual` of `diagnostics.hapo_token_fields`.

    `ratio` is the importance ratio the FIRST PPO update sees (before any optimizer step):
    exp(recomputed - old), i.e. exactly 1 with old_logprob_source "recompute" and
    exp(recomputed - rollout) with "rollout". Later updates' ratios live inside the loss; their
    clip fractions are the `loss/clipfrac_*` metrics. h_hat uses the old (T_base) entropy.
    """
    from hapo_megatron.diagnostics import hapo_token_fields
    mask = mb["loss_mask"] != 0
    old = mb["old_logprobs"]
    ratio = torch.where(mask, torch.exp(mb.get("recomputed_logprobs", old) - old), torch.ones_like(old))
    fields = hapo_token_fields(mb["old_entropy"], stats, mb["advantages"], ratio,
                               clip_ratio_low=algo.clip_ratio_low, clip_ratio_high=algo.clip_ratio_high,
                               clip_ratio_c=algo.clip_ratio_c, adaptive_clip=algo.adaptive_clip,
                               clip_alpha=algo.clip_alpha, adaptive_advantage=algo.adaptive_advantage,
                               adv_beta=algo.adv_beta, h_hat_mode=algo.h_hat_mode)
    return {"ratio": ratio, **fields}


def accumulate_token_diagnostics(micro_batches: list[dict], stats, algo, *,
                                 finish_reasons: list[str] | None = None, with_clips: bool = True):
    """`TokenDiagnostics` over the valid tokens of `micro_batches` (old-log-prob pass done) and
    the response lengths of their real sequences (`seq_index >= 0`; truncated = finish reason
    "length" in `finish_reasons[seq_index]`). Clip flags (first-update ratio, see
    `micro_batch_token_fields`) only with `with_clips`."""
    from hapo_megatron.diagnostics import TokenDiagnostics
    diag = TokenDiagnostics()
    for mb in micro_batches:
        f = micro_batch_token_fields(mb, stats, algo)
        mask = mb["loss_mask"] != 0
        clips = {k: f[k] for k in ("clip_low", "clip_high", "clip_dual")} if with_clips else {}
        diag.update_tokens(entropy=mb["old_entropy"], h_hat=f["h_hat"], mask=mask, token_ids=mb["labels"],
                           adv_before=mb["advantages"], adv_after=f["adv_after"],
                           temperatures=mb["temperatures"], **clips)
        idx = mb["seq_index"].tolist()
        real = [r for r, i in enumerate(idx) if i >= 0]
        diag.update_responses(mask[real].sum(dim=1), None if finish_reasons is None else
                              [finish_reasons[idx[r]] == "length" for r in real])
    return diag


def rollout_records(micro_batches: list[dict], batch: RolloutBatch, stats, algo, step: int) -> list[dict]:
    """Saved-rollout records (`diagnostics.ROLLOUT_FIELDS`, plus `index` in the step's batch) of
    the real sequences of `micro_batches`."""
    out = []
    for mb in micro_batches:
        f = micro_batch_token_fields(mb, stats, algo)
        per_tok = {"entropy": mb["old_entropy"], "h_hat": f["h_hat"], "adv_before": mb["advantages"],
                   "adv_after": f["adv_after"], "ratio": f["ratio"], "clip_low": f["clip_low"],
                   "clip_high": f["clip_high"], "clip_dual": f["clip_dual"], "temperatures": mb["temperatures"]}
        for r, i in enumerate(mb["seq_index"].tolist()):
            if i < 0:
                continue
            m = mb["loss_mask"][r] != 0
            rec = {"step": step, "index": i, "uid": int(batch.group_ids[i]), "data_source": batch.data_sources[i],
                   "reward": float(batch.rewards[i]), "acc": bool(batch.accs[i]),
                   "finish_reason": batch.finish_reasons[i], "response_ids": mb["labels"][r][m].tolist()}
            rec.update({k: v[r][m].tolist() for k, v in per_tok.items()})
            out.append(rec)
    return out


def token_diagnostics(rt: Runtime, minis: list[list[dict]], batch: RolloutBatch, stats,
                      step: int) -> dict[str, float]:
    """``diag/*`` metrics of the step (same on every rank) and, every
    ``logging.save_rollouts_interval`` steps, ``<run_dir>/rollouts/step_<step>.jsonl`` (rank 0).

    The old-log-prob pass left whole (CP-gathered) sequences on every TP/CP rank of the last
    stage, so only TP rank 0 / CP rank 0 of the last stage contributes and the sum runs over the
    world (= over DP among contributors, and it reaches rank 0 on the first stage too).
    """
    import math as _math
    from hapo_megatron.diagnostics import TokenDiagnostics, rollout_path, write_rollouts
    cfg, g = rt.cfg, rt.groups
    mbs = [mb for mini in minis for mb in mini]
    contribute = rt.contributes_metrics and g.cp_rank == 0
    # first-update ratios are exactly 1 with a recomputed old policy: no clip information there
    with_clips = cfg.algo.old_logprob_source == "rollout"
    diag = (accumulate_token_diagnostics(mbs, stats, cfg.algo, finish_reasons=batch.finish_reasons,
                                         with_clips=with_clips) if contribute else TokenDiagnostics())
    if dist.is_initialized() and dist.get_world_size() > 1:
        diag.all_reduce()
    metrics = {**diag.summary(pivot=_math.exp(stats.pivot)), **entropy_histogram_summary(diag)}
    every = cfg.logging.save_rollouts_interval
    if every and step % every == 0:
        rows = rollout_records(mbs, batch, stats, cfg.algo, step) if contribute else []
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size() if rt.is_main else None
            dist.gather_object(rows, gathered, dst=0)
            rows = [r for part in (gathered or []) for r in part]
        if rt.is_main:
            write_rollouts(rollout_path(rt.run_dir, step), sorted(rows, key=lambda r: r["index"]))
    return metrics


def entropy_histogram_summary(diag, prefix: str = "diag") -> dict[str, float]:
    """The entropy histogram in three numbers: shares of tokens below 1e-3 and 0.1 nats and at or
    above 1 nat (all bin edges of `diagnostics.ENTROPY_BIN_EDGES`)."""
    total = int(diag.entropy_hist.sum())
    if not total:
        return {}
    rows = diag.histogram()
    share = lambda pred: sum(r["count"] for r in rows if pred(r)) / total  # noqa: E731
    return {f"{prefix}/entropy_frac_lt_1e-3": share(lambda r: r["hi"] <= 1e-3 * (1 + 1e-9)),
            f"{prefix}/entropy_frac_lt_0.1": share(lambda r: r["hi"] <= 0.1 * (1 + 1e-9)),
            f"{prefix}/entropy_frac_ge_1": share(lambda r: r["lo"] >= 1.0 * (1 - 1e-9))}


def loss_config(rt: Runtime):
    """`LossConfig` of the run; the seq-mean-token-sum-norm horizon is the maximum response length
    (a constant, so the normalisation does not depend on how sequences are padded)."""
    from hapo_megatron.parallel.loss import LossConfig
    return LossConfig.from_algo(rt.cfg.algo, loss_scale_factor=float(rt.cfg.rollout.max_response_length))


def policy_loss_factory(rt: Runtime, stats):
    """``make_loss(mb)`` for `MegatronActor.train_step` with the HAPO loss of `parallel.loss`."""
    from hapo_megatron.parallel.loss import make_loss_func
    loss_cfg = loss_config(rt)
    g = rt.groups
    return lambda mb: make_loss_func(mb, cfg=loss_cfg, stats=stats, tp_group=g.tp,
                                     cp_group=g.cp if g.cp_size > 1 else None,
                                     temperature=rt.cfg.rollout.temperature)


def ppo_update(rt: Runtime, minis: list[list[dict]], stats) -> dict[str, float]:
    """``trainer.ppo_epochs`` passes of one optimizer step per mini-batch; loss metrics are
    token-weighted over the whole step and every rank."""
    from hapo_megatron.algo import finalize_loss_metrics
    make_loss = policy_loss_factory(rt, stats)
    sums: dict[str, Any] = {}
    norms, skipped, lr = [], 0, 0.0
    for _ in range(rt.cfg.trainer.ppo_epochs):
        for mbs in minis:
            res = rt.actor.train_step(mbs, make_loss)
            for k, v in res.metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            skipped += int(res.skipped)
            lr = res.lr
            if not res.skipped:
                norms.append(res.grad_norm)
    tot = sum_metrics_across_ranks(sums, contribute=rt.contributes_metrics)
    return {**finalize_loss_metrics(tot), "actor/grad_norm": sum(norms) / max(len(norms), 1),
            "actor/lr": lr, "actor/skipped_updates": float(skipped),
            "actor/num_updates": float(len(minis) * rt.cfg.trainer.ppo_epochs)}


def sync_weights(rt: Runtime) -> None:
    """Stream the actor's weights (HF names, gathered over TP/PP) into the rollout engine."""
    dtype = getattr(rt.engine, "dtype", None) if rt.engine is not None else None
    named = rt.actor.export_hf_weights(dtype=dtype)
    _empty_cache()  # what the trainer's allocator holds unused goes back before the servers resume
    if rt.engine is not None:
        resume_engine(rt, tags=["weights"])  # the KV cache comes back in rollout, after the offload
        rt.engine.update_weights(named)
    for _ in named:  # every rank consumes the generator fully (it runs collectives)
        pass


def evaluate(rt: Runtime, step: int) -> dict[str, float]:
    """Validation on rank 0 (fixed temperature, val_n samples); {} elsewhere or without val files.
    Colocated, every rank keeps its trainer state offloaded until rank 0 is done (the servers
    span every GPU), waiting for it like during a rollout."""
    if rt.val_ds is None:
        return {}
    with trainer_offloaded(rt):
        if not rt.is_main:
            wait_for_rank0(rt)
            return {}
        try:
            resume_engine(rt)
            try:
                out = _evaluate_rank0(rt)
            finally:  # keep the synced weights: only the rest goes
                release_engine(rt, tags=[t for t in ENGINE_MEMORY_TAGS if t != "weights"])
        except BaseException as e:
            _tell_others(("error", f"{type(e).__name__}: {e}"))
            raise
        _tell_others(("done", None))
        return out


def _tell_others(message) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        broadcast_object(message)


def _evaluate_rank0(rt: Runtime) -> dict[str, float]:
    from hapo_megatron.rollout.engine import SamplingParams
    from hapo_megatron.training.evaluation import evaluate as run_eval
    cfg = rt.cfg
    records = list(rt.val_ds)
    if cfg.data.val_max_samples:
        records = records[: cfg.data.val_max_samples]
    params = SamplingParams.from_config(cfg.rollout, cfg.algo, validation=True, seed=cfg.trainer.seed,
                                        stop_token_ids=_stop_ids(rt))
    return run_eval(rt.engine, records, rt.reward_fn, params, tokenizer=rt.tokenizer,
                    reward_kwargs={"score_format": cfg.reward.score_format, **cfg.reward.reward_kwargs})
