"""Make a `transformers.Trainer` (or any subclass, e.g. TRL's SFTTrainer) train on `pack_dataset` correctly.

Two accelerate defaults break packed batches silently or loudly:

- For an ``IterableDataset`` accelerate dispatches batches by default: it slices every tensor of a batch
  to the batch size along dim 0, which truncates ``cu_seqlens`` (B+1 entries) and ``pixel_values``
  (one row per vision patch). `prepare_trainer` turns dispatching (and batch splitting) off.
- Under several processes accelerate wraps every torch ``IterableDataset`` in ``IterableDatasetShard``, which
  keeps every ``world_size``-th batch of the stream. `pack_dataset` already hands each rank its own,
  rank-equal share, so that wrapper would silently train each rank on 1/world_size of its packs. In evaluation it
  re-shards the eval stream the same way, so part of the eval set goes unevaluated (measured: docs/trainer.md).
  `keep_rank_packs` makes it a pass-through for packed datasets, in ``get_train_dataloader``,
  ``get_eval_dataloader`` and ``get_test_dataloader``.

It also repairs resuming: transformers 5.23's ``Trainer._load_from_checkpoint`` loads ``model.safetensors``
non-strictly and without key conversion, while ``save_pretrained`` writes Qwen-VL checkpoints in the
original key layout (``model.layers.*``, ``visual.*``); only ``lm_head`` matches, so a resumed run silently
keeps its initial weights (huggingface/transformers#43701). ``Trainer._load_best_model`` (``load_best_model_at_end``)
loads the same way: only ``lm_head`` comes from the best checkpoint (tests/test_checkpoints.py: 26 of the 27 tensors
training had moved stayed at the last step's), and ``evaluate()`` reports neither the best loss nor the last.
`reload_checkpoints_with_key_conversion` loads the checkpoint again after both, through ``from_pretrained`` (the
model's own conversion), and copies it in strictly.

Evaluation is token-level like training (`hf_packing.training.evaluation.token_level_evaluation`): ``eval_loss`` = Σ
token CE / Σ supervised tokens over the whole eval set, whatever the packing, batch size or number of processes.

`TrainingArguments(use_liger_kernel=True)` makes ``Trainer.train()`` apply Liger's kernels, by default with its
fused-loss forward, which would undo `apply_rmpad` and hand the collator's ``cu_seqlens`` to the vision tower (the
patched forward already calls Liger's fused linear cross-entropy): `refuse_liger_kernel` keeps Liger's inner-module
kernels only (rope, RMSNorm / LayerNorm, SwiGLU, MoE experts: per-token ops, indifferent to packing) and refuses a
``liger_kernel_config`` that asks for the fused-loss forward or Liger's cross-entropy.

An eval set packed with the training default ``leftovers="drop"`` would lose its last packs (fewer than one per rank)
under several processes, and its ``eval_loss`` would miss their tokens (measured: docs/evaluation.md):
`spread_eval_packs` evaluates every `PackedDataset` through its
`~hf_packing.packing.dataset.PackedDataset.for_evaluation` view, which spreads them, also when the training set
itself is evaluated.

A ``data_collator`` of the user's around `VisionCollator` (a function that adds a key or logs) trains: nothing on a
function tells which collator it calls, so `check_wrapped_collator` checks each batch it returns instead
(`CheckedCollator`: the keys, shapes and counts the patched forward trusts must be `VisionCollator`'s), and a batch
built otherwise stops before its step with the reason. transformers' and TRL's own collators are refused up front.

Before any data is read, `check_setup` refuses what it can tell is wrong (collator, processor family, model type,
attention implementation, packs per micro-batch), each error naming the setting. Forgetting `prepare_trainer` is
loud too: the patched forward refuses packs from a loader it did not prepare (`hf_packing.patches.prepared`).

`prepare_trainer` does all of this and puts the packing telemetry in front of the reporting callbacks.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..packing.dataset import PackedDataset
from ..patches import unwrap_model
from ..patches.prepared import mark_prepared, training_ended, training_started
from .unwrap import packed_dataset

logger = logging.getLogger(__name__)


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
        shard: Any = getattr(loader, "dataset", None)
        if packed_dataset(loader) not in (None, shard):  # accelerate's IterableDatasetShard around our packs
            shard.num_processes, shard.process_index = 1, 0
        return mark_prepared(loader)  # the patched forward refuses packs from a loader without this mark

    return wrapped


def reload_checkpoints_with_key_conversion(trainer: Any) -> Any:
    """After each of the Trainer's own checkpoint loads, load full Qwen-VL weights again with key conversion, strictly.

    Both loads transformers 5.23 does non-strictly without key conversion are covered: resuming
    (``_load_from_checkpoint``: ``train(resume_from_checkpoint=path | True)``, also with ``model_init``) and
    ``load_best_model_at_end`` (``_load_best_model``, at the end of ``train()``). Each reload targets the model
    the Trainer holds at that moment (``model_init`` replaces it inside ``train()``).

    Only for a plain (non-PEFT) model of a supported family, a checkpoint holding full ``model.safetensors`` weights,
    and neither DeepSpeed nor FSDP: those engines load their own checkpoint files (saved under the runtime names, and
    loaded strictly), and an adapter loads through PEFT's ``load_adapter`` under its runtime names; both keep the
    Trainer's own path. Costs one extra copy of the model in host memory, once per load. The Trainer's non-strict
    load before it lists the keys it could not match ("missing keys" / "unexpected keys", on every rank); those lists
    are dropped when the exact reload follows, and one line says what was reloaded instead. Returns ``trainer``.
    """
    load_from_checkpoint, load_best_model = trainer._load_from_checkpoint, trainer._load_best_model

    def _load_from_checkpoint(resume_from_checkpoint: str, model: Any = None) -> None:
        _load_exactly(
            trainer,
            Path(resume_from_checkpoint),
            model,
            lambda: load_from_checkpoint(resume_from_checkpoint, model=model),
            "resumed from",
        )

    def _load_best_model() -> None:
        checkpoint = Path(trainer.state.best_model_checkpoint)
        _load_exactly(trainer, checkpoint, None, load_best_model, "loaded the best checkpoint")

    trainer._load_from_checkpoint = _load_from_checkpoint
    trainer._load_best_model = _load_best_model
    return trainer


def _load_exactly(trainer: Any, checkpoint: Path, model: Any, load: Callable[[], None], what: str) -> None:
    """Run the Trainer's own ``load``, then, where `_has_full_weights` applies, reload ``checkpoint`` exactly into
    ``model`` (``trainer.model`` when None) without the non-strict load's key lists."""
    target = unwrap_model(model if model is not None else trainer.model, peft=False)  # adapters: PEFT's own load
    engine = getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False)
    exact = not engine and _has_full_weights(target, checkpoint)
    if exact:  # its key lists describe the non-strict load that the exact reload below replaces
        trainer._issue_warnings_after_load = lambda load_result: None
    try:
        load()
    finally:
        trainer.__dict__.pop("_issue_warnings_after_load", None)
    if exact:
        count = _reload_full_weights(target, checkpoint)
        if trainer.is_world_process_zero():
            logger.info(
                "%s %s: all %d weight tensors reloaded exactly (strict, with the model's own key conversion; "
                "transformers' non-strict load matched only part of them)",
                what,
                checkpoint,
                count,
            )


