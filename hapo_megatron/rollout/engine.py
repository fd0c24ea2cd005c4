"""The rollout-engine interface: sampling parameters, samples, the protocol (engines are built by
`rollout.factory.make_engine`, which sits above their implementations).

Every engine (the embedded HF-transformers engine, SGLang servers) takes prompts as token ids and
returns, per prompt, ``n`` :class:`Sample` objects in prompt order. Each sample carries the
response token ids, the log-prob of every sampled token under the distribution it was sampled
from, and (where the engine can observe it) the temperature used at that token.

Adaptive temperature (docs/algorithm.md, section 1): with ``params.adaptive`` and
``params.entropy_stats`` set, each decoding step samples row ``b`` at
``T_b = T_base * (1 + temperature_tau * h_hat_b)``, where ``h_hat_b`` is the normalised entropy
of that row's next-token distribution at ``T_base`` (computed by
:func:`hapo_megatron.algo.adaptive_temperature`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from hapo_megatron.algo import EntropyStats, check_h_hat_mode, check_temperature_tau

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample the responses of one :meth:`RolloutEngine.generate` call (keyword arguments
    only). ``temperature``, ``top_p`` and ``top_k`` are required: every caller states the sampling
    it wants (training and validation sampling: :meth:`from_config`).

    Attributes:
        n: responses per prompt (>= 1).
        temperature: ``T_base`` (> 0), or 0 for greedy decoding (argmax; adaptive ignored).
        top_p: nucleus threshold in (0, 1], applied after the temperature.
        top_k: keep the k most likely tokens (-1 = off), applied after the temperature.
        max_new_tokens: maximum response length in tokens (>= 1).
        stop_token_ids: extra token ids that end a response (the model's eos always does unless
            ``ignore_eos``). The stop token is kept as the last response token.
        seed: sampling seed; the same seed, prompts and weights give the same samples (HF
            engine; SGLang only with ``SGLangEngine(send_sampling_seed=True)``). ``None`` draws a
            seed from torch's global generator.
        adaptive: apply the adaptive temperature (needs ``entropy_stats``; without stats the
            engine samples at ``T_base``).
        entropy_stats: the previous training step's entropy statistics.
        temperature_tau: ``tau`` in ``T = T_base * (1 + tau * h_hat)``, in [0, 1)
            (``algo.temperature_tau``). Required when ``adaptive``; ``None``: not used.
        h_hat_mode: ``"signed"`` (paper) or ``"reference"`` (public code's sign defect)
            (``algo.loss.h_hat_mode``). Required when ``adaptive``; ``None``: not used.
        ignore_eos: do not stop on the model's eos token (``stop_token_ids`` still stop).
        return_routes: MoE models: return each sample's routed experts (`Sample.routed_experts`;
            SGLang servers need ``--enable-return-routed-experts``).
    """

    n: int = 1
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int = 1024
    stop_token_ids: tuple[int, ...] = ()
    seed: Optional[int] = None
    adaptive: bool = False
    entropy_stats: Optional[EntropyStats] = None
    temperature_tau: Optional[float] = None
    h_hat_mode: Optional[str] = None
    ignore_eos: bool = False
    return_routes: bool = False

    def __post_init__(self) -> None:
        if int(self.n) < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        t = float(self.temperature)
        if not (t >= 0.0 and math.isfinite(t)):
            raise ValueError(f"temperature must be a finite float >= 0, got {self.temperature!r}")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if int(self.top_k) != -1 and int(self.top_k) < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        if int(self.max_new_tokens) < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens!r}")
        if self.adaptive and (self.temperature_tau is None or self.h_hat_mode is None):
            missing = [name for name, v in (("temperature_tau (algo.temperature_tau)", self.temperature_tau),
                                            ("h_hat_mode (algo.loss.h_hat_mode)", self.h_hat_mode)) if v is None]
            raise ValueError(f"adaptive sampling needs {' and '.join(missing)}; got None")
        if self.temperature_tau is not None:
            check_temperature_tau(self.temperature_tau)
        if self.h_hat_mode is not None:
            check_h_hat_mode(self.h_hat_mode)
        stats = self.entropy_stats
        if stats is not None and not isinstance(stats, EntropyStats):
            try:
                stats = EntropyStats.from_dict(stats)
            except Exception as e:  # noqa: BLE001 - re-raised with the argument name
                raise ValueError(f"entropy_stats must be EntropyStats or its dict: {e}") from None
        object.__setattr__(self, "entropy_stats", stats)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """Temperature 0: argmax decoding."""
        return float(self.temperature) == 0.0

    @property
    def uses_adaptive(self) -> bool:
        """Whether the adaptive temperature actually applies (adaptive, stats given, sampling)."""
        return bool(self.adaptive) and self.entropy_stats is not None and not self.greedy

    def with_(self, **changes: Any) -> "SamplingParams":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    @classmethod
    def from_config(cls, rollout_cfg: Any, algo_cfg: Any = None, *, validation: bool = False,
                    entropy_stats: Optional[EntropyStats] = None, seed: Optional[int] = None,
                    max_new_tokens: Optional[int] = None,
                    stop_token_ids: Sequence[int] = ()) -> "SamplingParams":
        """Training or validation sampling parameters from ``RolloutConfig`` (+ ``AlgoConfig``).

        Training: ``n``, ``temperature`` (T_base), ``top_p``, ``top_k``, and the adaptive
        temperature from ``algo_cfg`` (``adaptive_temperature``, ``temperature_tau``,
        ``h_hat_mode``) with ``entropy_stats``; ``algo_cfg`` is required. Validation: ``val_n``,
        ``val_temperature``, ``val_top_p``, top-k off, never adaptive (docs/algorithm.md, section 1):
        no ``algo_cfg`` needed, ``temperature_tau`` and ``h_hat_mode`` stay None. Every field is
        read by name, so a missing or renamed one raises instead of falling back to a default.
        """
        max_new = int(max_new_tokens if max_new_tokens is not None else rollout_cfg.max_response_length)
        if validation:
            return cls(n=rollout_cfg.val_n, temperature=rollout_cfg.val_temperature,
                       top_p=rollout_cfg.val_top_p, top_k=-1, max_new_tokens=max_new,
                       stop_token_ids=tuple(stop_token_ids), seed=seed, adaptive=False)
        if algo_cfg is None:
            raise ValueError("SamplingParams.from_config needs algo_cfg for training sampling "
                             "(adaptive_temperature, temperature_tau, h_hat_mode)")
        adaptive = bool(algo_cfg.adaptive_temperature)
        return cls(
            n=rollout_cfg.n, temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p,
            top_k=rollout_cfg.top_k, max_new_tokens=max_new, stop_token_ids=tuple(stop_token_ids),
            seed=seed, adaptive=adaptive, entropy_stats=entropy_stats if adaptive else None,
            temperature_tau=float(algo_cfg.temperature_tau), h_hat_mode=str(algo_cfg.loss.h_hat_mode),
        )


