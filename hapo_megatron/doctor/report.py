"""One doctor check's result and the pass/fail table."""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Callable

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass
class CheckResult:
    name: str
    status: str
    figure: str = ""
    fix: str = ""
    seconds: float = 0.0


def run_check(name: str, fn: Callable[[], CheckResult], default_fix: str) -> CheckResult:
    """``fn()``, timed; an exception becomes a FAIL whose figure is the error (last frame) and
    whose fix is ``default_fix``."""
    t0 = time.time()
    try:
        res = fn()
    except Exception as e:  # noqa: BLE001 - a check that crashes is a failed check
        frame = traceback.extract_tb(e.__traceback__)[-1]
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        res = CheckResult(name, FAIL, f"{type(e).__name__}: {first} ({frame.filename.split('/')[-1]}:{frame.lineno})",
                          getattr(e, "fix", None) or default_fix)
    res.name, res.seconds = name, time.time() - t0
    return res


def format_table(results: list[CheckResult]) -> str:
    """Fixed-width table: check, status, measured figure; a "fix:" line under each FAIL."""
    w = max([len(r.name) for r in results] + [5])
    lines = [f"{'check':<{w}}  status  {'time':>5}  figure", f"{'-' * w}  ------  -----  {'-' * 40}"]
    for r in results:
        lines.append(f"{r.name:<{w}}  {r.status:<6}  {r.seconds:4.0f}s  {r.figure}")
        if r.status == FAIL and r.fix:
            lines.append(f"{'':<{w}}  {'':<6}  {'':>5}  fix: {r.fix}")
    n = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, SKIP)}
    lines.append(f"{n[PASS]} passed, {n[FAIL]} failed, {n[SKIP]} skipped "
                 f"({sum(r.seconds for r in results):.0f} s)")
    return "\n".join(lines)
