"""End to end: the tiny CPU job with `rollout.max_staleness: 1` on two paced stand-in SGLang
servers (tools/bench/paced_sglang_server.py: tokens at a fixed rate, weight versions per token,
pause / continue), one of which crashes in the middle of the run; then the same job stopped by
SIGTERM while step 3 waits for its batch (tests/rollout/sglang/standin_sglang_server.py holds every
request after the first two steps' until aborted; tests/training/preempt_hook.py sends the
signal as the trainer starts to take step 3's batch), and resumed on paced servers.

- every trained sample's lag is <= 1 (the buffer checks each batch; the metrics say so per step);
- generation overlaps training, from the servers' request times: the trainer trains step c
  between the take (after the previous weight update's ``/continue_generation`` and its wait for
  data) and the next ``/pause_generation``; /generate requests run in those windows;
- the crashed server's requests go to the other one (retried rows counted) and the lag holds;
- the SIGTERM stops the run cleanly from inside the wait: exit code EXIT_STOPPED, step 2 saved
  with the prompts in flight, the held requests aborted on the server (the producer stopped);
- resume with a non-empty buffer: the prompts trained by the stopped + resumed runs are those of
  the uninterrupted run, in the same order (none lost or repeated).

Mutations tried (together, in one run): `AsyncRollout.snapshot` without the pending prompts, and
`stages.sync_weights` without the pause (`paused` replaced by a null context: the buffer never
learns the new version, so the producer's lag check stops the run): the fixture's runs fail.
`AsyncRollout.take_step` without its stop check: the stopped run waits on the held requests
until the stand-in's bound (HAPO_TEST_STANDIN_HOLD_BOUND_S) and the job times out.
`AsyncRollout.close` without the abort: the held requests are never aborted (the test's
``/abort_request`` assertion fails; the trainer's exit waits for its sending threads)."""

from __future__ import annotations

import json
import os

import sys

import pytest

from hapo_megatron.analysis.rollouts import rollout_path
from hapo_megatron.rollout.sglang.client import SGLangHTTP
from hapo_megatron.rollout.sglang.launch import free_port, start_process, stop_process
from hapo_megatron.training.checkpointing.checkpoint import find_latest, step_dir_name
from hapo_megatron.training.checkpointing.preemption import EXIT_STOPPED
from hapo_megatron.training.metrics.sinks import read_jsonl
from tests.tools._load import load_tool
from tests.training.tiny_setup import ROOT, prepare_tiny

pytestmark = pytest.mark.slow
bench = load_tool("bench/async_rollout")
RATE, STEPS, BATCH, N, LENGTH = 10.0, 5, 2, 2, 4  # 0.4 s of generation per group
STANDIN = os.path.join(ROOT, "tests", "rollout", "sglang", "standin_sglang_server.py")
STOP_STEP = 3


def _job(data, run_dir, urls, steps, run_kwargs=None, **extra):
    over = bench.job_overrides(data, run_dir, urls, max_staleness=1, steps=steps, batch=BATCH, n=N,
                               response_length=LENGTH, extra={"logging.save_rollouts_interval": 1, **extra})
    return bench.run_job(data, run_dir, over, timeout=600, **(run_kwargs or {}))


def _stopped_job(data, run_dir, rec_dir):
    """The job with SIGTERM as step STOP_STEP starts to take its batch, on one stand-in server that
    answers the groups of the steps before (max_staleness 1 admits two batches at the start, one
    more after each update) and holds every later one until aborted. (metrics, server log)"""
    vocab = json.load(open(os.path.join(data, "model", "config.json")))["vocab_size"]
    port = free_port()
    env = {**os.environ, "HAPO_TEST_STANDIN_DIR": rec_dir, "HAPO_TEST_STANDIN_VOCAB": str(vocab),
           "HAPO_TEST_STANDIN_HOLD_AFTER": str((STOP_STEP - 1) * BATCH)}
    server = start_process([sys.executable, STANDIN, "--host", "127.0.0.1", "--port", str(port)],
                           f"http://127.0.0.1:{port}", log_path=os.path.join(rec_dir, "server.log"), env=env)
    try:
        SGLangHTTP(timeout_s=30, max_retries=3).wait_healthy(server, 120.0)
        recs = _job(data, run_dir, [server.url], STEPS, run_kwargs=dict(
            module="tests.training.preempt_hook", returncode=EXIT_STOPPED, torchrun=False,
            env={"HAPO_TEST_HOLD_STAGE": "async_take", "HAPO_TEST_HOLD_STEP": str(STOP_STEP),
                 "HAPO_TEST_MARKER_DIR": rec_dir}))
    finally:
        stop_process(server)
    with open(os.path.join(rec_dir, f"server_{port}.jsonl")) as f:
        return recs, [json.loads(line) for line in f]


def _server_log(rec_dir):
    out = []
    for name in sorted(os.listdir(rec_dir)):
        with open(os.path.join(rec_dir, name)) as f:
            out += [dict(json.loads(line), server=name) for line in f]
    return out


def _survivor(log):
    """The records of a server that did not crash, in time order."""
    died = {e["server"] for e in log if e["path"] == "died"}
    name = min(e["server"] for e in log if e["server"] not in died)
    return sorted((e for e in log if e["server"] == name), key=lambda e: e["start"])


