"""Helper for tests/test_evaluation.py: evaluate a tiny Qwen2.5-VL with the HF Trainer under torchrun (CPU, gloo).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/multiproc_eval.py CONFIG.json

CONFIG.json (written by the test): ``model`` (a `save_tiny_checkpoint` dir); ``data`` (parquet files, packed by
`pack_dataset` split by rank, ``leftovers="spread"`` unless ``default_leftovers``);
``lengths`` (the max_lengths the eval set is packed at, each
evaluated with metric prefix ``eval_<max_length>``); ``keep_eval_packs`` (false: undo `keep_rank_packs` for
evaluation only, the negative control: a patched model refuses the re-sharded loader, its error goes to ``errors``
{prefix: message}); ``patched`` (`apply_rmpad` before loading); ``precisions`` (optional, default
``["fp32"]``: ``"bf16"`` loads bf16 weights, ``"autocast"`` fp32 weights with ``TrainingArguments(bf16=True)``; other
than fp32 the prefix gets ``_<precision>``); ``loss_only`` (optional: each set is evaluated again without
``compute_metrics``, prefix ``..._loss_only``, and, with ``"autocast"``, once more without the recorded token counts,
prefix ``..._control``: the negative control); ``default_leftovers`` (optional: pack with `pack_dataset`'s defaults,
training's ``leftovers="drop"``, and evaluate each set twice: passed to ``evaluate()``, then as the Trainer's own
``eval_dataset`` that is also its ``train_dataset``, prefix ``..._as_train``); ``no_eval_view`` (optional: evaluate
the packs as they are, without `PackedDataset.for_evaluation`, the negative control); ``mix`` (optional: ``[[name,
parquet file], ...]``, packed as a ``{name: dataset}`` mix instead of ``data``: per-source metrics); ``out``,
``output_dir``, ``pg_timeout``.

rank{r}.json: ``evaluated`` {prefix: the sample indices of each eval batch this rank collated}, ``metrics`` {the
token-level loss and accuracy, and ``label_tokens``: supervised labels compute_metrics received over all ranks}.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
from multiproc_train import RecordingCollator


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    from datasets import load_dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor, Trainer, TrainingArguments

    import hf_packing
    import hf_packing.training.evaluation
    from hf_packing import VisionCollator, pack_dataset, prepare_trainer

    processor = AutoProcessor.from_pretrained(config["model"])
    if config["patched"]:
        hf_packing.apply_rmpad("qwen2_5_vl")
    if config.get("no_eval_view"):
        hf_packing.packing.dataset.PackedDataset.for_evaluation = lambda self: self

    def compute_metrics(prediction):
        return {"label_tokens": int((prediction.label_ids != -100).sum())}

    evaluated, metrics, errors = {}, {}, {}
    for precision in config.get("precisions", ["fp32"]):
        args = TrainingArguments(
            output_dir=config["output_dir"],
            use_cpu=True,
            per_device_eval_batch_size=1,
            report_to=[],
            seed=0,
            remove_unused_columns=False,
            dataloader_num_workers=0,
            ddp_timeout=int(config["pg_timeout"]),
            disable_tqdm=True,
            bf16=precision == "autocast",
        )
        rank, world = args.process_index, args.world_size
        assert world == 2 and torch.distributed.is_initialized(), (world, rank)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        model = AutoModelForImageTextToText.from_pretrained(config["model"], dtype=dtype, attn_implementation="sdpa")
        model.config.use_cache = False
        collator = RecordingCollator(VisionCollator(processor, model_config=model.config))
        trainer = prepare_trainer(
            Trainer(model=model, args=args, data_collator=collator, compute_metrics=compute_metrics)
        )
        if not config["keep_eval_packs"]:
            trainer.get_eval_dataloader = Trainer.get_eval_dataloader.__get__(trainer)
        modes = (
            ["", "_loss_only"] + (["_control"] if precision == "autocast" else []) if config.get("loss_only") else [""]
        )
        if config.get("default_leftovers"):
            modes = ["", "_as_train"]
        for max_length in config["lengths"]:
            for mode in modes:
                ds = load_dataset("parquet", data_files=config["data"], split="train")
                if config.get("mix"):
                    ds = {name: load_dataset("parquet", data_files=f, split="train") for name, f in config["mix"]}
                packs = pack_dataset(
                    ds,
                    processor,
                    max_length=max_length,
                    rank=rank,
                    world_size=world,
                    disable_progress=True,
                    **({} if config.get("default_leftovers") else {"leftovers": "spread"}),
                )
                prefix = f"eval_{max_length}" + ("" if precision == "fp32" else f"_{precision}") + mode
                collator.calls, trainer.compute_metrics = [], None if mode else compute_metrics
                recording = hf_packing.training.evaluation.recording_token_counts
                if mode == "_control":  # the counts only as output attributes, which autocast's wrapper drops
                    hf_packing.training.evaluation.recording_token_counts = contextlib.nullcontext
                try:
                    if mode == "_as_train":  # one object as both sets: evaluate() with no argument
                        trainer.train_dataset = trainer.eval_dataset = packs
                        result = trainer.evaluate(metric_key_prefix=prefix)
                    else:
                        result = trainer.evaluate(eval_dataset=packs, metric_key_prefix=prefix)
                except RuntimeError as error:  # the patched forward refuses the re-sharded eval loader
                    if config["keep_eval_packs"]:
                        raise
                    errors[prefix] = str(error)
                    continue
                finally:
                    hf_packing.training.evaluation.recording_token_counts = recording
                evaluated[prefix] = [call["indices"] for call in collator.calls]
                metrics.update(
                    {k: v for k, v in result.items() if k.endswith(("_loss", "_token_accuracy", "_label_tokens"))}
                )
    torch.distributed.barrier()
    out = Path(config["out"])
    out.mkdir(parents=True, exist_ok=True)
    result = {"rank": rank, "evaluated": evaluated, "metrics": metrics, "errors": errors}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    hf_packing.end_distributed()  # barrier, gc, destroy_process_group: no abort at interpreter exit


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
    from hf_packing.training.distributed import end_process

    end_process()  # skip interpreter finalization, as multiprocessing's children do (hf_packing.training.distributed)
