"""MoE micro-batches on 2 gloo ranks (docs/moe.md, "Micro-batch counts" and "Padding and fillers"):
a `MegatronActor` on the tiny Qwen3-MoE of tests/convert/moe_checks.py, the SFT loss, several
micro-batches per rank of sequences of unequal lengths.

Fillers: the padded plan gives the two data-parallel ranks 3 and 2 micro-batches. At EP=2 every
MoE layer's dispatch is a collective over both ranks, so without the filler that evens the counts
the run hangs (`run_distributed`'s timeout fails the test). A filler is all padding for the
routers and all-masked for the loss: each of its contributions (loss, gradient, load-balancing
loss, expert counts) is an exact 0, so the results are bit-identical with and without fillers
(EP=1, where a rank may run fewer) and with more of them (EP=2). The aux loss is on (coefficient
0.5), where a routed filler would move the router's gradient and the expert metrics.
Mutations tried: plan not equalized (EP=2 hangs); `padding_mask` not passed to the model, or the
router hook off (gradients, expert counts and aux loss change); the empty-count guard off (NaN
gradients); the filler counted as a router call (`actor/moe_aux_loss` changes).

Packed rows: packed equals padded at EP=2 and at TP2 x EP2 with sequence parallelism (the MoE
layer spec's CPU per-sequence attention): per-sequence log-probs and entropies, the summed loss,
every gradient, and the expert-load metrics (pads are routed in neither layout: the same tokens
reach the same experts). The aux loss is off there: it is a per-micro-batch quantity, and the two
layouts group the sequences in other micro-batches. Mutation tried: pads routed (no
`padding_mask`) changes the expert-load metrics between the layouts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.convert.moe_checks import moe_model
from tests.distributed import run_distributed

pytestmark = pytest.mark.slow  # 2 ranks, 8 actors, about 1 min on 2 cores

BUDGET = 60  # tokens per micro-batch: padded, 3 and 2 micro-batches on the two ranks
AUX_COEF = 0.5
#: float32 rounding between two layouts (another TP split, other micro-batch shapes, the experts'
#: gradients summed by an all-to-all instead of the data-parallel all-reduce): sums of O(100)
#: products over hidden 64 / vocab 256 in 2 layers, a few hundred ulps (2^-23) of the largest term
#: at most: 1e-4 relative, plus 1e-5 of each tensor's scale for entries that nearly cancel.
RTOL, SCALE_ATOL = 1e-4, 1e-5


def _sequences():
    from hapo_megatron.training.batches.micro_batches import SequenceData
    g = torch.Generator().manual_seed(4)  # lengths whose padded plan gives the ranks 3 and 2 micro-batches
    out = []
    for i in range(9):
        p, r = int(torch.randint(3, 9, (1,), generator=g)), int(torch.randint(1, 30, (1,), generator=g))
        out.append(SequenceData(torch.randint(4, 150, (p,), generator=g).tolist(),
                                torch.randint(4, 150, (r,), generator=g).tolist(), index=i))
    return out


def _micro_batches(seqs, g, *, pack: bool, fillers: str, sequence_parallel: bool):
    """This rank's micro-batches: the trainer's plan (``fillers="plan"``), without its fillers
    (``"none"``), or with one more filler on every rank (``"extra"``)."""
    from hapo_megatron.training.batches.micro_batches import PadMultiples, collate_micro_batches, plan_micro_batches
    plan = plan_micro_batches([s.num_tokens for s in seqs], dp_size=g.dp_size, max_tokens_per_micro_batch=BUDGET,
                              pack=pack, micro_batch_size=1)
    mine = plan[g.dp_rank]
    if fillers == "none":
        mine = [b for b in mine if b]
    elif fillers == "extra":
        mine = mine + [[]]
    pads = PadMultiples.of(tp_size=g.tp_size, cp_size=1, sequence_parallel=sequence_parallel)
    return collate_micro_batches([[seqs[i] for i in b] for b in mine], seqs[0], pack=pack,
                                 **pads.kwargs()), [len(r) for r in plan], \
        [sum(1 for b in r if b) for r in plan]


def _run(path, *, tp, ep, pack, fillers, coef):
    import torch.distributed as dist
    from transformers import AutoConfig

    from hapo_megatron.config import OptimConfig
    from hapo_megatron.parallel.collectives import sum_metrics
    from hapo_megatron.parallel.groups import destroy_parallel, initialize_parallel
    from hapo_megatron.training.actor import MegatronActor
    from hapo_megatron.training.sft import cross_entropy_loss_factory

    g = initialize_parallel(tp=tp, ep=ep, etp=1, seed=1)  # TP2 x EP2: experts whole on each TP rank
    sp = tp > 1
    actor = MegatronActor(AutoConfig.from_pretrained(path), groups=g, total_optimizer_steps=2, init_hf_path=path,
                          optim=OptimConfig(lr=1e-2, lr_warmup_steps=0, weight_decay=0.0), sequence_parallel=sp,
                          moe_aux_loss_coef=coef, use_distributed_optimizer=False,
                              dtype='fp32', use_te=None, recompute_activations=False, fused_output_layer=False)
    mbs, counts, real_counts = _micro_batches(_sequences(), g, pack=pack, fillers=fillers, sequence_parallel=sp)
    out = {"counts": counts, "real_counts": real_counts, "num_micro_batches": len(mbs)}
    tokens = {}
    for mb, (lp, ent) in zip(mbs, actor.compute_logprobs_entropy(mbs, temperature=1.0)):
        rows = mb.with_(old_logprobs=lp, old_entropy=ent).unpacked()
        for r, i in enumerate(rows.seq_index.tolist()):
            if i >= 0:
                m = rows.loss_mask[r] != 0
                tokens[i] = (rows.old_logprobs[r][m].double().numpy(), rows.old_entropy[r][m].double().numpy())
    out["tokens"] = tokens
    for chunk in actor.model:  # what train_step does before its optimizer step
        chunk.zero_grad_buffer()
    actor.moe_monitor.recording = True
    per_mb = actor.forward_backward(mbs, cross_entropy_loss_factory(g.tp), forward_only=False)
    actor.moe_monitor.recording = False
    out["grads"] = {n: p.main_grad.detach().double().clone().numpy() for n, p in actor.model[0].named_parameters()}
    sums = {k: sum(float(m[k]) for m in per_mb) for k in ("sft/loss_sum", "sft/num_tokens")}
    out["loss"] = sum_metrics(sums, contribute=g.tp_rank == 0)
    out["moe"] = actor.moe_step_metrics()
    dist.barrier()
    destroy_parallel()
    return out


RUNS = {  # name: (tp, ep, pack, fillers, aux coefficient)
    "ep1-none": (1, 1, False, "none", AUX_COEF), "ep1-plan": (1, 1, False, "plan", AUX_COEF),
    "ep2-plan": (1, 2, False, "plan", AUX_COEF), "ep2-extra": (1, 2, False, "extra", AUX_COEF),
    "ep2-padded": (1, 2, False, "plan", 0.0), "ep2-packed": (1, 2, True, "plan", 0.0),
    "tp2ep2-padded": (2, 2, False, "plan", 0.0), "tp2ep2-packed": (2, 2, True, "plan", 0.0),
}


def _ranks(rank, world, path):
    return {name: _run(path, tp=tp, ep=ep, pack=pack, fillers=f, coef=c)
            for name, (tp, ep, pack, f, c) in RUNS.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3_moe"))
    moe_model()[1].save_pretrained(path)
    return run_distributed(_ranks, 2, path, timeout=600)


def _close(a, b, what):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=SCALE_ATOL * max(float(np.abs(b).max(initial=0)), 1e-30),
                               err_msg=what)


def test_plan_gives_ranks_unequal_real_counts_and_equal_totals(results):
    for r in results:
        assert r["ep2-plan"]["real_counts"] == [3, 2] and r["ep2-plan"]["counts"] == [3, 3]
    assert [r["ep1-none"]["num_micro_batches"] for r in results] == [3, 2]
    assert [r["ep2-extra"]["num_micro_batches"] for r in results] == [4, 4]
    assert sum(r["ep2-packed"]["num_micro_batches"] for r in results) >= 2


@pytest.mark.parametrize("pair", [("ep1-plan", "ep1-none"), ("ep2-extra", "ep2-plan")])
def test_fillers_change_nothing_bit_for_bit(results, pair):
    with_more, with_fewer = pair
    for r in results:
        a, b = r[with_more], r[with_fewer]
        assert a["moe"] == b["moe"] and a["loss"] == b["loss"]
        assert a["moe"]["actor/moe_aux_loss"] > 0.5  # the aux loss ran (~1 for a near-uniform router)
        assert sorted(a["tokens"]) == sorted(b["tokens"])
        for i in a["tokens"]:
            for x, y in zip(a["tokens"][i], b["tokens"][i]):
                np.testing.assert_array_equal(x, y)
        assert sorted(a["grads"]) == sorted(b["grads"])
        for n in a["grads"]:
            assert np.isfinite(a["grads"][n]).all(), n
            np.testing.assert_array_equal(a["grads"][n], b["grads"][n], err_msg=n)


def test_expert_parallel_with_fillers_equals_data_parallel_without(results):
    """EP=2 (fillers) against EP=1 (none): the same numbers up to float32 rounding; the gradients
    of the weights both layouts name alike (all but the experts, the router's included)."""
    ep1, ep2 = results[0]["ep1-none"], results[0]["ep2-plan"]
    _close(ep2["loss"]["sft/loss_sum"], ep1["loss"]["sft/loss_sum"], "loss")
    assert ep2["loss"]["sft/num_tokens"] == ep1["loss"]["sft/num_tokens"]
    for k, v in ep1["moe"].items():
        _close(ep2["moe"][k], v, k)
    shared = [n for n in ep1["grads"] if n in ep2["grads"] and ep1["grads"][n].shape == ep2["grads"][n].shape]
    assert any("router" in n for n in shared)
    for n in shared:
        _close(ep2["grads"][n], ep1["grads"][n], n)


@pytest.mark.parametrize("layout", ["ep2", "tp2ep2"])
def test_packed_equals_padded_for_moe(results, layout):
    tokens = {}
    for r in results:
        padded, packed = r[f"{layout}-padded"], r[f"{layout}-packed"]
        for k in ("actor/moe_expert_load_max", "actor/moe_expert_load_min", "actor/moe_expert_load_cv"):
            # the same real tokens routed to the same experts: equal counts, float64 shares
            np.testing.assert_allclose(packed["moe"][k], padded["moe"][k], rtol=1e-12, err_msg=k)
        assert packed["loss"]["sft/num_tokens"] == padded["loss"]["sft/num_tokens"] > 0
        _close(packed["loss"]["sft/loss_sum"], padded["loss"]["sft/loss_sum"], "loss")
        for n, grad in padded["grads"].items():
            assert np.abs(grad).max() > 0 or "experts" in n, n
            _close(packed["grads"][n], grad, f"{layout} {n}")
        for name, lay in (("padded", padded), ("packed", packed)):
            for i, t in lay["tokens"].items():
                tokens.setdefault(name, {})[i] = t
    assert sorted(tokens["padded"]) == sorted(tokens["packed"]) == list(range(9))
    for i in range(9):
        for x, y in zip(tokens["packed"][i], tokens["padded"][i]):
            _close(x, y, f"{layout} sequence {i}")
