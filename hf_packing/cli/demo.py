"""``hf-packing demo``: the whole stack on CPU, end to end, in minutes.

Generates a multimodal dataset on disk, saves a tiny random Qwen2.5-VL (or another family: ``model_type``) and
its processor and loads them back with ``from_pretrained`` (the loading code a real checkpoint uses), packs at 2048
tokens, patches
the model with `apply_rmpad` and trains with the HF Trainer and `VisionCollator`. The rows are a two-source mix,
``images`` (rows with an image or video) and ``text`` (text-only), named by a ``source`` column
(``pack_dataset(source_column="source")``); the last ``eval_fraction`` of them is the eval set. Prints a summary and
writes ``packs.png``, ``loss.png`` and ``curves.png`` (loss and token accuracy, overall and per source, training and
evaluation: `hf-packing plot`). Every step can point at the user's own model, processor and data.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..config import PackingConfig

logger = logging.getLogger(__name__)


#: the demo's packing settings where they differ from PackingConfig's defaults: short packs for a CPU run
DEMO_MAX_LENGTH = 2048


@dataclass
class DemoConfig:
    output_dir: Path
    model: str | None = None  # a local checkpoint dir; default: a tiny random `model_type` saved here
    model_type: str = "qwen2_5_vl"  # the tiny model's family when `model` is not given
    processor: str | None = None  # default: the model dir
    dataset: str | None = None  # a saved datasets dir or json/jsonl/parquet; default: generated here
    num_samples: int = 320
    epochs: int = 2
    learning_rate: float = 3e-3
    eval_fraction: float = 0.1  # the last rows, evaluated 4 times during training (0: no evaluation)
    #: how the data is packed; its `seed` also seeds the model, the generated data and training
    packing: PackingConfig = field(default_factory=lambda: PackingConfig(max_length=DEMO_MAX_LENGTH))


def _prepare(cfg: DemoConfig) -> tuple[str, str, str]:
    from ..testing.synthetic import save_synthetic_dataset
    from ..testing.tiny import save_tiny_checkpoint

    out = cfg.output_dir
    model_dir = cfg.model or str(out / f"tiny-{cfg.model_type}")
    if cfg.model is None and not (Path(model_dir) / "config.json").exists():
        save_tiny_checkpoint(cfg.model_type, model_dir, seed=cfg.packing.seed)
    data_dir = cfg.dataset or str(out / "data")
    if cfg.dataset is None and not (Path(data_dir) / "dataset_info.json").exists():
        save_synthetic_dataset(data_dir, cfg.num_samples, seed=cfg.packing.seed)
    return model_dir, cfg.processor or model_dir, data_dir


def load_any_dataset(path: str):
    """A saved ``datasets`` dir or local json/jsonl/parquet/arrow files (a file, glob or directory of them)."""
    from ..packing.readers import load_local

    return load_local(path)


def with_sources(ds):
    """``(ds, column)``: ``ds`` with a ``source`` column, ``"images"`` where a row has an image or video and ``"text"``
    elsewhere (kept if ``ds`` has one), or ``(ds, None)`` when its rows are all of one kind."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if "source" in ds.column_names:
        return ds, "source"
    media = [c for c in ("images", "image", "videos", "video") if c in ds.column_names]
    has = pa.array([False] * len(ds))
    table = ds.select_columns(media).with_format("arrow")[:] if media else pa.table({})
    for column in media:
        values = table.column(column)
        listed = pa.types.is_list(values.type) or pa.types.is_large_list(values.type)
        present = pc.greater(pc.list_value_length(values), 0) if listed else pc.is_valid(values)
        has = pc.or_(has, pc.fill_null(present, False))
    kinds = ["images" if x else "text" for x in has.to_pylist()]
    return (ds.add_column("source", kinds), "source") if len(set(kinds)) == 2 else (ds, None)


