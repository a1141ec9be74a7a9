"""Sequence-parallel sharding of one pack: tokens, positions, boundaries, DeepStack, vision units, targets, loss.

Everything here slices what was computed on the whole pack (or combines what the slices computed) so that the SP
group trains exactly what SP = 1 trains; the pictures and the gradient argument are in
`hf_packing.patches.sequence_parallel`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..ops.varlen import PackedSequences, vision_item_tokens
from .comm import SP_KWARG, LinearHeads, SPGroup, all_gather_rows, all_reduce_sum, key_replication

# ----------------------------------------------------------------------------------------------- sharding


def padded_length(total: int, size: int) -> int:
    """The smallest multiple of ``size`` that is ``>= total`` (``padded_length(10, 4) == 12``)."""
    return -(-total // size) * size


def padded_sequences(seqs: PackedSequences, size: int) -> PackedSequences:
    """``seqs`` plus one tail sequence holding the padding to a multiple of ``size`` (none when it divides).

    ``[0, 4, 10]`` with ``size=4`` → ``[0, 4, 10, 12]``: the two padding tokens attend only to each other.
    """
    total = int(sum(seqs.seqlens)) if seqs.seqlens else int(seqs.cu_seqlens[-1])
    pad = padded_length(total, size) - total
    if pad == 0:
        return seqs
    seqlens = list(seqs.seqlens or (seqs.cu_seqlens[1:] - seqs.cu_seqlens[:-1]).tolist()) + [pad]
    return PackedSequences.from_seqlens(seqlens, device=seqs.cu_seqlens.device)


def shard_range(total: int, sp: SPGroup) -> tuple[int, int]:
    """``[start, end)`` of this rank's slice of a stream of ``total`` tokens padded to a multiple of ``sp.size``."""
    local = padded_length(total, sp.size) // sp.size
    return sp.rank * local, (sp.rank + 1) * local


def pad_and_shard(x: torch.Tensor, sp: SPGroup, *, dim: int, value: float = 0) -> torch.Tensor:
    """Pad ``x`` along ``dim`` to a multiple of ``sp.size`` with ``value`` and keep this rank's slice.

    ``x = [a0 .. a9]`` (``dim=0``), ``P = 4``, rank 3 → ``[a9, value, value]``.
    """
    total = x.shape[dim]
    pad = padded_length(total, sp.size) - total
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.new_full(shape, value)], dim=dim)
    start, end = shard_range(total, sp)
    return x.narrow(dim, start, end - start)


def shard_position_ids(position_ids: torch.Tensor, sp: SPGroup) -> torch.Tensor:
    """This rank's slice of the pack's M-RoPE positions ``(R, 1, T)`` (R = 3, or 4 with a text row).

    The padding tail counts ``0, 1, ...`` on every row, like a text-only sequence of its own.
    """
    total = position_ids.shape[-1]
    pad = padded_length(total, sp.size) - total
    if pad:
        tail = torch.arange(pad, device=position_ids.device, dtype=position_ids.dtype)
        position_ids = torch.cat([position_ids, tail.expand(*position_ids.shape[:-1], pad)], dim=-1)
    start, end = shard_range(total, sp)
    return position_ids[..., start:end]


