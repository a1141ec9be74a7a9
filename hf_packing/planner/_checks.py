"""Argument validation shared by the planner modules (plain ints and 1-D int arrays)."""

from __future__ import annotations

from typing import Any

import numpy as np

STRATEGIES: tuple[str, ...] = ("next_fit", "ffd", "bfd", "balanced")


def _check_int(name: str, value: Any, *, minimum: int, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__} ({value!r}).")
    value = int(value)
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}.")
    return value


def _as_int_array(name: str, values: Any, n: int | None = None) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"`{name}` must be a 1-D sequence of ints, got shape {arr.shape}.")
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise TypeError(f"`{name}` must contain ints, got dtype {arr.dtype}.")
    arr = arr.astype(np.int64, copy=False)
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"`{name}` has {arr.shape[0]} entries but `lengths` has {n}; pass one value per sample.")
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"`{name}` must be >= 0; got {int(arr.min())} at index {int(arr.argmin())}.")
    return arr

