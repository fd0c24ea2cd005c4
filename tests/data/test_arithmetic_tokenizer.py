"""Arithmetic generator (determinism, correct answers, knobs) and the offline char tokenizer."""

import re

import pytest

from hapo_megatron.data import (build_char_tokenizer, generate_arithmetic_rows, load_prompt_rows,
                                write_arithmetic_dataset)
from hapo_megatron.data.char_tokenizer import CHAR_VOCAB


def reference_eval(expr: str) -> int:
    assert re.fullmatch(r"[0-9 +\-*]+", expr), expr
    return eval(expr)  # noqa: S307 - digits and + - * only, checked above


def test_deterministic_by_seed():
    assert generate_arithmetic_rows(30, 4) == generate_arithmetic_rows(30, 4)
    assert generate_arithmetic_rows(30, 4) != generate_arithmetic_rows(30, 5)
    assert generate_arithmetic_rows(10, 4) == generate_arithmetic_rows(30, 4)[:10]


@pytest.mark.parametrize("knobs", [{}, {"min_digits": 2, "max_digits": 3, "min_operands": 3, "max_operands": 5},
                                   {"ops": ("*",), "max_digits": 1},
                                   {"ops": ("-",), "min_operands": 4, "max_operands": 4}])
def test_answers_and_knobs(knobs):
    rows = generate_arithmetic_rows(200, 11, **knobs)
    lo_d, hi_d = knobs.get("min_digits", 1), knobs.get("max_digits", 2)
    lo_k, hi_k = knobs.get("min_operands", 2), knobs.get("max_operands", 3)
    ops = set(knobs.get("ops", "+-*"))
    for row in rows:
        expr = row["extra_info"]["expression"]
        content = row["prompt"][0]["content"]
        assert expr in content and "Answer: <number>" in content and row["prompt"][0]["role"] == "user"
        assert row["reward_model"]["ground_truth"] == str(reference_eval(expr))
        assert row["extra_info"]["solution"].endswith(f"Answer: {reference_eval(expr)}")
        nums = re.findall(r"\d+", expr)
        assert lo_k <= len(nums) <= hi_k
        assert all(lo_d <= len(n) <= hi_d for n in nums)
        assert set(re.findall(r"[+\-*]", expr)) <= ops
        assert row["data_source"] == "arithmetic"
    assert len({r["extra_info"]["expression"] for r in rows}) > 100


def test_bad_knobs():
    with pytest.raises(ValueError, match="ops must be a non-empty subset"):
        generate_arithmetic_rows(3, 0, ops=("/",))
    with pytest.raises(ValueError, match="min_digits <= max_digits"):
        generate_arithmetic_rows(3, 0, min_digits=3, max_digits=2)
    with pytest.raises(ValueError, match="min_operands <= max_operands"):
        generate_arithmetic_rows(3, 0, min_operands=1)


def test_write_and_load_both_formats(tmp_path):
    for ext in ("jsonl", "parquet"):
        path = write_arithmetic_dataset(str(tmp_path / f"a.{ext}"), 12, 2, max_operands=4)
        assert load_prompt_rows(path, prompt_key='prompt') == generate_arithmetic_rows(12, 2, max_operands=4)


def test_solutions_get_full_reward():
    from hapo_megatron.rewards import compute_score

    for row in generate_arithmetic_rows(20, 1):
        gt = row["reward_model"]["ground_truth"]
        assert compute_score(row["extra_info"]["solution"], gt, score_format="pm1").acc
        assert not compute_score(f"Answer: {int(gt) + 1}", gt, score_format="pm1").acc


def test_char_tokenizer_round_trip_and_template(tmp_path, monkeypatch):
    tok = build_char_tokenizer(str(tmp_path / "tok"))
    assert len(tok) < 128
    text = "".join(CHAR_VOCAB) + "What is 37 + 48?\nAnswer: 85"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id}) == 4
    assert tok("é", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]
    msgs = [{"role": "user", "content": "What is 1 + 2?"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        "<bos><|user|>What is 1 + 2?<eos><|assistant|>"
    chat = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "Answer: 3"}], tokenize=False)
    assert chat.endswith("<|assistant|>Answer: 3<eos>")
    # offline load with AutoTokenizer gives the same tokenizer
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.chat_template == tok.chat_template
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.bos_token_id) == \
        (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id)
    assert loaded.decode(loaded("<|assistant|>12", add_special_tokens=False)["input_ids"],
                         skip_special_tokens=True) == "12"
