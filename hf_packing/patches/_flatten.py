"""From the caller's batch to one flat row of real tokens: boundaries, indices and M-RoPE positions.

Every input format transformers accepts is taken, and two sequences are never merged silently::

    padded rows + attention_mask          one row packed by position ids (DataCollatorWithFlattening,
    (right or left padding)               TRL padding_free), no attention_mask, optional cu_seq_lens_q
    a a a 0 0   mask 1 1 1 0 0            a a a b b b b b c
    b b b b b        1 1 1 1 1            position_ids 0 1 2 0 1 2 3 4 0  (2-D, or row 0 of the 4-row form)
              │                                     │
              └──────────────► flat ids a a a b b b b b (c)   cu_seqlens [0, 3, 8, (9)]

Boundaries come from, in order: `VisionCollator`'s host ``seqlens`` (it built the mask and boundaries from
them and checked them in the worker; trusted here: no host read, no tensor made from host data); explicit
``cu_seqlens`` / ``cu_seq_lens_q`` (our collator, transformers' flash kwargs); the text-position row when position
ids restart inside a row that has no padding (a restart is a step other than +1, transformers'
``find_packed_sequence_indices`` rule);
else one sequence per row of the attention mask. A row that has an attention mask *and* restarting position ids, or
restarting 3-row M-RoPE positions without a text row, is ambiguous and raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.utils import logging as hf_logging

from ..ops.varlen import (
    PackedSequences,
    index_first_axis,
    pad_input,
    token_sequences,
    token_types,
    validate_attention_mask,
    vision_item_tokens,
)
from ._spec import FamilySpec

logger = hf_logging.get_logger(__name__)  # transformers' logger: `warning_once`


@dataclass
class FlatBatch:
    """A batch as one flat row of its ``T`` real tokens.

    Attributes:
        input_ids (`torch.LongTensor` of shape `(1, T)`), position_ids (`(3, 1, T)` M-RoPE positions),
        mm_token_type_ids (`(1, T)`, *optional*).
        indices (`torch.LongTensor` of shape `(T,)`): where each token sits in the caller's ``B * L`` grid.
        seqs (`PackedSequences`): the sequence boundaries inside the flat row.
        batch, length (`int`): the caller's ``(B, L)``, to re-pad outputs.
        vision_seqlens (`tuple[list[int], ...]`): see `_vision.vision_seqlens`; empty when not known on the host.
        collated (`bool`): the batch is `VisionCollator`'s (it gave ``seqlens``), checked on the host by the collator.
        vision_inputs (`dict`): the vision tower's precomputed boundaries and positions (the collator's).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mm_token_type_ids: torch.Tensor | None
    indices: torch.Tensor
    seqs: PackedSequences
    batch: int
    length: int
    #: host lengths of the vision tower's boundaries (`_vision.vision_seqlens`), when the collator gave the grids
    vision_seqlens: tuple[list[int], ...] = ()
    #: whether the batch is `VisionCollator`'s (it gave ``seqlens``): its host facts were checked in the collator
    collated: bool = False
    #: the collator's ``vision_inputs`` (`_vision.precomputed_vision_inputs`): what the tower's helpers would compute
    vision_inputs: dict[str, Any] = field(default_factory=dict)
    #: the family's tower encodes video frames as images (`FamilySpec.video_frames_as_images`, GLM-V)
    frames_as_images: bool = False

    def flatten(self, padded: torch.Tensor) -> torch.Tensor:
        """``(B, L, ...)`` → ``(T, ...)`` for any per-token tensor of the caller (labels, shift_labels)."""
        return index_first_axis(padded.flatten(0, 1), self.indices.to(padded.device))

    def repad(self, flat: torch.Tensor) -> torch.Tensor:
        """``(T, ...)`` → ``(B, L, ...)``, zeros at padded positions."""
        return pad_input(flat, self.indices.to(flat.device), self.batch, self.length)


