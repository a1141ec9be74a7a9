"""VisionCollator: exact tensors on literal inputs, and model-level equivalences for both modes."""

from __future__ import annotations

import pytest
import torch

import hf_packing
from hf_packing import VisionCollator
from hf_packing.testing.tiny import build_tiny_model, tiny_config
from tests.helpers import FIXTURES, conversations, load_processor, processed_samples

A = {"input_ids": [1, 2, 3], "labels": [1, 2, 3]}
B = {"input_ids": [4, 5, 6, 7, 8], "labels": [-100, -100, 6, 7, 8]}
C = {"input_ids": [9], "labels": [9]}


def test_rows_right_padding_literal():
    batch = VisionCollator(pad_token_id=0, return_cu_seqlens=True)([[A, B], [C]])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8], [9, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, -100], [-100, -100, 6, 7, 8], [-100] * 5]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert batch["cu_seqlens"].tolist() == [0, 3, 8, 9] and batch["cu_seqlens"].dtype == torch.int32
    assert batch["max_seqlen"] == 5 and type(batch["max_seqlen"]) is int
    assert batch["num_supervised_tokens"] == 5 and type(batch["num_supervised_tokens"]) is int
    assert batch["seqlens"] == [3, 5, 1]


def test_rows_left_padding_and_multiple_of_literal():
    batch = VisionCollator(pad_token_id=0, padding_side="left", pad_to_multiple_of=4, return_cu_seqlens=False)([A, C])
    assert batch["input_ids"].tolist() == [[0, 1, 2, 3], [0, 0, 0, 9]]
    assert batch["attention_mask"].tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]
    assert batch["labels"].tolist() == [[-100, -100, 2, 3], [-100] * 4]
    assert "cu_seqlens" not in batch and batch["num_supervised_tokens"] == 2 and batch["seqlens"] == [3, 1]


def test_flat_literal():
    batch = VisionCollator(pad_token_id=0, mode="flat", model_config=tiny_config("qwen2_vl"))([[A, B], C])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, -100, 6, 7, 8, -100]]
    assert batch["position_ids"].shape == (4, 1, 9)
    assert batch["position_ids"][0, 0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0]
    assert torch.equal(batch["position_ids"][1:], batch["position_ids"][:1].expand(3, -1, -1))
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 8, 9] and batch["max_length_q"] == 5
    assert batch["num_supervised_tokens"] == 5 and batch["seqlens"] == [3, 5, 1]
    assert "attention_mask" not in batch


def test_vision_grids_are_the_host_grids_images_then_videos():
    processor = load_processor("qwen2_vl")
    samples = processed_samples(processor)
    batch = VisionCollator(processor)([samples[4], samples[2], samples[0]])  # a video, then 2 images, then text
    assert batch["vision_grids"] == [[1, 4, 8], [1, 4, 4], [2, 4, 6]]
    assert "vision_grids" not in VisionCollator(pad_token_id=0)([A, B])


@pytest.mark.parametrize(
    "features, message",
    [
        ([], "empty batch"),
        ([[]], "only empty packs"),
        ([{"labels": [1]}], "sample 0 has no 'input_ids'"),
        ([A, {"input_ids": [1, 2], "labels": [1]}], "sample 1: labels has 1 tokens"),
    ],
)
def test_bad_input(features, message):
    with pytest.raises(ValueError, match=message):
        VisionCollator(pad_token_id=0)(features)


def test_image_token_mismatch_and_foreign_processor_name_the_sample():
    processor = load_processor("qwen2_5_vl")
    samples = processed_samples(processor, conversations(with_video=False))
    collate = VisionCollator(processor)
    broken = dict(samples[1], input_ids=samples[1]["input_ids"][:-30].clone(), labels=samples[1]["labels"][:-30])
    broken["input_ids"][5] = 1  # drop one placeholder too
    bad = dict(samples[1], input_ids=samples[1]["input_ids"].clone())
    bad["input_ids"][bad["input_ids"] == processor.image_token_id] = 5
    with pytest.raises(ValueError, match="sample 1: 0 image placeholder tokens"):
        collate([samples[0], bad])
    foreign = dict(samples[1], pixel_values=torch.zeros(samples[1]["pixel_values"].shape[0], 1536))
    with pytest.raises(ValueError, match="sample 0: pixel_values has patch dim 1536"):
        collate([foreign])


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_position_ids_match_model_rope_index_per_sample(model_type):
    processor = load_processor(model_type)
    model = build_tiny_model(model_type, processor_dir=FIXTURES / model_type)
    samples = processed_samples(processor)
    batch = VisionCollator(processor, model_config=model.config)(samples)
    for row, sample in enumerate(samples):
        extra = (
            {"second_per_grid_ts": sample["second_per_grid_ts"]} if sample.get("second_per_grid_ts") is not None else {}
        )
        if sample.get("image_grid_thw") is None and sample.get("video_grid_thw") is None:
            expected = torch.arange(sample["input_ids"].numel()).expand(3, -1)
        else:
            expected, _ = model.model.get_rope_index(
                sample["input_ids"][None],
                mm_token_type_ids=sample["mm_token_type_ids"][None],
                image_grid_thw=sample.get("image_grid_thw"),
                video_grid_thw=sample.get("video_grid_thw"),
                **extra,
            )
            expected = expected[:, 0]
        n = sample["input_ids"].numel()
        assert torch.equal(batch["position_ids"][:, row, :n], expected)


def _loss(model, batch) -> float:
    with torch.no_grad():
        return model(**batch).loss.item()


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_rows_unpatched_equals_patched_and_flat_equals_rows(model_type):
    processor = load_processor(model_type)
    model = build_tiny_model(model_type, processor_dir=FIXTURES / model_type).eval()
    samples = processed_samples(processor)
    packs = [samples[:2], samples[2:]]
    rows_unpatched = _loss(model, VisionCollator(processor)(packs))
    # Flat: one row, sdpa builds the block mask from the text position row; token-weighted mean like rows.
    flat = _loss(model, VisionCollator(processor, mode="flat", model_config=model.config)(packs))
    hf_packing.apply_rmpad(model_type)
    assert "cu_seqlens" not in VisionCollator(processor)(packs)  # only on request: the mask gives the boundaries
    rows_batch = VisionCollator(processor, model_config=model.config, return_cu_seqlens=True)(packs)
    assert "cu_seqlens" in rows_batch and "position_ids" in rows_batch
    rows_patched = _loss(model, rows_batch)
    flat_patched = _loss(model, VisionCollator(processor, mode="flat", model_config=model.config)(packs))
    print(
        f"{model_type}: rows unpatched {rows_unpatched:.7f} patched {rows_patched:.7f} flat {flat:.7f} "
        f"flat patched {flat_patched:.7f}"
    )
    assert rows_patched == pytest.approx(rows_unpatched, rel=1e-5)
    assert flat == pytest.approx(rows_unpatched, rel=1e-5)
    assert flat_patched == pytest.approx(rows_unpatched, rel=1e-5)
