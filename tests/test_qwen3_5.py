"""Qwen3.5 / Qwen3.5-MoE: packed and padded batches equal every sample run alone, unpadded, on the unpatched model.

The oracle is the strongest one available: no padding, no packing, transformers' own code (its torch fallbacks for
the Gated DeltaNet conv and delta rule). The patched loss is Σ token CE / Σ supervised tokens; the oracle sums
each sample's CE (its mean × its count) over the same total, and accumulates gradients with the same weights.
Layouts: padded rows (right, left), one packed row with ``cu_seq_lens_q`` (VisionCollator ``mode="flat"``,
transformers' flash kwargs), and one packed row with only position ids (``DataCollatorWithFlattening``-style).
The conversations cover text-only, one and two images, multi-turn and a video.
"""

from __future__ import annotations

import functools

import pytest
import torch

import hf_packing
from hf_packing import VisionCollator
from hf_packing.ops import linear_attention
from hf_packing.ops.varlen import PackedSequences
from hf_packing.patches import is_applied
from tests.helpers import (
    GRAD_RTOL,
    LOSS_RTOL,
    ROW_KEYS,
    assert_equivalent,
    assert_within_2x,
    each_sample_alone,
    load_processor,
    loss_and_grads,
    model_and_processor,
    processed_batch,
    processed_samples,
)
from tests.kernels import KernelContractError, install_linear_kernels

FAMILIES = ("qwen3_5", "qwen3_5_moe")
LAYOUTS = ("padded_right", "padded_left", "packed_cu_seqlens", "packed_position_ids")


@functools.cache
def _oracle(model_type: str) -> tuple[float, dict[str, torch.Tensor]]:
    """Each sample alone on the unpatched model; tests take it before they patch anything."""
    assert not is_applied(model_type), "the oracle runs on the unpatched model"
    model, processor = model_and_processor(model_type)
    return each_sample_alone(model, processed_samples(processor))


def layout_batch(model, model_type: str, layout: str) -> dict:
    """The conversations as one batch in ``layout``."""
    processor = load_processor(model_type, "left" if layout == "padded_left" else "right")
    if layout.startswith("padded"):
        return processed_batch(processor)
    batch = VisionCollator(processor, mode="flat", model_config=model.config)(processed_samples(processor))
    if layout == "packed_position_ids":
        batch = {k: v for k, v in batch.items() if not k.startswith(("cu_seq_lens", "max_length"))}
    return batch


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_patched_equals_each_sample_alone_unpatched(model_type, layout):
    oracle, (model, _) = _oracle(model_type), model_and_processor(model_type)
    batch = layout_batch(model, model_type, layout)
    hf_packing.apply_rmpad(model_type)
    assert_equivalent(oracle, loss_and_grads(model, batch), f"{model_type}/{layout} vs each alone")


def _unpatched_padded_report(model_type: str, side: str) -> None:
    model, processor = model_and_processor(model_type, side)
    assert_equivalent(
        _oracle(model_type),
        loss_and_grads(model, processed_batch(processor)),
        f"{model_type}/unpatched padded {side} vs each alone",
    )


@pytest.mark.parametrize("model_type", FAMILIES)
def test_unpatched_baselines_reported(model_type):
    """What the unpatched model gives on the same batches (printed), against the same oracle.

    - Padded rows, right or left: equal within tolerance. transformers (5.17-5.23) zeroes padded hidden states
      before the linear-attention projections (``apply_mask_to_padding_states``); with no biases, a pad's q/k/v are
      0, so the recurrent state stays 0 and the conv reads zeros: left padding cannot leak. The differences left
      are round-off (images batched in one vision-tower call instead of one call per sample).
    - One packed row with ``cu_seq_lens_q``: transformers 5.23's torch fallback refuses it ("can't keep packed
      sequences apart without flash-linear-attention"); 5.17's ignores it and the samples read each other.
    - One packed row with position ids only: the softmax layers see the boundaries (mask from position ids), the
      linear-attention layers do not: the samples read each other, far beyond the tolerance.
    """
    for side in ("right", "left"):
        _unpatched_padded_report(model_type, side)
    model, _ = model_and_processor(model_type)
    for layout in ("packed_cu_seqlens", "packed_position_ids"):
        try:
            unpatched = loss_and_grads(model, layout_batch(model, model_type, layout))
        except ValueError as refused:
            assert layout == "packed_cu_seqlens" and "can't keep packed sequences apart" in str(refused)
            print(f"{model_type}/unpatched {layout}: refused ({refused})")
            continue
        with pytest.raises(AssertionError):
            assert_equivalent(_oracle(model_type), unpatched, f"{model_type}/unpatched {layout} vs each alone")


