"""The padding-free ``ForConditionalGeneration.forward`` shared by every family.

It keeps the unpatched forward's contract: the same signature (plus the packing keywords) and return
annotation, ``return_dict`` / ``config.return_dict``, the same output class, ``hidden_states`` and ``logits``
re-padded to ``(B, L, ...)``::

    forward(*args, **kwargs) ──parse_call──► ForwardCall, read-only from here on       [_call.py]
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
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
from transformers.utils.generic import ModelOutput, can_return_tuple

from ..ops import loss as loss_
from ..ops.flops import num_experts
from ..ops.loss import (
    CrossEntropySum,
    cross_entropy_sum,
    linear_cross_entropy_sum,
    reduce_loss,
    shift_labels_per_sequence,
)
from ..parallel import shard as shard_
from ..parallel.comm import SPGroup, gather_sequence
from ..parallel.state import SequenceParallelState
from . import recording
from ._attention import PACKED_KWARG, WRAPPED_IMPLEMENTATIONS, host_vision_seqlens, inside_packed_forward
from ._call import PACKING_NAMES, PACKING_PARAMETERS, ForwardCall, ForwardSignature, parse_call
from ._flatten import FlatBatch, flatten_batch
from ._qwen4_exp import NO_MASKS
from ._spec import FamilySpec
from ._vision import (
    ITEM_TOKENS,
    deepstack_by_index,
    joint_items,
    shared_token_items,
    tower_calls,
    trusted_placeholder_masks,
    vision_seqlens,
)
from .prepared import check_active_loader


@dataclass(frozen=True)
class RmpadOptions:
    """Options bound into the patched forwards and the attention route at `apply_rmpad` time."""

    attn_backend: str = "auto"
    dummy_vision: bool = False
    loss_chunk_size: int | None = None
    use_liger: bool | None = None
    linear_backend: str = "auto"
    #: created by `apply_rmpad(sequence_parallel_size=...)`: the SP size, its mesh and comm timer
    sequence_parallel: SequenceParallelState = field(default_factory=SequenceParallelState)

    @property
    def sequence_parallel_size(self) -> int:
        return self.sequence_parallel.size


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


def signature_annotations(signature: inspect.Signature) -> dict[str, Any]:
    """``__annotations__`` matching ``signature``: what ``typing.get_type_hints`` and code that reads
    ``forward.__annotations__`` directly (transformers' own tests read the return type's fields there) expect."""
    annotations = {name: p.annotation for name, p in signature.parameters.items() if p.annotation is not p.empty}
    if signature.return_annotation is not signature.empty:
        annotations["return"] = signature.return_annotation
    return annotations


def resolve_use_cache(backbone, use_cache: bool | None) -> bool:
    """``use_cache`` as the unpatched forward resolves it: the text config's default, off under checkpointing."""
    if use_cache is None:
        use_cache = bool(getattr(backbone.config.get_text_config(), "use_cache", False))
    checkpointing = any(getattr(m, "gradient_checkpointing", False) for m in (backbone, backbone.language_model))
    return bool(use_cache) and not (backbone.training and checkpointing)


def is_generation_call(call: ForwardCall, generation_like: bool | None) -> bool:
    """Whether the original forward must run: a cache, ``use_cache`` in effect, or no ``input_ids`` to flatten."""
    return (
        call.past_key_values is not None or generation_like or call.input_ids is None or call.inputs_embeds is not None
    )


def generation_reason(call: ForwardCall) -> str:
    """Why `is_generation_call` sends a call to the original forward, and what would keep it padding-free."""
    if call.past_key_values is not None:
        return "it carries past_key_values (a cache): drop it to train"
    if call.inputs_embeds is not None or call.input_ids is None:
        return (
            "it passes inputs_embeds instead of input_ids, and the padding-free path flattens input_ids: pass input_ids"
        )
    return "use_cache resolves to True: pass use_cache=False (or set model.config.use_cache=False)"


