"""The activation-memory model: the bytes autograd keeps for backward in one training step, from a pack's counts.

`ActivationMemory.from_model` reads what the count needs from a model's module tree (built on the meta device is
enough: shapes, which norms, which MLPs) and `saved_bytes` turns a pack's counts (T real tokens, S supervised tokens,
P vision patches) into bytes, for bf16 weights (the GPU benchmark's precision), gradient checkpointing off or on::

    off   T·(embed ids + rotary + L·layer + final norm)  +  S·loss  +  P·(patch embed + blocks + mergers)
          + P/m²·merged tokens in the decoder
          + per step: fp32 copies of norm and GLM router weights, PLE conv padding (off); GLM's fp32 position
            table (with patches)
    on    the same, with each checkpointed layer / block keeping only its input (T·2H / P·2D bytes; Qwen4-Exp's
          layers take C hyper-connection streams: T·2CH)

The families (`MODELLED`): Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE), Qwen3.5(-MoE); the GLM-V families (GLM-4.1V,
GLM-4.5V's MoE with its sigmoid grouped router, GLM-4.6V: sandwich norms around the mixer and the MLP, a tower with
RMSNorms after the patch embedding and the blocks, bicubic position embeddings and a conv downsample before its
SwiGLU merger); Qwen4-Exp (C hyper-connection streams in place of the norms, each with a grouped norm and a low-rank
mix; Per-Layer Embeddings on chosen linear layers: hashed n-gram ids and their embedding, a per-stream gate, a
dilated conv; QSA "indexed_attention" layers; Qwen3.5-MoE's MoE and Gated DeltaNet).

Each term is a count of saved tensors of known widths, in the dtype they are saved in: activations in bf16 (2 bytes),
and what the modules compute in fp32 in 4 (transformers' RMSNorm keeps its fp32 input copy and 1/rms; Qwen3.5's keeps
its normalised value in fp32 too; routing probabilities; FLA's decay and norms). Tensors shared by several ops (the
norm's output read by q, k and v; a view of a fused projection) count once, as autograd keeps one storage.

The attention kernels' term is their backward contract on the GPU, not what the CPU reference keeps: FA2 and torch's
varlen attention keep q, k, v, the output (also o_proj's input: one storage) and the log-sum-exp (fp32, one per query
head and token); FLA's ``chunk_gated_delta_rule`` keeps q and k (l2-normalised copies, with their fp32 1/norm),
v, beta, its fp32 decay and the chunk's solved triangular matrix A (64 per value head and token, in k's dtype), and
``causal_conv1d`` keeps its input. The CPU references keep more (per-sequence copies, chunk temporaries), so tests
hold this model against steps run with stand-ins that keep exactly the kernels' tensors (tests/kernels.py).
Qwen4-Exp's QSA layers are the exception: their term is what the patched path's ``gather`` backend keeps
(`hf_packing.ops.sparse_attention`: the K = block_topk·r + r - 1 gathered keys and values per query, their index
and mask, q, SDPA's output and log-sum-exp), and on the GPU it is the same backend, since no varlen kernel takes a
per-query selection. Its indexer selects under ``no_grad`` and keeps nothing. The gathered K·2·H_kv·D per token
grow with the indexer's budget: a budget of 2,048 tokens with 2 kv heads of 256 would keep about 4 MiB per token
and QSA layer.

Not counted: the cos / sin of rotary held by a checkpointed layer's keyword arguments (2·head_dim per token, once),
the transient peak of one layer's recompute in backward, the logits of one loss chunk, allocator fragmentation, and
a few constants of a step (the expert offsets of grouped matmuls; the fp32 weight copy of the (1 + weight) norm after
the layers: 4·H bytes, 4·C·H for Qwen4-Exp's final hyper-connection).
`training_state_bytes` counts what adds to them at the peak (weights, gradients, AdamW moments); ``hf-packing stats``
and ``recipes/train.py --gpu_memory_gib`` add the two for the largest pack the budgets allow (docs/performance.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MODELLED", "ActivationMemory", "training_state_bytes"]

#: the families whose module trees `ActivationMemory.from_model` counts (held against saved_tensors_hooks in
#: tests/test_memory.py); the others keep other tensors and are refused rather than guessed
MODELLED = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "glm4v",
    "glm4v_moe",
    "glm46v",
    "qwen4_exp",
)

ACT, FP32, INDEX = 2.0, 4.0, 8.0  # bytes: a bf16 activation, an fp32 one, an int64 index
INT32, BOOL = 4.0, 1.0  # bytes: an int32 index, a bool mask
_LAYER_NORMS = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")


def _norm_bytes(norm: Any, width: float) -> float:
    """Bytes a norm over rows of ``width`` keeps per row (its input when that is its own fp32 copy, 1/rms or
    mean/rstd, the normalised value); its output is counted by whoever reads it."""
    if isinstance(norm, torch.nn.LayerNorm):
        return ACT * width + 2 * ACT  # input, mean and rstd in the input's dtype
    if hasattr(norm, "variance_epsilon"):  # weight * x_normed.to(dtype): fp32 input copy, 1/rms, bf16 normalised
        return (FP32 + ACT) * width + FP32
    # (1 + weight) * x_normed in fp32 (Qwen3.5): fp32 input and normalised value, 1/rms per group (Qwen4-Exp's
    # norms over the hyper-connection streams normalise each stream: group_size = hidden)
    groups = width // norm.group_size if getattr(norm, "group_size", None) else 1
    return 2 * FP32 * width + FP32 * groups


def _norm_fixed(layers: Any) -> float:
    """Bytes per step of the (1 + weight) norms' fp32 ``1 + weight`` (their product keeps it: one per call)."""
    norms = [m for m in layers.modules() if hasattr(m, "eps") and not hasattr(m, "variance_epsilon")]
    return sum(FP32 * m.weight.numel() for m in norms if not isinstance(m, torch.nn.LayerNorm))


