"""Ulysses sequence parallelism (SP) for Qwen-VL packs: one pack split along the sequence over ``P`` ranks.

Everything that needs the whole pack runs before the split, on every rank of the SP group, in transformers' own
code: the token embedding, the vision tower and the scatter of its features into the placeholders, and the M-RoPE
positions (per sample, from the family's ``get_rope_index``). A forward pre-hook on the text model then keeps this
rank's slice of the flat stream, padded to a multiple of ``P`` with one unsupervised tail sequence of its own::

    pack (T = 10, P = 4)       a a a a | b b b b b b            cu_seqlens [0, 4, 10]
    padded (T' = 12)           a a a a | b b b b b b | _ _      cu_seqlens [0, 4, 10, 12]   (_: own segment)
    rank 0 / 1 / 2 / 3         a a a   | a b b     | b b b    | b _ _
    M-RoPE positions           sliced with the tokens (computed on the whole pack first, never per shard)
    targets                    shifted per sequence on the whole pack, then sliced; the tail is -100

Each decoder layer's attention swaps sequence sharding for head sharding around the same varlen kernel::

    q/k/v (T'/P, H, D) ──all-to-all──► (T', H/P, D) ──varlen kernel, global cu_seqlens──► (T', H/P, D)
                                                                      ──all-to-all──► (T'/P, H, D)

q, k and v travel in one all-to-all. With fewer KV heads than ``P`` (GQA) each KV head is replicated
``P / gcd(H_kv, P)`` times first, so every rank holds the KV heads of its query heads. Per layer and rank the two
all-to-alls move ``(T'/P)·(H + 2·H_kv')·D + (T'/P)·H·D`` elements, ``(P-1)/P`` of them over the network; activations
per rank (everything but the tower and the embedding) fall to ``1/P`` (`benchmarks/sp_memory.py`).

Gradients. The collectives are autograd functions (the backward of an all-to-all is the inverse all-to-all; of the
tower's all-gather, a reduce-scatter), and slicing sends each rank's gradient only into the tokens it holds, so the
sum over the SP group of each parameter's gradient is the gradient of the whole pack: the tower and the embedding
are never counted twice. Data-parallel training sums (DDP, FSDP: averages, times the Trainer's ``num_processes``
factor) over every rank, so an SP group acts like one data-parallel rank holding the pack. The loss scaling that
makes this equal to SP = 1 is in `sp_loss`.

Vision tower. Its one call per forward (`hf_packing.patches._vision.tower_calls`) encodes only this rank's share of
the pack's temporal units (an image, or one frame group of a video: the towers attend within each), balanced by
patches, and the merged features (and DeepStack features) are all-gathered, so the tower's cost is divided too.
On the test packs (180 patches in 2 packs) the largest rank encodes 100 patches at P = 2 and 60 at P = 4 (ideal 90
and 45: units are indivisible); a rank without a unit encodes a 4-patch dummy image (FSDP needs the call). The
all-gather moves ``n_vision_tokens · H · (1 + deepstack layers)`` elements per step, its backward an all-reduce of
the same size (gloo has no reduce-scatter).

Qwen3.5's linear-attention layers (Gated DeltaNet) swap shardings the same way, around their whole core (the
causal conv and the gated delta rule, `hf_packing.sequence_parallel_linear`). The MoE load-balancing loss is
formed from router statistics summed over the SP group (`load_balancing_loss`), so its value and gradient are the
SP = 1 ones. Not covered: attention head counts not divisible by ``P`` (refused). ``logits`` / ``hidden_states``
outputs are gathered without gradient; the loss is computed on the shards.

Process groups come from a ``(dp, sp)`` `DeviceMesh` (`init_sequence_parallel`); SP ranks are consecutive global
ranks (within a node first). accelerate 1.15's ``ParallelismConfig(sp_size=...)`` cannot carry this: its only
``sp_backend`` is ``"deepspeed"`` (DeepSpeed's own Ulysses, text-only), for which it skips building a mesh and the
Trainer hands the model to DeepSpeed's SP wrapper. So the SP size is `apply_rmpad`'s ``sequence_parallel_size``
and FSDP2 / DDP from accelerate shard or replicate over the whole world as usual.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .varlen import PackedSequences

#: kwarg that carries the `SPGroup` from the text-model hook down to attention (next to the packed boundaries).
SP_KWARG = "hf_packing_sp"

_state: dict[str, Any] = {"mesh": None, "size": 1}


@dataclass(frozen=True)
class LinearHeads:
    """Head layout of a Gated DeltaNet (linear-attention) layer, from the text config.

    Attributes:
        key_heads (`int`), key_dim (`int`): ``linear_num_key_heads`` / ``linear_key_head_dim`` (q and k).
        value_heads (`int`), value_dim (`int`): ``linear_num_value_heads`` / ``linear_value_head_dim``.
    """

    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int

    @classmethod
    def from_config(cls, config: Any) -> LinearHeads | None:
        """The layout of a hybrid text config (Qwen3.5), ``None`` for a config without linear-attention layers."""
        if getattr(config, "linear_num_value_heads", None) is None:
            return None
        return cls(
            config.linear_num_key_heads,
            config.linear_key_head_dim,
            config.linear_num_value_heads,
            config.linear_value_head_dim,
        )

    def channels(self) -> tuple[int, int, int]:
        """Widths of the q, k and v blocks of the layer's conv channels (``mixed_qkv``)."""
        key = self.key_heads * self.key_dim
        return key, key, self.value_heads * self.value_dim


