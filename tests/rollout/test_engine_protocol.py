"""Every rollout engine implements the whole `RolloutEngine` protocol (docs/architecture.md, "The
engine protocol"): the production engines (HF, SGLang, node servers) and the tests' scripted
engines, every method with the protocol's signature (parameter names, kinds and defaults), every
declared attribute readable with its type. The loops call these without asking ``hasattr``, so a
missing member is this test failing, not a loop skipping a step.

Mutations tried (each fails `test_every_engine_class_has_every_method_with_its_signature`):
`NodeServersEngine` without `abort_requests` (the asynchronous producer's close() never aborted
with launched servers) or without `generate_group` (over-sampling reached into ``.supervisor``);
`HFRolloutEngine.update_weights` without its ``weight_version`` keyword."""

from __future__ import annotations

import inspect

import pytest
import torch

from hapo_megatron.rollout.engine import RolloutEngine, RowRequest, SamplingParams
from hapo_megatron.rollout.hf_engine import HFRolloutEngine
from hapo_megatron.rollout.sglang.engine import SGLangEngine
from hapo_megatron.rollout.sglang.node_servers import NodeServersEngine
from hapo_megatron.rollout.sglang.placement import NodeContext
from tests.rollout.sglang.engines import sglang_engine
from tests.rollout.sglang.fake_sglang import FakeSession
from tests.rollout.standin_engine import StandInEngine

METHODS = ("generate", "generate_group", "abort_requests", "pause_generation", "continue_generation",
           "spread_calls", "update_weights", "release_memory", "resume_memory", "fault_metrics", "check_health",
           "shutdown")
ATTRIBUTES = {"dtype": (type(None), torch.dtype), "send_sampling_seed": (bool,),
              "stop_check": (type(None), type(lambda: None))}
URLS = ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]


def _scripted_engines() -> list[type]:
    """The tests' scripted engines (imported where they are defined)."""
    from tests.rollout.sglang.test_partial_generation import FakeEngine as PartialFake
    from tests.rollout.sglang.test_weight_drain import _HalfReader
    from tests.training.asynchronous.test_producer import FakeEngine, _LateRequestEngine, _SyncEngine
    from tests.training.test_partial_rollouts import ScriptedServers, SyncOnly
    from tests.test_evaluation import FakeEngine as EvalFake
    from tests.test_evaluation import OracleEngine
    from tests.training.test_reward_counts import _Engine
    from tests.tools._load import load_tool
    bench = load_tool("bench/host_step")  # a benchmark's engines run the loops too
    return [StandInEngine, PartialFake, _HalfReader, FakeEngine, _LateRequestEngine, _SyncEngine, ScriptedServers,
            SyncOnly, _Engine, EvalFake, OracleEngine, bench._ChunkedEngine, bench._AnswerEngine]


def _shape(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_the_protocol_lists_what_the_loops_call():
    declared = tuple(n for n, v in vars(RolloutEngine).items() if callable(v) and not n.startswith("_"))
    assert sorted(declared) == sorted(METHODS)
    assert set(RolloutEngine.__annotations__) == set(ATTRIBUTES)


@pytest.mark.parametrize("cls", [HFRolloutEngine, SGLangEngine, NodeServersEngine, *_scripted_engines()],
                         ids=lambda c: c.__qualname__)
def test_every_engine_class_has_every_method_with_its_signature(cls):
    for name in METHODS:
        method = getattr(cls, name, None)
        assert callable(method), f"{cls.__qualname__} has no {name}"
        assert _shape(method) == _shape(getattr(RolloutEngine, name)), f"{cls.__qualname__}.{name}"


def _hf():
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=32, eos_token_id=2)
    return HFRolloutEngine(cfg, dtype=torch.float32)


def _node(rank: int):
    cluster = None if rank else sglang_engine(server_urls=URLS, weight_sync="disk", colocate=False, launch=False,
                                              session=FakeSession(), device="cpu", wait_for_servers=False,
                                              send_sampling_seed=True)
    ctx = NodeContext(rank=rank, node=rank, local_rank=0, num_nodes=2, ranks_per_node=1)
    return NodeServersEngine(ctx=ctx, slots=[], own=[], cluster=cluster, node_sync=None, weight_sync="disk",
                             leaders_group=None, dtype=torch.float32)


def test_every_engine_object_is_a_rollout_engine_with_its_attributes():
    engines = [_hf(), sglang_engine(server_urls=URLS, weight_sync="disk", colocate=False, launch=False,
                                    session=FakeSession(), device="cpu", wait_for_servers=False),
               _node(0), _node(1), *(StandInEngine(),)]
    for eng in engines:
        assert isinstance(eng, RolloutEngine), type(eng).__name__
        for name, types in ATTRIBUTES.items():
            assert isinstance(getattr(eng, name), types), (type(eng).__name__, name)
    assert engines[2].send_sampling_seed and not engines[3].send_sampling_seed  # rank 0's engine's setting


def test_node_servers_generate_groups_on_every_server():
    """Over-sampling's per-group call through the trainer's engine: successive groups start on
    successive servers, each row with its own budget; other leaders refuse it."""
    node = _node(0)
    sess = node.cluster.http.session
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=8)
    got = [node.generate_group([RowRequest((5, 6), 3, seed=1), RowRequest((7,), 2, seed=2)], params)
           for _ in range(2)]
    assert [[r.token_ids for r in g] for g in got] == [[(6, 7, 8), (8, 9)]] * 2
    assert [u for u, _ in sess.posts("/generate")] == [u + "/generate" for u in URLS]
    node.abort_requests()
    assert [u for u, _ in sess.posts("/abort_request")] == [u + "/abort_request" for u in URLS]
    with pytest.raises(RuntimeError, match="runs on global rank 0"):
        _node(1).generate_group([RowRequest((5,), 1)], params)


def test_hf_engine_defines_what_means_nothing_for_it():
    """Tagged updates reach the samples' versions; the server-only calls are no-ops or refusals."""
    eng = _hf()
    eng.update_weights(list(eng.model.state_dict().items()), weight_version=4)
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=3, seed=0)
    (sample,), = eng.generate([[3, 4]], params)
    assert sample.weight_versions.tolist() == [4] * len(sample.response_ids)
    eng.abort_requests()
    eng.spread_calls(True)
    eng.check_health()
    assert eng.fault_metrics() == {}
    with pytest.raises(NotImplementedError, match="rollout.engine=sglang"):
        eng.generate_group([RowRequest((3,), 2)], params)
    with pytest.raises(NotImplementedError, match="rollout.engine=sglang"):
        eng.pause_generation()
    eng.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        eng.check_health()
