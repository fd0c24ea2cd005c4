"""PromptSampler: epoch-wise shuffled prompt batches with a resumable cursor."""

from __future__ import annotations

import random
from typing import Any

__all__ = ["PromptSampler"]


class PromptSampler:
    """Yields batches of ``batch_size`` prompts; the order is a pure function of (seed, epoch).

    Batches never span two epochs: the last ``len(dataset) % batch_size`` prompts of a shuffled
    epoch are dropped (they are in other positions next epoch), so a batch never holds a prompt
    twice. ``state_dict()`` / ``load_state_dict()`` resume exactly where the cursor stopped.
    """

    def __init__(self, dataset, batch_size: int, seed: int, shuffle: bool):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if batch_size > len(dataset):
            raise ValueError(f"batch_size ({batch_size}) is larger than the dataset ({len(dataset)} prompts)")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.position = 0
        self._order_cache: tuple[int, list[int]] | None = None

    @property
    def batches_per_epoch(self) -> int:
        return len(self.dataset) // self.batch_size

    def epoch_order(self, epoch: int) -> list[int]:
        """Dataset indices in the order of ``epoch`` (deterministic from seed and epoch)."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(f"hapo-sampler-{self.seed}-{epoch}").shuffle(order)
        self._order_cache = (epoch, order)
        return order

    def next_indices(self) -> list[int]:
        """Dataset indices of the next batch; advances the cursor."""
        if self.position + self.batch_size > len(self.dataset):
            self.epoch, self.position = self.epoch + 1, 0
        order = self.epoch_order(self.epoch)
        batch = order[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return batch

    def next_batch(self) -> list:
        """The next batch of dataset items (PromptRecords); advances the cursor."""
        return [self.dataset[i] for i in self.next_indices()]

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe cursor: epoch, position, seed, shuffle, batch_size, dataset size."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "shuffle": self.shuffle, "batch_size": self.batch_size, "num_prompts": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a cursor; the dataset size must match the one it was saved with."""
        missing = {"epoch", "position", "seed"} - set(state)
        if missing:
            raise ValueError(f"state is missing keys {sorted(missing)}")
        saved = state.get("num_prompts", len(self.dataset))
        if saved != len(self.dataset):
            raise ValueError(f"state was saved with {saved} prompts but the dataset has {len(self.dataset)}; "
                             "resuming on different data would not reproduce the order")
        self.epoch, self.position, self.seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self.batch_size = int(state.get("batch_size", self.batch_size))
        self._order_cache = None
