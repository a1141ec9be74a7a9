"""Model FLOPs of one training step (forward + backward) for a collator batch: text and vision, counted exactly.

``training_flops(model, batch)`` reads host values only (grids, boundaries, the mask) and returns
``{"text", "vision", "total"}``::

    text    6·N·T  +  6·L·d·Σ_doc len²  +  18·L_lin·S·T
            N: matmul weights of the decoder layers (2-D and up; MoE experts × k/E, the router in full) + the
            LM head H·V (even when tied); norms, biases and the embedding lookup are not matmuls.
            L softmax layers, d = heads·head_dim: QKᵀ and AV, 4·d·len² forward, ½ for the causal mask, ×3.
            L_lin Gated DeltaNet layers, S = value heads·d_k·d_v: state read by k, written, read by q (model FLOPs).
    vision  per image / video item (t, h, w), P = t·h·w patches, m = spatial_merge_size:
            patch embedding 2·N_pe·P forward (its backward computes only the weight gradient: ×2 in all),
            blocks 2·N_blk·P, merger and DeepStack mergers 2·N_mrg·P/m² (they run on merged tokens),
            attention 4·D·Σ_unit n² per block, bidirectional, unit = one frame (t slices of h·w patches) or,
            in Qwen2.5-VL's windowed blocks, one window (its real size at the frame's edge); ×3 when any tower
            parameter trains, ×1 (forward only) when the tower is frozen.

How this differs from the FLOPs a step executes: activation checkpointing recomputes the forward (+1× forward
FLOPs for checkpointed layers); the chunked loss recomputes each chunk's logits in backward and computes logits
only at supervised positions (``6·H·V·T`` counts all T); the varlen kernels compute causal attention on
tiles, so they execute a bit more than ½ of the square; elementwise ops (norms, activations, rotary, softmax)
and the vision position-embedding interpolation are not counted; Gated DeltaNet's chunked kernel executes
intra-chunk products that the recurrence's model FLOPs leave out. MoE counts the k active experts per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _tower(model: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(model, "model", model)
    return getattr(inner, "visual", None) or model.visual


def _matmul_numel(module: torch.nn.Module, experts: int | None = None, active: int | None = None) -> float:
    """Σ numel of the weights that multiply activations (dim ≥ 2); MoE expert stacks count ``active / experts``."""
    total = 0.0
    for name, p in module.named_parameters():
        if p.dim() < 2 or "embed_tokens" in name or "pos_embed" in name:
            continue
        numel = float(getattr(p, "ds_numel", p.numel()))  # DeepSpeed ZeRO-3 partitions hold numel 0
        total += numel * active / experts if experts and active and ".experts." in f".{name}" else numel
    return total


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
    """Training FLOPs of the decoder layers and the LM head for documents of ``lengths`` (module docstring)."""
    model = _base(model)
    config = model.config.get_text_config()
    language = model.model.language_model
    experts, active = getattr(config, "num_experts", None), getattr(config, "num_experts_per_tok", None)
    n = _matmul_numel(language.layers, experts, active) + config.hidden_size * config.vocab_size
    heads = config.num_attention_heads
    d = heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)
    layer_types = list(getattr(config, "layer_types", None) or [])
    n_linear = layer_types.count("linear_attention")
    n_softmax = config.num_hidden_layers - n_linear
    state = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim if n_linear else 0
    tokens = float(sum(lengths))
    attention = 6.0 * n_softmax * d * sum(float(x) ** 2 for x in lengths) + 18.0 * n_linear * state * tokens
    return 6.0 * n * tokens + attention


def _attention_units(vision_config, grid: list[list[int]], windowed: bool) -> list[int]:
    """Patches per attention unit: one frame per temporal patch, or Qwen2.5-VL's windows (real sizes)."""
    m = vision_config.spatial_merge_size
    units: list[int] = []
    for t, h, w in grid:
        if not windowed:
            units += [h * w] * t
            continue
        size = vision_config.window_size // m // vision_config.patch_size  # merged tokens per window side
        rows = [size] * (h // m // size) + ([h // m % size] if h // m % size else [])
        cols = [size] * (w // m // size) + ([w // m % size] if w // m % size else [])
        units += [r * c * m * m for r in rows for c in cols] * t
    return units


def vision_flops(model: torch.nn.Module, grids: list[list[int]]) -> float:
    """Training FLOPs of the vision tower on items of ``grids`` (``(t, h, w)`` each; module docstring)."""
    model = _base(model)
    tower = _tower(model)
    vc = model.config.vision_config
    m2 = vc.spatial_merge_size**2
    patches = float(sum(t * h * w for t, h, w in grids))
    embed = _matmul_numel(tower.patch_embed)
    merged = sum(_matmul_numel(mod) for name, mod in tower.named_children() if "merger" in name)
    blocks = _matmul_numel(tower) - embed - merged
    width = getattr(vc, "embed_dim", None) or vc.hidden_size
    full = _attention_units(vc, grids, windowed=False)
    windowed_blocks = 0
    fields = vc.to_dict()  # getattr(vc, "window_size", None) raises on Qwen3-VL's per-layer config in 5.23
    if fields.get("fullatt_block_indexes") is not None and fields.get("window_size"):
        windowed_blocks = vc.depth - len(vc.fullatt_block_indexes)
    squares = (vc.depth - windowed_blocks) * sum(float(n) ** 2 for n in full)
    if windowed_blocks:
        squares += windowed_blocks * sum(float(n) ** 2 for n in _attention_units(vc, grids, windowed=True))
    forward = 2.0 * (embed * patches + blocks * patches + merged * patches / m2) + 4.0 * width * squares
    if not any(p.requires_grad for p in tower.parameters()):
        return forward
    return 3.0 * forward - 2.0 * embed * patches  # no gradient for the pixels: the patch embedding's backward is 1×


def training_flops(model: torch.nn.Module, batch: Mapping[str, Any]) -> dict[str, float]:
    """Model FLOPs of one training step (forward + backward) on ``batch`` (a collator batch, or any model kwargs).

    Args:
        model: a Qwen-VL ``ForConditionalGeneration`` (or a PEFT wrapper of one).
        batch: ``input_ids`` with ``cu_seqlens`` / ``cu_seq_lens_q`` or ``attention_mask``, and the vision grids.

    Returns:
        ``{"text": ..., "vision": ..., "total": ...}`` in FLOPs (see the module docstring for what is counted and
        how it differs from what a step executes). A dummy_vision image is not counted.
    """
    grids = [g for key in ("image_grid_thw", "video_grid_thw") if batch.get(key) is not None for g in _host(batch[key])]
    text = text_flops(model, document_lengths(batch))
    vision = vision_flops(model, grids) if grids else 0.0
    return {"text": text, "vision": vision, "total": text + vision}
