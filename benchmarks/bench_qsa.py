"""Qwen4-Exp's QSA indexer: transformers' ``Qwen4ExpTextQSAIndexer`` forward vs `hf_packing.ops.sparse_attention`
on the same samples, and the attention over the selected keys (forward + backward), CPU.

Each length runs 4 samples of about that many tokens (0.8x, 1.2x, 0.9x, 1.1x). transformers' arm: the samples as
right-padded rows with an sdpa bool mask (causal and padding), the indexer module's forward (a Python loop over rows
and queries, a ``nonzero`` and a ``topk`` per query). Ours: the same module's weights on the pack of the 4 samples
(one ``cu_seqlens``): projection, norms and rope, then `qsa_blocks`, `qsa_pool_keys`, ``k_layernorm`` + rope at each
block's first token, `qsa_select` and `qsa_token_index` (what the attention reads). Both under ``no_grad`` (the
selection is indices; the indexer gets no gradient from the LM loss either way). "rows equal": the fraction of
queries whose selected keys are identical in both (the rest are ties in the k-th place, broken differently:
transformers' ``topk`` has no tie order, ours takes the lower block).

Attention (forward + backward, GQA 4/2 heads of 32): transformers' sdpa path (padded rows, the causal mask ANDed with
its selection) vs our ``gather`` and ``reference`` backends on the pack, same selection.

Run: ``PYTHONPATH=. python benchmarks/bench_qsa.py`` (~2 min; ``--no-write`` prints the section instead).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import _common as C  # noqa: E402
import torch  # noqa: E402

from hf_packing.ops.sparse_attention import (  # noqa: E402
    qsa_attention,
    qsa_blocks,
    qsa_mask,
    qsa_pool_keys,
    qsa_select,
    qsa_token_index,
)
from hf_packing.ops.varlen import PackedSequences  # noqa: E402

SPREAD = (0.8, 1.2, 0.9, 1.1)


def build_indexer(budget: int, ratio: int, heads: int, head_dim: int, hidden: int):
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextQSAIndexer

    config = Qwen4ExpTextConfig(
        hidden_size=hidden, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8, shared_expert_intermediate_size=8,
        hc_count=2, hc_lowrank=4, layer_types=["indexed_attention"], indexer_n_heads=heads, indexer_kv_heads=1,
        indexer_head_dim=head_dim, indexer_budget=budget, indexer_compress_ratio=ratio,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen4ExpTextQSAIndexer(config, layer_idx=0).eval()


def rope(length: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.arange(length).float()[:, None] * inv_freq
    emb = torch.cat([emb, emb], dim=-1)
    return emb.cos(), emb.sin()


def ours(indexer, hidden: torch.Tensor, seqs: PackedSequences, cos: torch.Tensor, sin: torch.Tensor):
    """The pack's selection with the module's own weights (what the patched indexer runs)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import apply_rotary_pos_emb

    heads, dim, ratio = indexer.index_n_heads, indexer.index_head_dim, indexer.compress_ratio
    total = hidden.shape[0]
    q, raw = indexer.index_qk_proj(hidden).split([heads * dim, dim], dim=-1)
    q = apply_rotary_pos_emb(indexer.q_layernorm(q.view(total, heads, dim)), cos=cos, sin=sin)
    blocks = qsa_blocks(seqs, total=total, compress_ratio=ratio)
    first = blocks.tokens[:, 0]
    keys = indexer.k_layernorm(qsa_pool_keys(raw, blocks))[:, None]
    keys = apply_rotary_pos_emb(keys, cos=cos[first], sin=sin[first]).squeeze(1)
    selection = qsa_select(q, keys, seqs, blocks, compress_ratio=ratio, block_topk=indexer.block_topk)
    return selection, blocks, qsa_token_index(selection, blocks, compress_ratio=ratio)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(length: int, args) -> list[str]:
    indexer = build_indexer(args.budget, args.ratio, args.heads, args.head_dim, args.hidden)
    lengths = [round(length * f) for f in SPREAD]
    longest, total = max(lengths), sum(lengths)
    generator = torch.Generator().manual_seed(length)
    flat = torch.randn(total, args.hidden, generator=generator)
    seqs = PackedSequences.from_seqlens(lengths)
    cos_table, sin_table = rope(longest, args.head_dim)
    offsets = torch.cat([torch.arange(n) for n in lengths])
    cos, sin = cos_table[offsets], sin_table[offsets]
    # the same samples as right-padded rows, with the sdpa bool mask transformers builds (causal and padding)
    padded = torch.zeros(len(lengths), longest, args.hidden)
    real = torch.zeros(len(lengths), longest, dtype=torch.bool)
    for row, (piece, n) in enumerate(zip(flat.split(lengths), lengths)):
        padded[row, :n], real[row, :n] = piece, True
    mask = (torch.ones(longest, longest, dtype=torch.bool).tril() & real[:, None, :])[:, None]
    position = (cos_table[None].expand(len(lengths), -1, -1), sin_table[None].expand(len(lengths), -1, -1))

    outputs = {}

    def run_transformers() -> float:
        with torch.no_grad():
            return timed(lambda: outputs.__setitem__("hf", indexer(padded, position, mask, None)))

    def run_ours() -> float:
        with torch.no_grad():
            return timed(lambda: outputs.__setitem__("ours", ours(indexer, flat, seqs, cos, sin)))

    times = C.interleaved({"hf": run_transformers, "ours": run_ours}, warmup=1, repeats=args.repeats)
    selection, blocks, _ = outputs["ours"]
    pack_mask = qsa_mask(selection, seqs, compress_ratio=args.ratio)
    equal = 0
    for row, (start, n) in enumerate(zip(seqs.cu_seqlens.tolist(), lengths)):
        hf_rows = outputs["hf"][row, 0, :n, :n]
        equal += int((hf_rows == pack_mask[start : start + n, start : start + n]).all(dim=1).sum())

    # attention over the selected keys, forward + backward
    q = torch.randn(total, 4, 32, generator=generator, requires_grad=True)
    k, v = (torch.randn(total, 2, 32, generator=generator, requires_grad=True) for _ in range(2))
    hf_mask = mask & outputs["hf"]

    def attention_hf() -> float:
        def step():
            qs, ks, vs = (_pad(t, lengths, longest).transpose(1, 2) for t in (q, k, v))
            out = torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=hf_mask, scale=32**-0.5, enable_gqa=True
            )
            out.sum().backward()

        return timed(step)

    def attention(backend: str):
        def run() -> float:
            def step():
                out = qsa_attention(
                    q, k, v, selection, blocks, seqs, compress_ratio=args.ratio, scaling=32**-0.5, backend=backend
                )
                out.sum().backward()

            return timed(step)

        return run

    att = C.interleaved(
        {"hf": attention_hf, "gather": attention("gather"), "reference": attention("reference")},
        warmup=1,
        repeats=args.repeats,
    )
    hf_ms, ours_ms = (C.median(times[a]) * 1e3 for a in ("hf", "ours"))
    return [
        f"{length} ({'/'.join(map(str, lengths))})",
        f"{hf_ms:,.1f}",
        f"{ours_ms:,.2f}",
        f"{hf_ms / ours_ms:,.0f}x",
        f"{equal / total:.3f}",
        *(f"{C.median(att[a]) * 1e3:,.2f}" for a in ("hf", "gather", "reference")),
    ]


