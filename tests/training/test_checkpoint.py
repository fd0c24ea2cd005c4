"""Checkpoint atomicity, keep-last-k, half-written ones ignored, resume resolution, RNG round trip."""

import json
import os
import random

import pytest
import torch

from hapo_megatron.training.checkpoint import (CheckpointManager, capture_rng_state, find_latest,
                                               list_checkpoints, resolve_resume, restore_rng_state)


def _save_model(payload):
    def fn(d):
        os.makedirs(d, exist_ok=True)
        torch.save(payload, os.path.join(d, "w.pt"))
    return fn


def test_save_keep_last_k_and_latest(tmp_path):
    root = str(tmp_path / "ckpt")
    mgr = CheckpointManager(root, keep_last_k=2)
    for step in (1, 2, 3):
        mgr.save(step, rl_state={"cursor": step * 10}, save_model=_save_model({"w": torch.tensor(step)}))
    assert [s for s, _ in list_checkpoints(root)] == [2, 3]
    assert open(os.path.join(root, "latest")).read().strip() == "step_000003"
    latest = find_latest(root)
    seen = {}
    state = mgr.load(latest, load_model=lambda d: seen.update(torch.load(os.path.join(d, "w.pt"))))
    assert state == {"step": 3, "cursor": 30} and int(seen["w"]) == 3
    assert not [n for n in os.listdir(root) if n.startswith(".tmp")]


def test_half_written_checkpoint_is_ignored_with_warning(tmp_path):
    root = str(tmp_path / "ckpt")
    mgr = CheckpointManager(root, keep_last_k=3)
    mgr.save(1, rl_state={})

    def crash(d):
        os.makedirs(d)
        raise KeyboardInterrupt("killed while writing")
    with pytest.raises(KeyboardInterrupt):
        mgr.save(2, rl_state={}, save_model=crash)
    # a step dir without the marker (e.g. copied by hand) is ignored too
    os.makedirs(os.path.join(root, "step_000005"))
    with pytest.warns(UserWarning, match="half-written"):
        assert find_latest(root).endswith("step_000001")
    with pytest.warns(UserWarning, match="half-written"):
        assert resolve_resume("auto", root).endswith("step_000001")
    # the next save of step 2 replaces the stale temp dir
    mgr.save(2, rl_state={})
    with pytest.warns(UserWarning):
        assert find_latest(root).endswith("step_000002")


def test_stale_latest_pointer_falls_back_to_newest_complete(tmp_path):
    root = str(tmp_path / "ckpt")
    mgr = CheckpointManager(root)
    mgr.save(1, rl_state={})
    mgr.save(2, rl_state={})
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("step_000009\n")
    with pytest.warns(UserWarning, match="not complete"):
        assert find_latest(root).endswith("step_000002")


def test_resolve_resume(tmp_path):
    root = str(tmp_path / "ckpt")
    assert resolve_resume("none", root) is None
    assert resolve_resume("auto", root) is None
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_resume(str(tmp_path / "nope"), root)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve_resume(str(tmp_path / "empty"), root)
    path = CheckpointManager(root).save(4, rl_state={"a": 1})
    assert resolve_resume(path, "/elsewhere") == path
    assert resolve_resume(root, "/elsewhere") == path
    assert json.load(open(os.path.join(path, "rl_state.json")))["a"] == 1


def test_rng_round_trip():
    import numpy as np
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    state = capture_rng_state()
    a = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(99)
    random.seed(99)
    restore_rng_state(state)
    b = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_keep_last_k_validated(tmp_path):
    with pytest.raises(ValueError, match="keep_last_k"):
        CheckpointManager(str(tmp_path), keep_last_k=0)
