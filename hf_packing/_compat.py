"""The one place that probes versions and optional packages.

Every probe is a function, evaluated when first called, so ``import hf_packing`` touches no device,
reads no environment variable and imports neither transformers nor any kernel package.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
from functools import cache
from types import ModuleType, SimpleNamespace

from packaging.specifiers import SpecifierSet
from packaging.version import Version

logger = logging.getLogger(__name__)


def _broken(package: str, error: BaseException, instead: str) -> None:
    """Log, once per package (the probes are cached), that an installed optional kernel failed to import."""
    logger.warning(
        "hf_packing: %s is installed but failed to import (%s: %s); %s", package, type(error).__name__, error, instead
    )


#: transformers versions the patches are tested against: the one source, which pyproject.toml's dependency and
#: docs/versions.md restate (tests/test_patches.py holds them to it)
SUPPORTED_TRANSFORMERS = ">=5.17,<5.24"


def check_transformers_version() -> str:
    """Raise a clear error when the installed transformers is outside the supported range.

    Returns:
        `str`: the installed version.
    """
    import transformers

    version = transformers.__version__
    # a development build counts as its release (5.23.0.dev0 is 5.23.0): source installs of a supported one pass
    if Version(Version(version).base_version) not in SpecifierSet(SUPPORTED_TRANSFORMERS):
        raise RuntimeError(
            f"hf_packing supports transformers {SUPPORTED_TRANSFORMERS}; found {version}. Install a supported version "
            f"(pip install 'transformers{SUPPORTED_TRANSFORMERS}') or pin hf_packing to a release that supports yours."
        )
    return version


#: transformers' vision helpers the collator precomputes; each must pop its precomputed value from ``kwargs``
VISION_HELPERS = (
    "get_vision_position_ids",
    "get_vision_cu_seqlens",
    "get_vision_window_index",
    "get_vision_interpolation_indices_and_weights",
)


@cache
def vision_helpers() -> ModuleType | None:
    """``transformers.vision_utils`` when its helpers take precomputed tensors (``kwargs=``, transformers 5.23: the
    vision towers pop ``position_ids``, ``cu_seqlens``, ``max_seqlen``, ``window_index``, ... from their keyword
    arguments), else ``None`` (the towers compute them; a precomputed key would reach the blocks twice)."""
    try:
        module = importlib.import_module("transformers.vision_utils")
    except ImportError:
        return None
    for name in VISION_HELPERS:
        fn = getattr(module, name, None)
        if fn is None or "kwargs" not in inspect.signature(fn).parameters:
            return None
    return module


@cache
def flash_attn_varlen_module() -> ModuleType | None:
    """The module exposing ``flash_attn_varlen_func``: FA3 (``flash_attn_interface``) first, then FA2."""
    for name in ("flash_attn_interface", "flash_attn"):
        if importlib.util.find_spec(name) is None:
            continue
        try:
            module = importlib.import_module(name)
        except Exception as error:  # a broken CUDA build raises at import; treat it as absent, and say so
            _broken(name, error, "attention runs on the next backend (torch_varlen, then reference)")
            continue
        if hasattr(module, "flash_attn_varlen_func"):
            return module
    return None


@cache
def torch_varlen_attn():
    """``torch.nn.attention.varlen.varlen_attn`` if this torch has it, else ``None``."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None
    return varlen_attn


@cache
def torch_varlen_params() -> frozenset[str]:
    """Keyword names ``varlen_attn`` accepts; its signature changed across torch releases."""
    fn = torch_varlen_attn()
    return frozenset(inspect.signature(fn).parameters) if fn is not None else frozenset()


@cache
def liger_fused_linear_cross_entropy():
    """Liger-Kernel's fused linear cross-entropy function, or ``None`` when not installed."""
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except Exception as error:
        _broken("liger_kernel", error, "the loss runs on the chunked PyTorch path")
        return None
    return liger_fused_linear_cross_entropy


