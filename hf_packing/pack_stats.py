"""Statistics of a plan: fill, pack sizes, images per pack, and the padded-batch baseline it is compared with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .planner import IntArray, check_int

__all__ = ["PADDED_BATCH", "pack_stats", "padded_fill_at_batch"]

#: the baseline every fill is compared with: the same samples in padded batches of 8, in input order
PADDED_BATCH = 8


def padded_fill_at_batch(lengths: IntArray, batch_size: int = PADDED_BATCH) -> float:
    """Slot utilisation of padded batches of `batch_size` consecutive samples: Σ length / Σ (rows × longest).

    Args:
        lengths (`Sequence[int]` or `np.ndarray`): Token counts in the order they would be batched.
        batch_size (`int`, *optional*, defaults to 8): Samples per padded batch (the last one may be smaller).

    Returns:
        `float`: utilisation in [0, 1] (1.0 for empty input).
    """
    batch_size = check_int("batch_size", batch_size, minimum=1)
    la = np.asarray(lengths, dtype=np.int64)
    if la.shape[0] == 0 or int(la.sum()) == 0:
        return 1.0
    full = (la.shape[0] // batch_size) * batch_size
    slots = int(la[:full].reshape(-1, batch_size).max(axis=1).sum()) * batch_size
    if full < la.shape[0]:
        slots += int(la[full:].max()) * (la.shape[0] - full)
    return float(la.sum()) / slots


def pack_stats(
    packs: Sequence[Sequence[int]],
    lengths: IntArray,
    max_length: int,
    images: IntArray | None = None,
    *,
    batch_size: int = PADDED_BATCH,
) -> dict[str, Any]:
    """Summary statistics of a plan.

    Args:
        packs (`Sequence[Sequence[int]]`): Packs as returned by [`plan_packs`].
        lengths (`Sequence[int]` or `np.ndarray`): Token count per sample (the `lengths` the plan was made from).
        max_length (`int`): Token budget per pack.
        images (`Sequence[int]` or `np.ndarray`, *optional*): Image count per sample, for the per-pack image statistics.
        batch_size (`int`, *optional*, defaults to 8): Batch size of the padded baseline.

    Returns:
        `dict`: `num_packs`, `num_samples` (packed), `dropped` (samples in no pack), `fill` (Σ packed tokens /
        (num_packs · max_length)), `mean_tokens_per_pack`, `max_tokens_per_pack`, `min_tokens_per_pack`,
        `mean_samples_per_pack`, `mean_images_per_pack` / `max_images_per_pack` (`None` without `images`),
        `padded_batch_fill` (slot utilisation of padded batches of `batch_size` packed samples in input order)
        and `padding_ratio_padded_batches` (1 - that).
    """
    max_length = check_int("max_length", max_length, minimum=1)
    la = np.asarray(lengths, dtype=np.int64)
    num_packs = len(packs)
    flat = np.fromiter((i for p in packs for i in p), dtype=np.int64)
    sizes = np.fromiter((len(p) for p in packs), dtype=np.int64, count=num_packs)
    pack_of = np.repeat(np.arange(num_packs), sizes)
    tok = np.bincount(pack_of, weights=la[flat], minlength=num_packs).astype(np.int64)
    per_image = None
    if images is not None and num_packs:
        per_image = np.bincount(pack_of, weights=np.asarray(images, dtype=np.int64)[flat], minlength=num_packs)
    padded = padded_fill_at_batch(la[np.sort(flat)], batch_size)
    return {
        "num_packs": num_packs,
        "num_samples": int(flat.size),
        "dropped": int(la.shape[0] - np.unique(flat).size),
        "fill": float(tok.sum()) / (num_packs * max_length) if num_packs else 0.0,
        "mean_tokens_per_pack": float(tok.mean()) if num_packs else 0.0,
        "max_tokens_per_pack": int(tok.max()) if num_packs else 0,
        "min_tokens_per_pack": int(tok.min()) if num_packs else 0,
        "mean_samples_per_pack": float(sizes.mean()) if num_packs else 0.0,
        "mean_images_per_pack": None if per_image is None else float(per_image.mean()),
        "max_images_per_pack": None if per_image is None else int(per_image.max()),
        "padded_batch_fill": padded,
        "padding_ratio_padded_batches": 1.0 - padded,
    }
