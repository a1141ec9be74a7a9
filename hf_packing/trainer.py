"""Make a `transformers.Trainer` (or any subclass, e.g. TRL's SFTTrainer) train on `pack_dataset` correctly.

Two accelerate defaults break packed batches silently or loudly:

- For an ``IterableDataset`` accelerate dispatches batches by default: it slices every tensor of a batch
  to the batch size along dim 0, which truncates ``cu_seqlens`` (B+1 entries) and ``pixel_values``
  (one row per vision patch). `prepare_trainer` turns dispatching (and batch splitting) off.
- Under several processes accelerate wraps every torch ``IterableDataset`` in ``IterableDatasetShard``, which
  keeps every ``world_size``-th batch of the stream. `pack_dataset` already hands each rank its own,
  rank-equal share, so that wrapper would silently train each rank on 1/world_size of its packs
  (measured: 2 of 4 packs on rank 1 of 2). In evaluation it re-shards the eval stream the same way (measured: 4 of
  8 eval packs evaluated, 5 of 12 samples). `keep_rank_packs` makes it a pass-through for packed datasets, in
  ``get_train_dataloader``, ``get_eval_dataloader`` and ``get_test_dataloader``.

It also repairs resuming: transformers 5.23's ``Trainer._load_from_checkpoint`` loads ``model.safetensors``
non-strictly and without key conversion, while ``save_pretrained`` writes Qwen-VL checkpoints in the
original key layout (``model.layers.*``, ``visual.*``); only ``lm_head`` matches, so a resumed run silently
keeps its initial weights (huggingface/transformers#43701). `reload_checkpoints_with_key_conversion` loads the
checkpoint again through ``from_pretrained`` (the model's own conversion) and copies it in strictly.

Evaluation is token-level like training (`hf_packing.evaluation.token_level_evaluation`): ``eval_loss`` = Σ token CE
/ Σ supervised tokens over the whole eval set, whatever the packing, batch size or number of processes.

`TrainingArguments(use_liger_kernel=True)` makes ``Trainer.train()`` replace the model's forward with Liger's, which
would undo `apply_rmpad` and hand the collator's ``cu_seqlens`` to the vision tower: `prepare_trainer` refuses it.

An eval set packed with the training default ``leftovers="drop"`` would lose its last packs (fewer than one per rank)
under several processes (``eval_loss`` 5.2e-4 off the token-level mean on 2 processes): `spread_eval_packs`
evaluates every `PackedDataset` through its `~hf_packing.stream.PackedDataset.for_evaluation` view, which spreads
them, also when the training set itself is evaluated.

`prepare_trainer` does all of this and puts the packing telemetry in front of the reporting callbacks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .stream import PackedDataset
from .unwrap import packed_dataset


def keep_rank_packs(trainer: Any) -> Any:
    """Let each rank see every pack `pack_dataset` gave it, in training, evaluation and prediction (see the module
    docstring). Returns ``trainer``."""
    for name in ("get_train_dataloader", "get_eval_dataloader", "get_test_dataloader"):
        if hasattr(trainer, name):
            setattr(trainer, name, _unsharded(getattr(trainer, name)))
    return trainer


def spread_eval_packs(trainer: Any) -> Any:
    """Evaluate and predict on `PackedDataset.for_evaluation` views of packed eval / test sets: every pack exactly
    once on any number of processes, whatever ``leftovers`` the set was packed with (the training default, "drop",
    would leave its last packs out), also when the eval set is the training set itself. Returns ``trainer``."""

    def view(dataset: Any) -> Any:
        return dataset.for_evaluation() if isinstance(dataset, PackedDataset) else dataset

    get_eval, get_test = trainer.get_eval_dataloader, getattr(trainer, "get_test_dataloader", None)

    def get_eval_dataloader(eval_dataset: Any = None) -> Any:
        if isinstance(trainer.eval_dataset, dict):  # named eval sets: `eval_dataset` may be one of the names
            trainer.eval_dataset = {name: view(ds) for name, ds in trainer.eval_dataset.items()}
        else:
            trainer.eval_dataset = view(trainer.eval_dataset)
        return get_eval(view(eval_dataset))

    trainer.get_eval_dataloader = get_eval_dataloader
    if get_test is not None:
        trainer.get_test_dataloader = lambda test_dataset: get_test(view(test_dataset))
    return trainer


def _unsharded(get_dataloader: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args, **kwargs):
        loader = get_dataloader(*args, **kwargs)
        shard = getattr(loader, "dataset", None)
        if packed_dataset(loader) not in (None, shard):  # accelerate's IterableDatasetShard around our packs
            shard.num_processes, shard.process_index = 1, 0
        return loader

    return wrapped


def reload_checkpoints_with_key_conversion(trainer: Any) -> Any:
    """After the Trainer's own checkpoint load, load full Qwen-VL weights again with key conversion, strictly.

    Only for a plain (non-PEFT) model of a supported family and a checkpoint holding full ``model.safetensors``
    weights; sharded FSDP / DeepSpeed checkpoints and adapters keep the Trainer's own path. Costs one extra
    copy of the model in host memory, once, at resume. Returns ``trainer``.
    """
    original = trainer._load_from_checkpoint

    def _load_from_checkpoint(resume_from_checkpoint: str, model: Any = None) -> None:
        original(resume_from_checkpoint, model=model)
        target = model if model is not None else trainer.model
        target = getattr(target, "module", target)
        _reload_full_weights(target, Path(resume_from_checkpoint))

    trainer._load_from_checkpoint = _load_from_checkpoint
    return trainer


def _reload_full_weights(model: Any, checkpoint: Path) -> None:
    from transformers import PreTrainedModel

    from .patches import supported_model_types

    has_full_weights = (checkpoint / "model.safetensors").exists() or (
        checkpoint / "model.safetensors.index.json"
    ).exists()
    if not (
        isinstance(model, PreTrainedModel) and model.config.model_type in supported_model_types() and has_full_weights
    ):
        return
    loaded = type(model).from_pretrained(checkpoint, dtype=model.dtype, attn_implementation="sdpa")
    model.load_state_dict(loaded.state_dict(), strict=True)


def no_dispatch(trainer: Any) -> Any:
    """Stop accelerate from dispatching/splitting batches (see the module docstring). Returns ``trainer``."""
    config = trainer.accelerator.dataloader_config
    config.dispatch_batches, config.split_batches = False, False
    return trainer


def refuse_liger_kernel(trainer: Any) -> Any:
    """Raise if ``use_liger_kernel`` would replace the forward `apply_rmpad` patched. Returns ``trainer``."""
    from .patches import is_patched

    if getattr(trainer.args, "use_liger_kernel", False) and is_patched(trainer.model):
        raise ValueError(
            "TrainingArguments(use_liger_kernel=True) replaces the model's forward with Liger's, undoing "
            "hf_packing.apply_rmpad (packed batches would reach the unpatched vision tower and attention); set "
            "use_liger_kernel=False: apply_rmpad already computes the loss with Liger's fused linear cross-entropy "
            "when liger-kernel is installed on CUDA (apply_rmpad(use_liger=True) forces it)"
        )
    return trainer


def prepare_trainer(trainer: Any, *, telemetry: bool = True, **telemetry_kwargs: Any) -> Any:
    """`refuse_liger_kernel`, `keep_rank_packs`, `spread_eval_packs`, `no_dispatch`,
    `reload_checkpoints_with_key_conversion`, `hf_packing.evaluation.token_level_evaluation` and, unless
    ``telemetry=False``,
    `hf_packing.telemetry.add_telemetry`. Returns ``trainer``."""
    from .evaluation import token_level_evaluation

    refuse_liger_kernel(trainer)
    keep_rank_packs(trainer)
    spread_eval_packs(trainer)  # wraps keep_rank_packs' loaders: the view is unsharded too
    no_dispatch(trainer)
    reload_checkpoints_with_key_conversion(trainer)
    token_level_evaluation(trainer)
    if telemetry:
        from .telemetry import add_telemetry

        add_telemetry(trainer, **telemetry_kwargs)
    return trainer
