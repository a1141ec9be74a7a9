"""``hf-packing stats``: how a dataset would pack, per strategy, from metadata only (no pixel decoding).

The settings are a [`~hf_packing.config.PackingConfig`] (its fields are the command's flags), read as
`pack_dataset` reads them: lengths come from the same `Preprocessor.estimate` (chat template + image and video
headers + the processor's sampling and resize rules; `on_overlong` applies), so a pass decodes no pixel and costs
what a planning pass costs (docs/packer.md, 'What a row costs'); the planner then packs the numbers with the
configured strategy, then with each other one for comparison, and says which budget closed the packs (`tokens`,
`images`, `patches`: a pack at 0.45 fill closed by `images` wants a larger `max_images`). Several paths are read like
`recipes/train.py`'s `dataset_path` (files, globs, directories, saved datasets; each its own source, every row
counted); skip reasons are `pack_dataset`'s names. Videos and their `<|video_pad|>` tokens are reported on their own
line.

With a model config (``--model``, or the processor's directory when it holds one) it prints the predicted peak
memory per GPU for the largest pack the budgets allow (`predict_peak`) and, given ``--gpu_memory_gib``, whether
gradient checkpointing is needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from ..config import STRATEGIES, PackingConfig
from ..packing.planner import StreamingPlanner
from ..packing.replica import preprocessors
from ..packing.stats import pack_stats
from ..preprocess.errors import SampleError, SkipCounter
from ..preprocess.formats import FEATURES, source_formats
from ..preprocess.preprocessor import Preprocessor

logger = logging.getLogger(__name__)


def collect_metadata(dataset, preprocessor: Preprocessor, *, show_progress: bool = True):
    """Per-sample (tokens, images, vision patches) for every usable row, a `Counter` of skip reasons, and the usable
    rows' `{"videos", "video_tokens"}` and, for each of `formats.FEATURES` (reasoning, tool calls, ...), the rows
    carrying it (flat counts, so several sources' add up)."""
    from tqdm.auto import tqdm

    lengths: list[int] = []
    images: list[int] = []
    patches: list[int] = []
    videos: Counter[str] = Counter()
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
    return (
        lengths,
        images,
        patches,
        skipped,
        {"videos": videos["videos"], "video_tokens": videos["video_tokens"], **{f: videos[f] for f in FEATURES}},
    )


def load_sources(paths: list[str]) -> dict[str | None, Any]:
    """`{None: dataset}` for one path, else `{"<i>:<stem>": dataset}` (the names `recipes/train.py` gives a mix), each
    a file, glob, directory of files or saved datasets dir. A missing path ends the command with one line."""
    from ..packing.readers import load_local

    try:
        loaded = [load_local(path) for path in paths]
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"hf-packing stats: error: {err}") from None
    if len(loaded) == 1:
        return {None: loaded[0]}
    return {f"{i}:{Path(path.rstrip('/*')).stem or i}": ds for i, (path, ds) in enumerate(zip(paths, loaded))}


