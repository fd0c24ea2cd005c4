"""Pure per-step bookkeeping: rollout samples -> scored batch -> shaped rewards -> dynamic-sampling
filter -> per-sequence advantages -> `SequenceData` for the actor.

Nothing here touches Megatron or torch.distributed: the same functions run on every rank from the
same (broadcast) inputs and give the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Sequence

import numpy as np
import torch

from hapo_megatron.training.batches.micro_batches import SequenceData
from hapo_megatron.training.batches.ragged import Ragged


# per-token fields and their dtypes (ids fit int32; log-probs and temperatures are float32 on the
# trainer side, so storing them as float32 loses nothing the layout would keep; expert ids fit
# int16, a row holds positions x layers x top-k of them: `Sample.routed_experts` flattened)
RAGGED_FIELDS = {"prompt_ids": np.int32, "response_ids": np.int32, "rollout_logprobs": np.float32,
                 "temperatures": np.float32, "routed_experts": np.int16, "token_mask": np.float32}
# per-token fields a batch may lack (dense models, engines not asked for routes; every token trains):
# absent rows are empty
OPTIONAL_RAGGED = ("routed_experts", "token_mask")


@dataclass(eq=False)
class SequenceFields:
    """The per-sequence fields of a step's rollout, one entry per response in group-major order:
    ``group_ids[i]`` identifies the prompt (all ``n`` responses of a prompt share it); ``scores``
    are raw rewards, ``rewards`` the shaped ones used for advantages. `RolloutBatch` adds the
    per-token rows, `rollout_share.SequenceMeta` the lengths a rank needs without them."""

    finish_reasons: list[str] = field(default_factory=list)
    group_ids: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    accs: list[bool] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    data_sources: list[str] = field(default_factory=list)


@dataclass(eq=False)
class RolloutBatch(SequenceFields):
    """One step's rollout: the per-sequence fields (`SequenceFields`) and the per-token rows.

    The per-token fields (`RAGGED_FIELDS`) are `Ragged`: one flat array and row offsets (given as
    lists of rows, they are converted).
    """

    prompt_ids: Ragged = field(default_factory=lambda: Ragged(dtype=np.int32))
    response_ids: Ragged = field(default_factory=lambda: Ragged(dtype=np.int32))
    rollout_logprobs: Ragged = field(default_factory=lambda: Ragged(dtype=np.float32))
    temperatures: Ragged = field(default_factory=lambda: Ragged(dtype=np.float32))
    routed_experts: Ragged = field(default_factory=lambda: Ragged(dtype=np.int16))
    # per response token, 1 when it trains (rollout.partial_mode=mask_prefix); empty rows: all do
    token_mask: Ragged = field(default_factory=lambda: Ragged(dtype=np.float32))

    def __setattr__(self, name: str, value: Any) -> None:  # rows assigned as lists become Ragged too
        if name in RAGGED_FIELDS and not isinstance(value, Ragged):
            value = Ragged.from_rows(value, RAGGED_FIELDS[name])
        object.__setattr__(self, name, value)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RolloutBatch):
            return NotImplemented
        return all(self.column(f.name) == other.column(f.name) for f in fields(self))

    def __len__(self) -> int:
        return len(self.response_ids)

    def column(self, name: str) -> Any:
        """Field ``name``. An optional per-token field (`OPTIONAL_RAGGED`) left out (a dense model's
        rollout, rows appended without it) reads as one empty row per sequence."""
        value = getattr(self, name)
        if name in OPTIONAL_RAGGED and len(value) != len(self):
            if len(value):
                raise ValueError(f"RolloutBatch.{name} has {len(value)} rows for {len(self)} sequences")
            value = Ragged(np.zeros(0, RAGGED_FIELDS[name]), np.zeros(len(self) + 1, np.int64))
            object.__setattr__(self, name, value)
        return value

    @property
    def response_lengths(self) -> np.ndarray:
        return self.response_ids.lengths

    @property
    def prompt_lengths(self) -> np.ndarray:
        return self.prompt_ids.lengths

    def select(self, idx: Sequence[int]) -> "RolloutBatch":
        """A new batch with the sequences ``idx`` (in that order)."""
        idx = [int(i) for i in idx]
        return RolloutBatch(**{f.name: (self.column(f.name).select(idx) if f.name in RAGGED_FIELDS
                                        else [getattr(self, f.name)[i] for i in idx]) for f in fields(self)})

    @staticmethod
    def concat(batches: Sequence["RolloutBatch"]) -> "RolloutBatch":
        kw: dict[str, Any] = {}
        for f in fields(RolloutBatch):
            parts = [b.column(f.name) for b in batches]
            kw[f.name] = (Ragged.concat(parts, RAGGED_FIELDS[f.name]) if f.name in RAGGED_FIELDS
                          else [x for p in parts for x in p])
        return RolloutBatch(**kw)

    def to_dict(self) -> dict[str, Any]:
        """Plain lists (JSON: the dynamic-sampling buffer in rl_state.json)."""
        return {f.name: (self.column(f.name).tolist() if f.name in RAGGED_FIELDS else list(getattr(self, f.name)))
                for f in fields(self)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "RolloutBatch":
        return RolloutBatch(**{f.name: list(d.get(f.name, [])) for f in fields(RolloutBatch)})


def score_samples(samples: Sequence[Sequence[Any]], records: Sequence[Any], *,
                  reward_fn: Callable[..., Any], decode: Callable[[list[int]], str],
                  score_format: str, group_offset: int = 0,
                  reward_kwargs: dict | None = None) -> RolloutBatch:
    """Score the engine's ``samples[prompt][k]`` (`Sample`) against ``records[prompt]`` (`PromptRecord`)
    in this thread.

    ``reward_fn(solution_str, ground_truth, score_format=..., data_source=..., extra_info=...,
    **reward_kwargs)`` returns an object with ``score`` and ``acc``; prompt ``p`` gets group id
    ``group_offset + p``.
    """
    if len(samples) != len(records):
        raise ValueError(f"samples has {len(samples)} prompts but records has {len(records)}")
    results = [[reward_fn(decode(np.asarray(smp.response_ids).tolist()), rec.ground_truth, score_format=score_format,
                          data_source=getattr(rec, "data_source", None),
                          extra_info=getattr(rec, "extra_info", None), **(reward_kwargs or {}))
                for smp in group] for group, rec in zip(samples, records)]
    return build_batch(samples, records, results, group_offset=group_offset)


def build_batch(samples: Sequence[Sequence[Any]], records: Sequence[Any], results: Sequence[Sequence[Any]], *,
                group_offset: int = 0) -> RolloutBatch:
    """The `RolloutBatch` of ``samples[prompt][k]`` with their rewards ``results[prompt][k]``
    (objects with ``score`` and ``acc``); prompt ``p`` gets group id ``group_offset + p``."""
    if not len(samples) == len(records) == len(results):
        raise ValueError(f"samples, records and results cover {len(samples)}, {len(records)} and "
                         f"{len(results)} prompts")
    kw: dict[str, list] = {f.name: [] for f in fields(RolloutBatch)}
    for p, (group, rec, scored) in enumerate(zip(samples, records, results)):
        if len(group) != len(scored):
            raise ValueError(f"prompt {p} has {len(group)} samples but {len(scored)} rewards")
        for smp, res in zip(group, scored):
            for name in RAGGED_FIELDS:  # arrays (or lists) as the engine returned them: converted per row
                if name in OPTIONAL_RAGGED and not hasattr(smp, name):
                    continue  # a field samples never carry (token_mask): the batch leaves it out
                kw[name].append(getattr(smp, name, None) if name in OPTIONAL_RAGGED else getattr(smp, name))
            kw["finish_reasons"].append(str(smp.finish_reason))
            kw["group_ids"].append(group_offset + p)
            kw["scores"].append(float(res.score))
            kw["accs"].append(bool(res.acc))
            kw["rewards"].append(float(res.score))
            kw["data_sources"].append(str(getattr(rec, "data_source", "")))
    return RolloutBatch(**kw)


def shape_rewards(batch: RolloutBatch, *, max_response_length: int, overlong_buffer_enable: bool,
                  overlong_buffer_len: int, overlong_penalty_factor: float) -> RolloutBatch:
    """Set ``batch.rewards`` = score + DAPO overlong penalty (when enabled). Returns ``batch``."""
    rewards = torch.tensor(batch.scores, dtype=torch.float32)
    if overlong_buffer_enable and len(batch):
        from hapo_megatron.algo import overlong_penalty
        lengths = torch.tensor(batch.response_lengths, dtype=torch.float32)
        rewards = rewards + overlong_penalty(lengths, max_response_length, overlong_buffer_len,
                                             overlong_penalty_factor)
    batch.rewards = [float(x) for x in rewards]
    return batch


class DynamicSampler:
    """DAPO dynamic sampling with refill bookkeeping: keep only groups whose metric varies and
    accumulate them over generation batches until a step's batch is full.

    ``metric`` is ``"acc"`` or ``"score"`` (the shaped reward). With ``enabled=False`` every group
    is kept. The buffer lives within one step (surplus groups are dropped, as in DAPO);
    `state_dict` exists so a checkpoint records it anyway.
    """

    def __init__(self, *, enabled: bool, metric: str, max_num_gen_batches: int):
        if metric not in ("acc", "score"):
            raise ValueError(f"filter_groups_metric must be 'acc' or 'score', got {metric!r}")
        self.enabled, self.metric, self.max_num_gen_batches = enabled, metric, max_num_gen_batches
        self.reset()

    def reset(self) -> None:
        self.buffer = RolloutBatch()
        self.num_gen_batches = 0
        self.num_groups_seen = 0
        self.num_groups_kept = 0

    def add(self, batch: RolloutBatch) -> None:
        """Filter one generation batch and append the kept groups."""
        self.num_gen_batches += 1
        groups = list(dict.fromkeys(batch.group_ids))
        self.num_groups_seen += len(groups)
        if not self.enabled or not len(batch):
            kept = list(range(len(batch)))
        else:
            from hapo_megatron.algo import filter_groups
            values = batch.accs if self.metric == "acc" else batch.rewards
            mask = filter_groups(torch.tensor(batch.rewards, dtype=torch.float32), batch.group_ids,
                                 torch.tensor([float(v) for v in values], dtype=torch.float32))
            kept = [i for i, k in enumerate(mask.tolist()) if k]
        self.num_groups_kept += len(dict.fromkeys(batch.group_ids[i] for i in kept))
        self.buffer = RolloutBatch.concat([self.buffer, batch.select(kept)])

    @property
    def num_groups(self) -> int:
        return len(dict.fromkeys(self.buffer.group_ids))

    def needs_more(self, target_groups: int) -> bool:
        """True while the batch is short and another generation batch is allowed."""
        return self.num_groups < target_groups and self.num_gen_batches < self.max_num_gen_batches

    def take(self, target_groups: int) -> RolloutBatch:
        """The first ``target_groups`` kept groups (all if fewer); resets the buffer."""
        keep = set(list(dict.fromkeys(self.buffer.group_ids))[:target_groups])
        out = self.buffer.select([i for i, g in enumerate(self.buffer.group_ids) if g in keep])
        self.buffer = RolloutBatch()
        return out

    def metrics(self) -> dict[str, float]:
        return {"rollout/num_gen_batches": float(self.num_gen_batches),
                "rollout/kept_group_frac": self.num_groups_kept / max(self.num_groups_seen, 1)}

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": self.buffer.to_dict(), "num_gen_batches": self.num_gen_batches,
                "num_groups_seen": self.num_groups_seen, "num_groups_kept": self.num_groups_kept}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.buffer = RolloutBatch.from_dict(d.get("buffer", {}))
        self.num_gen_batches = int(d.get("num_gen_batches", 0))
        self.num_groups_seen = int(d.get("num_groups_seen", 0))
        self.num_groups_kept = int(d.get("num_groups_kept", 0))


def sequence_advantages(rewards: Sequence[float], lengths: Sequence[int], group_ids: Sequence[int], *,
                        adv_estimator: str, norm_adv_by_std: bool,
                        fallback_threshold: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-sequence advantage ``[B]`` (constant over a response's tokens; 0 for empty responses),
    O(B) from the response lengths (`algo.response_advantages`).

    ``hapo`` = token-level group average (TLGA, with GRPO fallback), ``grpo`` = GRPO / Dr.GRPO.
    Also returns metrics: ``adv/tlga_fallback_rate`` (share of groups that fell back), ``adv/abs_mean``.
    """
    from hapo_megatron.algo import response_advantages
    if not len(rewards):
        return torch.zeros(0), {}
    r = torch.tensor(np.asarray(rewards, dtype=np.float32))  # the float32 rewards the [B, T] path read
    gids = torch.as_tensor(np.asarray(group_ids, dtype=np.int64))
    per_seq, fallback = response_advantages(r, gids, torch.as_tensor(np.asarray(lengths, dtype=np.int64)),
                                            estimator=adv_estimator, norm_adv_by_std=norm_adv_by_std,
                                            fallback_threshold=fallback_threshold)
    metrics: dict[str, float] = {}
    if adv_estimator == "hapo":
        metrics["adv/tlga_fallback_rate"] = (len(torch.unique(gids[fallback])) / len(torch.unique(gids)))
    metrics["adv/abs_mean"] = float(per_seq.abs().mean())
    return per_seq, metrics


