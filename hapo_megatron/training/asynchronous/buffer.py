"""The bounded, version-tagged buffer between the rollout producer and the trainer
(docs/architecture.md, "Asynchronous rollouts"; `rollout.max_staleness`).

Prompt groups are *admitted* (a ticket, in order), generated, then *finished* (kept, or filtered
by dynamic sampling); the trainer *takes* batches of ``batch_groups`` kept groups **in admission
order**. Versions: ``version`` is the weight version the servers hold (updates done), ``taken``
the number of batches handed out; batch ``c`` (0-based) trains on version ``c``.

Admission control (AReaL's rule, made exact for in-order consumption): a new group with ``L``
live groups ahead of it (admitted, not filtered, not yet taken) lands in batch ``taken +
floor(L / batch_groups)``, so it is admitted only when

    taken + floor(L / batch_groups) - version <= max_staleness

and every token it gets is at most ``max_staleness`` versions older than the weights it is
trained from. Consuming in admission order is what makes the bound hold: a slow group is never
overtaken by later ones (which would push it into a later batch). Samples are never dropped for
age; a filtered group frees its place at once (it does not count towards a batch).

Over-sampling (``over_sampling`` f > 1; docs/architecture.md, "Over-sampling under asynchronous
rollouts"): a batch is the first ``batch_groups`` *finished* kept groups in admission order, passing
over up to ``ceil((f - 1) * batch_groups)`` groups still running (the long tail no longer holds the
batch back; past that many, it waits as without over-sampling). Admission is unchanged, so a group
never passed over keeps the bound: every group taken before it is older, at most ``L`` of them. A
group passed over keeps generating and trains in a later batch; its oldest tokens may then be more
than ``max_staleness`` versions old, which ``rollout.partial_mode`` handles as it does the
synchronous loop's resumed responses (masked, or corrected by ``algo.rollout_is``).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Optional


class BufferClosed(RuntimeError):
    """The buffer was closed (the run stops); a waiting producer or trainer returns."""


@dataclass
class FinishedGroup:
    """One generated prompt group: ``payload`` (the producer's: samples, scores), the dataset
    index of its prompt, the oldest and newest weight version of its tokens, the entropy
    statistics it was sampled with, and whether dynamic sampling kept it."""

    ticket: int
    prompt_index: int
    payload: Any
    min_version: int
    max_version: int
    kept: bool = True
    sampling_stats: Optional[dict] = None
    extra: dict = field(default_factory=dict)


class StalenessBuffer:
    """Thread-safe admission / finish / take (see the module docstring)."""

    def __init__(self, batch_groups: int, max_staleness: int, *, version: int = 0, taken: Optional[int] = None,
                 over_sampling: float):
        if int(batch_groups) < 1:
            raise ValueError(f"batch_groups must be >= 1, got {batch_groups}")
        if int(max_staleness) < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if not over_sampling >= 1.0:
            raise ValueError(f"over_sampling must be >= 1, got {over_sampling}")
        self.batch_groups, self.max_staleness = int(batch_groups), int(max_staleness)
        self.over_sampling = float(over_sampling)
        self.max_passed_over = math.ceil((self.over_sampling - 1.0) * self.batch_groups)
        self.version = int(version)
        self.taken = int(version if taken is None else taken)
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._live: dict[int, int] = {}  # ticket -> prompt index, admission order (dicts keep it)
        self._done: dict[int, FinishedGroup] = {}
        self._closed = False
        self._error: Optional[BaseException] = None
        self.num_filtered = 0
        self.num_kept = 0
        self.passed_over = 0  # the last batch: live groups admitted before its newest that it left
        self._ever_passed: set[int] = set()  # live tickets some batch passed over (may exceed the bound)

    # ------------------------------------------------------------------ producer side
    def may_admit(self) -> bool:
        """Whether a new group may start now (the lag rule of the module docstring)."""
        lands_in = self.taken + len(self._live) // self.batch_groups
        return lands_in - self.version <= self.max_staleness

    def admit(self, prompt_index: int, *, timeout: Optional[float] = None) -> Optional[int]:
        """Wait until a group may start, then register it; its ticket, or None after ``timeout``.
        Raises `BufferClosed` once closed."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed or self.may_admit(), timeout=timeout):
                return None
            if self._closed:
                raise BufferClosed("the rollout buffer is closed")
            ticket = self._next_ticket
            self._next_ticket += 1
            self._live[ticket] = int(prompt_index)
            return ticket

    def wait_admissible(self, *, timeout: Optional[float] = None) -> bool:
        """Wait until a group may start (or the buffer closes); whether one may."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self.may_admit(), timeout=timeout)
            return not self._closed and self.may_admit()

    def wait_version_after(self, version: int, *, timeout: Optional[float] = None, stop=None) -> None:
        """Wait until the servers hold a version newer than ``version`` (or the buffer closes)."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self.version > version or (stop is not None and stop.is_set()),
                                timeout=timeout)

    def finish(self, group: FinishedGroup) -> None:
        """A group is done: kept ones wait for their turn, filtered ones leave at once."""
        with self._cond:
            if group.ticket not in self._live:
                raise ValueError(f"ticket {group.ticket} is not in flight")
            if group.kept:
                self.num_kept += 1
                self._done[group.ticket] = group
            else:
                self.num_filtered += 1
                del self._live[group.ticket]
                self._ever_passed.discard(group.ticket)
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The producer failed: the trainer's `take` raises ``error``."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ------------------------------------------------------------------ trainer side
    def _next_batch(self) -> Optional[list[int]]:
        """The tickets of the next batch, or None while it is not ready: the first
        ``batch_groups`` finished live groups in admission order, passing over at most
        ``max_passed_over`` running ones (0 without over-sampling: the first live groups, once
        all are finished)."""
        head, passed = [], 0
        for t in self._live:
            if len(head) == self.batch_groups:
                break
            if t in self._done:
                head.append(t)
            else:
                passed += 1
                if passed > self.max_passed_over:
                    return None
        return head if len(head) == self.batch_groups else None

    def take(self, *, timeout: Optional[float] = None) -> Optional[list[FinishedGroup]]:
        """The next batch (`_next_batch`), in admission order. None after ``timeout``; raises the
        producer's error, or `BufferClosed`. Checks the lag rule on every group no batch passed
        over (an error here is a bug)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._error is not None or self._closed or
                                       self._next_batch() is not None, timeout=timeout):
                return None
            if self._closed:
                raise BufferClosed("the rollout buffer is closed")
            if self._error is not None:
                raise self._error
            head = self._next_batch()
            taken = set(head)
            passed = [t for t in self._live if t < head[-1] and t not in taken]
            self.passed_over = len(passed)
            self._ever_passed.update(passed)
            out = [self._done.pop(t) for t in head]
            for t in head:
                del self._live[t]
            late = self._ever_passed & taken  # over-sampling: may be older; rollout.partial_mode handles it
            self._ever_passed -= taken
            batch_version = self.taken
            self.taken += 1
            self._cond.notify_all()
        for g in out:
            if g.ticket in late:
                continue
            lag = batch_version - g.min_version
            if lag > self.max_staleness or lag < 0:
                raise AssertionError(f"group {g.ticket} (prompt {g.prompt_index}) sampled at version {g.min_version} "
                                     f"is trained at version {batch_version}: lag {lag} outside [0, "
                                     f"max_staleness={self.max_staleness}]")
        return out

    def set_version(self, version: int) -> None:
        """The servers now hold weight version ``version`` (after a weight update)."""
        with self._cond:
            if int(version) < self.version:
                raise ValueError(f"weight version went back from {self.version} to {version}")
            self.version = int(version)
            self._cond.notify_all()

    # ------------------------------------------------------------------ state
    def pending_prompts(self) -> list[int]:
        """Prompt indices admitted but not yet taken (in flight or finished), in admission order:
        what a checkpoint keeps so that a resume regenerates them first (none lost or repeated)."""
        with self._cond:
            return list(self._live.values())

    def num_live(self) -> int:
        with self._cond:
            return len(self._live)


__all__ = ["BufferClosed", "FinishedGroup", "StalenessBuffer"]
