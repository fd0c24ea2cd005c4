"""Megatron-Core GPTModel (and its TransformerConfig) from a Hugging Face Llama/Qwen2/Qwen3 config.

Vocab padding: Megatron shards the embedding and output layer over TP, so the vocab is padded to
`padded_vocab_size(vocab, tp)`: a multiple of lcm(make_vocab_size_divisible_by, tp), default
lcm(128, tp) = 128 for the usual power-of-two TP. Unlike Megatron-LM's 128 * tp this does not
depend on TP (up to 128), so one torch_dist checkpoint reshards to any TP. The logits of padded
ids are set to PADDED_VOCAB_LOGIT by a forward hook on the output layer: an HF model has no such
tokens, so they must get zero probability in log-probs and entropies. The padding rows are
dropped again on export (`hapo_megatron.convert`).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from hapo_megatron.config.validate import ModelSpec, check_layout
from hapo_megatron.models.hf_config import (
    has_qk_norm,
    has_qkv_bias,
    head_dim_of,
    num_kv_heads_of,
    rope_inv_freq,
    rope_parameters,
    validate_hf_config,
)
from hapo_megatron.models.moe import moe_config_fields
from hapo_megatron.parallel.groups import ParallelGroups, get_parallel_groups

DEFAULT_VOCAB_DIVISIBLE_BY = 128
# Logit given to padded vocab ids: exp() underflows to exactly 0 next to real logits, yet stays
# finite under temperature division and in bf16 (so 0 * logit in an entropy sum is 0, not NaN).
PADDED_VOCAB_LOGIT = -1.0e4


def padded_vocab_size(vocab: int, tp: int = 1, make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY) -> int:
    """Smallest multiple of lcm(make_vocab_size_divisible_by, tp) that is >= vocab."""
    if vocab <= 0:
        raise ValueError(f"vocab must be positive, got {vocab}")
    if tp <= 0:
        raise ValueError(f"tp must be positive, got {tp}")
    if make_vocab_size_divisible_by <= 0:
        raise ValueError(f"make_vocab_size_divisible_by must be positive, got {make_vocab_size_divisible_by}")
    multiple = math.lcm(make_vocab_size_divisible_by, tp)
    return -(-vocab // multiple) * multiple


def te_available() -> bool:
    """Transformer Engine importable and a GPU present (TE layers cannot run on CPU)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


def _dtype_flags(dtype: torch.dtype) -> dict:
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    return dict(params_dtype=dtype, pipeline_dtype=dtype,
                bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)


_ARG_NAMES = {"tp": "tp", "pp": "pp", "ep": "ep", "etp": "etp", "cp": "cp"}  # check_layout's messages


def transformer_config_from_hf(hf_config, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                               etp: int | None = None, sequence_parallel: bool,
                               dtype: torch.dtype = torch.float32, use_te: bool | None, **kw):
    """The Megatron TransformerConfig equivalent of `hf_config`; `kw` overrides any field.

    Dropout is 0 (RL fine-tuning), RMSNorm, SwiGLU without linear biases, q/k/v biases for Qwen2,
    QK-norm for Qwen3, GQA via num_query_groups, kv_channels = head_dim (Qwen3 may differ from
    hidden/heads). On a machine without CUDA, weights are initialised on the CPU. MoE models
    (Qwen3-MoE) get the fields of `moe_config_fields`, their experts split over `ep` ranks and each
    expert's FFN over `etp` (None: `tp`).
    """
    from megatron.core.transformer import TransformerConfig

    validate_hf_config(hf_config)
    spec = ModelSpec.of(hf_config)
    etp = tp if etp is None else etp
    check_layout(spec, tp=tp, pp=pp, ep=ep, etp=etp, names=_ARG_NAMES)
    if sequence_parallel and tp == 1:
        sequence_parallel = False  # Megatron rejects SP without TP; it is a no-op there anyway
    use_te = te_available() if use_te is None else use_te
    fields = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=num_kv_heads_of(hf_config),
        kv_channels=head_dim_of(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=has_qkv_bias(hf_config),
        qk_layernorm=has_qk_norm(hf_config),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=not torch.cuda.is_available(),
        # Fused kernels need TE/Apex/CUDA; the unfused paths are exact and run everywhere.
        bias_activation_fusion=use_te,
        masked_softmax_fusion=use_te,
        bias_dropout_fusion=use_te,
        # TE's fused RoPE on GPU, THD included (the unfused THD path loops over the sequences of a
        # packed row with a host sync, for q and for k, in every layer); `hapo doctor` compares both
        apply_rope_fusion=use_te,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        **_dtype_flags(dtype),
    )
    if spec.is_moe:
        fields.update(moe_config_fields(hf_config, etp, fused=use_te))
    fields.update(kw)
    return TransformerConfig(**fields)


