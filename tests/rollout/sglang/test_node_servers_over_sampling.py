"""Over-sampling (``rollout.over_sampling: 1.5``) with servers the trainer launches
(``rollout.engine: sglang``, ``rollout.sglang.num_servers: 2``, no ``server_urls``): the engine comes
from the trainer's own `build.build_engine` (`node_servers.start_node_servers` launches the two
servers and hands rank 0 a `NodeServersEngine`), and the rollout stage runs on it as the trainer
runs it (`stages.generate_step`, tools/bench/oversampling.py). The servers are the paced stand-in
(tools/bench/paced_sglang_server.py, heavy-tailed lengths; it aborts on ``/abort_request`` and
continues a response sent back as prompt + partial) started from the real command line, the
stand-in's module in SGLang's place.

Mutation tried: `NodeServersEngine` without `generate_group` (over-sampling reached into the
engine's ``.supervisor``, which the node-servers engine never had) fails the first rollout with
AttributeError."""

from __future__ import annotations

import json
import os

import numpy as np

from hapo_megatron.config import load_config
from hapo_megatron.rollout.sglang import launch as launcher
from hapo_megatron.rollout.sglang.node_servers import NodeServersEngine
from hapo_megatron.training import build
from hapo_megatron.training.partial_rollouts import PartialPool
from tests.rollout.sglang.test_placement import _free_port_range
from tests.tools._load import load_tool

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tools", "bench")
B, N, MAX_LEN, STEPS = 2, 3, 24, 3


def _paced_servers(monkeypatch, record_dir: str) -> None:
    """The servers' real command line with the paced stand-in's module in SGLang's place."""
    real = launcher.server_command

    def paced(*a, **k):
        cmd = real(*a, **k)
        assert cmd[1] == "-c" and "sglang.launch_server" in cmd[2]  # the keyed launcher (launch.module_argv)
        return [cmd[0], "-c", cmd[2].replace("sglang.launch_server", "paced_sglang_server"), *cmd[3:],
                "--tokens-per-s", "300", "--length-median", "6"]
    monkeypatch.setattr(launcher, "server_command", paced)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [os.path.abspath(BENCH),
                                                                   os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("HAPO_TEST_STANDIN_DIR", record_dir)


def test_over_sampling_on_two_launched_servers(tmp_path, monkeypatch):
    _paced_servers(monkeypatch, str(tmp_path))
    monkeypatch.setenv("HAPO_SGLANG_SYNC_DIR", str(tmp_path / "weights"))
    base = _free_port_range(2)
    cfg = load_config(overrides=[
        "rollout.engine=sglang", "rollout.sglang.colocate=false", "rollout.over_sampling=1.5",
        "rollout.sglang.num_servers=2", f"rollout.sglang.port_base={base}", "rollout.sglang.weight_sync=disk",
        "model.hf_model_path=standin-model", f"trainer.run_dir={tmp_path / 'run'}"])
    engine = build.build_engine(cfg, None, None)
    try:
        assert isinstance(engine, NodeServersEngine)
        bench = load_tool("bench/oversampling")
        rt = bench.build_rt(None, over_sampling=1.5, batch=B, n=N, max_len=MAX_LEN, partial_mode="mask_prefix",
                            engine=engine)
        got = bench.run_steps(rt, STEPS)
    finally:
        engine.shutdown()
    for r in got:
        kept = r["kept"]
        assert len(kept) == B * N and (np.unique(kept.group_ids, return_counts=True)[1] == N).all()
        assert (kept.column("token_mask").lengths == kept.response_lengths).all()
    pool = PartialPool.from_dict(rt.rl.partial_rollouts)
    trained = [int(g) for r in got for g in dict.fromkeys(r["kept"].group_ids)]
    assert sorted(trained + [g.serial for g in pool.groups]) == list(range(pool.next_serial))
    for port in (base, base + 1):  # the groups' calls start on both servers
        with open(tmp_path / f"paced_{port}.jsonl") as f:
            assert any(json.loads(line)["path"] == "/generate" for line in f), port
