"""Qwen4-Exp's QSA over a packed stream (`hf_packing.ops.sparse_attention`): the vectorised selection equals the
per-query oracle (exactly, ties included) and transformers' own ``Qwen4ExpTextQSAIndexer`` on each sample alone
(ties aside, see `test_selection_equals_transformers`); the attention backends equal each other and a per-sample
SDPA, values and gradients; no host sync; no key of another sample."""

from __future__ import annotations

import math

import pytest
import torch

from hf_packing.ops.sparse_attention import (
    QSASelection,
    gather_qsa_attention,
    qsa_attention,
    qsa_blocks,
    qsa_mask,
    qsa_pool_keys,
    qsa_select,
    qsa_selection_leaks,
    qsa_tied_queries,
    qsa_token_index,
    reference_qsa_mask,
)
from hf_packing.ops.varlen import PackedSequences, create_block_causal_mask
from hf_packing.testing.syncs import SyncCounter


def _packs(ratio: int, budget: int) -> list[list[int]]:
    """Packs with a sample shorter than one block, exactly one block, longer than the budget, and one alone."""
    return [
        [ratio - 1 or 1, ratio, 3 * budget + ratio + 1, budget + 1],
        [2 * budget + 2 * ratio - 1],
        [1, ratio + 1, budget, 1, 4 * budget],
    ]


#: (compress_ratio, budget): block_topk = budget // ratio of 1, 2 and 3 blocks
SETTINGS = [(4, 8), (2, 6), (3, 3), (8, 16), (1, 3)]


