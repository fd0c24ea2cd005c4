"""FP8 rollouts against bf16 on a real SGLang server (GPU only; docs/fp8.md).

For each of ``rollout.quantization`` none and fp8: launch one colocated server through the
trainer's engine (the FP8 one starts from the block-FP8 copy of the model), sync other random
weights into it (CUDA-IPC tensors, requantised on the way for FP8), then

- greedy tokens: each must be transformers' choice with the NEW bf16 weights (teacher-forced on
  the server's tokens) up to a near-tie margin, and somewhere not the OLD weights' (the sync
  arrived);
- the behaviour / trainer log-prob gap on sampled tokens (temperature 1): mean ``|log mu -
  log pi|`` and the k3 estimate of KL(mu || pi) (``mu`` the server's log-probs, ``pi``
  transformers' bf16 ones), what the off-policy correction has to absorb;
- rollout tokens/s of a sampled batch (after one warm-up batch).

The default model is a tiny random Qwen3 whose matrices are whole 128 x 128 blocks; ``hapo doctor
--sglang-model DIR`` times a real model instead (FP8-servable shapes, ``fp8_weights.check_servable``).
"""

from __future__ import annotations

import importlib.util
import math
import os
import tempfile
import time
from typing import Sequence

import torch

from hapo_megatron.doctor.report import FAIL, PASS, SKIP, CheckResult

NAME = "SGLang FP8 rollouts vs bf16"
PROMPTS = ([5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18, 19])
GREEDY_TOKENS = 16
SAMPLED_N, SAMPLED_TOKENS = 16, 128
# Near-tie margin of FP8 greedy tokens: E4M3 rounds weights and (dynamic, per 128 columns)
# activations by up to 2^-4 relative each; on the default model (logits of std 0.45) the weights'
# rounding alone moves logits by at most 0.10 (measured on CPU), activations about as much again:
# 0.5 is twice that.
FP8_TIE_MARGIN = 0.5
# at most this share of greedy positions may be confidently not transformers' choice
MAX_MISMATCH_SHARE = 0.1
TINY_SHAPE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=128)


def logprob_gap(behaviour: Sequence[float], target: Sequence[float]) -> dict[str, float]:
    """``mean_abs``: mean ``|log mu - log pi|``; ``k3``: mean of ``r - 1 - log r`` with
    ``r = pi / mu`` (Schulman's unbiased, non-negative estimator of KL(mu || pi) from samples of
    ``mu``), over tokens sampled from the behaviour policy ``mu``."""
    if len(behaviour) != len(target) or not behaviour:
        raise ValueError(f"need equally many behaviour and target log-probs, got {len(behaviour)} and {len(target)}")
    diffs = [t - b for b, t in zip(behaviour, target)]
    return {"mean_abs": sum(abs(d) for d in diffs) / len(diffs),
            "k3": sum(math.exp(d) - 1 - d for d in diffs) / len(diffs)}


def write_fp8_tiny_model(out_dir: str) -> str:
    """A tiny random Qwen3 (character tokenizer) whose FP8 matrices are whole 128 x 128 blocks."""
    from hapo_megatron.models.hf_config import write_tiny_char_model
    write_tiny_char_model(out_dir, "qwen3", dtype=torch.bfloat16, seed=0, **TINY_SHAPE)
    return out_dir


def _teacher_forced_logprobs(model, prompt: list[int], response: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    from hapo_megatron.doctor.colocated_checks import _teacher_forced_logits
    logits = _teacher_forced_logits(model, prompt, response)
    logps = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response, device=logits.device).view(-1, 1))
    return logits, logps.squeeze(-1)


def _serve(model_dir: str, quantization: str, new_state: dict, log_dir: str):
    """Launch, sync ``new_state``, generate greedy and sampled batches; the samples and figures."""
    from hapo_megatron.config import HapoConfig
    from hapo_megatron.rollout.engine import SamplingParams
    from hapo_megatron.rollout.factory import make_engine
    from hapo_megatron.rollout.sglang.launch import free_port
    cfg = HapoConfig.from_dict({"rollout": {
        "engine": "sglang", "quantization": quantization, "max_response_length": SAMPLED_TOKENS,
        "sglang": {"num_servers": 1, "colocate": True, "weight_sync": "tensor", "mem_fraction_static": 0.3,
                   "request_timeout_s": 300, "port_base": free_port()}}})
    engine = make_engine(cfg.rollout, hf_config_or_path=model_dir, dtype=torch.bfloat16, log_dir=log_dir)
    try:
        t0 = time.perf_counter()
        engine.update_weights((k, v.to("cuda")) for k, v in new_state.items())
        sync_s = time.perf_counter() - t0
        greedy = engine.generate([list(p) for p in PROMPTS],
                                 SamplingParams(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=GREEDY_TOKENS,
                                                ignore_eos=True))
        # transformers' log-probs of the comparison are of the plain softmax: T 1, no top-p / top-k
        sampling = SamplingParams(n=SAMPLED_N, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=SAMPLED_TOKENS,
                                  ignore_eos=True, seed=1)
        engine.generate([list(p) for p in PROMPTS], sampling)  # warm-up
        t0 = time.perf_counter()
        sampled = engine.generate([list(p) for p in PROMPTS], sampling)
        gen_s = time.perf_counter() - t0
    finally:
        engine.shutdown()
    tokens = sum(len(s.response_ids) for group in sampled for s in group)
    return greedy, sampled, {"tok_s": tokens / gen_s, "sync_s": sync_s}


