"""The field's objectives, the forking tokens and Clip-Cov / KL-Cov are exact at scale
(docs/algorithm.md, "The field's objectives", "Forking tokens", "Clip-Cov and KL-Cov").

GSPO's and GMPO's sequence ratio spans a sequence's context-parallel shards; the forking tokens'
threshold and Clip-Cov's / KL-Cov's means and selection span the whole step batch on every rank.
One process vs uneven micro-batches vs TP2 vs DP2 vs CP2 vs a packed row (alone and under CP2):
the loss `sum(loss_sum) / sum(num_tokens)` and its gradient w.r.t. the logits agree to float32
rounding, and the single process agrees with `algo.hapo_policy_loss` on a plain `log_softmax`.
Megatron's combination rule is simulated as in `tests/parallel/test_loss.py`, whose data this
reuses."""

import math

import torch

from hapo_megatron.algo import (
    PolicyLossConfig,
    cov_stats,
    position_keys,
    select_with_stats,
    forking_select,
    forking_threshold,
    hapo_policy_loss,
    normalize_entropy,
    token_entropy,
)
from hapo_megatron.parallel.context_parallel import gather_from_cp, gather_from_cp_thd, split_for_cp, split_for_cp_thd
from hapo_megatron.parallel.micro_batch import MicroBatch
from hapo_megatron.parallel.cov import global_cov_stats
from hapo_megatron.parallel.stats import global_forking_threshold
from tests.distributed import run_distributed
from tests.float_bounds import near_loss_discontinuity
from tests.parallel.test_loss import DP_ROWS, B, S, V, _close, _combine, _data, _run, _temperature

SEQ_MEAN = "seq-mean-token-mean"
SEED = 5
OFF = dict(adaptive_clip=False, adaptive_advantage=False)


