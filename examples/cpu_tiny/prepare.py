"""Prepare the CPU example: arithmetic prompts, the character tokenizer and a tiny random Llama
(or, with ``--arch qwen3_moe``, a tiny Qwen3-MoE: the MoE variant, examples/cpu_tiny_moe).

    python examples/cpu_tiny/prepare.py --out runs/cpu_tiny_data

Writes ``train.jsonl``, ``val.jsonl`` and ``model/`` (HF config + random weights + tokenizer) under
``--out``. Deterministic in ``--seed``; does nothing when ``--out`` is already complete with the same
settings (rebuilds it otherwise).
"""

from __future__ import annotations

import argparse
import os
import random


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/cpu_tiny_data")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--n-train", type=int, default=20000)
    p.add_argument("--n-val", type=int, default=128)
    p.add_argument("--max-digits", type=int, default=1, help="digits per operand")
    p.add_argument("--ops", default="+-", help="operators, e.g. '+' or '+-*'")
    p.add_argument("--arch", choices=("llama", "qwen3_moe"), default="llama")
    p.add_argument("--experts", type=int, default=8, help="qwen3_moe: experts per MoE layer")
    p.add_argument("--top-k", type=int, default=2, help="qwen3_moe: experts per token")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--solution", choices=("answer", "expression"), default="answer",
                   help="warm-start target: 'Answer: 85' or '37 + 48 = 85\\nAnswer: 85'")
    p.add_argument("--sft-noise", type=float, default=0.5,
                   help="share of training rows whose warm-start answer is off by 1 or 2 (the reward "
                        "still checks the true answer): the warm-started model is then unsure between "
                        "near-misses, the situation RL fixes")
    p.add_argument("--force", action="store_true", help="rebuild even if --out is complete")
    return p.parse_args(argv)


def main(argv=None) -> str:
    args = parse_args(argv)
    from hapo_megatron.data.prepared import already_prepared, code_fingerprint, mark_prepared

    # what the files hold depends on this script and the writers it calls, not on the flags only
    settings = {**vars(args), "code_sha256": code_fingerprint(
        __file__, "hapo_megatron.data.arithmetic", "hapo_megatron.data.rows", "hapo_megatron.models.hf_config")}
    if already_prepared(args.out, settings, force=args.force):
        return args.out
    from hapo_megatron.data import generate_arithmetic_rows, write_rows
    from hapo_megatron.models import write_tiny_char_model

    os.makedirs(args.out, exist_ok=True)
    task = dict(min_digits=1, max_digits=args.max_digits, min_operands=2, max_operands=2, ops=tuple(args.ops))
    for name, n, seed, source in (("train", args.n_train, args.seed, "arithmetic"),
                                  ("val", args.n_val, args.seed + 1000, "arithmetic_val")):
        rows = generate_arithmetic_rows(n, seed, data_source=source, **task)
        noise = random.Random(f"cpu-tiny-noise-{seed}")
        for row in rows:
            truth = int(row["reward_model"]["ground_truth"])
            shown = truth + noise.choice((-2, -1, 1, 2)) if name == "train" and noise.random() < args.sft_noise \
                else truth
            def solution(value: int) -> str:
                if args.solution == "answer":  # short targets: fast rollouts
                    return f"Answer: {value}"
                return f"{row['extra_info']['expression']} = {value}\nAnswer: {value}"
            row["extra_info"]["solution"] = solution(shown)
            # the noiseless one, for EDGE-GRPO's guided error correction (algo.edge_gec_solution_key)
            row["extra_info"]["exact_solution"] = solution(truth)
        write_rows(rows, os.path.join(args.out, f"{name}.jsonl"))
    model_dir = os.path.join(args.out, "model")
    # MoE: each expert a quarter of the dense FFN, so top-2 of 8 costs half the dense FFN per token
    moe = dict(num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.hidden,
               head_dim=args.hidden // args.heads) if args.arch == "qwen3_moe" else {}
    write_tiny_char_model(model_dir, args.arch, seed=args.seed, hidden_size=args.hidden,
                          intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                          num_attention_heads=args.heads, num_key_value_heads=args.heads,
                          max_position_embeddings=256, tie_word_embeddings=False, **moe)
    mark_prepared(args.out, settings)
    print(f"prepared {args.out}: {args.n_train} train / {args.n_val} val prompts, model {model_dir}")
    return args.out


if __name__ == "__main__":
    main()
