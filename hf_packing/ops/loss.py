"""Per-sequence shifted labels and a chunked linear + cross-entropy that never builds the full logits.

Labels shift inside each sequence of the flat stream; the last token of every sequence gets no target::

    tokens     a0 a1 a2 | b0 b1 b2 b3      cu_seqlens = [0, 3, 7]
    labels     -  a1 a2 | -  -  b2 b3      (-: -100, e.g. prompt tokens)
    targets    a1 a2 -  | -  b2 b3 -       (target[t] = label[t+1] within the sequence)

Logits are computed only for positions that have a target, in chunks of ``chunk_size`` rows, each chunk
recomputed in backward (activation checkpointing). At 16k tokens and a 151k vocabulary that is the
difference between ~10 GB of fp32 logits and ~1 GB for one chunk.

Argmax hits (token accuracy) are counted only when asked (``count_correct=True``: the patched forward asks when
evaluation or the per-source telemetry reads them, `hf_packing.patches.recording`). A training step without them
computes no argmax: one pass over each chunk's ``rows × vocab`` logits less.

Per source (``sources``, `hf_packing.packing.source_ids`): each chunk also adds its tokens' CE, count and argmax hits
to a ``(3, num_sources)`` buffer with ``index_add_`` (fixed shapes: no host sync, no logits beyond the chunk's own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .. import _compat

IGNORE_INDEX = -100
#: Rows per chunk are chosen so one chunk's fp32 logits hold about this many elements (1 GiB).
CHUNK_ELEMENTS = 2**28


def shift_labels_per_sequence(labels: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Next-token targets for a flat stream, never crossing a sequence boundary.

    Args:
        labels (`torch.LongTensor` of shape `(T,)`): -100 where a token is not supervised.
        cu_seqlens (`torch.IntTensor` of shape `(n_seqs + 1,)`): sequence boundaries.

    Returns:
        `torch.LongTensor` of shape `(T,)`.
    """
    targets = labels.roll(-1)
    ends = cu_seqlens[1:].to(device=labels.device, dtype=torch.long) - 1
    return targets.index_fill(0, ends, IGNORE_INDEX)


def token_sources(source_ids: torch.Tensor, cu_seqlens: torch.Tensor, num_sources: int, total: int) -> torch.Tensor:
    """Each position's source id, from one id per sequence, without a host sync.

    Args:
        source_ids (`torch.LongTensor` of shape `(n_seqs,)`): each sequence's source (`VisionCollator`'s
            ``source_ids``), in ``[0, num_sources)``; checked on the device.
        cu_seqlens (`torch.IntTensor` of shape `(n_seqs + 1,)`): sequence boundaries; ends at T.
        num_sources (`int`): the number of sources.
        total (`int`): T, the number of positions (a host number: a shape, never read from ``cu_seqlens``).

    Returns:
        `torch.LongTensor` of shape `(T,)`, on ``cu_seqlens``'s device.
    """
    if source_ids.numel() != cu_seqlens.numel() - 1:
        raise ValueError(
            f"source_ids gives {source_ids.numel()} sources for {cu_seqlens.numel() - 1} sequences; pass one per "
            "sequence (VisionCollator's source_ids), or none"
        )
    ids = source_ids.to(device=cu_seqlens.device, dtype=torch.long)
    torch._assert_async(((ids >= 0) & (ids < num_sources)).all(), "source_ids must lie in [0, num_sources)")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(ids, lengths, output_size=total)


def _chunk_ce_sum(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    correct: dict[int, torch.Tensor],
    chunk: int,
    sources: torch.Tensor | None = None,
    per_source: dict[int, torch.Tensor] | None = None,
    num_sources: int = 0,
    count_correct: bool = True,
) -> torch.Tensor:
    logits = head(hidden).float()
    targets = targets.to(logits.device)  # device_map: the head may live on another device than the last layer
    first = chunk not in correct  # checkpointing recomputes this chunk in backward; count it once
    if sources is None or per_source is None:
        if first and count_correct:
            with torch.no_grad():
                correct[chunk] = (logits.argmax(-1) == targets).sum()
        return F.cross_entropy(logits, targets, reduction="sum")
    tokens = F.cross_entropy(logits, targets, reduction="none")
    if first:
        with torch.no_grad():
            hit = logits.argmax(-1) == targets
            correct[chunk] = hit.sum()
            rows = torch.stack([tokens.detach(), torch.ones_like(tokens), hit.float()])  # (3, rows)
            per_source[chunk] = rows.new_zeros(3, num_sources).index_add_(1, sources.to(logits.device), rows)
    return tokens.sum()


