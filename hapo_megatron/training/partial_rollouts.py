"""Over-sampling with partial rollouts in the synchronous loop (``rollout.over_sampling > 1``;
docs/algorithm.md, "Over-sampling and partial rollouts").

Each generation round starts ``ceil(generate_batch_size * over_sampling)`` prompt groups: the
unfinished groups of the pool first (their unfinished rows resume: prompt + partial response as
input, the remaining token budget, the entropy statistics the group started with), then new
prompts. Once the step has ``train_batch_size`` complete groups that dynamic sampling keeps,
every request still running is aborted (`rollout.sglang.partial.generate_groups`) and its tokens
stay in the pool. A group trains only when all its ``n`` rows are complete; none is dropped
(kept groups beyond the batch stay in the pool for the next step). The pool is checkpointed
(`RLState.partial_rollouts`).

Every token records the weight version it was sampled under (the synchronous loop's rollout of
step ``k`` runs on version ``k - 1``, the number of updates so far) and its behaviour log-prob;
``rollout.partial_mode: mask_prefix`` leaves the tokens of older versions out of the loss
(`RolloutBatch.token_mask`), ``correct`` trains them with ``algo.rollout_is``.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from hapo_megatron.algo import EntropyStats
from hapo_megatron.rewards.counts import RewardCounts
from hapo_megatron.rollout.engine import Sample, SamplingParams
from hapo_megatron.rollout.sglang.engine import row_seeds
from hapo_megatron.rollout.sglang.partial import ABORT, RowRequest, RowResult, generate_groups
from hapo_megatron.training.batches.rollout_batch import (DynamicSampler, RolloutBatch, build_batch, rollout_metrics,
                                                         shape_rewards)
from hapo_megatron.training.rollout_protocol import PROGRESS, RolloutAbandoned


@dataclass
class PartialRow:
    """One response so far: tokens, behaviour log-probs, the weight version of each token, and
    ``"stop"`` / ``"length"`` once complete (None while it may go on)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: Optional[str] = None
    resumes: int = 0  # how many times it was continued after an abort

    def extend(self, res: RowResult, version: int, max_tokens: int, stop_ids: tuple[int, ...] = ()) -> None:
        """Append one request's answer. ``stop_ids``: the tokens that end a response (the request's
        ``stop_token_ids``, the EOS among them). An abort that lands in the decode step that sampled
        one returns it as the last token (SGLang appends the step's token before its stop check):
        the response is complete ("stop"), not resumed past its end (docs/algorithm.md,
        "Over-sampling and partial rollouts")."""
        self.tokens += res.token_ids
        self.logprobs += res.logprobs
        self.versions += [int(version)] * len(res.token_ids)
        if res.finish_reason != ABORT:
            self.finish = res.finish_reason
        elif self.tokens and self.tokens[-1] in stop_ids:  # aborted in the step that sampled a stop token
            self.finish = "stop"
        elif len(self.tokens) >= max_tokens:  # aborted at the budget: nothing left to generate
            self.finish = "length"


@dataclass
class PartialGroup:
    """One prompt group: ``serial`` (admission order, also its group id), the dataset index of
    its prompt, the entropy statistics it samples with (dict; None: ``T_base``), its rows."""

    serial: int
    prompt_index: int
    stats: Optional[dict]
    rows: list[PartialRow]

    @property
    def complete(self) -> bool:
        return all(r.finish is not None for r in self.rows)

    def to_dict(self) -> dict:
        return {"serial": self.serial, "prompt_index": self.prompt_index, "stats": self.stats,
                "rows": [vars(r).copy() for r in self.rows]}

    @staticmethod
    def from_dict(d: dict) -> "PartialGroup":
        return PartialGroup(int(d["serial"]), int(d["prompt_index"]), d["stats"],
                            [PartialRow(**{k: (list(v) if isinstance(v, list) else v) for k, v in r.items()})
                             for r in d["rows"]])


@dataclass
class PartialPool:
    """The groups started and not yet trained (admission order) and the prompts drawn from the
    sampler but not yet started; JSON state (`to_dict`) in the checkpoint."""

    groups: list[PartialGroup] = field(default_factory=list)
    queue: list[int] = field(default_factory=list)
    next_serial: int = 0

    def to_dict(self) -> dict:
        return {"groups": [g.to_dict() for g in self.groups], "queue": list(self.queue),
                "next_serial": self.next_serial}

    @staticmethod
    def from_dict(d: Optional[dict]) -> "PartialPool":
        if not d:
            return PartialPool()
        return PartialPool([PartialGroup.from_dict(g) for g in d["groups"]], [int(i) for i in d["queue"]],
                           int(d["next_serial"]))

    def start(self, sampler, n: int, stats: Optional[EntropyStats]) -> PartialGroup:
        """A new group on the next drawn prompt."""
        if not self.queue:
            self.queue.extend(sampler.next_indices())
        g = PartialGroup(self.next_serial, self.queue.pop(0), stats.to_dict() if stats is not None else None,
                         [PartialRow() for _ in range(n)])
        self.next_serial += 1
        self.groups.append(g)
        return g


