"""The step-by-step arithmetic task: generator, noisy warm-start targets, token roles, reward."""

import re

import pytest

from hapo_megatron.data.steps import generate_step_rows, parse_step_lines, step_solution, token_roles
from hapo_megatron.rewards.math import compute_score


def reference_eval(expr: str) -> int:
    assert re.fullmatch(r"[0-9 +\-]+", expr), expr
    return eval(expr)  # noqa: S307 - digits and + - only, checked above


def test_hand_case():
    text, answer = step_solution([7, 5, 3, 8], ["+", "-", "+"])
    assert text == "7 + 5 = 12\n12 - 3 = 9\n9 + 8 = 17\nAnswer: 17" and answer == 17
    assert parse_step_lines(text) == [(7, "+", 5, 12), (12, "-", 3, 9), (9, "+", 8, 17)]


def test_deterministic_and_noise_does_not_change_the_problems():
    assert generate_step_rows(20, 3) == generate_step_rows(20, 3)
    assert generate_step_rows(20, 3) != generate_step_rows(20, 4)
    clean, noisy = generate_step_rows(200, 3), generate_step_rows(200, 3, noise=0.3)
    assert [r["prompt"] for r in clean] == [r["prompt"] for r in noisy]
    assert [r["reward_model"] for r in clean] == [r["reward_model"] for r in noisy]


@pytest.mark.parametrize("knobs", [{}, {"min_operands": 3, "max_operands": 3}, {"max_operand": 5, "max_value": 9}])
def test_clean_solutions_are_correct_and_verified(knobs):
    rows = generate_step_rows(300, 7, **knobs)
    lo, hi = knobs.get("min_operands", 2), knobs.get("max_operands", 5)
    for row in rows:
        expr, sol = row["extra_info"]["expression"], row["extra_info"]["solution"]
        truth = reference_eval(expr)
        assert row["reward_model"]["ground_truth"] == str(truth) and expr in row["prompt"][0]["content"]
        steps = parse_step_lines(sol)
        assert lo - 1 <= len(steps) == row["extra_info"]["num_steps"] <= hi - 1
        for a, op, b, r in steps:  # every running value in range, every line right
            assert r == (a + b if op == "+" else a - b) and 0 <= r <= knobs.get("max_value", 19)
        assert compute_score(sol, str(truth), score_format="pm1").acc
    if not knobs:  # defaults: 1 to 4 steps, so variable length, tens of tokens
        lengths = {len(r["extra_info"]["solution"]) for r in rows}
        assert min(lengths) < 25 and max(lengths) > 45


def test_noisy_targets_carry_their_errors_consistently():
    rows = generate_step_rows(2000, 5, noise=0.2)
    wrong_steps = total_steps = wrong_answers = 0
    for row in rows:
        sol = row["extra_info"]["solution"]
        steps = parse_step_lines(sol)
        operands = [int(x) for x in re.findall(r"\d+", row["extra_info"]["expression"])]
        assert steps[0][0] == operands[0] and [b for _, _, b, _ in steps] == operands[1:]
        for (_, _, _, r), (a_next, _, _, _) in zip(steps, steps[1:]):
            assert a_next == r  # the written value is carried on
        for a, op, b, r in steps:
            err = r - (a + b if op == "+" else a - b)
            assert err in (0, -2, -1, 1, 2)
            wrong_steps += err != 0
            total_steps += 1
        assert sol.endswith(f"Answer: {steps[-1][3]}")
        ok = compute_score(sol, row["reward_model"]["ground_truth"], score_format="pm1").acc
        wrong_answers += not ok
        assert ok == (steps[-1][3] == int(row["reward_model"]["ground_truth"]))
    assert 0.17 < wrong_steps / total_steps < 0.23 and wrong_answers > 0.2 * len(rows)


def test_token_roles():
    text = "12 - 3 = 9\n9 + 8 = 17\nAnswer: 17"
    roles = token_roles(list(text) + ["<eos>"])
    picked = lambda role: "".join(c for c, r in zip(text, roles) if r == role)  # noqa: E731
    assert (picked("result"), picked("answer"), picked("carried")) == ("917", "17", "9")
    assert (picked("operand"), picked("operator")) == ("1238", "-+")
    assert picked("format") == "   = \n   = \nAnswer: " and roles[-1] == "end"
    assert token_roles(list("1 1 = x\nAnswer: -4")) == ["other"] * 7 + ["format"] * 9 + ["answer"] * 2
    assert token_roles(["5 + 1", " = ", "6", "<eos>"]) == ["operand", "format", "result", "end"]


def test_bad_knobs():
    with pytest.raises(ValueError, match="min_operands <= max_operands"):
        generate_step_rows(3, 0, min_operands=1)
    with pytest.raises(ValueError, match="max_value must be >="):
        generate_step_rows(3, 0, max_operand=9, max_value=10)
    with pytest.raises(ValueError, match="noise must be in"):
        generate_step_rows(3, 0, noise=1.5)
    with pytest.raises(ValueError, match="ops may only hold"):
        step_solution([1, 2], ["*"])
