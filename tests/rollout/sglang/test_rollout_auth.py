"""The rollout servers' API key: key files, the header on every request, the key kept off
command lines and out of logs (no server), then the session's real SGLang server, which requires
the key: refusals without it, its listening socket, its log."""

import os
import subprocess
import stat
import sys

import pytest
import requests
import torch

from hapo_megatron.algo import EntropyStats
from hapo_megatron.rollout.sglang import api_key as ak
from hapo_megatron.rollout.sglang import engine as se
from hapo_megatron.rollout.sglang import launch as sglang_launch
from hapo_megatron.rollout.sglang import weight_sync as ws
from hapo_megatron.rollout.engine import SamplingParams
from hapo_megatron.rollout.sglang.client import SGLangError, SGLangHTTP, ServerHandle

from .fake_sglang import FakeProcess, FakeSession
from tests.rollout.sglang.engines import sglang_engine

KEY = "k3y-for-the-tests_0123456789"


@pytest.fixture(autouse=True)
def no_key_in_env(monkeypatch):
    monkeypatch.delenv(ak.API_KEY_ENV, raising=False)


# ---------------------------------------------------------------- key and key file
def test_key_file_is_owner_only_from_creation(tmp_path, monkeypatch):
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open",
                        lambda p, flags, mode=0o777: opened.append((flags, mode)) or real_open(p, flags, mode))
    old = os.umask(0)  # a permissive umask must not widen it
    try:
        path = str(tmp_path / "run" / ak.KEY_FILE_NAME)
        ak.write_key_file(path, KEY)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    flags, mode = opened[0]  # created with its final mode: never readable by others, not even briefly
    assert flags & os.O_CREAT and flags & os.O_EXCL and mode == 0o600
    assert ak.read_key_file(path) == KEY
    with pytest.raises(FileExistsError):
        ak.write_key_file(path, "another")
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        ak.read_key_file(path)


def test_resolve_api_key_order(tmp_path, monkeypatch):
    path = str(tmp_path / ak.KEY_FILE_NAME)
    assert ak.resolve_api_key(path) is None and not os.path.exists(path)  # attach, nothing known: no key
    made = ak.resolve_api_key(path, create=True)
    assert len(made) >= 40 and ak.read_key_file(path) == made
    assert ak.resolve_api_key(path, create=True) == made  # a second node / a resumed run reuses it
    assert ak.resolve_api_key(None, create=True) not in (None, made)  # no file: a fresh one in memory
    monkeypatch.setenv(ak.API_KEY_ENV, KEY)
    assert ak.resolve_api_key(path, create=True) == KEY  # a user's own servers


# ---------------------------------------------------------------- the header on every request
def test_every_request_carries_the_key(tmp_path):
    sess = FakeSession()
    eng = sglang_engine(server_urls=["http://a:1", "http://b:2"], colocate=False, weight_sync="disk",
                          session=sess, launch=False, api_key=KEY, disk_sync_dir=str(tmp_path))
    eng.generate([[1, 2], [3]], SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=2))
    eng.update_weights(iter([("w", torch.zeros(2))]))
    eng.check_health()
    assert {c[1].rsplit("/", 1)[1] for c in sess.calls} >= {"health", "generate", "update_weights_from_disk"}
    assert sess.headers == [{"Authorization": f"Bearer {KEY}"}] * len(sess.calls)
    keyless = FakeSession()
    sglang_engine(server_urls=["http://a:1"], session=keyless, launch=False).check_health()
    assert keyless.headers and set(keyless.headers) == {None}  # no key known: no header at all


def test_attached_engine_reads_the_key_file_and_a_refusal_says_why(tmp_path):
    path = str(tmp_path / ak.KEY_FILE_NAME)
    ak.write_key_file(path, KEY)
    sess = FakeSession(failures={"/generate": [401]})
    eng = sglang_engine(server_urls=["http://a:1"], session=sess, launch=False, key_file=path)
    with pytest.raises(SGLangError, match="HTTP 401.*HAPO_ROLLOUT_API_KEY"):
        eng.generate([[1]], SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=1))
    assert sess.headers[-1] == {"Authorization": f"Bearer {KEY}"}
    assert len(sess.posts("/generate")) == 1  # 401 is final, not retried