_WARNED: set[str] = set()


class OriginalForward:
    """How many top-level forwards run their original code now (a plain counter, as `PackedForward`)."""

    depth = 0

    @classmethod
    @contextmanager
    def running(cls) -> Iterator[None]:
        cls.depth += 1
        try:
            yield
        finally:
            cls.depth -= 1


def warn_supervised_generation_call(model, call: ForwardCall) -> None:
    """Warn once per reason and class that a training call (with labels; for the backbone, in training mode with
    gradients) runs the original forward: padded rows, no per-sequence boundaries, transformers' own loss."""
    reason = generation_reason(call)
    key = f"{type(model).__name__}: {reason}"
    if key in _WARNED or torch.compiler.is_compiling():
        return
    _WARNED.add(key)
    what = "a call with labels" if hasattr(model, "lm_head") else "a training call"
    warnings.warn(
        f"hf_packing: {what} runs the original {type(model).__name__}.forward (padded rows, no per-sequence "
        f"boundaries) because {reason}",
        stacklevel=4,
    )


def without_packing(kwargs: dict) -> dict:
    """The caller's keywords for transformers' own path: a ``cu_seqlens`` key must not reach the vision tower,
    which reads it as its own."""
    return {k: v for k, v in kwargs.items() if k not in PACKING_NAMES}


def check_attn_implementation(config) -> None:
    """Raise unless the model's text attention goes through a registry entry the patch wraps (`_attention`)."""
    impl = config.get_text_config()._attn_implementation
    if impl not in WRAPPED_IMPLEMENTATIONS:
        raise ValueError(
            f"apply_rmpad runs attention through one of {WRAPPED_IMPLEMENTATIONS}, but this model was loaded with "
            f"attn_implementation={impl!r}; load it with attn_implementation='sdpa' (the backend is chosen by "
            "apply_rmpad(attn_backend=...))"
        )


def flatten_call(backbone, spec: FamilySpec, call: ForwardCall) -> FlatBatch:
    """Flatten a non-generation call once: its batch as a `FlatBatch`, with the tower's host boundaries and the
    collator's vision inputs (on the pixels' device)."""
    check_attn_implementation(backbone.config)
    if call.input_ids is None:  # `is_generation_call` sends a call without them to the original forward
        raise ValueError("the packed forward flattens input_ids; the call has none")
    flat = flatten_batch(
        backbone,
        spec,
        input_ids=call.input_ids,
        attention_mask=call.attention_mask,
        position_ids=call.position_ids,
        cu_seqlens=call.cu_seqlens,
        mm_token_type_ids=call.mm_token_type_ids,
        image_grid_thw=call.image_grid_thw,
        video_grid_thw=call.video_grid_thw,
        extra=dict(call.rope),
        seqlens=call.seqlens,
    )
    flat.frames_as_images = spec.video_frames_as_images
    if call.vision_grids:
        flat.vision_seqlens = vision_seqlens(backbone.config.vision_config, call.vision_grids)
    # the Trainer moves nested batch tensors; a caller that moved only the top level gets them moved here (a no-op
    # when they are already there)
    pixels = call.pixel_values if call.pixel_values is not None else call.pixel_values_videos
    device = pixels.device if pixels is not None else flat.input_ids.device
    flat.vision_inputs = {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        for k, v in (call.vision_inputs or {}).items()
    }
    return flat


def packed_attention_mask(spec: FamilySpec) -> Any:
    """The backbone's ``attention_mask`` on the packed path: ``None``; for Qwen4-Exp a mapping that gives every
    layer type no mask, since its text model always builds dense ``(T, T)`` masks for the indexer (`_qwen4_exp`)."""
    return NO_MASKS if spec.ple_qsa else None


