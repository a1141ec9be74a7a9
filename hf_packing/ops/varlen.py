"""Padding removal, sequence boundaries and varlen attention backends.

A batch of padded rows becomes one flat stream of real tokens. Boundaries are carried as flash-attn's
``cu_seqlens`` and are derived from lengths only, never guessed from position ids::

    attention_mask (B=3, L=5)      flat stream (T=9)                   cu_seqlens = [0, 3, 8, 9]
    row 0: 1 1 1 0 0              a a a | b b b b b | c               max_seqlen = 5
    row 1: 1 1 1 1 1              causal attention never crosses '|'
    row 2: 0 0 0 0 1   (left padding works the same way)

Backends share one signature ``(q, k, v, seqs, causal, scale, ...) -> out`` with q ``(T, H_q, D)`` and
k/v ``(T, H_kv, D)``:

- ``flash_attn``: ``flash_attn_varlen_func`` from FA3 (``flash_attn_interface``) or FA2 (``flash_attn``).
- ``torch_varlen``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA only).
- ``reference``: exact pure torch; one SDPA call per sequence, so it costs Σ len² like the fast kernels.

``create_block_causal_mask`` is the dense oracle the tests compare every backend against.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .. import _compat

BACKENDS = ("flash_attn", "torch_varlen", "reference")


@dataclass
class PackedSequences:
    """Boundaries of the sequences in a flat stream.

    Attributes:
        cu_seqlens (`torch.IntTensor` of shape `(n_seqs + 1,)`): cumulative lengths, int32, starts at 0, ends at T.
        max_seqlen (`int`): the longest sequence, a Python int so kernels need no device sync.
        seqlens (`list[int]`): per-sequence lengths on the host; lets the reference backend split without a sync.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    seqlens: list[int] = field(default_factory=list)

    @classmethod
    def from_seqlens(cls, seqlens: list[int], device: torch.device | str | None = None) -> PackedSequences:
        cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(seqlens, dtype=torch.int32).cumsum(0)
        return cls(cu_seqlens=cu.to(device), max_seqlen=max(seqlens, default=0), seqlens=list(seqlens))

    def host_seqlens(self) -> list[int]:
        """``seqlens``, read from ``cu_seqlens`` once (one device sync) when the caller did not give them."""
        if not self.seqlens:
            self.seqlens = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()
        return self.seqlens


def merged_tokens(patches: int, merge: int) -> int:
    """The text-row tokens of ``patches`` vision patches: the tower merges each ``merge × merge`` block of patches
    into one token (``spatial_merge_size``, 2 in every Qwen-VL), so ``patches / merge²``. The one place this fact
    lives: the preprocessing, the collator's checks, the patches and sequence parallelism all call it."""
    return patches // merge**2


def vision_item_tokens(grids: Sequence[Sequence[int]] | torch.Tensor, *, merge: int) -> list[int]:
    """Each vision item's tokens in the text row, `merged_tokens` of its ``t·h·w`` patches.

    Args:
        grids (`list` of ``[t, h, w]``, or `torch.Tensor` of shape `(N, 3)`, integer): the items' patch grids
            (``image_grid_thw`` / ``video_grid_thw``); a tensor is read on the host (one sync if on a device).
        merge (`int`): the spatial merge size.
    """
    rows = grids.tolist() if isinstance(grids, torch.Tensor) else grids
    return [merged_tokens(t * h * w, merge) for t, h, w in rows]


