"""Row formats: what a row may look like, one format per source, and the checks that keep a row from mis-training.

- `messages` (HF), detected by a `messages` column (a list of turns, or its JSON string as a CSV stores it):
  `role` / `content` turns (a string or typed parts), media in `images` (a list) or `image` (one, as the Hub's
  imagefolder and single-image parquet files name it) / `videos` or inline parts, tags are `{"type": "image" |
  "video"}` parts (OpenAI's `{"type": "image_url", "image_url": {"url": ...}}` and `video_url` parts are inline
  media too). Every other key of a message
  (`reasoning_content`, `tool_calls`, `name`, `tool_call_id`, …), any role (`tool`) and the row's `tools` reach the
  chat template as written. LLaMA-Factory's multimodal rows (string contents with `<image>` / `<video>` tags and
  `images` / `videos` columns) are this format: with media columns and no typed media parts, tags are split.
- `llava` (LLaVA / Qwen fine-tune, ShareGPT), detected by a `conversations` column: `from` / `value` turns (`human` /
  `user`, `gpt` / `assistant`, `system`, `observation` as a `tool` turn, `function_call` as tool calls), media in
  `image` or `images` and `video` or `videos`, tags are `<image>` / `<video>` in the text.
- `prompt_completion` (TRL), detected by `prompt` + `completion` columns: lists of messages (conversational: the
  completion's assistant turns are supervised, the prompt's are context) or strings (standard: `prompt + completion`
  with no template, the completion and an end-of-sequence token supervised).

Nothing is dropped and empty turns are kept: normalisation only translates what the format spells its own way.
A source's format is given (`row_format=`) or detected once from its own columns, so the `None` columns that
`datasets.interleave_datasets` adds to every row of a mix never decide it. A video is a file (a path, bytes or
`{"bytes", "path"}`; sampled by the source's `videos_kwargs`, see `video_sampling.py`) or pre-sampled frames (a
`(T, H, W, C)` array or a list of images; in `videos` a nested list per video) whose sampling rate is the row's `fps`
or the source's. A row whose tags and media disagree is skipped as `"placeholder_mismatch"`: never trained with a tag
left as text.

A source that gives no sample over a full pass raises [`~hf_packing.packing.stats.NoSamplesError`] (see
[`~hf_packing.packing.stats.check_yield`]) with its top skip reasons.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import SampleError

__all__ = [
    "FEATURES",
    "FORMATS",
    "Conversation",
    "detect_format",
    "normalize_row",
    "per_source",
    "row_fps",
    "source_formats",
]

FORMATS = ("auto", "messages", "llava", "prompt_completion")
_ROLES = {  # ShareGPT / LLaVA speakers (`from`)
    **{"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"},
    **{"observation": "tool", "tool": "tool", "function_call": "assistant"},
}
_TAGS = re.compile(r"(<image>|<video>)")
_URL_PARTS = {"image_url": "image", "video_url": "video"}  # OpenAI's media parts


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


def per_source_dict(value: Any, names: Sequence[str], setting: str) -> dict[str | None, Mapping[str, Any] | None]:
    """A dict-valued setting (`videos_kwargs`, `chat_template_kwargs`) for every source: one mapping for all, a list,
    or `{source name: mapping}` (a mapping whose keys are all source names)."""
    if isinstance(value, Mapping) and (not names or not set(value) <= set(names)):
        keys: list[str | None] = list(names) or [None]
        return dict.fromkeys(keys, value)
    return per_source(value, names, setting)


def detect_format(columns: Sequence[str] | None, name: str | None = None) -> str:
    """`"messages"`, `"llava"` or `"prompt_completion"` from a source's own columns; `"auto"` (per row) when several
    or unknown (streaming)."""
    if columns is None:
        return "auto"
    found = [
        f
        for f, needs in (("messages", {"messages"}), ("llava", {"conversations"}), ("prompt_completion", {"prompt"}))
        if needs <= set(columns)
    ]
    if not found:
        who = "the dataset" if name is None else f"source {name!r}"
        raise ValueError(
            f"{who} has no 'messages', 'conversations' or 'prompt' + 'completion' column (columns: {sorted(columns)});"
            " see docs/row_formats.md"
        )
    if found == ["prompt_completion"] and "completion" not in columns:
        raise ValueError(f"a 'prompt' column needs a 'completion' column (columns: {sorted(columns)})")
    return found[0] if len(found) == 1 else "auto"


def source_formats(ds: Any, row_format: Any = "auto") -> dict[str | None, str]:
    """Each source's format: given in `row_format` (one, or `{name: format}`), else detected from its columns."""
    parts: dict[str | None, Any] = {str(n): p for n, p in ds.items()} if isinstance(ds, Mapping) else {None: ds}
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


