"""Length index: every row's planning metadata computed once with `datasets.map`, cached as Arrow, shared by ranks.

Without it each replica (every DataLoader worker of every rank) estimates every row to plan the same packs:
R ranks × W workers × N rows estimates (chat template, tokenizer, image headers). With it the rows are
estimated once (`num_proc` processes, with `datasets`' progress bar) into the
[`~hf_packing.preprocess.preprocessor.META_COLUMNS`] (tokens, images, Σ t·h·w, Σ t·(h·w)², and the reason and message
of a refused row), and each replica reads those columns instead of estimating. The build costs about one estimating
pass, once; a second call with the same settings reads its file. Planning from columns against estimating, per
replica and modelled for LLaVA-665k at scale, is measured in benchmarks/RESULTS.md, 'Length index' (`bench_index.py`).

The index is a `datasets` cache file: `map(..., new_fingerprint=key)` where the key hashes the dataset's fingerprint,
the processor (tokenizer, image/video processor config, chat template) and every setting that changes a row's
metadata (`max_length`, `on_overlong`, `train_on`, `row_format`, media roots, `fps`, `videos_kwargs`,
`max_image_pixels`); another
value of any gives another file. It is written next to the dataset's own cache files (`cache-<key>.arrow`, where
`datasets` puts a `map`), or under a directory you name; a dataset without cache files (built in memory) gets an
in-memory index per process. Files that change on disk without the dataset changing are not seen: a stale length
is caught when its sample is processed (`"length_mismatch"`), never trained wrong.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from typing import Any

from ..preprocess.preprocessor import META_COLUMNS, Preprocessor
from .readers import json_decoder

__all__ = ["build_length_index", "index_key", "with_length_index"]

_INDEX_VERSION = 2  # bump when the columns or the estimate change meaning: older files are then never read
# 2: no "unexpected_error" rows (an exception that is not a SampleError ends the build); rows reach the chat template
# whole (lengths change); the hfp_features column


def processor_signature(processor: Any) -> dict[str, Any]:
    """What of `processor` decides a row's metadata: its class, tokenizer (vocabulary and added tokens), image and
    video processor settings and chat template, as JSON-able data."""
    tokenizer = getattr(processor, "tokenizer", processor)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    out: dict[str, Any] = {
        "class": type(processor).__name__,
        "tokenizer": backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items()),
        "chat_template": getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None),
    }
    for name in ("image_processor", "video_processor"):
        part = getattr(processor, name, None)
        out[name] = part.to_dict() if part is not None and hasattr(part, "to_dict") else None
    return out


def index_key(ds: Any, preprocessor: Preprocessor) -> str:
    """The cache key of `ds`'s index under `preprocessor`: 16 hex digits (a valid `datasets` fingerprint)."""
    pre = preprocessor
    settings = {
        "version": _INDEX_VERSION,
        "dataset": ds._fingerprint,
        "max_length": pre.max_length,
        "on_overlong": pre.on_overlong,
        "train_on": pre.train_on,
        "row_format": pre.row_format,
        "chat_template_kwargs": pre.template.template_kwargs,
        "empty_thinking": pre.template.empty_thinking,
        "fps": pre.fps,
        "media_root": str(pre.images.image_root),
        "video_root": str(pre.videos.images.image_root),
        "videos_kwargs": None if pre.sampling is None else dataclasses.asdict(pre.sampling.settings),
        "max_image_pixels": pre.images.max_image_pixels,
        # a URL that failed under these bounds is a skip stored in the index: other bounds index again
        "media": [pre.images.fetcher.timeout, pre.images.fetcher.tries, pre.images.fetcher.max_bytes],
        "processor": processor_signature(pre.processor),
    }
    blob = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


class _IndexRows:
    """The `map` function: a batch of raw Arrow rows (images undecoded, as the planner reads them) → META_COLUMNS."""

    def __init__(self, preprocessor: Preprocessor, decode: Any) -> None:
        self.preprocessor, self.decode = preprocessor, decode

    def __call__(self, batch: Any, indices: list[int]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {c: [] for c in META_COLUMNS}
        for row, index in zip(batch.to_pylist(), indices, strict=True):
            row = row if self.decode is None else self.decode(row)
            for column, value in self.preprocessor.metadata_columns(row, index).items():
                out[column].append(value)
        return out


def _features() -> Any:
    from datasets import Features, Value

    kinds = ("int64", "int32", "int64", "int64", "int32", "int64", "string", "string", "string")
    return Features({c: Value(k) for c, k in zip(META_COLUMNS, kinds, strict=True)})


@contextlib.contextmanager
def _progress(enabled: bool) -> Iterator[None]:
    from datasets.utils import logging as ds_logging

    was = ds_logging.is_progress_bar_enabled()
    if was and not enabled:
        ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not enabled:
            ds_logging.enable_progress_bar()


def build_length_index(
    ds: Any,
    preprocessor: Preprocessor,
    *,
    cache_dir: str | os.PathLike | None = None,
    num_proc: int | None = None,
    progress: bool = True,
) -> Any:
    """The [`META_COLUMNS`] of every row of `ds`, built once and cached (see the module docstring).

    Args:
        ds (`datasets.Dataset`): the rows (any format; read here as raw Arrow, images undecoded).
        preprocessor ([`Preprocessor`]): the source's preprocessor, with the settings `pack_dataset` uses.
        cache_dir (`str`, *optional*): where the Arrow file goes; by default next to `ds`'s cache files (none for a
            dataset held in memory: the index is then built in memory).
        num_proc (`int`, *optional*): processes for `map`; default 1 below 20,000 rows, else the usable cores (≤ 32).
        progress (`bool`, defaults to `True`): `datasets`' progress bar.

    Returns:
        `datasets.Dataset`: `len(ds)` rows of the META_COLUMNS (int64 counts, int32 images, string skip reason and
        message); a refused row has `hfp_num_tokens == -1`.
    """
    key = index_key(ds, preprocessor)
    if num_proc is None:
        num_proc = 1 if len(ds) < 20_000 else min(len(os.sched_getaffinity(0)), 32)
    cache_file = None
    if cache_dir is not None:
        os.makedirs(cache_dir, exist_ok=True)
        cache_file = os.path.join(os.fspath(cache_dir), f"hf_packing-index-{key}.arrow")
    # cache_file None and ds on disk: datasets writes cache-<key>.arrow next to ds's files and reuses it
    with _progress(progress):
        index = ds.with_format("arrow").map(
            _IndexRows(preprocessor, json_decoder(ds.features)),
            batched=True,
            batch_size=256,
            with_indices=True,
            remove_columns=ds.column_names,
            features=_features(),
            new_fingerprint=key,
            cache_file_name=cache_file,
            num_proc=num_proc if num_proc > 1 else None,
            desc="hf_packing: length index",
        )
    return index.with_format(None)


def with_length_index(ds: Any, preprocessor: Preprocessor, **kwargs: Any) -> Any:
    """`ds` with its length index as extra columns (`datasets.concatenate_datasets(axis=1)`, no copy of `ds`); `ds`
    itself when it already has them. `kwargs` go to [`build_length_index`]."""
    from datasets import concatenate_datasets

    if set(META_COLUMNS) <= set(ds.column_names):
        return ds
    return concatenate_datasets([ds, build_length_index(ds, preprocessor, **kwargs)], axis=1)