def check_sequence_parallel(spec: FamilySpec, sp_size: int) -> None:
    """Refuse sequence parallelism for a family whose token mixers are not split over ranks (Qwen4-Exp)."""
    if sp_size > 1 and spec.ple_qsa:
        raise ValueError(
            f"sequence_parallel_size={sp_size}: {spec.model_type} is not split over ranks: its QSA indexer selects "
            "each query's key blocks over the whole sample and its PLE conv and n-gram history reach back across "
            "the slice edges, which the Ulysses all-to-alls do not carry; use apply_rmpad(sequence_parallel_size=1) "
            "and a max_length that fits one GPU"
        )


def backbone_kwargs(call: ForwardCall) -> dict[str, Any]:
    """The backbone's keywords besides the flat batch and the vision inputs: the call's ``rest`` and the rope
    keywords it gave (a new dict)."""
    return {**call.rest, **{k: v for k, v in call.rope.items() if v is not None}}


def run_backbone(
    backbone,
    flat: FlatBatch,
    call: ForwardCall,
    model_kwargs: Mapping[str, Any],
    dummy_vision: bool,
    sp: SPGroup | None = None,
    forward: Callable | None = None,
    attention_mask: Any = None,
):
    """The backbone on the flat row of ``call`` (`flatten_call`) with ``call``'s vision inputs and ``model_kwargs``
    (`backbone_kwargs`), calling the vision tower once on every rank (see `_vision.tower_calls`).

    ``forward`` is the backbone's call: the module itself (the top-level path) or, from inside the patched backbone
    forward, its original function. Either way it carries the `PackedSequences`, so it runs unflattened code.

    Under sequence parallelism (``sp``) the tower's units are split over the SP group (`_vision.tower_calls`) and a
    pre-hook on the text model keeps this rank's slice of the whole pack (embedded, vision features placed, M-RoPE
    positions computed): the hidden states that come back are that slice.

    ``attention_mask`` is what the backbone gets for it: ``None`` (the boundaries travel in ``hf_packing_seqs``), or
    `packed_attention_mask`'s mapping for a text model that would otherwise build dense masks.

    Returns the backbone outputs and the dummy term (``None`` unless ``dummy_vision`` ran the tower on a batch
    without pixels, or an SP rank got no vision unit).
    """
    forward = backbone if forward is None else forward
    vision = call.vision
    hook = None
    if sp is not None:
        shard = shard_.text_model_pre_hook(sp, flat.seqs, PACKED_KWARG)
        hook = backbone.language_model.register_forward_pre_hook(shard, with_kwargs=True)
    try:
        # under SP the tower encodes this rank's share only: its boundaries are not the whole pack's
        known = host_vision_seqlens(flat.vision_seqlens if sp is None else ())
        precomputed = flat.vision_inputs if sp is None else {}
        # images and videos as one kind (DeepStack families): the tower's split and the placeholder masks agree on it
        if flat.frames_as_images and not flat.collated and sp is None:
            # GLM-V: an image and a video frame share one placeholder token, so transformers' two merges cannot keep
            # them apart (it refuses such a batch); as one kind in row order they can. The order is read on the host
            # here (the collator gives it from the workers); `check_placeholders` checked the counts.
            precomputed = shared_token_items(
                flat.mm_token_type_ids, vision["image_grid_thw"], vision["video_grid_thw"], backbone.config
            )
        # images and videos as one kind (DeepStack families, GLM-V): the tower's split and the placeholder masks agree
        joint = (flat.collated or flat.frames_as_images) and joint_items(
            precomputed, vision["pixel_values"], vision["pixel_values_videos"], model_kwargs
        )
        towers = tower_calls(
            backbone,
            **vision,
            dummy=dummy_vision,
            model_kwargs=model_kwargs,
            sp=sp,
            precomputed=precomputed,
            joint=joint,
            frames_as_images=flat.frames_as_images,
        )
        trusted = trusted_placeholder_masks(backbone, flat.collated or joint, joint)
        item_tokens = precomputed.get(ITEM_TOKENS)
        deepstack = deepstack_by_index(backbone, None if item_tokens is None else sum(item_tokens))
        with known, towers as dummy, trusted, deepstack, inside_packed_forward():
            outputs = forward(
                input_ids=flat.input_ids,
                attention_mask=attention_mask,
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
    call: ForwardCall,
    want_logits: bool,
    options: RmpadOptions,
    sp: SPGroup | None = None,
) -> tuple[CrossEntropySum | None, torch.Tensor | None]:
    """Σ CE over the flat row's supervised positions (per-sequence shift, ``call``'s labels or shift_labels) and/or
    its ``(T, V)`` logits.

    Without logits the head runs in checkpointed chunks on supervised rows only; with them, once on all rows.
    Under sequence parallelism ``hidden`` is this rank's slice: the targets are shifted on the whole pack, then
    sliced; the CE is this slice's; logits (outputs only, no gradient) come from the gathered hidden states.
    ``call.num_supervised_tokens`` (the collator's count for ``labels``) spares the loss its host sync.
    ``call.source_ids`` (one per sequence) fill `CrossEntropySum.per_source` inside `recording.counting_sources` (not
    under sequence parallelism).
    """
    labels, shift_labels, source_ids = call.labels, call.shift_labels, call.source_ids
    targets = None
    if shift_labels is not None:
        targets = flat.flatten(shift_labels)
    elif labels is not None:
        targets = shift_labels_per_sequence(flat.flatten(labels), flat.seqs.cu_seqlens)
    if sp is not None:
        ce = None
        if targets is not None:
            local = shard_.local_targets(targets, sp)
            ce = linear_cross_entropy_sum(
                hidden,
                model.lm_head,
                local,
                chunk_size=options.loss_chunk_size,
                use_liger=options.use_liger,
                count_correct=recording.counting_correct(),
            )
        if not want_logits:
            return ce, None
        with torch.no_grad():
            logits = model.lm_head(gather_sequence(hidden, sp, flat.indices.numel()))
        return ce, logits
    num_sources = recording.counted_sources() if source_ids is not None and targets is not None else 0
    sources = None
    if num_sources and source_ids is not None and targets is not None:
        sources = loss_.token_sources(source_ids, flat.seqs.cu_seqlens, num_sources, targets.shape[0])
    if not want_logits:
        if targets is None:  # neither a loss nor logits asked for
            return None, None
        ce = linear_cross_entropy_sum(
            hidden,
            model.lm_head,
            targets,
            chunk_size=options.loss_chunk_size,
            use_liger=options.use_liger,
            num_supervised=call.num_supervised_tokens if shift_labels is None and labels is not None else None,
            sources=sources,
            num_sources=num_sources,
            count_correct=recording.counting_correct(),
        )
        return ce, None
    logits = model.lm_head(hidden)
    if targets is None:
        return None, logits
    return cross_entropy_sum(logits, targets, sources, num_sources, recording.counting_correct()), logits


