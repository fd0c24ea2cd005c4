"""MoE checkpoints change expert layout: a tiny Qwen3-MoE actor saved at EP=2 (2 ranks: the experts
split over EP, the dense weights over DP 2) resumes at EP=1 (1 rank), at EP=1 x DP=2 and at
TP=2 x EP=2 (sequence parallel), and a checkpoint saved at EP=1 resumes at EP=2.

Why this is a case of its own: at EP > 1 Megatron keeps the experts' optimizer state in a second
optimizer of a chain (expert-data-parallel), at EP = 1 in the one of the dense weights, so the
saved optimizer is shaped differently (`hapo_megatron.training.checkpointing.optimizer_state`).

What is compared, as in `test_checkpoint_reshard.py` for the dense layouts:
- the optimizer state after loading, in model space (Adam exp_avg, exp_avg_sq, fp32 main weights
  of every parameter, experts included, gathered to full HF-named tensors, and Adam's step),
  equals the state before saving exactly;
- two more optimizer steps after the resume match the uninterrupted EP=2 run (loss, grad norm,
  final weights) to float32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.convert.moe_checks import moe_model
from tests.distributed import run_distributed
from tests.training.checkpointing.test_checkpoint_reshard import ADAM_EPS, ATOL, RTOL, STATE_KEYS, _portable

STEPS_BEFORE, STEPS_AFTER = 2, 2
# the aux loss is off: it depends on how tokens are grouped into micro-batches, which differs between
# the 1-rank and 2-rank layouts (the resumed run would differ by that, not by the checkpoint)
# (tp, ep, etp, sequence parallel) of the 2-rank resumes, run one after the other in the same ranks
# (start-ups are slow): from the EP=2 checkpoint, then ("ep2-from-ep1") from the one the EP=1 x DP=2
# run writes right after loading (one optimizer instead of a chain of two)
LAYOUTS = {"ep1-dp2": (1, 1, 1, False), "tp2-ep2-sp": (2, 2, 1, True), "ep2-from-ep1": (1, 2, 1, False)}


@pytest.fixture(scope="module")
def hf_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf_moe"))
    moe_model()[1].save_pretrained(path)
    return path


def _build(hf_path: str, *, tp: int = 1, ep: int = 1, etp: int = 1, sp: bool = False):
    from transformers import AutoConfig

    from hapo_megatron.config import OptimConfig
    from hapo_megatron.parallel.groups import initialize_parallel
    from hapo_megatron.training.actor import MegatronActor

    g = initialize_parallel(tp=tp, ep=ep, etp=etp, seed=5)
    optim = OptimConfig(lr=1e-2, lr_warmup_steps=0, weight_decay=0.01, adam_eps=ADAM_EPS)
    return g, MegatronActor(AutoConfig.from_pretrained(hf_path), groups=g, optim=optim, sequence_parallel=sp,
                            total_optimizer_steps=10, init_hf_path=hf_path, moe_aux_loss_coef=0.0,
                                dtype='fp32', use_te=None, recompute_activations=False, use_distributed_optimizer=True,
                                fused_output_layer=False)


def _batches(g):
    """The same 6 sequences every step, split over this rank's DP coordinate."""
    from hapo_megatron.training.batches.micro_batches import SequenceData, build_rank_micro_batches

    gen = torch.Generator().manual_seed(0)
    seqs = [SequenceData(torch.randint(4, 150, (4 + i,), generator=gen).tolist(),
                         torch.randint(4, 150, (3 + i,), generator=gen).tolist(), index=i) for i in range(6)]
    # sequence parallelism splits the padded length over TP (padding is masked out of the loss)
    return build_rank_micro_batches(seqs, dp_rank=g.dp_rank, dp_size=g.dp_size, micro_batch_size=2,
                                    pad_multiple=g.tp_size, max_tokens_per_micro_batch=None)


def _train(g, actor, steps: int) -> list[tuple[float, float]]:
    from hapo_megatron.parallel.collectives import sum_metrics
    from hapo_megatron.training.sft import cross_entropy_loss_factory

    out = []
    for _ in range(steps):
        res = actor.train_step(_batches(g), cross_entropy_loss_factory(g.tp))
        assert not res.skipped
        loss = sum_metrics(res.metrics, contribute=g.tp_rank == 0 and g.is_pipeline_last)
        out.append((loss["sft/loss_sum"], res.grad_norm))
    return out


def _weights(actor) -> dict[str, torch.Tensor]:
    return {n: t.cpu() for n, t in actor.export_hf_weights()}