def _pad(flat: torch.Tensor, lengths: list[int], longest: int) -> torch.Tensor:
    out = flat.new_zeros(len(lengths), longest, *flat.shape[1:])
    for row, piece in enumerate(flat.split(lengths)):
        out[row, : piece.shape[0]] = piece
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[125, 400, 1000], help="tokens per sample (about)")
    parser.add_argument("--budget", type=int, default=8, help="indexer_budget (tokens)")
    parser.add_argument("--ratio", type=int, default=4, help="indexer_compress_ratio")
    parser.add_argument("--heads", type=int, default=4, help="indexer_n_heads")
    parser.add_argument("--head-dim", type=int, default=32, help="indexer_head_dim (= the attention head_dim)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden_size")
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds after 1 warm-up")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before, t_start = C.load_average(), time.time()
    rows = [measure(n, args) for n in args.lengths]
    table = C.md_table(
        [
            "tokens per sample (4 samples)",
            "transformers indexer (ms)",
            "ours (ms)",
            "speed-up",
            "rows equal",
            "attention: transformers sdpa (ms)",
            "gather (ms)",
            "reference (ms)",
        ],
        rows,
    )
    intro = " ".join(
        f"""The indexer's forward on 4 samples: transformers' module on padded rows vs `hf_packing.ops.sparse_attention`
on their pack, the same weights (hidden {args.hidden}, {args.heads} indexer heads of {args.head_dim}, budget
{args.budget} in blocks of {args.ratio}: top-{args.budget // args.ratio} blocks), fp32, no_grad; medians of
{args.repeats} interleaved rounds after 1 warm-up. "ours" is the whole packed indexer: projection, norms, rope,
blocks, pooling, scores, top-k and the token index. "rows equal": queries with identical selected keys (the rest
would be ties at the k-th place, which transformers' `topk` breaks in no documented order and ours to the lower
block). Attention columns: forward + backward over the selected keys (4 query / 2 kv heads of 32): transformers'
sdpa on the padded rows with its mask vs our two backends on the pack. The machine is shared: see the load
averages; the arms of a row ran interleaved in one process, so their ratio holds better than their absolute
times.""".split()
    )
    body = f"""## Qwen4-Exp QSA indexer: transformers vs packed (`bench_qsa.py`)

{textwrap.fill(intro, 118, break_on_hyphens=False)}

{table}

{C.footer(t_start, C.machine(f"torch.set_num_threads({args.threads})"), load_before=load_before)}
"""
    if args.no_write:
        print(body)
    else:
        C.write_section("bench_qsa", body)
        print(body)


if __name__ == "__main__":
    main()
