"""Checkpoints change layout: saved at TP=2 (2 ranks), resumed at TP=1 (1 rank), DP=2 and PP=2.

What is compared:
- the optimizer state after loading, in model space (Adam exp_avg, exp_avg_sq and the fp32 main
  weights of every parameter, gathered to full HF-named tensors, plus Adam's step), equals the
  state before saving exactly: resharding only moves numbers;
- two more optimizer steps after the resume match two more steps of the uninterrupted TP=2 run:
  per-step loss and grad norm, and the weights afterwards, to float32 rounding (summation order
  differs between layouts): `RTOL`/`ATOL` below;
- an old-format (bucket-bound) checkpoint still loads on its own layout and raises a
  `LayoutChangeError` that says what to do under another one.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.training.tiny_setup import prepare_tiny

STATE_KEYS = ("exp_avg", "exp_avg_sq", "fp32_param")
# Another layout regroups float32 sums (row-parallel matmuls, the DP gradient all-reduce), so loss,
# grad norm and gradients differ by rounding: relative ~1e-7 per sum of <= 128 terms here, RTOL.
# A weight moves by Adam's lr * m / (sqrt(v) + eps); a gradient error dg changes that by at most
# (lr / eps) * |dg|. With eps = 1e-8 a gradient that is rounding noise around 0 would become a
# step of up to lr = 1e-2 either way (on any CPU kind); ADAM_EPS = 1e-3 bounds it by 10 |dg|, and
# this loss's gradients (sums over <= 60 tokens, entries < 1) are rounded by < 1e-8: < 2e-7 over
# the 2 steps, inside ATOL.
RTOL, ATOL = 1e-5, 1e-6
ADAM_EPS = 1e-3
STEPS_BEFORE, STEPS_AFTER = 2, 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return prepare_tiny(str(tmp_path_factory.mktemp("tiny")), n_train=8, n_val=2)


def _build(data: str, *, tp: int = 1, pp: int = 1):
    from transformers import AutoConfig

    from hapo_megatron.config import OptimConfig
    from hapo_megatron.parallel.groups import initialize_parallel
    from hapo_megatron.training.actor import MegatronActor

    g = initialize_parallel(tp=tp, pp=pp, seed=5)
    path = os.path.join(data, "model")
    optim = OptimConfig(lr=1e-2, lr_warmup_steps=0, weight_decay=0.01, adam_eps=ADAM_EPS)
    return g, MegatronActor(AutoConfig.from_pretrained(path), groups=g, optim=optim,
                            total_optimizer_steps=10, init_hf_path=path,
                                dtype='fp32', use_te=None, sequence_parallel=False, recompute_activations=False,
                                use_distributed_optimizer=True, fused_output_layer=False, moe_aux_loss_coef=None)


def _batches(g):
    """The same 6 sequences every step, split over this rank's DP coordinate."""
    from hapo_megatron.training.batches.micro_batches import SequenceData, build_rank_micro_batches

    gen = torch.Generator().manual_seed(0)
    seqs = [SequenceData(torch.randint(4, 80, (4 + i,), generator=gen).tolist(),
                         torch.randint(4, 80, (3 + i,), generator=gen).tolist(), index=i) for i in range(6)]
    return build_rank_micro_batches(seqs, dp_rank=g.dp_rank, dp_size=g.dp_size, micro_batch_size=2,
        max_tokens_per_micro_batch=None)


def _train(g, actor, steps: int) -> list[tuple[float, float]]:
    """``steps`` optimizer steps; (global summed loss, grad norm) of each."""
    from hapo_megatron.parallel.collectives import sum_metrics
    from hapo_megatron.training.sft import cross_entropy_loss_factory

    out = []
    for _ in range(steps):
        res = actor.train_step(_batches(g), cross_entropy_loss_factory(g.tp))
        assert not res.skipped
        loss = sum_metrics(res.metrics, contribute=g.tp_rank == 0 and g.is_pipeline_last)
        out.append((loss["sft/loss_sum"], res.grad_norm))
    return out


def _weights(g, actor) -> dict[str, torch.Tensor]:
    from hapo_megatron.convert import gather_hf_state_dict
    return gather_hf_state_dict(actor.model, actor.hf_config, tp_group=g.tp, pp_group=g.pp)


def _model_space_optimizer_state(g, actor) -> dict:
    """The distributed optimizer's state as full HF-named tensors, built without dist_checkpointing.

    Each rank's DP shard of a parameter's state is put at its place in the flattened parameter
    (zeros elsewhere) and summed over the DP group: every element has exactly one owner. The full
    per-rank tensors are then written into the parameters and exported like weights (TP/PP gather).
    """
    import torch.distributed as dist

    from hapo_megatron.convert import unwrap_model
    (opt,) = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    ranges = {p: r["param"] for maps in opt.gbuf_ranges for per_dtype in maps.values()
              for bucket in per_dtype for p, r in bucket["param_map"].items()}
    params = list(unwrap_model(actor.model[0]).parameters())
    full: dict[str, list[torch.Tensor]] = {k: [] for k in STATE_KEYS}
    for p in params:
        flat = {k: torch.zeros(p.numel()) for k in STATE_KEYS}
        if p in ranges:
            st, r = opt._get_main_param_and_optimizer_states(p), ranges[p]
            for k in STATE_KEYS:
                flat[k][r.start:r.end] = st["param" if k == "fp32_param" else k].detach().float()
        for k in STATE_KEYS:
            dist.all_reduce(flat[k], group=opt.data_parallel_group)
            full[k].append(flat[k].view(p.shape))
    original = [p.detach().clone() for p in params]
    out = {}
    with torch.no_grad():
        for k in STATE_KEYS:
            for p, t in zip(params, full[k]):
                p.copy_(t)
            out[k] = _weights(g, actor)
        for p, t in zip(params, original):
            p.copy_(t)
    out["step"] = sorted({float(st["step"]) for st in opt.optimizer.state.values()})
    return out


