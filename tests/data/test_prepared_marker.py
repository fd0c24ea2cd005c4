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


def _cpu_tiny_prepared(tmp_path):
    """examples/cpu_tiny/prepare.py loaded as a module, run once at a tiny size: (module, its
    arguments, the output directory)."""
    spec = importlib.util.spec_from_file_location(
        "cpu_tiny_prepare_marker", os.path.join(ROOT, "examples", "cpu_tiny", "prepare.py"))
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    out = str(tmp_path / "data")
    small = ["--out", out, "--n-train", "8", "--n-val", "4", "--hidden", "16", "--layers", "1", "--heads", "2"]
    prepare.main(small)
    return prepare, small, out


def test_cpu_tiny_prepare_rebuilds_on_a_changed_setting(tmp_path):
    prepare, small, out = _cpu_tiny_prepared(tmp_path)
    train = os.path.join(out, "train.jsonl")
    first = open(train).read()
    os.utime(train, (0, 0))
    prepare.main(small)  # unchanged settings: nothing rewritten
    assert os.stat(train).st_mtime == 0
    prepare.main(small[:5] + ["12"] + small[6:])  # --n-val 12: rebuilt
    assert len(open(os.path.join(out, "val.jsonl")).read().splitlines()) == 12
    assert open(train).read() == first  # deterministic in the seed


def test_a_directory_prepared_by_other_code_is_rebuilt(tmp_path, capsys):
    """The marker holds a hash of the code that wrote the data: the same flags with another
    ``prepare.py`` (or data writer) rebuild (a directory from before a new field was added was
    reused)."""
    from hapo_megatron.data.prepared import code_fingerprint
    script = tmp_path / "prepare.py"
    script.write_text("ROWS = 1\n")
    first = code_fingerprint(str(script), "hapo_megatron.data.rows")
    assert first == code_fingerprint(str(script), "hapo_megatron.data.rows") and len(first) == 16
    out = str(tmp_path / "data")
    os.makedirs(out)
    mark_prepared(out, {"seed": 1, "code_sha256": first})
    script.write_text("ROWS = 2\n")
    changed = code_fingerprint(str(script), "hapo_megatron.data.rows")
    assert not already_prepared(out, {"seed": 1, "code_sha256": changed})
    assert "code_sha256" in capsys.readouterr().out
    assert code_fingerprint(str(script)) != code_fingerprint(str(script), "hapo_megatron.data.steps")


def test_the_examples_markers_record_their_code(tmp_path):
    """cpu_tiny's marker has the hash; a marker without it (an older directory) does not match."""
    prepare, small, out = _cpu_tiny_prepared(tmp_path)
    marker = json.load(open(os.path.join(out, MARKER)))
    assert len(marker["code_sha256"]) == 16
    marker.pop("code_sha256")
    json.dump(marker, open(os.path.join(out, MARKER), "w"))
    train = os.path.join(out, "train.jsonl")
    os.utime(train, (0, 0))
    prepare.main(small)  # prepared by code that did not record itself: rebuilt
    assert os.stat(train).st_mtime != 0
    assert "exact_solution" in open(train).readline()
