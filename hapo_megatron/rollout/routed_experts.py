"""The experts a MoE rollout engine routed each token to, and how often the actor routes them
otherwise (routing replay, docs/moe.md).

SGLang (``--enable-return-routed-experts`` and per-request ``return_routed_experts``) answers
``meta_info["routed_experts"]``: base64 of int32 expert ids, shape ``[prompt + response - 1,
num_hidden_layers, top_k]`` (the positions of every token the server ran through the model: the
last sampled token is never fed back), in each router's top-k order. Layers without experts
(``mlp_only_layers``) hold zeros.
"""

from __future__ import annotations

import base64

import numpy as np

try:  # SIMD base64, an SGLang dependency (its servers encode the routes with it)
    import pybase64 as _pybase64
except ImportError:  # pragma: no cover - an install without SGLang's dependencies
    _pybase64 = None


def _b64decode(encoded: str) -> bytes:
    """Strict base64 (a character outside the alphabet raises ``ValueError``). pybase64's strict
    decode is 15x the stdlib's lenient one on a 10k-token answer's routes (21 MB a row): the routes
    of a recipe step are ~170 GB of base64 (tools/bench/README.md, host_step.py)."""
    if _pybase64 is not None:
        return _pybase64.b64decode(encoded, validate=True)
    return base64.b64decode(encoded, validate=True)


def decode_routed_experts(encoded: str, positions: int) -> np.ndarray:
    """SGLang's base64 ``routed_experts`` as an int16 array ``[positions, num_layers * top_k]``
    (`Sample.routed_experts`; ``.reshape(positions, num_layers, top_k)`` splits the layers)."""
    flat = np.frombuffer(_b64decode(encoded), dtype=np.int32)
    if positions <= 0 or flat.size % positions or flat.size == 0:
        raise ValueError(f"routed_experts holds {flat.size} ids, not the same number for each of "
                         f"{positions} positions: does the answer belong to this sequence?")
    if flat.size and (flat.min() < 0 or flat.max() > np.iinfo(np.int16).max):
        raise ValueError(f"routed_experts holds expert ids outside 0..{np.iinfo(np.int16).max}")
    return flat.reshape(positions, -1).astype(np.int16)


def routing_mismatch(engine: np.ndarray, actor: np.ndarray, moe_layers=None) -> float:
    """Share of (token, MoE layer) pairs whose top-k expert SET differs between ``engine`` and
    ``actor`` (both ``[tokens, layers, top_k]``; the order within the top-k does not count).
    ``moe_layers``: the layer indices to compare (default all). NaN when there is nothing to
    compare."""
    engine, actor = np.asarray(engine), np.asarray(actor)
    if engine.shape != actor.shape or engine.ndim != 3:
        raise ValueError(f"routing shapes differ or are not [tokens, layers, top_k]: {engine.shape} vs {actor.shape}")
    if moe_layers is not None:
        engine, actor = engine[:, list(moe_layers)], actor[:, list(moe_layers)]
    if engine.size == 0:
        return float("nan")
    differs = (np.sort(engine, axis=-1) != np.sort(actor, axis=-1)).any(axis=-1)
    return float(differs.mean())
