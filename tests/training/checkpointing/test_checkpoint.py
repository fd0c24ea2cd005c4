"""Checkpoint atomicity, keep-last-k, half-written ones ignored, resume resolution, RNG round trip,
layout record and the rules for loading under another layout (RNG streams, old-format checkpoints)."""

import json
import os
import random

import pytest
import torch

from hapo_megatron.training.checkpointing.manifest import MANIFEST
from hapo_megatron.training.checkpointing.checkpoint import (LAYOUT_FILE, LEGACY_OPTIMIZER_FORMAT,
                                                             OPTIMIZER_FORMAT, CheckpointManager, Layout,
                                                             LayoutChangeError, capture_rng_state,
                                                             find_latest, list_checkpoints,
                                                             read_checkpoint_info, resolve_resume,
                                                             restore_rng_state, resume_message)


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
    state = mgr.load(latest, load_model=lambda d, fmt: seen.update(torch.load(os.path.join(d, "w.pt")), fmt=fmt))
    assert state == {"step": 3, "cursor": 30} and int(seen["w"]) == 3 and seen["fmt"] == OPTIMIZER_FORMAT
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
    mgr = CheckpointManager(root, keep_last_k=3)
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
    path = CheckpointManager(root, keep_last_k=3).save(4, rl_state={"a": 1})
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


@pytest.mark.parametrize("rank, world", [(1, 1), (2, 2), (-1, 2)])
def test_a_rank_outside_its_world_is_refused(tmp_path, rank, world):
    """Rank 1 of a manager told world_size 1 checksummed every file on its own while rank 0
    renamed the directory under it (a CI failure: FileNotFoundError on layout.json)."""
    with pytest.raises(ValueError, match=f"rank {rank} is not in a world of {world}"):
        CheckpointManager(str(tmp_path), keep_last_k=2, rank=rank, world_size=world, gather=lambda obj: [obj] * world)


def test_layout_recorded_and_described(tmp_path):
    tp2 = Layout(tp=2, dp=2)
    path = CheckpointManager(str(tmp_path), layout=tp2, keep_last_k=3).save(1, rl_state={})
    meta = json.load(open(os.path.join(path, LAYOUT_FILE)))
    assert meta == {"layout": {"tp": 2, "pp": 1, "cp": 1, "dp": 2}, "optimizer_format": OPTIMIZER_FORMAT}
    info = read_checkpoint_info(path)
    assert info.layout == tp2 and info.world_size == 4 and not info.legacy
    assert str(tp2) == "TP=2 PP=1 CP=1 DP=2 (4 ranks)"
    msg = resume_message(path, info, Layout())
    assert "saved under TP=2 PP=1 CP=1 DP=2 (4 ranks), resuming under TP=1 PP=1 CP=1 DP=1 (1 rank)" in msg
    assert "RNG streams not restored" in msg
    assert "RNG streams restored" in resume_message(path, info, tp2)


def _draws():
    return torch.rand(2), random.random()


@pytest.mark.parametrize("resume_layout,restored", [(Layout(tp=2), True), (Layout(dp=2), False)])
def test_rng_restored_only_under_the_saved_layout(tmp_path, resume_layout, restored):
    path = CheckpointManager(str(tmp_path), layout=Layout(tp=2), keep_last_k=3).save(1, rl_state={})
    expected = _draws()  # what the saving rank 0 would have drawn next
    torch.manual_seed(123)
    random.seed(123)
    fresh = _draws()
    torch.manual_seed(123)
    random.seed(123)
    CheckpointManager(str(tmp_path), layout=resume_layout, keep_last_k=3).load(path)
    got = _draws()
    want = expected if restored else fresh
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


def _legacy_checkpoint(root, world_size):
    """A checkpoint as written before the layout record: no layout.json (nor manifest.json, which
    came later), one RNG file per rank."""
    path = CheckpointManager(root, keep_last_k=3).save(2, rl_state={"cursor": 1})
    os.remove(os.path.join(path, LAYOUT_FILE))
    os.remove(os.path.join(path, MANIFEST))
    for r in range(1, world_size):
        torch.save(capture_rng_state(), os.path.join(path, "rng", f"rank_{r:05d}.pt"))
    return path


def test_old_format_checkpoint_loads_on_its_layout_only(tmp_path):
    path = _legacy_checkpoint(str(tmp_path), world_size=2)
    info = read_checkpoint_info(path)
    assert info.legacy and info.world_size == 2 and info.optimizer_format == LEGACY_OPTIMIZER_FORMAT
    formats = []
    state = CheckpointManager(str(tmp_path), layout=Layout(tp=2), keep_last_k=3).load(
        path, load_model=lambda d, fmt: formats.append(fmt))
    assert state["cursor"] == 1 and formats == [LEGACY_OPTIMIZER_FORMAT]
    # another world size: refused before any load, with the way out
    with pytest.raises(LayoutChangeError, match="resume once with the original number of processes"):
        CheckpointManager(str(tmp_path), layout=Layout(),
            keep_last_k=3).load(path, load_model=lambda d, fmt: formats.append(fmt))
    assert len(formats) == 1
    # same world size, other split: the load's own failure comes back explained
    def shape_mismatch(d, fmt):
        raise RuntimeError("Global shape mismatch for loaded ...")
    with pytest.raises(LayoutChangeError, match="Global shape mismatch") as err:
        CheckpointManager(str(tmp_path), layout=Layout(dp=2), keep_last_k=3).load(path, load_model=shape_mismatch)
    assert isinstance(err.value.__cause__, RuntimeError)
    assert "old format" in resume_message(path, info, Layout())


def test_new_format_load_errors_are_not_rewritten(tmp_path):
    path = CheckpointManager(str(tmp_path), keep_last_k=3).save(1, rl_state={})

    def broken(d, fmt):
        raise RuntimeError("disk on fire")
    with pytest.raises(RuntimeError, match="disk on fire"):
        CheckpointManager(str(tmp_path), layout=Layout(tp=2), keep_last_k=3).load(path, load_model=broken)
