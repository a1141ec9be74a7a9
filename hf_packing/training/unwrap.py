"""What a Trainer holds, unwrapped: the model under its wrappers, the `PackedDataset` under its DataLoader.

Shared by `trainer` (which adapts the Trainer) and `evaluation` (which replaces its evaluation loop), below both.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.data_loader import IterableDatasetShard

from ..packing.dataset import PackedDataset

__all__ = ["base_model", "packed_dataset"]


def packed_dataset(loader: Any) -> PackedDataset | None:
    """The `PackedDataset` a DataLoader iterates (directly or in accelerate's ``IterableDatasetShard``), else None."""
    dataset = getattr(loader, "dataset", None)
    dataset = dataset.dataset if isinstance(dataset, IterableDatasetShard) else dataset
    return dataset if isinstance(dataset, PackedDataset) else None


def base_model(model: Any) -> Any:
    """The model under DDP / FSDP (``.module``) and PEFT (``get_base_model()``) wrappers."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model.get_base_model() if hasattr(model, "get_base_model") else model
