"""The host (CPU) side of one rollout step at recipe scale.

A synthetic rollout of ``--prompts x --n`` responses (prompts of ``--prompt-len`` tokens, lognormal
response lengths of mean ``--mean`` and shape ``--sigma``, capped at ``--cap``; each response ends in
a ``\\boxed{}`` answer, right or wrong) goes through the real math reward and the real data path,
each role in a fresh process (its peak RSS is its own):

- **rank 0** (`stages.generate_step` with a stand-in engine that hands over chunks of ``--chunk``
  responses evenly over ``--gen-s`` seconds, as SGLang's ``/generate`` calls return; the reward
  workers, ``reward.num_workers`` auto, score while it "generates"), then the kept batch split per
  DP rank and pickled (`stages._share_out`'s work). Reported: the seconds from the last response
  to the messages being ready.
- **one rank, per ``--dp``**: receive (unpickle the message bytes: the network transfer itself is
  not simulated; the message size is printed) + advantages + layout of DP rank 0's micro-batches;
  seconds and RSS growth over the process before the message arrived.

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


def samples(d: dict) -> list[list]:
    """``samples[prompt][k]``: the engine's answer, as arrays."""
    from hapo_megatron.rollout.engine import Sample
    off = np.concatenate([[0], np.cumsum(d["lengths"])])
    n = int(d["n"])
    out = []
    for p, prompt in enumerate(d["prompts"]):
        group = []
        for k in range(n):
            i = p * n + k
            a, b = off[i], off[i + 1]
            group.append(Sample(prompt_ids=prompt, response_ids=d["resp"][a:b],
                                rollout_logprobs=d["logprobs"][a:b], temperatures=[],
                                finish_reason="stop", prompt_index=p, sample_index=k))
        out.append(group)
    return out


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


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

    # the rest of the RolloutEngine protocol (rollout/engine.py), which the synchronous loop calls
    dtype, send_sampling_seed, stop_check = None, False, None

    def generate_group(self, rows, params):
        raise NotImplementedError("the host-step bench runs the synchronous loop only")

    def update_weights(self, named_tensors, *, weight_version=None, flush_cache=True):
        from hapo_megatron.rollout.engine import drain_weights
        drain_weights(named_tensors)

    def release_memory(self, tags=None):
        pass

    def resume_memory(self, tags=None):
        pass

    def abort_requests(self):
        pass

    def pause_generation(self, mode="retract"):
        pass

    def continue_generation(self):
        pass

    def spread_calls(self, enabled=True):
        pass

    def fault_metrics(self):
        return {}

    def check_health(self):
        pass

    def shutdown(self):
        pass


def role_rank0(d: dict, out_dir: str, cap: int, chunk: int, gen_s: float, dps: list[int]) -> dict:
    from hapo_megatron.rewards import get_reward_fn
    from hapo_megatron.rewards.scoring import RewardScorer
    from hapo_megatron.training import stages
    from hapo_megatron.training.memory.engine_memory import EngineMemory
    from hapo_megatron.training.batches.rollout_batch import DynamicSampler
    from hapo_megatron.training.batches.rollout_share import SequenceMeta, split_for_ranks
    prompts, n = len(d["prompts"]), int(d["n"])
    cfg = _cfg(prompts, n, cap)
    recs = records(d)
    engine = _ChunkedEngine(samples(d), chunk, gen_s)
    scorer = RewardScorer(cfg.reward)
    rt = SimpleNamespace(
        cfg=cfg, engine=engine, memory=EngineMemory(engine), control=SimpleNamespace(send=lambda kind, body: None),
        sampling_seed=lambda step, i: 0,
        actor=SimpleNamespace(routing="off"),  # a dense model: no experts to return
        tokenizer=SimpleNamespace(decode=lambda ids, **_: decode(ids), eos_token_id=None),
        reward_fn=get_reward_fn("math"), scorer=scorer,
        rl=SimpleNamespace(dyn=DynamicSampler(enabled=True, max_num_gen_batches=1, metric='acc'),
                           sampler=SimpleNamespace(next_batch=lambda: recs, state_dict=lambda: {}),
                           rollout_entropy_stats=None))
    try:
        kept, metrics, _ = stages.generate_step(rt, 1)
        t_ready = time.perf_counter()
        meta = SequenceMeta.of(kept)
        out = {}
        for dp in dps:  # what `stages._share_out` does on rank 0: split, one message per DP rank
            t0 = time.perf_counter()
            parts = [kept] if dp == 1 else split_for_ranks(kept, stages._plan(_rt_for(cfg, dp, 0), meta), dp)
            msgs = [pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL) for p in parts]
            split_s = time.perf_counter() - t0
            with open(os.path.join(out_dir, f"dp{dp}.msg"), "wb") as f:
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