@dataclass(frozen=True)
class SPGroup:
    """This rank's sequence-parallel group.

    Attributes:
        group: the `ProcessGroup` of the ``P`` ranks that share one pack.
        rank (`int`): this rank's index in it (which slice of the pack it holds).
        size (`int`): ``P``.
        linear (`LinearHeads`, *optional*): the linear-attention head layout of a hybrid model (set by the
            text-model hook; the conv route needs it to find the q / k / v channel blocks).
    """

    group: Any
    rank: int
    size: int
    linear: LinearHeads | None = None


# ----------------------------------------------------------------------------------------------- groups


def set_size(size: int) -> None:
    """Record the SP size `apply_rmpad` was given (read by `pack_dataset` and the telemetry)."""
    if size < 1:
        raise ValueError(f"sequence_parallel_size must be >= 1, got {size}")
    _state["size"] = int(size)


def current_size() -> int:
    """The SP size set by `apply_rmpad(sequence_parallel_size=...)` (1 when SP is off)."""
    return _state["size"]


def init_sequence_parallel(size: int, *, device_type: str | None = None):
    """Build (once) the ``(dp, sp)`` `DeviceMesh` over the initialised default process group and return it.

    Every rank must call it (it creates sub-groups); the patched forward calls it on its first SP step. Ranks
    ``[d·P, (d+1)·P)`` form SP group ``d``. ``mesh["dp"]`` is the data-parallel dimension (`pack_dataset`'s
    rank and world), ``mesh["sp"]`` the sequence-parallel one.

    Raises:
        ValueError: without a process group, or when the world size is not a multiple of ``size``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    mesh = _state["mesh"]
    if mesh is not None:
        if mesh["sp"].size() != size:
            raise ValueError(f"sequence parallelism is already set up with size {mesh['sp'].size()}, not {size}")
        return mesh
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"sequence_parallel_size={size} needs torch.distributed: launch with torchrun / accelerate launch "
            "(recipes/accelerate/sp.yaml), or set sequence_parallel_size=1"
        )
    world = dist.get_world_size()
    if world % size:
        raise ValueError(f"world size {world} is not a multiple of sequence_parallel_size={size}")
    if device_type is None:
        device_type = "cpu" if dist.get_backend() == "gloo" else torch.accelerator.current_accelerator().type
    mesh = init_device_mesh(device_type, (world // size, size), mesh_dim_names=("dp", "sp"))
    _state["mesh"] = mesh
    return mesh


def sp_group(size: int) -> SPGroup | None:
    """The `SPGroup` for ``size`` (building the mesh on first use), or ``None`` when ``size == 1``."""
    if size == 1:
        return None
    mesh = init_sequence_parallel(size)
    return SPGroup(mesh["sp"].get_group(), mesh["sp"].get_local_rank(), size)


def data_parallel_rank_world(size: int | None = None) -> tuple[int, int]:
    """``(dp rank, dp world)`` of this process: the global rank and world divided by the SP size.

    SP ranks of one group get the same answer, so `pack_dataset` gives them the same packs. ``(0, 1)`` without
    torch.distributed.
    """
    size = current_size() if size is None else size
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % size:
        raise ValueError(f"world size {world} is not a multiple of sequence_parallel_size={size}")
    return rank // size, world // size


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


# ----------------------------------------------------------------------------------------------- collectives


class CommTimer:
    """Time spent in the SP collectives (forward and backward), for the telemetry's all-to-all share.

    On CPU (gloo: blocking) wall time; on CUDA, pairs of events on the current stream resolved at `take`, so
    nothing syncs during the step. Off until `enable`.
    """

    def __init__(self) -> None:
        self.enabled, self.seconds, self.events = False, 0.0, []

    def enable(self, on: bool = True) -> None:
        self.enabled, self.seconds, self.events = on, 0.0, []

    def start(self, device: torch.device) -> Any:
        if not self.enabled:
            return None
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, started: Any) -> None:
        if started is None:
            return
        if isinstance(started, float):
            self.seconds += time.perf_counter() - started
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((started, end))

    def take(self) -> float:
        """Seconds since the last `take` (waits for pending CUDA events)."""
        seconds = self.seconds
        if self.events:
            self.events[-1][1].synchronize()
            seconds += sum(a.elapsed_time(b) for a, b in self.events) / 1e3
        self.seconds, self.events = 0.0, []
        return seconds


COMM_TIMER = CommTimer()


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    out = torch.empty_like(x)
    started = COMM_TIMER.start(x.device)
    dist.all_to_all_single(out, x, group=group)
    COMM_TIMER.stop(started)
    return out


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0 (chunk ``j`` goes to rank ``j``); its own inverse, hence its backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_to_all(grad.contiguous(), ctx.group), None


def seq_to_head(x: torch.Tensor, sp: SPGroup) -> torch.Tensor:
    """``(T/P, H, D)`` sequence-sharded → ``(T, H/P, D)`` head-sharded (rank ``j`` keeps head group ``j``)."""
    local, heads, dim = x.shape
    x = x.reshape(local, sp.size, heads // sp.size, dim).transpose(0, 1)  # (P, T/P, H/P, D): chunk j → rank j
    return _AllToAll.apply(x, sp.group).reshape(local * sp.size, heads // sp.size, dim)


def head_to_seq(x: torch.Tensor, sp: SPGroup) -> torch.Tensor:
    """Inverse of `seq_to_head`: ``(T, H/P, D)`` → ``(T/P, H, D)``."""
    total, heads, dim = x.shape
    x = _AllToAll.apply(x.reshape(sp.size, total // sp.size, heads, dim), sp.group)  # from rank i: head group i
    return x.transpose(0, 1).reshape(total // sp.size, sp.size * heads, dim)


def kv_replication(num_q_heads: int, num_kv_heads: int, size: int) -> int:
    """How many times each KV head is repeated so ``size`` ranks each get whole KV heads for their query heads.

    ``P / gcd(H_kv, P)``: 1 when ``H_kv`` divides evenly (4 KV heads, P = 4), 2 for 2 KV heads at P = 4.
    """
    if num_q_heads % size:
        raise ValueError(
            f"Ulysses sequence parallelism splits attention heads: {num_q_heads} query heads are not divisible by "
            f"sequence_parallel_size={size}; choose a size that divides the number of heads"
        )
    return size // math.gcd(num_kv_heads, size)


def key_replication(heads: LinearHeads, size: int) -> int:
    """How many times each linear-attention key head (q and k) is repeated so that each of ``size`` ranks holds
    whole key heads for its ``H_v / size`` value heads: ``size / gcd(H_k, size)``, as for GQA (`kv_replication`).

    The tiny test model (2 key, 4 value heads): 1 at P = 2, 2 at P = 4. The value heads must divide by ``size``
    (each rank runs whole recurrences), and the q / k channels too (the conv runs on an even channel split).

    Raises:
        ValueError: naming ``sequence_parallel_size`` and the head count it must divide.
    """
    if heads.value_heads % size:
        raise ValueError(
            f"Ulysses sequence parallelism splits the linear-attention heads: linear_num_value_heads="
            f"{heads.value_heads} is not divisible by sequence_parallel_size={size}; choose a size that divides it"
        )
    if (heads.key_heads * heads.key_dim) % size:
        raise ValueError(
            f"Ulysses sequence parallelism splits the linear-attention conv channels: linear_num_key_heads × "
            f"linear_key_head_dim = {heads.key_heads * heads.key_dim} is not divisible by sequence_parallel_size="
            f"{size}; choose a size that divides it"
        )
    return size // math.gcd(heads.key_heads, size)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sp: SPGroup,
    kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Attention over the whole pack from this rank's slice: all-to-all, ``kernel`` on ``H/P`` heads, all-to-all.

    Args:
        q (`torch.Tensor` of shape `(T/P, H_q, D)`), k, v (`(T/P, H_kv, D)`): this rank's tokens, after rotary.
        kernel: ``(q (T, H_q/P, D), k, v (T, H_kv'/P, D)) -> (T, H_q/P, D)``, the varlen attention with the
            pack's global (padded) boundaries.

    Returns:
        `torch.Tensor` of shape `(T/P, H_q, D)`.
    """
    heads_q = q.shape[1]
    repeat = kv_replication(heads_q, k.shape[1], sp.size)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    if not q.dtype == k.dtype == v.dtype:  # autocast: rotary promotes q/k; one buffer travels in one dtype
        dtype = v.dtype if torch.is_autocast_enabled(q.device.type) else torch.promote_types(q.dtype, k.dtype)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    local, heads_kv, dim = q.shape[0], k.shape[1], q.shape[2]
    group = [t.reshape(local, sp.size, -1, dim) for t in (q, k, v)]  # per destination rank: its q, k, v heads
    fused = seq_to_head(torch.cat(group, dim=2).reshape(local, -1, dim), sp)
    qh, kh, vh = fused.split([heads_q // sp.size, heads_kv // sp.size, heads_kv // sp.size], dim=1)
    return head_to_seq(kernel(qh, kh, vh), sp)


def gather_sequence(x: torch.Tensor, sp: SPGroup, total: int) -> torch.Tensor:
    """All ranks' slices of a sequence-sharded ``(T/P, ...)`` tensor as ``(total, ...)``, without autograd (outputs
    such as logits and hidden states; the loss is computed on the shards)."""
    parts = [torch.empty_like(x) for _ in range(sp.size)]
    dist.all_gather(parts, x.detach().contiguous(), group=sp.group)
    return torch.cat(parts, dim=0)[:total]


# ----------------------------------------------------------------------------------------------- vision tower


def split_vision_units(grid_thw: list[list[int]], size: int) -> list[list[int]]:
    """Assign a pack's vision units to ``size`` ranks, balanced by patches (largest first, to the least loaded).

    A unit is one temporal slice ``(1, h, w)`` of an image or video ``(t, h, w)``: the towers attend within each
    temporal slice (their ``cu_seqlens`` repeat ``h·w`` ``t`` times), so a video's slices encode alone exactly as
    together. Units are numbered in item order, slices in time order; each rank's list is sorted.

    ``[[1, 4, 4], [2, 2, 2]]`` (16 + 2 × 4 patches), ``size=2`` → ``[[0], [1, 2]]``.
    """
    patches = [h * w for t, h, w in grid_thw for _ in range(t)]
    load, ranks = [0] * size, [[] for _ in range(size)]
    for unit in sorted(range(len(patches)), key=lambda u: (-patches[u], u)):
        rank = min(range(size), key=lambda r: (load[r], r))
        ranks[rank].append(unit)
        load[rank] += patches[unit]
    return [sorted(r) for r in ranks]


class _GatherRows(torch.autograd.Function):
    """All-gather of ``(n_r, C)`` rows of different counts, in rank order; backward: the sum of every rank's
    gradient for this rank's rows (each rank used the gathered rows of its own token slice only)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, counts: list[int], group: Any, rank: int) -> torch.Tensor:
        ctx.counts, ctx.group, ctx.rank = counts, group, rank
        width = max(counts)
        padded = local.new_zeros(width, local.shape[1])
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in counts]
        started = COMM_TIMER.start(local.device)
        dist.all_gather(parts, padded.contiguous(), group=group)
        COMM_TIMER.stop(started)
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad = grad.contiguous()
        started = COMM_TIMER.start(grad.device)
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce-scatter; Σ n_r·C elements, once per step
        COMM_TIMER.stop(started)
        start = sum(ctx.counts[: ctx.rank])
        return grad[start : start + ctx.counts[ctx.rank]], None, None, None


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
    per_rank = [sum(units[u][2] * units[u][3] // merge**2 for u in r) for r in mine]
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
    gathered = _GatherRows.apply(torch.cat(parts, dim=1), per_rank, sp.group, sp.rank)
    # rows arrive rank by rank; put each unit's rows back in unit order, then split by item and by output
    offsets, at = {}, 0
    for r in mine:
        for u in r:
            offsets[u], at = at, at + units[u][2] * units[u][3] // merge**2
    order = torch.cat(
        [torch.arange(offsets[u], offsets[u] + units[u][2] * units[u][3] // merge**2) for u in range(len(units))]
    )
    whole = gathered.index_select(0, order.to(gathered.device)).split(width, dim=1)
    sizes = [t * h * w // merge**2 for t, h, w in grids]
    split = out.get("deepstack_features") and not isinstance(out.deepstack_features[0], torch.Tensor)
    result = type(out)()
    for key, value in out.items():  # key by key: some towers add keys that are not fields (router_logits)
        if key != "last_hidden_state":  # the pre-merge patches of this rank's units only: not the pack's
            result[key] = value
    result["pooler_output"] = whole[0].split(sizes)
    if len(whole) > 1:  # as the tower gives them: a tuple per item (5.23), or one tensor per layer (5.17)
        result["deepstack_features"] = [layer.split(sizes) if split else layer for layer in whole[1:]]
    return result, dummy_term


def all_gather_rows(local: torch.Tensor, counts: list[int], sp: SPGroup) -> torch.Tensor:
    """Every rank's ``(counts[r], C)`` rows in rank order, ``(Σ counts, C)``, with autograd (backward: each rank's
    rows get the sum of every rank's gradient for them)."""
    return _GatherRows.apply(local, counts, sp.group, sp.rank)


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


class _AllReduce(torch.autograd.Function):
    """Sum over the group; backward: the sum of every rank's gradient (each rank used the same sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        started = COMM_TIMER.start(x.device)
        dist.all_reduce(out, group=group)
        COMM_TIMER.stop(started)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        started = COMM_TIMER.start(grad.device)
        dist.all_reduce(grad, group=ctx.group)
        COMM_TIMER.stop(started)
        return grad, None


def load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int, sp: SPGroup, total: int
) -> torch.Tensor:
    """The MoE load-balancing loss of the whole pack from this rank's slice: transformers'
    ``load_balancing_loss_func`` with its router statistics summed over the SP group before the loss is formed.

    ``E · Σ_e f_e · p_e``, with ``f_e`` the share of top-k assignments to expert ``e`` and ``p_e`` the mean router
    probability, over the ``total`` real tokens of every layer (the padding tail is left out). Per shard, the
    loss of a product of means is not the mean of the shards' losses (the Qwen3-VL-MoE gradients moved by 0.17
    relative); summed first, the value is the SP = 1 one on every rank. The sum's backward adds every rank's
    gradient, so with loss weights that sum to the pack's weight over the group (`sp_loss`'s shares) the group's
    gradient equals SP = 1's.

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
    summed = _AllReduce.apply(torch.cat([counts, probs]), sp.group)
    rows = total * len(router_logits)  # every layer routes every real token once
    return (summed[:num_experts] / rows * (summed[num_experts:] / rows)).sum() * num_experts
