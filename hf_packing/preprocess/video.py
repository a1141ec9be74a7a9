"""Video I/O: header metadata without decoding, and decoding of chosen frames, with torchcodec or PyAV.

A video is a file (a path, bytes, or `{"bytes", "path"}` as `datasets` stores media undecoded) or pre-sampled frames
(a `(T, H, W, C)` array or a list of image references). For a file, planning opens the container and reads its
header, decoding nothing ([`VideoLoader.info`]: a small fraction of decoding the file, measured: docs/packer.md,
'What a row costs'); processing decodes the frames the sampler chose ([`VideoLoader.load`]).

Which count is trusted: the header's frame count (`nb_frames`, exact in mp4/mov), else `round(duration · average
fps)` (webm/mkv store no count; the duration is the stream's, else the container's). Both backends read these same
FFmpeg header fields, so they plan the same frames. Decoding takes frames by these ordinals; when the stream really
ends up to `max(2, 2%)` frames before the header's count (rounding, an edit list), the missing tail repeats the last
decoded frame, so the decoded count always equals the planned one; a larger shortfall is a truncated file
(`"corrupt_video"`). Decoding a finite file ends at its last packet, so a truncated clip never blocks.

Backends: torchcodec when it imports and loads its FFmpeg (it links the system's `libavcodec`), else PyAV (FFmpeg
bundled in the wheel: `pip install 'hf_packing[video]'`). [`BACKEND`] is the one switch (tests flip it). PyAV decodes
sequentially up to the last sampled frame and converts only the sampled ones to RGB; torchcodec seeks.

Decoded frames are held at their native size until the processor resizes them: sampled frames · H · W · 3 bytes
(64 frames of 1080p: 400 MB), so bound long videos with `max_frames`.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import _compat
from ..config import MAX_IMAGE_PIXELS
from .errors import SampleError
from .fetch import MediaFetcher, describe, is_remote
from .formats import NESTED_FRAMES_HINT, is_frame_path
from .images import ImageLoader

__all__ = ["BACKEND", "BACKENDS", "VideoInfo", "VideoLoader", "backend", "is_file_ref"]

BACKENDS = ("torchcodec", "pyav")
BACKEND = "auto"  # "auto" (torchcodec if it loads, else PyAV), or one of BACKENDS
_INSTALL = "pip install 'hf_packing[video]'"


@dataclass(frozen=True)
class VideoInfo:
    """What planning knows of a video without decoding it.

    `frames` is the trusted total (see the module docstring); `fps` the average frame rate (`None`: pre-sampled
    frames without a rate, which the processor takes as 24); `duration` in seconds (`None` for frames).
    """

    frames: int
    height: int
    width: int
    fps: float | None
    duration: float | None = None
    is_file: bool = True


def backend() -> str:
    """The decoder used here: [`BACKEND`], or with `"auto"` torchcodec if it loads its FFmpeg, else PyAV.

    Raises:
        `ImportError`: neither is usable (a setup error, never a skipped row).
    """
    if BACKEND not in ("auto", *BACKENDS):
        raise ValueError(f"hf_packing.preprocess.video.BACKEND must be 'auto' or one of {BACKENDS}, got {BACKEND!r}")
    for name in BACKENDS if BACKEND == "auto" else (BACKEND,):
        if (_compat.torchcodec_decoder() if name == "torchcodec" else _compat.pyav()) is not None:
            return name
    if BACKEND == "torchcodec":
        raise ImportError("torchcodec is not installed or cannot load FFmpeg's shared libraries (libavcodec)")
    raise ImportError(
        f"decoding video files needs PyAV (FFmpeg bundled) or torchcodec with a system FFmpeg: {_INSTALL}; "
        "or give videos as pre-sampled frames"
    )


def is_file_ref(ref: Any) -> bool:
    """Whether `ref` names a video file (path, bytes, `{"bytes", "path"}`) rather than pre-sampled frames."""
    return isinstance(ref, (str, os.PathLike, bytes, bytearray, memoryview, Mapping))


class VideoLoader:
    """Reads videos for one source: header metadata for planning, frames for processing.

    Args:
        video_root (`str` or `Path`, *optional*): relative paths (files and frames) resolve here, never outside it
            (`"path_outside_root"`); without it, paths are used as given.
        max_image_pixels (`int`, defaults to 89,478,485): a larger frame (`width · height` by header) is
            `"video_too_large"` (for frames given as images, `"image_too_large"`).
        fetcher ([`~hf_packing.preprocess.fetch.MediaFetcher`], *optional*): reads URLs and data URIs, files and
            frames alike (a video URL is fetched whole: its container's header may sit at its end).
    """

    def __init__(
        self,
        *,
        video_root: str | os.PathLike | None = None,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
        fetcher: MediaFetcher | None = None,
    ) -> None:
        self.images = ImageLoader(image_root=video_root, max_image_pixels=max_image_pixels, fetcher=fetcher)
        self.max_image_pixels = max_image_pixels

    # ------------------------------------------------------------------------------------------------ planning
    def info(self, ref: Any, fps: float | None = None) -> VideoInfo:
        """The video's [`VideoInfo`] from headers only; `fps` is the rate of pre-sampled frames (files: ignored).

        Raises:
            [`SampleError`]: `"missing_file"`, `"path_outside_root"`, `"empty_video"` (0 bytes, no video stream,
            0 frames or 0 duration), `"corrupt_video"` (unreadable container, no frame rate), `"video_too_large"`,
            `"unsupported_video"` (neither a file nor frames), `"bad_row"` (frames of different sizes).
        """
        if not is_file_ref(ref):
            frames, height, width = self._frames_shape(ref)
            return VideoInfo(frames, height, width, fps, is_file=False)
        src = self._source(ref)
        name = backend()
        try:
            info = _probe_torchcodec(src) if name == "torchcodec" else _probe_pyav(src)
        except SampleError:
            raise
        except Exception as err:  # noqa: BLE001 - FFmpeg's errors differ per backend and version
            raise SampleError("corrupt_video", f"unreadable video ({type(err).__name__}: {err})") from None
        if info.width * info.height > self.max_image_pixels:
            raise SampleError(
                "video_too_large",
                f"frames are {info.width}x{info.height} > max_image_pixels={self.max_image_pixels:,}",
            )
        return info

    def _frames_shape(self, ref: Any) -> tuple[int, int, int]:
        if isinstance(ref, np.ndarray) and ref.ndim == 4 and ref.shape[-1] in (1, 3, 4):
            return int(ref.shape[0]), int(ref.shape[1]), int(ref.shape[2])
        if isinstance(ref, (list, tuple)) and ref:
            sizes = {tuple(f.shape[:2]) if isinstance(f, np.ndarray) else self.images.size(f) for f in ref}
            if len(sizes) > 1:
                raise SampleError("bad_row", f"the frames of a video differ in size: {sorted(sizes)}")
            return (len(ref), *sizes.pop())
        raise SampleError(
            "unsupported_video",
            f"a video is a file (path, bytes) or pre-sampled frames (a (T, H, W, C) array or a list of images), "
            f"got {type(ref).__name__}",
        )

    def _source(self, ref: Any) -> Path | bytes:
        if isinstance(ref, Mapping):
            ref = ref.get("bytes") or ref.get("path")
        what = "video"
        if is_remote(ref):
            what, ref = f"video {describe(ref)}", self.images.fetcher.fetch(ref)
        if isinstance(ref, (bytes, bytearray, memoryview)):
            if not len(ref):
                raise SampleError("empty_video", f"{what} has 0 bytes")
            return bytes(ref)
        if not isinstance(ref, (str, os.PathLike)):
            raise SampleError("unsupported_video", f"unsupported video reference of type {type(ref).__name__}")
        if is_frame_path(ref):  # one frame where a video was expected: its list was not nested
            raise SampleError("bad_row", f"video {os.fspath(ref)!r} is an image file: {NESTED_FRAMES_HINT}")
        path = self.images.resolve(ref)
        if not path.is_file():
            raise SampleError("missing_file", f"video file {str(path)!r} not found")
        if path.stat().st_size == 0:
            raise SampleError("empty_video", f"video file {str(path)!r} has 0 bytes")
        return path

    # ------------------------------------------------------------------------------------------------ processing
    def load(self, ref: Any, info: VideoInfo, indices: Sequence[int] | None) -> np.ndarray:
        """The frames as one `(T, H, W, C)` uint8 array: pre-sampled frames as given, or the file's frames at
        `indices` (`T = len(indices)`, `H, W` = `info`'s, or swapped where a decoder applied a rotation).

        Raises:
            [`SampleError`]: `"corrupt_video"` when the file cannot give these frames, and the errors of [`info`].
        """
        if not info.is_file:
            if isinstance(ref, np.ndarray):
                return ref
            return np.stack([f if isinstance(f, np.ndarray) else np.asarray(self.images.load_rgb(f)) for f in ref])
        if indices is None or not len(indices):
            raise ValueError("a video file needs the frame indices to decode")
        src, name = self._source(ref), backend()
        try:
            frames = _decode_torchcodec(src, indices) if name == "torchcodec" else _decode_pyav(src, indices, info)
        except SampleError:
            raise
        except Exception as err:  # noqa: BLE001 - FFmpeg's errors differ per backend and version
            raise SampleError("corrupt_video", f"video cannot be decoded ({type(err).__name__}: {err})") from None
        shapes = ((info.height, info.width), (info.width, info.height))
        if frames.shape[0] != len(indices) or tuple(frames.shape[1:3]) not in shapes:
            raise SampleError(
                "corrupt_video",
                f"decoded {tuple(frames.shape)} but the header promised {len(indices)} frames of "
                f"{info.height}x{info.width}",
            )
        return frames


# ---------------------------------------------------------------------------------------------------- backends
def _trusted(
    header_frames: int | None, fps: float | None, duration: float | None, height: int, width: int
) -> VideoInfo:
    """The planning rule shared by both backends: the header's count, else `round(duration · fps)`."""
    fps = float(fps) if fps and fps > 0 else None
    duration = float(duration) if duration and duration > 0 else None
    frames = int(header_frames or 0) or (round(duration * fps) if duration and fps else 0)
    if frames <= 0 or not width or not height:
        raise SampleError("empty_video", f"the video has {frames} frames of {width}x{height} by its header")
    if fps is None:
        fps = frames / duration if duration else None
    if fps is None:
        raise SampleError("corrupt_video", "the header gives neither a frame rate nor a duration")
    return VideoInfo(frames, int(height), int(width), fps, duration or frames / fps)


def _installed(module: Any) -> Any:
    """``module`` (a decoder `_compat` found), or a `SampleError` when it is not installed."""
    if module is None:
        raise SampleError("unsupported_video", "no video decoder is installed: pip install 'hf_packing[video]'")
    return module


def _pyav_input(src: Path | bytes) -> str | io.BytesIO:
    return io.BytesIO(src) if isinstance(src, bytes) else str(src)


def _probe_pyav(src: Path | bytes) -> VideoInfo:
    av = _installed(_compat.pyav())
    with av.open(_pyav_input(src)) as container:
        if not container.streams.video:
            raise SampleError("empty_video", "the file has no video stream")
        stream = container.streams.video[0]
        duration: float | None = None
        if stream.duration:
            duration = float(stream.duration * stream.time_base)
        else:  # webm/mkv: only the container's
            duration = container.duration / 1_000_000 if container.duration else None
        fps = stream.average_rate or stream.guessed_rate
        return _trusted(stream.frames, fps, duration, stream.codec_context.height, stream.codec_context.width)


def _decode_pyav(src: Path | bytes, indices: Sequence[int], info: VideoInfo) -> np.ndarray:
    av = _installed(_compat.pyav())
    wanted, last = set(indices), max(indices)
    picked: dict[int, np.ndarray] = {}
    tail, ordinal = None, -1

    def rgb(frame: Any) -> np.ndarray:  # reformat to the header's size: a mid-stream size change keeps its shape
        return frame.to_ndarray(format="rgb24", width=info.width, height=info.height)

    with av.open(_pyav_input(src)) as container:
        stream = container.streams.video[0]  # FFmpeg's default threads: DataLoader workers are the parallelism
        try:
            for ordinal, frame in enumerate(container.decode(stream)):  # noqa: B007 - read after the loop
                tail = frame
                if ordinal in wanted:
                    picked[ordinal] = rgb(frame)
                if ordinal >= last:
                    break
        except av.error.FFmpegError:  # a damaged packet: the stream ends here; the slack rule below decides
            pass
    if ordinal < last:
        short = last - ordinal
        if tail is None or short > max(2, math.ceil(0.02 * info.frames)):
            raise SampleError(
                "corrupt_video",
                f"the stream ends after {ordinal + 1} frames but frame {last} of {info.frames} (by header) "
                "was planned: a truncated file",
            )
        fill = rgb(tail)
        picked.update({i: fill for i in wanted if i > ordinal})
    return np.stack([picked[i] for i in indices])


def _torchcodec_input(src: Path | bytes) -> str | bytes:
    return src if isinstance(src, bytes) else str(src)


def _probe_torchcodec(src: Path | bytes) -> VideoInfo:
    # "approximate": header metadata only, no scan of the file
    meta = _compat.torchcodec_decoder()(_torchcodec_input(src), seek_mode="approximate").metadata
    fps = meta.average_fps_from_header
    duration = meta.duration_seconds_from_header or meta.duration_seconds  # the container's when the stream has none
    return _trusted(meta.num_frames_from_header, fps, duration, meta.height, meta.width)


def _decode_torchcodec(src: Path | bytes, indices: Sequence[int]) -> np.ndarray:
    decoder = _compat.torchcodec_decoder()(_torchcodec_input(src), seek_mode="approximate", num_ffmpeg_threads=0)
    end = (decoder.metadata.num_frames or max(indices) + 1) - 1
    batch = decoder.get_frames_at([min(int(i), end) for i in indices])  # its count may round one frame lower
    return batch.data.permute(0, 2, 3, 1).contiguous().numpy()  # (T, C, H, W) -> (T, H, W, C) uint8