def token_types(
    input_ids: torch.Tensor, *, image_token_id: int | None, video_token_id: int | None, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    """``mm_token_type_ids`` from the ids, as Qwen-VL processors write them: 0 for text, 1 for an image placeholder,
    2 for a video placeholder (an id of ``None``: the model has no such placeholder).

    Args:
        input_ids (`torch.Tensor`, integer, any shape): token ids.
    Returns:
        `torch.Tensor` of ``dtype``, shape and device of ``input_ids``.
    """
    types = torch.zeros_like(input_ids, dtype=dtype)
    for code, token_id in ((1, image_token_id), (2, video_token_id)):
        if token_id is not None:
            types = types.masked_fill(input_ids == token_id, code)
    return types


def vision_seqlens(grids: list[list[int]], *, merge: int = 1, window: int = 0) -> tuple[list[int], ...]:
    """Host lengths of a vision tower's attention units for items ``grids`` (``[t, h, w]`` patches each): one
    sequence per frame (``h·w`` patches) and, with ``window``, also Qwen2.5-VL's windows as transformers'
    ``get_vision_window_index`` cuts each frame: row-major over windows of ``window × window`` merged patches
    (``window_size / patch_size / merge``), the last row and column of a frame cut to what is left, each window
    ``rows · cols · merge²`` patches. One list per distinct boundary set: ``(frames,)``, or ``(frames, windows)``.
    """
    frames = [h * w for t, h, w in grids for _ in range(t)]
    if not window or not frames:
        return (frames,)
    windows = []
    for t, h, w in grids:
        rows, cols = h // merge, w // merge
        spans = [
            min(window, rows - i) * min(window, cols - j) * merge**2
            for i in range(0, rows, window)
            for j in range(0, cols, window)
        ]
        windows += spans * t
    return (frames,) if windows == frames else (frames, windows)


def validate_attention_mask(attention_mask: torch.Tensor) -> list[int]:
    """Check a 2-D padding mask and return each row's real length.

    Args:
        attention_mask (`torch.Tensor` of shape `(B, L)`): 0/1 (bool or integer); each row's ones must be contiguous
            (right or left padding). Holes inside a row mean the row holds several sequences, which only the
            collator's explicit ``cu_seqlens`` can describe.

    Returns:
        `list[int]`: the number of ones per row (one host transfer for the whole batch).

    Raises:
        ValueError: naming the first offending row.
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be 2-D (batch, seq_len); got shape {tuple(attention_mask.shape)}")
    mask = attention_mask
    if mask.dtype != torch.bool:
        not_binary = ((mask != 0) & (mask != 1)).any(dim=1)
        mask = mask != 0
    else:
        not_binary = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
    as_int = mask.to(torch.int8)
    # A contiguous run of ones has at most one 0->1 edge, counting a leading one as an edge.
    rises = (as_int[:, 1:] - as_int[:, :-1] == 1).sum(dim=1) + as_int[:, 0]
    stats = torch.stack([mask.sum(dim=1), rises, not_binary.long()], dim=0).tolist()
    for row, (length, n_rises, bad) in enumerate(zip(*stats)):
        if bad:
            raise ValueError(f"attention_mask row {row} has values other than 0 and 1")
        if n_rises > 1:
            raise ValueError(
                f"attention_mask row {row} has a hole (padding between real tokens); each row must be one "
                "sequence padded on one side. Pass cu_seqlens from VisionCollator for packed rows."
            )
        if length == 0:
            raise ValueError(f"attention_mask row {row} is all padding; drop empty rows before the forward")
    return [int(n) for n in stats[0]]


def unpad_input(
    hidden_states: torch.Tensor, attention_mask: torch.Tensor, seqlens: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, PackedSequences]:
    """Remove padding from ``(B, L, ...)`` data.

    Args:
        hidden_states (`torch.Tensor` of shape `(B, L, ...)`): any per-token data (ids, embeddings, labels).
        attention_mask (`torch.Tensor` of shape `(B, L)`): 1 for real tokens.
        seqlens (`list[int]`, *optional*): per-row lengths if already known on the host.

    Returns:
        flat (`torch.Tensor` of shape `(T, ...)`), indices (`torch.LongTensor` of shape `(T,)`: positions in the
        flattened ``B*L`` grid, row-major), and the `PackedSequences` of the rows.
    """
    if seqlens is None:
        seqlens = validate_attention_mask(attention_mask)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    seqs = PackedSequences.from_seqlens(seqlens, device=attention_mask.device)
    return index_first_axis(hidden_states.flatten(0, 1), indices), indices, seqs


def index_first_axis(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``tensor[indices]`` along dim 0, for ``tensor`` of shape `(N, ...)` and int64 ``indices`` of shape `(T,)`."""
    return tensor.index_select(0, indices)


def pad_input(flat: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int, pad_value: float = 0) -> torch.Tensor:
    """Inverse of `unpad_input`: scatter ``(T, ...)`` back into ``(B, L, ...)`` filled with ``pad_value``."""
    out = flat.new_full((batch * seqlen, *flat.shape[1:]), pad_value)
    out.index_copy_(0, indices, flat)
    return out.view(batch, seqlen, *flat.shape[1:])


def create_block_causal_mask(seqlens: list[int], *, causal: bool = True, device=None) -> torch.Tensor:
    """Dense ``(T, T)`` bool mask (True = may attend) for a flat stream of sequences; the tests' oracle.

    For ``seqlens=[2, 3]``::

        1 0 . . .
        1 1 . . .
        . . 1 0 0
        . . 1 1 0
        . . 1 1 1
    """
    total = sum(seqlens)
    seq_id = torch.repeat_interleave(torch.arange(len(seqlens), device=device), torch.tensor(seqlens, device=device))
    mask = seq_id[:, None] == seq_id[None, :]
    if causal:
        mask &= torch.ones(total, total, dtype=torch.bool, device=device).tril()
    return mask


# --------------------------------------------------------------------------------------------------- backends


def _common_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q / k / v in one promoted dtype, as SDPA needs them (under autocast SDPA casts them itself)."""
    if q.dtype == k.dtype == v.dtype or torch.is_autocast_enabled(q.device.type):
        return q, k, v
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def reference_varlen(
    q, k, v, seqs: PackedSequences, *, causal: bool, scale: float, window: int | None = None, dropout: float = 0.0
) -> torch.Tensor:
    """Exact pure-torch varlen attention: SDPA on each sequence alone. Shapes as in the module docstring.

    Under ``torch.compile`` it runs one SDPA over the whole stream with the block-causal mask built from
    ``cu_seqlens`` on the device instead (`masked_reference_varlen`): a loop over the sequences would be unrolled
    and recompiled for every number of sequences.
    """
    if torch.compiler.is_compiling():
        return masked_reference_varlen(q, k, v, seqs, causal=causal, scale=scale, window=window, dropout=dropout)
    q, k, v = _common_dtype(q, k, v)
    if q.shape[1] != k.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    outs = []
    for qs, ks, vs in zip(*(t.split(seqs.host_seqlens(), dim=0) for t in (q, k, v))):
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (qs, ks, vs))  # (1, H, n, D)
        mask = None
        if window is not None and causal:
            n = qs.shape[2]
            pos = torch.arange(n, device=q.device)
            mask = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < window)
        out = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, dropout_p=dropout, is_causal=causal and mask is None, scale=scale
        )
        outs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0)


def token_sequences(seqs: PackedSequences, total: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's sequence and its position inside it, from ``cu_seqlens`` on the device (no host value)::

        flat row   a a a | b b b b b | c        cu_seqlens [0, 3, 8, 9]
        sequence   1 1 1   2 2 2 2 2   3
        offset     0 1 2   0 1 2 3 4   0

    Returns two `torch.LongTensor` of shape `(T,)`: the 1-based sequence index and the offset.
    """
    cu = seqs.cu_seqlens.to(device=device, dtype=torch.int64)
    pos = torch.arange(total, device=device)
    # the whole cu_seqlens (never of size 1, which torch.compile would specialise on), not cu_seqlens[1:];
    # cu[0] = 0 <= pos, so every index is >= 1
    seq_id = torch.searchsorted(cu, pos, right=True)
    return seq_id, pos - cu[seq_id - 1]


def masked_reference_varlen(
    q, k, v, seqs: PackedSequences, *, causal: bool, scale: float, window: int | None = None, dropout: float = 0.0
) -> torch.Tensor:
    """`reference_varlen` as one SDPA with a dense ``(T, T)`` mask from ``cu_seqlens`` (no host value, one graph
    for any number of sequences; O(T²) memory, so for compiled CPU tests and small packs)."""
    q, k, v = _common_dtype(q, k, v)
    pos = torch.arange(q.shape[0], device=q.device)
    seq_id, _ = token_sequences(seqs, q.shape[0], q.device)
    mask = seq_id[:, None] == seq_id[None, :]
    if causal:
        mask &= pos[:, None] >= pos[None, :]
        if window is not None:
            mask &= pos[:, None] - pos[None, :] < window
    qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, H, T, D)
    out = F.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.squeeze(0).transpose(0, 1)


