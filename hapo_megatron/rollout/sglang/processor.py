"""Adaptive temperature inside SGLang through its public ``CustomLogitProcessor`` hook.

SGLang's sampler (``sglang.srt.layers.sampler.Sampler``, checked on 0.5.23) calls custom logit
processors on the RAW logits, before it divides each row by the request's ``temperature``. So a
processor that returns ``z / (T / T_base)`` for a row, where ``T = adaptive_temperature(z, stats,
T_base, tau, h_hat_mode)`` (``hapo_megatron.algo``, docs/algorithm.md, section 1), makes the sampler's
``softmax((z / (T / T_base)) / T_base)`` equal ``softmax(z / T)``: the adaptive temperature,
with top-p / top-k applied after it as usual. The request's ``temperature`` MUST equal the
``base_temperature`` inside its ``custom_params`` (:class:`SGLangEngine` builds both from one
``SamplingParams``).

Wire format: the server rebuilds the processor class with no arguments (``from_str``), so all
configuration travels per request in ``sampling_params["custom_params"]`` under the single key
:data:`PARAM_KEY` (a flat dict of JSON scalars; SGLang adds its own keys such as ``"__req__"`` to
the dict, which are ignored). Rows whose params lack :data:`PARAM_KEY` (or carry ``None``) are
returned bit-for-bit unchanged. ``to_str()`` pickles the class BY REFERENCE with dill, so
``hapo_megatron`` must be importable on the server hosts, and the server must run with
``--enable-custom-logit-processor``.

Cost per decoding step: one entropy over ``[rows, V]`` per distinct ``(T_base, tau, h_hat_mode)``
(normally one), no host-device synchronisation: identical statistics for every row (the normal
case) travel as Python floats; mixed rows need one small pinned, non-blocking host-to-device copy.
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Optional

import torch

from hapo_megatron.algo import EntropyStats, adaptive_temperature, check_h_hat_mode, check_temperature_tau

try:  # the real base class when SGLang is installed (servers always have it)
    from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor as _ProcessorBase

    SGLANG_AVAILABLE = True
except Exception:  # noqa: BLE001 - any import failure means "no SGLang here"
    SGLANG_AVAILABLE = False

    class _ProcessorBase:  # type: ignore[no-redef]
        """Stand-in with SGLang's serialisation format, so requests can be built without SGLang."""

        def __call__(self, logits, custom_param_list=None):  # pragma: no cover - abstract
            raise NotImplementedError

        @classmethod
        def to_str(cls) -> str:
            import dill

            return json.dumps({"callable": dill.dumps(cls).hex()})

        @classmethod
        def from_str(cls, json_str: str):
            import dill

            return dill.loads(bytes.fromhex(json.loads(json_str)["callable"]))()


#: the key of our entry in a request's ``custom_params``
PARAM_KEY = "hapo_adaptive_temperature"
_STATS_FIELDS = ("pivot", "std", "pos_max", "neg_min")


def _parse_row(params: Optional[Dict[str, Any]]) -> Optional[tuple]:
    """``(pivot, std, pos_max, neg_min, T_base, tau, mode)`` or ``None`` (row untouched)."""
    if not isinstance(params, dict):
        return None
    entry = params.get(PARAM_KEY)
    if entry is None:
        return None
    try:
        stats = tuple(float(entry[k]) for k in _STATS_FIELDS)  # float("inf") parses "inf"
        t_base, tau, mode = float(entry["base_temperature"]), float(entry["temperature_tau"]), str(entry["h_hat_mode"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"custom_params[{PARAM_KEY!r}] is malformed ({e!r}): {entry!r}") from None
    check_h_hat_mode(mode)
    return stats + (t_base, tau, mode)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host-to-device copy that does not block the host (pinned + non_blocking on CUDA)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class AdaptiveTemperatureProcessor(_ProcessorBase):
    """SGLang ``CustomLogitProcessor`` applying HAPO's adaptive temperature per row.

    ``__call__(logits [R, V], custom_param_list: list of R dicts/None) -> [R, V]`` (same dtype):
    row ``r`` with our params becomes ``logits[r] * T_base / T_r``; other rows are unchanged.
    """

    @classmethod
    def custom_params(cls, stats: Optional[EntropyStats], base_temperature: float,
                      temperature_tau: float, h_hat_mode: str) -> dict:
        """A request's ``custom_params`` (JSON-safe). ``stats=None`` or a greedy request
        (``base_temperature == 0``) gives ``{}``: the processor leaves that row untouched."""
        tb, tau = float(base_temperature), float(temperature_tau)
        if not (tb >= 0 and math.isfinite(tb)):
            raise ValueError(f"base_temperature must be a finite float >= 0, got {base_temperature!r}")
        check_temperature_tau(tau)
        check_h_hat_mode(h_hat_mode)
        if stats is None or tb == 0.0:
            return {}
        if not isinstance(stats, EntropyStats):
            stats = EntropyStats.from_dict(stats)
        entry = dict(stats.to_dict())  # non-finite values become "inf" / "-inf" strings
        entry.update(base_temperature=tb, temperature_tau=tau, h_hat_mode=h_hat_mode)
        return {PARAM_KEY: entry}

    def __call__(self, logits: torch.Tensor, custom_param_list: Optional[List[Optional[Dict[str, Any]]]] = None
                 ) -> torch.Tensor:
        rows = list(custom_param_list or [])
        if len(rows) != logits.shape[0]:
            raise ValueError(f"custom_param_list has {len(rows)} entries for {logits.shape[0]} logits rows")
        specs = [_parse_row(p) for p in rows]
        if all(s is None for s in specs):
            return logits
        ratio = self._temperature_ratio(logits, specs)
        return (logits.float() / ratio.unsqueeze(-1)).to(logits.dtype)

    @staticmethod
    def _temperature_ratio(logits: torch.Tensor, specs: list) -> torch.Tensor:
        """``[R]`` float32: ``T / T_base`` for rows with params, exactly 1.0 for the others."""
        if all(s is not None for s in specs) and len(set(specs)) == 1:
            s = specs[0]  # the normal case: one statistic for the whole batch, as floats
            return adaptive_temperature(logits, s[:4], s[4], s[5], s[6]) / s[4]
        groups = sorted({s[4:] for s in specs if s is not None})
        neutral = (0.0, 1.0, 1.0, -1.0)
        table = torch.tensor([list(s[:4] if s is not None else neutral)
                              + [float(groups.index(s[4:])) if s is not None else -1.0] for s in specs],
                             dtype=torch.float64)
        table = _to_device(table, logits.device)
        stats = tuple(table[:, i] for i in range(4))
        gid = table[:, 4]
        ratio = torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device)
        for g, (t_base, tau, mode) in enumerate(groups):
            t = adaptive_temperature(logits, stats, t_base, tau, mode)
            ratio = torch.where(gid == g, t / t_base, ratio)
        return ratio


__all__ = ["AdaptiveTemperatureProcessor", "PARAM_KEY", "SGLANG_AVAILABLE"]