def _has_full_weights(model: Any, checkpoint: Path) -> bool:
    """Whether `_reload_full_weights` applies: a plain supported model and full safetensors weights."""
    from transformers import PreTrainedModel

    from ..patches import supported_model_types

    has_full_weights = (checkpoint / "model.safetensors").exists() or (
        checkpoint / "model.safetensors.index.json"
    ).exists()
    return (
        isinstance(model, PreTrainedModel) and model.config.model_type in supported_model_types() and has_full_weights
    )


def _reload_full_weights(model: Any, checkpoint: Path) -> int:
    """Load ``checkpoint`` through ``from_pretrained`` and copy it into ``model`` strictly; returns the tensor count."""
    loaded = type(model).from_pretrained(checkpoint, dtype=model.dtype, attn_implementation="sdpa")
    state = loaded.state_dict()
    model.load_state_dict(state, strict=True)
    return len(state)


def no_dispatch(trainer: Any) -> Any:
    """Stop accelerate from dispatching/splitting batches (see the module docstring). Returns ``trainer``."""
    config = trainer.accelerator.dataloader_config
    config.dispatch_batches, config.split_batches = False, False
    return trainer


#: Liger's options that replace the model's forward or its loss; the patched forward computes the loss itself
LIGER_LOSS_OPTIONS = ("fused_linear_cross_entropy", "cross_entropy")


