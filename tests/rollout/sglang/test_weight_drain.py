"""The weight-export contract: an engine's ``update_weights`` reads the weight iterator to the
end on every rank, also when the update fails (the export behind it runs collectives over the
trainer's ranks: a rank that stops early leaves the others waiting), and `stages.sync_weights`
drains it on ranks without an engine and refuses an engine that leaves tensors unread."""

from types import SimpleNamespace

import pytest
import torch

from hapo_megatron.rollout.sglang.client import SGLangError
from hapo_megatron.training import stages
from hapo_megatron.training.memory.engine_memory import EngineMemory

from .collective_worker import URLS, named_weights
from .fake_sglang import FakeSession
from tests.rollout.sglang.engines import sglang_engine
from tests.rollout.standin_engine import StandInEngine


class Stream:
    """A weight stream that counts what was read (like `export_hf_weights`, one pass)."""

    def __init__(self, items):
        self.items, self.read = list(items), 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.read == len(self.items):
            raise StopIteration
        self.read += 1
        return self.items[self.read - 1]

    @property
    def left(self) -> int:
        return len(self.items) - self.read


def _sglang(mode, rank=0, failures=None, tmp_path=None):
    eng = sglang_engine(server_urls=URLS, colocate=False, weight_sync=mode, session=FakeSession(failures=failures),
                          launch=False, bucket_size_mb=1, disk_sync_dir=str(tmp_path) if tmp_path else None)
    eng.bucket_bytes = 64 * 32 * 2  # several buckets
    eng._nccl_group, eng._sync_device = "fake-group", "cpu"
    eng.rank, eng.world_size = rank, 2 if rank else 1  # rank 1 of a collective engine (no real group)
    eng._barrier = lambda group=None: None
    return eng


@pytest.mark.parametrize("mode", ["distributed", "disk"])
@pytest.mark.parametrize("rank", [0, 1])
def test_sglang_reads_everything_on_every_rank(mode, rank, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.distributed, "broadcast", lambda *a, **k: None)
    stream = Stream(named_weights())
    _sglang(mode, rank, tmp_path=tmp_path).update_weights(stream)
    assert stream.left == 0


def test_sglang_reads_everything_when_a_server_refuses(monkeypatch):
    monkeypatch.setattr(torch.distributed, "broadcast", lambda *a, **k: None)
    stream = Stream(named_weights())
    eng = _sglang("distributed", failures={"/update_weights_from_distributed": [400]})
    with pytest.raises(SGLangError, match="400"):
        eng.update_weights(stream)
    assert stream.left == 0  # the first bucket failed; the rest was still read


def test_hf_engine_reads_everything_also_when_it_refuses_the_update():
    from tests.rollout.test_hf_engine import make
    eng = make(seed=0)
    named = [(k, v.float()) for k, v in eng.model.state_dict().items()]
    stream = Stream([("model.bogus.weight", torch.zeros(2))] + named)
    with pytest.raises(ValueError, match="unknown names"):
        eng.update_weights(stream)
    assert stream.left == 0
    stream = Stream(named)
    eng.update_weights(stream)
    assert stream.left == 0


# a synchronous run's config as far as sync_weights reads it (full or merged weights)
_CFG = SimpleNamespace(rollout=SimpleNamespace(max_staleness=0, sglang=SimpleNamespace(lora_sync="merged")))


class _Actor:
    def __init__(self, stream):
        self.stream = stream

    def export_hf_weights(self, dtype=None):
        return self.stream


class _HalfReader(StandInEngine):
    """An engine breaking the contract: it stops after half the tensors."""

    def update_weights(self, named_tensors, *, weight_version=None, flush_cache=True):
        for _ in range(2):
            next(named_tensors)


def test_sync_weights_drains_without_an_engine_and_refuses_an_engine_that_stops_early():
    stream = Stream(named_weights())
    stages.sync_weights(SimpleNamespace(engine=None, actor=_Actor(stream), cfg=_CFG))  # ranks 1..n-1
    assert stream.left == 0
    stream = Stream(named_weights())
    engine = _HalfReader()
    rt = SimpleNamespace(engine=engine, actor=_Actor(stream), memory=EngineMemory(engine),
                         cfg=_CFG)  # synchronous
    with pytest.raises(RuntimeError, match="_HalfReader.update_weights left 2 exported tensors unread"):
        stages.sync_weights(rt)
    assert stream.left == 0  # read before raising: no rank is left waiting in the export


def test_sync_weights_reports_the_bytes_it_handed_to_the_engine():
    """``rollout/weight_sync_bytes``: every exported tensor's elements x their size, with or
    without an engine on the rank: bf16 tensors of 64x32, 64x32, 32 and 64x32 values, 2 bytes each,
    and a float32 one of 3x5."""
    weights = named_weights() + [("model.extra.weight", torch.zeros(3, 5, dtype=torch.float32))]
    want = 2 * (3 * 64 * 32 + 32) + 4 * 15
    assert stages.sync_weights(SimpleNamespace(engine=None, actor=_Actor(Stream(weights)), cfg=_CFG)) == {
        "rollout/weight_sync_bytes": float(want)}
    engine = StandInEngine()
    rt = SimpleNamespace(engine=engine, actor=_Actor(Stream(weights)), memory=EngineMemory(engine),
                         cfg=_CFG)
    assert stages.sync_weights(rt) == {"rollout/weight_sync_bytes": float(want)}
