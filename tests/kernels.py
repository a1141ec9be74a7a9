"""Strict CPU stand-ins for the GPU varlen kernels: they refuse every input the real kernel refuses.

What they check is what ``flash_api.cpp`` (FA2 ``mha_varlen_fwd``) and torch's ``varlen_attn`` (cuDNN / flash)
check before computing: q/k/v in one of fp16/bf16 and all equal, ``(total, heads, head_dim)`` layout with a
contiguous last dimension, head_dim <= 256 and equal for q/k/v, heads of q a multiple of heads of k/v,
``cu_seqlens`` int32, contiguous, 1-D, on q's device, starting at 0 and ending at the token count, and
``max_seqlen`` a Python int no smaller than the longest sequence. Then they compute with the exact reference
(in fp32, output in q's dtype, as the kernels accumulate in fp32).

`install_kernel(monkeypatch, "flash_attn" | "torch_varlen")` puts one in place of the real package, makes
the backend count as available on CPU, and returns the list of ``causal`` flags of the calls it received.
`install_linear_kernels(monkeypatch)` does the same for flash-linear-attention's ``chunk_gated_delta_rule`` and
``causal_conv1d`` (Qwen3.5's linear-attention layers; their contract is described below).
"""

from __future__ import annotations

from types import ModuleType

import torch

from hf_packing import _compat
from hf_packing.ops import varlen

HALF = (torch.float16, torch.bfloat16)


