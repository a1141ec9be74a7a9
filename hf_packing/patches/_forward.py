"""The padding-free ``ForConditionalGeneration.forward`` shared by every family.

It keeps the unpatched forward's contract: the same signature (plus the packing keywords) and return
annotation, ``return_dict`` / ``config.return_dict``, the same output class, ``hidden_states`` and ``logits``
re-padded to ``(B, L, ...)``::

    caller's batch ──flatten_batch──► ids (1, T), M-RoPE (3, 1, T), cu_seqlens      [_flatten.py]
        └─► model.model(...)  transformers' own code; varlen attention via the registry   [_attention.py]
              └─► hidden (T, H) ──► per-sequence shifted, chunked CE / num_items_in_batch   [loss.py]
                                └─► logits re-padded to (B, L, V) when they are wanted

Generation-style calls (a KV cache, ``use_cache`` resolving to True without labels, ``inputs_embeds``)
go to the original forward unchanged.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
from transformers.utils.generic import ModelOutput, can_return_tuple

from .. import sequence_parallel as sequence_parallel_
from ..loss import CrossEntropySum, cross_entropy_sum, linear_cross_entropy_sum, reduce_loss, shift_labels_per_sequence
from ..sequence_parallel import SPGroup
from ._attention import PACKED_KWARG, WRAPPED_IMPLEMENTATIONS
from ._flatten import FlatBatch, flatten_batch
from ._spec import FamilySpec
from ._vision import tower_calls

#: transformers' flash-style boundary kwargs (DataCollatorWithFlattening, VisionCollator mode='flat').
HF_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
#: keywords the patched forward adds to the original signature (so the Trainer keeps these batch columns).
PACKING_PARAMETERS = (
    inspect.Parameter("cu_seqlens", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="torch.Tensor | None"),
    inspect.Parameter("max_seqlen", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="int | None"),
    inspect.Parameter("skip_logits", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="bool | None"),
    # VisionCollator's host count of supervised targets: the loss selects them without a host sync
    inspect.Parameter("num_supervised_tokens", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="int | None"),
)


@dataclass(frozen=True)
class RmpadOptions:
    """Options bound into the patched forwards and the attention route at `apply_rmpad` time."""

    attn_backend: str = "auto"
    dummy_vision: bool = False
    loss_chunk_size: int | None = None
    use_liger: bool | None = None
    linear_backend: str = "auto"
    sequence_parallel_size: int = 1


def _output_class(original: Callable, spec: FamilySpec) -> type:
    """The `ModelOutput` class in the original forward's return annotation (``tuple | XOutput``)."""
    try:
        hint = typing.get_type_hints(original).get("return")
    except Exception:  # unresolvable forward references: fall back to what the family is known to return
        hint = None
    for candidate in typing.get_args(hint) or (hint,):
        if isinstance(candidate, type) and issubclass(candidate, ModelOutput):
            return candidate
    return MoeCausalLMOutputWithPast if spec.moe else CausalLMOutputWithPast


def patched_signature(original: Callable) -> inspect.Signature:
    """The original forward's signature with `PACKING_PARAMETERS` inserted before ``**kwargs``."""
    signature = inspect.signature(original)
    params = list(signature.parameters.values())
    tail = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    head = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    taken = {p.name for p in head}
    return signature.replace(parameters=head + [p for p in PACKING_PARAMETERS if p.name not in taken] + tail)


def _resolve_use_cache(model, use_cache: bool | None) -> bool:
    """``use_cache`` as the unpatched forward resolves it: the text config's default, off under checkpointing."""
    if use_cache is None:
        use_cache = bool(getattr(model.config.get_text_config(), "use_cache", False))
    checkpointing = any(getattr(m, "gradient_checkpointing", False) for m in (model.model, model.model.language_model))
    return bool(use_cache) and not (model.training and checkpointing)


def _run_backbone(
    model,
    flat: FlatBatch,
    vision: dict[str, torch.Tensor | None],
    model_kwargs: dict[str, Any],
    dummy_vision: bool,
    sp: SPGroup | None = None,
):
    """``model.model`` on the flat row, calling the vision tower once on every rank (see `_vision.tower_calls`).

    Under sequence parallelism (``sp``) the tower's units are split over the SP group (`_vision.tower_calls`) and a
    pre-hook on the text model keeps this rank's slice of the whole pack (embedded, vision features placed, M-RoPE
    positions computed): the hidden states that come back are that slice.

    Returns the backbone outputs and the dummy term (``None`` unless ``dummy_vision`` ran the tower on a batch
    without pixels, or an SP rank got no vision unit).
    """
    hook = None
    if sp is not None:
        shard = sequence_parallel_.text_model_pre_hook(sp, flat.seqs, PACKED_KWARG)
        hook = model.model.language_model.register_forward_pre_hook(shard, with_kwargs=True)
    try:
        with tower_calls(model, **vision, dummy=dummy_vision, model_kwargs=model_kwargs, sp=sp) as dummy:
            outputs = model.model(
                input_ids=flat.input_ids,
                attention_mask=None,
                position_ids=flat.position_ids,
                **vision,
                mm_token_type_ids=flat.mm_token_type_ids,
                use_cache=False,
                return_dict=True,
                **model_kwargs,
                **{PACKED_KWARG: flat.seqs},
            )
    finally:
        if hook is not None:
            hook.remove()
    return outputs, (sum(dummy) if dummy else None)


