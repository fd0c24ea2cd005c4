"""Server placement over nodes: the pure plan, the trainer's preflight check, and two simulated
nodes (two torchrun agents on localhost, stand-in servers) going through the trainer's path."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from hapo_megatron.rollout.sglang.placement import NodeContext, ServerSlot, plan_servers, server_host
from tests.rollout.sglang.engines import sglang_engine

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))


def _plan(**kw):
    args = dict(num_servers=0, server_tp_size=2, num_nodes=2, ranks_per_node=8, colocate=True, gpus_per_node=8,
                port_base=30000)
    args.update(kw)
    return plan_servers(**args)


def test_every_node_runs_its_share_on_its_own_gpus():
    plan = _plan()  # 2 nodes x 8 GPUs, TP 2: four servers per node on GPU pairs, job-unique ports
    assert [(s.node, s.gpu_ids) for s in plan] == [(n, (g, g + 1)) for n in (0, 1) for g in (0, 2, 4, 6)]
    assert [s.port for s in plan] == list(range(30000, 30008)) and [s.index for s in plan] == list(range(8))
    # the recipe's old "scale with the node count" setting (8 servers x TP 2 on 2 nodes) now fits
    assert _plan(num_servers=8) == plan
    # fewer servers than the nodes hold: spread evenly, the first nodes take the remainder
    assert [(s.node, s.gpu_ids) for s in _plan(num_servers=3)] == [(0, (0, 1)), (0, (2, 3)), (1, (0, 1))]
    # separate GPUs: after the trainer's; CPU servers (no GPU count) have no limit
    assert [s.gpu_ids for s in _plan(colocate=False, ranks_per_node=4, num_servers=4)] == [(4, 5), (6, 7)] * 2
    assert len(_plan(colocate=False, gpus_per_node=None, num_servers=6)) == 6
    assert _plan(num_nodes=1, ranks_per_node=1, server_tp_size=1, num_servers=1) == [ServerSlot(0, 0, (0,), 30000)]


def test_plans_that_do_not_fit_name_the_fields():
    with pytest.raises(ValueError, match=r"num_servers=16 x server_tp_size=2 needs 32 GPUs.*2 node\(s\) hold 4"):
        _plan(num_servers=16)
    with pytest.raises(ValueError, match="one SGLang server needs rollout.sglang.server_tp_size=16 GPUs.*not span"):
        _plan(server_tp_size=16)
    with pytest.raises(ValueError, match="server_tp_size=2 GPUs but has only the 0 GPUs"):
        _plan(colocate=False)  # every GPU trains: nothing left for separate servers
    with pytest.raises(ValueError, match="port_base=65530 leaves no room for 8"):
        _plan(port_base=65530)


def test_node_context_and_bind_address():
    env = {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1", "GROUP_RANK": "1"}
    ctx = NodeContext.from_env(3, 4, env)
    assert (ctx.node, ctx.local_rank, ctx.num_nodes, ctx.is_node_leader, ctx.leader_ranks()) == (1, 1, 2, False, [0, 2])
    assert NodeContext.from_env(0, 1, {}).num_nodes == 1
    with pytest.raises(ValueError, match="not a multiple of LOCAL_WORLD_SIZE=3"):
        NodeContext.from_env(0, 4, {"LOCAL_WORLD_SIZE": "3"})
    assert server_host(1, {}) == "127.0.0.1"  # one node: loopback
    assert server_host(2, {"MASTER_ADDR": "node0"}, node_ip=lambda toward: f"toward-{toward}") == "toward-node0"
    assert server_host(2, {"HAPO_NODE_ADDR": "10.0.0.7"}) == "10.0.0.7"


def test_preflight_checks_the_plan():
    from hapo_megatron.config import HapoConfig
    from hapo_megatron.train import check_server_placement
    cfg = HapoConfig.from_dict({"rollout": {"engine": "sglang", "sglang": {"num_servers": 8, "server_tp_size": 2}}})
    two_nodes = {"RANK": "0", "LOCAL_WORLD_SIZE": "8"}
    check_server_placement(cfg, 16, two_nodes)  # 4 servers per node
    with pytest.raises(ValueError, match="num_servers=8 x server_tp_size=2 needs 16 GPUs"):
        check_server_placement(cfg, 8, {"RANK": "0", "LOCAL_WORLD_SIZE": "8"})  # one node holds 4
    cfg.rollout.sglang.server_urls = ["http://node1:30000"]  # attached: placed by whoever started them
    check_server_placement(cfg, 8, {"LOCAL_WORLD_SIZE": "8"})


def test_disk_sync_rank0_updates_every_node_the_others_keep_pace(tmp_path):
    import torch

    from hapo_megatron.rollout.sglang.node_servers import NodeServersEngine

    from .fake_sglang import FakeSession
    urls = ["http://127.0.0.1:30000", "http://10.0.0.2:30001"]  # node 0's and node 1's server
    sess = FakeSession()
    cluster = sglang_engine(server_urls=urls, weight_sync="disk", colocate=True, session=sess, launch=False,
                           disk_sync_dir=str(tmp_path / "w"), device="cuda", wait_for_servers=False)
    weights = [("model.norm.weight", torch.ones(4)), ("lm_head.weight", torch.ones(2, 4))]
    drained = []

    def stream():
        for item in weights:
            drained.append(item[0])
            yield item

    def leader(rank, cluster):
        ctx = NodeContext(rank=rank, node=rank // 2, local_rank=0, num_nodes=2, ranks_per_node=2)
        return NodeServersEngine(ctx=ctx, slots=[], own=[], cluster=cluster, node_sync=None, weight_sync="disk",
                                 leaders_group=None, dtype=torch.float32)

    leader(0, cluster).update_weights(stream())
    assert [u for u, _ in sess.posts("/update_weights_from_disk")] == [u + "/update_weights_from_disk" for u in urls]
    other = leader(2, None)
    other.update_weights(stream())  # posts nothing, but consumes the (collective) export
    assert len(drained) == 4 and len(sess.calls) == 2 and os.path.isfile(tmp_path / "w" / "model-00001.safetensors")
    with pytest.raises(RuntimeError, match="generation runs on global rank 0"):
        other.generate([[1]], None)
    other.release_memory()  # rank 0 manages every server's memory; a no-op elsewhere
    assert len(sess.calls) == 2


def test_launched_servers_take_asynchronous_updates_and_pauses(tmp_path):
    """Asynchronous rollouts with launched servers (no server_urls): rank 0's node engine pauses and
    continues every server and tags each update with its version; flush_cache=False (pause_mode
    in_place) reaches the servers' update request."""
    import torch

    from hapo_megatron.rollout.sglang.node_servers import NodeServersEngine

    from .fake_sglang import FakeSession
    urls = ["http://127.0.0.1:30000", "http://10.0.0.2:30001"]
    sess = FakeSession()
    cluster = sglang_engine(server_urls=urls, weight_sync="disk", colocate=False, session=sess, launch=False,
                            disk_sync_dir=str(tmp_path / "w"), device="cuda", wait_for_servers=False)
    ctx = NodeContext(rank=0, node=0, local_rank=0, num_nodes=2, ranks_per_node=2)
    node = NodeServersEngine(ctx=ctx, slots=[], own=[], cluster=cluster, node_sync=None, weight_sync="disk",
                             leaders_group=None, dtype=torch.float32)
    node.pause_generation("in_place")
    node.update_weights(iter([("lm_head.weight", torch.ones(2, 4))]), weight_version=3, flush_cache=False)
    node.continue_generation()
    paths = [url.split("/", 3)[-1] for m, url, _ in sess.calls if m == "POST"]
    assert paths == ["pause_generation"] * 2 + ["update_weights_from_disk"] * 2 + ["continue_generation"] * 2
    assert [b["mode"] for _, b in sess.posts("/pause_generation")] == ["in_place"] * 2
    assert [(b["weight_version"], b["flush_cache"]) for _, b in sess.posts("/update_weights_from_disk")] == \
        [("3", False)] * 2
    other = NodeServersEngine(ctx=NodeContext(rank=2, node=1, local_rank=0, num_nodes=2, ranks_per_node=2), slots=[],
                              own=[], cluster=None, node_sync=None, weight_sync="disk", leaders_group=None,
                              dtype=torch.float32)
    with pytest.raises(RuntimeError, match="pausing generation runs on global rank 0"):
        other.pause_generation()


