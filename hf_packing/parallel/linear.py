"""Ulysses sequence parallelism for Qwen3.5's Gated DeltaNet layers: the whole core runs on head shards.

A linear-attention layer carries a conv window and a recurrent state along the sequence, so a sequence shard
cannot run it alone. Its heads are independent, though (the conv is depthwise per channel, each head's delta rule
has its own state), so, as verl and ms-swift do, the layer swaps sequence sharding for head sharding around its
core and back, with the pack's global (padded) ``cu_seqlens``::

    mixed_qkv (1, C, T/P) ──all-to-all──► (1, C/P, T) rank r's q / k / v channel blocks
        ──causal conv, global boundaries──► (1, C/P, T)  (returned to transformers in the (1, C, T/P) shape)
    q, k (T, H_k/P, D_k), v (T, H_v/P, D_v), g, beta (all-to-all: (T/P, H_v) → (T, H_v/P))
        ──gated delta rule, global boundaries──► (T, H_v/P, D_v) ──all-to-all──► (1, T/P, H_v, D_v)

The patch only replaces the two functions transformers' ``Qwen3_5GatedDeltaNet.forward`` calls (`_linear`), so the
projections, the gate and the output norm stay transformers' code on the sequence shard. Between the two calls
transformers transposes, splits the channels into q / k / v and reshapes them into heads (5.17 also repeats the q /
k heads up to the value heads, undone and redone per rank); no op there mixes tokens or channels. So the conv hands
back its head-sharded ``(T, c)`` blocks reshaped to the ``(T/P, P·c)`` slots transformers expects (the same element
count: row ``t`` of a slot holds rows ``t·P … t·P+P-1``), and the delta rule reshapes them back, exactly. Per layer
and rank: three all-to-alls, ``(T/P)·(C + 2·H_v + H_v·D_v)`` elements, ``(P-1)/P`` of them over the network.

Head counts: the value heads must divide by ``P``; key heads (q and k) that do not (2 key heads at P = 4) are
replicated ``P / gcd(H_k, P)`` times after the conv, like GQA's KV heads (`key_replication`): the conv runs on an
even split of the q / k channels, and the q / k channels are all-gathered (``T·2·H_k·D_k`` more elements per rank)
so that each rank takes the whole key heads its value heads read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .comm import LinearHeads, SPGroup, all_gather_rows, head_to_seq, key_replication, seq_to_head

#: ``(x (1, C', T), weight (C', W), bias (C',) | None) -> (1, C', T)``: the varlen conv with global boundaries.
ConvKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
#: ``(q, k (1, T, h_k, D_k), v (1, T, h_v, D_v), g, beta (1, T, h_v)) -> (1, T, h_v, D_v)``, global boundaries.
DeltaRuleKernel = Callable[..., torch.Tensor]


def _layout(sp: SPGroup) -> LinearHeads:
    """The group's linear-attention head layout (set by the text-model hook on hybrid models)."""
    if sp.linear is None:
        raise ValueError("the sequence-parallel group has no linear-attention head layout (not a hybrid model)")
    return sp.linear


def _rank_channels(sp: SPGroup, device: torch.device) -> torch.Tensor:
    """Indices of this rank's conv channels: its ``1/P`` of the q, of the k and of the v block, in that order."""
    rows, offset = [], 0
    for width in _layout(sp).channels():
        share = width // sp.size
        rows.append(torch.arange(offset + sp.rank * share, offset + (sp.rank + 1) * share, device=device))
        offset += width
    return torch.cat(rows)


