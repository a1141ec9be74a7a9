"""Why a row does not become a sample: the skip reasons, the error that carries one, and the counter of skips.

Every part of preprocessing (formats, templates, images, video, the preprocessor) raises `SampleError` with one of
`REASONS`; the packer skips and counts it (`SkipCounter`, `hf_packing.packing.stats.PackStats`) under the skip budget
(`PackingConfig.max_skipped_fraction`), or re-raises it with ``on_error="raise"``. Any other exception is a bug and
stops the run.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

logger = logging.getLogger("hf_packing")

REASONS: tuple[str, ...] = (  # why a row is skipped: its conversation, its media, its size, its processing
    *("bad_row", "bad_text", "empty_conversation", "no_assistant_turn", "placeholder_mismatch", "missing_file"),
    *("template_error", "unlocated_assistant_turn"),
    *("path_outside_root", "empty_image", "corrupt_image", "image_too_large", "bad_aspect_ratio", "unsupported_video"),
    *("empty_video", "corrupt_video", "video_too_large", "fetch_failed", "bad_data_uri"),
    *("overlong", "overlong_vision", "length_mismatch", "too_many_images", "too_many_vision_patches"),
    "empty_pack",
)


class SampleError(ValueError):
    """A row that cannot become a sample; `reason` is one of [`REASONS`]. Skipped and counted (`on_error="skip"`)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class OverlongError(ValueError):
    """A sample over `max_length` with `on_overlong="error"`; always raised, whatever `on_error` is."""


class SkipCounter(Counter):
    """A `Counter` of skipped samples by reason (or by `key`, e.g. `(source, reason)`) that logs the first skip of each
    key once, with the sample id."""

    def __init__(self, *args: Any, log: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log = log

    def record(
        self, reason: str, index: Any, message: str, *, key: Any = None, exc_info: BaseException | None = None
    ) -> None:
        key = reason if key is None else key
        if self[key] == 0 and self.log:
            logger.warning(
                "skipping sample %s (%s): %s. Further %r skips are only counted (see stats()).",
                index,
                reason,
                message,
                reason,
                exc_info=exc_info,
            )
        self[key] += 1
