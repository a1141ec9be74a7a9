"""The central contract: the patched model equals the unpatched model (loss and every gradient) on one padded batch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import hf_packing
from hf_packing.patches import revert_rmpad
from tests.helpers import (
    MODEL_TYPES,
    assert_equivalent,
    conversations,
    loss_and_grads,
    model_and_processor,
    padded_rows,
    processed_batch,
)


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_patched_equals_unpatched(model_type, padding_side):
    model, processor = model_and_processor(model_type, padding_side)
    batch = processed_batch(processor)
    assert batch["input_ids"].shape[0] == 5 and batch["attention_mask"].sum(1).unique().numel() == 5
    ref = loss_and_grads(model, batch)
    hf_packing.apply_rmpad(model_type)
    assert_equivalent(ref, loss_and_grads(model, batch), f"{model_type}/{padding_side}")


def test_moe_router_loss_matches():
    model, processor = model_and_processor("qwen3_vl_moe")
    batch = processed_batch(processor, conversations(with_video=False)) | {"output_router_logits": True}
    ref = loss_and_grads(model, batch)
    hf_packing.apply_rmpad("qwen3_vl_moe")
    assert_equivalent(ref, loss_and_grads(model, batch), "moe+aux")


def test_token_level_accumulation():
    """Two micro-batches scaled by the Trainer's num_items_in_batch give the loss and gradient of one batch of both:
    the sum of the patched micro-batch losses and the accumulated gradients equal the unpatched model on the whole
    padded batch (its mean token cross-entropy)."""
    model, processor = model_and_processor("qwen2_5_vl")
    rows = conversations(with_video=False)
    whole = processed_batch(processor, rows)
    ref = loss_and_grads(model, whole)  # the oracle: unpatched, one padded batch
    hf_packing.apply_rmpad("qwen2_5_vl")
    first, second = processed_batch(processor, rows[:1]), processed_batch(processor, rows[1:])
    count = sum(int((b["labels"][:, 1:] != -100).sum()) for b in (first, second))  # the Trainer's count

    def accumulate(**extra) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = 0.0
        for micro in (first, second):
            out = model(**micro, **extra)
            out.loss.backward()
            loss += out.loss.item()
        return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    assert_equivalent(ref, accumulate(num_items_in_batch=torch.tensor(count)), "accumulation")
    with pytest.raises(AssertionError):  # negative control: each micro-batch's own mean, summed
        assert_equivalent(ref, accumulate(), "per-micro-batch means")


def test_trainer_passes_num_items_after_apply():
    from transformers import Qwen2_5_VLForConditionalGeneration

    assert Qwen2_5_VLForConditionalGeneration.accepts_loss_kwargs is False
    hf_packing.apply_rmpad("qwen2_5_vl")
    assert Qwen2_5_VLForConditionalGeneration.accepts_loss_kwargs is True


def test_revert_restores_identical_objects():
    from transformers import AttentionInterface
    from transformers.models.qwen3_vl import modeling_qwen3_vl as mod

    before = (
        mod.Qwen3VLForConditionalGeneration.__dict__["forward"],
        mod.is_flash_attention_requested,
        dict(AttentionInterface()),
    )
    hf_packing.apply_rmpad()
    hf_packing.apply_rmpad(attn_backend="reference")  # twice is harmless
    patched = mod.Qwen3VLForConditionalGeneration.__dict__["forward"]
    assert patched is not before[0] and patched.hf_packing_original is before[0]
    assert AttentionInterface()["sdpa"].__wrapped__ is before[2]["sdpa"]
    revert_rmpad()
    assert mod.Qwen3VLForConditionalGeneration.__dict__["forward"] is before[0]
    assert mod.Qwen3VLForConditionalGeneration.__dict__["accepts_loss_kwargs"] is False
    assert mod.is_flash_attention_requested is before[1]
    assert all(AttentionInterface()[k] is v for k, v in before[2].items())
    revert_rmpad()  # reverting twice is harmless too


def test_partial_revert_keeps_other_families():
    from transformers.models.qwen2_vl import modeling_qwen2_vl as mod2
    from transformers.models.qwen3_vl import modeling_qwen3_vl as mod3

    hf_packing.apply_rmpad(["qwen2_vl", "qwen3_vl"])
    revert_rmpad("qwen2_vl")
    assert not hasattr(mod2.Qwen2VLForConditionalGeneration.__dict__["forward"], "hf_packing_original")
    assert hasattr(mod3.Qwen3VLForConditionalGeneration.__dict__["forward"], "hf_packing_original")
    from transformers import AttentionInterface

    assert hasattr(AttentionInterface()["sdpa"], "__wrapped__")  # the attention route stays for qwen3_vl


def test_clear_errors_at_apply_time(monkeypatch):
    with pytest.raises(ValueError, match="supports \\['qwen2_vl'"):
        hf_packing.apply_rmpad("llava")
    with pytest.raises(ValueError, match="attn_backend"):
        hf_packing.apply_rmpad(attn_backend="xformers")
    import transformers

    monkeypatch.setattr(transformers, "__version__", "4.57.1")
    with pytest.raises(RuntimeError, match="transformers >=5.17,<5.24; found 4.57.1"):
        hf_packing.apply_rmpad()


def test_the_supported_transformers_range_has_one_source(monkeypatch):
    """`_compat.SUPPORTED_TRANSFORMERS` is what pyproject.toml requires and docs/versions.md states; the check
    compares with `packaging` (a development build counts as its release)."""
    import re
    from pathlib import Path

    import transformers
    from packaging.specifiers import SpecifierSet

    root = Path(__file__).resolve().parents[1]
    pyproject = (root / "pyproject.toml").read_text()
    required = re.findall(r'^    "transformers([^"]*)",$', pyproject, flags=re.M)  # tomllib is 3.11+
    assert required == [hf_packing._compat.SUPPORTED_TRANSFORMERS]
    row = [
        line for line in (root / "docs" / "versions.md").read_text().splitlines() if line.startswith("| transformers |")
    ]
    stated = re.findall(r"([<>=!]=?) ?(\d[\w.]*)", row[0].split("|")[2])
    assert SpecifierSet(",".join(op + v for op, v in stated)) == SpecifierSet(hf_packing._compat.SUPPORTED_TRANSFORMERS)
    for version, supported in [("5.17.0", True), ("5.23.0.dev0", True), ("5.23.4", True), ("5.24.0.dev0", False)]:
        monkeypatch.setattr(transformers, "__version__", version)
        if supported:
            assert hf_packing._compat.check_transformers_version() == version
        else:
            with pytest.raises(RuntimeError, match=f"found {version}"):
                hf_packing._compat.check_transformers_version()


def test_import_is_side_effect_free():
    code = "import hf_packing, sys; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_bad_attention_masks_name_the_row():
    model, processor = model_and_processor("qwen2_vl")
    batch = processed_batch(processor, conversations(with_video=False))
    hf_packing.apply_rmpad("qwen2_vl")
    holed = dict(batch, attention_mask=batch["attention_mask"].clone())
    holed["attention_mask"][2, 3] = 0
    with pytest.raises(ValueError, match="row 2 has a hole"):
        model(**holed)
    weird = dict(batch, attention_mask=batch["attention_mask"] * 2)
    with pytest.raises(ValueError, match="row 0 has values other than 0 and 1"):
        model(**weird)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "glm4v"])
def test_placeholder_mismatch_names_the_row(model_type):
    model, processor = model_and_processor(model_type)
    batch = processed_batch(processor, conversations(with_video=False))
    hf_packing.apply_rmpad(model_type)
    grids = batch["image_grid_thw"].clone()
    grids[[0, 1]] = grids[[1, 0]]  # same total, but rows 1 and 2 now disagree with their grids
    if torch.equal(grids, batch["image_grid_thw"]):
        pytest.skip("images have equal grids")
    with pytest.raises(
        ValueError, match="Image features and image tokens do not match.*sequence 1 has .* image placeholder"
    ):
        model(**dict(batch, image_grid_thw=grids))


@pytest.mark.parametrize("model_type", ["qwen3_vl", "glm4v"])
def test_eval_logits_and_loss_match_unpatched(model_type):
    """In eval mode the patched forward returns loss *and* re-padded logits, like the unpatched model; in training
    (or with skip_logits=True) the logits are never built."""
    model, processor = model_and_processor(model_type, "left")
    batch = processed_batch(processor, padded_rows(model_type)) | {"use_cache": False}
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    model.eval()
    with torch.no_grad():
        ref, ref_labelled = model(**inputs), model(**batch)
        hf_packing.apply_rmpad(model_type)
        got, labelled = model(**inputs), model(**batch)
        skipped = model(**batch, skip_logits=True)
    mask = batch["attention_mask"].bool()
    for ours, theirs in ((got, ref), (labelled, ref_labelled)):
        assert ours.logits.shape == theirs.logits.shape
        torch.testing.assert_close(ours.logits[mask], theirs.logits[mask], rtol=1e-4, atol=1e-5)
        assert not ours.logits[~mask].any()  # padded positions are zeros (documented difference)
    torch.testing.assert_close(labelled.loss, ref_labelled.loss, rtol=1e-5, atol=0)
    assert skipped.logits is None and skipped.loss.item() == labelled.loss.item()
    assert labelled.num_supervised_tokens == int((batch["labels"] != -100).sum())
    model.train()
    assert model(**batch).logits is None


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_5", "glm4v"])
def test_generation_falls_back_to_original_forward(model_type):
    """Cached generation runs the original forward (for Qwen3.5 also the original linear-attention kernels)."""
    model, processor = model_and_processor(model_type, "left")
    batch = processed_batch(processor, conversations(with_video=False)[:2])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    model.eval()
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=processor.tokenizer.pad_token_id)
    ref = model.generate(**inputs, **kwargs)
    hf_packing.apply_rmpad(model_type)
    assert torch.equal(model.generate(**inputs, **kwargs), ref)


@pytest.mark.parametrize("model_type", ["qwen3_vl", "qwen3_5", "glm4v"])
def test_gradient_checkpointing_equivalent(model_type):
    model, processor = model_and_processor(model_type)
    batch = processed_batch(processor, conversations(with_video=False))
    ref = loss_and_grads(model, batch)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    hf_packing.apply_rmpad(model_type)
    assert_equivalent(ref, loss_and_grads(model, batch), f"{model_type}/grad-ckpt")


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "glm4v"])
def test_peft_lora_equivalent(model_type):
    peft = pytest.importorskip("peft")
    model, processor = model_and_processor(model_type)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(model, config)
    batch = processed_batch(processor, conversations(with_video=False))
    ref = loss_and_grads(model, batch)
    hf_packing.apply_rmpad(model_type)
    assert_equivalent(ref, loss_and_grads(model, batch), "lora")


@pytest.mark.parametrize("model_type", ["qwen3_vl", "glm4v"])
def test_dummy_vision_touches_vision_tower_with_zero_weight(model_type):
    model, processor = model_and_processor(model_type)
    batch = processed_batch(processor, conversations()[:1])  # text only
    hf_packing.apply_rmpad(model_type)
    plain_loss, plain = loss_and_grads(model, batch)
    assert not any(n.startswith("model.visual") for n in plain)
    hf_packing.apply_rmpad(model_type, dummy_vision=True)
    loss, grads = loss_and_grads(model, batch)
    visual = [g for n, g in grads.items() if n.startswith("model.visual")]
    assert loss == plain_loss and visual and all(torch.count_nonzero(g) == 0 for g in visual)


def test_unsupported_attn_implementation_is_refused():
    model, processor = model_and_processor("qwen2_vl")
    model.set_attn_implementation("eager")
    hf_packing.apply_rmpad("qwen2_vl")
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        model(**processed_batch(processor, conversations(with_video=False)))


@pytest.mark.parametrize("mode", ["rows", "flat"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_collated_pack_patched_equals_unpatched(model_type, mode):
    """On `VisionCollator`'s batches (boundaries, positions, ``vision_inputs`` precomputed in the worker, trusted in
    the step) the patched model equals the unpatched one on the same samples as padded rows; a video comes before the
    images, so the DeepStack families place them as one kind in row order, not images first."""
    from hf_packing import VisionCollator
    from tests.helpers import processed_samples

    model, processor = model_and_processor(model_type)
    samples = processed_samples(processor)
    pack = [samples[4], samples[1], samples[0], samples[2]]  # video, image, text, 2 images
    ref = loss_and_grads(model, VisionCollator(processor)(pack))
    batch = VisionCollator(processor, mode=mode, model_config=model.config)(pack)
    if model_type.startswith("qwen3_vl"):
        assert batch["vision_inputs"]["hf_packing_item_order"] == [3, 0, 1, 2]  # the video (item 3) first
    hf_packing.apply_rmpad(model_type)
    assert_equivalent(ref, loss_and_grads(model, batch), f"{model_type}/{mode}")
