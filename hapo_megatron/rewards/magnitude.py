"""A cheap guard before sympy: would evaluating this answer exactly build an enormous number?

sympy evaluates integer powers, factorials and binomials eagerly and exactly, so a short answer
such as ``9^{9^{9}}`` (369 million digits) or ``1000000!`` keeps one process busy for seconds
to forever, mostly inside one C call that no signal can interrupt. `exceeds_digits` reads the
answer's text (LaTeX or ``**`` powers) and bounds, without evaluating anything, the number of
decimal digits each power / factorial / binomial would produce; above the limit the answer is not
handed to sympy at all (docs/algorithm.md, "Rewards").

The bound is conservative, not exact: every atom's "size" is an upper bound on the digits of its
exact value or of its reciprocal (``0.5^{n}`` is as costly as ``2^{n}``), symbols count as ~10,
sums and products add sizes, ``a^{b}`` has size ``|b| * size(a)``, ``n!`` has ``n * log10(n)``
and ``\\binom{n}{k}`` the smaller of ``n * log10(2)`` and ``k * log10(n)``. It never raises:
text it does not understand counts as a separator.
"""

from __future__ import annotations

import math
import re

__all__ = ["MAX_RESULT_DIGITS", "exceeds_digits", "digits_bound"]

MAX_RESULT_DIGITS = 100_000
"""Answers whose evaluation could build a number with more digits than this are not evaluated
(a 10^5-digit power or factorial takes sympy well under a second; 10^6 digits takes seconds)."""

_TOKEN_RE = re.compile(r"\\[a-zA-Z]+|\\.|\d+(?:\.\d*)?|\.\d+|[a-zA-Z]|\S")
_OPENERS = {"{": "}", "(": ")", "[": "]", "\\{": "\\}"}
_FRACS = {"\\frac", "\\dfrac", "\\tfrac", "\\cfrac"}
_BINOMS = {"\\binom", "\\dbinom", "\\tbinom"}
# commands that are operators or spacing: no size of their own
_NEUTRAL = {"\\cdot", "\\times", "\\div", "\\pm", "\\mp", "\\le", "\\leq", "\\ge", "\\geq", "\\ne",
            "\\neq", "\\approx", "\\in", "\\cup", "\\cap", "\\quad", "\\qquad", "\\,", "\\;", "\\:",
            "\\!", "\\ ", "\\text", "\\mathrm", "\\textbf", "\\mathbf", "\\displaystyle", "\\%", "\\$"}
_LOG10_2 = math.log10(2.0)


class _TooLarge(Exception):
    pass


def _value(size: float) -> float:
    """Upper bound of |x| for a number of the given size (inf when it does not fit a float)."""
    return 10.0 ** size if size < 300 else math.inf


def _number_size(tok: str) -> float:
    if "." in tok:  # exact decimal = digits / 10^k: as costly as its longest digit string
        return float(len(tok.replace(".", "").lstrip("0")) or 1)
    digits = tok.lstrip("0")
    if not digits:
        return 0.0
    if len(digits) > 15:
        return float(len(digits))
    return math.log10(int(digits))


class _Estimator:
    def __init__(self, text: str, max_digits: float):
        text = re.sub(r"\\(?:left|right)\s*\.?", "", text).replace("**", "^")
        self.toks = _TOKEN_RE.findall(text)
        self.i = 0
        self.max_digits = max_digits

    def _check(self, size: float) -> float:
        if not size <= self.max_digits:  # also catches nan
            raise _TooLarge
        return size

    def _peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else None

    def sequence(self, closer=None) -> float:
        """Size of the items up to ``closer`` (consumed) or the end: sizes add (a product's digits
        are at most the sum of its factors'; a sum of n terms adds at most log10(n))."""
        total, count = 0.0, 0
        while self.i < len(self.toks):
            if self.toks[self.i] == closer:
                self.i += 1
                break
            total += self.term()
            count += 1
        return self._check(total + (math.log10(count) if count > 1 else 0.0))

    def term(self) -> float:
        """An atom with its postfix ``^`` (right-assoc), ``_`` and ``!`` operators."""
        size = self.atom()
        while True:
            tok = self._peek()
            if tok == "^":
                self.i += 1
                exponent = _value(self.term())
                size = self._check(exponent * max(size, 0.0) if size > 0 else 0.0)
            elif tok == "_":
                self.i += 1
                self.atom()  # a subscript names, it does not scale
            elif tok == "!":
                self.i += 1
                n = _value(size)
                size = self._check(n * math.log10(max(n, 2.0)))
            elif tok == "'":
                self.i += 1
            else:
                return size

    def atom(self) -> float:
        tok = self._peek()
        if tok is None:
            return 0.0
        self.i += 1
        if tok in _OPENERS:
            return self.sequence(_OPENERS[tok])
        if tok[0].isdigit() or tok[0] == ".":
            return _number_size(tok)
        if tok in _FRACS:
            return self._check(self.atom() + self.atom())
        if tok in _BINOMS:
            n, k = _value(self.atom()), _value(self.atom())
            return self._check(min(n * _LOG10_2, k * math.log10(max(n, 2.0))))
        if tok == "\\sqrt":
            index = self.atom() if self._peek() == "[" else 0.0  # \sqrt[n]{x}
            return self._check(self.atom() + index)
        if tok == "\\exp":
            return self._check(_value(self.atom()) * math.log10(math.e))
        if tok in _NEUTRAL:
            return 0.0
        if tok.startswith("\\") and len(tok) > 2 or tok.isalpha():
            return 1.0  # a symbol, constant or function name: about 10
        return 0.0  # operators, separators, stray closers


def digits_bound(answer: str, max_digits: float = math.inf) -> float:
    """Upper bound of the digits evaluating ``answer`` exactly could produce at any one step
    (inf once it is over ``max_digits``)."""
    est = _Estimator(answer, max_digits)
    try:
        return est.sequence()
    except (_TooLarge, RecursionError):  # absurdly deep nesting is not cheap either
        return math.inf


def exceeds_digits(answer: str, max_digits: float = MAX_RESULT_DIGITS) -> bool:
    """True when evaluating ``answer`` could build a number with more than ``max_digits`` digits."""
    return digits_bound(answer, max_digits) > max_digits