def run_demo(cfg: DemoConfig) -> dict:
    """Run the demo; returns the summary dict it prints."""
    from .._compat import require_extra

    require_extra("cli", "matplotlib", purpose="hf-packing demo (it draws its pictures after training)")
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor, Trainer, TrainingArguments

    from .. import VisionCollator, apply_rmpad, pack_dataset, prepare_trainer
    from ..packing.stats import PADDED_BATCH, padded_fill_at_batch
    from .plots import plot_curves, plot_loss, plot_packs

    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.packing.seed)
    model_dir, processor_dir, data_dir = _prepare(cfg)
    processor = AutoProcessor.from_pretrained(processor_dir)
    dataset, source_column = with_sources(load_any_dataset(data_dir))
    n_eval = int(len(dataset) * cfg.eval_fraction)
    eval_rows = dataset.select(range(len(dataset) - n_eval, len(dataset)))
    dataset = dataset.select(range(len(dataset) - n_eval))

    started = time.perf_counter()
    source_column = cfg.packing.source_column or source_column
    packed = pack_dataset(dataset, processor, cfg.packing, source_column=source_column)
    # evaluation covers every eval pack once by itself (prepare_trainer), whatever `leftovers` says
    evaluated = (
        pack_dataset(eval_rows, processor, cfg.packing, source_column=cfg.packing.source_column or source_column)
        if n_eval
        else None
    )
    pack_ids = [[(sample["index"], sample["num_tokens"]) for sample in pack] for pack in packed]  # one pass
    packs = [[n for _, n in pack] for pack in pack_ids]
    in_order = [n for _, n in sorted(s for pack in pack_ids for s in pack)]  # a padded run sees dataset order
    plan_seconds = time.perf_counter() - started
    if not packs:
        raise RuntimeError(f"no packs from {data_dir}: every sample was dropped or skipped ({packed.stats()})")

    apply_rmpad(attn_backend="auto")
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    args = TrainingArguments(
        output_dir=str(cfg.output_dir / "trainer"),
        per_device_train_batch_size=1,
        max_steps=cfg.epochs * len(packs),
        learning_rate=cfg.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=5,
        logging_steps=1,
        eval_strategy="steps" if evaluated is not None else "no",
        eval_steps=max(1, cfg.epochs * len(packs) // 4),
        per_device_eval_batch_size=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        seed=cfg.packing.seed,
        disable_tqdm=False,
    )
    collator = VisionCollator(processor, model_config=model.config)
    trainer = prepare_trainer(
        Trainer(model=model, args=args, train_dataset=packed, eval_dataset=evaluated, data_collator=collator),
        max_length=cfg.packing.max_length,
    )
    started = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - started
    trainer.save_state()  # trainer_state.json, for `hf-packing plot`

    history = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    real_tokens = sum(map(sum, packs))
    summary = {
        "samples": sum(map(len, packs)),
        "packs": len(packs),
        "fill ratio": real_tokens / (len(packs) * cfg.packing.max_length),
        "padding avoided": 1 - padded_fill_at_batch(in_order, PADDED_BATCH),  # same samples, same tokens
        "real tokens/s": cfg.epochs * real_tokens / train_seconds,
        "loss first -> last": (history[0][1], _tail_mean(history)),
        "plan seconds": plan_seconds,
        "train seconds": train_seconds,
        "dropped/skipped": dict(packed.stats(log=False)["skipped"]),  # overlong drops are a skip reason
        "per-source loss (last log)": {
            name: next(h[f"loss/{name}"] for h in reversed(trainer.state.log_history) if f"loss/{name}" in h)
            for name in packed.source_names
            if any(f"loss/{name}" in h for h in trainer.state.log_history)
        },
    }
    plot_packs(pack_ids, cfg.output_dir / "packs.png", max_length=cfg.packing.max_length)
    plot_loss([s for s, _ in history], [loss for _, loss in history], cfg.output_dir / "loss.png")
    plot_curves(trainer.state.log_history, cfg.output_dir / "curves.png")
    print(format_summary(summary, cfg.output_dir))
    return summary


def _tail_mean(history: list[tuple[int, float]], n: int = 5) -> float:
    tail = [loss for _, loss in history[-n:]]
    return sum(tail) / len(tail)


def format_summary(summary: dict, output_dir: Path) -> str:
    first, last = summary["loss first -> last"]
    per_source = ", ".join(f"{k}: {v:.3f}" for k, v in summary["per-source loss (last log)"].items())
    rows = [
        ("samples", f"{summary['samples']}"),
        ("packs", f"{summary['packs']}"),
        ("fill ratio", f"{summary['fill ratio']:.3f}"),
        ("padding avoided vs padded batches of 8", f"{summary['padding avoided']:.1%}"),
        ("real tokens/s (training)", f"{summary['real tokens/s']:,.0f}"),
        ("loss first -> last (mean of last 5)", f"{first:.3f} -> {last:.3f}"),
        ("dropped / skipped", ", ".join(f"{k}: {v}" for k, v in summary["dropped/skipped"].items()) or "none"),
        ("loss per source (last log)", per_source or "one source"),
        ("pictures", ", ".join(str(output_dir / f) for f in ("packs.png", "loss.png", "curves.png"))),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["", "hf_packing demo", "-" * (width + 30)] + [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)