def layer_spec_for(hf_config, use_te: bool | None):
    """Transformer Engine layer spec when TE is usable, Megatron's local spec otherwise (with
    `PackedDotProductAttention`, so packed rows run on CPU too)."""
    from megatron.core.models.gpt import gpt_layer_specs

    qk_norm = has_qk_norm(hf_config)
    use_te = te_available() if use_te is None else use_te
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm)
    from hapo_megatron.models.packed_attention import PackedDotProductAttention
    spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    return spec


def decoder_spec_for(hf_config, config, use_te: bool, vp_stage: int | None = None):
    """The decoder spec of `build_gpt_model`: `layer_spec_for` for dense models; for MoE models
    Megatron's block spec, which places sparse and dense layers by `config.moe_layer_freq` on
    this pipeline stage (SequentialMLP experts with the local spec), with norms that support
    sequence parallelism in the local spec (`local_norm.py`: MoE with TP > 1 trains only with it)
    and `PackedDotProductAttention` in every layer, so packed rows run on CPU as for dense models.
    Dense models under sequence parallelism with the local spec get those norms too (in every
    layer and the final one: Megatron's `WrappedTorchNorm` refuses sequence parallelism)."""
    from hapo_megatron.models.local_norm import SequenceParallelTorchNorm, with_local_norm

    if not ModelSpec.of(hf_config).is_moe:
        spec = layer_spec_for(hf_config, use_te)
        if use_te or not config.sequence_parallel:
            return spec
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

        layers = get_num_layers_to_build(config, vp_stage)
        return TransformerBlockSubmodules(layer_specs=[with_local_norm(spec)] * layers,
                                          layer_norm=SequenceParallelTorchNorm)
    from megatron.core.models.gpt import gpt_layer_specs

    from hapo_megatron.models.packed_attention import PackedDotProductAttention

    spec = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                                      normalization="RMSNorm", vp_stage=vp_stage)
    if use_te:
        return spec
    spec = with_local_norm(spec)  # a copy: the layer specs below are its own
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    return spec


def _mask_padded_vocab_hook(vocab_size: int) -> Callable:
    """Forward hook for the output layer: padded vocab ids get PADDED_VOCAB_LOGIT.

    The output is `[s, b, V/tp]` (this rank's shard) or `[s, b, V]` when gathered (told apart by
    its width, since `runtime_gather_output` may gather per call).
    """
    import torch.distributed as dist

    def hook(module, inputs, output):
        logits, bias = output
        sharded = module.tp_group is not None and logits.shape[-1] == module.output_size_per_partition
        start = dist.get_rank(module.tp_group) * module.output_size_per_partition if sharded else 0
        first_pad = vocab_size - start
        if first_pad >= logits.shape[-1]:
            return output
        ids = torch.arange(logits.shape[-1], device=logits.device)
        return logits.masked_fill(ids >= max(first_pad, 0), PADDED_VOCAB_LOGIT), bias

    return hook


def _parallel_sizes(groups: Optional[ParallelGroups]) -> tuple[dict, bool, bool]:
    """({tp, pp, cp, ep, etp}, first_stage, last_stage) of ``groups`` (None: the initialised ones,
    read by `parallel.groups`, the one reader of Megatron's global state)."""
    g = groups if groups is not None else get_parallel_groups()
    sizes = dict(tp=g.tp_size, pp=g.pp_size, cp=g.cp_size, ep=g.ep_size, etp=g.etp_size)
    return sizes, g.is_pipeline_first, g.is_pipeline_last


