"""Bytes of MoE routes per training step (docs/moe.md, "Routes volume"), before and after each
rank got only its pipeline stage's layers in one byte per expert id (`training/batches/route_share.py`).

A step of ``--prompts x --responses`` sequences (``--prompt-len`` tokens of prompt, lognormal
responses of mean ``--mean`` capped at ``--cap``, `tools/bench/packing.py`'s `sample_lengths`)
routed by a model of ``--layers`` x top-``--top-k`` over ``--experts`` experts. Every sequence has
``prompt + response - 1`` routed positions. The figures come from the trainer's own plan
(`rollout_share.step_plan`: which data-parallel rank holds which sequence) on a world of
``dp x tp x pp`` ranks:

- ``sglang -> rank 0``: SGLang's answer, base64 text of int32 ids (4/3 x 4 bytes per id);
- ``rank 0 host``: the step's `RolloutBatch` routes (int16);
- ``share-out sent``: what rank 0 sends the other ranks (one message each; every rank of a DP
  group receives that group's sequences);
- ``largest rank``: the most any one rank receives.

Defaults: the Qwen3-30B-A3B recipe (examples/qwen3-30b-a3b: 48 layers, top-8 of 128 experts,
TP2 x PP2 x DP4, 512 x 16 responses of up to 10240 tokens after 1024-token prompts, PPO
mini-batches of 32 prompts, a 22528-token budget).
``--check`` builds a small batch and compares the formula with the pickled bytes of the parts that
`stages._stage_part` really makes.

    python tools/bench/routes_volume.py
    python tools/bench/routes_volume.py --mean 2500 --check
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

GIB = 2.0 ** 30


def _plan_holders(lengths, prompt_len, *, responses, dp, mini_prompts, budget):
    """The data-parallel rank of every sequence under the trainer's plan."""
    import numpy as np

    from hapo_megatron.training.batches.rollout_share import SequenceMeta, held_sequences, step_plan
    n = len(lengths)
    meta = SequenceMeta(group_ids=[i // responses for i in range(n)],
                        prompt_lengths=np.full(n, prompt_len, np.int64),
                        response_lengths=np.asarray(lengths, np.int64) - prompt_len)
    plans = step_plan(meta, ppo_mini_batch_size=mini_prompts, dp_size=dp, micro_batch_size=1,
                      max_tokens_per_micro_batch=budget, pack=False)
    holder = np.zeros(n, np.int64)
    for d in range(dp):
        holder[held_sequences(plans, d)] = d
    return holder


def volume(lengths, prompt_len, *, responses, layers, top_k, experts, tp, pp, dp, mini_prompts, budget) -> dict:
    """Bytes of one step's routes at each point of the data path, before and after."""
    import numpy as np

    from hapo_megatron.training.batches.route_share import route_dtype
    positions = np.asarray(lengths, np.int64) - 1
    holder = _plan_holders(lengths, prompt_len, responses=responses, dp=dp, mini_prompts=mini_prompts, budget=budget)
    ids_per_dp = np.bincount(holder, weights=positions * layers * top_k, minlength=dp)  # all layers
    total_ids = float(ids_per_dp.sum())
    compact = np.dtype(route_dtype(experts)).itemsize
    before_part = ids_per_dp * 2  # every layer, int16, to each rank of the DP group
    after_part = ids_per_dp / pp * compact  # the stage's layers, compact
    # world ranks: (dp, pp, tp) coordinates; rank 0 (dp 0, stage 0, tp 0) keeps its own part
    ranks = [(d, p) for d in range(dp) for p in range(pp) for _ in range(tp)]
    sent_before = sum(before_part[d] for d, _ in ranks[1:])
    sent_after = sum(after_part[d] for d, _ in ranks[1:])
    return {"sequences": len(lengths), "positions": float(positions.sum()), "ids": total_ids,
            "sglang_http": total_ids * 4 * 4 / 3, "rank0_host": total_ids * 2,
            "sent_before": float(sent_before), "sent_after": float(sent_after),
            "rank_max_before": float(before_part.max()), "rank_max_after": float(after_part.max())}


def check(seed: int = 0) -> int:
    """The formula against the pickled parts `stages._stage_part` makes of a small real batch:
    the routes' bytes of each part are those the formula counts."""
    import pickle
    from types import SimpleNamespace

    import numpy as np

    from hapo_megatron.training import stages
    from hapo_megatron.training.batches.rollout_batch import RolloutBatch
    from hapo_megatron.training.batches.rollout_share import SequenceMeta, split_for_ranks, step_plan
    rng = np.random.default_rng(seed)
    layers, top_k, experts, tp, pp, dp, responses, prompt_len = 4, 2, 16, 2, 2, 2, 4, 3
    resp = rng.integers(1, 30, 4 * responses)
    lengths = [prompt_len + int(r) for r in resp]
    routes = [rng.integers(0, experts, (n - 1) * layers * top_k) for n in lengths]
    batch = RolloutBatch(prompt_ids=[[5] * prompt_len] * len(lengths), response_ids=[[6] * int(r) for r in resp],
                         rollout_logprobs=[[0.0] * int(r) for r in resp], temperatures=[[] for _ in resp],
                         routed_experts=routes, finish_reasons=["stop"] * len(lengths),
                         group_ids=[i // responses for i in range(len(lengths))], scores=[0.0] * len(lengths),
                         accs=[False] * len(lengths), rewards=[0.0] * len(lengths), data_sources=[""] * len(lengths))
    kw = dict(responses=responses, layers=layers, top_k=top_k, experts=experts, tp=tp, pp=pp, dp=dp, mini_prompts=2,
              budget=64)
    want = volume(lengths, prompt_len, **kw)
    plans = step_plan(SequenceMeta.of(batch), ppo_mini_batch_size=2, dp_size=dp, micro_batch_size=1,
                      max_tokens_per_micro_batch=64, pack=False)
    rt = SimpleNamespace(actor=SimpleNamespace(routing="replay", hf_config=SimpleNamespace(
        num_hidden_layers=layers, num_experts_per_tok=top_k, num_experts=experts)), groups=SimpleNamespace(pp_size=pp))
    per_dp = split_for_ranks(batch, plans, dp)
    ranks = [(d, p) for d in range(dp) for p in range(pp) for _ in range(tp)]
    got_after = sum(stages._stage_part(rt, per_dp[d], p).column("routed_experts").flat.nbytes for d, p in ranks[1:])
    got_before = sum(per_dp[d].column("routed_experts").flat.nbytes for d, _ in ranks[1:])
    pickled = [len(pickle.dumps(stages._stage_part(rt, per_dp[d], p))) for d, p in ranks[1:]]
    ok = got_after == want["sent_after"] and got_before == want["sent_before"]
    print(f"check: routes bytes sent before {got_before} (formula {want['sent_before']:.0f}), after {got_after} "
          f"(formula {want['sent_after']:.0f}); pickled parts {sum(pickled)} bytes -> {'ok' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--responses", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--mean", type=float, default=5000.0, help="mean response length (lognormal, before the cap)")
    p.add_argument("--sigma", type=float, default=0.8)
    p.add_argument("--cap", type=int, default=10240)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--mini-prompts", type=int, default=32, help="trainer.ppo_mini_batch_size")
    p.add_argument("--max-tokens", type=int, default=22528, help="parallel.max_tokens_per_micro_batch")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--check", action="store_true", help="also compare the formula with real parts")
    args = p.parse_args(argv)
    if args.check and check(args.seed):
        return 1
    from tools.bench.packing import sample_lengths  # noqa: E402 - ROOT is on the path now
    lengths = sample_lengths(prompts=args.prompts, responses=args.responses, prompt_len=args.prompt_len,
                             mean=args.mean, sigma=args.sigma, cap=args.cap, seed=args.seed)
    v = volume(lengths, args.prompt_len, responses=args.responses, layers=args.layers, top_k=args.top_k,
               experts=args.experts, tp=args.tp, pp=args.pp, dp=args.dp, mini_prompts=args.mini_prompts,
               budget=args.max_tokens)
    print(f"# {args.prompts} x {args.responses} sequences, prompt {args.prompt_len}, response mean "
          f"{sum(lengths) / len(lengths) - args.prompt_len:.0f} (cap {args.cap}); {args.layers} layers x top-"
          f"{args.top_k} of {args.experts} experts; TP{args.tp} x PP{args.pp} x DP{args.dp}")
    print(f"routed positions {v['positions']:.3e}, expert ids {v['ids']:.3e}")
    print(f"{'where':<22}{'before GiB':>12}{'after GiB':>12}")
    for name, before, after in (("sglang -> rank 0", v["sglang_http"], v["sglang_http"]),
                                ("rank 0 host (int16)", v["rank0_host"], v["rank0_host"]),
                                ("share-out sent", v["sent_before"], v["sent_after"]),
                                ("largest rank", v["rank_max_before"], v["rank_max_after"])):
        print(f"{name:<22}{before / GIB:>12.2f}{after / GIB:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
