"""Packed, padding-free fine-tuning of a Qwen-VL model with the Hugging Face Trainer.

    python recipes/train.py recipes/configs/qwen2_5_vl_3b.yaml                    # a YAML config
    python recipes/train.py recipes/configs/qwen2_5_vl_3b.yaml --max_steps 100    # flags after it override it
    accelerate launch --config_file recipes/accelerate/fsdp2.yaml recipes/train.py recipes/configs/qwen2_5_vl_7b.yaml
    python recipes/train.py --model_name_or_path ... --dataset_path data.jsonl --output_dir out ...   # flags only
    python recipes/train.py CONFIG --dataset_name org/name --dataset_config c   # TRL's names: a Hub id or local dir

Pipeline: local files or a dataset by name → `pack_dataset` (one pack = one micro-batch, rank-equal) →
`VisionCollator` → a model patched by `apply_rmpad` before it is loaded → Trainer, with `PackingTelemetry` in front of
the reporting callbacks. Evaluation (``eval_dataset_path``, ``eval_split`` or dataset_name's test split, with
``eval_strategy``) packs the eval rows the same way and reports a token-level ``eval_loss`` and
``eval_token_accuracy``. See recipes/README.md for launch lines, FSDP2 / ZeRO notes and resuming.
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
    gpu_memory_gib: float | None = field(
        default=None,
        metadata={
            "help": "GPU memory: gradient checkpointing turns on when the largest pack needs it (the memory model of "
            "`hf-packing stats`); unset: gradient_checkpointing as set"
        },
    )
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
    # TRL's ScriptArguments names and meanings (dataset_streaming is `streaming`'s alias)
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "a Hub dataset id (datasets.load_dataset; offline: from the cache) or a local dataset directory "
            "(save_to_disk, or data files); instead of dataset_path"
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "dataset_name's configuration (subset)"})
    dataset_train_split: str = field(default="train", metadata={"help": "dataset_name's split to train on"})
    dataset_test_split: str = field(
        default="test",
        metadata={"help": "dataset_name's split to evaluate on (with eval_strategy, unless eval_split / eval files)"},
    )
    streaming: bool = field(
        default=False,
        metadata={"help": "read the data lazily (datasets streaming)", "aliases": ["--dataset_streaming"]},
    )
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


#: LLaMA-Factory's YAML keys (its hparams/*_args.py) that are not settings here, and what to write instead. None is
#: taken as an alias: each differs somewhere (LLaMA-Factory's val_size splits the mixed data, media_dir defaults to
#: dataset_dir, cutoff_len cuts where max_length drops), so the user rewrites the line knowingly.
LLAMA_FACTORY_KEYS = {
    "cutoff_len": "max_length (the token budget of a pack; a longer sample is dropped or cut: on_overlong)",
    "dataset": "dataset_path (local files or saved datasets dirs) or dataset_name (a Hub id or dataset directory); "
    "names from LLaMA-Factory's dataset_info.json are not read",
    "dataset_dir": "dataset_path (its files or directories) or dataset_name",
    "eval_dataset": "eval_dataset_path (or dataset_test_split of dataset_name)",
    "val_size": "eval_split (< 1 a fraction, >= 1 a count, held out of each dataset_path)",
    "media_dir": "media_root",
    "finetuning_type": "use_lora: true for 'lora' (omit it for 'full'; freeze_vision_tower: true freezes the ViT)",
    "lora_rank": "lora_r",
    "lora_target": "lora_target_modules (a regex or comma-separated module names; default: the LM's linears, "
    "as 'all' minus the vision tower)",
    "template": "nothing: every row is rendered by the checkpoint's own chat template (remove it)",
    "stage": "nothing: train.py does SFT (remove it)",
    "packing": "nothing: packing is always on (remove it)",
    "neat_packing": "nothing: packed samples never attend to each other (remove it)",
    "interleave_probs": "weights (one per dataset_path)",
    "mix_strategy": "stopping_strategy",
    "train_on_prompt": "train_on: all",
    "preprocessing_num_workers": "index_num_proc",
    "flash_attn": "attn_backend (auto | flash_attn | torch_varlen | reference)",
    "image_max_pixels": "the processor's max_pixels: save a processor loaded with max_pixels=N and set "
    "processor_name_or_path to it (max_image_pixels is a different setting: the size above which an image is skipped)",
    "image_min_pixels": "the processor's min_pixels, as image_max_pixels",
    "video_max_pixels": 'videos_kwargs: {"max_pixels": N}',
    "video_min_pixels": 'videos_kwargs: {"min_pixels": N}',
    "video_fps": 'videos_kwargs: {"fps": N}',
    "video_maxlen": 'videos_kwargs: {"max_frames": N}',
    "warmup_ratio": "warmup_steps (a float below 1 is a ratio of the run)",
    "max_samples": "nothing here: select the rows first (remove it)",
    "overwrite_cache": "nothing here (remove it)",
    "overwrite_output_dir": "nothing here (remove it)",
    "plot_loss": "nothing here (remove it); `hf-packing plot` draws a run's curves",
    "trust_remote_code": "nothing here (remove it)",
    "tokenized_path": "nothing here (remove it): rows are tokenised in the DataLoader workers",
    "mask_history": "nothing here (remove it): every assistant turn is supervised",
    "enable_liger_kernel": "use_liger",
    "disable_gradient_checkpointing": "gradient_checkpointing: false",
    "freeze_multi_modal_projector": "nothing: freeze_vision_tower freezes the ViT with its merger (the projector)",
    "compute_accuracy": "nothing: evaluation always reports eval_token_accuracy (remove it)",
    "quantization_bit": "nothing: no quantized (QLoRA) training here (remove it)",
    "adapter_name_or_path": "nothing: train.py starts new adapters (remove it)",
}
#: LLaMA-Factory's defaults that differ from this recipe's, for the keys a LLaMA-Factory file usually leaves out
LLAMA_FACTORY_DEFAULTS = (
    "defaults that differ: LLaMA-Factory trains LoRA unless told otherwise, this recipe all weights unless use_lora: "
    "true; freeze_vision_tower is true there, false here; lora_alpha is 2 x lora_rank there, 128 here; lora_dropout "
    "is 0 there, 0.05 here"
)
#: settings named as in LLaMA-Factory whose meaning differs here
LLAMA_FACTORY_SAME_NAME = {
    "buffer_size": "buffer_size here is the packer's planning window in rows, not a streaming shuffle buffer "
    "(shuffle_seed shuffles the rows)",
}


def unknown_keys_message(unknown: list[str], given: Any, known: Any) -> str:
    """The error for `unknown` keys of a config file (`given`: all its keys; `known`: the settings): LLaMA-Factory's
    keys each with the setting to write instead, the rest with the closest settings' names."""
    lf = [k for k in unknown if k in LLAMA_FACTORY_KEYS]
    other = [k for k in unknown if k not in LLAMA_FACTORY_KEYS]
    parts = []
    if other:
        near = {k: difflib.get_close_matches(k, sorted(known), n=1) for k in other}
        hint = ", ".join(f"{k} -> {m[0]}?" for k, m in near.items() if m)
        parts.append(f"unknown keys in the config file: {other}" + (f" (closest: {hint})" if hint else ""))
    if lf:
        notes = [f"{k} -> {LLAMA_FACTORY_KEYS[k]}" for k in lf]
        notes += [note for k, note in LLAMA_FACTORY_SAME_NAME.items() if k in given]
        notes.append(LLAMA_FACTORY_DEFAULTS)
        parts.append(
            f"LLaMA-Factory keys in the config file, and what to write instead: {'; '.join(notes)} "
            "(docs/recipes.md, 'From LLaMA-Factory')"
        )
    return ". ".join(parts)


