"""`linear_logprobs_entropy` (from hidden states) vs the logits path `vocab_parallel_logprobs_entropy`
on `hidden @ W^T` with autograd through the matmul: values, d hidden and d W at TP 1 and 2, with
and without sequence parallelism, chunk sizes that do and don't divide N, per-token temperatures,
large-magnitude hidden states, vocab padding and bf16."""

import itertools

import pytest
import torch

from hapo_megatron.parallel.linear import HiddenStates, linear_logprobs_entropy, logprobs_entropy_from_hidden
from hapo_megatron.parallel.vocab_parallel import vocab_parallel_logprobs_entropy
from tests.distributed import run_distributed

N, H, V = 24, 16, 40  # V divisible by 1, 2; N by 2 (sequence parallel)
CASES = list(itertools.product([None, 6, 5], ["scalar1", "scalar", "token"], [False, True]))


def _case(ci, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + ci)
    hidden = torch.randn(N, H, generator=g)
    if ci % 2:
        hidden[3:9] *= 300.0  # large-magnitude rows: logits in the thousands
    weight = torch.randn(V, H, generator=g) * 0.5
    targets = torch.randint(0, V - 3, (N,), generator=g)
    temp_kind = CASES[ci % len(CASES)][1]
    temp = {"scalar1": 1.0, "scalar": 0.7}.get(temp_kind)
    if temp is None:
        temp = torch.rand(N, generator=g) + 0.4
    vocab_size = V - 3 if ci % 3 == 0 else None  # the last 3 ids are padding
    return (hidden.to(dtype), weight.to(dtype), targets, temp, vocab_size,
            torch.randn(N, generator=g), torch.randn(N, generator=g))