def torch_varlen(
    q, k, v, seqs: PackedSequences, *, causal: bool, scale: float, window: int | None = None, dropout: float = 0.0
) -> torch.Tensor:
    """``torch.nn.attention.varlen.varlen_attn``; handles torch releases without ``enable_gqa`` or ``scale``."""
    fn = _compat.torch_varlen_attn()
    params = _compat.torch_varlen_params()
    if dropout:
        raise ValueError("attn_backend='torch_varlen' has no dropout; set attention_dropout=0 or use flash_attn")
    kwargs: dict[str, Any] = {}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if "scale" in params:
        kwargs["scale"] = scale
    else:  # the kernel applies 1/sqrt(D); fold the requested scale into q
        q = q * (scale * q.shape[-1] ** 0.5)
    if "window_size" in params:
        left = -1 if window is None else window - 1
        kwargs["window_size"] = (left, 0) if causal else (-1, -1)
    else:
        if window is not None:
            raise ValueError("this torch's varlen_attn has no sliding window; use attn_backend='flash_attn'")
        kwargs["is_causal"] = causal
    cu = seqs.cu_seqlens.to(device=q.device, dtype=torch.int32)
    return fn(q, k, v, cu, cu, seqs.max_seqlen, seqs.max_seqlen, **kwargs)


