"""One call of a patched forward, parsed once into an immutable record that the forward's helpers read.

The patched ``XForConditionalGeneration.forward`` and ``XModel.forward`` (`_forward`, `_backbone`) bind the
caller's ``(args, kwargs)`` against the original forward's signature (`ForwardSignature`) and sort the arguments
into a `ForwardCall` (`parse_call`): the batch, the vision inputs, the boundaries the collator computed, the loss
keywords, and the rest as a read-only mapping. Helpers take the record and return new values; nothing empties it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

#: transformers' flash-style boundary kwargs (DataCollatorWithFlattening, VisionCollator mode='flat').
HF_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
#: keywords the patched forward adds to the original signature (so the Trainer keeps these batch columns).
PACKING_PARAMETERS = (
    inspect.Parameter("cu_seqlens", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=torch.Tensor | None),
    inspect.Parameter("max_seqlen", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=int | None),
    inspect.Parameter("skip_logits", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=bool | None),
    # VisionCollator's host count of supervised targets: the loss selects them without a host sync
    inspect.Parameter("num_supervised_tokens", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=int | None),
    # VisionCollator's host lengths of the sequences it collated: boundaries without a host read
    inspect.Parameter("seqlens", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=list[int] | None),
    # VisionCollator's host copy of the vision grids (images then videos): the tower's boundaries without a read
    inspect.Parameter("vision_grids", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=list | None),
    # VisionCollator's vision_inputs: what the tower's helpers compute from the grids, computed in the worker
    inspect.Parameter("vision_inputs", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=dict | None),
    # VisionCollator's per-sequence source ids: the loss sums per source inside `recording.counting_sources`
    inspect.Parameter("source_ids", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=torch.Tensor | None),
)
PACKING_NAMES = frozenset(p.name for p in PACKING_PARAMETERS)

#: the caller's arguments that are `ForwardCall` fields of the same name, on either patched forward
_FIELDS = (
    "input_ids",
    "inputs_embeds",
    "attention_mask",
    "position_ids",
    "mm_token_type_ids",
    "past_key_values",
    "use_cache",
    "pixel_values",
    "pixel_values_videos",
    "image_grid_thw",
    "video_grid_thw",
    "seqlens",
    "vision_grids",
    "vision_inputs",
    "skip_logits",
    "num_supervised_tokens",
    "source_ids",
)
#: the loss keywords: fields of the top-level forward's record; the backbone passes its caller's on (`ForwardCall.rest`)
_HEAD_FIELDS = ("labels", "shift_labels", "num_items_in_batch", "logits_to_keep")
#: what the flat path drops: its own boundaries replace them (``seq_idx``: TRL padding-free's per-token sequence index)
_SUPERSEDED = ("cu_seqlens", "max_seqlen", *HF_VARLEN_KWARGS, "seq_idx")


class ForwardSignature:
    """A forward's signature as plain tuples, to bind a call: every argument given, by name.

    Not ``inspect.Signature.bind``: it reads ``Signature.parameters``, a ``mappingproxy``, and once the traced frame
    has mutated a dict (transformers' output-capturing wrapper does) dynamo refuses to read a mappingproxy
    (``Unsupported: mapping proxy affected by dictionary mutation``), which would break ``fullgraph=True``
    compilation of the generation path. Tuples and dicts built here trace.
    """

    def __init__(self, signature: inspect.Signature) -> None:
        self.signature = signature
        params = list(signature.parameters.values())[1:]  # without self
        kinds = inspect.Parameter
        self.positional = tuple(
            p.name for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
        )
        self.named = frozenset(p.name for p in params if p.kind is not kinds.VAR_KEYWORD)
        self.var_keyword = any(p.kind is kinds.VAR_KEYWORD for p in params)

    def bind(self, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """``{name: value}`` for every argument of the call (named parameters and ``**kwargs`` alike); raises the
        ``TypeError`` Python raises for a call the signature does not take."""
        if len(args) > len(self.positional):
            raise TypeError(f"forward() takes {len(self.positional)} positional arguments but {len(args)} were given")
        given = dict(zip(self.positional, args))
        for name, value in kwargs.items():
            if name in given:
                raise TypeError(f"forward() got multiple values for argument {name!r}")
            if name not in self.named and not self.var_keyword:
                raise TypeError(f"forward() got an unexpected keyword argument {name!r}")
            given[name] = value
        return given


@dataclass(frozen=True, kw_only=True)
class ForwardCall:
    """A patched forward's call, parsed once (`parse_call`); ``None`` for what the caller did not give.

    Attributes:
        input_ids, inputs_embeds, attention_mask, position_ids, mm_token_type_ids (`(B, L)`, position ids also
            `(3 or 4, B, L)`), past_key_values, use_cache: the caller's batch and cache, as transformers takes them.
        pixel_values, pixel_values_videos, image_grid_thw, video_grid_thw: the vision inputs.
        rope (`Mapping[str, Any]`): the family's extra rope keywords (`FamilySpec.rope_kwargs`), ``None`` where not
            given.
        cu_seqlens (`torch.Tensor` of shape `(N + 1,)`): the packing keyword, else transformers' ``cu_seq_lens_q``.
        seqlens, vision_grids, vision_inputs, num_supervised_tokens, source_ids, skip_logits: `PACKING_PARAMETERS`
            (`VisionCollator`'s host facts and the logits switch).
        labels, shift_labels, num_items_in_batch, logits_to_keep (``0`` when not given): the loss keywords, on the
            top-level forward's record; the backbone's caller's stay in ``rest``.
        rest (`Mapping[str, Any]`, read-only): every other argument given, for the backbone (``output_attentions``,
            ``mm_encoder_outputs``, per-modality vision keywords, ...). Not in it: the fields above, and what the
            flat path's own boundaries replace (``max_seqlen``, ``cu_seq_lens_k``, ``max_length_q/k``, ``seq_idx``).
    """

    input_ids: torch.Tensor | None
    inputs_embeds: torch.Tensor | None
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    mm_token_type_ids: torch.Tensor | None
    past_key_values: Any
    use_cache: bool | None
    pixel_values: torch.Tensor | None
    pixel_values_videos: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    video_grid_thw: torch.Tensor | None
    rope: Mapping[str, Any]
    cu_seqlens: torch.Tensor | None
    seqlens: list[int] | None
    vision_grids: list | None
    vision_inputs: Mapping[str, Any] | None
    num_supervised_tokens: int | None
    source_ids: torch.Tensor | None
    skip_logits: bool | None
    rest: Mapping[str, Any]
    labels: torch.Tensor | None = None
    shift_labels: torch.Tensor | None = None
    num_items_in_batch: int | torch.Tensor | None = None
    logits_to_keep: int | torch.Tensor = 0

    @property
    def supervised(self) -> bool:
        """Whether the call asks for the loss (labels or shift_labels)."""
        return self.labels is not None or self.shift_labels is not None

    @property
    def collated(self) -> bool:
        """Whether the batch is `VisionCollator`'s: it gave the host ``seqlens``."""
        return self.seqlens is not None

    @property
    def vision(self) -> dict[str, torch.Tensor | None]:
        """The vision inputs as the backbone takes them (a new dict)."""
        return {
            "pixel_values": self.pixel_values,
            "pixel_values_videos": self.pixel_values_videos,
            "image_grid_thw": self.image_grid_thw,
            "video_grid_thw": self.video_grid_thw,
        }


def parse_call(
    signature: ForwardSignature,
    args: tuple,
    kwargs: Mapping[str, Any],
    *,
    rope_kwargs: tuple[str, ...] = (),
    head: bool = True,
) -> ForwardCall:
    """The `ForwardCall` of ``forward(*args, **kwargs)`` (without ``self``) against the original's ``signature``.

    ``rope_kwargs``: the family's (`FamilySpec.rope_kwargs`). ``head``: the forward computes the loss (the top-level
    one), so the loss keywords are its fields; the backbone (``head=False``) passes its caller's on in ``rest``.
    Raises ``TypeError`` as Python would for arguments the original forward does not take.
    """
    given = signature.bind(args, kwargs)
    names = _FIELDS + _HEAD_FIELDS if head else _FIELDS
    taken = frozenset((*names, *rope_kwargs, *_SUPERSEDED))
    fields: dict[str, Any] = {name: given.get(name) for name in names}
    if head:
        fields["logits_to_keep"] = given.get("logits_to_keep", 0)
    cu_seqlens = given.get("cu_seqlens")
    return ForwardCall(
        **fields,
        rope=MappingProxyType({k: given.get(k) for k in rope_kwargs}),
        cu_seqlens=given.get("cu_seq_lens_q") if cu_seqlens is None else cu_seqlens,
        rest=MappingProxyType({k: v for k, v in given.items() if k not in taken}),
    )