def _portable(obj):
    """Tensors as numpy arrays: spawned ranks hand results back pickled, not in shared memory."""
    if torch.is_tensor(obj):
        return obj.numpy()
    if isinstance(obj, dict):
        return {k: _portable(v) for k, v in obj.items()}
    return obj


def _manager(root: str, g):
    import torch.distributed as dist

    from hapo_megatron.parallel.collectives import all_gather_objects
    from hapo_megatron.training.checkpointing.checkpoint import CheckpointManager, Layout
    # every rank of the job: the ranks share the checksums and rank 0 renames only after the gather
    return CheckpointManager(root, rank=dist.get_rank(), barrier=dist.barrier, layout=Layout.from_groups(g),
                             world_size=dist.get_world_size(), gather=all_gather_objects, keep_last_k=3)


def _save_at_tp2(rank, world, data, root, legacy_root):
    """Train, save (new and old format), train on; the old-format checkpoint reloads here."""
    import torch.distributed as dist

    from hapo_megatron.training.checkpointing.checkpoint import LAYOUT_FILE, LEGACY_OPTIMIZER_FORMAT
    from hapo_megatron.training.checkpointing.manifest import MANIFEST
    g, actor = _build(data, tp=2)
    _train(g, actor, STEPS_BEFORE)
    saved = _model_space_optimizer_state(g, actor)
    mgr = _manager(root, g)
    mgr.save(STEPS_BEFORE, rl_state={"cursor": 7}, save_model=actor.save)
    legacy = _manager(legacy_root, g).save(
        STEPS_BEFORE, rl_state={}, save_model=lambda d: actor.save(d, LEGACY_OPTIMIZER_FORMAT))
    if rank == 0:  # what a checkpoint from before the layout record (and the manifest) looks like
        os.remove(os.path.join(legacy, LAYOUT_FILE))
        os.remove(os.path.join(legacy, MANIFEST))
    dist.barrier()
    after = _train(g, actor, STEPS_AFTER)
    final = _weights(g, actor)
    _manager(legacy_root, g).load(legacy, load_model=actor.load)
    reloaded_legacy = _model_space_optimizer_state(g, actor)
    return _portable(dict(saved=saved, after=after, final=final, reloaded_legacy=reloaded_legacy))


def _resume(rank, world, data, root, legacy_root, tp, pp):
    from hapo_megatron.training.checkpointing.checkpoint import LayoutChangeError, find_latest
    g, actor = _build(data, tp=tp, pp=pp)
    rl_state = _manager(root, g).load(find_latest(root), load_model=actor.load)
    loaded = _model_space_optimizer_state(g, actor)
    after = _train(g, actor, STEPS_AFTER)
    final = _weights(g, actor)
    try:
        _manager(legacy_root, g).load(find_latest(legacy_root), load_model=actor.load)
        legacy_error = None
    except LayoutChangeError as e:
        legacy_error = str(e)
    return _portable(dict(rl_state=rl_state, loaded=loaded, after=after, final=final,
                          legacy_error=legacy_error))


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    root, legacy_root = (str(tmp_path_factory.mktemp(n)) for n in ("ckpt", "legacy"))
    out = run_distributed(_save_at_tp2, 2, tiny, root, legacy_root, timeout=400)
    return root, legacy_root, out[0]


def _assert_state_equal(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] == [float(STEPS_BEFORE)]
    for k in STATE_KEYS:
        assert a[k].keys() == b[k].keys()
        for name in a[k]:
            assert np.array_equal(a[k][name], b[k][name]), (k, name)


def test_old_format_checkpoint_reloads_on_its_layout(saved):
    _, _, ref = saved
    _assert_state_equal(ref["reloaded_legacy"], ref["saved"])


@pytest.mark.parametrize("world,tp,pp", [(1, 1, 1), (2, 1, 1), (2, 1, 2)], ids=["tp1", "dp2", "pp2"])
def test_resume_under_another_layout(tiny, saved, world, tp, pp):
    root, legacy_root, ref = saved
    out = run_distributed(_resume, world, tiny, root, legacy_root, tp, pp, timeout=400)
    for r in out:
        assert r["rl_state"] == {"step": STEPS_BEFORE, "cursor": 7}
        _assert_state_equal(r["loaded"], ref["saved"])
        print("resumed (loss, grad norm) per step:", r["after"], "uninterrupted:", ref["after"])
        for (loss, gnorm), (ref_loss, ref_gnorm) in zip(r["after"], ref["after"], strict=True):
            assert loss == pytest.approx(ref_loss, rel=RTOL, abs=ATOL)
            assert gnorm == pytest.approx(ref_gnorm, rel=RTOL, abs=ATOL)
        worst = max(float(np.abs(r["final"][n] - ref["final"][n]).max()) for n in ref["final"])
        print(f"max |weight diff| after {STEPS_AFTER} resumed steps vs uninterrupted: {worst:.3g}")
        for name, w in ref["final"].items():
            np.testing.assert_allclose(r["final"][name], w, rtol=RTOL, atol=ATOL, err_msg=name)
        assert "older hapo_megatron" in r["legacy_error"] and "resume once with the original" in r["legacy_error"]