def make_rmpad_forward(original: Callable, spec: FamilySpec, options: RmpadOptions) -> Callable:
    """Build the patched forward for one family, with ``options`` bound (apply again to change them)."""
    signature = ForwardSignature(inspect.signature(original))
    output_class = _output_class(original, spec)

    def forward(self, *args, **kwargs):
        call = parse_call(signature, args, kwargs, rope_kwargs=spec.rope_kwargs)
        generation_like = call.use_cache if call.supervised else resolve_use_cache(self.model, call.use_cache)
        if is_generation_call(call, generation_like):
            if call.supervised:
                warn_supervised_generation_call(self, call)
            if torch.compiler.is_compiling():  # (the counter only quiets a warning, which is eager-only too)
                return original(self, *args, **without_packing(kwargs), return_dict=True)
            with OriginalForward.running():  # its backbone call is this call: no second warning
                return original(self, *args, **without_packing(kwargs), return_dict=True)
        check_active_loader(collated=call.collated)  # forgetting prepare_trainer is loud

        flat = flatten_call(self.model, spec, call)
        model_kwargs = backbone_kwargs(call)
        if spec.moe:
            # as the original resolves it: the config's default where it is a parameter (5.23), else only when asked
            router = model_kwargs.get("output_router_logits")
            default = "output_router_logits" in signature.named and self.config.text_config.output_router_logits
            model_kwargs = {**model_kwargs, "output_router_logits": bool(default) if router is None else router}
        check_sequence_parallel(spec, options.sequence_parallel_size)
        sp = options.sequence_parallel.group()
        if sp is not None and spec.video_frames_as_images:
            raise ValueError(
                f"sequence_parallel_size={options.sequence_parallel_size} is not supported for {spec.model_type}: "
                "its tower encodes video frames as images and its placeholders share one token, which the split "
                "tower call (hf_packing.parallel.shard.encode_vision_split) does not handle yet; set "
                "sequence_parallel_size=1 (docs/sequence_parallel.md)"
            )
        # evaluation too: FSDP2 / ZeRO-3 all-gather the tower's parameters in every forward, with or without grad
        outputs, dummy = run_backbone(
            self.model, flat, call, model_kwargs, options.dummy_vision, sp, attention_mask=packed_attention_mask(spec)
        )
        skip_logits = call.skip_logits
        want_logits = not skip_logits if skip_logits is not None else not (call.supervised and self.training)
        ce, flat_logits = _loss_and_logits(self, outputs.last_hidden_state[0], flat, call, want_logits, options, sp)
        num_items_in_batch: Any = call.num_items_in_batch  # this rank's share of it under SP
        if sp is None:
            loss = None if ce is None else reduce_loss(ce.loss_sum, ce.num_supervised, num_items_in_batch)
        else:
            loss = None if ce is None else shard_.sp_loss(ce.loss_sum, ce.num_supervised, num_items_in_batch, sp)
            if num_items_in_batch is not None:  # the MoE aux weight below takes this rank's share of the count too
                num_items_in_batch = num_items_in_batch / sp.size
        if loss is not None and dummy is not None:
            loss = loss + dummy
        logits = None if flat_logits is None else _keep_logits(flat.repad(flat_logits), call.logits_to_keep)
        hidden_states = outputs.get("hidden_states")
        fields = dict(
            loss=loss,
            logits=logits,
            past_key_values=None,
            attentions=outputs.get("attentions"),
            hidden_states=None if hidden_states is None else repad_hidden_states(hidden_states, flat, sp),
        )
        if spec.moe:
            fields.update(_moe_fields(self, spec, outputs, loss, ce, num_items_in_batch, flat, sp))
        result = output_class(**fields)
        recording.attach_token_counts(result, ce)  # for evaluation: counts and accuracy without logits
        return result

    return as_patched_forward(forward, original)