def _model_space_optimizer_state(actor) -> dict:
    """Every chained optimizer's state as full HF-named tensors, built without dist_checkpointing.

    Each rank's shard of a parameter's state is put at its place in the flattened parameter (zeros
    elsewhere) and summed over the data-parallel group of the optimizer that owns the parameter
    (expert-data-parallel for experts at EP > 1): every element has one owner. The full tensors are
    then written into the parameters and exported like weights (TP / EP gather).
    """
    import torch.distributed as dist

    from hapo_megatron.convert import unwrap_model
    optimizers = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    owner, ranges = {}, {}
    for opt in optimizers:
        for buf in opt.buffers:
            owner.update({p: opt for p in buf.param_index_map})
        ranges.update({p: r["param"] for maps in opt.gbuf_ranges for per_dtype in maps.values()
                       for bucket in per_dtype for p, r in bucket["param_map"].items()})
    params = list(unwrap_model(actor.model[0]).parameters())
    full: dict[str, list[torch.Tensor]] = {k: [] for k in STATE_KEYS}
    for p in params:
        flat = {k: torch.zeros(p.numel()) for k in STATE_KEYS}
        if p in ranges:
            st, r = owner[p]._get_main_param_and_optimizer_states(p), ranges[p]
            for k in STATE_KEYS:
                flat[k][r.start:r.end] = st["param" if k == "fp32_param" else k].detach().float()
        for k in STATE_KEYS:
            dist.all_reduce(flat[k], group=owner[p].data_parallel_group)
            full[k].append(flat[k].view(p.shape))
    original = [p.detach().clone() for p in params]
    out = {}
    with torch.no_grad():
        for k in STATE_KEYS:
            for p, t in zip(params, full[k]):
                p.copy_(t)
            out[k] = _weights(actor)
        for p, t in zip(params, original):
            p.copy_(t)
    out["step"] = sorted({float(st["step"]) for opt in optimizers for st in opt.optimizer.state.values()})
    return out


def _manager(root: str, g):
    import torch.distributed as dist

    from hapo_megatron.parallel.collectives import all_gather_objects
    from hapo_megatron.training.checkpointing.checkpoint import CheckpointManager, Layout
    return CheckpointManager(root, rank=dist.get_rank(), barrier=dist.barrier, layout=Layout.from_groups(g),
                             world_size=dist.get_world_size(), gather=all_gather_objects, keep_last_k=3)


def _save_at_ep2(g, actor, root):
    """Train, save, train on: the uninterrupted run."""
    assert len(actor.optimizer.chained_optimizers) == 2  # dense + experts: the case under test
    _train(g, actor, STEPS_BEFORE)
    saved = _model_space_optimizer_state(actor)
    _manager(root, g).save(STEPS_BEFORE, rl_state={"cursor": 7}, save_model=actor.save)
    after = _train(g, actor, STEPS_AFTER)
    return dict(saved=saved, after=after, final=_weights(actor))


def _resume(g, actor, root, resave_root=None):
    """Load the newest checkpoint of ``root``; with ``resave_root`` save it again right away (this
    layout's format) before training on."""
    from hapo_megatron.training.checkpointing.checkpoint import find_latest
    rl_state = _manager(root, g).load(find_latest(root), load_model=actor.load)
    loaded = _model_space_optimizer_state(actor)
    if resave_root:
        _manager(resave_root, g).save(STEPS_BEFORE, rl_state=rl_state, save_model=actor.save)
    after = _train(g, actor, STEPS_AFTER)
    return dict(rl_state=rl_state, loaded=loaded, after=after, final=_weights(actor),
                n_optimizers=len(getattr(actor.optimizer, "chained_optimizers", [None])))


def _two_rank_runs(rank, world, hf_path, root, resave_root):
    from hapo_megatron.parallel.groups import destroy_parallel
    out = {"saved": _save_at_ep2(*_build(hf_path, ep=2), root)}
    destroy_parallel()
    for name, (tp, ep, etp, sp) in LAYOUTS.items():
        source = resave_root if name == "ep2-from-ep1" else root
        out[name] = _resume(*_build(hf_path, tp=tp, ep=ep, etp=etp, sp=sp), source,
                            resave_root if name == "ep1-dp2" else None)
        destroy_parallel()
    return _portable(out)


def _one_rank_run(rank, world, hf_path, root):
    return _portable(_resume(*_build(hf_path), root))


@pytest.fixture(scope="module")
def runs(hf_path, tmp_path_factory):
    root, resave_root = (str(tmp_path_factory.mktemp(n)) for n in ("ckpt_ep2", "ckpt_ep1"))
    two = run_distributed(_two_rank_runs, 2, hf_path, root, resave_root, timeout=900)
    one = run_distributed(_one_rank_run, 1, hf_path, root, timeout=600)
    return two, one


def _assert_state_equal(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] == [float(STEPS_BEFORE)]
    for k in STATE_KEYS:
        assert a[k].keys() == b[k].keys()
        assert any(".experts." in name for name in a[k])
        for name in a[k]:
            assert np.array_equal(a[k][name], b[k][name]), (k, name)


def _assert_continues(r: dict, ref: dict) -> None:
    print("resumed (loss, grad norm) per step:", r["after"], "uninterrupted:", ref["after"])
    for (loss, gnorm), (ref_loss, ref_gnorm) in zip(r["after"], ref["after"], strict=True):
        assert loss == pytest.approx(ref_loss, rel=RTOL, abs=ATOL)
        assert gnorm == pytest.approx(ref_gnorm, rel=RTOL, abs=ATOL)
    for name, w in ref["final"].items():
        np.testing.assert_allclose(r["final"][name], w, rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("layout", ["ep1", *LAYOUTS])
def test_moe_resume_under_another_expert_layout(runs, layout):
    two, one = runs
    results = one if layout == "ep1" else [r[layout] for r in two]
    ref = two[0]["saved"]
    for r in results:
        assert r["n_optimizers"] == (1 if layout.startswith("ep1") else 2)
        assert r["rl_state"] == {"step": STEPS_BEFORE, "cursor": 7}
        _assert_state_equal(r["loaded"], ref["saved"])
        _assert_continues(r, ref)
