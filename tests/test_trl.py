"""TRL's trainers (the version pyproject's dev extra names) on a patched model: padding-free through the backbone.

TRL >= 1.16 computes the loss with its own fused LM head on the backbone (``model.model``), never through
``ForConditionalGeneration.forward``; the patched backbone (`hf_packing.patches._backbone`) flattens TRL's batches.
Each run is compared with the unpatched trainer on the same batches: losses, weights after the steps, and the
tokens the first decoder layer receives. fp32 (``bf16=False``; TRL defaults to bf16 autocast) and SGD: Adam's first
steps move every weight by about ``±lr`` whatever the gradient's size, so gradients that are rounding noise (the
key bias, which softmax ignores) would differ by ``2·lr`` between two equal runs.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import hf_packing
from hf_packing import VisionCollator
from hf_packing.testing.tiny import build_tiny_model
from tests.helpers import FIXTURES, conversations, first_layer_tokens, image, load_processor, processed_samples

trl = pytest.importorskip("trl")

LOSS_RTOL, WEIGHT_RTOL = 1e-5, 1e-4


def _text_rows(n: int) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"Question {i} " * (i + 1)},
                {"role": "assistant", "content": f"Answer {i} " * (3 * i + 2)},
            ]
        }
        for i in range(n)
    ]


def _image_rows(n: int) -> list[dict]:
    """Rows in TRL's vision format: string messages and an ``images`` list (1 or 2 images of different sizes)."""
    return [
        {
            "messages": [
                {"role": "user", "content": "Describe this. " * (i % 4 + 1)},
                {"role": "assistant", "content": f"Answer {i} " * (2 * i + 1)},
            ],
            "images": [image(56 + 28 * (i % 3), 56 + 28 * ((i + 1) % 2), i)] * (1 + (i % 3 == 2)),
        }
        for i in range(n)
    ]


def _real_tokens(batch: dict) -> int:
    mask = batch.get("attention_mask")
    return int(batch["input_ids"].numel() if mask is None else mask.sum())


def trl_config(cls: type, tmp_path, name: str, **overrides):
    """A deterministic fp32 CPU config for ``cls`` (SFTConfig / DPOConfig); see the module docstring."""
    defaults = dict(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=4,
        max_steps=3,
        learning_rate=0.5,
        optim="sgd",
        bf16=False,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    return cls(**(defaults | overrides))


def run_trainer(model_type: str, patched: bool, make: Callable) -> dict:
    """Train with ``make(model, processor)`` (a TRL trainer); losses, weights, and real tokens per batch vs what
    the first decoder layer received."""
    torch.manual_seed(0)
    processor = load_processor(model_type)
    model = build_tiny_model(model_type, processor_dir=FIXTURES / model_type)
    if patched:
        hf_packing.apply_rmpad(model_type)
    seen = first_layer_tokens(model)
    trainer = make(model, processor)
    real: list[int] = []
    collate = trainer.data_collator

    def recording(examples):
        batch = collate(examples)
        real.append(_real_tokens(batch))
        return batch

    trainer.data_collator = recording
    trainer.train()
    return {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
        "seen": seen,
        "real": real,
        "collator": type(collate).__name__,
    }


def assert_same_training(ref: dict, got: dict, label: str) -> None:
    """Equal losses and weights; the patched run's first decoder layer saw exactly the real tokens."""
    loss_err = max(abs(a - b) / abs(a) for a, b in zip(ref["losses"], got["losses"], strict=True))
    weight_err = max(
        ((got["weights"][n] - w).norm() / w.norm().clamp_min(1e-12)).item() for n, w in ref["weights"].items()
    )
    print(
        f"{label}: losses {ref['losses']} vs {got['losses']} (worst rel {loss_err:.2e}); worst weight rel "
        f"{weight_err:.2e}; first layer saw {got['seen']} for real tokens {got['real'][: len(got['seen'])]} "
        f"(unpatched: {ref['seen']})"
    )
    assert len(got["losses"]) == 3
    assert loss_err <= LOSS_RTOL and weight_err <= WEIGHT_RTOL
    assert got["seen"] == got["real"][: len(got["seen"])] and len(got["seen"]) == 3


def _sft(tmp_path, name: str, dataset, collator=None, **config) -> Callable:
    def make(model, processor):
        return trl.SFTTrainer(
            model=model,
            args=trl_config(trl.SFTConfig, tmp_path, name, **config),
            train_dataset=dataset,
            data_collator=collator(model, processor) if collator else None,
            processing_class=processor if collator or name.startswith("vlm") else processor.tokenizer,
        )

    return make


def test_sft_padding_free_text_rows(tmp_path):
    """``padding_free=True`` (TRL's position-id-packed row): equal to unpatched, the backbone flattens it."""
    from datasets import Dataset

    dataset = Dataset.from_list(_text_rows(12))
    runs = [
        run_trainer("qwen3_vl", p, _sft(tmp_path, f"text{p}", dataset, padding_free=True, max_length=None))
        for p in (False, True)
    ]
    assert_same_training(*runs, "SFT padding_free text")


def test_sft_trl_vlm_collator_image_rows(tmp_path):
    """Image+text rows through TRL's own ``DataCollatorForVisionLanguageModeling`` (right-padded rows): unpatched,
    the first decoder layer gets every padded slot; patched, only the real tokens."""
    from datasets import Dataset

    dataset = Dataset.from_list(_image_rows(12))
    ref, got = (run_trainer("qwen2_5_vl", p, _sft(tmp_path, f"vlm{p}", dataset, max_length=None)) for p in (0, 1))
    assert got["collator"] == "DataCollatorForVisionLanguageModeling"
    assert_same_training(ref, got, "SFT TRL VLM collator")
    assert sum(ref["seen"]) > sum(got["seen"])  # unpatched: padded rows reach the layers


@pytest.mark.parametrize("mode", ["rows", "flat"])
def test_sft_vision_collator(tmp_path, mode):
    """`VisionCollator` batches (one sample per padded row, or one flat row) under SFTTrainer, patched, equal the
    unpatched trainer on the same samples as padded rows."""
    from datasets import Dataset

    processor = load_processor("qwen2_5_vl")
    rows = conversations(with_video=False)[1:] * 4  # image rows only: every sample has the same keys
    samples = Dataset.from_list(processed_samples(processor, rows)).with_format("torch")

    def collator(patched_mode: str):
        return lambda model, processor: VisionCollator(processor, mode=patched_mode, model_config=model.config)

    config = dict(max_length=None, remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True})
    ref = run_trainer("qwen2_5_vl", False, _sft(tmp_path, "vc-ref", samples, collator("rows"), **config))
    got = run_trainer("qwen2_5_vl", True, _sft(tmp_path, f"vc-{mode}", samples, collator(mode), **config))
    assert_same_training(ref, got, f"SFT VisionCollator {mode}")


