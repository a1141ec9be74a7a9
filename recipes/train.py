"""Packed, padding-free fine-tuning of a Qwen-VL model with the Hugging Face Trainer.

    python recipes/train.py recipes/configs/qwen2_5_vl_3b.yaml                    # a YAML config
    python recipes/train.py recipes/configs/qwen2_5_vl_3b.yaml --max_steps 100    # flags after it override it
    accelerate launch --config_file recipes/accelerate/fsdp2.yaml recipes/train.py recipes/configs/qwen2_5_vl_7b.yaml
    python recipes/train.py --model_name_or_path ... --dataset_path data.jsonl --output_dir out ...   # flags only

Pipeline: local dataset(s) → `pack_dataset` (one pack = one micro-batch, rank-equal) → `VisionCollator`
→ a model patched by `apply_rmpad` before it is loaded → Trainer, with `PackingTelemetry` in front of the
reporting callbacks. Evaluation (``eval_dataset_path`` or ``eval_split``, with ``eval_strategy``) packs the eval rows
the same way and reports a token-level ``eval_loss`` and ``eval_token_accuracy``. See recipes/README.md for launch
lines, FSDP2 / ZeRO notes and resuming.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import HfArgumentParser, Trainer, TrainerCallback, TrainingArguments

from hf_packing import PackingConfig
from hf_packing.config import per_source_flags

logger = logging.getLogger("hf_packing.recipes")

_LM_LINEARS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "checkpoint dir or hub id of a Qwen-VL model"})
    processor_name_or_path: str | None = field(default=None, metadata={"help": "default: model_name_or_path"})
    dtype: str = field(default="bfloat16", metadata={"help": "weights dtype: bfloat16 | float16 | float32 | auto"})
    attn_implementation: str = field(default="sdpa", metadata={"help": "transformers attention for unpatched parts"})
    rmpad: bool = field(default=True, metadata={"help": "apply hf_packing.apply_rmpad (padding-free forward)"})
    attn_backend: str = field(default="auto", metadata={"help": "auto | flash_attn | torch_varlen | reference"})
    dummy_vision: bool = field(
        default=False,
        metadata={"help": "run the vision tower on text-only micro-batches (needed for FSDP / ZeRO-3 / DDP)"},
    )
    loss_chunk_size: int | None = field(default=None, metadata={"help": "rows per linear+CE chunk"})
    sequence_parallel_size: int = field(
        default=1,
        metadata={"help": "split each pack over this many consecutive GPUs (Ulysses); data parallel = world / it"},
    )
    use_liger: bool | None = field(default=None, metadata={"help": "force Liger fused linear CE on/off"})
    freeze_vision_tower: bool = field(default=False, metadata={"help": "requires_grad=False on model.model.visual"})
    use_lora: bool = field(default=False, metadata={"help": "train LoRA adapters (PEFT) instead of all weights"})
    lora_r: int = 64
    lora_alpha: int = 128
    lora_dropout: float = 0.05
    lora_target_modules: str = field(
        default=_LM_LINEARS,
        metadata={"help": "regex (full match) or comma-separated module names; default: LM linears"},
    )


@dataclass
class DataArguments:
    dataset_path: list[str] = field(
        default_factory=list,
        metadata={"help": "json/jsonl/parquet/arrow file(s), globs, dirs of them, or saved datasets dirs"},
    )
    streaming: bool = field(default=False, metadata={"help": "read the data lazily (datasets streaming)"})
    shuffle_seed: int | None = field(default=None, metadata={"help": "shuffle rows first (pack_dataset does not)"})
    eval_dataset_path: list[str] = field(
        default_factory=list, metadata={"help": "eval file(s) or saved datasets dirs, read like dataset_path"}
    )
    eval_split: float = field(
        default=0.0, metadata={"help": "rows held out of each dataset_path for eval: < 1 a fraction, >= 1 a count"}
    )
    collator_mode: str = field(default="rows", metadata={"help": "rows (rmpad patch) | flat (transformers-native)"})


# Every pack_dataset setting comes from PackingConfig (per-source ones: one value, or a list of one per dataset_path).
# `seed` is both PackingConfig's and TrainingArguments': one flag sets both (see parse_args).
PARSER_TYPES = (ModelArguments, DataArguments, PackingConfig, TrainingArguments)


#: TrainingArguments fields renamed inside the supported transformers range (new name -> old name).
_RENAMED = {
    "activation_checkpointing": "gradient_checkpointing",
    "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs",
}


def parse_args(
    argv: list[str] | None = None,
) -> tuple[ModelArguments, DataArguments, PackingConfig, TrainingArguments]:
    """``[config.yaml] [--flag value ...]``: the YAML sets defaults, flags after it override them. A key may be a
    flag's alias (``image_root``: ``media_root``)."""
    import yaml

    argv = list(sys.argv[1:] if argv is None else argv)
    # "resolve": the one `--seed` flag (TrainingArguments', the last) stands for both dataclasses' seed
    parser = per_source_flags(HfArgumentParser(PARSER_TYPES, conflict_handler="resolve"))  # --weights 0.7 0.3
    if argv and argv[0].endswith((".yaml", ".yml")):
        config = yaml.safe_load(Path(argv.pop(0)).read_text()) or {}
        known = {action.dest for action in parser._actions}
        for new, old in _RENAMED.items():  # transformers 5.17 has only the old names, 5.23 prefers the new
            for a, b in ((new, old), (old, new)):
                if a in config and a not in known and b in known:
                    config[b] = config.pop(a)
        aliases = {o.lstrip("-").replace("-", "_"): a.dest for a in parser._actions for o in a.option_strings}
        config = {aliases.get(key, key): value for key, value in config.items()}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"unknown keys in the config file: {unknown}")
        parser.set_defaults(**config)
        for action in parser._actions:  # a value from the YAML satisfies a required flag
            action.required = action.required and action.dest not in config
    namespace = vars(parser.parse_args(argv))
    return tuple(  # like parse_args_into_dataclasses, but a name two dataclasses share reaches both
        cls(**{f.name: namespace[f.name] for f in dataclasses.fields(cls) if f.init and f.name in namespace})
        for cls in PARSER_TYPES
    )