class KernelContractError(RuntimeError):
    """An input the real kernel would refuse."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise KernelContractError(message)


def check_contract(q, k, v, cu_q, cu_k, max_q, max_k) -> None:
    """Raise `KernelContractError` for any input the real varlen kernels refuse."""
    _require(q.dtype in HALF, f"FlashAttention only support fp16 and bf16 data type (q is {q.dtype})")
    _require(
        k.dtype == q.dtype and v.dtype == q.dtype,
        f"query and key/value must have the same dtype ({q.dtype}, {k.dtype}, {v.dtype})",
    )
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require(t.dim() == 3, f"{name} must be (total, heads, head_dim), got shape {tuple(t.shape)}")
        _require(t.stride(-1) == 1, f"{name} must have contiguous last dimension")
    _require(q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] <= 256, "head_dim must match and be <= 256")
    _require(
        q.shape[1] % k.shape[1] == 0 and k.shape[1] == v.shape[1],
        "Number of heads in key/value must divide number of heads in query",
    )
    for name, cu, total in (("cu_seqlens_q", cu_q, q.shape[0]), ("cu_seqlens_k", cu_k, k.shape[0])):
        _require(isinstance(cu, torch.Tensor) and cu.dtype == torch.int32, f"{name} must have dtype int32")
        _require(cu.dim() == 1 and cu.is_contiguous(), f"{name} must be a contiguous 1-D tensor")
        _require(cu.device == q.device, f"{name} must be on the device of q")
        _require(
            int(cu[0]) == 0 and int(cu[-1]) == total and bool((cu[1:] >= cu[:-1]).all()),
            f"{name} must start at 0, be non-decreasing and end at the token count {total}",
        )
    for name, value, cu in (("max_seqlen_q", max_q, cu_q), ("max_seqlen_k", max_k, cu_k)):
        _require(type(value) is int, f"{name} must be a Python int, got {type(value).__name__}")
        _require(value >= int((cu[1:] - cu[:-1]).max()), f"{name}={value} is smaller than the longest sequence")


def _compute(q, k, v, cu, max_seqlen, causal: bool, scale: float | None, window: tuple[int, int]) -> torch.Tensor:
    left = window[0]
    seqs = varlen.PackedSequences(cu, max_seqlen)
    out = varlen.reference_varlen(
        q.float(),
        k.float(),
        v.float(),
        seqs,
        causal=causal,
        scale=q.shape[-1] ** -0.5 if scale is None else scale,
        window=None if left < 0 else left + 1,
    )
    return out.to(q.dtype)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """FA2's ``flash_attn_varlen_func`` signature and checks."""
    check_contract(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _require(dropout_p == 0.0, "the stand-in has no dropout")
    _require(not causal or window_size[1] in (0, -1), "causal needs window_size[1] in (0, -1)")
    return _compute(q, k, v, cu_seqlens_q, max_seqlen_q, causal, softmax_scale, window_size)


def varlen_attn(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    """torch 2.15's ``torch.nn.attention.varlen.varlen_attn`` signature and checks."""
    check_contract(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    _require(enable_gqa or query.shape[1] == key.shape[1], "GQA inputs need enable_gqa=True")
    causal = tuple(window_size) == (-1, 0) or (window_size[1] == 0 and window_size[0] >= 0)
    return _compute(query, key, value, cu_seq_q, max_q, causal, scale, window_size)


def install_kernel(monkeypatch, name: str, *, memory: bool = False) -> list[bool]:
    """Use the strict stand-in for backend ``name`` on CPU; returns the ``causal`` flag of every call it gets.
    ``memory``: it keeps for backward exactly what the kernel keeps (`_Kept`)."""
    calls: list[bool] = []

    def recording(fn):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            calls.append(bool(kwargs.get("causal")) if name == "flash_attn" else kwargs.get("window_size") == (-1, 0))
            return out

        return wrapper

    if name == "flash_attn":
        module = ModuleType("flash_attn")
        module.flash_attn_varlen_func = recording(_flash_kept if memory else flash_attn_varlen_func)
        monkeypatch.setattr(_compat, "flash_attn_varlen_module", lambda: module)
    elif name == "torch_varlen":
        monkeypatch.setattr(_compat, "torch_varlen_attn", lambda: recording(_varlen_kept if memory else varlen_attn))
        monkeypatch.setattr(
            _compat,
            "torch_varlen_params",
            lambda: frozenset(
                varlen_attn.__code__.co_varnames[
                    : varlen_attn.__code__.co_argcount + varlen_attn.__code__.co_kwonlyargcount
                ]
            ),
        )
    else:
        raise ValueError(name)
    real = varlen.backend_available
    monkeypatch.setattr(varlen, "backend_available", lambda backend, device: backend == name or real(backend, device))
    return calls


# ------------------------------------------------------------------ flash-linear-attention (Qwen3.5 linear attention)
#
# What FLA (>= 0.5) checks or needs before its Triton kernels run: ``chunk_gated_delta_rule`` takes q/k of one shape
# (B, T, H, K), v (B, T, HV, V) with HV % H == 0, g and beta (B, T, HV), q/k/v in one float dtype (its tl.dot needs
# equal operand types); ``causal_conv1d`` takes x (B, T, D), weight (D, W), bias (D,), activation silu/swish/None.
# With ``cu_seqlens`` both need B == 1 and a LongTensor (int64, FLA's documented type) on the inputs' device that
# starts at 0 and ends at T. The stand-ins add what the patch promises: no initial state, no final state, and
# compute with transformers' torch fallbacks per sequence (in fp32, output in v's / x's dtype, as FLA returns).

FLOATS = HALF + (torch.float32,)


def _check_fla_cu_seqlens(cu, batch: int, total: int, device) -> list[int]:
    _require(batch == 1, f"The batch size is expected to be 1 rather than {batch} when using `cu_seqlens`.")
    _require(isinstance(cu, torch.Tensor) and cu.dtype == torch.int64, "cu_seqlens must be a LongTensor (int64)")
    _require(cu.dim() == 1 and cu.is_contiguous(), "cu_seqlens must be a contiguous 1-D tensor")
    _require(cu.device == device, "cu_seqlens must be on the device of the inputs")
    _require(
        int(cu[0]) == 0 and int(cu[-1]) == total and bool((cu[1:] >= cu[:-1]).all()),
        f"cu_seqlens must start at 0, be non-decreasing and end at the token count {total}",
    )
    return (cu[1:] - cu[:-1]).tolist()


def _torch_fallback(name: str):
    """transformers' own torch implementation (the hub-kernel decorator and hf_packing's patch unwrapped)."""
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5

    return inspect.unwrap(getattr(modeling_qwen3_5, name))


def fla_chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    **kwargs,
):
    """FLA's ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` signature and checks."""
    _require(q.dim() == 4 and k.shape == q.shape, "q and k must be [B, T, H, K] of one shape")
    _require(v.dim() == 4 and v.shape[:2] == q.shape[:2], "v must be [B, T, HV, V]")
    _require(v.shape[2] % q.shape[2] == 0, "For GVA, num_v_heads must be evenly divisible by num_heads")
    _require(
        q.dtype in FLOATS and k.dtype == q.dtype and v.dtype == q.dtype,
        f"q, k, v must share one of fp16/bf16/fp32 ({q.dtype}, {k.dtype}, {v.dtype})",
    )
    _require(g.shape == v.shape[:3] and beta.shape == v.shape[:3], "g and beta must be [B, T, HV]")
    _require(g.is_floating_point() and beta.is_floating_point(), "g and beta must be floating point")
    _require(initial_state is None and not output_final_state, "packed training runs without recurrent states")
    _require(scale is None or scale == q.shape[-1] ** -0.5, "the stand-in computes with scale 1/sqrt(K)")
    _require(not kwargs.get("head_first", False), "head_first layout was removed; inputs are [B, T, H, ...]")
    seqlens = (
        [q.shape[1]] if cu_seqlens is None else _check_fla_cu_seqlens(cu_seqlens, q.shape[0], q.shape[1], q.device)
    )
    fn = _torch_fallback("torch_chunk_gated_delta_rule")
    outs = [
        fn(
            *(t.float() for t in parts[:3]),
            g=parts[3].float(),
            beta=parts[4].float(),
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )[0]
        for parts in zip(*(t.split(seqlens, dim=1) for t in (q, k, v, g, beta)))
    ]
    return torch.cat(outs, dim=1).to(v.dtype), None


def fla_causal_conv1d(
    x,
    weight=None,
    bias=None,
    residual=None,
    initial_state=None,
    output_final_state=False,
    activation=None,
    backend="triton",
    cu_seqlens=None,
    **kwargs,
):
    """FLA's ``fla.modules.convolution.causal_conv1d`` signature and checks."""
    _require(
        x.dim() == 3 and x.dtype in FLOATS, f"x must be [B, T, D] in fp16/bf16/fp32, got {tuple(x.shape)} {x.dtype}"
    )
    _require(weight is not None and weight.dim() == 2 and weight.shape[0] == x.shape[-1], "weight must be [D, W]")
    _require(bias is None or tuple(bias.shape) == (x.shape[-1],), "bias must be [D]")
    _require(activation in (None, "silu", "swish"), f"activation {activation!r}: only silu/swish or None")
    _require(residual is None and initial_state is None and not output_final_state, "no residual or conv states")
    seqlens = (
        [x.shape[1]] if cu_seqlens is None else _check_fla_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1], x.device)
    )
    fn = _torch_fallback("causal_conv1d_fn")
    w, b = weight.float(), None if bias is None else bias.float()
    outs = [
        fn(piece.float().transpose(1, 2), w, b, activation=activation).transpose(1, 2)
        for piece in x.split(seqlens, dim=1)
    ]
    return torch.cat(outs, dim=1).to(x.dtype), None