def _text_positions(position_ids: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Split the caller's position ids into (text row ``(B, L)`` or None, M-RoPE rows ``(3, B, L)`` or None)."""
    if position_ids is None:
        return None, None
    if position_ids.dim() == 2:
        return position_ids, position_ids.unsqueeze(0).expand(3, -1, -1)
    if position_ids.shape[0] == 4:  # transformers' packed form: text row + 3 M-RoPE rows
        return position_ids[0], position_ids[1:]
    return None, position_ids


def _row_restarts(text_positions: torch.Tensor) -> torch.Tensor:
    """``(B, L)`` bool: True where a new sequence starts after the row's first token (a step other than +1)."""
    step = text_positions[:, 1:] - text_positions[:, :-1]
    return torch.nn.functional.pad(step != 1, (1, 0), value=False)


def sequence_boundaries(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    seqlens: list[int] | None = None,
) -> tuple[torch.Tensor, PackedSequences]:
    """The flat indices of real tokens and the sequences they form (see the module docstring).

    Args:
        input_ids (`torch.LongTensor` of shape `(B, L)`).
        attention_mask (`torch.Tensor` of shape `(B, L)`, *optional*): 0/1 padding mask.
        position_ids (`torch.LongTensor` of shape `(B, L)`, `(3, B, L)` or `(4, B, L)`, *optional*).
        cu_seqlens (`torch.IntTensor` of shape `(n + 1,)`, *optional*): explicit boundaries over the real tokens.
        seqlens (`list[int]`, *optional*): `VisionCollator`'s host lengths of the sequences (see `collated_boundaries`).

    Returns:
        indices (`torch.LongTensor` of shape `(T,)`) and `PackedSequences` (one host read; none with ``seqlens``).

    Raises:
        ValueError: for a malformed mask, boundaries that do not cover the real tokens, or ambiguous input.
    """
    if seqlens is not None:
        return collated_boundaries(input_ids, attention_mask, cu_seqlens, seqlens)
    if attention_mask is None:
        lengths = [input_ids.shape[1]] * input_ids.shape[0]
        indices = torch.arange(input_ids.numel(), device=input_ids.device)
    else:
        lengths = validate_attention_mask(attention_mask)
        # the count is known on the host: a fixed-size nonzero needs no device sync (plain nonzero does)
        indices = torch.nonzero_static(attention_mask.flatten(), size=sum(lengths)).flatten()
    if cu_seqlens is not None:
        seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        if sum(seqlens) != indices.numel():
            raise _dispatch_error(sum(seqlens), indices.numel())
        cu = cu_seqlens.to(device=input_ids.device, dtype=torch.int32).contiguous()
        return indices, PackedSequences(cu_seqlens=cu, max_seqlen=max(seqlens, default=0), seqlens=seqlens)
    text, mrope = _text_positions(position_ids)
    if text is None and mrope is not None and attention_mask is None:
        if bool((mrope[0, :, 1:] < mrope[0, :, :-1]).any()):
            raise ValueError(
                "position_ids restart inside a row, but as 3 M-RoPE rows without a text-position row the sequence "
                "boundaries cannot be told from image positions. Pass transformers' packed form (4 rows: text "
                "positions first), or cu_seq_lens_q / cu_seqlens"
            )
        return indices, PackedSequences.from_seqlens(lengths, device=input_ids.device)
    if text is None:
        return indices, PackedSequences.from_seqlens(lengths, device=input_ids.device)
    restarts = _row_restarts(text.to(input_ids.device))
    if attention_mask is not None:
        restarts = restarts & attention_mask.bool() & attention_mask.bool().roll(1, dims=1)
    where = torch.nonzero(restarts, as_tuple=False).tolist()
    if where and attention_mask is not None:
        row, col = where[0]
        raise ValueError(
            f"position_ids restart at row {row}, column {col}, but attention_mask marks the row as one sequence. "
            "For packed rows drop the attention_mask (transformers' padding-free format) or pass cu_seq_lens_q; "
            "for padded rows pass position_ids that count up inside each row"
        )
    found: list[int] = []
    cuts: dict[int, list[int]] = {}
    for row, col in where:
        cuts.setdefault(row, []).append(col)
    for row, length in enumerate(lengths):
        edges = [0, *cuts.get(row, []), length]
        found += [b - a for a, b in zip(edges[:-1], edges[1:])]
    return indices, PackedSequences.from_seqlens(found, device=input_ids.device)


def _dispatch_error(covered: int, real: int) -> ValueError:
    return ValueError(
        f"cu_seqlens covers {covered} tokens but the batch has {real} real tokens. Under "
        "the HF Trainer this means accelerate sliced the batch (dispatch_batches): call "
        "hf_packing.prepare_trainer(trainer), or set accelerator_config={'dispatch_batches': False}"
    )


def collated_boundaries(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None, seqlens: list[int]
) -> tuple[torch.Tensor, PackedSequences]:
    """`sequence_boundaries` of a `VisionCollator` batch: no host read, no tensor made from host data.

    The collator built the mask (one sample per row, ``mode="rows"``) or ``cu_seq_lens_q`` (one flat row,
    ``mode="flat"``) from these lengths and checked them on the host, in the DataLoader worker; the batch is
    trusted here, not re-checked on the device. The device ``cu_seqlens`` is the batch's own (``cu_seqlens`` /
    ``cu_seq_lens_q``), else the mask's running row sums; ``seqlens`` gives the host side (``max_seqlen``, the
    reference backend's split, ``nonzero_static``'s size).

    Args:
        input_ids (`torch.LongTensor` of shape `(B, L)`), attention_mask (`(B, L)`, *optional*), cu_seqlens
            (`(n + 1,)`, *optional*), seqlens (`list[int]`, ``n`` host lengths: one per row with a mask).
    """
    device = input_ids.device
    if attention_mask is None:
        if sum(seqlens) != input_ids.numel():
            raise _dispatch_error(sum(seqlens), input_ids.numel())
        indices = torch.arange(input_ids.numel(), device=device)
    else:
        if len(seqlens) != input_ids.shape[0]:
            raise ValueError(
                f"seqlens lists {len(seqlens)} sequences for {input_ids.shape[0]} rows; VisionCollator(mode='rows') "
                "gives one per row (under the HF Trainer: call hf_packing.prepare_trainer(trainer))"
            )
        indices = torch.nonzero_static(attention_mask.flatten(), size=sum(seqlens)).flatten().to(device)
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=device, dtype=torch.int32)
    elif attention_mask is not None:  # one sequence per row: the rows' running lengths, on the device
        lengths = attention_mask.to(device=device, dtype=torch.int32).sum(-1, dtype=torch.int32)
        cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    else:  # seqlens without tensor boundaries (not VisionCollator's batch): made from the host lengths
        return indices, PackedSequences.from_seqlens(seqlens, device=device)
    return indices, PackedSequences(cu_seqlens=cu, max_seqlen=max(seqlens, default=0), seqlens=list(seqlens))


