"""Trainer-side per-token temperatures (stages.recompute_temperatures): the engine's rule applied
to the old-policy entropy, for every engine; the mismatch against engine-reported values."""

import math
from types import SimpleNamespace

import pytest
import torch

from hapo_megatron.algo import EntropyStats
from hapo_megatron.config import AlgoConfig, RolloutConfig
from hapo_megatron.parallel.micro_batch import MicroBatch
from hapo_megatron.training import stages

STATS = EntropyStats(pivot=1.0, std=0.5, pos_max=2.0, neg_min=-2.0)  # of log-entropies


def _rt(stats, *, adaptive=True, tau=0.2, t_base=0.8, mode="signed"):
    cfg = SimpleNamespace(rollout=RolloutConfig(temperature=t_base),
                          algo=AlgoConfig.from_dict(dict(adaptive_temperature=adaptive, temperature_tau=tau,
                                                         h_hat_mode=mode)))
    return SimpleNamespace(cfg=cfg, rl=SimpleNamespace(rollout_entropy_stats=stats))


def _mb(engine_rows=(True, False)):
    ent = torch.tensor([[0.2, 1.0, 3.5, 9.0], [2.0, 0.1, 0.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float32)
    engine = torch.ones(2, 4)
    engine[0, 1:] = torch.tensor([0.7, 0.9, 0.8])  # row 0: the engine reported these
    ids = torch.zeros(2, 4, dtype=torch.long)
    return MicroBatch(input_ids=ids, position_ids=ids, labels=ids, loss_mask=mask, old_entropy=ent,
                      temperatures=engine, engine_temperatures=torch.tensor(engine_rows))


def _hand(h, t_base=0.8, tau=0.2, pivot=1.0, std=0.5, pos_max=2.0, neg_min=-2.0):
    z = (math.log(max(h, 1e-8)) - pivot) / std  # statistics live in log-entropy space
    h_hat = z / pos_max if z > 0 else z / abs(neg_min)  # signed mode
    return t_base * (1 + tau * max(-1.0, min(1.0, h_hat)))


def test_adaptive_temperatures_recomputed_from_old_entropy():
    given = _mb()
    (mb,), sums = stages.recompute_temperatures(_rt(STATS), [given])
    want = torch.ones(2, 4)
    for r, c in [(0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]:
        want[r, c] = _hand(float(mb.old_entropy[r, c]))
    engine = torch.tensor([0.7, 0.9, 0.8])
    # row 1 (no engine values, e.g. SGLang) gets the recomputed ones; row 0 keeps what the engine used
    assert torch.allclose(mb.temperatures[1], want[1], atol=1e-6)
    assert torch.equal(mb.temperatures[0, 1:], engine) and mb.temperatures[0, 0] == 1
    assert torch.equal(given.temperatures[1], torch.ones(4))  # a new micro-batch; the input is unchanged
    used = torch.cat([engine, want[1, :2]])
    assert sums["t_n"] == 5 and sums["t_sum"] == pytest.approx(float(used.sum()), abs=1e-5)
    assert sums["t_diff_n"] == 3  # only row 0 reported temperatures
    assert sums["t_diff"] == pytest.approx(float((want[0, 1:] - engine).abs().sum()), abs=1e-5)
    m = stages._temperature_metrics(sums)
    assert m["rollout/temperature_std"] > 0.01 and m["rollout/temperature_engine_abs_diff"] > 0


@pytest.mark.parametrize("kw,stats", [({"adaptive": False}, STATS), ({}, None), ({"tau": 0.0}, STATS)])
def test_non_adaptive_rollouts_get_t_base(kw, stats):
    (mb,), _ = stages.recompute_temperatures(_rt(stats, **kw), [_mb((False, False))])  # an engine like SGLang
    mask = mb.loss_mask != 0
    assert torch.allclose(mb.temperatures[mask], torch.tensor(0.8)) and bool(torch.all(mb.temperatures[~mask] == 1))