def _mlp_bytes(mlp: Any, act: str) -> float:
    """A dense MLP's bytes per token beyond its input: SwiGLU keeps gate, act(gate), up and their product (GLM's fused
    gate‖up: its output, act(gate), the product); a plain MLP keeps fc1's output (QuickGELU: and its sigmoid) and the
    activation's output."""
    if hasattr(mlp, "gate_proj"):
        return 4 * ACT * mlp.gate_proj.out_features
    if isinstance(getattr(mlp, "gate_up_proj", None), torch.nn.Linear):
        return 2 * ACT * mlp.gate_up_proj.out_features
    fc1 = getattr(mlp, "fc1", None) or mlp.linear_fc1
    return (3 if act == "quick_gelu" else 2) * ACT * fc1.out_features


def _attention_bytes(attn: Any, text: Any) -> float:
    """A softmax-attention layer's bytes per token beyond its input (the norm's output), under FA2 / varlen."""
    heads, kv = text.num_attention_heads, text.num_key_value_heads
    dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    q, k = heads * dim, kv * dim
    total = ACT * (q + 2 * k + q) + FP32 * heads  # q, k (rotated copies), v, output, log-sum-exp
    if getattr(attn, "q_norm", None) is not None:  # per-head norms, their output rotated into a new tensor
        total += _norm_bytes(attn.q_norm, dim) * heads + _norm_bytes(attn.k_norm, dim) * kv
    if attn.q_proj.out_features == 2 * q:  # output gate (Qwen3.5): sigmoid(gate) and the gated output o_proj reads
        total += 2 * ACT * q
    return total


