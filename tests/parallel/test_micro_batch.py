"""`MicroBatch`: one typed value from batching through the actor, the loss and the diagnostics."""

import dataclasses

import pytest
import torch

from hapo_megatron.algo import PolicyTokenFields
from hapo_megatron.parallel.context_parallel import gather_from_cp, split_for_cp
from hapo_megatron.parallel.micro_batch import ROW_FIELDS, MicroBatch


def _mb(b=3, s=8):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (b, s), generator=g)
    f = lambda: torch.randn(b, s, generator=g)  # noqa: E731
    upd = PolicyTokenFields(ratio=f(), adv_after=f(), clip_low=f() > 0, clip_high=f() > 0, clip_dual=f() > 0)
    return MicroBatch(input_ids=ids, position_ids=torch.arange(s).expand(b, s), labels=ids.roll(-1, 1),
                      loss_mask=(f() > 0).float(), advantages=f(), rollout_logprobs=f(), temperatures=f(),
                      seq_index=torch.arange(b), engine_temperatures=torch.tensor([True, False, True]),
                      old_logprobs=f(), old_entropy=f(), recomputed_logprobs=f(), ref_logprobs=f(), updates=(upd,))


def test_split_for_cp_cuts_every_sequence_field_alike_and_keeps_rows():
    mb = _mb()
    tensors = [f.name for f in dataclasses.fields(MicroBatch) if torch.is_tensor(getattr(mb, f.name))]
    assert len(tensors) == 13  # every tensor field is set in _mb
    for cp in (1, 2):
        shards = [mb.split_for_cp(cp, r) for r in range(cp)]
        for name in tensors:
            if name in ROW_FIELDS:
                assert all(torch.equal(getattr(s, name), getattr(mb, name)) for s in shards), name
            else:
                assert torch.equal(getattr(shards[0], name), split_for_cp(getattr(mb, name), cp, 0)), name
                assert torch.equal(gather_from_cp([getattr(s, name) for s in shards]), getattr(mb, name)), name
        assert shards[0].updates == (() if cp > 1 else mb.updates)
    with pytest.raises(ValueError, match="divisible"):
        _mb(s=6).split_for_cp(4, 0)


def test_frozen_checked_and_copied_not_edited():
    mb = _mb()
    with pytest.raises(dataclasses.FrozenInstanceError):
        mb.old_logprobs = torch.zeros(3, 8)
    with pytest.raises(TypeError):
        mb.with_(old_logprob=torch.zeros(3, 8))  # a misspelt field is an error
    with pytest.raises(ValueError, match="old_entropy must have shape"):
        mb.with_(old_entropy=torch.zeros(3, 7))
    with pytest.raises(ValueError, match="seq_index must have shape"):
        mb.with_(seq_index=torch.zeros(3, 8))
    before = mb.old_logprobs.clone()
    new = mb.with_(old_logprobs=torch.zeros(3, 8))
    assert torch.equal(mb.old_logprobs, before) and not new.old_logprobs.any()
    rows = mb.rows(slice(1, 3))
    assert rows.batch_size == 2 and rows.seq_len == 8 and rows.seq_index.tolist() == [1, 2]
    assert torch.equal(rows.updates[0].ratio, mb.updates[0].ratio[1:3])
    assert mb.to("cpu") is mb
