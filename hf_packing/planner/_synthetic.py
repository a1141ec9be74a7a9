"""Synthetic LLaVA-like length/image/patch mix for the tests and `python -m hf_packing.planner`."""

from __future__ import annotations

import math

import numpy as np


def _synthetic_llava_mix(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """LLaVA-like synthetic mix: lognormal lengths (median 600, p99 ~1800), ~6% short text-only.

    Returns `(lengths, images, vision_patches)`; image samples have one image whose vision tokens are
    ~70% of the sample and 4 patches per vision token (2x2 merge).
    """
    rng = np.random.default_rng(seed)
    sigma = math.log(3.0) / 2.3263  # p99 / median = 3
    lengths = np.exp(rng.normal(math.log(600.0), sigma, size=n))
    text = rng.random(n) < 0.06
    lengths[text] = rng.uniform(16, 256, size=int(text.sum()))
    lengths = np.maximum(lengths.round().astype(np.int64), 1)
    images = (~text).astype(np.int64)
    patches = np.where(text, 0, (lengths * 0.7).astype(np.int64) * 4)
    return lengths, images, patches