def ulysses_causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sp: SPGroup, conv: ConvKernel
) -> torch.Tensor:
    """The depthwise causal conv over the whole pack from this rank's slice, run on this rank's channels.

    Args:
        x (`torch.Tensor` of shape `(1, C, T/P)`): ``mixed_qkv`` of this rank's tokens, channels ``[q | k | v]``.
        weight (`(C, W)`), bias (`(C,)`, *optional*): the layer's conv parameters (rank ``r`` uses its rows).
        sp: the group, with its ``linear`` head layout.

    Returns:
        `torch.Tensor` of shape `(1, C, T/P)`: the conv of this rank's ``C/P`` channels over all ``T`` tokens, each
        of its q / k / v blocks ``(T, c)`` reshaped into the ``(T/P, P·c)`` slot of that block (module docstring).
    """
    key_replication(_layout(sp), sp.size)  # the split must be even (raises a named error otherwise)
    widths = _layout(sp).channels()
    local = x.shape[-1]
    blocks = x[0].transpose(0, 1).split(widths, dim=1)  # (T/P, w) each
    # per destination rank j: its 1/P of each block, as "heads" of one channel for seq_to_head
    send = torch.cat([b.reshape(local, sp.size, w // sp.size) for b, w in zip(blocks, widths)], dim=2)
    mine = seq_to_head(send.reshape(local, -1, 1), sp).reshape(local * sp.size, -1)  # (T, C/P)
    rows = _rank_channels(sp, weight.device)
    out = conv(
        mine.transpose(0, 1).unsqueeze(0), weight.index_select(0, rows), None if bias is None else bias[rows]
    )  # (1, C/P, T)
    parts = out[0].transpose(0, 1).split([w // sp.size for w in widths], dim=1)
    return torch.cat([p.reshape(local, w) for p, w in zip(parts, widths)], dim=1).transpose(0, 1).unsqueeze(0)


def _key_heads(q: torch.Tensor, k: torch.Tensor, sp: SPGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's whole key heads ``(T, H_k'/P, D_k)`` from its q / k channel shards ``(T, H_k·D_k/P)``.

    With ``H_k`` divisible by ``P`` the shard is those heads. Otherwise the shards are all-gathered and each key
    head repeated ``P / gcd(H_k, P)`` times (`key_replication`), of which rank ``r`` takes its ``1/P``.
    """
    layout = _layout(sp)
    heads, dim = layout.key_heads, layout.key_dim
    total = q.shape[0]
    repeat = key_replication(layout, sp.size)
    if repeat == 1:
        return q.reshape(total, heads // sp.size, dim), k.reshape(total, heads // sp.size, dim)
    width = q.shape[1]
    rows = all_gather_rows(torch.cat([q, k], dim=1).transpose(0, 1), [2 * width] * sp.size, sp)  # (P·2w, T)
    full = rows.reshape(sp.size, 2, width, total).transpose(0, 1).reshape(2, heads, dim, total)
    per_rank = heads * repeat // sp.size
    take = torch.arange(sp.rank * per_rank, (sp.rank + 1) * per_rank, device=q.device) // repeat
    qh, kh = (t.index_select(0, take).permute(2, 0, 1) for t in full)  # (T, H_k'/P, D_k)
    return qh, kh


def ulysses_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    sp: SPGroup,
    rule: DeltaRuleKernel,
) -> torch.Tensor:
    """The gated delta rule over the whole pack on this rank's heads, from what `ulysses_causal_conv1d` returned.

    Args:
        q, k (`torch.Tensor` of shape `(1, T/P, H_k, D_k)`), v (`(1, T/P, H_v, D_v)`): transformers' reshape of
            the conv output, i.e. this rank's head-sharded blocks in their ``(T/P, P·c)`` slots. transformers 5.17
            repeats each q / k head ``H_v / H_k`` times first (``(1, T/P, H_v, D_k)``): the copies are dropped,
            and this rank's key heads repeated the same way for the kernel.
        g, beta (`(1, T/P, H_v)`): this rank's tokens, all heads (g in fp32, beta in the hidden dtype).

    Returns:
        `torch.Tensor` of shape `(1, T/P, H_v, D_v)`: this rank's tokens, all value heads.
    """
    local, value_heads, value_dim = v.shape[1:]
    total = local * sp.size
    seen, key_heads = q.shape[2], _layout(sp).key_heads
    if seen != key_heads:  # transformers 5.17 repeats q / k heads up to the value heads before the rule
        q, k = (t.unflatten(2, (key_heads, seen // key_heads))[:, :, :, 0] for t in (q, k))
    qh, kh = _key_heads(q.reshape(total, -1), k.reshape(total, -1), sp)
    vh = v.reshape(total, value_heads // sp.size, value_dim)
    if seen != key_heads:  # ... so do the same with this rank's heads (its kernels may expect it)
        qh, kh = (t.repeat_interleave(vh.shape[1] // t.shape[1], dim=1) for t in (qh, kh))
    gates = seq_to_head(torch.stack([g[0], beta[0].to(g.dtype)], dim=-1), sp)  # (T, H_v/P, 2), one all-to-all
    gh, bh = gates[..., 0], gates[..., 1].to(beta.dtype)
    out = rule(qh.unsqueeze(0), kh.unsqueeze(0), vh.unsqueeze(0), gh.unsqueeze(0), bh.unsqueeze(0))
    return head_to_seq(out[0], sp).unsqueeze(0)
