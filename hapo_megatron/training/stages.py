"""The stages of one training step (one function each, in data-path order; see trainer.fit).

rollout (rank 0; each rank receives its share) -> advantages (every rank, same answer) ->
micro-batch layout -> old-log-prob pass + global entropy statistics -> PPO updates -> weight sync
-> eval/checkpoint.

Between the stages travel typed values: this rank's `RankBatch` (every sequence's metadata, the
per-token data of the sequences it trains on) and the advantages, then this rank's micro-batches of each
PPO mini-batch (`Minis`, lists of `MicroBatch`). A stage returns new micro-batches with the fields
it adds (`MicroBatch.with_`); it never edits the ones it was given.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from hapo_megatron.algo import EntropyStats, PolicyTokenFields, temperature_from_entropy
from hapo_megatron.parallel.collectives import all_gather_objects, broadcast_object, scatter_objects, sum_metrics
from hapo_megatron.parallel.loss import DEFAULT_LOGPROB_CHUNK, TokenSink
from hapo_megatron.parallel.micro_batch import MicroBatch
from hapo_megatron.rewards.counts import RewardCounts
from hapo_megatron.rollout.engine import GenerationAborted, SamplingParams, drain_weights
from hapo_megatron.training.actor import LossFactory
from hapo_megatron.training.batches.micro_batches import PadMultiples, collate_micro_batches, token_efficiency
from hapo_megatron.training.memory.engine_memory import empty_cache
from hapo_megatron.training.batches.rollout_batch import (RolloutBatch, build_batch, rollout_metrics,
                                                          sequence_advantages, shape_rewards)
from hapo_megatron.training.batches.route_share import route_dtype, stage_layer_range, stage_routes
from hapo_megatron.training.batches.rollout_share import (MiniPlan, RankBatch, SequenceMeta, held_sequences,
                                                          split_for_ranks, step_plan)
from hapo_megatron.training.guided_correction import GecCounts, continuation_seed, correct_round
from hapo_megatron.training.rollout_protocol import ABANDONED, DONE, ERROR, PROGRESS, RolloutAbandoned
from hapo_megatron.training.runtime import Runtime

Minis = list[list[MicroBatch]]  # this rank's micro-batches of each PPO mini-batch, in training order


def _stop_ids(rt: Runtime) -> list[int]:
    eos = getattr(rt.tokenizer, "eos_token_id", None)
    return [int(eos)] if eos is not None else []


def fetches_routes(rt: Runtime, step: int) -> bool:
    """The step's rollouts ask the engine for its routes: always with replay; when only measuring
    the mismatch, in ``model.routing_mismatch_fraction`` of the steps, evenly (step ``k`` when
    ``floor(k * f)`` rises)."""
    if rt.actor.routing == "replay":
        return True
    if rt.actor.routing != "measure":
        return False
    f = rt.cfg.model.routing_mismatch_fraction
    return math.floor(step * f) > math.floor((step - 1) * f)


def _generate_round(rt: Runtime, step: int, gen_index: int, group_offset: int,
                    counts: RewardCounts, gec: Optional[GecCounts] = None) -> RolloutBatch:
    """One generation batch on rank 0: sample while the reward workers score what is done
    (failures and waiting into ``counts``), correct the wrong responses (``algo.edge_gec``, counted
    in ``gec``), shape."""
    cfg = rt.cfg
    records = rt.rl.sampler.next_batch()
    params = SamplingParams.from_config(cfg.rollout, cfg.algo, entropy_stats=rt.rl.rollout_entropy_stats,
                                        seed=rt.sampling_seed(step, gen_index), stop_token_ids=_stop_ids(rt))
    params = params.with_(return_routes=fetches_routes(rt, step))  # MoE: the experts of every token
    def decode(ids):
        return rt.tokenizer.decode(ids, skip_special_tokens=True)
    scoring = rt.scorer.start(records, decode=decode)
    samples = rt.engine.generate([r.prompt_ids for r in records], params, on_samples=scoring.add)
    results = scoring.results(samples, counts)
    if cfg.algo.edge_gec:  # EDGE-GRPO's guided error correction (training/guided_correction.py)
        samples, results = _guided_correction(rt, samples, results, records, params, counts,
                                              gec if gec is not None else GecCounts(), decode)
    batch = build_batch(samples, records, results, group_offset=group_offset)
    return shape_rewards(batch, max_response_length=cfg.rollout.max_response_length,
                         overlong_buffer_enable=cfg.reward.overlong_buffer_enable,
                         overlong_buffer_len=cfg.reward.overlong_buffer_len,
                         overlong_penalty_factor=cfg.reward.overlong_penalty_factor)


def _guided_correction(rt: Runtime, samples, results, records, params: SamplingParams, counts: RewardCounts,
                       gec: GecCounts, decode):
    """`guided_correction.correct_round` with this run's engine (the round's sampling, one sample
    per corrected row, a seed of its own), tokenizer and reward."""
    def continue_fn(inputs: list[list[int]], max_new_tokens: int):
        p = params.with_(n=1, max_new_tokens=max_new_tokens, return_routes=False,
                         seed=None if params.seed is None else continuation_seed(params.seed))
        return [group[0] for group in rt.engine.generate(inputs, p)]

    def score_fn(fixed, recs):
        return rt.scorer.start(recs, decode=decode).results(fixed, counts)

    return correct_round(samples, results, records, algo=rt.cfg.algo, seed=params.seed or 0,
                         max_response_length=rt.cfg.rollout.max_response_length, stop_ids=_stop_ids(rt),
                         encode=lambda text: rt.tokenizer.encode(text, add_special_tokens=False),
                         continue_fn=continue_fn, score_fn=score_fn, counts=gec)


def rollout(rt: Runtime, step: int, stop_check: Optional[Callable[[], bool]] = None
            ) -> tuple[RankBatch, dict[str, float]]:
    """Generate, score and filter (dynamic sampling) until the step's batch is full; rank 0 works,
    every rank receives its share of the kept batch (`_share_out`). ``rollout/*`` metrics cover
    every generated response.

    ``stop_check`` (rank 0: this rank has a stop request, training/checkpointing/preemption.py) is asked before
    every generation round and, by an SGLang engine, while it waits on the servers (their requests
    are then aborted): True gives the rollout up and every rank raises `RolloutAbandoned`, so a
    stop is honoured within about a second of its arrival, not after up to 16 rounds.

    Colocated, every rank first offloads its trainer state (`training.offload`) and reloads it
    after. The other ranks wait on ``rt.control`` (training/rollout_protocol.py: a CPU group,
    heartbeats from rank 0 during every round), never in a collective of the trainer's groups."""
    kept = None
    with rt.memory.trainer_offloaded():
        if not rt.is_main:
            meta, metrics, sampler_state = rt.control.wait()
        else:
            try:
                with rt.control.heartbeats({"step": step}):
                    kept, metrics, sampler_state = (_rollout_rank0(rt, step, stop_check)
                                                    if rt.async_rollout is None else _take_async(rt, step, stop_check))
            except (RolloutAbandoned, GenerationAborted) as e:
                _release_after_abandon(rt)
                rt.control.send(ABANDONED, str(e))
                raise RolloutAbandoned(str(e)) from None
            except BaseException as e:
                rt.control.send(ERROR, f"{type(e).__name__}: {e}")  # the others stop too
                raise
            meta = SequenceMeta.of(kept)
            rt.control.send(DONE, (meta, metrics, sampler_state))
    _apply_sampler_state(rt, sampler_state)
    return _share_out(rt, kept, meta), metrics


def _release_after_abandon(rt: Runtime) -> None:
    """Rank 0, the rollout given up: colocated servers hand the accelerator back before the trainer
    state reloads for the save (best effort: the run is stopping)."""
    try:
        rt.memory.release_generation()
    except Exception as e:  # noqa: BLE001 - the save matters more; the servers are shut down next
        warnings.warn(f"after the abandoned rollout the engine did not release its memory: {e}")


@contextmanager
def _engine_stop_check(engine, stop_check: Optional[Callable[[], bool]]) -> Iterator[None]:
    """``engine.stop_check`` set for the rollout only (SGLang engines poll it while waiting; an
    evaluation is never abandoned; the HF engine does not poll it and finishes the round it is in)."""
    if stop_check is None:
        yield
        return
    engine.stop_check = stop_check
    try:
        yield
    finally:
        engine.stop_check = None


def _take_async(rt: Runtime, step: int, stop_check: Optional[Callable[[], bool]] = None
                ) -> tuple[RolloutBatch, dict[str, float], dict]:
    """Rank 0 under ``rollout.max_staleness >= 1``: the step's batch from the producer's buffer
    (training/asynchronous/producer.py), ``stop_check`` asked while it waits; the checkpoint state
    and per-sequence sampling statistics travel with it to every rank."""
    kept, metrics, snapshot, seq_stats = rt.async_rollout.take_step(step, stop_check)
    return kept, metrics, {"async": snapshot, "sequence_sampling_stats": seq_stats}


def _apply_sampler_state(rt: Runtime, state: dict) -> None:
    """Every rank takes rank 0's sampler cursor; asynchronous rollouts keep it (and the prompts in
    flight) as the state to checkpoint instead: rank 0's live sampler runs ahead in the producer.
    Over-sampling (training/partial_rollouts.py) also hands over each sequence's entropy statistics."""
    if "partial" in state:
        rt.rl.sampler.load_state_dict(state["sampler"])
        rt.rl.sequence_sampling_stats = state["sequence_sampling_stats"]
        return
    if "async" not in state:
        rt.rl.sampler.load_state_dict(state)
        return
    rt.rl.async_state = state["async"]
    rt.rl.sequence_sampling_stats = state["sequence_sampling_stats"]


def _rollout_rank0(rt: Runtime, step: int, stop_check: Optional[Callable[[], bool]] = None
                   ) -> tuple[RolloutBatch, dict[str, float], dict]:
    """The synchronous loop's rollout on rank 0: `generate_step` here, or in the rollout manager
    process (``rollout.sync_producer: process``), with the memory moves of colocated servers here."""
    if rt.sync_manager is None:
        return generate_step(rt, step, stop_check)
    rt.memory.resume_generation()  # the KV cache (the weights came back in sync_weights)
    kept, metrics, state, rt.rl.partial_rollouts = rt.sync_manager.rollout_step(
        step, rt.rl.sampler.state_dict(), rt.rl.rollout_entropy_stats, rt.rl.partial_rollouts, stop_check)
    if len(kept):  # as generate_step does: the accelerator back to the actor, the weights too unless skipped
        rt.memory.release_all()
    else:
        rt.memory.release_generation()
    return kept, metrics, state


def generate_step(rt: Runtime, step: int, stop_check: Optional[Callable[[], bool]] = None
                  ) -> tuple[RolloutBatch, dict[str, float], dict]:
    """Generate, score and filter until the step's batch is full (rank 0, or the rollout manager
    with ``rollout.sync_producer: process``): the kept batch, the metrics, the sampler state."""
    if rt.cfg.rollout.over_sampling > 1.0:  # abort the long tail, resume it next step
        from hapo_megatron.training.partial_rollouts import rollout_rank0
        return rollout_rank0(rt, step, stop_check, _stop_ids(rt))
    target = rt.cfg.data.train_batch_size
    rt.memory.resume_generation()  # the KV cache (the weights came back in sync_weights)
    dyn = rt.rl.dyn
    dyn.reset()
    generated, offset, counts, gec = [], 0, RewardCounts(), GecCounts()
    with _engine_stop_check(rt.engine, stop_check):
        while True:
            if stop_check is not None and stop_check():
                raise RolloutAbandoned(f"stop requested before generation round {dyn.num_gen_batches + 1} of step "
                                       f"{step}")
            b = _generate_round(rt, step, dyn.num_gen_batches, offset, counts, gec)
            generated.append(b)
            offset += len(set(b.group_ids))
            dyn.add(b)
            if not dyn.needs_more(target):
                break
            rt.control.send(PROGRESS, {"step": step, "round": dyn.num_gen_batches})
    kept = dyn.take(target)
    # colocated engines give the accelerator back to the actor; the weights go too unless the step
    # is skipped (no weight sync follows then, and released weights are not kept)
    if len(kept):
        rt.memory.release_all()
    else:
        rt.memory.release_generation()
    metrics = {**rollout_metrics(RolloutBatch.concat(generated),
                                 max_response_length=rt.cfg.rollout.max_response_length),
               **dyn.metrics(), **counts.metrics(), **(gec.metrics() if rt.cfg.algo.edge_gec else {}),
               **rt.engine.fault_metrics(),  # SGLang: restarts
               "batch/reward_mean": sum(kept.rewards) / max(len(kept), 1),
               "batch/acc": sum(kept.accs) / max(len(kept), 1),
               "batch/num_groups": float(len(set(kept.group_ids)))}
    return kept, metrics, rt.rl.sampler.state_dict()


def _share_out(rt: Runtime, kept: Optional[RolloutBatch], meta: SequenceMeta) -> RankBatch:
    """Every rank's `RankBatch`: rank 0 (holding ``kept``) sends each data-parallel rank the
    per-token data of its own sequences (`rollout_share.step_plan`, computed here once per step on
    every rank; it travels in the `RankBatch` to `layout`), one point-to-point message per rank
    over the control group; ``meta`` came with ``done``. A MoE
    model's routes go to each pipeline stage with its own layers only, in the smallest integer type
    of the expert ids (`route_share`)."""
    dp_size = rt.groups.dp_size if len(meta) else 1
    group = rt.control.group
    # (DP rank, PP stage) of every rank of `group`
    coords = all_gather_objects((rt.groups.dp_rank if dp_size > 1 else 0, rt.groups.pp_rank), group=group)
    plans = _plan(rt, meta)
    parts = None
    if rt.is_main:
        per_dp = [kept] if dp_size == 1 else split_for_ranks(kept, plans, dp_size)
        by_coords = {c: _stage_part(rt, per_dp[c[0]], c[1]) for c in set(coords)}
        parts = [by_coords[c] for c in coords]  # ranks of one DP group and stage share one pickled message
    tokens = scatter_objects(parts, src=rt.control.src, group=group)
    held = np.arange(len(meta)) if dp_size == 1 else held_sequences(plans, rt.groups.dp_rank)
    return RankBatch(meta, held, tokens, plans)


def _stage_part(rt: Runtime, part: RolloutBatch, pp_rank: int) -> RolloutBatch:
    """``part`` with the routes of pipeline stage ``pp_rank``'s layers, compact (`route_share`)."""
    if rt.actor.routing == "off":
        return part
    cfg = rt.actor.hf_config
    first, end = stage_layer_range(cfg.num_hidden_layers, rt.groups.pp_size, pp_rank)
    return stage_routes(part, num_layers=cfg.num_hidden_layers, top_k=int(cfg.num_experts_per_tok), first=first,
                        end=end, dtype=route_dtype(int(cfg.num_experts)))


def _plan(rt: Runtime, meta: SequenceMeta) -> list[MiniPlan]:
    p = rt.cfg.parallel
    return step_plan(meta, ppo_mini_batch_size=rt.cfg.trainer.ppo_mini_batch_size, dp_size=rt.groups.dp_size,
                     micro_batch_size=p.micro_batch_size, max_tokens_per_micro_batch=p.max_tokens_per_micro_batch,
                     pack=p.pack_sequences)


def advantages(rt: Runtime, batch: RankBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Every sequence's advantage ``[B]`` from its (reward, response length, group), the same on
    every rank (`rollout_batch.sequence_advantages`, O(B)), and the ``adv/*`` metrics."""
    a, meta = rt.cfg.algo, batch.meta
    return sequence_advantages(meta.rewards, meta.response_lengths, meta.group_ids, adv_estimator=a.adv_estimator,
                               norm_adv_by_std=a.norm_adv_by_std, fallback_threshold=a.tlga_fallback_threshold)


def layout(rt: Runtime, batch: RankBatch, adv: torch.Tensor) -> tuple[Minis, dict[str, float]]:
    """This rank's micro-batches of each PPO mini-batch (DP-balanced by token count; identical
    assignment on every rank, ``batch.plans``), padded or packed (``parallel.pack_sequences``), from the
    sequences it holds with their advantages ``adv``; ``perf/token_efficiency`` is real / computed
    tokens of the step over every rank (from the assignment, which every rank knows: no collective),
    ``perf/filler_micro_batches`` the all-masked micro-batches that even the ranks' counts."""
    cfg, g = rt.cfg, rt.groups
    p = cfg.parallel
    pads = PadMultiples.of(tp_size=g.tp_size, cp_size=g.cp_size, sequence_parallel=p.sequence_parallel).kwargs()
    plans = batch.plans
    mbs = []
    for idx, plan in plans:
        mine = [[batch.sequence(idx[j], float(adv[idx[j]])) for j in b] for b in plan[g.dp_rank]]
        # a filler (an empty entry: ranks run equal counts) copies the mini-batch's first tokens
        mbs.append(collate_micro_batches(mine, batch.meta.head(idx[0]), pack=p.pack_sequences, **pads))
    real = computed = fillers = 0.0
    tokens = batch.meta.num_tokens
    for idx, plan in plans:
        eff = token_efficiency(plan, [int(tokens[i]) for i in idx], pack=p.pack_sequences, **pads)
        real, computed = real + eff["real_tokens"], computed + eff["computed_tokens"]
        fillers += eff["filler_micro_batches"]
    return mbs, {"perf/token_efficiency": real / max(computed, 1.0), "perf/filler_micro_batches": fillers}


def _flat(minis: Minis) -> list[MicroBatch]:
    return [mb for mini in minis for mb in mini]


def _regroup(flat: list[MicroBatch], like: Minis) -> Minis:
    """``flat`` (in `_flat` order) cut into the mini-batches of ``like``."""
    out, k = [], 0
    for mini in like:
        out.append(flat[k:k + len(mini)])
        k += len(mini)
    return out


def recompute_temperatures(rt: Runtime,
                           micro_batches: list[MicroBatch]) -> tuple[list[MicroBatch], dict[str, float]]:
    """Per-token sampling temperatures, recomputed trainer-side for every engine (SGLang cannot
    report them): the engine's rule ``T = T_base * (1 + tau * h_hat(H))`` applied to the
    old-policy entropy at T_base (the rollout policy's weights) with the statistics the rollout
    used (``rt.rl.rollout_entropy_stats``, the previous step's); plain ``T_base`` when the rollout
    was not adaptive. Returns the micro-batches with ``temperatures`` that keep the engine's own values
    where it reported them (what was really used; HF engine) and the recomputed ones elsewhere
    (SGLang), and token sums for the metrics, including the absolute difference between the two
    where both exist."""
    params = SamplingParams.from_config(rt.cfg.rollout, rt.cfg.algo, entropy_stats=rt.rl.rollout_entropy_stats)
    t_base = float(params.temperature)
    sums = {"t_n": 0.0, "t_sum": 0.0, "t_sq": 0.0, "t_diff": 0.0, "t_diff_n": 0.0}
    out = []
    for mb in micro_batches:
        mask = mb.loss_mask != 0
        ent = mb.old_entropy.float()
        temps = torch.full_like(ent, t_base)
        if params.uses_adaptive:
            temps = temperature_from_entropy(ent, params.entropy_stats, t_base, params.temperature_tau,
                                             params.h_hat_mode)
        seq_stats = getattr(rt.rl, "sequence_sampling_stats", None)
        if seq_stats is not None and params.adaptive:  # asynchronous: each sequence's own statistics
            temps = _temperatures_by_sequence(mb, ent, seq_stats, params)
        temps = torch.where(mask, temps, torch.ones_like(temps))
        if mb.engine_temperatures is not None:
            both = mask & mb.tokens_of_sequences(mb.engine_temperatures)
            sums["t_diff"] += float(((temps - mb.temperatures).abs() * both).sum())
            sums["t_diff_n"] += float(both.sum())
            temps = torch.where(both, mb.temperatures, temps)
        out.append(mb.with_(temperatures=temps))
        sums["t_n"] += float(mask.sum())
        sums["t_sum"] += float((temps * mask).sum())
        sums["t_sq"] += float((temps.double() ** 2 * mask).sum())
    return out, sums


def _temperatures_by_sequence(mb: MicroBatch, ent: torch.Tensor, seq_stats: list, params: SamplingParams):
    """``[b, s]`` temperatures with the statistics each sequence was sampled with (``seq_stats``
    by the step's sequence index; None: sampled at ``T_base``, e.g. the first step's)."""
    t_base = float(params.temperature)
    out = torch.full_like(ent, t_base)
    rows = mb.seq_index.tolist()
    for d in {repr(seq_stats[i]): seq_stats[i] for i in rows if i >= 0 and seq_stats[i]}.values():
        stats = EntropyStats.from_dict(d)
        t = temperature_from_entropy(ent, stats, t_base, params.temperature_tau, params.h_hat_mode)
        mine = torch.tensor([i >= 0 and seq_stats[i] == d for i in rows])
        out = torch.where(mb.tokens_of_sequences(mine), t, out)
    return out


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


def with_old_policy(mb: MicroBatch, logprobs: torch.Tensor, entropy: torch.Tensor, *,
                    old_logprob_source: str, ref_logprobs: torch.Tensor | None = None) -> MicroBatch:
    """``mb`` with the old-log-prob pass's results: ``recomputed_logprobs`` and ``old_entropy``
    (the actor at T_base), ``old_logprobs`` (what the loss's ratio divides by: the recomputed
    ones, or the rollout's with ``old_logprob_source: rollout``) and ``ref_logprobs``."""
    old = logprobs if old_logprob_source == "recompute" else mb.rollout_logprobs * mb.loss_mask
    return mb.with_(old_logprobs=old, old_entropy=entropy, recomputed_logprobs=logprobs, ref_logprobs=ref_logprobs)


def old_logprob_pass(rt: Runtime, minis: Minis) -> tuple[Minis, EntropyStats, dict[str, float]]:
    """Old log-probs + entropies at T_base for every micro-batch (`with_old_policy`, and the
    trainer-side temperatures), the exact global entropy statistics, and the rollout/training
    mismatch. Returns (the micro-batches with those fields, EntropyStats, metrics)."""
    from hapo_megatron.parallel.stats import global_entropy_stats
    cfg, g = rt.cfg, rt.groups
    flat = _flat(minis)
    chunk = DEFAULT_LOGPROB_CHUNK  # the loss's chunking (hapo_loss_from_logits's default): same numbers
    t_base = cfg.rollout.temperature
    with rt.actor.counting_routing_mismatch():
        policy = rt.actor.compute_logprobs_entropy(flat, temperature=t_base, chunk_size=chunk)
    ref = (rt.actor.compute_logprobs_entropy(flat, temperature=t_base, model=rt.reference, chunk_size=chunk)
           if rt.reference is not None else None)
    sums: dict[str, float] = {}
    stats = None
    if g.is_pipeline_last:
        flat = [with_old_policy(mb, lp, ent, old_logprob_source=cfg.algo.loss.old_logprob_source,
                                ref_logprobs=ref[i][0] if ref is not None else None)
                for i, (mb, (lp, ent)) in enumerate(zip(flat, policy))]
        ent = torch.cat([mb.old_entropy.reshape(-1) for mb in flat])
        mask = torch.cat([mb.loss_mask.reshape(-1) for mb in flat])
        # the actor gathered the CP chunks: every CP rank holds whole sequences, so the token set
        # is spread over DP only (reducing over DP x CP would count each token cp_size times)
        dev = rt.actor.device
        stats = global_entropy_stats(ent.to(dev), mask.to(dev), group=g.dp, entropy_pivot=cfg.algo.loss.entropy_pivot)
        diff = sum(float(((mb.recomputed_logprobs - mb.rollout_logprobs).abs() * mb.loss_mask).sum())
                   for mb in flat)
        flat, t_sums = recompute_temperatures(rt, flat)
        sums = {"n": float(mask.sum()), "ent": float((ent * mask).sum()), "diff": diff, **t_sums}
    is_metrics = {}
    if cfg.algo.loss.rollout_is_mode != "none":  # the off-policy correction's proximal log-probs (collective)
        from hapo_megatron.training.off_policy import with_proximal_logprobs
        flat, is_metrics = with_proximal_logprobs(rt, flat)
    if g.pp_size > 1:  # the rollout (rank 0, first stage) needs the statistics
        last = dist.get_global_rank(g.pp, g.pp_size - 1)
        stats = broadcast_object(stats.to_dict() if stats is not None else None, src=last, group=g.pp)
        stats = EntropyStats.from_dict(stats)
    tot = sum_metrics(sums, contribute=rt.contributes_metrics and g.is_pipeline_last)
    n = max(tot.get("n", 0.0), 1.0)
    metrics = {"entropy/mean": tot.get("ent", 0.0) / n, "rollout/logprob_abs_diff": tot.get("diff", 0.0) / n,
               **{f"entropy/{k}": float(v) for k, v in stats.to_dict().items()}, **_temperature_metrics(tot),
               **is_metrics}
    if rt.actor.routing != "off":
        mismatch = _routing_mismatch(rt)
        if mismatch is not None:  # not a measured step (model.routing_mismatch_fraction)
            metrics["rollout/routing_mismatch"] = mismatch
    return _regroup(flat, minis), stats, metrics


def _routing_mismatch(rt: Runtime) -> Optional[float]:
    """Share of the (token, MoE layer) pairs the engine routed whose top-k set the actor chose
    otherwise in the old-log-prob pass (collective: every rank counts its own tokens / layers, see
    `MegatronActor.take_routing_mismatch`); None when the engine returned no routes."""
    differing, compared = rt.actor.take_routing_mismatch()
    tot = sum_metrics({"differing": differing, "compared": compared})
    return tot["differing"] / tot["compared"] if tot["compared"] else None


def forking_threshold(rt: Runtime, minis: Minis) -> Optional[float]:
    """``algo.forking_tokens``: the step batch's log-entropy threshold of the forking tokens, exact
    over every rank (docs/algorithm.md, "Forking tokens"; collective over the last stage's DP
    group, where the loss runs and every CP rank holds whole sequences, as for the statistics)."""
    if not rt.cfg.algo.loss.forking_tokens or not rt.groups.is_pipeline_last:
        return None
    from hapo_megatron.parallel.stats import global_forking_threshold
    flat, dev = _flat(minis), rt.actor.device
    ent = torch.cat([mb.old_entropy.reshape(-1) for mb in flat]).to(dev)
    mask = torch.cat([mb.loss_mask.reshape(-1) for mb in flat]).to(dev)
    return global_forking_threshold(ent, mask, group=rt.groups.dp, rho=rt.cfg.algo.loss.forking_rho)


def edge_eda(rt: Runtime, minis: Minis, meta: SequenceMeta) -> tuple[Minis, dict[str, float]]:
    """``algo.edge_eda`` (EDGE-GRPO's entropy-driven advantage, docs/algorithm.md, "EDGE-GRPO"): every
    sequence's advantage times ``mean_g P / P_i``, ``P`` the mean old entropy of a response. The
    per-sequence sums are exact over the last stage's DP group (each sequence is held whole by one
    DP rank, the others add zeros), so the factors do not depend on the layout."""
    if not rt.cfg.algo.loss.edge_eda:
        return minis, {}
    if not rt.groups.is_pipeline_last:
        return minis, last_stage_metrics(rt, {})
    from hapo_megatron.algo import eda_scales, sequence_entropy_sums
    flat, dev, n = _flat(minis), rt.actor.device, len(meta.group_ids)
    sums = torch.zeros(n, dtype=torch.float64, device=dev)
    cnt = torch.zeros_like(sums)
    for mb in flat:
        s_, c_ = sequence_entropy_sums(mb.old_entropy.to(dev), mb.loss_mask.to(dev),
                                       mb.tokens_of_sequences(mb.seq_index).to(dev), n)
        sums += s_
        cnt += c_
    g = rt.groups.dp
    if g is not None and dist.is_initialized() and dist.get_world_size(g) > 1:
        dist.all_reduce(sums, group=g)
        dist.all_reduce(cnt, group=g)
    scale = eda_scales(sums, cnt, meta.group_ids)
    out = []
    for mb in flat:
        idx = mb.seq_index.to(dev)
        per_seq = torch.where(idx >= 0, scale[idx.clamp_min(0)], torch.ones_like(idx, dtype=scale.dtype))
        tok = mb.tokens_of_sequences(per_seq.to(mb.advantages.device))
        out.append(mb.with_(advantages=(mb.advantages.double() * tok).to(mb.advantages.dtype)))
    has = cnt > 0
    sc = scale[has]
    metrics = {"adv/edge_eda_scale_mean": float(sc.mean()) if sc.numel() else 1.0,
               "adv/edge_eda_scale_max": float(sc.max()) if sc.numel() else 1.0,
               "adv/edge_eda_scale_min": float(sc.min()) if sc.numel() else 1.0}
    return _regroup(out, minis), last_stage_metrics(rt, metrics)


def last_stage_metrics(rt: Runtime, metrics: dict[str, float]) -> dict[str, float]:
    """Step-wide metrics that every rank of the last pipeline stage computed alike, on every rank:
    the logger is global rank 0's, on the first stage when PP > 1 (collective over all ranks; the
    other stages pass ``{}``)."""
    g = rt.groups
    one = g.is_pipeline_last and g.tp_rank == 0 and g.cp_rank == 0 and g.dp_rank == 0
    return sum_metrics(metrics, contribute=one)


def _step_tokens(rt: Runtime, minis: Minis) -> Callable[[Callable], torch.Tensor]:
    """``cat(fn)``: ``fn(mb)`` of every micro-batch of the step, flattened and joined on the actor's device."""
    flat, dev = _flat(minis), rt.actor.device
    return lambda fn: torch.cat([fn(mb).reshape(-1) for mb in flat]).to(dev)


def step_cov_stats(rt: Runtime, minis: Minis):
    """``algo.policy_loss`` clip_cov / kl_cov: the step's `CovStats` (docs/algorithm.md, "Clip-Cov and
    KL-Cov"), exact over the last stage's DP group like `forking_threshold`; with ``cov_scope:
    micro_batch`` only the step's seed (the loss selects per micro-batch)."""
    from hapo_megatron.algo import COV_LOSSES, CovStats, position_keys, step_seed
    loss = rt.cfg.algo.loss
    if loss.policy_loss not in COV_LOSSES or not rt.groups.is_pipeline_last:
        return None
    seed = step_seed(rt.cfg.trainer.seed, rt.rl.step)
    if loss.cov_scope == "micro_batch":
        return CovStats(0.0, 0.0, seed, None)
    from hapo_megatron.parallel.cov import global_cov_stats
    cat = _step_tokens(rt, minis)
    keys = cat(lambda mb: position_keys(seed, mb.tokens_of_sequences(mb.seq_index), mb.position_ids))
    ratio = loss.clip_cov_ratio if loss.policy_loss == "clip_cov" else loss.kl_cov_ratio
    return global_cov_stats(loss.policy_loss, cat(lambda mb: mb.advantages), cat(lambda mb: mb.old_logprobs),
                            cat(lambda mb: mb.loss_mask), keys, group=rt.groups.dp, seed=seed, ratio=ratio,
                            lb=loss.clip_cov_lb, ub=loss.clip_cov_ub)


def step_cov_metrics(rt: Runtime, minis: Minis) -> dict[str, float]:
    """``algo.policy_loss`` clip_cov / kl_cov: the step batch's token covariances (old log-probs)
    as ``cov/*`` metrics, exact over the last stage's DP group (`parallel.cov.global_cov_distribution`),
    on every rank; in both ``cov_scope`` settings (``micro_batch`` selects from other numbers:
    docs/algorithm.md, "Clip-Cov and KL-Cov")."""
    from hapo_megatron.algo import COV_LOSSES
    if rt.cfg.algo.loss.policy_loss not in COV_LOSSES:
        return {}
    if not rt.groups.is_pipeline_last:
        return last_stage_metrics(rt, {})
    from hapo_megatron.parallel.cov import global_cov_distribution
    cat = _step_tokens(rt, minis)
    return last_stage_metrics(rt, global_cov_distribution(cat(lambda mb: mb.advantages),
                                                          cat(lambda mb: mb.old_logprobs),
                                                          cat(lambda mb: mb.loss_mask), group=rt.groups.dp))


def policy_loss_factory(rt: Runtime, stats: EntropyStats, on_token_fields: Optional[TokenSink] = None,
                        forking_threshold: Optional[float] = None, cov_stats=None) -> LossFactory:
    """``make_loss(mb)`` for `MegatronActor.train_step` with the HAPO loss of `parallel.loss`;
    ``on_token_fields`` receives each micro-batch's `PolicyTokenFields` (this rank's CP shard)."""
    from hapo_megatron.parallel.loss import make_loss_func
    g = rt.groups
    # the seq-mean-token-sum-norm horizon is the maximum response length (a constant, so the
    # normalisation does not depend on how sequences are padded)
    return lambda mb: make_loss_func(mb, cfg=rt.cfg.algo.loss, stats=stats, tp_group=g.tp,
                                     cp_group=g.cp if g.cp_size > 1 else None,
                                     temperature=rt.cfg.rollout.temperature, on_token_fields=on_token_fields,
                                     loss_scale_factor=float(rt.cfg.rollout.max_response_length),
                                     forking_threshold=forking_threshold, cov_stats=cov_stats)


def ppo_update(rt: Runtime, minis: Minis, stats: EntropyStats) -> tuple[Minis, dict[str, float]]:
    """``trainer.ppo_epochs`` passes of one optimizer step per mini-batch; loss metrics are
    token-weighted over the whole step and every rank. Returns the micro-batches with the loss's
    per-token view of each of their updates (`MicroBatch.updates`, last pipeline stage) and the
    metrics."""
    from hapo_megatron.algo import finalize_loss_metrics
    recorded: list[PolicyTokenFields] = []
    make_loss = policy_loss_factory(rt, stats, on_token_fields=recorded.append,
                                    forking_threshold=forking_threshold(rt, minis),
                                    cov_stats=step_cov_stats(rt, minis))
    sums: dict[str, float] = {}
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
    tot = sum_metrics(sums, contribute=rt.contributes_metrics)
    metrics = {**finalize_loss_metrics(tot), "actor/grad_norm": sum(norms) / max(len(norms), 1),
               "actor/lr": lr, "actor/skipped_updates": float(skipped),
               "actor/num_updates": float(len(minis) * rt.cfg.trainer.ppo_epochs),
               **rt.actor.step_metrics(),  # trainable / total parameters (LoRA: the adapters / all)
               **rt.actor.moe_step_metrics(),  # MoE models: aux loss, per-expert load
               **step_cov_metrics(rt, minis)}  # Clip-Cov / KL-Cov: the covariances' mean and quantiles
    return _with_updates(rt, minis, recorded), metrics


def _with_updates(rt: Runtime, minis: Minis, recorded: list[PolicyTokenFields]) -> Minis:
    """The micro-batches with their recorded token fields, gathered over CP to full sequences
    (on the host). ``recorded`` holds one entry per micro-batch per update, in training order."""
    if not rt.groups.is_pipeline_last:
        return minis  # the loss runs on the last stage only
    flat = _flat(minis)
    if len(recorded) != len(flat) * rt.cfg.trainer.ppo_epochs:
        raise RuntimeError(f"the loss reported {len(recorded)} micro-batch updates, expected "
                           f"{len(flat)} micro-batches x {rt.cfg.trainer.ppo_epochs} epochs")

    def full(t: torch.Tensor, cu_seqlens) -> torch.Tensor:  # bool flags travel as float through the all-gather
        if rt.groups.cp_size == 1:
            return t.cpu()
        packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}  # a packed row's THD shard
        return rt.actor.gather_cp(t.float(), **packed).to(t.dtype).cpu()

    per_mb = [[] for _ in flat]
    for k, fields in enumerate(recorded):
        cu = flat[k % len(flat)].cu_seqlens
        per_mb[k % len(flat)].append(fields.apply(lambda t: full(t, cu)))
    return _regroup([mb.with_(updates=mb.updates + tuple(u)) for mb, u in zip(flat, per_mb)], minis)


def sync_weights(rt: Runtime) -> dict[str, float]:
    """Stream the actor's weights (HF names, gathered over TP/PP) into the rollout engine.

    The export runs collectives over the trainer's ranks, so every rank reads it to the end:
    rank 0's engine by the `RolloutEngine.update_weights` contract (checked here: an engine that
    leaves tensors unread is an error, after they are read so that no rank is left waiting), the
    ranks without an engine here. Returns ``rollout/weight_sync_bytes``: the bytes of the tensors
    the export handed to the engine (the full weights, or LoRA's A and B in adapter mode), the
    same on every rank."""
    dtype = rt.engine.dtype if rt.engine is not None else None
    adapters = rt.cfg.rollout.sglang.lora_sync == "adapter"  # LoRA: A and B only (validated: sglang, rank > 0)
    counted = SyncBytes(rt.actor.export_lora_adapters(dtype) if adapters else rt.actor.export_hf_weights(dtype=dtype))
    named = iter(counted)
    empty_cache()  # what the trainer's allocator holds unused goes back before the servers resume
    if rt.engine is None:
        drain_weights(named)
        return counted.metrics()
    rt.memory.resume_weights()  # the KV cache comes back in rollout, after the offload
    if rt.cfg.rollout.max_staleness:  # asynchronous: tag the version; generation pauses around the update
        with rt.async_rollout.paused(rt.rl.step) if rt.async_rollout is not None else contextlib.nullcontext():
            # requests paused in place keep running on the servers: SGLang cannot flush their cache
            rt.engine.update_weights(named, weight_version=rt.rl.step,
                                     flush_cache=rt.cfg.rollout.sglang.pause_mode != "in_place")
    else:
        rt.engine.update_weights(named)
    left = drain_weights(named)
    if left:
        raise RuntimeError(f"{type(rt.engine).__name__}.update_weights left {left} exported tensors unread; "
                           "a RolloutEngine must read the weight iterator to the end on every rank")
    return counted.metrics()


class SyncBytes:
    """A weight stream that counts the bytes of the tensors read from it (one weight sync)."""

    def __init__(self, named):
        self._named, self.bytes = named, 0

    def __iter__(self):
        for name, t in self._named:
            self.bytes += t.numel() * t.element_size()
            yield name, t

    def metrics(self) -> dict[str, float]:
        return {"rollout/weight_sync_bytes": float(self.bytes)}


def evaluate(rt: Runtime, step: int) -> dict[str, float]:
    """Validation on rank 0 (fixed temperature, val_n samples); {} elsewhere or without val files.
    Colocated, every rank keeps its trainer state offloaded until rank 0 is done (the servers
    span every GPU), waiting for it like during a rollout."""
    if rt.val_ds is None:
        return {}
    with rt.memory.trainer_offloaded():
        if not rt.is_main:
            rt.control.wait()
            return {}
        try:
            with rt.control.heartbeats({"evaluation": True}):
                rt.memory.resume_generation()
                try:
                    out = _evaluate_rank0(rt)
                finally:  # keep the synced weights: only the rest goes
                    rt.memory.release_generation()
        except BaseException as e:
            rt.control.send(ERROR, f"{type(e).__name__}: {e}")
            raise
        rt.control.send(DONE, None)
        return out


def _evaluate_rank0(rt: Runtime) -> dict[str, float]:
    from hapo_megatron.training.benchmark_accuracy import evaluate as run_eval
    cfg = rt.cfg
    records = list(rt.val_ds)
    if cfg.data.val_max_samples:
        records = records[: cfg.data.val_max_samples]
    params = SamplingParams.from_config(cfg.rollout, cfg.algo, validation=True, seed=cfg.trainer.seed,
                                        stop_token_ids=_stop_ids(rt))
    return run_eval(rt.engine, records, rt.reward_fn, params, tokenizer=rt.tokenizer,
                    reward_kwargs={"score_format": cfg.reward.score_format, **cfg.reward.reward_kwargs})