def _preference_pairs(n: int) -> list[dict]:
    """Image preference pairs in TRL's conversational format: one image, a prompt, chosen and rejected answers."""
    return [
        {
            "images": [image(56 + 28 * (i % 3), 56 + 28 * (i % 2), i)],
            "prompt": [{"role": "user", "content": "What is in the picture? " * (i + 1)}],
            "chosen": [{"role": "assistant", "content": f"A thing number {i}. " * (i + 1)}],
            "rejected": [{"role": "assistant", "content": "Nothing."}],
        }
        for i in range(n)
    ]


def _dpo_step(patched: bool, tmp_path) -> dict:
    """One DPOTrainer step on 4 image pairs; gradients before the (unclipped) optimizer step, and the tokens the
    first decoder layer of the policy and of the reference model received."""
    import copy

    from datasets import Dataset
    from transformers import TrainerCallback

    torch.manual_seed(0)
    processor = load_processor("qwen2_5_vl")
    model = build_tiny_model("qwen2_5_vl", processor_dir=FIXTURES / "qwen2_5_vl")
    ref_model = copy.deepcopy(model)
    with torch.no_grad():  # a reference that differs from the policy, so the loss is not log 2 by construction
        for p in ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    if patched:
        hf_packing.apply_rmpad("qwen2_5_vl")
    seen, ref_seen = first_layer_tokens(model), first_layer_tokens(ref_model)
    args = trl_config(trl.DPOConfig, tmp_path, f"dpo{patched}", max_steps=1, max_grad_norm=0.0, max_length=None)
    trainer = trl.DPOTrainer(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=Dataset.from_list(_preference_pairs(4)),
        processing_class=processor,
    )
    grads: dict[str, torch.Tensor] = {}

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    trainer.add_callback(Grads())
    real: list[int] = []
    collate = trainer.data_collator
    trainer.data_collator = lambda examples: (batch := collate(examples), real.append(_real_tokens(batch)))[0]
    trainer.train()
    loss = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    return {"loss": loss, "grads": grads, "seen": seen, "ref_seen": ref_seen, "real": real}


def test_dpo_image_pairs_one_step(tmp_path):
    """DPOTrainer (TRL's vision preference collator: chosen and rejected rows, padded, with images): the loss and
    every gradient equal the unpatched step; policy and reference see only the real tokens."""
    ref, got = _dpo_step(False, tmp_path), _dpo_step(True, tmp_path)
    assert ref["grads"].keys() == got["grads"].keys()
    grad_err = max(((got["grads"][n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in ref["grads"].items())
    loss_err = abs(got["loss"] - ref["loss"]) / abs(ref["loss"])
    print(
        f"DPO: loss {ref['loss']:.7f} vs {got['loss']:.7f} (rel {loss_err:.2e}); worst grad rel {grad_err:.2e}; "
        f"policy saw {got['seen']}, reference {got['ref_seen']} for real {got['real'][:1]} (unpatched: {ref['seen']})"
    )
    assert abs(ref["loss"] - 0.6931472) > 1e-3  # the reference differs from the policy
    assert loss_err <= LOSS_RTOL and grad_err <= 1e-4
    assert got["seen"] == got["ref_seen"] == got["real"][:1] and ref["seen"][0] > got["seen"][0]
