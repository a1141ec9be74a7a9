"""Helper for tests/test_evaluation.py: evaluate a tiny Qwen2.5-VL with the HF Trainer under torchrun (CPU, gloo).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/multiproc_eval.py CONFIG.json

CONFIG.json (written by the test): ``model`` (a `save_tiny_checkpoint` dir); ``data`` (parquet files, packed by
`pack_dataset` split by rank, ``leftovers="spread"``); ``lengths`` (the max_lengths the eval set is packed at, each
evaluated with metric prefix ``eval_<max_length>``); ``keep_eval_packs`` (false: undo `keep_rank_packs` for
evaluation only, the negative control); ``patched`` (`apply_rmpad` before loading); ``out``, ``output_dir``,
``pg_timeout``.

rank{r}.json: ``evaluated`` {prefix: the sample indices of each eval batch this rank collated}, ``metrics`` {the
token-level loss and accuracy, and ``label_tokens``: supervised labels compute_metrics received over all ranks}.
"""

from __future__ import annotations

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
    from hf_packing import VisionCollator, pack_dataset, prepare_trainer

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
    )
    rank, world = args.process_index, args.world_size
    assert world == 2 and torch.distributed.is_initialized(), (world, rank)
    processor = AutoProcessor.from_pretrained(config["model"])
    if config["patched"]:
        hf_packing.apply_rmpad("qwen2_5_vl")
    model = AutoModelForImageTextToText.from_pretrained(
        config["model"], dtype=torch.float32, attn_implementation="sdpa"
    )
    model.config.use_cache = False
    collator = RecordingCollator(VisionCollator(processor, model_config=model.config))

    def compute_metrics(prediction):
        return {"label_tokens": int((prediction.label_ids != -100).sum())}

    trainer = prepare_trainer(Trainer(model=model, args=args, data_collator=collator, compute_metrics=compute_metrics))
    if not config["keep_eval_packs"]:
        trainer.get_eval_dataloader = Trainer.get_eval_dataloader.__get__(trainer)
    evaluated, metrics = {}, {}
    for max_length in config["lengths"]:
        ds = load_dataset("parquet", data_files=config["data"], split="train")
        packs = pack_dataset(
            ds, processor, max_length=max_length, rank=rank, world_size=world, leftovers="spread", disable_progress=True
        )
        prefix, collator.calls = f"eval_{max_length}", []
        result = trainer.evaluate(eval_dataset=packs, metric_key_prefix=prefix)
        evaluated[prefix] = [call["indices"] for call in collator.calls]
        metrics.update({k: v for k, v in result.items() if k.endswith(("_loss", "_token_accuracy", "_label_tokens"))})
    torch.distributed.barrier()
    out = Path(config["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "evaluated": evaluated, "metrics": metrics}))
    hf_packing.end_distributed()  # barrier, gc, destroy_process_group: no abort at interpreter exit


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
