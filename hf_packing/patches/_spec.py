"""What differs between the model families (Qwen-VL, GLM-V): names, and a couple of forward arguments."""

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
        video_frames_as_images: the tower encodes each video frame as an image of its own (grid ``[1, h, w]``) and
            the text writes a frame's tokens with the image token (GLM-V): the one tower call gets the frames' grids,
            and a pack with images and videos enters the text model as one kind, in row order (`_vision`).
        attention_module: where ``text_attention`` / ``vision_attention`` live when not in ``module`` (GLM-4.6V
            builds GLM-4.1V's text and vision models).
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
    attention_module: str | None = None
    video_frames_as_images: bool = False
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

    def load_attention(self) -> ModuleType:
        """The module of the attention classes (and of the vision tower's flash check): ``module`` unless the
        family builds its text and vision models from another family's (GLM-4.6V: GLM-4.1V's, via ``AutoModel``)."""
        return importlib.import_module(self.attention_module or self.module)

    def classes(self) -> tuple[type, type, type]:
        mod, attention = self.load(), self.load_attention()
        return (
            getattr(mod, self.model_class),
            getattr(attention, self.text_attention),
            getattr(attention, self.vision_attention),
        )


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
        # GLM-V (GLM-4.1V, GLM-4.5V, GLM-4.6V): Qwen2-VL's layout with their own tower and processor; what is new
        # about them is documented in docs/patches.md ("GLM-V")
        _spec("glm4v", "Glm4v", "Glm4vTextAttention", "Glm4vVisionAttention", video_frames_as_images=True),
        _spec(
            "glm4v_moe",
            "Glm4vMoe",
            "Glm4vMoeTextAttention",
            "Glm4vMoeVisionAttention",
            moe=True,
            video_frames_as_images=True,
        ),
        _spec(
            "glm46v",
            "Glm46V",
            "Glm4vTextAttention",
            "Glm4vVisionAttention",
            attention_module="transformers.models.glm4v.modeling_glm4v",
            video_frames_as_images=True,
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


def frames_as_images(config) -> bool:
    """Whether the family of a model ``config`` has `FamilySpec.video_frames_as_images` (unknown families: no)."""
    spec = FAMILIES.get(getattr(config, "model_type", ""))
    return bool(spec and spec.video_frames_as_images)