def prepare_training_args(args: TrainingArguments) -> TrainingArguments:
    """Settings packed, variable-shape batches need, whatever the config says."""
    if args.per_device_train_batch_size != 1:
        logger.warning(
            "per_device_train_batch_size=%d overridden to 1: a pack is the batch; raise "
            "max_length or gradient_accumulation_steps instead",
            args.per_device_train_batch_size,
        )
        args.per_device_train_batch_size = 1
    args.remove_unused_columns = False  # samples carry pixel_values, grids, mm_token_type_ids
    # Every rank reads its own packs (pack_dataset splits by rank); batches differ in shape, so rank 0
    # must not read and broadcast them (dispatch) nor split one batch across ranks.
    args.accelerator_config.dispatch_batches = False
    args.accelerator_config.split_batches = False
    # The DataLoader pins every tensor of the collator's batch (dataloader_pin_memory, on by default; the nested
    # vision_inputs too); from pinned memory the batch's host-to-device copies can run without the host waiting.
    args.accelerator_config.non_blocking = bool(args.dataloader_pin_memory)
    if args.max_steps <= 0:
        raise ValueError("set max_steps: a packed stream has no length, so num_train_epochs cannot define the run")
    return args


class SettingError(ValueError):
    """A setting the run cannot start with; run as a script, train.py reports it in one line (no traceback)."""


def check_data_paths(data_args: DataArguments) -> None:
    """Every ``dataset_path`` / ``eval_dataset_path`` entry exists (a file, a directory, a glob that matches), checked
    before the processor or the model loads; a missing one is a `SettingError` naming the setting, with the closest
    names in its folder."""
    for setting in ("dataset_path", "eval_dataset_path"):
        for path in getattr(data_args, setting):
            if any(ch in path for ch in "*?[") and glob.glob(path, recursive=True) or Path(path).exists():
                continue
            parent = Path(path).parent
            near = difflib.get_close_matches(Path(path).name, os.listdir(parent) if parent.is_dir() else [], n=3)
            hint = f"; did you mean {', '.join(repr(str(parent / n)) for n in near)}?" if near else ""
            raise SettingError(
                f"{setting}: {path!r} does not exist (relative to {os.getcwd()}){hint} "
                "(a local json/jsonl/parquet/arrow file, a glob or directory of them, or a save_to_disk dir)"
            )


