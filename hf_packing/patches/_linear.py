"""Patch records for hybrid families (Qwen3.5): the linear-attention kernels learn the sequence boundaries.

transformers' ``Qwen3_5GatedDeltaNet.forward`` calls two module-level functions, and hands both the keyword
arguments it got from the decoder layer, which carry the patched forward's `PackedSequences`::

    causal_conv1d_fn(mixed_qkv, weight, bias, activation=..., hf_packing_seqs=seqs, ...)
    torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, ..., hf_packing_seqs=seqs, ...)

The patch replaces those two module attributes with wrappers: a call carrying ``hf_packing_seqs`` runs the
varlen op of `hf_packing.ops.linear_attention` (state and conv window restart at every boundary); every other call
(the unpatched forward, generation, other batches) goes to the original function untouched. transformers'
own fallbacks, unwrapped from their hub-kernel decorator, are the per-sequence reference. A packed call that also
carries an `~hf_packing.parallel.comm.SPGroup` (``hf_packing_sp``) holds one slice of the pack: the same op
runs on this rank's heads over the whole pack, between Ulysses all-to-alls (`hf_packing.parallel.linear`).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from types import ModuleType

import torch

from ..ops import linear_attention
from ..parallel.comm import SP_KWARG
from ..parallel.linear import ulysses_causal_conv1d, ulysses_gated_delta_rule
from ._attention import PACKED_KWARG, PackedForward, missing_boundaries_error
from ._patcher import Patch

logger = logging.getLogger(__name__)


def _log_backend_once(logged: set[str], kind: str, backend: str, x) -> None:
    """Log the linear-attention backend `resolve_linear_backend` picks, once per op and `apply_rmpad` (eager only)."""
    if torch.compiler.is_compiling() or kind in logged:
        return
    logged.add(kind)
    name = linear_attention.resolve_linear_backend(backend, x)
    logger.info(
        "hf_packing: linear attention (%s) runs on %s (linear_backend=%r, %s on %s)",
        kind,
        name,
        backend,
        x.dtype,
        x.device,
    )


#: module-level names the linear-attention layer calls (transformers 5.17-5.23).
CONV_FN, DELTA_RULE_FN = "causal_conv1d_fn", "torch_chunk_gated_delta_rule"


def make_conv_route(original: Callable, backend: str, logged: set[str] | None = None) -> Callable:
    """Wrap ``causal_conv1d_fn``: packed calls never convolve across a boundary."""
    torch_fn = inspect.unwrap(original)
    logged = set() if logged is None else logged

    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        seqs, sp = kwargs.pop(PACKED_KWARG, None), kwargs.pop(SP_KWARG, None)
        if seqs is None:
            if PackedForward.depth:
                raise missing_boundaries_error(causal_conv1d_fn)
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        _log_backend_once(logged, "conv", backend, hidden_states)

        def conv(x, w, b):
            return linear_attention.causal_conv1d(x, w, b, activation, seqs, backend=backend, torch_fn=torch_fn)

        return (
            conv(hidden_states, weight, bias)
            if sp is None
            else ulysses_causal_conv1d(hidden_states, weight, bias, sp, conv)
        )

    functools.update_wrapper(causal_conv1d_fn, original, assigned=(), updated=())  # only __wrapped__
    return causal_conv1d_fn


def make_delta_rule_route(original: Callable, backend: str, logged: set[str] | None = None) -> Callable:
    """Wrap ``torch_chunk_gated_delta_rule``: packed calls restart the recurrent state at every boundary."""
    torch_fn = inspect.unwrap(original)
    logged = set() if logged is None else logged

    def torch_chunk_gated_delta_rule(
        query,
        key,
        value,
        g,
        beta,
        chunk_size=64,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        **kwargs,
    ):
        seqs, sp = kwargs.pop(PACKED_KWARG, None), kwargs.pop(SP_KWARG, None)
        if seqs is None and PackedForward.depth:
            raise missing_boundaries_error(torch_chunk_gated_delta_rule)
        if seqs is None:
            return original(
                query,
                key,
                value,
                g=g,
                beta=beta,
                chunk_size=chunk_size,
                initial_state=initial_state,
                output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                **kwargs,
            )
        if initial_state is not None or output_final_state:
            raise ValueError("hf_packing runs packed linear attention without a cache (use_cache=False)")
        _log_backend_once(logged, "gated delta rule", backend, query)

        def rule(q, k, v, g, beta):
            return linear_attention.gated_delta_rule(
                q, k, v, g, beta, seqs, use_qk_l2norm=use_qk_l2norm_in_kernel, backend=backend, torch_fn=torch_fn
            )

        if sp is None:
            return rule(query, key, value, g, beta), None
        return ulysses_gated_delta_rule(query, key, value, g, beta, sp, rule), None

    functools.update_wrapper(torch_chunk_gated_delta_rule, original, assigned=(), updated=())  # only __wrapped__
    return torch_chunk_gated_delta_rule


def linear_patches(module: ModuleType, backend: str) -> list[Patch]:
    """The two kernel patches for one hybrid modeling module; raises if this transformers lacks the names."""
    missing = [name for name in (CONV_FN, DELTA_RULE_FN) if not callable(getattr(module, name, None))]
    if missing:
        raise RuntimeError(
            f"{module.__name__} has no {missing}: this transformers' linear-attention layer is not the one hf_packing "
            "patches (5.17-5.23); install a supported transformers"
        )
    logged: set[str] = set()  # the backends logged since this apply
    return [
        Patch(module, CONV_FN, make_conv_route(getattr(module, CONV_FN), backend, logged)),
        Patch(module, DELTA_RULE_FN, make_delta_rule_route(getattr(module, DELTA_RULE_FN), backend, logged)),
    ]
