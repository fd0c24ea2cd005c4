"""Pure per-step bookkeeping: rollout samples -> scored batch -> shaped rewards -> dynamic-sampling
filter -> per-sequence advantages -> `SequenceData` for the actor.

Nothing here touches Megatron or torch.distributed: the same functions run on every rank from the
same (broadcast) inputs and give the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Sequence

import torch

from hapo_megatron.training.batching import SequenceData


@dataclass
class RolloutBatch:
    """Per-sequence data of one step, in group-major order (one entry per response).

    ``group_ids[i]`` identifies the prompt (all ``n`` responses of a prompt share it);
    ``scores`` are raw rewards, ``rewards`` the shaped ones used for advantages.
    """

    prompt_ids: list[list[int]] = field(default_factory=list)
    response_ids: list[list[int]] = field(default_factory=list)
    rollout_logprobs: list[list[float]] = field(default_factory=list)
    temperatures: list[list[float]] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    group_ids: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    accs: list[bool] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    data_sources: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def response_lengths(self) -> list[int]:
        return [len(r) for r in self.response_ids]

    def select(self, idx: Sequence[int]) -> "RolloutBatch":
        """A new batch with the sequences ``idx`` (in that order)."""
        return RolloutBatch(**{f.name: [getattr(self, f.name)[i] for i in idx] for f in fields(self)})

    @staticmethod
    def concat(batches: Sequence["RolloutBatch"]) -> "RolloutBatch":
        out = RolloutBatch()
        for b in batches:
            for f in fields(b):
                getattr(out, f.name).extend(getattr(b, f.name))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {f.name: list(getattr(self, f.name)) for f in fields(self)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "RolloutBatch":
        return RolloutBatch(**{f.name: list(d.get(f.name, [])) for f in fields(RolloutBatch)})

    _RAGGED = {"prompt_ids": "int32", "response_ids": "int32", "rollout_logprobs": "float32",
               "temperatures": "float32"}

    def pack(self) -> dict[str, Any]:
        """Compact form for broadcasting: ragged fields as one flat numpy array + lengths
        (a pickled list of Python floats is ~8x larger)."""
        import numpy as np
        out: dict[str, Any] = {}
        for f in fields(self):
            vals = getattr(self, f.name)
            if f.name in self._RAGGED:
                out[f.name] = (np.asarray([x for row in vals for x in row], dtype=self._RAGGED[f.name]),
                               np.asarray([len(row) for row in vals], dtype=np.int64))
            else:
                out[f.name] = list(vals)
        return out

    @staticmethod
    def unpack(d: dict[str, Any]) -> "RolloutBatch":
        """Inverse of `pack` (values come back as Python ints / floats)."""
        import numpy as np
        kw: dict[str, Any] = {}
        for f in fields(RolloutBatch):
            v = d.get(f.name, [])
            if f.name in RolloutBatch._RAGGED:
                flat, lengths = v
                bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
                items = flat.tolist()
                kw[f.name] = [items[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
            else:
                kw[f.name] = list(v)
        return RolloutBatch(**kw)


def score_samples(samples: Sequence[Sequence[Any]], records: Sequence[Any], *,
                  reward_fn: Callable[..., Any], decode: Callable[[list[int]], str],
                  score_format: str = "pm1", group_offset: int = 0,
                  reward_kwargs: dict | None = None) -> RolloutBatch:
    """Score the engine's ``samples[prompt][k]`` (`Sample`) against ``records[prompt]`` (`PromptRecord`)
    in this thread.

    ``reward_fn(solution_str, ground_truth, score_format=..., data_source=..., extra_info=...,
    **reward_kwargs)`` returns an object with ``score`` and ``acc``; prompt ``p`` gets group id
    ``group_offset + p``.
    """
    if len(samples) != len(records):
        raise ValueError(f"samples has {len(samples)} prompts but records has {len(records)}")
    results = [[reward_fn(decode(list(smp.response_ids)), rec.ground_truth, score_format=score_format,
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
    out = RolloutBatch()
    for p, (group, rec, scored) in enumerate(zip(samples, records, results)):
        if len(group) != len(scored):
            raise ValueError(f"prompt {p} has {len(group)} samples but {len(scored)} rewards")
        for smp, res in zip(group, scored):
            out.prompt_ids.append(list(smp.prompt_ids))
            out.response_ids.append(list(smp.response_ids))
            out.rollout_logprobs.append([float(x) for x in smp.rollout_logprobs])
            out.temperatures.append([float(x) for x in smp.temperatures])
            out.finish_reasons.append(str(smp.finish_reason))
            out.group_ids.append(group_offset + p)
            out.scores.append(float(res.score))
            out.accs.append(bool(res.acc))
            out.rewards.append(float(res.score))
            out.data_sources.append(str(getattr(rec, "data_source", "")))
    return out


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

    def __init__(self, *, enabled: bool, metric: str = "acc", max_num_gen_batches: int = 16):
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


def _length_mask(lengths: Sequence[int]) -> torch.Tensor:
    """``[B, max(1, max L)]`` mask with ``lengths[i]`` leading ones in row i."""
    width = max([1, *lengths])
    return (torch.arange(width).unsqueeze(0) < torch.tensor(list(lengths)).unsqueeze(1)).float()


def sequence_advantages(rewards: Sequence[float], lengths: Sequence[int], group_ids: Sequence[int], *,
                        adv_estimator: str = "hapo", norm_adv_by_std: bool = True,
                        fallback_threshold: float = 5.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-sequence advantage ``[B]`` (constant over a response's tokens; 0 for empty responses).

    ``hapo`` = token-level group average (TLGA, with GRPO fallback), ``grpo`` = GRPO / Dr.GRPO.
    Also returns metrics: ``adv/tlga_fallback_rate`` (share of groups that fell back), ``adv/abs_mean``.
    """
    from hapo_megatron.algo import grpo_advantages, token_level_group_advantages
    if not len(rewards):
        return torch.zeros(0), {}
    r = torch.tensor([float(x) for x in rewards], dtype=torch.float32)
    mask = _length_mask(lengths)
    gids = torch.tensor([int(g) for g in group_ids], dtype=torch.long)
    metrics: dict[str, float] = {}
    if adv_estimator == "hapo":
        adv, fallback = token_level_group_advantages(r, gids, mask, norm_adv_by_std=norm_adv_by_std,
                                                     fallback_threshold=fallback_threshold,
                                                     return_fallback=True)
        fell = {int(g) for g, f in zip(group_ids, fallback.tolist()) if f}
        metrics["adv/tlga_fallback_rate"] = len(fell) / len(set(int(g) for g in group_ids))
    elif adv_estimator == "grpo":
        adv = grpo_advantages(r, gids, mask, norm_adv_by_std=norm_adv_by_std)
    else:
        raise ValueError(f"adv_estimator must be 'hapo' or 'grpo', got {adv_estimator!r}")
    per_seq = torch.where(torch.tensor([int(x) > 0 for x in lengths]), adv[:, 0], torch.zeros(()))
    metrics["adv/abs_mean"] = float(per_seq.abs().mean())
    return per_seq, metrics


