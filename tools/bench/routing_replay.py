"""Routing replay (docs/moe.md, "Routing replay"): how closely the actor's log-probs of the sampled
tokens match the rollout engine's, with and without replay, over seeds.

Per seed: a tiny random Qwen3-MoE (``--experts``, top ``--top-k``, ``--layers``); the embedded HF
engine samples ``--prompts x --n`` responses at temperature 1 (no adaptive temperature, so both
sides score the same distribution) in ``--engine-dtype`` and returns its routed experts; the
Megatron actor (float32, one process) recomputes the log-probs of the sampled tokens twice, with
its own routing ("measure") and with the engine's experts replayed ("replay"). Printed per seed:
the routing mismatch (share of (token, MoE layer) pairs whose top-k set the actor chooses
otherwise; under replay it is the actor's own choice given the replayed layers before it) and the
mean |actor - engine| log-prob over all response tokens and over the tokens routing touches (those
whose actor log-prob differs between the two passes: a token routed otherwise, or one attending to
such a token); then the paired differences (measure - replay) over seeds with their Student-t 95%
intervals (hapo_megatron/analysis/paired_stats.py).

    python tools/bench/routing_replay.py                        # 5 seeds, bf16 engine
    python tools/bench/routing_replay.py --engine-dtype fp32    # control: no precision gap
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

MODES = ("measure", "replay")


def _setup():
    import torch.distributed as dist

    from hapo_megatron.compat import activate_cpu_shims
    from hapo_megatron.parallel.groups import initialize_parallel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    activate_cpu_shims()  # CPU only: a no-op with CUDA (explicit opt-in, see compat)
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    return initialize_parallel(tp=1, pp=1, seed=1)


def sample(path: str, *, seed: int, engine_dtype: str, prompts: int, n: int, max_new_tokens: int, vocab: int):
    """The engine's samples (``Sample`` with rollout log-probs and routes) of random prompts."""
    import torch

    from hapo_megatron.dtypes import torch_dtype
    from hapo_megatron.rollout.engine import SamplingParams
    from hapo_megatron.rollout.hf_engine import HFRolloutEngine

    engine = HFRolloutEngine(path, dtype=torch_dtype(engine_dtype), max_batch_size=prompts * n)
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = [torch.randint(1, vocab, (int(torch.randint(4, 12, (1,), generator=gen)),), generator=gen).tolist()
                  for _ in range(prompts)]
    params = SamplingParams(n=n, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=max_new_tokens, seed=seed,
                            ignore_eos=True, return_routes=True)
    return [s for group in engine.generate(prompt_ids, params) for s in group]


def actor_logprobs(path: str, hf_config, groups, samples, routing: str):
    """The actor's log-probs of each sample's response tokens (float64 numpy) and its
    ``(differing, compared)`` routing counts, with ``routing`` "measure" or "replay"."""
    from hapo_megatron.config import OptimConfig
    from hapo_megatron.training.actor import MegatronActor
    from hapo_megatron.training.batches.micro_batches import SequenceData, build_rank_micro_batches

    actor = MegatronActor(hf_config, groups=groups, optim=OptimConfig(lr=1e-6, lr_warmup_steps=0),
                          total_optimizer_steps=1, init_hf_path=path, moe_aux_loss_coef=0.0, routing=routing,
                              dtype='fp32', use_te=None, sequence_parallel=False, recompute_activations=False,
                              use_distributed_optimizer=True, fused_output_layer=False)
    seqs = [SequenceData([int(t) for t in s.prompt_ids], [int(t) for t in s.response_ids],
                         routed_experts=s.routed_experts, index=i) for i, s in enumerate(samples)]
    mbs = build_rank_micro_batches(seqs, dp_rank=0, dp_size=1, micro_batch_size=len(seqs),
        max_tokens_per_micro_batch=None)
    with actor.counting_routing_mismatch():
        results = actor.compute_logprobs_entropy(mbs, temperature=1.0)
    out = {}
    for mb, (lp, _) in zip(mbs, results):
        for r, i in enumerate(mb.seq_index.tolist()):
            if i >= 0:
                out[i] = lp[r][mb.loss_mask[r] > 0].double().numpy()
    return [out[i] for i in range(len(samples))], actor.take_routing_mismatch()


def run_seed(seed: int, args, groups) -> dict[str, dict[str, float]]:
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hapo_megatron.models import tiny_hf_config

    cfg = tiny_hf_config("qwen3_moe", vocab_size=args.vocab, num_hidden_layers=args.layers,
                         num_experts=args.experts, num_experts_per_tok=args.top_k)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp)
        samples = sample(tmp, seed=seed, engine_dtype=args.engine_dtype, prompts=args.prompts, n=args.n,
                         max_new_tokens=args.max_new_tokens, vocab=args.vocab)
        engine_lp = np.concatenate([np.asarray(s.rollout_logprobs, np.float64) for s in samples])
        actor = {mode: actor_logprobs(tmp, AutoConfig.from_pretrained(tmp), groups, samples, mode) for mode in MODES}
    touched = np.concatenate(actor["measure"][0]) != np.concatenate(actor["replay"][0])
    row = {}
    for mode, (lps, (differing, compared)) in actor.items():
        diff = np.abs(np.concatenate(lps) - engine_lp)
        row[mode] = {"mismatch": differing / max(compared, 1), "abs_diff": float(diff.mean()),
                     "touched_diff": float(diff[touched].mean()) if touched.any() else float("nan"),
                     "tokens": len(diff), "touched": int(touched.sum())}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--engine-dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--json", help="also write the per-seed rows here")
    args = ap.parse_args(argv)
    from hapo_megatron.analysis.paired_stats import paired_t_interval

    groups = _setup()
    print(f"# engine {args.engine_dtype}, actor fp32; {args.experts} experts top-{args.top_k}, {args.layers} layers; "
          f"{args.prompts}x{args.n} responses of {args.max_new_tokens} tokens per seed")
    print(f"{'seed':>4} {'tokens':>6} {'touched':>7} {'mismatch':>9} {'|dlp| measure':>14} {'|dlp| replay':>13} "
          f"{'touched: measure':>17} {'replay':>10}")
    gaps: dict[str, list[float]] = {"abs_diff": [], "touched_diff": []}
    rows = {}
    for seed in range(1, args.seeds + 1):
        row = rows[seed] = run_seed(seed, args, groups)
        m, r = row["measure"], row["replay"]
        for key in gaps:
            gaps[key].append(m[key] - r[key])
        print(f"{seed:>4} {m['tokens']:>6} {m['touched']:>7} {m['mismatch']:>9.4f} {m['abs_diff']:>14.3e} "
              f"{r['abs_diff']:>13.3e} {m['touched_diff']:>17.3e} {r['touched_diff']:>10.3e}", flush=True)
    for key, label in (("abs_diff", "all tokens"), ("touched_diff", "touched tokens")):
        vals = [g for g in gaps[key] if g == g]  # seeds where replay touched nothing have no touched figure
        if len(vals) >= 2:
            ci = paired_t_interval(vals)
            print(f"mean |dlp| measure - replay, {label}, {ci['n']} seeds: {ci['mean']:.3e} "
                  f"(95% CI {ci['lower']:.3e} .. {ci['upper']:.3e})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
