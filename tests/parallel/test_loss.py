"""The HAPO loss under Megatron's per-token normalisation is layout invariant.

One process vs TP2 vs DP2 vs CP2 vs uneven micro-batches, all four loss_agg_modes: the loss
`sum(loss_sum) / sum(num_tokens)` and its gradient w.r.t. the logits agree to float32
rounding, and agree with `algo.hapo_policy_loss` on a plain `log_softmax` (the independent
reference). Megatron's combination rule is simulated exactly: `loss_sum` backpropagated as
is, gradients summed over DP/CP ranks and micro-batches, divided by the summed count.
"""

import pytest
import torch

from hapo_megatron.algo import (
    LOSS_AGG_MODES,
    PolicyLossConfig,
    compute_entropy_stats,
    hapo_policy_loss,
    normalize_entropy,
    token_entropy,
)
from hapo_megatron.parallel.context_parallel import gather_from_cp, split_for_cp
from hapo_megatron.parallel.micro_batch import MicroBatch
from hapo_megatron.parallel.loss import (
    DEFAULT_LOGPROB_CHUNK,
    hapo_loss_from_logits,
    logprobs_entropy_from_logits,
    make_logprob_func,
    make_loss_func,
)
from tests.distributed import run_distributed
from tests.float_bounds import near_loss_discontinuity

B, S, V = 6, 8, 12
DP_ROWS = (0, 2, 6)  # uneven DP split: rank 0 two rows, rank 1 four


def _configs():
    out = []
    for i, mode in enumerate(LOSS_AGG_MODES):
        extra = [dict(), dict(kl_loss_coef=0.1, kl_loss_type="k3"), dict(entropy_coeff=0.01),
                 dict(tis_cap=1.5, clip_ratio_high=0.28)][i]
        chunk = {0: 7, 2: 5}.get(i, DEFAULT_LOGPROB_CHUNK)  # the fused log-prob's chunking
        out.append((PolicyLossConfig(loss_agg_mode=mode, **extra), "token" if i % 2 else 0.9, chunk))
    out.append((PolicyLossConfig(adaptive_clip=False, adaptive_advantage=False, h_hat_mode="reference"), 1.0,
                DEFAULT_LOGPROB_CHUNK))
    # the off-policy correction: seq_tis needs each sequence's sum over the CP ranks (a dropped CP
    # reduction in parallel.loss._seq_is_log_ratio fails the "cp" layout below)
    out.append((PolicyLossConfig(rollout_is="seq_tis", rollout_is_cap=1.5), "token", DEFAULT_LOGPROB_CHUNK))
    out.append((PolicyLossConfig(rollout_is="token_mis", rollout_is_cap=1.3, loss_agg_mode="seq-mean-token-mean"),
                0.9, DEFAULT_LOGPROB_CHUNK))
    out.append((PolicyLossConfig(rollout_is="token_tis", rollout_is_cap=1.2), 1.0, DEFAULT_LOGPROB_CHUNK))
    return out


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, S, V, generator=g) * 2
    labels = torch.randint(0, V, (B, S), generator=g)
    lengths = torch.tensor([8, 3, 0, 6, 1, 5])
    mask = (torch.arange(S)[None, :] < lengths[:, None]).float()
    mask[3, 0] = 0  # a hole
    logp = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    batch = MicroBatch(
        input_ids=labels.roll(1, 1), position_ids=torch.arange(S).expand(B, S), labels=labels, loss_mask=mask,
        old_logprobs=logp + 0.3 * torch.randn(B, S, generator=g),
        advantages=torch.randn(B, 1, generator=g).expand(B, S).contiguous(),
        old_entropy=token_entropy(logits, temperature=1.0) * torch.exp(0.2 * torch.randn(B, S, generator=g)),
        ref_logprobs=logp + 0.1 * torch.randn(B, S, generator=g),
        rollout_logprobs=logp + 0.2 * torch.randn(B, S, generator=g),
    )
    temp_tok = 0.7 + 0.6 * torch.rand(B, S, generator=g)
    g2 = torch.Generator().manual_seed(seed + 1000)  # the other fields keep their values
    batch = batch.with_(proximal_logprobs=batch.rollout_logprobs + 0.25 * torch.randn(B, S, generator=g2))
    stats = compute_entropy_stats(batch.old_entropy, mask, entropy_pivot=PolicyLossConfig().entropy_pivot)
    return logits, batch, stats, temp_tok


def _temperature(kind, temp_tok):
    return temp_tok if kind == "token" else kind


