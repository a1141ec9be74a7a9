"""Row formats: what a row may look like, one format per source, and the checks that keep a row from mis-training.

- `messages` (HF), detected by a `messages` column: `role` / `content` turns (a string or typed parts), media in
  `images` / `videos` or inline parts, tags are `{"type": "image" | "video"}` parts.
- `llava` (LLaVA / Qwen fine-tune), detected by a `conversations` column: `from` / `value` turns, media in `image`
  or `images` and `video` or `videos`, tags are `<image>` / `<video>` in the text.

A source's format is given (`row_format=`) or detected once from its own columns, so the `None` columns that
`datasets.interleave_datasets` adds to every row of a mix never decide it. A video is a file (a path, bytes or
`{"bytes", "path"}`; sampled by the source's `videos_kwargs`, see `video_sampling.py`) or pre-sampled frames (a
`(T, H, W, C)` array or a list of images; in `videos` a nested list per video) whose sampling rate is the row's `fps`
or the source's. A row whose tags and media disagree is skipped as `"placeholder_mismatch"`: never trained with a tag
left as text.

A source that gives no sample over a full pass raises [`~hf_packing.pack_stats.NoSamplesError`] (see
[`~hf_packing.pack_stats.check_yield`]) with its top skip reasons.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from transformers.utils import logging

from .images import SampleError

__all__ = [
    "FORMATS",
    "detect_format",
    "normalize_row",
    "per_source",
    "row_fps",
    "source_formats",
]

FORMATS = ("auto", "messages", "llava")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_TAGS = re.compile(r"(<image>|<video>)")
logger = logging.get_logger("hf_packing")


# ------------------------------------------------------------------------------------------------ per source
def per_source(value: Any, names: Sequence[str], setting: str, default: Any = None) -> dict[str | None, Any]:
    """`value` for every source: one value for all, a list of one per source (in `names`' order) or a `{source name:
    value}` mapping (absent names: `default`).

    A single dataset (no `names`) is the source `None`.
    """
    keys: list[str | None] = list(names) or [None]
    if isinstance(value, (list, tuple)):
        if len(value) != 1 and len(value) != len(names):
            raise ValueError(
                f"{setting} has {len(value)} values for {len(keys)} source(s) {list(names)}: give one value, one per "
                "source (in the mix's order) or {name: value}"
            )
        value = value[0] if len(value) == 1 else dict(zip(names, value, strict=True))
    if not isinstance(value, Mapping):
        return dict.fromkeys(keys, default if value is None else value)
    unknown = set(value) - set(keys)
    if unknown:
        raise ValueError(
            f"{setting} names {sorted(map(str, unknown))} but the sources are {list(names)}; a single "
            f"dataset takes one value, a {{name: dataset}} mix one per name"
        )
    return {k: default if value.get(k) is None else value[k] for k in keys}


def detect_format(columns: Sequence[str] | None, name: str | None = None) -> str:
    """`"messages"` or `"llava"` from a source's own columns; `"auto"` (per row) when both or unknown (streaming)."""
    if columns is None:
        return "auto"
    has = ("messages" in columns, "conversations" in columns)
    if not any(has):
        who = "the dataset" if name is None else f"source {name!r}"
        raise ValueError(
            f"{who} has neither a 'messages' nor a 'conversations' column (columns: {sorted(columns)}); "
            "see docs/row_formats.md"
        )
    return "auto" if all(has) else "messages" if has[0] else "llava"


def source_formats(ds: Any, row_format: Any = "auto") -> dict[str | None, str]:
    """Each source's format: given in `row_format` (one, or `{name: format}`), else detected from its columns."""
    parts = {str(n): p for n, p in ds.items()} if isinstance(ds, Mapping) else {None: ds}
    given = per_source(row_format, [n for n in parts if n is not None], "row_format", "auto")
    for name, fmt in given.items():
        if fmt not in FORMATS:
            raise ValueError(f"row_format must be one of {FORMATS}, got {fmt!r} for {name or 'the dataset'}")
    return {
        n: f if f != "auto" else detect_format(getattr(parts[n], "column_names", None), n) for n, f in given.items()
    }


# ------------------------------------------------------------------------------------------------ rows
def _text(value: Any, index: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as err:
            raise SampleError("bad_text", f"text is not valid UTF-8 ({err})") from None
    if not isinstance(value, str):
        raise SampleError("bad_row", f"expected text, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:  # lone surrogates from a lossy decode upstream
        raise SampleError("bad_text", f"text is not valid UTF-8 ({err})") from None
    return value


def _media(row: Mapping[str, Any], *keys: str) -> list[Any]:
    """The references under the first of `keys` that holds a value (a `None` column is absent), as a list."""
    given = [k for k in keys if row.get(k) is not None]
    if len(given) > 1:
        raise SampleError("bad_row", f"the row has both {given[0]!r} and {given[1]!r}; keep one")
    if not given:
        return []
    value = row[given[0]]
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _split_tags(text: str) -> list[dict[str, Any]]:
    """`"<image>\\nWhat?"` → an image part and a text part; one newline next to a tag belongs to the tag."""
    pieces, parts = _TAGS.split(text), []
    for k, piece in enumerate(pieces):
        if k % 2:
            parts.append({"type": piece[1:-1]})
            continue
        piece = piece[1:] if k and piece.startswith("\n") else piece
        piece = piece[:-1] if k < len(pieces) - 1 and piece.endswith("\n") else piece
        parts.append({"type": "text", "text": piece})
    return parts


def normalize_row(
    row: Mapping[str, Any],
    index: Any = None,
    *,
    row_format: str = "auto",
) -> tuple[list[dict[str, Any]], list[Any], list[Any]]:
    """A row of either format → `(messages, images, videos)` with every content a list of typed parts.

    Args:
        row (`Mapping`): an HF-messages or a LLaVA row (see the module docstring).
        index (*optional*): the sample's id, for error messages.
        row_format (`str`, defaults to `"auto"`): the source's format; `"auto"` reads the column holding a value.

    Returns:
        `tuple`: messages (`role` in user/assistant/system; parts `{"type": "image" | "video"}` or
        `{"type": "text", "text": str}`), the image references and the videos, in tag order.

    Raises:
        [`SampleError`]: `"empty_conversation"`, `"placeholder_mismatch"` (tags and media disagree), `"bad_row"`,
        `"bad_text"`.
    """
    if row_format == "auto":
        filled = [k for k in ("messages", "conversations") if row.get(k) is not None]
        present = filled or [k for k in ("messages", "conversations") if k in row]
        if not present:
            raise SampleError("bad_row", f"row has neither 'messages' nor 'conversations' (keys: {sorted(row)})")
        row_format = "messages" if present[0] == "messages" else "llava"
    llava = row_format == "llava"
    if llava:
        turns, images, videos = row.get("conversations"), _media(row, "image", "images"), _media(row, "video", "videos")
    else:
        turns, images, videos = row.get("messages"), _media(row, "images"), _media(row, "videos")
    inline = not llava and not images
    messages: list[dict[str, Any]] = []
    for turn in turns or []:
        role = _ROLES.get(_text(turn.get("role", turn.get("from")), index).lower())
        if role is None:
            raise SampleError("bad_row", f"unknown role {turn.get('role', turn.get('from'))!r}")
        content = turn.get("content", turn.get("value"))
        if isinstance(content, (str, bytes, bytearray)) or content is None:
            text = _text(content, index)
            parts = _split_tags(text) if llava else [{"type": "text", "text": text}]
        else:
            parts = []
            for part in content:
                kind = part.get("type") or ("image" if part.get("image") is not None else "text")
                if kind in ("image", "video"):
                    parts.append({"type": kind})
                    ref = part.get(kind, part.get("path"))
                    if inline and ref is not None:
                        (images if kind == "image" else videos).append(ref)
                else:
                    parts.append({"type": "text", "text": _text(part.get("text"), index)})
        parts = [p for p in parts if p["type"] != "text" or p["text"]]
        if parts:
            messages.append({"role": role, "content": parts})
    if not messages:
        raise SampleError("empty_conversation", "the conversation is empty")
    tags = Counter(p["type"] for m in messages for p in m["content"])
    if (tags["image"], tags["video"]) != (len(images), len(videos)):
        raise SampleError(
            "placeholder_mismatch",
            f"{tags['image']} image / {tags['video']} video tags but {len(images)} images / {len(videos)} videos",
        )
    return messages, images, videos


def row_fps(
    row: Mapping[str, Any], num_videos: int, default: float | None = None, *, frames: Sequence[bool] | None = None
) -> list[float | None]:
    """The sampling rate of each video's frames: the row's `fps` (one number, or one per video), else `default`.

    `frames` marks the videos given as pre-sampled frames (default: all); only they need a rate (a file's is in its
    header), so only they warn without one.
    """
    value = row.get("fps")
    value = default if value is None else value
    rates = list(value) if isinstance(value, (list, tuple)) else [value] * num_videos
    if len(rates) != num_videos or not all(r is None or (isinstance(r, (int, float)) and r > 0) for r in rates):
        raise SampleError("bad_row", f"fps must be a positive number or one per video ({num_videos}), got {value!r}")
    if any(r is None and f for r, f in zip(rates, [True] * num_videos if frames is None else frames)):
        logger.warning_once(
            "video frames without fps: the processor assumes 24 fps (Qwen2.5-VL second_per_grid_ts, "
            "Qwen3-VL timestamps), wrong for frames taken seconds apart; give rows an 'fps' or pass "
            "fps="
        )
    return [None if r is None else float(r) for r in rates]
