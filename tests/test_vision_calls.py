"""One vision-tower call per forward on every rank (hf_packing/patches/_vision.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

import hf_packing
from hf_packing.testing.tiny import build_tiny_model
from tests.conftest import FIXTURES, MODEL_TYPES, conversations, load_processor, processed_batch, torchrun


def _count_tower_calls(model) -> list[int]:
    calls: list[int] = []
    model.model.visual.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_images_and_video_in_one_tower_call_equal_two(model_type):
    """A pack with 2 images and a video: the patched forward calls the tower once (unpatched: twice), and its
    loss and every gradient equal the unpatched model's."""
    processor = load_processor(model_type)
    rows = conversations()
    batch = processed_batch(processor, [rows[2], rows[4]])
    assert "pixel_values" in batch and "pixel_values_videos" in batch
    torch.manual_seed(0)
    model = build_tiny_model(model_type, processor_dir=FIXTURES / model_type)
    calls = _count_tower_calls(model)
    reference = model(**batch, use_cache=False).loss
    reference.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert len(calls) == 2  # transformers: images, then videos
    model.zero_grad()
    calls.clear()
    hf_packing.apply_rmpad(model_type)
    loss = model(**batch).loss
    loss.backward()
    assert len(calls) == 1
    torch.testing.assert_close(loss, reference, rtol=2e-6, atol=0)
    for name, grad in expected.items():
        got = dict(model.named_parameters())[name].grad
        assert float((got - grad).norm() / grad.norm().clamp_min(1e-12)) < 1e-5, name
    vision_grads = [n for n in expected if n.startswith("model.visual.") and expected[n].abs().sum() > 0]
    assert vision_grads  # the features of both kinds reach the loss through the single call


@pytest.mark.parametrize("has_pixels", [False, True])
def test_dummy_call_only_without_pixels(has_pixels):
    """``dummy_vision`` runs the tower once on a text-only batch, and never adds a call to a batch with pixels."""
    processor = load_processor("qwen2_5_vl")
    rows = conversations()
    batch = processed_batch(processor, [rows[1]] if has_pixels else [rows[0]])
    model = build_tiny_model("qwen2_5_vl", processor_dir=FIXTURES / "qwen2_5_vl")
    calls = _count_tower_calls(model)
    hf_packing.apply_rmpad("qwen2_5_vl", dummy_vision=True)
    model(**batch).loss.backward()
    assert len(calls) == 1
    assert model.model.visual.patch_embed.proj.weight.grad is not None


def _fsdp_run(tmp_path: Path, model_type: str, *extra: str) -> subprocess.CompletedProcess:
    script = Path(__file__).parent / "multiproc_fsdp_vision.py"
    proc = torchrun(script, model_type, str(tmp_path / "out.json"), *extra)
    if proc is None:
        pytest.fail("FSDP2 run with mixed image/video ranks hung (no step finished in 240 s)")
    return proc


@pytest.mark.multiproc
@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_fsdp2_mixed_image_video_ranks_complete(tmp_path, model_type):
    """2 gloo processes under FSDP2: rank 0 images + video, rank 1 images only, then text only. Both finish their
    training steps and an evaluation step (images + video | text only) with one tower call each."""
    proc = _fsdp_run(tmp_path, model_type)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"out.json.{rank}").read_text())
        assert result["tower_calls"] == [1, 1, 1]
        assert all(torch.isfinite(torch.tensor(result["losses"])))


@pytest.mark.multiproc
def test_fsdp2_mixed_ranks_negative_control(tmp_path):
    """The same run with the tower calls left as transformers makes them (2 on rank 0, 1 on rank 1) fails."""
    proc = _fsdp_run(tmp_path, "qwen2_5_vl", "separate")
    assert proc.returncode != 0
    assert "collective mismatch" in proc.stderr or "doesn't match" in proc.stderr, proc.stderr[-2000:]