def _run(logits, batch, cfg, stats, temperature, chunk=DEFAULT_LOGPROB_CHUNK, **groups):
    """loss_sum, num_tokens, d loss_sum / d logits, metrics of one (rank, micro-batch)."""
    x = logits.clone().requires_grad_(True)
    loss_sum, num_tokens, metrics = hapo_loss_from_logits(x, batch, cfg=cfg, stats=stats, temperature=temperature,
                                                          logprob_chunk_size=chunk, **groups)
    assert num_tokens.dtype == torch.int32 and num_tokens.dim() == 0
    loss_sum.backward()
    return loss_sum.item(), int(num_tokens), x.grad, {k: float(v) for k, v in metrics.items()}


def _loss_worker(rank, world_size):
    import torch.distributed as dist

    logits, batch, stats, temp_tok = _data()
    out = []
    for cfg, tkind, chunk in _configs():
        temp = _temperature(tkind, temp_tok)
        res = {}
        shard = V // 2
        res["tp"] = _run(logits[..., rank * shard:(rank + 1) * shard], batch, cfg, stats, temp, chunk,
                         tp_group=dist.group.WORLD)
        rows = slice(DP_ROWS[rank], DP_ROWS[rank + 1])
        t_rows = temp[rows] if torch.is_tensor(temp) else temp
        res["dp"] = _run(logits[rows], batch.rows(rows), cfg, stats, t_rows, chunk)
        t_cp = split_for_cp(temp, 2, rank) if torch.is_tensor(temp) else temp
        res["cp"] = _run(split_for_cp(logits, 2, rank), batch.split_for_cp(2, rank),
                         cfg, stats, t_cp, chunk, cp_group=dist.group.WORLD)
        # plain arrays: tensors sent through the result queue would be shared via file descriptors
        out.append({k: (v[0], v[1], v[2].numpy(), v[3]) for k, v in res.items()})
    return out


def _reference(logits, batch, cfg, stats, temperature):
    """algo.hapo_policy_loss on an independent log_softmax: (loss, grad)."""
    x = logits.clone().requires_grad_(True)
    t = temperature.unsqueeze(-1) if torch.is_tensor(temperature) else temperature
    logp_all = torch.log_softmax(x / t, -1)
    logp = logp_all.gather(-1, batch.labels[..., None]).squeeze(-1)
    ent = token_entropy(x, temperature)
    h_hat = normalize_entropy(batch.old_entropy, stats, cfg.h_hat_mode)
    loss_sum, norm, _ = hapo_policy_loss(
        logp, batch.old_logprobs, batch.advantages, batch.loss_mask, h_hat, cfg=cfg, entropy=ent,
        ref_logprobs=batch.ref_logprobs, rollout_logprobs=batch.rollout_logprobs,
        proximal_logprobs=batch.proximal_logprobs)
    loss = loss_sum / norm
    loss.backward()
    return loss.item(), x.grad


def _combine(parts):
    """Megatron's rule: sum the loss sums and counts over ranks/micro-batches."""
    total_n = sum(p[1] for p in parts)
    loss = sum(p[0] for p in parts) / total_n
    metrics = {k: sum(p[3][k] for p in parts) for k in parts[0][3]}
    return loss, total_n, metrics


def _close(a, b, what):
    # d loss / d logits under another layout: softmax terms of float32 log-sum-exps over V = 12
    # (split over TP ranks, or cut into other row blocks) differ by a few ulps, ~2e-7 relative
    assert torch.allclose(a, b, rtol=2e-5, atol=2e-7), (what, (a - b).abs().max().item())


def _assert_no_ratio_on_a_discontinuity(logits, batch, cfg, stats, temp, what):
    """The loss is continuous in each ratio except at the clip / neutral-zone / dual-clip edges;
    another layout moves a ratio by float32 rounding of its log-prob (~1e-6 relative), so the
    loss compares to rounding and the clip counts exactly only while no ratio is within 1e-5 of an
    edge (else one token could change branch: that would need an allowance, not a wider rtol)."""
    fields = []
    hapo_loss_from_logits(logits, batch, cfg=cfg, stats=stats, temperature=temp, on_token_fields=fields.append)
    h_hat = normalize_entropy(batch.old_entropy, stats, cfg.h_hat_mode)
    near = near_loss_discontinuity(fields[0].ratio, h_hat, batch.loss_mask, cfg, rel=1e-5)
    assert not near.any(), (what, "ratios on a discontinuity", fields[0].ratio[near])


