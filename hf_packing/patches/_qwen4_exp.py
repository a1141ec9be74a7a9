"""Patch records for Qwen4-Exp's token mixers beyond Qwen3.5's: Per-Layer Embeddings (PLE) and the QSA indexer.

Qwen4-Exp's text stack mixes tokens in four places; each gets the pack's `PackedSequences` (``hf_packing_seqs``,
which the decoder layer receives from the patched forward):

- Gated DeltaNet layers: as Qwen3.5 (`_linear`: the conv and delta-rule functions of the modeling module).
- PLE (``Qwen4ExpTextPLELayer`` on chosen linear layers): the decoder layer hands it ``ple_input_ids`` only, so the
  patched decoder layer hands it ``(ple_input_ids, seqs)``; the patched PLE layer runs transformers' own forward
  with the boundaries in its ``past_key_values`` slot (a packed call has no cache), where its two token mixers look:
  the n-gram embedding (history restarts at every sample start and after every EOS, `hf_packing.ops.ple`) and the
  dilated depthwise conv (restarts at every sample start, `linear_attention.masked_causal_conv1d`).
- QSA ("indexed_attention" layers, ``Qwen4ExpTextAttention``): the packed call selects each query's blocks over
  the pack at once (`hf_packing.ops.sparse_attention`, blocks counted from each sample's first token), then runs
  Qwen3.5's attention body (``Qwen4ExpTextAttention`` is Qwen3.5's attention with the indexer in front, as
  transformers' modular file writes it) with the selection in ``hf_packing_qsa``, which the attention registry
  route (`_attention`) sends to the sparse varlen attention. transformers' dense ``(T, T)`` masks are never built:
  the patched forward passes the text model a mask mapping that answers ``None`` for every layer type
  (`NO_MASKS`), whatever the sparse layer type is called (``indexed_attention`` in 5.23, ``qwen_sparse_attention``
  later).
- Hyper-connections, the MoE router, M-RoPE and the vision tower mix nothing across tokens, or run on the paths
  every family shares.

Every patched function runs transformers' original on any call without the boundaries (generation, other
batches), and raises inside a packed forward if the boundaries did not reach it.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from ..ops import ple, sparse_attention
from ..ops.linear_attention import masked_causal_conv1d
from ..ops.varlen import PackedSequences
from ._attention import PACKED_KWARG, QSA_KWARG, PackedForward, PackedQSA, missing_boundaries_error
from ._patcher import Patch


class NoMasks(dict):
    """A mask mapping (``{layer type: mask}``, which transformers' text models accept as ``attention_mask``) that
    answers ``None`` for every layer type: the packed path's boundaries travel in ``hf_packing_seqs`` instead."""

    def __missing__(self, key: str) -> None:
        return None


#: the ``attention_mask`` a packed Qwen4-Exp backbone call receives (see the module docstring)
NO_MASKS = NoMasks()

#: class names of the modeling module (transformers 5.23)
DECODER, PLE_LAYER, NGRAM, ATTENTION, INDEXER = (
    "Qwen4ExpTextDecoderLayer",
    "Qwen4ExpTextPLELayer",
    "Qwen4ExpTextNGramEmbedding",
    "Qwen4ExpTextAttention",
    "Qwen4ExpTextQSAIndexer",
)


def with_checkpointing(owner: type, forward: Callable) -> Callable:
    """``forward`` inside transformers' gradient-checkpointing wrapper, made the way ``owner`` got its own.

    transformers (5.x) checkpoints a ``GradientCheckpointingLayer`` in a wrapper it puts around the class's
    ``forward`` when the class is created, and the wrapper checkpoints only while it is the class's ``forward``
    itself; a replacement ``forward`` without it turns the layer's checkpointing off silently (found by transformers'
    own ``test_training_gradient_checkpointing`` under the patch). A throwaway subclass gets the wrapper made."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if not issubclass(owner, GradientCheckpointingLayer):
        return forward
    carrier = type(owner.__name__, (owner,), {"forward": forward, "__module__": owner.__module__})
    return carrier.__dict__["forward"]


def make_decoder_forward(original: Callable) -> Callable:
    """The decoder layer's forward: a packed call hands its PLE layer ``(ple_input_ids, seqs)``. ``original`` is
    the class's (checkpointing) forward; it runs the layer unwrapped, since the patched class's ``forward`` is no
    longer its wrapper (`with_checkpointing` puts one around this)."""

    def forward(self, *args, **kwargs):
        seqs = kwargs.get(PACKED_KWARG)
        if seqs is not None and getattr(self, "ple", None) is not None:
            kwargs["ple_input_ids"] = (kwargs.get("ple_input_ids"), seqs)
        return original(self, *args, **kwargs)

    return forward


def make_ple_forward(original: Callable) -> Callable:
    """The PLE layer's forward: transformers' own, with the boundaries in the ``past_key_values`` slot."""

    def forward(self, hidden_states, input_ids, past_key_values=None, conv_mask=None):
        if isinstance(input_ids, tuple):
            ids, seqs = input_ids
            return original(self, hidden_states, ids, seqs, conv_mask=None)
        if PackedForward.depth:
            raise missing_boundaries_error(self)
        return original(self, hidden_states, input_ids, past_key_values, conv_mask=conv_mask)

    return forward


def make_ngram_forward(original: Callable) -> Callable:
    """The n-gram embedding's forward: on a packed call, the history restarts at every sample start too."""

    def forward(self, input_ids, past_key_values=None):
        if not isinstance(past_key_values, PackedSequences):
            return original(self, input_ids, past_key_values)
        history = ple.ngram_history(
            input_ids.reshape(-1).long(), past_key_values, context=self.context_len, eos=self.eos_token_id
        )
        ids = ple.ngram_ids(
            history,
            self.layer_multipliers,
            self.ngram_heads_vocab_sizes,
            self.ngram_heads_offsets,
            self.heads_per_ngram,
        )
        weight = self.ngram_embedding.weight  # transformers may leave this huge table off the device map
        device = weight.device if weight.device.type != "meta" else None
        return self.ngram_embedding(ids.to(device)).to(input_ids.device).flatten(-2)[None]

    return forward


def make_short_conv(original: Callable) -> Callable:
    """The PLE layer's dilated depthwise conv: on a packed call, no window reaches into the previous sample."""

    def _short_conv(self, hidden_states, past_key_values=None):
        if not isinstance(past_key_values, PackedSequences):
            return original(self, hidden_states, past_key_values)
        conv = self.conv1d
        out = masked_causal_conv1d(
            hidden_states.transpose(1, 2),
            conv.weight.squeeze(1),
            conv.bias,
            "silu",
            past_key_values,
            dilation=conv.dilation[0],
        )
        return out.transpose(1, 2)

    return _short_conv


def packed_qsa(indexer, hidden_states, position_embeddings, seqs: PackedSequences, rotary: Callable) -> PackedQSA:
    """transformers' ``Qwen4ExpTextQSAIndexer`` on a pack: the same projections, norms, pooling and rotary
    embeddings, with the blocks and the top-k of `hf_packing.ops.sparse_attention` (per sample, vectorised).

    Args:
        indexer: the layer's ``Qwen4ExpTextQSAIndexer`` (its weights and sizes).
        hidden_states (`torch.Tensor` of shape `(1, T, hidden)`), position_embeddings (``cos, sin`` of shape
            `(1, T, rotary_dim)`): the attention module's inputs.
        seqs (`PackedSequences`): the boundaries.
        rotary: the modeling module's ``apply_rotary_pos_emb`` (``k=None`` rotates the queries only).

    The selection is indices: no gradient reaches the indexer from the LM loss (as in transformers), so it runs
    under ``no_grad`` and keeps no activations.
    """
    ratio, dim = indexer.compress_ratio, indexer.index_head_dim
    with torch.no_grad():
        hidden = hidden_states[0]
        total = hidden.shape[0]
        cos, sin = (x[0] for x in position_embeddings)
        q, raw_keys = indexer.index_qk_proj(hidden).split(
            [indexer.index_n_heads * dim, indexer.index_kv_heads * dim], dim=-1
        )
        q = rotary(indexer.q_layernorm(q.view(total, -1, dim)), cos=cos, sin=sin, unsqueeze_dim=1)
        blocks = sparse_attention.qsa_blocks(seqs, total=total, compress_ratio=ratio)
        pooled = indexer.k_layernorm(sparse_attention.qsa_pool_keys(raw_keys.view(total, dim), blocks))
        first = blocks.tokens[:, 0]  # positions restart per sample: the rope of a block's first token in its sample
        keys = rotary(
            pooled.unsqueeze(1), cos=cos.index_select(0, first), sin=sin.index_select(0, first), unsqueeze_dim=1
        ).squeeze(1)
        # scores in fp32 as transformers writes them (``.float()`` before its matmul); under autocast a matmul would
        # come back in half precision, and the selection orders the fp32 scores' bits
        with torch.autocast(hidden.device.type, enabled=False):
            selection = sparse_attention.qsa_select(
                q.float(), keys.float(), seqs, blocks, compress_ratio=ratio, block_topk=indexer.block_topk
            )
    return PackedQSA(selection, blocks, ratio)


def make_attention_forward(original: Callable, body: Callable, rotary: Callable) -> Callable:
    """The QSA attention module's forward: a packed call selects with `packed_qsa`, then runs ``body`` (Qwen3.5's
    attention forward, which transformers' modular file extends with the indexer) without masks, the selection
    in ``hf_packing_qsa`` for the attention route."""

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        seqs = kwargs.get(PACKED_KWARG)
        if seqs is None:
            return original(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        qsa = packed_qsa(self.indexer, hidden_states, position_embeddings, seqs, rotary)
        return body(self, hidden_states, position_embeddings, None, None, **kwargs, **{QSA_KWARG: qsa})

    return forward


def make_indexer_forward(original: Callable) -> Callable:
    """The indexer's forward: refused inside a packed forward (its per-query loop would see one flat row)."""

    def forward(self, *args, **kwargs):
        if PackedForward.depth:
            raise missing_boundaries_error(self)
        return original(self, *args, **kwargs)

    return forward


def qwen4_exp_patches(module: ModuleType) -> list[Patch]:
    """The PLE and QSA patches for the Qwen4-Exp modeling ``module``; raises if this transformers lacks the classes."""
    missing = [name for name in (DECODER, PLE_LAYER, NGRAM, ATTENTION, INDEXER) if not hasattr(module, name)]
    if missing:
        raise RuntimeError(
            f"{module.__name__} has no {missing}: this transformers' Qwen4-Exp is not the one hf_packing patches "
            "(5.23); install a supported transformers"
        )
    cls: dict[str, Any] = {name: getattr(module, name) for name in (DECODER, PLE_LAYER, NGRAM, ATTENTION, INDEXER)}
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention

    attention = make_attention_forward(
        cls[ATTENTION].__dict__["forward"], Qwen3_5Attention.forward, module.apply_rotary_pos_emb
    )
    return [
        Patch(cls[ATTENTION], "forward", attention),
        Patch(cls[INDEXER], "forward", make_indexer_forward(cls[INDEXER].__dict__["forward"])),
        Patch(
            cls[DECODER],
            "forward",
            with_checkpointing(cls[DECODER], make_decoder_forward(cls[DECODER].__dict__["forward"])),
        ),
        Patch(cls[PLE_LAYER], "forward", make_ple_forward(cls[PLE_LAYER].__dict__["forward"])),
        Patch(cls[PLE_LAYER], "_short_conv", make_short_conv(cls[PLE_LAYER].__dict__["_short_conv"])),
        Patch(cls[NGRAM], "forward", make_ngram_forward(cls[NGRAM].__dict__["forward"])),
    ]