def flash_attn(
    q, k, v, seqs: PackedSequences, *, causal: bool, scale: float, window: int | None = None, dropout: float = 0.0
) -> torch.Tensor:
    """``flash_attn_varlen_func`` (FA3 interface if installed, else FA2); GQA is native to both."""
    module = _compat.flash_attn_varlen_module()
    if module is None:
        raise ValueError("attn_backend='flash_attn' needs flash-attn installed: pip install 'hf_packing[flash]'")
    cu = seqs.cu_seqlens.to(device=q.device, dtype=torch.int32)
    kwargs: dict[str, Any] = dict(
        softmax_scale=scale, causal=causal, window_size=(-1 if window is None else window - 1, 0 if causal else -1)
    )
    if module.__name__ == "flash_attn_interface":  # FA3 has no dropout argument
        if dropout:
            raise ValueError("FA3 has no attention dropout; set attention_dropout=0")
    else:
        kwargs["dropout_p"] = dropout
    out = module.flash_attn_varlen_func(q, k, v, cu, cu, seqs.max_seqlen, seqs.max_seqlen, **kwargs)
    return out[0] if isinstance(out, tuple) else out


_BACKEND_FNS = {"flash_attn": flash_attn, "torch_varlen": torch_varlen, "reference": reference_varlen}


def check_backend(name: str, *, installed: bool = False) -> None:
    """The one check of an ``attn_backend`` setting: ``"auto"`` or one of `BACKENDS`, else `ValueError` naming the
    choices; with ``installed`` (apply time, no device yet), a forced kernel whose package is missing raises
    `RuntimeError` naming the extra to install. Whether it runs on a given device is `resolve_backend`'s question."""
    if name not in ("auto",) + BACKENDS:
        raise ValueError(f"unknown attn_backend {name!r}; choose one of {('auto',) + BACKENDS}")
    if installed and name == "flash_attn" and _compat.flash_attn_varlen_module() is None:
        raise RuntimeError(
            "attn_backend='flash_attn' needs flash-attn (pip install 'hf_packing[flash]'); or use 'auto'"
        )
    if installed and name == "torch_varlen" and _compat.torch_varlen_attn() is None:
        raise RuntimeError("attn_backend='torch_varlen' needs torch>=2.9 (torch.nn.attention.varlen); or use 'auto'")


def backend_available(name: str, device: torch.device) -> bool:
    """Whether backend ``name`` can run on tensors living on ``device``."""
    if name == "reference":
        return True
    if device.type != "cuda":
        return False
    if name == "torch_varlen":
        return _compat.torch_varlen_attn() is not None
    if name == "flash_attn":
        return _compat.flash_attn_varlen_module() is not None
    check_backend(name)  # an unknown name raises here
    raise ValueError(f"backend_available takes one of {BACKENDS}; resolve {name!r} first (resolve_backend)")


def resolve_backend(name: str, device: torch.device) -> str:
    """``auto`` → the first available of flash_attn, torch_varlen, reference; a forced one must be available."""
    if name == "auto":
        return next(b for b in BACKENDS if backend_available(b, device))
    check_backend(name)
    if not backend_available(name, device):
        need = "a CUDA device and the flash-attn package" if name == "flash_attn" else "a CUDA device and torch>=2.9"
        raise RuntimeError(
            f"attn_backend={name!r} is not available for tensors on {device} (needs {need}); "
            "use attn_backend='auto' or 'reference'"
        )
    return name


#: dtypes the flash and torch varlen kernels accept for q/k/v (all three equal).
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def kernel_input_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.dtype | None:
    """The half-precision dtype a varlen kernel should receive, as transformers' own flash path picks it.

    Under autocast the projections give half precision, but rotary embeddings with fp32 ``cos``/``sin`` (and
    Qwen3-VL's q/k norms) promote q and k back to fp32, so the kernel would see ``(fp32, fp32, bf16)``:
    the autocast dtype wins. Otherwise any half-precision input's dtype (v is the projection's own output),
    else ``None``: fp32 inputs with autocast off, which no kernel accepts.
    """
    if torch.is_autocast_enabled(q.device.type):
        return torch.get_autocast_dtype(q.device.type)
    return next((t.dtype for t in (v, q, k) if t.dtype in KERNEL_DTYPES), None)


