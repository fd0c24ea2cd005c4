"""The SLURM scripts (examples/slurm/hapo.sbatch, examples/qwen2.5-math-7b-sglang/slurm.sbatch) run
against stand-in `srun` / `scontrol` / `squeue` / `torchrun` on PATH: the commands they build.

What a GPU user relies on (docs/multinode.md, "SLURM"; docs/troubleshooting.md, "Preemption"):
- the run directory comes from a stable name (the job name), so a resubmitted, chained
  (`--dependency=afterany`) or requeued job with a new job id continues with `--resume auto`;
- the task srun starts on each node is torchrun itself (`exec`), so SLURM's stop signal reaches
  torchrun, not a shell whose death makes `srun --kill-on-bad-exit` kill the step;
- trainer.exit_after_minutes is the job's time left minus STOP_MARGIN_MIN (time_budget.sh);
- hapo.sbatch runs `python -m hapo_megatron.train --check` with torchrun's arguments first: a
  refusal is one line and exit 2 before any node starts, a finished run exits 0 (docs/troubleshooting.md,
  "Refusals").
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = {"generic": ["examples/slurm/hapo.sbatch", "examples/qwen2.5-math-7b/config.yaml"],
           "7b-sglang": ["examples/qwen2.5-math-7b-sglang/slurm.sbatch"]}

# srun: drop its options, start the task as a CHILD (as slurmstepd does) and record the child's pid
STANDINS = {
    "srun": """#!/usr/bin/env bash
