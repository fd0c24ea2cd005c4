"""A real SGLang server on a tiny random model, driven through the trainer's own engine
(`rollout.engine.make_engine`, which launches servers with `rollout.sglang.launch`): generation
with the adaptive-temperature processor, then one weight update per weight-sync mode. On CPU the
server runs SGLang's CPU engine with the import-only stand-ins of hapo_megatron/compat/sglang_cpu
(the launcher adds them), in float32, for the modes that need no NCCL (tensor, disk): one server,
which the tensor mode's engine launches and the disk mode's engine attaches to.

Which modes run where (`plan_modes`): with two GPUs or more every mode, distributed and disk on a
server of their own GPU; on one GPU (an H100 / H200 alone) the modes that run beside the trainer on
its GPU, tensor and disk, on one server with a small memory fraction (launched colocated by the
tensor mode, the disk mode attached), and distributed is skipped with its reason (NCCL takes no two
ranks on one GPU). The first server also runs what the asynchronous and over-sampling loops ask
of it: an update paused in place, tagged with a weight version and kept without a cache flush,
after which every token reports that version; and an abort of a running request whose partial
answer then resumes to its end (`_exercise_async`, `_exercise_abort_resume`)."""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time

import torch

from hapo_megatron.doctor.report import FAIL, PASS, SKIP, CheckResult
from hapo_megatron.rollout.sglang.api_key import new_api_key

MODES = ("tensor", "distributed", "disk")
SERVER_FIX = ("read the server log named in the error; the image pins the SGLang build this project tests "
              "(docs/docker.md)")
ONE_GPU_SKIPPED = "needs a second GPU (NCCL takes no two ranks, the trainer and the server, on one GPU)"


def plan_modes(*, cuda: bool, gpus: int) -> tuple[list[tuple[str, bool]], list[tuple[str, str]], bool]:
    """``([(mode, colocate)], [(skipped mode, why)], one server)`` of this machine. With fewer than
    two GPUs (CPU included) one server, launched by the colocated tensor mode's engine on the
    trainer's device, serves the disk mode too (attached, as ``server_urls`` do), and distributed
    is skipped (CPU: NCCL needs CUDA; one GPU: `ONE_GPU_SKIPPED`). With two or more every mode
    launches its own server, the non-colocated ones on the next GPU."""
    if not cuda or gpus < 2:
        why = ONE_GPU_SKIPPED if cuda else "NCCL needs CUDA"
        return [("tensor", True), ("disk", False)], [("distributed", why)], True
    return [(m, m == "tensor") for m in MODES], [], False


def write_tiny_model(out_dir: str, dtype: torch.dtype = torch.bfloat16) -> str:
    """A tiny random Qwen2 with the character tokenizer (no download)."""
    from hapo_megatron.models.hf_config import write_tiny_char_model
    write_tiny_char_model(out_dir, "qwen2", dtype=dtype)
    return out_dir


