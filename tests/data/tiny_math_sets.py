"""Tiny local copies of the paper's math sets, each in its hub set's real column layout (docs/data.md).

Each set has repeated prompts; ``malformed=True`` adds a row the command must refuse. ``EXPECTED``
holds, per set, the (problem, answer) pairs the command must keep, in order.
"""

import os

import pyarrow as pa
import pyarrow.parquet as pq

from hapo_megatron.data.math_sources import DAPO_TEMPLATE_PREFIX, DAPO_TEMPLATE_SUFFIX

DAPO_ROWS = [("What is $3 \\cdot 7$?", "21"), ("Find the remainder of $2^{10}$ divided by $7$.", "2"),
             ("What is $3 \\cdot 7$?", "21"), ("What is $3 \\cdot 7$?", "21"),
             ("How many primes are below $20$?", "8"),
             ("Compute $1+2+3$.", "6"), ("Compute $1+2+3$.", "7")]  # copies disagree: the prompt is dropped

EXPECTED = {
    "dapo-math-17k": [("What is $3 \\cdot 7$?", "21"), ("Find the remainder of $2^{10}$ divided by $7$.", "2"),
                      ("How many primes are below $20$?", "8")],
    "aime-2024": [("Find $x$ if $2x = 10$.", "5"), ("Find the number of divisors of $12$.", "6")],
    "aime-2025": [("Let $n = 17$. Find $n^2$.", "289"), ("Find $\\binom{6}{2}$.", "15")],
    "math-500": [("Simplify $\\frac{2}{4}$.", "\\frac{1}{2}"), ("What is $\\sqrt{16}$?", "4")],
    "amc-2023": [("What is $12 \\cdot 12$?", "144")],
}


def _parquet(rows, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def dapo(tmp, malformed=False):
    """BytedTsinghua-SIA/DAPO-Math-17k: verl layout, the DAPO template already in the prompt."""
    rows = [{"data_source": "math_dapo",
             "prompt": [{"content": DAPO_TEMPLATE_PREFIX + p + DAPO_TEMPLATE_SUFFIX, "role": "user"}],
             "ability": "MATH", "reward_model": {"ground_truth": a, "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": f"uuid-{i}"}} for i, (p, a) in enumerate(DAPO_ROWS)]
    if malformed:
        rows[4]["reward_model"] = {"ground_truth": None, "style": "rule-lighteval/MATH_v2"}
    return _parquet(rows, os.path.join(tmp, "dapo", "dapo-math-17k.parquet"))


def aime_2024(tmp, malformed=False):
    """Maxwell-Jia/AIME_2024: ID, Problem, Solution, Answer (an integer)."""
    rows = [{"ID": "2024-I-1", "Problem": "Find $x$ if $2x = 10$.", "Solution": "x = 5", "Answer": 5},
            {"ID": "2024-I-2", "Problem": "Find the number of divisors of $12$.", "Solution": "...", "Answer": 6},
            {"ID": "2024-I-2", "Problem": "Find the number of  divisors of $12$.\n", "Solution": "...", "Answer": 6}]
    if malformed:
        rows.append({"ID": "2024-I-3", "Problem": "Find $y$.", "Solution": "...", "Answer": None})
    return _parquet(rows, os.path.join(tmp, "aime24", "aime_2024_problems.parquet"))


def aime_2025(tmp, malformed=False):
    """yentinglin/aime_2025: problem, answer (a string), id; here as a JSONL file."""
    import json

    rows = [{"id": 0, "problem": "Let $n = 17$. Find $n^2$.", "answer": "289"},
            {"id": 1, "problem": "Find $\\binom{6}{2}$.", "answer": "15"},
            {"id": 0, "problem": "Let $n = 17$. Find $n^2$.", "answer": "289"}]
    if malformed:
        rows.insert(1, {"id": 2, "problem": "   ", "answer": "3"})
    os.makedirs(tmp, exist_ok=True)
    path = os.path.join(tmp, "aime25.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def math_500(tmp, malformed=False):
    """HuggingFaceH4/MATH-500: problem, solution, answer, subject, level, unique_id; a saved DatasetDict."""
    from datasets import Dataset, DatasetDict

    rows = [{"problem": "Simplify $\\frac{2}{4}$.", "solution": "...", "answer": "\\frac{1}{2}",
             "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"},
            {"problem": "What is $\\sqrt{16}$?", "solution": "...", "answer": "4", "subject": "Algebra",
             "level": 1, "unique_id": "test/algebra/2.json"},
            {"problem": "Simplify $\\frac{2}{4}$.", "solution": "...", "answer": "\\frac{1}{2}",
             "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"}]
    if malformed:
        rows[2]["answer"] = ""
    path = os.path.join(tmp, "math500_saved")
    DatasetDict({"test": Dataset.from_list(rows)}).save_to_disk(path)
    return path


def amc_2023(tmp, malformed=False):
    """AI-MO/aimo-validation-amc: id, problem, answer (float64), url; AMC 12 2022 and 2023; a copy of the
    hub repository (data/train-00000-of-00001.parquet)."""
    url = "https://artofproblemsolving.com/wiki/index.php/{}_AMC_12A_Problems/Problem_{}"
    rows = [{"id": 0, "problem": "What is $5 + 6$?", "answer": 11.0, "url": url.format(2022, 1)},
            {"id": 1, "problem": "What is $12 \\cdot 12$?", "answer": 144.0, "url": url.format(2023, 2)},
            {"id": 2, "problem": "What is $12 \\cdot 12$?", "answer": 144.0, "url": url.format(2023, 2)}]
    if malformed:
        rows[1]["url"] = "https://example.org/problem"
    return _parquet(rows, os.path.join(tmp, "aimo-validation-amc", "data", "train-00000-of-00001.parquet"))


BUILDERS = {"dapo-math-17k": dapo, "aime-2024": aime_2024, "aime-2025": aime_2025, "math-500": math_500,
            "amc-2023": amc_2023}
"""Each set's tiny copy; amc-2023's --from is the repository directory, two levels above its file."""


def from_path(name, tmp, malformed=False):
    path = BUILDERS[name](tmp, malformed)
    return os.path.dirname(os.path.dirname(path)) if name == "amc-2023" else path