def refuse_liger_kernel(trainer: Any) -> Any:
    """On a patched model, ``use_liger_kernel=True`` gets Liger's inner kernels only: ``liger_kernel_config`` with
    `LIGER_LOSS_OPTIONS` off, applied now (`hf_packing._compat.apply_liger_inner_kernels`; the forward stays ours),
    and ``use_liger_kernel`` set to False so that ``Trainer.train()`` does not apply Liger's defaults over them. A
    config asking for either loss option is refused. Returns ``trainer``."""
    from ..patches import is_patched

    args = trainer.args
    if not getattr(args, "use_liger_kernel", False) or not is_patched(trainer.model):
        return trainer
    config = dict(getattr(args, "liger_kernel_config", None) or {})
    asked = [option for option in LIGER_LOSS_OPTIONS if config.get(option)]
    if asked:
        raise ValueError(
            f"liger_kernel_config={config} asks for {' and '.join(asked)}, which replaces the model's forward with "
            "Liger's, undoing hf_packing.apply_rmpad (packed batches would reach the unpatched vision tower and "
            f"attention); drop {', '.join(asked)} from liger_kernel_config: apply_rmpad already computes the loss "
            "with Liger's fused linear cross-entropy when liger-kernel is installed on CUDA (apply_rmpad(use_liger="
            "True) forces it), and use_liger_kernel=True keeps Liger's rope / RMSNorm / SwiGLU kernels"
        )
    from .._compat import apply_liger_inner_kernels

    args.liger_kernel_config = {**config, **dict.fromkeys(LIGER_LOSS_OPTIONS, False)}
    apply_liger_inner_kernels(unwrap_model(trainer.model), args.liger_kernel_config)  # under DDP / compile / PEFT
    args.use_liger_kernel = False  # applied: Trainer.train() would apply Liger's defaults (its fused-loss forward)
    logger.info("Liger's inner kernels applied under apply_rmpad (%s)", args.liger_kernel_config)
    return trainer


class CheckedCollator:
    """The user's ``data_collator`` around `VisionCollator` (a function that adds a key or logs), each batch it returns
    checked by `hf_packing.collator.batch_problem` in the DataLoader worker, before the step that would use it.

    The patched forward trusts a `VisionCollator` batch's host values (boundaries, supervised-token count, vision
    grids) without reading the device, and a function can hide which collator it calls, so the batch itself is
    checked: its keys, shapes and counts must be what `VisionCollator` makes of it (O(tokens) on CPU, per batch).
    ``.collator`` is the wrapped callable.
    """

    def __init__(self, collator: Callable[[Any], Any]) -> None:
        self.collator = collator

    def __call__(self, features: Any) -> Any:
        from ..collator import batch_problem

        batch = self.collator(features)
        problem = batch_problem(batch)
        if problem is not None:
            name = getattr(self.collator, "__qualname__", type(self.collator).__name__)
            raise ValueError(
                f"the Trainer's data_collator ({name}) returned a batch that is not VisionCollator's as built: "
                f"{problem}. The patched forward takes the sequence boundaries (seqlens), the loss's token count "
                "(num_supervised_tokens) and the vision grids from VisionCollator's host values without reading "
                "them back from the device, so they must match the tensors. A function around VisionCollator may add "
                "keys ({**batch, 'my_key': ...}) or log, and may change the samples before calling it, not the "
                "batch after; to build batches differently, subclass VisionCollator and start from "
                "super().__call__(features). Otherwise pass data_collator=VisionCollator(processor, "
                "model_config=model.config)"
            )
        return batch