def _qsa_bytes(attn: Any, text: Any) -> float:
    """A Qwen4-Exp QSA ("indexed_attention") layer's bytes per token beyond its input, under the patched path.

    The indexer's selection runs under ``no_grad`` and keeps nothing. The ``gather`` backend
    (`hf_packing.ops.sparse_attention`) attends each query's K = block_topk·r + r - 1 gathered keys and gathers
    them again in backward: it keeps q, the layer's k and v, the int32 index and bool validity (K per query), its
    output and fp32 log-sum-exp (one per query head), never the gathered keys and values. On the GPU it is the same
    backend (no varlen kernel takes a per-query selection) and the same tensors; its fp32 workspace (one query
    chunk's gathered keys, values and scores) is transient. With attention dropout it runs SDPA under autograd
    instead, which keeps the gathered chunks: not modelled (Qwen4-Exp trains without attention dropout).
    """
    heads, kv = text.num_attention_heads, text.num_key_value_heads
    dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    q = heads * dim
    indexer = attn.indexer
    keys = indexer.block_topk * indexer.compress_ratio + indexer.compress_ratio - 1
    norms = _norm_bytes(attn.q_norm, dim) * heads + _norm_bytes(attn.k_norm, dim) * kv
    # q (rotated), the attention's output, sigmoid(gate) and the gated output o_proj reads; k and v
    return norms + 4 * ACT * q + 2 * ACT * kv * dim + FP32 * heads + keys * (INT32 + BOOL)


def _hyper_connection_bytes(hc: Any, hidden: int) -> float:
    """A Qwen4-Exp hyper-connection (``GatedResidual``) over C streams: its grouped norm, the normalised streams
    (read by the low-rank mix, the mixing product and the injection's projection), the mix's silu input and output
    and its sigmoid; with a block after it, the injection's sigmoid, 2·sigmoid and the block's output (their product
    keeps both)."""
    streams = hc.hc_count
    width = streams * hidden
    rank = hc.input_mix_weight_down.out_features
    total = _norm_bytes(hc.hc_norm, width) + 2 * ACT * width + 2 * ACT * rank
    if hc.block_inject_weight is not None:
        total += 2 * ACT * streams + ACT * hidden
    return total


def _ple_bytes(ple: Any, hidden: int) -> float:
    """A Qwen4-Exp Per-Layer Embedding's bytes per token, under the patched path: the hashed n-gram ids, their
    embedding (read by the key and value projections), three grouped norms, the normalised key and query, the gate's
    abs / clamp / sqrt / sign / sigmoid per stream, the value, and the dilated conv (`masked_causal_conv1d`): its
    padded input (the padding once per step: `_ple_fixed`), one bool mask per tap, silu's input."""
    streams = ple.hc_count
    width = streams * hidden
    embedding = ple.key_proj.in_features
    ids = INDEX * ple.ple_embedding.ngram_heads
    norms = sum(_norm_bytes(norm, width) for norm in (ple.norm_key, ple.norm_query, ple.norm_conv))
    gate = 2 * ACT * width + 5 * ACT * streams + ACT * hidden
    conv = 2 * ACT * width + ple.conv1d.kernel_size[0]
    return ids + ACT * embedding + norms + gate + conv


def _ple_fixed(ple: Any) -> float:
    """Bytes per step of a PLE conv's left padding ((kernel - 1)·dilation columns of its bf16 input)."""
    conv = ple.conv1d
    return ACT * conv.in_channels * (conv.kernel_size[0] - 1) * conv.dilation[0]


def _linear_attention_bytes(attn: Any, text: Any) -> float:
    """A Gated DeltaNet layer's bytes per token beyond its input, under FLA's kernels."""
    hk, hv = text.linear_num_key_heads, text.linear_num_value_heads
    dk, dv = text.linear_key_head_dim, text.linear_value_head_dim
    conv = 2 * hk * dk + hv * dv
    kernel = ACT * (2 * hk * dk + hv * dv + hv * 64) + 2 * FP32 * hk  # q, k, v, A; 1/norm of q and k
    gates = 3 * FP32 * hv + ACT * hv  # decay: softplus input, its output, g (fp32); beta = sigmoid(b)
    norm = hv * (3 * FP32 * dv + 2 * ACT * dv + FP32)  # gated RMSNorm per value head: fp32 x, normed, gate; 1/rms
    return ACT * conv + kernel + gates + norm + ACT * hv * dv  # conv input; ...; out_proj's input


