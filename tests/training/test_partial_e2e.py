"""End to end: the tiny CPU job (one torchrun process) with `rollout.over_sampling: 2` and
`partial_mode: mask_prefix` on the heavy-tailed paced stand-in (tools/bench/paced_sglang_server.py
``--length-median``): the trainer's whole step runs on the over-sampled batches (the token mask
through the share-out and the layout, the per-sequence sampling statistics, the weight sync), the
checkpoint holds the pool of partial responses, and the over-sampling metrics are logged.

Mutation tried: `stages._apply_sampler_state` without its over-sampling branch (the sampler cursor
taken from the wrong key) fails the run."""

from __future__ import annotations

import json
import os

import pytest

from hapo_megatron.training.checkpointing.checkpoint import step_dir_name
from hapo_megatron.training.metrics.sinks import read_jsonl
from tests.tools._load import load_tool
from tests.training.tiny_setup import prepare_tiny

pytestmark = pytest.mark.slow
STEPS, BATCH, N, LENGTH = 3, 2, 2, 24


def test_tiny_job_with_over_sampling(tmp_path):
    bench = load_tool("bench/async_rollout")
    data = prepare_tiny(str(tmp_path / "data"), 40, 2)
    os.makedirs(tmp_path / "servers")
    procs, urls = bench.start_servers(1, 400.0, str(tmp_path / "servers"), extra=[["--length-median", "4"]])
    run_dir = str(tmp_path / "run")
    try:
        over = bench.job_overrides(data, run_dir, urls, max_staleness=0, steps=STEPS, batch=BATCH, n=N,
                                   response_length=LENGTH, rollout_is="none",
                                   extra={"rollout.over_sampling": 2.0, "rollout.partial_mode": "mask_prefix",
                                          "trainer.save_interval": 1})
        recs = bench.run_job(data, run_dir, over, timeout=600)
    finally:
        bench.stop_servers(procs)
    assert len(recs) == STEPS
    for r in recs:
        for k in ("rollout/aborted", "rollout/resumed", "rollout/older_version_token_frac",
                  "rollout/trained_length_p90", "rollout/completed_length_p90"):
            assert k in r, k
        assert r["batch/num_groups"] == BATCH
    assert sum(r["rollout/aborted"] for r in recs) > 0
    with open(os.path.join(run_dir, "checkpoints", step_dir_name(STEPS), "rl_state.json")) as f:
        state = json.load(f)
    pool = state["partial_rollouts"]
    assert pool["next_serial"] >= STEPS * BATCH and len(pool["groups"]) <= pool["next_serial"]
    assert list(read_jsonl(os.path.join(run_dir, "metrics.jsonl")))
