"""Slow, obviously-correct reference implementations (Python loops over floats), written from the
math in docs/algorithm.md independently of hapo_megatron.algo."""

import math


def entropy_row(logits, temperature=1.0):
    z = [x / temperature for x in logits]
    finite = [x for x in z if x != -math.inf]
    if not finite:
        return 0.0
    m = max(finite)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in z]
    s = sum(e)
    h = 0.0
    for ei in e:
        p = ei / s
        if p > 0:
            h -= p * math.log(p)
    return h


def entropy_stats(entropies, q):
    """entropies: list of valid-token entropies (floats). Returns (pivot, std, pos_max, neg_min)."""
    xs = sorted(math.log(max(h, 1e-8)) for h in entropies)
    n = len(xs)
    pivot = xs[round(q * (n - 1))]
    ms = sum((x - pivot) ** 2 for x in xs) / n
    std = math.sqrt(max(ms, 1e-8))
    zs = [(x - pivot) / std for x in xs]
    pos = [z for z in zs if z > 0]
    neg = [z for z in zs if z < 0]
    pos_max = max(max(pos) if pos else 0.0, 1e-8)
    neg_min = min(min(neg) if neg else 0.0, -1e-8)
    return pivot, std, pos_max, neg_min


def h_hat(entropy, stats, mode):
    pivot, std, pos_max, neg_min = stats
    return h_hat_from_z((math.log(max(entropy, 1e-8)) - pivot) / std, stats, mode)


def h_hat_from_z(z, stats, mode):
    _, _, pos_max, neg_min = stats
    if z > 0:
        h = z / pos_max
    elif mode == "signed":
        h = z / abs(neg_min)
    else:
        h = z * (1.0 / neg_min)
    return min(1.0, max(-1.0, h))


def groups_of(group_ids):
    out = {}
    for i, g in enumerate(group_ids):
        out.setdefault(g, []).append(i)
    return out


def grpo(rewards, group_ids, lengths, norm=True, eps=1e-6):
    """Per-response GRPO advantage (list of floats)."""
    adv = [0.0] * len(rewards)
    for members in groups_of(group_ids).values():
        rs = [rewards[i] for i in members]
        n = len(rs)
        if n == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(rs) / n
            std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (n - 1))
        for i in members:
            adv[i] = (rewards[i] - mean) / (std + eps) if norm else rewards[i] - mean
            if n == 1:
                adv[i] = rewards[i]
    return adv


def tlga(rewards, group_ids, lengths, norm=True, eps=1e-6, thr=5.0):
    """Per-response TLGA advantage with the GRPO fallback; returns (adv, fallback flags)."""
    adv = [0.0] * len(rewards)
    fb = [False] * len(rewards)
    g_adv = grpo(rewards, group_ids, lengths, norm, eps)
    for members in groups_of(group_ids).values():
        tokens = []  # one reward per valid token
        for i in members:
            tokens += [rewards[i]] * lengths[i]
        if not tokens:
            continue
        mu = sum(tokens) / len(tokens)
        sigma = math.sqrt(sum((r - mu) ** 2 for r in tokens) / len(tokens))
        a = {i: ((rewards[i] - mu) / (sigma + eps) if norm else rewards[i] - mu) for i in members}
        use_fb = thr is not None and any(abs(a[i]) >= thr for i in members if lengths[i] > 0)
        for i in members:
            adv[i] = g_adv[i] if use_fb else a[i]
            fb[i] = use_fb
    return adv, fb


def clip_range(h, eps_l, eps_r, alpha):
    if h > 0:
        return eps_l, eps_r * (1 + alpha * h)
    return eps_l * (1 - alpha * h), eps_r


def redistribute(a, h, ratio, lo, hi, beta):
    a_ent = a * (1 + beta * h)
    in_n = (1 - lo / 2) < ratio < (1 + hi / 2)
    if h > 0:
        return a if in_n else a_ent
    return a_ent if in_n else a
