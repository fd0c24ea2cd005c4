"""examples/cpu_steps: its config resolves, the prepared data fit its length limits."""

import os

from hapo_megatron.config.loading import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "cpu_steps")


def test_config_resolves_for_every_compared_variant():
    for preset, extra in (("hapo", ()), ("dapo", ()), ("hapo", ("algo.h_hat_mode=reference",))):
        cfg = load_config(os.path.join(EXAMPLE, "config.yaml"), overrides=extra, preset=preset)
        assert cfg.rollout.max_response_length == 72 and cfg.logging.save_rollouts_interval > 0
    assert cfg.algo.loss.h_hat_mode == "reference"


def test_prepared_rows_fit_the_length_limits(tmp_path):
    import importlib.util

    # a private module name: tests/training imports examples/cpu_tiny/prepare.py as "prepare"
    spec = importlib.util.spec_from_file_location("cpu_steps_prepare", os.path.join(EXAMPLE, "prepare.py"))
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    from hapo_megatron.data import build_char_tokenizer
    from hapo_megatron.data.steps import generate_step_rows

    args = prepare.parse_args([])
    rows = generate_step_rows(2000, args.seed, noise=args.sft_noise, max_operands=args.max_operands,
                              max_operand=args.max_operand, max_value=args.max_value)
    tok = build_char_tokenizer()
    cfg = load_config(os.path.join(EXAMPLE, "config.yaml"))
    longest_prompt = max(len(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True))
                         for r in rows)
    longest_target = max(len(r["extra_info"]["solution"]) + 1 for r in rows)  # + eos
    assert longest_prompt <= cfg.data.max_prompt_length
    assert longest_target <= cfg.rollout.max_response_length - cfg.reward.overlong_buffer_len
