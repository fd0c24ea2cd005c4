"""`StandInEngine`: the base of the tests' scripted engines. It implements every member of
`hapo_megatron.rollout.engine.RolloutEngine` (docs/architecture.md, "The engine protocol"), so a
scripted engine passed to a loop is a whole engine, as the loops require: a test overrides what it
scripts; the generation calls it does not script refuse (the test reached something it did not
plan), the other calls do nothing and are counted in ``calls`` (name -> how many)."""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable, Optional, Sequence

import torch

from hapo_megatron.rollout.engine import RowRequest, RowResult, Sample, SamplingParams, drain_weights


class StandInEngine:
    dtype: Optional[torch.dtype] = None
    send_sampling_seed: bool = False
    stop_check: Optional[Callable[[], bool]] = None

    @property
    def calls(self) -> Counter:
        if "_standin_calls" not in self.__dict__:
            self._standin_calls = Counter()
        return self._standin_calls

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 on_samples: Optional[Callable[[list[Sample]], None]] = None) -> list[list[Sample]]:
        raise AssertionError(f"{type(self).__name__}.generate is not scripted")

    def generate_group(self, rows: Sequence[RowRequest], params: SamplingParams) -> list[RowResult]:
        raise AssertionError(f"{type(self).__name__}.generate_group is not scripted")

    def abort_requests(self) -> None:
        self.calls["abort_requests"] += 1

    def pause_generation(self, mode: str = "retract") -> None:
        self.calls["pause_generation"] += 1

    def continue_generation(self) -> None:
        self.calls["continue_generation"] += 1

    def spread_calls(self, enabled: bool = True) -> None:
        self.calls["spread_calls"] += 1

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                       weight_version: Optional[int] = None, flush_cache: bool = True) -> None:
        drain_weights(named_tensors)  # the RolloutEngine contract: read to the end
        self.calls["update_weights"] += 1

    def release_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        self.calls["release_memory"] += 1

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        self.calls["resume_memory"] += 1

    def fault_metrics(self) -> dict[str, float]:
        return {}

    def check_health(self) -> None:
        self.calls["check_health"] += 1

    def shutdown(self) -> None:
        self.calls["shutdown"] += 1
