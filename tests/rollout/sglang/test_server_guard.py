"""A launched server ends with its trainer (``rollout/sglang/server_guard.py``), with stand-in servers:
the trainer SIGKILLed, a server that will not stop on SIGTERM, a server that exits by itself."""

import json
import os
import signal
import subprocess
import sys

from hapo_megatron.rollout.sglang import server_guard
from hapo_megatron.rollout.sglang.client import SGLangHTTP, ServerHandle
from hapo_megatron.rollout.sglang.launch import STOP_GRACE_S, free_port, start_process
from tests.tools._load import load_tool
from tests.training.tiny_setup import ROOT

from .test_sglang_launch import STANDIN

procs = load_tool("bench/procs")
#: the spec's bound: no launched server is left this long after its trainer died
GONE_WITHIN_S = 30.0

# a trainer: launches the stand-in from a thread that then ends (a server supervisor's restart runs
# on a generate call's pool thread), reports the server's pid and waits for its stdin to close
TRAINER = """import json, sys, threading
from hapo_megatron.rollout.sglang.launch import start_process
standin, port, log = sys.argv[1:]
handles = []
t = threading.Thread(target=lambda: handles.append(start_process(
    [sys.executable, standin, "--host", "127.0.0.1", "--port", port], f"http://127.0.0.1:{port}", log_path=log)))
t.start()
t.join()
print(json.dumps({"pid": handles[0].process.pid}), flush=True)
sys.stdin.read()
"""


def test_servers_die_with_a_sigkilled_trainer(tmp_path):
    """kill -9 of the trainer (no atexit runs): its server's whole process group is gone within 30 s,
    and before that the server outlived the thread that launched it.
    Mutation: launch without the guard (``launch.guarded`` returning ``cmd``): the server survives."""
    port = free_port()
    env = {**os.environ, "HAPO_TEST_STANDIN_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, STANDIN, str(port), str(tmp_path / "server.log")],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    group = []
    try:
        pid = json.loads(trainer.stdout.readline())["pid"]
        SGLangHTTP(timeout_s=10, max_retries=0).wait_healthy(ServerHandle(f"http://127.0.0.1:{port}"), 60,
                                                             poll_s=0.2)
        group = procs.group_processes(pid)
        assert pid in {p.pid for p in group}  # the server (and its watcher)
        trainer.kill()
        trainer.wait()
        assert procs.survivors(group, GONE_WITHIN_S) == []
    finally:
        for p in group:
            try:
                p.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass
        trainer.kill()
        trainer.wait()


IGNORES_SIGTERM = """import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
while True:
    time.sleep(60)
"""


def _stop_ends_it_by_sigkill(script: str, tmp_path) -> None:
    """Start ``script`` as a guarded server, SIGTERM its group once it is ready (what stop_process
    sends), and require that the guard ends it with SIGKILL after STOP_GRACE_S."""
    log = tmp_path / "server.log"
    h = start_process([sys.executable, "-c", script], "http://127.0.0.1:9", log_path=str(log))
    while "ready" not in log.read_text():
        assert h.process.poll() is None
        subprocess.run(["sleep", "0.1"])
    os.killpg(h.process.pid, signal.SIGTERM)
    # the bound only turns a hang into a failure: the guard acts after STOP_GRACE_S
    assert h.process.wait(timeout=STOP_GRACE_S + 60) == -signal.SIGKILL


def test_a_server_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    """SIGTERM to the group (what stop_process sends) ends a server that ignores it (SGLang's own
    handler waits for its requests in flight, without a bound): its guard SIGKILLs the group after
    STOP_GRACE_S. Mutation: no guard: the wait below reaches its bound."""
    _stop_ends_it_by_sigkill(IGNORES_SIGTERM, tmp_path)


# a server like SGLang's main process on SIGTERM: it kills every descendant of its own (SGLang's
# kill_process_tree: its schedulers, and the guard's watcher were it one of them), then never ends
# (SGLang waits for its HTTP clients to close their connections)
STUCK_SHUTDOWN = """import signal, time, psutil
def shutdown(*_):
    for child in psutil.Process().children(recursive=True):
        child.kill()
signal.signal(signal.SIGTERM, shutdown)
print("ready", flush=True)
while True:
    time.sleep(60)
"""


def test_stop_ends_a_server_whose_shutdown_kills_its_descendants_and_hangs(tmp_path):
    """SIGTERM to the group (stop_process) of a server that kills its own descendants and hangs:
    the watcher, no descendant of the server, SIGKILLs the group after STOP_GRACE_S.
    Mutation: the watcher a child of the server (one fork): the server kills it and runs on (the
    wait below reaches its bound)."""
    _stop_ends_it_by_sigkill(STUCK_SHUTDOWN, tmp_path)


def test_the_watcher_ends_with_a_server_that_exits(tmp_path):
    """A server that exits by itself takes its watcher (and anything left in its group) with it;
    its exit code is the server's own."""
    h = start_process([sys.executable, "-c", "import sys; sys.exit(3)"], "http://127.0.0.1:9",
                      log_path=str(tmp_path / "s.log"))
    assert h.process.wait(timeout=60) == 3
    assert procs.survivors(procs.group_processes(h.process.pid), GONE_WITHIN_S) == []


def test_the_guard_starts_nothing_once_its_trainer_is_gone(tmp_path):
    """A guard whose parent is not the trainer it was given (the trainer died before it started)
    refuses to start the server."""
    marker = tmp_path / "started"
    run = subprocess.run([sys.executable, "-I", "-S", server_guard.__file__, "1", "1", "USR1",
                          sys.executable, "-c", f"open({str(marker)!r}, 'w')"], capture_output=True, text=True)
    assert run.returncode == 1 and "is gone" in run.stderr and not marker.exists()


def test_proc_readers():
    assert server_guard.parent_of(os.getpid()) == os.getppid()
    assert server_guard.proc_stat(2**22 + 12345) == ("X", 0)
    child = subprocess.Popen(["sleep", "60"])
    child.kill()
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    assert server_guard.proc_stat(child.pid) == ("Z", os.getpid())
    child.wait()
