"""TRL's SFTTrainer (the version pyproject's dev extra names) on a patched model.

TRL >= 1.16 computes the training loss with its own fused LM head on the backbone (``model.model``), so the
patched ``ForConditionalGeneration.forward`` is not on its training path: training must be unchanged by the
patch, and evaluation (which calls the model's forward for logits) must work through the patched forward.
"""

from __future__ import annotations

import pytest
import torch

import hf_packing
from tests.test_patches import model_and_processor

trl = pytest.importorskip("trl")


def _rows(n: int) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"Question {i} " * (i + 1)},
                {"role": "assistant", "content": f"Answer {i} " * (3 * i + 2)},
            ]
        }
        for i in range(n)
    ]


def _train_losses(patched: bool, tmp_path) -> tuple[list[float], dict]:
    from datasets import Dataset

    torch.manual_seed(0)
    model, processor = model_and_processor("qwen3_vl")
    if patched:
        hf_packing.apply_rmpad("qwen3_vl")
    args = trl.SFTConfig(
        str(tmp_path / f"out{patched}"),
        padding_free=True,
        max_length=None,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=2,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(_rows(8)),
        eval_dataset=Dataset.from_list(_rows(4)),
        processing_class=processor.tokenizer,
    )
    trainer.train()
    metrics = trainer.evaluate()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], metrics


def test_sft_trainer_padding_free_text_rows_unchanged_by_the_patch(tmp_path):
    ref_losses, ref_metrics = _train_losses(False, tmp_path)
    losses, metrics = _train_losses(True, tmp_path)
    print(
        f"SFTTrainer padding_free: losses {ref_losses} vs {losses}; eval {ref_metrics['eval_loss']:.6f} vs "
        f"{metrics['eval_loss']:.6f}"
    )
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert metrics["eval_loss"] == pytest.approx(ref_metrics["eval_loss"], rel=1e-5)