def install_linear_kernels(monkeypatch, *, memory: bool = False) -> dict[str, list[torch.dtype]]:
    """Use the FLA stand-ins on CPU; returns, per op, the dtype of every call's first input. ``memory``: they keep
    for backward exactly what FLA keeps (`_Kept`)."""
    from types import SimpleNamespace

    from hf_packing.ops import linear_attention

    calls: dict[str, list[torch.dtype]] = {"chunk_gated_delta_rule": [], "causal_conv1d": []}

    def recording(name, fn):
        def wrapper(x, *args, **kwargs):
            out = fn(x, *args, **kwargs)
            calls[name].append(x.dtype)
            return out

        return wrapper

    ops = SimpleNamespace(
        **{
            name: recording(name, fn)
            for name, fn in (
                ("chunk_gated_delta_rule", _fla_chunk_kept if memory else fla_chunk_gated_delta_rule),
                ("causal_conv1d", _fla_conv_kept if memory else fla_causal_conv1d),
            )
        }
    )
    monkeypatch.setattr(_compat, "fla_linear_ops", lambda: ops)
    real = linear_attention.linear_backend_available
    monkeypatch.setattr(
        linear_attention, "linear_backend_available", lambda backend, device: backend == "fla" or real(backend, device)
    )
    return calls


