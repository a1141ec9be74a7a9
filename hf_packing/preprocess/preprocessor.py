"""Preprocessing: chat template, assistant-only labels, and token counts from image metadata.

One row becomes one *sample*: 1-D `input_ids`, `labels`, `attention_mask`, `mm_token_type_ids`, the vision tensors
with their grids, `num_tokens` and `index`. Rows are HF messages or LLaVA/Qwen conversations (see `formats.py`); the
same conversation gives the same sample in either format.

[`Preprocessor.estimate`] counts a sample's tokens without decoding pixels: the chat template is rendered and
tokenized with ONE placeholder token per image, image sizes come from file headers (`PIL.Image.open` is lazy), and
the processor's own `get_number_of_image_patches` (Qwen's `smart_resize`: 28 px cells on Qwen2/2.5-VL, 32 px on
Qwen3-VL) gives each image's `patches / merge**2` tokens. That costs a small fraction of a full
[`Preprocessor.process`] (decode, convert, resize, patchify; measured: docs/packer.md, 'What a row costs'), which runs
only for samples placed in a pack and checks that the processed length equals the estimate.
[`Preprocessor.metadata_columns`] stores the estimate as columns (one `ds.map`), so a large run plans from columns
instead.

Videos follow the same split: a file's tokens come from its header (`video.py`) and the processor's own frame sampling
and patch rules (`video_sampling.py`); processing decodes only the frame indices the estimate counted.

Bad input raises [`SampleError`] with a `reason` from [`REASONS`]; the caller skips and counts it (see
[`SkipCounter`]). Odd image modes (CMYK, RGBA/LA/P with alpha on white, 16-bit, float) are converted, not refused.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..config import MAX_IMAGE_PIXELS, PackingConfig
from ..ops.loss import IGNORE_INDEX
from ..ops.varlen import merged_tokens
from .errors import REASONS, OverlongError, SampleError, SkipCounter
from .fetch import MediaFetcher
from .formats import FORMATS, Conversation, normalize_row, row_fps
from .images import ImageLoader
from .templates import ChatRenderer
from .video import VideoInfo, VideoLoader, is_file_ref
from .video_sampling import VideoSampling

logger = logging.getLogger(__name__)


#: a row's planning metadata as columns (`hf_packing.packing.length_index`): tokens, images, Σ t·h·w, Σ t·(h·w)²,
#: videos and
#: their `<|video_pad|>` tokens, for a refused row its reason and message (tokens -1), and what the row carries
#: beyond text (`formats.FEATURES`, comma-separated)
META_COLUMNS = (
    "hfp_num_tokens",
    "hfp_num_images",
    "hfp_vision_patches",
    "hfp_vision_sq",
    "hfp_num_videos",
    "hfp_video_tokens",
    "hfp_skip",
    "hfp_skip_message",
    "hfp_features",
)
#: the tokens that wrap image / video placeholders in the families' templates and processors
_VISION_WRAPPERS = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
)
VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
__all__ = [
    "META_COLUMNS",
    "REASONS",
    "VISION_KEYS",
    "OverlongError",
    "Preprocessor",
    "SampleError",
    "SampleMeta",
    "SkipCounter",
    "normalize_row",
]


@dataclass(frozen=True)
class SampleMeta:
    """What the planner needs, from metadata only: tokens (after truncation), images, Σ t·h·w vision patches, and
    Σ t·(h·w)² (the vision tower's attention work: each image or video frame attends within itself); for
    statistics, videos and their `<|video_pad|>` tokens."""

    num_tokens: int
    num_images: int
    vision_patches: int
    vision_sq: int = 0
    num_videos: int = 0
    video_tokens: int = 0
    features: tuple[str, ...] = ()  # what of formats.FEATURES the row carries (reasoning, tool calls, ...)


@dataclass(frozen=True)
class _Video:
    ref: Any  # a file reference or pre-sampled frames
    info: VideoInfo  # from headers
    frames: int  # what the processor receives: len(indices) of a file, or every pre-sampled frame
    indices: list[int] | None  # the file's frames to decode; None for pre-sampled frames
    metadata: dict[str, Any]  # `VideoMetadata` fields for the processor: fps and frame indices give time


@dataclass
class _Prepared:
    text: str  # the rendered chat template, one placeholder per image/video (what the processor receives)
    images: list[Any]
    videos: list[_Video]
    ids: np.ndarray  # tokens of `text`, videos' placeholders expanded with each pad run compressed to one token
    repeats: np.ndarray  # how many tokens each of `ids` becomes in the processed sample
    supervised: np.ndarray  # bool per `ids` entry
    meta: SampleMeta  # its `num_tokens` after truncation


class Preprocessor:
    """Turns one source's rows into samples (full processing) or [`SampleMeta`] (metadata only) for one processor.

    Args:
        processor: a Qwen-VL processor (`Qwen2VLProcessor`, `Qwen2_5_VLProcessor`, `Qwen3VLProcessor`).
        max_length (`int`, *optional*): token budget (`None`: none); longer samples follow `on_overlong`.
        media_root, video_root, fps, videos_kwargs, train_on, on_overlong, max_image_pixels, chat_template_kwargs,
            empty_thinking, media_timeout, media_tries, media_max_bytes, media_cache_bytes: one source's value of the
            [`~hf_packing.packing.dataset.pack_dataset`] setting of that name (`image_root`: `media_root`'s former
            name).
        row_format (`str`, defaults to `"auto"`): `"messages"`, `"llava"`, or `"auto"` per row (see `formats.py`).
    """

    def __init__(
        self,
        processor: Any,
        *,
        max_length: int | None = None,
        media_root: str | os.PathLike | None = None,
        video_root: str | os.PathLike | None = None,
        fps: float | None = None,
        videos_kwargs: Mapping[str, Any] | None = None,
        row_format: Any = PackingConfig.row_format,  # the defaults are pack_dataset's, declared once there
        train_on: str = PackingConfig.train_on,
        on_overlong: str = PackingConfig.on_overlong,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
        image_root: str | os.PathLike | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        empty_thinking: str = PackingConfig.empty_thinking,
        media_timeout: float = PackingConfig.media_timeout,
        media_tries: int = PackingConfig.media_tries,
        media_max_bytes: int = PackingConfig.media_max_bytes,
        media_cache_bytes: int = PackingConfig.media_cache_bytes,
    ) -> None:
        if media_root is not None and image_root is not None:
            raise ValueError("image_root is the former name of media_root: pass one of them")
        if row_format not in FORMATS:
            raise ValueError(f"row_format must be one of {FORMATS}, got {row_format!r}")
        if train_on not in ("assistant", "all"):
            raise ValueError(f"train_on must be 'assistant' or 'all', got {train_on!r}")
        if on_overlong not in ("drop", "error", "truncate_text"):
            raise ValueError(f"on_overlong must be 'drop', 'error' or 'truncate_text', got {on_overlong!r}")
        self.processor, self.max_length, self.train_on, self.on_overlong = processor, max_length, train_on, on_overlong
        root = media_root if media_root is not None else image_root
        # one fetcher (and its cache) for images, videos and frames: URLs and data URIs, see fetch.py
        fetcher = MediaFetcher(
            timeout=media_timeout, tries=media_tries, max_bytes=media_max_bytes, cache_bytes=media_cache_bytes
        )
        self.images = ImageLoader(image_root=root, max_image_pixels=max_image_pixels, fetcher=fetcher)
        self.videos = VideoLoader(
            video_root=root if video_root is None else video_root, max_image_pixels=max_image_pixels, fetcher=fetcher
        )
        video_processor = getattr(processor, "video_processor", None)
        self.sampling = VideoSampling(video_processor, videos_kwargs) if video_processor is not None else None
        self.fps, self.row_format = fps, row_format
        self.template = ChatRenderer(processor, chat_template_kwargs, empty_thinking=empty_thinking)
        if train_on == "assistant":
            self.template.markers  # noqa: B018 - a template whose turns cannot be located is refused here, not per row
        self.tokenizer = getattr(processor, "tokenizer", processor)
        ids = self.tokenizer.convert_tokens_to_ids
        self.image_token, self.video_token = processor.image_token, getattr(processor, "video_token", None)
        self.image_id, self.video_id = ids(self.image_token), ids(self.video_token) if self.video_token else None
        # the placeholders and the tokens that wrap them (Qwen: vision start/end; GLM-V: begin/end of image/video),
        # those of the tokenizer's vocabulary: never supervised
        wrappers = [ids(t) for t in _VISION_WRAPPERS if t in self.tokenizer.get_vocab()]
        self.vision_ids = np.array(
            [i for i in (self.image_id, self.video_id, *wrappers) if isinstance(i, int) and i >= 0]
        )
        self.merge = processor.image_processor.merge_size

    # ------------------------------------------------------------------------------------------------ metadata
    def estimate(self, row: Mapping[str, Any], index: Any = None) -> SampleMeta:
        """Tokens, images and vision patches of `row` from text and image headers only; raises [`SampleError`]."""
        return self._prepare(row, index).meta

    def metadata_columns(self, row: Mapping[str, Any], index: Any = None) -> dict[str, Any]:
        """[`META_COLUMNS`] of one row: what [`~hf_packing.packing.length_index.build_length_index`] stores (once,
        shared by every rank through the `datasets` cache); `pack_dataset` then plans from these columns (for a
        `datasets.Dataset` it reads only them) instead of estimating each row in every worker of every rank. A refused
        row keeps its reason and message, so it is counted without being read again. Stale columns are caught when
        the sample is processed (`"length_mismatch"`)."""
        try:
            meta = self.estimate(row, index)
        except SampleError as err:  # a bad row, counted as planning counts it; any other error ends the build
            return dict(zip(META_COLUMNS, (-1, 0, 0, 0, 0, 0, err.reason, str(err), ""), strict=True))
        counts = (meta.num_tokens, meta.num_images, meta.vision_patches, meta.vision_sq, meta.num_videos)
        return dict(zip(META_COLUMNS, (*counts, meta.video_tokens, "", "", ",".join(meta.features)), strict=True))

    def planned_meta(self, row: Mapping[str, Any], index: Any = None) -> SampleMeta:
        """What the planner uses: the row's [`META_COLUMNS`] when it has them, else [`estimate`]. Columns computed with
        `max_length=None` follow this preprocessor's `on_overlong` here; a `truncate_text` cut through an image is
        found when the sample is processed (reason `"overlong_vision"`)."""
        if META_COLUMNS[0] not in row:
            return self.estimate(row, index)
        tokens, images, patches, vision_sq, videos, video_tokens, skip, message, features = (
            row[c] for c in META_COLUMNS
        )
        if skip:
            raise SampleError(skip, message or f"refused when the metadata columns were computed ({skip})")
        if self.max_length is not None and tokens > self.max_length:
            tokens = self._truncate(index, np.array([tokens]), np.zeros(1, bool), np.ones(1, bool))
        features = tuple(features.split(",")) if features else ()
        return SampleMeta(tokens, images, patches, vision_sq, videos, video_tokens, features)

    def _prepare(self, row: Mapping[str, Any], index: Any) -> _Prepared:
        conv = normalize_row(row, index, row_format=self.row_format)
        images, refs = conv.images, conv.videos
        fps = row_fps(row, len(refs), self.fps, frames=[not is_file_ref(ref) for ref in refs])
        text, spans = self._render(conv)
        if text.count(self.image_token) != len(images) or (
            self.video_token and text.count(self.video_token) != len(refs)
        ):
            raise SampleError("placeholder_mismatch", "the text itself contains image/video placeholder tokens")
        img_patches = [self._image_patches(ref) for ref in images]
        videos = [self._video(ref, rate) for ref, rate in zip(refs, fps, strict=True)]
        compressed, vid_runs, vid_patches, shift, run_starts = self._expand_videos(text, videos)
        enc = self.tokenizer(compressed, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        starts = np.asarray([a for a, _ in enc["offset_mapping"]], dtype=np.int64)
        repeats = np.ones(len(ids), dtype=np.int64)
        # each placeholder token, in text order, is an image's or a video run's (GLM-V writes frames with the image
        # token: the run's place tells them apart, not the id)
        where = np.flatnonzero(np.isin(ids, [i for i in (self.image_id, self.video_id) if i is not None]))
        in_video = np.isin(starts[where], run_starts)
        for picked, counts in ((~in_video, [merged_tokens(p, self.merge) for p in img_patches]), (in_video, vid_runs)):
            if int(picked.sum()) != len(counts):
                raise SampleError(
                    "placeholder_mismatch",
                    f"{int(picked.sum())} placeholder tokens after tokenizing, {len(counts)} expected",
                )
            repeats[where[picked]] = counts
        vision = np.isin(ids, self.vision_ids)
        supervised = np.zeros(len(ids), dtype=bool)
        for a, b in [(shift(a), shift(b)) for a, b in spans] if spans is not None else [(0, len(compressed))]:
            supervised |= (starts >= a) & (starts < b)
        for a, b in vid_patches[1]:  # video timestamps are part of the vision span
            vision |= (starts >= a) & (starts < b)
        supervised &= ~vision
        num_tokens = self._truncate(index, repeats, vision, supervised)
        patches = sum(img_patches) + sum(vid_patches[0])
        vision_sq = sum(p * p for p in img_patches) + sum(vid_patches[2])
        meta = SampleMeta(
            num_tokens, len(images), patches, vision_sq, len(videos), sum(vid_runs), tuple(conv.features())
        )
        return _Prepared(text, images, videos, ids, repeats, supervised, meta)

    def _render(self, conv: Conversation) -> tuple[str, list[tuple[int, int]] | None]:
        """The text the processor receives and the character spans supervised in it (`None`: every token).

        The checkpoint's chat template renders the conversation as written; the supervised spans are its assistant
        turns (from `first_supervised` on) as [`~hf_packing.preprocess.templates.ChatRenderer`] locates them. A
        standard TRL prompt/completion row has no template: `prompt + completion + eos`, the completion and eos
        supervised.
        """
        if conv.raw is not None:
            prompt, completion = conv.raw
            eos = self.tokenizer.eos_token or ""
            text = prompt + completion + ("" if completion.endswith(eos) else eos)
            return text, None if self.train_on == "all" else [(len(prompt), len(text))]
        first = conv.first_supervised
        if self.train_on == "assistant" and not any(m["role"] == "assistant" for m in conv.messages[first:]):
            raise SampleError("no_assistant_turn", "no assistant turn to supervise (or set train_on='all')")
        text = self.template.render(conv.messages, conv.tools)
        if self.train_on == "all":
            return text, None
        return self.template.closed(
            text, self.template.assistant_spans(text, conv.messages, supervised=lambda i: i >= first)
        )

    def _video(self, ref: Any, rate: float | None) -> _Video:
        """A video's plan from headers: a file's sampled frame indices, or pre-sampled frames taken at `rate`."""
        if self.sampling is None:
            raise SampleError("unsupported_video", f"{type(self.processor).__name__} has no video processor")
        info = self.videos.info(ref, rate)
        if not info.is_file:
            return _Video(ref, info, info.frames, None, _video_metadata(info, rate, list(range(info.frames))))
        indices = self.sampling.indices(info)
        return _Video(ref, info, len(indices), indices, _video_metadata(info, info.fps, indices))

    def _expand_videos(
        self, text: str, videos: list[_Video]
    ) -> tuple[str, list[int], tuple[list[int], list, list[int]], Any, list[int]]:
        """Replace each video placeholder by the processor's own expansion (Qwen3 adds timestamps; GLM-V writes each
        frame as an image with its timestamp), each placeholder run compressed to one token; also returns where those
        compressed run tokens start in the output text."""
        if not videos:
            return text, [], ([], [], []), lambda p: p, []
        from transformers.video_utils import VideoMetadata

        # a row with videos reached here only with a video processor (`_video` refuses it before)
        assert self.sampling is not None and self.video_token is not None

        pieces, runs, patches, ranges, edits, squares, run_starts = [], [], [], [], [], [], []
        pos, out_len = 0, 0
        # a run of the video token (Qwen) or of the image token inside a video's expansion (GLM-V's frames)
        tokens = [re.escape(t) for t in (self.video_token, self.image_token) if t]
        run = "|".join(f"(?:{t})+" for t in tokens)
        for video in videos:
            grid_t, per_t = self.sampling.grid(video.frames, video.info.height, video.info.width)
            n = per_t * grid_t
            fake = {
                "video_grid_thw": torch.tensor([[grid_t, per_t, 1]]),
                "video_metadata": [VideoMetadata(**video.metadata)],
            }
            repl = self.processor.replace_video_token(fake, 0)
            found = [(m.group(0), m.start()) for m in re.finditer(run, repl)]
            token_of = [self.video_token if r.startswith(self.video_token) else self.image_token for r, _ in found]
            runs += [len(r) // len(t) for (r, _), t in zip(found, token_of, strict=True)]
            pieces_of_repl, cursor = [], 0
            at = text.index(self.video_token, pos)
            out_len += at - pos
            for (r, start), t in zip(found, token_of, strict=True):
                pieces_of_repl.append(repl[cursor:start])
                run_starts.append(out_len + sum(map(len, pieces_of_repl)))
                pieces_of_repl.append(t)
                cursor = start + len(r)
            repl = "".join(pieces_of_repl) + repl[cursor:]
            pieces += [text[pos:at], repl]
            ranges.append((out_len, out_len + len(repl)))
            edits.append((at + len(self.video_token), len(repl) - len(self.video_token)))
            out_len += len(repl)
            pos = at + len(self.video_token)
            patches.append(n)
            squares.append(n * per_t)  # attention per frame group: grid_t blocks of per_t patches
        return (
            "".join(pieces) + text[pos:],
            runs,
            (patches, ranges, squares),
            lambda p: p + sum(d for e, d in edits if e <= p),
            run_starts,
        )

    def _truncate(self, index: Any, repeats: np.ndarray, vision: np.ndarray, supervised: np.ndarray) -> int:
        ends = np.cumsum(repeats)
        total, limit = int(ends[-1]), self.max_length
        if limit is None or total <= limit:
            return total
        if self.on_overlong == "error":
            raise OverlongError(
                f"sample {index} has {total:,} tokens > max_length={limit}; raise max_length or set "
                "on_overlong='truncate_text' (or 'drop')"
            )
        if self.on_overlong == "drop":
            raise SampleError("overlong", f"{total:,} tokens > max_length={limit} (on_overlong='drop')")
        vision_end = int(ends[np.flatnonzero(vision)[-1]]) if vision.any() else 0
        if vision_end > limit:
            raise SampleError(
                "overlong_vision",
                f"its vision tokens end at {vision_end:,} > max_length={limit}; truncate_text never cuts an image",
            )
        if not supervised[ends <= limit].any():
            raise SampleError("overlong", f"nothing supervised within the first max_length={limit} tokens")
        return limit

    # ------------------------------------------------------------------------------------------------ media
    def _image_patches(self, ref: Any) -> int:
        height, width = self.images.size(ref)
        try:
            return int(self.processor.image_processor.get_number_of_image_patches(height, width, {}))
        except ValueError as err:  # smart_resize refuses aspect ratios > 200
            raise SampleError("bad_aspect_ratio", str(err)) from None

    # ------------------------------------------------------------------------------------------------ samples
    def process(
        self,
        row: Mapping[str, Any],
        index: Any = None,
        *,
        planned_tokens: int | None = None,
    ) -> dict[str, Any]:
        """Full processing: decode pixels, run the processor, build labels, truncate, check the planned length.

        Args:
            row (`Mapping`): the row.
            index (*optional*): its id (stored as `sample["index"]`, used in messages).
            planned_tokens (`int`, *optional*): the length the planner used; a different processed length raises
                [`SampleError`] with reason `"length_mismatch"`.

        Returns:
            `dict`: `input_ids`, `labels`, `attention_mask`, `mm_token_type_ids` (1-D `LongTensor`), the vision
            tensors the processor made (`pixel_values`, `image_grid_thw`, `pixel_values_videos`, `video_grid_thw`,
            `second_per_grid_ts`), `num_tokens` and `index`.
        """
        prep = self._prepare(row, index)
        images = [self.images.load_rgb(ref) for ref in prep.images] or None
        videos = [self.videos.load(v.ref, v.info, v.indices) for v in prep.videos] or None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kwargs = (
                {
                    "videos_kwargs": {
                        "do_sample_frames": False,  # sampled here, by the indices the estimate counted
                        "video_metadata": [dict(v.metadata) for v in prep.videos],  # the processor may edit them
                        **self.sampling.processor_kwargs(),
                    }
                }
                if videos and self.sampling is not None
                else {}
            )
            out = self.processor(text=[prep.text], images=images, videos=videos, return_tensors="pt", **kwargs)
        ids = out["input_ids"][0].long()
        expected = torch.from_numpy(np.repeat(prep.ids, prep.repeats))
        if ids.shape != expected.shape or not torch.equal(ids, expected):
            raise SampleError("length_mismatch", f"processed {ids.numel():,} tokens, estimated {expected.numel():,}")
        n = prep.meta.num_tokens
        if planned_tokens is not None and n != planned_tokens:
            raise SampleError("length_mismatch", f"processed {n:,} tokens, planned {planned_tokens:,}")
        supervised = torch.from_numpy(np.repeat(prep.supervised, prep.repeats))
        sample: dict[str, Any] = {
            "input_ids": ids[:n],
            "labels": ids.masked_fill(~supervised, IGNORE_INDEX)[:n],
            "attention_mask": torch.ones(n, dtype=torch.long),
            "mm_token_type_ids": out["mm_token_type_ids"][0, :n].long(),
        }
        for key in VISION_KEYS:
            if out.get(key) is not None:
                sample[key] = out[key]
        sample["num_tokens"], sample["index"] = n, index
        return sample


def _video_metadata(info: VideoInfo, fps: float | None, indices: list[int]) -> dict[str, Any]:
    """`VideoMetadata` fields of the frames at `indices` of a video of `info.frames` frames at `fps`: what transformers
    turns into `second_per_grid_ts` (sampled fps = len(indices) / frames · fps) and Qwen3-VL timestamps (index / fps).
    """
    return {
        "total_num_frames": info.frames,
        "fps": fps,
        "frames_indices": indices,
        "duration": info.duration,
        "width": info.width,
        "height": info.height,
    }
