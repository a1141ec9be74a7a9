"""Forgetting `prepare_trainer` is loud: the patched forward checks the loader that feeds it, once per loader.

accelerate records the DataLoader being iterated in its ``GradientState`` singleton (``active_dataloader``): every
``Accelerator.prepare``'d loader registers itself when its iteration begins, which covers the Trainer's train,
eval and test loaders (and their resume fast-forward copies) under one process, ``torchrun`` or
``accelerate launch``. A packed forward (`hf_packing.apply_rmpad`) that runs while such a loader is active refuses:

- a ``DataLoaderDispatcher`` (accelerate's default for an ``IterableDataset``) around `pack_dataset`'s packs or
  `VisionCollator` batches: it slices every batch tensor to the batch size (``cu_seqlens``, ``pixel_values``, the
  ``(3, B, L)`` positions), which would otherwise surface as a deep ``IndexError`` / rotary ``RuntimeError``;
- `pack_dataset`'s packs behind an ``IterableDatasetShard`` of several processes: each rank would silently train
  on every ``world_size``-th pack of a stream that is already its own share (exit 0, half the data);
- `pack_dataset`'s packs in a loader that `prepare_trainer` did not hand out (`mark_prepared`): without it resuming
  keeps the initial weights and evaluation is not token-level.

Each error names ``hf_packing.prepare_trainer(trainer)``. The check reads Python attributes only (no device sync),
once per loader object, eagerly also under ``torch.compile(model)`` (one graph break). Batches from another collator
on a map-style dataset, and loops without accelerate, are not checked: nothing there reshards or slices.

It also knows whether a prepared Trainer is inside ``train()`` (`training`), so `revert_rmpad` can refuse then.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

#: attribute `prepare_trainer` sets on the dataset a prepared loader iterates (accelerate's shard or the packs)
PREPARED_ATTR = "hf_packing_prepared"
#: class attribute (``True``) that marks `pack_dataset`'s ``PackedDataset``: the packer sits above the patches, so
#: this guard knows its packs by the mark, not by the class
PACKS_ATTR = "hf_packing_packs"
_CHECKED: weakref.WeakSet = weakref.WeakSet()  # loaders found fine
_TRAINING: weakref.WeakSet = weakref.WeakSet()  # prepared Trainers inside train()

_FIX = "Call hf_packing.prepare_trainer(trainer) after building the Trainer (before train() / evaluate())"


def mark_prepared(loader: Any) -> Any:
    """Mark a loader `prepare_trainer` made (on its dataset, which accelerate's resume fast-forward keeps)."""
    dataset = getattr(loader, "dataset", None)
    if dataset is not None:
        try:
            setattr(dataset, PREPARED_ATTR, True)
        except AttributeError:  # a dataset with __slots__: nothing to check it against later
            pass
    return loader


def active_loader() -> Any:
    """accelerate's loader being iterated now, or None (no Accelerator, or between loops)."""
    from accelerate.state import GradientState

    if not GradientState._shared_state:  # no Accelerator created in this process: do not create its state
        return None
    references = GradientState._shared_state.get("_dataloader_references_ref") or [None]
    ref = references[-1]
    return None if ref is None else ref()


@torch.compiler.disable
def check_active_loader(collated: bool) -> None:
    """Raise if the loader feeding this packed forward is one `prepare_trainer` would have fixed (module docstring).

    ``collated``: the batch came from `VisionCollator` (it carries ``seqlens``). Under ``torch.compile(model)``
    (``TrainingArguments(torch_compile=True)``) it runs eagerly, at the cost of one graph break before the step's work.
    """
    loader = active_loader()
    if loader is None or loader in _CHECKED:
        return
    problem = _loader_problem(loader, collated)
    if problem is not None:
        # the raise ends this loop, but accelerate forgets a loader only when its iteration ends: a later forward
        # outside any loop (a quick check after fixing the Trainer) must not be refused for this one
        from accelerate.state import GradientState

        GradientState()._remove_dataloader(loader)
        raise RuntimeError(problem)
    _CHECKED.add(loader)


def _loader_problem(loader: Any, collated: bool) -> str | None:
    """What is wrong with feeding packed forwards from ``loader`` (see the module docstring), or None."""
    from accelerate.data_loader import DataLoaderDispatcher, IterableDatasetShard

    packs = _packs(loader, IterableDatasetShard)
    if isinstance(loader, DataLoaderDispatcher) and (collated or packs is not None):
        return (
            "accelerate dispatches this loader's batches (dispatch_batches, its default for an IterableDataset): it "
            "slices every tensor of a packed batch to the batch size (cu_seqlens, pixel_values, position_ids). "
            f"{_FIX}; in your own accelerate loop: DataLoaderConfiguration(dispatch_batches=False, split_batches=False)"
        )
    if packs is None:
        return None
    shard = getattr(loader, "dataset", None)
    if isinstance(shard, IterableDatasetShard) and shard.num_processes > 1:
        return (
            f"accelerate's IterableDatasetShard keeps 1 of every {shard.num_processes} packs of a pack_dataset "
            f"stream that is already this rank's share: each rank would see only 1/{shard.num_processes} of its "
            f"packs. {_FIX}"
        )
    if not getattr(shard, PREPARED_ATTR, False):
        return (
            "a Trainer iterates pack_dataset's packs without hf_packing.prepare_trainer (it keeps each rank's "
            f"packs, stops accelerate's dispatching, reloads checkpoints exactly, evaluates token-level). {_FIX}"
        )
    return None


def _packs(loader: Any, shard_class: Any) -> Any:
    """The `PackedDataset` ``loader`` iterates (directly or in accelerate's shard), else None: known by its
    `PACKS_ATTR` mark (`hf_packing.training.unwrap.packed_dataset` tests the class, from above the packer)."""
    dataset: Any = getattr(loader, "dataset", None)
    dataset = dataset.dataset if isinstance(dataset, shard_class) else dataset
    return dataset if getattr(type(dataset), PACKS_ATTR, False) is True else None


def training_started(trainer: Any) -> None:
    _TRAINING.add(trainer)


def training_ended(trainer: Any) -> None:
    _TRAINING.discard(trainer)


def training() -> bool:
    """Whether a Trainer that `prepare_trainer` prepared is inside ``train()`` now."""
    return len(_TRAINING) > 0
