"""Which source each sample came from, as a small int that travels with the pack to the loss.

A source is the key of a ``{name: dataset}`` mix given to `pack_dataset`, or the value of the column named by
``pack_dataset(source_column=...)``. `PackedDataset.source_names` lists them (the id is the position in that list);
each processed sample gets ``sample["source_id"]``, `VisionCollator` turns a batch's ids into ``source_ids``
(int64, one per sequence, in ``cu_seqlens`` order), and the patched loss adds each supervised token's cross-entropy,
count and argmax hit to its source's slot (`hf_packing.ops.loss`)::

    pack        [caption a(3)] [chart b(4)] [caption c(2)]        source_names = ["caption", "chart"]
    cu_seqlens  [0, 3, 7, 9]       source_ids = [0, 1, 0]
    per source  Σ CE, supervised tokens, correct argmax:  (3, num_sources), on the device, no host sync

Metric names: training logs ``loss/<name>``, ``token_accuracy/<name>`` and ``supervised_tokens/<name>``
(`hf_packing.training.telemetry`), evaluation
``<prefix>_<name>_loss`` and ``<prefix>_<name>_token_accuracy`` (`hf_packing.training.evaluation`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["SOURCE_ID", "SourceTagger", "per_source_metrics"]

#: the sample key holding the source id (an `int`)
SOURCE_ID = "source_id"


class SourceTagger:
    """Gives each row its source id; falsy when samples carry no source (one dataset, no ``source_column``).

    Args:
        ds: what `pack_dataset` got: a dataset or a ``{name: dataset}`` mix.
        column (`str`, *optional*): ``source_column``: the column whose value names a row's source. Its names are
            read from a ``ClassLabel`` feature (any dataset) or from the column's values (a `datasets.Dataset`).
    """

    def __init__(self, ds: Any, column: str | None = None) -> None:
        self.column = column
        self.names: list[str] = []
        self._labels = False  # a ClassLabel column: the value is already the id
        if column is None:
            self.names = [str(n) for n in ds] if isinstance(ds, Mapping) else []
        else:
            self.names = self._column_names(ds, column)
        self._ids = {name: i for i, name in enumerate(self.names)}

    def _column_names(self, ds: Any, column: str) -> list[str]:
        import datasets

        if isinstance(ds, Mapping):
            raise ValueError(
                f"source_column={column!r} applies to one dataset; a {{name: dataset}} mix is tagged by its keys "
                "(pass source_column=None)"
            )
        features = getattr(ds, "features", None) or {}
        if column not in features:
            raise ValueError(f"source_column={column!r} is not a column of the dataset (columns: {sorted(features)})")
        if isinstance(features[column], datasets.ClassLabel):
            self._labels = True
            return list(features[column].names)
        if not isinstance(ds, datasets.Dataset):
            raise ValueError(
                f"source_column={column!r} on a streaming dataset needs a ClassLabel column (its names are the "
                f"sources): ds.cast_column({column!r}, datasets.ClassLabel(names=[...]))"
            )
        return sorted({str(v) for v in ds.unique(column)})

    def __bool__(self) -> bool:
        return bool(self.names)

    def __call__(self, mix_source: str | None, row: Mapping[str, Any]) -> int:
        """The source id of ``row``, read from the mix (``mix_source``) or from ``row[column]``."""
        name: Any = mix_source if self.column is None else row[self.column]
        if self._labels:
            return int(name)
        return self._ids[str(name)]


def per_source_metrics(
    names: list[str], sums: list[float], *, loss_key: str, accuracy_key: str, count_key: str | None = None
) -> dict[str, float]:
    """``{loss_key.format(name): Σ CE / n, accuracy_key.format(name): correct / n}`` for each source with n > 0, and
    ``count_key.format(name): n`` for every source when ``count_key`` is given.

    Args:
        names: the source names, in id order.
        sums: ``3 · len(names)`` numbers: all sources' Σ CE, then their supervised counts, then their correct counts
            (a ``(3, num_sources)`` tensor's ``flatten().tolist()``).
    """
    k = len(names)
    if len(sums) != 3 * k:
        raise ValueError(f"expected 3 x {k} per-source sums, got {len(sums)}")
    metrics = {}
    for i, name in enumerate(names):
        ce, n, correct = sums[i], sums[k + i], sums[2 * k + i]
        if count_key is not None:
            metrics[count_key.format(name)] = n
        if n > 0:
            metrics[loss_key.format(name)] = ce / n
            metrics[accuracy_key.format(name)] = correct / n
    return metrics