def to_sequences(batch: RolloutBatch, advantages: torch.Tensor) -> list[SequenceData]:
    """`SequenceData` for the actor, ``index`` = position in ``batch``."""
    if len(advantages) != len(batch):
        raise ValueError(f"advantages has {len(advantages)} entries for {len(batch)} sequences")
    return [SequenceData(prompt_ids=batch.prompt_ids[i], response_ids=batch.response_ids[i],
                         advantage=float(advantages[i]), rollout_logprobs=batch.rollout_logprobs[i],
                         temperatures=batch.temperatures[i], routed_experts=batch.column("routed_experts")[i],
                         token_mask=batch.column("token_mask")[i], index=i)
            for i in range(len(batch))]


def rollout_metrics(batch: RolloutBatch, *, max_response_length: int) -> dict[str, float]:
    """Per-step rollout metrics (means over sequences; temperature over response tokens)."""
    n = max(len(batch), 1)
    lengths = batch.response_lengths if len(batch) else np.zeros(1, np.int64)
    temps = batch.temperatures.flat
    per_source: dict[str, list[bool]] = {}
    for src, a in zip(batch.data_sources, batch.accs):
        per_source.setdefault(src or "default", []).append(a)
    clipped = (np.asarray(batch.finish_reasons) == "length") | (batch.response_lengths >= max_response_length)
    out = {
        "rollout/reward_mean": sum(batch.rewards) / n,
        "rollout/score_mean": sum(batch.scores) / n,
        "rollout/acc": sum(batch.accs) / n,
        "rollout/response_length_mean": int(lengths.sum()) / len(lengths),
        "rollout/response_length_max": float(lengths.max()),
        "rollout/response_length_min": float(lengths.min()),
        "rollout/clip_ratio": int(clipped.sum()) / n,
        "rollout/temperature_mean": float(temps.sum(dtype=np.float64)) / len(temps) if len(temps) else 0.0,
        "rollout/num_sequences": float(len(batch)),
        "rollout/num_groups": float(len(set(batch.group_ids))),
    }
    if len(per_source) > 1:
        for src, accs in sorted(per_source.items()):
            out[f"rollout/acc/{src}"] = sum(accs) / len(accs)
    return out