def role_rank(out_dir: str, dp: int, prompts: int, n: int, cap: int) -> dict:
    from hapo_megatron.training import stages
    from hapo_megatron.training.batches.rollout_share import RankBatch, held_sequences
    cfg = _cfg(prompts, n, cap)
    rss0 = rss_mb()
    with open(os.path.join(out_dir, "meta.msg"), "rb") as f:
        raw_meta = f.read()
    with open(os.path.join(out_dir, f"dp{dp}.msg"), "rb") as f:
        raw = f.read()
    t0 = time.perf_counter()
    meta, _ = pickle.loads(raw_meta)
    tokens = pickle.loads(raw)
    t_recv = time.perf_counter() - t0
    rt = _rt_for(cfg, dp, 0)
    plans = stages._plan(rt, meta)
    batch = RankBatch(meta, held_sequences(plans, 0) if dp > 1 else np.arange(len(meta)), tokens, plans)
    adv, _ = stages.advantages(rt, batch)
    mbs, _ = stages.layout(rt, batch, adv)
    total = time.perf_counter() - t0
    tokens_laid = sum(int(mb.loss_mask.sum()) for mini in mbs for mb in mini)
    return {"receive_s": t_recv, "receive+layout_s": total, "rss_growth_mb": peak_rss_mb() - rss0,
            "peak_rss_mb": peak_rss_mb(), "message_mb": len(raw) / 2 ** 20, "response_tokens_laid_out": tokens_laid,
            "kept_response_tokens": int(meta.response_lengths.sum())}


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
        if args.role[0] == "rank0":
            res = role_rank0(d, args.out, args.cap, args.chunk, args.gen_s, args.dp)
        else:
            del d
            res = role_rank(args.out, int(args.role[1]), args.prompts, args.n, args.cap)
        print(json.dumps(res, default=float))
        return
    with tempfile.TemporaryDirectory(prefix="host_step_") as out:
        args.out = out
        d = synth(args.prompts, args.n, args.prompt_len, args.mean, args.sigma, args.cap, args.seed)
        np.savez(os.path.join(out, "rollout.npz"), **d)
        print(f"rollout: {args.prompts} x {args.n} responses, {int(d['lengths'].sum())} response tokens "
              f"(mean {d['lengths'].mean():.0f}), prompts of {args.prompt_len}; layout {LAYOUT}; "
              f"responses arrive in chunks of {args.chunk} over {args.gen_s:.0f} s")
        r0 = _child(args, ["rank0"])
        print("\nrank 0: host seconds left after the last response")
        print(f"  {r0['after_last_response_s']:8.2f} s (results+build+filter+metrics "
              f"{r0['results+build+filter+metrics_s']:.2f} s, split+pickle for DP={args.dp[0]} "
              f"{r0['per_dp'][str(args.dp[0])]['split+pickle_s']:.2f} s; {r0['num_workers']} reward workers, "
              f"reward wait {r0['reward_wait_s']:.2f} s), {r0['kept']} responses kept, "
              f"peak RSS {r0['peak_rss_mb']:.0f} MB")
        print("\none rank (DP rank 0): receive (unpickle) + advantages + layout")
        for dp in args.dp:
            r = _child(args, ["rank", str(dp)])
            print(f"  DP={dp:<2}: receive+layout {r['receive+layout_s']:6.2f} s (receive {r['receive_s']:.2f} s), "
                  f"message {r['message_mb']:6.0f} MB, RSS growth {r['rss_growth_mb']:6.0f} MB, "
                  f"response tokens laid out {r['response_tokens_laid_out']} of {r['kept_response_tokens']} kept")


if __name__ == "__main__":
    main()
