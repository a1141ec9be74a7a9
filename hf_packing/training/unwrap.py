"""The `PackedDataset` under a DataLoader (directly or in accelerate's ``IterableDatasetShard``).

Shared by `trainer` (which adapts the Trainer) and `evaluation` (which replaces its evaluation loop), below both. The
model under its wrappers is `hf_packing.patches.unwrap_model` (``is_patched`` needs it, and the patches sit below).
"""

from __future__ import annotations

from typing import Any

from accelerate.data_loader import IterableDatasetShard

from ..packing.dataset import PackedDataset

__all__ = ["packed_dataset"]


def packed_dataset(loader: Any) -> PackedDataset | None:
    """The `PackedDataset` a DataLoader iterates (directly or in accelerate's ``IterableDatasetShard``), else None."""
    dataset = getattr(loader, "dataset", None)
    dataset = dataset.dataset if isinstance(dataset, IterableDatasetShard) else dataset
    return dataset if isinstance(dataset, PackedDataset) else None
