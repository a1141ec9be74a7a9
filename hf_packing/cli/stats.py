"""``hf-packing stats``: how a dataset would pack, per strategy, from metadata only (no pixel decoding).

The settings are a [`~hf_packing.config.PackingConfig`] (its fields are the command's flags), read as
`pack_dataset` reads them: lengths come from the same `Preprocessor.estimate` (chat template + image and video
headers + the processor's sampling and resize rules; `on_overlong` applies), so a pass costs ~0.1 ms per sample (~1 ms
per video file); the planner then packs the numbers with the configured strategy, then with each other one for
comparison. Videos and their `<|video_pad|>` tokens are reported on their own line.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections import Counter

from ..config import PackingConfig
from ..data import Preprocessor, SampleError, SkipCounter
from ..formats import FEATURES, source_formats
from ..pack_stats import pack_stats
from ..planner import STRATEGIES, plan_packs
from ..replica import preprocessors

logger = logging.getLogger("hf_packing")


def collect_metadata(dataset, preprocessor: Preprocessor, *, show_progress: bool = True):
    """Per-sample (tokens, images, vision patches) for every usable row, a `Counter` of skip reasons, and the usable
    rows' `{"videos", "video_tokens", "features"}` (features: rows carrying each of `formats.FEATURES`)."""
    from tqdm.auto import tqdm

    lengths, images, patches, videos = [], [], [], Counter()
    skipped = SkipCounter()
    total = len(dataset) if hasattr(dataset, "__len__") else None
    for index, row in enumerate(tqdm(dataset, total=total, desc="metadata", unit="rows", disable=not show_progress)):
        try:
            meta = preprocessor.estimate(row, index)
        except SampleError as err:
            skipped.record(err.reason, index, str(err))
            continue
        lengths.append(meta.num_tokens)
        images.append(meta.num_images)
        patches.append(meta.vision_patches)
        videos.update(videos=meta.num_videos, video_tokens=meta.video_tokens, **dict.fromkeys(meta.features, 1))
    features = {f: videos[f] for f in FEATURES}
    return (
        lengths,
        images,
        patches,
        skipped,
        {"videos": videos["videos"], "video_tokens": videos["video_tokens"], "features": features},
    )


def run_stats(args: argparse.Namespace, config: PackingConfig | None = None) -> dict[str, dict]:
    """Print a table per strategy (`config`'s first) for `args.data` with the processor at `args.processor`, write
    the fill/length histogram to `args.output`; returns the per-strategy stats."""
    from transformers import AutoProcessor

    from .._compat import require_extra

    require_extra("cli", "matplotlib", purpose="hf-packing stats (it draws the fill/length histogram)")

    from .demo import load_any_dataset
    from .plots import plot_stats

    cfg = config or PackingConfig()
    processor = AutoProcessor.from_pretrained(args.processor)
    dataset = load_any_dataset(args.data)
    cfg = dataclasses.replace(cfg, row_format=source_formats(dataset, cfg.row_format)[None])
    preprocessor = preprocessors(cfg, processor, [])[None]  # the one pack_dataset would use
    show = sys.stderr.isatty() and not cfg.disable_progress
    lengths, images, patches, skipped, videos = collect_metadata(dataset, preprocessor, show_progress=show)
    if not lengths:
        raise SystemExit(f"no usable samples in {args.data}; skipped: {dict(skipped)}")
    results, fills = {}, {}
    for strategy in [cfg.strategy, *(s for s in STRATEGIES if s != cfg.strategy)]:
        packs = plan_packs(
            lengths,
            max_length=cfg.max_length,
            strategy=strategy,
            images=images,
            max_images=cfg.max_images,
            vision_patches=patches,
            max_vision_patches=cfg.max_vision_patches,
            buffer_size=cfg.buffer_size,
        )
        stats = pack_stats(packs, lengths, cfg.max_length, images=images)
        placed = {i for pack in packs for i in pack}
        dropped = Counter(
            _drop_reason(i, lengths, images, patches, cfg) for i in range(len(lengths)) if i not in placed
        )
        results[strategy] = {**stats, "dropped": dict(dropped), "skipped": dict(skipped), **videos}
        fills[strategy] = [sum(lengths[i] for i in p) / cfg.max_length for p in packs]
    print(format_table(results, len(lengths) + sum(skipped.values()), cfg))
    print("rows carrying " + ", ".join(f"{k.replace('_', ' ')}: {n}" for k, n in videos["features"].items()))
    share = videos["video_tokens"] / sum(lengths)
    print(f"videos: {videos['videos']} in usable rows, {videos['video_tokens']:,} video tokens ({share:.1%} of tokens)")
    plot_stats(fills, lengths, args.output, cfg.max_length)
    print(f"histogram: {args.output}")
    return results


def _drop_reason(i: int, lengths, images, patches, cfg: PackingConfig) -> str:
    if lengths[i] > cfg.max_length:
        return "longer_than_max_length"
    if cfg.max_images is not None and images[i] > cfg.max_images:
        return "more_images_than_max_images"
    return "more_patches_than_max_vision_patches"


def format_table(results: dict[str, dict], rows: int, cfg: PackingConfig) -> str:
    header = f"{'strategy':<10} {'fill':>7} {'packs':>7} {'img/pack':>9} {'padded-8 fill':>14}  dropped / skipped"
    lines = [f"{rows} rows, max_length={cfg.max_length}, buffer_size={cfg.buffer_size}", header, "-" * len(header)]
    for name, r in results.items():
        reasons = ", ".join(f"{k}: {v}" for k, v in {**r["dropped"], **r["skipped"]}.items()) or "none"
        lines.append(
            f"{name:<10} {r['fill']:>7.4f} {r['num_packs']:>7} {r.get('mean_images_per_pack') or 0:>9.2f} "
            f"{r['padded_batch_fill']:>14.3f}  {reasons}"
        )
    return "\n".join(lines)
