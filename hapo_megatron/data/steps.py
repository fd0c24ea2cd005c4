"""Multi-step arithmetic written out step by step: a CPU task with real token heterogeneity.

A problem is a chain of single-digit additions/subtractions, e.g. "Compute 7 + 5 - 3 + 8 step
by step. End with Answer: <number>."; its reference solution writes one line per operation,
each line restating the running value it carries from the line before::

    7 + 5 = 12
    12 - 3 = 9
    9 + 8 = 17
    Answer: 17

Most tokens of such a response are copies (the operands and operators of the prompt, the running
value carried from the line above, "=", "Answer: "): once learned they are near-deterministic.
The digits after each "=" are the decisions. The warm-start targets (``noise`` > 0) get some of
those results off by one or two and carry the wrong value on consistently, so the warm-started
model stays unsure exactly at the result digits and confident elsewhere; the final answer is
then wrong and the math reward (which reads the "Answer:" line) says so. The number of
operations varies per problem, so responses have variable length (tens of tokens).

Rows use the verl/DAPO layout of :mod:`hapo_megatron.data.arithmetic`.
"""

from __future__ import annotations

import random
import re
from typing import Any, Sequence

from hapo_megatron.data.rows import math_row

__all__ = ["generate_step_rows", "step_solution", "parse_step_lines", "token_roles", "TOKEN_ROLES", "STEP_OPS"]

STEP_OPS = ("+", "-")
INSTRUCTION = "End with Answer: <number>."
_TEMPLATES = ("Compute {expr} step by step.", "Work out {expr} step by step.")
_NOISE_OFFSETS = (-2, -1, 1, 2)
_LINE_RE = re.compile(r"^(-?\d+) ([+-]) (\d+) = (-?\d+)$")
_ANSWER_RE = re.compile(r"^Answer: (-?\d+)$")
TOKEN_ROLES = ("result", "answer", "carried", "operand", "operator", "format", "other", "end")
"""Roles of response tokens (:func:`token_roles`): the digits (and sign) after "=" of a step
line (the decisions); those of the "Answer:" line; the running value restated at the start of
every step line after the first (a copy of the line above); the other numbers of a step line
(copies of the prompt's operands); the "+"/"-"; the "=", spaces, newlines and "Answer: "; the
characters of a line that is neither a step nor an answer line; the end-of-sequence token."""


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def step_solution(operands: Sequence[int], ops: Sequence[str], noise: float = 0.0,
                  rng: random.Random | None = None) -> tuple[str, int]:
    """The step-by-step text of ``operands[0] ops[0] operands[1] ...`` (left to right) and the
    answer it ends with.

    With ``noise`` > 0 each written result is, with that probability, off by -2, -1, +1 or +2
    (drawn from ``rng``), and the next line carries the written (wrong) value on, so the chain
    stays self-consistent and only its result digits carry the error.
    """
    if len(ops) != len(operands) - 1 or not ops:
        raise ValueError(f"need len(ops) = len(operands) - 1 >= 1, got {len(operands)} operands, {len(ops)} ops")
    if any(op not in STEP_OPS for op in ops):
        raise ValueError(f"ops may only hold {STEP_OPS}, got {tuple(ops)!r}")
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise must be in [0, 1], got {noise}")
    if noise > 0 and rng is None:
        raise ValueError("noise > 0 needs an rng")
    value, lines = operands[0], []
    for op, x in zip(ops, operands[1:]):
        result = _apply(value, op, x)
        if noise > 0 and rng.random() < noise:
            result += rng.choice(_NOISE_OFFSETS)
        lines.append(f"{value} {op} {x} = {result}")
        value = result
    lines.append(f"Answer: {value}")
    return "\n".join(lines), value


def parse_step_lines(text: str) -> list[tuple[int, str, int, int]]:
    """The ``(left, op, right, written result)`` of each step line of a response (other lines,
    e.g. the "Answer:" line, are skipped). For checking solutions and inspecting rollouts."""
    out = []
    for line in text.splitlines():
        m = _LINE_RE.match(line.strip())
        if m:
            out.append((int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))))
    return out