def _split_tags(text: str, *, tag_newlines: bool = True) -> list[dict[str, Any]]:
    """`"<image>\\nWhat?"` → an image part and a text part. With `tag_newlines` (LLaVA), one newline next to a tag
    belongs to the tag; without (LLaMA-Factory, which replaces a tag in place), the text stays as written."""
    pieces, parts = _TAGS.split(text), []
    for k, piece in enumerate(pieces):
        if k % 2:
            parts.append({"type": piece[1:-1]})
            continue
        if tag_newlines:
            piece = piece[1:] if k and piece.startswith("\n") else piece
            piece = piece[:-1] if k < len(pieces) - 1 and piece.endswith("\n") else piece
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


@dataclass
class Conversation:
    """A row as the chat template receives it.

    Attributes:
        messages (`list[dict]`): every message with every key the row gave it (`None` values dropped, as
            `apply_chat_template` drops them); only the format's own spelling is translated (`from` / `value`, media
            references and `<image>` / `<video>` tags in text become `{"type": "image" | "video"}` parts).
        images (`list`), videos (`list`): the media references, in placeholder order.
        tools (`list`, *optional*): the row's `tools` (JSON schemas), passed to the template.
        first_supervised (`int`): assistant turns before this message index are context (a TRL prompt's turns).
        raw (`tuple[str, str]`, *optional*): a standard (string) TRL prompt/completion row, rendered without a
            template: the text is `prompt + completion`, the completion supervised.
    """

    messages: list[dict[str, Any]]
    images: list[Any]
    videos: list[Any]
    tools: list[Any] | None = None
    first_supervised: int = 0
    raw: tuple[str, str] | None = None

    def features(self) -> list[str]:
        """What of [`FEATURES`] the row carries: so a user sees that reasoning and tool calls arrived."""
        found = []
        assistant = [m for m in self.messages if m.get("role") == "assistant"]
        if any(_REASONING_KEYS & set(m) or "<think>" in _plain_text(m.get("content")) for m in assistant):
            found.append("reasoning")
        if any(m.get("tool_calls") for m in self.messages):
            found.append("tool_calls")
        if any(m.get("role") == "tool" for m in self.messages):
            found.append("tool_turns")
        if self.tools:
            found.append("tools")
        return found


#: what a row may carry beyond text, counted per row by the packer's statistics
FEATURES = ("reasoning", "tool_calls", "tool_turns", "tools")
_REASONING_KEYS = frozenset({"reasoning_content", "reasoning", "thinking"})  # transformers aliases all three


def _plain_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        return "".join(p.get("text") or "" for p in content if isinstance(p, Mapping))
    return ""


