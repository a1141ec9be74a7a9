"""``hf_packing.testing.tiny``: local tiny Qwen-VL processors (committed fixtures) and random-weight models."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hf_packing.testing.tiny import (
    MODEL_TYPES,
    TOKEN_IDS,
    VOCAB_SIZE,
    build_tiny_model,
    build_tiny_processor,
    check_special_tokens,
    save_tiny_checkpoint,
    tiny_config,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
PROCESSOR_CLASS = {
    "qwen2_vl": "Qwen2VLProcessor",
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
    "qwen3_vl_moe": "Qwen3VLProcessor",
    "qwen3_5": "Qwen3VLProcessor",
    "qwen3_5_moe": "Qwen3VLProcessor",
    "qwen4_exp": "Qwen3VLProcessor",
}
MODEL_CLASS = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen4_exp": "Qwen4ExpForConditionalGeneration",
}
IMAGE_PAD, VIDEO_PAD = TOKEN_IDS["<|image_pad|>"], TOKEN_IDS["<|video_pad|>"]

per_family = pytest.mark.parametrize("model_type", MODEL_TYPES)


def _image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _messages(image: Image.Image, question: str = "Describe the image.") -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]},
        {"role": "assistant", "content": "A red car near a small house."},
    ]


@pytest.fixture(scope="module")
def _cache() -> dict:
    return {}


@pytest.fixture
def processor(model_type: str, _cache: dict):
    from transformers import AutoProcessor

    key = ("processor", model_type)
    if key not in _cache:
        _cache[key] = AutoProcessor.from_pretrained(FIXTURES / model_type)
    return _cache[key]


@pytest.fixture
def model(model_type: str, _cache: dict):
    key = ("model", model_type)
    if key not in _cache:
        _cache[key] = build_tiny_model(model_type, processor_dir=FIXTURES / model_type, seed=0)
    return _cache[key]


def _assert_image_tokens(batch, merge: int = 2) -> None:
    grids = batch["image_grid_thw"]
    expected = [int(g.prod()) // merge**2 for g in grids]
    assert int((batch["input_ids"] == IMAGE_PAD).sum()) == sum(expected)
    assert batch["pixel_values"].shape[0] == int(grids.prod(-1).sum())
    if "mm_token_type_ids" in batch:  # emitted by transformers 5.x; 1 marks image tokens, 2 video tokens
        assert torch.equal(batch["mm_token_type_ids"] == 1, batch["input_ids"] == IMAGE_PAD)


@per_family
def test_fixture_processor_class(model_type: str, processor) -> None:
    assert type(processor).__name__ == PROCESSOR_CLASS[model_type]
    assert type(processor.tokenizer).__name__ == (
        "Qwen3_5Tokenizer" if model_type.startswith(("qwen3_5", "qwen4")) else "Qwen2Tokenizer"
    )
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    assert processor.image_processor.patch_size == (16 if model_type.startswith(("qwen3", "qwen4")) else 14)
    assert sum(f.stat().st_size for f in (FIXTURES / model_type).iterdir()) < 1_000_000


@per_family
def test_fixture_is_up_to_date(model_type: str, tmp_path: Path) -> None:
    fresh = build_tiny_processor(model_type, tmp_path / model_type)
    for name in ("tokenizer.json", "processor_config.json", "tokenizer_config.json"):
        assert json.loads((fresh / name).read_text()) == json.loads((FIXTURES / model_type / name).read_text()), name
    assert (fresh / "chat_template.jinja").read_text() == (FIXTURES / model_type / "chat_template.jinja").read_text()


@per_family
def test_special_token_ids_match(model_type: str, processor) -> None:
    config = tiny_config(model_type)
    tok = processor.tokenizer
    text = config.get_text_config()
    assert len(tok) == VOCAB_SIZE == text.vocab_size
    for name, token in [
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ]:
        assert getattr(config, name) == tok.convert_tokens_to_ids(token) == TOKEN_IDS[token]
    assert text.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert text.pad_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert processor.image_token_id == IMAGE_PAD and processor.video_token_id == VIDEO_PAD
    check_special_tokens(config, processor)
    with pytest.raises(ValueError, match="image_token_id"):
        check_special_tokens(tiny_config(model_type, image_token_id=3), processor)


@per_family
def test_chat_template_renders_chatml(model_type: str, processor) -> None:
    text = processor.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Hi"}]},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\n"
    )


@per_family
def test_single_image_chat_and_forward(model_type: str, processor, model) -> None:
    batch = processor.apply_chat_template(
        _messages(_image(112, 84)), tokenize=True, return_dict=True, return_tensors="pt"
    )
    assert {"input_ids", "attention_mask", "pixel_values", "image_grid_thw"} <= set(batch)
    # 84x112 -> qwen2/2.5 (28 px per merged token): 84x112 -> grid 6x8; qwen3 (32 px): 96x128 -> grid 6x8.
    assert batch["image_grid_thw"].tolist() == [[1, 6, 8]]
    _assert_image_tokens(batch)
    assert int((batch["input_ids"] == IMAGE_PAD).sum()) == 12
    torch.manual_seed(0)
    out = model(**batch, labels=batch["input_ids"])
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    assert out.logits.shape[-1] == VOCAB_SIZE
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    model.zero_grad(set_to_none=True)


@per_family
def test_padded_batch_forward(model_type: str, processor, model) -> None:
    images = [_image(112, 84, seed=1), _image(150, 200, seed=2)]
    texts = [
        processor.apply_chat_template(_messages(images[0]), tokenize=False),
        processor.apply_chat_template(_messages(images[1], "What is in this tall picture of a dog?"), tokenize=False),
    ]
    batch = processor(text=texts, images=images, padding=True, return_tensors="pt")
    assert batch["input_ids"].shape[0] == 2 and batch["image_grid_thw"].shape == (2, 3)
    assert (batch["attention_mask"] == 0).any()
    pad_id = processor.tokenizer.pad_token_id
    assert (batch["input_ids"][batch["attention_mask"] == 0] == pad_id).all()
    _assert_image_tokens(batch)
    for row, grid in zip(batch["input_ids"], batch["image_grid_thw"]):
        assert int((row == IMAGE_PAD).sum()) == int(grid.prod()) // 4
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with torch.no_grad():
        out = model(**batch, labels=labels)
    assert torch.isfinite(out.loss)


@per_family
def test_video_from_numpy_frames(model_type: str, processor, model) -> None:
    rng = np.random.default_rng(3)
    video = rng.integers(0, 256, (4, 64, 64, 3), dtype=np.uint8)  # (T, H, W, 3); no decoder package needed
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    batch = processor(text=[text], videos=[video], return_tensors="pt")
    grid = batch["video_grid_thw"]
    assert grid.tolist() == [[2, 4, 4]]
    assert int((batch["input_ids"] == VIDEO_PAD).sum()) == int(grid.prod()) // 4
    decoded = processor.tokenizer.decode(batch["input_ids"][0])
    # Qwen3-VL splits a video per temporal patch, each preceded by a "<t seconds>" timestamp.
    assert ("seconds>" in decoded) == model_type.startswith(("qwen3", "qwen4"))
    with torch.no_grad():
        out = model(**batch, labels=batch["input_ids"])
    assert torch.isfinite(out.loss)


@per_family
def test_model_is_tiny_fp32_and_seeded(model_type: str, model) -> None:
    assert type(model).__name__ == MODEL_CLASS[model_type]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    rotary_dim = int(head_dim * text.rope_parameters.get("partial_rotary_factor", 1.0))  # Qwen3.5: 0.25
    assert sum(text.rope_parameters["mrope_section"]) == rotary_dim // 2
    state = torch.get_rng_state()
    again = build_tiny_model(model_type, seed=0)
    assert torch.equal(state, torch.get_rng_state())  # global RNG untouched
    other = build_tiny_model(model_type, seed=1)
    ref = dict(model.named_parameters())
    assert all(torch.equal(p, ref[n]) for n, p in again.named_parameters())
    assert not torch.equal(other.lm_head.weight, model.lm_head.weight)


@per_family
def test_save_tiny_checkpoint_roundtrip(model_type: str, tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    out = save_tiny_checkpoint(model_type, tmp_path / "ckpt")
    model = AutoModelForImageTextToText.from_pretrained(out)
    processor = AutoProcessor.from_pretrained(out)
    assert type(model).__name__ == MODEL_CLASS[model_type] and model.dtype == torch.float32
    assert type(processor).__name__ == PROCESSOR_CLASS[model_type]
    assert model.config.model_type == model_type
    ref = build_tiny_model(model_type, seed=0).state_dict()
    assert all(torch.equal(t, ref[k]) for k, t in model.state_dict().items())


def test_import_is_side_effect_free() -> None:
    code = (
        "import sys, hf_packing, hf_packing.testing.tiny; print('transformers' in sys.modules, 'torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]


def test_the_tiny_families_follow_the_spec_table():
    """`MODEL_TYPES` + `GLM_TYPES` are the patches' family table, in its order (the testing part sits below the
    patches, so it lists them itself and this test ties the two); the GLM types are the rows whose towers take video
    frames as images. A family added to the table without a tiny model fails here."""
    from hf_packing.patches import FAMILIES
    from hf_packing.testing.tiny import GLM_TYPES

    assert [n for n in FAMILIES if n not in GLM_TYPES] == list(MODEL_TYPES)
    assert [n for n in FAMILIES if n in GLM_TYPES] == list(GLM_TYPES)
    assert list(GLM_TYPES) == [n for n, spec in FAMILIES.items() if spec.video_frames_as_images]