def _configs():
    return [
        (PolicyLossConfig(policy_loss="gspo", clip_ratio_low=0.02, clip_ratio_high=0.03, loss_agg_mode=SEQ_MEAN,
                          **OFF), 1.0),
        (PolicyLossConfig(policy_loss="gmpo", clip_ratio_low=0.25, clip_ratio_high=0.2, loss_agg_mode=SEQ_MEAN,
                          **OFF), "token"),
        # CISPO with HAPO's adaptive clip and redistribution (h_hat from the step's statistics)
        (PolicyLossConfig(policy_loss="cispo", clip_ratio_low=0.1, clip_ratio_high=0.2), "token"),
        (PolicyLossConfig(policy_loss="sapo", loss_agg_mode=SEQ_MEAN, **OFF), 0.9),
        (PolicyLossConfig(forking_tokens=True, forking_rho=0.3, clip_ratio_high=0.28, **OFF), 1.0),
        (PolicyLossConfig(policy_loss="cispo", forking_tokens=True, forking_rho=0.5, loss_agg_mode=SEQ_MEAN,
                          clip_ratio_low=10.0, clip_ratio_high=0.2, **OFF), 1.0),
        # Clip-Cov with HAPO's components; KL-Cov (the step's selection, exact over ranks)
        (PolicyLossConfig(policy_loss="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=0.05), "token"),
        (PolicyLossConfig(policy_loss="kl_cov", kl_cov_ratio=0.2, kl_cov_coef=0.5, **OFF), 1.0),
    ]


def _cov_stats(cfg, batch, group=None):
    """The step's CovStats: over this process's rows (None) or every rank's (group)."""
    if cfg.policy_loss not in ("clip_cov", "kl_cov"):
        return None
    keys = position_keys(SEED, batch.tokens_of_sequences(batch.seq_index), batch.position_ids)
    ratio = cfg.clip_cov_ratio if cfg.policy_loss == "clip_cov" else cfg.kl_cov_ratio
    args = (cfg.policy_loss, batch.advantages, batch.old_logprobs, batch.loss_mask, keys)
    kw = dict(seed=SEED, ratio=ratio, lb=cfg.clip_cov_lb, ub=cfg.clip_cov_ub)
    return cov_stats(*args, **kw) if group is None else global_cov_stats(*args, group=group, **kw)


def _packed(batch: MicroBatch) -> MicroBatch:
    """The padded batch as one packed row: sequence i spans positions [i S, (i + 1) S)."""
    def flat(t):
        return None if t is None else t.reshape(1, -1)
    return MicroBatch(
        input_ids=flat(batch.input_ids), position_ids=flat(batch.position_ids), labels=flat(batch.labels),
        loss_mask=flat(batch.loss_mask), advantages=flat(batch.advantages), old_logprobs=flat(batch.old_logprobs),
        old_entropy=flat(batch.old_entropy), ref_logprobs=flat(batch.ref_logprobs),
        rollout_logprobs=flat(batch.rollout_logprobs), proximal_logprobs=flat(batch.proximal_logprobs),
        seq_index=batch.seq_index, cu_seqlens=torch.arange(0, B * S + 1, S, dtype=torch.int32),
        segment_ids=torch.arange(B).repeat_interleave(S).unsqueeze(0))


def _pack_t(t):
    return t.reshape(1, B * S, *t.shape[2:]) if torch.is_tensor(t) else t


def _step_data():
    logits, batch, stats, temp_tok = _data()
    return logits, batch.with_(seq_index=torch.arange(B)), stats, temp_tok


def _worker(rank, world_size):
    import torch.distributed as dist

    logits, batch, stats, temp_tok = _step_data()
    packed, plogits = _packed(batch), _pack_t(logits)
    cu = packed.cu_seqlens
    out = []
    for cfg, tkind in _configs():
        temp = _temperature(tkind, temp_tok)
        thr = forking_threshold(batch.old_entropy, batch.loss_mask, cfg.forking_rho)
        cs = _cov_stats(cfg, batch)
        step = dict(forking_threshold=thr, cov_stats=cs)
        res = {}
        shard = V // 2
        res["tp"] = _run(logits[..., rank * shard:(rank + 1) * shard], batch, cfg, stats, temp,
                         tp_group=dist.group.WORLD, **step)
        rows = slice(DP_ROWS[rank], DP_ROWS[rank + 1])
        # DP: the threshold from every rank's own rows, exact over the group
        thr_dp = global_forking_threshold(batch.old_entropy[rows], batch.loss_mask[rows], group=dist.group.WORLD,
                                          rho=cfg.forking_rho)
        assert thr_dp == thr, (thr_dp, thr)
        held = batch.loss_mask * rank  # rank 0 holds no valid token
        assert global_forking_threshold(batch.old_entropy, held, group=dist.group.WORLD, rho=cfg.forking_rho) == thr
        cs_dp = _cov_stats(cfg, batch.rows(rows), group=dist.group.WORLD)
        assert cs_dp == cs, (cs_dp, cs)  # the step's means and threshold, exact over the ranks
        t_rows = temp[rows] if torch.is_tensor(temp) else temp
        res["dp"] = _run(logits[rows], batch.rows(rows), cfg, stats, t_rows, forking_threshold=thr_dp, cov_stats=cs_dp)
        t_cp = split_for_cp(temp, 2, rank) if torch.is_tensor(temp) else temp
        res["cp"] = _run(split_for_cp(logits, 2, rank), batch.split_for_cp(2, rank), cfg, stats, t_cp,
                         cp_group=dist.group.WORLD, **step)
        t_pk = split_for_cp_thd(_pack_t(temp), cu, 2, rank) if torch.is_tensor(temp) else temp
        res["packed_cp"] = _run(split_for_cp_thd(plogits, cu, 2, rank), packed.split_for_cp(2, rank), cfg, stats,
                                t_pk, cp_group=dist.group.WORLD, **step)
        out.append({k: (v[0], v[1], v[2].numpy(), v[3]) for k, v in res.items()})
    return out


def _reference(logits, batch, cfg, stats, temperature):
    """algo.hapo_policy_loss on an independent log_softmax of the whole batch: (loss, grad)."""
    x = logits.clone().requires_grad_(True)
    t = temperature.unsqueeze(-1) if torch.is_tensor(temperature) else temperature
    logp = torch.log_softmax(x / t, -1).gather(-1, batch.labels[..., None]).squeeze(-1)
    h_hat = normalize_entropy(batch.old_entropy, stats, cfg.h_hat_mode)
    sel = None
    if cfg.forking_tokens:
        thr = forking_threshold(batch.old_entropy, batch.loss_mask, cfg.forking_rho)
        sel = forking_select(batch.old_entropy, batch.loss_mask, thr)
    cs, cov_sel = _cov_stats(cfg, batch), None
    if cs is not None:
        keys = position_keys(SEED, batch.seq_index.unsqueeze(1).expand(B, S), batch.position_ids)
        cov_sel = select_with_stats(cfg.policy_loss, cs, batch.advantages, batch.old_logprobs, batch.loss_mask, keys,
                                    cfg.clip_cov_lb, cfg.clip_cov_ub)
        assert 0 < int(cov_sel.sum()) < int(batch.loss_mask.sum())
    loss_sum, norm, _ = hapo_policy_loss(logp, batch.old_logprobs, batch.advantages, batch.loss_mask, h_hat,
                                         cfg=cfg, entropy=token_entropy(x, temperature), token_select=sel,
                                         cov_select=cov_sel)
    (loss_sum / norm).backward()
    return (loss_sum / norm).item(), x.grad


def _assert_off_the_edges(logits, batch, cfg, stats, temperature):
    """No token ratio (ppo, cispo), token log-ratio (gmpo) or sequence ratio (gspo) lies within 1e-4 of
    where its branch changes: another layout moves them by float32 rounding only (see
    `tests/parallel/test_loss.py`), so the clip counts must agree exactly."""
    t = temperature.unsqueeze(-1) if torch.is_tensor(temperature) else temperature
    lr = torch.log_softmax(logits / t, -1).gather(-1, batch.labels[..., None]).squeeze(-1) - batch.old_logprobs
    valid = batch.loss_mask != 0
    if cfg.policy_loss == "gspo":
        n = valid.sum(-1)
        s = torch.exp(torch.where(valid, lr, 0).sum(-1) / n.clamp_min(1))[n > 0]
        for edge in (1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high):
            assert ((s - edge).abs() > 1e-4).all(), (s, edge)
        assert ((s < 1 - cfg.clip_ratio_low) | (s > 1 + cfg.clip_ratio_high)).any()  # some clipped
        assert ((s > 1 - cfg.clip_ratio_low) & (s < 1 + cfg.clip_ratio_high)).any()  # and some not
    elif cfg.policy_loss == "gmpo":
        for edge in (-cfg.clip_ratio_low, cfg.clip_ratio_high):
            assert ((lr[valid] - edge).abs() > 1e-4).all()
    elif cfg.policy_loss in ("ppo", "cispo", "clip_cov"):
        h_hat = normalize_entropy(batch.old_entropy, stats, cfg.h_hat_mode)
        assert not near_loss_discontinuity(torch.exp(lr), h_hat, valid, cfg, rel=1e-4).any()


def test_objectives_and_forking_tokens_are_layout_invariant():
    results = run_distributed(_worker, 2, timeout=240)
    results = [[{k: (v[0], v[1], torch.from_numpy(v[2]), v[3]) for k, v in c.items()} for c in r] for r in results]
    logits, batch, stats, temp_tok = _step_data()
    packed = _packed(batch)
    for ci, (cfg, tkind) in enumerate(_configs()):
        what = (cfg.policy_loss, cfg.forking_tokens)
        temp = _temperature(tkind, temp_tok)
        thr = forking_threshold(batch.old_entropy, batch.loss_mask, cfg.forking_rho)
        step = dict(forking_threshold=thr, cov_stats=_cov_stats(cfg, batch))
        _assert_off_the_edges(logits, batch, cfg, stats, temp)
        ref_loss, ref_grad = _reference(logits, batch, cfg, stats, temp)
        single = _run(logits, batch, cfg, stats, temp, **step)
        loss1, n1, m1 = _combine([single])
        assert abs(loss1 - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (what, loss1, ref_loss)
        _close(single[2] / n1, ref_grad, (what, "single vs reference"))

        parts, grads = [], []
        for lo, hi in ((0, 1), (1, 4), (4, 6)):  # micro-batches of 1, 3, 2 sequences
            t = temp[lo:hi] if torch.is_tensor(temp) else temp
            parts.append(_run(logits[lo:hi], batch.rows(slice(lo, hi)), cfg, stats, t, **step))
            grads.append(parts[-1][2])
        layouts = {"micro": (parts, torch.cat(grads))}
        pk = _run(_pack_t(logits), packed, cfg, stats, _pack_t(temp), **step)
        layouts["packed"] = ([pk], pk[2].reshape(B, S, V))
        tp = [r[ci]["tp"] for r in results]
        assert tp[0][:2] == tp[1][:2], what  # TP ranks compute the same loss and count
        layouts["tp"] = ([tp[0]], torch.cat([tp[0][2], tp[1][2]], -1))
        for name in ("dp", "cp", "packed_cp"):
            ps = [r[ci][name] for r in results]
            gs = [p[2] for p in ps]
            full = {"dp": lambda: torch.cat(gs, 0), "cp": lambda: gather_from_cp(gs, dim=1),
                    "packed_cp": lambda: gather_from_cp_thd(gs, packed.cu_seqlens, dim=1).reshape(B, S, V)}[name]()
            layouts[name] = (ps, full)
        for name, (ps, full) in layouts.items():
            loss, n, metrics = _combine(ps)
            assert n == n1, (what, name, n, n1)
            assert abs(loss - loss1) <= 1e-5 * max(1.0, abs(loss1)), (what, name, loss, loss1)
            _close(full / n, ref_grad, (what, name))
            for k in m1:
                if k.startswith("loss/") and k not in ("loss/entropy_sum", "loss/objective_sum"):
                    tol = 1e-5 * max(1.0, abs(m1[k]))
                    assert abs(metrics[k] - m1[k]) <= tol, (what, name, k, metrics[k], m1[k])
        if cfg.forking_tokens:
            assert 0 < m1["loss/num_selected_tokens"] < m1["loss/num_tokens"]
            assert m1["loss/selected_entropy_sum"] / m1["loss/num_selected_tokens"] > \
                m1["loss/unselected_entropy_sum"] / m1["loss/num_unselected_tokens"]
        if cfg.policy_loss in ("gspo", "gmpo"):
            assert m1["loss/num_seqs"] == 5 and math.isfinite(m1["loss/seq_ratio_sum"])