def run_stats(args: argparse.Namespace, config: PackingConfig | None = None) -> dict[str, dict]:
    """Print a table per strategy (`config`'s first) for `args.data` (one path or several: every row of each, each
    with its own format and per-source settings) with the processor at `args.processor`, write the fill/length
    histogram to `args.output`; returns the per-strategy stats."""
    from transformers import AutoProcessor

    from .._compat import require_extra

    require_extra("cli", "matplotlib", purpose="hf-packing stats (it draws the fill/length histogram)")

    from .plots import plot_stats

    cfg = config or PackingConfig()
    paths = [args.data] if isinstance(args.data, str) else list(args.data)
    sources = load_sources(paths)
    names = [n for n in sources if n is not None]
    formats = source_formats(sources if names else sources[None], cfg.row_format)
    cfg = dataclasses.replace(cfg, row_format=formats if names else formats[None])
    processor = AutoProcessor.from_pretrained(args.processor)
    pres = preprocessors(cfg, processor, names)  # the ones pack_dataset would use
    show = sys.stderr.isatty() and not cfg.disable_progress
    lengths: list[int] = []
    images: list[int] = []
    patches: list[int] = []
    skipped, videos = SkipCounter(), Counter[str]()
    for name, dataset in sources.items():
        meta = collect_metadata(dataset, pres[name], show_progress=show)
        for total, part in zip((lengths, images, patches), meta[:3]):
            total += part
        skipped.update(meta[3])
        videos.update(meta[4])
    if not lengths:
        raise SystemExit(f"no usable samples in {' '.join(paths)}; skipped: {dict(skipped)}")
    results, fills = {}, {}
    for strategy in [cfg.strategy, *(s for s in STRATEGIES if s != cfg.strategy)]:
        planner = StreamingPlanner(
            max_length=cfg.max_length,
            strategy=strategy,
            max_images=cfg.max_images,
            max_vision_patches=cfg.max_vision_patches,
            buffer_size=cfg.buffer_size,
        )
        packs = planner.extend(lengths, images=images, patches=patches) + planner.flush()
        stats = pack_stats(packs, lengths, cfg.max_length, images=images)
        placed = {i for pack in packs for i in pack}
        dropped = Counter(
            _drop_reason(i, lengths, images, patches, cfg) for i in range(len(lengths)) if i not in placed
        )
        closed = {reason: n for reason, n in planner.closed_by.items() if n}
        results[strategy] = {**stats, "dropped": dict(dropped), "skipped": dict(skipped), "closed_by": closed}
        results[strategy].update(videos=videos["videos"], video_tokens=videos["video_tokens"])
        results[strategy]["rows_with"] = {f: videos[f] for f in FEATURES}
        fills[strategy] = [sum(lengths[i] for i in p) / cfg.max_length for p in packs]
    print(format_table(results, len(lengths) + sum(skipped.values()), cfg))
    print("rows carrying " + ", ".join(f"{f.replace('_', ' ')}: {videos[f]}" for f in FEATURES))
    share = videos["video_tokens"] / sum(lengths)
    print(f"videos: {videos['videos']} in usable rows, {videos['video_tokens']:,} video tokens ({share:.1%} of tokens)")
    plot_stats(fills, lengths, args.output, cfg.max_length)
    print(f"histogram: {args.output}")
    model_dir = getattr(args, "model", None) or args.processor
    if (Path(model_dir) / "config.json").is_file():
        from ..ops.memory import MODELLED

        model_cfg = model_config(model_dir)
        gib = getattr(args, "gpu_memory_gib", None)
        if model_cfg.model_type in MODELLED:
            print(format_peak(predict_peak(model_cfg, cfg), gib))
        else:
            print(
                f"memory per GPU: not modelled for model_type {model_cfg.model_type!r} "
                f"(modelled: {', '.join(MODELLED)})"
            )
    return results