def _trained_prompts(run_dir, steps):
    """The prompt (uid >> 32, `async_rollout.group_id`) of each trained group, step by step."""
    out = []
    for s in steps:
        path = rollout_path(run_dir, s)
        assert os.path.exists(path), path
        rows = list(read_jsonl(path))
        out.append(list(dict.fromkeys(int(r["uid"]) >> 32 for r in rows)))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    data = prepare_tiny(str(root / "data"), 40, 2)
    out = {"data": data}
    rec = str(root / "servers_full")
    os.makedirs(rec)
    procs, urls = bench.start_servers(2, RATE, rec, extra=((), ("--die-at-request", "4")))
    try:
        out["full"] = (str(root / "full"), _job(data, str(root / "full"), urls, STEPS), _server_log(rec))
    finally:
        bench.stop_servers(procs)
    rec = str(root / "servers_part")
    os.makedirs(rec)
    procs, urls = bench.start_servers(2, RATE, rec)
    try:
        part, stop_rec = str(root / "part"), str(root / "servers_stopped")
        os.makedirs(stop_rec)
        first, stop_log = _stopped_job(data, part, stop_rec)
        latest = find_latest(os.path.join(part, "checkpoints"))
        with open(os.path.join(part, "checkpoints", step_dir_name(STOP_STEP - 1), "rl_state.json")) as f:
            state = json.load(f)
        second = _job(data, part, urls, STEPS)
        out["part"] = (part, first, second, state)
        out["stopped"] = (first, stop_log, latest, sorted(os.listdir(stop_rec)))
    finally:
        bench.stop_servers(procs)
    return out


def test_every_batch_within_the_lag_and_generation_overlaps_training(runs):
    run_dir, recs, log = runs["full"]
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert all(r["rollout/staleness_max"] <= 1 for r in recs)
    assert max(r["rollout/staleness_max"] for r in recs) == 1
    for key in ("rollout/staleness_mean", "timing/trainer_wait_s", "rollout/generation_overlap_frac",
                "rollout_is/weight_mean", "rollout_is/kl_k3", "loss/rollout_is_weight"):
        assert key in recs[-1], key
    # the windows in which the trainer trained (see the module docstring), from the servers' clocks
    server0 = _survivor(log)
    pauses = [e["start"] for e in server0 if e["path"] == "/pause_generation"]
    conts = [e["end"] for e in server0 if e["path"] == "/continue_generation"]
    assert len(pauses) == len(conts) == STEPS
    gens = [(e["start"], e["end"]) for e in log if e["path"] == "/generate"]
    overlapped = 0.0
    for c in range(2, STEPS + 1):  # step c trains between update c-1 (+ its wait) and update c
        lo, hi = conts[c - 2] + recs[c - 1]["timing/trainer_wait_s"], pauses[c - 1]
        overlapped += sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in gens)
    assert overlapped > 0, "no generation ran while the trainer trained"


def test_a_crashed_server_is_replaced_by_the_other_and_the_lag_holds(runs):
    _, recs, log = runs["full"]
    assert any(e["path"] == "died" for e in log)
    assert sum(r.get("rollout/requests_retried", 0.0) for r in recs) >= N  # the crashed call's rows
    assert all(r["rollout/staleness_max"] <= 1 for r in recs)


def test_weight_updates_are_paused_and_versioned(runs):
    _, _, log = runs["full"]
    server0 = _survivor(log)
    paths = [e["path"] for e in server0 if e["path"] in ("/pause_generation", "/update_weights_from_disk",
                                                          "/continue_generation")]
    # the first sync (before the producer starts) is not paused; every later one is
    assert paths == ["/update_weights_from_disk"] + ["/pause_generation", "/update_weights_from_disk",
                                                     "/continue_generation"] * STEPS
    versions = [e["version"] for e in server0 if e["path"] == "/update_weights_from_disk"]
    assert versions == [str(v) for v in range(STEPS + 1)]


def test_sigterm_while_waiting_for_a_batch_stops_the_producer_and_saves(runs):
    recs, log, latest, files = runs["stopped"]
    assert f"signalled.take.step{STOP_STEP}" in files  # the signal came as the take began
    assert [r["step"] for r in recs] == list(range(1, STOP_STEP))
    assert latest is not None and latest.endswith(step_dir_name(STOP_STEP - 1))
    paths = [e["path"] for e in log]
    assert paths.count("held") >= BATCH, paths  # step STOP_STEP's groups were in flight, held
    # the producer's close aborted them (else the trainer's exit would wait for their threads)
    assert "/abort_request" in paths[paths.index("held"):], paths


def test_resume_with_a_non_empty_buffer_loses_and_repeats_no_prompt(runs):
    full_dir = runs["full"][0]
    part, first, second, state = runs["part"]
    assert state["async_pending"], "the checkpoint should hold prompts in flight"
    assert [r["step"] for r in first] == list(range(1, STOP_STEP))
    assert [r["step"] for r in second] == list(range(1, STEPS + 1))  # steps 1-2 then 3-5 in one file
    want = _trained_prompts(full_dir, range(1, STEPS + 1))
    assert _trained_prompts(part, range(1, STEPS + 1)) == want
    flat = [p for s in want for p in s]
    assert len(flat) == STEPS * BATCH