def check_wrapped_collator(trainer: Any) -> Any:
    """Wrap a packed dataset's ``data_collator`` in `CheckedCollator` unless it is a `VisionCollator` itself (a
    `VisionCollator`'s batches are consistent as built). Returns ``trainer``."""
    from ..collator import VisionCollator

    if _packed_sets(trainer) and not isinstance(trainer.data_collator, (VisionCollator, CheckedCollator)):
        trainer.data_collator = CheckedCollator(trainer.data_collator)
    return trainer


def _library_collator(collator: Any) -> bool:
    """Whether ``collator`` is defined by transformers, TRL or torch (so it builds its own batch, not ours)."""
    module = collator.__module__ if inspect.isroutine(collator) else type(collator).__module__
    return str(module).split(".")[0] in ("transformers", "trl", "torch")


def _collators(collator: Any) -> list[Any]:
    """``collator`` and what it wraps (``.collator``, ``.data_collator``, ``__wrapped__``), outermost first."""
    found: list[Any] = []
    while collator is not None and len(found) < 4:
        found.append(collator)
        collator = next(
            (getattr(collator, a) for a in ("collator", "data_collator", "__wrapped__") if hasattr(collator, a)), None
        )
    return found


def _packed_sets(trainer: Any) -> list[PackedDataset]:
    eval_sets = trainer.eval_dataset.values() if isinstance(trainer.eval_dataset, dict) else [trainer.eval_dataset]
    return [d for d in (trainer.train_dataset, *eval_sets) if isinstance(d, PackedDataset)]


