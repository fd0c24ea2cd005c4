"""Counts of rewards that did not score normally over one training step (all generation rounds)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RewardCounts"]


@dataclass
class RewardCounts:
    """``timeouts``: responses whose reward hit its time limit (scored wrong, `RewardResult.timed_out`)."""

    timeouts: int = 0

    def add(self, result) -> None:
        self.timeouts += bool(getattr(result, "timed_out", False))

    def metrics(self) -> dict[str, float]:
        return {"reward/timeouts": float(self.timeouts)}
