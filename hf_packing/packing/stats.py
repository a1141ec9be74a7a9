"""Statistics of a plan: fill, pack sizes, images per pack, and the padded-batch baseline it is compared with;
[`PackStats`], the counters of one pass of `pack_dataset`; and the checks that stop a pass whose sources are mostly
skipped ([`check_skips`], [`check_yield`])."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..preprocess.errors import REASONS, SkipCounter
from ..preprocess.formats import FEATURES
from .planner import CLOSE_REASONS, IntArray, check_int

__all__ = [
    "PADDED_BATCH",
    "SKIP_HINTS",
    "NoSamplesError",
    "PackStats",
    "TooManySkipsError",
    "check_skips",
    "check_yield",
    "pack_stats",
    "padded_fill_at_batch",
    "skip_hint",
]

#: the baseline every fill is compared with: the same samples in padded batches of 8, in input order
PADDED_BATCH = 8


def padded_fill_at_batch(lengths: IntArray, batch_size: int = PADDED_BATCH) -> float:
    """Slot utilisation of padded batches of `batch_size` consecutive samples: Σ length / Σ (rows × longest).

    Args:
        lengths (`Sequence[int]` or `np.ndarray`): Token counts in the order they would be batched.
        batch_size (`int`, *optional*, defaults to 8): Samples per padded batch (the last one may be smaller).

    Returns:
        `float`: utilisation in [0, 1] (1.0 for empty input).
    """
    batch_size = check_int("batch_size", batch_size, minimum=1)
    la = np.asarray(lengths, dtype=np.int64)
    if la.shape[0] == 0 or int(la.sum()) == 0:
        return 1.0
    full = (la.shape[0] // batch_size) * batch_size
    slots = int(la[:full].reshape(-1, batch_size).max(axis=1).sum()) * batch_size
    if full < la.shape[0]:
        slots += int(la[full:].max()) * (la.shape[0] - full)
    return float(la.sum()) / slots


def pack_stats(
    packs: Sequence[Sequence[int]],
    lengths: IntArray,
    max_length: int,
    images: IntArray | None = None,
    *,
    batch_size: int = PADDED_BATCH,
) -> dict[str, Any]:
    """Summary statistics of a plan.

    Args:
        packs (`Sequence[Sequence[int]]`): Packs as returned by [`plan_packs`].
        lengths (`Sequence[int]` or `np.ndarray`): Token count per sample (the `lengths` the plan was made from).
        max_length (`int`): Token budget per pack.
        images (`Sequence[int]` or `np.ndarray`, *optional*): Image count per sample, for the per-pack image statistics.
        batch_size (`int`, *optional*, defaults to 8): Batch size of the padded baseline.

    Returns:
        `dict`: `num_packs`, `num_samples` (packed), `dropped` (samples in no pack), `fill` (Σ packed tokens /
        (num_packs · max_length)), `mean_tokens_per_pack`, `max_tokens_per_pack`, `min_tokens_per_pack`,
        `mean_samples_per_pack`, `mean_images_per_pack` / `max_images_per_pack` (`None` without `images`),
        `padded_batch_fill` (slot utilisation of padded batches of `batch_size` packed samples in input order)
        and `padding_ratio_padded_batches` (1 - that).
    """
    max_length = check_int("max_length", max_length, minimum=1)
    la = np.asarray(lengths, dtype=np.int64)
    num_packs = len(packs)
    flat = np.fromiter((i for p in packs for i in p), dtype=np.int64)
    sizes = np.fromiter((len(p) for p in packs), dtype=np.int64, count=num_packs)
    pack_of = np.repeat(np.arange(num_packs), sizes)
    tok = np.bincount(pack_of, weights=la[flat], minlength=num_packs).astype(np.int64)
    per_image = None
    if images is not None and num_packs:
        per_image = np.bincount(pack_of, weights=np.asarray(images, dtype=np.int64)[flat], minlength=num_packs)
    padded = padded_fill_at_batch(la[np.sort(flat)], batch_size)
    return {
        "num_packs": num_packs,
        "num_samples": int(flat.size),
        "dropped": int(la.shape[0] - np.unique(flat).size),
        "fill": float(tok.sum()) / (num_packs * max_length) if num_packs else 0.0,
        "mean_tokens_per_pack": float(tok.mean()) if num_packs else 0.0,
        "max_tokens_per_pack": int(tok.max()) if num_packs else 0,
        "min_tokens_per_pack": int(tok.min()) if num_packs else 0,
        "mean_samples_per_pack": float(sizes.mean()) if num_packs else 0.0,
        "mean_images_per_pack": None if per_image is None else float(per_image.mean()),
        "max_images_per_pack": None if per_image is None else int(per_image.max()),
        "padded_batch_fill": padded,
        "padding_ratio_padded_batches": 1.0 - padded,
    }


@dataclasses.dataclass
class PackStats:
    """The counters of one pass of one replica (a rank's DataLoader worker), by source and skip reason ([`REASONS`]).

    The planning counters (`rows` to `batch_longest`) are the same on every replica, since each plans every row; the
    rest is the replica's own yielded work. Every counter is an integer over fixed keys, so the stats travel from
    DataLoader workers as one row of a shared table, and into `state_dict()`, as [`~PackStats.to_row`].
    """

    sources: Sequence[str | None]  # the names of a mix; empty or `(None,)` for a single dataset
    rows: Counter = dataclasses.field(default_factory=Counter)  # source -> rows read
    kept: Counter = dataclasses.field(default_factory=Counter)  # source -> rows planned
    planning_skips: SkipCounter = dataclasses.field(default_factory=SkipCounter)  # (source, reason) -> rows
    planned_packs: int = 0  # for all ranks
    leftover_packs: int = 0  # the last incomplete group of world_size packs, yielded by no rank
    leftover_samples: int = 0
    complete: int = 0
    padded_tokens: int = 0  # tokens of the kept rows, and the slots their padded batches use: closed ones ...
    padded_slots: int = 0
    batch_rows: int = 0  # ... and the open one
    batch_longest: int = 0
    packs: int = 0  # yielded by this replica, fillers included
    samples: Counter = dataclasses.field(default_factory=Counter)  # source -> samples yielded
    tokens: int = 0
    images: int = 0
    videos: int = 0
    video_tokens: int = 0  # <|video_pad|> tokens of the yielded samples
    processing_skips: SkipCounter = dataclasses.field(default_factory=SkipCounter)  # reason -> samples
    closed_by: Counter = dataclasses.field(default_factory=Counter)  # why packs closed (all ranks): CLOSE_REASONS
    features: Counter = dataclasses.field(default_factory=Counter)  # kept rows carrying each of formats.FEATURES

    _YIELDED = ("packs", "samples", "tokens", "images", "videos", "video_tokens", "processing_skips")

    def __post_init__(self) -> None:
        self.sources = tuple(self.sources) or (None,)

    def add_padded(self, tokens: int) -> None:
        """Counts a kept row into the padded-batch baseline (integers, so it resumes with the other counters)."""
        self.padded_tokens += tokens
        self.batch_rows += 1
        self.batch_longest = max(self.batch_longest, tokens)
        if self.batch_rows == PADDED_BATCH:
            self.padded_slots += PADDED_BATCH * self.batch_longest
            self.batch_rows = self.batch_longest = 0

    def _layout(self) -> list[tuple[str, Sequence[Any] | None]]:
        """Each counter and, for a `Counter`, its keys in a fixed order (`None` for an `int`)."""
        keys = {
            "planning_skips": [(s, r) for s in self.sources for r in REASONS],
            "processing_skips": REASONS,
            "closed_by": CLOSE_REASONS,
            "features": FEATURES,
        }
        return [
            (f.name, keys.get(f.name, self.sources) if isinstance(getattr(self, f.name), Counter) else None)
            for f in dataclasses.fields(self)[1:]
        ]  # [0] is `sources`, the layout itself

    def to_row(self) -> list[int]:
        row = []
        for name, keys in self._layout():
            value = getattr(self, name)
            row += [value] if keys is None else [value[key] for key in keys]
        return row

    @classmethod
    def from_row(cls, sources: Sequence[str | None], row: Sequence[float]) -> PackStats:
        stats = cls(tuple(sources))
        values = iter(row)
        for name, keys in stats._layout():
            if keys is None:
                setattr(stats, name, int(next(values)))
            else:
                getattr(stats, name).update({key: int(value) for key in keys if (value := next(values))})
        return stats

    @classmethod
    def merge(cls, sources: Sequence[str | None], rows: np.ndarray) -> PackStats:
        """One rank's stats from its replicas' rows (one per row of `rows`): planning counters by max (the same on
        every replica: the one furthest along), yielded work summed."""
        yielded = [name in cls._YIELDED for name, keys in cls(sources)._layout() for _ in keys or [None]]
        return cls.from_row(sources, np.where(yielded, rows.sum(axis=0), rows.max(axis=0)))


class NoSamplesError(ValueError):
    """A source (or the whole stream) gave no sample over a full pass: training would silently train nothing."""


class TooManySkipsError(NoSamplesError):
    """A source skipped more than `max_skipped_fraction` of its rows: training would run on what is left of it."""


#: what to change, per skip reason, in a [`NoSamplesError`] / [`TooManySkipsError`]; `{...}` are the source's settings
#: (see [`skip_hint`]: "overlong" is worded there, with the longest sample's tokens when they are known)
SKIP_HINTS = {
    "missing_file": "relative paths resolve under media_root={media_root!r}: set media_root (one, a list or "
    "{{source: root}}) to the directory the rows' paths start from (video_root for videos, if elsewhere)",
    "path_outside_root": "every file must lie under media_root={media_root!r} (no `..`, absolute paths or symlinks "
    "out): point media_root at their common root",
    "overlong_vision": "its vision tokens do not fit max_length={max_length} (truncate_text never cuts an image): "
    "raise max_length",
    "too_many_images": "max_images=None leaves the packs' vision work to max_vision_patches",
    "too_many_vision_patches": "or lower the processor's max_pixels",
    "no_assistant_turn": "set train_on='all' to train rows without an answer, or check row_format={row_format!r}",
    "placeholder_mismatch": "each image/video needs exactly one tag in the text (docs/row_formats.md); check "
    "row_format={row_format!r}",
    "empty_conversation": "check row_format={row_format!r} against the rows' columns (docs/row_formats.md)",
    "bad_row": "check row_format={row_format!r} against the rows' columns (docs/row_formats.md)",
    "image_too_large": "raise max_image_pixels={max_image_pixels:,} (memory grows with it) or downscale the images",
    "video_too_large": "frames are larger than max_image_pixels={max_image_pixels:,}: raise it or downscale them",
    "corrupt_image": "the image files cannot be decoded: re-encode or drop them",
    "corrupt_video": "the video files cannot be decoded (check them with ffprobe): re-encode them, or give the "
    "frames as a nested list per video",
    "empty_image": "the image files are empty: re-export them",
    "empty_video": "the videos have no frames to sample: re-export them, or check videos_kwargs",
    "fetch_failed": "every training host must reach the URLs: check them, or raise media_timeout / media_tries / "
    "media_max_bytes",
    "bad_data_uri": "a data URI is data:<mime>;base64,<payload>: re-encode the rows' data URIs",
}
_TOKENS = re.compile(r"^([\d,]+) tokens > max_length")


def overlong_tokens(message: str) -> int | None:
    """The token count of an `overlong` skip's message ("9,312 tokens > max_length=8192 ..."), else `None`."""
    found = _TOKENS.match(message)
    return int(found.group(1).replace(",", "")) if found else None


def skip_hint(reason: str, settings: dict[str, Any], longest: int | None = None) -> str:
    """What to change for rows skipped for `reason`, with the source's `settings` (`max_length`, `media_root`,
    `row_format`, `on_overlong`, ...) and, for "overlong", the `longest` sample's tokens when a skip reported them (a
    number is printed only when it is known)."""
    if reason == "overlong":
        max_length = settings.get("max_length")
        if longest:
            return (
                f"the longest has {longest:,} tokens > max_length={max_length}: raise max_length or set "
                "on_overlong='truncate_text'"
            )
        if settings.get("on_overlong") == "truncate_text":  # the one overlong skip that reports no count
            return f"no supervised token lies within the first max_length={max_length} tokens: raise max_length"
        return f"samples are longer than max_length={max_length}: raise max_length or set on_overlong='truncate_text'"
    try:
        return SKIP_HINTS[reason].format(**settings) if reason in SKIP_HINTS else "see docs/row_formats.md"
    except (KeyError, ValueError):  # a setting the caller did not pass: the hint without numbers is still right
        return "see docs/row_formats.md"


def _why(
    source: str | None,
    reason: str,
    examples: dict[tuple[str | None, str], tuple[Any, str]],
    settings: dict[str, Any],
    longest: int | None,
) -> str:
    """``"{reason} (first: row {i}, {message}; {hint})"``."""
    index, message = examples.get((source, reason), (None, ""))
    first = f"first: row {index}, {message}" if message else ""
    return f"{reason} ({'; '.join(x for x in (first, skip_hint(reason, settings, longest)) if x)})"


def check_skips(
    stats: PackStats,
    source: str | None,
    *,
    max_fraction: float,
    min_rows: int,
    examples: dict[tuple[str | None, str], tuple[Any, str]],
    settings: dict[str, Any],
    longest: int | None = None,
) -> None:
    """Raises [`TooManySkipsError`] when `source` has skipped more than `max_fraction` of the rows read of it while
    planning, once at least `min_rows` of them were read (0: at the end of a pass). The message names the top three
    reasons, each with its first row (`examples`: `(source, reason)` -> `(row, message)`) and a hint
    ([`skip_hint`], with the source's `settings` and the `longest` overlong sample).

    `stats` are the planning counters, the same on every replica, so every rank and worker raises at the same row and
    none waits in a collective.
    """
    rows = stats.rows[source]
    if not rows or rows < min_rows or max_fraction >= 1.0:
        return
    skips = Counter({reason: n for (name, reason), n in stats.planning_skips.items() if name == source and n})
    skipped = sum(skips.values())
    if skipped <= max_fraction * rows:
        return
    why = [f"{n} {_why(source, reason, examples, settings, longest)}" for reason, n in skips.most_common(3)]
    name = "the dataset" if source is None else f"source {source!r}"
    raise TooManySkipsError(
        f"{name} skipped {skipped} of the {rows} rows read so far ({skipped / rows:.0%} > max_skipped_fraction="
        f"{max_fraction:g}): " + "; ".join(why) + ". Fix the data or the settings named, or raise max_skipped_fraction"
        " (1.0: never stop); stats() counts every skip"
    )


# ------------------------------------------------------------------------------------------------ empty sources
def check_yield(
    stats: PackStats,
    *,
    groups: int | None,
    world: int,
    examples: dict[tuple[str | None, str], tuple[Any, str]] | None = None,
    settings: dict[str | None, dict[str, Any]] | None = None,
    longest: dict[str | None, int] | None = None,
) -> None:
    """Raises [`NoSamplesError`] after a full planning pass that kept no sample of a source that had rows, or none at
    all, or planned packs but no complete group of `world` (every rank would train on nothing; not checked with
    `groups=None`, before the last packs are assigned).

    The message gives each such source's top reasons and, for the first (the dominant one), its first row and the hint
    that names what to change ([`skip_hint`], with `examples`: `(source, reason)` -> `(row, message)`, `settings`:
    source -> its settings, `longest`: source -> its longest overlong sample).

    `stats` are the planning counters, the same on every replica, so every rank raises at the same point and none
    waits in a collective.
    """
    failed = []
    for source in stats.sources:
        rows = stats.rows[source]
        if stats.kept[source] or (source is not None and not rows):
            continue
        skips = Counter({reason: n for (name, reason), n in stats.planning_skips.items() if name == source})
        why = ", ".join(f"{n} {reason}" for reason, n in skips.most_common(3)) or "it is empty"
        if skips:  # the dominant reason's first row and what to change for it
            ((top, _),) = skips.most_common(1)
            own = (settings or {}).get(source, {})
            why += ". " + _why(source, top, examples or {}, own, (longest or {}).get(source))
        failed.append(f"{'the dataset' if source is None else f'source {source!r}'} yielded 0 of {rows} rows: {why}")
    if failed:
        raise NoSamplesError("; ".join(failed) + ". stats() counts every skip")
    if not sum(stats.kept.values()):
        raise NoSamplesError("no source yielded a sample: every source is empty")
    if groups is not None and not groups:
        packs = stats.planned_packs
        raise NoSamplesError(
            f"{packs} pack{'s' * (packs != 1)} planned, none for any of world_size={world} ranks "
            "(a step needs one pack per rank): add data or lower max_length"
        )
