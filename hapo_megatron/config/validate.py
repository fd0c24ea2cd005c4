"""The checks a run's config makes against its model and world size, before any process group.

``ModelSpec.of(hf_config)`` reads the model's shape once (what counts as a MoE model is decided
here only); ``check_layout`` holds the rules the Megatron layout puts on that shape (TP divides the
heads, KV heads and FFN, PP the layers, EP the experts, ETP each expert's FFN, no expert split of a
dense model), for the model builder and the converter as well; ``validate_run`` adds the rules of
training (MoE under TP needs sequence parallelism, no context parallelism with MoE), the world
size's, and what the servers the trainer launches need of the hardware (FP8 needs CUDA servers).
``hapo train`` runs it before ``init_process_group``, ``hapo doctor --config`` too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from hapo_megatron.config.base import _fail

__all__ = ["ModelSpec", "check_layout", "validate_run", "CONFIG_NAMES", "CPU_FP8_REFUSED", "CPU_LORA_REFUSED",
           "check_fp8_launch", "rollout_dtype"]

#: the parallel sizes under their config keys, as ``validate_run``'s messages name them
CONFIG_NAMES = {"tp": "parallel.tensor_model_parallel_size", "pp": "parallel.pipeline_model_parallel_size",
                "ep": "parallel.expert_model_parallel_size", "etp": "parallel.expert_tensor_parallel_size",
                "cp": "parallel.context_parallel_size"}

MOE_MODEL_TYPES = ("qwen3_moe",)


def _int(hf_config, name: str, default: int = 0) -> int:
    return int(getattr(hf_config, name, None) or default)


@dataclass(frozen=True)
class ModelSpec:
    """The model's shape as the checks, the actor and the memory plan read it."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn: int
    vocab_size: int
    num_experts: int = 0
    """0 for a dense model."""
    moe_ffn: int = 0
    """Each expert's FFN size (moe_intermediate_size; 0 dense)."""
    experts_per_token: int = 0
    """Router top-k (num_experts_per_tok; 0 dense)."""

    @property
    def is_moe(self) -> bool:
        """Whether the model has Mixture-of-Experts layers."""
        return self.num_experts > 0

    @classmethod
    def of(cls, hf_config) -> "ModelSpec":
        """Read from an HF config; a model of a type without experts here (Qwen3-MoE is the one MoE
        architecture supported) counts as dense whatever ``num_experts`` says."""
        model_type = str(getattr(hf_config, "model_type", None) or "")
        heads = _int(hf_config, "num_attention_heads")
        moe = model_type in MOE_MODEL_TYPES and _int(hf_config, "num_experts") > 0
        return cls(model_type=model_type, num_layers=_int(hf_config, "num_hidden_layers"), num_heads=heads,
                   num_kv_heads=_int(hf_config, "num_key_value_heads", heads),
                   ffn=_int(hf_config, "intermediate_size"), vocab_size=_int(hf_config, "vocab_size"),
                   num_experts=_int(hf_config, "num_experts") if moe else 0,
                   moe_ffn=_int(hf_config, "moe_intermediate_size") if moe else 0,
                   experts_per_token=_int(hf_config, "num_experts_per_tok") if moe else 0)


def check_layout(spec: ModelSpec, *, tp: Optional[int] = None, pp: Optional[int] = None,
                 ep: Optional[int] = None, etp: Optional[int] = None,
                 names: Mapping[str, str] = CONFIG_NAMES) -> None:
    """ValueError when the Megatron layout cannot split ``spec``; a size left None is not checked.
    ``names`` say what the caller calls each size (the config keys by default, the converter's and
    the model builder's arguments otherwise)."""
    sizes = {"tp": tp, "pp": pp, "ep": ep, "etp": etp}
    for key, size in sizes.items():
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            _fail(f"{names[key]} must be an integer >= 1, got {size!r}")
    if tp is not None:
        for what, n in (("num_attention_heads", spec.num_heads), ("num_key_value_heads", spec.num_kv_heads),
                        ("intermediate_size", spec.ffn)):
            if n % tp:
                _fail(f"{names['tp']}={tp} must divide the model's {what}={n}")
    if pp is not None and spec.num_layers % pp:
        _fail(f"{names['pp']}={pp} must divide the model's num_hidden_layers={spec.num_layers}")
    if not spec.is_moe:
        if (ep is not None and ep != 1) or (etp is not None and tp is not None and etp != tp):
            _fail(f"{names['ep']}={ep} / {names['etp']}={etp}: the model ({spec.model_type}) has no experts; "
                  "expert parallelism needs a MoE model (leave them at 1 / the tensor-parallel size)")
        return
    if ep is not None and spec.num_experts % ep:
        _fail(f"{names['ep']}={ep} must divide the model's num_experts={spec.num_experts}")
    if etp is not None and spec.moe_ffn % etp:
        _fail(f"{names['etp']}={etp} must divide the model's moe_intermediate_size={spec.moe_ffn}")


