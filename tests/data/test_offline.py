"""Offline first (hapo_megatron/hub_offline.py): with the hub out of reach, `hapo data prepare`
goes to the caches at once and says what to pass instead, leaves no folder behind, and a tokenizer
it cannot load only skips the length report."""

import os
import socket
import subprocess
import sys

import pytest

from hapo_megatron import hub_offline
from tests.data import tiny_math_sets as tiny

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: a connection is refused at once
    return port


@pytest.fixture
def online_env(monkeypatch):
    for var in hub_offline._OFFLINE_VARS:
        monkeypatch.delenv(var, raising=False)


def test_an_offline_variable_skips_the_probe(online_env, monkeypatch):
    def no_probe(*a, **k):
        raise AssertionError("probed the hub although HF_HUB_OFFLINE is set")
    monkeypatch.setattr(socket, "create_connection", no_probe)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_offline.offline_reason() == "HF_HUB_OFFLINE=1"


def test_an_unreachable_hub_turns_the_libraries_offline(online_env, monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    reason = hub_offline.go_offline_if_unreachable()
    assert reason and "cannot be reached" in reason
    assert all(os.environ[v] == "1" for v in hub_offline._OFFLINE_VARS)
    # the libraries read their flags once, at import: the imported copies follow too
    assert huggingface_hub.constants.HF_HUB_OFFLINE is True and datasets.config.HF_HUB_OFFLINE is True
    for var in hub_offline._OFFLINE_VARS:
        monkeypatch.delenv(var)


def test_a_reachable_hub_changes_nothing(online_env, monkeypatch):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
    try:
        assert hub_offline.go_offline_if_unreachable() is None
        assert "HF_HUB_OFFLINE" not in os.environ
    finally:
        server.close()


def _prepare(tmp_path, *args, offline_env: dict):
    env = {k: v for k, v in os.environ.items() if k not in hub_offline._OFFLINE_VARS}
    env.update(offline_env, HF_HOME=str(tmp_path / "empty_home"),
               PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), ROOT])))
    env.pop("HF_DATASETS_CACHE", None)
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-m", "hapo_megatron.cli", "data", "prepare", *args, "--no-progress"],
                          env=env, capture_output=True, text=True, timeout=300)


def test_prepare_with_the_hub_unreachable_says_what_to_pass_and_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    done = _prepare(tmp_path, "aime-2024", "--out", str(out), "--tokenizer", "none",
                    offline_env={"HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"})
    assert done.returncode == 2, done.stderr
    assert "offline (the hub (127.0.0.1:" in done.stderr  # detected before datasets tried
    assert "HF_HUB_OFFLINE='1'" in done.stderr and "--from PATH" in done.stderr
    assert "Traceback" not in done.stderr and "Retrying" not in done.stderr, done.stderr
    assert not out.exists()


def test_a_tokenizer_that_cannot_load_skips_the_length_report(tmp_path):
    out = tmp_path / "out"
    done = _prepare(tmp_path, "aime-2024", "--out", str(out), "--tokenizer", str(tmp_path / "no_tokenizer"),
                    "--from", tiny.aime_2024(str(tmp_path)), offline_env={"HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: --tokenizer")]
    assert len(warnings) == 1 and "length report is skipped" in warnings[0]
    assert "prompt lengths not measured" in done.stdout
    assert (out / "aime24.parquet").exists()


def test_a_hub_model_name_with_the_hub_unreachable_is_one_line(online_env, monkeypatch, tmp_path):
    """model.hf_model_path / data.tokenizer_path named on the hub (hapo train, eval, convert resolve
    them with models/hub.py): offline at once, then the cache or a one-line refusal."""
    import huggingface_hub.constants

    from hapo_megatron.models.hub import resolve_model_path

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match=r"model.hf_model_path: 'tiny-org/absent' is not a local directory and is "
                                         r"not in the HF cache .*HF_HUB_OFFLINE='1'.*"
                                         r"outgoing traffic has been disabled"):
        resolve_model_path("tiny-org/absent")
    for var in hub_offline._OFFLINE_VARS:
        monkeypatch.delenv(var)
