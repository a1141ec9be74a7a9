"""Model FLOPs of one training step (forward + backward) for a collator batch: text and vision, counted exactly.

``training_flops(model, batch)`` reads host values only (grids, boundaries, the mask), counts the model's weights
(`hf_packing.ops.flops.ModelFlops.from_model`, under any compile / DDP / PEFT wrapper) and returns
``{"text", "vision", "total"}``. The formula, and how model FLOPs differ from the FLOPs a step executes, are in
`hf_packing.ops.flops`: the one cost model, which the telemetry's MFU and the packer's rank balance use too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..ops.flops import ModelFlops
from ..patches import unwrap_model

__all__ = ["document_lengths", "cost_model", "text_flops", "training_flops", "vision_flops"]


def cost_model(model: torch.nn.Module) -> ModelFlops:
    """The cost model's counts of ``model`` (unwrapped from compile / DDP / FSDP / PEFT first)."""
    return ModelFlops.from_model(unwrap_model(model))


def _host(t: Any) -> list:
    return t.tolist() if isinstance(t, torch.Tensor) else list(t)


def document_lengths(batch: Mapping[str, Any]) -> list[int]:
    """Each document's length: from ``cu_seqlens`` / ``cu_seq_lens_q``, else the mask's rows, else whole rows."""
    cu = batch.get("cu_seqlens", batch.get("cu_seq_lens_q"))
    if cu is not None:
        cu = _host(cu)
        return [b - a for a, b in zip(cu[:-1], cu[1:])]
    mask = batch.get("attention_mask")
    if mask is not None:
        return [int(n) for n in _host(mask.sum(-1))]
    ids = batch["input_ids"]
    return [ids.shape[-1]] * ids.shape[0]


def text_flops(model: torch.nn.Module, lengths: list[int]) -> float:
    """Training FLOPs of the decoder layers and the LM head for documents of ``lengths``."""
    return cost_model(model).text_of(lengths)


def vision_flops(model: torch.nn.Module, grids: list[list[int]]) -> float:
    """Training FLOPs of the vision tower on items of ``grids`` (``(t, h, w)`` each), frames and windows exact."""
    return cost_model(model).vision_of(grids)


def training_flops(model: torch.nn.Module, batch: Mapping[str, Any]) -> dict[str, float]:
    """Model FLOPs of one training step (forward + backward) on ``batch`` (a collator batch, or any model kwargs).

    Args:
        model: a Qwen-VL ``ForConditionalGeneration`` (or a compiled / DDP / PEFT wrapper of one).
        batch: ``input_ids`` with ``cu_seqlens`` / ``cu_seq_lens_q`` or ``attention_mask``, and the vision grids.

    Returns:
        ``{"text": ..., "vision": ..., "total": ...}`` in FLOPs (see `hf_packing.ops.flops` for what is counted and
        how it differs from what a step executes). A dummy_vision image is not counted.
    """
    counts = cost_model(model)
    lengths = document_lengths(batch)
    grids = [g for key in ("image_grid_thw", "video_grid_thw") if batch.get(key) is not None for g in _host(batch[key])]
    text = counts.text_of(lengths)
    vision = counts.vision_of(grids)
    return {"text": text, "vision": vision, "total": text + vision}
