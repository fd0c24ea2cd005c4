"""The host (CPU) side of one rollout step at recipe scale: the old path and the new one
in the same run.

A synthetic rollout of ``--prompts x --n`` responses (prompts of ``--prompt-len`` tokens, lognormal
response lengths of mean ``--mean`` and shape ``--sigma``, capped at ``--cap``; each response ends in
a ``\\boxed{}`` answer, right or wrong) goes through the real math reward and the real data path,
each role in a fresh process (its peak RSS is its own):

- **rank 0, old path** (BASELINE, reconstructed below from the functions before the array path, the
  ``legacy_*`` functions): after the last response, score every response serially, build the batch
  as per-token Python lists, shape, filter, metrics, pack and pickle the whole batch (one message
  for every rank). All of it is left after the last response.
- **rank 0, new path** (`stages._rollout_rank0` with a stand-in engine that hands over chunks of
  ``--chunk`` responses evenly over ``--gen-s`` seconds, as SGLang's ``/generate`` calls return;
  the reward workers, ``reward.num_workers`` auto, score while it "generates"), then the kept
  batch split per DP rank and pickled (`stages._share_out`'s work). Reported: the seconds from the
  last response to the messages being ready.
- **one rank, old / new, per ``--dp``**: receive (unpickle the message bytes: the network
  transfer itself is not simulated; the message size is printed) + advantages + layout of DP rank
  0's micro-batches; seconds and RSS growth over the process before the message arrived.

    python tools/bench/host_step.py                                   # 512 x 16, mean 2.5k, DP 1 and 8
    python tools/bench/host_step.py --prompts 32 --n 4 --mean 300 --gen-s 2 --dp 1 2   # quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import resource
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

LAYOUT = dict(ppo_mini_batch_size=32, micro_batch_size=1, max_tokens_per_micro_batch=22528, pack=False)  # 7B recipe
WORDS = np.array([f"w{i} " for i in range(1000)])


# --------------------------------------------------------------------------- the synthetic rollout
def synth(prompts: int, n: int, prompt_len: int, mean: float, sigma: float, cap: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    mu = math.log(mean) - sigma ** 2 / 2  # E[lognormal(mu, sigma)] = exp(mu + sigma^2 / 2)
    lengths = np.minimum(np.maximum(np.round(rng.lognormal(mu, sigma, prompts * n)), 2), cap).astype(np.int64)
    resp = rng.integers(0, 150_000, int(lengths.sum()), dtype=np.int64).astype(np.int32)
    ends = np.cumsum(lengths) - 1
    answers = rng.integers(0, 4, prompts * n)  # the last token encodes the answer: right (0) or wrong
    resp[ends] = answers.astype(np.int32)
    return {"prompts": rng.integers(0, 150_000, (prompts, prompt_len), dtype=np.int64).astype(np.int32),
            "resp": resp, "lengths": lengths, "logprobs": -rng.random(len(resp), dtype=np.float32),
            "n": np.int64(n), "truths": rng.integers(0, 100, prompts)}


def decode(ids) -> str:
    """Stand-in tokenizer: one word per token (the cost grows with the length), the last token the
    answer: ``\\boxed{truth}`` for 0, another number otherwise."""
    ids = np.asarray(ids)
    body = "".join(WORDS[ids[:-1] % 1000])
    return body + f" so the answer is \\boxed{{{int(ids[-1])}}}"


def records(d: dict) -> list:
    return [SimpleNamespace(prompt_ids=p.tolist(), ground_truth="0", data_source="math", extra_info=None)
            for p in d["prompts"]]


def samples(d: dict, *, as_lists: bool) -> list[list]:
    """``samples[prompt][k]``: the engine's answer; lists (the old engines) or arrays."""
    from hapo_megatron.rollout.engine import Sample
    off = np.concatenate([[0], np.cumsum(d["lengths"])])
    n = int(d["n"])
    conv = (lambda a: a.tolist()) if as_lists else (lambda a: a)
    out = []
    for p, prompt in enumerate(d["prompts"]):
        group = []
        for k in range(n):
            i = p * n + k
            a, b = off[i], off[i + 1]
            group.append(Sample(prompt_ids=conv(prompt), response_ids=conv(d["resp"][a:b]),
                                rollout_logprobs=conv(d["logprobs"][a:b]), temperatures=[],
                                finish_reason="stop", prompt_index=p, sample_index=k))
        out.append(group)
    return out


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


