"""Which frames of a video file train, and how many tokens they make: the Qwen video processors' own rules.

A source's `videos_kwargs` use the video processors' names: `fps` (frames sampled per second of video) or
`num_frames` (a fixed count), `min_frames` / `max_frames` (bounds of the fps rule), `min_pixels` / `max_pixels`
(the per-video resize budget, `size={"shortest_edge", "longest_edge"}` in the processor) and `do_sample_frames`
(`False`: every frame). They are set on a copy of the processor's video processor, whose `sample_frames` (uniform
sampling at `fps`, rounded to `temporal_patch_size` on Qwen2/2.5-VL; `linspace` on Qwen3-VL) picks the frame
indices from the header's [`~hf_packing.preprocess.video.VideoInfo`] and whose `get_num_of_video_patches`
(`smart_resize`: 28 px cells on Qwen2/2.5-VL, 32 px on Qwen3-VL, whose budget also counts frames) gives the grid.
Without `fps` or `num_frames`, the processor's own are used, and where it has neither (Qwen2/2.5-VL) 2 fps
(qwen-vl-utils' default), never every frame of a long file. Pre-sampled frames are not re-sampled; the pixel budget
applies to them too.

Processing passes the decoded frames with `do_sample_frames=False` and the metadata the sampler saw (total frames,
average fps, chosen indices), so transformers derives Qwen2.5-VL's `second_per_grid_ts` and Qwen3-VL's timestamps
exactly as if it had sampled the file itself.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from .errors import SampleError
from .video import VideoInfo

__all__ = ["DEFAULT_FPS", "VIDEO_KWARGS", "VideoSampling"]

_KINDS = {"fps": "a positive number", "do_sample_frames": "True or False"}
DEFAULT_FPS = 2.0  # qwen-vl-utils' FPS, used when neither the settings nor the processor give a rate or a count


@dataclass(frozen=True)
class VideoSettings:
    """The validated `videos_kwargs` of one source (`None`: the processor's own)."""

    fps: float | None = None
    num_frames: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    do_sample_frames: bool = True

    @classmethod
    def parse(cls, kwargs: Mapping[str, Any] | None, where: str = "videos_kwargs") -> VideoSettings:
        kwargs = dict(kwargs or {})
        unknown = set(kwargs) - set(VIDEO_KWARGS)
        if unknown:
            raise ValueError(f"{where} takes {list(VIDEO_KWARGS)}, got {sorted(unknown)}")
        if kwargs.get("fps") is not None and kwargs.get("num_frames") is not None:
            raise ValueError(f"{where}: fps and num_frames are mutually exclusive (as in the video processors)")
        for key, value in kwargs.items():
            if key == "do_sample_frames":
                ok = isinstance(value, bool)
            else:
                kind = (int, float) if key == "fps" else int
                ok = value is None or (isinstance(value, kind) and not isinstance(value, bool) and value > 0)
            if not ok:
                raise ValueError(f"{where}[{key!r}] must be {_KINDS.get(key, 'a positive integer')}, got {value!r}")
        return cls(**kwargs)


VIDEO_KWARGS: tuple[str, ...] = tuple(f.name for f in fields(VideoSettings))


class VideoSampling:
    """One source's frame sampling and token counting, from a processor's video processor and `videos_kwargs`."""

    def __init__(self, video_processor: Any, videos_kwargs: Mapping[str, Any] | None = None) -> None:
        self.settings = s = VideoSettings.parse(videos_kwargs)
        vp = self.processor = copy.copy(video_processor)  # attributes below are this source's, not the user's object
        if s.num_frames is not None:
            vp.fps, vp.num_frames = None, s.num_frames
        elif s.fps is not None:
            vp.fps, vp.num_frames = s.fps, None
        elif getattr(vp, "fps", None) is None and getattr(vp, "num_frames", None) is None:
            vp.fps = DEFAULT_FPS
        for name in ("min_frames", "max_frames"):  # GLM-V's sampler has neither: its rule is fps over max_duration
            value = getattr(s, name)
            if value is not None and not hasattr(vp, name):
                raise ValueError(
                    f"videos_kwargs[{name!r}]: {type(vp).__name__} samples frames without it (fps or num_frames "
                    "only); drop it"
                )
            if value is not None:
                setattr(vp, name, value)
        if s.min_pixels is not None or s.max_pixels is not None:
            vp.size = type(vp.size)(
                shortest_edge=vp.size["shortest_edge"] if s.min_pixels is None else s.min_pixels,
                longest_edge=vp.size["longest_edge"] if s.max_pixels is None else s.max_pixels,
            )
        self.tps = int(vp.temporal_patch_size)
        # transformers 5.17's helper floors the frame count while processing pads it up; later ones round up
        side = 4 * vp.patch_size * vp.merge_size
        self._helper_rounds_up = vp.get_num_of_video_patches(self.tps + 1, side, side, {}) > (
            vp.get_num_of_video_patches(self.tps, side, side, {})
        )
        self._cap_by_hand = bool(getattr(vp, "cap_pixels_per_frame", None)) and _helper_ignores_cap(vp)

    def indices(self, info: VideoInfo) -> list[int]:
        """The frames of a file the processor would sample, from its header metadata only.

        Raises:
            [`SampleError`]: `"empty_video"` when the rule leaves no frame (a clip shorter than one temporal patch).
        """
        from transformers.video_utils import VideoMetadata

        if not self.settings.do_sample_frames:
            return list(range(info.frames))
        meta = VideoMetadata(
            total_num_frames=info.frames, fps=info.fps, duration=info.duration, width=info.width, height=info.height
        )
        try:
            # passed as the processor passes them (Qwen3-VL's sample_frames reads num_frames from its arguments only)
            vp = self.processor
            chosen = [int(i) for i in vp.sample_frames(meta, num_frames=vp.num_frames, fps=vp.fps)]
        except (ValueError, ZeroDivisionError) as err:  # Qwen2-VL's rule divides by 0 frames on a 1-frame clip
            raise SampleError("empty_video", f"no frames to sample from {info.frames} ({err})") from None
        if not chosen:
            raise SampleError("empty_video", f"the sampling rule keeps none of {info.frames} frames")
        return chosen

    def grid(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """`(grid_t, patches per temporal step)` of `frames` frames of `height` x `width`, as the processor makes.

        Raises:
            [`SampleError`]: `"bad_aspect_ratio"` (> 200), `"empty_video"` (fewer frames than a temporal patch on
            Qwen3-VL).
        """
        try:
            n = int(self.processor.get_num_of_video_patches(frames, height, width, self._cap_kwargs(frames)))
        except ValueError as err:
            reason = "bad_aspect_ratio" if "aspect ratio" in str(err) else "empty_video"
            raise SampleError(reason, str(err)) from None
        grid_t = -(-frames // self.tps)  # the processor pads the last temporal patch with the last frame
        helper_t = grid_t if self._helper_rounds_up else frames // self.tps
        if not helper_t:
            n, helper_t = int(self.processor.get_num_of_video_patches(self.tps, height, width, {})), 1
        return grid_t, n // helper_t

    def _cap_kwargs(self, frames: int) -> dict[str, Any]:
        """Qwen2-VL's `resize` applies `cap_pixels_per_frame` (an even share of `max_video_tokens` per frame) but its
        patch-count helper does not: the same bound, given to the helper as the size."""
        if not self._cap_by_hand:
            return {}
        vp, size = self.processor, self.processor.size
        factor = vp.patch_size * vp.merge_size
        share = int(vp.max_video_tokens * factor * factor * 0.9) * self.tps // frames
        longest = max(min(size["longest_edge"], share), int(size["shortest_edge"] * 1.05))
        # the helper reads `size` on transformers 5.23, `min_pixels` / `max_pixels` before: both, with one bound
        bounds = {"shortest_edge": size["shortest_edge"], "longest_edge": longest}
        return {"size": bounds, "min_pixels": bounds["shortest_edge"], "max_pixels": longest}

    def processor_kwargs(self) -> dict[str, Any]:
        """`videos_kwargs` for the processor call on already sampled frames (the pixel budget, when set)."""
        s = self.settings
        if s.min_pixels is None and s.max_pixels is None:
            return {}
        size = self.processor.size
        return {"size": {"shortest_edge": size["shortest_edge"], "longest_edge": size["longest_edge"]}}


def _helper_ignores_cap(vp: Any) -> bool:
    """Whether `get_num_of_video_patches` leaves out `cap_pixels_per_frame` (Qwen2-VL's on transformers 5.23)."""
    capped, plain = copy.copy(vp), copy.copy(vp)
    capped.cap_pixels_per_frame, plain.cap_pixels_per_frame = True, False
    args: tuple[Any, ...] = (768, 2048, 2048, {})  # far over any cap
    return capped.get_num_of_video_patches(*args) == plain.get_num_of_video_patches(*args)
