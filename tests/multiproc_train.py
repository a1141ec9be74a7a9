"""Helper for tests/test_training.py: train a tiny Qwen2.5-VL with the HF Trainer under torchrun (CPU, gloo).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/multiproc_train.py CONFIG.json

CONFIG.json (written by the test):
    model         a `save_tiny_checkpoint` directory, loaded with `from_pretrained` after `apply_rmpad`
    data          parquet files read as one `datasets` stream, split by rank by `pack_dataset`; or
    rank_data     {rank: parquet files}: each rank packs only its own files (rank=0, world_size=1), to force
                  what one rank's micro-batches hold (text-only on one rank, images on the other)
    out           where each rank writes rank{r}.json; output_dir: the Trainer's
    max_steps     an int, or null for the per-rank pack count (`count_packs()`, so the epoch ends exactly)
    save_steps    checkpoint every N steps (null: no checkpoints); resume: a checkpoint dir to resume from
    dummy_vision  passed to `apply_rmpad`; fsdp: FSDP2 through the Trainer's accelerate plugin
    stateful      resume through accelerate's StatefulDataLoader and `PackedDataset.state_dict` (see below)
    mix           {name: parquet files}: a `{name: dataset}` mix instead of `data` (per-source loss logging)
    grad_accum    gradient_accumulation_steps (default 1); telemetry_all_reduce: `PackingTelemetry(all_reduce=)`
    unprepared_first  first train a Trainer without `prepare_trainer` (dispatching off, as recipes/README.md lists),
                  which must stop at its first step; its error goes to rank{r}.json's `unprepared_error`
    pg_timeout    process-group timeout in seconds (a rank waiting in a collective fails after it)
    best          evaluate and save every step, `load_best_model_at_end` with step 1 the best (its metric is the
                  step, lower is better); rank{r}.json's `final_eval` is `evaluate()`'s eval_loss after train()

rank{r}.json: `global_step`; `collated` (per collator call: the samples' `index` and a hash of the batch);
`trained` (per training micro-batch, as `compute_loss` sees it: the step, the batch hash, the loss, whether it
had pixels); `log_history` (the Trainer's); `stats` (`packs.stats()`); `count` (the per-rank pack count when
counted); `fsdp_version` and the parameters' type (`DTensor` once FSDP2 sharded them).

`stateful`: transformers 5.23's Trainer neither saves nor restores a dataloader state (on resume it skips the
first N batches by re-iterating), and its AcceleratorConfig refuses `use_stateful_dataloader`, so that is set on
accelerate's DataLoaderConfiguration after the Trainer is built. A callback saves the prepared loader's
`state_dict()` into each checkpoint (one file per rank); the resumed run loads it into its new loader and sets
`ignore_data_skip`; accelerate's `IterableDatasetShard` (a pass-through once `prepare_trainer` ran) forwards
`state_dict` / `load_state_dict` to the `PackedDataset`, so torchdata restores the packer's own state instead of
replaying the skipped packs.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

CLASSES = ["Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock"]


def batch_hash(batch: dict[str, Any]) -> str:
    """Hash of a collated batch's real tokens and labels (its padding excluded)."""
    real = batch["attention_mask"].bool()
    h = hashlib.sha1(batch["input_ids"][real].cpu().numpy().tobytes())
    h.update(batch["labels"][real].cpu().numpy().tobytes())
    if batch.get("pixel_values") is not None:
        h.update(batch["pixel_values"].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class RecordingCollator:
    """Wraps `VisionCollator`: remembers every pack's sample indices and the hash of the batch it became."""

    def __init__(self, collator: Any) -> None:
        self.collator, self.calls = collator, []

    def __call__(self, packs: list[list[dict[str, Any]]]) -> dict[str, Any]:
        batch = self.collator(packs)
        self.calls.append({"indices": [int(s["index"]) for pack in packs for s in pack], "hash": batch_hash(batch)})
        return batch


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    from datasets import load_dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor, Trainer, TrainerCallback, TrainingArguments

    import hf_packing
    from hf_packing import VisionCollator, pack_dataset, prepare_trainer

    out = Path(config["out"])
    out.mkdir(parents=True, exist_ok=True)
    accelerator_config: dict[str, Any] = {"dispatch_batches": False, "split_batches": False}
    fsdp = (
        {
            "fsdp": True,
            "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": CLASSES, "reshard_after_forward": True},
        }
        if config.get("fsdp")
        else {}
    )
    best = (
        {
            "eval_strategy": "steps",
            "eval_steps": 1,
            "per_device_eval_batch_size": 1,
            "load_best_model_at_end": True,
            "metric_for_best_model": "order",
            "greater_is_better": False,
        }
        if config.get("best")
        else {}
    )
    args = TrainingArguments(
        output_dir=config["output_dir"],
        use_cpu=True,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=config.get("grad_accum", 1),
        max_steps=1,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps" if config.get("save_steps") else "no",
        save_steps=config.get("save_steps") or 500,
        report_to=[],
        seed=0,
        data_seed=0,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        accelerator_config=accelerator_config,
        ddp_timeout=int(config["pg_timeout"]),
        ignore_data_skip=bool(config.get("stateful") and config.get("resume")),
        disable_tqdm=True,
        **fsdp,
        **best,
    )
    rank, world = args.process_index, args.world_size
    assert world == 2 and torch.distributed.is_initialized(), (world, rank)

    processor = AutoProcessor.from_pretrained(config["model"])
    if config.get("mix"):
        ds = {
            name: load_dataset("parquet", data_files=files, split="train", streaming=True)
            for name, files in config["mix"].items()
        }
        split = {"rank": rank, "world_size": world}
    elif config.get("rank_data"):
        ds = load_dataset("parquet", data_files=config["rank_data"][str(rank)], split="train", streaming=True)
        split = {"rank": 0, "world_size": 1}  # this rank's own rows: forces what its micro-batches hold
    else:
        ds = load_dataset("parquet", data_files=config["data"], split="train", streaming=True)
        split = {"rank": rank, "world_size": world}
    packs = pack_dataset(
        ds,
        processor,
        max_length=config["max_length"],
        buffer_size=config.get("buffer_size", 16),
        disable_progress=True,
        **split,
    )
    count = packs.count_packs() if config.get("max_steps") is None else None
    args.max_steps = count if count is not None else config["max_steps"]

    hf_packing.apply_rmpad("qwen2_5_vl", dummy_vision=bool(config.get("dummy_vision")))
    model = AutoModelForImageTextToText.from_pretrained(
        config["model"], dtype=torch.float32, attn_implementation="sdpa"
    )
    model.config.use_cache = False
    collator = RecordingCollator(VisionCollator(processor, model_config=model.config))
    trained: list[dict[str, Any]] = []

    class RecordingTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            value = loss[0] if return_outputs else loss
            trained.append(
                {
                    "step": self.state.global_step + 1,
                    "hash": batch_hash(inputs),
                    "loss": float(value.detach()),
                    "pixels": inputs.get("pixel_values") is not None,
                }
            )
            return loss

        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            if config.get("fsdp"):
                fsdp2_on_cpu(self)

    class SaveLoaderState(TrainerCallback):
        def on_save(self, args, state, control, train_dataloader=None, **kwargs):
            path = Path(args.output_dir) / f"checkpoint-{state.global_step}" / f"hf_packing_loader_rank{rank}.pt"
            torch.save(train_dataloader.state_dict(), path)

    unprepared_error = None
    if config.get("unprepared_first"):
        fresh = pack_dataset(ds, processor, max_length=config["max_length"], disable_progress=True, **split)
        unprepared_error = train_without_prepare_trainer(model, args, fresh, VisionCollator(processor))

    class StepOneIsBest(TrainerCallback):  # `best`: each evaluation's metrics get the step, lower is better
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            metrics["eval_order"] = state.global_step

    callbacks = [SaveLoaderState()] if config.get("stateful") else []
    callbacks += [StepOneIsBest()] if config.get("best") else []
    eval_packs = (
        pack_dataset(ds, processor, max_length=config["max_length"], disable_progress=True, **split)
        if config.get("best")
        else None
    )
    trainer = RecordingTrainer(
        model=model,
        args=args,
        train_dataset=packs,
        eval_dataset=eval_packs,
        data_collator=collator,
        callbacks=callbacks or None,
    )
    prepare_trainer(trainer, max_length=config["max_length"], all_reduce=config.get("telemetry_all_reduce", True))
    if config.get("stateful"):
        use_stateful_packs(trainer, config.get("resume"), rank)
        assert trainer.accelerator.use_stateful_dataloader
    trainer.train(resume_from_checkpoint=config.get("resume"))
    torch.distributed.barrier()
    result = {
        "rank": rank,
        "global_step": trainer.state.global_step,
        "count": count,
        "max_steps": args.max_steps,
        "collated": collator.calls,
        "trained": trained,
        "log_history": list(trainer.state.log_history),  # a copy: `final_eval` below logs once more
        "stats": packs.stats(log=False),
        "unprepared_error": unprepared_error,
        "fsdp_version": getattr(getattr(trainer.accelerator.state, "fsdp_plugin", None), "fsdp_version", None),
        "sharded": type(next(trainer.model.parameters())).__name__,
        "best_model_checkpoint": trainer.state.best_model_checkpoint,
        "final_eval": trainer.evaluate()["eval_loss"] if config.get("best") else None,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    hf_packing.end_distributed()  # barrier, gc, destroy_process_group: no abort at interpreter exit


def train_without_prepare_trainer(model: Any, args: Any, packs: Any, collator: Any) -> str | None:
    """A Trainer on `pack_dataset`'s packs without `prepare_trainer`: before the check in
    `hf_packing.patches.prepared`, each rank trained on every other pack of its stream and exited 0. Returns the error
    its first step raised (None if it trained), after checking the model took no optimizer step."""
    import gc

    from transformers import Trainer

    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(model=model, args=args, train_dataset=packs, data_collator=collator)
    try:
        trainer.train()
        message = None
    except RuntimeError as error:
        message = str(error)
    assert trainer.state.global_step == 0 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    del trainer
    gc.collect()  # its DDP wrapper (and reducer) go before the prepared Trainer wraps the model again
    return message


def fsdp2_on_cpu(trainer: Any) -> None:
    """accelerate only turns its FSDP plugin on for accelerator device types (MULTI_GPU, ...); on CPU it keeps
    MULTI_CPU (DDP) and drops the plugin. Set what `accelerate launch --use_fsdp` sets on a GPU host, so the Trainer
    and `Accelerator.prepare` take their real FSDP2 path (`fsdp2_prepare_model`: `fully_shard` per decoder layer and
    vision block, then the root) over the gloo process group."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    assert getattr(state, "fsdp_plugin", None) is None and state.distributed_type == DistributedType.MULTI_CPU
    plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    state.distributed_type, state.fsdp_plugin = DistributedType.FSDP, plugin
    trainer.is_fsdp_enabled = True


def use_stateful_packs(trainer: Any, resume: str | None, rank: int) -> None:
    """Let torchdata save/restore `PackedDataset.state_dict` through accelerate's (pass-through) shard wrapper, and
    load the loader state a checkpoint holds (see the module docstring)."""
    from accelerate.data_loader import IterableDatasetShard

    # transformers 5.23's AcceleratorConfig has no `use_stateful_dataloader` (TypeError): set it on accelerate's own
    # DataLoaderConfiguration, as prepare_trainer does for dispatch_batches.
    trainer.accelerator.dataloader_config.use_stateful_dataloader = True
    get_loader = trainer.get_train_dataloader

    def get_train_dataloader(*a, **kw):
        loader = get_loader(*a, **kw)
        shard = loader.dataset
        assert isinstance(shard, IterableDatasetShard) and shard.num_processes == 1, shard
        shard.state_dict, shard.load_state_dict = shard.dataset.state_dict, shard.dataset.load_state_dict
        if resume is not None:
            state = torch.load(Path(resume) / f"hf_packing_loader_rank{rank}.pt", weights_only=False)
            assert state["dataset_state"] is not None, "the PackedDataset's own state was not saved"
            loader.load_state_dict(state)
        return loader

    trainer.get_train_dataloader = get_train_dataloader


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
    from hf_packing.training.distributed import end_process

    end_process()  # skip interpreter finalization, as multiprocessing's children do (hf_packing.training.distributed)