@dataclass
class Sample:
    """One generated response. The per-token fields are numpy arrays (int32 ids, float32
    log-probs and temperatures: what the trainer keeps), whatever sequence an engine builds them
    from, so a step's rollout holds no Python object per token.

    Attributes:
        prompt_ids: the prompt's token ids (unpadded).
        response_ids: generated token ids; ends with the stop token when ``finish_reason`` is
            ``"stop"``.
        rollout_logprobs: per response token, its log-prob under the distribution it was sampled
            from (``[len(response_ids)]``). HF engine: after temperature and top-k/top-p
            renormalisation. SGLang: after temperature, before top-k/top-p (SGLang's convention;
            identical when top_p = 1 and top_k = -1). Greedy: ``log_softmax`` of the raw logits.
        temperatures: per response token, the sampling temperature used, or an EMPTY array when
            the engine cannot observe it (SGLang: the custom logit processor cannot return data).
            Callers detect ``len(temperatures) != len(response_ids)`` and, if needed, recompute
            ``T = T_base * (1 + tau * h_hat(old_entropy))`` trainer-side.
        finish_reason: ``"stop"`` (eos / stop token) or ``"length"`` (``max_new_tokens``).
        prompt_index: index of the prompt in the ``generate`` call.
        sample_index: index of this sample among the prompt's ``n``.
        routed_experts: MoE engines asked for routes (``params.return_routes``): int16
            ``[len(prompt_ids) + len(response_ids) - 1, num_hidden_layers * top_k]``, per token the
            engine ran through the model (the last sampled token never is), each layer's top-k
            experts in turn (dense layers hold 0); an empty array otherwise.
        weight_versions: per response token, the weight version that generated it (int32; SGLang
            reports version spans when the updates were tagged with ``weight_version``, see
            `SGLangEngine.update_weights`); an EMPTY array when the engine did not report them.
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    rollout_logprobs: np.ndarray
    temperatures: np.ndarray
    finish_reason: str
    prompt_index: int
    sample_index: int = 0
    routed_experts: Optional[np.ndarray] = None
    weight_versions: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        for name, dtype in (("prompt_ids", np.int32), ("response_ids", np.int32), ("rollout_logprobs", np.float32),
                            ("temperatures", np.float32)):
            setattr(self, name, np.asarray(getattr(self, name), dtype=dtype).reshape(-1))
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        if len(self.rollout_logprobs) != len(self.response_ids):
            raise ValueError(f"rollout_logprobs has {len(self.rollout_logprobs)} entries for "
                             f"{len(self.response_ids)} response tokens")
        routes = np.zeros(0, np.int16) if self.routed_experts is None else np.asarray(self.routed_experts, np.int16)
        positions = len(self.prompt_ids) + len(self.response_ids) - 1
        if routes.size and (routes.ndim != 2 or len(routes) != positions):
            raise ValueError(f"routed_experts must be [prompt + response - 1 = {positions}, layers * top_k], "
                             f"got shape {routes.shape}")
        self.routed_experts = routes
        versions = np.zeros(0, np.int32) if self.weight_versions is None else \
            np.asarray(self.weight_versions, np.int32).reshape(-1)
        if versions.size and len(versions) != len(self.response_ids):
            raise ValueError(f"weight_versions has {len(versions)} entries for {len(self.response_ids)} "
                             "response tokens")
        self.weight_versions = versions

    @property
    def has_routes(self) -> bool:
        """Whether the engine returned the experts of every token it ran."""
        return self.routed_experts.size > 0

    @property
    def has_temperatures(self) -> bool:
        """Whether per-token temperatures were recorded."""
        return len(self.temperatures) == len(self.response_ids)


@dataclass(frozen=True)
class RowRequest:
    """One row of a `RolloutEngine.generate_group` call: its input (the prompt, or prompt + the
    partial response to continue), its token budget and its sampling seed (None: the engine's own
    randomness)."""

    input_ids: tuple[int, ...]
    max_new_tokens: int
    seed: Optional[int] = None


@dataclass(frozen=True)
class RowResult:
    """What one row of a `RolloutEngine.generate_group` call returned: the new tokens, their
    log-probs, and ``"stop"``, ``"length"`` or ``"abort"`` (`ABORT`: the tokens so far; none when
    it never started); ``weight_versions``: the weight version of each new token when the engine
    reports them (SGLang, updates tagged with ``weight_version``), else empty."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    weight_versions: tuple[int, ...] = ()


