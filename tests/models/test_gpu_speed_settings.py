"""The GPU speed settings of MoE policies (docs/moe.md, "GPU speed settings"): with Transformer
Engine (a GPU) the TransformerConfig gets TE's grouped MLP, fused token permutation and fused RoPE
(THD included); without it (CPU) every one stays off. TransformerConfig itself refuses the fused
settings without TE, so the TE case records the fields through a stand-in."""

from types import SimpleNamespace

from hapo_megatron.models import tiny_hf_config, transformer_config_from_hf

FUSED = ("moe_grouped_gemm", "moe_permute_fusion", "apply_rope_fusion")


def test_cpu_keeps_the_unfused_paths():
    tc = transformer_config_from_hf(tiny_hf_config("qwen3_moe"), use_te=False, sequence_parallel=False)
    assert [getattr(tc, f) for f in FUSED] == [False, False, False]
    # use_te=None: TE when usable, and it is not on CPU
    tc = transformer_config_from_hf(tiny_hf_config("qwen3_moe"), use_te=None, sequence_parallel=False)
    assert [getattr(tc, f) for f in FUSED] == [False, False, False]


def test_transformer_engine_turns_the_fused_paths_on(monkeypatch):
    """Fails when a setting is left at its CPU value (tried: moe_grouped_gemm=False,
    moe_permute_fusion=False, apply_rope_fusion=False in turn)."""
    import megatron.core.transformer as mt

    monkeypatch.setattr(mt, "TransformerConfig", lambda **kw: SimpleNamespace(**kw))
    moe = transformer_config_from_hf(tiny_hf_config("qwen3_moe"), use_te=True, sequence_parallel=False)
    assert [getattr(moe, f) for f in FUSED] == [True, True, True]
    dense = transformer_config_from_hf(tiny_hf_config("qwen3"), use_te=True, sequence_parallel=False)
    assert dense.apply_rope_fusion is True and not hasattr(dense, "moe_grouped_gemm")
    off = transformer_config_from_hf(tiny_hf_config("qwen3_moe"), use_te=False, sequence_parallel=False)
    assert [getattr(off, f) for f in FUSED] == [False, False, False]