def _json(value: Any, what: str) -> Any:
    """A value that datasets often stores as a JSON string (tools, tool calls): decoded, else as given."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise SampleError("bad_row", f"{what} is a string but not JSON ({err})") from None


def _content(
    content: Any, index: Any, *, sharegpt: bool, split_tags: bool, inline: bool, images: list[Any], videos: list[Any]
) -> str | list[dict[str, Any]]:
    """A message's content with media made placeholder parts; text, empty text and unknown parts kept as given."""
    if isinstance(content, (str, bytes, bytearray)):
        text = _text(content, index)
        return _split_tags(text, tag_newlines=sharegpt) if split_tags and _TAGS.search(text) else text
    if not isinstance(content, (list, tuple)):
        raise SampleError("bad_row", f"message content must be text or a list of parts, got {type(content).__name__}")
    parts = []
    for part in content:
        if isinstance(part, str):
            part = {"type": "text", "text": part}
        if not isinstance(part, Mapping):
            raise SampleError("bad_row", f"a content part must be a dict, got {type(part).__name__}")
        part = {k: v for k, v in part.items() if v is not None}
        kind = part.get("type") or ("image" if "image" in part else "video" if "video" in part else "text")
        if kind in _URL_PARTS:  # OpenAI: {"type": "image_url", "image_url": {"url": ...}} (or the URL itself)
            url = part.pop(kind, None)
            part[_URL_PARTS[kind]] = url.get("url") if isinstance(url, Mapping) else url
            kind = _URL_PARTS[kind]
        if kind in ("image", "video"):
            ref = part.pop(kind, part.pop("path", None))
            if inline and ref is not None:
                (images if kind == "image" else videos).append(ref)
            part["type"] = kind
        elif kind == "text":
            part["text"] = _text(part.get("text"), index)
        parts.append(part)
    return parts


def _message(
    turn: Any, index: Any, *, sharegpt: bool, split_tags: bool, inline: bool, images: list[Any], videos: list[Any]
) -> dict[str, Any]:
    """One turn as the template receives it: every key kept; ShareGPT / LLaVA `from` / `value` become `role` /
    `content` (`observation` a `tool` turn, `function_call` an assistant turn whose JSON value is its `tool_calls`)."""
    if not isinstance(turn, Mapping):
        raise SampleError("bad_row", f"a message must be a dict, got {type(turn).__name__}")
    message = {k: v for k, v in turn.items() if v is not None}
    if "role" not in message and "from" in message:
        sharegpt = True
    if sharegpt:
        speaker = _text(message.pop("from") if "from" in message else message.pop("role", None), index)
        role = _ROLES.get(speaker.lower())
        if role is None:
            raise SampleError("bad_row", f"unknown role {speaker!r} (known: {sorted(_ROLES)})")
        if "value" in message and "content" not in message:
            message["content"] = message.pop("value")
        if speaker.lower() == "function_call":
            calls = _json(message.pop("content", None), "a function_call turn")
            calls = calls if isinstance(calls, list) else [calls]
            message["tool_calls"] = [c if "function" in c else {"type": "function", "function": c} for c in calls]
            message["content"] = ""
    else:
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise SampleError("bad_row", f"a message's role must be a non-empty string, got {role!r}")
    message = {"role": role, **{k: v for k, v in message.items() if k != "role"}}
    if "content" in message:
        message["content"] = _content(
            message["content"],
            index,
            sharegpt=sharegpt,
            split_tags=split_tags,
            inline=inline,
            images=images,
            videos=videos,
        )
    return message


def _has_media_parts(turns: Any) -> bool:
    return any(
        isinstance(t, Mapping)
        and isinstance(t.get("content"), (list, tuple))
        and any(isinstance(p, Mapping) and p.get("type") in ("image", "video", *_URL_PARTS) for p in t["content"])
        for t in turns
    )


