"""Prepare the step-by-step CPU task: chained +/- problems, the character tokenizer, a tiny Llama.

    python examples/cpu_steps/prepare.py --out runs/cpu_steps_data

Writes ``train.jsonl`` (with noisy step-by-step warm-start targets), ``val.jsonl`` (held-out
problems, exact solutions) and ``model/`` (HF config + random weights + tokenizer) under
``--out``. Deterministic in ``--seed``; does nothing when ``--out`` is already complete with the same
settings (rebuilds it otherwise).
The task is described in ``hapo_megatron/data/steps.py``.
"""

from __future__ import annotations

import argparse
import os


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/cpu_steps_data")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--n-train", type=int, default=20000)
    p.add_argument("--n-val", type=int, default=128)
    p.add_argument("--min-operands", type=int, default=2)
    p.add_argument("--max-operands", type=int, default=5, help="5 operands = 4 written steps")
    p.add_argument("--max-operand", type=int, default=9)
    p.add_argument("--max-value", type=int, default=19, help="every running value stays in 0..max-value")
    p.add_argument("--sft-noise", type=float, default=0.2,
                   help="per written step, the chance that the warm-start target's result is off by "
                        "1 or 2 (carried on to the answer; the reward checks the true answer): the "
                        "warm-started model is then unsure at the result digits only")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--force", action="store_true", help="rebuild even if --out is complete")
    return p.parse_args(argv)


def main(argv=None) -> str:
    args = parse_args(argv)
    from hapo_megatron.data.prepared import already_prepared, code_fingerprint, mark_prepared

    # what the files hold depends on this script and the writers it calls, not on the flags only
    settings = {**vars(args), "code_sha256": code_fingerprint(
        __file__, "hapo_megatron.data.steps", "hapo_megatron.data.rows", "hapo_megatron.models.hf_config")}
    if already_prepared(args.out, settings, force=args.force):
        return args.out
    from hapo_megatron.data import write_rows
    from hapo_megatron.data.steps import generate_step_rows
    from hapo_megatron.models import write_tiny_char_model

    os.makedirs(args.out, exist_ok=True)
    task = dict(min_operands=args.min_operands, max_operands=args.max_operands, max_operand=args.max_operand,
                max_value=args.max_value)
    train = generate_step_rows(args.n_train, args.seed, noise=args.sft_noise, **task)
    val = generate_step_rows(args.n_val, args.seed + 1000, data_source="steps_val", **task)
    write_rows(train, os.path.join(args.out, "train.jsonl"))
    write_rows(val, os.path.join(args.out, "val.jsonl"))
    model_dir = os.path.join(args.out, "model")
    write_tiny_char_model(model_dir, "llama", seed=args.seed, hidden_size=args.hidden,
                          intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                          num_attention_heads=args.heads, num_key_value_heads=args.heads,
                          max_position_embeddings=256, tie_word_embeddings=False)
    mark_prepared(args.out, settings)
    print(f"prepared {args.out}: {args.n_train} train / {args.n_val} val prompts, model {model_dir}")
    return args.out


if __name__ == "__main__":
    main()
