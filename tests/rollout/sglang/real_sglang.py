"""A REAL SGLang server for the tests (CPU or GPU, whatever this machine has): the tiny random
Llama of the CPU example, launched through the engine's own launcher (``server_command`` +
``server_env``: on CPU, SGLang's CPU engine flags and the import-only stand-ins of
``hapo_megatron/compat/sglang_cpu``), with an API key like every server the project starts. The
tests skip only when SGLang itself cannot be imported."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from hapo_megatron.rollout.sglang import launch as launcher
from hapo_megatron.rollout.sglang.client import SGLangHTTP, ServerHandle


def sglang_import_error() -> str | None:
    """Why ``import sglang`` fails here, or None when it works."""
    try:
        importlib.import_module("sglang")
    except Exception as e:  # noqa: BLE001 - any failure is the reason to report
        return f"{type(e).__name__}: {e}"
    return None


def require_sglang() -> None:
    """Skip (with the reason printed by ``-ra``) when SGLang cannot be imported."""
    why = sglang_import_error()
    if why is not None:
        pytest.skip(f"SGLang cannot be imported ({why}); install it as in the README's test command")


def start_server(model_dir: str, log_path: str, api_key: str, timeout_s: float = 900.0,
                 extra_args: tuple[str, ...] = ()) -> ServerHandle:
    """Launch one server requiring ``api_key`` on a free port, bound where the launcher binds a
    colocated server by default, and wait until it is healthy (fails with its log tail).
    ``extra_args``: more ``sglang.launch_server`` flags."""
    return wait_started(launch_server_process(model_dir, log_path, api_key, extra_args), timeout_s)


def launch_server_process(model_dir: str, log_path: str, api_key: str,
                          extra_args: tuple[str, ...] = ()) -> ServerHandle:
    """The process of :func:`start_server`, not waited for (several start-ups may overlap)."""
    port = launcher.free_port()
    device = launcher.resolve_device("auto")
    cmd = launcher.server_command(model_dir, port=port, device=device, dtype="float32",
                                  mem_fraction_static=0.3, max_total_tokens=4096,
                                  extra_args=extra_args, quantization='none', kv_cache_dtype='auto')
    return launcher.start_process(cmd, f"http://127.0.0.1:{port}", log_path=log_path,
                                  env=launcher.server_env(cpu=device == "cpu"), api_key=api_key)


def wait_started(handle: ServerHandle, timeout_s: float = 900.0) -> ServerHandle:
    """``handle`` once healthy; stopped, with the error, when it is not."""
    try:
        SGLangHTTP(timeout_s=30, max_retries=0).wait_healthy(handle, timeout_s, poll_s=0.5)
    except BaseException:
        launcher.stop_process(handle)
        raise
    return handle


def tiny_model_dir(root: str) -> str:
    """The CPU example's tiny random Llama (char tokenizer, hidden 32, 2 layers) under ``root``."""
    from tests.training.tiny_setup import prepare_tiny

    return os.path.join(prepare_tiny(root, n_train=32, n_val=4), "model")


def hf_model(path_or_state, model_dir: str):
    """A float32 transformers model from ``model_dir``, optionally with ``path_or_state`` weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if path_or_state is not None:
        model.load_state_dict(dict(path_or_state), strict=True)
    return model


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (eos ignored: exactly max_new_tokens)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(max_new_tokens):
                nxt = model(input_ids=ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            out.append(ids[0, len(p):].tolist())
    return out
