"""`hapo doctor`'s SGLang check on the machines it meets (hapo_megatron/doctor/sglang_checks.py):
which weight-sync modes run, on which server, and what is skipped with its reason. The servers are
stand-ins here (the check itself runs a real CPU server in tests/doctor/test_doctor.py; the GPU
paths run where a GPU is). Mutation tried: the old plan on one GPU (distributed and disk launch a
non-colocated server, which needs a second GPU): the one-GPU test fails."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hapo_megatron.doctor import sglang_checks as sc


def test_plans():
    assert sc.plan_modes(cuda=False, gpus=0) == ([("tensor", True), ("disk", False)],
                                                 [("distributed", "NCCL needs CUDA")], True)
    assert sc.plan_modes(cuda=True, gpus=1) == ([("tensor", True), ("disk", False)],
                                                [("distributed", sc.ONE_GPU_SKIPPED)], True)
    assert sc.plan_modes(cuda=True, gpus=2) == ([("tensor", True), ("distributed", False), ("disk", False)], [],
                                                False)


class _Engine:
    def __init__(self, url):
        self.servers = [SimpleNamespace(url=url)]
        self.shut = False

    def shutdown(self):
        self.shut = True


@pytest.mark.parametrize("gpus", [1, 2])
def test_one_gpu_launches_one_colocated_server_and_skips_distributed(monkeypatch, gpus):
    """On one GPU only the colocated engine launches a server (on the trainer's GPU); the disk mode
    attaches to it, distributed is reported skipped with its reason, and the first server runs the
    asynchronous and abort/resume exercises. With two GPUs every mode launches its own."""
    launched, exercised = [], []

    def engine(model_dir, mode, log_dir, dtype, api_key, attach_to=None, colocate=None):
        if attach_to is None:
            launched.append((mode, colocate))
        return SimpleNamespace(rollout=None), _Engine(attach_to or f"http://127.0.0.1:{len(launched)}")

    monkeypatch.setattr(sc, "_engine", engine)
    monkeypatch.setattr(sc, "_exercise", lambda cfg, eng, md, mode, dev, dt: exercised.append(mode) or f"{mode}: ok")
    monkeypatch.setattr(sc, "_exercise_async", lambda *a: exercised.append("async") or "v1")
    monkeypatch.setattr(sc, "_exercise_abort_resume", lambda *a: exercised.append("abort") or "resumed")
    monkeypatch.setattr(sc, "write_tiny_model", lambda out, dtype: out)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(sc.importlib.util, "find_spec", lambda name: object())
    res = sc.check_sglang_server()
    assert res.status == "PASS", res
    if gpus == 1:
        assert launched == [("tensor", True)]  # nothing needs a second GPU
        assert exercised == ["tensor", "async", "abort", "disk"]
        assert f"distributed: skipped, {sc.ONE_GPU_SKIPPED}" in res.figure
        assert "async: v1" in res.figure and "abort/resume: resumed" in res.figure
    else:
        assert launched == [("tensor", True), ("distributed", False), ("disk", False)]
        assert "skipped" not in res.figure


def test_a_failing_exercise_fails_the_check_and_keeps_the_others(monkeypatch):
    monkeypatch.setattr(sc, "_engine", lambda *a, attach_to=None, colocate=None: (None, _Engine("http://x:1")))
    monkeypatch.setattr(sc, "_exercise", lambda cfg, eng, md, mode, dev, dt: f"{mode}: ok")

    def async_fails(*a):
        raise AssertionError("tokens after the update report weight versions [0], not 1")
    monkeypatch.setattr(sc, "_exercise_async", async_fails)
    monkeypatch.setattr(sc, "_exercise_abort_resume", lambda *a: "resumed")
    figures, failed = sc._run_modes("m", [("tensor", True), ("disk", False)], "/tmp", "cpu", torch.float32,
                                    one_server=True, server_loops=True)
    assert failed == ["async: AssertionError: tokens after the update report weight versions [0], not 1"]
    assert figures == ["tensor: ok", "abort/resume: resumed", "disk: ok"]
