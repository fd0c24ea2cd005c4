"""tools/bench/routing_replay.py at a tiny size, in a subprocess (it starts its own 1-process group).

With an fp32 engine there is no precision gap: the engine and the actor route alike (mismatch 0)
and replay changes nothing, so both passes give the engine's log-probs to float32 rounding. With a
bf16 engine it reports a figure for every seed."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--seeds", "2", "--prompts", "2", "--n", "2", "--max-new-tokens", "8"]


def _bench(tmp_path, *args):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "-W", "ignore", os.path.join(ROOT, "tools", "bench", "routing_replay.py"),
                           *TINY, *args, "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {int(k): v for k, v in json.loads(out.read_text()).items()}, proc.stdout


def test_fp32_engine_routes_like_the_actor(tmp_path):
    rows, _ = _bench(tmp_path, "--engine-dtype", "fp32")
    assert sorted(rows) == [1, 2]
    for row in rows.values():
        for mode in ("measure", "replay"):
            assert row[mode]["tokens"] == 2 * 2 * 8 and row[mode]["mismatch"] == 0.0
            assert row[mode]["abs_diff"] < 1e-4, row
        assert row["measure"]["touched"] == 0


def test_bf16_engine_reports_every_seed(tmp_path):
    rows, stdout = _bench(tmp_path)
    assert sorted(rows) == [1, 2] and "all tokens, 2 seeds" in stdout
    for row in rows.values():
        assert 0.0 <= row["measure"]["mismatch"] < 1.0 and row["measure"]["abs_diff"] > 1e-4  # bf16 rounding shows
