"""Failed rollout servers with a fake transport (rollout/sglang/server_supervisor.py): their requests go
to the others with the same body, launched ones are restarted and rejoin only through a whole
weight sync, and the run stops past max_restarts or with no server left."""

import atexit

import pytest

from hapo_megatron.config.sections import SGLangConfig
from hapo_megatron.rollout.sglang import engine as se
from hapo_megatron.rollout.engine import SamplingParams
from hapo_megatron.rollout.sglang.server_supervisor import IN_USE, LOST, RESTARTING, ServerPoolError
from hapo_megatron.rollout.sglang.client import SGLangError, ServerHandle

from .collective_worker import named_weights
from .fake_sglang import FakeProcess, FakeSession
from tests.rollout.sglang.engines import sglang_engine

URLS = ["http://a:1", "http://b:2"]
PARAMS = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=3, seed=5)
PROMPTS = [[10 * (p + 1)] for p in range(8)]  # 16 rows: 4 calls of 4 rows, 2 per server


class Restarts:
    """The restart callable of launched fake servers: records, and brings the server back
    (its /health answers, connections are accepted) unless ``comes_back`` is False."""

    def __init__(self, sess, comes_back=True):
        self.sess, self.comes_back, self.urls = sess, comes_back, []

    def __call__(self, handle):
        self.urls.append(handle.url)
        if self.comes_back:
            self.sess.down.discard(handle.url)
            self.sess.hung.discard(handle.url)


def launched(url):
    return ServerHandle(url=url, process=FakeProcess(), launch="a LaunchSpec")


def engine(sess, *, launch_handles=True, max_restarts=3, comes_back=True, log=None, **kw):
    handles = [launched(u) for u in URLS] if launch_handles else URLS
    eng = sglang_engine(server_urls=handles, session=sess, launch=False, colocate=False, weight_sync="disk",
                          wait_for_servers=False, requests_per_call=4, send_sampling_seed=True, max_retries=1,
                          max_restarts=max_restarts, **kw)
    eng.http.sleep = lambda s: None
    atexit.unregister(eng.shutdown)  # the fake processes have no process group to stop
    eng.supervisor.restart = Restarts(sess, comes_back)
    eng.supervisor._log = (log if log is not None else (lambda m: None))
    return eng


def responses(out):
    return [[(list(s.response_ids), list(s.rollout_logprobs)) for s in group] for group in out]


def bodies_by_rows(sess, url):
    return {tuple(map(tuple, b["input_ids"])): b for u, b in sess.posts("/generate") if u.startswith(url)}


def test_requests_of_a_refusing_server_go_to_the_other_with_the_same_body():
    want = responses(engine(FakeSession(), launch_handles=False).generate(PROMPTS, PARAMS))
    sess, lines = FakeSession(down={URLS[1]}, dead={URLS[1]}), []
    eng = engine(sess, launch_handles=False, log=lines.append)
    assert responses(eng.generate(PROMPTS, PARAMS)) == want  # nothing lost, nothing doubled, prompt order
    assert eng.supervisor.state == {0: IN_USE, 1: LOST}  # attached: nothing to restart
    # 1 or 2 calls (they run at once) reached b, each tried max_retries + 1 times
    sent_to_b = {id(b) for u, b in sess.posts("/generate") if u.startswith(URLS[1])}
    assert sent_to_b and eng.fault_metrics() == {"rollout/server_restarts": 0.0,
                                                 "rollout/requests_retried": 4.0 * len(sent_to_b)}
    assert any("http://b:2 is unhealthy" in line for line in lines)
    # the rows b never answered were sent to a as they were: same ids, same sampling seeds
    bodies = bodies_by_rows(sess, URLS[0])
    clean = FakeSession()
    engine(clean, launch_handles=False).generate(PROMPTS, PARAMS)
    assert bodies == bodies_by_rows(clean, "")  # every call's body, byte for byte, now all on a


def test_a_timeout_marks_a_wedged_server_after_one_attempt_and_it_is_restarted():
    """POSTs to b time out while its /health still answers (a stopped scheduler): one attempt,
    no retry on b, restarted, its rows answered by a."""
    sess, lines = FakeSession(hung={URLS[1]}), []
    eng = engine(sess, log=lines.append)
    out = eng.generate(PROMPTS, PARAMS)
    assert responses(out) == responses(engine(FakeSession()).generate(PROMPTS, PARAMS))
    assert len([u for u, _ in sess.posts("/generate") if u.startswith(URLS[1])]) == 1  # found on its first timeout
    assert eng.supervisor.restart.urls == [URLS[1]] and eng.supervisor.state[1] == RESTARTING
    assert any("no answer within 600 s" in line for line in lines)
    assert any("restarting SGLang server http://b:2 (restart 1 of at most 3" in line for line in lines)


