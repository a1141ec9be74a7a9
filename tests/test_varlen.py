"""Varlen utilities and backends against the dense block-causal oracle."""

from __future__ import annotations

import pytest
import torch

from hf_packing import _compat
from hf_packing.ops import varlen
from hf_packing.ops.varlen import PackedSequences, create_block_causal_mask, pad_input, unpad_input


def test_block_causal_mask_literal():
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(create_block_causal_mask([2, 3]), expected)


def test_unpad_pad_roundtrip_and_boundaries():
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    data = torch.arange(15).view(3, 5)
    flat, indices, seqs = unpad_input(data, mask)
    assert flat.tolist() == [0, 1, 2, 5, 6, 7, 8, 9, 14]
    assert seqs.cu_seqlens.tolist() == [0, 3, 8, 9] and seqs.cu_seqlens.dtype == torch.int32
    assert seqs.max_seqlen == 5 and type(seqs.max_seqlen) is int
    assert torch.equal(pad_input(flat, indices, 3, 5, pad_value=-1), data.masked_fill(mask == 0, -1))


@pytest.mark.parametrize(
    "mask, message",
    [
        ([[1, 0, 1]], "row 0 has a hole"),
        ([[1, 1, 0], [0, 2, 1]], "row 1 has values"),
        ([[1, 1], [0, 0]], "row 1 is all padding"),
    ],
)
def test_bad_masks_name_the_row(mask, message):
    with pytest.raises(ValueError, match=message):
        varlen.validate_attention_mask(torch.tensor(mask))


def _dense(q, k, v, seqlens, causal, scale):
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    allowed = create_block_causal_mask(seqlens, causal=causal)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_dense_oracle(causal):
    torch.manual_seed(0)
    seqlens = [5, 1, 9, 3]
    q, k, v = torch.randn(18, 4, 8), torch.randn(18, 2, 8), torch.randn(18, 2, 8)
    seqs = PackedSequences.from_seqlens(seqlens)
    out = varlen.reference_varlen(q, k, v, seqs, causal=causal, scale=0.3)
    torch.testing.assert_close(out, _dense(q, k, v, seqlens, causal, 0.3), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("signature", ["old", "new"])
def test_torch_varlen_wiring_with_stand_in(monkeypatch, signature):
    """torch<2.10 varlen_attn had is_causal and no enable_gqa/scale; newer ones take window_size/enable_gqa/scale."""
    seen = {}

    def old(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, return_aux=None):
        seen.update(is_causal=is_causal, heads=(q.shape[1], k.shape[1]))
        seqs = PackedSequences(cu_q, max_q)
        return varlen.reference_varlen(q, k, v, seqs, causal=is_causal, scale=q.shape[-1] ** -0.5)

    def new(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False):
        assert cu_q.dtype == torch.int32 and type(max_q) is int
        seen.update(window=window_size, gqa=enable_gqa, heads=(q.shape[1], k.shape[1]))
        seqs = PackedSequences(cu_q, max_q)
        return varlen.reference_varlen(q, k, v, seqs, causal=window_size == (-1, 0), scale=scale)

    fn = old if signature == "old" else new
    monkeypatch.setattr(_compat, "torch_varlen_attn", lambda: fn)
    monkeypatch.setattr(
        _compat, "torch_varlen_params", lambda: frozenset(__import__("inspect").signature(fn).parameters)
    )
    torch.manual_seed(1)
    seqlens = [4, 7]
    q, k, v = torch.randn(11, 4, 8), torch.randn(11, 2, 8), torch.randn(11, 2, 8)
    seqs = PackedSequences.from_seqlens(seqlens)
    out = varlen.torch_varlen(q, k, v, seqs, causal=True, scale=0.2)
    torch.testing.assert_close(out, _dense(q, k, v, seqlens, True, 0.2), rtol=1e-5, atol=1e-6)
    if signature == "old":
        assert seen == {"is_causal": True, "heads": (4, 4)}  # GQA expanded by hand, scale folded into q
    else:
        assert seen == {"window": (-1, 0), "gqa": True, "heads": (4, 2)}


def test_backend_resolution_on_cpu():
    cpu = torch.device("cpu")
    assert varlen.resolve_backend("auto", cpu) == "reference"
    with pytest.raises(RuntimeError, match="attn_backend='torch_varlen' is not available"):
        varlen.resolve_backend("torch_varlen", cpu)
    with pytest.raises(ValueError, match="unknown attn_backend"):
        varlen.resolve_backend("xformers", cpu)


def test_auto_never_picks_the_reference_on_cuda_silently(monkeypatch):
    """``auto`` on CUDA with fp32 inputs and autocast off (no kernel takes them) runs the per-sequence reference and
    says why and what to set; with a half dtype it runs the kernel, silently; with no kernel installed it says that.
    The selection is a function of (backend, device, kernel dtype), so it is checked here without a GPU; and
    `varlen_attention` warns once per reason, not once per layer."""
    cuda = torch.device("cuda", 0)
    available = {"torch_varlen"}  # the kernels of a CUDA machine with torch>=2.9 and no flash-attn
    monkeypatch.setattr(
        varlen,
        "backend_available",
        lambda name, device: name == "reference" or (name in available and device.type == "cuda"),
    )
    name, why = varlen.select_backend("auto", cuda, None)
    assert name == "reference" and "fp32 with autocast off" in why and "bf16=True" in why and "autocast" in why
    assert varlen.select_backend("auto", cuda, torch.bfloat16) == ("torch_varlen", None)
    assert varlen.select_backend("torch_varlen", cuda, None) == ("torch_varlen", None)  # forced: raises later
    assert varlen.select_backend("reference", cuda, None) == ("reference", None)  # chosen: no warning
    assert varlen.select_backend("auto", torch.device("cpu"), None) == ("reference", None)  # the only one there
    available.discard("torch_varlen")
    name, why = varlen.select_backend("auto", cuda, torch.bfloat16)
    assert name == "reference" and "flash-attn" in why

    monkeypatch.setattr(varlen, "_WARNED", set())
    monkeypatch.setattr(varlen, "select_backend", lambda backend, device, dtype: ("reference", "a test's reason"))
    q = torch.randn(5, 2, 4)
    seqs = PackedSequences.from_seqlens([2, 3])
    with pytest.warns(UserWarning, match="per-sequence reference .* because a test's reason") as caught:
        for _ in range(3):  # three layers
            varlen.varlen_attention(q, q, q, seqs, causal=True, scale=0.5)
    assert len([w for w in caught if "per-sequence reference" in str(w.message)]) == 1


@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (True, 2)])
def test_masked_reference_equals_per_sequence_reference(causal, window):
    """The compile path (one SDPA, block mask from cu_seqlens on the device) equals SDPA per sequence, GQA too;
    a mask from merged boundaries differs (negative control)."""
    from hf_packing.ops.varlen import masked_reference_varlen, reference_varlen

    torch.manual_seed(0)
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    seqs = PackedSequences.from_seqlens([3, 5, 1])
    kwargs = dict(causal=causal, scale=0.3, window=window)
    ref = reference_varlen(q, k, v, seqs, **kwargs)
    torch.testing.assert_close(masked_reference_varlen(q, k, v, seqs, **kwargs), ref)
    merged = masked_reference_varlen(q, k, v, PackedSequences.from_seqlens([8, 1]), **kwargs)
    assert not torch.allclose(merged, ref, atol=1e-3)


