"""`python -m hf_packing.planner`: fill and items/s per strategy on the synthetic mix (manual)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ._synthetic import _synthetic_llava_mix
from .stats import pack_stats, padded_fill_at_batch
from .streaming import StreamingPlanner


def _benchmark(n: int = 1_000_000, repeats: int = 3) -> None:  # pragma: no cover - manual
    """Prints fill and throughput per strategy on the synthetic mix (`python -m hf_packing.planner`).

    Throughput is the best of `repeats` runs of `time.perf_counter()` around `plan_packs` (lengths
    only, one core). The media rows add `max_images=64, max_vision_patches=4 * max_length` (never
    binding on this mix) and `max_images=8` (binding).
    """
    lengths, images, patches = _synthetic_llava_mix(n)
    print(f"{n} samples, median {int(np.median(lengths))}, p99 {int(np.percentile(lengths, 99))}")
    rows: list[tuple[str, dict[str, Any]]] = [
        ("next_fit", {"strategy": "next_fit"}),
        ("ffd whole", {"strategy": "ffd"}),
        ("bfd whole", {"strategy": "bfd"}),
        ("bfd buffer=1000", {"strategy": "bfd", "buffer_size": 1000}),
        ("bfd buffer=1000, no re-planning", {"strategy": "bfd", "buffer_size": 1000, "repack_windows": 0}),
        ("bfd buffer=1000, no carry-over", {"strategy": "bfd", "buffer_size": 1000, "max_open_bins": 0}),
        ("balanced whole", {"strategy": "balanced"}),
        ("balanced buffer=1000", {"strategy": "balanced", "buffer_size": 1000}),
    ]
    for ml in (8192, 16384):
        media_rows: list[tuple[str, dict[str, Any]]] = [
            ("bfd buffer=1000, slack media", {"buffer_size": 1000, "max_images": 64, "max_vision_patches": 4 * ml}),
            ("bfd buffer=1000, max_images=8", {"buffer_size": 1000, "max_images": 8, "max_vision_patches": 4 * ml}),
        ]
        print(f"max_length={ml}: padded batches of 8 -> slot utilisation {padded_fill_at_batch(lengths, 8):.4f}")
        for name, kw in rows + media_rows:
            best = float("inf")
            for _ in range(repeats if kw.get("buffer_size") else 1):
                planner = StreamingPlanner(max_length=ml, **kw)
                media = {"images": images, "patches": patches} if "max_images" in kw else {}
                t0 = time.perf_counter()
                packs = planner.extend(lengths, **media) + planner.flush()
                best = min(best, time.perf_counter() - t0)
            st = pack_stats(packs, lengths, ml)
            print(f"  {name:32s} fill={st['fill']:.5f} packs={st['num_packs']:6d} {n / best / 1e6:.2f}M items/s")


if __name__ == "__main__":  # pragma: no cover
    _benchmark()