def test_a_healthy_server_answering_an_error_is_not_replaced():
    sess = FakeSession(failures={"/generate": [500, 500]})  # both attempts of the first call
    eng = engine(sess)
    with pytest.raises(SGLangError, match="HTTP 500"):
        eng.generate([[1]], SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=2))
    assert eng.supervisor.state == {0: IN_USE, 1: IN_USE} and eng.supervisor.restart.urls == []


def test_a_restarted_server_serves_again_only_after_a_whole_weight_sync(tmp_path):
    sess = FakeSession(down={URLS[1]}, dead={URLS[1]})
    eng = engine(sess, comes_back=False, disk_sync_dir=str(tmp_path / "w"))
    eng.generate(PROMPTS, PARAMS)
    assert eng.supervisor.state[1] == RESTARTING
    sess.calls.clear()
    eng.generate(PROMPTS, PARAMS)  # restarted but not synced: not used
    assert {u.rsplit("/", 1)[0] for u, _ in sess.posts("/generate")} == {URLS[0]}
    eng.update_weights(iter(named_weights()))  # still starting (/health fails): left out of the sync
    assert [u.rsplit("/", 1)[0] for u, _ in sess.posts("/update_weights_from_disk")] == [URLS[0]]
    assert eng.supervisor.state[1] == RESTARTING
    sess.down.clear()
    sess.dead.clear()  # it answers now
    sess.calls.clear()
    eng.update_weights(iter(named_weights()))
    assert [u.rsplit("/", 1)[0] for u, _ in sess.posts("/update_weights_from_disk")] == URLS
    assert eng.supervisor.state == {0: IN_USE, 1: IN_USE}
    sess.calls.clear()
    eng.generate(PROMPTS, PARAMS)
    assert {u.rsplit("/", 1)[0] for u, _ in sess.posts("/generate")} == set(URLS)
    assert eng.fault_metrics()["rollout/server_restarts"] == 1.0


def test_a_server_failing_during_the_sync_is_restarted_and_never_used_with_stale_weights(tmp_path):
    sess = FakeSession()
    eng = engine(sess, comes_back=False, disk_sync_dir=str(tmp_path / "w"))
    sess.down.add(URLS[0])
    sess.dead.add(URLS[0])
    eng.update_weights(iter(named_weights()))  # a fails, b takes the new weights, the sync completes
    assert eng.supervisor.state == {0: RESTARTING, 1: IN_USE}
    assert eng.supervisor.restart.urls == [URLS[0]]
    sess.calls.clear()
    eng.generate(PROMPTS, PARAMS)
    assert {u.rsplit("/", 1)[0] for u, _ in sess.posts("/generate")} == {URLS[1]}


def test_past_max_restarts_the_run_stops_with_the_reason():
    sess = FakeSession(down={URLS[1]}, dead={URLS[1]})
    eng = engine(sess, max_restarts=1, comes_back=False)
    eng.generate(PROMPTS, PARAMS)  # restart 1 (the fake restart leaves b refusing)
    eng.supervisor.rejoined([1])  # as if it had taken a sync
    with pytest.raises(ServerPoolError, match=r"http://b:2 failed .*after 1 restart\(s\): "
                                              r"rollout.sglang.max_restarts=1 used up"):
        eng.generate(PROMPTS, PARAMS)


def test_no_server_left_stops_the_run_even_with_restarts_left():
    sess = FakeSession(down=set(URLS), dead=set(URLS))
    eng = engine(sess, comes_back=False)
    with pytest.raises(ServerPoolError, match="no SGLang server left in use"):
        eng.generate(PROMPTS, PARAMS)
    assert eng.supervisor.restart.urls == URLS
    with pytest.raises(ServerPoolError, match="weight sync: no SGLang server left in use"):  # not a silent no-op
        eng.update_weights(iter(named_weights()))


def test_max_restarts_comes_from_the_config():
    """Mutation: the engine's supervisor not reading ``cfg.max_restarts`` leaves 3."""
    cfg = SGLangConfig(server_urls=URLS, colocate=False, weight_sync="disk", max_restarts=1)
    eng = se.SGLangEngine(cfg, model_path="/m", session=FakeSession(), launch=False, quantization="none",
                          kv_cache_dtype="auto")
    assert eng.supervisor.max_restarts == 1
    with pytest.raises(ValueError, match="max_restarts"):
        SGLangConfig(max_restarts=-1).validate()


