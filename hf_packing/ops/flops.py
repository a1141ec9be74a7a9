"""The one cost model: model FLOPs of one training step (forward + backward) from a pack's counts.

`ModelFlops` holds what the count needs from a model (its matmul weights and attention shapes, read once by
`ModelFlops.from_model`) and turns a pack's counts into FLOPs. Three users share it: `hf_packing.training.flops`
(``training_flops(model, batch)``, exact, tested against ``FlopCounterMode``), the telemetry's MFU (the same counts,
summed over a logging window) and the packer's rank balance (`hf_packing.packing.balance.WorkCost`, which sees only
a sample's metadata: tokens n, P = Σ t·h·w and Q = Σ t·(h·w)²)::

    text    6·N·T  +  6·L·d·Σ_doc len²  +  18·L_lin·S·T
            N: matmul weights of the decoder layers (2-D and up; MoE experts × k/E, the router in full) + the
            LM head H·V (even when tied); norms, biases and the embedding lookup are not matmuls.
            L softmax layers, d = heads·head_dim: QKᵀ and AV, 4·d·len² forward, ½ for the causal mask, ×3.
            L_lin Gated DeltaNet layers, S = value heads·d_k·d_v: state read by k, written, read by q (model FLOPs).
            Qwen4-Exp's QSA layers (`ModelFlops.text_of`, exact per document): 12·d per selected (query, key) pair
            instead of the causal square, the indexer 2·H_idx·D_idx per (query, visible block) and 2·N_idx per token
            (forward only: no gradient reaches it); its PLE n-gram tables are lookups, its conv and
            hyper-connection mixers matmul weights in N. The telemetry counts them exactly as well (`qsa_counts` of
            each micro-batch's lengths, on the device); the packer's balance, which sees only Σ len², counts QSA
            layers as dense causal attention (an upper bound).
    vision  P = Σ t·h·w patches, m = spatial_merge_size:
            patch embedding 2·N_pe·P forward (its backward computes only the weight gradient: ×2 in all),
            blocks 2·N_blk·P, merger and DeepStack mergers 2·N_mrg·P/m² (they run on merged tokens; GLM-V's
            m×m ``downsample`` convolution too),
            attention 4·D·Σ_unit n² per block, bidirectional, unit = one frame (Q = Σ t·(h·w)²) or, in
            Qwen2.5-VL's windowed blocks, one window (W = Σ_window n², its real size at the frame's edge; the packer,
            without the grids, counts every patch in a whole window: W ≈ window_patches·P, exact when the frames
            are whole windows, above otherwise); ×3 when any tower parameter trains, ×1 when the tower is frozen.

How this differs from the FLOPs a step executes: activation checkpointing recomputes the forward (+1× forward
FLOPs for checkpointed layers); the chunked loss recomputes each chunk's logits in backward and computes logits
only at supervised positions (``6·H·V·T`` counts all T); the varlen kernels compute causal attention on
tiles, so they execute a bit more than ½ of the square; elementwise ops (norms, activations, rotary, softmax)
and the vision position-embedding interpolation are not counted; Gated DeltaNet's chunked kernel executes
intra-chunk products that the recurrence's model FLOPs leave out. MoE counts the k active experts per token.

A new family whose modules follow Qwen-VL's layout (``model.visual`` with ``patch_embed`` and ``*merger*`` children)
needs no edit here: the weights are counted from the model (`hf_packing.packing.balance` builds it on the meta device
from a config).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .varlen import vision_seqlens

__all__ = ["ModelFlops", "num_experts"]

#: weights read by lookup or interpolation, not multiplied: token embeddings, the vision position tables (Qwen's
#: ``pos_embed``, GLM-V's ``embeddings.position_embedding``), and the LM head (counted as H·V analytically)
_LOOKUPS = (
    "embed_tokens",
    "pos_embed",
    "position_embedding",
    "ngram_embedding",
    "lm_head",
)  # ngram: Qwen4-Exp PLE tables


def _on_merged(name: str) -> bool:
    """Whether a tower child runs on merged tokens (P/m² rows): the mergers, and GLM-V's ``downsample``, the m×m
    stride-m convolution that merges the patches before its merger."""
    return "merger" in name or name == "downsample"


def num_experts(text_config: Any) -> int | None:
    """Routed experts of a text config: ``num_experts`` (Qwen), ``num_local_experts`` (GLM-4.5V's alias of
    ``n_routed_experts``); ``None`` for a dense model."""
    return getattr(text_config, "num_experts", None) or getattr(text_config, "num_local_experts", None)


def _matmul_numel(named: Any, experts: int | None = None, active: int | None = None) -> float:
    """Σ numel of the weights that multiply activations (dim ≥ 2, not an embedding lookup); MoE expert stacks count
    ``active / experts``. ``named``: ``(name, parameter)`` pairs."""
    total = 0.0
    for name, p in named:
        shape = _full_shape(p)
        if len(shape) < 2 or any(lookup in name for lookup in _LOOKUPS):
            continue
        numel = float(torch.Size(shape).numel())
        total += numel * active / experts if experts and active and ".experts." in f".{name}" else numel
    return total


def _floor_sum(n, r: int):
    """Σ_{m=1..n} ⌊m / r⌋, of an int or elementwise of an int64 tensor."""
    q, rem = n // r, n % r
    return r * q * (q - 1) // 2 + q * (rem + 1)


def qsa_counts(n, compress_ratio: int, block_topk: int):
    """Per QSA layer, for one document of ``n`` tokens (`hf_packing.ops.sparse_attention`'s rule, closed form):
    Σ over queries of the keys each attends (its ``min(k, v)`` selected blocks of ``r`` and its tail of ``m mod r``,
    ``v = ⌊m / r⌋`` complete blocks visible to the query at ``m = offset + 1``), and Σ of ``v`` (blocks scored).

    ``n`` is an int, or an int64 tensor of document lengths (elementwise, on its device: the telemetry counts a
    batch without a host sync); returns ``(keys, scored)`` of the same kind.
    """
    r, k = compress_ratio, block_topk
    if isinstance(n, torch.Tensor):
        short, long = n.clamp(max=k * r - 1), (n - k * r + 1).clamp(min=0)
    else:
        short, long = min(n, k * r - 1), max(0, n - k * r + 1)
    scored = _floor_sum(n, r)
    tails = n * (n + 1) // 2 - r * scored
    return r * (_floor_sum(short, r) + k * long) + tails, scored


def _full_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The shape of the whole parameter, read from attributes only (no gather, no weight touched): DeepSpeed ZeRO-3
    partitions hold a local shape of ``(0,)`` (or a 1-D slice) and the full one in ``ds_shape``; an FSDP2 DTensor's
    ``shape`` is already its global shape (its local shard is ``to_local()``)."""
    ds_shape = getattr(p, "ds_shape", None)
    return tuple(ds_shape) if ds_shape is not None else tuple(p.shape)


@dataclass(frozen=True)
class ModelFlops:
    """What the FLOP count needs from a model (see the module docstring for the formula).

    Attributes:
        text_params (`float`): N, matmul weights per text token (decoder layers, MoE active share, LM head H·V).
        attention_layers / attention_dim (`int`): L softmax-attention layers and d = heads·head_dim.
        linear_layers / linear_state (`int`): L_lin Gated DeltaNet layers and their state size S.
        vision_embed / vision_blocks / vision_mergers (`float`): N_pe, N_blk and N_mrg (all mergers, DeepStack's too).
        merge (`int`): m, the spatial merge size. vision_width (`int`): D, the tower's attention width.
        full_blocks / window_blocks (`int`): tower blocks attending per frame / per window (Qwen2.5-VL).
        window (`int`): merged patches per window side (``window_size / patch_size / merge``), 0 without windows.
        vision_trainable (`bool`): any tower parameter trains (×3), else forward only (×1).
        qsa_layers (`int`): Qwen4-Exp's QSA-indexed layers (among the L softmax layers); 0 elsewhere.
        indexer_params (`float`): N_idx, their indexers' projection weights (in N, but forward only: no gradient).
        indexer_dim (`int`): H_idx·D_idx, the indexer's query heads times head dim.
        compress_ratio / block_topk (`int`): r tokens per block and the k blocks kept per query.
    """

    text_params: float
    attention_layers: int
    attention_dim: int
    linear_layers: int = 0
    linear_state: int = 0
    vision_embed: float = 0.0
    vision_blocks: float = 0.0
    vision_mergers: float = 0.0
    merge: int = 1
    vision_width: int = 0
    full_blocks: int = 0
    window_blocks: int = 0
    window: int = 0
    vision_trainable: bool = True
    qsa_layers: int = 0
    indexer_params: float = 0.0
    indexer_dim: int = 0
    compress_ratio: int = 1
    block_topk: int = 0

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> ModelFlops:
        """Counts of a transformers model (unwrapped: no DDP / PEFT / compile wrapper), text-only or Qwen-VL."""
        config: Any = model.config  # a transformers PretrainedConfig (ops import no transformers)
        text = config.get_text_config()
        heads = text.num_attention_heads
        experts, active = num_experts(text), getattr(text, "num_experts_per_tok", None)
        tower: Any = getattr(getattr(model, "model", model), "visual", None) or getattr(model, "visual", None)
        in_tower = {id(p) for p in tower.parameters()} if tower is not None else set()
        decoder = [(n, p) for n, p in model.named_parameters() if id(p) not in in_tower]
        layer_types = list(getattr(text, "layer_types", None) or [])
        n_linear = layer_types.count("linear_attention")
        state = text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim if n_linear else 0
        qsa: dict[str, Any] = {}
        if getattr(text, "indexer_compress_ratio", None):  # Qwen4-Exp: every softmax layer is QSA-indexed
            qsa = dict(
                qsa_layers=text.num_hidden_layers - n_linear,
                indexer_params=_matmul_numel((n, p) for n, p in decoder if ".indexer." in f".{n}"),
                indexer_dim=text.indexer_n_heads * text.indexer_head_dim,
                compress_ratio=text.indexer_compress_ratio,
                block_topk=text.indexer_budget // text.indexer_compress_ratio,
            )
        counts = cls(
            text_params=_matmul_numel(decoder, experts, active) + text.hidden_size * text.vocab_size,
            attention_layers=text.num_hidden_layers - n_linear,
            attention_dim=heads * (getattr(text, "head_dim", None) or text.hidden_size // heads),
            linear_layers=n_linear,
            linear_state=state,
            **qsa,
        )
        if tower is None:
            return counts
        vc: Any = config.vision_config
        embed = _matmul_numel(tower.patch_embed.named_parameters())
        mergers = sum(_matmul_numel(m.named_parameters()) for n, m in tower.named_children() if _on_merged(n))
        fields = vc.to_dict()  # getattr(vc, "window_size", None) raises on Qwen3-VL's per-layer config in 5.23
        windowed = fields.get("fullatt_block_indexes") is not None and bool(fields.get("window_size"))
        window_blocks = vc.depth - len(vc.fullatt_block_indexes) if windowed else 0
        return cls(
            **{k: getattr(counts, k) for k in ("text_params", "attention_layers", "attention_dim")},
            linear_layers=n_linear,
            linear_state=state,
            **qsa,
            vision_embed=embed,
            vision_blocks=_matmul_numel(tower.named_parameters()) - embed - mergers,
            vision_mergers=mergers,
            merge=vc.spatial_merge_size,
            vision_width=getattr(vc, "embed_dim", None) or vc.hidden_size,  # Qwen2-VL: hidden_size is its output
            full_blocks=vc.depth - window_blocks,
            window_blocks=window_blocks,
            window=fields["window_size"] // vc.spatial_merge_size // vc.patch_size if windowed else 0,
            vision_trainable=any(p.requires_grad for p in tower.parameters()),
        )

    def text(self, *, tokens: float, sum_sq_lens: float) -> float:
        """Training FLOPs of the decoder layers and the LM head: ``tokens`` real tokens, ``sum_sq_lens`` = Σ len²
        over the documents."""
        attention = 6.0 * self.attention_layers * self.attention_dim * sum_sq_lens
        return 6.0 * self.text_params * tokens + attention + 18.0 * self.linear_layers * self.linear_state * tokens

    def text_of(self, lengths: list[int]) -> float:
        """`text` of documents of ``lengths``, with Qwen4-Exp's QSA layers exact (`text_counts`)."""
        keys = scored = 0.0
        if self.qsa_layers:
            keys, scored = (float(sum(c)) for c in zip(*(self.qsa_counts(n) for n in lengths)))
        return self.text_counts(
            tokens=float(sum(lengths)),
            sum_sq_lens=sum(float(n) ** 2 for n in lengths),
            qsa_keys=keys,
            qsa_scored=scored,
        )

    def qsa_counts(self, lengths):
        """`qsa_counts` with this model's ratio and budget (an int length, or an int64 tensor of lengths)."""
        return qsa_counts(lengths, self.compress_ratio, self.block_topk)

    def text_counts(
        self, *, tokens: float, sum_sq_lens: float, qsa_keys: float = 0.0, qsa_scored: float = 0.0
    ) -> float:
        """`text` with Qwen4-Exp's QSA layers exact, from summed counts (`qsa_counts` over the documents): each
        query attends its selected keys (``12·d`` per key, not the causal square) and its indexer scores its visible
        blocks (``2·H_idx·D_idx`` per block, forward only, as its projections: ``2·N_idx`` per token, not 6)."""
        dense = self.text(tokens=tokens, sum_sq_lens=sum_sq_lens)
        if not self.qsa_layers:
            return dense
        square = 6.0 * self.qsa_layers * self.attention_dim * sum_sq_lens
        sparse = 12.0 * self.qsa_layers * self.attention_dim * qsa_keys
        indexer = 2.0 * self.qsa_layers * self.indexer_dim * qsa_scored - 4.0 * self.indexer_params * tokens
        return dense - square + sparse + indexer

    def vision(self, *, patches: float, frame_sq: float, window_sq: float | None = None) -> float:
        """Training FLOPs of the tower: ``patches`` = Σ t·h·w, ``frame_sq`` = Σ t·(h·w)², ``window_sq`` = Σ n² over
        Qwen2.5-VL's windows (``None``: every patch in a whole window, the packer's estimate)."""
        if window_sq is None:
            window_sq = (self.window * self.merge) ** 2 * patches
        matmuls = self.vision_embed + self.vision_blocks + self.vision_mergers / self.merge**2
        squares = self.full_blocks * frame_sq + self.window_blocks * window_sq
        forward = 2.0 * matmuls * patches + 4.0 * self.vision_width * squares
        if not self.vision_trainable:
            return forward
        return 3.0 * forward - 2.0 * self.vision_embed * patches  # no gradient for the pixels: the embedding's is 1×

    def vision_of(self, grids: list[list[int]]) -> float:
        """`vision` of items ``grids`` (``[t, h, w]`` each), with their exact frames and windows."""
        if not grids:
            return 0.0
        units = vision_seqlens(grids, merge=self.merge, window=self.window)
        frame_sq = sum(float(n) ** 2 for n in units[0])
        patches = float(sum(t * h * w for t, h, w in grids))
        return self.vision(patches=patches, frame_sq=frame_sq, window_sq=sum(float(n) ** 2 for n in units[-1]))
