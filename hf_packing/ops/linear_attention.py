"""Gated DeltaNet linear attention over packed sequences: state and conv window restart at every boundary.

Qwen3.5's linear-attention layers (transformers' ``Qwen3_5GatedDeltaNet``) mix tokens twice, and both carry
information along the flat row unless they are told where each sequence starts::

    flat row         a a a | b b b b b | c                   cu_seqlens [0, 3, 8, 9]
    causal conv1d    each output reads the last 4 inputs of its own sequence (zeros before b's first token)
    gated delta rule the recurrent state S is 0 at the start of a, of b and of c; S never carries a's keys into b

Without boundaries b's first 3 outputs read a's last inputs through the conv window, and b's state starts from
a's final state, so every token of b reads a: in the tests' negative control (softmax layers keeping their
boundaries) the linear layer's output moves far beyond round-off without them (measured: docs/verified.md, 'negative
control'). Two backends, one signature per op:

- ``fla``: flash-linear-attention's Triton kernels with ``cu_seqlens`` (CUDA): ``chunk_gated_delta_rule`` on
  ``(1, T, H, D)`` q/k/v and ``causal_conv1d`` on ``(1, T, C)``, int64 ``cu_seqlens`` (FLA's ``LongTensor``);
- ``reference``: transformers' own torch fallbacks run on each sequence alone, exact by construction (the same
  function on the same tokens as an unpacked sample), at one call per sequence. Under ``torch.compile`` it runs
  the whole flat row at once instead, the boundaries applied as device-side masks (`masked_causal_conv1d`,
  `scan_gated_delta_rule`): a loop over the sequences, and transformers' loop over 64-token chunks, would be
  unrolled and recompiled for every pack.

``auto`` picks ``fla`` for CUDA tensors in half precision (or under autocast) when the package imports, else
``reference`` (on CUDA with a warning, once per reason, saying why and what to set); forcing ``fla`` where it
cannot run raises.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from .. import _compat
from .varlen import KERNEL_DTYPES, PackedSequences, token_sequences

LINEAR_BACKENDS = ("fla", "reference")

#: torch's ``scan``, looked up once here: dynamo would trace through the cached lookup on every compile
_SCAN = _compat.torch_scan()


def check_linear_backend(name: str, *, installed: bool = False) -> None:
    """The one check of a ``linear_backend`` setting: ``"auto"`` or one of `LINEAR_BACKENDS`, else `ValueError`
    naming the choices; with ``installed`` (apply time), ``"fla"`` without flash-linear-attention raises
    `RuntimeError` naming the extra."""
    if name not in ("auto",) + LINEAR_BACKENDS:
        raise ValueError(f"unknown linear_backend {name!r}; choose one of {('auto',) + LINEAR_BACKENDS}")
    if installed and name == "fla" and _compat.fla_linear_ops() is None:
        raise RuntimeError(
            "linear_backend='fla' needs flash-linear-attention (pip install 'hf_packing[linear]'); or use 'auto'"
        )


def linear_backend_available(name: str, device: torch.device) -> bool:
    """Whether linear-attention backend ``name`` can run on tensors living on ``device``."""
    if name == "reference":
        return True
    if name == "fla":
        return device.type == "cuda" and _compat.fla_linear_ops() is not None
    check_linear_backend(name)  # an unknown name raises here
    raise ValueError(f"linear_backend_available takes one of {LINEAR_BACKENDS}; resolve {name!r} first")


def select_linear_backend(name: str, device: torch.device, half: bool) -> tuple[str, str | None]:
    """The backend ``name`` resolves to on ``device`` (``half``: half-precision inputs or autocast on), and, when
    ``auto`` falls back to the per-sequence reference on CUDA, why and what to set (warned once by
    `resolve_linear_backend`; elsewhere the reference is the expected path and ``None``)."""
    if name != "auto":
        return name, None
    if half and linear_backend_available("fla", device):
        return "fla", None
    if device.type != "cuda":
        return "reference", None
    if not half:
        return "reference", (
            "the inputs are fp32 with autocast off, which the fla kernels are not picked for: train with bf16=True "
            "(autocast; or run the step under torch.autocast('cuda', dtype=torch.bfloat16)), or load the model in "
            "bfloat16; linear_backend='reference' chooses this path without a warning, linear_backend='fla' runs "
            "the kernels in fp32"
        )
    return "reference", (
        "flash-linear-attention is not installed: pip install 'hf_packing[linear]'; linear_backend='reference' "
        "chooses this path without a warning"
    )


#: the reasons `resolve_linear_backend` has warned about (once per process each)
_WARNED: set[str] = set()


def resolve_linear_backend(name: str, x: torch.Tensor) -> str:
    """``auto`` → ``fla`` for half-precision (or autocast) CUDA inputs when available, else ``reference``.

    fp32 inputs with autocast off take the exact reference under ``auto``, as the softmax layers do; a forced
    ``fla`` runs them in fp32 (FLA accepts fp32, with TF32 matmuls). On CUDA ``auto``'s fallback to the reference
    (a Python loop over the sequences in every linear-attention layer) is warned once per reason, with what to set.
    """
    if name == "auto":
        half = x.dtype in KERNEL_DTYPES or torch.is_autocast_enabled(x.device.type)
        picked, why = select_linear_backend(name, x.device, half)
        if why is not None and why not in _WARNED and not torch.compiler.is_compiling():
            _WARNED.add(why)
            warnings.warn(
                "hf_packing: linear_backend='auto' runs Qwen3.5's linear attention on CUDA with the per-sequence "
                f"reference (a Python loop over the sequences in every linear-attention layer, far slower than the "
                f"fla kernels) because {why}",
                stacklevel=3,
            )
        return picked
    if not linear_backend_available(name, x.device):
        raise RuntimeError(
            f"linear_backend={name!r} is not available for tensors on {x.device} (needs a CUDA device and "
            "pip install 'hf_packing[linear]'); use linear_backend='auto' or 'reference'"
        )
    return name


def _cu_seqlens_int64(seqs: PackedSequences, device: torch.device) -> torch.Tensor:
    """int64 ``cu_seqlens`` on ``device``, made once per forward: FLA caches its chunk indices by tensor identity,
    so every linear layer passing the same tensor costs one host sync in total, not one per layer."""
    cached = getattr(seqs, "_cu_seqlens_int64", None)
    if cached is None or cached.device != device:
        cached = seqs.cu_seqlens.to(device=device, dtype=torch.int64).contiguous()
        setattr(seqs, "_cu_seqlens_int64", cached)  # noqa: B010 - a per-forward cache, not a field of the record
    return cached


# ---------------------------------------------------------------------------------------------- causal conv1d


def reference_causal_conv1d(
    x, weight, bias, activation: str | None, seqs: PackedSequences, *, torch_fn: Callable
) -> torch.Tensor:
    """``torch_fn`` (transformers' ``causal_conv1d_fn`` fallback) on each sequence alone, concatenated
    (`masked_causal_conv1d` under ``torch.compile``).

    Args:
        x (`torch.Tensor` of shape `(1, C, T)`), weight (`(C, W)`), bias (`(C,)`, *optional*), activation (`str`).
        seqs (`PackedSequences`): the boundaries of the ``T`` tokens.
        torch_fn: ``fn(x, weight, bias, activation=...) -> (1, C, n)`` for one sequence.
    """
    if torch.compiler.is_compiling():
        return masked_causal_conv1d(x, weight, bias, activation, seqs)
    pieces = x.split(seqs.host_seqlens(), dim=-1)
    return torch.cat([torch_fn(piece, weight, bias, activation=activation) for piece in pieces], dim=-1)


def masked_causal_conv1d(
    x, weight, bias, activation: str | None, seqs: PackedSequences, *, dilation: int = 1
) -> torch.Tensor:
    """`reference_causal_conv1d` on the whole row at once: tap ``j`` of the window (``(W - 1 - j) · dilation``
    tokens back) is dropped for the tokens fewer than that many tokens into their sequence, which is what zero
    padding before each sequence gives. One graph for any pack; shapes and dtypes as in the reference.
    ``dilation`` > 1: Qwen4-Exp's PLE conv (kernel 4, dilation ``ngram_size``), which no varlen kernel takes."""
    width, total = weight.shape[-1], x.shape[-1]
    _, offsets = token_sequences(seqs, total, x.device)
    reach = (width - 1) * dilation
    padded = torch.nn.functional.pad(x.to(weight.dtype), (reach, 0))
    out: Any = bias[None, :, None].expand(1, -1, total) if bias is not None else 0
    for tap in range(width):  # W is the layer's kernel size (4): a fixed, short loop
        back = (width - 1 - tap) * dilation
        start = reach - back
        out = out + weight[None, :, tap, None] * padded[..., start : start + total] * (offsets >= back)
    if activation is not None:
        if activation not in ("silu", "swish"):  # transformers' ACT2FN names for the one activation Qwen3.5 uses
            raise ValueError(f"causal conv1d activation {activation!r}: only 'silu' is supported")
        out = torch.nn.functional.silu(out)
    return out.to(x.dtype)


def _fla() -> Any:
    """FLA's varlen ops; only the ``fla`` backend calls them, which `resolve_linear_backend` picks when they load."""
    ops = _compat.fla_linear_ops()
    if ops is None:
        raise ValueError("linear_backend='fla' needs flash-linear-attention: pip install 'hf_packing[linear]'")
    return ops


def fla_causal_conv1d(
    x, weight, bias, activation: str | None, seqs: PackedSequences, *, torch_fn: Callable
) -> torch.Tensor:
    """FLA's varlen ``causal_conv1d`` on ``(1, T, C)`` (x arrives as transformers' ``(1, C, T)`` transpose view,
    so this is no copy); same arguments and result as `reference_causal_conv1d`."""
    ops = _fla()
    y, _ = ops.causal_conv1d(
        x.transpose(1, 2).contiguous(),
        weight,
        bias,
        activation=activation,
        cu_seqlens=_cu_seqlens_int64(seqs, x.device),
    )
    return y.transpose(1, 2)


def causal_conv1d(
    x, weight, bias, activation: str | None, seqs: PackedSequences, *, backend: str = "auto", torch_fn: Callable
) -> torch.Tensor:
    """Depthwise causal conv1d over a flat row that never reads across a boundary (shapes as in the reference)."""
    fn = fla_causal_conv1d if resolve_linear_backend(backend, x) == "fla" else reference_causal_conv1d
    return fn(x, weight, bias, activation, seqs, torch_fn=torch_fn)


# -------------------------------------------------------------------------------------------- gated delta rule


def reference_gated_delta_rule(
    q, k, v, g, beta, seqs: PackedSequences, *, use_qk_l2norm: bool, torch_fn: Callable
) -> torch.Tensor:
    """``torch_fn`` (transformers' ``torch_chunk_gated_delta_rule``) on each sequence alone, from a zero state
    (`scan_gated_delta_rule` under ``torch.compile``, where torch has ``scan``).

    Args:
        q, k (`torch.Tensor` of shape `(1, T, H_k, D_k)`), v (`(1, T, H_v, D_v)`) with H_v % H_k == 0,
        g (`(1, T, H_v)`, log-space decay), beta (`(1, T, H_v)`).
        seqs (`PackedSequences`): the boundaries.

    Returns:
        `torch.Tensor` of shape `(1, T, H_v, D_v)` in q's dtype.
    """
    if torch.compiler.is_compiling() and _SCAN is not None:
        return scan_gated_delta_rule(q, k, v, g, beta, seqs, use_qk_l2norm=use_qk_l2norm)
    outs = []
    for qs, ks, vs, gs, bs in zip(*(t.split(seqs.host_seqlens(), dim=1) for t in (q, k, v, g, beta))):
        out, _ = torch_fn(
            qs,
            ks,
            vs,
            g=gs,
            beta=bs,
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=use_qk_l2norm,
        )
        outs.append(out)
    return torch.cat(outs, dim=1)


def scan_gated_delta_rule(q, k, v, g, beta, seqs: PackedSequences, *, use_qk_l2norm: bool) -> torch.Tensor:
    """`reference_gated_delta_rule` as one token-by-token recurrence over the whole row (transformers'
    ``torch_recurrent_gated_delta_rule`` step, in torch's ``scan``, which torch.compile traces once for any length):
    the state's decay is 0 at each sequence's first token, so the state restarts there::

        flat row   a a a | b b b b b | c
        decay      0 e e   0 e e e e   0        e = exp(g_t);  S_t = decay_t * S_(t-1) + (delta rule update)

    Same arguments, shapes and result as the reference (fp32 inside, q's dtype out). Backward keeps the state of
    every step, ``T * H_v * D_k * D_v`` floats: for compiled CPU runs and small packs, like `masked_reference_varlen`.
    """
    dtype, total, heads = q.dtype, q.shape[1], v.shape[2]
    if q.shape[2] != heads:  # each query/key head serves heads // H_k consecutive value heads
        q, k = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (q, k))
    q, k, v, g, beta = (t[0].float() for t in (q, k, v, g, beta))  # (T, H, D) and (T, H)
    if use_qk_l2norm:
        q, k = (t * torch.rsqrt((t * t).sum(dim=-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q / q.shape[-1] ** 0.5
    first = token_sequences(seqs, total, q.device)[1] == 0
    decay = torch.where(first[:, None], torch.zeros_like(g), g.exp())

    def step(state, token):  # state (H, D_k, D_v)
        q_t, k_t, v_t, decay_t, beta_t = token
        state = state * decay_t[:, None, None]
        delta = (v_t - (state * k_t[..., None]).sum(dim=-2)) * beta_t[:, None]
        # q_t^T S_t with S_t = state + k_t delta^T, expanded: reading the output off the returned state makes
        # scan's backward (torch 2.14) reject the step as "aliasing the input or the output"
        out = (state * q_t[..., None]).sum(dim=-2) + (q_t * k_t).sum(dim=-1, keepdim=True) * delta
        return state + k_t[..., None] * delta[:, None, :], out

    state = q.new_zeros(heads, q.shape[-1], v.shape[-1])
    _, out = _SCAN(step, state, (q, k, v, decay, beta))
    return out.unsqueeze(0).to(dtype)


def fla_gated_delta_rule(
    q, k, v, g, beta, seqs: PackedSequences, *, use_qk_l2norm: bool, torch_fn: Callable
) -> torch.Tensor:
    """FLA's ``chunk_gated_delta_rule`` with ``cu_seqlens``: q/k/v in one dtype (the autocast dtype under
    autocast), contiguous; g and beta as given (g is fp32 in transformers' layer)."""
    ops = _fla()
    dtype = torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type) else q.dtype
    q, k, v = (t.to(dtype).contiguous() for t in (q, k, v))
    out, _ = ops.chunk_gated_delta_rule(
        q,
        k,
        v,
        g.contiguous(),
        beta.contiguous(),
        scale=q.shape[-1] ** -0.5,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        cu_seqlens=_cu_seqlens_int64(seqs, q.device),
    )
    return out


def gated_delta_rule(
    q, k, v, g, beta, seqs: PackedSequences, *, use_qk_l2norm: bool, backend: str = "auto", torch_fn: Callable
) -> torch.Tensor:
    """The gated delta rule over a flat row, its state restarting from 0 at every boundary (see the reference)."""
    fn = fla_gated_delta_rule if resolve_linear_backend(backend, q) == "fla" else reference_gated_delta_rule
    return fn(q, k, v, g, beta, seqs, use_qk_l2norm=use_qk_l2norm, torch_fn=torch_fn)
