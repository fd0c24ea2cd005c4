"""The MoE step metrics (`models/moe.py` `ExpertLoadMonitor`) on GPU terms, checked on CPU:

- collectives over Megatron's groups get tensors on the model's device: the guard in
  `parallel/collectives.py` rejects a CPU tensor on a non-gloo (NCCL) group, and the monitor's
  real reductions run on its device (simulated here with the ``meta`` device and an NCCL backend);
- the aux loss is counted once under activation recompute (Megatron tracks it only under grad),
  and the per-expert counts kept on the device equal the per-call host copies of the old monitor;
- under context parallelism (each CP rank routes its slice of the sequences, its aux loss is a
  partial sum over megatron-core's TP x CP group) the metrics are reduced over data x context
  parallel and equal the single-process answer at DP1 x CP1, DP1 x CP2 and DP2 x CP2.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hapo_megatron.parallel import collectives as C
from tests.distributed import run_distributed


def test_guard_rejects_cpu_tensors_on_nccl_groups(monkeypatch):
    group = object()
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match="CPU tensor .* 'nccl' group"):
        C.check_collective_device(torch.zeros(3, dtype=torch.float64), group)
    C.check_collective_device(torch.zeros(3, device="meta"), group)  # a device tensor passes
    for backend in ("gloo", "cpu:gloo,cuda:nccl"):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        C.check_collective_device(torch.zeros(3), group)


class _Router:
    def __init__(self, layer_number):
        self.layer_number = layer_number


def test_monitor_reduces_on_the_model_device(monkeypatch):
    """The monitor's real reductions over TP (SP), PP and DP groups of an NCCL job: every tensor is
    on the model's device (``meta`` stands for a GPU here), none trips the guard. Fails when the
    monitor's tensors are built on the CPU (tried: ``device="cpu"`` for the counts or the calls,
    ``.to("cpu")`` on the tracker's values, and a plain ``dist.all_reduce`` without the guard)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from hapo_megatron.models.moe import AUX_LOSS_NAME, ExpertLoadMonitor

    tp, pp, dp = object(), object(), object()
    seen = []

    def fake_all_reduce(tensor, op=None, group=None):
        C.check_collective_device(tensor, group)
        seen.append((tensor.device.type, group))

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(C, "rank_and_world", lambda group=None: (0, 2))
    monkeypatch.setitem(get_moe_layer_wise_logging_tracker(), AUX_LOSS_NAME,
                        {"values": torch.zeros(2, device="meta")})
    monitor = ExpertLoadMonitor([], num_layers=2, num_experts=4, device="meta")
    monitor.recording = True
    monitor._hook(_Router(1), (), (None, torch.zeros(5, 4, dtype=torch.bool, device="meta")))
    totals = monitor._reduced_totals(tp_group=tp, pp_group=pp, dp_cp_group=dp, sequence_parallel=True)
    assert all(t.device.type == "meta" for t in totals)
    assert [d for d, _ in seen] == ["meta"] * 6
    assert [g for _, g in seen] == [pp, tp, dp, pp, tp, dp]


def _per_call_host_counts(actor):
    """The old monitor's accounting: one device-to-host copy of each router call's counts, under
    grad only (the calls Megatron's aux-loss tracker counts)."""
    counts = torch.zeros(actor.hf_config.num_hidden_layers, actor.hf_config.num_experts, dtype=torch.float64)

    def hook(router, inputs, output):
        if torch.is_grad_enabled():
            counts[router.layer_number - 1] += output[1].detach().sum(0).to("cpu", torch.float64)
    handles = [m.register_forward_hook(hook) for c in actor.model for m in c.modules()
               if type(m).__name__ == "TopKRouter"]
    return counts, handles


def _recompute_ranks(rank, world, tmpdir):
    from transformers import AutoConfig

    from hapo_megatron.config import OptimConfig
    from hapo_megatron.parallel.groups import destroy_parallel, initialize_parallel
    from hapo_megatron.training.actor import MegatronActor
    from hapo_megatron.training.batches.micro_batches import build_rank_micro_batches
    from hapo_megatron.training.sft import cross_entropy_loss_factory
    from tests.convert.moe_checks import moe_model
    from tests.parallel.test_moe_training import _sequences

    path = f"{tmpdir}/hf_moe"
    moe_model()[1].save_pretrained(path)
    out = {}
    for recompute in (False, True):
        g = initialize_parallel(tp=1, seed=1)
        actor = MegatronActor(AutoConfig.from_pretrained(path), groups=g, total_optimizer_steps=2,
                              init_hf_path=path, optim=OptimConfig(lr=1e-2, lr_warmup_steps=0, weight_decay=0.0),
                              moe_aux_loss_coef=0.5, recompute_activations=recompute,
                                  dtype='fp32', use_te=None, sequence_parallel=False, use_distributed_optimizer=True,
                                  fused_output_layer=False)
        mbs = build_rank_micro_batches(_sequences(), dp_rank=0, dp_size=1,
            micro_batch_size=1, max_tokens_per_micro_batch=None)
        host_counts, handles = _per_call_host_counts(actor)
        actor.train_step(mbs, cross_entropy_loss_factory(g.tp))
        device_counts = actor.moe_monitor.counts.cpu().double()
        # numpy, not tensors: torch's queue would share tensor storage through this process, which
        # exits before the parent reads it
        out[recompute] = {"metrics": actor.moe_step_metrics(), "host": host_counts.numpy(),
                          "device": device_counts.numpy(), "mbs": [mb.input_ids.numpy() for mb in mbs]}
        for h in handles:
            h.remove()
        destroy_parallel()
    return out