def _line_roles(line: str, first_step: bool) -> tuple[list[str], bool]:
    """Roles of the characters of one line, and whether it was a step line."""
    m = _LINE_RE.match(line)
    if m is None:
        a = _ANSWER_RE.match(line)
        if a is None:
            return ["other"] * len(line), False
        return ["format"] * a.start(1) + ["answer"] * (a.end(1) - a.start(1)), False
    roles = ["format"] * len(line)
    for group, role in ((1, "operand" if first_step else "carried"), (2, "operator"), (3, "operand"), (4, "result")):
        roles[m.start(group):m.end(group)] = [role] * (m.end(group) - m.start(group))
    return roles, True


def token_roles(pieces: Sequence[str], eos_token: str = "<eos>") -> list[str]:
    """The role (:data:`TOKEN_ROLES`) of each token of a response, given its decoded pieces
    (one character each for the character tokenizer; ``eos_token`` marks the end). Lines are
    split at newlines (which count as "format"); pieces longer than one character take the role
    of their first character.
    """
    text = "".join(p for p in pieces if p != eos_token)
    char_roles: list[str] = []
    seen_step = False
    for i, line in enumerate(text.split("\n")):
        roles, is_step = _line_roles(line, not seen_step)
        seen_step |= is_step
        char_roles += (["format"] if i else []) + roles
    out, pos = [], 0
    for p in pieces:
        if p == eos_token:
            out.append("end")
            continue
        out.append(char_roles[pos] if pos < len(char_roles) else "other")
        pos += len(p)
    return out


def _check_knobs(n: int, min_operands: int, max_operands: int, max_operand: int, max_value: int,
                 noise: float) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    if not 2 <= min_operands <= max_operands:
        raise ValueError(f"need 2 <= min_operands <= max_operands, got {min_operands}, {max_operands}")
    if not 1 <= max_operand <= 99:
        raise ValueError(f"max_operand must be in [1, 99], got {max_operand}")
    if max_value < 2 * max_operand - 1:
        raise ValueError(f"max_value must be >= 2 * max_operand - 1 = {2 * max_operand - 1} (so that one of "
                         f"+/- always keeps the running value in range), got {max_value}")
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise must be in [0, 1], got {noise}")


def _random_chain(rng: random.Random, k: int, max_operand: int, max_value: int) -> tuple[list[int], list[str]]:
    """``k`` operands and ``k - 1`` operators whose running value stays in ``[0, max_value]``
    (a random operator, flipped when it would leave the range)."""
    operands = [rng.randint(0, max_operand) for _ in range(k)]
    ops, value = [], operands[0]
    for x in operands[1:]:
        op = rng.choice(STEP_OPS)
        if not 0 <= _apply(value, op, x) <= max_value:
            op = "-" if op == "+" else "+"
        ops.append(op)
        value = _apply(value, op, x)
    return operands, ops


def generate_step_rows(n: int, seed: int, *, min_operands: int = 2, max_operands: int = 5,
                       max_operand: int = 9, max_value: int = 19, noise: float = 0.0,
                       data_source: str = "steps", instruction: str = INSTRUCTION) -> list[dict[str, Any]]:
    """``n`` problems of ``min_operands..max_operands`` operands in ``0..max_operand`` joined by
    ``+``/``-`` with every running value in ``0..max_value``, deterministic in ``seed``.
    ``extra_info.solution`` is the step-by-step text (with ``noise``, see :func:`step_solution`);
    ``reward_model.ground_truth`` is always the true answer. The problems do not depend on
    ``noise`` (it has its own random stream).
    """
    _check_knobs(n, min_operands, max_operands, max_operand, max_value, noise)
    rng = random.Random(f"hapo-steps-{seed}")
    noise_rng = random.Random(f"hapo-steps-noise-{seed}")
    rows = []
    for i in range(n):
        k = rng.randint(min_operands, max_operands)
        operands, ops = _random_chain(rng, k, max_operand, max_value)
        expr = " ".join([str(operands[0])] + [f"{op} {x}" for op, x in zip(ops, operands[1:])])
        _, answer = step_solution(operands, ops)
        solution, _ = step_solution(operands, ops, noise, noise_rng if noise > 0 else None)
        question = rng.choice(_TEMPLATES).format(expr=expr)
        rows.append(math_row(data_source=data_source, question=f"{question} {instruction}".strip(),
                             answer=answer, extra_info={"index": i, "expression": expr, "answer": answer,
                                                        "num_steps": k - 1, "solution": solution}))
    return rows
