"""A step's `RolloutBatch` from the rollout manager process to trainer rank 0 as arrays
(training/asynchronous/manager.py): a small header (field names, dtypes, lengths; the two string
columns) and one raw buffer per array, written and read with ``Connection.send_bytes`` /
``recv_bytes``. The trainer wraps each buffer as a numpy array (no copy, no per-token Python
object): what it parses per step is the header, not the rows.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

import numpy as np

from hapo_megatron.training.batches.ragged import Ragged
from hapo_megatron.training.batches.rollout_batch import RAGGED_FIELDS, RolloutBatch, SequenceFields

# the per-sequence numeric fields and the dtype that holds each exactly (Python int / float / bool)
_NUMERIC = {"group_ids": np.int64, "scores": np.float64, "accs": np.bool_, "rewards": np.float64}
_STRINGS = ("finish_reasons", "data_sources")
assert set(_NUMERIC) | set(_STRINGS) == {f.name for f in fields(SequenceFields)}, "a field without a transport"


def batch_arrays(batch: RolloutBatch) -> tuple[dict[str, Any], list[np.ndarray]]:
    """(header, arrays) of ``batch``; `batch_from_arrays` inverts it."""
    arrays, names = [], []
    for name, dtype in _NUMERIC.items():
        names.append(name)
        arrays.append(np.asarray(getattr(batch, name), dtype=dtype).reshape(-1))
    for name in RAGGED_FIELDS:
        col = batch.column(name)
        names += [f"{name}.flat", f"{name}.offsets"]
        arrays += [np.ascontiguousarray(col.flat), np.ascontiguousarray(col.offsets, dtype=np.int64)]
    header = {"names": names, "dtypes": [a.dtype.str for a in arrays], "sizes": [int(a.size) for a in arrays],
              **{name: list(getattr(batch, name)) for name in _STRINGS}}
    return header, arrays


def batch_from_arrays(header: dict[str, Any], arrays: list[np.ndarray]) -> RolloutBatch:
    got = dict(zip(header["names"], arrays))
    kw: dict[str, Any] = {name: got[name].tolist() for name in _NUMERIC}
    kw.update({name: list(header[name]) for name in _STRINGS})
    for name in RAGGED_FIELDS:
        kw[name] = Ragged(got[f"{name}.flat"], got[f"{name}.offsets"])
    return RolloutBatch(**kw)


def send_batch(conn, batch: RolloutBatch) -> None:
    """Write ``batch`` to ``conn`` (a `multiprocessing.connection.Connection`)."""
    header, arrays = batch_arrays(batch)
    conn.send_bytes(json.dumps(header).encode())
    for a in arrays:
        conn.send_bytes(memoryview(a).cast("B") if a.size else b"")


def recv_batch(conn) -> RolloutBatch:
    """Read one batch written by `send_batch`."""
    header = json.loads(conn.recv_bytes())
    arrays = []
    for dtype, size in zip(header["dtypes"], header["sizes"]):
        dt = np.dtype(dtype)
        buf = bytearray(size * dt.itemsize)  # read straight into a writable buffer the array then owns
        n = conn.recv_bytes_into(buf) if size else len(conn.recv_bytes())
        if n != len(buf):
            raise ValueError(f"rollout batch transport: expected {len(buf)} bytes, got {n}")
        arrays.append(np.frombuffer(buf, dtype=dt, count=size) if size else np.zeros(0, dt))
    return batch_from_arrays(header, arrays)


__all__ = ["batch_arrays", "batch_from_arrays", "recv_batch", "send_batch"]
