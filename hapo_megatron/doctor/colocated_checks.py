"""The trainer's colocated weight-sync sequence on a real SGLang server of TP=2 (GPU only).

What `hapo train` does around every step with colocated servers (training/stages.py,
training/memory/engine_memory.py): release every memory region -> (train) -> resume the weights ->
update the weights from tensors (CUDA-IPC, one serialisation per server TP rank) -> resume the KV
cache and CUDA graphs -> generate. Here on a tiny random model whose weights are replaced by other
random weights, then the server's greedy tokens are checked against transformers holding the new
weights (teacher-forced on the server's tokens, so every position is compared): each token must
be transformers' argmax, or within a rounding margin of it, and at least one confident position
must differ from what the OLD weights would have picked (the update really arrived).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile

import numpy as np
import torch

from hapo_megatron.doctor.report import FAIL, PASS, SKIP, CheckResult

NAME = "SGLang colocated sync (TP=2)"
# Logit gap under which two tokens count as tied: bf16 rounding of a TP=2 reduction vs a TP=1 one
# moves logits of O(1) by ~1e-2 (8-bit mantissa), so 0.1 leaves a 10x margin.
TIE_MARGIN = 0.1
PROMPTS = ([5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16])
MAX_NEW_TOKENS = 12


def greedy_mismatches(tokens: list[int], logits: torch.Tensor, margin: float = TIE_MARGIN) -> list[int]:
    """Positions where ``tokens[t]`` is not the argmax of ``logits[t]`` ([T, V], the logits that
    predicted it) by more than ``margin`` (a near-tie may go either way under rounding)."""
    if logits.shape[0] != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but logits for {logits.shape[0]} positions")
    best = logits.max(dim=-1).values
    picked = logits.gather(-1, torch.as_tensor(tokens, device=logits.device).view(-1, 1)).squeeze(-1)
    return [t for t, gap in enumerate((best - picked).tolist()) if gap > margin]


def confident_differences(tokens: list[int], logits: torch.Tensor, margin: float = TIE_MARGIN) -> int:
    """How many of ``tokens`` another model (``logits`` [T, V]) would NOT have picked, by more
    than ``margin``: > 0 shows the tokens did not come from that model."""
    return len(greedy_mismatches(tokens, logits, margin))


def _teacher_forced_logits(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """[len(response), V] float32 logits that predicted each response token."""
    ids = torch.tensor([prompt + response], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    return logits[len(prompt) - 1:len(prompt) - 1 + len(response)]


def _new_weights(model, seed: int = 1234) -> dict[str, torch.Tensor]:
    """Other random weights of the same shapes and scales (what a training step would produce);
    a tied output layer stays tied to the embedding."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    for name, t in model.state_dict().items():
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
        if t.dim() == 1:  # norm weights around 1, biases around 0: keep their centre
            new = t.float().cpu() + 0.1 * noise
        else:
            new = noise * max(t.float().std().item(), 1e-3)
        out[name] = new.to(t.dtype)
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _run_sequence(model_dir: str, log_dir: str) -> str:
    from transformers import AutoModelForCausalLM

    from hapo_megatron.config import HapoConfig
    from hapo_megatron.rollout.engine import SamplingParams
    from hapo_megatron.rollout.factory import make_engine
    from hapo_megatron.rollout.sglang.launch import free_port
    from hapo_megatron.training.memory.engine_memory import ENGINE_MEMORY_TAGS
    cfg = HapoConfig.from_dict({"rollout": {"engine": "sglang", "n": 1, "max_response_length": MAX_NEW_TOKENS,
                                            "sglang": {"num_servers": 1, "server_tp_size": 2, "colocate": True,
                                                       "weight_sync": "tensor", "mem_fraction_static": 0.2,
                                                       "request_timeout_s": 120, "port_base": free_port()}}})
    old = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).to("cuda:0").eval()
    new_state = _new_weights(old)
    engine = make_engine(cfg.rollout, hf_config_or_path=model_dir, dtype=torch.bfloat16, log_dir=log_dir)
    try:
        engine.release_memory()  # the trainer's rollout ends so (stages._rollout_rank0)
        engine.resume_memory(["weights"])  # stages.sync_weights
        engine.update_weights((k, v.to("cuda:0")) for k, v in new_state.items())
        engine.resume_memory([t for t in ENGINE_MEMORY_TAGS if t != "weights"])  # stages._rollout_rank0
        greedy = SamplingParams(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=MAX_NEW_TOKENS,
                                ignore_eos=True)
        samples = engine.generate([list(p) for p in PROMPTS], greedy)
    finally:
        engine.shutdown()
    new = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).to("cuda:0").eval()
    new.load_state_dict({k: v.to("cuda:0") for k, v in new_state.items()})
    problems, moved, compared = [], 0, 0
    for prompt, (sample,) in zip(PROMPTS, samples):
        response = np.asarray(sample.response_ids).tolist()
        if not response:
            problems.append(f"prompt {prompt}: empty response")
            continue
        compared += len(response)
        bad = greedy_mismatches(response, _teacher_forced_logits(new, list(prompt), response))
        if bad:
            problems.append(f"prompt {prompt}: tokens at {bad} are not transformers' greedy choice")
        moved += confident_differences(response, _teacher_forced_logits(old, list(prompt), response))
    if problems:
        raise AssertionError("; ".join(problems))
    if moved == 0:
        raise AssertionError("the server's greedy tokens are also the OLD weights' choice everywhere: "
                             "the update did not reach the server")
    return f"{compared} greedy tokens = transformers after release/resume/update (TP=2, CUDA-IPC per rank)"


def check_colocated_sync(model_dir: str | None = None) -> CheckResult:
    if importlib.util.find_spec("sglang") is None:
        return CheckResult(NAME, SKIP, "sglang is not installed")
    if not torch.cuda.is_available():
        return CheckResult(NAME, SKIP, "needs CUDA (the colocated sequence releases GPU memory)")
    if torch.cuda.device_count() < 2:
        return CheckResult(NAME, SKIP, f"needs 2 GPUs for TP=2, {torch.cuda.device_count()} visible")
    from hapo_megatron.doctor.sglang_checks import SERVER_FIX, write_tiny_model
    with tempfile.TemporaryDirectory(prefix="hapo_doctor_colocated_") as tmp:
        model_dir = model_dir or write_tiny_model(os.path.join(tmp, "model"), torch.bfloat16)
        try:
            return CheckResult(NAME, PASS, _run_sequence(model_dir, os.path.join(tmp, "logs")))
        except Exception as e:  # noqa: BLE001 - reported as the check's failure
            return CheckResult(NAME, FAIL, f"{type(e).__name__}: {str(e)[:300]}", SERVER_FIX)