def row_requests(group: PartialGroup, prompt_ids: list[int], max_tokens: int,
                 seeds: list[Optional[int]]) -> tuple[list[int], list[RowRequest]]:
    """The unfinished rows of ``group`` (their indices) and their requests: prompt + partial
    response as input, the rest of the token budget."""
    idx = [k for k, r in enumerate(group.rows) if r.finish is None]
    return idx, [RowRequest(tuple(prompt_ids) + tuple(group.rows[k].tokens), max_tokens - len(group.rows[k].tokens),
                            seeds[k]) for k in idx]


def group_samples(group: PartialGroup, prompt_ids: list[int]) -> list[Sample]:
    """The complete group's `Sample` objects (per-token weight versions included)."""
    return [Sample(prompt_ids=prompt_ids, response_ids=r.tokens, rollout_logprobs=r.logprobs, temperatures=[],
                   finish_reason=r.finish, prompt_index=0, sample_index=k, weight_versions=r.versions)
            for k, r in enumerate(group.rows)]


def prefix_mask(versions: list[int], version: int) -> list[float]:
    """``mask_prefix``: 1 for the tokens the current weights sampled, 0 for older ones."""
    return [1.0 if int(v) >= version else 0.0 for v in versions]


@dataclass
class _Round:
    """What the rollout of one step learns while its rounds run (metrics and scored groups)."""

    scored: dict = field(default_factory=dict)  # serial -> shaped RolloutBatch of the complete group
    kept: int = 0
    aborted: int = 0
    resumed: int = 0
    completed_lengths: list[int] = field(default_factory=list)


def rollout_rank0(rt, step: int, stop_check: Optional[Callable[[], bool]], stop_ids: list[int]
                  ) -> tuple[RolloutBatch, dict[str, float], dict[str, Any]]:
    """Rank 0's rollout of ``step`` with over-sampling (module docstring): the kept batch, the
    metrics, and the state every rank applies (the sampler cursor, the entropy statistics of each
    sequence; the pool itself stays in ``rt.rl.partial_rollouts`` on rank 0)."""
    cfg = rt.cfg
    target = int(cfg.data.train_batch_size)
    per_round = int(cfg.rollout.generate_batch_size or target)
    want = math.ceil(per_round * float(cfg.rollout.over_sampling))
    max_tokens, n, version = int(cfg.rollout.max_response_length), int(cfg.rollout.n), int(rt.rl.step)
    pool = PartialPool.from_dict(rt.rl.partial_rollouts)
    rt.memory.resume_generation()
    dyn = rt.rl.dyn
    dyn.reset()
    rnd, counts, generated, added = _Round(), RewardCounts(), [], set()
    lock = threading.Lock()
    while True:
        if stop_check is not None and stop_check():
            raise RolloutAbandoned(f"stop requested before generation round {dyn.num_gen_batches + 1} of step {step}")
        while len(pool.groups) < want:
            pool.start(rt.rl.sampler, n, rt.rl.rollout_entropy_stats)
        need, rnd.kept = target - dyn.num_groups, 0
        for g in pool.groups:  # complete before the round: kept groups beyond an earlier batch
            if g.complete and g.serial not in added:
                rnd.kept += _score(rt, g, rnd, counts)
        todo = [g for g in pool.groups if not g.complete] if rnd.kept < need else []
        requests, params, rows_of = [], [], []
        for g in todo:
            # a row keeps its seed when it resumes: (run seed, group serial, row), not the step
            p = SamplingParams.from_config(cfg.rollout, cfg.algo, seed=rt.sampling_seed(0, 0), stop_token_ids=stop_ids,
                                           entropy_stats=EntropyStats.from_dict(g.stats) if g.stats else None)
            idx, req = row_requests(g, _prompt(rt, g), max_tokens,
                                    row_seeds(p, [g.serial * n + k for k in range(n)]) if _seeded(rt) else [None] * n)
            rnd.resumed += sum(1 for k in idx if g.rows[k].tokens)
            requests.append(req)
            params.append(p)
            rows_of.append(idx)

        def on_group(i: int, results: list[RowResult]) -> bool:
            g = todo[i]
            with lock:
                for k, res in zip(rows_of[i], results):
                    g.rows[k].resumes += int(bool(g.rows[k].tokens))
                    g.rows[k].extend(res, version, max_tokens, params[i].stop_token_ids)
                    rnd.aborted += int(res.finish_reason == ABORT)
                    if g.rows[k].finish is not None:
                        rnd.completed_lengths.append(len(g.rows[k].tokens))
                if g.complete:
                    rnd.kept += _score(rt, g, rnd, counts)
                return rnd.kept >= need

        if todo:
            generate_groups(rt.engine, requests, params, on_group, stop_check=stop_check)
        # admission order: the batch's deterministic order
        done = [g for g in pool.groups if g.complete and g.serial not in added]
        added |= {g.serial for g in done}
        batch = RolloutBatch.concat([rnd.scored[g.serial] for g in done]) if done else RolloutBatch()
        generated.append(batch)
        dyn.add(batch)
        filtered = {g.serial for g in done} - set(dyn.buffer.group_ids)
        pool.groups = [g for g in pool.groups if g.serial not in filtered]  # dynamic sampling drops them
        if not dyn.needs_more(target):
            break
        rt.control.send(PROGRESS, {"step": step, "round": dyn.num_gen_batches})
    kept = dyn.take(target)
    taken = set(kept.group_ids)
    by_serial = {g.serial: g for g in pool.groups}
    trained = [by_serial[s] for s in dict.fromkeys(kept.group_ids)]  # the batch's order
    pool.groups = [g for g in pool.groups if g.serial not in taken]  # the rest: resumed or trained later
    if cfg.rollout.partial_mode == "mask_prefix":
        kept.token_mask = [prefix_mask(r.versions, version) for g in trained for r in g.rows]
    rt.rl.partial_rollouts = pool.to_dict()
    if len(kept):
        rt.memory.release_all()
    else:
        rt.memory.release_generation()
    metrics = {**rollout_metrics(RolloutBatch.concat(generated), max_response_length=max_tokens),
               **dyn.metrics(), **counts.metrics(),
               **rt.engine.fault_metrics(),
               **partial_metrics(trained, rnd, version, pool),
               "batch/reward_mean": sum(kept.rewards) / max(len(kept), 1),
               "batch/acc": sum(kept.accs) / max(len(kept), 1),
               "batch/num_groups": float(len(taken))}
    seq_stats = [g.stats for g in trained for _ in g.rows]
    return kept, metrics, {"partial": True, "sampler": rt.rl.sampler.state_dict(),
                           "sequence_sampling_stats": seq_stats}