def _loss_and_logits(
    model,
    hidden: torch.Tensor,
    flat: FlatBatch,
    labels,
    shift_labels,
    want_logits: bool,
    options: RmpadOptions,
    sp: SPGroup | None = None,
    num_supervised: int | None = None,
) -> tuple[CrossEntropySum | None, torch.Tensor | None]:
    """Σ CE over the flat row's supervised positions (per-sequence shift) and/or its ``(T, V)`` logits.

    Without logits the head runs in checkpointed chunks on supervised rows only; with them, once on all rows.
    Under sequence parallelism ``hidden`` is this rank's slice: the targets are shifted on the whole pack, then
    sliced; the CE is this slice's; logits (outputs only, no gradient) come from the gathered hidden states.
    ``num_supervised`` (the collator's count for ``labels``) spares the loss its host sync.
    """
    targets = None
    if shift_labels is not None:
        targets = flat.flatten(shift_labels)
    elif labels is not None:
        targets = shift_labels_per_sequence(flat.flatten(labels), flat.seqs.cu_seqlens)
    if sp is not None:
        ce = None
        if targets is not None:
            local = sequence_parallel_.local_targets(targets, sp)
            ce = linear_cross_entropy_sum(
                hidden, model.lm_head, local, chunk_size=options.loss_chunk_size, use_liger=options.use_liger
            )
        if not want_logits:
            return ce, None
        with torch.no_grad():
            logits = model.lm_head(sequence_parallel_.gather_sequence(hidden, sp, flat.indices.numel()))
        return ce, logits
    if not want_logits:
        ce = linear_cross_entropy_sum(
            hidden,
            model.lm_head,
            targets,
            chunk_size=options.loss_chunk_size,
            use_liger=options.use_liger,
            num_supervised=num_supervised if shift_labels is None and labels is not None else None,
        )
        return ce, None
    logits = model.lm_head(hidden)
    return (None if targets is None else cross_entropy_sum(logits, targets)), logits


