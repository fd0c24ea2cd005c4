"""The paper's math sets on the Hugging Face hub and how each one's columns map to a prompt row.

Every set becomes rows of the project's layout (``hapo_megatron.data.rows``): one user message
holding the problem in the DAPO prompt template, the answer as ``reward_model.ground_truth`` and
the set's ``data_source`` (the name the evaluation metrics use). The template is the one the
DAPO-Math-17k rows carry and the recipe documents (docs/data.md): it asks for a final
``Answer: ...`` line, which the math reward reads (docs/evaluation.md).

An adapter reads one source row and returns ``(problem, answer, extra_info)``, or ``None`` for a
row the set does not use (AMC 2022 problems in the AMC validation set). A row it cannot map stops
the command with a ValueError naming the set and the row. Rows already in the verl layout (a
``prompt`` of chat messages and a ``reward_model``, e.g. a local copy of a verl-prepared file)
are read by every set: the template is taken off and put back, so it is never applied twice.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["DAPO_TEMPLATE_PREFIX", "DAPO_TEMPLATE_SUFFIX", "apply_template", "strip_template", "MathSource",
           "SOURCES", "PAPER_SETS"]

DAPO_TEMPLATE_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of "
                        "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_TEMPLATE_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
_TEMPLATE_OPENING = "Solve the following math problem step by step."

Mapped = Optional[tuple[str, str, dict]]


def apply_template(problem: str) -> str:
    """The user message of ``problem`` in the DAPO template."""
    return DAPO_TEMPLATE_PREFIX + problem + DAPO_TEMPLATE_SUFFIX


def strip_template(text: str, where: str) -> str:
    """The bare problem of a prompt that may carry the DAPO template (as DAPO-Math-17k's do).

    A prompt that opens like the template but is not exactly it (another answer format) is
    refused: applying our template on top of it would ask for two answer formats.
    """
    if text.startswith(DAPO_TEMPLATE_PREFIX) and text.endswith(DAPO_TEMPLATE_SUFFIX):
        return text[len(DAPO_TEMPLATE_PREFIX):len(text) - len(DAPO_TEMPLATE_SUFFIX)]
    if text.startswith(_TEMPLATE_OPENING):
        raise ValueError(f"{where}: the prompt carries an instruction template other than the DAPO one "
                         f"(docs/data.md); it starts {text[:160]!r}")
    return text


def _text(row: dict, column: str, where: str) -> str:
    value = row.get(column)
    if value is None:
        raise ValueError(f"{where}: column {column!r} is missing or null (columns: {sorted(row)})")
    if not isinstance(value, str):
        raise ValueError(f"{where}: column {column!r} must be a string, got {type(value).__name__} ({value!r})")
    if not value.strip():
        raise ValueError(f"{where}: column {column!r} is empty")
    return value.strip()


def _answer(row: dict, column: str, where: str) -> str:
    """An answer as the string the reward compares: 5.0 (a float column) is "5"."""
    value = row.get(column)
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{where}: column {column!r} must be a string or number, got {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: column {column!r} is {value!r}")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, int):
        return str(value)
    return _text(row, column, where)


def _verl_row(row: dict, where: str) -> tuple[str, str, dict]:
    """A row already in the verl layout: the user message without its template, the ground truth."""
    prompt = row["prompt"]
    if isinstance(prompt, str):
        content = prompt
    else:
        users = [m.get("content") for m in (prompt or []) if isinstance(m, dict) and m.get("role") == "user"]
        if len(users) != 1 or not isinstance(users[0], str):
            raise ValueError(f"{where}: column 'prompt' must hold exactly one user message with string content, "
                             f"got {prompt!r:.200}")
        content = users[0]
    problem = strip_template(content.strip(), where).strip()
    if not problem:
        raise ValueError(f"{where}: the prompt holds no problem")
    reward = row.get("reward_model")
    if not isinstance(reward, dict):
        raise ValueError(f"{where}: column 'reward_model' must be a mapping with 'ground_truth', got {reward!r}")
    answer = _answer(reward, "ground_truth", where + " (reward_model)")
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    return problem, answer, {"id": str(extra.get("index", ""))}


def _columns(problem: str, answer: str, ident: Optional[str] = None) -> Callable[[dict, str], Mapped]:
    """An adapter for a set with a problem, an answer and an optional id column."""
    def adapt(row: dict, where: str) -> Mapped:
        ident_value = "" if ident is None or row.get(ident) is None else str(row[ident])
        return _text(row, problem, where), _answer(row, answer, where), {"id": ident_value}
    return adapt


_AMC_YEAR = re.compile(r"/(\d{4})_AMC_")


def _amc_2023(row: dict, where: str) -> Mapped:
    """AI-MO/aimo-validation-amc holds AMC 12 2022 and 2023; the year is in the AoPS url."""
    url = _text(row, "url", where)
    year = _AMC_YEAR.search(url)
    if year is None:
        raise ValueError(f"{where}: cannot read the contest year from url {url!r} (expected .../2023_AMC_12A_...)")
    if year.group(1) != "2023":
        return None
    problem, answer, extra = _columns("problem", "answer", "id")(row, where)
    return problem, answer, {**extra, "url": url}


@dataclass(frozen=True)
class MathSource:
    """One set: where it is on the hub, the file it becomes, and how its columns map to a row."""

    name: str                   # the command's name for it
    hub_id: str                 # datasets.load_dataset(hub_id, config, split=split)
    split: str
    out_file: str               # the file name the recipes' configs read
    data_source: str            # the row's data_source (eval metrics are reported per data_source)
    adapt: Callable[[dict, str], Mapped]
    columns: str                # the source columns, for docs and error messages
    config: Optional[str] = None

    def convert(self, row: Any, where: str) -> Mapped:
        """``(problem, answer, extra_info)`` of one source row, or None for a row the set skips."""
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a row must be a mapping of columns, got {type(row).__name__}")
        if row.get("prompt") is not None and row.get("reward_model") is not None:
            return _verl_row(row, where)
        return self.adapt(row, where)


def _dapo(row: dict, where: str) -> Mapped:
    missing = [c for c in ("prompt", "reward_model") if row.get(c) is None]
    raise ValueError(f"{where}: DAPO-Math-17k rows are in the verl layout ('prompt' and 'reward_model'); "
                     f"missing or null here: {missing} (columns: {sorted(row)})")


SOURCES: dict[str, MathSource] = {s.name: s for s in (
    MathSource("dapo-math-17k", "BytedTsinghua-SIA/DAPO-Math-17k", "train", "dapo-math-17k.parquet", "math_dapo",
               _dapo, "data_source, prompt [{role, content}], ability, reward_model {ground_truth, style}, "
               "extra_info {index}"),
    MathSource("aime-2024", "Maxwell-Jia/AIME_2024", "train", "aime24.parquet", "aime24",
               _columns("Problem", "Answer", "ID"), "ID, Problem, Solution, Answer"),
    MathSource("aime-2025", "yentinglin/aime_2025", "train", "aime25.parquet", "aime25",
               _columns("problem", "answer", "id"), "problem, answer, id"),
    MathSource("math-500", "HuggingFaceH4/MATH-500", "test", "math500.parquet", "math500",
               _columns("problem", "answer", "unique_id"), "problem, solution, answer, subject, level, unique_id"),
    MathSource("amc-2023", "AI-MO/aimo-validation-amc", "train", "amc23.parquet", "amc23",
               _amc_2023, "id, problem, answer (float), url; the rows whose url is a 2023 contest"),
)}

PAPER_SETS = ("dapo-math-17k", "aime-2024", "aime-2025", "math-500", "amc-2023")
"""What ``paper`` prepares: the 7B recipe's training file and its four validation files."""