def as_patched_forward(forward: Callable, original: Callable) -> Callable:
    """``forward`` dressed as ``original``: ``return_dict`` handling, the patched signature, name and docstring."""
    wrapped = can_return_tuple(forward)
    wrapped.__signature__ = patched_signature(original)
    wrapped.__annotations__ = signature_annotations(wrapped.__signature__)
    wrapped.__doc__ = (original.__doc__ or "") + "\n\n(hf_packing: padding-free path; see hf_packing.apply_rmpad)"
    wrapped.__name__, wrapped.__qualname__ = original.__name__, original.__qualname__
    del wrapped.__wrapped__  # inspect must read __signature__, tools must not unwrap to the inner function
    wrapped.hf_packing_original = original
    return wrapped


def _whole(hidden: torch.Tensor, flat: FlatBatch, sp: SPGroup | None) -> torch.Tensor:
    """A flat ``(T, ...)`` output: as is, or gathered from the SP ranks' slices (no gradient)."""
    return hidden if sp is None else gather_sequence(hidden, sp, flat.indices.numel())


def repad_hidden_states(states: tuple, flat: FlatBatch, sp: SPGroup | None = None) -> tuple:
    """Per-layer ``(1, T, H)`` hidden states as the caller's ``(B, L, H)``, zeros at pads; a ``None`` entry (a layer
    that ``output_hidden_states=[indices]`` left out) stays ``None``."""
    return tuple(None if h is None else flat.repad(_whole(h[0], flat, sp)) for h in states)


