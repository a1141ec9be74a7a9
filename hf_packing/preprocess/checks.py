"""Checks of the user's pieces that need no data: the processor against the model, before anything loads or trains.

Used by `pack_dataset`, `VisionCollator` and `prepare_trainer`, so a wrong piece fails where it is passed, with
the setting to change, instead of deep in a preprocessor or the vision tower at the first step.
"""

from __future__ import annotations

from typing import Any


def is_tokenizer(processor: Any) -> bool:
    """Whether ``processor`` is a bare tokenizer (no image processor): what ``AutoTokenizer`` or
    ``processor.tokenizer`` give, where `VisionCollator` and `pack_dataset` need ``AutoProcessor``'s processor."""
    from transformers import PreTrainedTokenizerBase

    return isinstance(processor, PreTrainedTokenizerBase)


def check_processor(processor: Any, config: Any = None, *, where: str = "VisionCollator") -> None:
    """Raise when ``processor`` cannot serve a Qwen-VL model of ``config``: a tokenizer instead of the processor, or
    the processor of another family (its image processor cuts other patches than the model's vision tower reads).

    Args:
        processor: what the user passed (``None`` is not checked).
        config (`PretrainedConfig`, *optional*): the model's config.
        where (`str`): the argument's owner, for the message.
    """
    if processor is None:
        return
    if is_tokenizer(processor):
        raise ValueError(
            f"{where} got a tokenizer ({type(processor).__name__}) where the model's processor is needed (its image "
            "processor and placeholder tokens): pass AutoProcessor.from_pretrained(<the model's checkpoint>), not "
            "AutoTokenizer / processor.tokenizer"
        )
    vision = getattr(config, "vision_config", None)
    image_processor = getattr(processor, "image_processor", None)
    if vision is None or image_processor is None:
        return
    pairs = (
        ("patch_size", "patch_size"),
        ("temporal_patch_size", "temporal_patch_size"),
        ("merge_size", "spatial_merge_size"),
    )
    for ours, theirs in pairs:
        got, want = getattr(image_processor, ours, None), getattr(vision, theirs, None)
        if got is not None and want is not None and got != want:
            raise ValueError(
                f"{where}: the processor ({type(processor).__name__}, image {ours}={got}) is not this model's "
                f"({config.model_type}, vision {theirs}={want}); load both from the same checkpoint: "
                "AutoProcessor.from_pretrained(<the model's checkpoint>)"
            )
    for token in ("image_token_id", "video_token_id"):
        got, want = getattr(processor, token, None), getattr(config, token, None)
        if got is not None and want is not None and got != want:
            raise ValueError(
                f"{where}: the processor's {token}={got} differs from the model's ({config.model_type}: {want}); load "
                "both from the same checkpoint: AutoProcessor.from_pretrained(<the model's checkpoint>)"
            )
