"""``hf-packing``: ``demo`` (train a tiny model end to end on CPU), ``stats`` (packing statistics from metadata) and
``plot`` (loss and token accuracy curves, overall and per source, of a Trainer run)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..planner import STRATEGIES
from ..testing.tiny import MODEL_TYPES


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-packing", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="generate data, pack, patch and train a tiny Qwen-VL on CPU")
    demo.add_argument("--output-dir", type=Path, default=Path("demo_out"))
    demo.add_argument("--model", help="local checkpoint dir (default: a tiny random --model-type saved in output-dir)")
    demo.add_argument("--model-type", default="qwen2_5_vl", choices=MODEL_TYPES, help="family of the tiny model")
    demo.add_argument("--processor", help="local processor dir (default: the model dir)")
    demo.add_argument("--dataset", help="saved datasets dir or json/jsonl/parquet (default: generated)")
    demo.add_argument("--num-samples", type=int, default=320)
    demo.add_argument("--max-length", type=int, default=2048)
    demo.add_argument("--strategy", default="bfd", choices=STRATEGIES)
    demo.add_argument("--epochs", type=int, default=2)
    demo.add_argument("--learning-rate", type=float, default=3e-3)
    demo.add_argument("--seed", type=int, default=0)

    stats = sub.add_parser("stats", help="packing statistics per strategy, from metadata only")
    stats.add_argument("data", help="local json/jsonl/parquet/arrow file(s) or a saved datasets dir")
    stats.add_argument("--processor", required=True, help="local processor dir")
    stats.add_argument("--max-length", type=int, required=True)
    stats.add_argument("--strategy", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    stats.add_argument("--buffer-size", type=int, default=1000)
    stats.add_argument("--max-images", type=int)
    stats.add_argument("--max-vision-patches", type=int)
    stats.add_argument("--media-root", "--image-root", dest="media_root", help="root of relative image/video paths")
    stats.add_argument("--video-root", help="root of relative video frame paths, if not --media-root")
    stats.add_argument("--fps", type=float, help="sampling rate of pre-sampled video frames (a row's 'fps' wins)")
    stats.add_argument(
        "--videos-kwargs",
        help='video file sampling as JSON, e.g. \'{"fps": 1, "max_frames": 32, "max_pixels": 200704}\'',
    )
    stats.add_argument("--row-format", default="auto", choices=["auto", "messages", "llava"])
    stats.add_argument("--output", type=Path, default=Path("pack_stats.png"), help="histogram PNG")

    plot = sub.add_parser("plot", help="loss / token accuracy curves, overall and per source, training and eval")
    plot.add_argument("output_dir", type=Path, help="the Trainer's output_dir (or a trainer_state.json)")
    plot.add_argument("--output", type=Path, help="PNG path (default: curves.png next to trainer_state.json)")
    return parser


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
                max_length=args.max_length,
                strategy=args.strategy,
                epochs=args.epochs,
                learning_rate=args.learning_rate,
                seed=args.seed,
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

    run_stats(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