def rope_positions(
    backbone,
    spec: FamilySpec,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    mm_token_type_ids: torch.Tensor | None,
    image_grid_thw,
    video_grid_thw,
    extra: dict[str, Any],
) -> torch.Tensor:
    """M-RoPE positions ``(3, B, L)`` of rows holding one sequence each, from the family's own ``get_rope_index``.

    Without images or videos every row's positions are ``0..n-1`` on all three rows, which is what
    ``get_rope_index`` gives too; computing them directly skips its Python loop over rows.
    """
    if image_grid_thw is None and video_grid_thw is None:
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
        return (mask.cumsum(-1) - 1).clamp(min=0).unsqueeze(0).expand(3, -1, -1)
    if mm_token_type_ids is None:
        logger.warning_once(
            "batch has images/videos but no mm_token_type_ids; deriving them from input_ids. (The unpatched model "
            "would silently fall back to 1-D positions here; pass the processor's mm_token_type_ids.)"
        )
        config = backbone.config
        mm_token_type_ids = token_types(
            input_ids, image_token_id=config.image_token_id, video_token_id=config.video_token_id, dtype=torch.int32
        )
    position_ids, _ = backbone.get_rope_index(
        input_ids,
        mm_token_type_ids=mm_token_type_ids,
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        attention_mask=attention_mask,
        **{k: v for k, v in extra.items() if v is not None},
    )
    return position_ids