def load_one(path: str, *, streaming: bool) -> Any:
    """A saved ``datasets`` dir or local data files (a file, glob or directory of them), split ``train``."""
    from hf_packing.packing.readers import load_local

    return load_local(path, streaming=streaming)


#: PackingConfig settings that take one value per source
PER_SOURCE = ("media_root", "video_root", "fps", "videos_kwargs", "row_format", "weights")


def for_every_source(value: Any) -> Any:
    """The value a per-source setting gives every source: itself, or the entry of a one-element list; `None` (the
    setting's default) when it differs per source."""
    if isinstance(value, (list, tuple)):
        return value[0] if len(value) == 1 else None
    return None if isinstance(value, dict) else value


def hold_out(ds: Any, split: float, *, seed: int) -> tuple[Any, Any]:
    """(train rows, eval rows): ``split`` rows (>= 1) or a fraction (< 1, map-style only) held out of ``ds``."""
    import datasets

    if not isinstance(ds, datasets.IterableDataset):
        if split >= len(ds):
            raise ValueError(f"eval_split={split:g} would hold out all {len(ds)} rows of a dataset_path; lower it")
        parts = ds.train_test_split(test_size=split if split < 1 else int(split), seed=seed)
        return parts["train"], parts["test"]
    if split < 1:
        raise ValueError(
            f"eval_split={split} is a fraction, which a streaming dataset has no length for; "
            "give a number of rows (eval_split >= 1)"
        )
    return ds.skip(int(split)), ds.take(int(split))


def eval_sources(sources: dict[str, Any], data_args: DataArguments, *, seed: int) -> dict[str, Any]:
    """``{name: eval rows}``: each ``eval_dataset_path`` (named ``eval<i>:<stem>``), or ``eval_split`` rows held out
    of every training source, under the source's own name (so its media_root / row_format apply); the training
    source keeps the rest."""
    if data_args.eval_dataset_path and data_args.eval_split:
        raise ValueError("set eval_dataset_path or eval_split, not both")
    held = {
        f"eval{i}:{Path(path).stem}": load_one(path, streaming=data_args.streaming)
        for i, path in enumerate(data_args.eval_dataset_path)
    }
    if data_args.eval_split:
        for name, ds in sources.items():
            sources[name], held[name] = hold_out(ds, data_args.eval_split, seed=seed)
    return held


def one_or_mix(sources: dict[str, Any]) -> Any:
    """What `pack_dataset` takes: the dataset itself when there is one, else the ``{name: dataset}`` mix."""
    return next(iter(sources.values())) if len(sources) == 1 else sources


def pack_eval(
    pack: Callable[..., Any], held_out: dict[str, Any], config: PackingConfig, *, split: bool, batch_size: int
) -> Any:
    """`pack_dataset` (``pack``, with ``config``) for the eval rows: every row once (a mix is not oversampled, its
    weights do not apply) and every pack once on any number of processes (``leftovers="spread"``). Rows held out
    (``split``) keep their source's settings; eval files take the settings given once for all sources."""
    per_source = {} if split else {k: for_every_source(getattr(config, k)) for k in PER_SOURCE}
    return pack(
        one_or_mix(held_out),
        config=config,
        **{**per_source, "weights": None},
        batch_size=batch_size,
        stopping_strategy="all_exhausted_without_replacement",
        leftovers="spread",
    )