while [[ $# -gt 0 && $1 == --* ]]; do shift; done
SLURM_NODEID=0 "$@" &
echo $! > "$STANDIN_LOG/task.pid"
wait $!
""",
    "scontrol": "#!/usr/bin/env bash\necho node-a; echo node-b\n",
    "squeue": "#!/usr/bin/env bash\necho \"$STANDIN_TIME_LEFT\"\n",
    # the launcher's check: records its arguments, exits with STANDIN_CHECK_RC (0: go)
    "python": """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$STANDIN_LOG/check.args"
exit "${STANDIN_CHECK_RC:-0}"
""",
    "torchrun": """#!/usr/bin/env bash
echo $$ > "$STANDIN_LOG/torchrun.pid"
printf '%s\\n' "$@" > "$STANDIN_LOG/torchrun.args"
""",
}


@pytest.fixture
def standins(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in STANDINS.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def run_sbatch(which: str, tmp_path: Path, bin_dir: Path, *, job_id: str, job_name: str = "hapo7b",
               time_left: str = "2-00:00:00", extra_env=None, args=()) -> dict:
    """Run the batch script as sbatch would on the first node; returns torchrun's argv and pids."""
    log = tmp_path / f"log-{job_id}"
    log.mkdir()
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), "STANDIN_LOG": str(log),
           "STANDIN_TIME_LEFT": time_left, "SLURM_JOB_ID": job_id, "SLURM_JOB_NAME": job_name,
           "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_SUBMIT_DIR": str(REPO), "RUNS": str(tmp_path / "runs"), **(extra_env or {})}
    script, *script_args = SCRIPTS[which]
    proc = subprocess.run(["bash", str(REPO / script), *script_args, *args], env=env, cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    argv = (log / "torchrun.args").read_text().splitlines()
    return {"argv": argv, "torchrun_pid": (log / "torchrun.pid").read_text().strip(),
            "task_pid": (log / "task.pid").read_text().strip()}


def override(argv: list[str], field: str):
    values = [a.split("=", 1)[1] for a in argv if a.startswith(field + "=")]
    return values[-1] if values else None


@pytest.mark.parametrize("which", sorted(SCRIPTS))
def test_resubmitted_job_uses_the_same_run_dir(which, tmp_path, standins):
    """Two jobs of the same name (a resubmission, a chained or requeued job) get the same run
    directory, named after the job, never after its id (mutation: `RUN_NAME=$SLURM_JOB_ID` in the
    script makes the two run dirs differ)."""
    first = run_sbatch(which, tmp_path, standins, job_id="1001")
    second = run_sbatch(which, tmp_path, standins, job_id="2002")
    run_dir = override(first["argv"], "trainer.run_dir")
    assert run_dir == str(tmp_path / "runs" / "hapo7b")
    assert override(second["argv"], "trainer.run_dir") == run_dir
    assert "1001" not in run_dir


@pytest.mark.parametrize("which", sorted(SCRIPTS))
def test_run_name_overrides_the_job_name(which, tmp_path, standins):
    got = run_sbatch(which, tmp_path, standins, job_id="7", extra_env={"RUN_NAME": "dapo7b"})
    assert override(got["argv"], "trainer.run_dir") == str(tmp_path / "runs" / "dapo7b")


@pytest.mark.parametrize("which", sorted(SCRIPTS))
def test_the_task_srun_starts_is_torchrun(which, tmp_path, standins):
    """torchrun is exec'd: the process srun started is torchrun (mutation: `torchrun` without
    `exec` in qwen2.5-math-7b-sglang/launch.sh, or `bash launch.sh` without exec in the sbatch's
    `bash -c`, leaves a shell in between and the pids differ)."""
    got = run_sbatch(which, tmp_path, standins, job_id="11")
    assert got["torchrun_pid"] == got["task_pid"]
    argv = got["argv"]
    assert "SIGUSR1" in argv[argv.index("--signals-to-handle") + 1]


@pytest.mark.parametrize("which", sorted(SCRIPTS))
@pytest.mark.parametrize("time_left, expected", [("2-00:00:00", "2850"), ("10:00:00", "570"), ("45:00", "15"),
                                                  ("UNLIMITED", None)])
def test_exit_after_minutes_from_the_time_left(which, time_left, expected, tmp_path, standins):
    """trainer.exit_after_minutes = squeue's time left - STOP_MARGIN_MIN (30); none without a limit
    (mutation: dropping `trainer.exit_after_minutes` from the script fails the first three)."""
    got = run_sbatch(which, tmp_path, standins, job_id="12", time_left=time_left)
    assert override(got["argv"], "trainer.exit_after_minutes") == expected
    assert override(got["argv"], "trainer.exit_grace_s") == "480"


def test_too_little_time_left_is_refused(tmp_path, standins):
    log = tmp_path / "log-x"
    log.mkdir()
    env = {"PATH": f"{standins}:{os.environ['PATH']}", "STANDIN_LOG": str(log), "STANDIN_TIME_LEFT": "20:00",
           "SLURM_JOB_ID": "5", "SLURM_JOB_NAME": "x", "SLURM_JOB_NODELIST": "node-a", "SLURM_NNODES": "1",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_SUBMIT_DIR": str(REPO), "RUNS": str(tmp_path / "runs")}
    proc = subprocess.run(["bash", str(REPO / "examples/slurm/hapo.sbatch"), "examples/qwen2.5-math-7b/config.yaml"],
                          env=env, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "STOP_MARGIN_MIN" in proc.stderr
    assert not (log / "torchrun.args").exists()


def test_7b_launcher_passes_the_model_only_when_asked(tmp_path, standins):
    """launch.sh leaves model.hf_model_path to the config unless MODEL_PATH is set (mutation: a
    default MODEL_PATH in launch.sh overrides the config's model silently)."""
    plain = run_sbatch("7b-sglang", tmp_path, standins, job_id="21")
    assert override(plain["argv"], "model.hf_model_path") is None
    asked = run_sbatch("7b-sglang", tmp_path, standins, job_id="22", extra_env={"MODEL_PATH": "/models/q7b"})
    assert override(asked["argv"], "model.hf_model_path") == "/models/q7b"


def test_the_check_runs_first_with_the_trainers_arguments(tmp_path, standins):
    """The check gets the world torchrun will start and exactly the trainer's arguments (mutation:
    a check without the run_dir or --resume auto would check another run than the one trained)."""
    got = run_sbatch("generic", tmp_path, standins, job_id="31", args=["--preset", "dapo"])
    check = (tmp_path / "log-31" / "check.args").read_text().splitlines()
    assert check[:8] == ["-m", "hapo_megatron.train", "--check", "--nnodes", "2", "--nproc-per-node", "8",
                         "--config"]
    argv = got["argv"]
    assert check[7:] == argv[argv.index("hapo_megatron.train") + 1:]


@pytest.mark.parametrize("check_rc, job_rc", [(2, 2), (3, 0)])
def test_a_refused_or_finished_run_starts_no_torchrun(check_rc, job_rc, tmp_path, standins):
    """Check exit 2 (refused): the job exits 2; 3 (finished): the job exits 0; neither starts
    torchrun (mutation: without the check step torchrun starts on every node)."""
    log = tmp_path / "log-41"
    log.mkdir()
    env = {"PATH": f"{standins}:{os.environ['PATH']}", "STANDIN_LOG": str(log), "STANDIN_TIME_LEFT": "10:00:00",
           "SLURM_JOB_ID": "41", "SLURM_JOB_NAME": "x", "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NNODES": "2",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_SUBMIT_DIR": str(REPO), "RUNS": str(tmp_path / "runs"),
           "STANDIN_CHECK_RC": str(check_rc)}
    proc = subprocess.run(["bash", str(REPO / "examples/slurm/hapo.sbatch"), "examples/qwen2.5-math-7b/config.yaml"],
                          env=env, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == job_rc, proc.stderr
    assert (log / "check.args").exists() and not (log / "torchrun.args").exists()
