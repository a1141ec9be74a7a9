"""One vision-tower call per forward on every rank (hf_packing/patches/_vision.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

import hf_packing
from hf_packing.testing.tiny import build_tiny_model
from tests.helpers import (
    FIXTURES,
    MODEL_TYPES,
    assert_equivalent,
    conversations,
    each_sample_alone,
    glm_params,
    load_processor,
    loss_and_grads,
    model_and_processor,
    padded_rows,
    processed_batch,
    processed_samples,
    torchrun,
)


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


@pytest.mark.parametrize("model_type", glm_params("glm4v", "glm4v_moe"))
def test_glm_images_and_video_in_one_tower_call_equal_each_sample_alone(model_type, monkeypatch):
    """GLM-V: the same padded batch of 2 images and a video (the video's frames encoded as images) in one tower call.
    transformers' GLM refuses that batch, so the oracle is each sample alone, unpatched: one tower call each. Its
    loss and every gradient equal the patched batch's, and the tower's parameters get a gradient through the call.
    Negative control: the same call with the tower's attention over all items at once (its frame boundaries
    dropped) fails the comparison."""
    from hf_packing.ops.varlen import PackedSequences
    from hf_packing.patches import _attention

    processor = load_processor(model_type)
    rows = [conversations()[2], conversations()[4]]
    batch = processed_batch(processor, rows)
    assert "pixel_values" in batch and "pixel_values_videos" in batch
    model = build_tiny_model(model_type, processor_dir=FIXTURES / model_type)
    calls = _count_tower_calls(model)
    reference = each_sample_alone(model, processed_samples(processor, rows))
    assert len(calls) == 2
    calls.clear()
    hf_packing.apply_rmpad(model_type)
    got = loss_and_grads(model, batch)
    assert len(calls) == 1
    assert_equivalent(reference, got, f"{model_type}: one tower call vs each sample alone")
    assert any(n.startswith("model.visual.") and g.abs().sum() > 0 for n, g in got[1].items())
    kernel = _attention.varlen_attention

    def merged(q, k, v, seqs, *, causal, **kwargs):
        if not causal:  # the tower's attention: every frame of every item as one sequence
            seqs = PackedSequences.from_seqlens([sum(seqs.seqlens)], device=seqs.cu_seqlens.device)
        return kernel(q, k, v, seqs, causal=causal, **kwargs)

    monkeypatch.setattr(_attention, "varlen_attention", merged)
    with pytest.raises(AssertionError):
        assert_equivalent(reference, loss_and_grads(model, batch), f"{model_type}: tower boundaries dropped")


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl", "glm4v"])
def test_one_call_splits_back_into_the_two_calls_outputs(model_type):
    """Inside `tower_calls` the image and video features (pooled, pre-merge ``last_hidden_state``, DeepStack) equal
    two separate tower calls, split by pixel rows without reading the grids back (no ``tolist``). GLM-V (a video's
    frames encoded as images): with the collator's precomputed inputs, which give the per-item split from the host."""
    from hf_packing.patches._spec import FAMILIES
    from hf_packing.patches._vision import precomputed_vision_inputs, tower_calls
    from hf_packing.testing.syncs import SyncCounter

    processor = load_processor(model_type)
    rows = conversations()
    batch = processed_batch(processor, [rows[2], rows[4]])
    backbone = build_tiny_model(model_type, processor_dir=FIXTURES / model_type).model
    vision = {k: batch[k] for k in ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw")}
    with torch.no_grad():
        apart = (
            backbone.get_image_features(vision["pixel_values"], vision["image_grid_thw"], return_dict=True),
            backbone.get_video_features(vision["pixel_values_videos"], vision["video_grid_thw"], return_dict=True),
        )
        frames = FAMILIES[model_type].video_frames_as_images
        grids = torch.cat([vision["image_grid_thw"], vision["video_grid_thw"]]).tolist()
        config, n_images = backbone.config.vision_config, len(vision["image_grid_thw"])
        given = precomputed_vision_inputs(config, grids, n_images=n_images, frames_as_images=True)
        extra = {"frames_as_images": True, "precomputed": given} if frames else {}
        with tower_calls(backbone, **vision, dummy=False, **extra), SyncCounter() as counter:
            joint = (
                backbone.get_image_features(vision["pixel_values"], vision["image_grid_thw"], return_dict=True),
                backbone.get_video_features(vision["pixel_values_videos"], vision["video_grid_thw"], return_dict=True),
            )
    assert not [at for _, at in counter.host_reads if at.startswith("hf_packing/")]
    for one, two in zip(apart, joint):
        assert sorted(one.keys()) == sorted(two.keys())
        torch.testing.assert_close(one.last_hidden_state, two.last_hidden_state)
        assert [p.shape for p in one.pooler_output] == [p.shape for p in two.pooler_output]  # split per item
        torch.testing.assert_close(torch.cat(one.pooler_output), torch.cat(two.pooler_output))
        for a, b in zip(one.get("deepstack_features") or (), two.get("deepstack_features") or ()):
            torch.testing.assert_close(torch.cat(list(a)), torch.cat(list(b)))


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


FSDP_FAMILIES = ("qwen2_5_vl", "qwen3_vl")


def _fsdp_run(tmp_path: Path, model_types: tuple[str, ...], *extra: str) -> subprocess.CompletedProcess:
    script = Path(__file__).parent / "multiproc_fsdp_vision.py"
    proc = torchrun(script, ",".join(model_types), str(tmp_path / "out.json"), *extra)
    if proc is None:
        pytest.fail("FSDP2 run with mixed image/video ranks hung (no step finished in 240 s)")
    return proc


@pytest.fixture(scope="module")
def fsdp_mixed_ranks(tmp_path_factory) -> list[dict]:
    """One launch for both families, trained in turn in the same processes: each rank's {family: results}."""
    tmp_path = tmp_path_factory.mktemp("fsdp_vision")
    proc = _fsdp_run(tmp_path, FSDP_FAMILIES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"out.json.{rank}").read_text()) for rank in (0, 1)]


