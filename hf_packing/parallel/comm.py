"""Ulysses communication for sequence parallelism (SP): the group, the all-to-alls and the other collectives.

Every collective is an autograd function (the backward of an all-to-all is the inverse all-to-all; of an all-gather
of rows, the sum of every rank's gradient for this rank's rows), timed by the group's `CommTimer` (off until the
telemetry enables it). The design, the pictures and the communication costs are in
`hf_packing.patches.sequence_parallel`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

#: kwarg that carries the `SPGroup` from the text-model hook down to attention (next to the packed boundaries).
SP_KWARG = "hf_packing_sp"


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


class CommTimer:
    """Time spent in the SP collectives (forward and backward), for the telemetry's all-to-all share.

    On CPU (gloo: blocking) wall time; on CUDA, pairs of events on the current stream resolved at `take`, so
    nothing syncs during the step. Off until `enable`.
    """

    def __init__(self) -> None:
        self.enabled, self.seconds = False, 0.0
        self.events: list[Any] = []

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

    @contextmanager
    def timing(self, device: torch.device) -> Iterator[None]:
        """Count the time of the block (a collective on ``device``) when enabled."""
        started = self.start(device)
        yield
        self.stop(started)


@dataclass(frozen=True)
class SPGroup:
    """This rank's sequence-parallel group.

    Attributes:
        group: the `ProcessGroup` of the ``P`` ranks that share one pack.
        rank (`int`): this rank's index in it (which slice of the pack it holds).
        size (`int`): ``P``.
        linear (`LinearHeads`, *optional*): the linear-attention head layout of a hybrid model (set by the
            text-model hook; the conv route needs it to find the q / k / v channel blocks).
        timer (`CommTimer`): where this group's collectives add their time (the `SequenceParallelState`'s, so the
            telemetry reads it; a fresh, disabled one by default).
    """

    group: Any
    rank: int
    size: int
    linear: LinearHeads | None = None
    timer: CommTimer = field(default_factory=CommTimer, compare=False, repr=False)


def _all_to_all(x: torch.Tensor, sp: SPGroup) -> torch.Tensor:
    out = torch.empty_like(x)
    with sp.timer.timing(x.device):
        dist.all_to_all_single(out, x, group=sp.group)
    return out


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0 (chunk ``j`` goes to rank ``j``); its own inverse, hence its backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SPGroup) -> torch.Tensor:
        ctx.sp = sp
        return _all_to_all(x.contiguous(), sp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_to_all(grad.contiguous(), ctx.sp), None


def seq_to_head(x: torch.Tensor, sp: SPGroup) -> torch.Tensor:
    """``(T/P, H, D)`` sequence-sharded → ``(T, H/P, D)`` head-sharded (rank ``j`` keeps head group ``j``)."""
    local, heads, dim = x.shape
    x = x.reshape(local, sp.size, heads // sp.size, dim).transpose(0, 1)  # (P, T/P, H/P, D): chunk j → rank j
    return _AllToAll.apply(x, sp).reshape(local * sp.size, heads // sp.size, dim)


def head_to_seq(x: torch.Tensor, sp: SPGroup) -> torch.Tensor:
    """Inverse of `seq_to_head`: ``(T, H/P, D)`` → ``(T/P, H, D)``."""
    total, heads, dim = x.shape
    x = _AllToAll.apply(x.reshape(sp.size, total // sp.size, heads, dim), sp)  # from rank i: head group i
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


class _GatherRows(torch.autograd.Function):
    """All-gather of ``(n_r, C)`` rows of different counts, in rank order; backward: the sum of every rank's
    gradient for this rank's rows (each rank used the gathered rows of its own token slice only)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, counts: list[int], sp: SPGroup) -> torch.Tensor:
        ctx.counts, ctx.sp = counts, sp
        width = max(counts)
        padded = local.new_zeros(width, local.shape[1])
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in counts]
        with sp.timer.timing(local.device):
            dist.all_gather(parts, padded.contiguous(), group=sp.group)
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad, sp = grad.contiguous(), ctx.sp
        with sp.timer.timing(grad.device):
            dist.all_reduce(grad, group=sp.group)  # gloo has no reduce-scatter; Σ n_r·C elements, once per step
        start = sum(ctx.counts[: sp.rank])
        return grad[start : start + ctx.counts[sp.rank]], None, None


def all_gather_rows(local: torch.Tensor, counts: list[int], sp: SPGroup) -> torch.Tensor:
    """Every rank's ``(counts[r], C)`` rows in rank order, ``(Σ counts, C)``, with autograd (backward: each rank's
    rows get the sum of every rank's gradient for them)."""
    return _GatherRows.apply(local, counts, sp)


class _AllReduce(torch.autograd.Function):
    """Sum over the group; backward: the sum of every rank's gradient (each rank used the same sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SPGroup) -> torch.Tensor:
        ctx.sp = sp
        out = x.clone()
        with sp.timer.timing(x.device):
            dist.all_reduce(out, group=sp.group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        with ctx.sp.timer.timing(grad.device):
            dist.all_reduce(grad, group=ctx.sp.group)
        return grad, None


def all_reduce_sum(x: torch.Tensor, sp: SPGroup) -> torch.Tensor:
    """``x`` summed over the SP group, with autograd (backward: the sum of every rank's gradient)."""
    return _AllReduce.apply(x, sp)
