"""Padding vs packing of RL micro-batches: token efficiency, micro-batches per rank and
the update phase's time, both layouts in the same run.

One PPO mini-batch of ``--prompts x --responses`` sequences (``--prompt-len`` tokens of prompt,
lognormal response lengths with mean ``--mean`` and shape ``--sigma``, capped at ``--cap``) is laid
out over ``--dp`` data-parallel ranks by the trainer's own `plan_micro_batches` /
`token_efficiency` (`hapo_megatron.training.batches.micro_batches`), padded and packed, with
``parallel.max_tokens_per_micro_batch = --max-tokens``. Defaults: the 7B recipe's settings.

``--time`` also runs the update phase (forward + backward of the HAPO loss through the actor and
one optimizer step) of one rank's micro-batches on a tiny random model on CPU, every length and
the budget scaled by ``--time-scale`` (CPU attention over 22k-token rows is out of reach; the
scaled run keeps the layouts' shapes), padded and packed alternately ``--repeats`` times.

    python tools/bench/packing.py                      # efficiency at the 7B recipe settings
    python tools/bench/packing.py --time               # + update time (CPU, scaled lengths)
    python tools/bench/packing.py --mean 800 --sigma 1.2 --dp 4 --max-tokens 16384 --tp 4 --sp
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def sample_lengths(*, prompts: int, responses: int, prompt_len: int, mean: float, sigma: float, cap: int,
                   seed: int) -> list[int]:
    """Prompt + response token counts; response ~ lognormal with the given mean (before the cap)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    mu = math.log(mean) - sigma ** 2 / 2  # E[lognormal(mu, sigma)] = exp(mu + sigma^2 / 2)
    resp = np.minimum(np.maximum(np.round(rng.lognormal(mu, sigma, prompts * responses)), 1), cap)
    return [prompt_len + int(r) for r in resp]


def layouts(lengths, *, dp, max_tokens, micro_batch_size, tp, cp, sp):
    """{"padded"|"packed": (plan, token_efficiency dict)} with the trainer's padding multiples."""
    from hapo_megatron.training.batches.micro_batches import PadMultiples, plan_micro_batches, token_efficiency
    pads = PadMultiples.of(tp_size=tp, cp_size=cp, sequence_parallel=sp)
    out = {}
    for pack in (False, True):
        plan = plan_micro_batches(lengths, dp_size=dp, micro_batch_size=micro_batch_size,
                                  max_tokens_per_micro_batch=max_tokens, pack=pack)
        out["packed" if pack else "padded"] = (plan, token_efficiency(
            plan, lengths, pack=pack, **pads.kwargs()))
    return out


def _tiny_actor(path: str):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hapo_megatron.compat import activate_cpu_shims
    from hapo_megatron.config import OptimConfig
    from hapo_megatron.models import tiny_hf_config
    from hapo_megatron.parallel.groups import initialize_parallel
    from hapo_megatron.training.actor import MegatronActor

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    activate_cpu_shims()  # CPU only: a no-op with CUDA (explicit opt-in, see compat)
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = tiny_hf_config("qwen2", max_position_embeddings=1 << 16)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    g = initialize_parallel(tp=1, pp=1, seed=1)
    return MegatronActor(cfg, groups=g, optim=OptimConfig(lr=1e-6, lr_warmup_steps=0), total_optimizer_steps=10,
                         init_hf_path=path,
                             dtype='fp32', use_te=None, sequence_parallel=False, recompute_activations=False,
                             use_distributed_optimizer=True, fused_output_layer=False, moe_aux_loss_coef=None), g, cfg


