"""Math reward: extract the final answer of a response and verify it with ``math-verify``.

The final answer is the content of the last ``\\boxed{...}`` (balanced braces; ``\\fbox`` too) or
the text after the last ``Answer:`` (DAPO's "Answer: $Answer" line), whichever comes later in the
response. It is compared with the ground truth by ``math_verify.parse`` + ``math_verify.verify``
(so ``0.5`` == ``\\frac{1}{2}``, ``85`` == ``85.0``).

Every call is bounded in time, in any thread (docs/algorithm.md, "Rewards"), cheapest test first:

1. the same string after normalisation: correct, nothing else runs;
2. an answer longer than ``MAX_ANSWER_CHARS``, or one whose exact value could exceed
   ``magnitude.MAX_RESULT_DIGITS`` digits (``9^{9^{9}}``, ``1000000!``): wrong, sympy never sees it;
3. math-verify in a killable worker process (`bounded.shared_pool`) with a hard limit of
   ``verify_timeout_s``; a call that hits it is wrong with ``RewardResult.timed_out`` set. Inside a
   bounded worker already (the trainer's reward pool) math-verify runs in place: that worker's own
   limit bounds it.

math-verify's own signal timeouts stay off (``None``): they only work in a main thread, and each
parse / comparison would restart its own alarm; the worker's single timer covers the whole call.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Optional

from hapo_megatron.rewards.bounded import in_worker, shared_pool
from hapo_megatron.rewards.magnitude import exceeds_digits

__all__ = ["RewardResult", "compute_score", "extract_boxed", "extract_answer_line", "extract_final_answer",
           "answers_equivalent", "equivalence", "verify_unbounded", "MAX_ANSWER_CHARS", "VERIFY_TIMEOUT_S"]

logger = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 300
"""Extracted answers longer than this are scored wrong without calling sympy (bounded time)."""
VERIFY_TIMEOUT_S = 5.0
"""Hard limit (seconds) of one math-verify comparison run outside a bounded worker."""

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_ANSWER_RE = re.compile(r"answer\s*:", re.IGNORECASE)


@dataclass(frozen=True)
class RewardResult:
    """Outcome of scoring one response.

    score: the reward (+1/-1 for "pm1", 1/0 for "01"); acc: the answer was verified correct;
    pred: the extracted final answer (None when the response has none); timed_out: below.
    """

    score: float
    acc: bool
    pred: Optional[str] = None
    timed_out: bool = False
    """The verification hit its time limit (scored wrong; counted in ``reward/timeouts``)."""


def _boxed_spans(text: str) -> list[tuple[int, str]]:
    """(start, content) of every ``\\boxed{...}`` / ``\\boxed x`` with balanced braces."""
    out = []
    for m in _BOXED_RE.finditer(text):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        out.append((m.start(), text[i + 1:j]))
                        break
                j += 1
        elif m.group(0).endswith(" ") or m.group(0).endswith("\t"):
            # `\boxed 5`: the argument is the next whitespace-free run
            tail = re.match(r"[^\s$]+", text[i:])
            if tail:
                out.append((m.start(), tail.group(0)))
    return out


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last complete ``\\boxed{...}`` in ``text`` (None if there is none)."""
    spans = _boxed_spans(text)
    return spans[-1][1].strip() if spans else None


def _clean(answer: str) -> str:
    answer = answer.strip()
    if answer.startswith("$") and answer.endswith("$") and len(answer) > 1:
        answer = answer.strip("$").strip()
    return answer.rstrip(".").strip()


