"""The HF Trainer with the patch: token-level averaging across gradient-accumulation steps actually happens."""

from __future__ import annotations

import pytest
import torch

import hf_packing
from hf_packing import VisionCollator
from hf_packing.testing.tiny import build_tiny_model
from tests.helpers import FIXTURES, conversations, load_processor, processed_samples, sgd_training_args


def _one_sgd_step(tmp_path, packs, *, batch_size: int, accumulation: int, patched: bool) -> dict[str, torch.Tensor]:
    from transformers import Trainer

    processor = load_processor("qwen2_5_vl")
    model = build_tiny_model("qwen2_5_vl", processor_dir=FIXTURES / "qwen2_5_vl")
    if patched:
        hf_packing.apply_rmpad("qwen2_5_vl")
    args = sgd_training_args(
        tmp_path / f"run{batch_size}{accumulation}{patched}",
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
    )
    trainer = Trainer(model=model, args=args, train_dataset=packs, data_collator=VisionCollator(processor))
    trainer.train()
    hf_packing.revert_rmpad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _max_rel_diff(a, b) -> float:
    return max(((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-12)).item() for n in a)


@pytest.fixture(scope="module")
def packs():
    samples = processed_samples(load_processor("qwen2_5_vl"), conversations(with_video=False))
    return [samples[:1], samples[1:]]  # very different supervised-token counts


def test_accumulated_step_equals_one_big_batch_when_patched(tmp_path, packs):
    whole = _one_sgd_step(tmp_path, packs, batch_size=2, accumulation=1, patched=True)
    accumulated = _one_sgd_step(tmp_path, packs, batch_size=1, accumulation=2, patched=True)
    diff = _max_rel_diff(accumulated, whole)
    print(f"patched: max rel param diff after one accumulated SGD step {diff:.2e}")
    assert diff < 1e-5


def test_unpatched_accumulation_averages_per_micro_batch(tmp_path, packs):
    """What the patch fixes: Qwen2.5-VL ships accepts_loss_kwargs=False, so the Trainer averages per micro-batch."""
    whole = _one_sgd_step(tmp_path, packs, batch_size=2, accumulation=1, patched=False)
    accumulated = _one_sgd_step(tmp_path, packs, batch_size=1, accumulation=2, patched=False)
    diff = _max_rel_diff(accumulated, whole)
    print(f"unpatched: max rel param diff {diff:.2e}")
    assert diff > 1e-3


def test_keep_rank_packs_undoes_accelerates_second_sharding():
    """accelerate's IterableDatasetShard keeps 1 of world_size items; our stream is already this rank's share."""
    from accelerate.data_loader import IterableDatasetShard
    from datasets import Dataset
    from torch.utils.data import DataLoader

    from hf_packing import pack_dataset
    from hf_packing.training.trainer import keep_rank_packs

    rows = [
        {"messages": [{"role": "user", "content": "word " * (5 + 7 * i)}, {"role": "assistant", "content": "ok"}]}
        for i in range(12)
    ]
    settings = {"max_length": 160, "rank": 1, "world_size": 2, "disable_progress": True}
    settings["max_skipped_fraction"] = 1.0  # 5 of the 12 rows are over max_length: dropped on purpose
    packs = pack_dataset(Dataset.from_list(rows), load_processor("qwen2_vl"), **settings)
    own = [[s["index"] for s in p] for p in packs]
    assert len(own) >= 2

    class FakeTrainer:  # what Trainer.get_train_dataloader returns under 2 processes
        def get_train_dataloader(self):
            shard = IterableDatasetShard(packs, batch_size=1, num_processes=2, process_index=1)
            return DataLoader(shard, batch_size=None, collate_fn=lambda pack: pack)

    assert len([p for p in FakeTrainer().get_train_dataloader()]) < len(own)  # the bug: half the packs vanish
    trainer = keep_rank_packs(FakeTrainer())
    assert [[s["index"] for s in p] for p in trainer.get_train_dataloader()] == own


def test_prepare_trainer_turns_off_batch_dispatching(tmp_path):
    """accelerate's default dispatching slices every batch tensor to the batch size: cu_seqlens and pixel_values too."""
    from transformers import Trainer, TrainingArguments

    from hf_packing import prepare_trainer
    from hf_packing.training.telemetry import PackingTelemetry

    model = build_tiny_model("qwen2_vl")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    trainer = prepare_trainer(Trainer(model=model, args=args, train_dataset=[]))
    config = trainer.accelerator.dataloader_config
    assert config.dispatch_batches is False and config.split_batches is False
    assert isinstance(trainer.callback_handler.callbacks[0], PackingTelemetry)
