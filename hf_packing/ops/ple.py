"""Qwen4-Exp's Per-Layer Embeddings (PLE) on a flat pack: the n-gram history restarts at every sample start.

transformers' ``Qwen4ExpTextNGramEmbedding`` hashes, for each token, the ``n``-grams ending at it (``n`` = 2 ..
``ngram_size``): the token and the ``ngram_size - 1`` tokens before it. The history restarts after every EOS token
(a token whose history would reach back past an EOS sees EOS instead) and, for one row, before its first token. On
a pack the history must also restart at every sample start, or a sample's first tokens hash the previous sample's
last ones::

    flat row    a1 a2 a3 | b1 b2 E  b3          cu_seqlens [0, 3, 7], E = EOS
    1 back      E  a1 a2   E  b1 b2 E
    2 back      E  E  a1   E  E  b1 E

The PLE's dilated depthwise conv (kernel ``ple_conv_kernel_size``, dilation ``ngram_size``) restarts at every sample
start with `hf_packing.ops.linear_attention.masked_causal_conv1d` (``dilation=``). Both are vectorised over the
pack: no loop over samples, no host value; a few elementwise ops per token, negligible next to the layer's
projections.
"""

from __future__ import annotations

import torch

from .varlen import PackedSequences, token_sequences


def ngram_history(input_ids: torch.Tensor, seqs: PackedSequences, *, context: int, eos: int) -> torch.Tensor:
    """Each token and the ``context`` tokens before it inside its segment (its sample, cut after each EOS), else EOS.

    Args:
        input_ids (`torch.LongTensor` of shape `(T,)`): the flat pack.
        seqs (`PackedSequences`): its sample boundaries.
        context (`int`): how many tokens back (``ngram_size - 1``).
        eos (`int`): the EOS id: the filler, and where a history restarts inside a sample (as transformers does).

    Returns:
        `torch.LongTensor` of shape `(context + 1, T)`: row ``s`` holds the token ``s`` back (row 0: the token).
    """
    total = input_ids.shape[0]
    _, offsets = token_sequences(seqs, total, input_ids.device)
    pos = torch.arange(total, device=input_ids.device)
    eos_at = torch.where(input_ids == eos, pos, -1)
    # the last EOS strictly before each token (-1: none), as transformers' `_shift_right_ignore_eos`
    previous_eos = torch.nn.functional.pad(torch.cummax(eos_at, dim=0).values[:-1], (1, 0), value=-1)
    start = torch.maximum(previous_eos + 1, pos - offsets)  # the segment: after that EOS and inside the sample
    rows = [input_ids]
    for shift in range(1, context + 1):  # ngram_size - 1 (2 in Qwen4-Exp): a fixed, short loop
        back = input_ids[(pos - shift).clamp_min(0)]
        rows.append(torch.where(pos - start >= shift, back, eos))
    return torch.stack(rows)


def ngram_ids(
    history: torch.Tensor,
    multipliers: torch.Tensor,
    head_vocab_sizes: torch.Tensor,
    head_offsets: torch.Tensor,
    heads_per_ngram: int,
) -> torch.Tensor:
    """The hashed n-gram ids of every token: transformers' ``Qwen4ExpTextNGramEmbedding`` hash on `ngram_history`.

    Args:
        history (`torch.LongTensor` of shape `(N, T)`): `ngram_history`, ``N = ngram_size``.
        multipliers (`torch.LongTensor` of shape `(N,)`): the layer's ``layer_multipliers``.
        head_vocab_sizes, head_offsets (`torch.LongTensor` of shape `((N - 1) · heads_per_ngram,)`): each hashed
            head's table size and its offset in the concatenated table.
        heads_per_ngram (`int`): heads per n-gram order.

    Returns:
        `torch.LongTensor` of shape `(T, (N - 1) · heads_per_ngram)`: rows of the concatenated embedding table,
        2-grams' heads first.
    """
    blocks = []
    for n in range(2, history.shape[0] + 1):
        mixed = history[0] * multipliers[0]
        for back in range(1, n):  # int64 products wrap around, as in transformers
            mixed = torch.bitwise_xor(mixed, history[back] * multipliers[back])
        heads = slice((n - 2) * heads_per_ngram, (n - 1) * heads_per_ngram)
        blocks.append(torch.remainder(mixed[:, None], head_vocab_sizes[None, heads]) + head_offsets[None, heads])
    return torch.cat(blocks, dim=-1)