def _engine(model_dir: str, mode: str, log_dir: str, dtype: torch.dtype, api_key: str, attach_to: str | None = None,
            colocate: bool | None = None):
    """The trainer's engine for ``mode``: it launches its own server, or with ``attach_to`` (a
    URL) uses that running one, as a run with ``rollout.sglang.server_urls`` does. ``colocate``:
    the server on the trainer's GPU (default: the tensor mode only)."""
    from hapo_megatron.config import HapoConfig
    from hapo_megatron.rollout.factory import make_engine
    from hapo_megatron.rollout.sglang.launch import free_port
    # a free port: on a shared machine another job's server may hold the default one (it would
    # answer /health, then refuse our key)
    cfg = HapoConfig.from_dict({"rollout": {"engine": "sglang", "n": 2, "max_response_length": 16, "sglang": {
        "num_servers": 1, "weight_sync": mode, "colocate": mode == "tensor" if colocate is None else colocate,
        "mem_fraction_static": 0.2,
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


def _fresh_weights(model_dir: str, device: str, dtype: torch.dtype):
    """The model's weights as the trainer's export yields them: own tensors (a tied HF model shares
    two entries' storage)."""
    from transformers import AutoModelForCausalLM
    weights = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype).to(device).state_dict()
    return ((k, v.detach().clone()) for k, v in weights.items())


def _exercise_async(cfg, engine, model_dir: str, device: str, dtype: torch.dtype, version: int = 1) -> str:
    """What an asynchronous step does to a server (``pause_mode: in_place``): pause in place, an
    update tagged ``version`` without a cache flush, continue; every token sampled after it must
    report ``version`` (SGLang's per-token ``weight_versions``, `Sample.weight_versions`)."""
    from hapo_megatron.rollout.engine import SamplingParams
    params = SamplingParams.from_config(cfg.rollout, cfg.algo, seed=1).with_(adaptive=False, entropy_stats=None)
    t0 = time.time()
    engine.pause_generation("in_place")
    try:
        engine.update_weights(_fresh_weights(model_dir, device, dtype), weight_version=version, flush_cache=False)
    finally:
        engine.continue_generation()
    pause_s = time.time() - t0
    samples = [s for group in engine.generate([[5, 6, 7], [8, 9]], params) for s in group]
    versions = {int(v) for s in samples for v in s.weight_versions}
    assert versions == {version}, f"tokens after the update report weight versions {sorted(versions)}, not {version}"
    return f"in-place pause + update v{version} + continue {pause_s:.1f} s, every token v{version}"


def _exercise_abort_resume(cfg, engine, long_tokens: int) -> str:
    """What over-sampling does to a server (`rollout.sglang.partial.generate_groups`): a short
    group returns, the caller has enough, every server aborts what it runs; a long row comes back
    ``abort`` with its tokens so far, and resumed from prompt + partial response it runs to its
    token budget."""
    from hapo_megatron.rollout.engine import SamplingParams
    from hapo_megatron.rollout.sglang.partial import ABORT, RowRequest, generate_groups
    params = SamplingParams.from_config(cfg.rollout, cfg.algo, seed=1).with_(adaptive=False, entropy_stats=None,
                                                                               ignore_eos=True)
    prompt = (5, 6, 7)
    groups = [[RowRequest(prompt, 1)]] + [[RowRequest(prompt, long_tokens)] for _ in range(4)]
    out = generate_groups(engine, groups, [params] * len(groups), lambda g, rows: g == 0)
    aborted = [rows[0] for rows in out[1:] if rows is not None and rows[0].finish_reason == ABORT]
    if not aborted:
        raise AssertionError(f"no long request was running at the abort ({long_tokens} tokens each finished first)")
    part = aborted[0]
    left = long_tokens - len(part.token_ids)
    (resumed,) = generate_groups(engine, [[RowRequest(prompt + part.token_ids, left)]], [params], lambda g, rows: False)
    (rest,) = resumed
    assert rest.finish_reason == "length" and len(part.token_ids) + len(rest.token_ids) == long_tokens, \
        f"resumed row: {rest.finish_reason}, {len(part.token_ids)} + {len(rest.token_ids)} of {long_tokens} tokens"
    return f"abort at {len(part.token_ids)} of {long_tokens} tokens, resumed to the budget"


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def _run_modes(model_dir: str, modes: list[tuple[str, bool]], log_dir: str, device: str, dtype: torch.dtype,
               one_server: bool, server_loops: bool = False) -> tuple[list[str], list[str]]:
    """(figures, failures) of ``modes`` (``(mode, colocate)``); each mode's engine launches its own
    server, or with ``one_server`` the first mode's engine launches it and the others attach to it.
    ``server_loops``: the first engine also runs the asynchronous and the abort/resume exercises."""
    figures, failed, api_key, shared = [], [], new_api_key(), None
    try:
        for mode, colocate in modes:
            engine = None
            try:
                cfg, engine = _engine(model_dir, mode, os.path.join(log_dir, f"logs_{mode}"), dtype, api_key,
                                      attach_to=shared.servers[0].url if shared is not None else None,
                                      colocate=colocate)
                first = shared is None
                if one_server and shared is None:
                    shared = engine  # shut down last: its server serves the later modes
                figures.append(_exercise(cfg, engine, model_dir, mode, device, dtype))
                if server_loops and first:
                    for name, run in (("async", lambda: _exercise_async(cfg, engine, model_dir, device, dtype)),
                                      ("abort/resume", lambda: _exercise_abort_resume(cfg, engine, LONG_TOKENS))):
                        try:
                            figures.append(f"{name}: {run()}")
                        except Exception as e:  # noqa: BLE001 - reported as this exercise's failure
                            failed.append(f"{name}: {_first_line(e)}")
            except Exception as e:  # noqa: BLE001 - one mode failing must not hide the others
                failed.append(f"{mode}: {_first_line(e)}")
            finally:
                if engine is not None and engine is not shared:
                    engine.shutdown()
    finally:
        if shared is not None:
            shared.shutdown()
    return figures, failed


LONG_TOKENS = 240  # the tiny model's context is 256: the longest row that fits after a 3-token prompt


def check_sglang_server(model_dir: str | None = None) -> CheckResult:
    if importlib.util.find_spec("sglang") is None:
        return CheckResult("SGLang server", SKIP, "sglang is not installed")
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    modes, skipped, one_server = plan_modes(cuda=cuda, gpus=torch.cuda.device_count() if cuda else 0)
    with tempfile.TemporaryDirectory(prefix="hapo_doctor_") as tmp:
        model_dir = model_dir or write_tiny_model(os.path.join(tmp, "model"), dtype)
        figures, failed = _run_modes(model_dir, modes, tmp, device, dtype, one_server=one_server,
                                     server_loops=True)
    notes = [f"{mode}: skipped, {why}" for mode, why in skipped if cuda]
    if failed:
        return CheckResult("SGLang server", FAIL, "; ".join(failed + figures + notes), SERVER_FIX)
    return CheckResult("SGLang server", PASS, f"{device}, adaptive temperature; " + "; ".join(figures + notes))