def test_launched_servers_get_the_key_and_the_file(monkeypatch, tmp_path):
    started = []

    def fake_start(cmd, url, **kw):
        started.append((cmd, kw))
        return ServerHandle(url=url)

    monkeypatch.setattr(sglang_launch, "start_process", fake_start)
    path = str(tmp_path / "run" / ak.KEY_FILE_NAME)
    sess = FakeSession()
    eng = sglang_engine(model_path=str(tmp_path), num_servers=2, session=sess, log_dir=str(tmp_path),
                          device="cpu", weight_sync="disk", key_file=path)
    key = ak.read_key_file(path)
    assert [kw["api_key"] for _, kw in started] == [key] * 2  # both servers
    for cmd, _ in started:
        assert key not in " ".join(cmd) and "-c" in cmd  # the key reaches them through the environment
    assert "--admin-api-key" in started[0][0][started[0][0].index("-c") + 1]
    eng.generate([[1]], SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=1))
    assert sess.headers[-1] == {"Authorization": f"Bearer {key}"}


# ---------------------------------------------------------------- keyed processes: argv and log
FAKE_SERVER = """import os, sys
print("argv", sys.argv[1:], "env", os.environ.get("HAPO_ROLLOUT_API_KEY"), flush=True)
"""


def test_keyed_process_gets_the_key_in_its_argv_only_and_its_log_is_redacted(tmp_path):
    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    cmd = [sys.executable, *sglang_launch.module_argv("fake_server", sglang_launch.SERVER_KEY_FLAGS), "--port", "1"]
    assert KEY not in " ".join(cmd)
    log = tmp_path / "server.log"
    h = sglang_launch.start_process(cmd, "http://127.0.0.1:1", log_path=str(log), env=env, api_key=KEY)
    assert h.process.wait(timeout=60) == 0
    h.log_copier.join(timeout=10)
    text = log.read_text()
    assert KEY not in text
    # the key was appended to the program's own argv (and removed from its environment)
    r = ak.REDACTED
    assert f"['--port', '1', '--api-key={r}', '--admin-api-key={r}'] env None" in text
    bare = sglang_launch.start_process(cmd, "http://127.0.0.1:1", log_path=str(tmp_path / "bare.log"),
                                       env={**env, ak.API_KEY_ENV: KEY})  # a key we did not hand over
    assert bare.process.wait(timeout=60) != 0
    assert "HAPO_ROLLOUT_API_KEY is not set" in (tmp_path / "bare.log").read_text()


ARGPARSE_SERVER = """import argparse
p = argparse.ArgumentParser()
p.add_argument("--port")
p.add_argument("--api-key")
p.add_argument("--admin-api-key")
a = p.parse_args()
print("parsed", a.api_key == a.admin_api_key == "-leading-dash-key", flush=True)
"""


