"""Math reward: answer extraction, math-verify equivalence, score formats, thread safety."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from hapo_megatron.rewards import (
    RewardResult, answers_equivalent, compute_score, extract_answer_line, extract_boxed, extract_final_answer,
)


@pytest.mark.parametrize("text, expected", [
    ("so the answer is \\boxed{85}.", "85"),
    ("\\boxed{1} and later \\boxed{2}", "2"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\frac{a}{b} + {c}}", "\\frac{a}{b} + {c}"),
    ("\\boxed{3} then \\boxed{\\sqrt{2", "3"),  # the unbalanced last one is ignored
    ("\\fbox{7}", "7"),
    ("\\boxed 5 is it", "5"),
    ("no box here", None),
    ("", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("work...\nAnswer: 85", "85"),
    ("Answer: 1\nmore\nAnswer: 85.", "85"),
    ("answer: $-3$\n", "-3"),
    ("Answer: \\boxed{42}", "42"),
    ("Final Answer:  12 \nthanks", "12"),
    ("Answer:   \n", None),
    ("no answer line", None),
])
def test_extract_answer_line(text, expected):
    assert extract_answer_line(text) == expected


def test_extract_final_answer_takes_the_later_form():
    assert extract_final_answer("\\boxed{1}\nAnswer: 2") == "2"
    assert extract_final_answer("Answer: 2\nso \\boxed{3}") == "3"
    assert extract_final_answer("Answer: \\boxed{4}") == "4"
    assert extract_final_answer(None) is None


@pytest.mark.parametrize("pred, truth", [
    ("0.5", "\\frac{1}{2}"), ("\\frac{1}{2}", "0.5"), ("85.0", "85"), ("85", "85.0"), ("1,000", "1000"),
    ("\\dfrac{3}{4}", "0.75"), ("x = 5", "5"), ("2^{10}", "1024"), ("\\sqrt{2}", "\\sqrt 2"), (" 85 ", "85"),
])
def test_equivalent_forms(pred, truth):
    assert answers_equivalent(pred, truth)
    assert compute_score(f"... Answer: {pred}", truth, score_format="pm1").acc


@pytest.mark.parametrize("pred, truth", [("84", "85"), ("-85", "85"), ("\\frac{1}{3}", "0.5"), ("12", "1,2"),
                                         ("", "1")])
def test_wrong_answers(pred, truth):
    assert not answers_equivalent(pred, truth)


def test_scores_and_formats():
    ok = compute_score("think\nAnswer: 85", "85", score_format="pm1")
    assert ok == RewardResult(score=1.0, acc=True, pred="85")
    bad = compute_score("think\nAnswer: 84", "85", score_format="pm1")
    assert bad == RewardResult(score=-1.0, acc=False, pred="84")
    assert compute_score("Answer: 84", "85", score_format="01") == RewardResult(0.0, False, "84")
    assert compute_score("Answer: 85", "85", score_format="01") == RewardResult(1.0, True, "85")
    for empty in ("", None, "I do not know"):
        assert compute_score(empty, "85", score_format="pm1") == RewardResult(-1.0, False, None)
        assert compute_score(empty, "85", score_format="01").score == 0.0
    assert compute_score("\\boxed{85}", 85, score_format="pm1").acc  # a numeric ground truth works too
    assert compute_score("Answer: 3", "3", score_format="pm1", data_source="x", extra_info={}).acc  # extras ignored
    with pytest.raises(ValueError, match="score_format must be 'pm1' or '01'"):
        compute_score("Answer: 1", "1", score_format="bin")


def test_long_answer_is_bounded():
    start = time.time()
    res = compute_score("Answer: " + "(1+" * 400 + "1" + ")" * 400, "2", score_format="pm1")
    assert not res.acc and time.time() - start < 5


def test_thread_safe():
    cases = [("Answer: \\frac{1}{2}", "0.5", True), ("\\boxed{0.75}", "\\frac{3}{4}", True),
             ("Answer: 7", "8", False), ("\\boxed{2^{10}}", "1024", True)] * 8
    errors = []

    def score(case):
        text, truth, want = case
        try:
            assert threading.current_thread() is not threading.main_thread()
            return compute_score(text, truth, score_format="pm1").acc == want
        except Exception as err:  # pragma: no cover - would be the signal-in-thread failure
            errors.append(err)
            return False

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(score, cases))
    assert not errors and all(results)


# --- bounded time: every call returns, with a defined score and a counted timeout ---

from math import comb  # noqa: E402

from hapo_megatron.rewards import get_reward_fn  # noqa: E402
from hapo_megatron.rewards import math as math_reward  # noqa: E402
from hapo_megatron.rewards.bounded import shared_pool  # noqa: E402

EXPLOSIVE = ["9^{9^{9}}", "10^{10^{100}}", "2^{2^{2^{2^{2^{2}}}}}", "99999999999^{99999999}", "9^{9^{9^{9}}}",
             "1000000!"]
PATHOLOGICAL = [
    "\\sqrt{2+" * 25 + "2" + "}" * 25,                       # nested radicals
    "\\frac{1}{1+" * 25 + "1" + "}" * 25,                    # a deep continued fraction
    "9" * 290,                                               # a huge integer
    "2^{3^{4^{5}}}", "7^{7^{7^{7^{7}}}}", "10^{10^{10^{10}}}",  # tall towers
    "((((((3!)!)!)!)!)!)!", "(10!)!", "\\binom{10^{7}}{5\\cdot10^{6}}", "\\left(10^{5}\\right)!",
    "\\sqrt{\\frac{1}{9^{9^{9}}}}", "\\frac{9^{9^{9}}}{9^{9^{9}}+1}",
]


def _pool_timeouts():
    return shared_pool().timeouts


@pytest.mark.parametrize("answer", EXPLOSIVE)
def test_explosive_answers_are_wrong_without_sympy(answer):
    before = _pool_timeouts()
    for fmt, wrong in (("pm1", -1.0), ("01", 0.0)):
        res = compute_score(f"so \\boxed{{{answer}}}", "1", score_format=fmt)
        assert res == RewardResult(score=wrong, acc=False, pred=answer, timed_out=False)
    assert get_reward_fn("math")(f"\\boxed{{{answer}}}", "1", score_format="pm1").score == -1.0
    assert _pool_timeouts() == before  # the guard decided: no worker was asked


@pytest.mark.parametrize("answer", PATHOLOGICAL)
def test_pathological_corpus_returns_with_a_defined_score(answer):
    before = _pool_timeouts()
    res = compute_score(f"\\boxed{{{answer}}}", "1", verify_timeout_s=2.0, score_format="pm1")
    assert res.score == -1.0 and not res.acc
    assert _pool_timeouts() - before == int(res.timed_out)  # a timeout is flagged and counted, once


@pytest.mark.parametrize("thread", [False, True])
def test_hard_limit_when_the_guard_misses(monkeypatch, thread):
    monkeypatch.setattr(math_reward, "exceeds_digits", lambda *a, **k: False)  # sympy gets 9^(9^9)
    before = _pool_timeouts()
    out = []
    run = lambda: out.append(compute_score("\\boxed{9^{9^{9}}}", "1", score_format="01", verify_timeout_s=0.5))
    if thread:
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
    else:
        run()
    assert out == [RewardResult(score=0.0, acc=False, pred="9^{9^{9}}", timed_out=True)]
    assert _pool_timeouts() == before + 1
    assert compute_score("\\boxed{2^{10}}", "1024", score_format="pm1").acc  # the pool still answers


@pytest.mark.parametrize("pred, truth", [
    ("2^{100}", str(2 ** 100)), (str(2 ** 100), "2^{100}"), ("\\binom{100}{50}", str(comb(100, 50))),
    ("\\dbinom{100}{50}", str(comb(100, 50))), ("2^{2^{2^{2}}}", "65536"), ("20!", str(2432902008176640000)),
    ("9^{9^{9}}", "9^{9^{9}}"), ("\\dfrac{1}{9^{9^{9}}}", "\\frac{1}{9^{9^{9}}}"),  # same string: no sympy needed
    ("\\left(10^{10^{100}}\\right)", "(10^{10^{100}})"),
    ("\\sqrt{5+\\sqrt{24}}-\\sqrt{3}-\\sqrt{2}+" * 6 + "1", "1"),  # nested radicals that simplify
])
def test_large_but_cheap_forms_still_verify(pred, truth):
    before = _pool_timeouts()
    res = compute_score(f"\\boxed{{{pred}}}", truth, score_format="pm1")
    assert res == RewardResult(score=1.0, acc=True, pred=pred, timed_out=False)
    assert _pool_timeouts() == before


def test_bounded_from_worker_threads():
    answers = EXPLOSIVE + ["\\frac{1}{2}", "2^{100}"]
    truths = ["1"] * len(EXPLOSIVE) + ["0.5", str(2 ** 100)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda a, t: compute_score(f"\\boxed{{{a}}}", t, score_format="pm1"), answers, truths))
    assert [r.acc for r in results] == [False] * len(EXPLOSIVE) + [True, True]
    assert not any(r.timed_out for r in results)
