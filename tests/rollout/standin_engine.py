"""`StandInEngine`: the base of the tests' scripted engines. It implements every member of
`hapo_megatron.rollout.engine.RolloutEngine` (docs/architecture.md, "The engine protocol"), so a
scripted engine passed to a loop is a whole engine, as the loops require: a test overrides what it
scripts; the generation calls it does not script refuse (the test reached something it did not
plan), the other calls do nothing (`update_weights` reads its stream to the end, as the contract
asks)."""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

import torch

from hapo_megatron.rollout.engine import RowRequest, RowResult, Sample, SamplingParams, drain_weights


class StandInEngine:
    dtype: Optional[torch.dtype] = None
    send_sampling_seed: bool = False
    stop_check: Optional[Callable[[], bool]] = None

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 on_samples: Optional[Callable[[list[Sample]], None]] = None) -> list[list[Sample]]:
        raise AssertionError(f"{type(self).__name__}.generate is not scripted")

    def generate_group(self, rows: Sequence[RowRequest], params: SamplingParams) -> list[RowResult]:
        raise AssertionError(f"{type(self).__name__}.generate_group is not scripted")

    def abort_requests(self) -> None:
        pass

    def pause_generation(self, mode: str = "retract") -> None:
        pass

    def continue_generation(self) -> None:
        pass

    def spread_calls(self, enabled: bool = True) -> None:
        pass

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                       weight_version: Optional[int] = None, flush_cache: bool = True) -> None:
        drain_weights(named_tensors)  # the RolloutEngine contract: read to the end

    def release_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        pass

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        pass

    def fault_metrics(self) -> dict[str, float]:
        return {}

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
