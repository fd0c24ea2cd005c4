"""tools/bench/host_step.py at a tiny size (each role in its own subprocess): it runs end to end
through the trainer's rollout stage (which failed once a stage started reading ``rt.actor``), and
the old and new paths lay out the same response tokens for every DP size."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_host_step_bench_runs_and_paths_agree():
    proc = subprocess.run([sys.executable, "-W", "ignore", os.path.join(ROOT, "tools", "bench", "host_step.py"),
                           "--prompts", "32", "--n", "2", "--mean", "40", "--cap", "96", "--prompt-len", "16",
                           "--dp", "1", "2", "--gen-s", "0", "--chunk", "16"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    laid = re.findall(r"DP=(\d+)\s+(old|new).*response tokens laid out (\d+)", proc.stdout)
    assert sorted({(dp, path) for dp, path, _ in laid}) == [("1", "new"), ("1", "old"), ("2", "new"), ("2", "old")]
    by = {(dp, path): int(n) for dp, path, n in laid}
    total = int(re.search(r"(\d+) response tokens", proc.stdout).group(1))
    assert by[("1", "old")] == by[("1", "new")] > 0
    assert by[("2", "old")] == by[("2", "new")] > 0
    assert by[("2", "new")] < by[("1", "new")] <= total  # DP rank 0 of 2 lays out its share only
    assert "new / old:" in proc.stdout
