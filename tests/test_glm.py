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
from pathlib import Path

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
    image,
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


def _mixed_sample() -> tuple:
    """One conversation holding a video, then an image: transformers' GLM refuses it even alone."""
    (question, answer), clip = conversations()[-1][0], conversations()[-1][2]
    return [{**question, "content": [*question["content"], {"type": "image"}]}, answer], [image(84, 56, 5)], clip


@pytest.mark.parametrize("mode", ["rows", "flat"])
def test_a_pack_with_videos_before_images_and_a_video_and_an_image_in_one_sample(mode):
    """The tower's items in row order, not images-then-videos. A pack whose first sample is a video equals each sample
    alone on the unpatched model. A sample holding a video and then an image (which transformers' GLM refuses even
    alone) packed with the others equals each of them alone on the patched model."""
    model, processor = model_and_processor("glm4v")
    video_first = processed_samples(processor, conversations()[::-1])
    oracle = each_sample_alone(model, video_first)
    collate = VisionCollator(processor, mode=mode, model_config=model.config)
    hf_packing.apply_rmpad("glm4v")
    assert_equivalent(oracle, loss_and_grads(model, collate(video_first)), f"glm4v/video first/{mode} vs each alone")
    mixed = [*video_first, *processed_samples(processor, [_mixed_sample()])]
    alone = each_sample_alone(model, mixed)
    assert_equivalent(alone, loss_and_grads(model, collate(mixed)), f"glm4v/video+image sample/{mode} vs each alone")


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


# ------------------------------------------------------------------------------------------------ the packer's side
def _rows(with_video: bool = True) -> list[dict]:
    """The conversations as dataset rows: messages with bare placeholders, `images` / `videos` columns, frames at 2
    fps."""
    return [
        {"messages": messages, "images": images, "videos": videos, "fps": 2.0}
        for messages, images, videos in conversations(with_video)
    ]


def _processors_own_tokens(processor, pre, row: dict) -> torch.Tensor:
    """The processor on the row alone: its template's text (plus the eos a footer-less template's last answer gets,
    docs/chat_templates.md), its images and its frames with their metadata."""
    text = pre.template.render(row["messages"])
    text += pre.template.markers.close if row["messages"][-1]["role"] == "assistant" else ""
    metadata = [
        {"total_num_frames": len(v), "fps": row["fps"], "frames_indices": list(range(len(v)))} for v in row["videos"]
    ]
    out = processor(
        text=[text],
        images=row["images"] or None,
        videos=row["videos"] or None,
        videos_kwargs={"do_sample_frames": False, "video_metadata": metadata} if row["videos"] else {},
        return_tensors="pt",
    )
    return out["input_ids"][0]


@pytest.mark.parametrize("model_type", GLM_TYPES)
def test_planned_lengths_equal_the_processors_own_token_counts(model_type):
    """The packer's metadata-only estimate (GLM's resize rules, a video's frames with their timestamps) equals the
    processor's own tokens for each row: text, one and two images, multi-turn, a video; and the processed sample is
    exactly those tokens. Negative control: the estimate without the video's timestamps would be short."""
    from hf_packing.preprocess.preprocessor import Preprocessor

    processor = load_processor(model_type)
    pre = Preprocessor(processor)
    for row in _rows():
        meta = pre.estimate(row)
        own = _processors_own_tokens(processor, pre, row)
        sample = pre.process(row, planned_tokens=meta.num_tokens)
        assert meta.num_tokens == own.numel() and torch.equal(sample["input_ids"], own)
        if row["videos"]:
            frames = int(sample["video_grid_thw"][0, 0])
            stamps = processor.tokenizer(processor.replace_frame_token_id(0.0, 1)).input_ids[3:]  # after the image
            assert meta.num_tokens - meta.video_tokens - frames * (2 + len(stamps)) > 0
            assert meta.video_tokens == int((sample["mm_token_type_ids"] == 2).sum())


def test_the_prober_ends_a_glm_answer_at_the_next_role_token_and_closes_the_last_with_eos():
    """GLM's template writes nothing after an assistant turn: the answer ends at the control token that opens what
    follows (supervised: GLM's generation stops on it), and the last answer, which ends the text, gets the eos."""
    from hf_packing.preprocess.preprocessor import Preprocessor

    processor = load_processor("glm4v")
    pre = Preprocessor(processor)
    markers = pre.template.markers
    assert (markers.header, markers.footer, markers.close) == ("<|assistant|>\n", "", "<|endoftext|>")
    assert set(markers.stops) == {"<|user|>", "<|assistant|>", "<|observation|>"}
    sample = pre.process(_rows(False)[3])  # two turns
    text = glm_marked(processor, sample)
    assert text in DOC_SAMPLE, f"docs/chat_templates.md: the GLM-4.1V example is stale; it renders as\n{text}"
    eos, user = processor.tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|user|>"])
    supervised = sample["input_ids"][sample["labels"] != -100].tolist()
    assert supervised.count(user) == 1 and supervised[-1] == eos


def glm_marked(processor, sample: dict) -> str:
    """The sample's text with each run of supervised tokens in ⟦ ⟧ and each run of image tokens as one."""
    out, inside, previous = [], False, None
    for token, label in zip(sample["input_ids"].tolist(), sample["labels"].tolist()):
        if (label != -100) != inside:
            out.append("⟦" if not inside else "⟧")
            inside = not inside
        text = processor.tokenizer.decode([token])
        if not (text == "<|image|>" == previous):
            out.append(text)
        previous = text
    return "".join(out) + ("⟧" if inside else "")


DOC_SAMPLE = (Path(__file__).parents[1] / "docs" / "chat_templates.md").read_text()


def test_glm4v_moe_router_loss_matches():
    """GLM-4.5V's load-balancing term (``num_local_experts``, GLM's alias of ``n_routed_experts``) on a padded batch
    the unpatched model accepts (images, no video): loss, aux loss and gradients equal."""
    model, processor = model_and_processor("glm4v_moe")
    batch = processed_batch(processor, conversations(with_video=False)) | {"output_router_logits": True}
    model.zero_grad(set_to_none=True)
    ref_aux = model(**batch).aux_loss.item()
    ref = loss_and_grads(model, batch)
    hf_packing.apply_rmpad("glm4v_moe")
    assert model(**batch).aux_loss.item() == pytest.approx(ref_aux, rel=1e-5)
    assert_equivalent(ref, loss_and_grads(model, batch), "glm4v_moe+aux")