def _moe_bytes(mlp: Any, text: Any) -> float:
    """An MoE block's bytes per token beyond its input: the router, each of the k experts a token visits, and the
    shared expert with its gate (Qwen3.5-MoE)."""
    k, experts = text.num_experts_per_tok, text.num_experts
    width = text.moe_intermediate_size
    router = FP32 * (experts + k + 1) + INDEX * k  # probabilities, top-k values and their sum, top-k indices
    # per visit: the gathered input and the expert's output, gate‖up, act(gate), the product, the routing weight,
    # three int64 indices (sort, gather, scatter)
    routed = k * (2 * ACT * text.hidden_size + 4 * ACT * width + ACT + 3 * INDEX)
    shared = getattr(mlp, "shared_expert", None)
    if shared is None:
        return router + routed
    return router + routed + _mlp_bytes(shared, "silu") + ACT * (text.hidden_size + 1)  # its output, sigmoid gate


def _glm_moe_bytes(mlp: Any, text: Any) -> float:
    """A GLM-4.5V MoE block's bytes per token beyond its input: the sigmoid router (DeepSeek-V3's grouped top-k), each
    of the k experts a token visits (its routing weight in fp32), and the shared experts (no gate)."""
    gate = mlp.gate
    k, experts, groups = gate.top_k, gate.num_experts, gate.num_group
    # fp32 input copy, sigmoid scores, the group top-2's and the top-groups' indices, the expert mask (bool), the
    # top-k indices; normalised: the weights and their sum
    router = FP32 * (text.hidden_size + experts) + INDEX * (2 * groups + gate.topk_group + k) + experts
    if gate.norm_topk_prob:
        router += FP32 * (k + 1)
    routed = k * (2 * ACT * text.hidden_size + 4 * ACT * text.moe_intermediate_size + FP32 + 3 * INDEX)
    return router + routed + _mlp_bytes(mlp.shared_experts, "silu")


def _moe_fixed(lm: Any) -> float:
    """Bytes per step that no count scales: the fp32 copy of each GLM router's weight (its linear keeps it)."""
    gates = [
        layer.mlp.gate for layer in lm.layers if hasattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias")
    ]
    return sum(FP32 * g.weight.numel() for g in gates)


