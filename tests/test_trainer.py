"""The HF Trainer with the patch: token-level averaging across gradient-accumulation steps actually happens."""

from __future__ import annotations

import pytest
import torch

import hf_packing
from hf_packing import VisionCollator
from hf_packing.tiny import build_tiny_model
from tests.conftest import FIXTURES, conversations, load_processor, processed_samples


def _one_sgd_step(tmp_path, packs, *, batch_size: int, accumulation: int, patched: bool) -> dict[str, torch.Tensor]:
    from transformers import Trainer, TrainingArguments

    processor = load_processor("qwen2_5_vl")
    model = build_tiny_model("qwen2_5_vl", processor_dir=FIXTURES / "qwen2_5_vl")
    if patched:
        hf_packing.apply_rmpad("qwen2_5_vl")
    args = TrainingArguments(
        output_dir=str(tmp_path / f"run{batch_size}{accumulation}{patched}"), per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=1.0, optim="sgd",
        lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, report_to=[], save_strategy="no",
        use_cpu=True, remove_unused_columns=False, dataloader_num_workers=0, logging_steps=1, seed=0,
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
    """The problem the patch fixes: Qwen2.5-VL ships accepts_loss_kwargs=False, so the Trainer averages per micro-batch."""
    whole = _one_sgd_step(tmp_path, packs, batch_size=2, accumulation=1, patched=False)
    accumulated = _one_sgd_step(tmp_path, packs, batch_size=1, accumulation=2, patched=False)
    diff = _max_rel_diff(accumulated, whole)
    print(f"unpatched: max rel param diff {diff:.2e}")
    assert diff > 1e-3
