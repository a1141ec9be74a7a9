"""Exactly one vision-tower call per patched forward, on every rank.

transformers' ``XModel.forward`` calls the tower once for a pack's images and once more for its videos, and not
at all for text. Under FSDP / ZeRO-3 each call all-gathers the tower's parameters (and its backward
reduce-scatters their gradients), so a rank whose pack holds images and a video issues collectives that a rank
with images only never matches: a hang on NCCL, a size mismatch on gloo. Here every rank calls it once::

    pack holds        transformers' XModel.forward           with tower_calls(...)
    images + videos   visual(images); visual(videos)         visual(images ‖ videos), split back
    images only       visual(images)                         visual(images)
    videos only       visual(videos)                         visual(videos)
    nothing           (no call)                              visual(dummy 1-frame image) × 0   [dummy_vision]

The tower encodes each image / video on its own (per-item rotary positions, windows and ``cu_seqlens``), so one
call over ``images ‖ videos`` gives the same features as two calls. The call stays where transformers makes it
(inside ``XModel.forward``, after the token embedding), because FSDP orders its collectives by execution.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

import torch
from transformers.utils.generic import ModelOutput

from .. import _compat
from ..ops import varlen
from ..parallel.comm import SPGroup
from ..parallel.shard import encode_vision_split

#: keyword prefixes transformers routes to one modality's encoder only; with one of them the calls stay apart.
_MODALITY_PREFIXES = ("image_", "video_")


def _items(output: Any, keep: slice, rows: slice) -> ModelOutput:
    """The part of a tower output that belongs to items ``keep`` (``pooler_output`` is a tuple per item), whose
    pre-merge patches are ``last_hidden_state[rows]`` (or, for a tower whose ``last_hidden_state`` is already one row
    per merged token, GLM-V's, the rows of those items' tokens)."""
    fields = dict(output.items())
    fields["pooler_output"] = tuple(output.pooler_output[keep])
    merged = [len(item) for item in output.pooler_output]
    if output.get("deepstack_features") is not None:  # Qwen3-VL: per layer, a tuple per item (< 5.23: one tensor)
        fields["deepstack_features"] = [
            tuple(layer[keep]) if isinstance(layer, (tuple, list)) else _rows(layer, merged, keep)
            for layer in output.deepstack_features
        ]
    if output.get("last_hidden_state") is not None:
        # in item order: pre-merge patch features (Σ t·h·w, D) on the Qwen-VL towers; GLM-V's tower downsamples before
        # it returns, one row per merged token (Σ t·h·w / merge², D), so the pixel rows would take the next item's
        # (the two counts are equal only when merge is 1, where both splits are the same)
        hidden = output.last_hidden_state
        fields["last_hidden_state"] = _rows(hidden, merged, keep) if hidden.shape[0] == sum(merged) else hidden[rows]
    part = type(output)()
    for key, value in fields.items():  # item by item: some towers add keys that are not fields (5.17's router_logits)
        part[key] = value
    return part


def _reordered(output: Any, order: list[int]) -> ModelOutput:
    """A tower output (split per item) with its items in ``order``; the pre-merge patches stay as they are."""
    fields = dict(output.items())
    fields["pooler_output"] = tuple(output.pooler_output[i] for i in order)
    if output.get("deepstack_features") is not None:
        fields["deepstack_features"] = [tuple(layer[i] for i in order) for layer in output.deepstack_features]
    part = type(output)()
    for key, value in fields.items():
        part[key] = value
    return part


def _rows(tensor: torch.Tensor, sizes: list[int], keep: slice) -> torch.Tensor:
    """Rows of the items ``keep`` from a tensor that stacks items of ``sizes`` rows."""
    start = sum(sizes[: keep.start or 0])
    return tensor[start : start + sum(sizes[keep])]


def vision_seqlens(vision_config, grids: list[list[int]]) -> tuple[list[int], ...]:
    """`hf_packing.ops.varlen.vision_seqlens` for this tower's config: one sequence per frame and, on Qwen2.5-VL
    (a config with ``window_size``), also its windows of ``window_size / patch_size / spatial_merge_size`` merged
    patches a side. Items ``grids`` (``[t, h, w]`` each) in the tower's order, images then videos."""
    merge = vision_config.spatial_merge_size
    window = getattr(vision_config, "window_size", None) or 0
    return varlen.vision_seqlens(grids, merge=merge, window=window // merge // vision_config.patch_size)


#: Qwen3-VL-style towers' position-embedding interpolation (set in their ``__init__``, not in the config)
INTERPOLATION = {"mode": "bilinear", "align_corners": True}


#: the keys of `precomputed_vision_inputs` that are hf_packing's own (`tower_calls` takes them out before the tower)
ITEM_TOKENS = "hf_packing_item_tokens"
ITEM_ORDER = "hf_packing_item_order"
#: the grids the tower gets when it encodes video frames as images (GLM-V): images, then each video frame as [1, h, w]
TOWER_GRIDS = "hf_packing_tower_grids"
_OURS = (ITEM_TOKENS, ITEM_ORDER, TOWER_GRIDS)


def frame_grids(grids: torch.Tensor, n_images: int) -> torch.Tensor:
    """``grids`` (``(N, 3)``, images then videos) with each video split into its frames, ``[1, h, w]`` each: what a
    tower that encodes frames as images (GLM-V's ``get_video_features``) is given. On the device a data-dependent
    ``repeat_interleave`` (the collator gives it from the host: `precomputed_vision_inputs`)."""
    videos = grids[n_images:]
    frames = torch.repeat_interleave(videos, videos[:, 0], dim=0)
    frames[:, 0] = 1
    return torch.cat([grids[:n_images], frames])


def item_order(token_types: torch.Tensor, item_tokens: list[int], n_images: int) -> list[int] | None:
    """The tower's items (images, then videos) in the order their tokens appear in the flat row, or ``None`` when
    some item's tokens are not one contiguous run among the visual tokens (then no single order places them).

    Args:
        token_types (`torch.Tensor` of shape `(T,)`): the flat row's ``mm_token_type_ids`` (1 image, 2 video), host.
        item_tokens (`list[int]`): each item's placeholder tokens, images then videos.
        n_images (`int`): how many of the items are images.
    """
    visual = token_types[token_types != 0].tolist()  # the modality of each visual token, in row order
    rank: dict[int, list[int]] = {1: [], 2: []}  # each modality's tokens' places among the visual tokens
    for place, kind in enumerate(visual):
        rank.setdefault(kind, []).append(place)
    firsts = []
    for kind, items in ((1, range(n_images)), (2, range(n_images, len(item_tokens)))):
        start = 0
        for item in items:
            places = rank[kind][start : start + item_tokens[item]]
            if len(places) != item_tokens[item] or places[-1] - places[0] != len(places) - 1:
                return None
            firsts.append((places[0], item))
            start += item_tokens[item]
    return [item for _, item in sorted(firsts)]


def joint_items(precomputed: Mapping[str, Any], pixel_values, pixel_values_videos, model_kwargs) -> bool:
    """Whether the one tower call hands transformers its images and videos as one modality (`tower_calls`): the
    collator gave their token order (`ITEM_ORDER`, DeepStack families), the pack holds both, and no per-modality
    keyword keeps the calls apart."""
    return (
        precomputed.get(ITEM_ORDER) is not None
        and pixel_values is not None
        and pixel_values_videos is not None
        and not any(k.startswith(_MODALITY_PREFIXES) for k in model_kwargs)
    )


def shared_token_items(token_types: torch.Tensor | None, image_grid_thw, video_grid_thw, config) -> dict[str, Any]:
    """`ITEM_TOKENS` and `ITEM_ORDER` of a call that is not the collator's, read on the host (``.tolist()`` of the
    grids and the flat row's token types ``(1, T)``): what `precomputed_vision_inputs` gives the collator's batches.
    ``{}`` without both images and videos, or without token types."""
    if image_grid_thw is None or video_grid_thw is None or token_types is None:
        return {}
    merge = config.vision_config.spatial_merge_size
    grids = image_grid_thw.tolist() + video_grid_thw.tolist()
    sizes = varlen.vision_item_tokens(grids, merge=merge)
    return {ITEM_TOKENS: sizes, ITEM_ORDER: item_order(token_types.flatten().cpu(), sizes, len(image_grid_thw))}


def _tower_features(inner, pixels: torch.Tensor, grids: torch.Tensor, sizes: list[int], **kwargs: Any) -> ModelOutput:
    """transformers 5.23's ``get_image_features`` (every family: the tower, then its output split per item, DeepStack
    features too), with the split sizes given on the host instead of read from ``grids`` (``.tolist()``)."""
    out = inner.visual(pixels.type(inner.visual.dtype), grid_thw=grids, **kwargs)
    out.pooler_output = torch.split(out.pooler_output, sizes)
    if out.get("deepstack_features") is not None:
        out.deepstack_features = [torch.split(feat, sizes) for feat in out.deepstack_features]
    return out


def precomputed_vision_inputs(
    vision_config,
    grids: list[list[int]],
    *,
    n_images: int = 0,
    token_types: torch.Tensor | None = None,
    frames_as_images: bool = False,
) -> dict[str, Any]:
    """What the vision tower would compute from ``grids`` on the device, computed here on the host (in the collator's
    DataLoader worker) with transformers' own helpers, in the keys its tower pops them under (transformers 5.23,
    `hf_packing._compat.vision_helpers`; ``{}`` on a transformers whose towers do not take them)::

        every family          position_ids (rotary, (N, 2)), cu_seqlens (frames, int32), max_seqlen (int)
        Qwen2.5-VL            + window_index, cu_window_seqlens, max_window_seqlen (windows)
        Qwen3-VL, Qwen3.5     + interp_indices, interp_weights (position-embedding interpolation)
        (ours)                ITEM_TOKENS: each item's merged tokens t·h·w / merge², the split of the tower's output
        (ours, DeepStack)     ITEM_ORDER: with images and videos, their order in the row (``token_types``: the flat
                              row's ``mm_token_type_ids``; `item_order`), so they enter the text model as one kind
        (ours, GLM-V)         TOWER_GRIDS: the videos split into frames (``frames_as_images``, `frame_grids`), and
                              ITEM_ORDER as for DeepStack: an image and a frame share one placeholder token

    On the device each is a host read, a data-dependent ``repeat_interleave`` or a tensor made from host data, every
    step (counted: docs/patches.md; benchmarks/RESULTS.md, 'bench_syncs'). ``grids``: ``[t, h, w]`` per item, images
    then videos (one tower call takes them in that order).
    """
    helpers = _compat.vision_helpers()
    if helpers is None or not grids:
        return {}
    grid = torch.tensor(grids, dtype=torch.long)
    merge = vision_config.spatial_merge_size
    cu_seqlens = helpers.get_vision_cu_seqlens(grid)
    frames = [h * w for t, h, w in grids for _ in range(t)]
    out = {
        "position_ids": helpers.get_vision_position_ids(grid, merge),
        "cu_seqlens": cu_seqlens,
        "max_seqlen": max(frames),
        ITEM_TOKENS: varlen.vision_item_tokens(grids, merge=merge),
    }
    if getattr(vision_config, "window_size", None):
        window_index, cu_windows = helpers.get_vision_window_index(
            grid, merge, vision_config.window_size, vision_config.patch_size
        )
        windows = vision_seqlens(vision_config, grids)[-1]
        out.update(window_index=window_index, cu_window_seqlens=cu_windows, max_window_seqlen=max(windows))
    if getattr(vision_config, "num_position_embeddings", None):
        indices, weights = helpers.get_vision_interpolation_indices_and_weights(
            grid,
            num_grid_per_side=int(vision_config.num_position_embeddings**0.5),
            spatial_merge_size=merge,
            **INTERPOLATION,
        )
        out.update(interp_indices=indices, interp_weights=weights)
    if frames_as_images and n_images < len(grids):
        out[TOWER_GRIDS] = frame_grids(grid, n_images)
    if (
        (getattr(vision_config, "deepstack_visual_indexes", None) or frames_as_images)
        and token_types is not None
        and 0 < n_images < len(grids)
    ):
        out[ITEM_ORDER] = item_order(token_types, out[ITEM_TOKENS], n_images)
    return out


def _dummy_output(backbone, **kwargs: Any) -> ModelOutput:
    """The tower's output for one 1-frame, ``merge × merge``-patch zero image (``backbone``: the ``XModel``)."""
    vcfg = backbone.config.vision_config
    merge = vcfg.spatial_merge_size
    patch_dim = vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size**2
    device = backbone.get_input_embeddings().weight.device
    pixels = torch.zeros(merge * merge, patch_dim, device=device, dtype=backbone.visual.dtype)
    grid = torch.full((1, 3), merge, dtype=torch.long, device=device)  # [[1, merge, merge]], no host data
    grid[:, 0] = 1
    return type(backbone).get_image_features(backbone, pixels, grid, **{**kwargs, "return_dict": True})


def _dummy_features(backbone, **kwargs: Any) -> tuple[ModelOutput, torch.Tensor]:
    """The dummy image's tower output and 0 · Σ of it (a 0-d fp32 tensor that keeps the tower in the graph)."""
    out = _dummy_output(backbone, **kwargs)
    total: Any = sum(t.float().sum() for t in _iter_tensors(out.to_tuple()))  # a tensor: the output has some
    return out, total * 0.0


def _iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _iter_tensors(item)


def frozen_tower(backbone) -> bool:
    """Whether the backbone's vision tower trains nothing while gradients are on: then its one call runs without
    autograd. transformers' ``enable_input_require_grads`` (which ``gradient_checkpointing_enable()`` calls) hooks
    every input embedding, the tower's patch embedding included, so a frozen tower's features would still require
    a gradient and the backward would run through every tower block for no parameter. Under sequence parallelism
    the split call keeps autograd (its all-gather and the dummy image's term take part in the backward)."""
    visual = getattr(backbone, "visual", None)
    return torch.is_grad_enabled() and visual is not None and not any(p.requires_grad for p in visual.parameters())


@contextmanager
def tower_calls(
    backbone,
    pixel_values: torch.Tensor | None,
    pixel_values_videos: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    *,
    dummy: bool,
    model_kwargs: Mapping[str, Any] = MappingProxyType({}),
    sp: SPGroup | None = None,
    precomputed: Mapping[str, Any] = MappingProxyType({}),
    joint: bool = False,
    frames_as_images: bool = False,
) -> Iterator[list[torch.Tensor]]:
    """Make the backbone (``XModel``) inside the block call the vision tower exactly once (see the module docstring).

    Yields a list that holds the dummy term (``0 · Σ features``, a 0-d fp32 tensor) once the dummy call ran; the
    caller adds it to the loss so the tower's parameters are in the graph of every rank.

    Under sequence parallelism (``sp``) that one call encodes only this rank's share of the pack's temporal units
    (images and video frame groups, balanced by patches) and the features are all-gathered over the SP group
    (`~hf_packing.parallel.shard.encode_vision_split`); an SP rank that gets no unit encodes the dummy image.

    ``precomputed`` (`precomputed_vision_inputs` of the call's items, images then videos: the collator's
    ``vision_inputs``) goes to the one tower call, whose helpers pop it instead of computing it on the device; not
    under sequence parallelism (each rank encodes a share) nor with per-modality keywords (two calls). ``joint``
    (`joint_items`, decided by the caller with `trusted_placeholder_masks`'s): the images and videos are handed to
    transformers as images only, in the order of ``precomputed[ITEM_ORDER]``; the videos' call gets nothing.
    ``frames_as_images`` (GLM-V): the tower gets each video frame as an image (``precomputed[TOWER_GRIDS]``, else
    `frame_grids` on the device), as the family's own ``get_video_features`` gives them.
    """
    inner = backbone
    dummy_terms: list[torch.Tensor] = []
    if pixel_values is None and pixel_values_videos is None:
        hook = None
        if dummy:  # right after the embedding: where a rank with pixels reaches the tower

            def after_embedding(*_) -> None:
                if not dummy_terms:
                    dummy_terms.append(_dummy_features(backbone)[1])

            hook = inner.get_input_embeddings().register_forward_hook(after_embedding)
        try:
            yield dummy_terms
        finally:
            if hook is not None:
                hook.remove()
        return
    separate = any(k.startswith(_MODALITY_PREFIXES) for k in model_kwargs)  # per-modality inputs: keep apart
    if separate and sp is not None:
        raise ValueError(
            "sequence parallelism encodes images and videos in one split tower call; per-modality vision keywords "
            f"({[k for k in model_kwargs if k.startswith(_MODALITY_PREFIXES)]}) cannot be split: drop them or set "
            "sequence_parallel_size=1"
        )
    if separate:  # per-modality inputs: leave transformers' calls apart
        yield dummy_terms
        return

    encoded: dict[str, Any] = {}
    kinds = ((pixel_values, image_grid_thw), (pixel_values_videos, video_grid_thw))
    media: list[tuple[torch.Tensor, Any]] = [(pixels, grid) for pixels, grid in kinds if pixels is not None]

    def encode(**kwargs: Any) -> None:
        if encoded:
            return
        pixels = torch.cat([p.to(media[0][0].dtype) for p, _ in media])
        grids = torch.cat([g for _, g in media])
        if frames_as_images and pixel_values_videos is not None:
            n_images = 0 if image_grid_thw is None else len(image_grid_thw)
            tower = precomputed.get(TOWER_GRIDS)
            grids = frame_grids(grids, n_images) if tower is None else tower.to(grids.device)
        # return_dict explicitly: before 5.23 transformers let config.return_dict=False turn this into a tuple
        kwargs = {**kwargs, "return_dict": True}
        if sp is None:
            sizes = precomputed.get(ITEM_TOKENS)
            # the tower's helpers pop their inputs from these keywords: a new dict per call
            kwargs = {**{k: v for k, v in precomputed.items() if k not in _OURS}, **kwargs}
            with torch.no_grad() if frozen_tower(inner) else contextlib.nullcontext():
                if sizes is None and frames_as_images:  # split per item, not per frame: sizes read on the host
                    merge = inner.config.vision_config.spatial_merge_size
                    sizes = varlen.vision_item_tokens(torch.cat([g for _, g in media]), merge=merge)
                if sizes is None:
                    out = type(inner).get_image_features(inner, pixels, grids, **kwargs)
                else:
                    out = _tower_features(inner, pixels, grids, sizes, **kwargs)
        else:
            out, term = encode_vision_split(
                lambda p, g: type(inner).get_image_features(inner, p, g, **kwargs),
                pixels,
                grids,
                sp,
                backbone.config.vision_config.spatial_merge_size,
                lambda: _dummy_features(backbone, **kwargs),
            )
            if term is not None:
                dummy_terms.append(term)
        if joint:  # images and videos as one kind, in row order: transformers' image path places them all
            encoded["image"], encoded["video"] = _reordered(out, precomputed[ITEM_ORDER]), None
            return
        # the images' patches are pixel_values' rows: a shape, so the split needs no host read of the grids
        n_images, n_patches = (0, 0) if pixel_values is None else (len(media[0][1]), pixel_values.shape[0])
        encoded["image"] = _items(out, slice(0, n_images), slice(0, n_patches))
        encoded["video"] = _items(out, slice(n_images, None), slice(n_patches, None))

    def features(kind: str):
        def get_features(pixels: torch.Tensor, grid_thw: torch.Tensor | None = None, **kwargs: Any) -> ModelOutput:
            encode(**kwargs)
            return encoded[kind]

        return get_features

    # instance attributes shadow the class's methods for this call only; FSDP2's swapped class is unaffected
    inner.get_image_features, inner.get_video_features = features("image"), features("video")
    try:
        yield dummy_terms
    finally:
        del inner.get_image_features, inner.get_video_features


def scatter_rows(target: torch.Tensor, mask: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``target.masked_scatter(mask, source)`` for a placeholder mask (``mask`` is ``(..., H)``, each row all True or
    all False, as ``get_placeholder_mask`` expands it) holding as many True rows as ``source`` has rows, by
    ``index_copy`` at ``nonzero_static`` positions sized by ``source``'s shape. Same values and gradients; the
    backward selects the source's gradient by index, where ``masked_scatter``'s selects it by the mask (a host sync
    on CUDA to size the selection)."""
    hidden = target.shape[-1]
    rows = mask[..., 0].reshape(-1)  # (B·L,): the expanded mask's first column, no copy of the (B, L, H) view
    where = torch.nonzero_static(rows, size=source.numel() // hidden).squeeze(1)
    flat = target.reshape(-1, hidden).index_copy(0, where, source.reshape(-1, hidden).to(target.dtype))
    return flat.view_as(target)


class PlaceholderMask(torch.Tensor):
    """A placeholder mask whose ``masked_scatter`` (transformers' merge of the vision features into the token
    embeddings: ``inputs_embeds.masked_scatter(mask, features)``) runs as `scatter_rows`; every other op sees a plain
    boolean tensor and returns plain tensors."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if func is torch.Tensor.masked_scatter and not kwargs and len(args) == 3:
                return scatter_rows(*args)
            return func(*args, **kwargs)


@contextmanager
def trusted_placeholder_masks(backbone, trusted: bool, joint: bool = False) -> Iterator[None]:
    """Inside the block (when ``trusted``: the collator's batch) the backbone's ``get_placeholder_mask`` skips its
    feature-count checks: it is called without the features, which is how transformers asks for the masks alone.

    Those checks (``torch_compilable_check(n_tokens * hidden == features.numel(), f"... {n_tokens} ...")``) read the
    count back twice per modality (the check, and the f-string that formats a 0-d tensor), every step. The
    collator checked every sample's placeholders against its grids on the host (``VisionCollator._check``), and
    the tower gives ``t·h·w / merge²`` features per item by construction. Other callers keep transformers' checks.

    The masks come back as `PlaceholderMask`, so transformers' ``inputs_embeds.masked_scatter(mask, features)``
    merges by index (`scatter_rows`): ``masked_scatter``'s backward selects the features' gradient by the mask, a
    host sync on CUDA per modality whenever the features need a gradient (a trained tower, or a frozen one under
    ``gradient_checkpointing_enable()``, whose input-gradient hook reaches the tower's patch embedding too).

    ``joint`` (`joint_items`): the image mask covers the video tokens too, where `tower_calls` hands transformers
    the images and videos as one kind, in row order; the DeepStack families then need no merge of the two
    (transformers' is boolean-mask indexing and ``new_zeros(mask.sum())``: host syncs in forward and backward,
    counted in docs/patches.md).
    """
    if not trusted:
        yield
        return
    original = type(backbone).get_placeholder_mask

    def get_placeholder_mask(input_ids, inputs_embeds=None, image_features=None, video_features=None, **kwargs):
        image_mask, video_mask = original(backbone, input_ids, inputs_embeds=inputs_embeds, **kwargs)
        if joint:
            image_mask = image_mask | video_mask
        return image_mask.as_subclass(PlaceholderMask), video_mask.as_subclass(PlaceholderMask)

    backbone.get_placeholder_mask = get_placeholder_mask  # an instance attribute: this forward only
    try:
        yield
    finally:
        del backbone.get_placeholder_mask


@contextmanager
def deepstack_by_index(backbone, visual_tokens: int | None) -> Iterator[None]:
    """Inside the block, Qwen3-VL's ``_deepstack_process`` (adding each DeepStack layer's features at the visual
    tokens) selects those tokens with a fixed-size ``nonzero_static`` instead of a boolean mask: ``visual_tokens``,
    the number of image and video tokens of the call (the collator's, known on the host), sizes it. transformers'
    ``hidden[mask] + features; hidden[mask] = ...`` reads the mask back in every DeepStack layer, in forward and in
    backward; the same sums by ``index_add`` read nothing back. ``None`` (not the collator's batch, or sequence
    parallelism, whose ranks hold a slice of the tokens), or a backbone without DeepStack: transformers' own code.
    """
    text: Any = getattr(backbone, "language_model", None)
    if visual_tokens is None or not hasattr(type(text), "_deepstack_process"):
        yield
        return

    def _deepstack_process(hidden_states, visual_pos_masks, visual_embeds):
        rows = hidden_states.flatten(0, -2)  # (B·L, H)
        where = torch.nonzero_static(visual_pos_masks.to(rows.device).flatten(), size=visual_tokens).flatten()
        added = rows.index_add(0, where, visual_embeds.to(rows.device, rows.dtype))
        return added.view_as(hidden_states)

    text._deepstack_process = _deepstack_process  # an instance attribute: this forward only
    try:
        yield
    finally:
        del text._deepstack_process
