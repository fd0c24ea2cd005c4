"""A generated integer-arithmetic task for tests and the CPU example (no downloads).

Problems look like "What is 37 + 48?" or "Compute 7 * 8 - 5." with the usual precedence (``*``
before ``+``/``-``) and an integer answer; the prompt asks the model to end with
"Answer: <number>", the format the math reward reads. Rows use the verl/DAPO layout and carry a
reference solution in ``extra_info.solution`` (for the supervised warm-up).
"""

from __future__ import annotations

import random
from typing import Any, Sequence

from hapo_megatron.data.rows import math_row, write_rows

__all__ = ["generate_arithmetic_rows", "write_arithmetic_dataset", "evaluate_expression", "OPS"]

OPS = ("+", "-", "*")
INSTRUCTION = "End with Answer: <number>."
_TEMPLATES = ("What is {expr}?", "Compute {expr}.", "Calculate {expr}.")


def evaluate_expression(operands: Sequence[int], ops: Sequence[str]) -> int:
    """Value of ``operands[0] ops[0] operands[1] ...`` with ``*`` binding tighter than ``+``/``-``."""
    if len(ops) != len(operands) - 1:
        raise ValueError(f"ops must have len(operands) - 1 = {len(operands) - 1} items, got {len(ops)}")
    terms, signs = [operands[0]], [1]
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= x
        elif op in ("+", "-"):
            terms.append(x)
            signs.append(1 if op == "+" else -1)
        else:
            raise ValueError(f"ops may only hold {OPS}, got {op!r}")
    return sum(s * t for s, t in zip(signs, terms))


def _check_knobs(n, min_digits, max_digits, min_operands, max_operands, ops) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got min_digits={min_digits}, max_digits={max_digits}")
    if not 2 <= min_operands <= max_operands:
        raise ValueError(f"need 2 <= min_operands <= max_operands, got {min_operands}, {max_operands}")
    if not ops or any(op not in OPS for op in ops):
        raise ValueError(f"ops must be a non-empty subset of {OPS}, got {ops!r}")


def generate_arithmetic_rows(n: int, seed: int, *, min_digits: int = 1, max_digits: int = 2,
                             min_operands: int = 2, max_operands: int = 3, ops: Sequence[str] = OPS,
                             data_source: str = "arithmetic", instruction: str = INSTRUCTION) -> list[dict[str, Any]]:
    """``n`` problems, deterministic in ``seed``; difficulty from digits per operand and operand count.

    Returns verl-layout rows: prompt (one user message), reward_model.ground_truth (the answer as a
    string), data_source, extra_info {index, expression, answer, solution}.
    """
    _check_knobs(n, min_digits, max_digits, min_operands, max_operands, tuple(ops))
    rng = random.Random(f"hapo-arithmetic-{seed}")
    rows = []
    for i in range(n):
        k = rng.randint(min_operands, max_operands)
        operands = [rng.randint(0 if d == 1 else 10 ** (d - 1), 10 ** d - 1)
                    for d in (rng.randint(min_digits, max_digits) for _ in range(k))]
        chosen = [rng.choice(list(ops)) for _ in range(k - 1)]
        expr = " ".join([str(operands[0])] + [f"{op} {x}" for op, x in zip(chosen, operands[1:])])
        answer = evaluate_expression(operands, chosen)
        question = rng.choice(_TEMPLATES).format(expr=expr)
        rows.append(math_row(data_source=data_source, question=f"{question} {instruction}".strip(),
                             answer=answer, extra_info={"index": i, "expression": expr, "answer": answer,
                                                        "solution": f"{expr} = {answer}\nAnswer: {answer}"}))
    return rows


def write_arithmetic_dataset(path: str, n: int, seed: int, **knobs: Any) -> str:
    """Generate ``n`` problems and write them to ``path`` (.jsonl or .parquet); returns path."""
    return write_rows(generate_arithmetic_rows(n, seed, **knobs), path)
