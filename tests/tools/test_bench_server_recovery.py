"""tools/bench/server_recovery.py at a tiny size, in a subprocess, on stand-in servers (``--standin``;
the real servers' recovery is tested in tests/rollout/sglang/test_server_recovery_real.py): two
servers, one SIGKILLed in the middle of a round. Every row comes back, some of them retried by the
survivor, and the killed server is restarted and in use again after the next weight sync."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = 8  # x n=2: 16 rows, 4 calls of 4 rows, 2 per server: the kill comes before server 1's second


def test_server_recovery_bench_runs_and_recovers():
    proc = subprocess.run([sys.executable, "-W", "ignore", os.path.join(ROOT, "tools", "bench", "server_recovery.py"),
                           "--prompts", str(PROMPTS), "--max-new-tokens", "4", "--standin"], cwd=ROOT,
                          capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows, retried = (int(x) for x in re.search(r"rows: (\d+); retried: (\d+)", proc.stdout).groups())
    assert rows == 2 * PROMPTS and 0 < retried <= rows
    with_kill = int(re.search(r"with the kill: (\d+) rows with other tokens", proc.stdout).group(1))
    assert 0 <= with_kill <= rows
    healthy, back = (float(x) for x in re.search(
        r"restarted server answering ([\d.]+) s after the kill; back in use after the next sync at ([\d.]+) s",
        proc.stdout).groups())
    assert 0 < healthy <= back
    assert "{0: 'in use', 1: 'in use'}" in proc.stdout  # both servers serve again


def test_server_recovery_bench_refuses_a_round_too_small_to_kill_in():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench", "server_recovery.py"),
                           "--prompts", "4"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 2 and "--prompts must be at least 8" in proc.stderr
