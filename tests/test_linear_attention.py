"""The whole-pack forms of Qwen3.5's linear-attention ops (what runs under torch.compile) equal the per-sequence
references (what runs eager): transformers' own torch fallbacks on each sequence alone."""

from __future__ import annotations

import inspect

import pytest
import torch

from hf_packing.ops.linear_attention import (
    masked_causal_conv1d,
    reference_causal_conv1d,
    reference_gated_delta_rule,
    scan_gated_delta_rule,
)
from hf_packing.ops.varlen import PackedSequences, token_sequences

modeling_qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
CHUNK_RULE = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
CONV = inspect.unwrap(modeling_qwen3_5.causal_conv1d_fn)

#: packs with 1-token sequences, a sequence shorter than the conv window, and one longer than a 64-token chunk
PACKS = ([5], [3, 5, 1], [1, 1, 2], [70, 2, 9])


def test_token_sequences():
    seq_id, offsets = token_sequences(PackedSequences.from_seqlens([3, 5, 1]), 9, torch.device("cpu"))
    assert seq_id.tolist() == [1, 1, 1, 2, 2, 2, 2, 2, 3]
    assert offsets.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0]


def _delta_rule_inputs(total: int, generator: torch.Generator) -> list[torch.Tensor]:
    q, k = (torch.randn(1, total, 2, 8, generator=generator) for _ in range(2))  # 2 key heads, 4 value heads
    v = torch.randn(1, total, 4, 6, generator=generator)
    g, beta = -torch.rand(1, total, 4, generator=generator), torch.rand(1, total, 4, generator=generator)
    return [t.requires_grad_(True) for t in (q, k, v, g, beta)]


def _value_and_grads(out: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    grads = torch.autograd.grad(out.square().sum(), inputs)
    return [out.detach(), *grads]


def _delta_rules(seqlens: list[int], boundaries: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    inputs = _delta_rule_inputs(sum(seqlens), torch.Generator().manual_seed(0))
    reference = reference_gated_delta_rule(
        *inputs, PackedSequences.from_seqlens(seqlens), use_qk_l2norm=True, torch_fn=CHUNK_RULE
    )
    scanned = scan_gated_delta_rule(*inputs, PackedSequences.from_seqlens(boundaries), use_qk_l2norm=True)
    return _value_and_grads(scanned, inputs), _value_and_grads(reference, inputs)


def _convs(seqlens: list[int], boundaries: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, 12, sum(seqlens), generator=generator), torch.randn(12, 4, generator=generator)]
    inputs.append(torch.randn(12, generator=generator))
    inputs = [t.requires_grad_(True) for t in inputs]
    reference = reference_causal_conv1d(*inputs, "silu", PackedSequences.from_seqlens(seqlens), torch_fn=CONV)
    masked = masked_causal_conv1d(*inputs, "silu", PackedSequences.from_seqlens(boundaries))
    return _value_and_grads(masked, inputs), _value_and_grads(reference, inputs)


@pytest.mark.parametrize("seqlens", PACKS, ids=str)
@pytest.mark.parametrize("op", [_delta_rules, _convs], ids=["gated_delta_rule", "causal_conv1d"])
def test_whole_pack_form_equals_per_sequence_reference(op, seqlens):
    got, want = op(seqlens, seqlens)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", [_delta_rules, _convs], ids=["gated_delta_rule", "causal_conv1d"])
def test_negative_control_whole_pack_form_without_boundaries(op):
    """The same comparison with the boundaries dropped from the whole-pack form (one sequence over the pack): the
    first sequence still matches, the later ones read it and do not."""
    seqlens = [3, 5, 1]
    (got, *_), (want, *_) = op(seqlens, [sum(seqlens)])
    token_dim = 1 if op is _delta_rules else 2  # (1, T, H, D) and (1, C, T)
    torch.testing.assert_close(got.narrow(token_dim, 0, 3), want.narrow(token_dim, 0, 3), rtol=1e-5, atol=1e-6)
    assert (got.narrow(token_dim, 3, 6) - want.narrow(token_dim, 3, 6)).abs().max() > 1e-2


def test_auto_never_picks_the_linear_reference_on_cuda_silently(monkeypatch):
    """Qwen3.5's ``linear_backend='auto'`` on CUDA with fp32 inputs and autocast off (or without fla) runs the
    per-sequence reference and says why and what to set, once per reason, not once per layer; half precision with
    fla runs the kernels silently, and on CPU the reference is the expected path (no warning). The selection is a
    function of (backend, device, half), checked here without a GPU, as tests/test_varlen.py does for attention."""
    from hf_packing.ops import linear_attention

    cuda = torch.device("cuda", 0)
    fla = {"installed": True}
    monkeypatch.setattr(
        linear_attention,
        "linear_backend_available",
        lambda name, device: name == "reference" or (fla["installed"] and device.type == "cuda"),
    )
    name, why = linear_attention.select_linear_backend("auto", cuda, half=False)
    assert name == "reference" and "fp32 with autocast off" in why and "bf16=True" in why
    assert linear_attention.select_linear_backend("auto", cuda, half=True) == ("fla", None)
    assert linear_attention.select_linear_backend("reference", cuda, half=False) == ("reference", None)  # chosen
    assert linear_attention.select_linear_backend("fla", cuda, half=False) == ("fla", None)  # forced
    assert linear_attention.select_linear_backend("auto", torch.device("cpu"), half=False) == ("reference", None)
    fla["installed"] = False
    name, why = linear_attention.select_linear_backend("auto", cuda, half=True)
    assert name == "reference" and "hf_packing[linear]" in why

    monkeypatch.setattr(linear_attention, "_WARNED", set())
    monkeypatch.setattr(linear_attention, "select_linear_backend", lambda *a: ("reference", "a test's reason"))
    x = torch.randn(1, 4, 3)
    with pytest.warns(UserWarning, match="per-sequence reference .* because a test's reason") as caught:
        for _ in range(3):  # three linear-attention layers
            assert linear_attention.resolve_linear_backend("auto", x) == "reference"
    assert len([w for w in caught if "per-sequence reference" in str(w.message)]) == 1