def _ignoring_boundaries(fn, seqs_at: int):
    """``fn`` called with the whole flat row as one sequence (its positional argument ``seqs_at`` replaced)."""

    def merged(*args, **kwargs):
        args = list(args)
        seqs = args[seqs_at]
        args[seqs_at] = PackedSequences.from_seqlens([sum(seqs.seqlens)], device=seqs.cu_seqlens.device)
        return fn(*args, **kwargs)

    return merged


def _linear_layer_output(model, batch) -> torch.Tensor:
    """``(T, hidden)`` output of the first decoder layer (Gated DeltaNet), for a batch of one unpadded row."""
    model.eval()
    with torch.no_grad():
        out = model(
            **{k: v for k, v in batch.items() if k != "labels"} | {"use_cache": False}, output_hidden_states=True
        )
    model.train()
    return out.hidden_states[1][0]


@pytest.mark.parametrize("ignored", ["conv_window", "recurrent_state", "both"])
def test_negative_control_ignoring_boundaries_in_linear_layers(ignored, monkeypatch):
    """The same pack, patched, with the boundaries dropped in the linear-attention layers only (the softmax layers
    keep theirs): the gradients and the linear layer's output differ from each sample alone by orders of magnitude
    more than the tolerance, for the conv window alone, the recurrent state alone, and both. (The loss of a random
    tiny model, near ln(vocab) for any input, moves less.)"""
    model_type = "qwen3_5"
    (ref_loss, ref_grads), (model, processor) = _oracle(model_type), model_and_processor(model_type)
    batch = layout_batch(model, model_type, "packed_cu_seqlens")
    alone = torch.cat(
        [
            _linear_layer_output(model, {k: (v[None] if k in ROW_KEYS else v) for k, v in s.items()})
            for s in processed_samples(processor)
        ]
    )
    layer_diff = lambda: ((_linear_layer_output(model, batch) - alone).abs().max() / alone.abs().max()).item()  # noqa: E731
    hf_packing.apply_rmpad(model_type)
    kept = layer_diff()
    if ignored in ("conv_window", "both"):
        monkeypatch.setattr(linear_attention, "causal_conv1d", _ignoring_boundaries(linear_attention.causal_conv1d, 4))
    if ignored in ("recurrent_state", "both"):
        monkeypatch.setattr(
            linear_attention, "gated_delta_rule", _ignoring_boundaries(linear_attention.gated_delta_rule, 5)
        )
    loss, grads = loss_and_grads(model, batch)
    loss_err = abs(loss - ref_loss) / abs(ref_loss)
    grad_err = max(((grads[n] - g).norm() / g.norm()).item() for n, g in ref_grads.items())
    dropped = layer_diff()
    print(
        f"{model_type}, {ignored} ignored: linear layer output max rel diff {dropped:.2e} (boundaries kept: "
        f"{kept:.2e}); loss rel {loss_err:.2e} (tolerance {LOSS_RTOL:.0e}); worst grad rel {grad_err:.2e} "
        f"(tolerance {GRAD_RTOL:.0e})"
    )
    assert kept < 1e-5 and dropped > 1e-2 and grad_err > 100 * GRAD_RTOL


@pytest.mark.parametrize("model_type", FAMILIES)
def test_fla_path_through_strict_stand_ins(model_type, monkeypatch):
    """linear_backend='fla' on CPU through stand-ins that refuse what FLA refuses: fp32 equals each sample alone,
    and every linear-attention layer called both kernels once, with int64 cu_seqlens and (1, T, ...) layout."""
    oracle, (model, _) = _oracle(model_type), model_and_processor(model_type)
    calls = install_linear_kernels(monkeypatch)
    batch = layout_batch(model, model_type, "packed_cu_seqlens")
    hf_packing.apply_rmpad(model_type, linear_backend="fla")
    assert_equivalent(oracle, loss_and_grads(model, batch), f"{model_type}/fla stand-ins vs each alone")
    n_linear = model.config.text_config.layer_types.count("linear_attention")
    assert calls == {"chunk_gated_delta_rule": [torch.float32] * n_linear, "causal_conv1d": [torch.float32] * n_linear}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_fla_and_flash_stand_ins_under_autocast(model_type, monkeypatch):
    """fp32 weights + bf16 autocast (the recipes' setup), every kernel a strict stand-in: the linear kernels get
    bf16 q/k/v and x; the error against the fp32 oracle is within 2x of each sample alone under plain autocast."""
    from tests.kernels import install_kernel

    oracle, (model, processor) = _oracle(model_type), model_and_processor(model_type)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = each_sample_alone(model, processed_samples(processor))
    calls = install_linear_kernels(monkeypatch)
    install_kernel(monkeypatch, "flash_attn")
    hf_packing.apply_rmpad(model_type, attn_backend="flash_attn", linear_backend="fla")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        patched = loss_and_grads(model, layout_batch(model, model_type, "packed_cu_seqlens"))
    flat = lambda run: (run[0], torch.cat([run[1][n].float().flatten() for n in sorted(run[1])]))  # noqa: E731
    assert_within_2x(flat(oracle), flat(plain), flat(patched), f"{model_type}/fla+flash/autocast")
    assert set(calls["chunk_gated_delta_rule"]) == set(calls["causal_conv1d"]) == {torch.bfloat16}