def select_backend(backend: str, device: torch.device, kernel_dtype: torch.dtype | None) -> tuple[str, str | None]:
    """The backend `varlen_attention` runs on ``device`` when the kernels would get ``kernel_dtype``
    (`kernel_input_dtype`: ``None`` for fp32 inputs with autocast off), and why ``auto`` chose the per-sequence
    ``reference`` on CUDA (``None`` otherwise)::

        backend   device  kernel available  kernel_dtype   runs        why
        auto      cuda    yes               bf16 / fp16    the kernel  -
        auto      cuda    yes               None (fp32)    reference   fp32 without autocast: set bf16=True ...
        auto      cuda    no                any            reference   no varlen kernel: install flash-attn ...
        auto      cpu     -                 any            reference   - (the only backend there)
        forced    any     must be           None           the kernel  - (`varlen_attention` raises for fp32)

    Returns:
        `tuple[str, str | None]`: the backend's name and the reason, which `varlen_attention` warns once.
    """
    name = resolve_backend(backend, device)
    if backend != "auto":
        return name, None
    cuda = device.type == "cuda"  # elsewhere the reference is the expected path: nothing to warn about
    if name == "reference":
        return name, (
            "no varlen kernel is available here: install flash-attn (pip install 'hf_packing[flash]') or use "
            "torch>=2.9 (torch_varlen)"
        ) if cuda else None
    if kernel_dtype is None:
        return "reference", (
            "the attention inputs are fp32 with autocast off, which no varlen kernel takes: train with bf16=True "
            "(autocast; or run the step under torch.autocast('cuda', dtype=torch.bfloat16)), or load the model in "
            "bfloat16; attn_backend='reference' chooses this path without a warning"
        ) if cuda else None
    return name, None


def effective_backend(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The backend `varlen_attention` runs for these inputs (`select_backend`)."""
    return select_backend(backend, q.device, kernel_input_dtype(q, k, v))[0]


#: the reasons `warn_reference_once` has warned about (once per process each)
_WARNED: set[str] = set()


def warn_reference_once(why: str) -> None:
    """Warn, once per reason, that ``attn_backend='auto'`` runs the per-sequence reference on CUDA (eager only)."""
    if torch.compiler.is_compiling() or why in _WARNED:
        return
    _WARNED.add(why)
    warnings.warn(
        "hf_packing: attn_backend='auto' runs attention on CUDA with the per-sequence reference (a Python loop of "
        f"SDPA calls in every layer, far slower than a varlen kernel) because {why}",
        stacklevel=3,
    )


def varlen_attention(
    q,
    k,
    v,
    seqs: PackedSequences,
    *,
    causal: bool,
    scale: float,
    backend: str = "auto",
    window: int | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Attention over a flat stream that never crosses a sequence boundary.

    Args:
        q (`torch.Tensor` of shape `(T, H_q, D)`), k, v (`torch.Tensor` of shape `(T, H_kv, D)`), with H_q % H_kv == 0.
        seqs (`PackedSequences`): the boundaries.
        causal (`bool`), scale (`float`): as in SDPA. window (`int`, *optional*): sliding-window size (causal only).
        backend (`str`): ``auto`` or one of `BACKENDS`.

    Kernel backends get q/k/v cast to one half-precision dtype (`kernel_input_dtype`), last dim contiguous, with
    int32 ``cu_seqlens`` on q's device and a Python-int ``max_seqlen``. fp32 inputs with autocast off cannot
    run on a kernel: ``auto`` then takes the exact ``reference`` path (on CUDA with a warning, once, saying why and
    what to set: `select_backend`), a forced kernel raises.

    Returns:
        `torch.Tensor` of shape `(T, H_q, D)`: the kernel's dtype under autocast, else q's dtype.
    """
    dtype = kernel_input_dtype(q, k, v)
    name, why = select_backend(backend, q.device, dtype)
    if why is not None:
        warn_reference_once(why)
    if name == "reference":
        return reference_varlen(q, k, v, seqs, causal=causal, scale=scale, window=window, dropout=dropout)
    if dtype is None:
        raise ValueError(
            f"attn_backend={name!r} needs fp16/bf16 attention inputs but got {q.dtype} with autocast off; load "
            "the model in bfloat16, train with bf16=True (autocast), or use attn_backend='reference'"
        )
    out_dtype = q.dtype
    # The kernels need a contiguous last dim (flash-attn's own maybe_contiguous); a full copy would cost a pass over
    # q/k/v in every layer.
    q, k, v = (t.to(dtype) if t.stride(-1) == 1 else t.to(dtype).contiguous() for t in (q, k, v))
    out = _BACKEND_FNS[name](q, k, v, seqs, causal=causal, scale=scale, window=window, dropout=dropout)
    return out if torch.is_autocast_enabled(out.device.type) else out.to(out_dtype)
