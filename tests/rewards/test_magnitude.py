"""The digits guard: hand-computed bounds, towers, factorials, binomials, garbage that never raises."""

import math

import pytest

from hapo_megatron.rewards.magnitude import MAX_RESULT_DIGITS, digits_bound, exceeds_digits

L2, L9 = math.log10(2), math.log10(9)


@pytest.mark.parametrize("answer, expected", [
    ("2^{100}", 100 * L2),
    ("2^10", 10 * L2),               # a number run counts whole (the larger reading)
    ("9^{9^{9}}", 9 ** 9 * L9),
    ("9**9**9", 9 ** 9 * L9),        # ** is ^, right-associative
    ("x^{100}", 100.0),              # a symbol counts as ~10
    ("100!", 200.0),                 # n log10 n
    ("\\left(2^{10}\\right)!", 1024 * 10 * L2),
    ("\\binom{100}{50}", 100 * L2),  # min(n log10 2, k log10 n)
    ("\\dbinom{1000000}{3}", 3 * 6.0),
    ("\\frac{1}{2}", L2),
    ("0.5^{10}", 10.0),              # a decimal costs its digits: 0.5 is 5/10
    ("\\sqrt[3]{8}", math.log10(3) + math.log10(8)),
    ("1^{10^{100}}", 0.0),           # a base of size 0 stays 0
    ("\\exp(100)", 100 * math.log10(math.e)),
    ("1000000!", 6e6),
])
def test_hand_computed_bounds(answer, expected):
    assert digits_bound(answer) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("answer", [
    "9^{9^{9}}", "10^{10^{100}}", "2^{2^{2^{2^{2^{2}}}}}", "99999999999^{99999999}", "9^{9^{9^{9}}}",
    "1000000!", "((((3!)!)!)!)!", "\\binom{10^{9}}{10^{8}}", "\\sqrt{2^{10^{7}}}", "\\frac{1}{7^{10^{6}}}",
    "e^{10^{100}}", "\\exp(10^{6})", "(10^{6})!", "2^{-10^{6}}", "\\log(9^{9^{9}})",
])
def test_explosive_answers_are_caught(answer):
    assert exceeds_digits(answer)


@pytest.mark.parametrize("answer", [
    "2^{100}", "\\binom{100}{50}", "2^{2^{2^{2^{2}}}}", "1000!", "10^{-3}", "\\frac{\\sqrt{3}}{2}", "x^{2}+1",
    "(1,2,3)", "\\{1,2\\}", "\\pi r^{2}", "3\\times10^{8}", "9" * 299,
])
def test_ordinary_answers_pass(answer):
    assert not exceeds_digits(answer)


@pytest.mark.parametrize("garbage", ["", "}}}{{{", "^^^!!!", "\\frac", "\\binom{", "\\sqrt[", "((((", "a^", "!",
                                     "{" * 400 + "9" + "}" * 400, "\\left.\\right|", "$$", "\\unknown{x}^{2}"])
def test_never_raises(garbage):
    assert isinstance(exceeds_digits(garbage), bool)
    assert digits_bound(garbage) >= 0


def test_limit_is_the_threshold():
    assert not exceeds_digits("10^{100000}") and exceeds_digits("10^{100001}")
    assert MAX_RESULT_DIGITS == 100_000
    assert exceeds_digits("10^{1000}", max_digits=999) and not exceeds_digits("10^{1000}", max_digits=1000)
