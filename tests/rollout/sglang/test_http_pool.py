"""The client's connection pool follows the calls in flight (`rollout/sglang/client.py`;
docs/multinode.md, "Network settings worth knowing").

A loopback HTTP/1.1 server answers ``/generate`` only once all N calls of a round are in
flight (a barrier in its handler), so every round has exactly N calls at once. After the first
rounds the session's adapter pools N connections per host, and a further round reuses the
connections of the round before it: no new TCP connection. Mutation tried: the client without
its pool sizing (requests' 10 per host): the pool size stays 10 and each round opens N - 10 new
connections.

A replaced adapter stays open while calls that entered before its replacement are in flight:
one of them may hold its pool, and urllib3 fails a call on a closed pool (``ClosedPoolError``)
without reaching the server. Mutation tried: closing the old adapter at once (the client before
this): the retired adapter is closed with three calls still in flight.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import requests

from hapo_megatron.rollout.sglang.client import DEFAULT_POOL_SIZE, ServerHandle, SGLangHTTP, _PoolSizer

N = 32  # calls in flight: well past requests' 10 per host


@pytest.fixture
def server():
    state = {"barrier": threading.Barrier(N), "ports": [], "lock": threading.Lock()}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a pooled connection serves the next call

        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with state["lock"]:
                state["ports"].append(self.client_address[1])
            # answer once all N calls of the round are in flight; a call that never arrives breaks
            # the barrier (every handler fails at once) instead of leaving the others to the timeout
            state["barrier"].wait(timeout=120)
            body = json.dumps({"ok": True}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    class Server(ThreadingHTTPServer):
        # socketserver listens with a backlog of 5: of N connects at once a few then wait on
        # SYN retransmits past the barrier's timeout (SGLang's uvicorn listens with 2048)
        request_queue_size = 4 * N

    httpd = Server(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", state
    httpd.shutdown()
    httpd.server_close()


def _round(http, url, state):
    """N concurrent calls; the client ports the server saw in this round."""
    with state["lock"]:
        state["ports"].clear()
    with ThreadPoolExecutor(max_workers=N) as pool:
        answers = list(pool.map(lambda _: http.request(ServerHandle(url=url), "/generate", {}), range(N)))
    assert answers == [{"ok": True}] * N
    with state["lock"]:
        return set(state["ports"])


def test_pool_size_follows_the_calls_in_flight(server):
    url, state = server
    http = SGLangHTTP(timeout_s=300, max_retries=0)

    def pool_size():
        return http.session.get_adapter(url).poolmanager.connection_pool_kw["maxsize"]

    assert pool_size() == DEFAULT_POOL_SIZE
    _round(http, url, state)
    assert pool_size() >= N
    # the round that grew the pool released the connections of the smaller pools; from then on
    # every round reuses the one before it
    second = _round(http, url, state)
    third = _round(http, url, state)
    assert len(third) == N and third == second


def test_an_injected_session_is_left_alone():
    class Fake:
        def post(self, url, json=None, timeout=None):
            return type("R", (), {"status_code": 200, "text": "{}", "json": lambda self: {}})()

    http = SGLangHTTP(timeout_s=10, max_retries=0, session=Fake())
    assert http.request(ServerHandle(url="http://127.0.0.1:9"), "/generate", {}) == {}
    assert http._pool is None


def test_a_replaced_adapter_closes_only_after_the_calls_that_may_hold_it():
    session = requests.Session()
    closed = []
    first = session.adapters["http://"]
    first.close = lambda: closed.append("first")
    sizer = _PoolSizer(session)
    url = "http://127.0.0.1:9/generate"
    early = [sizer.enter(url) for _ in range(DEFAULT_POOL_SIZE)]
    late = sizer.enter(url)  # the call past the size mounts a larger pool
    assert session.adapters["http://"] is not first
    second = session.adapters["http://"]
    second.close = lambda: closed.append("second")
    sizer.leave(late)
    for generation in early[:-1]:
        sizer.leave(generation)
    assert closed == []  # one call from before the mount is still in flight: it may hold a pool
    sizer.leave(early[-1])
    assert closed == ["first"]  # the https adapter is closed too (not recorded); the live one stays
    assert session.adapters["http://"] is second and sizer.in_flight == 0