#: settings that stand for each other: a command-line flag for one drops the other's value from the YAML
_ALTERNATIVES = (("dataset_path", "dataset_name"),)


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
            raise SettingError(unknown_keys_message(unknown, config, known))
        flags = {arg.split("=")[0].lstrip("-").replace("-", "_") for arg in argv if arg.startswith("--")}
        for pair in _ALTERNATIVES:  # `--dataset_name X` after a YAML with dataset_path trains on X alone
            for a, b in (pair, pair[::-1]):
                if a in flags and b not in flags:
                    config.pop(b, None)
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
        raise SettingError("set max_steps: a packed stream has no length, so num_train_epochs cannot define the run")
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


def load_named(data_args: DataArguments, split_setting: str) -> Any:
    """The split named by ``split_setting`` (``dataset_train_split`` / ``dataset_test_split``) of ``dataset_name``, as
    TRL's scripts load it: a ``save_to_disk`` directory with ``load_from_disk`` (a saved `Dataset` is its train split),
    else ``datasets.load_dataset(dataset_name, dataset_config)`` (a local directory of data files, or a Hub id: from the
    cache when offline). A name that cannot be loaded, a missing split or config is a `SettingError` naming the
    setting and what to do."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    name, config, split = data_args.dataset_name, data_args.dataset_config, getattr(data_args, split_setting)
    assert name is not None
    path = Path(name)
    if path.is_file():
        raise SettingError(f"dataset_name: {name!r} is a file; data files go in dataset_path (or their directory here)")
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        found = datasets.load_from_disk(str(path))
        if isinstance(found, datasets.Dataset):  # one saved split, no name: it trains
            if split_setting != "dataset_train_split":
                raise SettingError(
                    f"{split_setting}={split!r}: dataset_name {name!r} is a saved Dataset (one split, for training); "
                    "save a DatasetDict, or set eval_split or eval_dataset_path"
                )
            found = datasets.DatasetDict({split: found})
    else:
        try:
            found = datasets.load_dataset(name, config, streaming=data_args.streaming)
        except (ConnectionError, FileNotFoundError, DatasetNotFoundError) as err:
            why = str(err).splitlines()[0] if str(err) else type(err).__name__
            if path.is_dir():
                raise SettingError(
                    f"dataset_name: {name!r} is a directory that datasets cannot read as a dataset ({why}); give a "
                    "save_to_disk directory or one of data files (json/jsonl/parquet/arrow, or an image folder)"
                ) from None
            raise SettingError(
                f"dataset_name: {name!r} is not a local dataset directory and cannot be loaded ({why}); download it "
                "once with network access (it is then read from the cache offline), or pass a local directory "
                "(save_to_disk or data files) as dataset_name, or files as dataset_path"
            ) from None
        except ValueError as err:
            if config is None or "config" not in str(err).lower():
                raise
            raise SettingError(f"dataset_config={config!r} is not a configuration of {name!r}: {err}") from None
    if split not in found:
        raise SettingError(f"{split_setting}={split!r} is not a split of {name!r} (splits: {sorted(found)})")
    ds = found[split]
    return ds.to_iterable_dataset() if data_args.streaming and isinstance(ds, datasets.Dataset) else ds


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


def choose_checkpointing(model_args: ModelArguments, packing: PackingConfig, args: TrainingArguments) -> None:
    """With ``gpu_memory_gib``: turn gradient checkpointing on when the predicted peak of the largest pack needs it
    (`hf_packing.cli.stats.predict_peak`: bf16, AdamW, one GPU); a setting already on stays on; a pack that fits in
    neither mode is a `SettingError`."""
    from transformers import AutoConfig

    from hf_packing.cli.stats import checkpointing_needed, format_peak, predict_peak

    if model_args.gpu_memory_gib is None:
        return
    config = AutoConfig.from_pretrained(model_args.model_name_or_path)
    peak = predict_peak(config, packing, vision_trainable=not model_args.freeze_vision_tower)
    needed = checkpointing_needed(peak, model_args.gpu_memory_gib)
    logger.info(format_peak(peak, model_args.gpu_memory_gib))
    if needed is None:
        raise SettingError(
            f"the largest pack (max_length={packing.max_length}, max_vision_patches={packing.max_vision_patches}) "
            f"does not fit gpu_memory_gib={model_args.gpu_memory_gib:g} even with gradient checkpointing: lower them"
        )
    if needed and not args.gradient_checkpointing:
        args.gradient_checkpointing = True
        if hasattr(args, "activation_checkpointing"):  # transformers 5.23's name, which the Trainer reads
            args.activation_checkpointing = True


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

    from hf_packing import VisionCollator, WorkCost, end_distributed, pack_dataset, prepare_trainer

    model_args, data_args, packing, training_args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if training_args.should_log else logging.WARNING)
    training_args = prepare_training_args(training_args)
    if data_args.dataset_path and data_args.dataset_name:
        raise SettingError("set dataset_path (local files) or dataset_name (a Hub id or dataset directory), not both")
    if not data_args.dataset_path and not data_args.dataset_name:
        raise SettingError(
            "set dataset_name (a Hub id or local dataset directory) or dataset_path (local files / saved datasets dirs)"
        )
    check_data_paths(data_args)  # a mistyped path fails here, before anything loads
    choose_checkpointing(model_args, packing, training_args)
    names = data_args.dataset_path or [data_args.dataset_name]
    weights = packing.weights
    if isinstance(weights, (list, dict)) and len(weights) != len(names):
        raise SettingError(f"{len(weights)} weights for {len(names)} dataset_path entries")

    sources = {}  # name -> rows; pack_dataset mixes a dict by `weights`
    for i, path in enumerate(names):
        ds = (
            load_named(data_args, "dataset_train_split")
            if data_args.dataset_name
            else load_one(path, streaming=data_args.streaming)
        )
        if data_args.shuffle_seed is not None:
            ds = ds.shuffle(seed=data_args.shuffle_seed)
        sources[f"{i}:{Path(path).stem}"] = ds
    held_out = eval_sources(sources, data_args, seed=training_args.seed)
    if not held_out and data_args.dataset_name and training_args.eval_strategy != "no":  # TRL: the test split
        held_out = {f"eval:{data_args.dataset_test_split}": load_named(data_args, "dataset_test_split")}
    if not held_out and training_args.eval_strategy != "no":
        raise SettingError(
            f"eval_strategy={training_args.eval_strategy.value!r} needs eval data: set eval_dataset_path or eval_split"
        )
    processor = AutoProcessor.from_pretrained(model_args.processor_name_or_path or model_args.model_name_or_path)
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
