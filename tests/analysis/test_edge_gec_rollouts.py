"""examples/cpu_tiny/edge_gec_rollouts.py: the breakdown of a run's saved rollouts by EDGE-GRPO's
correction branch, on hand-built records whose counts and first-token sums are known, and the
script end to end on a run directory with the character tokenizer."""

from __future__ import annotations

import importlib.util
import os

import yaml

from hapo_megatron.analysis.rollouts import rollout_path, write_rollouts
from hapo_megatron.data import build_char_tokenizer

SCRIPT = os.path.join(os.path.dirname(__file__), "../../examples/cpu_tiny/edge_gec_rollouts.py")
CUE, HINT = "\nWait!", "\nAnswer: {answer}"


def _script():
    spec = importlib.util.spec_from_file_location("edge_gec_rollouts", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _records(tok, step: int = 7) -> list[dict]:
    eos = tok.eos_token_id
    rows = [  # (text, acc, advantage)
        ("Answer: 3" + CUE + "ok", False, -1.0),   # reflection, 2 tokens after the cue
        (CUE, False, -2.0),                        # reflection on an empty response, none after
        ("Answer: 3\nAnswer: 5", True, 0.5),      # hint
        ("\nAnswer: 5", True, 1.5),                # hint on an empty response
        ("Answer: 5", True, 0.25),                 # correct (or the solution branch)
        ("Answer: 4", False, -0.75),               # wrong, not corrected (the correction skipped)
    ]
    out = []
    for i, (text, acc, adv) in enumerate(rows):
        ids = tok.encode(text, add_special_tokens=False) + [eos]
        out.append({"step": step, "uid": i, "acc": acc, "response_ids": ids, "adv_after": [adv] * len(ids)})
    return out


def test_step_summary_counts_each_branch_and_sums_first_token_advantages(tmp_path):
    mod = _script()
    tok = build_char_tokenizer()
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    s = mod.step_summary(_records(tok), enc(CUE), enc("\nAnswer: "), [tok.eos_token_id])
    assert {k: s[k] for k in ("rows", "reflect", "reflect_on_empty", "hint", "hint_on_empty", "correct", "wrong")} \
        == {"rows": 6, "reflect": 2, "reflect_on_empty": 1, "hint": 2, "hint_on_empty": 1, "correct": 1, "wrong": 1}
    assert s["continuation_mean"] == 1.0  # (2 + 0) / 2: the stop token is not counted
    a, nl = enc("A")[0], enc("\n")[0]
    assert s["first_token_adv"] == {a: (4, -1.0 + 0.5 + 0.25 - 0.75), nl: (2, -2.0 + 1.5)}


def test_the_script_reads_a_run_directory(tmp_path, capsys):
    tok_dir = str(tmp_path / "tok")
    tok = build_char_tokenizer(tok_dir)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(
        {"data": {"tokenizer_path": tok_dir}, "algo": {"edge_gec_cue": CUE, "edge_gec_hint": HINT}}))
    write_rollouts(rollout_path(str(run), 7), _records(tok))
    assert _script().main([str(run)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[2] == "| 7 | 6 | 2 (1) | 2 (1) | 1 | 1 | 1.0 | `A`: 4, -1.0, `\\n`: 2, -0.5 |"


def test_the_script_says_when_nothing_was_saved(tmp_path, capsys):
    tok_dir = str(tmp_path / "tok")
    build_char_tokenizer(tok_dir)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(
        {"data": {"tokenizer_path": tok_dir}, "algo": {"edge_gec_cue": CUE, "edge_gec_hint": HINT}}))
    assert _script().main([str(tmp_path)]) == 1
    assert "no saved rollouts" in capsys.readouterr().err
