"""The RL loop's checkpointed state as one typed value (`RLState`).

A checkpoint's ``rl_state.json`` holds it next to the model, optimizer and RNG states:
``step``, ``sampler`` (the prompt cursor), ``entropy_stats`` (`RLState.rollout_entropy_stats`: the
statistics the next rollout's adaptive temperature uses), ``consecutive_skips``, ``sft_done`` and
``dynamic_sampling`` (the refill buffer), plus the actor's own ``num_skipped_updates`` and ``scheduler``
(`MegatronActor.train_state_dict`). The key names are the ones checkpoints have always used;
keys that older checkpoints lack get the value a run of that time behaved as if it had.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hapo_megatron.algo import EntropyStats
from hapo_megatron.data.sampler import PromptSampler
from hapo_megatron.training.batches.rollout_batch import DynamicSampler


@dataclass
class RLState:
    """What the RL loop carries from one step to the next.

    Attributes:
        sampler: the training prompts' sampler (its cursor is checkpointed).
        dyn: the dynamic-sampling filter and its refill buffer.
        step: the last finished training step (0 before the first).
        rollout_entropy_stats: the global entropy statistics the next rollout's adaptive
            temperature uses: measured in the last finished step's old-log-prob pass (None before
            the first step). Checkpoint key ``entropy_stats``.
        consecutive_skips: steps skipped in a row (no usable group, non-finite update).
        sft_done: the supervised warm start has run (or was not asked for).
        async_state: asynchronous rollouts (`training.async_rollout`): the sampler cursor and the
            prompts admitted but not yet trained as of the last step's batch; checkpointed as the
            ``sampler`` and ``async_pending`` keys (the live sampler runs ahead on rank 0).
        async_pending: after a resume, the prompts to regenerate first (``async_pending``).
        sequence_sampling_stats: asynchronous rollouts: the entropy statistics (dicts) each
            sequence of the current step was sampled with (not checkpointed: a step is redone whole).
    """

    sampler: PromptSampler
    dyn: DynamicSampler
    step: int = 0
    rollout_entropy_stats: Optional[EntropyStats] = None
    consecutive_skips: int = 0
    sft_done: bool = False
    async_state: Optional[dict] = None
    async_pending: Optional[list] = None
    sequence_sampling_stats: Optional[list] = None

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (the keys of ``rl_state.json``)."""
        return {
            "step": int(self.step),
            "sampler": self.sampler.state_dict(),
            "entropy_stats": (self.rollout_entropy_stats.to_dict() if self.rollout_entropy_stats is not None
                              else None),
            "consecutive_skips": int(self.consecutive_skips),
            "sft_done": bool(self.sft_done),
            "dynamic_sampling": self.dyn.state_dict(),
            **self._async_keys(),
        }

    def _async_keys(self) -> dict[str, Any]:
        if self.async_state is None:
            return {}
        return {"sampler": self.async_state["sampler"], "async_pending": list(self.async_state["pending"])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `state_dict`. Older checkpoints: without ``consecutive_skips`` the count
        restarts at 0, without ``sft_done`` the warm start counts as done (they were written after
        it), without ``dynamic_sampling`` the buffer is empty (it never outlived a step)."""
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        es = state.get("entropy_stats")
        self.rollout_entropy_stats = EntropyStats.from_dict(es) if es else None
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        self.sft_done = bool(state.get("sft_done", True))
        self.dyn.load_state_dict(state.get("dynamic_sampling", {}))
        self.async_pending = [int(i) for i in state["async_pending"]] if "async_pending" in state else None


__all__ = ["RLState"]
