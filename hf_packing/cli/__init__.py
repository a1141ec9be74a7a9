"""``hf-packing``: ``demo`` (train a tiny model end to end on CPU), ``stats`` (packing statistics from metadata) and
``plot`` (loss and token accuracy curves, overall and per source, of a Trainer run).

Owns: the command line and its pictures (`plots`). May import: every part of the package (the top layer).

Files:
    __main__.py  `python -m hf_packing.cli`
    demo.py      `hf-packing demo`: generate, pack (images / text sources), patch, train, evaluate, draw
    stats.py     `hf-packing stats`: per-strategy packing statistics from metadata (flags: PackingConfig's)
    plots.py     packs.png, loss.png, `hf-packing plot` curves and the stats histogram (matplotlib: `cli` extra)
"""

from __future__ import annotations

import argparse
import logging
import sys
from argparse import ArgumentDefaultsHelpFormatter
from pathlib import Path
from typing import Any

from ..config import PackingConfig, per_source_flags
from ..testing.tiny import MODEL_TYPES


def _parser() -> argparse.ArgumentParser:
    from transformers import HfArgumentParser

    from .demo import DEMO_MAX_LENGTH, DemoConfig

    parser = argparse.ArgumentParser(prog="hf-packing", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    # every PackingConfig field is a flag of both commands (`--max_length` / `--max-length`), generated from the
    # dataclass with its default and help
    def packing() -> dict[str, Any]:  # a parent per command: argparse shares a parent's actions (and defaults)
        return {
            # transformers types its dataclasses as a NewType of Any, which a dataclass type is not
            "parents": [per_source_flags(HfArgumentParser(PackingConfig, add_help=False))],  # type: ignore[arg-type]
            "formatter_class": ArgumentDefaultsHelpFormatter,
        }

    demo = sub.add_parser("demo", help="generate data, pack, patch and train a tiny Qwen-VL on CPU", **packing())
    demo.set_defaults(max_length=DEMO_MAX_LENGTH)
    demo.add_argument("--output-dir", type=Path, default=Path("demo_out"))
    demo.add_argument("--model", help="local checkpoint dir (default: a tiny random --model-type saved in output-dir)")
    demo.add_argument("--model-type", default="qwen2_5_vl", choices=MODEL_TYPES, help="family of the tiny model")
    demo.add_argument("--processor", help="local processor dir (default: the model dir)")
    demo.add_argument("--dataset", help="saved datasets dir or json/jsonl/parquet (default: generated)")
    demo.add_argument("--num-samples", type=int, default=DemoConfig.num_samples)
    demo.add_argument("--epochs", type=int, default=DemoConfig.epochs)
    demo.add_argument("--learning-rate", type=float, default=DemoConfig.learning_rate)

    stats = sub.add_parser(
        "stats", help="packing statistics of the configured strategy and the others, from metadata only", **packing()
    )
    stats.add_argument(
        "data", nargs="+", help="local json/jsonl/parquet/arrow files, globs, directories of them, saved datasets dirs"
    )
    stats.add_argument("--processor", required=True, help="local processor dir")
    stats.add_argument("--output", type=Path, default=Path("pack_stats.png"), help="histogram PNG")
    stats.add_argument(
        "--model", help="local checkpoint or config dir for the memory prediction (default: --processor's, if any)"
    )
    stats.add_argument(
        "--gpu_memory_gib", type=float, help="GPU memory: say whether the largest pack needs gradient checkpointing"
    )

    plot = sub.add_parser("plot", help="loss / token accuracy curves, overall and per source, training and eval")
    plot.add_argument("output_dir", type=Path, help="the Trainer's output_dir (or a trainer_state.json)")
    plot.add_argument("--output", type=Path, help="PNG path (default: curves.png next to trainer_state.json)")
    return parser


def packing_config(args: argparse.Namespace) -> PackingConfig:
    """The `PackingConfig` of parsed flags."""
    return PackingConfig(**{name: getattr(args, name) for name in PackingConfig.names()})


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        from .demo import DemoConfig, run_demo

        summary = run_demo(
            DemoConfig(
                output_dir=args.output_dir,
                model=args.model,
                model_type=args.model_type,
                processor=args.processor,
                dataset=args.dataset,
                num_samples=args.num_samples,
                epochs=args.epochs,
                learning_rate=args.learning_rate,
                packing=packing_config(args),
            )
        )
        first, last = summary["loss first -> last"]
        if not last < first:
            print(f"loss did not fall ({first:.3f} -> {last:.3f})", file=sys.stderr)
            return 1
        return 0
    if args.command == "plot":
        from .plots import run_plot

        print(run_plot(args.output_dir, args.output))
        return 0
    from .stats import run_stats

    run_stats(args, packing_config(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
