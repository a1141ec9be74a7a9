"""GLM-V (GLM-4.1V, GLM-4.5V, GLM-4.6V): padded and packed batches equal every sample run alone on the unpatched model.

The oracle is each sample alone, unpadded, on transformers' own code: GLM's unpatched model refuses a padded batch
that holds images and a video ("Image features and image tokens do not match": a video frame is written with the
image token), so no batched unpatched run can serve. Layouts: padded rows (right, left, processor's batch) and the
collator's packs (rows and one flat row). The conversations cover text-only, one and two images, multi-turn and a
video, so every batch mixes images and a video. Negative controls: the text attention without the boundaries fails,
and transformers' own packed format (one flat row, positions restarting per sample) leaks.
"""

from __future__ import annotations

import functools

import pytest
import torch

import hf_packing
from hf_packing import VisionCollator
from hf_packing.ops.varlen import PackedSequences
from hf_packing.patches import _attention, is_applied
from hf_packing.testing.tiny import GLM_TYPES
from tests.helpers import (
    assert_equivalent,
    conversations,
    each_sample_alone,
    load_processor,
    loss_and_grads,
    model_and_processor,
    processed_batch,
    processed_samples,
)

LAYOUTS = ("padded_right", "padded_left", "rows", "flat")


@functools.cache
def _oracle(model_type: str, with_video: bool = True) -> tuple[float, dict[str, torch.Tensor]]:
    """Each sample alone on the unpatched model; tests take it before they patch anything."""
    assert not is_applied(model_type), "the oracle runs on the unpatched model"
    model, processor = model_and_processor(model_type)
    return each_sample_alone(model, processed_samples(processor, conversations(with_video)))


def layout_batch(model, model_type: str, layout: str, with_video: bool = True) -> dict:
    """The conversations as one batch in ``layout``."""
    processor = load_processor(model_type, "left" if layout == "padded_left" else "right")
    rows = conversations(with_video)
    if layout.startswith("padded"):
        return processed_batch(processor, rows)
    return VisionCollator(processor, mode=layout, model_config=model.config)(processed_samples(processor, rows))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model_type", GLM_TYPES)
def test_patched_equals_each_sample_alone_unpatched(model_type, layout):
    oracle, (model, _) = _oracle(model_type), model_and_processor(model_type)
    batch = layout_batch(model, model_type, layout)
    assert batch["pixel_values"] is not None and batch["pixel_values_videos"] is not None  # one batch, both kinds
    hf_packing.apply_rmpad(model_type)
    assert_equivalent(oracle, loss_and_grads(model, batch), f"{model_type}/{layout} vs each alone")


@pytest.mark.parametrize("model_type", GLM_TYPES)
def test_unpatched_refuses_images_with_a_video_and_its_packed_format_leaks(model_type):
    """What the unpatched model does with the same batches: a padded batch holding images and a video is refused;
    transformers' own packed format (`DataCollatorWithFlattening`: one flat row, text positions restarting per
    sample, `cu_seq_lens_*`) on the samples without the video runs, but far from each sample alone: its positions
    are 1-D per sample, where each image's tokens need their 3-D M-RoPE positions."""
    model, _ = model_and_processor(model_type)
    with pytest.raises((ValueError, RuntimeError), match="features and image tokens do not match"):
        loss_and_grads(model, layout_batch(model, model_type, "padded_right"))
    flat = layout_batch(model, model_type, "flat", with_video=False)
    flat["position_ids"] = flat["position_ids"][0]  # transformers' flattening collator: text positions per sample
    unpatched = loss_and_grads(model, flat)
    with pytest.raises(AssertionError):
        assert_equivalent(_oracle(model_type, False), unpatched, f"{model_type}/unpatched flat vs each alone")


@pytest.mark.parametrize("model_type", GLM_TYPES)
def test_negative_control_text_attention_without_boundaries(model_type, monkeypatch):
    """The same comparison fails when the text attention sees the pack as one sequence (the vision tower and the loss
    keep their boundaries): the equivalence above depends on the text boundaries."""
    oracle, (model, _) = _oracle(model_type), model_and_processor(model_type)
    batch = layout_batch(model, model_type, "rows")
    kernel = _attention.varlen_attention

    def merged(q, k, v, seqs, *, causal, **kwargs):
        if causal:
            seqs = PackedSequences.from_seqlens([sum(seqs.seqlens)], device=seqs.cu_seqlens.device)
        return kernel(q, k, v, seqs, causal=causal, **kwargs)

    monkeypatch.setattr(_attention, "varlen_attention", merged)
    hf_packing.apply_rmpad(model_type)
    with pytest.raises(AssertionError):
        assert_equivalent(oracle, loss_and_grads(model, batch), f"{model_type}/text boundary dropped")


def test_sequence_parallel_is_refused_naming_why():
    from hf_packing.parallel.state import SequenceParallelState

    model, processor = model_and_processor("glm4v")
    batch = VisionCollator(processor, model_config=model.config)(processed_samples(processor)[:2])
    state = SequenceParallelState(2)
    state.group = lambda: object()  # type: ignore[method-assign]  # a group, as on 2 ranks; refused before use
    hf_packing.apply_rmpad("glm4v", sequence_parallel_size=state)
    with pytest.raises(ValueError, match="sequence_parallel_size=2 is not supported for glm4v"):
        model(**batch)