def to_sequences(batch: RolloutBatch, advantages: torch.Tensor) -> list[SequenceData]:
    """`SequenceData` for the actor, ``index`` = position in ``batch``."""
    if len(advantages) != len(batch):
        raise ValueError(f"advantages has {len(advantages)} entries for {len(batch)} sequences")
    return [SequenceData(prompt_ids=batch.prompt_ids[i], response_ids=batch.response_ids[i],
                         advantage=float(advantages[i]), rollout_logprobs=batch.rollout_logprobs[i],
                         temperatures=batch.temperatures[i], index=i) for i in range(len(batch))]


def rollout_metrics(batch: RolloutBatch, *, max_response_length: int) -> dict[str, float]:
    """Per-step rollout metrics (means over sequences; temperature over response tokens)."""
    n = max(len(batch), 1)
    lengths = batch.response_lengths or [0]
    temps = [t for ts in batch.temperatures for t in ts]
    per_source: dict[str, list[bool]] = {}
    for src, a in zip(batch.data_sources, batch.accs):
        per_source.setdefault(src or "default", []).append(a)
    out = {
        "rollout/reward_mean": sum(batch.rewards) / n,
        "rollout/score_mean": sum(batch.scores) / n,
        "rollout/acc": sum(batch.accs) / n,
        "rollout/response_length_mean": sum(lengths) / len(lengths),
        "rollout/response_length_max": float(max(lengths)),
        "rollout/response_length_min": float(min(lengths)),
        "rollout/clip_ratio": sum(f == "length" or l >= max_response_length
                                  for f, l in zip(batch.finish_reasons, lengths)) / n,
        "rollout/temperature_mean": sum(temps) / len(temps) if temps else 0.0,
        "rollout/num_sequences": float(len(batch)),
        "rollout/num_groups": float(len(set(batch.group_ids))),
    }
    if len(per_source) > 1:
        for src, accs in sorted(per_source.items()):
            out[f"rollout/acc/{src}"] = sum(accs) / len(accs)
    return out
