"""Make a `transformers.Trainer` (or any subclass, e.g. TRL's SFTTrainer) train on `pack_dataset` correctly.

Two accelerate defaults break packed batches silently or loudly:

- For an ``IterableDataset`` accelerate dispatches batches by default: it slices every tensor of a batch
  to the batch size along dim 0, which truncates ``cu_seqlens`` (B+1 entries) and ``pixel_values``
  (one row per vision patch). `prepare_trainer` turns dispatching (and batch splitting) off.
- Under several processes accelerate wraps every torch ``IterableDataset`` in ``IterableDatasetShard``, which
keeps every ``world_size``-th batch of the stream. `pack_dataset` already hands each rank its own,
  rank-equal share, so that wrapper would silently train each rank on 1/world_size of its packs
  (measured: 2 of 4 packs on rank 1 of 2). `keep_rank_packs` makes it a pass-through for packed datasets.

`prepare_trainer` does both and puts the packing telemetry in front of the reporting callbacks.
"""

from __future__ import annotations

from typing import Any


def keep_rank_packs(trainer: Any) -> Any:
    """Let each rank see every pack `pack_dataset` gave it (see the module docstring). Returns ``trainer``."""
    original = trainer.get_train_dataloader

    def get_train_dataloader(*args, **kwargs):
        from accelerate.data_loader import IterableDatasetShard

        from .stream import PackedDataset

        loader = original(*args, **kwargs)
        shard = getattr(loader, "dataset", None)
        if isinstance(shard, IterableDatasetShard) and isinstance(shard.dataset, PackedDataset):
            shard.num_processes, shard.process_index = 1, 0
        return loader

    trainer.get_train_dataloader = get_train_dataloader
    return trainer


def no_dispatch(trainer: Any) -> Any:
    """Stop accelerate from dispatching/splitting batches (see the module docstring). Returns ``trainer``."""
    config = trainer.accelerator.dataloader_config
    config.dispatch_batches, config.split_batches = False, False
    return trainer


def prepare_trainer(trainer: Any, *, telemetry: bool = True, **telemetry_kwargs: Any) -> Any:
    """`keep_rank_packs`, `no_dispatch` and, unless ``telemetry=False``, `hf_packing.telemetry.add_telemetry`. Returns ``trainer``."""
    keep_rank_packs(trainer)
    no_dispatch(trainer)
    if telemetry:
        from .telemetry import add_telemetry

        add_telemetry(trainer, **telemetry_kwargs)
    return trainer
