"""The trainer's forking-token threshold (`stages.forking_threshold`) is the algo threshold of every
micro-batch of the step together (docs/algorithm.md, "Forking tokens"), and is only computed where
the loss runs with the switch on."""

from types import SimpleNamespace

import torch

from hapo_megatron.algo import PolicyLossConfig, forking_threshold as algo_threshold
from hapo_megatron.parallel.micro_batch import MicroBatch
from hapo_megatron.training import stages


def _mb(seed, b=2, s=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 9, (b, s), generator=g)
    return MicroBatch(input_ids=ids, position_ids=torch.arange(s).expand(b, s), labels=ids,
                      loss_mask=(torch.rand(b, s, generator=g) > 0.3).float(),
                      old_entropy=torch.rand(b, s, generator=g))


def _rt(loss: PolicyLossConfig, last: bool = True):
    return SimpleNamespace(cfg=SimpleNamespace(algo=SimpleNamespace(loss=loss)),
                           groups=SimpleNamespace(is_pipeline_last=last, dp=None),
                           actor=SimpleNamespace(device=torch.device("cpu")))


def test_step_threshold_spans_every_micro_batch():
    minis = [[_mb(0), _mb(1)], [_mb(2)]]
    on = PolicyLossConfig(forking_tokens=True, forking_rho=0.25)
    ent = torch.cat([mb.old_entropy.reshape(-1) for mini in minis for mb in mini])
    mask = torch.cat([mb.loss_mask.reshape(-1) for mini in minis for mb in mini])
    assert stages.forking_threshold(_rt(on), minis) == algo_threshold(ent, mask, 0.25)
    assert stages.forking_threshold(_rt(on), minis) != algo_threshold(minis[0][0].old_entropy,
                                                                      minis[0][0].loss_mask, 0.25)
    assert stages.forking_threshold(_rt(PolicyLossConfig()), minis) is None
    assert stages.forking_threshold(_rt(on, last=False), minis) is None