def make_rmpad_forward(original: Callable, spec: FamilySpec, options: RmpadOptions) -> Callable:
    """Build the patched forward for one family, with ``options`` bound (apply again to change them)."""
    signature = inspect.signature(original)
    output_class = _output_class(original, spec)

    def forward(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs).arguments
        call.pop("self")
        extra = dict(call.pop("kwargs", {}))
        packing = {p.name: extra.pop(p.name, None) for p in PACKING_PARAMETERS}
        labels, shift_labels = call.pop("labels", None), extra.pop("shift_labels", None)
        supervised = labels is not None or shift_labels is not None
        use_cache = call.pop("use_cache", extra.pop("use_cache", None))
        input_ids, inputs_embeds = call.pop("input_ids", None), call.pop("inputs_embeds", None)
        past_key_values = call.pop("past_key_values", None)
        generation_like = use_cache if supervised else _resolve_use_cache(self, use_cache)
        if past_key_values is not None or generation_like or input_ids is None or inputs_embeds is not None:
            # transformers' own path; a cu_seqlens key must not reach the vision tower, which reads it as its own
            return original(self, *args, **{k: v for k, v in kwargs.items() if k not in packing}, return_dict=True)

        impl = self.config.get_text_config()._attn_implementation
        if impl not in WRAPPED_IMPLEMENTATIONS:
            raise ValueError(
                f"apply_rmpad runs attention through one of {WRAPPED_IMPLEMENTATIONS}, but this model was loaded with "
                f"attn_implementation={impl!r}; load it with attn_implementation='sdpa' (the backend is chosen by "
                "apply_rmpad(attn_backend=...))"
            )
        hf_varlen = {k: extra.pop(k) for k in HF_VARLEN_KWARGS if k in extra}
        cu_seqlens = packing["cu_seqlens"] if packing["cu_seqlens"] is not None else hf_varlen.get("cu_seq_lens_q")
        num_items_in_batch = extra.pop("num_items_in_batch", None)
        logits_to_keep = call.pop("logits_to_keep", 0)
        vision = {
            k: call.pop(k, None) for k in ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw")
        }
        rope_extra = {k: call.pop(k, extra.pop(k, None)) for k in spec.rope_kwargs}
        flat = flatten_batch(
            self,
            spec,
            input_ids=input_ids,
            attention_mask=call.pop("attention_mask", None),
            position_ids=call.pop("position_ids", None),
            cu_seqlens=cu_seqlens,
            mm_token_type_ids=call.pop("mm_token_type_ids", None),
            image_grid_thw=vision["image_grid_thw"],
            video_grid_thw=vision["video_grid_thw"],
            extra=rope_extra,
        )
        model_kwargs = {**call, **extra, **{k: v for k, v in rope_extra.items() if v is not None}}
        if spec.moe:
            # as the original resolves it: the config's default where it is a parameter (5.23), else only when asked
            router = model_kwargs.get("output_router_logits")
            default = "output_router_logits" in signature.parameters and self.config.text_config.output_router_logits
            model_kwargs["output_router_logits"] = bool(default) if router is None else router
        sp = sequence_parallel_.sp_group(options.sequence_parallel_size)
        if sp is not None and spec.linear_attention:
            raise ValueError(
                f"sequence_parallel_size={sp.size} is not supported for {spec.model_type} (its Gated DeltaNet "
                "linear-attention layers carry a recurrent state along the sequence); use sequence_parallel_size=1"
            )
        # evaluation too: FSDP2 / ZeRO-3 all-gather the tower's parameters in every forward, with or without grad
        outputs, dummy = _run_backbone(self, flat, vision, model_kwargs, options.dummy_vision, sp)
        skip_logits = packing["skip_logits"]
        want_logits = not skip_logits if skip_logits is not None else not (supervised and self.training)
        ce, flat_logits = _loss_and_logits(
            self,
            outputs.last_hidden_state[0],
            flat,
            labels,
            shift_labels,
            want_logits,
            options,
            sp,
            packing["num_supervised_tokens"],
        )
        if sp is None:
            loss = None if ce is None else reduce_loss(ce.loss_sum, ce.num_supervised, num_items_in_batch)
        else:
            loss = (
                None
                if ce is None
                else sequence_parallel_.sp_loss(ce.loss_sum, ce.num_supervised, num_items_in_batch, sp)
            )
            if num_items_in_batch is not None:  # the MoE aux weight below takes this rank's share of the count too
                num_items_in_batch = num_items_in_batch / sp.size
        if loss is not None and dummy is not None:
            loss = loss + dummy
        logits = None if flat_logits is None else _keep_logits(flat.repad(flat_logits), logits_to_keep)
        hidden_states = outputs.get("hidden_states")
        fields = dict(
            loss=loss,
            logits=logits,
            past_key_values=None,
            attentions=outputs.get("attentions"),
            hidden_states=None
            if hidden_states is None
            else tuple(flat.repad(_whole(h[0], flat, sp)) for h in hidden_states),
        )
        if spec.moe:
            fields.update(_moe_fields(self, spec, outputs, loss, ce, num_items_in_batch))
        result = output_class(**fields)
        if ce is not None:  # plain attributes, not fields: to_tuple() stays what the unpatched model gives
            result.num_supervised_tokens, result.num_correct_tokens = ce.num_supervised, ce.num_correct
        return result

    wrapped = can_return_tuple(forward)
    wrapped.__signature__ = patched_signature(original)
    wrapped.__doc__ = (original.__doc__ or "") + "\n\n(hf_packing: padding-free path; see hf_packing.apply_rmpad)"
    wrapped.__name__, wrapped.__qualname__ = original.__name__, original.__qualname__
    del wrapped.__wrapped__  # inspect must read __signature__, tools must not unwrap to the inner function
    wrapped.hf_packing_original = original
    return wrapped


def _whole(hidden: torch.Tensor, flat: FlatBatch, sp: SPGroup | None) -> torch.Tensor:
    """A flat ``(T, ...)`` output: as is, or gathered from the SP ranks' slices (no gradient)."""
    return hidden if sp is None else sequence_parallel_.gather_sequence(hidden, sp, flat.indices.numel())


def _keep_logits(logits: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    if isinstance(logits_to_keep, int):
        return logits[:, -logits_to_keep:] if logits_to_keep > 0 else logits
    return logits[:, logits_to_keep]


def _moe_fields(
    model, spec: FamilySpec, outputs, loss, ce: CrossEntropySum | None, num_items_in_batch
) -> dict[str, Any]:
    """``aux_loss`` / ``router_logits`` as the unpatched MoE forward returns them, and the aux term in the loss.

    The unpatched loss is ``CE_mean + coef · aux`` per micro-batch, which the Trainer divides by the
    accumulation steps and DDP averages over ranks. With ``num_items_in_batch`` the Trainer does neither
    (and multiplies by the number of processes), so the aux term is weighted by this micro-batch's share of
    the supervised tokens, ``n_local / num_items_in_batch``: its weights sum to 1 over micro-batches and ranks,
    like the unpatched ``1 / (steps · ranks)`` (equal to it when micro-batches hold equal token counts).
    """
    router_logits = outputs.get("router_logits")
    if not router_logits:
        return {"aux_loss": None, "router_logits": router_logits}
    text = model.config.text_config
    aux_loss = spec.load().load_balancing_loss_func(router_logits, text.num_experts, text.num_experts_per_tok, None)
    if loss is not None:
        weight = text.router_aux_loss_coef
        if num_items_in_batch is not None:
            weight = weight * reduce_loss(loss.new_tensor(float(ce.num_supervised)), 0, num_items_in_batch)
        loss = loss + weight * aux_loss.to(loss.device)
    return {"loss": loss, "aux_loss": aux_loss, "router_logits": router_logits}
