"""Packing benchmark: fill and speed of `plan_packs` vs TRL's `pack_dataset`, collator latency, data path.

Length mixes (modelled, fixed seeds; token counts use Qwen2.5-VL's rule, one token per 28x28 px after
``smart_resize`` with min 56x56 and max 12,845,056 pixels):

- **llava** (LLaVA-665k-like): 6% text-only samples, lognormal tokens median 250, sigma 0.7. The other
  94% have one image (3% of those two), plus text tokens lognormal median 170, sigma 0.8, plus 2 tokens
  (vision start/end) per image. Image sizes by source, long side x (short/long ratio):
  COCO 55% 640 x U(0.56, 1.0); GQA 11% 500 x U(0.56, 1.0); OCR-VQA 12% U(300, 500) x U(0.6, 0.75);
  Visual Genome 13% 800 x U(0.56, 1.0); TextVQA 9% 1024 x U(0.56, 1.0).
  Result: median ~610 tokens, p99 ~1,830, a COCO image ~390 tokens.
- **docs** (high-resolution documents): 1-4 page images (p = 0.4, 0.3, 0.2, 0.1), each of
  U(0.8, 3.1) Mpx, 70% portrait A4 (1 : sqrt 2) and 30% landscape 16:9 slides, i.e. ~1,000-4,000 tokens
  per page; text tokens lognormal median 600, sigma 0.9. Samples longer than ``max_length`` are
  dropped before planning (that count is reported), so every arm sees the same samples in the same order.

Arms, all in one process, interleaved round by round (warm-up round first, then ``--repeats`` measured
rounds; medians reported): `plan_packs` with each strategy streaming (``buffer_size=1000``) and over the
whole dataset; TRL's ``trl.data_utils.pack_dataset(dataset, seq_length, strategy="bfd")`` on a
`datasets.Dataset` whose ``input_ids`` lists have exactly these lengths (int32 zeros), once with TRL's
default ``map`` batch of 1,000 rows (BFD inside each batch, no carry-over) and once with
``map_kwargs={"batch_size": None}`` (whole dataset). TRL moves the token data (Arrow ``take``); `plan_packs`
only plans numbers: items/s compare the two *as users call them*, not the same amount of work.

Planner, TRL and collator arms are single-threaded (``torch.set_num_threads(1)``, ``pyarrow.set_cpu_count(1)``);
the end-to-end data path is pinned to one core (``os.sched_setaffinity``).

Also: streaming BFD variants (``VARIANTS``: without carry-over, with image/patch budgets that do not bind and with a
``max_images`` that does; ``--baseline REV`` adds each on REV's planner); `VisionCollator` latency per 8k-token pack (pre-processed tensors, no
image processing) in ``rows`` and ``flat`` mode; and, when ``hf_packing.packing.dataset.pack_dataset`` exists, the end-to-end
data path (JPEG decode + tiny Qwen2.5-VL processor + planning + collation) in samples/s, in this process and through
a ``torch.utils.data.DataLoader`` at 0 and 2 workers (``--baseline REV``: REV's package beside this one).

Run: ``python benchmarks/bench_packing.py`` (about 5 minutes; ``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "qwen2_5_vl"
TARGET_FILL = 0.995
TARGET_ITEMS_PER_S = 500_000
TARGET_VS_TRL = 20.0
TARGET_COLLATOR_MS = 5.0
TARGET_E2E_PER_CORE = 50.0

# ------------------------------------------------------------------------------------------------ length mixes


def smart_resize_tokens(
    h: np.ndarray, w: np.ndarray, *, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 12_845_056
) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2.5-VL's resize rule, vectorised: merged-token grid ``(h_tokens, w_tokens)`` of each image."""
    h = np.asarray(h, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    hb = np.maximum(factor, np.round(h / factor) * factor)
    wb = np.maximum(factor, np.round(w / factor) * factor)
    big = hb * wb > max_pixels
    beta = np.sqrt(h * w / max_pixels)
    hb = np.where(big, np.maximum(factor, np.floor(h / beta / factor) * factor), hb)
    wb = np.where(big, np.maximum(factor, np.floor(w / beta / factor) * factor), wb)
    small = hb * wb < min_pixels
    beta = np.sqrt(min_pixels / (h * w))
    hb = np.where(small, np.ceil(h * beta / factor) * factor, hb)
    wb = np.where(small, np.ceil(w * beta / factor) * factor, wb)
    return (hb // factor).astype(np.int64), (wb // factor).astype(np.int64)


#: LLaVA-665k image sources: name, weight, long side (lo, hi) px, short/long ratio (lo, hi)
LLAVA_SOURCES = (
    ("coco", 0.55, (640, 640), (0.56, 1.0)),
    ("gqa", 0.11, (500, 500), (0.56, 1.0)),
    ("ocr_vqa", 0.12, (300, 500), (0.6, 0.75)),
    ("vg", 0.13, (800, 800), (0.56, 1.0)),
    ("textvqa", 0.09, (1024, 1024), (0.56, 1.0)),
)


def _llava_image_grids(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    weights = np.array([s[1] for s in LLAVA_SOURCES])
    src = rng.choice(len(LLAVA_SOURCES), size=n, p=weights / weights.sum())
    lo, hi = (np.array([s[2][k] for s in LLAVA_SOURCES])[src] for k in (0, 1))
    rlo, rhi = (np.array([s[3][k] for s in LLAVA_SOURCES])[src] for k in (0, 1))
    long = rng.uniform(lo, hi)
    short = long * rng.uniform(rlo, rhi)
    landscape = rng.random(n) < 0.7
    return smart_resize_tokens(np.where(landscape, short, long), np.where(landscape, long, short))


def llava_mix(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """LLaVA-665k-like samples (see the module docstring): total tokens, image count, text tokens, first image grid."""
    rng = np.random.default_rng(seed)
    text_only = rng.random(n) < 0.06
    two = (~text_only) & (rng.random(n) < 0.03)
    n_img = np.where(text_only, 0, np.where(two, 2, 1))
    text = np.exp(rng.normal(math.log(170), 0.8, n))
    text_only_len = np.exp(rng.normal(math.log(250), 0.7, n))
    h1, w1 = _llava_image_grids(rng, n)
    h2, w2 = _llava_image_grids(rng, n)
    img = h1 * w1 * (n_img >= 1) + h2 * w2 * (n_img >= 2)
    squares = (4 * h1 * w1) ** 2 * (n_img >= 1) + (4 * h2 * w2) ** 2 * (n_img >= 2)  # Σ patches² per image
    text = np.where(text_only, text_only_len, text)
    text = np.maximum(np.round(text).astype(np.int64), 4)
    lengths = text + img + 2 * n_img
    grids = {"grid_h": h1, "grid_w": w1, "grid_h2": h2, "grid_w2": w2}
    return {"lengths": lengths, "images": n_img, "text": text, "vision_sq": squares, **grids}


def docs_mix(n: int, seed: int = 1) -> dict[str, np.ndarray]:
    """High-resolution document samples: 1-4 pages of ~1,000-4,000 tokens each plus text."""
    rng = np.random.default_rng(seed)
    n_img = rng.choice([1, 2, 3, 4], size=n, p=[0.4, 0.3, 0.2, 0.1])
    img = np.zeros(n, dtype=np.int64)
    squares = np.zeros(n, dtype=np.int64)  # Σ patches² per image (vision attention), 4 patches per token
    for k in range(4):
        area = rng.uniform(0.8e6, 3.1e6, n)
        portrait = rng.random(n) < 0.7
        aspect = np.where(portrait, math.sqrt(2), 9 / 16)  # h / w
        w = np.sqrt(area / aspect)
        gh, gw = smart_resize_tokens(w * aspect, w)
        img += gh * gw * (n_img > k)
        squares += (4 * gh * gw) ** 2 * (n_img > k)
    text = np.maximum(np.round(np.exp(rng.normal(math.log(600), 0.9, n))).astype(np.int64), 4)
    return {"lengths": text + img + 2 * n_img, "images": n_img, "text": text, "vision_sq": squares}


def hires_mix(n: int, seed: int = 2) -> dict[str, np.ndarray]:
    """Hi-res photos next to long text-only conversations, the mix where vision work differs most between packs of
    equal length: 50% text-only (lognormal median 1,500 tokens, sigma 0.8), 50% one photo of U(1, 8) Mpx, aspect
    (short/long) U(0.5, 1), 70% landscape (~1,300-10,000 tokens), plus text lognormal median 200, sigma 0.8."""
    rng = np.random.default_rng(seed)
    photo = rng.random(n) < 0.5
    area = rng.uniform(1e6, 8e6, n)
    ratio = rng.uniform(0.5, 1.0, n)
    long = np.sqrt(area / ratio)
    landscape = rng.random(n) < 0.7
    gh, gw = smart_resize_tokens(np.where(landscape, long * ratio, long), np.where(landscape, long, long * ratio))
    img = gh * gw * photo
    prompt = np.exp(rng.normal(math.log(200), 0.8, n))
    chat = np.exp(rng.normal(math.log(1500), 0.8, n))
    text = np.maximum(np.round(np.where(photo, prompt, chat)).astype(np.int64), 4)
    n_img = photo.astype(np.int64)
    return {"lengths": text + img + 2 * n_img, "images": n_img, "text": text, "vision_sq": (4 * img) ** 2}


def small_mix(n: int, seed: int = 3) -> dict[str, np.ndarray]:
    """Small images (icons, charts, thumbnails, UI crops): 1 image (2 for 20% of samples) of U(56, 448) px a side,
    i.e. 4-256 tokens each, plus short text lognormal median 60 tokens, sigma 0.6."""
    rng = np.random.default_rng(seed)
    n_img = np.where(rng.random(n) < 0.2, 2, 1)
    img = np.zeros(n, dtype=np.int64)
    for k in range(2):
        gh, gw = smart_resize_tokens(rng.uniform(56, 448, n), rng.uniform(56, 448, n))
        img += gh * gw * (n_img > k)
    text = np.maximum(np.round(np.exp(rng.normal(math.log(60), 0.6, n))).astype(np.int64), 4)
    return {"lengths": text + img + 2 * n_img, "images": n_img, "text": text}


def max_images_section(n: int, max_lengths: list[int], buffer: int) -> str:
    """Fill and the budget that closed the packs (the planner's `closed_by`) for `max_images` in 16, 32, 64 and
    `None`, with `PackingConfig`'s default `max_vision_patches` (65,536), on the LLaVA-like, document and small-image
    mixes: what `PackingConfig.max_images`' default is chosen from (docs/packer.md)."""
    from hf_packing.config import PackingConfig
    from hf_packing.packing.planner import StreamingPlanner
    from hf_packing.packing.stats import pack_stats

    mixes = {"llava": llava_mix(n), "docs": docs_mix(n // 5), "small images": small_mix(n)}
    patches_budget = PackingConfig.max_vision_patches
    rows = []
    for mix_name, mix in mixes.items():
        for ml in max_lengths:
            keep = mix["lengths"] <= ml
            lengths, images, patches = mix["lengths"][keep], mix["images"][keep], vision_patches(mix)[keep]
            for max_images in (16, 32, 64, None):
                planner = StreamingPlanner(
                    max_length=ml, buffer_size=buffer, max_images=max_images, max_vision_patches=patches_budget
                )
                packs = planner.extend(lengths, images=images, patches=patches) + planner.flush()
                stats = pack_stats(packs, lengths, ml, images=images)
                closed = planner.closed_by
                shares = ", ".join(f"{k} {v / len(packs):.0%}" for k, v in closed.items() if v)
                rows.append(
                    [
                        mix_name,
                        str(ml),
                        str(max_images),
                        f"{stats['fill']:.4f}",
                        str(stats["num_packs"]),
                        f"{stats['mean_images_per_pack']:.1f} / {stats['max_images_per_pack']}",
                        shares,
                    ]
                )
    header = ["mix", "max_length", "max_images", "fill", "packs", "images/pack mean / max", "packs closed by"]
    return C.md_table(header, rows)


def describe(lengths: np.ndarray) -> str:
    q = np.percentile(lengths, [1, 50, 99])
    return f"median {q[1]:.0f}, p1 {q[0]:.0f}, p99 {q[2]:.0f}, mean {lengths.mean():.0f}, max {lengths.max()}"


# ------------------------------------------------------------------------------------------------ planner vs TRL


def min_packs_l2(lengths: np.ndarray, capacity: int) -> int:
    """Martello-Toth L2 lower bound on the number of packs (bins of ``capacity``) any packer needs.

    For each threshold a in {0} ∪ {sizes <= C/2}: items > C - a each need their own pack, items in (C/2, C - a]
    need one each too, and items in [a, C/2] fit only into those packs' leftover room or into new packs.
    """
    a = np.sort(np.asarray(lengths, dtype=np.int64))
    csum = np.concatenate([[0], np.cumsum(a)])
    half = capacity // 2

    def count_sum(lo_excl: np.ndarray, hi_incl: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        i, j = np.searchsorted(a, lo_excl, side="right"), np.searchsorted(a, hi_incl, side="right")
        return j - i, csum[j] - csum[i]

    alphas = np.concatenate([[0], np.unique(a[a <= half])])
    n1, _ = count_sum(capacity - alphas, np.full_like(alphas, capacity))
    n2, s2 = count_sum(np.full_like(alphas, half), capacity - alphas)
    n3, s3 = count_sum(alphas - 1, np.full_like(alphas, half))
    extra = np.maximum(0, -(-(s3 - (n2 * capacity - s2)) // capacity))
    return int(max(-(-int(a.sum()) // capacity), int((n1 + n2 + extra).max())))


def _trl_pack():
    try:
        from trl.data_utils import pack_dataset
    except Exception:  # noqa: BLE001 - trl is optional for this script
        return None
    return pack_dataset


def _trl_dataset(lengths: np.ndarray):
    """A `datasets.Dataset` with one ``input_ids`` column of int32 lists of the given lengths."""
    import pyarrow as pa
    from datasets import Dataset
    from datasets.table import InMemoryTable

    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(lengths)
    list_type = pa.LargeListArray if offsets[-1] >= 2**31 else pa.ListArray
    off = offsets if list_type is pa.LargeListArray else offsets.astype(np.int32)
    values = pa.array(np.zeros(int(offsets[-1]), dtype=np.int32))
    column = list_type.from_arrays(pa.array(off), values)
    return Dataset(InMemoryTable(pa.table({"input_ids": column})))


def _trl_fill(packed, max_length: int) -> tuple[float, int]:
    import pyarrow.compute as pc

    table = packed.with_format("arrow")[:]
    tokens = pc.list_value_length(table["input_ids"]).to_numpy()
    return float(tokens.sum()) / (len(tokens) * max_length), len(tokens)


def planner_section(
    mixes: dict[str, dict[str, np.ndarray]],
    max_lengths: list[int],
    *,
    warmup: int,
    repeats: int,
    buffer: int,
    skip_trl: bool,
) -> tuple[str, dict[str, Any]]:
    from hf_packing.config import STRATEGIES
    from hf_packing.packing.planner import plan_packs
    from hf_packing.packing.stats import pack_stats, padded_fill_at_batch

    trl_pack = None if skip_trl else _trl_pack()
    rows, checks = [], {"fill": [], "speed": [], "trl": {}}
    for mix_name, mix in mixes.items():
        for ml in max_lengths:
            all_lengths = mix["lengths"]
            keep = all_lengths <= ml
            lengths = all_lengths[keep]
            n = len(lengths)
            results: dict[str, Any] = {}

            # Each arm keeps only its fill and pack count (computed outside the timed region) and collects garbage
            # before it starts: otherwise the packs of the other arms inflate the heap and a full GC pass lands in
            # whichever arm happens to trigger it (seen as a 50x slower next_fit on one mix).
            def planner_arm(strategy: str, buf: int | None) -> Callable[[], float]:
                def run() -> float:
                    gc.collect()
                    t0 = time.perf_counter()
                    packs = plan_packs(lengths, max_length=ml, strategy=strategy, buffer_size=buf)
                    dt = time.perf_counter() - t0
                    stats = pack_stats(packs, lengths, ml)
                    results[(strategy, buf)] = (stats["fill"], stats["num_packs"])
                    return dt

                return run

            arms: dict[str, Callable[[], float]] = {}
            for strategy in STRATEGIES:
                for buf in (buffer, None):
                    arms[f"{strategy}|{buf}"] = planner_arm(strategy, buf)
            dataset = None
            if trl_pack is not None:
                dataset = _trl_dataset(lengths)

                def trl_arm(batch_size: int | None) -> Callable[[], float]:
                    kwargs = {} if batch_size == 1000 else {"map_kwargs": {"batch_size": batch_size}}

                    def run() -> float:
                        gc.collect()
                        t0 = time.perf_counter()
                        packed = trl_pack(dataset, ml, strategy="bfd", **kwargs)
                        dt = time.perf_counter() - t0
                        results[("trl", batch_size)] = _trl_fill(packed, ml)
                        return dt

                    return run

                arms["trl|1000"] = trl_arm(1000)
                arms["trl|None"] = trl_arm(None)
            times = C.interleaved(arms, warmup=warmup, repeats=repeats)
            padded = padded_fill_at_batch(lengths, 8)
            rows.append([mix_name, str(ml), "padded batches of 8 (input order)", "-", f"{padded:.4f}", "-", "-", "-"])
            min_packs = min_packs_l2(lengths, ml)
            bound = lengths.sum() / (min_packs * ml)
            rows.append(
                [
                    mix_name,
                    str(ml),
                    "upper bound on fill (Martello-Toth L2 lower bound on packs)",
                    "-",
                    f"{bound:.5f}",
                    str(min_packs),
                    "-",
                    "-",
                ]
            )
            checks.setdefault("bound", {})[(mix_name, ml)] = bound
            for name, ts in times.items():
                kind, buf = name.split("|")
                buf_label = "whole dataset" if buf == "None" else f"buffer {buf}"
                med = C.median(ts)
                if kind == "trl":
                    fill, num_packs = results[("trl", None if buf == "None" else int(buf))]
                    label = "TRL pack_dataset bfd" + (
                        " (map batch 1000, default)" if buf != "None" else " (batch_size=None)"
                    )
                    buf_label = "map batch 1000" if buf != "None" else "whole dataset"
                else:
                    fill, num_packs = results[(kind, None if buf == "None" else int(buf))]
                    label = f"plan_packs {kind}"
                rate = n / med
                if kind == "trl":  # keyed like the planner arm it is compared with
                    checks["trl"][(mix_name, ml, "whole dataset" if buf == "None" else f"buffer {buffer}")] = rate
                rows.append(
                    [
                        mix_name,
                        str(ml),
                        label,
                        buf_label,
                        f"{fill:.5f}",
                        str(num_packs),
                        f"{rate / 1e3:,.0f}k",
                        f"{med * 1e3:,.1f}",
                    ]
                )
                if kind == "bfd" and buf != "None":
                    checks["fill"].append((mix_name, ml, fill))
                if kind != "trl":
                    checks["speed"].append((mix_name, ml, kind, buf_label, rate))
            del dataset, results
            dropped = int((~keep).sum())
            rows.append(
                [
                    mix_name,
                    str(ml),
                    f"(dropped before planning: {dropped} of {len(all_lengths)} samples > {ml})",
                    "",
                    "",
                    "",
                    "",
                    "",
                ]
            )
            print(f"[packing] {mix_name} @ {ml}: done", flush=True)
    table = C.md_table(["mix", "max_length", "arm", "window", "fill", "packs", "items/s", "median ms"], rows)
    return table, checks


def vision_patches(mix: dict[str, np.ndarray]) -> np.ndarray:
    """Σ t·h·w vision patches per sample: 4 per image token (2x2 merge); image tokens = total - text - 2 per image."""
    return 4 * (mix["lengths"] - mix["text"] - 2 * mix["images"])


#: streaming BFD variants: what re-planning, carry-over and image/patch budgets cost or buy; each gets the kept
#: lengths and images and the max_length
VARIANTS: dict[str, Callable[[np.ndarray, np.ndarray, int], dict[str, Any]]] = {
    "default (carry-over)": lambda lengths, images, ml: {},
    "no carry-over (max_open_bins=0)": lambda lengths, images, ml: {"max_open_bins": 0},
    "media budgets set, not binding": lambda lengths, images, ml: {"max_images": 64, "max_vision_patches": 64 * ml},
    # about the mean images per full pack (so it binds), but never below one sample's images (none dropped)
    "max_images binding": lambda lengths, images, ml: {
        "max_images": max(round(images.sum() * ml / lengths.sum()), int(images.max())),
        "max_vision_patches": 64 * ml,
    },
}


def planner_at(rev: str) -> Any:
    """`hf_packing/packing/planner.py` as it was at git revision `rev`, loaded as a module beside today's."""
    import subprocess
    import types

    src = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:hf_packing/packing/planner.py"], check=True, capture_output=True
    ).stdout.decode()
    module = types.ModuleType(f"planner_at_{rev}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(
        compile(src.replace("from ..config import", "from hf_packing.config import"), module.__name__, "exec"),
        module.__dict__,
    )
    return module


def variants_section(
    mixes: dict[str, dict[str, np.ndarray]],
    max_lengths: list[int],
    *,
    warmup: int,
    repeats: int,
    buffer: int,
    baseline: str | None = None,
) -> str:
    """Fill and items/s of streaming BFD variants (`VARIANTS`), interleaved like the main table; with `baseline` (a git
    revision) each variant also runs on that revision's planner, in the same rounds."""
    from hf_packing.packing.planner import StreamingPlanner

    planners = {"": StreamingPlanner}
    if baseline:
        planners[f" [planner at {baseline}]"] = planner_at(baseline).StreamingPlanner
    from hf_packing.packing.stats import pack_stats

    rows = []
    for mix_name, mix in mixes.items():
        for ml in max_lengths:
            keep = mix["lengths"] <= ml
            lengths, images, patches = mix["lengths"][keep], mix["images"][keep], vision_patches(mix)[keep]
            results: dict[str, tuple[float, int]] = {}

            def arm(name: str, kwargs: dict[str, Any], planner_class: Any) -> Callable[[], float]:
                def run() -> float:
                    gc.collect()
                    planner = planner_class(max_length=ml, buffer_size=buffer, **kwargs)
                    media = {"images": images, "patches": patches} if "max_images" in kwargs else {}
                    t0 = time.perf_counter()
                    packs = planner.extend(lengths, **media) + planner.flush()
                    dt = time.perf_counter() - t0
                    stats = pack_stats(packs, lengths, ml)
                    results[name] = (stats["fill"], stats["num_packs"])
                    return dt

                return run

            kwargs = {name + tag: make(lengths, images, ml) for name, make in VARIANTS.items() for tag in planners}
            arms = {
                name + tag: arm(name + tag, kwargs[name + tag], cls)
                for name in VARIANTS
                for tag, cls in planners.items()
            }
            times = C.interleaved(arms, warmup=warmup, repeats=repeats)
            for name, ts in times.items():
                fill, num_packs = results[name]
                med = C.median(ts)
                label = name.replace("max_images", f"max_images={kwargs[name].get('max_images')}")
                rate = len(lengths) / med
                rows.append(
                    [
                        mix_name,
                        str(ml),
                        label,
                        f"{fill:.5f}",
                        str(num_packs),
                        f"{rate / 1e3:,.0f}k",
                        f"{med * 1e3:,.1f}",
                    ]
                )
    return C.md_table(
        ["mix", "max_length", "streaming BFD, buffer " + str(buffer), "fill", "packs", "items/s", "median ms"], rows
    )


def buffer_sweep(
    mixes: dict[str, dict[str, np.ndarray]],
    max_lengths: list[int],
    buffers: tuple[int, ...] = (250, 500, 1000, 2000, 4000),
) -> tuple[str, dict[tuple[str, int], int | None]]:
    """Streaming BFD fill against the window size (one run each; fill is deterministic).

    Returns the table and, per (mix, max_length), the smallest swept buffer reaching `TARGET_FILL` (None: none does).
    """
    from hf_packing.packing.planner import plan_packs
    from hf_packing.packing.stats import pack_stats

    rows, smallest = [], {}
    for mix_name, mix in mixes.items():
        for ml in max_lengths:
            lengths = mix["lengths"][mix["lengths"] <= ml]
            fills = [
                pack_stats(plan_packs(lengths, max_length=ml, strategy="bfd", buffer_size=b), lengths, ml)["fill"]
                for b in (*buffers, None)
            ]
            rows.append([mix_name, str(ml)] + [f"{f:.5f}" for f in fills])
            smallest[(mix_name, ml)] = next((b for b, f in zip(buffers, fills) if f >= TARGET_FILL), None)
    return C.md_table(["mix", "max_length", *(f"buffer {b}" for b in buffers), "whole dataset"], rows), smallest


# ------------------------------------------------------------------------------------------------ collator latency


def _image_sample(
    rng: np.random.Generator,
    text_tokens: int,
    grids: list[tuple[int, int]],
    patch_dim: int,
    ids: dict[str, int],
    vocab: int = 498,
) -> dict[str, Any]:
    """One processed-looking sample: prompt text, image placeholders, answer; fp32 pixels per patch.

    ``grids`` are merged-token grids ``(h, w)`` (2x2 patches each); text ids are drawn from ``[0, vocab)``.
    """
    import torch

    prompt = max(2, text_tokens // 3)
    parts = [torch.tensor([ids["im_start"]]), torch.from_numpy(rng.integers(0, vocab, prompt))]
    for gh, gw in grids:
        parts += [
            torch.tensor([ids["vision_start"]]),
            torch.full((gh * gw,), ids["image_pad"]),
            torch.tensor([ids["vision_end"]]),
        ]
    answer_start = sum(p.numel() for p in parts)
    parts += [torch.from_numpy(rng.integers(0, vocab, max(1, text_tokens - prompt - 2))), torch.tensor([ids["im_end"]])]
    input_ids = torch.cat(parts).long()
    labels = input_ids.clone()
    labels[:answer_start] = -100
    types = (input_ids == ids["image_pad"]).long()
    sample: dict[str, Any] = {"input_ids": input_ids, "labels": labels, "mm_token_type_ids": types}
    if grids:
        sample["image_grid_thw"] = torch.tensor([[1, 2 * gh, 2 * gw] for gh, gw in grids])
        patches = sum(4 * gh * gw for gh, gw in grids)
        sample["pixel_values"] = torch.randn(patches, patch_dim)
    return sample


def collator_packs(patch_dim: int, ids: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
    """Two 8k-token packs: 10 samples with 4 images, and a pack drawn from the LLaVA-like mix (most with an image)."""
    rng = np.random.default_rng(7)
    # (text tokens, image grids in merged tokens): 5,946 text + 2,233 image + 8 markers = 8,187 tokens
    few = [
        (180, [(17, 23)]),
        (1100, []),
        (220, [(13, 18)]),
        (900, []),
        (250, [(27, 37)]),
        (700, []),
        (160, [(21, 29)]),
        (650, []),
        (1086, []),
        (700, []),
    ]
    pack_a = []
    for text, grids in few:
        pack_a.append(_image_sample(rng, text, grids, patch_dim, ids))
    mix = llava_mix(200, seed=3)
    pack_b, total = [], 0
    for i in range(200):
        n = int(mix["lengths"][i])
        if total + n > 8192:
            break
        grids = []
        if mix["images"][i] >= 1:
            grids.append((int(mix["grid_h"][i]), int(mix["grid_w"][i])))
        if mix["images"][i] >= 2:
            grids.append((int(mix["grid_h2"][i]), int(mix["grid_w2"][i])))
        pack_b.append(_image_sample(rng, int(mix["text"][i]), grids, patch_dim, ids))
        total += n
    return {"10 samples, 4 images": pack_a, "LLaVA-like (most samples with an image)": pack_b}


def collator_section(calls: int) -> tuple[list[list[str]], dict[str, float]]:
    """Rows of the collator table and the medians (ms) by ``"pack :: arm"``."""
    import torch
    from transformers import AutoProcessor

    from hf_packing.collator import VisionCollator
    from hf_packing.testing.tiny import TOKEN_IDS, tiny_config

    processor = AutoProcessor.from_pretrained(str(FIXTURE))
    config = tiny_config("qwen2_5_vl")
    ids = {
        "im_start": TOKEN_IDS["<|im_start|>"],
        "im_end": TOKEN_IDS["<|im_end|>"],
        "vision_start": TOKEN_IDS["<|vision_start|>"],
        "vision_end": TOKEN_IDS["<|vision_end|>"],
        "image_pad": TOKEN_IDS["<|image_pad|>"],
    }
    patch_dim = 3 * 2 * 14 * 14
    packs = collator_packs(patch_dim, ids)
    collators = {
        "rows": VisionCollator(processor, mode="rows"),
        "rows + model_config (M-RoPE positions)": VisionCollator(processor, mode="rows", model_config=config),
        "flat (model_config)": VisionCollator(processor, mode="flat", model_config=config),
    }
    rows, checks = [], {}
    for pack_name, pack in packs.items():
        tokens = sum(int(s["input_ids"].numel()) for s in pack)
        images = sum(int(s["image_grid_thw"].shape[0]) for s in pack if "image_grid_thw" in s)
        pixel_mb = sum(s["pixel_values"].numel() * 4 for s in pack if "pixel_values" in s) / 2**20
        text_only = [{k: v for k, v in s.items() if k != "pixel_values"} for s in pack]

        def arm(collator: VisionCollator, features: list) -> Callable[[], float]:
            def run() -> float:
                t0 = time.perf_counter()
                collator([features])
                return time.perf_counter() - t0

            return run

        arms = {}
        for name, collator in collators.items():
            arms[name] = arm(collator, pack)
            arms[name + " | no pixel_values"] = arm(collator, text_only)
        times = C.interleaved(arms, warmup=10, repeats=calls)
        for name, ts in times.items():
            ms = C.median(ts) * 1e3
            p90 = float(np.percentile(ts, 90)) * 1e3
            rows.append(
                [
                    pack_name,
                    f"{len(pack)} / {tokens} / {images} / {pixel_mb:.0f} MB",
                    name.replace(" | ", ", "),
                    f"{ms:.2f}",
                    f"{p90:.2f}",
                ]
            )
            checks[f"{pack_name} :: {name}"] = ms
        # a memcpy of the pixel bytes, for scale: what any collator must do to return one contiguous tensor
        parts = [s["pixel_values"] for s in pack if "pixel_values" in s]
        out = torch.empty(sum(p.shape[0] for p in parts), patch_dim)
        cat_times = C.interleaved(
            {
                "torch.cat(pixel_values) alone (fresh buffer)": lambda: _timed(lambda: torch.cat(parts)),
                "torch.cat(pixel_values, out=reused buffer)": lambda: _timed(lambda: torch.cat(parts, out=out)),
            },
            warmup=10,
            repeats=calls,
        )
        for name, ts in cat_times.items():
            rows.append([pack_name, "", name, f"{C.median(ts) * 1e3:.2f}", f"{np.percentile(ts, 90) * 1e3:.2f}"])
    return rows, checks


COLLATOR_NOTE = """Where the time goes: the collator's own work (ids, labels, masks, positions) is 0.3-3 ms per pack; the
rest is `torch.cat` of the pixel tensors into one fresh 40-100 MB buffer. glibc serves a block that large with a
fresh `mmap` (its dynamic mmap threshold stops at 32 MiB) and returns it with `munmap` when freed, so every call
page-faults the whole buffer in again (the kernel zero-fills each 4 KiB page): ~2.5 GB/s instead of the ~20 GB/s
of the same copy into a reused buffer (`out=` rows). Starting the process with `MALLOC_MMAP_MAX_=0
MALLOC_TRIM_THRESHOLD_=4294967296` keeps freed blocks in the heap, and the collator meets the target. The same
settings speed up the end-to-end data path below (the image processor allocates large float arrays too).
They are read at process start, so they belong in the launcher's environment (DataLoader workers inherit it);
in-process, `mallopt(M_MMAP_MAX, 0)` through `ctypes` does the same. Keeping the heap means RSS stays at its
high-water mark instead of shrinking between batches."""

#: glibc settings that keep freed large blocks in the heap instead of unmapping them (see RESULTS.md)
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(4 * 2**30)}


def collator_tables(calls: int) -> tuple[str, dict[str, float], dict[str, float]]:
    """The collator table: this process (default malloc), then a child process with `MALLOC_ENV`."""
    import json
    import subprocess

    rows, checks = collator_section(calls)
    env = {**os.environ, **MALLOC_ENV}
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        cmd = [sys.executable, __file__, "--collator-json", tmp.name, "--collator-calls", str(calls)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode == 0:
            data = json.loads(Path(tmp.name).read_text())
            tuned_rows, tuned = data["rows"], data["checks"]
        else:
            tuned_rows, tuned = [["(child process failed)", "", proc.stderr[-300:].replace("\n", " "), "", ""]], {}
    env_text = " ".join(f"{k}={v}" for k, v in MALLOC_ENV.items())
    header = ["pack", "samples / tokens / images / pixels", "collator", "median ms", "p90 ms"]
    table = (
        "Default glibc malloc (this process):\n\n"
        + C.md_table(header, rows)
        + f"\n\nSame measurement in a child process started with `{env_text}` (one thread, like this one):\n\n"
        + C.md_table(header, tuned_rows)
    )
    return table, checks, tuned


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------ end-to-end


def e2e_run(num_samples: int) -> dict[str, Any] | str:
    """End-to-end samples/s of ``hf_packing.packing.dataset.pack_dataset`` on real JPEGs, if the module exists.

    The process is pinned to the least busy core first, so the whole data path runs on one core.
    """
    try:
        from hf_packing.packing.dataset import pack_dataset
    except Exception as exc:  # noqa: BLE001
        return (
            f"Skipped: `hf_packing.packing.dataset.pack_dataset` is not importable here ({type(exc).__name__}: {exc})."
        )
    allowed = os.sched_getaffinity(0)
    core = C.idlest_core()
    os.sched_setaffinity(0, {core})
    try:
        return _e2e(pack_dataset, num_samples, [core])
    finally:
        os.sched_setaffinity(0, allowed)


def e2e_section(num_samples: int) -> tuple[str, float | None]:
    """The end-to-end text: this process (default malloc), then a child process with `MALLOC_ENV`."""
    import json
    import subprocess

    here = e2e_run(num_samples)
    if isinstance(here, str):
        return here, None
    table, per_core = _e2e_table(here)
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        cmd = [sys.executable, __file__, "--e2e-json", tmp.name, "--e2e-samples", str(num_samples)]
        proc = subprocess.run(cmd, env={**os.environ, **MALLOC_ENV}, capture_output=True, text=True)
        child = json.loads(Path(tmp.name).read_text()) if proc.returncode == 0 else proc.stderr[-300:]
    env_text = " ".join(f"{k}={v}" for k, v in MALLOC_ENV.items())
    tuned = _e2e_table(child)[0] if isinstance(child, dict) else f"(failed: {child})"
    where = f", pinned to core {child['core']}" if isinstance(child, dict) else ""
    body = (
        f"{num_samples} HF-messages rows (94% with one JPEG of random size 300-1000 px a side, quality 90; text "
        f"15-160 words), `pack_dataset(dataset, processor, max_length=8192, strategy='bfd', buffer_size=1000, "
        f"image_root=tmp)` iterated in the benchmark process, then "
        f"`VisionCollator(mode='rows')` on every pack. Samples counted per pass: {here['count']} (rows the packer "
        f"skipped would not count). The process is pinned to one core (the idlest, core {here['core']}) before "
        f"the packer starts; torch 1 thread. Both processors are "
        f"interleaved pass by pass: one warm-up pass each, then the median of 3 passes.\n\n{table}\n\n"
        f"The same in a child process started with `{env_text}`{where} (see the collator section):\n\n{tuned}"
    )
    return body, min(per_core.values())


def _jpeg_rows(num: int, folder: Path) -> list[dict[str, Any]]:
    """HF-messages rows with one JPEG each (6% text-only), 300-1000 px a side, written to ``folder``."""
    from PIL import Image

    rng = np.random.default_rng(11)
    words = (
        "the a picture shows red car small house green door two windows describe image detail what colour "
        "sky people photo dog bird tree table chair book cup coffee laptop"
    ).split()
    rows = []
    for i in range(num):
        w, h = (int(x) for x in rng.integers(300, 1001, 2))
        # smooth gradients + noise compress (and decode) like photos, unlike pure noise
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([(xx * (i % 7 + 1)) % 256, (yy * 3) % 256, ((xx + yy) * 2) % 256], -1)
        pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        name = f"img_{i:05d}.jpg"
        Image.fromarray(pixels).save(folder / name, quality=90)
        q = " ".join(rng.choice(words, int(rng.integers(5, 40))))
        a = " ".join(rng.choice(words, int(rng.integers(10, 120))))
        text_only = rng.random() < 0.06
        user = [{"type": "text", "text": q}] if text_only else [{"type": "image"}, {"type": "text", "text": q}]
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": [{"type": "text", "text": a}]},
                ],
                "images": [] if text_only else [name],
            }
        )
    return rows


def _e2e(pack_dataset: Callable, num_samples: int, cores: list[int]) -> dict[str, Any] | str:
    """Samples/s per processor arm (interleaved passes), or an error message."""
    import copy

    from datasets import Dataset
    from transformers import AutoProcessor

    from hf_packing.collator import VisionCollator

    tiny = AutoProcessor.from_pretrained(str(FIXTURE))
    real_limits = copy.deepcopy(tiny)  # Qwen2.5-VL's released pixel limits: 56x56 .. 12,845,056 px
    real_limits.image_processor.size = {"shortest_edge": 56 * 56, "longest_edge": 12_845_056}
    processors = {
        "tiny processor (images resized to <= 448x448 px)": tiny,
        "tiny processor with Qwen2.5-VL's real pixel limits (images kept at 300-1000 px)": real_limits,
    }
    with tempfile.TemporaryDirectory() as tmp:
        dataset = Dataset.from_list(_jpeg_rows(num_samples, Path(tmp)))
        kwargs = dict(max_length=8192, strategy="bfd", buffer_size=1000, image_root=tmp, disable_progress=True)

        def arm(processor) -> Callable[[], float]:
            collator = VisionCollator(processor, mode="rows")

            def run() -> float:
                t0 = time.perf_counter()
                count = 0
                for pack in pack_dataset(dataset, processor, **kwargs):
                    collator([pack])
                    count += len(pack)
                dt = time.perf_counter() - t0
                counts.append(count)
                return count / dt

            return run

        counts: list[int] = []
        try:
            rates = C.interleaved({name: arm(p) for name, p in processors.items()}, warmup=1, repeats=3)
        except Exception as exc:  # noqa: BLE001 - an API still in flux must not sink the other results
            return (
                f"Skipped: `pack_dataset(dataset, processor, {', '.join(kwargs)})` failed with "
                f"{type(exc).__name__}: {exc}. Its signature here: `{inspect.signature(pack_dataset)}`."
            )
    return {"rates": {name: C.median(values) for name, values in rates.items()}, "count": counts[-1], "core": cores[0]}


def _e2e_table(result: dict[str, Any]) -> tuple[str, dict[str, float]]:
    rows, per_core = [], {}
    for name, rate in result["rates"].items():
        per_core[name] = rate  # one core
        ok = "PASS" if rate >= TARGET_E2E_PER_CORE else "FAIL"
        rows.append([name, f"{rate:.0f}", ok])
    header = ["processor", "samples/s on one core", f"target >= {TARGET_E2E_PER_CORE:.0f}/core"]
    return C.md_table(header, rows), per_core


class _Collate:
    """A DataLoader `collate_fn` for `batch_size=None`: one pack at a time into the collator."""

    def __init__(self, processor: Any) -> None:
        from hf_packing.collator import VisionCollator

        self.collator = VisionCollator(processor, mode="rows")

    def __call__(self, pack: list[dict[str, Any]]) -> dict[str, Any]:
        return self.collator([pack])


def loader_pass(num_samples: int, num_workers: int) -> dict[str, Any]:
    """One pass of `pack_dataset` through `torch.utils.data.DataLoader(num_workers=...)` over the rows saved by
    `loader_section` (``HF_PACKING_BENCH_ROWS``): samples and seconds, measured from `iter()` to the last batch."""
    import torch
    from datasets import load_from_disk
    from transformers import AutoProcessor

    import hf_packing
    from hf_packing.packing.dataset import pack_dataset

    folder = Path(os.environ["HF_PACKING_BENCH_ROWS"])
    processor = AutoProcessor.from_pretrained(str(FIXTURE))
    packs = pack_dataset(
        load_from_disk(str(folder / "rows")),
        processor,
        max_length=8192,
        buffer_size=1000,
        media_root=str(folder),
        disable_progress=True,
    )
    loader = torch.utils.data.DataLoader(
        packs, batch_size=None, num_workers=num_workers, collate_fn=_Collate(processor)
    )
    t0, count = time.perf_counter(), 0
    for batch in loader:
        count += int(batch["input_ids"].shape[0])
    return {"samples": count, "seconds": time.perf_counter() - t0, "package": hf_packing.__file__}


def loader_section(num_samples: int, baseline: str | None, repeats: int = 3) -> str:
    """Samples/s through a DataLoader at 0 and 2 workers, for this tree and, with `baseline`, a `git archive` of that
    revision, each pass a child process (interleaved round by round: one warm-up round, then `repeats`)."""
    import json
    import subprocess

    trees = {"this tree": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if baseline:
            old = folder / "baseline"
            old.mkdir()
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", baseline], check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
            trees[f"at {baseline}"] = old
        from datasets import Dataset

        Dataset.from_list(_jpeg_rows(num_samples, folder)).save_to_disk(str(folder / "rows"))

        def arm(tree: Path, workers: int) -> Callable[[], float]:
            def run() -> float:
                out = folder / "pass.json"
                cmd = [sys.executable, __file__, "--loader-json", str(out), "--loader-workers", str(workers)]
                env = {**os.environ, "PYTHONPATH": str(tree), "HF_PACKING_BENCH_ROWS": str(folder)}
                proc = subprocess.run(
                    cmd + ["--e2e-samples", str(num_samples)], env=env, capture_output=True, text=True
                )
                if proc.returncode:
                    raise RuntimeError(proc.stderr[-2000:])
                result = json.loads(out.read_text())
                assert Path(result["package"]).is_relative_to(tree), result["package"]
                counts[(str(tree), workers)] = result["samples"]
                return result["samples"] / result["seconds"]

            return run

        counts: dict[tuple[str, int], int] = {}
        arms = {(name, w): arm(tree, w) for w in (0, 2) for name, tree in trees.items()}
        rates = C.interleaved(arms, warmup=1, repeats=repeats)
    rows = [
        [name, str(w), str(counts[(str(trees[name]), w)]), f"{C.median(r):.1f}", " ".join(f"{x:.1f}" for x in r)]
        for (name, w), r in rates.items()
    ]
    table = C.md_table(["package", "num_workers", "samples", "samples/s (median)", "passes"], rows)
    return (
        f"The rows of the end-to-end data path ({num_samples}, saved with `save_to_disk`), `pack_dataset(rows, "
        f"processor, max_length=8192, buffer_size=1000)` (length index on: built in the warm-up pass) through "
        f"`torch.utils.data.DataLoader(packs, batch_size=None, num_workers=...)` with `VisionCollator(mode='rows')` "
        f"as its `collate_fn`; tiny processor; samples/s from `iter()` to the last batch (worker start included). "
        f"Each pass is a child process with the package on `PYTHONPATH` (the baseline from `git archive`), not "
        f"pinned, torch threads at their default; arms interleaved round by round, one warm-up round, then {repeats}.\n\n"
        f"{table}"
    )


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n-llava", type=int, default=100_000, help="samples in the LLaVA-like mix")
    parser.add_argument("--n-docs", type=int, default=20_000, help="samples in the document mix")
    parser.add_argument("--max-lengths", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--buffer-size", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--collator-calls", type=int, default=200, help="measured collator calls per arm")
    parser.add_argument("--e2e-samples", type=int, default=300)
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-collator", action="store_true")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--collator-json", help=argparse.SUPPRESS)  # internal: child process of the collator table
    parser.add_argument("--e2e-json", help=argparse.SUPPRESS)  # internal: child process of the end-to-end table
    parser.add_argument("--quick", action="store_true", help="small sizes, 1 repeat; does not write RESULTS.md")
    parser.add_argument(
        "--max-images", action="store_true", help="only the max_images table (its own RESULTS.md section, ~1 min)"
    )
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing RESULTS.md")
    parser.add_argument(
        "--baseline",
        help="a git revision: its planner runs beside today's in the variants table, and its data path beside "
        "today's in the DataLoader table (the 'before' of a change, measured in the same run)",
    )
    parser.add_argument("--loader-only", action="store_true", help="only the DataLoader table, printed")
    parser.add_argument("--loader-json", help=argparse.SUPPRESS)  # internal: child process of the DataLoader table
    parser.add_argument("--loader-workers", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.n_llava, args.n_docs, args.repeats, args.collator_calls, args.e2e_samples = 5000, 2000, 1, 20, 30
        args.no_write = True

    import pyarrow as pa
    import torch

    torch.set_num_threads(1)
    if args.collator_json:
        import json

        rows, checks = collator_section(args.collator_calls)
        Path(args.collator_json).write_text(json.dumps({"rows": rows, "checks": checks}))
        return
    if args.loader_json:
        import json

        Path(args.loader_json).write_text(json.dumps(loader_pass(args.e2e_samples, args.loader_workers)))
        return
    if args.loader_only:
        print(f"- Date: {C.today()}; load average before: {C.load_average()}; command: `{C.command_line()}`\n")
        print(loader_section(args.e2e_samples, args.baseline, args.repeats))
        print(f"\nLoad average after: {C.load_average()}")
        return
    if args.e2e_json:
        import json

        Path(args.e2e_json).write_text(json.dumps(e2e_run(args.e2e_samples)))
        return
    if args.max_images:
        t_start = time.time()
        table = max_images_section(args.n_llava, args.max_lengths, args.buffer_size)
        body = f"""## Packing: the max_images default (`bench_packing.py --max-images`)

- Date: {C.today()}; took {time.time() - t_start:.0f} s
- Versions: {C.versions()}
- Command: `{C.command_line()}`
- Streaming BFD (buffer {args.buffer_size}), `max_vision_patches` at PackingConfig's default (65,536), on the
  LLaVA-like mix ({args.n_llava:,} samples), the document mix ({args.n_llava // 5:,}) and the small-image mix
  ({args.n_llava:,}: 1-2 images of 56-448 px a side, 4-256 tokens each, text median 60 tokens); samples over
  max_length left out. "packs closed by": the budget each pack reached (the planner's `closed_by`), `end`: the
  input ended with room left.

{table}
"""
        print(body) if args.no_write else print(f"wrote {C.write_section('Packing: the max_images default', body)}")
        return
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    try:
        import datasets

        datasets.disable_progress_bars()
    except Exception:  # noqa: BLE001
        pass
    load_before = C.load_average()
    t_start = time.time()

    mixes = {"llava": llava_mix(args.n_llava), "docs": docs_mix(args.n_docs)}
    planner_table, checks = planner_section(
        mixes,
        args.max_lengths,
        warmup=args.warmup,
        repeats=args.repeats,
        buffer=args.buffer_size,
        skip_trl=args.skip_trl,
    )
    sweep_table, smallest_buffer = buffer_sweep(mixes, args.max_lengths)
    variants_table = variants_section(
        mixes,
        args.max_lengths,
        warmup=args.warmup,
        repeats=args.repeats,
        buffer=args.buffer_size,
        baseline=args.baseline,
    )
    loader_body = "(skipped)" if args.skip_e2e else loader_section(args.e2e_samples, args.baseline, args.repeats)
    collator_table, collator_ms, collator_tuned = (
        ("(skipped)", {}, {}) if args.skip_collator else collator_tables(args.collator_calls)
    )
    e2e_body, _ = ("(skipped)", None) if args.skip_e2e else e2e_section(args.e2e_samples)

    fill_ok = all(f >= TARGET_FILL for *_, f in checks["fill"])
    fill_text = ", ".join(f"{m}@{ml}: {f:.5f}" for m, ml, f in checks["fill"])
    bounds = checks.get("bound", {})
    misses = [(m, ml, f) for m, ml, f in checks["fill"] if f < TARGET_FILL]
    unreachable = "".join(
        f" {m}@{ml} misses it, but no packer can reach it there: the L2 bound caps fill at {bounds[(m, ml)]:.4f}, and "
        f"streaming BFD gets {f / bounds[(m, ml)]:.1%} of that bound."
        if bounds.get((m, ml), 1) < TARGET_FILL
        else f" {m}@{ml} misses it with the bound at {bounds.get((m, ml), float('nan')):.4f}"
        + (
            f"; a window of {smallest_buffer[(m, ml)]} samples reaches it (sweep below)."
            if smallest_buffer.get((m, ml))
            else "; no swept window reaches it (sweep below)."
        )
        for m, ml, f in misses
    )
    stream_bfd = [(m, ml, r) for m, ml, k, b, r in checks["speed"] if k == "bfd" and b != "whole dataset"]
    speed_ok = all(r >= TARGET_ITEMS_PER_S for *_, r in stream_bfd)
    speed_text = ", ".join(f"{m}@{ml}: {r / 1e3:,.0f}k" for m, ml, r in stream_bfd)
    slow = sorted({f"{k} ({b})" for m, ml, k, b, r in checks["speed"] if r < TARGET_ITEMS_PER_S})
    vs_trl = [
        (m, ml, b, r / checks["trl"][(m, ml, b)])
        for m, ml, k, b, r in checks["speed"]
        if k == "bfd" and (m, ml, b) in checks["trl"]
    ]
    trl_ok = all(x >= TARGET_VS_TRL for *_, x in vs_trl) if vs_trl else None
    trl_text = ", ".join(
        f"{m}@{ml} {'whole' if b == 'whole dataset' else 'streaming'}: {x:.0f}x" for m, ml, b, x in vs_trl
    )
    headline = [k for k in collator_ms if k.startswith("10 samples") and "no pixel" not in k and "positions" not in k]
    coll_ok = all(collator_ms[k] <= TARGET_COLLATOR_MS for k in headline) if headline else None
    tuned_ok = (
        all(collator_tuned[k] <= TARGET_COLLATOR_MS for k in headline)
        if headline and all(k in collator_tuned for k in headline)
        else None
    )

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("PASS" if ok else "FAIL")

    llava, docs = mixes["llava"]["lengths"], mixes["docs"]["lengths"]
    body = f"""## Packing: fill, planner speed, TRL, collator, data path (`bench_packing.py`)

{C.footer(t_start, C.machine("single-threaded: planner, TRL and collator run on one thread (`torch.set_num_threads(1)`, `pyarrow.set_cpu_count(1)`), not pinned, so the scheduler may move them off a core another process is using; the end-to-end part is pinned to one core"), load_before=load_before, extra=["pyarrow"])}
- Method: every arm in one process, interleaved round by round on the same lengths in the same order; {args.warmup} warm-up round(s), median of {args.repeats} measured rounds. Samples longer than `max_length` are removed first (counted below) so planner and TRL see identical inputs (TRL would truncate them, cutting images).

Mixes (modelled, fixed seeds; full model in the script docstring; tokens per image = Qwen2.5-VL rule, one per 28x28 px):
- **llava**: {args.n_llava:,} samples, LLaVA-665k-like: 6% text-only, 94% one image (3% of those two) from COCO / GQA / OCR-VQA / VG / TextVQA-like size distributions, text lognormal median 170 tokens. Lengths: {describe(llava)}.
- **docs**: {args.n_docs:,} high-resolution document samples: 1-4 pages of ~1,000-4,000 tokens each + text lognormal median 600. Lengths: {describe(docs)}.

### Fill and planner speed (plan_packs vs TRL)

fill = Σ packed tokens / (packs × max_length). items/s = samples / median wall time of one call, one core.
Padded batches of 8: Σ tokens / Σ (8 × longest in batch), input order.

{planner_table}

Targets:
- streaming BFD (buffer {args.buffer_size}) fill >= {TARGET_FILL}: **{verdict(fill_ok)}** ({fill_text}).{unreachable}
- planner >= {TARGET_ITEMS_PER_S / 1e3:,.0f}k items/s on one core, streaming BFD: **{verdict(speed_ok)}** ({speed_text}). Arms below the target: {", ".join(slow) if slow else "none"}.
- BFD >= {TARGET_VS_TRL:.0f}x TRL's BFD items/s in the same run (buffer {args.buffer_size} vs TRL's default map batch of 1000; whole dataset vs `batch_size=None`): **{verdict(trl_ok)}** ({trl_text or "TRL not run"}).

Streaming BFD fill against the window size (`buffer_size`):

{sweep_table}

Streaming BFD variants (same interleaving; the media rows plan with per-sample image counts and vision patches, 4 per image token; the binding `max_images` is about the mean images per full pack, at least the most of one sample, so none is dropped):

{variants_table}

### VisionCollator latency per 8k-token pack (CPU, no image processing)

Samples are built once as processed tensors (Qwen2.5-VL layout: fp32 `pixel_values` of 4 × tokens patches × 1176 per image); each call collates one pack (`collator([pack])`). Median and p90 of {args.collator_calls} interleaved calls after 10 warm-up calls, 1 thread. `rows` without `model_config` leaves M-RoPE positions to the model; `flat` needs them and computes them per sample with the model's own `get_rope_index` (qwen2_5_vl `tiny_config`; its cost does not depend on the model size). "no pixel_values" is the same pack with the pixel tensors removed, i.e. the cost of everything but concatenating pixels.

{collator_table}

Target <= {TARGET_COLLATOR_MS:.0f} ms per 8k pack (10 samples, 4 images; rows and flat), default malloc: **{verdict(coll_ok)}** ({", ".join(f"{k.split(' :: ')[1]}: {collator_ms[k]:.2f} ms" for k in headline)}); with the malloc settings: **{verdict(tuned_ok)}** ({", ".join(f"{k.split(' :: ')[1]}: {collator_tuned[k]:.2f} ms" for k in headline if k in collator_tuned)}).

{COLLATOR_NOTE}

### End-to-end data path

{e2e_body}

### Through a DataLoader

{loader_body}
"""
    if args.no_write:
        print(body)
    else:
        path = C.write_section("bench_packing", body)
        print(body)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