def test_a_single_engine_fills_its_node_with_num_servers_0(monkeypatch, tmp_path):
    """`hapo eval` / doctor build one engine in one process from the recipes' num_servers: 0."""
    import torch

    from hapo_megatron.rollout.sglang import launch as sglang_launch
    from hapo_megatron.rollout.sglang.client import ServerHandle

    from .fake_sglang import FakeSession
    started = []
    monkeypatch.setattr(sglang_launch, "start_process", lambda cmd, url, **kw: started.append(cmd) or ServerHandle(url))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    sglang_engine(model_path=str(tmp_path), num_servers=0, server_tp_size=2, session=FakeSession(), device="cuda",
                 log_dir=str(tmp_path), weight_sync="disk")
    assert [c[c.index("--base-gpu-id") + 1] for c in started] == ["0", "2", "4", "6"]


def _free_port_range(n: int) -> int:
    """A port ``p`` with ``p .. p + n - 1`` free on 127.0.0.1 and 127.0.0.2."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            for host in ("127.0.0.1", "127.0.0.2"):
                for port in range(base, base + n):
                    with socket.socket() as s:
                        s.bind((host, port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range")


def _records(out_dir):
    recs = {}
    for f in os.listdir(out_dir):
        if f.startswith("server_"):
            with open(os.path.join(out_dir, f)) as fh:
                lines = [json.loads(line) for line in fh]
            recs[lines[0]["bound"], int(f[7:-6])] = lines
    return recs


def _arg(argv, flag):
    """The value of ``flag`` in ``argv``: ``FLAG VALUE`` or ``FLAG=VALUE`` (how the key flags come)."""
    joined = [a.split("=", 1)[1] for a in argv if a.startswith(flag + "=")]
    return joined[-1] if joined else argv[argv.index(flag) + 1]


def test_two_nodes_place_route_and_sync(tmp_path):
    """Two torchrun agents (nodes) x 2 ranks: each node's first rank starts two stand-in servers
    on its own address (127.0.0.1 / 127.0.0.2) and GPUs 0 and 1; rank 0 routes over all four,
    and each node's servers get their weights from their own node's rank, after rank 0 resumed
    them and before it generates again."""
    out, base, master = str(tmp_path), _free_port_range(4), _free_port_range(1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HAPO_TEST_STANDIN_DIR": out}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
         "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(master),
         os.path.join(HERE, "placement_worker.py"), out, str(base)],
        # node 1's servers take 1 s per weight update: rank 0 must still wait for them
        env={**env, "HAPO_NODE_ADDR": f"127.0.0.{n + 1}", "HAPO_TEST_STANDIN_UPDATE_DELAY_S": str(n)},
        cwd=REPO, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=300)[0])  # ~35 s on an idle 2-core machine
    except subprocess.TimeoutExpired:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
        pytest.fail("two-node run hung:\n" + "\n".join(p.communicate()[0][-3000:] for p in procs))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for (_, _), lines in _records(out).items():  # servers run in sessions of their own
            try:
                os.kill(lines[0]["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-4000:] for log in logs)
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(4)]
    assert [r["has_engine"] for r in ranks] == [True, False, True, False]  # node leaders only
    # rank 0 routes over both nodes' servers, each on its node's address
    assert ranks[0]["urls"] == [f"http://127.0.0.{1 + i // 2}:{base + i}" for i in range(4)]
    assert ranks[0]["first_response"] == [101, 102]
    recs = _records(out)
    assert all(not os.path.exists(f"/proc/{lines[0]['pid']}") for lines in recs.values())  # stopped at shutdown
    assert sorted(recs) == [("127.0.0.1", base), ("127.0.0.1", base + 1), ("127.0.0.2", base + 2),
                            ("127.0.0.2", base + 3)]
    for (host, port), lines in recs.items():
        node, local = int(host[-1]) - 1, (port - base) % 2
        start = lines[0]
        assert start["ppid"] == ranks[2 * node]["pid"]  # started by its own node's first rank
        argv = start["argv"]
        assert (_arg(argv, "--host"), _arg(argv, "--port"), _arg(argv, "--base-gpu-id"), _arg(argv, "--tp-size")) == \
            (host, str(port), str(local), "1")
        assert "--enable-memory-saver" in argv and "--enable-custom-logit-processor" in argv
        assert _arg(argv, "--api-key") == _arg(argv, "--admin-api-key") == "<key>"  # per-run key, every node
        paths = [x["path"] for x in lines[1:]]
        assert paths == ["/release_memory_occupation", "/resume_memory_occupation", "/generate",
                         "/release_memory_occupation", "/resume_memory_occupation", "/begin_weight_update",
                         "/update_weights_from_tensor", "/end_weight_update", "/resume_memory_occupation",
                         "/generate"], (host, port, paths)
        update = lines[paths.index("/update_weights_from_tensor") + 1]["body"]
        assert update["serialized_named_tensors"] == [f"node{node}:" + ",".join(
            ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"])]
        assert update["flush_cache"] is True
        assert lines[paths.index("/resume_memory_occupation", 3) + 1]["body"]["tags"] == ["weights"]
