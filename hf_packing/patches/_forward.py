"""The padding-free ``ForConditionalGeneration.forward`` shared by every family.

Padded rows come in; the padding is removed once, before the embedding; the family's own model forward
(vision tower, placeholder scatter, DeepStack, decoder layers) then runs on one flat row of real tokens,
with the boundaries travelling to attention as ``hf_packing_seqs``; the loss is a per-sequence shifted,
chunked linear cross-entropy::

    input_ids (B, L) + attention_mask ──unpad──► ids (1, T), M-RoPE positions (3, 1, T), cu_seqlens (n+1,)
        └─► model.model(...)  [unchanged transformers code, varlen attention via the registry]
              └─► hidden (T, H) ──► targets shifted inside each sequence ──► Σ CE / num_items_in_batch

Generation (a KV cache), ``inputs_embeds`` inputs and ``use_cache=True`` go to the original forward.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..loss import linear_cross_entropy_sum, reduce_loss, shift_labels_per_sequence
from ..varlen import PackedSequences, pad_input, validate_attention_mask
from ._attention import PACKED_KWARG, WRAPPED_IMPLEMENTATIONS
from ._spec import FamilySpec

logger = logging.getLogger("hf_packing")

#: flash-style boundary kwargs that transformers' own packed path uses; accepted as an alternative input.
_HF_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def mm_token_types(input_ids: torch.Tensor, config) -> torch.Tensor:
    """0 for text, 1 for image placeholders, 2 for video placeholders; shape and device of ``input_ids``."""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types = types.masked_fill(input_ids == config.image_token_id, 1)
    return types.masked_fill(input_ids == config.video_token_id, 2)


def rope_position_ids(model, spec: FamilySpec, input_ids, attention_mask, mm_token_type_ids, image_grid_thw,
                      video_grid_thw, extra: dict[str, Any]) -> torch.Tensor:
    """M-RoPE positions ``(3, B, L)`` of padded rows, from the family's own ``get_rope_index``, row by row.

    Without images or videos every row's positions are ``0..n-1`` on all three rows, which is what
    ``get_rope_index`` gives too; computing them directly skips its Python loop over rows.
    """
    if image_grid_thw is None and video_grid_thw is None:
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
        return (mask.cumsum(-1) - 1).clamp(min=0).unsqueeze(0).expand(3, -1, -1)
    if mm_token_type_ids is None:
        _warn_once(
            "batch has images/videos but no mm_token_type_ids; deriving them from input_ids. (The unpatched model "
            "would silently fall back to 1-D positions here; pass the processor's mm_token_type_ids.)"
        )
        mm_token_type_ids = mm_token_types(input_ids, model.config)
    position_ids, _ = model.model.get_rope_index(
        input_ids,
        mm_token_type_ids=mm_token_type_ids,
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        attention_mask=attention_mask,
        **{k: v for k, v in extra.items() if v is not None},
    )
    return position_ids


def _boundaries(input_ids, attention_mask, cu_seqlens) -> tuple[torch.Tensor, PackedSequences]:
    """Validate the batch and return the flat indices of real tokens and their `PackedSequences` (one host sync)."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    if cu_seqlens is None:
        return indices, PackedSequences.from_seqlens(validate_attention_mask(attention_mask), device=input_ids.device)
    seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    if sum(seqlens) != indices.numel():
        raise ValueError(
            f"cu_seqlens covers {sum(seqlens)} tokens but attention_mask has {indices.numel()} real tokens. Under the "
            "HF Trainer this means accelerate sliced the batch (dispatch_batches): call "
            "hf_packing.prepare_trainer(trainer), or set accelerator_config={'dispatch_batches': False}"
        )
    cu = cu_seqlens.to(device=input_ids.device, dtype=torch.int32)
    return indices, PackedSequences(cu_seqlens=cu, max_seqlen=max(seqlens, default=0), seqlens=seqlens)


def _dummy_vision_loss(model) -> torch.Tensor:
    """Run the vision tower on one tiny image so every rank issues the same collectives; weight 0."""
    vcfg = model.config.vision_config
    merge = vcfg.spatial_merge_size
    patch_dim = vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size**2
    device = model.lm_head.weight.device
    pixels = torch.zeros(merge * merge, patch_dim, device=device, dtype=model.model.visual.dtype)
    grid = torch.tensor([[1, merge, merge]], device=device)
    out = model.model.get_image_features(pixels, grid, return_dict=True)
    return sum(t.float().sum() for t in _iter_tensors(out.to_tuple())) * 0.0