def test_timeout_is_not_retried_on_the_same_server_only_with_retry_timeouts_false():
    from hapo_megatron.rollout.sglang.client import SGLangHTTP, ServerUnreachableError

    sess = FakeSession(hung={URLS[0]})
    http = SGLangHTTP(session=sess, sleep=lambda s: None, max_retries=2, timeout_s=7)
    with pytest.raises(ServerUnreachableError, match="no answer within 7 s") as e:
        http.request(ServerHandle(URLS[0]), "/generate", {}, retry_timeouts=False)
    assert e.value.timed_out and len(sess.posts("/generate")) == 1
    with pytest.raises(ServerUnreachableError):
        http.request(ServerHandle(URLS[0]), "/generate", {})
    assert len(sess.posts("/generate")) == 1 + 3
    sess = FakeSession(down={URLS[0]})
    http = SGLangHTTP(session=sess, sleep=lambda s: None, max_retries=2, timeout_s=600.0)
    with pytest.raises(ServerUnreachableError) as e:  # refused connections are retried as before
        http.request(ServerHandle(URLS[0]), "/generate", {}, retry_timeouts=False)
    assert not e.value.timed_out and len(sess.posts("/generate")) == 3


def test_a_rejoining_server_that_fails_its_sync_stays_out_of_use(tmp_path):
    """Mutation: rejoining every candidate after the sync, failed or not -> b would serve with
    weights it never fully received."""
    sess = FakeSession(down={URLS[1]}, dead={URLS[1]})
    eng = engine(sess, disk_sync_dir=str(tmp_path / "w"))
    eng.generate(PROMPTS, PARAMS)  # b restarted (and answering: the fake restart brings it back)
    assert eng.supervisor.state[1] == RESTARTING
    sess.dead.clear()
    sess.failures["/update_weights_from_disk"] = [200, TimeoutError("read timed out")]  # a's fine, b's hangs
    eng.update_weights(iter(named_weights()))
    assert eng.supervisor.state == {0: IN_USE, 1: RESTARTING}
    assert eng.supervisor.restart.urls == [URLS[1], URLS[1]]


# ---------------------------------------------------------------- real processes (stand-in servers)
def test_standin_servers_killed_and_stopped_are_restarted_as_they_were_started(tmp_path):
    """Two stand-in server processes (tests/rollout/sglang/standin_sglang_server.py: starts in a
    fraction of a second, requires its API key): SIGKILL one, then SIGSTOP it; each time every row
    is answered, the process is started again with the same command line and environment (its
    start record), and it serves again after a weight sync."""
    import json
    import os
    import signal
    import sys

    from hapo_megatron.rollout.sglang.launch import free_port, start_process, stop_process

    standin = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin_sglang_server.py")
    key, handles = "k" * 32, []
    env = {**os.environ, "HAPO_TEST_STANDIN_DIR": str(tmp_path)}
    for i in range(2):
        port = free_port()
        handles.append(start_process([sys.executable, standin, "--host", "127.0.0.1", "--port", str(port),
                                      "--api-key", key], f"http://127.0.0.1:{port}",
                                     log_path=str(tmp_path / f"s{i}.log"), env=env, api_key=key))
    starts = lambda h: [r for r in map(json.loads, open(tmp_path / f"server_{h.url.rsplit(':', 1)[1]}.jsonl"))  # noqa: E731
                        if r["path"] == "start"]
    lines = []
    try:
        # request timeout: how long the stopped one takes to be found; a stand-in answers in milliseconds
        eng = sglang_engine(server_urls=handles, launch=False, colocate=False, weight_sync="disk", max_retries=0,
                              request_timeout_s=5.0, requests_per_call=4, api_key=key, max_restarts=2,
                              disk_sync_dir=str(tmp_path / "w"), launch_timeout_s=60)
        eng.supervisor._log = lines.append
        want = responses(eng.generate(PROMPTS, PARAMS))
        for sig in (signal.SIGKILL, signal.SIGSTOP):
            first_pid = handles[1].process.pid
            os.killpg(first_pid, sig)
            assert responses(eng.generate(PROMPTS, PARAMS)) == want
            assert eng.supervisor.state[1] == RESTARTING and handles[1].process.pid != first_pid
            eng.http.wait_healthy(handles[1], 60, poll_s=0.1)
            eng.update_weights(iter(named_weights()))
            assert eng.supervisor.state == {0: IN_USE, 1: IN_USE}
        runs = starts(handles[1])
        assert len(runs) == 3 and runs[0]["argv"] == runs[1]["argv"] == runs[2]["argv"]
        assert len({r["pid"] for r in runs}) == 3
        assert any("no answer within 5 s" in m for m in lines)  # the stopped one: found by its timeout
        assert eng.fault_metrics()["rollout/server_restarts"] == 2
    finally:
        for h in handles:
            stop_process(h, timeout_s=10)
