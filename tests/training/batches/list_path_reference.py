"""A slow, obviously-correct reference for tests/training/batches/test_array_path.py: a step's batch as
per-token Python lists, the advantages from a ``[B, max L]`` response mask through the token-level
estimators (`algo.token_level_group_advantages`, `algo.grpo_advantages`), and each mini-batch laid
out by `batching.build_rank_micro_batches` over the whole list of sequences. The array path
(`rl_step`, `rollout_share`, `stages.layout`) must give the same numbers."""

import torch

RAGGED = {"prompt_ids": "int32", "response_ids": "int32", "rollout_logprobs": "float32", "temperatures": "float32"}
FIELDS = ("prompt_ids", "response_ids", "rollout_logprobs", "temperatures", "finish_reasons", "group_ids",
          "scores", "accs", "rewards", "data_sources")


def build_batch(samples, records, results, *, group_offset: int = 0) -> dict:
    """``{field: [one entry per response]}``, prompts in order, their responses in order."""
    out = {f: [] for f in FIELDS}
    for p, (group, rec, scored) in enumerate(zip(samples, records, results)):
        for smp, res in zip(group, scored):
            out["prompt_ids"].append(list(smp.prompt_ids))
            out["response_ids"].append(list(smp.response_ids))
            out["rollout_logprobs"].append([float(x) for x in smp.rollout_logprobs])
            out["temperatures"].append([float(x) for x in smp.temperatures])
            out["finish_reasons"].append(str(smp.finish_reason))
            out["group_ids"].append(group_offset + p)
            out["scores"].append(float(res.score))
            out["accs"].append(bool(res.acc))
            out["rewards"].append(float(res.score))
            out["data_sources"].append(str(getattr(rec, "data_source", "")))
    return out


def select(b: dict, idx) -> dict:
    return {f: [b[f][i] for i in idx] for f in FIELDS}


def filter_groups(b: dict, metric: str = "acc") -> dict:
    """One round of dynamic sampling: the groups whose ``metric`` varies."""
    from hapo_megatron.algo import filter_groups as keep
    values = b["accs"] if metric == "acc" else b["rewards"]
    mask = keep(torch.tensor(b["rewards"], dtype=torch.float32), b["group_ids"],
                torch.tensor([float(v) for v in values], dtype=torch.float32))
    return select(b, [i for i, k in enumerate(mask.tolist()) if k])


def rollout_metrics(b: dict, *, max_response_length: int) -> dict:
    n = max(len(b["response_ids"]), 1)
    lengths = [len(r) for r in b["response_ids"]] or [0]
    temps = [t for ts in b["temperatures"] for t in ts]
    per_source: dict = {}
    for src, a in zip(b["data_sources"], b["accs"]):
        per_source.setdefault(src or "default", []).append(a)
    out = {"rollout/reward_mean": sum(b["rewards"]) / n, "rollout/score_mean": sum(b["scores"]) / n,
           "rollout/acc": sum(b["accs"]) / n, "rollout/response_length_mean": sum(lengths) / len(lengths),
           "rollout/response_length_max": float(max(lengths)), "rollout/response_length_min": float(min(lengths)),
           "rollout/clip_ratio": sum(f == "length" or L >= max_response_length
                                     for f, L in zip(b["finish_reasons"], lengths)) / n,
           "rollout/temperature_mean": sum(temps) / len(temps) if temps else 0.0,
           "rollout/num_sequences": float(len(b["response_ids"])),
           "rollout/num_groups": float(len(set(b["group_ids"])))}
    if len(per_source) > 1:
        for src, accs in sorted(per_source.items()):
            out[f"rollout/acc/{src}"] = sum(accs) / len(accs)
    return out


def sequence_advantages(rewards, lengths, group_ids, *, adv_estimator="hapo", norm_adv_by_std=True,
                        fallback_threshold=5.0):
    """Per-token advantages over a ``[B, max L]`` mask, read at each response's first token."""
    from hapo_megatron.algo import grpo_advantages, token_level_group_advantages
    if not len(rewards):
        return torch.zeros(0), {}
    r = torch.tensor([float(x) for x in rewards], dtype=torch.float32)
    width = max([1, *lengths])
    mask = (torch.arange(width).unsqueeze(0) < torch.tensor(list(lengths)).unsqueeze(1)).float()
    gids = torch.tensor([int(g) for g in group_ids], dtype=torch.long)
    metrics = {}
    if adv_estimator == "hapo":
        adv, fallback = token_level_group_advantages(r, gids, mask, norm_adv_by_std=norm_adv_by_std,
                                                     fallback_threshold=fallback_threshold, return_fallback=True)
        fell = {int(g) for g, f in zip(group_ids, fallback.tolist()) if f}
        metrics["adv/tlga_fallback_rate"] = len(fell) / len(set(int(g) for g in group_ids))
    else:
        adv = grpo_advantages(r, gids, mask, norm_adv_by_std=norm_adv_by_std)
    per_seq = torch.where(torch.tensor([int(x) > 0 for x in lengths]), adv[:, 0], torch.zeros(()))
    metrics["adv/abs_mean"] = float(per_seq.abs().mean())
    return per_seq, metrics


def layout(b: dict, adv, *, dp_rank: int, dp_size: int, ppo_mini_batch_size: int, micro_batch_size: int,
           max_tokens_per_micro_batch, pack: bool, pad_multiple: int = 1, seq_multiple: int = 1,
           row_multiple: int = 1) -> list:
    """Every sequence with its advantage, then `build_rank_micro_batches` per PPO mini-batch."""
    from hapo_megatron.training.batches.micro_batches import SequenceData, build_rank_micro_batches, split_mini_batches
    seqs = [SequenceData(prompt_ids=b["prompt_ids"][i], response_ids=b["response_ids"][i], advantage=float(adv[i]),
                         rollout_logprobs=b["rollout_logprobs"][i], temperatures=b["temperatures"][i], index=i)
            for i in range(len(b["response_ids"]))]
    minis = split_mini_batches(list(dict.fromkeys(b["group_ids"])), b["group_ids"], ppo_mini_batch_size)
    return [build_rank_micro_batches([seqs[i] for i in idx], dp_rank=dp_rank, dp_size=dp_size,
                                     micro_batch_size=micro_batch_size,
                                     max_tokens_per_micro_batch=max_tokens_per_micro_batch, pack=pack,
                                     pad_multiple=pad_multiple, seq_multiple=seq_multiple, row_multiple=row_multiple)
            for idx in minis]