def model_config(path: str) -> Any:
    """The transformers config saved at ``path``."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def predict_peak(
    config: Any, cfg: PackingConfig, *, vision_trainable: bool = True, optimizer_bytes_per_param: float | None = None
) -> dict[str, Any]:
    """Predicted bytes per GPU of one training step on the largest pack ``cfg``'s budgets allow (``max_length``
    tokens, all supervised; ``max_vision_patches`` patches, at most ``max_length`` merged tokens' worth), bf16
    weights, gradients and AdamW moments (or ``optimizer_bytes_per_param``; `hf_packing.ops.memory`), all weights
    trained on one GPU (``vision_trainable=False``: the tower frozen), the model built on the meta device.
    Returns the counts and ``{"weights", "grads", "optimizer", "activations", "activations_ckpt"}`` in bytes."""
    import copy

    import torch
    from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    from ..ops.memory import ActivationMemory, training_state_bytes

    config = copy.deepcopy(config)
    config._attn_implementation = "eager"  # the shapes only
    model_class: Any = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]
    with torch.device("meta"):
        model = model_class(config).to(torch.bfloat16)
    if not vision_trainable:
        model.model.visual.requires_grad_(False)
    memory = ActivationMemory.from_model(model)
    tokens = cfg.max_length
    patches = tokens * memory.merge**2
    if cfg.max_vision_patches is not None:
        patches = min(patches, cfg.max_vision_patches)
    state = training_state_bytes(model, optimizer_bytes_per_param=optimizer_bytes_per_param)
    return {
        "tokens": tokens,
        "patches": patches,
        **state,
        "activations": memory.saved_bytes(tokens=tokens, patches=patches),
        "activations_ckpt": memory.saved_bytes(tokens=tokens, patches=patches, checkpointing=True),
    }


def checkpointing_needed(peak: dict[str, Any], gpu_memory_gib: float) -> bool | None:
    """Whether the `predict_peak` step needs gradient checkpointing on a GPU of ``gpu_memory_gib``: ``False`` (fits
    without), ``True`` (fits only with it) or ``None`` (fits in neither)."""
    state = peak["weights"] + peak["grads"] + peak["optimizer"]
    budget = gpu_memory_gib * 2.0**30
    if state + peak["activations"] <= budget:
        return False
    return True if state + peak["activations_ckpt"] <= budget else None


def format_peak(peak: dict[str, Any], gpu_memory_gib: float | None) -> str:
    """Lines of `predict_peak`: the state, the peak with checkpointing off and on, and the verdict for a GPU."""
    gib = 2.0**30
    state = peak["weights"] + peak["grads"] + peak["optimizer"]
    off, on = state + peak["activations"], state + peak["activations_ckpt"]
    lines = [
        f"predicted peak per GPU, largest pack ({peak['tokens']:,} tokens, {peak['patches']:,} vision patches; bf16, "
        f"AdamW): weights {peak['weights'] / gib:.2f} + grads {peak['grads'] / gib:.2f} + optimizer "
        f"{peak['optimizer'] / gib:.2f} GiB; activations {peak['activations'] / gib:.2f} GiB without checkpointing "
        f"(peak {off / gib:.2f} GiB), {peak['activations_ckpt'] / gib:.2f} GiB with it (peak {on / gib:.2f} GiB)"
    ]
    if gpu_memory_gib is not None:
        verdict = {
            False: "not needed: turn gradient checkpointing off",
            True: "needed: turn gradient checkpointing on",
            None: "does not fit even with it: lower max_length / max_vision_patches or shard (FSDP2, ZeRO, SP)",
        }[checkpointing_needed(peak, gpu_memory_gib)]
        lines.append(f"gradient checkpointing on a {gpu_memory_gib:g} GiB GPU: {verdict}")
    return "\n".join(lines)


def _drop_reason(i: int, lengths, images, patches, cfg: PackingConfig) -> str:
    """The skip reason (a name of `REASONS`, as `pack_dataset` counts it) of a sample over a budget on its own."""
    if lengths[i] > cfg.max_length:
        return "overlong"
    if cfg.max_images is not None and images[i] > cfg.max_images:
        return "too_many_images"
    return "too_many_vision_patches"


def format_table(results: dict[str, dict], rows: int, cfg: PackingConfig) -> str:
    header = (
        f"{'strategy':<10} {'fill':>7} {'packs':>7} {'img/pack':>9} {'padded-8 fill':>14}  packs closed by  /  skipped"
    )
    budgets = f"max_images={cfg.max_images}, max_vision_patches={cfg.max_vision_patches}"
    lines = [f"{rows} rows, max_length={cfg.max_length}, {budgets}, buffer_size={cfg.buffer_size}", header]
    lines.append("-" * len(header))
    for name, r in results.items():
        reasons = ", ".join(f"{k}: {v}" for k, v in (Counter(r["dropped"]) + Counter(r["skipped"])).items()) or "none"
        closed = ", ".join(f"{k}: {v}" for k, v in r["closed_by"].items()) or "none"
        lines.append(
            f"{name:<10} {r['fill']:>7.4f} {r['num_packs']:>7} {r.get('mean_images_per_pack') or 0:>9.2f} "
            f"{r['padded_batch_fill']:>14.3f}  {closed}  /  {reasons}"
        )
    lines.append(
        "packs closed by: the budget a pack reached (tokens: max_length, images: max_images, patches: "
        "max_vision_patches), or end (the data ended) / open_packs (over the planner's open-pack limit)"
    )
    return "\n".join(lines)
