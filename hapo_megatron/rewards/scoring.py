"""Rewards scored in worker processes while generation runs (docs/algorithm.md, "Rewards").

`RewardScorer` owns a `BoundedPool` started once (``reward.num_workers``). Per generation round,
`RewardScorer.start` gives a `ScoringRound`; the engine hands it each chunk of finished samples
(`ScoringRound.add`, the engines' ``on_samples`` callback: SGLang per ``/generate`` call, HF per
batch), which decodes them and submits one call per response; `ScoringRound.results` submits what
the engine did not hand over, waits for the rest and returns one `RewardResult` per sample.

A call that hits ``reward.timeout_s``, raises, returns something unusable or kills its worker
scores the format's minimum and is counted (`RewardCounts`); the pool replaces a dead or stuck
worker. The reward travels to the workers by reference (module + name), so registered rewards
and dotted-path user rewards both run there; a function that cannot (a lambda, a closure) is
refused at start. ``reward.num_workers=0`` scores in the calling process after generation
(no isolation; the math reward still bounds itself).
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence

import numpy as np

from hapo_megatron.rewards.bounded import MATH_PRELOAD, BoundedPool
from hapo_megatron.rewards.counts import RewardCounts
from hapo_megatron.rewards.math import RewardResult, compute_score
from hapo_megatron.rewards.registry import resolve_reward, wrap_reward

__all__ = ["RewardScorer", "ScoringRound", "auto_num_workers", "min_score"]

logger = logging.getLogger(__name__)


def auto_num_workers() -> int:
    """Reward workers when ``reward.num_workers=-1``: half the usable CPUs, 1 to 8."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, min(8, cpus // 2))


def min_score(score_format: str) -> float:
    """The score of a response whose reward failed: the format's minimum."""
    return {"pm1": -1.0, "01": 0.0}[score_format]


@functools.lru_cache(maxsize=None)
def _wrapped(fn: Callable) -> Callable[..., RewardResult]:
    return wrap_reward(fn)


def _score_one(fn: Callable, solution_str: str, ground_truth: Any, kwargs: dict) -> RewardResult:
    """Runs in a worker: the user's function, its arguments filtered, its return normalised."""
    return _wrapped(fn)(solution_str, ground_truth, **kwargs)


class RewardScorer:
    """The reward of a run: its function, arguments and (``num_workers > 0``) worker pool."""

    def __init__(self, cfg: Any):
        """``cfg``: the ``reward`` section (``RewardConfig``, which checks its fields): the reward,
        its keyword arguments, the score format, workers and time limit."""
        reward, num_workers = cfg.reward_fn, cfg.num_workers
        if num_workers == -1:
            num_workers = auto_num_workers()
        self.fn = resolve_reward(reward)
        self.name, self.timeout_s, self.score_format = reward, float(cfg.timeout_s), cfg.score_format
        self.wrong = min_score(cfg.score_format)
        self.reward_kwargs = dict(cfg.reward_kwargs or {})
        self.pool: Optional[BoundedPool] = None
        if num_workers > 0:
            module = getattr(self.fn, "__module__", None)
            try:
                if module in (None, "__main__"):
                    raise ValueError(f"it lives in {module!r}, which a worker process cannot import")
                pickle.loads(pickle.dumps(self.fn))
            except Exception as err:  # noqa: BLE001 - name the reward and the way out
                raise ValueError(f"reward {reward!r} cannot run in reward worker processes ({type(err).__name__}: "
                                 f"{err}); define it at module level of an importable module or set "
                                 "reward.num_workers=0") from err
            # the worker imports the reward's module before its first call (not inside its time limit)
            self.pool = BoundedPool(num_workers, preload=MATH_PRELOAD if self.fn is compute_score else module)

    def start(self, records: Sequence[Any], decode: Callable[[list[int]], str]) -> "ScoringRound":
        """A round scoring samples of ``records`` (`PromptRecord`s; a sample's ``prompt_index``)."""
        return ScoringRound(self, records, decode)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


class ScoringRound:
    """One generation round's scoring: `add` chunks as they finish, `results` at the end."""

    def __init__(self, scorer: RewardScorer, records: Sequence[Any], decode: Callable[[list[int]], str]):
        self.scorer, self.records, self.decode = scorer, records, decode
        self.futures: dict[tuple[int, int], Future] = {}

    def _kwargs(self, rec) -> dict:
        return {"score_format": self.scorer.score_format, "data_source": getattr(rec, "data_source", None),
                "extra_info": getattr(rec, "extra_info", None), **self.scorer.reward_kwargs}

    def add(self, samples: Sequence[Any]) -> None:
        """Submit these finished samples (any thread); in-process scoring waits for `results`."""
        if self.scorer.pool is None:
            return
        for smp in samples:
            rec = self.records[smp.prompt_index]
            self.futures[(smp.prompt_index, smp.sample_index)] = self.scorer.pool.submit(
                _score_one, self.scorer.fn, self.decode(np.asarray(smp.response_ids).tolist()), rec.ground_truth,
                self._kwargs(rec), timeout_s=self.scorer.timeout_s)

    def results(self, samples: Sequence[Sequence[Any]], counts: RewardCounts) -> list[list[RewardResult]]:
        """One `RewardResult` per ``samples[prompt][k]``; failures and waiting into ``counts``."""
        if len(samples) != len(self.records):
            raise ValueError(f"samples has {len(samples)} prompts but records has {len(self.records)}")
        t0 = time.monotonic()
        if self.scorer.pool is None:
            out = [[self._inline(smp, rec) for smp in group] for group, rec in zip(samples, self.records)]
        else:
            self.add([s for group in samples for s in group if (s.prompt_index, s.sample_index) not in self.futures])
            out = [[self._collect(self.futures[(s.prompt_index, s.sample_index)].result(), counts) for s in group]
                   for group in samples]
        counts.wait_s += time.monotonic() - t0
        for group in out:
            for res in group:
                counts.add(res)
        return out

    def _inline(self, smp, rec) -> RewardResult:
        fn = _wrapped(self.scorer.fn)
        return fn(self.decode(np.asarray(smp.response_ids).tolist()), rec.ground_truth, **self._kwargs(rec))

    def _collect(self, outcome, counts: RewardCounts) -> RewardResult:
        if outcome.ok and isinstance(outcome.value, RewardResult):
            return outcome.value
        if outcome.status == "timeout":
            return RewardResult(score=self.scorer.wrong, acc=False, pred=None, timed_out=True)
        counts.errors += 1
        if counts.errors == 1:  # once per step: the metric counts the rest
            logger.warning("reward %r failed on a response (%s); it scores %s, reward/errors counts every such "
                           "response", self.scorer.name, outcome.message or outcome.value, self.scorer.wrong)
        return RewardResult(score=self.scorer.wrong, acc=False, pred=None)
