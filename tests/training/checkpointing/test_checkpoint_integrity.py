"""Checkpoint integrity: the manifest (size + CRC32 of every file) written before COMPLETE, its
check at load, and `trainer.resume=auto` falling back to the newest checkpoint that loads."""

import json
import os
import zlib

import pytest
import torch

from hapo_megatron.training.checkpointing.checkpoint import (CheckpointLoadError, CheckpointManager,
                                                             list_checkpoints, load_newest_loadable)
from hapo_megatron.training.checkpointing.manifest import MANIFEST, checksum_share, share, verify


def _save_model(payload):
    def fn(d):
        os.makedirs(d, exist_ok=True)
        torch.save(payload, os.path.join(d, "w.pt"))
        with open(os.path.join(d, "big.bin"), "wb") as f:
            f.write(bytes(range(256)) * 4096)  # 1 MiB, several read chunks of zlib.crc32 apart
    return fn


def _load_into(box):
    def fn(d, fmt):
        box["w"] = torch.load(os.path.join(d, "w.pt"))
    return fn


def test_manifest_records_every_file_with_size_and_crc32(tmp_path):
    path = CheckpointManager(str(tmp_path),
        keep_last_k=3).save(3, rl_state={"a": 1}, save_model=_save_model(torch.ones(3)))
    files = json.load(open(os.path.join(path, MANIFEST)))["files"]
    on_disk = sorted(os.path.relpath(os.path.join(r, n), path) for r, _, ns in os.walk(path) for n in ns)
    assert sorted(files) == [f for f in on_disk if f not in ("COMPLETE", MANIFEST)]
    assert {"model/w.pt", "model/big.bin", "rl_state.json", "layout.json", "rng/rank_00000.pt"} <= set(files)
    for rel, entry in files.items():  # against a one-shot read of the whole file
        data = open(os.path.join(path, rel), "rb").read()
        assert entry == {"size": len(data), "crc32": zlib.crc32(data)}, rel
    assert verify(path) == []


def test_share_splits_the_files_once_over_the_ranks(tmp_path):
    sizes = {f"f{i}": s for i, s in enumerate([50, 10, 10, 30, 1, 0, 7])}
    parts = [share(list(sizes), sizes, r, 3) for r in range(3)]
    assert sorted(f for p in parts for f in p) == sorted(sizes)
    assert max(sum(sizes[f] for f in p) for p in parts) == 50  # the biggest file alone
    # what 2 ranks checksum together is what 1 rank checksums alone
    path = CheckpointManager(str(tmp_path), keep_last_k=3).save(1, rl_state={}, save_model=_save_model(torch.ones(3)))
    two = [checksum_share(path, r, 2) for r in range(2)]
    assert two[0] and two[1] and not set(two[0]) & set(two[1])
    assert {**two[0], **two[1]} == checksum_share(path, 0, 1)


def test_truncated_or_flipped_file_fails_verification_naming_it(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep_last_k=3)
    path = mgr.save(1, rl_state={}, save_model=_save_model(torch.ones(3)))
    shard = os.path.join(path, "model", "big.bin")
    with open(shard, "r+b") as f:  # a flipped byte in the middle, same size
        f.seek(500_000)
        byte = f.read(1)
        f.seek(500_000)
        f.write(bytes([byte[0] ^ 1]))
    assert [p.split(":")[0] for p in verify(path)] == ["model/big.bin"]
    assert "CRC32" in verify(path)[0]
    os.truncate(shard, 1000)
    assert verify(path) == ["model/big.bin: 1000 bytes, 1048576 recorded (truncated or rewritten)"]
    with pytest.raises(CheckpointLoadError, match=r"step_000001 fails verification .*model/big.bin: 1000 bytes"):
        mgr.load(path, load_model=_load_into({}))


def test_a_file_that_does_not_load_is_named(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep_last_k=3)
    path = mgr.save(1, rl_state={}, save_model=_save_model(torch.ones(3)))
    os.remove(os.path.join(path, MANIFEST))  # unverifiable (as before manifests): loading decides
    with open(os.path.join(path, "rl_state.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointLoadError,
                       match=r"step_000001: loading failed: rank 0: rl_state.json: JSONDecodeError"):
        mgr.load(path, load_model=_load_into({}))


def test_auto_resume_skips_damaged_checkpoints_and_says_why(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep_last_k=5)
    for step in (2, 4, 6):
        mgr.save(step, rl_state={"cursor": step}, save_model=_save_model(torch.full((3,), float(step))))
    newest_first = [p for _, p in reversed(list_checkpoints(str(tmp_path)))]
    os.truncate(os.path.join(newest_first[0], "model", "big.bin"), 10)  # step 6: truncated shard

    def fails_on_4(d, fmt):
        if "step_000004" in d:
            raise EOFError("Ran out of input")
        box["w"] = torch.load(os.path.join(d, "w.pt"))
    box, lines = {}, []
    path, state = load_newest_loadable(mgr, newest_first, load_model=fails_on_4, log=lines.append)
    assert path.endswith("step_000002") and state["cursor"] == 2 and torch.equal(box["w"], torch.full((3,), 2.0))
    assert len(lines) == 2
    assert lines[0].startswith("resume: skipping step_000006: checkpoint ") and "model/big.bin: 10 bytes" in lines[0]
    assert lines[1].startswith("resume: skipping step_000004: ") and "model/ (dist_checkpointing): EOFError" in lines[1]


def test_auto_resume_with_no_loadable_checkpoint_stops_instead_of_starting_fresh(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep_last_k=3)
    path = mgr.save(2, rl_state={}, save_model=_save_model(torch.ones(3)))
    os.remove(os.path.join(path, "model", "w.pt"))
    with pytest.raises(CheckpointLoadError,
                       match=r"none of the 1 complete checkpoint\(s\) .* model/w.pt: missing.*trainer.resume=none"):
        load_newest_loadable(mgr, [path], load_model=_load_into({}), log=lambda _: None)


def test_a_stop_mid_step_saves_the_snapshot_state_and_rng(tmp_path):
    """`Runtime.save_checkpoint(snapshot)` (a step abandoned at a stop signal) records the RL state
    and RNG streams of the snapshot, not the ones the abandoned stage moved on."""
    from types import SimpleNamespace

    from hapo_megatron.training.checkpointing.checkpoint import capture_rng_state
    from hapo_megatron.training.runtime import Runtime, StepSnapshot
    mgr = CheckpointManager(str(tmp_path), keep_last_k=3)
    snapshot = StepSnapshot({"step": 1, "cursor": 7}, capture_rng_state())
    after_snapshot = torch.rand(4)
    torch.rand(100)  # the abandoned rollout moves the stream on
    rt = SimpleNamespace(ckpt=mgr, actor=SimpleNamespace(save=_save_model(torch.ones(2))),
                         checkpoint_state=lambda: {"step": 2, "cursor": 9})
    path = Runtime.save_checkpoint(rt, snapshot)
    assert path.endswith("step_000001")
    assert mgr.load(path, load_model=_load_into({}))["cursor"] == 7
    assert torch.equal(torch.rand(4), after_snapshot)
