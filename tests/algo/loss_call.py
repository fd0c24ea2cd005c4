"""``hapo_policy_loss`` called with its knobs as keywords, as the tests write them: the knobs go
into a ``PolicyLossConfig`` (the adaptive switches off unless given), the tensors stay keywords."""

from dataclasses import fields

from hapo_megatron.algo import PolicyLossConfig, hapo_policy_loss

KNOBS = frozenset(f.name for f in fields(PolicyLossConfig))


def loss_config(**knobs) -> PolicyLossConfig:
    return PolicyLossConfig(**{"adaptive_clip": False, "adaptive_advantage": False, **knobs})


def policy_loss(*tensors, **kw):
    knobs = {k: kw.pop(k) for k in list(kw) if k in KNOBS}
    return hapo_policy_loss(*tensors, cfg=loss_config(**knobs), **kw)
