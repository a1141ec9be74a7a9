"""Plan quality: [`pack_stats`] and the padded-batch baseline [`padded_fill_at_batch`]."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._checks import _check_int


def padded_fill_at_batch(lengths: Sequence[int] | np.ndarray, batch_size: int = 8) -> float:
    """Slot utilisation of padded batches of `batch_size` consecutive samples (input order).

    Each batch costs `len(batch) * max(batch)` token slots; utilisation is Σ length / Σ slots.

    Args:
        lengths (`Sequence[int]` or `np.ndarray`):
            Token counts in the order they would be batched.
        batch_size (`int`, *optional*, defaults to 8):
            Samples per padded batch (the last batch may be smaller).

    Returns:
        `float`: utilisation in [0, 1] (1.0 for empty input).
    """
    batch_size = _check_int("batch_size", batch_size, minimum=1)  # type: ignore[assignment]
    la = np.asarray(lengths, dtype=np.int64)
    n = la.shape[0]
    if n == 0 or int(la.sum()) == 0:
        return 1.0
    full = (n // batch_size) * batch_size
    slots = int(la[:full].reshape(-1, batch_size).max(axis=1).sum()) * batch_size
    if full < n:
        slots += int(la[full:].max()) * (n - full)
    return float(la.sum()) / slots


def pack_stats(
    packs: Sequence[Sequence[int]],
    lengths: Sequence[int] | np.ndarray,
    max_length: int,
    images: Sequence[int] | np.ndarray | None = None,
    *,
    batch_size: int = 8,
) -> dict[str, Any]:
    """Summary statistics of a packing plan.

    Args:
        packs (`Sequence[Sequence[int]]`):
            Packs as returned by [`plan_packs`].
        lengths (`Sequence[int]` or `np.ndarray`):
            Token count per sample (the same `lengths` the plan was made from).
        max_length (`int`):
            Token budget per pack.
        images (`Sequence[int]` or `np.ndarray`, *optional*):
            Image count per sample, for the per-pack image statistics.
        batch_size (`int`, *optional*, defaults to 8):
            Batch size of the padded baseline.

    Returns:
        `dict`: `num_packs`, `num_samples` (packed), `dropped` (samples of `lengths` in no pack),
        `fill` (Σ packed tokens / (num_packs · max_length)), `mean_tokens_per_pack`,
        `max_tokens_per_pack`, `min_tokens_per_pack`, `mean_samples_per_pack`,
        `mean_images_per_pack` / `max_images_per_pack` (`None` without `images`),
        `padded_batch_fill` (slot utilisation of padded batches of `batch_size` consecutive packed
        samples in input order) and `padding_ratio_padded_batches` (1 - that, the fraction of padded
        slots wasted).
    """
    max_length = _check_int("max_length", max_length, minimum=1)  # type: ignore[assignment]
    la = np.asarray(lengths, dtype=np.int64)
    num_packs = len(packs)
    flat = np.fromiter((i for p in packs for i in p), dtype=np.int64)
    sizes = np.fromiter((len(p) for p in packs), dtype=np.int64, count=num_packs)
    pack_of = np.repeat(np.arange(num_packs), sizes)
    tok = np.bincount(pack_of, weights=la[flat], minlength=num_packs).astype(np.int64)
    stats: dict[str, Any] = {
        "num_packs": num_packs,
        "num_samples": int(flat.size),
        "dropped": int(la.shape[0] - np.unique(flat).size),
        "fill": float(tok.sum()) / (num_packs * max_length) if num_packs else 0.0,
        "mean_tokens_per_pack": float(tok.mean()) if num_packs else 0.0,
        "max_tokens_per_pack": int(tok.max()) if num_packs else 0,
        "min_tokens_per_pack": int(tok.min()) if num_packs else 0,
        "mean_samples_per_pack": float(sizes.mean()) if num_packs else 0.0,
        "mean_images_per_pack": None,
        "max_images_per_pack": None,
    }
    if images is not None and num_packs:
        ia = np.asarray(images, dtype=np.int64)
        per = np.bincount(pack_of, weights=ia[flat], minlength=num_packs).astype(np.int64)
        stats["mean_images_per_pack"] = float(per.mean())
        stats["max_images_per_pack"] = int(per.max())
    packed_sorted = np.sort(flat)
    util = padded_fill_at_batch(la[packed_sorted], batch_size)
    stats["padded_batch_fill"] = util
    stats["padding_ratio_padded_batches"] = 1.0 - util
    return stats