def test_vision_item_tokens_are_the_patches_over_merge_squared():
    """A 448×448 image at patch 14 is a 32×32 grid: 1024 patches, 256 tokens after the 2×2 merge (Qwen2-VL's
    processor puts 256 image tokens for it); a 2-frame 4×6 video is 48 patches, 12 tokens. Lists and tensors agree."""
    grids = [[1, 32, 32], [2, 4, 6]]
    assert varlen.vision_item_tokens(grids, merge=2) == [256, 12]
    assert varlen.vision_item_tokens(torch.tensor(grids), merge=2) == [256, 12]
    assert varlen.vision_item_tokens(grids, merge=1) == [1024, 48]
    assert varlen.vision_item_tokens(torch.zeros(0, 3, dtype=torch.long), merge=2) == []
    assert varlen.merged_tokens(1024, 2) == 256


def test_the_backend_setting_is_checked_in_one_place(monkeypatch):
    """`check_backend` is what `apply_rmpad` and `resolve_backend` both raise from: the choices for an unknown name,
    the extra to install for a forced kernel that is missing (only with ``installed``; a known name passes)."""
    import hf_packing

    for call in (lambda: varlen.check_backend("xformers"), lambda: hf_packing.apply_rmpad(attn_backend="xformers")):
        with pytest.raises(ValueError, match=r"unknown attn_backend 'xformers'; choose one of \('auto', 'flash_attn'"):
            call()
    monkeypatch.setattr(_compat, "flash_attn_varlen_module", lambda: None)
    varlen.check_backend("flash_attn")  # the name alone is fine
    for call in (
        lambda: varlen.check_backend("flash_attn", installed=True),
        lambda: hf_packing.apply_rmpad("qwen2_vl", attn_backend="flash_attn"),
    ):
        with pytest.raises(RuntimeError, match=r"needs flash-attn \(pip install 'hf_packing\[flash\]'\)"):
            call()


def test_token_types_mark_image_and_video_placeholders():
    """0 text, 1 image, 2 video, in the caller's dtype and shape; a missing placeholder id marks nothing."""
    ids = torch.tensor([[5, 7, 7, 5, 9, 9], [9, 5, 7, 5, 5, 5]])
    expected = torch.tensor([[0, 1, 1, 0, 2, 2], [2, 0, 1, 0, 0, 0]])
    types = varlen.token_types(ids, image_token_id=7, video_token_id=9, dtype=torch.int32)
    assert types.dtype == torch.int32 and torch.equal(types, expected.int())
    assert torch.equal(
        varlen.token_types(ids[0], image_token_id=7, video_token_id=None), torch.tensor([0, 1, 1, 0, 0, 0])
    )
