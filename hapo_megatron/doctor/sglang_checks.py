"""A real SGLang server on a tiny random model, driven through the trainer's own engine
(`rollout.engine.make_engine`, which launches servers with `rollout.sglang.launch`): generation
with the adaptive-temperature processor, then one weight update per weight-sync mode. On CPU the
server runs SGLang's CPU engine with the import-only stand-ins of tools/sglang_cpu_stubs (the
launcher adds them), in float32, for the modes that need no NCCL (tensor, disk): one server, which
the tensor mode's engine launches and the disk mode's engine attaches to."""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time

import torch

from hapo_megatron.doctor.report import FAIL, PASS, SKIP, CheckResult
from hapo_megatron.rollout.sglang.api_key import new_api_key
from hapo_megatron.rollout.sglang.launch import CPU_STUBS_ENV, cpu_stubs_dir

MODES = ("tensor", "distributed", "disk")
CPU_MODES = ("tensor", "disk")  # "distributed" is NCCL
SERVER_FIX = ("read the server log named in the error; the image pins the SGLang build this project tests "
              "(docs/docker.md)")


def write_tiny_model(out_dir: str, dtype: torch.dtype = torch.bfloat16) -> str:
    """A tiny random Qwen2 with the character tokenizer (no download)."""
    from hapo_megatron.models.hf_config import write_tiny_char_model
    write_tiny_char_model(out_dir, "qwen2", dtype=dtype)
    return out_dir


def _engine(model_dir: str, mode: str, log_dir: str, dtype: torch.dtype, api_key: str, attach_to: str | None = None):
    """The trainer's engine for ``mode``: it launches its own server, or with ``attach_to`` (a
    URL) uses that running one, as a run with ``rollout.sglang.server_urls`` does."""
    from hapo_megatron.config import HapoConfig
    from hapo_megatron.rollout.factory import make_engine
    from hapo_megatron.rollout.sglang.launch import free_port
    # a free port: on a shared machine another job's server may hold the default one (it would
    # answer /health, then refuse our key)
    cfg = HapoConfig.from_dict({"rollout": {"engine": "sglang", "n": 2, "max_response_length": 16, "sglang": {
        "num_servers": 1, "weight_sync": mode, "colocate": mode == "tensor", "mem_fraction_static": 0.2,
        "request_timeout_s": 120, "port_base": free_port(), "server_urls": [attach_to] if attach_to else []}}})
    return cfg, make_engine(cfg.rollout, hf_config_or_path=model_dir, dtype=dtype, log_dir=log_dir, api_key=api_key)


def _exercise(cfg, engine, model_dir: str, mode: str, device: str, dtype: torch.dtype) -> str:
    """Generate, update the weights through ``engine``'s weight-sync mode, generate again."""
    from transformers import AutoModelForCausalLM

    from hapo_megatron.algo import EntropyStats
    from hapo_megatron.rollout.engine import SamplingParams
    params = SamplingParams.from_config(cfg.rollout, cfg.algo, entropy_stats=EntropyStats.neutral(), seed=1)
    t0 = time.time()
    samples = engine.generate([[5, 6, 7], [8, 9]], params)
    gen_s = time.time() - t0
    assert len(samples) == 2 and all(len(s) == 2 for s in samples), "wrong number of samples"
    weights = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype).to(device).state_dict()
    t0 = time.time()
    # own tensors, as the trainer's export yields them (a tied HF model shares two entries' storage)
    engine.update_weights((k, v.detach().clone()) for k, v in weights.items())
    sync_s = time.time() - t0
    engine.generate([[5, 6, 7]], params)  # still serves after the update
    return f"{mode}: generate {gen_s:.1f} s, sync {sync_s:.1f} s"


def _run_modes(model_dir: str, modes: tuple[str, ...], log_dir: str, device: str, dtype: torch.dtype,
               one_server: bool) -> tuple[list[str], list[str]]:
    """(figures, failures) of ``modes``; each mode's engine launches its own server, or with
    ``one_server`` the first mode's engine launches it and the others attach to it."""
    figures, failed, api_key, shared = [], [], new_api_key(), None
    try:
        for mode in modes:
            engine = None
            try:
                cfg, engine = _engine(model_dir, mode, os.path.join(log_dir, f"logs_{mode}"), dtype, api_key,
                                      attach_to=shared.servers[0].url if shared is not None else None)
                if one_server and shared is None:
                    shared = engine  # shut down last: its server serves the later modes
                figures.append(_exercise(cfg, engine, model_dir, mode, device, dtype))
            except Exception as e:  # noqa: BLE001 - one mode failing must not hide the others
                failed.append(f"{mode}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
            finally:
                if engine is not None and engine is not shared:
                    engine.shutdown()
    finally:
        if shared is not None:
            shared.shutdown()
    return figures, failed


def check_sglang_server(model_dir: str | None = None) -> CheckResult:
    if importlib.util.find_spec("sglang") is None:
        return CheckResult("SGLang server", SKIP, "sglang is not installed")
    cuda = torch.cuda.is_available()
    if not cuda and cpu_stubs_dir() is None:
        return CheckResult("SGLang server", SKIP, f"CPU server needs the stand-ins of tools/sglang_cpu_stubs "
                           f"(set {CPU_STUBS_ENV} to a source checkout's copy)")
    device, dtype, modes = ("cuda", torch.bfloat16, MODES) if cuda else ("cpu", torch.float32, CPU_MODES)
    with tempfile.TemporaryDirectory(prefix="hapo_doctor_") as tmp:
        model_dir = model_dir or write_tiny_model(os.path.join(tmp, "model"), dtype)
        # on CPU both modes' servers have one command line (no memory saver), so one server serves
        # both; on GPU the colocated (tensor) one differs (memory saver, the trainer's GPU)
        figures, failed = _run_modes(model_dir, modes, tmp, device, dtype, one_server=not cuda)
    if failed:
        return CheckResult("SGLang server", FAIL, "; ".join(failed + figures), SERVER_FIX)
    return CheckResult("SGLang server", PASS, f"{device}, adaptive temperature; " + "; ".join(figures))