def _prompt(rt, g: PartialGroup) -> list[int]:
    return [int(t) for t in rt.train_ds[g.prompt_index].prompt_ids]


def _seeded(rt) -> bool:
    return bool(rt.engine.send_sampling_seed)


def _score(rt, g: PartialGroup, rnd: _Round, counts: RewardCounts) -> int:
    """Score, shape and filter the complete group ``g`` into ``rnd.scored``; 1 when dynamic
    sampling keeps it."""
    cfg = rt.cfg
    record = rt.train_ds[g.prompt_index]
    samples = [group_samples(g, _prompt(rt, g))]
    scoring = rt.scorer.start([record], decode=lambda ids: rt.tokenizer.decode(ids, skip_special_tokens=True))
    scoring.add(samples[0])
    batch = build_batch(samples, [record], scoring.results(samples, counts), group_offset=g.serial)
    batch = shape_rewards(batch, max_response_length=cfg.rollout.max_response_length,
                          overlong_buffer_enable=cfg.reward.overlong_buffer_enable,
                          overlong_buffer_len=cfg.reward.overlong_buffer_len,
                          overlong_penalty_factor=cfg.reward.overlong_penalty_factor)
    rnd.scored[g.serial] = batch
    one = DynamicSampler(enabled=cfg.algo.filter_groups, metric=cfg.algo.filter_groups_metric,
                         max_num_gen_batches=cfg.algo.max_num_gen_batches)
    one.add(batch)
    return int(len(one.buffer) > 0)


def _quantiles(prefix: str, lengths: list[int]) -> dict[str, float]:
    x = np.asarray(lengths if lengths else [0], dtype=np.float64)
    return {f"{prefix}_mean": float(x.mean()), f"{prefix}_p50": float(np.percentile(x, 50)),
            f"{prefix}_p90": float(np.percentile(x, 90))}


def partial_metrics(trained: list[PartialGroup], rnd: _Round, version: int, pool: PartialPool) -> dict[str, float]:
    """``rollout/aborted`` and ``rollout/resumed`` (rows), the share of trained tokens an older
    version sampled, and the lengths of the trained responses next to those of every response
    completed this step (mean, p50, p90): the trained ones must not skew short."""
    rows = [r for g in trained for r in g.rows]
    tokens = sum(len(r.versions) for r in rows)
    older = sum(int(np.sum(np.asarray(r.versions) < version)) for r in rows)
    return {"rollout/aborted": float(rnd.aborted), "rollout/resumed": float(rnd.resumed),
            "rollout/older_version_token_frac": older / max(tokens, 1),
            "rollout/partial_groups": float(len(pool.groups)),
            **_quantiles("rollout/trained_length", [len(r.tokens) for r in rows]),
            **_quantiles("rollout/completed_length", rnd.completed_lengths)}


__all__ = ["PartialGroup", "PartialPool", "PartialRow", "group_samples", "partial_metrics", "prefix_mask",
           "row_requests", "rollout_rank0"]
