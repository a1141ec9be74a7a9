"""Row sources for `pack_dataset`: a position per row, so a resumed run re-reads exactly the rows it still needs.

- `datasets.Dataset`: read as raw Arrow rows (no image decoding); the position is a row number.
- `datasets.IterableDataset`: images switched to `{"bytes", "path"}` with `.decode(False)`; the position is the
  dataset's own `state_dict()`, taken after every row (cheap next to planning a row: docs/packer.md, 'What a row
  costs').
- `{name: dataset}`: tagged with a source column, then mixed by `datasets.interleave_datasets` (its RNG and
  per-source positions are part of its state_dict): without weights every row of every source once, sources
  alternating row by row; with weights by their probabilities until `stopping_strategy` ends the mix.
"""

from __future__ import annotations

import copy
import functools
import glob
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ..preprocess.preprocessor import META_COLUMNS

__all__ = ["SOURCE_COLUMN", "IterSource", "MapSource", "is_imagefolder", "load_local", "make_source"]

SOURCE_COLUMN = "__hf_packing_source__"


def json_decoder(feature: Any) -> Any:
    """A function that parses the `Json`-typed leaves of a row, or None when there are none.

    datasets types list items whose keys differ (``{"type": "image"}`` next to ``{"type": "text", "text": ..}``,
    common in messages-format jsonl) as `Json`; read as raw Arrow they arrive as JSON strings.
    """
    from datasets.features import Json, LargeList, List, Sequence

    if isinstance(feature, Json):
        return lambda v: json.loads(v) if isinstance(v, str) else v
    if isinstance(feature, (List, LargeList, Sequence)):
        inner = json_decoder(feature.feature)
        return None if inner is None else (lambda v: v if v is None else [inner(x) for x in v])
    if isinstance(feature, Mapping):
        fields = {k: f for k, f in ((k, json_decoder(f)) for k, f in feature.items()) if f is not None}
        if not fields:
            return None
        return lambda v: v if v is None else {k: (fields[k](x) if k in fields else x) for k, x in v.items()}
    return None


def _decoded(rows: list[dict[str, Any]], decode: Any) -> list[dict[str, Any]]:
    return rows if decode is None else [decode(row) for row in rows]


class MapSource:
    """A `datasets.Dataset` read as raw Arrow rows (no image decoding), 256 at a time; its position is a row number.

    With the [`~hf_packing.preprocess.preprocessor.META_COLUMNS`], planning reads only those columns (and the source
    tag) and [`~MapSource.fetch`] reads a whole row by number when its pack is processed.
    """

    def __init__(self, ds: Any) -> None:
        self.ds, self.size = ds.with_format("arrow"), len(ds)
        self.lazy = set(META_COLUMNS) <= set(ds.column_names)
        keep = [c for c in ds.column_names if c in META_COLUMNS or c == SOURCE_COLUMN]
        self.plan_ds = ds.select_columns(keep).with_format("arrow") if self.lazy else self.ds
        self.decode = json_decoder(ds.features)

    def rows(self, state: int | None, epoch: int) -> Iterator[tuple[dict[str, Any], int]]:
        for start in range(state or 0, self.size, 256):
            rows = self.plan_ds[start : start + 256].to_pylist()
            for k, row in enumerate(rows if self.lazy else _decoded(rows, self.decode)):
                yield row, start + k + 1

    def fetch(self, index: int) -> dict[str, Any]:
        return _decoded(self.ds[index].to_pylist(), self.decode)[0]


class IterSource:
    """A `datasets.IterableDataset`; its position is its own `state_dict()`, taken after every row."""

    size, lazy = None, False

    def __init__(self, ds: Any) -> None:
        if getattr(ds, "_distributed", None) is not None:
            raise ValueError(
                "pass the dataset before split_dataset_by_node(): pack_dataset splits packs by rank itself"
            )
        if ds.features is not None:  # images as {"bytes", "path"}: headers are read, pixels only for placed rows
            ds = ds.decode(False)
        self.ds = ds
        self.decode = json_decoder(ds.features) if ds.features is not None else None

    def rows(self, state: dict[str, Any] | None, epoch: int) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
        ds = copy.copy(self.ds)
        if hasattr(ds, "set_epoch"):
            ds.set_epoch(epoch)
        if state is not None:
            ds.load_state_dict(state)
        for batch in ds.iter(batch_size=1):
            row = {k: v[0] for k, v in batch.items()}
            yield (row if self.decode is None else self.decode(row)), ds.state_dict()


def _tag(row: dict[str, Any], *, name: str) -> dict[str, Any]:
    return {SOURCE_COLUMN: name}