def repad_router_logits(router_logits: tuple, flat: FlatBatch, sp: SPGroup | None = None) -> tuple:
    """Per-layer ``(T, E)`` router logits as transformers records them on the caller's rows: ``(B·L, E)``, zeros at
    pads."""
    return tuple(flat.repad(_whole(r, flat, sp)).flatten(0, 1) for r in router_logits)


def _keep_logits(logits: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    if isinstance(logits_to_keep, int):
        return logits[:, -logits_to_keep:] if logits_to_keep > 0 else logits
    return logits[:, logits_to_keep]


def _share(num_supervised: int, num_items_in_batch: int | torch.Tensor, device: torch.device) -> float | torch.Tensor:
    """``num_supervised / num_items_in_batch`` (a count of 0 gives 0): for a tensor count, a Python number divided by
    it on the device, so no tensor is made from the host number (on a GPU, a copy that would wait for the forward
    queued before it)."""
    if isinstance(num_items_in_batch, torch.Tensor):
        return num_supervised / num_items_in_batch.to(device).clamp(min=1)
    return num_supervised / max(num_items_in_batch, 1)


def _moe_fields(
    model,
    spec: FamilySpec,
    outputs,
    loss,
    ce: CrossEntropySum | None,
    num_items_in_batch,
    flat: FlatBatch,
    sp: SPGroup | None,
) -> dict[str, Any]:
    """``aux_loss`` / ``router_logits`` as the unpatched MoE forward returns them, and the aux term in the loss.

    ``router_logits``: one ``(B·L, num_experts)`` tensor per MoE layer, as transformers records them on the caller's
    rows, zeros at padded positions (like ``logits``); the aux loss is computed on the real tokens alone, as the
    unpatched one with its attention mask.

    The unpatched loss is ``CE_mean + coef · aux`` per micro-batch, which the Trainer divides by the
    accumulation steps and DDP averages over ranks. With ``num_items_in_batch`` the Trainer does neither
    (and multiplies by the number of processes), so the aux term is weighted by this micro-batch's share of
    the supervised tokens, ``n_local / num_items_in_batch``: its weights sum to 1 over micro-batches and ranks,
    like the unpatched ``1 / (steps · ranks)`` (equal to it when micro-batches hold equal token counts).
    Under sequence parallelism the aux loss is the whole pack's (`hf_packing.parallel.shard.load_balancing_loss`, over
    the pack's real tokens), and the SP ranks' weights sum to the pack's.
    """
    router_logits = outputs.get("router_logits")
    if not router_logits:
        return {"aux_loss": None, "router_logits": router_logits}
    text = model.config.text_config
    experts = int(num_experts(text) or 0)  # a model that returns router logits routes to experts
    if sp is None:
        aux_loss = spec.load().load_balancing_loss_func(router_logits, experts, text.num_experts_per_tok, None)
    else:
        aux_loss = shard_.load_balancing_loss(
            router_logits, experts, text.num_experts_per_tok, sp, flat.indices.numel()
        )
    if loss is not None and ce is not None:
        weight = text.router_aux_loss_coef
        if num_items_in_batch is not None:  # n_local / num_items_in_batch: a Python number over the Trainer's count
            weight = weight * _share(ce.num_supervised, num_items_in_batch, loss.device)
        loss = loss + weight * aux_loss.to(loss.device)
    return {"loss": loss, "aux_loss": aux_loss, "router_logits": repad_router_logits(router_logits, flat, sp)}
