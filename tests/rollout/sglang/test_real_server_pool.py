"""The session's pool of real SGLang servers (tests/rollout/sglang/conftest.py), with stand-in processes:
a live server is shared, one a test killed is started again (its whole process group ended) only
when asked for, a prestarted one is waited for when first asked for, and the pool stops what it
started."""

import os
import select
import signal
import subprocess
import sys

from hapo_megatron.rollout.sglang.client import ServerHandle

from .conftest import RealServerPool

# a "server": a process group of two sleepers (a leader and a child, like SGLang's scheduler)
STANDIN = "import subprocess, time; subprocess.Popen(['sleep', '600']); print('up', flush=True); time.sleep(600)"


def _start(model_dir, log_path, api_key):
    proc = subprocess.Popen([sys.executable, "-c", STANDIN], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n"  # its child runs
    return ServerHandle(f"http://127.0.0.1:{proc.pid}", process=proc, log_path=log_path)


def _group_ended(handle) -> bool:
    """Whether every process of the stand-in's group has exited: its output pipe, which the leader and its
    child share, reaches end of file (bounded wait, for a group that never ends)."""
    ready, _, _ = select.select([handle.process.stdout], [], [], 60)
    return bool(ready) and handle.process.stdout.read() == ""


def test_pool_shares_a_live_server_and_restarts_a_killed_one_on_demand(tmp_path):
    waited = []
    pool = RealServerPool("model", "key", str(tmp_path), launch=_start, wait=waited.append)
    try:
        first = pool.get(0)
        assert pool.get(0) is first and pool.starts == 1  # shared while alive
        first.process.send_signal(signal.SIGKILL)  # a test kills the leader only
        first.process.wait()
        assert pool.starts == 1  # nothing restarted until asked for
        second = pool.get(0)
        assert second is not first and second.exit_code() is None and pool.starts == 2
        assert _group_ended(first)  # the killed server's child ended too
        assert second.log_path == os.path.join(str(tmp_path), "server0.start2.log")
        assert waited == [first, second]  # each start waited for once
        pool.prestart(1)  # launched, not waited for: its start-up overlaps what runs meanwhile
        other = pool.handles[1]
        assert waited == [first, second] and other.exit_code() is None and pool.starts == 3
        assert pool.get(1) is other and waited == [first, second, other] and pool.starts == 3
    finally:
        pool.close()
    assert second.exit_code() is not None and other.exit_code() is not None and not pool.handles
