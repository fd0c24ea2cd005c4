"""Process handling with real child processes (a tiny stand-in HTTP server, not SGLang)."""

import json
import os
import socket
import sys

import pytest

from hapo_megatron.rollout.sglang.client import SGLangHTTP, ServerDiedError
from hapo_megatron.rollout.sglang.launch import free_port, start_process, stop_process

STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin_sglang_server.py")


def test_start_health_request_stop(tmp_path):
    port = free_port()
    h = start_process([sys.executable, STANDIN, "--host", "127.0.0.1", "--port", str(port)],
                      f"http://127.0.0.1:{port}", log_path=str(tmp_path / "server.log"),
                      env={**os.environ, "HAPO_TEST_STANDIN_DIR": str(tmp_path)})
    http = SGLangHTTP(timeout_s=10, max_retries=0)
    try:
        http.wait_healthy(h, timeout_s=60, poll_s=0.2)
        assert http.request(h, "/flush_cache", {"x": 1}) == {"success": True, "message": "ok"}
        http.check_alive(h)
    finally:
        stop_process(h, timeout_s=10)
    assert h.exit_code() is not None
    with pytest.raises(ServerDiedError, match="exited with code"):
        http.request(h, "/generate", {})
    seen = [json.loads(line) for line in open(tmp_path / f"server_{port}.jsonl")]
    assert [r["path"] for r in seen] == ["start", "/flush_cache"] and seen[1]["body"] == {"x": 1}


def test_crashing_server_reports_its_log(tmp_path):
    code = "import sys; print('RuntimeError: no CUDA devices', flush=True); sys.exit(3)"
    h = start_process([sys.executable, "-c", code], "http://127.0.0.1:9", log_path=str(tmp_path / "s.log"))
    http = SGLangHTTP(timeout_s=5, max_retries=0)
    with pytest.raises(ServerDiedError, match="exited with code 3(.|\n)*no CUDA devices"):
        http.wait_healthy(h, timeout_s=60, poll_s=0.2)


def _ignored_signals(pid: int) -> int:
    """The SigIgn mask of ``pid`` (Linux /proc)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("SigIgn:"):
            return int(line.split()[1], 16)
    raise AssertionError("no SigIgn line")


def test_server_outlives_slurms_stop_signal(tmp_path):
    """SLURM's `--signal=USR1@600` reaches every process of the job step: a launched server ignores
    SIGUSR1/SIGUSR2 (the trainer stops it itself), and it is the process we started (exec, no
    shell, no guard in between: server_guard.py execs it). Mutation: without the guard's ignored
    signals the stand-in dies of the SIGUSR1 and /health fails."""
    import signal
    port = free_port()
    h = start_process([sys.executable, STANDIN, "--host", "127.0.0.1", "--port", str(port)],
                      f"http://127.0.0.1:{port}", log_path=str(tmp_path / "server.log"),
                      env={**os.environ, "HAPO_TEST_STANDIN_DIR": str(tmp_path)})
    http = SGLangHTTP(timeout_s=10, max_retries=0)
    try:
        http.wait_healthy(h, timeout_s=60, poll_s=0.2)
        mask = _ignored_signals(h.process.pid)
        assert mask & (1 << (signal.SIGUSR1 - 1)) and mask & (1 << (signal.SIGUSR2 - 1))
        os.killpg(h.process.pid, signal.SIGUSR1)
        assert http.healthy(h) and h.exit_code() is None
    finally:
        stop_process(h, timeout_s=10)
    assert h.exit_code() is not None  # SIGTERM still stops it
    start = json.loads(open(tmp_path / f"server_{port}.jsonl").readline())
    assert start["pid"] == h.process.pid


def test_free_port_is_a_free_run_below_the_ephemeral_range():
    """Ports from `bind(0)` (the ephemeral range) are what the trainer's gloo listeners take while
    a server starts; `free_port` stays below that range, with a run of free ports for port_base + i."""
    from hapo_megatron.rollout.sglang import launch
    low = launch.ephemeral_port_range()[0]
    for _ in range(5):
        base = launch.free_port()
        assert 1024 <= base and base + launch.FREE_RUN <= low
        for i in range(launch.FREE_RUN):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("", base + i))


def test_a_port_in_use_is_refused_before_any_server_starts(tmp_path, monkeypatch):
    """Something already listening on the port (another run's server, any process): one line, and
    no server process (it could not bind, and the trainer would wait on the other listener)."""
    from hapo_megatron.rollout.sglang import launch
    started = []
    monkeypatch.setattr(launch, "start_process", lambda *a, **k: started.append(a))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        port = other.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port {port} on 127.0.0.1 is in use") as e:
            launch.launch_server(str(tmp_path), port=port, host="127.0.0.1", log_path=str(tmp_path / "log"),
                                 api_key=None, mem_fraction_static=0.5, colocate=False, device="cpu",
                                 quantization="none", kv_cache_dtype="auto")
    assert "\n" not in str(e.value) and started == []