def _logits_path(hidden, weight, targets, temp, vocab_size, chunk, eg, g1, g2):
    """Single process: output layer, the models.gpt padding mask, the fused logits function."""
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logits = h @ w.t()
    if vocab_size is not None:
        logits = logits.masked_fill(torch.arange(V) >= vocab_size, -1.0e4)
    lp, ent = vocab_parallel_logprobs_entropy(logits, targets, temperature=temp, chunk_size=chunk,
                                              entropy_grad=eg)
    ((lp * g1).sum() + ((ent * g2).sum() if eg else 0.0)).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _float64_reference(hidden, weight, targets, temp, vocab_size, eg, g1, g2):
    """Obviously-correct float64 autograd version (plain log_softmax)."""
    h = hidden.double().requires_grad_(True)
    w = weight.double().requires_grad_(True)
    logits = h @ w.t()
    if vocab_size is not None:
        logits = logits.masked_fill(torch.arange(V) >= vocab_size, -1.0e4)
    t = temp.double().unsqueeze(-1) if torch.is_tensor(temp) else temp
    logp = torch.log_softmax(logits / t, dim=-1)
    lp = logp.gather(1, targets.unsqueeze(1)).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    ((lp * g1.double()).sum() + ((ent * g2.double()).sum() if eg else 0.0)).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _fused(hidden, weight, targets, temp, vocab_size, chunk, eg, g1, g2, tp_group, rank, tp, sp):
    shard, rows = V // tp, N // tp
    h = (hidden[rank * rows:(rank + 1) * rows] if sp else hidden).clone().requires_grad_(True)
    w = weight[rank * shard:(rank + 1) * shard].clone().requires_grad_(True)
    lp, ent = linear_logprobs_entropy(h, w, targets, tp_group=tp_group, temperature=temp, chunk_size=chunk,
                                      entropy_grad=eg, sequence_parallel=sp, vocab_size=vocab_size)
    assert lp.dtype == torch.float32 and ent.requires_grad == eg
    ((lp * g1).sum() + ((ent * g2).sum() if eg else 0.0)).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _run(tp_group, rank, tp, chunks=(None, 6, 5)):
    for ci, (chunk, _, eg) in enumerate(CASES):
        if chunk not in chunks:
            continue
        hidden, weight, targets, temp, vocab_size, g1, g2 = _case(ci)
        ref = _logits_path(hidden, weight, targets, temp, vocab_size, chunk, eg, g1, g2)
        sp = tp > 1 and ci % 2 == 1
        lp, ent, dh, dw = _fused(hidden, weight, targets, temp, vocab_size, chunk, eg, g1, g2,
                                 tp_group, rank, tp, sp)
        rows, shard = slice(rank * (N // tp), (rank + 1) * (N // tp)) if sp else slice(None), \
            slice(rank * (V // tp), (rank + 1) * (V // tp))
        msg = f"case {ci} chunk={chunk} eg={eg} sp={sp} tp={tp}"
        # log-probs of the large rows are ~1e3: float32 rounding is relative to the logits' size
        scale = 1.0 + (hidden @ weight.t()).abs().amax(dim=-1)
        if tp == 1:  # the same passes, slices merged: float32 rounding of the largest logit
            torch.testing.assert_close(lp, ref[0], rtol=0, atol=1e-6 * scale.max().item(), msg=msg)
        assert ((lp - ref[0]).abs() <= 2e-6 * scale).all(), msg
        assert ((ent - ref[1]).abs() <= 2e-6 * scale).all(), msg
        # Gradients: no further from float64 than the float32 logits path is (the entropy gradient
        # of rows with logits in the thousands carries their float32 rounding, in both paths).
        exact = _float64_reference(hidden, weight, targets, temp, vocab_size, eg, g1, g2)
        for name, ours, theirs, truth in (("d hidden", dh, ref[2][rows], exact[2][rows]),
                                          ("d W", dw, ref[3][shard], exact[3][shard])):
            err, err_ref = (ours.double() - truth).abs().max(), (theirs.double() - truth).abs().max()
            assert err <= 2 * err_ref + 1e-5 * (1 + truth.abs().max()), (msg, name, err, err_ref)
        if vocab_size is not None and rank == tp - 1:
            assert (dw[vocab_size - rank * (V // tp):] == 0).all(), msg
    return True


def test_single_process_matches_logits_path():
    _run(None, 0, 1)


def _tp_worker(rank, world_size, chunks=(None, 6, 5)):
    import torch.distributed as dist

    _run(dist.group.WORLD, rank, world_size, chunks)
    # bf16: same rounding as the logits path (bf16 logits and gradients), float32 d W accumulation
    hidden, weight, targets, temp, vocab_size, g1, g2 = _case(2, torch.bfloat16)
    ref = _logits_path(hidden, weight, targets, temp, vocab_size, 5, True, g1, g2)
    lp, ent, dh, dw = _fused(hidden, weight, targets, temp, vocab_size, 5, True, g1, g2, dist.group.WORLD,
                             rank, world_size, False)
    shard = slice(rank * (V // world_size), (rank + 1) * (V // world_size))
    torch.testing.assert_close(lp, ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref[1], rtol=1e-5, atol=1e-5)
    assert dh.dtype == dw.dtype == torch.bfloat16
    torch.testing.assert_close(dh.float(), ref[2].float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dw.float(), ref[3][shard].float(), rtol=2e-2, atol=2e-2)
    return True


def test_tensor_parallel_matches_logits_path():
    assert all(run_distributed(_tp_worker, 2, timeout=300))


def test_hidden_states_layout_and_bad_input():
    """Sequence-first hidden states with batch-first labels and per-token temperatures."""
    g = torch.Generator().manual_seed(3)
    s, b = 5, 3
    hidden = torch.randn(s, b, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (b, s), generator=g)
    temp = torch.rand(b, s, generator=g) + 0.5
    states = HiddenStates(hidden, weight, sequence_parallel=False)
    lp, ent = logprobs_entropy_from_hidden(states, labels, temperature=temp, chunk_size=4)
    ref_lp, ref_ent = vocab_parallel_logprobs_entropy(hidden.transpose(0, 1) @ weight.t(), labels, temperature=temp)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    h2 = hidden.reshape(-1, H)
    with pytest.raises(ValueError, match="targets"):
        linear_logprobs_entropy(h2, weight, labels.reshape(-1)[:-1], temperature=1.0, sequence_parallel=False)
    with pytest.raises(ValueError, match=r"\[N, H\]"):
        linear_logprobs_entropy(h2, weight[:, :-1], labels.reshape(-1), temperature=1.0, sequence_parallel=False)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_logprobs_entropy(h2, weight, labels.reshape(-1), chunk_size=0, temperature=1.0, sequence_parallel=False)
    with pytest.raises(ValueError, match="temperature"):
        linear_logprobs_entropy(h2, weight, labels.reshape(-1), temperature=-1.0, sequence_parallel=False)


def test_padding_constant_matches_the_model():
    from hapo_megatron.models.gpt import PADDED_VOCAB_LOGIT
    from hapo_megatron.parallel import linear

    assert linear.PADDED_VOCAB_LOGIT == PADDED_VOCAB_LOGIT
