"""[`StreamingPlanner`]: settings, resumable state, input (`add`/`extend`/`flush`), window driver."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._checks import STRATEGIES, _as_int_array, _check_int
from .bfd import _BestFit
from .closing import _ClosingRules
from .strategies import _WindowStrategies

_STATE_VERSION = 2


class StreamingPlanner(_ClosingRules, _BestFit, _WindowStrategies):
    """Stateful, resumable bin-packing planner; the single code path behind [`plan_packs`].

    Samples arrive one at a time ([`~StreamingPlanner.add`]) or in bulk
    ([`~StreamingPlanner.extend`]). They are collected into a window of `buffer_size` samples; when
    the window is full it is planned against the packs still open from earlier windows, and the packs
    that are full get closed and returned. [`~StreamingPlanner.flush`] plans what is pending and closes
    everything. [`~StreamingPlanner.state_dict`] / [`~StreamingPlanner.load_state_dict`] capture and
    restore the complete state as plain JSON-able data so an interrupted run resumes with exactly the
    packs it would otherwise have produced.

    Args:
        max_length (`int`):
            Token budget per pack (hard limit). Samples longer than this are dropped.
        strategy (`str`, *optional*, defaults to `"bfd"`):
            One of `"next_fit"`, `"ffd"`, `"bfd"`, `"balanced"` (see the package docstring).
        max_images (`int`, *optional*):
            Maximum number of images per pack. `None` means unlimited (image counts are then ignored).
        max_vision_patches (`int`, *optional*):
            Maximum Σ `t·h·w` vision patches per pack. `None` means unlimited.
        buffer_size (`int`, *optional*):
            Window size in samples. `None` plans everything at [`~StreamingPlanner.flush`] (whole
            dataset, unbounded memory).
        max_open_bins (`int`, *optional*):
            Most packs carried over between windows (`ffd`/`bfd`); when exceeded the fullest are
            closed. Defaults to `buffer_size`.
        close_threshold (`int`, *optional*):
            A pack whose remaining token room is `<=` this is closed at the end of a window
            (`ffd`/`bfd`). Defaults to `max_length // 200` (0.5%). Packs with less room than the
            shortest sample seen so far are closed too, unless the next window re-plans them
            (`repack_windows`).
        seed (`int`, *optional*, defaults to 0):
            Recorded in the state. All strategies are currently deterministic (ties are broken by
            arrival order), so the output depends only on the input and the settings; the seed is
            reserved for randomised strategies and must match on `load_state_dict`.
        repack_windows (`int`, *optional*, defaults to 2):
            `"bfd"` only: how many later windows may re-plan a sample that sits in a pack still open
            (not yet emitted). Such packs are dissolved and their samples planned again together with
            the next window, which recombines them with the new samples; a pack holding a sample
            that was already re-planned this often is kept as a pack instead and only receives
            samples (closed when full or when it received nothing). `0` disables re-planning.
        repack_budget (`int`, *optional*):
            `"bfd"` only: most samples re-planned per window (the emptiest open packs first; the
            others are kept as packs that only receive samples, as with `repack_windows=0`).
            Defaults to `buffer_size // 4`, which bounds the extra planning work per window.
    """

    def __init__(
        self,
        *,
        max_length: int,
        strategy: str = "bfd",
        max_images: int | None = None,
        max_vision_patches: int | None = None,
        buffer_size: int | None = None,
        max_open_bins: int | None = None,
        close_threshold: int | None = None,
        seed: int = 0,
        repack_windows: int = 2,
        repack_budget: int | None = None,
    ) -> None:
        self.max_length: int = _check_int("max_length", max_length, minimum=1)  # type: ignore[assignment]
        if strategy not in STRATEGIES:
            valid = ", ".join(map(repr, STRATEGIES))
            raise ValueError(f"Unknown `strategy`={strategy!r}; valid strategies are {valid}.")
        self.strategy: str = strategy
        self.max_images: int | None = _check_int("max_images", max_images, minimum=0, allow_none=True)
        self.max_vision_patches: int | None = _check_int(
            "max_vision_patches", max_vision_patches, minimum=0, allow_none=True
        )
        self.buffer_size: int | None = _check_int("buffer_size", buffer_size, minimum=1, allow_none=True)
        if max_open_bins is None:
            max_open_bins = buffer_size
        self.max_open_bins: int | None = _check_int("max_open_bins", max_open_bins, minimum=0, allow_none=True)
        if close_threshold is None:
            close_threshold = self.max_length // 200
        self.close_threshold: int = _check_int(  # type: ignore[assignment]
            "close_threshold", close_threshold, minimum=0
        )
        self.seed: int = _check_int("seed", seed, minimum=-(2**63))  # type: ignore[assignment]
        self.repack_windows: int = _check_int(  # type: ignore[assignment]
            "repack_windows", repack_windows, minimum=0
        )
        if repack_budget is None and buffer_size is not None:
            repack_budget = buffer_size // 4
        self.repack_budget: int | None = _check_int("repack_budget", repack_budget, minimum=0, allow_none=True)
        self._media = self.max_images is not None or self.max_vision_patches is not None
        self._reset_state()

    # ------------------------------------------------------------------ state
    def _reset_state(self) -> None:
        # Open bins: bin_id -> [sample indices, tokens, images, patches]; dict order == creation order.
        self._open: dict[int, list[Any]] = {}
        self._p_idx: list[int] = []
        self._p_len: list[int] = []
        self._p_img: list[int] = []
        self._p_pat: list[int] = []
        self._next_id = 0
        self._min_len: int | None = None
        # Smallest image / patch count among samples that carry any media (media budgets only).
        self._min_media_img: int | None = None
        self._min_media_pat: int | None = None
        self._num_seen = 0
        self._num_dropped = 0
        self._num_windows = 0
        self._num_emitted = 0
        self._carried: dict[int, int] = {}
        # Open bins the next window re-plans (`"bfd"`, `repack_windows > 0`): bin_id -> [per-sample
        # tokens, per-sample images, per-sample patches, born], born = the earliest window number any
        # of its samples was first planned in (the media lists are empty without media budgets).
        # Every other open bin is frozen: it keeps its samples and only receives more.
        self._repack: dict[int, list[Any]] = {}

    def _config(self) -> dict[str, Any]:
        return {
            "max_length": self.max_length,
            "strategy": self.strategy,
            "max_images": self.max_images,
            "max_vision_patches": self.max_vision_patches,
            "buffer_size": self.buffer_size,
            "max_open_bins": self.max_open_bins,
            "close_threshold": self.close_threshold,
            "seed": self.seed,
            "repack_windows": self.repack_windows,
            "repack_budget": self.repack_budget,
        }

    def state_dict(self) -> dict[str, Any]:
        """Returns the complete planner state as plain JSON-able Python data.

        Contains the settings (checked on load), the open packs, the pending (not yet planned)
        window and the counters. Restoring it with [`~StreamingPlanner.load_state_dict`] and feeding
        the remaining samples gives exactly the packs an uninterrupted run would give.
        """
        return {
            "version": _STATE_VERSION,
            "config": self._config(),
            "open_bins": [[bid, list(b[0]), b[1], b[2], b[3]] for bid, b in self._open.items()],
            "repack": [[bid, list(r[0]), list(r[1]), list(r[2]), r[3]] for bid, r in self._repack.items()],
            "pending": {
                "indices": list(self._p_idx),
                "lengths": list(self._p_len),
                "images": list(self._p_img),
                "patches": list(self._p_pat),
            },
            "next_bin_id": self._next_id,
            "min_length_seen": self._min_len,
            "min_media_images_seen": self._min_media_img,
            "min_media_patches_seen": self._min_media_pat,
            "num_seen": self._num_seen,
            "num_dropped": self._num_dropped,
            "num_windows": self._num_windows,
            "num_emitted": self._num_emitted,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a state produced by [`~StreamingPlanner.state_dict`] (possibly JSON round-tripped).

        Args:
            state (`dict`):
                The saved state.

        Raises:
            ValueError: if the state's version or settings differ from this planner's settings.
        """
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"Unsupported planner state version {state.get('version')!r}; expected {_STATE_VERSION}.")
        mine, theirs = self._config(), state["config"]
        for key, value in mine.items():
            if theirs.get(key) != value:
                raise ValueError(
                    f"Planner state was saved with `{key}`={theirs.get(key)!r} but this planner has "
                    f"`{key}`={value!r}; construct the planner with the same `{key}` to resume."
                )
        self._reset_state()
        for bid, items, tokens, images, patches in state["open_bins"]:
            self._open[int(bid)] = [[int(x) for x in items], int(tokens), int(images), int(patches)]
        for bid, lens, images, patches, born in state["repack"]:
            self._repack[int(bid)] = [
                [int(x) for x in lens],
                [int(x) for x in images],
                [int(x) for x in patches],
                int(born),
            ]
        pending = state["pending"]
        self._p_idx = [int(x) for x in pending["indices"]]
        self._p_len = [int(x) for x in pending["lengths"]]
        self._p_img = [int(x) for x in pending["images"]]
        self._p_pat = [int(x) for x in pending["patches"]]
        self._next_id = int(state["next_bin_id"])
        self._min_len = None if state["min_length_seen"] is None else int(state["min_length_seen"])
        mmi, mmp = state["min_media_images_seen"], state["min_media_patches_seen"]
        self._min_media_img = None if mmi is None else int(mmi)
        self._min_media_pat = None if mmp is None else int(mmp)
        self._num_seen = int(state["num_seen"])
        self._num_dropped = int(state["num_dropped"])
        self._num_windows = int(state["num_windows"])
        self._num_emitted = int(state["num_emitted"])

    @property
    def num_dropped(self) -> int:
        """Number of samples dropped so far because they alone exceed a budget."""
        return self._num_dropped

    @property
    def num_open_bins(self) -> int:
        """Number of packs currently open (carried over between windows)."""
        return len(self._open)

    @property
    def num_pending(self) -> int:
        """Number of samples waiting for the current window to fill."""
        return len(self._p_idx)

    # ------------------------------------------------------------------ input
    def _oversize(self, length: int, images: int, patches: int) -> bool:
        return (
            length > self.max_length
            or (self.max_images is not None and images > self.max_images)
            or (self.max_vision_patches is not None and patches > self.max_vision_patches)
        )

    def add(self, index: int, length: int, images: int = 0, patches: int = 0) -> list[list[int]]:
        """Adds one sample; returns the packs this closed (often none).

        Args:
            index (`int`):
                Identifier of the sample, returned inside the packs (e.g. its dataset index).
            length (`int`):
                Token count of the sample.
            images (`int`, *optional*, defaults to 0):
                Number of images in the sample (ignored unless `max_images` is set).
            patches (`int`, *optional*, defaults to 0):
                Σ `t·h·w` vision patches of the sample (ignored unless `max_vision_patches` is set).

        Returns:
            `list[list[int]]`: packs closed by this call, in creation order. A sample that alone
            exceeds a budget is counted in [`~StreamingPlanner.num_dropped`] and never packed.
        """
        index = int(index)
        length = int(length)
        images = int(images)
        patches = int(patches)
        if length < 0 or images < 0 or patches < 0:
            raise ValueError(
                f"Sample {index}: `length`, `images` and `patches` must be >= 0, got {length}, {images}, {patches}."
            )
        self._num_seen += 1
        if self._oversize(length, images, patches):
            self._num_dropped += 1
            return []
        self._p_idx.append(index)
        self._p_len.append(length)
        if self._media:
            # A dimension without a budget is ignored entirely.
            self._p_img.append(images if self.max_images is not None else 0)
            self._p_pat.append(patches if self.max_vision_patches is not None else 0)
        if self.buffer_size is not None and len(self._p_idx) >= self.buffer_size:
            return self._process_window(final=False)
        return []

    def extend(
        self,
        lengths: Sequence[int] | np.ndarray,
        *,
        indices: Sequence[int] | np.ndarray | None = None,
        images: Sequence[int] | np.ndarray | None = None,
        patches: Sequence[int] | np.ndarray | None = None,
    ) -> list[list[int]]:
        """Adds many samples at once; equivalent to calling [`~StreamingPlanner.add`] for each, but faster.

        Args:
            lengths (`Sequence[int]` or `np.ndarray`):
                Token count per sample.
            indices (`Sequence[int]` or `np.ndarray`, *optional*):
                Identifiers returned in the packs. Defaults to consecutive integers continuing the
                count of samples seen so far (so `plan_packs` gets indices into `lengths`).
            images (`Sequence[int]` or `np.ndarray`, *optional*):
                Image count per sample. Required when `max_images` is set.
            patches (`Sequence[int]` or `np.ndarray`, *optional*):
                Vision patches per sample. Required when `max_vision_patches` is set.

        Returns:
            `list[list[int]]`: packs closed by this call, in creation order.
        """
        lens = _as_int_array("lengths", lengths)
        n = lens.shape[0]
        if indices is None:
            idx = np.arange(self._num_seen, self._num_seen + n, dtype=np.int64)
        else:
            idx = np.asarray(indices, dtype=np.int64)
            if idx.shape != (n,):
                raise ValueError(f"`indices` has shape {idx.shape} but `lengths` has {n} entries.")
        if self.max_images is not None and images is None:
            raise ValueError(
                "`max_images` is set but no per-sample `images` were given; pass `images=` or unset `max_images`."
            )
        if self.max_vision_patches is not None and patches is None:
            raise ValueError(
                "`max_vision_patches` is set but no per-sample `patches` were given; pass the per-sample "
                "vision patch counts or unset `max_vision_patches`."
            )
        # A dimension without a budget is ignored entirely (validated, then zeroed).
        img = _as_int_array("images", images, n) if images is not None else None
        pat = _as_int_array("patches", patches, n) if patches is not None else None
        if img is None or self.max_images is None:
            img = np.zeros(n, dtype=np.int64)
        if pat is None or self.max_vision_patches is None:
            pat = np.zeros(n, dtype=np.int64)
        self._num_seen += n
        keep = lens <= self.max_length
        if self.max_images is not None:
            keep &= img <= self.max_images
        if self.max_vision_patches is not None:
            keep &= pat <= self.max_vision_patches
        if not keep.all():
            self._num_dropped += int(n - keep.sum())
            lens, idx, img, pat = lens[keep], idx[keep], img[keep], pat[keep]
            n = lens.shape[0]
        out: list[list[int]] = []
        start = 0
        while start < n:
            if self.buffer_size is None:
                stop = n
            else:
                stop = min(n, start + self.buffer_size - len(self._p_idx))
            self._p_idx.extend(idx[start:stop].tolist())
            self._p_len.extend(lens[start:stop].tolist())
            if self._media:
                self._p_img.extend(img[start:stop].tolist())
                self._p_pat.extend(pat[start:stop].tolist())
            start = stop
            if self.buffer_size is not None and len(self._p_idx) >= self.buffer_size:
                out.extend(self._process_window(final=False))
        return out

    def flush(self) -> list[list[int]]:
        """Plans the pending samples and closes every open pack.

        Returns:
            `list[list[int]]`: all remaining packs, in creation order. The planner stays usable
            (counters continue; the next sample starts a fresh window).
        """
        return self._process_window(final=True)

    # ------------------------------------------------------------------ planning
    def _process_window(self, *, final: bool) -> list[list[int]]:
        idx, lens = self._p_idx, self._p_len
        imgs, pats = self._p_img, self._p_pat
        self._p_idx, self._p_len, self._p_img, self._p_pat = [], [], [], []
        if lens:
            m = min(lens)
            if self._min_len is None or m < self._min_len:
                self._min_len = m
            if self._media:
                media = [(im, pa) for im, pa in zip(imgs, pats) if im or pa]
                if media:
                    mmi = min(im for im, _ in media)
                    mmp = min(pa for _, pa in media)
                    if self._min_media_img is None or mmi < self._min_media_img:
                        self._min_media_img = mmi
                    if self._min_media_pat is None or mmp < self._min_media_pat:
                        self._min_media_pat = mmp
        # Dissolve the open bins this window re-plans: their samples go in front of the new ones
        # (bin creation order, then order within the bin; the stable sort keeps older samples first
        # among equal lengths). `born_of` maps a re-planned sample to the window it was first planned
        # in (with repeated indices, the earliest: a sample can only look older, never younger).
        born_of: dict[int, int] = {}
        if self._repack:
            d_idx: list[int] = []
            d_len: list[int] = []
            d_img: list[int] = []
            d_pat: list[int] = []
            for bid, (r_len, r_img, r_pat, born) in self._repack.items():
                items = self._open.pop(bid)[0]
                d_idx += items
                d_len += r_len
                if self._media:
                    d_img += r_img
                    d_pat += r_pat
                for x in items:
                    if born_of.get(x, born) >= born:
                        born_of[x] = born
            self._repack = {}
            idx, lens = d_idx + idx, d_len + lens
            if self._media:
                imgs, pats = d_img + imgs, d_pat + pats
        if lens:
            self._num_windows += 1
        if not self._media:
            imgs = pats = None  # type: ignore[assignment]
        # Sizes of the carried-over (frozen) bins, to spot those that received nothing in this window.
        self._carried = {bid: len(b[0]) for bid, b in self._open.items()}
        if self.strategy == "next_fit":
            packs = self._window_next_fit(idx, lens, imgs, pats, final)
        elif self.strategy == "bfd":
            packs = self._window_bfd(idx, lens, imgs, pats, final, born_of)
        elif self.strategy == "ffd":
            packs = self._window_ffd(idx, lens, imgs, pats, final)
        else:
            packs = self._window_balanced(idx, lens, imgs, pats)
        self._num_emitted += len(packs)
        return packs
