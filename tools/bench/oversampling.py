"""Over-sampling with partial rollouts: rollout-phase time per step and trained tokens per second
with ``rollout.over_sampling`` 1.0 (off) and a factor above 1, in one run, against a stand-in
server with heavy-tailed response lengths (`paced_sglang_server.py --length-median`: lognormal,
sigma 1.0, capped at the maximum response length) that emits tokens at a fixed rate.

    PYTHONPATH=$PWD python tools/bench/oversampling.py            # the figures
    PYTHONPATH=$PWD python tools/bench/oversampling.py --small    # seconds

The rollout stage runs as the trainer runs it (`stages.generate_step` on rank 0: generation
rounds, scoring, dynamic sampling; with over-sampling the abort and the resumption of the partial
responses), step after step with the weight version advancing, without the update in between (it
takes the same time with and without). Trained tokens per second = response tokens of the trained
batches / rollout time. The length distribution of the trained responses is printed next to that of
the run without over-sampling (where every generated response trains): it must not skew short.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Optional

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REWARD = "tests.training.parity_reward:score"  # costs no CPU; the stand-in's tokens are random


class _NoMemory:
    """The engine-memory moves of a colocated run: nothing to move with separate servers."""

    def resume_generation(self):
        pass

    def release_all(self):
        pass

    def release_generation(self):
        pass


def build_rt(url: Optional[str], *, over_sampling: float, batch: int, n: int, max_len: int, prompts: int = 256,
             partial_mode: str = "correct", filter_groups: bool = False, seed: int = 1, extra=(), engine=None):
    """The parts of a `Runtime` the rollout stage reads (rank 0), on the server at ``url`` (or
    ``engine``)."""
    from hapo_megatron.config import load_config
    from hapo_megatron.data.sampler import PromptSampler
    from hapo_megatron.rewards.scoring import RewardScorer
    from hapo_megatron.rollout.sglang.engine import SGLangEngine
    from hapo_megatron.training.batches.rollout_batch import DynamicSampler
    from hapo_megatron.training.checkpointing.rl_state import RLState
    cfg = load_config(overrides=[
        "rollout.engine=sglang", "rollout.sglang.colocate=false", f"rollout.over_sampling={over_sampling}",
        f"rollout.partial_mode={partial_mode}", f"data.train_batch_size={batch}",
        f"trainer.ppo_mini_batch_size={batch}", f"rollout.n={n}", f"rollout.max_response_length={max_len}",
        f"algo.filter_groups={str(filter_groups).lower()}", "reward.overlong_buffer_enable=false",
        f"trainer.seed={seed}", f"reward.reward_fn={REWARD}", "reward.num_workers=0", *extra])
    ds = [SimpleNamespace(prompt_ids=[1, 3 + i % 29, 3 + i // 29], ground_truth=str(i), data_source="bench",
                          extra_info=None, index=i) for i in range(prompts)]
    sampler = PromptSampler(ds, cfg.rollout.generate_batch_size or batch, seed=seed, shuffle=True)
    rl = RLState(sampler=sampler, dyn=DynamicSampler(enabled=cfg.algo.filter_groups,
                                                     metric=cfg.algo.filter_groups_metric, max_num_gen_batches=16))
    if engine is None:
        sg = cfg.rollout.sglang
        sg.server_urls, sg.max_retries, sg.request_timeout_s = [url], 0, 600.0
        engine = SGLangEngine(sg, send_sampling_seed=True, launch=False, quantization=cfg.rollout.quantization,
                              kv_cache_dtype=cfg.rollout.kv_cache_dtype)
    rt = SimpleNamespace(cfg=cfg, train_ds=ds, engine=engine, rl=rl, memory=_NoMemory(),
                         scorer=RewardScorer(cfg.reward),
                         tokenizer=SimpleNamespace(decode=lambda ids, **kw: "".join(chr(65 + t % 26) for t in ids),
                                                   eos_token_id=None),
                         control=SimpleNamespace(send=lambda *a: None), async_rollout=None,
                         actor=SimpleNamespace(routing="off"))
    rt.sampling_seed = lambda step, gen: (seed * 1_000_003 + step * 1_009 + gen) % (2**31 - 1)
    return rt


def run_steps(rt, steps: int, first_step: int = 1) -> list[dict]:
    """``steps`` rollouts (`stages.generate_step`), the weight version advancing after each;
    per step: its metrics, its rollout seconds, its kept batch."""
    from hapo_megatron.training.stages import _apply_sampler_state, generate_step
    out = []
    for step in range(first_step, first_step + steps):
        t0 = time.monotonic()
        kept, metrics, state = generate_step(rt, step)
        out.append({"metrics": metrics, "rollout_s": time.monotonic() - t0, "kept": kept})
        _apply_sampler_state(rt, state)
        rt.rl.step = step
    return out


def summarize(rows: list[dict], warmup: int) -> dict:
    rows = rows[warmup:]
    secs = sum(r["rollout_s"] for r in rows)
    lengths = np.concatenate([r["kept"].response_lengths for r in rows]).astype(np.float64)
    m = [r["metrics"] for r in rows]
    return {"steps": len(rows), "rollout_s_per_step": secs / max(len(rows), 1),
            "trained_tokens_per_s": float(lengths.sum()) / max(secs, 1e-9),
            "len_mean": float(lengths.mean()), "len_p50": float(np.percentile(lengths, 50)),
            "len_p90": float(np.percentile(lengths, 90)),
            "aborted": sum(x.get("rollout/aborted", 0.0) for x in m),
            "resumed": sum(x.get("rollout/resumed", 0.0) for x in m),
            "older_frac": float(np.mean([x.get("rollout/older_version_token_frac", 0.0) for x in m]))}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="measured steps per setting")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out (the pool fills)")
    ap.add_argument("--batch", type=int, default=16, help="prompt groups per step")
    ap.add_argument("--n", type=int, default=8, help="responses per prompt")
    ap.add_argument("--max-len", type=int, default=512, help="rollout.max_response_length (the cap)")
    ap.add_argument("--median", type=float, default=64.0, help="median response length (lognormal)")
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--tokens-per-s", type=float, default=400.0, help="decode rate of every request")
    ap.add_argument("--factor", type=float, default=1.5, help="rollout.over_sampling of the second setting")
    ap.add_argument("--small", action="store_true", help="2 steps, tiny sizes (the suite's smoke test)")
    ap.add_argument("--out", default=None, help="directory for the server's request log")
    args = ap.parse_args(argv)
    if args.small:
        args.steps, args.warmup, args.batch, args.n, args.max_len, args.median = 2, 1, 2, 2, 16, 4.0
        args.tokens_per_s = 2000.0
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from async_rollout import start_servers, stop_servers
    rec_dir = args.out or tempfile.mkdtemp(prefix="hapo_oversampling_bench_")
    procs, urls = start_servers(1, args.tokens_per_s, rec_dir, extra=[
        ["--length-median", str(args.median), "--length-sigma", str(args.sigma)]])
    results = {}
    try:
        for factor in (1.0, args.factor):
            rt = build_rt(urls[0], over_sampling=factor, batch=args.batch, n=args.n, max_len=args.max_len)
            results[factor] = summarize(run_steps(rt, args.steps + args.warmup), args.warmup)
    finally:
        stop_servers(procs)
    base, over = results[1.0], results[args.factor]
    print(f"lognormal lengths median {args.median:g} sigma {args.sigma:g} capped at {args.max_len}; "
          f"{args.batch} groups x {args.n} per step; {args.tokens_per_s:g} tokens/s per request; "
          f"{args.steps} steps after {args.warmup}")
    print(f"{'over_sampling':>13} {'rollout s/step':>14} {'trained tok/s':>13} {'ratio':>6} "
          f"{'len mean':>8} {'p50':>5} {'p90':>5} {'aborted':>7} {'resumed':>7} {'older':>6}")
    for f, r in results.items():
        print(f"{f:13.2f} {r['rollout_s_per_step']:14.3f} {r['trained_tokens_per_s']:13.1f} "
              f"{r['trained_tokens_per_s'] / base['trained_tokens_per_s']:6.2f} {r['len_mean']:8.1f} "
              f"{r['len_p50']:5.0f} {r['len_p90']:5.0f} {r['aborted']:7.0f} {r['resumed']:7.0f} "
              f"{r['older_frac']:6.3f}")
    return {"results": results, "throughput_ratio": over["trained_tokens_per_s"] / base["trained_tokens_per_s"],
            "step_time_ratio": base["rollout_s_per_step"] / over["rollout_s_per_step"],
            "length_mean_ratio": over["len_mean"] / base["len_mean"]}


if __name__ == "__main__":
    main()