def normalize_row(row: Mapping[str, Any], index: Any = None, *, row_format: str = "auto") -> Conversation:
    """A row of any format → the [`Conversation`] the chat template receives.

    Args:
        row (`Mapping`): an HF-messages, LLaVA, LLaMA-Factory or TRL prompt/completion row (module docstring).
        index (*optional*): the sample's id, for error messages.
        row_format (`str`, defaults to `"auto"`): the source's format; `"auto"` reads the column holding a value.

    Raises:
        [`SampleError`]: `"empty_conversation"`, `"placeholder_mismatch"` (tags and media disagree), `"bad_row"`,
        `"bad_text"`.
    """
    if row_format == "auto":
        row_format = _row_format(row)
    if row_format == "prompt_completion":
        prompt, completion = row.get("prompt"), row.get("completion")
        if isinstance(prompt, (str, bytes)) and isinstance(completion, (str, bytes)):
            if _media(row, "image", "images") or _media(row, "videos"):
                raise SampleError("bad_row", "string prompt/completion rows hold no media: use the conversational form")
            return Conversation([], [], [], raw=(_text(prompt, index), _text(completion, index)))
        if not isinstance(prompt, (list, tuple)) or not isinstance(completion, (list, tuple)):
            raise SampleError("bad_row", "prompt and completion must both be text or both be lists of messages")
        turns, first = [*prompt, *completion], len(prompt)
    else:
        turns, first = row.get("messages" if row_format == "messages" else "conversations") or [], 0
        if isinstance(turns, str):  # a CSV (imagefolder's metadata.csv) holds the turns as JSON
            turns = _json(turns, "messages" if row_format == "messages" else "conversations")
    llava = row_format == "llava"
    # `image` (one, or a list): the Hub's imagefolder and single-image parquet column, accepted by every format
    images = _media(row, "image", "images")
    videos = _media(row, "video", "videos") if llava else _media(row, "videos")
    turns = list(turns or [])
    typed = _has_media_parts(turns)
    # LLaMA-Factory: HF messages whose string contents hold <image> / <video> tags for the `images` / `videos` columns
    split_tags = llava or (bool(images or videos) and not typed)
    inline = not llava and not images and not videos
    messages = [
        _message(turn, index, sharegpt=llava, split_tags=split_tags, inline=inline, images=images, videos=videos)
        for turn in turns
    ]
    if not messages:
        raise SampleError("empty_conversation", "the conversation is empty")
    tags = Counter(
        p["type"] for m in messages if isinstance(m.get("content"), list) for p in m["content"] if "type" in p
    )
    check_video_frames(videos, tags["video"])
    if (tags["image"], tags["video"]) != (len(images), len(videos)):
        raise SampleError(
            "placeholder_mismatch",
            f"{tags['image']} image / {tags['video']} video tags but {len(images)} images / {len(videos)} videos",
        )
    tools = _json(row.get("tools"), "tools")
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise SampleError("bad_row", f"tools must be a list of tool schemas (or its JSON), got {type(tools).__name__}")
    return Conversation(messages, images, videos, list(tools) if tools else None, first)


def _row_format(row: Mapping[str, Any]) -> str:
    """A row's format from the columns that hold a value (a `None` column, added by a mix, is absent)."""
    columns = {"messages": "messages", "conversations": "llava", "prompt": "prompt_completion"}
    filled = [f for k, f in columns.items() if row.get(k) is not None]
    present = filled or [f for k, f in columns.items() if k in row]
    if not present:
        raise SampleError(
            "bad_row", f"row has no 'messages', 'conversations' or 'prompt'/'completion' (keys: {sorted(row)})"
        )
    return present[0]


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
        from transformers.utils import logging as hf_logging  # loaded by then (a processor exists)

        hf_logging.get_logger(__name__).warning_once(
            "video frames without fps: the processor assumes 24 fps (Qwen2.5-VL second_per_grid_ts, "
            "Qwen3-VL timestamps), wrong for frames taken seconds apart; give rows an 'fps' or pass "
            "fps="
        )
    return [None if r is None else float(r) for r in rates]


#: file suffixes of still images: a video reference that names one is a frame, not a video file
FRAME_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff")
NESTED_FRAMES_HINT = "a video's frames go in a nested list, one list per video (videos: [[frame, frame, ...]])"


def is_frame_path(ref: Any) -> bool:
    """Whether `ref` is a path naming a still image (by its suffix), which a video reference never should be."""
    path = os.fspath(ref) if isinstance(ref, (str, os.PathLike)) else None
    return isinstance(path, str) and path.lower().endswith(FRAME_SUFFIXES)


def check_video_frames(videos: Sequence[Any], tags: int) -> None:
    """Refuses a video given as a flat list of frame paths (more videos than `tags`, each a still image) with the hint
    to nest them; the plain tag/media mismatch is reported by the caller.

    Raises:
        [`SampleError`]: `"placeholder_mismatch"`, naming [`NESTED_FRAMES_HINT`].
    """
    if tags < len(videos) and all(is_frame_path(ref) for ref in videos):
        raise SampleError(
            "placeholder_mismatch",
            f"{tags} video tag(s) but {len(videos)} videos, each an image file: {NESTED_FRAMES_HINT}",
        )