# ------------------------------------------------------------------ what the kernels keep for backward
#
# FA2's and torch's varlen attention keep q, k, v, the output and the log-sum-exp (fp32, one per query head and
# token); FLA's ``chunk_gated_delta_rule`` (its autograd Function, fla >= 0.4) keeps q and k (l2-normalised copies
# when ``use_qk_l2norm_in_kernel``, with their fp32 reciprocal norms, one per key head and token), v, beta, its
# chunk-local cumulative decay g (fp32) and the chunk's solved triangular matrix A (one 64-row per value head and
# token, in k's dtype); ``causal_conv1d`` keeps x. The references autograd through keep far more (per-sequence copies,
# chunk temporaries), so `install_kernel(..., memory=True)` / `install_linear_kernels(..., memory=True)` run the
# stand-ins under `_Kept`, which saves exactly those tensors and recomputes the reference in backward: a step then
# saves what it saves on the GPU (`hf_packing.ops.memory` states the same contract).


class _Kept(torch.autograd.Function):
    """``fn(*inputs)`` computed without autograd, keeping ``inputs`` and the output plus ``extra`` empty tensors
    (``(shape, dtype)`` each: what the kernel adds, e.g. its log-sum-exp) for backward, which recomputes ``fn``."""

    @staticmethod
    def forward(ctx, fn, extra, keep_out, *inputs):
        with torch.no_grad():
            out = fn(*inputs)
        ctx.fn, ctx.n = fn, len(inputs)
        made = [torch.empty(shape, dtype=dtype) for shape, dtype in extra]
        ctx.save_for_backward(*inputs, *([out] if keep_out else []), *made)
        return out

    @staticmethod
    def backward(ctx, grad):
        inputs = ctx.saved_tensors[: ctx.n]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
            out = ctx.fn(*leaves)
            wanted = [i for i, t in enumerate(leaves) if t.requires_grad]
            grads = torch.autograd.grad(out, [leaves[i] for i in wanted], grad, allow_unused=True)
        full: list = [None] * ctx.n
        for i, g in zip(wanted, grads):
            full[i] = g
        return (None, None, None, *full)


def kept(fn, *inputs, extra=(), keep_out: bool = True):
    """`_Kept` of ``fn`` on ``inputs`` (tensors only; everything else bound in ``fn``); ``keep_out``: the kernel
    keeps its output too."""
    return _Kept.apply(fn, tuple(extra), keep_out, *inputs)


def _flash_kept(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
    check_contract(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    lse = ((q.shape[1], q.shape[0]), torch.float32)
    return kept(lambda q, k, v: flash_attn_varlen_func(q, k, v, *args, **kwargs), q, k, v, extra=[lse])


def _varlen_kept(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs):
    check_contract(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    args = (cu_seq_q, cu_seq_k, max_q, max_k)
    lse = ((query.shape[1], query.shape[0]), torch.float32)
    return kept(lambda q, k, v: varlen_attn(q, k, v, *args, **kwargs), query, key, value, extra=[lse])


def _fla_chunk_kept(q, k, v, g, beta, scale=None, use_qk_l2norm_in_kernel=False, **kwargs):
    def fn(q, k, v, g, beta):
        return fla_chunk_gated_delta_rule(
            q, k, v, g, beta, scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs
        )[0]

    norms = [(q.shape[:3], torch.float32)] * 2 if use_qk_l2norm_in_kernel else []
    extra = [*norms, ((*v.shape[:3], 64), k.dtype)]  # the rstd of q and k, and A: one 64-row per value head
    return kept(fn, q, k, v, g, beta, extra=extra, keep_out=False), None


def _fla_conv_kept(x, weight=None, bias=None, **kwargs):
    return kept(lambda x: fla_causal_conv1d(x, weight, bias, **kwargs)[0], x, keep_out=False), None
