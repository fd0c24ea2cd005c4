"""tools/bench/host_step.py at a tiny size (each role in its own subprocess): it runs end to end
through the trainer's rollout stage (which failed once a stage started reading ``rt.actor``), DP
rank 0 alone lays out every kept response token, and of two DP ranks it lays out a part."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_host_step_bench_runs_and_lays_out_the_kept_tokens():
    proc = subprocess.run([sys.executable, "-W", "ignore", os.path.join(ROOT, "tools", "bench", "host_step.py"),
                           "--prompts", "32", "--n", "2", "--mean", "40", "--cap", "96", "--prompt-len", "16",
                           "--dp", "1", "2", "--gen-s", "0", "--chunk", "16"],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    laid = {dp: (int(n), int(kept)) for dp, n, kept in
            re.findall(r"DP=(\d+)\s*:.*response tokens laid out (\d+) of (\d+) kept", proc.stdout)}
    assert sorted(laid) == ["1", "2"]
    total = int(re.search(r"(\d+) response tokens", proc.stdout).group(1))
    (one, kept), (two, kept2) = laid["1"], laid["2"]
    assert kept == kept2 and 0 < kept <= total
    assert one == kept  # one DP rank trains on every kept response token
    assert 0 < two < one  # DP rank 0 of 2 lays out its share only
    assert re.search(r"rank 0: host seconds left after the last response\n\s+[\d.]+ s", proc.stdout)