def check_setup(trainer: Any, telemetry_kwargs: dict[str, Any] | None = None) -> None:
    """Raise, before any data or step, for what `prepare_trainer` can tell is wrong; each error names the setting.

    - packs from `pack_dataset` with transformers', TRL's or torch's own ``data_collator`` (a function of the user's
      is checked on its batches instead: `check_wrapped_collator`);
    - the processor (`pack_dataset`'s, ``processing_class``) of another family than the model, or a tokenizer;
    - packs for a model type `apply_rmpad` does not support;
    - a patched model loaded with an attention implementation the patches do not route (``eager``, flex);
    - ``per_device_train_batch_size`` other than `pack_dataset`'s ``batch_size`` (packs per micro-batch);
    - telemetry's ``max_length`` other than the packs' (``pack_fill`` would be off);
    - packs split for another sequence-parallel size than `apply_rmpad`'s (SP ranks would get different packs).
    """
    from ..collator import VisionCollator
    from ..patches import check_attn_implementation, is_patched, supported_model_types
    from ..patches.sequence_parallel import current_size
    from ..preprocess.checks import check_processor, is_tokenizer

    packs = _packed_sets(trainer)
    model = None if trainer.model is None else unwrap_model(trainer.model)
    config = getattr(model, "config", None)
    collators = _collators(trainer.data_collator)
    if packs and not any(isinstance(c, VisionCollator) for c in collators) and _library_collator(collators[0]):
        name = getattr(collators[0], "__qualname__", type(collators[0]).__name__)
        raise ValueError(
            f"the Trainer's data_collator is {name}, but its dataset is a pack_dataset stream (each item a list of "
            "samples): pass data_collator=VisionCollator(processor, model_config=model.config) to the Trainer (or a "
            "function of yours that returns VisionCollator's batch: prepare_trainer checks each batch it returns)"
        )
    if packs and config is not None and config.model_type not in supported_model_types():
        raise ValueError(
            f"the model is a {config.model_type!r} model; pack_dataset and VisionCollator train "
            f"{supported_model_types()}: load a Qwen-VL checkpoint"
        )
    processors = [(p.processor, "pack_dataset") for p in packs[:1]]
    processors += [(c.processor, "VisionCollator") for c in collators if isinstance(c, VisionCollator)]
    processing_class = getattr(trainer, "processing_class", None)
    if processing_class is not None and not is_tokenizer(processing_class):  # a text trainer's tokenizer is fine
        processors.append((processing_class, "the Trainer's processing_class"))
    for processor, where in processors:
        check_processor(processor, config, where=where)
    if model is not None and is_patched(model):
        check_attn_implementation(config)  # at prepare time, not at the first step after loading everything
    train = trainer.train_dataset if isinstance(trainer.train_dataset, PackedDataset) else None
    asked = trainer.args.per_device_train_batch_size
    if train is not None and asked != train.cfg.batch_size:
        raise ValueError(
            f"per_device_train_batch_size={asked}, but pack_dataset was built with batch_size={train.cfg.batch_size}: "
            f"each item of the stream is one pack of up to max_length={train.cfg.max_length} tokens, so every "
            f"micro-batch would hold {asked} packs. Set per_device_train_batch_size={train.cfg.batch_size} (for more "
            "tokens per step raise max_length or gradient_accumulation_steps), or pack_dataset(..., "
            "batch_size=per_device_train_batch_size)"
        )
    given = (telemetry_kwargs or {}).get("max_length")
    if train is not None and given is not None and given != train.cfg.max_length:
        raise ValueError(
            f"prepare_trainer(max_length={given}) differs from the packs' max_length={train.cfg.max_length}; "
            "leave it out: prepare_trainer reads it from the packed dataset"
        )
    for packed in packs:
        if packed.sequence_parallel_size != current_size():
            raise ValueError(
                f"pack_dataset(sequence_parallel_size={packed.sequence_parallel_size}), but apply_rmpad("
                f"sequence_parallel_size={current_size()}): pass the same size to both, so the ranks of one "
                "sequence-parallel group get the same packs"
            )


def track_training(trainer: Any) -> Any:
    """Record while ``trainer.train()`` runs, so `hf_packing.revert_rmpad` can refuse mid-run. Returns ``trainer``."""
    train = trainer.train

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        training_started(trainer)
        try:
            return train(*args, **kwargs)
        finally:
            training_ended(trainer)

    trainer.train = wrapped
    return trainer


def prepare_trainer(trainer: Any, *, telemetry: bool = True, **telemetry_kwargs: Any) -> Any:
    """`check_setup`, `refuse_liger_kernel`, `check_wrapped_collator`, `keep_rank_packs`, `spread_eval_packs`,
    `no_dispatch`, `reload_checkpoints_with_key_conversion`, `hf_packing.training.evaluation.token_level_evaluation`,
    `track_training` and, unless ``telemetry=False``, `hf_packing.training.telemetry.add_telemetry` (``max_length``
    defaults to the packs'). Returns ``trainer``.

    Forgetting it is loud: a patched forward fed `pack_dataset`'s packs from a loader it did not prepare, or fed
    `VisionCollator` batches that accelerate dispatches, raises at the first step (`hf_packing.patches.prepared`)."""
    from .evaluation import token_level_evaluation

    check_setup(trainer, telemetry_kwargs)
    refuse_liger_kernel(trainer)
    check_wrapped_collator(trainer)
    keep_rank_packs(trainer)
    spread_eval_packs(trainer)  # wraps keep_rank_packs' loaders: the view is unsharded too
    no_dispatch(trainer)
    reload_checkpoints_with_key_conversion(trainer)
    token_level_evaluation(trainer)
    track_training(trainer)
    if telemetry:
        from .telemetry import add_telemetry

        add_telemetry(trainer, **telemetry_kwargs)
    return trainer