#: why a CPU server cannot serve block FP8 (measured: docs/testing.md, "FP8 rollouts on CPU")
CPU_FP8_REFUSED = ("rollout.quantization='fp8' needs CUDA servers: SGLang 0.5.23's CPU backend runs block-FP8 "
                   "layers only on CPUs with AMX, through sgl_kernel's CPU build (docs/fp8.md)")
_HALF_DTYPES = ("bfloat16", "float16", "bf16", "fp16")


def rollout_dtype(cfg, *, on_gpu: bool) -> str:
    """The rollout engine's dtype name: ``rollout.dtype``, else the model's on a GPU and fp32 on CPU."""
    return cfg.rollout.dtype or (cfg.model.dtype if on_gpu else "fp32")


CPU_LORA_REFUSED = ("rollout.sglang.lora_sync='adapter' needs CUDA servers: SGLang 0.5.23's CPU backend cannot "
                    "serve LoRA (its column-parallel LoRA layers pin host memory at start, which fails without an "
                    "accelerator: sglang/srt/lora/layers.py); use lora_sync=merged (docs/lora.md)")


def check_fp8_launch(quantization: str, *, device: str, dtype) -> None:
    """ValueError when servers cannot be launched with ``quantization`` on ``device`` in ``dtype``
    (a name or a torch dtype): FP8 on a CPU server, or FP8 with float32 activations (SGLang's
    Fp8Config takes bf16 / fp16)."""
    if quantization == "fp8":
        if device == "cpu":
            _fail(CPU_FP8_REFUSED)
        if str(dtype).replace("torch.", "") not in _HALF_DTYPES:
            _fail(f"rollout.quantization='fp8' runs the servers in bf16 or fp16, not {dtype}: "
                  "set rollout.dtype to bf16")


def _check_launched_servers(cfg, cuda: bool) -> None:
    """What the servers the trainer launches need of this machine (attached servers, ``server_urls``,
    run elsewhere and decide for themselves)."""
    r = cfg.rollout
    if r.engine != "sglang" or r.sglang.server_urls:
        return
    check_fp8_launch(r.quantization, device="cuda" if cuda else "cpu", dtype=rollout_dtype(cfg, on_gpu=cuda))
    if r.sglang.lora_sync == "adapter" and not cuda:
        _fail(CPU_LORA_REFUSED)


def validate_run(cfg, model_spec: ModelSpec, world_size: int, *, cuda: Optional[bool] = None) -> int:
    """Every check of ``cfg`` (a ``HapoConfig``) against the model, the world size and this
    machine's hardware (``cuda``: whether the run has GPUs; None: whether this machine has one)
    that needs no process group; returns the data-parallel size. ValueError naming the config
    fields, one line (the CLI prints it as its error)."""
    if cuda is None:
        import torch
        cuda = torch.cuda.is_available()
    _check_launched_servers(cfg, cuda)
    p = cfg.parallel
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    check_layout(model_spec, tp=tp, pp=p.pipeline_model_parallel_size, ep=p.expert_model_parallel_size,
                 etp=p.expert_tensor_parallel_size or tp)
    if model_spec.is_moe and tp > 1 and not p.sequence_parallel:
        _fail(f"parallel.sequence_parallel must be true for a MoE model with tensor_model_parallel_size={tp} "
              "(Megatron trains MoE layers under TP only with sequence parallelism)")
    if model_spec.is_moe and cp > 1:
        _fail("parallel.context_parallel_size > 1 is not supported with MoE models")
    return p.validate_world(world_size)