@pytest.mark.multiproc
@pytest.mark.parametrize("model_type", FSDP_FAMILIES)
def test_fsdp2_mixed_image_video_ranks_complete(fsdp_mixed_ranks, model_type):
    """2 gloo processes under FSDP2: rank 0 images + video, rank 1 images only, then text only. Both finish their
    training steps and an evaluation step (images + video | text only) with one tower call each."""
    for ranks in fsdp_mixed_ranks:
        result = ranks[model_type]
        assert result["tower_calls"] == [1, 1, 1]
        assert all(torch.isfinite(torch.tensor(result["losses"])))


@pytest.mark.multiproc
def test_fsdp2_mixed_ranks_negative_control(tmp_path):
    """The same run with the tower calls left as transformers makes them (2 on rank 0, 1 on rank 1) fails."""
    proc = _fsdp_run(tmp_path, ("qwen2_5_vl",), "separate")
    assert proc.returncode != 0
    assert "collective mismatch" in proc.stderr or "doesn't match" in proc.stderr, proc.stderr[-2000:]


def test_vision_seqlens_match_transformers_boundaries():
    """`vision_seqlens` (host, from the collator's grids) equals transformers' own frame and window ``cu_seqlens``
    on odd grids (partial windows, several frames); under `host_vision_seqlens` the boundaries are taken from them
    with no host read and no tensor made from host data (trusted: this equality is what makes that safe), no match
    reads back."""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_window_index

    from hf_packing.patches._attention import _VisionBoundaries, host_vision_seqlens
    from hf_packing.patches._vision import vision_seqlens
    from hf_packing.testing.syncs import SyncCounter
    from hf_packing.testing.tiny import tiny_config

    vision = tiny_config("qwen2_5_vl").vision_config
    vision.window_size = 4 * vision.spatial_merge_size * vision.patch_size  # 4x4 merged patches per window
    grids = [[1, 10, 18], [2, 8, 8], [1, 2, 4]]
    frames, windows = vision_seqlens(vision, grids)
    grid = torch.tensor(grids)
    assert frames == get_vision_cu_seqlens(grid).diff().tolist()
    _, cu_windows = get_vision_window_index(grid, vision.spatial_merge_size, vision.window_size, vision.patch_size)
    assert windows == cu_windows.diff().tolist()
    assert vision_seqlens(tiny_config("qwen3_vl").vision_config, grids) == (frames,)
    with host_vision_seqlens((frames, windows)), SyncCounter() as counter:
        assert _VisionBoundaries()(cu_windows, None).seqlens == windows
        assert _VisionBoundaries()(get_vision_cu_seqlens(grid), None).seqlens == frames
    assert (counter.created, sum(counter.host_reads.values())) == (0, 0), counter.report()
    assert _VisionBoundaries()(cu_windows, None).seqlens == windows  # outside: read back from the tensor


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v"])
def test_precomputed_vision_inputs_equal_the_towers_own(model_type):
    """The collator's ``vision_inputs`` (transformers' own helpers, run on the host grids in the worker) give the
    tower exactly the features it computes itself, on odd grids (Qwen2.5-VL windows cut at image edges, a 2-frame
    video, Qwen3-VL's position interpolation), unpatched and through the patched varlen route; and with them the
    tower makes no sync, no ``tolist`` read and no tensor from host data. GLM-V's tower takes a video's frames as
    images: the precomputed inputs of the grids as the collator has them (images, then whole videos) equal the
    tower's own on the frames' grids."""
    from hf_packing import _compat
    from hf_packing.patches._attention import host_vision_seqlens
    from hf_packing.patches._spec import FAMILIES
    from hf_packing.patches._vision import ITEM_TOKENS, TOWER_GRIDS, precomputed_vision_inputs, vision_seqlens
    from hf_packing.testing.syncs import SyncCounter
    from hf_packing.testing.tiny import build_tiny_model

    if _compat.vision_helpers() is None:
        pytest.skip("this transformers' vision towers compute their boundaries themselves")
    overrides = {"vision_config": {"window_size": 4 * 2 * 14}} if model_type == "qwen2_5_vl" else {}
    model = build_tiny_model(model_type, **overrides)
    tower, vision = model.model.visual, model.config.vision_config
    grids = [[1, 10, 18], [2, 8, 8], [1, 2, 4]]  # an image, then two videos
    frames = FAMILIES[model_type].video_frames_as_images
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), patch_dim, generator=torch.Generator().manual_seed(0))

    def inputs() -> tuple[torch.Tensor, dict]:
        """(the tower's grids, the precomputed keywords it pops) as the patched forward hands them over"""
        given = precomputed_vision_inputs(vision, grids, n_images=1, frames_as_images=frames)
        assert given.pop(ITEM_TOKENS) == [t * h * w // vision.spatial_merge_size**2 for t, h, w in grids]
        return given.pop(TOWER_GRIDS, torch.tensor(grids)), given

    grid, precomputed = inputs()
    if frames:  # each video frame as a 1-frame image
        assert grid.tolist() == [[1, 10, 18], [1, 8, 8], [1, 8, 8], [1, 2, 4]]
    assert {"position_ids", "cu_seqlens", "max_seqlen"} <= set(precomputed)
    assert ("window_index" in precomputed) == (model_type == "qwen2_5_vl")
    assert ("interp_indices" in precomputed) == (model_type == "qwen3_vl")
    with torch.no_grad():
        own = tower(pixels, grid_thw=grid).pooler_output
        given = tower(pixels, grid_thw=grid, **precomputed).pooler_output
        assert torch.equal(own, given)
        hf_packing.apply_rmpad(model_type)
        try:
            patched = tower(pixels, grid_thw=grid).pooler_output
            again = inputs()[1]
            # as in the patched forward: the host lengths from the collator's grids (`vision_grids`)
            with host_vision_seqlens(vision_seqlens(vision, grids)), SyncCounter() as counter:
                patched_given = tower(pixels, grid_thw=grid, **again).pooler_output
        finally:
            hf_packing.revert_rmpad(model_type)
    torch.testing.assert_close(patched, own, rtol=1e-5, atol=1e-6)
    assert torch.equal(patched, patched_given)
    assert (counter.total, sum(counter.host_reads.values()), counter.created) == (0, 0, 0), counter.report()


def test_deepstack_by_index_equals_transformers_masked_update():
    """Qwen3-VL's DeepStack update by ``index_add`` at ``nonzero_static`` positions (sized by the collator's count)
    equals transformers' boolean-mask update, values and gradients, with no sync; without a count it is
    transformers' own code."""
    from hf_packing.patches._vision import deepstack_by_index
    from hf_packing.testing.syncs import SyncCounter

    model = build_tiny_model("qwen3_vl")
    backbone = model.model
    generator = torch.Generator().manual_seed(0)
    mask = torch.rand(2, 9, generator=generator) < 0.4
    hidden = torch.randn(2, 9, 8, generator=generator, requires_grad=True)
    embeds = torch.randn(int(mask.sum()), 8, generator=generator, requires_grad=True)
    own = backbone.language_model._deepstack_process(hidden, mask, embeds)
    own_grads = torch.autograd.grad(own.square().sum(), (hidden, embeds))
    with deepstack_by_index(backbone, int(mask.sum())), SyncCounter() as counter:
        given = backbone.language_model._deepstack_process(hidden, mask, embeds)
        grads = torch.autograd.grad(given.square().sum(), (hidden, embeds))
    assert counter.total == 0, counter.report()
    assert torch.equal(own, given) and all(torch.equal(a, b) for a, b in zip(own_grads, grads))
    assert "_deepstack_process" not in vars(backbone.language_model)  # the shadow is gone after the block
    with deepstack_by_index(backbone, None):
        assert "_deepstack_process" not in vars(backbone.language_model)


def test_scatter_rows_equals_masked_scatter_values_and_gradients():
    """The placeholder merge by index (`scatter_rows`, what `PlaceholderMask` routes transformers'
    ``inputs_embeds.masked_scatter(mask, features)`` to) equals ``masked_scatter``: values and both gradients. Negative
    control: a mask with one placeholder row fewer than the features gives another result."""
    from hf_packing.patches._vision import PlaceholderMask, scatter_rows

    torch.manual_seed(0)
    embeds = torch.randn(2, 5, 3, requires_grad=True)
    rows = torch.tensor([[0, 1, 1, 0, 0], [1, 0, 0, 0, 1]], dtype=torch.bool)
    mask = rows.unsqueeze(-1).expand_as(embeds)
    features = torch.randn(4, 3, requires_grad=True)
    weights = torch.randn(2, 5, 3)

    def run(merge):
        embeds.grad = features.grad = None
        out = merge()
        (out * weights).sum().backward()
        return out.detach(), embeds.grad.clone(), features.grad.clone()

    want = run(lambda: embeds.masked_scatter(mask, features))
    for got in (
        run(lambda: scatter_rows(embeds, mask, features)),
        run(lambda: embeds.masked_scatter(mask.as_subclass(PlaceholderMask), features)),
    ):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert type(mask.as_subclass(PlaceholderMask)[..., 0]) is torch.Tensor  # other ops see a plain tensor
    fewer = rows.clone()
    fewer[1, 4] = False
    short = run(lambda: scatter_rows(embeds, fewer.unsqueeze(-1).expand_as(embeds), features[:3]))
    assert not torch.equal(short[0], want[0])


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v"])
def test_a_frozen_tower_runs_without_autograd_and_trains_the_same(model_type):
    """A frozen vision tower under gradient checkpointing: where transformers' input-gradient hook reaches the tower's
    patch embedding (Qwen2-VL, Qwen2.5-VL), unpatched every tower block's output requires a gradient and the backward
    runs through the tower for no parameter (the negative control); patched the one tower call runs without autograd
    in every family, and the loss and every trained parameter's gradient equal the unpatched model's."""
    model, processor = model_and_processor(model_type)
    model.model.visual.requires_grad_(False)
    model.gradient_checkpointing_enable()
    model.train()
    batch = processed_batch(processor, padded_rows(model_type))
    graph: list[bool] = []
    model.model.visual.blocks[-1].register_forward_hook(lambda m, i, out: graph.append(_first(out).requires_grad))
    hooked = any(m._forward_hooks for m in model.model.visual.patch_embed.modules())  # transformers' hook
    ref = loss_and_grads(model, batch)
    assert graph and all(graph) == hooked  # unpatched: the tower's activations are in the graph where hooked
    graph.clear()
    hf_packing.apply_rmpad(model_type)
    assert_equivalent(ref, loss_and_grads(model, batch), f"{model_type} frozen tower")
    assert graph and not any(graph)


def _first(out):
    return out[0] if isinstance(out, tuple) else out