def time_update(plan_rank: list[list[int]], lengths, *, pack: bool, actor, groups, vocab: int, budget: int,
                prompt_len: int, seed: int = 0) -> float:
    """Seconds of one update (old log-probs given) over one rank's micro-batches."""
    import torch

    from hapo_megatron.algo import EntropyStats
    from hapo_megatron.algo import PolicyLossConfig
    from hapo_megatron.parallel.loss import make_loss_func
    from hapo_megatron.training.batches.micro_batches import SequenceData, build_rank_micro_batches
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for b in plan_rank:
        for i in b:
            p = min(prompt_len, lengths[i] - 1)
            ids = torch.randint(4, vocab, (lengths[i],), generator=g).tolist()
            seqs.append(SequenceData(ids[:p], ids[p:], advantage=1.0, index=len(seqs)))
    mbs = build_rank_micro_batches(seqs, dp_rank=0, dp_size=1, max_tokens_per_micro_batch=budget, pack=pack,
        micro_batch_size=1)
    mbs = [mb.with_(old_logprobs=-mb.loss_mask, old_entropy=mb.loss_mask) for mb in mbs]
    cfg, stats = PolicyLossConfig(), EntropyStats(pivot=0.0, std=1.0, pos_max=1.0, neg_min=-1.0)
    t0 = time.perf_counter()
    actor.train_step(mbs, lambda mb: make_loss_func(mb, cfg=cfg, stats=stats, tp_group=groups.tp, temperature=1.0))
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mean", type=float, nargs="+", default=[1000, 2500, 5000], help="mean response lengths")
    ap.add_argument("--sigma", type=float, default=0.8)
    ap.add_argument("--cap", type=int, default=10240, help="max response length")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--responses", type=int, default=16)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=22528, help="parallel.max_tokens_per_micro_batch")
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--sp", action="store_true", help="sequence parallelism (pads rows to TP multiples)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time", action="store_true", help="also time the update phase (tiny model, CPU)")
    ap.add_argument("--time-scale", type=float, default=1 / 32, help="length scale of the timed run")
    ap.add_argument("--time-rank", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    print(f"# {args.prompts} prompts x {args.responses} responses, prompt {args.prompt_len}, lognormal sigma "
          f"{args.sigma} cap {args.cap}, DP={args.dp} TP={args.tp} CP={args.cp} SP={args.sp}, "
          f"max_tokens_per_micro_batch={args.max_tokens}, seed {args.seed}")
    actor = None
    if args.time:
        import tempfile

        import torch
        torch.set_num_threads(1)
        actor, groups, cfg = _tiny_actor(tempfile.mkdtemp(prefix="bench_packing_"))
        print(f"# update time: rank {args.time_rank}'s micro-batches, lengths x {args.time_scale:g}, tiny qwen2 "
              f"(hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}), CPU fp32, "
              f"1 thread, best of {args.repeats}")
    head = f"{'mean':>6} {'layout':>7} {'efficiency':>10} {'real':>9} {'computed':>9} {'mb/rank':>9}"
    print(head + (f" {'update s':>9} {'vs padded':>9}" if args.time else ""))
    for mean in args.mean:
        lengths = sample_lengths(prompts=args.prompts, responses=args.responses, prompt_len=args.prompt_len,
                                 mean=mean, sigma=args.sigma, cap=args.cap, seed=args.seed)
        res = layouts(lengths, dp=args.dp, max_tokens=args.max_tokens, micro_batch_size=args.micro_batch_size,
                      tp=args.tp, cp=args.cp, sp=args.sp)
        times = {}
        if args.time:
            scaled = [max(2, round(x * args.time_scale)) for x in lengths]
            budget = max(2, round(args.max_tokens * args.time_scale))
            small = layouts(scaled, dp=args.dp, max_tokens=budget, micro_batch_size=args.micro_batch_size,
                            tp=1, cp=1, sp=False)
            best = {k: float("inf") for k in small}
            for _ in range(args.repeats):
                for name, (plan, _) in small.items():
                    best[name] = min(best[name], time_update(
                        plan[args.time_rank], scaled, pack=name == "packed", actor=actor, groups=groups,
                        vocab=cfg.vocab_size, budget=budget,
                        prompt_len=max(1, round(args.prompt_len * args.time_scale))))
            times = best
        for name, (plan, eff) in res.items():
            line = (f"{mean:>6.0f} {name:>7} {eff['token_efficiency']:>10.3f} {eff['real_tokens']:>9.0f} "
                    f"{eff['computed_tokens']:>9.0f} "
                    f"{eff['micro_batches_per_rank_min']:>4.0f}-{eff['micro_batches_per_rank_max']:<4.0f}")
            if times:
                line += f" {times[name]:>9.2f} {times[name] / times['padded']:>9.2f}"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