def _compare(greedy, sampled, old, new) -> dict:
    """Greedy mismatches vs the new weights (near ties of FP8_TIE_MARGIN allowed), positions the
    old weights confidently would not have picked (colocated_checks' bf16 margin), and the
    log-prob gap of the sampled tokens."""
    from hapo_megatron.doctor.colocated_checks import confident_differences, greedy_mismatches
    mismatched = moved = positions = 0
    for prompt, (sample,) in zip(PROMPTS, greedy):
        response = [int(t) for t in sample.response_ids]
        positions += len(response)
        new_logits, _ = _teacher_forced_logprobs(new, list(prompt), response)
        mismatched += len(greedy_mismatches(response, new_logits, FP8_TIE_MARGIN))
        moved += confident_differences(response, _teacher_forced_logprobs(old, list(prompt), response)[0])
    behaviour, target = [], []
    for prompt, group in zip(PROMPTS, sampled):
        for s in group:
            response = [int(t) for t in s.response_ids]
            behaviour += [float(x) for x in s.rollout_logprobs]
            target += _teacher_forced_logprobs(new, list(prompt), response)[1].tolist()
    return {"mismatch_share": mismatched / max(positions, 1), "moved": moved, **logprob_gap(behaviour, target)}


def _run(model_dir: str, tmp: str) -> str:
    from transformers import AutoModelForCausalLM

    from hapo_megatron.convert import per_expert_state
    from hapo_megatron.doctor.colocated_checks import _new_weights
    old = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda").eval()
    new_state = _new_weights(old)
    new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda").eval()
    new.load_state_dict({k: v.to("cuda") for k, v in new_state.items()})
    export = per_expert_state(new_state)  # the trainer's export names (MoE experts one by one)
    if getattr(new.config, "tie_word_embeddings", False):
        export.pop("lm_head.weight", None)
    figures, problems = {}, []
    for quantization in ("none", "fp8"):
        greedy, sampled, timing = _serve(model_dir, quantization, export, os.path.join(tmp, f"logs_{quantization}"))
        figures[quantization] = {**timing, **_compare(greedy, sampled, old, new)}
        f = figures[quantization]
        if f["mismatch_share"] > MAX_MISMATCH_SHARE:
            problems.append(f"{quantization}: {f['mismatch_share']:.0%} of greedy tokens are not transformers' choice "
                            f"by more than {FP8_TIE_MARGIN}")
        if f["moved"] == 0:
            problems.append(f"{quantization}: greedy tokens are the OLD weights' choice everywhere (no sync)")
    b, q = figures["none"], figures["fp8"]
    text = (f"tok/s bf16 {b['tok_s']:.0f}, fp8 {q['tok_s']:.0f} (x{q['tok_s'] / b['tok_s']:.2f}); "
            f"|dlogp| bf16 {b['mean_abs']:.2e}, fp8 {q['mean_abs']:.2e}; k3 KL bf16 {b['k3']:.2e}, fp8 {q['k3']:.2e}; "
            f"greedy off bf16 {b['mismatch_share']:.0%}, fp8 {q['mismatch_share']:.0%}; "
            f"sync bf16 {b['sync_s']:.1f} s, fp8 {q['sync_s']:.1f} s")
    if problems:
        raise AssertionError("; ".join(problems) + " | " + text)
    return text


def check_fp8_rollouts(model_dir: str | None = None) -> CheckResult:
    if importlib.util.find_spec("sglang") is None:
        return CheckResult(NAME, SKIP, "sglang is not installed")
    if not torch.cuda.is_available():
        return CheckResult(NAME, SKIP, "needs CUDA (SGLang's CPU backend serves no block FP8: docs/fp8.md)")
    with tempfile.TemporaryDirectory(prefix="hapo_doctor_fp8_") as tmp:
        model_dir = model_dir or write_fp8_tiny_model(os.path.join(tmp, "model"))
        try:
            return CheckResult(NAME, PASS, _run(model_dir, tmp))
        except Exception as e:  # noqa: BLE001 - reported as the check's failure
            return CheckResult(NAME, FAIL, f"{type(e).__name__}: {str(e)[:400]}",
                               "read the server logs named in the error (docs/fp8.md, troubleshooting)")
