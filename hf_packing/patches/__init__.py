"""``apply_rmpad`` / ``revert_rmpad``: the padding-free patches, one reversible group per model family.

Per family the patch replaces ``XForConditionalGeneration.forward`` (unpad once, per-sequence loss) and the
backbone's ``XModel.forward`` (unpad once for callers with their own head, e.g. TRL; see `_backbone`), sets
``accepts_loss_kwargs = True`` (so the Trainer passes ``num_items_in_batch`` and averages tokens across
gradient-accumulation steps and ranks), and answers "flash" to the vision tower's backend check so its
``cu_seqlens`` reach the varlen kernels. Hybrid families (Qwen3.5) also get their linear-attention kernels
replaced by boundary-aware ones (see `_linear`), and Qwen4-Exp its Per-Layer Embeddings and QSA indexer (see
`_qwen4_exp`). Once for all families it wraps transformers' attention registry
(see `_attention`). Everything else, decoder layers, norms, MLPs, DeepStack, stays transformers' own code.

Owns: the model side, transformers' classes as patched (`_forward`, `_backbone`, `_vision`, `_flatten`,
`_attention`, `_linear`, `_qwen4_exp`; the call record `_call`; the family table `_spec`), the loader guard
(`prepared`), the channel of the forward's token counts to evaluation and the telemetry (`recording`) and the applied
sequence-parallel state (`sequence_parallel`). May import: `hf_packing.ops`,
`hf_packing.parallel`, `_compat` and transformers; never the packer, the preprocessing or the Trainer side.

Public to the other parts (the private modules stay this part's own): `FAMILIES`, the family table (``model_type`` →
`FamilySpec`: transformers' module and classes, the M-RoPE keyword arguments); `precomputed_vision_inputs`, the vision
tower's host-side inputs, which the collator computes in its DataLoader workers.

Files:
    _spec.py              what differs between families: class names, rope kwargs, MoE, hybrid linear attention
    _call.py              ForwardCall: a patched forward's call, parsed once into an immutable record (parse_call)
    _forward.py           the padding-free ForConditionalGeneration.forward: contract, routing, outputs, MoE aux weight
    _backbone.py          the padding-free XModel.forward (model.model) for callers with their own head (TRL)
    _flatten.py           caller's batch → one flat row: boundaries (mask, cu_seqlens, position-id restarts), M-RoPE
    _attention.py         routes patched attention classes through varlen (AttentionInterface.register)
    _vision.py            one vision-tower call per forward on every rank: images ‖ videos together, dummy_vision
    _linear.py            Qwen3.5: the linear-attention kernel functions get the boundaries (fla → reference)
    _qwen4_exp.py         Qwen4-Exp: PLE n-grams and conv restart per sample, QSA selection per sample, no dense masks
    _patcher.py           reversible patch records, registry entries included (revert restores the same objects)
    recording.py          the forward's token counts to evaluation and the telemetry (ContextVars)
    prepared.py           forgetting prepare_trainer is loud: the packed forward checks accelerate's active loader
    sequence_parallel.py  the applied SP state: current_state / current_size, init_sequence_parallel, sp_group
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from accelerate.utils import extract_model_from_parallel

from .. import _compat
from ..ops.linear_attention import check_linear_backend
from ..ops.varlen import check_backend
from ..parallel.state import SequenceParallelState
from ._attention import WRAPPED_IMPLEMENTATIONS, make_dispatcher, make_vision_flash_check
from ._backbone import make_backbone_forward
from ._forward import RmpadOptions, check_attn_implementation, make_rmpad_forward
from ._linear import linear_patches
from ._patcher import Patch, PatchSet, RegistryPatch
from ._qwen4_exp import qwen4_exp_patches
from ._spec import FAMILIES, FamilySpec, frames_as_images
from ._vision import precomputed_vision_inputs
from .prepared import training

__all__ = [
    "FAMILIES",
    "FamilySpec",
    "apply_rmpad",
    "check_attn_implementation",
    "frames_as_images",
    "is_applied",
    "is_patched",
    "precomputed_vision_inputs",
    "revert_rmpad",
    "sequence_parallel_state",
    "supported_model_types",
    "unwrap_model",
]

_PATCHES = PatchSet()
_REGISTRY_GROUP = "attention-registry"


def supported_model_types() -> list[str]:
    """The ``config.model_type`` values `apply_rmpad` can patch with the installed transformers."""
    return [name for name, spec in FAMILIES.items() if spec.available()]


def _normalise(model_type: str | Iterable[str] | None) -> list[str]:
    if model_type is None:
        names = supported_model_types()
    else:
        names = [model_type] if isinstance(model_type, str) else list(model_type)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise ValueError(f"unsupported model_type {unknown[0]!r}; hf_packing supports {supported_model_types()}")
    missing = [n for n in names if not FAMILIES[n].available()]
    if missing:
        spec = FAMILIES[missing[0]]
        raise ValueError(
            f"model_type {spec.model_type!r} needs transformers>={spec.min_transformers} (this one has no "
            f"{spec.module}); upgrade transformers"
        )
    return names


def _registry_patches(options: RmpadOptions, families: list[FamilySpec]) -> list[Patch]:
    from transformers import AttentionInterface

    classes = [spec.classes() for spec in families]
    text, vision = tuple(c[1] for c in classes), tuple(c[2] for c in classes)
    registered = AttentionInterface()
    return [
        RegistryPatch(
            AttentionInterface,
            key,
            make_dispatcher(registered[key], backend=options.attn_backend, text_classes=text, vision_classes=vision),
        )
        for key in WRAPPED_IMPLEMENTATIONS
        if key in registered
    ]


def _family_patches(spec: FamilySpec, options: RmpadOptions) -> list[Patch]:
    module = spec.load()
    model_cls, backbone_cls = getattr(module, spec.model_class), getattr(module, spec.backbone_class)
    linear = linear_patches(module, options.linear_backend) if spec.linear_attention else []
    towers = spec.load_attention()
    extra = qwen4_exp_patches(module) if spec.ple_qsa else []
    return [
        Patch(model_cls, "forward", make_rmpad_forward(model_cls.__dict__["forward"], spec, options)),
        Patch(model_cls, "accepts_loss_kwargs", True),
        Patch(backbone_cls, "forward", make_backbone_forward(backbone_cls.__dict__["forward"], spec, options)),
        # the tower's module (GLM-4.6V's tower is GLM-4.1V's): where its attention reads the flash check
        Patch(towers, "is_flash_attention_requested", make_vision_flash_check(towers.is_flash_attention_requested)),
        *linear,
        *extra,
    ]


def _rebuild(families: list[str], options: RmpadOptions | None) -> None:
    """Revert everything, then apply ``families`` with ``options`` bound (none: stay reverted)."""
    for group in reversed(_PATCHES.active()):
        _PATCHES.revert(group)
    if options is None or not families:
        return
    _PATCHES.apply(_REGISTRY_GROUP, _registry_patches(options, [FAMILIES[n] for n in families]), options)
    for name in families:
        _PATCHES.apply(name, _family_patches(FAMILIES[name], options), options)


def apply_rmpad(
    model_type: str | Iterable[str] | None = None,
    *,
    attn_backend: str = "auto",
    dummy_vision: bool = False,
    loss_chunk_size: int | None = None,
    use_liger: bool | None = None,
    linear_backend: str = "auto",
    sequence_parallel_size: int | SequenceParallelState = 1,
) -> None:
    """Make Qwen-VL training padding-free. Call before (or after) loading the model; it patches classes.

    Args:
        model_type (`str` or list, *optional*): one or more of `supported_model_types()`; all by default.
        attn_backend (`str`): ``"auto"`` (flash_attn → torch_varlen → reference, by device and dtype), or force one.
        dummy_vision (`bool`): on a micro-batch without pixels (training or evaluation), run the vision tower on a
            tiny dummy image with zero loss weight, so FSDP / ZeRO-3 ranks issue the same collectives (a text-only
            rank would hang). Images and videos always share one tower call.
        loss_chunk_size (`int`, *optional*): rows per chunk of the linear + cross-entropy.
        use_liger (`bool`, *optional*): force Liger-Kernel's fused linear cross-entropy on or off.
        linear_backend (`str`): Qwen3.5's linear-attention layers: ``"auto"`` (fla → reference, by device and
            dtype), ``"fla"`` (flash-linear-attention) or ``"reference"`` (exact, per sequence).
        sequence_parallel_size (`int`): split each pack along the sequence over this many consecutive ranks
            (Ulysses; see `hf_packing.patches.sequence_parallel`). The world size must be a multiple of it; ranks of one
            group must get the same pack (`pack_dataset` does it), and the number of attention heads (and of
            Qwen3.5's linear-attention value heads) must be divisible by it. The state this creates (the size,
            the mesh built on the first SP step, the comm timer) lives in the applied options
            (`sequence_parallel_state()`) and goes with `revert_rmpad`; pass an earlier state back instead of the
            size to keep its mesh across a revert (a benchmark that toggles the patches per step).

    The options are bound into the patched functions: applying again with the same options changes nothing,
    with other options it re-patches every applied family with them. Raises at apply time, never at import, for
    an unsupported transformers version, model type or an unavailable forced backend.
    """
    _compat.check_transformers_version()
    names = _normalise(model_type)
    check_linear_backend(linear_backend, installed=True)
    check_backend(attn_backend, installed=True)
    sequence_parallel = (
        sequence_parallel_size
        if isinstance(sequence_parallel_size, SequenceParallelState)
        else SequenceParallelState(sequence_parallel_size)
    )
    previous = sequence_parallel_state()
    if previous == sequence_parallel:  # same size: keep the mesh already built (its sub-groups exist on every rank)
        sequence_parallel = previous
    options = RmpadOptions(attn_backend, dummy_vision, loss_chunk_size, use_liger, linear_backend, sequence_parallel)
    applied = [n for n in _PATCHES.active() if n in FAMILIES]
    families = applied + [n for n in names if n not in applied]
    if families != applied or _PATCHES.options(_REGISTRY_GROUP) != options:
        _rebuild(families, options)


def revert_rmpad(model_type: str | Iterable[str] | None = None) -> None:
    """Undo `apply_rmpad` for the given families (all by default); the original functions come back (``is``).

    Refused while a Trainer prepared by `hf_packing.prepare_trainer` is inside ``train()``: its next steps would
    run the unpatched forward on packed batches."""
    names = _normalise(model_type)
    if training() and any(_PATCHES.is_applied(n) for n in names):
        raise RuntimeError(
            "revert_rmpad() while Trainer.train() runs would train the next steps unpatched (packed batches through "
            "the original forward); call it after train() returns"
        )
    remaining = [n for n in _PATCHES.active() if n in FAMILIES and n not in names]
    _rebuild(remaining, _PATCHES.options(_REGISTRY_GROUP))


def sequence_parallel_state() -> SequenceParallelState | None:
    """The `SequenceParallelState` bound into the applied patches (``None`` when nothing is applied): what the
    patched forwards, `pack_dataset` (data-parallel rank and world) and the telemetry read."""
    options = _PATCHES.options(_REGISTRY_GROUP)
    return None if options is None else options.sequence_parallel


def is_applied(model_type: str) -> bool:
    """Whether `apply_rmpad` is in effect for ``model_type``."""
    return _PATCHES.is_applied(model_type)


def unwrap_model(model: Any, *, peft: bool = True) -> Any:
    """The model under its wrappers, in any nesting: ``torch.compile``'s ``_orig_mod``, DDP / FSDP / DeepSpeed
    (accelerate's ``extract_model_from_parallel``) and, with ``peft``, PEFT's ``get_base_model()``. The one unwrap
    of the package: here, below the Trainer side, because `is_patched` needs it."""
    while isinstance(model, torch.nn.Module):
        inner = extract_model_from_parallel(model, keep_torch_compile=False)
        if peft and hasattr(inner, "get_base_model"):
            inner = inner.get_base_model()
        if inner is model:
            break
        model = inner
    return model


def is_patched(model) -> bool:
    """Whether ``model`` (or the model inside compile / DDP / FSDP / PEFT wrappers) runs the padding-free forward."""
    return hasattr(type(unwrap_model(model)).forward, "hf_packing_original")
