"""The asynchronous producer on the engine the trainer builds for the servers it launches
(`NodeServersEngine`, rollout/sglang/node_servers.py) over two stand-in servers that hold every
``/generate`` until an ``/abort_request`` reaches them: the groups in flight start on both
servers, and close() aborts them on both (docs/architecture.md, "The engine protocol").

Mutations tried, each alone failing the test: the producer's former probes, which the
node-servers engine did not pass: ``hasattr(engine, "spread_calls")`` (every group on server 0)
and ``hasattr(engine, "abort_requests")`` around close()'s abort (no server aborted)."""

from __future__ import annotations

import threading

import torch

from hapo_megatron.rollout.sglang.node_servers import NodeServersEngine
from hapo_megatron.rollout.sglang.placement import NodeContext
from tests.rollout.sglang.engines import sglang_engine
from tests.rollout.sglang.fake_sglang import FakeResponse, FakeSession
from tests.training.asynchronous.test_producer import _rt

URLS = ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
HOLD_BOUND_S = 60.0  # a request never aborted is answered anyway then: the test fails, not hangs


class HoldingServers(FakeSession):
    """``/generate`` waits until an ``/abort_request`` reaches its server, then answers with finish
    reason abort (as SGLang's abort_all); the URLs that got a ``/generate`` are in ``generating``."""

    def __init__(self):
        super().__init__()
        self.cond = threading.Condition()
        self.generating, self.aborted = set(), set()

    def post(self, url, json=None, timeout=None, headers=None):
        base, path = url.rsplit("/", 1)
        if path == "abort_request":
            with self.cond:
                self.aborted.add(base)
                self.cond.notify_all()
        if path != "generate":
            return super().post(url, json=json, timeout=timeout, headers=headers)
        with self.cond:
            self.calls.append(("POST", url, json))
            self.generating.add(base)
            self.cond.notify_all()
            self.cond.wait_for(lambda: base in self.aborted, timeout=HOLD_BOUND_S)
        return FakeResponse(200, [{"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"},
                                                                   "output_token_logprobs": []}}
                                  for _ in json["input_ids"]])


def test_groups_start_on_every_server_and_close_aborts_them():
    from hapo_megatron.training.asynchronous.producer import AsyncRollout
    servers = HoldingServers()
    cluster = sglang_engine(server_urls=URLS, weight_sync="disk", colocate=False, launch=False, session=servers,
                            device="cpu", wait_for_servers=False, max_retries=0)
    ctx = NodeContext(rank=0, node=0, local_rank=0, num_nodes=1, ranks_per_node=1)
    rt = _rt(1)  # 2 groups a batch, lag 1: 4 groups in flight at once
    rt.engine = NodeServersEngine(ctx=ctx, slots=[], own=[], cluster=cluster, node_sync=None, weight_sync="disk",
                                  leaders_group=None, dtype=torch.float32)
    ar = AsyncRollout(rt).start()
    try:
        with servers.cond:
            both = servers.cond.wait_for(lambda: servers.generating == set(URLS), timeout=HOLD_BOUND_S)
    finally:
        ar.close()
    assert both, f"only {sorted(servers.generating)} received groups"
    assert servers.aborted == set(URLS)
    assert ar._in_flight == 0 and not ar._thread.is_alive()