@dataclass(frozen=True)
class ActivationMemory:
    """Bytes autograd keeps for backward, per unit of a pack's counts (see the module docstring).

    Attributes:
        token (`float`): per real token, checkpointing off: input ids, rotary cos / sin, every decoder layer, the
            final norm.
        token_checkpointed (`float`): the same with every decoder layer keeping only its input.
        supervised (`float`): per supervised token (the loss keeps its hidden state, label and index).
        patch / patch_checkpointed (`float`): per vision patch, the tower trained: pixels, blocks, mergers.
        merged (`float`): per merged vision token, in the decoder (the scattered embeddings, DeepStack's additions).
        merge (`int`): m, the spatial merge size (a merged token is m² patches).
        vision_trainable (`bool`): any tower parameter trains; a frozen tower runs without autograd and keeps
            nothing, its merged tokens only their index into the sequence.
        fixed (`float`): per step whatever the counts, checkpointing off: the fp32 copies of the (1 + weight)
            norms' weights and of each GLM router's weight, the PLE convs' left padding.
        patch_fixed (`float`): per step with patches, the tower trained: GLM's position table, in fp32 for
            grid_sample.
    """

    token: float
    token_checkpointed: float
    supervised: float
    patch: float = 0.0
    patch_checkpointed: float = 0.0
    merged: float = 0.0
    merge: int = 1
    vision_trainable: bool = True
    fixed: float = 0.0
    patch_fixed: float = 0.0

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> ActivationMemory:
        """Counts of a transformers ``ForConditionalGeneration`` of a `MODELLED` family (unwrapped; the meta device
        will do)."""
        config: Any = model.config  # a transformers PretrainedConfig (ops import no transformers)
        if config.model_type not in MODELLED:
            raise ValueError(
                f"the activation-memory model covers {', '.join(MODELLED)}, not model_type {config.model_type!r}: "
                "choose gradient checkpointing yourself (drop gpu_memory_gib)"
            )
        text = config.get_text_config()
        inner: Any = getattr(model, "model", model)
        lm: Any = getattr(inner, "language_model", inner)
        hidden = text.hidden_size
        heads = text.num_attention_heads
        dim = getattr(text, "head_dim", None) or hidden // heads
        rotary = int(dim * (getattr(text, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0))
        layers, fixed = 0.0, _moe_fixed(lm) + _norm_fixed(lm.layers)
        for layer in lm.layers:
            # GLM-4.1V's sandwich norms: the post-mixer and post-MLP norms' outputs go into the residual sum only
            norm = sum(_norm_bytes(getattr(layer, name), hidden) for name in _LAYER_NORMS if hasattr(layer, name))
            if hasattr(layer, "attn_hyper_connection"):  # Qwen4-Exp: hyper-connections in place of the norms
                norm += sum(
                    _hyper_connection_bytes(hc, hidden)
                    for hc in (layer.mlp_hyper_connection, layer.attn_hyper_connection)
                )
            if getattr(layer, "ple", None) is not None:
                norm += _ple_bytes(layer.ple, hidden)
                fixed += _ple_fixed(layer.ple)
            if getattr(layer, "linear_attn", None) is not None:
                mixer = _linear_attention_bytes(layer.linear_attn, text)
            elif hasattr(layer.self_attn, "indexer"):
                mixer = _qsa_bytes(layer.self_attn, text)
            else:
                mixer = _attention_bytes(layer.self_attn, text)
            if hasattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias"):
                mlp = _glm_moe_bytes(layer.mlp, text)
            elif hasattr(layer.mlp, "experts"):
                mlp = _moe_bytes(layer.mlp, text)
            else:
                mlp = _mlp_bytes(layer.mlp, "silu")
            layers += norm + 2 * ACT * hidden + mixer + mlp  # the two pre-norms' outputs, read by the mixer and MLP
        mixer_out: Any = getattr(lm, "hyper_connection_mixer", None)  # Qwen4-Exp: the streams mixed into one
        if mixer_out is None:
            outside = INDEX + _norm_bytes(lm.norm, hidden)  # input ids, final norm
        else:
            outside = INDEX + _hyper_connection_bytes(mixer_out, hidden)
        streams = getattr(text, "hc_count", 1) if mixer_out is not None else 1  # a layer's input: C streams
        counts = cls(
            token=outside + 2 * ACT * rotary + layers,  # cos / sin: once, shared by the layers
            token_checkpointed=outside + len(lm.layers) * ACT * hidden * streams,
            supervised=ACT * hidden + 2 * INDEX,
            fixed=fixed,
        )
        tower: Any = getattr(inner, "visual", None)
        if tower is None:
            return counts
        return dataclasses.replace(counts, **_tower_bytes(tower, config.vision_config, hidden))

    def saved_bytes(
        self, *, tokens: float, patches: float = 0.0, supervised: float | None = None, checkpointing: bool = False
    ) -> float:
        """Bytes kept for backward by one step on a pack of ``tokens`` real tokens (``supervised`` of them with a
        label; default all), ``patches`` vision patches (Σ t·h·w), gradient checkpointing off or on (every decoder
        layer and tower block)."""
        supervised = tokens if supervised is None else supervised
        text = tokens * (self.token_checkpointed if checkpointing else self.token) + supervised * self.supervised
        text += 0.0 if checkpointing else self.fixed
        if not self.vision_trainable:  # the tower ran without autograd: only the scatter's index into the tokens
            return text + patches / self.merge**2 * INDEX
        tower = patches * (self.patch_checkpointed if checkpointing else self.patch)
        tower += self.patch_fixed if patches else 0.0
        return text + tower + patches / self.merge**2 * self.merged


def _tower_bytes(tower: Any, vc: Any, text_hidden: int) -> dict[str, Any]:
    """`ActivationMemory`'s vision fields (per patch; merged tokens per m² patches)."""
    fields = vc.to_dict()  # getattr(vc, "window_size", None) raises on Qwen3-VL's per-layer config in 5.23
    width = fields.get("embed_dim") or vc.hidden_size  # Qwen2-VL: hidden_size is its output
    heads, merge = vc.num_heads, vc.spatial_merge_size
    patch_dim = 3 * vc.temporal_patch_size * vc.patch_size**2
    act = str(fields.get("hidden_act", ""))
    per_block = 0.0
    for block in tower.blocks:
        attention = ACT * (2 * width + 3 * width + width) + FP32 * heads  # rotated q, k; fused qkv (v's storage); out
        norms = _norm_bytes(block.norm1, width) + _norm_bytes(block.norm2, width)
        per_block += norms + 2 * ACT * width + attention + _mlp_bytes(block.mlp, act)
    windows = 2 * INDEX / merge**2 if fields.get("fullatt_block_indexes") and fields.get("window_size") else 0.0
    positions = 4 * INDEX + 4 * FP32 if fields.get("num_position_embeddings") else 0.0  # bilinear ids and weights
    merger: Any = tower.merger
    deepstack = list(getattr(tower, "deepstack_merger_list", None) or [])
    table = 0.0
    if hasattr(tower, "downsample"):  # GLM-V: RMSNorms after the patch embedding and the blocks, a conv downsample
        positions = 2 * FP32  # grid_sample's sampling grid (and, once per step, its fp32 table: patch_fixed)
        table = FP32 * tower.embeddings.position_embedding.weight.numel()
        positions += _norm_bytes(tower.post_conv_layernorm, width)
        # per merged token: proj's input, the LayerNorm (its input is proj's output), GELU's input, the SwiGLU's
        # input, and the SwiGLU
        merged_width = merger.proj.in_features
        per_merged = ACT * 3 * merged_width + _norm_bytes(merger.post_projection_norm, merged_width)
        # the post-blocks norm, its output (the downsample conv's input)
        mergers = _norm_bytes(tower.post_layernorm, width) + ACT * width
        mergers += (per_merged + _mlp_bytes(merger, act)) / merge**2
    else:
        merger_norm = getattr(merger, "ln_q", None) or merger.norm
        mergers = _norm_bytes(merger_norm, width) + 3 * ACT * width  # fc1's input, the activation's input and output
        # a DeepStack merger's norm reads the block output that the next block (or the merger) already keeps
        mergers += len(deepstack) * (2 * ACT / merge**2 + 3 * ACT * width)
    outside = ACT * patch_dim + windows + positions  # the pixels (patch embedding's input)
    return {
        "patch": outside + 2 * FP32 * (width // heads) + per_block + mergers,  # rotary cos / sin (fp32), once
        "patch_checkpointed": outside + len(tower.blocks) * ACT * width + mergers,
        "merged": (1 + len(deepstack)) * (ACT * text_hidden + INDEX),
        "merge": merge,
        "vision_trainable": any(p.requires_grad for p in tower.parameters()),
        "patch_fixed": table,
    }


def training_state_bytes(model: torch.nn.Module, *, optimizer_bytes_per_param: float | None = None) -> dict[str, float]:
    """Weights, gradients and optimizer state of ``model`` in bytes: weights and gradients in the parameters' dtype
    (trainable ones only get a gradient and optimizer state); torch's AdamW keeps two moments in the parameter's
    dtype (``optimizer_bytes_per_param`` overrides: 8 for fp32 moments of bf16 weights)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = sum(p.numel() * p.element_size() for p in trainable)
    if optimizer_bytes_per_param is None:
        optimizer = float(2 * grads)
    else:
        optimizer = optimizer_bytes_per_param * sum(p.numel() for p in trainable)
    return {"weights": float(weights), "grads": float(grads), "optimizer": float(optimizer)}