@dataclass
class CrossEntropySum:
    """What `linear_cross_entropy_sum` returns.

    Attributes:
        loss_sum (`torch.Tensor`): fp32 scalar Σ CE over supervised positions, connected to every head parameter.
        num_supervised (`int`): supervised positions (targets != -100).
        num_correct (`torch.Tensor`, *optional*): int64 scalar, positions whose argmax is the target (``None``
            when nothing asked for it, see `linear_cross_entropy_sum`'s ``count_correct``, and under Liger, whose
            fused kernel never exposes the logits).
        per_source (`torch.Tensor`, *optional*): fp32 ``(3, num_sources)``, no gradient: per source Σ CE, supervised
            positions, correct argmax (only when asked for: ``sources`` given, not under Liger).
    """

    loss_sum: torch.Tensor
    num_supervised: int
    num_correct: torch.Tensor | None
    per_source: torch.Tensor | None = None


def liger_can_read_weight(head: torch.nn.Module) -> bool:
    """Whether Liger's fused kernel may read ``head.weight`` directly, outside the head's own forward.

    Not for PEFT-wrapped heads (the adapter would be skipped), a DeepSpeed ZeRO-3 partition (``ds_id``,
    zero-size outside the module's forward) or an FSDP2 shard (a DTensor): the kernel would read a shard.
    """
    weight = getattr(head, "weight", None)
    return (
        type(head) is torch.nn.Linear
        and weight is not None
        and weight.numel() > 0
        and not hasattr(weight, "ds_id")
        and type(weight) in (torch.Tensor, torch.nn.Parameter)
    )


