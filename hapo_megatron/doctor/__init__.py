"""`hapo doctor`: the first command on a new machine. Each check is one line of a pass/fail
table with its measured figure and, on failure, the fix.

    hapo doctor                          # every check this machine can run (CPU subset on CPU)
    hapo doctor --config X.yaml          # + the per-GPU memory plan of that config
    hapo doctor --only imports --strict  # the image build's smoke test: every compiled piece imports

Checks: torch/CUDA/NCCL versions and visibility; imports of megatron-core, Transformer Engine's
torch extension, sgl_kernel, flashinfer, SGLang (apex optional); TE layer spec vs local spec on a
tiny GPTModel (GPU); the MoE fused paths (grouped MLP, permute fusion, RoPE fusion) vs unfused
on a tiny Qwen3-MoE (GPU) and that model trained at EP=2 (2 GPUs); fused log-prob + entropy vs
float64 (+ memory bandwidth on a GPU); the update's model TFLOP/s beside the device's bf16 peak
(GPU); TP=2 and CP=2 on two ranks (two GPUs, else gloo on CPU);
a real SGLang server per weight-sync mode with an in-place pause + tagged update and an
abort/resume (on one GPU sharing the trainer's GPU, the distributed sync skipped); the trainer's
colocated sync sequence on a TP=2 server checked against transformers (2+ GPUs); FP8 rollouts
against bf16 (greedy tokens, log-prob gap, tokens/s; GPU, docs/fp8.md); the memory plan.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from hapo_megatron.doctor.report import FAIL, PASS, SKIP, CheckResult, format_table, run_check

__all__ = ["main", "collect_checks", "run_checks", "CheckResult", "format_table", "PASS", "FAIL", "SKIP"]

GROUPS = ("env", "imports", "model", "moe", "kernel", "parallel", "sglang", "memory")


def collect_checks(args) -> list:
    """[(group, name, fn, default fix)] for the selected groups."""
    from hapo_megatron.doctor import (colocated_checks, env_checks, fp8_checks, kernel_checks, model_checks,
                                      moe_checks, moe_ep_checks, parallel_checks, sglang_checks,
                                      throughput_checks)
    fix_env = env_checks.IMAGE_FIX
    checks = [("env", "torch", env_checks.check_torch, fix_env),
              ("env", "cuda devices", env_checks.check_cuda_devices, fix_env)]
    checks += [("imports", n, fn, fix_env) for n, fn in env_checks.import_checks(strict=args.strict)]
    checks += [("model", "TE spec vs local", model_checks.check_te_vs_local,
                "set model.use_te=false to train without Transformer Engine, and report the error"),
               ("model", "packed == padded (TE THD)", model_checks.check_packed_vs_padded,
                "set parallel.pack_sequences=false and report the error"),
               *[("moe", n, fn, moe_checks.FIX) for n, fn in moe_checks.moe_fused_checks()],
               ("moe", moe_ep_checks.NAME, moe_ep_checks.check_moe_ep2, moe_ep_checks.FIX),
               ("kernel", "logprob+entropy", kernel_checks.check_logprob_entropy,
                "run python -m pytest tests/parallel/test_vocab_parallel.py and report the failure"),
               ("kernel", throughput_checks.NAME, throughput_checks.check_update_tflops, throughput_checks.FIX)]
    checks += [("parallel", n, fn, "check NCCL (NCCL_DEBUG=INFO) and the GPUs' peer access")
               for n, fn in parallel_checks.parallel_checks()]
    checks.append(("sglang", "SGLang server", lambda: sglang_checks.check_sglang_server(args.sglang_model),
                   sglang_checks.SERVER_FIX))
    checks.append(("sglang", colocated_checks.NAME, colocated_checks.check_colocated_sync, sglang_checks.SERVER_FIX))
    checks.append(("sglang", fp8_checks.NAME, lambda: fp8_checks.check_fp8_rollouts(args.sglang_model),
                   sglang_checks.SERVER_FIX))
    if args.config:
        from hapo_megatron.doctor.memory_checks import check_memory_plan

        def memory():
            res, text = check_memory_plan(args.config, args.overrides, world_size=args.world_size,
                                          device_memory_gib=args.device_memory_gib)
            print(text, flush=True)
            return res
        checks.append(("memory", "memory plan", memory, "fix the config fields the warning names"))
    only = set(args.only.split(",")) if args.only else set(GROUPS)
    return [c for c in checks if c[0] in only]


def run_checks(checks: list, *, progress: bool = True) -> list:
    results = []
    for _, name, fn, fix in checks:
        if progress:
            print(f"  checking {name} ...", file=sys.stderr, flush=True)
        results.append(run_check(name, fn, fix))
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hapo doctor", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="also print and check the per-GPU memory plan of this config")
    p.add_argument("overrides", nargs="*", help="dotted overrides of --config")
    p.add_argument("--only", help=f"comma-separated check groups: {','.join(GROUPS)}")
    p.add_argument("--strict", action="store_true",
                   help="a compiled component that does not import is a failure even without a GPU (image build)")
    p.add_argument("--world-size", type=int, default=None, help="ranks of the planned run (default: the GPUs here)")
    p.add_argument("--device-memory-gib", "--device-memory-gb", dest="device_memory_gib", type=float, default=None,
                   help="plan for devices of this size in GiB (2^30 bytes, as torch.cuda reports it: an 80 GB H100 "
                        "has 79.6 GiB; default: this GPU, or 79.6 without one)")
    p.add_argument("--sglang-model", default=None, help="model directory for the SGLang check (default: tiny random)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print the table; exit status 1 when a check failed, 0 otherwise."""
    from hapo_megatron.train import quiet_warnings
    quiet_warnings()
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    if args.only and set(args.only.split(",")) - set(GROUPS):
        print(f"hapo doctor: unknown group in --only {args.only!r}; groups: {', '.join(GROUPS)}", file=sys.stderr)
        return 2
    results = run_checks(collect_checks(args))
    print(format_table(results), flush=True)
    return 1 if any(r.status == FAIL for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
