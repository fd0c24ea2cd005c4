"""THE table of CPU counterparts: every GPU-only switch of a recipe and what runs in its place when
tests/recipes runs the recipe on CPU (docs/testing.md, "GPU recipes on CPU"). Nothing else in
tests/recipes changes a recipe's switches; sizes shrink in tiny_recipe.py.

Each row is applied in one of two ways:

- ``by="package"``: hapo_megatron itself makes the substitution on a machine without CUDA (the
  row names where); the test passes the recipe's value unchanged and only prints the row;
- ``by="override"``: the test adds the row's dotted overrides (or environment) to the recipe's
  own command line, because the switch cannot run here at all.

A recipe whose config holds a GPU-only switch that no row covers fails its test (``unmatched``):
a new recipe switch gets a row here (and in docs/testing.md) before it runs on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Counterpart:
    """One row: ``switch`` (config field or launch setting), its GPU value and CPU counterpart."""

    switch: str
    gpu: str
    cpu: str
    by: str  # "package" | "override"
    why: str
    applies: Callable[[object], bool]
    overrides: Callable[[object], list[str]] = field(default=lambda cfg: [])


def _cp(cfg) -> int:
    return cfg.parallel.context_parallel_size


def _sglang(cfg) -> bool:
    return cfg.rollout.engine == "sglang"


def _weight_sync(cfg) -> str:
    from hapo_megatron.rollout.sglang.engine import resolve_weight_sync
    return resolve_weight_sync(cfg.rollout.sglang.weight_sync, colocate=cfg.rollout.sglang.colocate)


def _server_tp_to_1(cfg) -> list[str]:
    out = ["rollout.sglang.server_tp_size=1"]
    args = list(cfg.rollout.sglang.extra_server_args)
    if "--ep-size" in args:  # expert parallelism inside a server spans its TP ranks: none left
        i = args.index("--ep-size")
        del args[i:i + 2]
        out.append("rollout.sglang.extra_server_args=[" + ",".join(args) + "]")
    return out


TABLE: tuple[Counterpart, ...] = (
    Counterpart(
        "model.use_te", "Transformer Engine layers (null: TE when installed and CUDA is visible)",
        "Megatron-Core's local layer spec (TE's fused MoE permute / grouped GEMM -> the unfused paths)", "package",
        "TE needs CUDA; model.use_te=null resolves to the local spec without it (training/actor.py)",
        applies=lambda cfg: cfg.model.use_te is not False),
    Counterpart(
        "model.dtype", "bf16 parameters and compute", "fp32", "package",
        "the actor trains in fp32 without CUDA (training/build.py build_runtime); the CPU tests' float "
        "bounds are fp32 ones",
        applies=lambda cfg: cfg.model.dtype != "fp32"),
    Counterpart(
        "torch.distributed backend", "NCCL", "gloo", "package",
        "Megatron-Core's groups and the trainer's collectives run over gloo on CPU (hapo_megatron/compat)",
        applies=lambda cfg: True),
    Counterpart(
        "parallel.context_parallel_size", "CP > 1 (context-parallel attention)",
        "CP = 1: the ranks CP held train data-parallel (same world size)", "override",
        "Megatron-Core's local attention refuses CP ('Context parallelism is only supported by "
        "TEDotProductAttention'); the CP loss and batch math run on CPU in tests/parallel/",
        applies=lambda cfg: _cp(cfg) > 1,
        overrides=lambda cfg: ["parallel.context_parallel_size=1"]),
    Counterpart(
        "rollout servers' dtype", "the trainer's dtype (bf16) on GPU servers",
        "float32 (--dtype float32, SGLang's CPU engine: --device cpu --attention-backend torch_native)",
        "package", "launch.server_command on CPU; the rollout engine's dtype follows (training/build.py)",
        applies=_sglang),
    Counterpart(
        "rollout.sglang.mem_fraction_static", "the servers' share of GPU memory",
        "--max-total-tokens 8192 (the KV pool of a CPU server)", "package",
        "a CPU server sizes its pool from the machine's RAM otherwise (launch.CPU_MAX_TOTAL_TOKENS)",
        applies=_sglang),
    Counterpart(
        "rollout.sglang.colocate=true memory release", "--enable-memory-saver; /release_memory_occupation "
        "and /resume_memory_occupation around every update", "no memory saver; release / resume are no-ops",
        "package", "the memory saver needs CUDA (SGLangEngine.release_memory / resume_memory on CPU)",
        applies=lambda cfg: _sglang(cfg) and cfg.rollout.sglang.colocate),
    Counterpart(
        "rollout.sglang.weight_sync=tensor", "CUDA-IPC handles through /update_weights_from_tensor",
        "the same endpoint and buckets, CPU tensors pickled by value", "package",
        "CUDA IPC needs CUDA tensors (weight_sync.serialize_bucket_for_sglang on CPU tensors)",
        applies=lambda cfg: _sglang(cfg) and _weight_sync(cfg) == "tensor"),
    Counterpart(
        "rollout.sglang.weight_sync=distributed", "an NCCL group of trainer rank 0 and every server rank",
        "the same group over gloo, buckets broadcast from CPU memory", "package",
        "NCCL needs CUDA (rollout/sglang/sync_group.py: sync_backend / sync_buffer_device of the servers' device)",
        applies=lambda cfg: _sglang(cfg) and _weight_sync(cfg) == "distributed"),
    Counterpart(
        "rollout.sglang.server_tp_size", "server_tp_size GPUs per server (with --ep-size: experts spread "
        "over them)", "1 process per server (and no --ep-size)", "override",
        "layout shrink: a CPU server with --tp-size 2 --ep-size 2 was not healthy after 300 s on the loaded "
        "2-core machine (docs/testing.md); num_servers=0 then means one server per rank",
        applies=lambda cfg: _sglang(cfg) and cfg.rollout.sglang.server_tp_size > 1,
        overrides=_server_tp_to_1),
)

#: GPU-only switches that have no CPU counterpart yet: a recipe setting one fails its test
UNCOVERED: tuple[tuple[str, Callable[[object], bool]], ...] = (
    ("rollout.quantization=fp8 (SGLang's CPU backend serves no block-FP8 weights, docs/testing.md)",
     lambda cfg: cfg.rollout.quantization != "none"),
    ("rollout.kv_cache_dtype (FP8 KV cache)", lambda cfg: cfg.rollout.kv_cache_dtype not in ("auto",)),
    ("model.offload_during_rollout=true (moves CUDA memory to the host)",
     lambda cfg: cfg.model.offload_during_rollout is True),
)


def counterparts_for(cfg) -> tuple[list[Counterpart], list[str]]:
    """The rows that apply to ``cfg`` (a loaded recipe config) and their overrides in order."""
    rows = [row for row in TABLE if row.applies(cfg)]
    return rows, [o for row in rows for o in row.overrides(cfg)]


def unmatched(cfg) -> list[str]:
    """GPU-only switches of ``cfg`` that no row covers."""
    return [what for what, on in UNCOVERED if on(cfg)]


def describe(rows: list[Counterpart]) -> str:
    """The substitutions as the test prints them."""
    return "\n".join(f"  [{row.by}] {row.switch}: {row.gpu} -> {row.cpu} ({row.why})" for row in rows)
