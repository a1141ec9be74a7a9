"""What differs between the Qwen-VL families: names, and a couple of forward arguments."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class FamilySpec:
    """One model family, named by ``config.model_type``.

    Attributes:
        model_type: e.g. ``"qwen2_5_vl"``.
        module: the transformers modeling module.
        model_class / backbone_class / text_attention / vision_attention: class names inside ``module``
            (``XForConditionalGeneration``, its ``model`` attribute's ``XModel``, the attention modules).
        rope_kwargs: extra ``get_rope_index`` / model-forward arguments the family takes.
        moe: whether the text model routes tokens to experts (adds the load-balancing loss).
        linear_attention: whether text layers mix softmax attention with Gated DeltaNet linear attention
            (Qwen3.5), whose conv and recurrent kernels get the boundaries too (see `_linear`).
        ple_qsa: whether the text model has Qwen4-Exp's Per-Layer Embeddings and QSA-indexed attention, which get
            the boundaries too and run without transformers' dense masks (see `_qwen4_exp`).
        min_transformers: the first transformers release with the family (``None``: every supported one).
    """

    model_type: str
    module: str
    model_class: str
    backbone_class: str
    text_attention: str
    vision_attention: str
    rope_kwargs: tuple[str, ...] = ()
    moe: bool = False
    linear_attention: bool = False
    ple_qsa: bool = False
    min_transformers: str | None = None

    def available(self) -> bool:
        """Whether the installed transformers has the family's modeling module."""
        try:
            return importlib.util.find_spec(self.module) is not None
        except ModuleNotFoundError:  # the family's package itself is missing (find_spec imports the parents)
            return False

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)

    def classes(self) -> tuple[type, type, type]:
        mod = self.load()
        return getattr(mod, self.model_class), getattr(mod, self.text_attention), getattr(mod, self.vision_attention)


def _spec(model_type: str, prefix: str, text_attention: str, vision_attention: str, **extra) -> FamilySpec:
    return FamilySpec(
        model_type=model_type,
        module=f"transformers.models.{model_type}.modeling_{model_type}",
        model_class=f"{prefix}ForConditionalGeneration",
        backbone_class=f"{prefix}Model",
        text_attention=text_attention,
        vision_attention=vision_attention,
        **extra,
    )


#: The supported families, in the order `supported_model_types()` lists them.
FAMILIES: dict[str, FamilySpec] = {
    spec.model_type: spec
    for spec in (
        _spec("qwen2_vl", "Qwen2VL", "Qwen2VLAttention", "VisionAttention"),
        _spec(
            "qwen2_5_vl",
            "Qwen2_5_VL",
            "Qwen2_5_VLAttention",
            "Qwen2_5_VLVisionAttention",
            rope_kwargs=("second_per_grid_ts",),
        ),
        _spec("qwen3_vl", "Qwen3VL", "Qwen3VLTextAttention", "Qwen3VLVisionAttention"),
        _spec("qwen3_vl_moe", "Qwen3VLMoe", "Qwen3VLMoeTextAttention", "Qwen3VLMoeVisionAttention", moe=True),
        _spec("qwen3_5", "Qwen3_5", "Qwen3_5Attention", "Qwen3_5VisionAttention", linear_attention=True),
        _spec(
            "qwen3_5_moe",
            "Qwen3_5Moe",
            "Qwen3_5MoeAttention",
            "Qwen3_5MoeVisionAttention",
            moe=True,
            linear_attention=True,
        ),
        _spec(
            "qwen4_exp",
            "Qwen4Exp",
            "Qwen4ExpTextAttention",
            "Qwen4ExpVisionAttention",
            moe=True,
            linear_attention=True,
            ple_qsa=True,
            min_transformers="5.23",
        ),
    )
}