def build_gpt_model(hf_config, *, pre_process: bool | None = None, post_process: bool | None = None,
                    dtype: torch.dtype = torch.float32, use_te: bool | None,
                    parallel_output: bool = True, vp_stage: int | None = None, config=None,
                    make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
                    sequence_parallel: bool, groups: Optional[ParallelGroups] = None, lora=None, **config_kw):
    """A GPTModel for `hf_config` on this rank of ``groups`` (`ParallelGroups`; None: the
    initialised ones, `parallel.groups.get_parallel_groups`).

    pre_process/post_process default to "this rank is the first/last pipeline stage". `config`
    is a ready TransformerConfig; otherwise one is built with the initialised TP/PP/CP sizes,
    `dtype`, `sequence_parallel` and `config_kw`. The model carries `hf_vocab_size` (unpadded).
    `use_te`: Transformer Engine layers (None: when usable; `model.use_te`); `sequence_parallel`:
    `parallel.sequence_parallel` (unused when `config` is given); `lora`: `models.lora.LoraSettings`
    (None: no adapters), adapters on the targeted linear layers (the base weights are not frozen here:
    `models.lora.freeze_base`).
    """
    from hapo_megatron.compat.megatron_fixes import fix_moe_router_without_te
    from hapo_megatron.models.lora import lora_decoder_spec
    from megatron.core.models.gpt import GPTModel

    sizes, first, last = _parallel_sizes(groups)
    pre_process = first if pre_process is None else pre_process
    post_process = last if post_process is None else post_process
    use_te = te_available() if use_te is None else use_te
    if config is None:
        config = transformer_config_from_hf(hf_config, **sizes, dtype=dtype, use_te=use_te,
                                            sequence_parallel=sequence_parallel, **config_kw)
    vocab = padded_vocab_size(hf_config.vocab_size, sizes["tp"], make_vocab_size_divisible_by)
    if ModelSpec.of(hf_config).is_moe:
        fix_moe_router_without_te()  # the router's GEMM without TE (compat/megatron_fixes.py)
    model = GPTModel(
        config=config,
        transformer_layer_spec=lora_decoder_spec(decoder_spec_for(hf_config, config, use_te, vp_stage), lora),
        vocab_size=vocab,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=float(rope_parameters(hf_config)["rope_theta"]),
        vp_stage=vp_stage,
    )
    if config.params_dtype != torch.float32:
        # The local spec's torch norms ignore params_dtype; cast them like Megatron's Float16Module
        # (and TE's norms) would, so every parameter has the model dtype.
        model.to(config.params_dtype)
    inv_freq = rope_inv_freq(hf_config)
    if inv_freq is not None:  # scaled RoPE: HF's own inverse frequencies (see hf_config.py)
        rotary = model.rotary_pos_emb
        rotary.inv_freq = inv_freq.to(rotary.inv_freq.device)
    if post_process and vocab > hf_config.vocab_size:
        model.output_layer.register_forward_hook(_mask_padded_vocab_hook(hf_config.vocab_size))
    if ModelSpec.of(hf_config).is_moe:  # before any other router hook (the expert-load monitor counts what it leaves)
        from hapo_megatron.models.moe_padding import route_no_padding
        route_no_padding(model)
    model.hf_vocab_size = hf_config.vocab_size
    return model


def model_provider_for(hf_config, **kw) -> Callable:
    """`provider(pre_process=True, post_process=True, vp_stage=None) -> GPTModel` for model builders
    that decide the pipeline stage (Megatron's get_model pattern); `kw` go to build_gpt_model."""

    def provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None, **_):
        return build_gpt_model(hf_config, pre_process=pre_process, post_process=post_process,
                               vp_stage=vp_stage, **kw)

    return provider


def _unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def output_weight(gpt) -> torch.Tensor:
    """This rank's vocab shard `[V/tp, H]` of the output layer's weight: the embedding's when the
    weights are tied and this stage holds the embedding, else the output layer's own (with PP > 1
    and tied weights, the last stage's copy that Megatron keeps in sync)."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def forward_hidden_states(model, *args, **kwargs):
    """Call `model` (a GPTModel, possibly wrapped) with its output layer left to the loss.

    On the last pipeline stage this returns a `parallel.linear.HiddenStates`: the decoder's final
    (normed) hidden states `[s, b, H]` (sequence-sharded under sequence parallelism), the output
    weight and the unpadded vocab size, for `parallel.linear_logprobs_entropy`; elsewhere the
    usual output. WHY the `post_process` switch: GPTModel._postprocess returns the decoder output
    untouched when it is off (the decoder keeps its own final norm), and nothing else in forward
    reads it; the output layer's parameters stay registered (checkpoints, DDP buffers, optimizer).
    """
    from hapo_megatron.parallel.linear import HiddenStates

    gpt = _unwrap(model)
    if not gpt.post_process:
        return model(*args, **kwargs)
    if getattr(gpt.config, "mtp_num_layers", None):
        raise ValueError("the fused output layer does not support multi-token prediction (mtp_num_layers)")
    gpt.post_process = False
    try:
        hidden = model(*args, **kwargs)
    finally:
        gpt.post_process = True
    return HiddenStates(hidden, output_weight(gpt), sequence_parallel=bool(gpt.config.sequence_parallel),
                        vocab_size=getattr(gpt, "hf_vocab_size", None))
