"""Math reward: extract the final answer of a response and verify it with ``math-verify``.

The final answer is the content of the last ``\\boxed{...}`` (balanced braces; ``\\fbox`` too) or
the text after the last ``Answer:`` (DAPO's "Answer: $Answer" line), whichever comes later in the
response. It is compared with the ground truth by ``math_verify.parse`` + ``math_verify.verify``
(so ``0.5`` == ``\\frac{1}{2}``, ``85`` == ``85.0``), after a fast exact-string check.

Thread safety: math-verify's default timeouts use ``signal.alarm``, which only works in the main
thread. We pass ``parsing_timeout=None`` / ``timeout_seconds=None`` (no signals) so the reward can
run in worker threads, and bound the work instead by refusing over-long answers
(``MAX_ANSWER_CHARS``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Optional

__all__ = ["RewardResult", "compute_score", "extract_boxed", "extract_answer_line",
           "extract_final_answer", "answers_equivalent", "MAX_ANSWER_CHARS"]

MAX_ANSWER_CHARS = 300
"""Extracted answers longer than this are scored wrong without calling sympy (bounded time)."""

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_ANSWER_RE = re.compile(r"answer\s*:", re.IGNORECASE)


@dataclass(frozen=True)
class RewardResult:
    """Outcome of scoring one response.

    score: the reward (+1/-1 for "pm1", 1/0 for "01"); acc: the answer was verified correct;
    pred: the extracted final answer (None when the response has none).
    """

    score: float
    acc: bool
    pred: Optional[str] = None


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


def _normalize_str(s: str) -> str:
    return re.sub(r"\s+", "", _clean(str(s))).replace("\\!", "")


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


def answers_equivalent(pred: str, ground_truth: str) -> bool:
    """True when ``pred`` and ``ground_truth`` are the same answer (string or math-verify check)."""
    if not pred or ground_truth is None:
        return False
    if _normalize_str(pred) == _normalize_str(ground_truth):
        return True
    if len(pred) > MAX_ANSWER_CHARS:
        return False
    mv = _math_verify()
    try:
        gold = _parse(mv, _clean(str(ground_truth)))
        target = _parse(mv, pred)
        if not gold or not target:
            return False
        return bool(mv.verify(gold, target, timeout_seconds=None))
    except Exception:  # math-verify/sympy failures mean "not verified", never a crashed step
        return False


def compute_score(solution_str: str, ground_truth, *, score_format: str = "pm1", **_: object) -> RewardResult:
    """Score one response against the ground truth.

    Returns RewardResult(score=+1/-1 ("pm1") or 1/0 ("01"), acc, pred). Extra keyword arguments
    (data_source, extra_info, ...) are accepted and ignored.
    """
    if score_format not in ("pm1", "01"):
        raise ValueError(f"score_format must be 'pm1' or '01', got {score_format!r}")
    pred = extract_final_answer(solution_str or "")
    acc = pred is not None and answers_equivalent(pred, str(ground_truth))
    wrong = -1.0 if score_format == "pm1" else 0.0
    return RewardResult(score=1.0 if acc else wrong, acc=acc, pred=pred)
