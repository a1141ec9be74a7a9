"""Per-sequence shifted labels and a chunked linear + cross-entropy that never builds the full logits.

Labels shift inside each sequence of the flat stream; the last token of every sequence gets no target::

    tokens     a0 a1 a2 | b0 b1 b2 b3      cu_seqlens = [0, 3, 7]
    labels     -  a1 a2 | -  -  b2 b3      (-: -100, e.g. prompt tokens)
    targets    a1 a2 -  | -  b2 b3 -       (target[t] = label[t+1] within the sequence)

Logits are computed only for positions that have a target, in chunks of ``chunk_size`` rows, each chunk
recomputed in backward (activation checkpointing). At 16k tokens and a 151k vocabulary that is the
difference between ~10 GB of fp32 logits and ~1 GB for one chunk.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from . import _compat

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


def _chunk_ce_sum(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum")


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    *,
    chunk_size: int | None = None,
    use_liger: bool | None = None,
) -> tuple[torch.Tensor, int]:
    """Σ cross-entropy of ``head(hidden)`` against ``targets`` over supervised positions.

    Args:
        hidden (`torch.Tensor` of shape `(T, hidden)`): final hidden states of the flat stream.
        head (`torch.nn.Module`): the lm_head (a plain or PEFT-wrapped linear); called chunk by chunk.
        targets (`torch.LongTensor` of shape `(T,)`): shifted targets, -100 to skip.
        chunk_size (`int`, *optional*): rows per chunk; default keeps one chunk's logits near 1 GiB.
        use_liger (`bool`, *optional*): use Liger-Kernel's fused kernel (default: when installed, on CUDA, and
            ``head`` is a plain `nn.Linear`).

    Returns:
        (`torch.Tensor` scalar fp32 sum, `int` number of supervised positions).
    """
    keep = torch.nonzero(targets != IGNORE_INDEX, as_tuple=False).flatten()
    n = keep.numel()
    if n == 0:  # keep the graph connected so every rank runs the same backward
        return hidden.sum() * 0.0, 0
    hidden, targets = hidden.index_select(0, keep), targets.index_select(0, keep)
    liger = _compat.liger_fused_linear_cross_entropy()
    if use_liger is None:
        use_liger = liger is not None and hidden.is_cuda and type(head) is torch.nn.Linear
    if use_liger:
        if liger is None:
            raise RuntimeError("use_liger=True but liger-kernel is not installed (pip install liger-kernel)")
        return liger(hidden, head.weight, targets, bias=head.bias, ignore_index=IGNORE_INDEX, reduction="sum"), n
    vocab = getattr(head, "out_features", None) or head.weight.shape[0]
    rows = chunk_size or max(256, CHUNK_ELEMENTS // vocab)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, n, rows):
        h, t = hidden[start : start + rows], targets[start : start + rows]
        if torch.is_grad_enabled() and h.requires_grad:
            total = total + checkpoint(_chunk_ce_sum, head, h, t, use_reentrant=False)
        else:
            total = total + _chunk_ce_sum(head, h, t)
    return total, n


def reduce_loss(loss_sum: torch.Tensor, num_supervised: int, num_items_in_batch: int | torch.Tensor | None) -> torch.Tensor:
    """``sum / num_items_in_batch`` when the Trainer gives the count (token-level averaging across micro-batches
    and ranks), else the mean over this batch's supervised tokens."""
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss_sum.device)
        return loss_sum / num_items_in_batch
    return loss_sum / max(num_supervised, 1)
