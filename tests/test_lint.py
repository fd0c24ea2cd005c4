"""The tree is clean under the project's linter (ruff, configured in pyproject.toml), so the
README's test command (and CI) runs the lint too."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_finds_nothing():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]


ISSUE_NUMBER = re.compile(r"\bissues? #?\d+\b", re.IGNORECASE)


def test_no_issue_numbers_in_the_code():
    """Comments and docstrings cite documents in the repository (docs/), not tracker issues, whose
    numbers mean nothing to a reader of the code."""
    found = []
    for top in ("hapo_megatron", "tests", "tools", "examples"):
        for dirpath, _, names in os.walk(os.path.join(ROOT, top)):
            for name in names:
                if name.endswith((".py", ".sh", ".yaml")):
                    path = os.path.join(dirpath, name)
                    with open(path, encoding="utf-8") as f:
                        found += [f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}"
                                  for i, line in enumerate(f, 1) if ISSUE_NUMBER.search(line)]
    assert not found, "\n".join(found)