def _iter_tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _iter_tensors(item)


def make_rmpad_forward(original: Callable, spec: FamilySpec, options: dict[str, Any]) -> Callable:
    """Build the patched forward for one family; ``options`` is read at call time (apply_rmpad updates it)."""

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        video_grid_thw: torch.LongTensor | None = None,
        mm_token_type_ids: torch.IntTensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,  # taken here so it never reaches the vision tower, which reads its own
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs,
    ):
        if past_key_values is not None or use_cache or input_ids is None or inputs_embeds is not None:
            if num_items_in_batch is not None:
                kwargs["num_items_in_batch"] = num_items_in_batch
            return original(
                self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                pixel_values=pixel_values, pixel_values_videos=pixel_values_videos, image_grid_thw=image_grid_thw,
                video_grid_thw=video_grid_thw, mm_token_type_ids=mm_token_type_ids, logits_to_keep=logits_to_keep,
                **kwargs,
            )
        impl = self.config.get_text_config()._attn_implementation
        if impl not in WRAPPED_IMPLEMENTATIONS:
            raise ValueError(
                f"apply_rmpad runs attention through one of {WRAPPED_IMPLEMENTATIONS}, but this model was loaded with "
                f"attn_implementation={impl!r}; load it with attn_implementation='sdpa' (the backend is chosen by "
                "apply_rmpad(attn_backend=...))"
            )
        # transformers' own packed-row kwargs (VisionCollator mode='flat') describe the same boundaries.
        hf_varlen = {k: kwargs.pop(k) for k in _HF_VARLEN_KWARGS if k in kwargs}
        if cu_seqlens is None:
            cu_seqlens = hf_varlen.get("cu_seq_lens_q")
        shift_labels = kwargs.pop("shift_labels", None)
        extra = {k: kwargs.pop(k, None) for k in spec.rope_kwargs}
        batch, length = input_ids.shape

        indices, seqs = _boundaries(input_ids, attention_mask, cu_seqlens)
        flat_ids = input_ids.flatten().index_select(0, indices).unsqueeze(0)
        if image_grid_thw is not None or video_grid_thw is not None:
            check_placeholders(self.config, flat_ids[0], seqs, image_grid_thw, video_grid_thw)
        if position_ids is None:
            if len(seqs.seqlens) != batch:
                raise ValueError(
                    f"the batch packs {len(seqs.seqlens)} sequences into {batch} rows; packed rows need their "
                    "per-sample position_ids (VisionCollator computes them)"
                )
            position_ids = rope_position_ids(
                self, spec, input_ids, attention_mask, mm_token_type_ids, image_grid_thw, video_grid_thw, extra
            )
        if position_ids.dim() == 2:
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        elif position_ids.shape[0] == 4:  # transformers' packed form: text row + 3 M-RoPE rows
            position_ids = position_ids[1:]
        flat_pos = position_ids.flatten(1).index_select(1, indices).unsqueeze(1)
        flat_types = None if mm_token_type_ids is None else mm_token_type_ids.flatten().index_select(0, indices)[None]
        model_kwargs = dict(kwargs)
        if spec.moe:
            router = model_kwargs.pop("output_router_logits", None)
            default = getattr(self.config.text_config, "output_router_logits", False)  # absent before 5.23
            model_kwargs["output_router_logits"] = default if router is None else router
        for key, value in extra.items():
            if value is not None:
                model_kwargs[key] = value
        # The dummy image runs exactly where real pixels would: right after the token embedding, before the decoder
        # layers. FSDP / ZeRO-3 gather parameters (and reduce gradients) module by module in execution order, so a
        # text-only rank must reach the tower at the same point as a rank with images, or the collectives mismatch.
        dummy: list[torch.Tensor] = []

        def dummy_after_embedding(*_) -> None:
            if not dummy:
                dummy.append(_dummy_vision_loss(self))

        hook = None
        if (options.get("dummy_vision") and self.training and pixel_values is None and pixel_values_videos is None
                and (labels is not None or shift_labels is not None)):
            hook = self.model.get_input_embeddings().register_forward_hook(dummy_after_embedding)
        try:
            outputs = self.model(
                input_ids=flat_ids, attention_mask=None, position_ids=flat_pos, pixel_values=pixel_values,
                pixel_values_videos=pixel_values_videos, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                mm_token_type_ids=flat_types, use_cache=False, **model_kwargs, **{PACKED_KWARG: seqs},
            )
        finally:
            if hook is not None:
                hook.remove()
        hidden = outputs.last_hidden_state.squeeze(0)

        loss, logits = None, None
        if labels is not None or shift_labels is not None:
            if shift_labels is not None:
                targets = shift_labels.flatten().index_select(0, indices)
            else:
                targets = shift_labels_per_sequence(labels.flatten().index_select(0, indices), seqs.cu_seqlens)
            loss_sum, n_supervised = linear_cross_entropy_sum(
                hidden, self.lm_head, targets, chunk_size=options.get("loss_chunk_size"), use_liger=options.get("use_liger")
            )
            loss = reduce_loss(loss_sum, n_supervised, num_items_in_batch)
            if dummy:
                loss = loss + dummy[0]
        else:
            logits = pad_input(self.lm_head(hidden), indices, batch, length)
            if isinstance(logits_to_keep, int) and logits_to_keep > 0:
                logits = logits[:, -logits_to_keep:]
            elif isinstance(logits_to_keep, torch.Tensor):
                logits = logits[:, logits_to_keep]

        if spec.moe and model_kwargs.get("output_router_logits"):
            return _moe_output(self, spec, outputs, loss, logits)
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, past_key_values=None,
            hidden_states=outputs.hidden_states, attentions=outputs.attentions,
        )

    forward.__doc__ = (original.__doc__ or "") + "\n\n(hf_packing: padding-free training path; see hf_packing.apply_rmpad)"
    forward.__name__ = original.__name__
    forward.__qualname__ = original.__qualname__
    forward.hf_packing_original = original
    return forward


