"""The distributed weight sync's process group (``rollout/sglang/sync_group.py``) in torchrun's
environment, and what a launched server inherits of it (``launch.server_env``)."""

import os
import subprocess
import sys

import torch

from hapo_megatron.rollout.sglang import sync_group
from hapo_megatron.rollout.sglang.launch import server_env
from tests.rollout.sglang.real_sglang import require_sglang
from tests.training.tiny_setup import ROOT

#: what torchrun's agent puts in a worker's environment (torch/distributed/elastic/agent/server/
#: local_elastic_agent.py), with values of a one-node run
TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "0", "ROLE_WORLD_SIZE": "2", "ROLE_NAME": "default",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
                "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_ERROR_FILE": "/tmp/error.json"}


def test_distributed_sync_under_torchrun_hosts_its_own_store(tmp_path):
    """Rank 0 of a torchrun job (``TORCHELASTIC_USE_AGENT_STORE=True``) syncs weights to a server's
    side of the group (SGLang's own ``init_custom_process_group`` through ``tcp://``) over gloo on CPU:
    the server receives the flattened bucket byte for byte.
    Mutations: rank 0 joins through ``init_method="tcp://..."`` as before (it then waits as a store
    client, as does the server, and the run below stops at its bound); the bucket left on "cuda"
    (``_sync_device``) or backend "nccl" on CPU: the sync raises."""
    require_sglang()
    env = {**os.environ, **TORCHRUN_ENV, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    # the bound only turns a hang (the failure this test is about) into a failure
    run = subprocess.run([sys.executable, "-m", "tests.rollout.sglang.sync_group_worker", str(tmp_path)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    from tests.rollout.sglang.sync_group_worker import tensors
    want = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in tensors()])
    assert torch.equal(torch.load(tmp_path / "received.pt"), want)


def test_backend_and_buffers_follow_the_servers_device():
    assert (sync_group.sync_backend("cuda"), sync_group.sync_buffer_device("cuda")) == ("nccl", "cuda")
    assert (sync_group.sync_backend("cpu"), sync_group.sync_buffer_device("cpu")) == ("gloo", "cpu")


def test_hosted_store_serves_a_client_while_torchrun_asks_for_the_agent_store(monkeypatch):
    """The store is this process's, whatever torchrun's variable says: a client reaches it."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    store = sync_group.host_store("127.0.0.1", 2)
    store.set("k", "v")
    client = torch.distributed.TCPStore("127.0.0.1", store.port, 2, is_master=False)
    assert client.get("k") == b"v"


def test_server_env_drops_torchruns_variables():
    """A launched server's environment has none of torchrun's variables: with them SGLang's own
    process groups would rendezvous with the trainer's job, and TORCHELASTIC_USE_AGENT_STORE would
    make its weight-update rank a client of a store nobody hosts."""
    env = server_env(cpu=True, base={**TORCHRUN_ENV, "PATH": "/usr/bin", "OMP_NUM_THREADS": "1"})
    assert not set(TORCHRUN_ENV) & set(env)
    assert env["PATH"] == "/usr/bin" and env["OMP_NUM_THREADS"] == "1"