def test_a_key_starting_with_a_dash_reaches_an_argparse_server(tmp_path):
    """secrets.token_urlsafe starts with '-' one time in 64: as a separate argv word argparse took
    it for an option and SGLang exited ("--api-key: expected one argument"); FLAG=KEY is one word."""
    (tmp_path / "argparse_server.py").write_text(ARGPARSE_SERVER)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    cmd = [sys.executable, *sglang_launch.module_argv("argparse_server", sglang_launch.SERVER_KEY_FLAGS),
           "--port", "1"]
    out = subprocess.run(cmd, env={**env, ak.API_KEY_ENV: "-leading-dash-key"}, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "parsed True" in out.stdout


def test_serve_hands_every_server_the_shared_key(monkeypatch, tmp_path):
    from hapo_megatron.rollout.sglang import serve

    got = []

    def fake_start(cmd, url, **kw):
        got.append((cmd, kw["api_key"]))
        return ServerHandle(url=url, process=FakeProcess(returncode=1))  # exits at once: serve stops

    monkeypatch.setattr(serve.launch, "start_process", fake_start)
    monkeypatch.setattr(serve.signal, "signal", lambda *a: None)  # keep pytest's own handlers
    key_file = str(tmp_path / "run" / ak.KEY_FILE_NAME)
    ak.write_key_file(key_file, KEY)  # made by another node first
    args = ["--model-path", "/m", "--num-servers", "2", "--host", "127.0.0.1", "--device", "cpu",
            "--log-dir", str(tmp_path / "logs"), "--api-key-file", key_file]
    assert serve.main(args) == 1
    assert [k for _, k in got] == [KEY, KEY] and all("--admin-api-key" in " ".join(c) for c, _ in got)
    got.clear()
    assert serve.main(args[:-2]) == 1  # no file named: a new key in LOG_DIR/rollout_api_key
    assert [k for _, k in got] == [ak.read_key_file(str(tmp_path / "logs" / ak.KEY_FILE_NAME))] * 2


# ---------------------------------------------------------------- the real server requires the key
def _refusal_bodies():
    plain = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=2)
    adaptive = plain.with_(adaptive=True, entropy_stats=EntropyStats.neutral(), temperature_tau=0.5,
                           h_hat_mode="signed")
    (blob,), _ = ws.serialize_bucket_for_sglang([("lm_head.weight", torch.zeros(4, 4))])
    bucket = [("lm_head.weight", torch.zeros(4, 4))]
    return {
        "generate": ("/generate", se.generate_payload([[1, 2]], plain)),
        "custom logit processor": ("/generate", se.generate_payload([[1, 2]], adaptive)),
        "tensor update": ("/update_weights_from_tensor", ws.tensor_update_payload([blob], flush_cache=True)),
        "disk update": ("/update_weights_from_disk", {"model_path": "/tmp/any/path", "flush_cache": True}),
        "begin update": ("/begin_weight_update", {}),
        "end update": ("/end_weight_update", {}),
        "NCCL group": ("/init_weights_update_group", ws.init_group_payload(
            master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2, group_name="g")),
        "NCCL update": ("/update_weights_from_distributed", ws.distributed_update_payload(
            bucket, group_name="g", flush_cache=True)),
        "release memory": ("/release_memory_occupation", {}),
    }


def test_real_server_refuses_requests_without_the_key(real_server, real_api_key):
    bodies = _refusal_bodies()
    assert "custom_logit_processor" in bodies["custom logit processor"][1]
    status = {}
    for what, (path, body) in bodies.items():
        for who, headers in (("no key", {}), ("wrong key", ak.auth_headers(KEY))):
            answer = requests.post(real_server.url + path, json=body, headers=headers, timeout=120)
            status[what, who] = answer.status_code
    assert set(status.values()) == {401}, status
    # with the key: the same server answers (weights and processor: the other real-server tests)
    http = SGLangHTTP(timeout_s=120, max_retries=0, api_key=real_api_key)
    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=2, adaptive=True,
                            entropy_stats=EntropyStats.neutral(), temperature_tau=0.05, h_hat_mode="signed")
    answer = http.request(real_server, "/generate", se.generate_payload([[1, 2]], params))
    assert len(se.parse_generate_item(answer[0])[0]) == 2


def test_real_server_listens_on_loopback_only(real_server, real_api_key):
    psutil = pytest.importorskip("psutil")
    top = psutil.Process(real_server.process.pid)
    tree = [top] + top.children(recursive=True)
    listening = [(c.laddr.ip, c.laddr.port, p.name()) for p in tree for c in p.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    port = int(real_server.url.rsplit(":", 1)[1])
    assert [(ip, name) for ip, p, name in listening if p == port] == [("127.0.0.1", top.name())], listening
    # every other socket too, except one: the rendezvous store of the scheduler's own tensor-parallel
    # process group (torch's TCPStore binds all interfaces, whatever host it is given; README, Security)
    wide = [(p, name) for ip, p, name in listening if ip not in ("127.0.0.1", "::1")]
    assert len(wide) <= 1 and all(name == "sglang::scheduler" for _, name in wide), listening
    assert not any(real_api_key in " ".join(p.cmdline()) for p in tree)  # ps shows no key


def test_real_server_log_has_the_key_redacted(real_server, real_api_key):
    with open(real_server.log_path) as f:
        text = f.read()
    assert real_api_key not in text
    assert ak.REDACTED in text  # SGLang prints its arguments, key included: it was there to redact
