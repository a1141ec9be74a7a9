"""Bin-packing planner: which samples train together, decided from numbers only (no torch, no pixels).

A sample is `(tokens, images, vision patches)`. A pack holds at most `max_length` tokens and, when set,
`max_images` images and `max_vision_patches` patches (Σ t·h·w). A sample over a budget on its own is
dropped; every other sample is in exactly one pack.

`"bfd"` (default) is best-fit decreasing over windows of `buffer_size` samples. Packs that are not full stay
open for the next window, so the next window's samples fill them:

    max_length=16; window w, longest first: 10 6 5 4 2; pack 0 is open from window w-1 (13 tokens)
    each sample goes to the open pack with the least room that still fits it (ties: the oldest)

    pack 0 |0000000000000 22|  carried, room 1 < shortest sample  -> closed
    pack 1 |1111111111666666|  full                               -> closed
    pack 2 |555554444       |  made in w, room 7                  -> open: window w+1 may fill it

Closed packs come out in creation order. A pack also closes when it was carried over and got nothing, or
when it can take no more images/patches; beyond `max_open_bins` the fullest close. Memory is
O(buffer_size + max_open_bins).

Trade-off: streaming BFD with carry-over comes close to planning the whole dataset at once, and a larger
`buffer_size` comes closer; carrying unfinished packs over is what makes a window work. Dissolving and re-planning a
window's unfinished packs bought less fill than a larger window does and cost a large share of the planner's time, so
packs are never re-planned. A sample with images walks past packs whose token room fits but whose image/patch room
does not: nothing while the budgets do not bind. `"next_fit"` keeps input order (streaming equals whole-dataset) but
leaves a visible share of every step's slots empty. Measured in benchmarks/RESULTS.md: 'Fill and planner speed' and
'#32: re-planning and the producer thread, before and after'.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import numpy as np

from ..config import DEFAULT_STRATEGY, STRATEGIES

__all__ = ["CLOSE_REASONS", "Bin", "StreamingPlanner", "plan_packs"]

_STATE_VERSION = 5  # 4: closed_by; 5: no re-planning (no `born` per pack, no repack settings)
#: why a pack closed: the budget it reached (`tokens`: no sample fits its token room; `images` / `patches`: no media
#: sample fits), `open_packs` (the fullest close beyond `max_open_bins`) or `end` (the input ended while it still had
#: room: `flush`). A pack that no sample fitted during a window closes under the budget it is fullest in
CLOSE_REASONS: tuple[str, ...] = ("tokens", "images", "patches", "open_packs", "end")
# Open packs are sorted ints `room << _SHIFT | bin_id`: `bisect` on plain ints stays in C, and equal room sorts
# the oldest pack first.
_SHIFT = 40
_MASK = (1 << _SHIFT) - 1
_UNLIMITED = 1 << 62
IntArray = Sequence[int] | np.ndarray
Columns = tuple[list[int], list[int], list[int], list[int]]  # indices, tokens, images, patches per sample


@dataclass(slots=True)
class Bin:
    """An open pack: one entry per sample in `items` (indices) and `lengths`, and in `images` / `patches` when a
    media budget is set (else empty); and the totals."""

    items: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    images: list[int] = field(default_factory=list)
    patches: list[int] = field(default_factory=list)
    tokens: int = 0
    num_images: int = 0
    num_patches: int = 0


def check_int(name: str, value: Any, *, minimum: int, allow_none: bool = False) -> Any:
    """`value` as an int >= `minimum` (or None when allowed); a clear `TypeError` / `ValueError` naming `name`."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__} ({value!r}).")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}.")
    return int(value)


def _as_int_array(name: str, values: Any, n: int | None = None) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"`{name}` must be a 1-D sequence of ints, got shape {arr.shape}.")
    if (
        arr.size
        and arr.dtype.kind not in "iu"
        and not (arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)))
    ):
        raise TypeError(f"`{name}` must contain ints, got dtype {arr.dtype}.")
    arr = arr.astype(np.int64, copy=False)
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"`{name}` has {arr.shape[0]} entries but `lengths` has {n}; pass one value per sample.")
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"`{name}` must be >= 0; got {int(arr.min())} at index {int(arr.argmin())}.")
    return arr