def mix_stopping(weights: Any, stopping_strategy: str | None) -> str:
    """What ends a mix: `stopping_strategy` when given, else every row once without weights
    ("all_exhausted_without_replacement", which alternates the sources row by row) and "first_exhausted" with them."""
    if stopping_strategy is not None:
        return stopping_strategy
    return "first_exhausted" if weights is not None else "all_exhausted_without_replacement"


def make_source(ds: Any, weights: Any, seed: int, stopping_strategy: str | None) -> tuple[Any, list[str]]:
    import datasets

    names: list[str] = []
    if isinstance(ds, Mapping):
        names = [str(n) for n in ds]
        parts = list(ds.values())
        if any(isinstance(p, datasets.IterableDataset) for p in parts):  # undecoded before map() hides features
            parts = [p if isinstance(p, datasets.IterableDataset) else p.to_iterable_dataset() for p in parts]
            parts = [p.decode(False) if p.features is not None else p for p in parts]
        parts = [
            p.map(functools.partial(_tag, name=n))
            if isinstance(p, datasets.IterableDataset)
            else p.add_column(SOURCE_COLUMN, [n] * len(p))
            for n, p in zip(names, parts, strict=True)
        ]
        probs = None
        if weights is not None:
            w = [float(weights[n]) for n in ds] if isinstance(weights, Mapping) else [float(x) for x in weights]
            if len(w) != len(names) or min(w) < 0 or sum(w) <= 0:
                raise ValueError(f"weights must give one non-negative weight per dataset ({names}), got {weights!r}")
            probs = [x / sum(w) for x in w]
        stop = mix_stopping(weights, stopping_strategy)
        ds = datasets.interleave_datasets(parts, probabilities=probs, seed=seed, stopping_strategy=stop)
    elif weights is not None:
        raise ValueError("weights= needs a {name: dataset} mapping as ds")
    if isinstance(ds, datasets.Dataset):
        return MapSource(ds), names
    if isinstance(ds, datasets.IterableDataset):
        return IterSource(ds), names
    raise TypeError(
        f"ds must be a datasets.Dataset, datasets.IterableDataset or a dict of them, got {type(ds).__name__}"
    )


# ------------------------------------------------------------------------------------------------ local files
_BUILDERS = {"jsonl": "json", "json": "json", "parquet": "parquet", "arrow": "arrow"}


def _builder(path: str) -> str:
    builder = _BUILDERS.get(path.rsplit(".", 1)[-1].lower())
    if builder is None:
        raise ValueError(f"cannot read {path!r}: expected json/jsonl/parquet/arrow files or a saved datasets dir")
    return builder


def is_imagefolder(path: Path) -> bool:
    """Whether directory `path` is an image folder as `datasets`' `imagefolder` builder reads it: image files under it,
    with a top-level ``metadata.jsonl`` / ``.csv`` / ``.parquet`` or no other data file at its top level."""
    from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

    extensions = {e.lower() for e in ImageFolder.EXTENSIONS}
    metadata = any((path / f"metadata.{ext}").is_file() for ext in ("jsonl", "csv", "parquet"))
    data = any(f.is_file() and f.suffix.lstrip(".") in _BUILDERS for f in path.iterdir())
    if data and not metadata:
        return False
    return any(f.suffix.lower() in extensions for f in path.rglob("*") if f.is_file())


def load_local(path: str, *, streaming: bool = False) -> Any:
    """One local source, split ``train``: a directory written by ``save_to_disk`` (``load_from_disk``), an image folder
    (images with a ``metadata.jsonl`` / ``metadata.csv``: ``load_dataset("imagefolder", data_dir=path)``, each row's
    image in its `image` column), or json/jsonl/parquet/arrow data files (``load_dataset``): a file, a glob or a
    directory of them. A path that does not exist, or a glob that matches nothing, is a `FileNotFoundError` naming
    it."""
    import datasets

    p = Path(path)
    if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()):
        ds = datasets.load_from_disk(str(p))
        ds = ds["train"] if isinstance(ds, datasets.DatasetDict) else ds
        return ds.to_iterable_dataset() if streaming else ds
    if p.is_dir() and is_imagefolder(p):
        return datasets.load_dataset("imagefolder", data_dir=str(p), split="train", streaming=streaming)
    if p.is_dir():
        files = sorted(str(f) for f in p.iterdir() if f.suffix.lstrip(".") in _BUILDERS)
        if not files:
            raise ValueError(f"no json/jsonl/parquet/arrow files in {path!r}")
    elif any(ch in path for ch in "*?["):
        files = sorted(glob.glob(path, recursive=True))
        if not files:
            raise FileNotFoundError(f"no file matches {path!r}")
    elif p.exists():
        files = [path]
    else:
        raise FileNotFoundError(f"{path!r} does not exist")
    return datasets.load_dataset(_builder(files[0]), data_files=files, split="train", streaming=streaming)