def test_stand_ins_refuse_what_fla_refuses():
    from tests import kernels

    q, g = torch.randn(1, 6, 2, 8), torch.rand(1, 6, 4)
    v, cu = torch.randn(1, 6, 4, 8), torch.tensor([0, 2, 6])
    with pytest.raises(KernelContractError, match="LongTensor"):
        kernels.fla_chunk_gated_delta_rule(q, q, v, -g, g, cu_seqlens=cu.int())
    with pytest.raises(KernelContractError, match="batch size is expected to be 1"):
        kernels.fla_chunk_gated_delta_rule(
            q.expand(2, -1, -1, -1),
            q.expand(2, -1, -1, -1),
            v.expand(2, -1, -1, -1),
            -g.expand(2, -1, -1),
            g.expand(2, -1, -1),
            cu_seqlens=cu,
        )
    with pytest.raises(KernelContractError, match="share one of"):
        kernels.fla_chunk_gated_delta_rule(q, q, v.bfloat16(), -g, g, cu_seqlens=cu)
    with pytest.raises(KernelContractError, match="end at the token count 6"):
        kernels.fla_chunk_gated_delta_rule(q, q, v, -g, g, cu_seqlens=torch.tensor([0, 2, 5]))
    x, w = torch.randn(1, 6, 12), torch.randn(12, 4)
    with pytest.raises(KernelContractError, match="weight must be"):
        kernels.fla_causal_conv1d(x.transpose(1, 2), w, cu_seqlens=cu)
    with pytest.raises(KernelContractError, match="LongTensor"):
        kernels.fla_causal_conv1d(x, w, activation="silu", cu_seqlens=cu.int())
    out, _ = kernels.fla_causal_conv1d(x, w, activation="silu", cu_seqlens=cu)
    alone, _ = kernels.fla_causal_conv1d(x[:, 2:], w, activation="silu")
    torch.testing.assert_close(out[:, 2:], alone)  # the second sequence never reads the first


def test_linear_backend_choice_and_errors():
    x = torch.randn(1, 4, 3)
    assert linear_attention.resolve_linear_backend("auto", x) == "reference"
    with pytest.raises(RuntimeError, match="linear_backend='fla' is not available"):
        linear_attention.resolve_linear_backend("fla", x)
    with pytest.raises(ValueError, match="unknown linear_backend"):
        hf_packing.apply_rmpad("qwen3_5", linear_backend="triton")
    if hf_packing._compat.fla_linear_ops() is None:
        with pytest.raises(RuntimeError, match=r"hf_packing\[linear\]"):
            hf_packing.apply_rmpad("qwen3_5", linear_backend="fla")


def test_apply_twice_and_revert_restore_the_kernel_functions():
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as mod

    assert {"qwen3_5", "qwen3_5_moe"} <= set(hf_packing.supported_model_types())
    before = (mod.causal_conv1d_fn, mod.torch_chunk_gated_delta_rule)
    hf_packing.apply_rmpad("qwen3_5_moe")
    patched = (mod.causal_conv1d_fn, mod.torch_chunk_gated_delta_rule)
    hf_packing.apply_rmpad("qwen3_5_moe")
    assert (mod.causal_conv1d_fn, mod.torch_chunk_gated_delta_rule) == patched
    assert all(p.__wrapped__ is b for p, b in zip(patched, before))
    hf_packing.apply_rmpad("qwen3_5_moe", linear_backend="reference")  # other options: re-patched from the originals
    assert all(f.__wrapped__ is b for f, b in zip((mod.causal_conv1d_fn, mod.torch_chunk_gated_delta_rule), before))
    hf_packing.revert_rmpad()
    assert mod.causal_conv1d_fn is before[0] and mod.torch_chunk_gated_delta_rule is before[1]