def _single_and_micro(logits, batch, cfg, stats, temp, chunk):
    single = _run(logits, batch, cfg, stats, temp, chunk)
    parts, grads = [], []
    for lo, hi in ((0, 1), (1, 4), (4, 6)):  # micro-batches of 1, 3, 2 sequences
        t = temp[lo:hi] if torch.is_tensor(temp) else temp
        parts.append(_run(logits[lo:hi], batch.rows(slice(lo, hi)), cfg, stats, t, chunk))
        grads.append(parts[-1][2])
    return single, parts, torch.cat(grads)


def test_layout_invariance_all_agg_modes():
    results = run_distributed(_loss_worker, 2, timeout=240)
    results = [[{k: (v[0], v[1], torch.from_numpy(v[2]), v[3]) for k, v in c.items()} for c in r]
               for r in results]
    logits, batch, stats, temp_tok = _data()
    for ci, (cfg, tkind, chunk) in enumerate(_configs()):
        temp = _temperature(tkind, temp_tok)
        what = cfg.loss_agg_mode
        _assert_no_ratio_on_a_discontinuity(logits, batch, cfg, stats, temp, what)
        ref_loss, ref_grad = _reference(logits, batch, cfg, stats, temp)
        single, micro_parts, micro_grad = _single_and_micro(logits, batch, cfg, stats, temp, chunk)
        loss1, n1, m1 = _combine([single])
        assert abs(loss1 - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (what, loss1, ref_loss)
        _close(single[2] / n1, ref_grad, (what, "single vs reference"))

        loss_mb, n_mb, m_mb = _combine(micro_parts)
        assert n_mb == n1 and abs(loss_mb - loss1) <= 1e-6 * max(1.0, abs(loss1)), what
        _close(micro_grad / n_mb, ref_grad, (what, "micro-batches"))

        tp = [r[ci]["tp"] for r in results]
        assert tp[0][:2] == tp[1][:2]  # TP ranks compute the same loss and count
        assert abs(tp[0][0] / tp[0][1] - loss1) <= 1e-5 * max(1.0, abs(loss1)), what
        _close(torch.cat([tp[0][2], tp[1][2]], -1) / tp[0][1], ref_grad, (what, "tp2"))

        for layout in ("dp", "cp"):
            parts = [r[ci][layout] for r in results]
            loss, n, metrics = _combine(parts)
            assert n == n1, (what, layout, n, n1)
            assert abs(loss - loss1) <= 1e-5 * max(1.0, abs(loss1)), (what, layout, loss, loss1)
            grads = [p[2] for p in parts]
            full = torch.cat(grads, 0) if layout == "dp" else gather_from_cp(grads, dim=1)
            _close(full / n, ref_grad, (what, layout))
            for k in ("loss/num_tokens", "loss/num_seqs", "loss/clipfrac_sum", "loss/normalizer",
                      "loss/num_high_entropy_tokens", "loss/pg_loss_sum"):
                assert abs(metrics[k] - m1[k]) <= 1e-5 * max(1.0, abs(m1[k])), (what, layout, k)


def test_microbatch_scope_uses_current_entropy_stats():
    logits, batch, _, _ = _data(1)
    cfg = PolicyLossConfig(entropy_stats_scope="microbatch", h_hat_entropy="current")
    loss_sum, n, metrics = hapo_loss_from_logits(logits, batch, cfg=cfg, stats=None, temperature=1.0)
    ent = token_entropy(logits, temperature=1.0)
    stats = compute_entropy_stats(ent, batch.loss_mask, entropy_pivot=PolicyLossConfig().entropy_pivot)
    ref = PolicyLossConfig(entropy_stats_scope="global", h_hat_entropy="current")
    loss_sum2, n2, _ = hapo_loss_from_logits(logits, batch, cfg=ref, stats=stats, temperature=1.0)
    assert int(n) == int(n2) and torch.allclose(loss_sum, loss_sum2, rtol=1e-5)
    # h_hat_entropy="old" with microbatch scope: stats of the old entropies of the micro-batch
    cfg_old = PolicyLossConfig(entropy_stats_scope="microbatch", h_hat_entropy="old")
    l3, _, _ = hapo_loss_from_logits(logits, batch, cfg=cfg_old, stats=None, temperature=1.0)
    l4, _, _ = hapo_loss_from_logits(logits, batch, cfg=PolicyLossConfig(),
                                     stats=compute_entropy_stats(batch.old_entropy, batch.loss_mask,
                                         entropy_pivot=PolicyLossConfig().entropy_pivot), temperature=1.0)
    assert torch.allclose(l3, l4)


def test_loss_scale_factor_is_the_seq_mean_token_sum_norm_horizon():
    """The horizon divides the loss sum (Megatron's count stays the sequence count): the row
    length S by default, the given constant otherwise."""
    logits, batch, stats, _ = _data()
    cfg = PolicyLossConfig(loss_agg_mode="seq-mean-token-sum-norm")
    row, n_row, _ = hapo_loss_from_logits(logits, batch, cfg=cfg, stats=stats, temperature=1.0)
    const, n_const, _ = hapo_loss_from_logits(logits, batch, cfg=cfg, stats=stats, loss_scale_factor=100.0,
                                              temperature=1.0)
    assert int(n_row) == int(n_const) == 5  # the rows with a valid token
    assert float(const) * 100.0 == pytest.approx(float(row) * S, rel=1e-6)


def test_make_loss_func_and_logprob_func():
    logits, batch, stats, _ = _data(2)
    f = make_loss_func(batch, cfg=PolicyLossConfig(), stats=stats, temperature=1.0)
    a = f(logits)
    b = hapo_loss_from_logits(logits, batch, cfg=PolicyLossConfig(), stats=stats, temperature=1.0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    zero, n, out = make_logprob_func(batch.labels, temperature=0.8)(logits)
    lp, ent = logprobs_entropy_from_logits(logits, batch.labels, temperature=0.8)
    assert zero.item() == 0.0 and int(n) == 0
    assert torch.equal(out["logprobs"], lp) and torch.equal(out["entropy"], ent)
    assert torch.allclose(ent, token_entropy(logits, 0.8), atol=1e-5)


def test_token_fields_are_what_the_metrics_count():
    """The loss reports its per-token ratio, A' and clip flags; the clip metrics are their sums
    (one computation, which the diagnostics reuse)."""
    logits, batch, stats, _ = _data(3)  # a seed where all three bounds are hit
    got = []
    cfg = PolicyLossConfig(clip_ratio_low=0.05, clip_ratio_high=0.05, clip_ratio_c=1.01)
    _, _, m = hapo_loss_from_logits(logits, batch, cfg=cfg, stats=stats, on_token_fields=got.append, temperature=1.0)
    (f,) = got
    valid = batch.loss_mask != 0
    for side in ("low", "high", "dual"):
        flags = getattr(f, "clip_" + side)
        assert flags.dtype == torch.bool and not (flags & ~valid).any()
        assert int(flags.sum()) == int(m[f"loss/clipfrac_{side}_sum"]) > 0, side
    lp, _ = logprobs_entropy_from_logits(logits, batch.labels, temperature=1.0)
    assert torch.allclose(f.ratio[valid], torch.exp(lp - batch.old_logprobs)[valid], rtol=1e-5)
    assert bool((f.ratio[~valid] == 1).all()) and bool((f.adv_after[~valid] == 0).all())
    # A' is the redistributed advantage (adaptive_advantage on), not A
    scale = (f.adv_after.abs() / batch.advantages.abs())[valid]
    assert not torch.allclose(scale, torch.ones_like(scale))


def test_empty_microbatch_and_bad_input():
    logits, batch, stats, _ = _data(3)
    empty = batch.with_(loss_mask=torch.zeros(B, S))
    x = logits.clone().requires_grad_(True)
    loss_sum, n, _ = hapo_loss_from_logits(x, empty, cfg=PolicyLossConfig(), stats=stats, temperature=1.0)
    loss_sum.backward()
    assert int(n) == 0 and loss_sum.item() == 0.0 and torch.all(x.grad == 0)
    with pytest.raises(ValueError, match="advantages"):
        hapo_loss_from_logits(logits, batch.with_(advantages=None), cfg=PolicyLossConfig(), stats=stats,
                              temperature=1.0)
    with pytest.raises(TypeError, match="MicroBatch"):
        hapo_loss_from_logits(logits, {"labels": batch.labels}, cfg=PolicyLossConfig(), stats=stats, temperature=1.0)
    with pytest.raises(ValueError, match="stats"):
        hapo_loss_from_logits(logits, batch, cfg=PolicyLossConfig(), stats=None, temperature=1.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        PolicyLossConfig(loss_agg_mode="mean")
    with pytest.raises(ValueError, match="old_logprobs"):
        batch.with_(old_logprobs=batch.old_logprobs[:, :3])
