"""A run directory's records are never overwritten (hapo_megatron/training/run_records.py): a fresh
start moves them into one dated folder, a resume sets aside what it writes again and only appends
to metrics.jsonl, and summary.json is replaced atomically."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from hapo_megatron.training.run_records import (PREVIOUS, RECORDS, finished_message, move_records_aside,
                                                set_aside_after, write_json_atomic)
from tests.training.tiny_setup import ROOT


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _a_finished_run(run_dir):
    """Every kind of record a run writes, each with its own content."""
    for name in ("metrics.jsonl", "sft_metrics.jsonl", "summary.json", "config.yaml"):
        _write(os.path.join(run_dir, name), f"the first run's {name}\n")
    for sub in ("checkpoints/step_000004/COMPLETE", "checkpoints/latest", "rollouts/step_000004.jsonl",
                "reference/COMPLETE", "sglang_logs/server_0.log", "tensorboard/events", "wandb/run"):
        _write(os.path.join(run_dir, sub), f"the first run's {sub}\n")


def _tree(root):
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            path = os.path.join(d, f)
            out[os.path.relpath(path, root)] = open(path).read()
    return out


def test_a_fresh_start_moves_every_record_into_one_new_dated_folder(tmp_path):
    """Mutation: leaving a name out of RECORDS (e.g. config.yaml, the old behaviour) leaves it in
    the run dir; a second start reusing the first folder overwrites its records."""
    run = str(tmp_path / "run")
    _a_finished_run(run)
    _write(os.path.join(run, "notes.txt"), "mine\n")  # not a record: stays
    first = _tree(run)
    dest = move_records_aside(run)
    assert os.path.dirname(dest) == os.path.join(run, PREVIOUS)
    assert sorted(os.listdir(run)) == ["notes.txt", PREVIOUS]
    moved = _tree(dest)
    assert moved == {k: v for k, v in first.items() if k != "notes.txt"}
    assert sorted({k.split(os.sep)[0] for k in moved}) == sorted(RECORDS)
    # a second run in the same second, started over again: another folder, the first untouched
    _a_finished_run(run)
    second = move_records_aside(run)
    assert second != dest and _tree(dest) == moved and len(_tree(second)) == len(moved)
    assert move_records_aside(run) is None  # nothing left to move: no empty folder
    assert len(os.listdir(os.path.join(run, PREVIOUS))) == 2


def _lines(*steps):
    return "".join(json.dumps({"step": s, "rollout/reward_mean": s / 10}) + "\n" for s in steps)


def test_a_resume_sets_aside_the_later_records_and_keeps_the_metrics_file(tmp_path):
    """The metrics lines after the checkpoint's step move out, the kept bytes stay where they are
    (the same file, not a rewrite: same inode), a torn last line goes with the later ones.
    Mutation: rewriting the kept records (the old truncate_jsonl) changes the inode; cutting at the
    first later line without copying it loses the lines."""
    run = str(tmp_path / "run")
    metrics = os.path.join(run, "metrics.jsonl")
    kept = _lines(0, 1, 2)
    later = _lines(3, 4) + '{"step": 5, "rollout/rew'
    _write(metrics, kept + later)
    for s in (2, 4):
        _write(os.path.join(run, "rollouts", f"step_{s:06d}.jsonl"), f"{s}\n")
    _write(os.path.join(run, "summary.json"), '{"steps": 4}')
    inode = os.stat(metrics).st_ino
    dest = set_aside_after(run, 2)
    assert open(metrics).read() == kept and os.stat(metrics).st_ino == inode
    assert open(os.path.join(dest, "metrics.jsonl")).read() == later
    assert os.listdir(os.path.join(run, "rollouts")) == ["step_000002.jsonl"]
    assert os.listdir(os.path.join(dest, "rollouts")) == ["step_000004.jsonl"]
    assert json.load(open(os.path.join(dest, "summary.json"))) == {"steps": 4}
    assert not os.path.exists(os.path.join(run, "summary.json"))
    assert dest.endswith("-after-step_000002")
    assert set_aside_after(run, 2) is None  # nothing after step 2 any more
    assert open(metrics).read() == kept


def test_a_resume_of_a_run_that_logged_nothing_later_moves_nothing(tmp_path):
    run = str(tmp_path / "run")
    _write(os.path.join(run, "metrics.jsonl"), _lines(1, 2) + json.dumps({"step": 2, "eval/x/avg@2": 0.5}) + "\n")
    before = open(os.path.join(run, "metrics.jsonl")).read()
    assert set_aside_after(run, 2) is None
    assert open(os.path.join(run, "metrics.jsonl")).read() == before and not os.path.exists(os.path.join(run, PREVIOUS))


_KILLED_MID_WRITE = """
import resource, signal, sys
from hapo_megatron.training.run_records import write_json_atomic
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; the kernel's default kills
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # a write past 4 KiB: SIGXFSZ kills the process
write_json_atomic(sys.argv[1], {"steps": 8, "eval_end": {f"eval/set{i}/avg@4": i / 7 for i in range(2000)}})
"""


def test_a_kill_during_the_summary_write_leaves_the_old_summary(tmp_path):
    """A process killed by the kernel in the middle of writing the new summary (SIGXFSZ past its
    file-size limit) leaves the old summary whole. Mutation: writing summary.json in place (open
    'w' + json.dump, as before) leaves a 4 KiB fragment."""
    path = str(tmp_path / "summary.json")
    old = {"steps": 4, "wall_time_s": 292.0, "eval_start": {"eval/a/avg@4": 0.5}}
    write_json_atomic(path, old)
    proc = subprocess.run([sys.executable, "-c", _KILLED_MID_WRITE, path], cwd=ROOT, capture_output=True,
                          env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert proc.returncode == -signal.SIGXFSZ, (proc.returncode, proc.stderr[-2000:])  # killed by the signal, mid-write
    assert json.load(open(path)) == old
    write_json_atomic(path, {"steps": 8})
    assert json.load(open(path)) == {"steps": 8}


def test_finished_only_with_the_last_step_checkpointed_and_summarized(tmp_path):
    run = str(tmp_path)
    assert finished_message(run, 4, 4) is None  # no summary yet: the final evaluation runs again
    write_json_atomic(os.path.join(run, "summary.json"), {"steps": 4})
    why = finished_message(run, 4, 4)
    assert "is finished" in why and "trainer.total_steps=N" in why and "--resume none" in why
    assert finished_message(run, 4, 8) is None  # a larger trainer.total_steps: it goes on
    write_json_atomic(os.path.join(run, "summary.json"), {"steps": 2})
    assert finished_message(run, 4, 4) is None  # the summary is of an earlier step than the checkpoint