# --------------------------------------------------------------------------- BASELINE: the old path
# The functions of hapo_megatron/training/batches/rollout_batch.py and stages.layout before the array path, per-token
# Python lists throughout; kept here only to measure against (and as the reference of
# tests/training/batches/test_array_path.py).
LEGACY_RAGGED = {"prompt_ids": "int32", "response_ids": "int32", "rollout_logprobs": "float32",
                 "temperatures": "float32"}
LEGACY_FIELDS = ("prompt_ids", "response_ids", "rollout_logprobs", "temperatures", "finish_reasons", "group_ids",
                 "scores", "accs", "rewards", "data_sources")


def legacy_build_batch(samples, records, results, *, group_offset: int = 0) -> dict:
    out = {f: [] for f in LEGACY_FIELDS}
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


def legacy_select(b: dict, idx) -> dict:
    return {f: [b[f][i] for i in idx] for f in LEGACY_FIELDS}


def legacy_filter(b: dict, metric: str = "acc") -> dict:
    """DynamicSampler.add's filter (one round, enabled)."""
    from hapo_megatron.algo import filter_groups
    values = b["accs"] if metric == "acc" else b["rewards"]
    mask = filter_groups(torch.tensor(b["rewards"], dtype=torch.float32), b["group_ids"],
                         torch.tensor([float(v) for v in values], dtype=torch.float32))
    return legacy_select(b, [i for i, k in enumerate(mask.tolist()) if k])


def legacy_rollout_metrics(b: dict, *, max_response_length: int) -> dict:
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


def legacy_pack(b: dict) -> dict:
    out = {}
    for f in LEGACY_FIELDS:
        if f in LEGACY_RAGGED:
            out[f] = (np.asarray([x for row in b[f] for x in row], dtype=LEGACY_RAGGED[f]),
                      np.asarray([len(row) for row in b[f]], dtype=np.int64))
        else:
            out[f] = list(b[f])
    return out


