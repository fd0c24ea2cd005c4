"""Trainer-state offload around colocated generation (training/memory/offload.py), checked on CPU: the
storage moves (CPU -> host copy -> CPU here, CUDA -> pinned host on a GPU) keep every view valid
and every value, gradient buffers come back zeroed, and a real Megatron actor trains identically
with an offload/reload between its steps."""

import os

import pytest
import torch

from hapo_megatron.training.memory.offload import OffloadSet, StorageOffloader, actor_offload_sets
from tests.distributed import run_distributed
from tests.training.tiny_setup import prepare_tiny


def test_storage_round_trip_keeps_views_and_values():
    buf = torch.arange(12, dtype=torch.float32)
    view_a, view_b = buf[:4], buf[4:].view(2, 4)  # Megatron keeps params as views into one buffer
    grads = torch.full((6,), 3.0)
    other = torch.ones(5, dtype=torch.bfloat16)
    off = StorageOffloader([OffloadSet("params", [view_a, view_b, buf]), OffloadSet("grads", [grads], keep=False),
                            OffloadSet("optimizer", [other, view_a])])  # view_a again: moved once
    moved = off.offload()
    assert moved == {"params": 12 * 4, "grads": 6 * 4, "optimizer": 5 * 2}
    assert buf.untyped_storage().nbytes() == 0 and grads.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="twice"):
        off.offload()
    off.reload()
    assert torch.equal(buf, torch.arange(12, dtype=torch.float32))
    assert view_b.data_ptr() == buf.data_ptr() + 4 * 4 and torch.equal(view_b.flatten(), buf[4:])
    view_a.add_(100)  # still a view of the reloaded buffer
    assert float(buf[0]) == 100.0
    assert torch.equal(grads, torch.zeros(6)), "gradient buffers come back zeroed"
    assert torch.equal(other, torch.ones(5, dtype=torch.bfloat16))
    off.reload()  # a reload without an offload is a no-op
    assert not off.offloaded


def test_sets_are_collected_at_each_offload():
    state = []
    off = StorageOffloader(lambda: [OffloadSet("optimizer", list(state))])
    assert off.offload() == {"optimizer": 0}
    off.reload()
    state.append(torch.ones(3))  # Adam state appears at the first step
    assert off.offload() == {"optimizer": 12}
    off.reload()


def _actor_round_trip(rank, world, data):
    from transformers import AutoConfig

    from hapo_megatron.config import OptimConfig
    from hapo_megatron.parallel.groups import initialize_parallel
    from hapo_megatron.training.actor import MegatronActor
    from hapo_megatron.training.batches.micro_batches import SequenceData, build_rank_micro_batches
    from hapo_megatron.training.sft import cross_entropy_loss_factory

    g = initialize_parallel(tp=1, seed=3)
    path = os.path.join(data, "model")
    hf_config = AutoConfig.from_pretrained(path)

    def make():
        return MegatronActor(hf_config, groups=g, optim=OptimConfig(lr=1e-2, lr_warmup_steps=0),
                             total_optimizer_steps=10, init_hf_path=path,
                                 dtype='fp32', use_te=None, sequence_parallel=False, recompute_activations=False,
                                 use_distributed_optimizer=True, fused_output_layer=False, moe_aux_loss_coef=None)
    gen = torch.Generator().manual_seed(0)
    seqs = [SequenceData(torch.randint(4, 80, (5 + i,), generator=gen).tolist(),
                         torch.randint(4, 80, (3 + i,), generator=gen).tolist(), index=i) for i in range(3)]
    mbs = build_rank_micro_batches(seqs, dp_rank=0, dp_size=1, micro_batch_size=2, max_tokens_per_micro_batch=None)
    loss = cross_entropy_loss_factory(g.tp)
    a, b = make(), make()
    for actor in (a, b):
        actor.train_step(mbs, loss)
    off = StorageOffloader(lambda: actor_offload_sets(a.model, a.optimizer, device_type="cpu"))
    moved = off.offload()
    emptied = all(p.untyped_storage().nbytes() == 0 for p in a.model[0].parameters())
    off.reload()
    for actor in (a, b):
        actor.train_step(mbs, loss)
    same = all(torch.equal(x, y) for x, y in zip(a.model[0].parameters(), b.model[0].parameters()))
    return dict(moved=moved, emptied=emptied, same=same)


def test_megatron_actor_trains_identically_across_an_offload(tmp_path):
    data = prepare_tiny(str(tmp_path / "tiny"), n_train=8, n_val=2)
    (r,) = run_distributed(_actor_round_trip, 1, data, timeout=300)
    assert r["emptied"], "the actor's parameters were not offloaded"
    assert all(v > 0 for v in r["moved"].values()), r["moved"]  # params, grad buffers, Adam state
    assert r["same"], "training after offload/reload differs from training without it"