def _last_answer_line(text: str) -> Optional[tuple[int, str]]:
    matches = list(_ANSWER_RE.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    line = text[m.end():].split("\n", 1)[0]
    return m.start(), line


def extract_answer_line(text: str) -> Optional[str]:
    """The text after the last ``Answer:`` up to the end of its line, cleaned (None if none/empty)."""
    found = _last_answer_line(text)
    if found is None:
        return None
    answer = found[1]
    boxed = extract_boxed(answer)
    answer = _clean(boxed if boxed is not None else answer)
    return answer or None


def extract_final_answer(text: str) -> Optional[str]:
    """The final answer of a response: last boxed or last ``Answer:`` line, whichever is later."""
    if not text:
        return None
    spans = _boxed_spans(text)
    line = _last_answer_line(text)
    if line is not None and (not spans or line[0] > spans[-1][0]):
        return extract_answer_line(text)
    if spans:
        return _clean(spans[-1][1]) or None
    return None


_SAME_COMMANDS = [(re.compile(r"\\[dt]frac(?![a-zA-Z])"), r"\\frac"),
                  (re.compile(r"\\[dt]binom(?![a-zA-Z])"), r"\\binom"),
                  (re.compile(r"\\(?:left|right)(?![a-zA-Z])|\\[!,;]"), "")]


def _normalize_str(s: str) -> str:
    """Whitespace, display-size and spacing commands removed: what stays equal is the same answer."""
    out = re.sub(r"\s+", "", _clean(str(s)))
    for command, same in _SAME_COMMANDS:
        out = command.sub(same, out)
    return out


class _QuietTimeoutWarning(logging.Filter):
    """math-verify warns once that timeouts are off; we turned them off on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_MATH_VERIFY = None


def _math_verify():
    """Import math_verify lazily (it pulls in sympy) and silence the timeout-off warning."""
    global _MATH_VERIFY
    if _MATH_VERIFY is None:
        import math_verify

        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_QuietTimeoutWarning())
        _MATH_VERIFY = math_verify
    return _MATH_VERIFY


def _parse(mv, answer: str):
    parsed = mv.parse("\\boxed{" + answer + "}", parsing_timeout=None)
    return parsed or mv.parse(answer, parsing_timeout=None)


def verify_unbounded(pred: str, ground_truth: str) -> bool:
    """math-verify's verdict, with no time limit of its own: call it through `equivalence`."""
    mv = _math_verify()
    try:
        gold = _parse(mv, _clean(str(ground_truth)))
        target = _parse(mv, pred)
        if not gold or not target:
            return False
        return bool(mv.verify(gold, target, timeout_seconds=None))
    except Exception:  # math-verify/sympy failures mean "not verified", never a crashed step
        return False


def equivalence(pred: str, ground_truth: str, *, timeout_s: float = VERIFY_TIMEOUT_S) -> tuple[bool, bool]:
    """``(equivalent, timed_out)`` for two answers, the cheap checks first (module doc)."""
    if not pred or ground_truth is None:
        return False, False
    ground_truth = str(ground_truth)
    if _normalize_str(pred) == _normalize_str(ground_truth):
        return True, False
    if len(pred) > MAX_ANSWER_CHARS or exceeds_digits(pred) or exceeds_digits(ground_truth):
        return False, False
    if in_worker():
        return verify_unbounded(pred, ground_truth), False
    outcome = shared_pool().call(verify_unbounded, pred, ground_truth, timeout_s=timeout_s)
    if not outcome.ok:
        logger.warning("math reward: verifying %.80r against %.80r: %s (%s); scored wrong",
                       pred, ground_truth, outcome.status, outcome.message)
    return bool(outcome.ok and outcome.value), outcome.status == "timeout"


def answers_equivalent(pred: str, ground_truth: str, *, timeout_s: float = VERIFY_TIMEOUT_S) -> bool:
    """True when ``pred`` and ``ground_truth`` are the same answer (string or math-verify check)."""
    return equivalence(pred, ground_truth, timeout_s=timeout_s)[0]


def compute_score(solution_str: str, ground_truth, *, score_format: str,
                  verify_timeout_s: float = VERIFY_TIMEOUT_S, **_: object) -> RewardResult:
    """Score one response against the ground truth, in bounded time (module doc).

    Returns RewardResult(score=+1/-1 ("pm1") or 1/0 ("01"), acc, pred, timed_out); a verification
    that hits ``verify_timeout_s`` scores wrong with ``timed_out=True``. Extra keyword arguments
    (data_source, extra_info, ...) are accepted and ignored.
    """
    if score_format not in ("pm1", "01"):
        raise ValueError(f"score_format must be 'pm1' or '01', got {score_format!r}")
    pred = extract_final_answer(solution_str or "")
    acc, timed_out = (False, False) if pred is None else equivalence(pred, str(ground_truth),
                                                                     timeout_s=verify_timeout_s)
    wrong = -1.0 if score_format == "pm1" else 0.0
    return RewardResult(score=1.0 if acc else wrong, acc=acc, pred=pred, timed_out=timed_out)