ABORT = "abort"


@runtime_checkable
class RolloutEngine(Protocol):
    """What the synchronous, asynchronous and over-sampling loops call on a rollout engine
    (docs/architecture.md, "The engine protocol"). Every engine implements every member; where one
    means nothing for an engine it is a documented no-op or a one-line refusal, never missing:
    the loops never ask ``hasattr(engine, ...)`` (tests/rollout/test_engine_protocol.py checks
    every engine class against this list, signatures included).

    Declared attributes (capabilities the loops read):
        dtype: the dtype the trainer exports the weights in for this engine (None: the actor's).
        send_sampling_seed: whether `RowRequest.seed` / ``SamplingParams.seed`` reach the sampler
            per row (a resumed row keeps its seed only then).
        stop_check: set by the trainer for the time of a rollout; an engine that waits on servers
            polls it and, when it answers True, aborts its requests and raises `GenerationAborted`.
    """

    dtype: Optional[torch.dtype]
    send_sampling_seed: bool
    stop_check: Optional[Callable[[], bool]]

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 on_samples: Optional[Callable[[list[Sample]], None]] = None) -> list[list[Sample]]:
        """``params.n`` samples per prompt; outer list in prompt order, inner in sample order.

        ``on_samples`` (when given) is called with each chunk of finished samples as soon as the
        chunk is done (from any thread; every sample exactly once), so rewards can be scored while
        the rest is generated (rewards.scoring)."""
        ...

    def generate_group(self, rows: Sequence[RowRequest], params: SamplingParams) -> list[RowResult]:
        """One prompt group's rows in one call (over-sampling, docs/algorithm.md "Over-sampling and
        partial rollouts"): each row with its own input, budget and seed (``params`` gives the rest
        of the sampling); a row that `abort_requests` ends returns its tokens so far with finish
        reason `ABORT`. Safe to call from many threads at once."""
        ...

    def abort_requests(self) -> None:
        """End every request in flight (their calls return what they have); best effort."""
        ...

    def pause_generation(self, mode: str = "retract") -> None:
        """Pause generation for a weight update (asynchronous rollouts; ``mode``: SGLang's
        ``retract``, ``in_place`` or ``abort``)."""
        ...

    def continue_generation(self) -> None:
        """Undo :meth:`pause_generation`."""
        ...

    def spread_calls(self, enabled: bool = True) -> None:
        """With ``enabled``, successive generate calls start on successive servers (asynchronous
        rollouts send one small call per group from many threads); off: each call's chunks are
        spread from the first server, the synchronous loop's order."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                       weight_version: Optional[int] = None, flush_cache: bool = True) -> None:
        """Load HF-named full tensors (``export_hf_weights`` output) into the engine's model.
        ``weight_version``: the version the samples generated from now on report per token
        (`Sample.weight_versions`); ``flush_cache=False`` keeps the KV cache of requests paused in
        place.

        Contract: reads ``named_tensors`` to the end on every rank that calls it, also when the
        update fails (then it raises after reading). The export behind the iterator runs
        collectives over the trainer's ranks, so a rank that stops reading early leaves the
        others waiting in them; `drain_weights` reads the rest."""
        ...

    def release_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Free the accelerator memory regions ``tags`` (of ``"weights"``, ``"kv_cache"``,
        ``"cuda_graph"``; None = all) while the trainer runs (colocated setups); no-op otherwise.
        `training.engine_memory.EngineMemory` makes these calls and tracks what is released."""
        ...

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Undo :meth:`release_memory` of ``tags`` (None = all) before an update / generation."""
        ...

    def fault_metrics(self) -> dict[str, float]:
        """Metrics of the faults handled so far (``rollout/server_restarts``, ...); {} when none
        can happen."""
        ...

    def check_health(self) -> None:
        """Raise when the engine cannot generate (a dead server in use)."""
        ...

    def shutdown(self) -> None:
        """Release every resource (servers, processes, model)."""
        ...


def drain_weights(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Read the rest of a weight stream (running the export's collectives); returns how many
    tensors were left."""
    it: Iterator = iter(named_tensors)
    return sum(1 for _ in it)


def check_prompt_ids(prompt_ids: Any) -> list[list[int]]:
    """Validate ``prompt_ids`` (a list of non-empty lists of non-negative ints)."""
    if not isinstance(prompt_ids, (list, tuple)):
        raise ValueError(f"prompt_ids must be a list of token-id lists, got {type(prompt_ids).__name__}")
    out = []
    for i, p in enumerate(prompt_ids):
        if torch.is_tensor(p):
            p = p.tolist()
        if not isinstance(p, (list, tuple)) or len(p) == 0:
            raise ValueError(f"prompt_ids[{i}] must be a non-empty list of token ids")
        ids = [int(t) for t in p]
        if min(ids) < 0:
            raise ValueError(f"prompt_ids[{i}] has a negative token id")
        out.append(ids)
    return out


class GenerationAborted(RuntimeError):
    """``generate`` gave up because its ``stop_check`` asked it to (a stop request of the run): the
    in-flight requests were aborted and no sample is returned (training/stages.py abandons the step)."""


__all__ = ["ABORT", "GenerationAborted", "FINISH_REASONS", "RowRequest", "RowResult", "Sample", "SamplingParams",
           "RolloutEngine", "check_prompt_ids", "drain_weights"]
