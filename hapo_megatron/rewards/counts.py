"""Counts of rewards that did not score normally over one training step (all generation rounds)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RewardCounts"]


@dataclass
class RewardCounts:
    """``timeouts``: responses whose reward hit its time limit; ``errors``: responses whose reward
    raised, returned something unusable or killed its worker (both scored the format's minimum);
    ``wait_s``: seconds spent waiting for rewards after generation had ended."""

    timeouts: int = 0
    errors: int = 0
    wait_s: float = 0.0

    def add(self, result) -> None:
        """Count a `RewardResult` that timed out inside the reward (the math reward's own limit)."""
        self.timeouts += bool(getattr(result, "timed_out", False))

    def metrics(self) -> dict[str, float]:
        return {"reward/timeouts": float(self.timeouts), "reward/errors": float(self.errors),
                "timing/reward_wait_s": self.wait_s}