class _NoLossForward(ModuleType):
    """Stands in for a Liger fused-loss module that fails to import: any name it is asked for is a function that
    raises (the caller turned the fused loss off, so none is ever called)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{self.__name__}.{name} failed to import and was not to be used")

        return unavailable


def apply_liger_inner_kernels(model, config: dict) -> None:
    """Liger-Kernel's kernels for ``model``'s family (``liger_kernel.transformers._apply_liger_kernel_to_instance``,
    as transformers' ``use_liger_kernel`` applies them) with ``config``, whose fused-loss options the caller turned
    off. Liger (0.8.5) imports its family's fused-loss forward even when that option is off, and on transformers 5.23
    those modules fail to import (output classes that transformers no longer has); such a module is, for this call
    only, a `_NoLossForward`. Raises `ImportError` naming the extra when liger-kernel is not installed, and
    `ValueError` for a family Liger has no kernels for (Qwen4-Exp in 0.8.5), where it would silently apply nothing."""
    import sys

    require_extra("liger", "liger_kernel", purpose="TrainingArguments(use_liger_kernel=True)")
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = model.config.model_type
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:  # Liger would log this and apply nothing: say it instead
        raise ValueError(
            f"use_liger_kernel=True: the installed liger-kernel has no kernels for model_type {model_type!r} (it "
            f"knows {sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)}); set use_liger_kernel=False"
        )
    name = f"liger_kernel.transformers.model.{model_type}"
    placeholder = None
    try:
        importlib.import_module(name)
    except ImportError as error:
        logger.info("hf_packing: %s does not import (%s); its fused loss is off, so it is not needed", name, error)
        placeholder = sys.modules[name] = _NoLossForward(name)
    try:
        _apply_liger_kernel_to_instance(model=model, **config)
    finally:
        if placeholder is not None and sys.modules.get(name) is placeholder:
            del sys.modules[name]


@cache
def fla_linear_ops() -> SimpleNamespace | None:
    """flash-linear-attention's varlen kernels, or ``None`` when the package (or its Triton build) is missing.

    Returns a namespace with ``chunk_gated_delta_rule`` (``fla.ops.gated_delta_rule``) and ``causal_conv1d``
    (``fla.modules.convolution``: a module in 0.4-0.5, an alias in 0.6), both taking ``cu_seqlens``. Qwen3.5's
    grouped values (more value than key heads) need >= 0.5, which the ``linear`` extra pins.
    """
    if importlib.util.find_spec("fla") is None:
        return None
    try:
        from fla.modules.convolution import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as error:  # no Triton, no GPU driver, or an incompatible torch: treat it as absent, and say so
        _broken("fla (flash-linear-attention)", error, "linear attention runs on the per-sequence reference")
        return None
    if "cu_seqlens" not in inspect.signature(causal_conv1d).parameters:
        logger.warning(
            "hf_packing: fla (flash-linear-attention) is installed but its causal_conv1d takes no cu_seqlens (too "
            "old; pip install 'hf_packing[linear]'); linear attention runs on the per-sequence reference"
        )
        return None
    return SimpleNamespace(chunk_gated_delta_rule=chunk_gated_delta_rule, causal_conv1d=causal_conv1d)


@cache
def torch_scan():
    """``torch._higher_order_ops.scan.scan`` (a loop that torch.compile traces once, whatever its length, with
    autograd), or ``None`` on a torch without it (scan's autograd landed in 2.7)."""
    import torch

    if Version(torch.__version__).release[:2] < (2, 7):
        return None
    try:
        from torch._higher_order_ops.scan import scan
    except Exception:
        return None
    return scan


@cache
def torchcodec_decoder():
    """torchcodec's ``VideoDecoder`` when torchcodec imports *and* loads its FFmpeg libraries, else ``None``.

    torchcodec's wheel links the system FFmpeg (``libavcodec.so.N``, N in 4-9): ``import torchcodec`` succeeds
    without it, and only the first decoder raises, so the probe checks the library load itself.
    """
    if importlib.util.find_spec("torchcodec") is None:
        return None
    try:
        from torchcodec._core import ops
        from torchcodec.decoders import VideoDecoder
    except Exception:  # older releases raise at import when FFmpeg is missing
        return None
    if getattr(ops, "_FFMPEG_AVAILABLE", True) is False:
        return None
    return VideoDecoder


@cache
def pyav() -> ModuleType | None:
    """The ``av`` module (PyAV, FFmpeg bundled in its wheel), or ``None`` when not installed."""
    if importlib.util.find_spec("av") is None:
        return None
    try:
        return importlib.import_module("av")
    except Exception:
        return None


def require_extra(extra: str, *modules: str, purpose: str) -> None:
    """Raises `ImportError` naming ``pip install 'hf_packing[extra]'`` when one of `modules` is not installed.

    For work that would otherwise run for minutes and only then fail (the demo trains before it draws).
    """
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"{purpose} needs {', '.join(missing)}: pip install 'hf_packing[{extra}]'")
