"""[`plan_packs`]: plan a whole input in one call (a [`StreamingPlanner`] fed everything, then flushed)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .streaming import StreamingPlanner


def plan_packs(
    lengths: Sequence[int] | np.ndarray,
    *,
    max_length: int,
    strategy: str = "bfd",
    images: Sequence[int] | np.ndarray | None = None,
    max_images: int | None = None,
    vision_patches: Sequence[int] | np.ndarray | None = None,
    max_vision_patches: int | None = None,
    buffer_size: int | None = None,
    seed: int = 0,
) -> list[list[int]]:
    """Groups samples into packs that respect token, image and vision-patch budgets.

    Implemented as `StreamingPlanner(...).extend(...)` followed by `flush()`, so streaming here and
    in a data pipeline give the same packs.

    Args:
        lengths (`Sequence[int]` or `np.ndarray`):
            Token count per sample.
        max_length (`int`):
            Token budget per pack (hard limit).
        strategy (`str`, *optional*, defaults to `"bfd"`):
            `"next_fit"`, `"ffd"`, `"bfd"` or `"balanced"`.
        images (`Sequence[int]` or `np.ndarray`, *optional*):
            Image count per sample; required when `max_images` is set.
        max_images (`int`, *optional*):
            Maximum images per pack.
        vision_patches (`Sequence[int]` or `np.ndarray`, *optional*):
            Σ `t·h·w` of each sample's images/videos; required when `max_vision_patches` is set.
        max_vision_patches (`int`, *optional*):
            Maximum vision patches per pack.
        buffer_size (`int`, *optional*):
            `None` plans the whole input at once; `k` streams it in windows of k samples with
            carry-over of packs that are not yet full.
        seed (`int`, *optional*, defaults to 0):
            Reserved; all strategies are deterministic.

    Returns:
        `list[list[int]]`: packs as lists of indices into `lengths`. Samples that alone exceed a
        budget are in no pack; every other sample is in exactly one.

    Example:

    ```python
    >>> plan_packs([5, 4, 3, 3, 2, 1], max_length=8, strategy="bfd")
    [[0, 2], [1, 3, 5], [4]]
    ```
    """
    planner = StreamingPlanner(
        max_length=max_length,
        strategy=strategy,
        max_images=max_images,
        max_vision_patches=max_vision_patches,
        buffer_size=buffer_size,
        seed=seed,
    )
    packs = planner.extend(lengths, images=images, patches=vision_patches)
    packs.extend(planner.flush())
    return packs
