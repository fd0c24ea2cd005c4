"""The examples' "already prepared" marker: same settings skip, changed settings rebuild."""

import importlib.util
import json
import os

from hapo_megatron.data.prepared import MARKER, already_prepared, mark_prepared

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_same_settings_skip_other_settings_rebuild(tmp_path, capsys):
    out = str(tmp_path)
    settings = {"seed": 1, "n_train": 10, "force": False}
    assert not already_prepared(out, settings)  # no marker: half-written or new
    mark_prepared(out, settings)
    assert json.load(open(os.path.join(out, MARKER))) == {"seed": 1, "n_train": 10}
    assert already_prepared(out, dict(settings, force=False))
    assert not already_prepared(out, settings, force=True)
    assert not os.path.exists(os.path.join(out, MARKER))  # a rebuild starts without a marker
    mark_prepared(out, settings)
    assert not already_prepared(out, dict(settings, n_train=11))
    assert "n_train" in capsys.readouterr().out  # says which setting changed
    # a rebuild for n_train=11 that stopped half-way must not pass for the old settings
    assert not already_prepared(out, settings)
    mark_prepared(out, settings)
    assert not already_prepared(out, {"seed": 1})  # a setting that disappeared also counts


def test_cpu_tiny_prepare_rebuilds_on_a_changed_setting(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "cpu_tiny_prepare_marker", os.path.join(ROOT, "examples", "cpu_tiny", "prepare.py"))
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    out = str(tmp_path / "data")
    small = ["--out", out, "--n-train", "8", "--n-val", "4", "--hidden", "16", "--layers", "1", "--heads", "2"]
    prepare.main(small)
    train = os.path.join(out, "train.jsonl")
    first = open(train).read()
    os.utime(train, (0, 0))
    prepare.main(small)  # unchanged settings: nothing rewritten
    assert os.stat(train).st_mtime == 0
    prepare.main(small[:5] + ["12"] + small[6:])  # --n-val 12: rebuilt
    assert len(open(os.path.join(out, "val.jsonl")).read().splitlines()) == 12
    assert open(train).read() == first  # deterministic in the seed
