"""Qwen4-Exp's QSA sparse attention ("indexed_attention") over a packed stream, without a host sync.

transformers' ``Qwen4ExpTextQSAIndexer`` loops over rows and queries in Python (a ``nonzero`` and a ``topk`` per
query). Here every step is vectorised over the whole pack, with shapes from ``T``, ``max_seqlen`` and Python ints
only. The rule is transformers' per-query rule applied to each sample alone. With ``compress_ratio`` r = 4::

    flat stream (T=14)   a a a a a a a a a a | b b b b        cu_seqlens = [0, 10, 14]
    offset in sample     0 1 2 3 4 5 6 7 8 9   0 1 2 3        max_seqlen = 10
    complete blocks      [ 0   ] [ 1   ] - -   [ 2   ]        blocks count from each sample's first token; a
    (global block id)                                         sample's last r-1 tokens or fewer never complete one

    query a9 (offset 9): visible complete blocks {0, 1} (all their tokens <= the query), tail a8 a9
    query a6 (offset 6): visible complete blocks {0} (block 1 ends at a7 > a6), tail a4 a5 a6
    query b3 (offset 3): visible complete blocks {2}, empty tail; never a key of sample a

Each query keeps the top ``block_topk = budget // r`` of its own sample's visible complete blocks (all of them when
it has fewer) plus its tail (the tokens after its last visible complete block, up to itself). A query whose own
block just completed and was not chosen does not see itself, as in transformers.

The steps, in the order the patched indexer and attention call them:

1. `qsa_blocks`: the complete blocks of the pack, ``(NB, r)`` token indices with ``NB = T // r`` (a static bound;
   the rows past the real count are padding), and each sample's first block id.
2. `qsa_pool_keys`: each block's raw indexer key averaged in fp32 and cast back, as transformers pools. The caller
   then applies the indexer's own ``k_layernorm`` and the rotary embedding at the block's first token
   (``blocks.tokens[:, 0]``): positions restart per sample, so that equals transformers' per-sample rope.
3. `qsa_select`: scores ``relu(q · key)`` summed over indexer heads ``/ sqrt(head_dim)`` in fp32 against the
   query's own visible blocks only, and keeps the top ``block_topk`` per query. Ties (common: relu makes exact-zero
   scores) go to the lower block index (``topk`` over keys made unique by the block order: a stable descending
   sort's first k); ``torch.topk`` on the scores alone documents no tie order.
   Runs under ``no_grad``: the selection is indices, so the indexer gets no gradient from the LM loss, as in
   transformers.
4. `qsa_attention`: attention of each query over its selected keys (GQA, ``scaling`` given), differentiable in q, k
   and v. Backends with one signature, switched by ``backend``:

   - ``reference``: one SDPA over the pack with the dense ``(T, T)`` mask of `qsa_mask` (same sample, causal,
     selected); exact, O(T²) memory, for tests and short packs.
   - ``gather``: each query's selected keys gathered, ``(T, K, H_kv, D)`` with ``K = block_topk·r + r - 1``, and
     attended in fp32 with the queries as the batch; FLOPs grow with ``T·K``, not ``T²``, and the gathered
     keys are a transient workspace (chunked over queries): backward gathers again, as flash attention
     recomputes its probabilities, so a step keeps ``5·K`` bytes of index and validity per token, not
     ``K·H_kv·(D + D_v)`` values (4 MiB per token per layer at a budget of 2,048 with 2 kv heads of 256 in bf16).
     The default.

Measured (`benchmarks/bench_qsa.py`, 2-core CPU, 4 samples, budget 8 in blocks of 4): the whole packed indexer
takes 3 / 9 / 25 ms at ~125 / ~400 / ~1,000 tokens per sample against transformers' 95 / 328 / 890 ms (30-36x), and
``gather`` attention (forward + backward, gathering again in backward) 13 / 34 / 73 ms against 4 / 27 / 188 ms for
transformers' padded sdpa with its dense mask and 10 / 100 / 623 ms for ``reference``: the gather's fixed costs
lose at short samples, its ``T·K`` work wins from ~1,000 tokens.

No ``flex_attention`` backend: the selection differs from query to query, so nearly every 128 x 128 tile of a
block mask would be partial and flex would do the dense causal work (and on CPU it runs only eager or after a
~30 s compile); ``gather`` does ``K`` keys per query.

How the patched layer calls them (``raw_keys`` ``(T, D_idx)`` and ``q_idx`` ``(T, H_idx, D_idx)`` from the indexer's
projection, ``q_idx`` after ``q_layernorm`` and rope; ``cos``/``sin`` ``(T, rotary_dim)`` at positions restarting
per sample)::

    blocks = qsa_blocks(seqs, total=T, compress_ratio=r)
    first = blocks.tokens[:, 0]
    keys = indexer.k_layernorm(qsa_pool_keys(raw_keys, blocks))[:, None]
    keys = apply_rotary_pos_emb(keys, cos=cos[first], sin=sin[first]).squeeze(1)  # transformers' helper
    selection = qsa_select(q_idx, keys, seqs, blocks, compress_ratio=r, block_topk=indexer.block_topk)
    out = qsa_attention(q, k, v, selection, blocks, seqs, compress_ratio=r, scaling=attn.scaling)  # (T, H_q, D)

`qsa_token_index` gives each query's selected pack token indices ``(T, K)``, ``-1`` padded (transformers'
``selected_token_indices``, in pack coordinates); `qsa_selection_leaks` counts those outside the query's own sample
or after it (zero for any `qsa_select` output; tests plant one to see it fire); `qsa_tied_queries` flags the queries
whose k-th place is a tie, where any two tie rules may differ. Both backends AND the selection
with the pack's block-causal mask, as transformers ANDs it with the causal mask. `reference_qsa_mask` is the
oracle: a plain per-sample, per-query loop that mirrors transformers' indexer, with the same tie rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .varlen import PackedSequences, token_sequences

QSA_BACKENDS = ("gather", "reference")

#: elements of fp32 workspace one query chunk of `qsa_select` / the ``gather`` backend may hold (~256 MiB)
CHUNK_ELEMENTS = 1 << 26


class QSABlocks(NamedTuple):
    """The complete blocks of a pack (`qsa_blocks`).

    Attributes:
        tokens (`torch.LongTensor` of shape `(NB, r)`): pack token indices of each block, ``NB = T // r``. Sample
            ``s`` owns blocks ``first[s]:first[s + 1]``, in order; rows from ``first[-1]`` on are padding (tokens
            ``0..r-1``, safe to gather, never selected).
        first (`torch.LongTensor` of shape `(B + 1,)`): cumulative complete-block counts, ``first[0] = 0``.
    """

    tokens: torch.Tensor
    first: torch.Tensor


class QSASelection(NamedTuple):
    """What each query keeps (`qsa_select`).

    Attributes:
        blocks (`torch.LongTensor` of shape `(T, k)`): global block ids (rows of `QSABlocks.tokens`), best first,
            ``-1`` where the query has fewer than ``k`` visible blocks; ``k = min(block_topk, max_seqlen // r)``.
        tail_start (`torch.LongTensor` of shape `(T,)`): the pack index of the first tail token: the query's
            sample start plus r times its number of visible complete blocks; the tail is ``tail_start..t``
            (empty when ``tail_start > t``, i.e. the query ends a block).
    """

    blocks: torch.Tensor
    tail_start: torch.Tensor


def _check_seqs(seqs: PackedSequences, device: torch.device) -> None:
    """``cu_seqlens`` as the kernels take it: int32 on the data's device (a copy from the host would wait)."""
    cu = seqs.cu_seqlens
    if cu.dtype != torch.int32 or cu.device != device or cu.dim() != 1:
        raise ValueError(
            f"cu_seqlens must be a 1-D int32 tensor on {device}, got {cu.dtype} {tuple(cu.shape)} on {cu.device}; "
            "build it with PackedSequences.from_seqlens(..., device=...) or the collator's batch"
        )


def _check_ratio(compress_ratio: int, block_topk: int | None = None) -> None:
    if compress_ratio < 1:
        raise ValueError(f"indexer_compress_ratio must be >= 1, got {compress_ratio}")
    if block_topk is not None and block_topk < 1:
        raise ValueError(
            f"block_topk = indexer_budget // indexer_compress_ratio must be >= 1, got {block_topk}; raise "
            "indexer_budget to at least indexer_compress_ratio"
        )


def qsa_blocks(seqs: PackedSequences, *, total: int, compress_ratio: int) -> QSABlocks:
    """The complete blocks of ``compress_ratio`` tokens of every sample, counted from each sample's first token.

    Args:
        seqs (`PackedSequences`): the boundaries (int32 ``cu_seqlens`` of shape `(B + 1,)` ending at ``total``).
        total (`int`): T, the number of tokens in the flat stream (a Python int: a tensor's shape).
        compress_ratio (`int`): r, tokens per block (``config.indexer_compress_ratio``).

    Returns:
        `QSABlocks`: ``tokens`` `(T // r, r)` int64 and ``first`` `(B + 1,)` int64, on ``cu_seqlens``' device.
    """
    _check_ratio(compress_ratio)
    cu = seqs.cu_seqlens.to(torch.int64)
    device = cu.device
    per_sample = (cu[1:] - cu[:-1]) // compress_ratio
    first = torch.cat([cu.new_zeros(1), per_sample.cumsum(0)])
    block = torch.arange(total // compress_ratio, device=device)
    # the whole ``first`` (first[0] = 0 <= block), so every index is >= 1; samples with no block are skipped because
    # right=True passes over their repeated ``first`` value
    sample = (torch.searchsorted(first, block, right=True) - 1).clamp(max=cu.shape[0] - 2)
    start = cu[sample] + (block - first[sample]) * compress_ratio
    start = torch.where(block < first[-1], start, 0)
    tokens = start[:, None] + torch.arange(compress_ratio, device=device)
    return QSABlocks(tokens=tokens, first=first)


def qsa_pool_keys(raw_keys: torch.Tensor, blocks: QSABlocks) -> torch.Tensor:
    """Each block's mean raw indexer key, averaged in fp32 and cast back, exactly as transformers pools.

    Args:
        raw_keys (`torch.Tensor` of shape `(T, D_idx)`): the indexer's token keys before ``k_layernorm``.
        blocks (`QSABlocks`): from `qsa_blocks`.

    Returns:
        `torch.Tensor` of shape `(NB, D_idx)` in ``raw_keys``' dtype (padding rows hold the first tokens' mean).
    """
    groups = raw_keys.index_select(0, blocks.tokens.flatten()).view(*blocks.tokens.shape, raw_keys.shape[-1])
    return groups.float().mean(dim=1).to(raw_keys.dtype)


def _query_spans(total: int, per_query: int, query_chunk: int | None) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]`` query chunks of at most ``query_chunk`` queries (default: `CHUNK_ELEMENTS` of
    workspace at ``per_query`` values per query). One span under ``torch.compile``: a loop over ``range(T)`` would
    specialise the graph on ``T``."""
    if query_chunk is not None and query_chunk < 1:
        raise ValueError(f"query_chunk must be >= 1, got {query_chunk}")
    if query_chunk is None and torch.compiler.is_compiling():
        return [(0, total)]
    chunk = query_chunk or max(1, CHUNK_ELEMENTS // max(per_query, 1))
    return [(lo, min(lo + chunk, total)) for lo in range(0, total, chunk)]


def _check_select_inputs(q_index: torch.Tensor, block_keys: torch.Tensor, seqs: PackedSequences) -> None:
    if q_index.dim() != 3 or block_keys.dim() != 2 or block_keys.shape[-1] != q_index.shape[-1]:
        raise ValueError(
            f"qsa_select needs q_index (T, H_idx, D_idx) and block_keys (NB, D_idx); got {tuple(q_index.shape)} "
            f"and {tuple(block_keys.shape)}"
        )
    _check_seqs(seqs, q_index.device)


def _visible_blocks(seqs: PackedSequences, total: int, compress_ratio: int, device: torch.device):
    """Per token: its sample's start (int64), its number of visible complete blocks, and its 0-based sample."""
    sample, offset = token_sequences(seqs, total, device)
    sample = sample - 1
    cu = seqs.cu_seqlens.to(device=device, dtype=torch.int64)
    return cu[sample], (offset + 1) // compress_ratio, sample


def _block_scores(
    q_index: torch.Tensor,
    block_keys: torch.Tensor,
    seqs: PackedSequences,
    blocks: QSABlocks,
    *,
    compress_ratio: int,
    query_chunk: int | None,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(lo, hi, scores)`` per query chunk: ``scores`` `(hi - lo, max_seqlen // r)` fp32, column ``j`` the score
    of the query's sample's ``j``-th block, ``-inf`` where not visible. No autograd graph.

    One matmul per chunk against a window of blocks (no per-query gather of keys): the blocks of every sample the
    chunk touches lie in ``first[sample(lo)] + [0, W)`` with ``W = (chunk + max_seqlen) // r + 1``, so the chunk's
    work is ``(chunk + max_seqlen) / max_seqlen`` times the longest sample's blocks per query.
    """
    total, heads, head_dim = q_index.shape
    device = q_index.device
    candidates = seqs.max_seqlen // compress_ratio  # M: local block slots per query
    _, n_visible, sample = _visible_blocks(seqs, total, compress_ratio, device)
    first = blocks.first.to(device)[sample]  # (T,) the query's sample's first block id
    n_blocks = block_keys.shape[0]
    local = torch.arange(candidates, device=device)
    if query_chunk is None and not torch.compiler.is_compiling():
        # a quarter of the longest sample: the window is then ~1.25x its blocks (CPU, 4 x 1,000 tokens: 42 ms
        # against 86 ms for chunks of max_seqlen and 67 ms for chunks of 64)
        query_chunk = max(1, min(max(64, seqs.max_seqlen // 4), CHUNK_ELEMENTS // (2 * heads * (candidates + 1))))
    spans = _query_spans(total, heads * (candidates + 1), query_chunk)
    # fp32 as documented even under autocast (which would run the matmul in half precision): `qsa_select` orders
    # the fp32 scores' bit patterns
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        for lo, hi in spans:
            if len(spans) == 1:  # the whole pack (and the only form under torch.compile: no guard on T)
                start, width = first.new_zeros(()), n_blocks
            else:
                start, width = first[lo], min(n_blocks, (hi - lo + seqs.max_seqlen) // compress_ratio + 1)
            window = (start + torch.arange(width, device=device)).clamp(max=n_blocks - 1)
            keys = block_keys.index_select(0, window).float()  # (W, D_idx)
            window_scores = torch.einsum("chd,wd->chw", q_index[lo:hi].float(), keys)
            window_scores = window_scores.relu().sum(dim=1) / math.sqrt(head_dim)  # (C, W)
            visible = local[None, :] < n_visible[lo:hi, None]  # (C, M): candidate j is the sample's j-th block
            slot = torch.where(visible, first[lo:hi, None] - start + local[None, :], 0)
            yield lo, hi, window_scores.gather(1, slot).masked_fill(~visible, float("-inf"))


def qsa_select(
    q_index: torch.Tensor,
    block_keys: torch.Tensor,
    seqs: PackedSequences,
    blocks: QSABlocks,
    *,
    compress_ratio: int,
    block_topk: int,
    query_chunk: int | None = None,
) -> QSASelection:
    """Each query's top ``block_topk`` visible complete blocks of its own sample, and its tail.

    A block is visible to a query when it is complete and all its tokens are <= the query. Score of block ``j``
    for query ``t``: ``sum_h relu(q_index[t, h] · block_keys[j]) / sqrt(D_idx)`` in fp32, as transformers scores.
    Ties go to the lower block index.

    Args:
        q_index (`torch.Tensor` of shape `(T, H_idx, D_idx)`): the indexer's queries after ``q_layernorm`` and rope.
        block_keys (`torch.Tensor` of shape `(NB, D_idx)`): per block, `qsa_pool_keys` then ``k_layernorm`` and the
            rope at ``blocks.tokens[:, 0]``.
        seqs (`PackedSequences`): the boundaries (``cu_seqlens[-1] == T``: the stream holds real tokens only);
            ``max_seqlen`` (a Python int) bounds the candidates per query.
        blocks (`QSABlocks`): from `qsa_blocks` with the same ``compress_ratio``.
        compress_ratio (`int`): r. block_topk (`int`): ``indexer_budget // indexer_compress_ratio``, >= 1.
        query_chunk (`int`, *optional*): queries scored at once (default: ``max_seqlen // 4``, at least 64, within
            a ~256 MiB fp32 workspace; all of them under ``torch.compile``). The workspace is
            ``query_chunk · H_idx · W`` fp32 values with ``W = (query_chunk + max_seqlen) // r + 1`` blocks
            (``T // r`` for one chunk).

    Returns:
        `QSASelection`: ``blocks`` `(T, min(block_topk, max_seqlen // r))` int64 and ``tail_start`` `(T,)` int64.
    """
    _check_ratio(compress_ratio, block_topk)
    _check_select_inputs(q_index, block_keys, seqs)
    total, device = q_index.shape[0], q_index.device
    candidates = seqs.max_seqlen // compress_ratio
    k = min(block_topk, candidates)
    sample_start, n_visible, sample = _visible_blocks(seqs, total, compress_ratio, device)
    tail_start = sample_start + n_visible * compress_ratio
    if k == 0 or total == 0:
        return QSASelection(q_index.new_full((total, k), -1, dtype=torch.int64), tail_start)
    first = blocks.first.to(device)[sample]
    reverse = candidates - 1 - torch.arange(candidates, device=device)
    rank = torch.arange(k, device=device)
    picked = []
    for lo, hi, scores in _block_scores(
        q_index, block_keys, seqs, blocks, compress_ratio=compress_ratio, query_chunk=query_chunk
    ):
        # ties go to the lower block: topk over unique int64 keys (the score's fp32 bits, then the block order
        # reversed) is a stable descending sort's first k at topk's cost. Visible scores are >= 0, whose bit
        # patterns order as int32 as the floats do (``+ 0.0`` turns a -0.0 into 0.0); -inf's are negative.
        bits = (scores + 0.0).view(torch.int32).to(torch.int64)
        order = (bits * (1 << 32) + reverse).topk(k, dim=-1).indices
        picked.append(torch.where(rank[None, :] < n_visible[lo:hi, None], first[lo:hi, None] + order, -1))
    return QSASelection(torch.cat(picked, dim=0), tail_start)


def qsa_tied_queries(
    q_index: torch.Tensor,
    block_keys: torch.Tensor,
    seqs: PackedSequences,
    blocks: QSABlocks,
    *,
    compress_ratio: int,
    block_topk: int,
    rtol: float = 1e-4,
    query_chunk: int | None = None,
) -> torch.Tensor:
    """Which queries have a tie at the k-th place: more than ``k`` visible blocks and the k-th and (k+1)-th best
    scores within ``rtol`` (relative to ``max(1, k-th)``). There the choice is the tie rule's: ours takes the lower
    block, transformers' ``topk`` has no documented order (on CPU it differs from ours on about half of them), and
    rounding may flip a near tie. A model-level comparison with transformers is exact only on inputs with none.
    Arguments as `qsa_select`.

    Returns:
        `torch.BoolTensor` of shape `(T,)`.
    """
    _check_ratio(compress_ratio, block_topk)
    _check_select_inputs(q_index, block_keys, seqs)
    k = min(block_topk, seqs.max_seqlen // compress_ratio)
    if k == 0 or k >= seqs.max_seqlen // compress_ratio:
        return torch.zeros(q_index.shape[0], dtype=torch.bool, device=q_index.device)
    tied = []
    for _, _, scores in _block_scores(
        q_index, block_keys, seqs, blocks, compress_ratio=compress_ratio, query_chunk=query_chunk
    ):
        top = scores.topk(k + 1, dim=-1).values
        kth, next_ = top[:, k - 1], top[:, k]
        tied.append((next_ > float("-inf")) & (kth - next_ <= rtol * kth.clamp(min=1.0)))
    return torch.cat(tied, dim=0)


def qsa_token_index(selection: QSASelection, blocks: QSABlocks, *, compress_ratio: int) -> torch.Tensor:
    """Each query's selected pack token indices: its blocks' tokens (best block first), then its tail.

    Args:
        selection (`QSASelection`): from `qsa_select`. blocks (`QSABlocks`): from `qsa_blocks`.
        compress_ratio (`int`): r.

    Returns:
        `torch.LongTensor` of shape `(T, k·r + r - 1)`, ``-1`` padded: transformers' ``selected_token_indices`` in
        pack coordinates (``k·r + r - 1 = budget + r - 1`` when every sample is long enough).
    """
    total, k = selection.blocks.shape
    device = selection.blocks.device
    picked = blocks.tokens.to(device).index_select(0, selection.blocks.clamp(min=0).flatten()).view(total, k, -1)
    picked = torch.where(selection.blocks[:, :, None] >= 0, picked, -1).flatten(1)
    tail = selection.tail_start[:, None] + torch.arange(compress_ratio - 1, device=device)
    query = torch.arange(total, device=device)
    tail = torch.where(tail <= query[:, None], tail, -1)
    return torch.cat([picked, tail], dim=1)


def _block_of_token(seqs: PackedSequences, total: int, compress_ratio: int, device: torch.device) -> torch.Tensor:
    """`(T,)` int64: the global id of the complete block holding each token, ``-1`` for a sample's incomplete end."""
    sample, offset = token_sequences(seqs, total, device)
    sample = sample - 1
    cu = seqs.cu_seqlens.to(device=device, dtype=torch.int64)
    lengths = cu[1:] - cu[:-1]
    first = torch.cat([cu.new_zeros(1), (lengths // compress_ratio).cumsum(0)])
    local = offset // compress_ratio
    complete = (local + 1) * compress_ratio <= lengths[sample]
    return torch.where(complete, first[sample] + local, -1)


def qsa_mask(selection: QSASelection, seqs: PackedSequences, *, compress_ratio: int) -> torch.Tensor:
    """Dense ``(T, T)`` bool mask, True where query ``t`` may attend key ``s``: same sample, ``s <= t``, and ``s``
    in one of ``t``'s selected blocks or in its tail. O(T²): for the ``reference`` backend and tests.

    Args:
        selection (`QSASelection`): from `qsa_select`. seqs (`PackedSequences`): the boundaries.
        compress_ratio (`int`): r.
    """
    total = selection.tail_start.shape[0]
    device = selection.tail_start.device
    n_blocks = total // compress_ratio
    chosen = torch.zeros(total, n_blocks + 1, dtype=torch.bool, device=device)
    # -1 (no block) lands in the extra last column, which is dropped
    chosen.scatter_(1, torch.where(selection.blocks >= 0, selection.blocks, n_blocks), True)
    chosen[:, n_blocks] = False
    key_block = _block_of_token(seqs, total, compress_ratio, device)
    in_block = chosen[:, torch.where(key_block >= 0, key_block, n_blocks)]
    pos = torch.arange(total, device=device)
    sample, _ = token_sequences(seqs, total, device)
    causal = (sample[:, None] == sample[None, :]) & (pos[None, :] <= pos[:, None])
    tail = pos[None, :] >= selection.tail_start[:, None]
    return causal & (in_block | tail)


def qsa_selection_leaks(selection: QSASelection, blocks: QSABlocks, seqs: PackedSequences, *, compress_ratio: int):
    """Per query, how many of its selected tokens (`qsa_token_index`) lie outside its own sample's tokens up to
    itself: all zero for any `qsa_select` output. The check tests and patched-model tests apply to a selection.

    Returns:
        `torch.LongTensor` of shape `(T,)`.
    """
    index = qsa_token_index(selection, blocks, compress_ratio=compress_ratio)
    total = index.shape[0]
    sample, _ = token_sequences(seqs, total, index.device)
    safe = index.clamp(min=0)
    query = torch.arange(total, device=index.device)[:, None]
    outside = (index >= 0) & ((safe > query) | (sample[safe] != sample[:, None]))
    return outside.sum(dim=1)


def _check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: QSASelection) -> None:
    """The contract every backend keeps, as a kernel would enforce it."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(
            "qsa_attention needs q (T, H_q, D), k (T, H_kv, D), v (T, H_kv, D_v); got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"qsa_attention: H_q % H_kv must be 0 and k/v heads equal; got {q.shape}, {k.shape}, {v.shape}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(
            f"qsa_attention needs q, k, v in one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them "
            "(under autocast, to the autocast dtype) before the call"
        )
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("qsa_attention needs q, k, v with a contiguous last dim (as attention kernels do)")
    for name, t in (("selection.blocks", selection.blocks), ("selection.tail_start", selection.tail_start)):
        if t.dtype != torch.int64 or t.device != q.device:
            raise ValueError(f"{name} must be int64 on {q.device}, got {t.dtype} on {t.device}; use qsa_select's")
    if selection.tail_start.shape[0] != q.shape[0]:
        raise ValueError(f"selection is for {selection.tail_start.shape[0]} queries, q has {q.shape[0]}")


def reference_qsa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: QSASelection,
    blocks: QSABlocks,
    seqs: PackedSequences,
    *,
    compress_ratio: int,
    scaling: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """`qsa_attention`'s ``reference`` backend: one SDPA with the dense `qsa_mask` (transformers' sdpa path on
    one sample, for the whole pack)."""
    mask = qsa_mask(selection, seqs, compress_ratio=compress_ratio)
    qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, H, T, D)
    out = F.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.squeeze(0).transpose(0, 1)


def _heads_first(t: torch.Tensor, h_kv: int) -> torch.Tensor:
    """`(C, H, D)` → `(H_kv · C, H / H_kv, D)`: the batch of the chunk's small matmuls, kv head first."""
    chunk, heads, dim = t.shape
    return t.reshape(chunk, h_kv, heads // h_kv, dim).transpose(0, 1).reshape(h_kv * chunk, heads // h_kv, dim)


def _tokens_first(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """The inverse of `_heads_first`: `(H_kv · C, G, D)` → `(C, H_kv · G, D)`."""
    h_kv = t.shape[0] // chunk
    return t.reshape(h_kv, chunk, t.shape[1], t.shape[2]).transpose(0, 1).reshape(chunk, -1, t.shape[2])


def _gather_chunk(q, k_heads, v_heads, index, valid, scaling: float):
    """One query chunk of the ``gather`` backend, as 3-D batches (kv head, query) of contiguous fp32 matrices:
    ``qs`` `(H_kv · C, G, D)`, the gathered ``ks`` `(H_kv · C, K, D)` and ``vs`` `(H_kv · C, K, D_v)`, and the
    scores `(H_kv · C, G, K)`, ``-inf`` where not valid. ``k_heads`` / ``v_heads``: k and v as `(H_kv, T, D)`,
    contiguous, so that one ``index_select`` gathers each batch's keys contiguously."""
    chunk, n_keys = index.shape
    h_kv = k_heads.shape[0]
    ids = index.flatten()
    ks = k_heads.index_select(1, ids).view(h_kv * chunk, n_keys, -1).float()
    vs = v_heads.index_select(1, ids).view(h_kv * chunk, n_keys, -1).float()
    qs = _heads_first(q, h_kv).float()
    scores = torch.bmm(qs, ks.transpose(1, 2)) * scaling
    hidden = ~valid[None, :, None, :].expand(h_kv, chunk, 1, n_keys).reshape(h_kv * chunk, 1, n_keys)
    return qs, ks, vs, scores.masked_fill(hidden, float("-inf"))


def _gather_workspace(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_keys: int) -> int:
    """fp32 values one query of a gather chunk holds at once: its gathered keys and values, its scores and
    probabilities."""
    return n_keys * (k.shape[1] * (q.shape[-1] + v.shape[-1]) + 2 * q.shape[1])


class _GatheredAttention(torch.autograd.Function):
    """The ``gather`` backend without dropout: softmax attention of each query over its ``K`` gathered keys, in
    fp32, keeping for backward only q, k, v, the index and validity ``(T, K)``, the output and the log-sum-exp;
    the backward gathers again, as flash attention recomputes its probabilities instead of keeping them.

    Keeping the gathered keys and values instead (autograd through SDPA) costs ``K · H_kv · (D + D_v)`` values per
    token: at a budget of 2,048 tokens, 2 kv heads of 256, about 4 MiB per token per QSA layer in bf16, 32 GiB
    for an 8k pack. This keeps ``5·K`` bytes of index and validity per token.
    """

    @staticmethod
    def forward(ctx, q, k, v, index, valid, scaling: float, query_chunk: int | None):
        total, h_q = q.shape[0], q.shape[1]
        k_heads, v_heads = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
        outs, lses = [], []
        for lo, hi in _query_spans(total, _gather_workspace(q, k, v, index.shape[1]), query_chunk):
            _, _, vs, scores = _gather_chunk(q[lo:hi], k_heads, v_heads, index[lo:hi], valid[lo:hi], scaling)
            lse = torch.logsumexp(scores, dim=-1, keepdim=True)
            lse = torch.where(torch.isinf(lse), 0.0, lse)  # a query with no valid key (never for a selection): out 0
            outs.append(_tokens_first(torch.bmm((scores - lse).exp(), vs), hi - lo).to(q.dtype))
            lses.append(_tokens_first(lse, hi - lo))  # (C, H_q, 1)
        out = torch.cat(outs, dim=0) if outs else q.new_zeros(0, h_q, v.shape[-1])
        lse = torch.cat(lses, dim=0) if lses else q.new_zeros(0, h_q, 1, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, index, valid, out, lse)
        ctx.scaling, ctx.query_chunk = scaling, query_chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, index, valid, out, lse = ctx.saved_tensors
        total, h_kv = q.shape[0], k.shape[1]
        k_heads, v_heads = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
        grad_q = []
        grad_k = torch.zeros(k_heads.shape, dtype=torch.float32, device=k.device)  # (H_kv, T, D)
        grad_v = torch.zeros(v_heads.shape, dtype=torch.float32, device=v.device)
        for lo, hi in _query_spans(total, _gather_workspace(q, k, v, index.shape[1]), ctx.query_chunk):
            chunk = hi - lo
            qs, ks, vs, scores = _gather_chunk(q[lo:hi], k_heads, v_heads, index[lo:hi], valid[lo:hi], ctx.scaling)
            probs = (scores - _heads_first(lse[lo:hi], h_kv)).exp()  # (H_kv · C, G, K), 0 where not valid
            d_out = _heads_first(grad_out[lo:hi], h_kv).float()
            o = _heads_first(out[lo:hi], h_kv).float()
            d_scores = probs * (torch.bmm(d_out, vs.transpose(1, 2)) - (d_out * o).sum(-1, keepdim=True))
            d_scores = d_scores * ctx.scaling
            grad_q.append(_tokens_first(torch.bmm(d_scores, ks), chunk))
            ids = index[lo:hi].flatten()
            d_keys = torch.bmm(d_scores.transpose(1, 2), qs).view(h_kv, -1, k.shape[-1])  # (H_kv, C · K, D)
            d_values = torch.bmm(probs.transpose(1, 2), d_out).view(h_kv, -1, v.shape[-1])
            grad_k.index_add_(1, ids, d_keys)
            grad_v.index_add_(1, ids, d_values)
        d_q = torch.cat(grad_q, dim=0) if grad_q else torch.zeros_like(q, dtype=torch.float32)
        return d_q.to(q.dtype), grad_k.transpose(0, 1).to(k.dtype), grad_v.transpose(0, 1).to(v.dtype), *[None] * 4


def gather_qsa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: QSASelection,
    blocks: QSABlocks,
    seqs: PackedSequences,
    *,
    compress_ratio: int,
    scaling: float,
    dropout: float = 0.0,
    query_chunk: int | None = None,
) -> torch.Tensor:
    """`qsa_attention`'s ``gather`` backend: each query's ``K`` selected keys and values gathered and attended in
    fp32 (`_GatheredAttention`: the backward gathers again rather than keep the gathered tensors, ``5·K`` bytes of
    int32 index and bool validity per token kept instead of ``K · H_kv · (D + D_v)`` values).

    ``query_chunk`` bounds the gathered workspace (``chunk · K · H_kv · (D + D_v)`` fp32 values, forward and
    backward). With ``dropout`` > 0 one SDPA per chunk runs under autograd instead, which keeps the gathered chunks
    (a dropout mask recomputed in backward would need its RNG state replayed).
    """
    index = qsa_token_index(selection, blocks, compress_ratio=compress_ratio)  # (T, K)
    total, n_keys = index.shape
    h_q, h_kv, dim = q.shape[1], k.shape[1], q.shape[2]
    safe = index.clamp(min=0)
    # the selection ANDed with the pack's block-causal mask, as transformers ANDs it with the causal mask (and as
    # the reference's `qsa_mask` does): a selection that names another sample's key cannot reach it
    sample, _ = token_sequences(seqs, total, q.device)
    query = torch.arange(total, device=q.device)[:, None]
    valid = (index >= 0) & (safe <= query) & (sample[safe] == sample[:, None])
    if dropout == 0.0:
        return _GatheredAttention.apply(q, k, v, safe.to(torch.int32), valid, scaling, query_chunk)
    outs = []
    for lo, hi in _query_spans(total, _gather_workspace(q, k, v, n_keys), query_chunk):
        ids = safe[lo:hi].flatten()
        ks = k.index_select(0, ids).view(hi - lo, n_keys, h_kv, dim).transpose(1, 2)
        vs = v.index_select(0, ids).view(hi - lo, n_keys, h_kv, v.shape[-1]).transpose(1, 2)
        qs = q[lo:hi].reshape(hi - lo, h_kv, h_q // h_kv, dim)
        mask = valid[lo:hi, None, None, :]
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, dropout_p=dropout, scale=scaling)
        outs.append(out.reshape(hi - lo, h_q, v.shape[-1]))
    if not outs:
        return q.new_zeros(0, h_q, v.shape[-1])
    return torch.cat(outs, dim=0)


def qsa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: QSASelection,
    blocks: QSABlocks,
    seqs: PackedSequences,
    *,
    compress_ratio: int,
    scaling: float,
    backend: str = "gather",
    dropout: float = 0.0,
) -> torch.Tensor:
    """Attention of each query over its selected keys only (its blocks and tail, its own sample, causal).

    Args:
        q (`torch.Tensor` of shape `(T, H_q, D)`), k (`(T, H_kv, D)`), v (`(T, H_kv, D_v)`): one floating dtype
            (cast them first under autocast), ``H_q % H_kv == 0`` (GQA), each with a contiguous last dim.
        selection (`QSASelection`), blocks (`QSABlocks`), seqs (`PackedSequences`): from `qsa_select` /
            `qsa_blocks` on the same pack.
        compress_ratio (`int`): r. scaling (`float`): the softmax scale (the attention module's ``scaling``).
        backend (`str`): one of `QSA_BACKENDS`; the same result up to rounding.
        dropout (`float`): attention-probability dropout (training only).

    Returns:
        `torch.Tensor` of shape `(T, H_q, D_v)` in q's dtype; differentiable in q, k and v.
    """
    if backend not in QSA_BACKENDS:
        raise ValueError(f"unknown QSA attention backend {backend!r}; choose one of {QSA_BACKENDS}")
    _check_ratio(compress_ratio)
    _check_seqs(seqs, q.device)
    _check_attention_inputs(q, k, v, selection)
    fn = gather_qsa_attention if backend == "gather" else reference_qsa_attention
    return fn(q, k, v, selection, blocks, seqs, compress_ratio=compress_ratio, scaling=scaling, dropout=dropout)


# ------------------------------------------------------------------------------------------------------ oracle


def reference_qsa_mask(
    q_index: torch.Tensor,
    raw_keys: torch.Tensor,
    seqs: PackedSequences,
    *,
    compress_ratio: int,
    block_topk: int,
    block_key_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The oracle: transformers' indexer rule as a plain loop over samples and queries (host syncs, slow).

    For each sample alone and each query ``t`` in it: the visible tokens are the sample's tokens up to ``t``; they
    form ``n = len // r`` complete blocks; each block's key is ``block_key_fn(mean of its raw keys in fp32 cast
    back, its first token's pack index)``; scores as in `qsa_select`; the top ``min(block_topk, n)`` blocks (ties:
    lower block first) plus the leftover tail are selected.

    Args:
        q_index (`torch.Tensor` of shape `(T, H_idx, D_idx)`), raw_keys (`torch.Tensor` of shape `(T, D_idx)`).
        block_key_fn: ``(pooled (n, D_idx), first_token (n,) int64) -> keys (n, D_idx)``: ``k_layernorm`` and rope.

    Returns:
        `torch.BoolTensor` of shape `(T, T)`: True where query row may attend key column.
    """
    total, _, head_dim = q_index.shape
    mask = torch.zeros(total, total, dtype=torch.bool)
    bounds = seqs.cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        for t in range(start, end):
            visible = torch.arange(start, t + 1)
            n = visible.numel() // compress_ratio
            selected = visible[n * compress_ratio :]
            if n > 0:
                groups = visible[: n * compress_ratio].view(n, compress_ratio)
                pooled = raw_keys.index_select(0, groups.flatten()).view(n, compress_ratio, -1)
                pooled = pooled.float().mean(dim=1).to(raw_keys.dtype)
                keys = block_key_fn(pooled, groups[:, 0])
                scores = (q_index[t].float() @ keys.float().T).relu().sum(dim=0) / math.sqrt(head_dim)
                best = sorted(range(n), key=lambda j: (-scores[j].item(), j))[: min(block_topk, n)]
                selected = torch.cat([groups[best].flatten(), selected])
            mask[t, selected] = True
    return mask.to(q_index.device)
