"""Route Qwen-VL attention through the varlen backends via transformers' attention-function registry.

transformers calls ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)`` in every
attention module. The patch registers wrappers (``AttentionInterface.register``) around the sdpa and
flash_attention_* entries: a call from a patched text-attention class that carries the packed boundaries
(``hf_packing_seqs``) runs causal varlen attention; a call from a patched vision-attention class with
``cu_seq_lens_q`` runs non-causal varlen attention; every other call goes to the original function
untouched. A text call that also carries an `~hf_packing.parallel.comm.SPGroup` (``hf_packing_sp``) holds
one slice of the pack: the same kernel runs between two Ulysses all-to-alls (`ulysses_attention`). So other
models, generation and unpatched forwards behave exactly as without the patch, and nothing
depends on a config switch that gradient checkpointing's recomputation could miss.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

from ..ops import sparse_attention
from ..ops.varlen import PackedSequences, effective_backend, kernel_input_dtype, varlen_attention
from ..parallel.comm import SP_KWARG, ulysses_attention

logger = logging.getLogger(__name__)

#: kwarg that carries the text stream's `PackedSequences` from the patched forward down to attention.
PACKED_KWARG = "hf_packing_seqs"
#: kwarg that carries a Qwen4-Exp QSA layer's `PackedQSA` from its patched attention module to the attention route
QSA_KWARG = "hf_packing_qsa"
#: registry keys the patch wraps; a model on another implementation (eager, flex) is refused at forward time.
WRAPPED_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")


class PackedQSA(NamedTuple):
    """What a Qwen4-Exp QSA layer selected on a pack (`hf_packing.ops.sparse_attention`): the attention route runs
    `~hf_packing.ops.sparse_attention.qsa_attention` over these keys instead of causal varlen attention."""

    selection: sparse_attention.QSASelection
    blocks: sparse_attention.QSABlocks
    compress_ratio: int


def qsa_backend(attn_backend: str) -> str:
    """The QSA attention backend for ``attn_backend``: the dense-mask ``reference`` when forced, else ``gather``
    (memory and work grow with T times the selected keys per query, not T²)."""
    return "reference" if attn_backend == "reference" else "gather"


def qsa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    qsa: PackedQSA,
    seqs: PackedSequences,
    scale: float,
    dropout: float,
    backend: str,
) -> torch.Tensor:
    """`sparse_attention.qsa_attention` for the registry route: ``(1, H, T, D)`` q / k / v (transformers' layout)
    cast to one dtype (the autocast dtype under autocast, as transformers' kernels get it; else the promoted one),
    the output ``(1, T, H, D_v)`` as transformers' attention functions return it."""
    q, k, v = _to_flat(query), _to_flat(key), _to_flat(value)
    dtype = kernel_input_dtype(q, k, v) or torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    out = sparse_attention.qsa_attention(
        q.to(dtype),
        k.to(dtype),
        v.to(dtype),
        qsa.selection,
        qsa.blocks,
        seqs,
        compress_ratio=qsa.compress_ratio,
        scaling=scale,
        backend=backend,
        dropout=dropout,
    )
    return out.unsqueeze(0)


def _to_flat(t: torch.Tensor) -> torch.Tensor:
    """(1, H, T, D) → (T, H, D)."""
    return t.squeeze(0).transpose(0, 1)


#: the host lengths the vision tower's ``cu_seqlens`` will hold in this forward (`host_vision_seqlens`)
_VISION_SEQLENS: contextvars.ContextVar[tuple[list[int], ...]] = contextvars.ContextVar("hf_packing_vision", default=())


@contextmanager
def host_vision_seqlens(candidates: tuple[list[int], ...]) -> Iterator[None]:
    """Inside the block, a vision ``cu_seqlens`` of ``len(c) + 1`` entries takes its host lengths from candidate
    ``c`` (trusted: the collator's grids) instead of being read back. ``candidates``: one list per distinct boundary
    set, of distinct lengths (Qwen2.5-VL: frames, and windows when some frame has several)."""
    token = _VISION_SEQLENS.set(candidates)
    try:
        yield
    finally:
        _VISION_SEQLENS.reset(token)


def _known_seqlens(cu_seqlens: torch.Tensor) -> list[int] | None:
    """The host lengths of ``cu_seqlens`` from `host_vision_seqlens`, else None.

    Trusted, not re-checked on the device: the tower computes ``cu_seqlens`` from the same grids the collator read
    (`_vision.vision_seqlens` is tested equal to transformers' own boundaries on odd grids), and a device check would
    need the host lengths copied to the device every forward."""
    return next((c for c in _VISION_SEQLENS.get() if len(c) + 1 == cu_seqlens.shape[0]), None)


class PackedForward:
    """How many packed forwards are running (`inside_packed_forward`): a plain counter, which torch.compile reads
    as a constant (a ``ContextVar`` would break ``fullgraph`` compilation of the decoder layers)."""

    depth = 0


@contextmanager
def inside_packed_forward() -> Iterator[None]:
    """Inside the block a patched text attention call without the pack's boundaries raises (`make_dispatcher`):
    the original attention would see one flat row of several samples without a mask, and attend across them."""
    PackedForward.depth += 1
    try:
        yield
    finally:
        PackedForward.depth -= 1


def missing_boundaries_error(caller: object) -> RuntimeError:
    """The error for a call from ``caller`` (an attention module or a linear-attention op) that lost the boundaries."""
    name = getattr(caller, "__name__", None) if not isinstance(caller, torch.nn.Module) else None
    name = name or type(caller).__name__
    return RuntimeError(
        f"{name} was called inside a packed forward without the pack's boundaries "
        f"({PACKED_KWARG!r} did not reach it): the original attention would attend across the samples of the flat "
        "row. Something between the decoder layer and its attention dropped the keyword arguments (a wrapper, hook "
        "or custom layer that does not pass **kwargs on); pass them through"
    )


class _VisionBoundaries:
    """Host-side `PackedSequences` of the vision tower's ``cu_seqlens``, once per tensor.

    Every block of a vision tower passes the same ``cu_seqlens`` tensor (Qwen2.5-VL alternates two); keyed
    weakly by that tensor, the host copy is made once per forward instead of once per block. Under
    `host_vision_seqlens` (the collator's grids) it is taken from there, with no host read.
    """

    def __init__(self) -> None:
        # id -> (weak reference, boundaries); tensors compare elementwise, so they cannot be dict keys themselves
        self._seen: dict[int, tuple[weakref.ref, PackedSequences]] = {}

    def __call__(self, cu_seqlens: torch.Tensor, max_seqlen: int | None) -> PackedSequences:
        ref, seqs = self._seen.get(id(cu_seqlens), (None, None))
        if ref is None or seqs is None or ref() is not cu_seqlens:
            self._seen = {k: v for k, v in self._seen.items() if v[0]() is not None}
            seqlens = _known_seqlens(cu_seqlens)
            if seqlens is None:
                seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            seqs = PackedSequences(cu_seqlens.to(torch.int32), max(seqlens, default=0), seqlens)
            self._seen[id(cu_seqlens)] = (weakref.ref(cu_seqlens), seqs)
        return seqs if max_seqlen is None else PackedSequences(seqs.cu_seqlens, int(max_seqlen), seqs.seqlens)


def make_dispatcher(
    original: Callable, *, backend: str, text_classes: tuple[type, ...], vision_classes: tuple[type, ...]
) -> Callable:
    """Wrap a registered attention function with the varlen route described in the module docstring."""
    vision_boundaries = _VisionBoundaries()
    logged: set[str] = set()

    def log_backend_once(kind: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if kind in logged:
            return
        logged.add(kind)
        name = effective_backend(backend, query, key, value)
        logger.info(
            "hf_packing: %s attention runs on %s (attn_backend=%r, %s on %s%s)",
            kind,
            name,
            backend,
            query.dtype,
            query.device,
            ", autocast" if torch.is_autocast_enabled(query.device.type) else "",
        )

    def attention(module, query, key, value, attention_mask, **kwargs):
        seqs, sp, qsa = kwargs.pop(PACKED_KWARG, None), kwargs.pop(SP_KWARG, None), kwargs.pop(QSA_KWARG, None)
        # isinstance, not type(): FSDP2's fully_shard swaps a wrapped module's class for a generated subclass.
        if kwargs.get("cu_seq_lens_q") is not None and isinstance(module, vision_classes):
            seqs, causal = vision_boundaries(kwargs["cu_seq_lens_q"], kwargs.get("max_length_q")), False
        elif seqs is not None and isinstance(module, text_classes):
            causal = True
        elif PackedForward.depth and isinstance(module, text_classes):
            raise missing_boundaries_error(module)
        else:
            return original(module, query, key, value, attention_mask, **kwargs)
        scale = kwargs.get("scaling")
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        window, dropout = kwargs.get("sliding_window"), kwargs.get("dropout", 0.0) or 0.0
        if qsa is not None and causal:
            if sp is not None:
                raise ValueError("QSA attention (Qwen4-Exp) does not run under sequence parallelism")
            return qsa_attention(query, key, value, qsa, seqs, scale, dropout, qsa_backend(backend)), None
        if not torch.compiler.is_compiling():
            log_backend_once("vision" if not causal else "text", query, key, value)

        def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return varlen_attention(
                q, k, v, seqs, causal=causal, scale=scale, backend=backend, window=window, dropout=dropout
            )

        q, k, v = _to_flat(query), _to_flat(key), _to_flat(value)
        out = kernel(q, k, v) if sp is None or not causal else ulysses_attention(q, k, v, sp, kernel)
        return out.unsqueeze(0), None

    functools.update_wrapper(attention, original, assigned=(), updated=())  # only __wrapped__
    return attention


def make_vision_flash_check(original: Callable) -> Callable:
    """Wrap a modeling module's ``is_flash_attention_requested`` so vision towers take their ``cu_seqlens`` path.

    Vision attention only passes ``cu_seqlens`` to the attention function on its flash branch; on every
    other branch it loops over images. Answering "flash" for vision configs on a wrapped implementation
    sends the whole tower through one varlen call of the chosen backend.
    """

    def is_flash_attention_requested(config=None, requested_attention_implementation=None, version=None):
        if (
            config is not None
            and version is None
            and hasattr(config, "spatial_merge_size")  # vision configs only; text configs keep the answer
            and getattr(config, "_attn_implementation", None) in WRAPPED_IMPLEMENTATIONS
        ):
            return True
        return original(
            config=config, requested_attention_implementation=requested_attention_implementation, version=version
        )

    functools.update_wrapper(is_flash_attention_requested, original, assigned=(), updated=())  # only __wrapped__
    return is_flash_attention_requested