def load_model(model_args: ModelArguments):
    """Patch (before loading, as `apply_rmpad` patches classes), load, then freeze / wrap in LoRA."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    import hf_packing

    config = AutoConfig.from_pretrained(model_args.model_name_or_path)
    if model_args.rmpad:
        hf_packing.apply_rmpad(
            config.model_type,
            attn_backend=model_args.attn_backend,
            dummy_vision=model_args.dummy_vision,
            loss_chunk_size=model_args.loss_chunk_size,
            use_liger=model_args.use_liger,
            sequence_parallel_size=model_args.sequence_parallel_size,
        )
    dtype = model_args.dtype if model_args.dtype == "auto" else getattr(torch, model_args.dtype)
    model = AutoModelForImageTextToText.from_pretrained(
        model_args.model_name_or_path, dtype=dtype, attn_implementation=model_args.attn_implementation
    )
    model.config.use_cache = False
    if model_args.freeze_vision_tower:
        model.model.visual.requires_grad_(False)  # the ViT and its merger; the LLM still trains
    if model_args.use_lora:
        from peft import LoraConfig, get_peft_model

        targets = model_args.lora_target_modules
        lora = LoraConfig(
            r=model_args.lora_r,
            lora_alpha=model_args.lora_alpha,
            lora_dropout=model_args.lora_dropout,
            target_modules=targets.split(",") if "," in targets else targets,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
        model.print_trainable_parameters()
    return model


#: what ``accelerate launch`` exports for a config's ``distributed_type`` -> the Trainer's flag that says it engaged
ENGINES = {
    "ACCELERATE_USE_FSDP": ("FSDP", "is_fsdp_enabled"),
    "ACCELERATE_USE_DEEPSPEED": ("DeepSpeed", "is_deepspeed_enabled"),
}


def check_engine(trainer: Trainer) -> None:
    """Refuses a silent engine fallback: when the launch asked for FSDP or DeepSpeed (``accelerate launch`` exports
    ``ACCELERATE_USE_FSDP`` / ``ACCELERATE_USE_DEEPSPEED`` from the config) and the Trainer's accelerator did not
    engage it, a `SettingError` before training. accelerate engages FSDP only on GPU-like devices and DeepSpeed
    only without ``use_cpu``; otherwise it runs plain DDP (or one process) unsharded, without a word."""
    for variable, (engine, engaged) in ENGINES.items():
        if os.environ.get(variable, "false").lower() == "true" and not getattr(trainer, engaged):
            raise SettingError(
                f"the accelerate config asks for {engine} ({variable}=true) but the Trainer would run "
                f"{trainer.accelerator.distributed_type.value} (device {trainer.args.device}, use_cpu="
                f"{trainer.args.use_cpu}): accelerate engages FSDP on GPU-like devices only and DeepSpeed only "
                "without use_cpu; launch on GPUs, or use recipes/accelerate/ddp.yaml for CPU processes"
            )


class EngineReport(TrainerCallback):
    """Prints `engine_report` on every rank when training begins (the model is wrapped then), one JSON line each."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        sys.stdout.write(f"hf_packing engine: {json.dumps(engine_report(self.trainer))}\n")  # one write: ranks
        sys.stdout.flush()  # share the launcher's stdout, and print() writes the line and its end separately


def engine_report(trainer: Trainer) -> dict[str, Any]:
    """What the engine did to the parameters, read on this rank once training has wrapped the model: the
    distributed type, the ZeRO stage, and the parameters' elements held here (``local``: a ZeRO-3 partition, an
    FSDP2 DTensor's shard) against the whole model's (``full``: ``ds_numel``, the DTensor's global shape)."""
    from torch.distributed.tensor import DTensor

    model = trainer.model
    local = full = dtensors = 0
    for p in model.parameters():
        is_dtensor = isinstance(p, DTensor)
        dtensors += is_dtensor
        local += (p.to_local() if is_dtensor else getattr(p, "ds_tensor", p)).numel()  # ZeRO-3: its partition
        full += int(getattr(p, "ds_numel", p.numel()))
    engine = trainer.model_wrapped
    stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else None
    return {
        "distributed_type": trainer.accelerator.distributed_type.value,
        "zero_stage": stage,
        "dtensor_params": dtensors,
        "local_numel": local,
        "full_numel": full,
        "rank": trainer.args.process_index,
        "world_size": trainer.args.world_size,
    }