def _vocab_size(head: torch.nn.Module) -> int:
    return getattr(head, "out_features", None) or head.get_parameter("weight").shape[0]


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    *,
    chunk_size: int | None = None,
    use_liger: bool | None = None,
    num_supervised: int | None = None,
    sources: torch.Tensor | None = None,
    num_sources: int = 0,
    count_correct: bool = False,
) -> CrossEntropySum:
    """Σ cross-entropy of ``head(hidden)`` against ``targets`` over supervised positions.

    Args:
        hidden (`torch.Tensor` of shape `(T, hidden)`): final hidden states of the flat stream.
        head (`torch.nn.Module`): the lm_head (a plain or PEFT-wrapped linear); called chunk by chunk.
        targets (`torch.LongTensor` of shape `(T,)`): shifted targets, -100 to skip; any device.
        chunk_size (`int`, *optional*): rows per chunk; default keeps one chunk's logits near 1 GiB.
        use_liger (`bool`, *optional*): use Liger-Kernel's fused kernel (default: when installed, on CUDA, and
            `liger_can_read_weight`).
        num_supervised (`int`, *optional*): the number of supervised targets when the caller knows it on the host
            (`VisionCollator` counts it in the DataLoader worker). Then the supervised rows are selected with a
            fixed-size ``nonzero_static`` and checked on the device (``torch._assert_async``), so the step never
            waits for the device here; without it ``nonzero`` reads the count from the device (one host sync).
        sources (`torch.LongTensor` of shape `(T,)`, *optional*): each position's source in ``[0, num_sources)``
            (`token_sources`); then `CrossEntropySum.per_source` is filled, chunk by chunk, with ``index_add_``
            into a fixed ``(3, num_sources)`` buffer: no host sync, no extra logits. Ignored under Liger.
        num_sources (`int`): the per-source buffer's width.
        count_correct (`bool`): count the positions whose argmax is the target (`CrossEntropySum.num_correct`);
            the patched forward asks when something reads them (`hf_packing.patches.recording.counting_correct`).
            Per-source sums always count their hits.

    With no supervised position the sum is ``0 * head(hidden[:1]).sum()``: zero, but every head and backbone
    parameter stays in the graph, so DDP (``find_unused_parameters=False``) and ZeRO see the same backward
    on every rank.

    Returns:
        `CrossEntropySum`.
    """
    targets = targets.to(hidden.device)
    supervised = targets != IGNORE_INDEX
    if num_supervised is None:
        keep = torch.nonzero(supervised, as_tuple=False).flatten()
    else:
        # fill -1 would index the last row: the assert below catches a wrong count before any result is used
        torch._assert_async(
            supervised.sum() == num_supervised, "num_supervised_tokens does not match the labels' supervised count"
        )
        keep = torch.nonzero_static(supervised, size=num_supervised).flatten()
    n = keep.numel()
    sources = sources if sources is not None and num_sources > 0 else None
    count_correct = count_correct or sources is not None
    if n == 0:
        zero = head(hidden[:1]).float().sum() * 0.0
        per = None if sources is None else torch.zeros(3, num_sources, device=zero.device)
        hits = torch.zeros((), dtype=torch.long, device=zero.device) if count_correct else None
        return CrossEntropySum(zero, 0, hits, per)
    hidden, targets = hidden.index_select(0, keep), targets.index_select(0, keep)
    if sources is not None:
        sources = sources.to(keep.device).index_select(0, keep)
    liger = _compat.liger_fused_linear_cross_entropy()
    if use_liger is None:
        use_liger = liger is not None and hidden.is_cuda and liger_can_read_weight(head)
    if use_liger:
        if liger is None:
            raise RuntimeError("use_liger=True but liger-kernel is not installed (pip install liger-kernel)")
        if not liger_can_read_weight(head):
            raise ValueError(
                "use_liger=True needs a plain, unsharded lm_head weight, but it is PEFT-wrapped or partitioned "
                "(DeepSpeed ZeRO-3 / FSDP2); use apply_rmpad(use_liger=None) to use the chunked loss there"
            )
        total = liger(hidden, head.weight, targets, bias=head.bias, ignore_index=IGNORE_INDEX, reduction="sum")
        return CrossEntropySum(total, n, None)
    rows = chunk_size or max(256, CHUNK_ELEMENTS // _vocab_size(head))
    total = hidden.new_zeros((), dtype=torch.float32)
    correct: dict[int, torch.Tensor] = {}
    per_source: dict[int, torch.Tensor] = {}
    for start in range(0, n, rows):
        h, t = hidden[start : start + rows], targets[start : start + rows]
        s = None if sources is None else sources[start : start + rows]
        args = (head, h, t, correct, start, s, per_source, num_sources, count_correct)
        if torch.is_grad_enabled() and h.requires_grad:
            total = total + checkpoint(_chunk_ce_sum, *args, use_reentrant=False)
        else:
            total = total + _chunk_ce_sum(*args)
    per = torch.stack(list(per_source.values())).sum(0) if per_source else None
    hits = torch.stack(list(correct.values())).sum() if count_correct else None
    return CrossEntropySum(total, n, hits, per)


def cross_entropy_sum(
    logits: torch.Tensor,
    targets: torch.Tensor,
    sources: torch.Tensor | None = None,
    num_sources: int = 0,
    count_correct: bool = False,
) -> CrossEntropySum:
    """`linear_cross_entropy_sum` for logits that are already there: ``(T, V)`` logits, ``(T,)`` targets."""
    return linear_cross_entropy_sum(
        logits,
        torch.nn.Identity(),
        targets,
        chunk_size=logits.shape[0] or 1,
        use_liger=False,
        sources=sources,
        num_sources=num_sources,
        count_correct=count_correct,
    )


def reduce_loss(
    loss_sum: torch.Tensor, num_supervised: int, num_items_in_batch: int | torch.Tensor | None
) -> torch.Tensor:
    """``sum / num_items_in_batch`` when the Trainer gives the count (token-level averaging across micro-batches
    and ranks), else the mean over this batch's supervised tokens. A count of 0 gives 0, never NaN."""
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            return loss_sum / num_items_in_batch.to(loss_sum.device).clamp(min=1)
        return loss_sum / max(num_items_in_batch, 1)
    return loss_sum / max(num_supervised, 1)