class StreamingPlanner:
    """Stateful, resumable bin packing; the one code path behind [`plan_packs`].

    Samples come one at a time ([`~StreamingPlanner.add`]) or in bulk ([`~StreamingPlanner.extend`]) and are
    planned a window of `buffer_size` at a time against the packs still open; full packs are returned.
    [`~StreamingPlanner.flush`] plans what is pending and closes every pack. [`~StreamingPlanner.state_dict`] is
    plain JSON-able data: loading it and feeding the rest gives exactly the packs of an uninterrupted run.

    Args:
        max_length (`int`): Token budget per pack (hard). Longer samples are dropped.
        strategy (`str`, *optional*, defaults to `"bfd"`): `"bfd"` (best-fit decreasing per window, open packs carried
            over) or `"next_fit"` (input order, one open pack).
        max_images (`int`, *optional*): Images per pack; `None` ignores image counts.
        max_vision_patches (`int`, *optional*): Σ `t·h·w` vision patches per pack; `None` ignores patch counts.
        buffer_size (`int`, *optional*): Samples per window; `None` plans everything at [`~StreamingPlanner.flush`]
            (whole dataset).
        max_open_bins (`int`, *optional*): Most packs carried over between windows; beyond it the fullest close.
            Defaults to `buffer_size`.
        close_threshold (`int`, *optional*): A pack with at most this much token room closes at the end of a window.
            Defaults to `max_length // 200` (0.5%). A pack with less room than the shortest sample seen closes too.
    """

    def __init__(
        self,
        *,
        max_length: int,
        strategy: str = DEFAULT_STRATEGY,
        max_images: int | None = None,
        max_vision_patches: int | None = None,
        buffer_size: int | None = None,
        max_open_bins: int | None = None,
        close_threshold: int | None = None,
    ) -> None:
        if strategy not in STRATEGIES:
            valid = ", ".join(map(repr, STRATEGIES))
            raise ValueError(f"Unknown `strategy`={strategy!r}; valid strategies are {valid}.")
        self.strategy = strategy
        self.max_length: int = check_int("max_length", max_length, minimum=1)
        self.max_images: int | None = check_int("max_images", max_images, minimum=0, allow_none=True)
        self.max_vision_patches: int | None = check_int(
            "max_vision_patches", max_vision_patches, minimum=0, allow_none=True
        )
        self.buffer_size: int | None = check_int("buffer_size", buffer_size, minimum=1, allow_none=True)
        self.max_open_bins: int | None = check_int(
            "max_open_bins", buffer_size if max_open_bins is None else max_open_bins, minimum=0, allow_none=True
        )
        self.close_threshold: int = check_int(
            "close_threshold", self.max_length // 200 if close_threshold is None else close_threshold, minimum=0
        )
        self._media = self.max_images is not None or self.max_vision_patches is not None
        self._mi = _UNLIMITED if self.max_images is None else self.max_images
        self._mp = _UNLIMITED if self.max_vision_patches is None else self.max_vision_patches
        self._reset()

    def _reset(self) -> None:
        self._open: dict[int, Bin] = {}  # bin_id -> pack; ids only grow, so dict order is creation order
        self._pending: Columns = ([], [], [], [])
        self._next_id = self._num_seen = self._num_dropped = self._num_emitted = 0
        self._closed_by = dict.fromkeys(CLOSE_REASONS, 0)
        self._min_len: int | None = None
        # Fewest images / patches on a sample with any media: a pack with less room takes no media sample.
        self._min_media: tuple[int, int] | None = None

    def _config(self) -> dict[str, Any]:
        keys = (
            "max_length",
            "strategy",
            "max_images",
            "max_vision_patches",
            "buffer_size",
            "max_open_bins",
            "close_threshold",
        )
        return {key: getattr(self, key) for key in keys}

    def state_dict(self) -> dict[str, Any]:
        """The complete state as plain JSON-able data: the settings (checked on load), the open packs as
        `[bin_id, indices, lengths, images, patches]`, the pending samples and the counters."""
        return {
            "version": _STATE_VERSION,
            "config": self._config(),
            "open_bins": [
                [bid, list(b.items), list(b.lengths), list(b.images), list(b.patches)] for bid, b in self._open.items()
            ],
            "pending": dict(zip(("indices", "lengths", "images", "patches"), map(list, self._pending))),
            "next_bin_id": self._next_id,
            "min_length_seen": self._min_len,
            "min_media_seen": None if self._min_media is None else list(self._min_media),
            **{f"num_{k}": getattr(self, f"_num_{k}") for k in ("seen", "dropped", "emitted")},
            "closed_by": dict(self._closed_by),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a state from [`~StreamingPlanner.state_dict`] (possibly JSON round-tripped).

        Args:
            state (`dict`): The saved state.

        Raises:
            ValueError: if the state's version or settings differ from this planner's.
        """
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"Unsupported planner state version {state.get('version')!r}; expected {_STATE_VERSION}.")
        for key, value in self._config().items():
            if state["config"].get(key) != value:
                raise ValueError(
                    f"Planner state was saved with `{key}`={state['config'].get(key)!r} but this planner "
                    f"has `{key}`={value!r}; construct the planner with the same `{key}` to resume."
                )
        self._reset()
        for bid, *cols in state["open_bins"]:
            items, lens, imgs, pats = ([int(x) for x in col] for col in cols)
            self._open[int(bid)] = Bin(items, lens, imgs, pats, sum(lens), sum(imgs), sum(pats))
        self._pending = tuple(
            [int(x) for x in state["pending"][k]]  # type: ignore[assignment]
            for k in ("indices", "lengths", "images", "patches")
        )
        self._next_id = int(state["next_bin_id"])
        self._min_len = None if state["min_length_seen"] is None else int(state["min_length_seen"])
        media = state["min_media_seen"]
        self._min_media = None if media is None else (int(media[0]), int(media[1]))
        for k in ("seen", "dropped", "emitted"):
            setattr(self, f"_num_{k}", int(state[f"num_{k}"]))
        self._closed_by.update({k: int(v) for k, v in state["closed_by"].items()})

    @property
    def closed_by(self) -> dict[str, int]:
        """Packs closed so far by reason ([`CLOSE_REASONS`]): which budget closed them (`tokens`, `images`,
        `patches`), `open_packs` (over `max_open_bins`) or `end` (flushed at the end of the input)."""
        return dict(self._closed_by)

    @property
    def num_dropped(self) -> int:
        """Samples dropped so far because they alone exceed a budget."""
        return self._num_dropped

    @property
    def num_open_bins(self) -> int:
        """Packs currently open (carried over between windows)."""
        return len(self._open)

    def add(self, index: int, length: int, images: int = 0, patches: int = 0) -> list[list[int]]:
        """Adds one sample; returns the packs this closed (often none), in creation order.

        Args:
            index (`int`): Identifier of the sample, returned inside the packs (e.g. its dataset index).
            length (`int`): Token count.
            images (`int`, *optional*, defaults to 0): Image count (ignored unless `max_images` is set).
            patches (`int`, *optional*, defaults to 0): Σ `t·h·w` vision patches (ignored unless `max_vision_patches` is
                set).
        """
        sample = int(index), int(length), int(images), int(patches)
        if min(sample[1:]) < 0:
            raise ValueError(f"Sample {index}: `length`, `images` and `patches` must be >= 0, got {sample[1:]}.")
        return self._push(*([x] for x in sample))

    def extend(
        self,
        lengths: IntArray,
        *,
        indices: IntArray | None = None,
        images: IntArray | None = None,
        patches: IntArray | None = None,
    ) -> list[list[int]]:
        """Adds many samples; the same as [`~StreamingPlanner.add`] for each, but faster.

        Args:
            lengths (`Sequence[int]` or `np.ndarray`): Token count per sample.
            indices (`Sequence[int]` or `np.ndarray`, *optional*): Identifiers returned in the packs. Defaults to
                consecutive integers continuing the count of samples seen (so [`plan_packs`] gets indices into
                `lengths`).
            images (`Sequence[int]` or `np.ndarray`, *optional*): Image count per sample; required when `max_images` is
                set.
            patches (`Sequence[int]` or `np.ndarray`, *optional*): Vision patches per sample; required when
                `max_vision_patches` is set.

        Returns:
            `list[list[int]]`: packs closed by this call, in creation order.
        """
        lens = _as_int_array("lengths", lengths)
        n = lens.shape[0]
        idx = np.arange(self._num_seen, self._num_seen + n) if indices is None else np.asarray(indices, np.int64)
        if idx.shape != (n,):
            raise ValueError(f"`indices` has shape {idx.shape} but `lengths` has {n} entries.")
        media = []
        for name, values, arg in (("images", images, "max_images"), ("patches", patches, "max_vision_patches")):
            if getattr(self, arg) is not None and values is None:
                raise ValueError(
                    f"`{arg}` is set but no per-sample `{name}` were given; pass `{name}=` or unset `{arg}`."
                )
            media.append(np.zeros(n, np.int64) if values is None else _as_int_array(name, values, n))
        return self._push(idx, lens, *media)

    def flush(self) -> list[list[int]]:
        """Plans the pending samples and closes every open pack; returns them in creation order. The planner
        stays usable: counters continue and the next sample starts a fresh window."""
        return self._plan_window(final=True)

    def _push(self, idx: IntArray, lens: IntArray, imgs: IntArray, pats: IntArray) -> list[list[int]]:
        """Drops the samples over a budget (a dimension without a budget is ignored) and queues the others."""
        idx, lens, imgs, pats = map(np.asarray, (idx, lens, imgs, pats))
        keep = (lens <= self.max_length) & (imgs <= self._mi) & (pats <= self._mp)
        self._num_seen += len(keep)
        self._num_dropped += int(len(keep) - keep.sum())
        columns = [idx[keep].tolist(), lens[keep].tolist()]
        if self._media:
            columns += [
                col[keep].tolist() if limit is not None else [0] * len(columns[0])
                for col, limit in ((imgs, self.max_images), (pats, self.max_vision_patches))
            ]
        out: list[list[int]] = []
        start, n = 0, len(columns[0])
        while start < n:
            stop = n if self.buffer_size is None else start + self.buffer_size - len(self._pending[0])
            for pending, col in zip(self._pending, columns):
                pending += col[start:stop]
            start = stop
            if self.buffer_size is not None and len(self._pending[0]) >= self.buffer_size:
                out += self._plan_window(final=False)
        return out

    def _plan_window(self, *, final: bool) -> list[list[int]]:
        (idx, lens, imgs, pats), self._pending = self._pending, ([], [], [], [])
        if lens:
            self._min_len = min(lens) if self._min_len is None else min(self._min_len, min(lens))
            media = [(im, pa) for im, pa in zip(imgs, pats) if im or pa]
            if media:
                media += [self._min_media] if self._min_media else []
                self._min_media = min(im for im, _ in media), min(pa for _, pa in media)
        window: Columns = (idx, lens, imgs, pats)
        carried = {bid: len(b.items) for bid, b in self._open.items()}  # open pack -> its samples before this window
        if self.strategy == "next_fit":
            packs = self._next_fit(window, final)
        else:
            self._best_fit(window)
            if final:
                packs = self._close(list(self._open), {bid: self._closed_at_end(b) for bid, b in self._open.items()})
            else:
                packs = self._close_full(carried)
        self._num_emitted += len(packs)
        return packs

    def _next_fit(self, window: Columns, final: bool) -> list[list[int]]:
        ml, mi, mp, media = self.max_length, self._mi, self._mp, self._media
        packs: list[list[int]] = []
        bid, b = next(iter(self._open.items()), (-1, Bin(tokens=ml + 1)))  # an empty full pack takes nothing
        self._open.clear()
        tok, img, pat = b.tokens, b.num_images, b.num_patches
        for x, length, im, pa in zip(*window[:2], *(window[2:] if media else (repeat(0), repeat(0)))):
            if tok + length > ml or img + im > mi or pat + pa > mp:
                if b.items:
                    packs.append(b.items)
                    why = "tokens" if tok + length > ml else "images" if img + im > mi else "patches"
                    self._closed_by[why] += 1
                bid, b, tok, img, pat = self._next_id, Bin(), 0, 0, 0
                self._next_id += 1
            b.items.append(x)
            b.lengths.append(length)
            if media:
                b.images.append(im)
                b.patches.append(pa)
            tok, img, pat = tok + length, img + im, pat + pa
        b.tokens, b.num_images, b.num_patches = tok, img, pat
        if b.items and final:
            packs.append(b.items)
            self._closed_by[self._closed_at_end(b)] += 1
        elif b.items:
            self._open[bid] = b
        return packs

    def _best_fit(self, window: Columns) -> None:
        """Longest first, each sample into the open pack with the least token room that fits every budget (ties: the
        oldest): a bisect on the sorted room keys, then, for a sample with media, a walk up to the first pack whose
        image/patch room also fits (short unless those budgets bind)."""
        order = np.argsort(-np.asarray(window[1], dtype=np.int64), kind="stable")  # ties keep arrival order
        media = self._media
        cols = [np.asarray(col, dtype=np.int64)[order].tolist() for col in window[: 4 if media else 2]]
        ml, mi, mp, bins = self.max_length, self._mi, self._mp, self._open
        shift, mask, bl = _SHIFT, _MASK, bisect_left
        keys = sorted(((ml - b.tokens) << shift) | bid for bid, b in bins.items())
        next_id = self._next_id
        for x, length, im, pa in zip(*cols, *(() if media else (repeat(0), repeat(0)))):
            need = length << shift
            pos = bl(keys, need)
            if im or pa:
                n = len(keys)
                while pos < n and (
                    bins[keys[pos] & mask].num_images + im > mi or bins[keys[pos] & mask].num_patches + pa > mp
                ):
                    pos += 1
            if pos < len(keys):
                k = keys[pos] - need
                new_pos = bl(keys, k, 0, pos)
                if new_pos == pos:
                    keys[pos] = k
                else:
                    del keys[pos]
                    keys.insert(new_pos, k)
                b = bins[k & mask]
            else:
                k = ((ml - length) << shift) | next_id
                keys.insert(bl(keys, k), k)
                b = bins[next_id] = Bin()
                next_id += 1
            b.items.append(x)
            b.lengths.append(length)
            if media:
                b.images.append(im)
                b.patches.append(pa)
                b.num_images += im
                b.num_patches += pa
        self._next_id = next_id
        for k in keys:
            bins[k & mask].tokens = ml - (k >> shift)

    def _close(self, bids: list[int], why: str | dict[int, str]) -> list[list[int]]:
        """Closes the packs `bids` (in creation order), counting each under `why` (one reason, or one per pack)."""
        for bid in bids:
            self._closed_by[why if isinstance(why, str) else why[bid]] += 1
        return [self._open.pop(bid).items for bid in sorted(bids)]

    def _thresholds(self) -> tuple[int, int, int]:
        """A pack with at most this much token / image / patch room takes no further sample (-1: any room may)."""
        ct, mp = self.close_threshold, self._mp
        tok_thr = ct if self._min_len is None else max(ct, self._min_len - 1)
        img_thr = pat_thr = -1
        if self._min_media is not None:
            img_thr = -1 if self.max_images is None else self._min_media[0] - 1
            pat_thr = -1 if self.max_vision_patches is None else max(mp // 200, self._min_media[1] - 1)
        return tok_thr, img_thr, pat_thr

    def _closed_at_end(self, b: Bin) -> str:
        """Why a pack flushed at the end counts as closed: the budget it had reached (as a window would close it),
        else `end`."""
        tok_thr, img_thr, pat_thr = self._thresholds()
        if self._media and self._mi - b.num_images <= img_thr:
            return "images"
        if self._media and self._mp - b.num_patches <= pat_thr:
            return "patches"
        return "tokens" if self.max_length - b.tokens <= tok_thr else "end"

    def _binding(self, b: Bin) -> str:
        """The budget a pack that no sample fits is fullest in (tokens on ties)."""
        ml, mi, mp = self.max_length, self.max_images, self.max_vision_patches
        used = [(b.tokens / ml, "tokens")]
        used += [(b.num_images / mi, "images")] if mi else []
        used += [(b.num_patches / mp, "patches")] if mp else []
        return max(used, key=lambda u: u[0])[1]

    def _close_full(self, carried: dict[int, int]) -> list[list[int]]:
        """Closes the full packs after a BFD window; `carried`: the packs open before it, with their sample counts.

        A pack closes when its token room is within `close_threshold` or below the shortest sample seen, when it was
        carried over and got nothing, or when it can take no media sample any more (image room below the fewest
        images, or patch room within 0.5% of `max_vision_patches` / below the fewest patches, of a media sample):
        waiting for text-only samples could keep it open forever. Over `max_open_bins` the fullest (largest used
        fraction of any budget) close.
        """
        ml, bins, media, mi, mp = self.max_length, self._open, self._media, self._mi, self._mp
        tok_thr, img_thr, pat_thr = self._thresholds()
        closing: dict[int, str] = {}  # pack -> why it closes
        keep: list[int] = []
        for bid, b in bins.items():
            room = ml - b.tokens
            if media and mi - b.num_images <= img_thr:
                closing[bid] = "images"
            elif media and mp - b.num_patches <= pat_thr:
                closing[bid] = "patches"
            elif room <= tok_thr:
                closing[bid] = "tokens"
            elif carried.get(bid) == len(b.items):
                closing[bid] = self._binding(b)
            else:
                keep.append(bid)
        if self.max_open_bins is not None and len(keep) > self.max_open_bins:
            mi, mp = self.max_images, self.max_vision_patches

            def fullness(bid: int) -> float:
                b = bins[bid]
                return max(b.tokens / ml, b.num_images / mi if mi else 0, b.num_patches / mp if mp else 0)

            keep.sort(key=lambda bid: (-fullness(bid), bid))
            closing.update(dict.fromkeys(keep[: len(keep) - self.max_open_bins], "open_packs"))
        return self._close(list(closing), closing)


def plan_packs(
    lengths: IntArray,
    *,
    max_length: int,
    strategy: str = DEFAULT_STRATEGY,
    images: IntArray | None = None,
    max_images: int | None = None,
    vision_patches: IntArray | None = None,
    max_vision_patches: int | None = None,
    buffer_size: int | None = None,
) -> list[list[int]]:
    """Groups samples into packs that respect the token, image and vision-patch budgets: a [`StreamingPlanner`]
    fed everything, then flushed, so planning here and in a data pipeline give the same packs.

    Args:
        lengths (`Sequence[int]` or `np.ndarray`): Token count per sample.
        max_length (`int`): Token budget per pack (hard).
        strategy (`str`, *optional*, defaults to `"bfd"`): `"bfd"` or `"next_fit"` (see [`StreamingPlanner`]).
        images (`Sequence[int]` or `np.ndarray`, *optional*): Image count per sample; required when `max_images` is set.
        max_images (`int`, *optional*): Images per pack.
        vision_patches (`Sequence[int]` or `np.ndarray`, *optional*): Σ `t·h·w` of each sample's images/videos; required
            when `max_vision_patches` is set.
        max_vision_patches (`int`, *optional*): Vision patches per pack.
        buffer_size (`int`, *optional*): `None` plans the whole input at once; `k` streams it in windows of k samples.

    Returns:
        `list[list[int]]`: packs of indices into `lengths`. A sample over a budget on its own is in no pack;
        every other sample is in exactly one.

    Example:

    ```python
    >>> plan_packs([5, 4, 3, 3, 2, 1], max_length=8)
    [[0, 2], [1, 3, 5], [4]]
    ```
    """
    planner = StreamingPlanner(
        max_length=max_length,
        strategy=strategy,
        max_images=max_images,
        max_vision_patches=max_vision_patches,
        buffer_size=buffer_size,
    )
    return planner.extend(lengths, images=images, patches=vision_patches) + planner.flush()