def shard_deepstack(
    visual_pos_masks: torch.Tensor, deepstack_visual_embeds: list[torch.Tensor], sp: SPGroup
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Qwen3-VL DeepStack inputs for this rank: the mask ``(1, T)`` sliced like the tokens, and of each layer's
    ``(n_visual, H)`` features the rows of the visual tokens that fall in this slice (they are in token order)."""
    total = visual_pos_masks.shape[-1]
    start, end = shard_range(total, sp)
    before = int(visual_pos_masks[..., :start].sum()) if start < total else int(visual_pos_masks.sum())
    local_mask = pad_and_shard(visual_pos_masks, sp, dim=-1, value=False)
    inside = int(local_mask.sum())
    return local_mask, [e.narrow(0, before, inside) for e in deepstack_visual_embeds]


def text_model_pre_hook(sp: SPGroup, seqs: PackedSequences, packed_kwarg: str) -> Callable:
    """A ``register_forward_pre_hook(..., with_kwargs=True)`` hook for the text model (``model.language_model``).

    It receives the whole pack (``inputs_embeds (1, T, H)``, ``position_ids (R, 1, T)``, Qwen3-VL's
    ``visual_pos_masks`` / ``deepstack_visual_embeds``) and passes on this rank's slice of each, the padded
    boundaries, and the `SPGroup` for attention (with the linear-attention head layout of a hybrid model, checked
    against ``P`` here, before any layer runs).
    """

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        heads = LinearHeads.from_config(module.config)
        if heads is not None:
            key_replication(heads, sp.size)
        embeds = kwargs["inputs_embeds"]
        kwargs["inputs_embeds"] = pad_and_shard(embeds, sp, dim=1)
        kwargs["position_ids"] = shard_position_ids(kwargs["position_ids"], sp)
        if kwargs.get("visual_pos_masks") is not None:
            kwargs["visual_pos_masks"], kwargs["deepstack_visual_embeds"] = shard_deepstack(
                kwargs["visual_pos_masks"], kwargs["deepstack_visual_embeds"], sp
            )
        kwargs[packed_kwarg] = padded_sequences(seqs, sp.size)
        kwargs[SP_KWARG] = sp if heads is None else dataclasses.replace(sp, linear=heads)
        return args, kwargs

    return hook


# ----------------------------------------------------------------------------------------------- vision tower


def split_vision_units(grid_thw: list[list[int]], size: int) -> list[list[int]]:
    """Assign a pack's vision units to ``size`` ranks, balanced by patches (largest first, to the least loaded).

    A unit is one temporal slice ``(1, h, w)`` of an image or video ``(t, h, w)``: the towers attend within each
    temporal slice (their ``cu_seqlens`` repeat ``h·w`` ``t`` times), so a video's slices encode alone exactly as
    together. Units are numbered in item order, slices in time order; each rank's list is sorted.

    ``[[1, 4, 4], [2, 2, 2]]`` (16 + 2 × 4 patches), ``size=2`` → ``[[0], [1, 2]]``.
    """
    patches = [h * w for t, h, w in grid_thw for _ in range(t)]
    load = [0] * size
    ranks: list[list[int]] = [[] for _ in range(size)]
    for unit in sorted(range(len(patches)), key=lambda u: (-patches[u], u)):
        rank = min(range(size), key=lambda r: (load[r], r))
        ranks[rank].append(unit)
        load[rank] += patches[unit]
    return [sorted(r) for r in ranks]


def encode_vision_split(
    encode: Callable[[torch.Tensor, torch.Tensor], Any],
    pixel_values: torch.Tensor,
    grid_thw: torch.Tensor,
    sp: SPGroup,
    merge: int,
    dummy: Callable[[], tuple[Any, torch.Tensor]],
) -> tuple[Any, torch.Tensor | None]:
    """The tower's output for every item of the pack, each rank encoding only its units (`split_vision_units`).

    Args:
        encode: ``(pixels (n, C_in), grid (k, 3)) -> output`` with ``pooler_output`` a tuple per item and, for
            Qwen3-VL, ``deepstack_features`` (per layer, a tuple per item): the model's ``get_image_features``.
        pixel_values (`(Σ t·h·w, C_in)`), grid_thw (`(items, 3)`): the pack's images or videos.
        merge: the spatial merge size (features per unit = ``h·w / merge²``).
        dummy: runs the tower on a dummy image and returns its output and ``0 · Σ`` of it, for a rank that got no
            unit (every rank calls the tower once: FSDP / ZeRO-3 gather its parameters collectively).

    Returns:
        The output with ``pooler_output`` / ``deepstack_features`` for all items in item order, gathered over the
        SP group with autograd (``last_hidden_state``, the pre-merge patches, is ``None``), and the dummy term
        (``0 · Σ dummy features``) to add to the loss, or ``None``.
    """
    grids = grid_thw.tolist()
    units = [(i, f, h, w) for i, (t, h, w) in enumerate(grids) for f in range(t)]
    starts = torch.tensor([0] + [t * h * w for t, h, w in grids]).cumsum(0).tolist()
    mine = split_vision_units(grids, sp.size)
    unit_tokens = vision_item_tokens([[1, h, w] for _, _, h, w in units], merge=merge)  # one frame each
    per_rank = [sum(unit_tokens[u] for u in r) for r in mine]
    dummy_term = None
    if mine[sp.rank]:
        rows = [
            pixel_values[starts[i] + f * h * w : starts[i] + (f + 1) * h * w]
            for i, f, h, w in (units[u] for u in mine[sp.rank])
        ]
        local_grid = grid_thw.new_tensor([[1, units[u][2], units[u][3]] for u in mine[sp.rank]])
        out = encode(torch.cat(rows), local_grid)
        parts = [_rows(out.pooler_output)] + [_rows(layer) for layer in out.get("deepstack_features") or []]
    else:
        out, dummy_term = dummy()
        parts = [_rows(out.pooler_output)[:0]] + [_rows(layer)[:0] for layer in out.get("deepstack_features") or []]
    width = parts[0].shape[1]
    gathered = all_gather_rows(torch.cat(parts, dim=1), per_rank, sp)
    # rows arrive rank by rank; put each unit's rows back in unit order, then split by item and by output
    offsets, at = {}, 0
    for r in mine:
        for u in r:
            offsets[u], at = at, at + unit_tokens[u]
    order = torch.cat([torch.arange(offsets[u], offsets[u] + unit_tokens[u]) for u in range(len(units))])
    whole = gathered.index_select(0, order.to(gathered.device)).split(width, dim=1)
    sizes = vision_item_tokens(grids, merge=merge)
    split = out.get("deepstack_features") and not isinstance(out.deepstack_features[0], torch.Tensor)
    result = type(out)()
    for key, value in out.items():  # key by key: some towers add keys that are not fields (router_logits)
        if key != "last_hidden_state":  # the pre-merge patches of this rank's units only: not the pack's
            result[key] = value
    result["pooler_output"] = whole[0].split(sizes)
    if len(whole) > 1:  # as the tower gives them: a tuple per item (5.23), or one tensor per layer (5.17)
        result["deepstack_features"] = [layer.split(sizes) if split else layer for layer in whole[1:]]
    return result, dummy_term


def _rows(items: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``(n, C)`` rows of a tower output field: a tuple per item (concatenated) or already one tensor."""
    return items if isinstance(items, torch.Tensor) else torch.cat(items)


# ----------------------------------------------------------------------------------------------- loss


def local_targets(targets: torch.Tensor, sp: SPGroup, ignore_index: int = -100) -> torch.Tensor:
    """This rank's slice of the pack's targets ``(T,)``, already shifted per sequence; the padding tail ignored."""
    return pad_and_shard(targets, sp, dim=0, value=ignore_index)


def sp_loss(
    loss_sum: torch.Tensor, num_supervised: int, num_items_in_batch: int | torch.Tensor | None, sp: SPGroup
) -> torch.Tensor:
    """The loss an SP rank returns, so that the training loop's combination equals SP = 1.

    Args:
        loss_sum: Σ CE over this rank's supervised tokens; num_supervised: their count.
        num_items_in_batch: the Trainer's count, summed over every rank: each SP group's pack is counted ``P``
            times (each of its ranks holds the whole pack's labels), so it is ``P × N`` for ``N`` supervised tokens.

    With ``num_items_in_batch``: ``loss_sum / (num_items_in_batch / P)``, a share of the global loss; the Trainer
    multiplies it by ``num_processes`` and DDP / FSDP average over all ranks, so the update is ``∇ Σ CE / N``.
    Without: the pack's mean CE as the value (the same on every SP rank, one all-reduce) carrying the gradient of
    ``P · loss_sum / N_pack``, so averaging over ranks (DDP) gives the mean of the packs' mean losses, as at SP = 1.
    """
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            return loss_sum / (num_items_in_batch.to(loss_sum.device) / sp.size).clamp(min=1)
        return loss_sum / max(num_items_in_batch / sp.size, 1)
    both = torch.stack([loss_sum.detach().float(), loss_sum.new_tensor(float(num_supervised))])
    dist.all_reduce(both, group=sp.group)
    count = both[1].clamp(min=1)
    share = loss_sum * sp.size / count
    return share + (both[0] / count - share).detach()


def load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int, sp: SPGroup, total: int
) -> torch.Tensor:
    """The MoE load-balancing loss of the whole pack from this rank's slice: transformers'
    ``load_balancing_loss_func`` with its router statistics summed over the SP group before the loss is formed.

    ``E · Σ_e f_e · p_e``, with ``f_e`` the share of top-k assignments to expert ``e`` and ``p_e`` the mean router
    probability, over the ``total`` real tokens of every layer (the padding tail is left out). Per shard, the
    loss of a product of means is not the mean of the shards' losses (the gradients move far beyond round-off,
    measured: docs/sequence_parallel.md); summed first, the value is the SP = 1 one on every rank. The sum's
    backward adds every rank's gradient, so with loss weights that sum to the pack's weight over the group
    (`sp_loss`'s shares) the group's gradient equals SP = 1's.

    Args:
        router_logits: per MoE layer, ``(T/P, E)`` pre-softmax logits of this rank's tokens.
        total (`int`): the pack's real token count ``T`` (before SP padding).

    Returns:
        A scalar fp32 `torch.Tensor`, the same on every rank of the group.
    """
    device = router_logits[0].device
    start, end = shard_range(total, sp)
    valid = (torch.arange(start, end, device=device) < total).float()
    counts = torch.zeros(num_experts, device=device)
    probs = torch.zeros(num_experts, device=device)
    for layer in router_logits:
        weights = torch.nn.functional.softmax(layer.to(device), dim=-1)
        _, selected = torch.topk(weights, top_k, dim=-1)
        counts = counts.scatter_add(
            0, selected.reshape(-1), valid.repeat_interleave(top_k, output_size=valid.numel() * top_k)
        )
        probs = probs + (weights.float() * valid.unsqueeze(-1)).sum(dim=0)
    summed = all_reduce_sum(torch.cat([counts, probs]), sp)
    rows = total * len(router_logits)  # every layer routes every real token once
    return (summed[:num_experts] / rows * (summed[num_experts:] / rows)).sum() * num_experts