def _first_token_key(pooled: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """A stand-in for k_layernorm + rope that depends on the block's first token, as the real one does."""
    return pooled * (1 + first % 3)[:, None].to(pooled.dtype)


def _fast_mask(q, raw, seqs, ratio, topk, key_fn=_first_token_key, **kwargs) -> tuple[torch.Tensor, QSASelection]:
    blocks = qsa_blocks(seqs, total=q.shape[0], compress_ratio=ratio)
    keys = key_fn(qsa_pool_keys(raw, blocks), blocks.tokens[:, 0])
    selection = qsa_select(q, keys, seqs, blocks, compress_ratio=ratio, block_topk=topk, **kwargs)
    return qsa_mask(selection, seqs, compress_ratio=ratio), selection


def test_blocks_literal():
    """Blocks count from each sample's first token; an incomplete end is no block; padding rows past the count."""
    blocks = qsa_blocks(PackedSequences.from_seqlens([10, 4, 3, 17]), total=34, compress_ratio=4)
    starts = [0, 4, 10, 17, 21, 25, 29]
    assert blocks.tokens[:7].tolist() == [[s, s + 1, s + 2, s + 3] for s in starts]
    assert blocks.tokens.shape == (8, 4) and blocks.tokens.dtype == torch.int64
    assert blocks.first.tolist() == [0, 2, 3, 3, 7]


def test_selection_literal():
    """Hand-worked pack [6 | 5], r=2, top-1: scores chosen so block 1 beats block 0 and ties go to the lower block."""
    seqs = PackedSequences.from_seqlens([6, 5])
    q = torch.ones(11, 1, 1)
    # pooled keys per block (r=2): sample a: blocks (0,1) (2,3) (4,5) -> 1, 3, 3; sample b: (6,7) (8,9) -> 0, 0
    raw = torch.tensor([1.0, 1, 3, 3, 3, 3, 0, 0, 0, 0, 5])[:, None]
    mask, selection = _fast_mask(q, raw, seqs, 2, 1, key_fn=lambda pooled, first: pooled)
    assert selection.blocks[:, 0].tolist() == [-1, 0, 0, 1, 1, 1, -1, 3, 3, 3, 3]
    assert selection.tail_start.tolist() == [0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10]
    rows = [torch.nonzero(row).flatten().tolist() for row in mask]
    assert rows == [[0], [0, 1], [0, 1, 2], [2, 3], [2, 3, 4], [2, 3], [6], [6, 7], [6, 7, 8], [6, 7], [6, 7, 10]]


@pytest.mark.parametrize(("ratio", "budget"), SETTINGS)
@pytest.mark.parametrize("heads", [1, 3])
def test_selection_equals_oracle(ratio: int, budget: int, heads: int):
    """Exact equality with the per-query loop, ties included: integer-valued queries and keys (the pooled means are
    multiples of 1/r of integers) make the scores exact in fp32 and full of ties (relu zeros and equal sums)."""
    generator = torch.Generator().manual_seed(ratio * 10 + heads)
    ties = 0
    for seqlens in _packs(ratio, budget):
        seqs = PackedSequences.from_seqlens(seqlens)
        total = sum(seqlens)
        q = torch.randint(-2, 3, (total, heads, 8), generator=generator).float()
        raw = torch.randint(-2, 3, (total, 8), generator=generator).float() * ratio
        mask, selection = _fast_mask(q, raw, seqs, ratio, budget // ratio)
        oracle = reference_qsa_mask(
            q, raw, seqs, compress_ratio=ratio, block_topk=budget // ratio, block_key_fn=_first_token_key
        )
        assert torch.equal(mask, oracle), f"pack {seqlens}: {(mask != oracle).any(dim=1).sum()} rows differ"
        assert not (mask & ~create_block_causal_mask(seqlens)).any()
        blocks = qsa_blocks(seqs, total=total, compress_ratio=ratio)
        assert int(qsa_selection_leaks(selection, blocks, seqs, compress_ratio=ratio).sum()) == 0
        band_rows = _tie_band(q, raw, seqs, ratio, budget // ratio, _first_token_key, tol=0.0).any(dim=1)
        keys = _first_token_key(qsa_pool_keys(raw, blocks), blocks.tokens[:, 0])
        tied = qsa_tied_queries(q, keys, seqs, blocks, compress_ratio=ratio, block_topk=budget // ratio, rtol=0.0)
        assert torch.equal(tied, band_rows)
        ties += int(tied.sum())
    if heads == 1 and ratio < budget:
        assert ties > 0, "no tie straddled the k-th place: the tie rule went untested"


def _tie_band(q, raw, seqs, ratio, topk, key_fn, tol: float) -> torch.Tensor:
    """(T, T) bool: for a query whose k-th and (k+1)-th best visible block scores are within ``tol`` (relative),
    the tokens of every block scored within ``tol`` of the k-th; empty rows elsewhere. A plain loop over queries,
    scores in float64 of the fp32 inputs."""
    blocks = qsa_blocks(seqs, total=q.shape[0], compress_ratio=ratio)
    keys = key_fn(qsa_pool_keys(raw, blocks), blocks.tokens[:, 0]).detach().double()
    band = torch.zeros(q.shape[0], q.shape[0], dtype=torch.bool)
    bounds = seqs.cu_seqlens.tolist()
    first = 0  # the sample's first global block id
    for start, end in zip(bounds[:-1], bounds[1:]):
        for t in range(start, end):
            n = (t - start + 1) // ratio
            scores = (q[t].double() @ keys[first : first + n].T).relu().sum(0) / math.sqrt(q.shape[-1])
            top = scores.sort(descending=True).values
            if n > topk and top[topk - 1] - top[topk] <= tol * max(1.0, float(top[topk - 1])):
                near = (scores - top[topk - 1]).abs() <= tol * max(1.0, float(top[topk - 1]))
                for j in torch.nonzero(near).flatten().tolist():
                    band[t, start + j * ratio : start + (j + 1) * ratio] = True
        first += (end - start) // ratio
    return band


def test_planted_cross_sample_key_is_caught():
    """Negative control: a selection naming a block of the previous sample is counted by `qsa_selection_leaks` and
    breaks the equality with the oracle; both attention backends still never attend to it."""
    seqs = PackedSequences.from_seqlens([12, 12])
    generator = torch.Generator().manual_seed(0)
    q, raw = torch.randn(24, 2, 8, generator=generator), torch.randn(24, 8, generator=generator)
    blocks = qsa_blocks(seqs, total=24, compress_ratio=4)
    mask, selection = _fast_mask(q, raw, seqs, 4, 1)
    planted = selection.blocks.clone()
    planted[20, 0] = 0  # query 20 (sample b, offset 8) gets block 0: tokens 0..3 of sample a
    bad = QSASelection(planted, selection.tail_start)
    leaks = qsa_selection_leaks(bad, blocks, seqs, compress_ratio=4)
    assert leaks.tolist() == [0] * 20 + [4, 0, 0, 0]
    oracle = reference_qsa_mask(q, raw, seqs, compress_ratio=4, block_topk=1, block_key_fn=_first_token_key)
    assert torch.equal(mask, oracle) and not torch.equal(qsa_mask(bad, seqs, compress_ratio=4), oracle)
    qkv = [torch.randn(24, 2, 8, generator=generator) for _ in range(3)]
    outs = [
        qsa_attention(*qkv, s, blocks, seqs, compress_ratio=4, scaling=0.3, backend=b)
        for s in (selection, bad)
        for b in ("reference", "gather")
    ]
    # the planted block replaced the query's own block: its row changes, but only to fewer keys of its own sample
    assert torch.allclose(outs[0], outs[1], atol=1e-6) and torch.allclose(outs[2], outs[3], atol=1e-6)
    assert not torch.allclose(outs[0][20], outs[2][20])
    torch.testing.assert_close(outs[3][20], qkv[2][20])  # only its tail (itself) is left: the planted key is not read


@pytest.mark.parametrize("query_chunk", [1, 3, 5, 17])
def test_query_chunks_do_not_change_the_selection(query_chunk: int):
    """Chunks score against a window of blocks starting at the chunk's first sample: every chunk size, with chunks
    that start mid-sample and span several short samples, selects what the whole pack does."""
    seqlens = [1, 2, 3, 37, 5, 1, 22, 4]
    seqs = PackedSequences.from_seqlens(seqlens)
    generator = torch.Generator().manual_seed(1)
    total = sum(seqlens)
    q, raw = torch.randn(total, 2, 8, generator=generator), torch.randn(total, 8, generator=generator)
    whole = _fast_mask(q, raw, seqs, 4, 2, query_chunk=total)[1]
    chunked = _fast_mask(q, raw, seqs, 4, 2, query_chunk=query_chunk)[1]
    assert torch.equal(whole.blocks, chunked.blocks) and torch.equal(whole.tail_start, chunked.tail_start)


def test_token_index_matches_the_mask():
    """`qsa_token_index` (the gather backend's keys) names exactly the tokens of `qsa_mask`, ``budget + r - 1``
    columns when the pack has a sample of at least ``budget`` tokens."""
    seqs = PackedSequences.from_seqlens([3, 30, 9])
    generator = torch.Generator().manual_seed(2)
    q, raw = torch.randn(42, 2, 8, generator=generator), torch.randn(42, 8, generator=generator)
    mask, selection = _fast_mask(q, raw, seqs, 4, 2)
    index = qsa_token_index(selection, qsa_blocks(seqs, total=42, compress_ratio=4), compress_ratio=4)
    assert index.shape == (42, 8 + 4 - 1)
    from_index = torch.zeros(42, 43, dtype=torch.bool).scatter_(1, torch.where(index >= 0, index, 42), True)
    assert torch.equal(from_index[:, :42], mask)


# ------------------------------------------------------------------------------------------ transformers' indexer


modeling = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")


def _indexer(ratio: int, budget: int, heads: int) -> torch.nn.Module:
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    config = Qwen4ExpTextConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8, shared_expert_intermediate_size=8,
        hc_count=2, hc_lowrank=4, layer_types=["indexed_attention"], indexer_n_heads=heads, indexer_kv_heads=1,
        indexer_head_dim=16, indexer_budget=budget, indexer_compress_ratio=ratio,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )  # fmt: skip
    torch.manual_seed(ratio * 100 + budget + heads)
    indexer = modeling.Qwen4ExpTextQSAIndexer(config, layer_idx=0).eval()
    with torch.no_grad():  # non-trivial norms, so a wrong k_layernorm / q_layernorm would show
        indexer.q_layernorm.weight.uniform_(0.5, 1.5)
        indexer.k_layernorm.weight.uniform_(0.5, 1.5)
    return indexer


def _rope(length: int, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (length, dim) for positions 0..length-1 (partial rope: 8 of the 16 index dims)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.arange(length).float()[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _transformers_selection(indexer, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' selection mask for one sample alone, (S, S) bool, under an sdpa bool causal mask."""
    length = hidden.shape[0]
    cos, sin = _rope(length)
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        return indexer(hidden[None], (cos[None], sin[None]), causal, None)[0, 0]


def _packed_selection(indexer, hidden: torch.Tensor, seqs: PackedSequences):
    """Our selection on the pack: the module's own projections and norms, rope at positions restarting per sample."""
    heads, dim = indexer.index_n_heads, indexer.index_head_dim
    total = hidden.shape[0]
    offsets = torch.cat([torch.arange(n) for n in (seqs.cu_seqlens[1:] - seqs.cu_seqlens[:-1]).tolist()])
    cos_table, sin_table = _rope(seqs.max_seqlen)
    cos, sin = cos_table[offsets], sin_table[offsets]
    with torch.no_grad():
        q, raw = indexer.index_qk_proj(hidden).split([heads * dim, dim], dim=-1)
        q = modeling.apply_rotary_pos_emb(indexer.q_layernorm(q.view(total, heads, dim)), cos=cos, sin=sin)

        def key_fn(pooled: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
            normed = indexer.k_layernorm(pooled)[:, None]
            return modeling.apply_rotary_pos_emb(normed, cos=cos[first], sin=sin[first]).squeeze(1)

        mask, _ = _fast_mask(q, raw, seqs, indexer.compress_ratio, indexer.block_topk, key_fn=key_fn)
        band = _tie_band(q, raw, seqs, indexer.compress_ratio, indexer.block_topk, key_fn, tol=1e-4)
        blocks = qsa_blocks(seqs, total=total, compress_ratio=indexer.compress_ratio)
        keys = key_fn(qsa_pool_keys(raw, blocks), blocks.tokens[:, 0])
        tied = qsa_tied_queries(
            q, keys, seqs, blocks, compress_ratio=indexer.compress_ratio, block_topk=indexer.block_topk, rtol=1e-4
        )
    return mask, band, tied


@pytest.mark.parametrize(("ratio", "budget"), [(4, 8), (2, 6), (3, 3), (8, 16)])
@pytest.mark.parametrize("heads", [1, 4])
def test_selection_equals_transformers(ratio: int, budget: int, heads: int):
    """Each sample of a pack gets the keys transformers' indexer selects on that sample alone.

    Ties: transformers' ``topk`` has no documented tie order, ours takes the lower block. Where a query's k-th and
    (k+1)-th best block scores are within 1e-4 (relative; with 1 indexer head, relu zeros make many exact ties), the
    blocks scored within that band of the k-th may differ (`_tie_band`): the rows must agree on every other token
    (the blocks above and below the band, the tail) and hold as many keys. Every other query must match exactly."""
    indexer = _indexer(ratio, budget, heads)
    for seqlens in _packs(ratio, budget):
        seqs = PackedSequences.from_seqlens(seqlens)
        hidden = torch.randn(sum(seqlens), 32, generator=torch.Generator().manual_seed(sum(seqlens)))
        mask, band, tied = _packed_selection(indexer, hidden, seqs)
        expected = torch.zeros_like(mask)
        for start, end in zip(seqs.cu_seqlens.tolist()[:-1], seqs.cu_seqlens.tolist()[1:]):
            expected[start:end, start:end] = _transformers_selection(indexer, hidden[start:end])
        differ = (mask != expected) & ~band
        assert not differ.any(), f"pack {seqlens}: {int(differ.any(1).sum())} rows differ outside a tie"
        assert torch.equal(mask.sum(1), expected.sum(1))
        assert not ((mask != expected).any(1) & ~tied).any()  # what differs, `qsa_tied_queries` flags
        assert not (mask & ~create_block_causal_mask(seqlens)).any()
        assert int(band.any(1).sum()) <= 0.2 * mask.shape[0]  # most rows are compared whole


# ------------------------------------------------------------------------------------------------- attention


def _attention_case(seqlens: list[int], ratio: int = 4, topk: int = 2, dtype=torch.float32):
    seqs = PackedSequences.from_seqlens(seqlens)
    total = sum(seqlens)
    generator = torch.Generator().manual_seed(3)
    q_idx, raw = torch.randn(total, 2, 8, generator=generator), torch.randn(total, 8, generator=generator)
    _, selection = _fast_mask(q_idx, raw, seqs, ratio, topk)
    blocks = qsa_blocks(seqs, total=total, compress_ratio=ratio)
    q = torch.randn(total, 4, 16, generator=generator, dtype=dtype)  # GQA: 4 query heads over 2 kv heads
    k, v = (torch.randn(total, 2, 16, generator=generator, dtype=dtype) for _ in range(2))
    return seqs, selection, blocks, [t.requires_grad_(True) for t in (q, k, v)]


def _value_and_grads(out: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    weights = torch.linspace(-1, 1, out.numel()).view_as(out)  # a loss that weighs every output differently
    return [out.detach(), *torch.autograd.grad((out * weights).sum(), inputs)]


PACKS = ([3, 4, 29, 9], [40], [1, 2, 3, 4, 5, 6, 7, 8])


@pytest.mark.parametrize("seqlens", PACKS)
def test_attention_reference_equals_per_sample_sdpa(seqlens: list[int]):
    """The reference backend on the pack equals SDPA on each sample alone with the oracle's mask (transformers'
    sdpa path: the causal mask ANDed with the selection), values and gradients."""
    seqs, selection, blocks, qkv = _attention_case(seqlens)
    out = qsa_attention(*qkv, selection, blocks, seqs, compress_ratio=4, scaling=0.25, backend="reference")
    mask = qsa_mask(selection, seqs, compress_ratio=4)
    pieces = []
    for start, end in zip(seqs.cu_seqlens.tolist()[:-1], seqs.cu_seqlens.tolist()[1:]):
        q, k, v = (t[start:end].transpose(0, 1)[None] for t in qkv)
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        sample_mask = mask[start:end, start:end]
        pieces.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=sample_mask, scale=0.25))
    alone = torch.cat([p[0].transpose(0, 1) for p in pieces])
    for got, want in zip(_value_and_grads(out, qkv), _value_and_grads(alone, qkv)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seqlens", PACKS)
@pytest.mark.parametrize("query_chunk", [None, 7])
def test_attention_gather_equals_reference(seqlens: list[int], query_chunk: int | None):
    seqs, selection, blocks, qkv = _attention_case(seqlens)
    kwargs = dict(compress_ratio=4, scaling=0.25)
    reference = qsa_attention(*qkv, selection, blocks, seqs, backend="reference", **kwargs)
    if query_chunk is None:
        gathered = qsa_attention(*qkv, selection, blocks, seqs, backend="gather", **kwargs)
    else:
        gathered = gather_qsa_attention(*qkv, selection, blocks, seqs, query_chunk=query_chunk, **kwargs)
    for got, want in zip(_value_and_grads(gathered, qkv), _value_and_grads(reference, qkv)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for backward while ``fn()`` builds its graph."""
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(kept.values())


def test_attention_gather_keeps_no_gathered_keys():
    """The gather backend's backward gathers again: at a budget of 64 tokens (K = 67 keys per query) it keeps q, k,
    v, its output, log-sum-exp, int32 index and bool validity, far below the ``T · K · H_kv · (D + D_v)`` values of
    the gathered keys and values. Negative control: SDPA under autograd (the dropout path) keeps them."""
    seqs, selection, blocks, qkv = _attention_case([150, 90], topk=16)
    kwargs = dict(compress_ratio=4, scaling=0.25)
    total, n_keys = 240, 16 * 4 + 3
    gathered = total * n_keys * 2 * (16 + 16) * 4  # fp32 k and v, per query
    kept = _saved_bytes(lambda: qsa_attention(*qkv, selection, blocks, seqs, backend="gather", **kwargs))
    io = sum(t.numel() for t in qkv) * 4 + total * 4 * 16 * 4 + total * 4 * 4  # q, k, v, out, lse
    assert kept == io + total * n_keys * (4 + 1), kept
    sdpa = _saved_bytes(lambda: gather_qsa_attention(*qkv, selection, blocks, seqs, dropout=0.5, **kwargs))
    print(f"kept {kept:,} B; SDPA under autograd {sdpa:,} B; the gathered k and v {gathered:,} B")
    assert sdpa >= gathered > 10 * kept


def test_attention_negative_control():
    """The comparison sees a wrong key set: the plain block-causal attention (no selection) differs."""
    seqs, selection, blocks, qkv = _attention_case([40, 9])
    out = qsa_attention(*qkv, selection, blocks, seqs, compress_ratio=4, scaling=0.25, backend="gather")
    q, k, v = (t.transpose(0, 1)[None] for t in qkv)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=create_block_causal_mask([40, 9]), scale=0.25, enable_gqa=True
    )[0].transpose(0, 1)
    assert (out - dense).abs().max() > 1e-2


def test_attention_bf16_close_to_fp32():
    """bf16 gather vs the fp32 reference: within 2x plain bf16 SDPA's error against the same fp32 reference."""
    seqs, selection, blocks, qkv = _attention_case([3, 4, 29, 9])
    kwargs = dict(compress_ratio=4, scaling=0.25)
    exact = qsa_attention(*qkv, selection, blocks, seqs, backend="reference", **kwargs).detach()
    half = [t.detach().bfloat16() for t in qkv]
    fast = qsa_attention(*half, selection, blocks, seqs, backend="gather", **kwargs)
    plain = qsa_attention(*half, selection, blocks, seqs, backend="reference", **kwargs)
    fast_err, plain_err = ((o.float() - exact).abs().max().item() for o in (fast, plain))
    print(f"bf16 error vs fp32: gather {fast_err:.2e}, SDPA {plain_err:.2e}")
    assert fast.dtype == torch.bfloat16 and fast_err <= 2 * plain_err


def test_selection_is_fp32_under_autocast():
    """Autocast would run the scoring matmul in bf16 (and the top-k orders fp32 bit patterns): the selection under
    autocast equals the one without."""
    seqs = PackedSequences.from_seqlens([30, 19])
    generator = torch.Generator().manual_seed(5)
    q, raw = torch.randn(49, 2, 8, generator=generator), torch.randn(49, 8, generator=generator)
    plain = _fast_mask(q, raw, seqs, 4, 2, query_chunk=7)[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = _fast_mask(q, raw, seqs, 4, 2, query_chunk=7)[1]
    assert torch.equal(plain.blocks, autocast.blocks)


def test_the_indexer_gets_no_gradient():
    """The selection is indices: no graph reaches the indexer's queries or keys (as in transformers)."""
    seqs = PackedSequences.from_seqlens([20, 7])
    q_idx, raw = torch.randn(27, 2, 8, requires_grad=True), torch.randn(27, 8, requires_grad=True)
    blocks = qsa_blocks(seqs, total=27, compress_ratio=4)
    selection = qsa_select(q_idx, qsa_pool_keys(raw, blocks), seqs, blocks, compress_ratio=4, block_topk=1)
    assert not selection.blocks.requires_grad and selection.blocks.grad_fn is None


def test_contract_errors():
    seqs, selection, blocks, qkv = _attention_case([9, 8])
    kwargs = dict(compress_ratio=4, scaling=0.25)
    q, k, v = (t.detach() for t in qkv)
    with pytest.raises(ValueError, match="one floating dtype"):
        qsa_attention(q, k.bfloat16(), v, selection, blocks, seqs, **kwargs)
    with pytest.raises(ValueError, match="int64"):
        bad = QSASelection(selection.blocks.int(), selection.tail_start)
        qsa_attention(q, k, v, bad, blocks, seqs, **kwargs)
    with pytest.raises(ValueError, match="H_q % H_kv"):
        qsa_attention(q[:, :3], k, v, selection, blocks, seqs, **kwargs)
    with pytest.raises(ValueError, match="contiguous last dim"):
        qsa_attention(q, k.transpose(0, 2).contiguous().transpose(0, 2), v, selection, blocks, seqs, **kwargs)
    with pytest.raises(ValueError, match="int32"):
        seqs64 = PackedSequences(seqs.cu_seqlens.long(), seqs.max_seqlen, seqs.seqlens)
        qsa_attention(q, k, v, selection, blocks, seqs64, **kwargs)
    with pytest.raises(ValueError, match="choose one of"):
        qsa_attention(q, k, v, selection, blocks, seqs, backend="flash", **kwargs)
    with pytest.raises(ValueError, match="indexer_budget"):
        qsa_select(q[:, :2, :8], torch.zeros(4, 8), seqs, blocks, compress_ratio=4, block_topk=0)


def test_no_host_sync():
    """Blocks, pooling, selection and gathered attention, forward and backward: no sync, no host read, no tensor
    from host data (a CPU proxy for the GPU). Negative control: the oracle's loop is counted."""
    seqs = PackedSequences.from_seqlens([3, 4, 29, 9])
    generator = torch.Generator().manual_seed(4)
    q_idx, raw = torch.randn(45, 2, 8, generator=generator), torch.randn(45, 8, generator=generator)
    q = torch.randn(45, 4, 16, generator=generator, requires_grad=True)
    k, v = (torch.randn(45, 2, 16, generator=generator, requires_grad=True) for _ in range(2))
    with SyncCounter() as counter:
        blocks = qsa_blocks(seqs, total=45, compress_ratio=4)
        selection = qsa_select(q_idx, qsa_pool_keys(raw, blocks), seqs, blocks, compress_ratio=4, block_topk=2)
        out = qsa_attention(q, k, v, selection, blocks, seqs, compress_ratio=4, scaling=0.25, backend="gather")
        out.sum().backward()
    print(counter.report())
    assert counter.total == 0 and not counter.host_reads and counter.created == 0
    with SyncCounter() as counter:
        reference_qsa_mask(q_idx, raw, seqs, compress_ratio=4, block_topk=2, block_key_fn=lambda p, f: p)
    assert counter.total + sum(counter.host_reads.values()) > 0


def _selection_and_attention(q_idx, raw, q, k, v, seqs, query_chunk=None):
    blocks = qsa_blocks(seqs, total=q.shape[0], compress_ratio=4)
    keys = qsa_pool_keys(raw, blocks)
    selection = qsa_select(q_idx, keys, seqs, blocks, compress_ratio=4, block_topk=2, query_chunk=query_chunk)
    return qsa_attention(q, k, v, selection, blocks, seqs, compress_ratio=4, scaling=0.25, backend="gather")


class _CountingBackend:
    """``aot_eager`` that counts compilations (frame, recompile) once each."""

    def __init__(self) -> None:
        self.compile_ids: set[tuple[int, int]] = set()

    def __call__(self, gm, example_inputs):
        compile_id = torch._guards.CompileContext.current_compile_id()
        self.compile_ids.add((compile_id.frame_id, compile_id.frame_compile_id))
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)


def _compiled_runs(query_chunk: int | None, packs) -> int:
    torch._dynamo.reset()
    backend = _CountingBackend()
    compiled = torch.compile(_selection_and_attention, fullgraph=True, dynamic=True, backend=backend)
    for seqlens in packs:
        seqs = PackedSequences.from_seqlens(seqlens)
        total = sum(seqlens)
        generator = torch.Generator().manual_seed(total)
        inputs = [torch.randn(total, 2, 8, generator=generator), torch.randn(total, 8, generator=generator)]
        qkv = [torch.randn(total, h, 16, generator=generator, requires_grad=True) for h in (4, 2, 2)]
        results = []
        for fn in (compiled, _selection_and_attention):
            out = fn(*inputs, *qkv, seqs, query_chunk=query_chunk)
            results.append(_value_and_grads(out, qkv))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    return len(backend.compile_ids)


@pytest.mark.slow  # ~1 min of dynamo tracing (2-3 on a loaded 2-core machine), most of it the negative control
def test_compiles_once_for_all_packs():
    """Selection and gathered attention compiled ``fullgraph=True, dynamic=True``: packs of different lengths,
    sample counts and ``max_seqlen`` reuse one graph (at most 2 compilations: dynamo's static first guess, then the
    dynamic one), equal to eager with gradients. Negative control: a forced query chunk (a Python loop over ``T``)
    compiles a graph per pack."""
    packs = ([10, 4, 3, 17], [20, 9, 33], [5, 50, 7, 8, 9], [41])
    graphs = _compiled_runs(None, packs)
    print(f"QSA selection + attention: {graphs} compilations over {len(packs)} packs")
    assert 1 <= graphs <= 2
    assert _compiled_runs(8, packs) > 2
