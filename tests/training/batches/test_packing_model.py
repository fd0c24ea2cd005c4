"""A packed row through megatron-core's GPTModel on CPU: `PackedDotProductAttention`
(block-diagonal causal mask, computed block by block; checked against the dense masked product) +
megatron-core's per-sequence rotary embedding give every sequence the logits it gets alone in a
padded row, for Llama with llama3-scaled RoPE (untied) and
Qwen2 (q/k/v biases, tied), plain and through the fused output layer. Not assumed from "RoPE is
relative": compared. Single process (TP = PP = 1); the parallel layouts are test_packing_parity."""

import pytest
import torch

from tests.convert.dist_checks import random_hf_model
from tests.distributed import run_distributed

#: both layouts compute each logit from the same operands; only the order of float32 sums over
#: other matmul / softmax shapes may differ: a few ulps of O(1) values (logits here are < 10).
ATOL = 1e-5


def _packed_vs_alone(rank, world, arch):
    from hapo_megatron.convert import load_hf_weights_into_mcore
    from hapo_megatron.models import build_gpt_model, forward_hidden_states
    from hapo_megatron.parallel.groups import initialize_parallel
    from hapo_megatron.parallel.linear import HiddenStates
    from hapo_megatron.parallel.loss import logprobs_entropy_from_logits
    from hapo_megatron.training.actor import packed_seq_params_of
    from hapo_megatron.training.batches.micro_batches import SequenceData, collate, collate_packed

    g = initialize_parallel(tp=1, pp=1, seed=1)
    cfg, hf = random_hf_model(arch)
    model = build_gpt_model(cfg, use_te=None, sequence_parallel=False)
    load_hf_weights_into_mcore(model, hf.state_dict(), cfg, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    model.eval()
    gen = torch.Generator().manual_seed(5)
    # long enough that llama3 RoPE scaling (original_max_position_embeddings 32) matters
    seqs = [SequenceData(torch.randint(0, cfg.vocab_size, (p,), generator=gen).tolist(),
                         torch.randint(0, cfg.vocab_size, (r,), generator=gen).tolist(), index=i)
            for i, (p, r) in enumerate([(3, 40), (5, 2), (2, 17), (4, 30)])]
    packed = collate_packed(seqs)
    out = {}
    with torch.no_grad():
        row = model(packed.input_ids, packed.position_ids, None, packed_seq_params=packed_seq_params_of(packed))
        hidden = forward_hidden_states(model, packed.input_ids, packed.position_ids, None,
                                       packed_seq_params=packed_seq_params_of(packed))
        assert isinstance(hidden, HiddenStates)
        lp_fused, _ = logprobs_entropy_from_logits(hidden, packed.labels, tp_group=g.tp, temperature=1.0)
        lp_row, _ = logprobs_entropy_from_logits(row, packed.labels, tp_group=g.tp, temperature=1.0)
        cu = packed.cu_seqlens.tolist()
        diffs, fused_diffs, spread = [], [], []
        for i, s in enumerate(seqs):
            alone = collate([s])  # the sequence alone, positions 0.. (the padded path)
            ref = model(alone.input_ids, alone.position_ids, None)[0]
            n = s.num_tokens
            got = row[0, cu[i]:cu[i] + n]
            diffs.append(float((got - ref[:n]).abs().max()))
            ref_lp, _ = logprobs_entropy_from_logits(ref.unsqueeze(0), alone.labels, tp_group=g.tp, temperature=1.0)
            fused_diffs.append(float((lp_fused[0, cu[i]:cu[i] + n - 1] - ref_lp[0, :n - 1]).abs().max()))
            fused_diffs.append(float((lp_row[0, cu[i]:cu[i] + n - 1] - ref_lp[0, :n - 1]).abs().max()))
            spread.append(float(ref[:n].abs().max()))
    out.update(diffs=diffs, fused_diffs=fused_diffs, spread=spread)
    return out


def _attention_vs_dense_mask(rank, world, gqa):
    """PackedDotProductAttention (block by block) against the obviously-correct dense product
    under `block_causal_mask`: outputs and the gradients of q, k, v."""
    import math

    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from hapo_megatron.models import transformer_config_from_hf
    from hapo_megatron.models.hf_config import tiny_hf_config
    from hapo_megatron.models.packed_attention import PackedDotProductAttention, block_causal_mask
    from hapo_megatron.parallel.groups import initialize_parallel

    initialize_parallel(tp=1, pp=1, seed=1)
    hf = tiny_hf_config("llama")
    config = transformer_config_from_hf(
        hf if gqa else tiny_hf_config("llama", num_key_value_heads=hf.num_attention_heads), use_te=None,
        sequence_parallel=False)
    attn = PackedDotProductAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                     attention_type="self")
    heads, groups, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
    cu = torch.tensor([0, 5, 7, 16, 20], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(20, h, d, generator=g, requires_grad=True) for h in (heads, groups, groups))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
    out = attn(q, k, v, None, packed_seq_params=params)
    w = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    kk, vv = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))  # GQA
    scores = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(d)
    probs = torch.softmax(scores.masked_fill(block_causal_mask(cu)[0], float("-inf")), dim=-1)
    ref = torch.einsum("hqk,khd->qhd", probs, vv).reshape(20, 1, heads * d)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    return {"out": float((out - ref).abs().max()), "shape": tuple(out.shape),
            "grads": max(float((a - b).abs().max()) for a, b in zip(grads, ref_grads)),
            "scale": float(ref.abs().max())}


@pytest.mark.parametrize("gqa", [True, False])  # without GQA, k/v reach the parent's .view() as given
def test_packed_attention_is_the_block_diagonal_causal_attention(gqa):
    (res,) = run_distributed(_attention_vs_dense_mask, 1, gqa, timeout=300)
    assert res["shape"][:2] == (20, 1), res
    assert res["scale"] > 0.1 and res["out"] <= ATOL and res["grads"] <= ATOL, res


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_row_gives_each_sequence_its_own_logits(arch):
    (res,) = run_distributed(_packed_vs_alone, 1, arch, timeout=300)
    assert min(res["spread"]) > 0.1  # the logits are not trivially small
    assert max(res["diffs"]) <= ATOL, res
    assert max(res["fused_diffs"]) <= ATOL, res


def _te_checks(rank, world):
    from hapo_megatron.doctor.model_checks import check_packed_vs_padded
    return check_packed_vs_padded()


@pytest.mark.gpu
def test_transformer_engine_thd_row_matches_padded_rows():
    """The GPU path: TE's THD attention through megatron-core's PackedSeqParams (`hapo doctor`'s
    check, bf16 tolerance)."""
    pytest.importorskip("transformer_engine.pytorch")
    (res,) = run_distributed(_te_checks, 1, timeout=600)
    assert res.status == "PASS", res
