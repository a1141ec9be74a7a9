"""`training_flops` against `torch.utils.flop_counter.FlopCounterMode`, module by module, every family.

FlopCounterMode counts matmuls and convolutions (and sdpa only on CUDA kernels), so the references run with
``attn_implementation="eager"``: attention becomes ``bmm`` calls, one per vision unit (frame or window) and one
per text document (each document runs alone, unpadded). The text reference halves those ``bmm`` FLOPs (the
convention counts causal attention as half the square) and adds the LM head's 6·H·V per token analytically.
MoE experts run their eager loop (``grouped_mm`` is not counted). Qwen3.5's Gated DeltaNet recurrence is
stubbed in the reference and its model-FLOP term 18·S·T left out of ours: the projections and the conv are
compared, the recurrence's term is a convention (see `hf_packing.training.flops`). Qwen4-Exp's QSA layers: the
reference scales their ``bmm`` by the fraction of the square transformers' own indexer keeps (its selection and the
causal mask), and counts the indexer's projections and per-query scoring ``mm`` as they run (forward only).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hf_packing.patches import frames_as_images
from hf_packing.patches._vision import frame_grids
from hf_packing.testing.tiny import GLM_TYPES, MODEL_TYPES, build_tiny_model
from hf_packing.training.flops import cost_model, text_flops
from hf_packing.training.telemetry import training_flops

#: an image-heavy pack (each image ≥ 1,000 patches, one with edge windows) and a video pack
PACKS = {
    "images": [[1, 32, 36], [1, 40, 26]],
    "video": [[4, 12, 16]],
}


def _sum_outputs(output) -> torch.Tensor:
    """Σ of every tensor in a tower output (pooler_output per item, DeepStack features, ...)."""
    values = output.values() if hasattr(output, "values") else [output]
    total = torch.zeros(())
    for value in values:
        for t in value if isinstance(value, (tuple, list)) else [value]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                total = total + t.float().sum()
    return total


def _tower_reference(model, grid: torch.Tensor, train: bool) -> float:
    tower = model.model.visual
    if frames_as_images(model.config):  # GLM-V's tower takes a video's frames as images, as get_video_features does
        grid = frame_grids(grid, n_images=0)
    in_dim = math.prod(tower.patch_embed.proj.weight.shape[1:])
    pixels = torch.randn(int(grid.prod(-1).sum()), in_dim)
    with FlopCounterMode(display=False) as counter:
        if train:
            _sum_outputs(tower(pixels, grid_thw=grid)).backward()
        else:
            with torch.no_grad():
                tower(pixels, grid_thw=grid)
    return float(counter.get_total_flops())


@pytest.fixture(scope="module", params=MODEL_TYPES + GLM_TYPES)
def eager_model(request):
    # eager experts: a loop of mm over the routed tokens (grouped_mm is not counted by FlopCounterMode)
    return build_tiny_model(request.param, attn_implementation="eager", experts_implementation="eager").train()


@pytest.mark.parametrize("pack", list(PACKS))
@pytest.mark.parametrize("frozen", [False, True])
def test_vision_flops_equal_flop_counter_on_the_tower(eager_model, pack, frozen):
    grid = torch.tensor(PACKS[pack])
    eager_model.model.visual.requires_grad_(not frozen)
    try:
        reference = _tower_reference(eager_model, grid, train=not frozen)
        ours = training_flops(eager_model, {"input_ids": torch.zeros(1, 8, dtype=torch.long), "image_grid_thw": grid})
    finally:
        eager_model.model.visual.requires_grad_(True)
    print(f"{eager_model.config.model_type} {pack} frozen={frozen}: ours {ours['vision']:.4e} ref {reference:.4e}")
    assert ours["vision"] == pytest.approx(reference, rel=0.03)


def _kept_fraction(model, n: int, monkeypatch) -> list[float]:
    """Qwen4-Exp: record, per QSA layer call, the fraction of the ``n × n`` square that transformers' own indexer
    keeps (its selection AND the causal mask)."""
    indexer = type(model.model.language_model.layers[1].self_attn.indexer)
    original, kept = indexer.forward, []

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values):
        selected = original(self, hidden_states, position_embeddings, attention_mask, past_key_values)
        visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        kept.append((selected & visible).sum().item() / n**2)
        return selected

    monkeypatch.setattr(indexer, "forward", forward)
    return kept


def _text_reference(model, lengths: list[int], monkeypatch=None) -> float:
    """Decoder layers run per document under FlopCounterMode, attention ``bmm`` halved (Qwen4-Exp's QSA layers:
    scaled by the fraction of the square transformers' indexer keeps), + LM head 6·H·V·T."""
    config = model.config.get_text_config()
    qsa = getattr(config, "indexer_compress_ratio", None) is not None
    total = 0.0
    for n in lengths:
        embeds = torch.randn(1, n, config.hidden_size, requires_grad=True)
        positions = torch.arange(n).expand(3, 1, -1)
        # Qwen4-Exp's PLE reads token ids: given with inputs_embeds, or it would reverse the embedding
        ids = {"ple_input_ids": torch.randint(0, config.vocab_size, (1, n))} if qsa else {}
        kept = _kept_fraction(model, n, monkeypatch) if qsa else []
        with FlopCounterMode(display=False) as counter:
            model.model.language_model(
                inputs_embeds=embeds, position_ids=positions, use_cache=False, **ids
            ).last_hidden_state.sum().backward()
        ops = {str(op): c for op, c in counter.get_flop_counts()["Global"].items()}
        if kept:  # every softmax layer is a QSA layer: its dense bmm (forward and backward) times what it keeps
            ops["aten.bmm"] = 2 * ops["aten.bmm"] * sum(kept) / len(kept)
        if "aten.convolution_backward" in ops:
            # Qwen3.5's depthwise conv: torch 2.14's counter ignores `groups` for the input gradient (129× the
            # forward for 128 channels); its backward is the input + weight gradient, 2× the forward
            ops["aten.convolution_backward"] = 2 * ops["aten.convolution"]
        total += sum(c / 2 if op == "aten.bmm" else c for op, c in ops.items())
    return total + 6.0 * config.hidden_size * config.vocab_size * sum(lengths)


def _no_recurrence(query, key, value, g, beta, **kwargs):
    """Gated DeltaNet's recurrence as an elementwise stand-in: its torch reference executes the chunked
    algorithm's matmuls, not the model FLOPs, so the reference counts projections and conv only."""
    return value * beta[..., None] + 0 * g[..., None, None].sum(), None


@pytest.mark.parametrize("lengths", [[37], [64, 9, 120]])
def test_text_flops_equal_flop_counter_on_the_decoder_layers(eager_model, lengths, monkeypatch):
    ours = text_flops(eager_model, lengths)
    config = eager_model.config.get_text_config()
    expected = ours
    if eager_model.config.model_type.startswith(("qwen3_5", "qwen4_exp")):
        module = __import__(type(eager_model).__module__, fromlist=["torch_chunk_gated_delta_rule"])
        monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", _no_recurrence)
        state = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
        expected -= 18.0 * config.layer_types.count("linear_attention") * state * sum(lengths)
    reference = _text_reference(eager_model, lengths, monkeypatch)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    assert training_flops(eager_model, {"input_ids": torch.zeros(1, sum(lengths)), "cu_seqlens": cu})["text"] == ours
    print(f"{eager_model.config.model_type} {lengths}: ours {expected:.6e} ref {reference:.6e}")
    assert expected == pytest.approx(reference, rel=0.03)


def test_negative_control_full_square_attention_is_off():
    """Counting the causal attention as the full square must miss the reference by more than the tolerance."""
    model = build_tiny_model("qwen2_5_vl", attn_implementation="eager").train()
    config = model.config.get_text_config()
    lengths = [200]
    d = config.num_attention_heads * config.head_dim if getattr(config, "head_dim", None) else config.hidden_size
    full_square = text_flops(model, lengths) + 6.0 * config.num_hidden_layers * d * 200**2
    assert full_square != pytest.approx(_text_reference(model, lengths), rel=0.03)


def test_linear_attention_term_is_linear_in_tokens():
    """Qwen3.5: a Gated DeltaNet layer costs 18·S per token (S its state size; a convention, left out of the
    FlopCounterMode comparison above), so splitting a document changes only the softmax layers' term. By hand for
    the tiny config (layers: one linear, one full attention of 4 heads × 64 = d 256): splitting 1000 tokens in two
    halves saves 6·256·(1000² − 2·500²) = 768,000,000 FLOPs; 2000 tokens cost twice 1000 plus 6·256·(2000² − 2·1000²)
    = 3,072,000,000 (every per-token term, the recurrence's included, cancels)."""
    model = build_tiny_model("qwen3_5")
    counts = cost_model(model)
    assert (counts.attention_layers, counts.linear_layers, counts.linear_state) == (1, 1, 4 * 16 * 16)
    assert counts.attention_dim == 256
    one_doc, two_docs = text_flops(model, [1000]), text_flops(model, [500, 500])
    assert one_doc - two_docs == 768_000_000
    assert text_flops(model, [2000]) - 2 * one_doc == 3_072_000_000


def test_negative_control_qsa_counted_as_dense_attention_is_off(monkeypatch):
    """Qwen4-Exp: counting its QSA layer as dense causal attention (what ``text(tokens, sum_sq_lens)`` gives, the
    telemetry's upper bound) must miss the reference by more than the tolerance; `text_flops` (exact per query's
    selected keys) meets it."""
    model = build_tiny_model("qwen4_exp", attn_implementation="eager", experts_implementation="eager").train()
    module = __import__(type(model).__module__, fromlist=["torch_chunk_gated_delta_rule"])
    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", _no_recurrence)
    counts, lengths = cost_model(model), [120]
    recurrence = 18.0 * counts.linear_layers * counts.linear_state * sum(lengths)
    reference = _text_reference(model, lengths, monkeypatch)
    dense = counts.text(tokens=120.0, sum_sq_lens=120.0**2) - recurrence
    ours = text_flops(model, lengths) - recurrence
    print(f"qwen4_exp {lengths}: dense {dense:.4e}, ours {ours:.4e}, ref {reference:.4e}")
    assert dense != pytest.approx(reference, rel=0.03)
    assert ours == pytest.approx(reference, rel=0.03)