def main(argv: list[str] | None = None) -> Trainer:
    from transformers import AutoConfig, AutoProcessor

    from hf_packing import VisionCollator, end_distributed, prepare_trainer
    from hf_packing.packing.balance import WorkCost
    from hf_packing.packing.dataset import pack_dataset

    model_args, data_args, packing, training_args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if training_args.should_log else logging.WARNING)
    training_args = prepare_training_args(training_args)
    if not data_args.dataset_path:
        raise SettingError("set dataset_path (one or more local files / saved datasets dirs)")
    check_data_paths(data_args)  # a mistyped path fails here, before anything loads
    weights = packing.weights
    if isinstance(weights, (list, dict)) and len(weights) != len(data_args.dataset_path):
        raise SettingError(f"{len(weights)} weights for {len(data_args.dataset_path)} dataset_path entries")

    processor = AutoProcessor.from_pretrained(model_args.processor_name_or_path or model_args.model_name_or_path)
    sources = {}
    for i, path in enumerate(data_args.dataset_path):  # name -> rows; pack_dataset mixes a dict by `weights`
        ds = load_one(path, streaming=data_args.streaming)
        if data_args.shuffle_seed is not None:
            ds = ds.shuffle(seed=data_args.shuffle_seed)
        sources[f"{i}:{Path(path).stem}"] = ds
    held_out = eval_sources(sources, data_args, seed=training_args.seed)
    if not held_out and training_args.eval_strategy != "no":
        raise ValueError(
            f"eval_strategy={training_args.eval_strategy.value!r} needs eval data: set eval_dataset_path or eval_split"
        )
    pack = partial(
        pack_dataset,
        processor=processor,
        model_config=WorkCost.from_config(
            AutoConfig.from_pretrained(model_args.model_name_or_path),
            vision_trainable=not model_args.freeze_vision_tower,
        ),  # ranks balanced on this model's text and vision work
        rank=training_args.process_index // model_args.sequence_parallel_size,
        world_size=training_args.world_size // model_args.sequence_parallel_size,
        sequence_parallel_size=model_args.sequence_parallel_size,  # SP ranks share their packs
    )
    # per-source lists follow dataset_path's order, the order of `sources`
    packs = pack(
        one_or_mix(sources), config=packing, batch_size=training_args.per_device_train_batch_size
    )  # a source that yields nothing raises NoSamplesError: no model is saved
    eval_packs = (
        None
        if not held_out
        else pack_eval(
            pack,
            held_out,
            packing,
            split=bool(data_args.eval_split),
            batch_size=training_args.per_device_eval_batch_size,
        )
    )
    model = load_model(model_args)
    collator = VisionCollator(processor, mode=data_args.collator_mode, model_config=model.config)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=packs,
        eval_dataset=eval_packs,
        data_collator=collator,
        processing_class=processor,
    )
    prepare_trainer(trainer, max_length=packing.max_length)  # keep each rank's packs; telemetry before reporters
    check_engine(trainer)  # FSDP / DeepSpeed asked for and not engaged: stop here, not after an unsharded run
    trainer.add_callback(EngineReport(trainer))
    resume = training_args.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=True if resume in ("true", "True", "last") else resume)
    if trainer.is_fsdp_enabled:  # sharded checkpoints resume fast; the final model is one consolidated copy
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model()
    trainer.save_state()  # trainer_state.json: the full-precision log history next to the model
    logger.info("packing stats: %s", packs.stats(log=False))
    end_distributed()  # every rank: barrier, then destroy the process group (no SIGABRT at interpreter exit)
    return trainer


if __name__ == "__main__":
    try:
        main()
    except SettingError as error:  # a setting to fix, not a bug: one line, exit status 1
        sys.exit(f"train.py: {error}")
    from hf_packing import end_process

    end_process()  # skip interpreter finalization (where a late C++ thread can still abort), like multiprocessing
