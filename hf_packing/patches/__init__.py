"""``apply_rmpad`` / ``revert_rmpad``: the padding-free patches, one reversible group per model family.

Per family the patch replaces ``XForConditionalGeneration.forward`` (unpad once, per-sequence loss), sets
``accepts_loss_kwargs = True`` (so the Trainer passes ``num_items_in_batch`` and averages tokens across
gradient-accumulation steps and ranks), and answers "flash" to the vision tower's backend check so its
``cu_seqlens`` reach the varlen kernels. Once for all families it wraps transformers' attention registry
(see `_attention`). Everything else, decoder layers, norms, MLPs, DeepStack, stays transformers' own code.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Iterable

from .. import _compat
from ..varlen import BACKENDS
from . import _attention
from ._attention import WRAPPED_IMPLEMENTATIONS, make_dispatcher, make_vision_flash_check
from ._forward import make_rmpad_forward
from ._patcher import Patch, PatchSet
from ._spec import FAMILIES, FamilySpec

_PATCHES = PatchSet()
_REGISTRY_GROUP = "attention-registry"
#: read by the patched forwards at call time; apply_rmpad updates it in place.
OPTIONS: dict[str, Any] = {"dummy_vision": False, "loss_chunk_size": None, "use_liger": None}


def supported_model_types() -> list[str]:
    """The ``config.model_type`` values `apply_rmpad` can patch."""
    return list(FAMILIES)


def _normalise(model_type: str | Iterable[str] | None) -> list[str]:
    names = supported_model_types() if model_type is None else [model_type] if isinstance(model_type, str) else list(model_type)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise ValueError(f"unsupported model_type {unknown[0]!r}; hf_packing supports {supported_model_types()}")
    return names


def _check_backend(attn_backend: str) -> None:
    if attn_backend not in ("auto",) + BACKENDS:
        raise ValueError(f"unknown attn_backend {attn_backend!r}; choose one of {('auto',) + BACKENDS}")
    if attn_backend == "flash_attn" and _compat.flash_attn_varlen_module() is None:
        raise RuntimeError("attn_backend='flash_attn' needs flash-attn (pip install 'hf_packing[flash]'); or use 'auto'")
    if attn_backend == "torch_varlen" and _compat.torch_varlen_attn() is None:
        raise RuntimeError("attn_backend='torch_varlen' needs torch>=2.9 (torch.nn.attention.varlen); or use 'auto'")


def _registry_patches() -> list[Patch]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
    return [Patch(mapping, key, make_dispatcher(mapping[key])) for key in WRAPPED_IMPLEMENTATIONS if key in mapping]


def _family_patches(spec: FamilySpec) -> list[Patch]:
    module = spec.load()
    model_cls = getattr(module, spec.model_class)
    return [
        Patch(model_cls, "forward", make_rmpad_forward(model_cls.__dict__["forward"], spec, OPTIONS)),
        Patch(model_cls, "accepts_loss_kwargs", True),
        Patch(module, "is_flash_attention_requested", make_vision_flash_check(module.is_flash_attention_requested)),
    ]


def _sync_attention_state() -> None:
    text, vision = set(), set()
    for name in _PATCHES.active():
        if name in FAMILIES:
            _, text_cls, vision_cls = FAMILIES[name].classes()
            text.add(text_cls)
            vision.add(vision_cls)
    _attention.STATE["text_classes"], _attention.STATE["vision_classes"] = tuple(text), tuple(vision)


def apply_rmpad(
    model_type: str | Iterable[str] | None = None,
    *,
    attn_backend: str = "auto",
    dummy_vision: bool = False,
    loss_chunk_size: int | None = None,
    use_liger: bool | None = None,
) -> None:
    """Make Qwen-VL training padding-free. Call before (or after) loading the model; it patches classes.

    Args:
        model_type (`str` or list, *optional*): one or more of `supported_model_types()`; all by default.
        attn_backend (`str`): ``"auto"`` (flash_attn → torch_varlen → reference, by device), or force one.
        dummy_vision (`bool`): on a micro-batch without pixels, run the vision tower on a tiny dummy image with
            zero loss weight, so FSDP / ZeRO-3 ranks issue the same collectives (a text-only rank would hang).
        loss_chunk_size (`int`, *optional*): rows per chunk of the linear + cross-entropy.
        use_liger (`bool`, *optional*): force Liger-Kernel's fused linear cross-entropy on or off.

    Applying again only updates the options. Raises at apply time, never at import, for an unsupported
    transformers version, model type or an unavailable forced backend.
    """
    _compat.check_transformers_version()
    names = _normalise(model_type)
    _check_backend(attn_backend)
    _attention.STATE["backend"] = attn_backend
    OPTIONS.update(dummy_vision=dummy_vision, loss_chunk_size=loss_chunk_size, use_liger=use_liger)
    if not _PATCHES.is_applied(_REGISTRY_GROUP):
        _PATCHES.apply(_REGISTRY_GROUP, _registry_patches())
    for name in names:
        if not _PATCHES.is_applied(name):
            _PATCHES.apply(name, _family_patches(FAMILIES[name]))
    _sync_attention_state()


def revert_rmpad(model_type: str | Iterable[str] | None = None) -> None:
    """Undo `apply_rmpad` for the given families (all by default); the original functions come back (``is``)."""
    for name in _normalise(model_type):
        _PATCHES.revert(name)
    if not any(name in FAMILIES for name in _PATCHES.active()):
        _PATCHES.revert(_REGISTRY_GROUP)
        _attention.STATE["backend"] = "auto"
    _sync_attention_state()


def is_applied(model_type: str) -> bool:
    """Whether `apply_rmpad` is in effect for ``model_type``."""
    return _PATCHES.is_applied(model_type)


apply_rmpad_qwen2_vl = partial(apply_rmpad, "qwen2_vl")
apply_rmpad_qwen2_5_vl = partial(apply_rmpad, "qwen2_5_vl")
apply_rmpad_qwen3_vl = partial(apply_rmpad, "qwen3_vl")
apply_rmpad_qwen3_vl_moe = partial(apply_rmpad, "qwen3_vl_moe")