def flatten_batch(
    backbone,
    spec: FamilySpec,
    *,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    mm_token_type_ids: torch.Tensor | None,
    image_grid_thw,
    video_grid_thw,
    extra: dict[str, Any],
    seqlens: list[int] | None = None,
) -> FlatBatch:
    """Remove the padding once: the caller's ``(B, L)`` batch as a `FlatBatch` (checks placeholders per sequence).

    ``backbone`` is the family's ``XModel`` (``model.model``): its config and ``get_rope_index``.
    """
    batch, length = input_ids.shape
    indices, seqs = sequence_boundaries(input_ids, attention_mask, position_ids, cu_seqlens, seqlens)
    flat_ids = index_first_axis(input_ids.flatten(), indices).unsqueeze(0)
    if image_grid_thw is not None or video_grid_thw is not None:
        # the collator's batch (seqlens): checked by the collator, on the host; any other caller's: here, on the host
        check = check_placeholders if seqlens is None else collated_placeholders
        types = None if mm_token_type_ids is None else index_first_axis(mm_token_type_ids.flatten(), indices)
        check(backbone.config, flat_ids[0], seqs, image_grid_thw, video_grid_thw, types)
    _, mrope = _text_positions(position_ids)
    if mrope is None:
        if len(seqs.seqlens) != batch:
            raise ValueError(
                f"the batch packs {len(seqs.seqlens)} sequences into {batch} rows; packed rows need their "
                "per-sample position_ids (VisionCollator computes them)"
            )
        mrope = rope_positions(
            backbone, spec, input_ids, attention_mask, mm_token_type_ids, image_grid_thw, video_grid_thw, extra
        )
    flat_pos = mrope.flatten(1).index_select(1, indices.to(mrope.device)).unsqueeze(1)
    flat_types = None if mm_token_type_ids is None else index_first_axis(mm_token_type_ids.flatten(), indices)[None]
    return FlatBatch(flat_ids, flat_pos, flat_types, indices, seqs, batch, length, collated=seqlens is not None)


def _placeholder_counts(
    config, flat_ids: torch.Tensor, seqs: PackedSequences, flat_types: torch.Tensor | None = None
) -> torch.Tensor:
    """``(2, n_seqs)`` int64 on the device: image / video placeholder tokens per sequence (from the device
    ``cu_seqlens``: no host sync, no tensor from host data). By the token types when given (1 image, 2 video: GLM-V
    writes a video's frames with the image token), else by the config's two token ids."""
    seq_id, _ = token_sequences(seqs, flat_ids.numel(), flat_ids.device)  # 1-based
    counts = torch.zeros(2, len(seqs.seqlens) + 1, dtype=torch.long, device=flat_ids.device)
    if flat_types is None:
        image, video = flat_ids == config.image_token_id, flat_ids == config.video_token_id
    else:  # a placeholder token of either id, of the type's kind
        placeholder = (flat_ids == config.image_token_id) | (flat_ids == config.video_token_id)
        image, video = (flat_types == 1) & placeholder, (flat_types == 2) & placeholder
    counts[0].index_add_(0, seq_id, image.long())
    counts[1].index_add_(0, seq_id, video.long())
    return counts[:, 1:]


def collated_placeholders(
    config, flat_ids: torch.Tensor, seqs: PackedSequences, image_grid_thw, video_grid_thw, flat_types=None
) -> None:
    """`check_placeholders` for `VisionCollator`'s batches: nothing to do in the step. The collator checked each
    sample's placeholders against its grids on the host, in the DataLoader worker (``VisionCollator._check``), and
    a device-side re-check would cost a copy of the host lengths and, on CUDA, turn a clear error into a dead
    context. (A seam: the sync gate's negative control puts the host check back here.)"""


def check_placeholders(
    config, flat_ids: torch.Tensor, seqs: PackedSequences, image_grid_thw, video_grid_thw, flat_types=None
) -> None:
    """Each sequence's image/video placeholder count must equal the tokens of the items (in order) that belong
    to it; otherwise features would land in the wrong sample. Raises `ValueError` with transformers' wording
    ("Image features and image tokens do not match") plus the sequence it concerns."""
    merge = config.vision_config.spatial_merge_size
    counts = _placeholder_counts(config, flat_ids, seqs, flat_types)
    for kind, row_counts, grid in zip(("image", "video"), counts.tolist(), (image_grid_thw, video_grid_thw)):
        per_item = [] if grid is None else vision_item_tokens(grid, merge=merge)
        wording = (
            f"{kind.capitalize()} features and {kind} tokens do not match, "
            f"tokens: {sum(row_counts)}, features: {sum(per_item)}"
        )
        item = 0
        for row, count in enumerate(row_counts):
            taken = 0
            while taken < count and item < len(per_item):
                taken += per_item[item]
                item += 1
            if taken != count:
                raise ValueError(
                    f"{wording} (hf_packing: sequence {row} has {count} {kind} placeholder tokens but "
                    f"{kind}_grid_thw gives {taken} for the {kind}s assigned to it; re-run the processor on this "
                    "sample)"
                )
        if item != len(per_item):
            raise ValueError(
                f"{wording} (hf_packing: {kind}_grid_thw lists {len(per_item)} {kind}s but the "
                f"placeholders cover only {item})"
            )