def test_aux_loss_counted_once_under_recompute(tmp_path):
    """`actor/moe_aux_loss` and the expert load with activation recompute equal those without, and
    the loop over HF's router logits. Fails without the grad-mode check in the monitor's hook (the
    aux loss halves: the router runs twice, Megatron's tracker counts once); the counts kept on
    the device equal the old per-call host copies (fails if a call is dropped or doubled)."""
    from tests.parallel.test_moe_training import _routing_reference

    out = run_distributed(_recompute_ranks, 1, str(tmp_path), timeout=600)[0]
    expected = _routing_reference([torch.as_tensor(ids) for ids in out[False]["mbs"]])
    for recompute in (False, True):
        run = out[recompute]
        assert np.array_equal(run["device"], run["host"]), recompute
        assert float(run["device"].sum()) > 0
        for key, value in expected.items():  # float32 router softmax vs float64: ~1e-7 relative
            np.testing.assert_allclose(run["metrics"][key], value, rtol=1e-5, err_msg=f"{key} recompute={recompute}")
    # the same forward computations in one process: recompute changes no metric beyond rounding
    for key, value in out[False]["metrics"].items():
        np.testing.assert_allclose(out[True]["metrics"][key], value, rtol=1e-12, err_msg=key)


CP_LAYERS, CP_EXPERTS, CP_TOPK, CP_MICRO_BATCHES, CP_TOKENS = 2, 4, 2, 4, 12


def _cp_routing(mb: int, layer: int) -> torch.Tensor:
    """Micro-batch ``mb``'s routing map ``[tokens, experts]`` in MoE layer ``layer`` (seeded)."""
    g = torch.Generator().manual_seed(100 * mb + layer)
    scores = torch.rand(CP_TOKENS, CP_EXPERTS, generator=g) ** (layer + 1 + mb % 3)  # uneven loads
    top = scores.topk(CP_TOPK, dim=1).indices
    return torch.zeros(CP_TOKENS, CP_EXPERTS, dtype=torch.bool).scatter_(1, top, True)


def _cp_aux(routing: torch.Tensor) -> float:
    """A micro-batch's load-balancing loss stand-in: any function of its whole routing map."""
    share = routing.sum(0).double() / routing.sum()
    return float((share ** 2).sum())


def _cp_ranks(rank, world, cp):
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from hapo_megatron.models.moe import AUX_LOSS_NAME, ExpertLoadMonitor
    from hapo_megatron.parallel.groups import destroy_parallel, initialize_parallel
    from hapo_megatron.training.actor import MegatronActor

    g = initialize_parallel(cp=cp, seed=1)
    dp = g.dp_cp_size // g.cp_size
    assert (g.dp_cp_size, g.cp_size) == (world, cp)
    values = torch.zeros(CP_LAYERS, dtype=torch.float32)
    get_moe_layer_wise_logging_tracker()[AUX_LOSS_NAME] = {"values": values}
    monitor = ExpertLoadMonitor([], num_layers=CP_LAYERS, num_experts=CP_EXPERTS)
    monitor.recording = True
    dp_rank = g.dp_cp_rank // cp
    span = CP_TOKENS // cp
    with torch.enable_grad():
        for mb in range(dp_rank, CP_MICRO_BATCHES, dp):  # this data-parallel rank's micro-batches
            for layer in range(CP_LAYERS):
                routing = _cp_routing(mb, layer)
                mine = routing[g.cp_rank * span:(g.cp_rank + 1) * span]  # this CP rank's slice
                monitor._hook(_Router(layer + 1), (), (None, mine))
                values[layer] += _cp_aux(routing) * span / CP_TOKENS  # a partial sum over CP
    # the actor's call with its groups (a stand-in for the rest of the actor)
    actor = SimpleNamespace(moe_monitor=monitor, groups=g, config=SimpleNamespace(sequence_parallel=False))
    metrics = MegatronActor.moe_step_metrics(actor)
    destroy_parallel()
    return metrics


def test_metrics_reduced_over_data_and_context_parallel():
    """Fails when the actor hands the monitor the pure data-parallel group (tried: each CP rank
    reports only its slice's load and its partial aux loss) or the monitor divides the aux loss
    by DP x CP (tried)."""
    maps = [[_cp_routing(mb, layer) for layer in range(CP_LAYERS)] for mb in range(CP_MICRO_BATCHES)]
    aux = np.mean([np.mean([_cp_aux(maps[mb][layer]) for mb in range(CP_MICRO_BATCHES)])
                   for layer in range(CP_LAYERS)])
    counts = torch.stack([sum(maps[mb][layer].sum(0) for mb in range(CP_MICRO_BATCHES))
                          for layer in range(CP_LAYERS)]).double()
    share = counts / counts.sum(1, keepdim=True) * CP_EXPERTS
    expected = {"actor/moe_aux_loss": aux, "actor/moe_expert_load_max": float(share.max(1).values.mean()),
                "actor/moe_expert_load_min": float(share.min(1).values.mean()),
                "actor/moe_expert_load_cv": float(share.std(1, unbiased=False).mean())}
    assert expected["actor/moe_expert_load_max"] > 1.1  # uneven loads: a missing slice shows
    for world, cp in ((1, 1), (2, 2), (4, 2)):
        for rank, got in enumerate(run_distributed(_cp_ranks, world, cp, timeout=120)):
            assert got.keys() == expected.keys()
            for k, v in expected.items():
                # float32 partial sums of the aux loss (the tracker's dtype): a few ulps of O(1)
                assert got[k] == pytest.approx(v, rel=1e-6), (world, cp, rank, k)