def _moe_output(model, spec: FamilySpec, outputs, loss, logits):
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    load_balancing_loss_func = spec.load().load_balancing_loss_func
    text = model.config.text_config
    aux_loss = load_balancing_loss_func(outputs.router_logits, text.num_experts, text.num_experts_per_tok, None)
    if loss is not None:
        loss = loss + text.router_aux_loss_coef * aux_loss.to(loss.device)
    return MoeCausalLMOutputWithPast(
        loss=loss, aux_loss=aux_loss, logits=logits, past_key_values=None, hidden_states=outputs.hidden_states,
        attentions=outputs.attentions, router_logits=outputs.router_logits,
    )


def check_placeholders(config, flat_ids: torch.Tensor, seqs: PackedSequences, image_grid_thw, video_grid_thw) -> None:
    """Each sequence's image/video placeholder count must equal the tokens of the items (in order) that belong to
    it; otherwise features would land in the wrong sample. Raises `ValueError` naming the sequence (row)."""
    seq_id = torch.repeat_interleave(
        torch.arange(len(seqs.seqlens), device=flat_ids.device), torch.tensor(seqs.seqlens, device=flat_ids.device)
    )
    counts = torch.zeros(2, len(seqs.seqlens), dtype=torch.long, device=flat_ids.device)
    counts[0].index_add_(0, seq_id, (flat_ids == config.image_token_id).long())
    counts[1].index_add_(0, seq_id, (flat_ids == config.video_token_id).long())
    merge = config.vision_config.spatial_merge_size
    for kind, row_counts, grid in zip(("image", "video"), counts.tolist(), (image_grid_thw, video_grid_thw)):
        per_item = [] if grid is None else [t * h * w // merge**2 for t, h, w in grid.tolist()]
        item = 0
        for row, count in enumerate(row_counts):
            taken = 0
            while taken < count and item < len(per_item):
                taken += per_item[item]
                item += 1
            if taken != count:
                raise ValueError(
                    f"row {row} has {count} {kind} placeholder tokens but {kind}_grid_thw gives {taken} for the "
                    f"{kind}s assigned to it; re-run the processor on this sample"
                )
        if item != len(per_item):
            raise ValueError(f"{kind}_grid_thw lists {len(per_item)} {kind}s but the placeholders cover only {item}")
