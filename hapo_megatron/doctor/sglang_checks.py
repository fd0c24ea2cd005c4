"""A real SGLang server on a tiny random model, driven through the trainer's own engine
(`rollout.engine.make_engine`, which launches servers with `rollout.sglang_launch`): generation
with the adaptive-temperature processor, then one weight update per weight-sync mode. On CPU the
server runs SGLang's CPU engine with the import-only stand-ins of tools/sglang_cpu_stubs (the
launcher adds them), in float32, for the modes that need no NCCL (tensor, disk)."""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time

import torch

from hapo_megatron.doctor.report import FAIL, PASS, SKIP, CheckResult
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


def _engine(model_dir: str, mode: str, log_dir: str, dtype: torch.dtype):
    from hapo_megatron.config import HapoConfig
    from hapo_megatron.rollout.factory import make_engine
    from hapo_megatron.rollout.sglang.launch import free_port
    # a free port: on a shared machine another job's server may hold the default one (it would
    # answer /health, then refuse our key)
    cfg = HapoConfig.from_dict({"rollout": {"engine": "sglang", "n": 2, "max_response_length": 16, "sglang": {
        "num_servers": 1, "weight_sync": mode, "colocate": mode == "tensor", "mem_fraction_static": 0.2,
        "request_timeout_s": 120, "port_base": free_port()}}})
    return cfg, make_engine(cfg.rollout, hf_config_or_path=model_dir, dtype=dtype, log_dir=log_dir)


def _one_mode(model_dir: str, mode: str, log_dir: str, device: str, dtype: torch.dtype) -> str:
    from transformers import AutoModelForCausalLM

    from hapo_megatron.algo import EntropyStats
    from hapo_megatron.rollout.engine import SamplingParams
    cfg, engine = _engine(model_dir, mode, log_dir, dtype)
    try:
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
    finally:
        engine.shutdown()
    return f"{mode}: generate {gen_s:.1f} s, sync {sync_s:.1f} s"


def check_sglang_server(model_dir: str | None = None) -> CheckResult:
    if importlib.util.find_spec("sglang") is None:
        return CheckResult("SGLang server", SKIP, "sglang is not installed")
    cuda = torch.cuda.is_available()
    if not cuda and cpu_stubs_dir() is None:
        return CheckResult("SGLang server", SKIP, f"CPU server needs the stand-ins of tools/sglang_cpu_stubs "
                           f"(set {CPU_STUBS_ENV} to a source checkout's copy)")
    device, dtype, modes = ("cuda", torch.bfloat16, MODES) if cuda else ("cpu", torch.float32, CPU_MODES)
    figures, failed = [], []
    with tempfile.TemporaryDirectory(prefix="hapo_doctor_") as tmp:
        model_dir = model_dir or write_tiny_model(os.path.join(tmp, "model"), dtype)
        for mode in modes:
            try:
                figures.append(_one_mode(model_dir, mode, os.path.join(tmp, f"logs_{mode}"), device, dtype))
            except Exception as e:  # noqa: BLE001 - one mode failing must not hide the others
                failed.append(f"{mode}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
    if failed:
        return CheckResult("SGLang server", FAIL, "; ".join(failed + figures), SERVER_FIX)
    return CheckResult("SGLang server", PASS, f"{device}, adaptive temperature; " + "; ".join(figures))
