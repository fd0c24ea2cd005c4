"""`Ragged`: rows of different lengths (a rollout's per-token data) as one flat numpy array plus
row offsets, so that selecting, concatenating and shipping a step's rollout costs array operations,
not a Python object per token."""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

import numpy as np


class Ragged:
    """Row ``i`` is ``flat[offsets[i]:offsets[i + 1]]`` (a view; ``offsets`` int64 ``[rows + 1]``,
    starting at 0, non-decreasing). Rows appended one by one (`append`, for small hand-built
    batches) are joined into ``flat`` on the next read."""

    def __init__(self, flat: Any = None, offsets: Any = None, *, dtype: Any = np.float32) -> None:
        self.dtype = np.dtype(dtype if flat is None else np.asarray(flat).dtype)
        self._flat = np.zeros(0, self.dtype) if flat is None else np.ascontiguousarray(flat)
        self._offsets = np.zeros(1, np.int64) if offsets is None else np.asarray(offsets, dtype=np.int64)
        if self._flat.ndim != 1 or self._offsets.ndim != 1 or len(self._offsets) < 1:
            raise ValueError("Ragged needs a 1-D flat array and 1-D offsets [rows + 1]")
        if self._offsets[0] != 0 or self._offsets[-1] != len(self._flat) or bool((np.diff(self._offsets) < 0).any()):
            raise ValueError(f"offsets must rise from 0 to len(flat)={len(self._flat)}")
        self._pending: list[np.ndarray] = []

    @classmethod
    def from_rows(cls, rows: Iterable[Any], dtype: Any) -> "Ragged":
        """From per-row sequences (lists, numpy arrays or tensors; one conversion per row; None is an
        empty row)."""
        arrays = [np.zeros(0, dtype) if r is None else np.asarray(r, dtype=dtype).reshape(-1) for r in rows]
        return cls._join(arrays, np.dtype(dtype))

    @classmethod
    def _join(cls, arrays: Sequence[np.ndarray], dtype: np.dtype) -> "Ragged":
        offsets = np.zeros(len(arrays) + 1, np.int64)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        flat = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
        return cls(flat, offsets)

    def _settle(self) -> None:
        if self._pending:
            joined = Ragged._join([self._flat, *self._pending], self.dtype)
            self._offsets = np.concatenate([self._offsets, joined._offsets[2:]])  # row 0 of `joined` is flat
            self._flat, self._pending = joined._flat, []

    @property
    def flat(self) -> np.ndarray:
        self._settle()
        return self._flat

    @property
    def offsets(self) -> np.ndarray:
        self._settle()
        return self._offsets

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def append(self, row: Any) -> None:
        self._pending.append(np.asarray(row, dtype=self.dtype).reshape(-1))

    def extend(self, rows: Iterable[Any]) -> None:
        for r in rows:
            self.append(r)

    def __len__(self) -> int:
        return len(self._offsets) - 1 + len(self._pending)

    def __getitem__(self, i: int) -> np.ndarray:
        off = self.offsets
        i = range(len(off) - 1)[i]  # negative indices; IndexError out of range
        return self._flat[off[i]:off[i + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        off = self.offsets
        return (self._flat[off[i]:off[i + 1]] for i in range(len(off) - 1))

    def select(self, idx: Sequence[int]) -> "Ragged":
        """The rows ``idx`` (in that order); all rows in order share this one's arrays (they are
        never written in place)."""
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        off, flat = self.offsets, self.flat
        if len(idx) == len(self) and bool((idx == np.arange(len(idx))).all()):
            return Ragged(flat, off)
        lengths = self.lengths[idx]
        new_off = np.zeros(len(idx) + 1, np.int64)
        np.cumsum(lengths, out=new_off[1:])
        # one slice per row: a memcpy each, no per-token index array
        parts = [flat[a:b] for a, b in zip(off[idx].tolist(), off[idx + 1].tolist())]
        return Ragged(np.concatenate(parts) if parts else flat[:0], new_off)

    @staticmethod
    def concat(parts: Sequence["Ragged"], dtype: Any = None) -> "Ragged":
        """Rows of ``parts`` in order; a single non-empty part is shared, not copied."""
        dt = np.dtype(dtype) if dtype is not None else (parts[0].dtype if parts else np.dtype(np.float32))
        rows = [p for p in parts if len(p)]
        if len(rows) == 1 and rows[0].dtype == dt:
            return Ragged(rows[0].flat, rows[0].offsets)
        flats, offs, base = [], [np.zeros(1, np.int64)], 0
        for p in rows:
            flats.append(p.flat)
            offs.append(p.offsets[1:] + base)
            base += len(p.flat)
        return Ragged(np.concatenate(flats).astype(dt, copy=False) if flats else np.zeros(0, dt), np.concatenate(offs))

    def tolist(self) -> list[list]:
        return [r.tolist() for r in self]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Ragged):
            return bool(np.array_equal(self.offsets, other.offsets) and np.array_equal(self.flat, other.flat))
        try:
            rows = list(other)  # type: ignore[call-overload]
        except TypeError:
            return NotImplemented
        return len(rows) == len(self) and all(np.array_equal(a, np.asarray(b)) and len(a) == len(b)
                                              for a, b in zip(self, rows))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Ragged(rows={len(self)}, tokens={len(self.flat)}, dtype={self.dtype})"

    def __getstate__(self) -> dict:
        return {"flat": self.flat, "offsets": self.offsets}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["flat"], state["offsets"])


__all__ = ["Ragged"]
