"""`hapo doctor`'s colocated-sync check (doctor/colocated_checks.py): its token comparison on CPU
by hand-made logits, its clean skip without 2 GPUs, and the real sequence on 2+ GPUs."""

import importlib.util

import pytest
import torch

from hapo_megatron.doctor import colocated_checks as cc
from hapo_megatron.doctor.report import PASS, SKIP


def test_greedy_mismatches_by_hand():
    logits = torch.tensor([[0.0, 2.0, 1.0],    # argmax 1
                           [1.00, 0.95, 0.0],  # near-tie: 0 or 1 both fine
                           [0.0, 0.0, 3.0]])   # argmax 2
    assert cc.greedy_mismatches([1, 1, 2], logits) == []  # position 1 is within the margin
    assert cc.greedy_mismatches([1, 0, 2], logits) == []
    assert cc.greedy_mismatches([2, 2, 1], logits) == [0, 1, 2]  # gaps 1.0, 1.0, 3.0
    assert cc.greedy_mismatches([1, 1, 2], logits, margin=0.01) == [1]
    assert cc.confident_differences([0, 0, 0], logits) == 2
    with pytest.raises(ValueError, match="2 tokens but logits for 3 positions"):
        cc.greedy_mismatches([1, 1], logits)


def test_new_weights_differ_and_keep_ties():
    from types import SimpleNamespace
    emb = torch.nn.Embedding(10, 4)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = emb
    model.lm_head = torch.nn.Linear(4, 10, bias=False)
    model.lm_head.weight = emb.weight  # tied
    model.norm = torch.nn.LayerNorm(4)
    model.config = SimpleNamespace(tie_word_embeddings=True)
    new = cc._new_weights(model)
    assert set(new) == set(model.state_dict())
    assert new["lm_head.weight"] is new["model.embed_tokens.weight"]
    assert not torch.equal(new["model.embed_tokens.weight"], emb.weight)
    assert (new["norm.weight"] - 1).abs().max() < 1.0  # norm weights stay around 1


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() >= 2, reason="GPU machine: runs below")
def test_skips_cleanly_without_two_gpus():
    res = cc.check_colocated_sync()
    assert res.status == SKIP, res
    assert ("needs CUDA" in res.figure or "needs 2 GPUs" in res.figure or "not installed" in res.figure), res


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2), reason="needs 2 GPUs")
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed")
def test_colocated_sequence_matches_transformers_on_two_gpus():
    res = cc.check_colocated_sync()
    assert res.status == PASS, res