def legacy_unpack(d: dict) -> dict:
    out = {}
    for f in LEGACY_FIELDS:
        if f in LEGACY_RAGGED:
            flat, lengths = d[f]
            bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
            items = flat.tolist()
            out[f] = [items[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        else:
            out[f] = list(d[f])
    return out


def legacy_sequence_advantages(rewards, lengths, group_ids, *, adv_estimator="hapo", norm_adv_by_std=True,
                               fallback_threshold=5.0):
    """[B, max L] mask, then the token-level estimators (rl_step.sequence_advantages before)."""
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


def legacy_layout(b: dict, adv, *, dp_rank: int, dp_size: int, ppo_mini_batch_size: int, micro_batch_size: int,
                  max_tokens_per_micro_batch, pack: bool, pad_multiple: int = 1, seq_multiple: int = 1,
                  row_multiple: int = 1) -> list:
    """to_sequences over the whole batch, then build_rank_micro_batches per mini-batch."""
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


# --------------------------------------------------------------------------- the roles
def _cfg(prompts: int, n: int, cap: int):
    from hapo_megatron.config import HapoConfig
    return HapoConfig.from_dict({
        "data": {"train_batch_size": prompts},
        "trainer": {"ppo_mini_batch_size": LAYOUT["ppo_mini_batch_size"]},
        "rollout": {"n": n, "max_response_length": cap},
        "algo": {"adaptive_temperature": False, "filter_groups": True, "max_num_gen_batches": 1},
        "parallel": {"micro_batch_size": LAYOUT["micro_batch_size"],
                     "max_tokens_per_micro_batch": LAYOUT["max_tokens_per_micro_batch"],
                     "pack_sequences": LAYOUT["pack"]},
        "reward": {"reward_fn": "math"}})


def role_rank0_old(d: dict, out_dir: str, cap: int) -> dict:
    from hapo_megatron.rewards import get_reward_fn
    from hapo_megatron.training.batches.rollout_batch import DynamicSampler  # noqa: F401 - the old one filtered the same way
    smp, recs = samples(d, as_lists=True), records(d)
    reward_fn = get_reward_fn("math")
    reward_fn(decode(np.array([0, 0])), "0")  # its imports happen once per process, not per step
    t = {}
    t0 = time.perf_counter()
    results = [[reward_fn(decode(list(s.response_ids)), rec.ground_truth, score_format="pm1", data_source="math",
                          extra_info=None) for s in group] for group, rec in zip(smp, recs)]
    t["score"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    b = legacy_build_batch(smp, recs, results)
    kept = legacy_filter(b)  # shaping is off in the recipe: rewards = scores
    legacy_rollout_metrics(b, max_response_length=cap)
    t["build+filter+metrics"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    msg = pickle.dumps(legacy_pack(kept), protocol=pickle.HIGHEST_PROTOCOL)
    t["pack+pickle"] = time.perf_counter() - t2
    total = time.perf_counter() - t0
    with open(os.path.join(out_dir, "old.msg"), "wb") as f:
        f.write(msg)
    return {"after_last_response_s": total, "stages_s": t, "message_mb": len(msg) / 2 ** 20,
            "kept": len(kept["response_ids"]), "peak_rss_mb": peak_rss_mb()}


class _ChunkedEngine:
    """Stand-in for the SGLang engine: hands the samples over in chunks of ``chunk`` evenly over
    ``gen_s`` seconds (generation itself is not simulated), records when the last one arrived."""

    def __init__(self, smp: list, chunk: int, gen_s: float):
        self.smp, self.chunk, self.gen_s, self.last_response = smp, chunk, gen_s, None

    def generate(self, prompt_ids, params, on_samples=None):
        flat = [s for group in self.smp for s in group]
        parts = [flat[i:i + self.chunk] for i in range(0, len(flat), self.chunk)]
        start = time.monotonic()
        for k, part in enumerate(parts):
            time.sleep(max(0.0, start + self.gen_s * (k + 1) / len(parts) - time.monotonic()))
            if on_samples is not None:
                on_samples(part)
        self.last_response = time.perf_counter()
        return self.smp

    def release_memory(self, tags=None):
        pass

    def resume_memory(self, tags=None):
        pass


def role_rank0_new(d: dict, out_dir: str, cap: int, chunk: int, gen_s: float, dps: list[int]) -> dict:
    from hapo_megatron.rewards import get_reward_fn
    from hapo_megatron.rewards.scoring import RewardScorer
    from hapo_megatron.training import stages
    from hapo_megatron.training.memory.engine_memory import EngineMemory
    from hapo_megatron.training.batches.rollout_batch import DynamicSampler
    from hapo_megatron.training.batches.rollout_share import SequenceMeta, split_for_ranks
    prompts, n = len(d["prompts"]), int(d["n"])
    cfg = _cfg(prompts, n, cap)
    recs = records(d)
    engine = _ChunkedEngine(samples(d, as_lists=False), chunk, gen_s)
    scorer = RewardScorer.from_config(cfg.reward)
    rt = SimpleNamespace(
        cfg=cfg, engine=engine, memory=EngineMemory(engine), control=SimpleNamespace(send=lambda kind, body: None),
        sampling_seed=lambda step, i: 0,
        actor=SimpleNamespace(routing="off"),  # a dense model: no experts to return
        tokenizer=SimpleNamespace(decode=lambda ids, **_: decode(ids), eos_token_id=None),
        reward_fn=get_reward_fn("math"), scorer=scorer,
        rl=SimpleNamespace(dyn=DynamicSampler(enabled=True, max_num_gen_batches=1),
                           sampler=SimpleNamespace(next_batch=lambda: recs, state_dict=lambda: {}),
                           rollout_entropy_stats=None))
    try:
        kept, metrics, _ = stages._rollout_rank0(rt, 1)
        t_ready = time.perf_counter()
        meta = SequenceMeta.of(kept)
        out = {}
        for dp in dps:  # what `stages._share_out` does on rank 0: split, one message per DP rank
            t0 = time.perf_counter()
            parts = [kept] if dp == 1 else split_for_ranks(kept, stages._plan(_rt_for(cfg, dp, 0), meta), dp)
            msgs = [pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL) for p in parts]
            split_s = time.perf_counter() - t0
            with open(os.path.join(out_dir, f"new_dp{dp}.msg"), "wb") as f:
                f.write(msgs[0])
            out[dp] = {"split+pickle_s": split_s, "message_mb_rank0": len(msgs[0]) / 2 ** 20,
                       "messages_mb_total": sum(map(len, msgs)) / 2 ** 20}
        with open(os.path.join(out_dir, "meta.msg"), "wb") as f:
            f.write(pickle.dumps((meta, metrics), protocol=pickle.HIGHEST_PROTOCOL))
    finally:
        scorer.close()
    first = out[dps[0]]
    return {"after_last_response_s": t_ready - engine.last_response + first["split+pickle_s"],
            "results+build+filter+metrics_s": t_ready - engine.last_response, "per_dp": out,
            "reward_wait_s": metrics["timing/reward_wait_s"], "kept": len(kept),
            "num_workers": scorer.pool.num_workers if scorer.pool is not None else 0, "peak_rss_mb": peak_rss_mb()}


def _rt_for(cfg, dp: int, dp_rank: int):
    return SimpleNamespace(cfg=cfg, groups=SimpleNamespace(tp_size=1, cp_size=1, dp_size=dp, dp_rank=dp_rank))


def role_rank(out_dir: str, path: str, dp: int, prompts: int, n: int, cap: int) -> dict:
    from hapo_megatron.training import stages
    from hapo_megatron.training.batches.rollout_share import RankBatch, held_sequences
    cfg = _cfg(prompts, n, cap)
    legacy_layout({f: [] for f in LEGACY_FIELDS}, [], dp_rank=0, dp_size=1, ppo_mini_batch_size=1, micro_batch_size=1,
                  max_tokens_per_micro_batch=None, pack=False)  # its imports, before the baseline RSS
    rss0 = rss_mb()
    if path == "old":
        with open(os.path.join(out_dir, "old.msg"), "rb") as f:
            raw = f.read()
        t0 = time.perf_counter()
        b = legacy_unpack(pickle.loads(raw))
        t_recv = time.perf_counter() - t0
        lengths = [len(r) for r in b["response_ids"]]
        adv, _ = legacy_sequence_advantages(b["rewards"], lengths, b["group_ids"])
        mbs = legacy_layout(b, adv, dp_rank=0, dp_size=dp, ppo_mini_batch_size=LAYOUT["ppo_mini_batch_size"],
                            micro_batch_size=LAYOUT["micro_batch_size"],
                            max_tokens_per_micro_batch=LAYOUT["max_tokens_per_micro_batch"], pack=LAYOUT["pack"])
    else:
        with open(os.path.join(out_dir, "meta.msg"), "rb") as f:
            raw_meta = f.read()
        with open(os.path.join(out_dir, f"new_dp{dp}.msg"), "rb") as f:
            raw = f.read()
        t0 = time.perf_counter()
        meta, _ = pickle.loads(raw_meta)
        tokens = pickle.loads(raw)
        t_recv = time.perf_counter() - t0
        rt = _rt_for(cfg, dp, 0)
        batch = RankBatch(meta, held_sequences(stages._plan(rt, meta), 0) if dp > 1 else np.arange(len(meta)), tokens)
        adv, _ = stages.advantages(rt, batch)
        mbs, _ = stages.layout(rt, batch, adv)
    total = time.perf_counter() - t0
    tokens_laid = sum(int(mb.loss_mask.sum()) for mini in mbs for mb in mini)
    return {"receive_s": t_recv, "receive+layout_s": total, "rss_growth_mb": peak_rss_mb() - rss0,
            "peak_rss_mb": peak_rss_mb(), "message_mb": len(raw) / 2 ** 20, "response_tokens_laid_out": tokens_laid}


# --------------------------------------------------------------------------- driver
def _child(args: argparse.Namespace, role: list[str]) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--role", *role, "--out", args.out,
           "--prompts", str(args.prompts), "--n", str(args.n), "--cap", str(args.cap),
           "--chunk", str(args.chunk), "--gen-s", str(args.gen_s), "--dp", *map(str, args.dp)]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    if res.returncode:
        raise RuntimeError(f"{' '.join(role)} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--mean", type=float, default=2500.0)
    ap.add_argument("--sigma", type=float, default=0.6)
    ap.add_argument("--cap", type=int, default=10240)
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--chunk", type=int, default=64, help="responses per /generate call")
    ap.add_argument("--gen-s", type=float, default=120.0, help="seconds over which the responses arrive")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        with np.load(os.path.join(args.out, "rollout.npz")) as z:
            d = {k: z[k] for k in z.files}
        kind = args.role[0]
        if kind == "rank0-old":
            res = role_rank0_old(d, args.out, args.cap)
        elif kind == "rank0-new":
            res = role_rank0_new(d, args.out, args.cap, args.chunk, args.gen_s, args.dp)
        else:
            del d
            res = role_rank(args.out, args.role[1], int(args.role[2]), args.prompts, args.n, args.cap)
        print(json.dumps(res, default=float))
        return
    with tempfile.TemporaryDirectory(prefix="host_step_") as out:
        args.out = out
        d = synth(args.prompts, args.n, args.prompt_len, args.mean, args.sigma, args.cap, args.seed)
        np.savez(os.path.join(out, "rollout.npz"), **d)
        print(f"rollout: {args.prompts} x {args.n} responses, {int(d['lengths'].sum())} response tokens "
              f"(mean {d['lengths'].mean():.0f}), prompts of {args.prompt_len}; layout {LAYOUT}; "
              f"responses arrive in chunks of {args.chunk} over {args.gen_s:.0f} s")
        old0 = _child(args, ["rank0-old"])
        new0 = _child(args, ["rank0-new"])
        print("\nrank 0: host seconds left after the last response")
        print(f"  old (baseline, serial): {old0['after_last_response_s']:8.2f} s  {_fmt(old0['stages_s'])}  "
              f"message to every rank {old0['message_mb']:.0f} MB, peak RSS {old0['peak_rss_mb']:.0f} MB")
        print(f"  new:                    {new0['after_last_response_s']:8.2f} s  "
              f"(results+build+filter+metrics {new0['results+build+filter+metrics_s']:.2f} s, split+pickle "
              f"for DP={args.dp[0]} {new0['per_dp'][str(args.dp[0])]['split+pickle_s']:.2f} s; "
              f"{new0['num_workers']} reward workers, reward wait {new0['reward_wait_s']:.2f} s), "
              f"peak RSS {new0['peak_rss_mb']:.0f} MB")
        print(f"  new / old: {new0['after_last_response_s'] / old0['after_last_response_s']:.1%}")
        print("\none rank (DP rank 0): receive (unpickle) + advantages + layout")
        for dp in args.dp:
            for path in ("old", "new"):
                r = _child(args, ["rank", path, str(dp)])
                print(f"  DP={dp:<2} {path:3}{' (baseline)' if path == 'old' else '           '}: "
                      f"receive+layout {r['receive+layout_s']:6.2f} s (receive {r['receive_s']:.2f} s), "
                      f"message {r['message_mb']:6.0f} MB, RSS growth {r['rss_growth_mb']:6.0f} MB, "
                      f"response tokens laid out {r['response_tokens_laid_out']}")


def _fmt(stages: dict) -> str:
    return "(" + ", ".join(f"{k} {v:.2f} s" for k, v in stages.items()) + ")"


if __name__ == "__main__":
    main()
