"""The planner replica: one per (rank, DataLoader worker) of a [`~hf_packing.packing.dataset.PackedDataset`].

A replica reads every row of the source, plans packs from metadata, schedules closed packs into rank-balanced groups
and pixel-processes only the packs its rank and worker own (see [`~hf_packing.packing.dataset`]'s docstring, 1.-3. and
5.). Every replica reads the same rows and makes the same decisions, so replicas agree without communicating; the price
is that each plans every row (a length index makes that a column read, [`~hf_packing.packing.length_index`]). That
includes stopping: a source that skips more than `max_skipped_fraction` of its rows raises on every replica at the same
row ([`~hf_packing.packing.stats.check_skips`]).

A row problem is a [`SampleError`] (a reason of `REASONS`): skipped and counted. Any other exception (a processor or
library API break, a bug) is not a bad row and ends the pass, on every replica that meets it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from ..config import PackingConfig
from ..ops.loss import IGNORE_INDEX
from ..preprocess.errors import SampleError
from ..preprocess.formats import per_source, per_source_dict
from ..preprocess.preprocessor import Preprocessor, SampleMeta
from .balance import WorkCost, schedule
from .planner import StreamingPlanner
from .readers import SOURCE_COLUMN
from .source_ids import SOURCE_ID, SourceTagger
from .stats import PackStats, check_skips, check_yield, overlong_tokens

__all__ = ["Replica", "preprocessors"]
Owned = tuple[list[dict[str, Any]], dict[str, Any]]  # a pack this replica owns: its processed samples, the position


def preprocessors(cfg: PackingConfig, processor: Any, names: list[str]) -> dict[str | None, Preprocessor]:
    """One [`Preprocessor`] per source of `cfg` (key `None` for a single dataset), with that source's format and
    roots."""
    per = {k: per_source(getattr(cfg, k), names, k) for k in ("media_root", "video_root", "fps")}
    videos_kwargs = per_source_dict(cfg.videos_kwargs, names, "videos_kwargs")
    template_kwargs = per_source_dict(cfg.chat_template_kwargs, names, "chat_template_kwargs")
    fmt = per_source(cfg.row_format, names, "row_format", "auto")
    return {
        n: Preprocessor(
            processor,
            max_length=cfg.max_length,
            media_root=per["media_root"][n],
            video_root=per["video_root"][n],
            fps=per["fps"][n],
            videos_kwargs=videos_kwargs[n],
            row_format=fmt[n],
            train_on=cfg.train_on,
            on_overlong=cfg.on_overlong,
            max_image_pixels=cfg.max_image_pixels,
            chat_template_kwargs=template_kwargs[n],
            empty_thinking=cfg.empty_thinking,
            media_timeout=cfg.media_timeout,
            media_tries=cfg.media_tries,
            media_max_bytes=cfg.media_max_bytes,
            media_cache_bytes=cfg.media_cache_bytes,
        )
        for n in fmt
    }


class Replica:
    """The planner replica of (`rank` of `world`, `worker` of `workers`) over `source` (a
    [`~hf_packing.packing.readers.make_source`] reader of the sources `names`): reads every row, plans, assigns packs to
    ranks, processes its own. `cost` weighs a pack's work for rank balance; `position` is a saved
    [`~Replica.position`] to resume from."""

    def __init__(
        self,
        cfg: PackingConfig,
        processor: Any,
        source: Any,
        names: list[str],
        *,
        cost: WorkCost,
        epoch: int,
        rank: int,
        world: int,
        worker: int,
        workers: int,
        position: dict[str, Any] | None,
        tag_source: SourceTagger | None = None,
    ) -> None:
        self.cfg, self.cost, self.source, self.epoch = cfg, cost, source, epoch
        self.rank, self.world, self.worker, self.workers = rank, world, worker, workers
        self.preprocessors = preprocessors(cfg, processor, names)
        self.tag_source = tag_source if tag_source else None  # falsy tagger: samples carry no source id
        self.pad_id = next(iter(self.preprocessors.values())).tokenizer.pad_token_id or 0
        self.planner = StreamingPlanner(
            max_length=cfg.max_length,
            strategy=cfg.strategy,
            max_images=cfg.max_images,
            max_vision_patches=cfg.max_vision_patches,
            buffer_size=cfg.buffer_size,
        )
        # row -> (row, tokens, source, cost)
        self.held: dict[int, tuple[dict[str, Any], int | None, str | None, float]] = {}
        self.unassigned: list[list[int]] = []  # closed packs waiting for a full balance window
        self.ready: list[list[list[int]]] = []  # scheduled groups (one pack per rank) not yet handed out
        self.next_group = 0
        self.source_positions: dict[int, Any] = {0: None}  # row -> source position before it (from the oldest held)
        self.next_row, self.replay_until = 0, 0
        self.replay: set[int] = set()  # rows before replay_until: re-read, not planned
        self.stats = PackStats(names)
        self.skip_examples: dict[tuple[str | None, str], tuple[int, str]] = {}  # (source, reason) -> its first row
        self.longest: dict[str | None, int] = {}  # source -> its longest overlong sample
        self.settings = {
            n: {
                "media_root": None if p.images.image_root is None else str(p.images.image_root),
                "row_format": p.row_format,
                **{
                    k: getattr(cfg, k)
                    for k in ("max_length", "max_images", "max_vision_patches", "on_overlong", "max_image_pixels")
                },
            }
            for n, p in self.preprocessors.items()
        }
        if position is not None:
            self._restore(position)
        self.stats.planning_skips.log = self.rank == 0 and worker == 0  # one replica per run logs planning skips

    # ------------------------------------------------------------------------------------------------ state
    def position(self, planner: dict[str, Any]) -> dict[str, Any]:
        """Where this replica stands, as plain data: `planner`, its planner's state (shared by the positions of one
        batch of closed packs), the rows still held and the source position of the oldest, the row where planning
        continues, the packs not yet assigned, the groups scheduled but not handed out, the group count and the
        [`PackStats`] row."""
        read_from = self._oldest()
        return {
            "planner": planner,
            "held": list(self.held),
            "read_from": read_from,
            "source_state": self.source_positions[read_from],
            "planned_until": self.next_row,
            "unassigned": list(self.unassigned),
            "ready": [list(g) for g in self.ready],
            "next_group": self.next_group,
            "stats": self.stats.to_row(),
        }

    def _restore(self, position: dict[str, Any]) -> None:
        self.planner.load_state_dict(position["planner"])
        self.replay = {int(i) for i in position["held"]}
        self.next_row, self.replay_until = int(position["read_from"]), int(position["planned_until"])
        self.source_positions = {self.next_row: position["source_state"]}
        self.unassigned = [list(p) for p in position["unassigned"]]
        self.ready = [[list(p) for p in group] for group in position["ready"]]
        self.next_group = int(position["next_group"])
        self.stats = PackStats.from_row(self.stats.sources, position["stats"])

    # ------------------------------------------------------------------------------------------------ main loop
    def run(self, *, process: bool = True, progress: Any = None) -> Iterator[Owned]:
        """Reads the whole source, yielding `(samples, position)` for each pack this replica owns, processed. With
        `process=False` it only plans (counts groups) and yields nothing. Stopping early is closing the iterator."""
        for row, state_after in self.source.rows(self.source_positions[self.next_row], self.epoch):
            index, self.next_row = self.next_row, self.next_row + 1
            self.source_positions[self.next_row] = state_after
            if not self.next_row % 4096:  # bounded even when rows keep being skipped and no pack closes
                self._prune()
            if progress is not None:
                progress.update(1)
            if index < self.replay_until:  # re-reading the rows a resumed planner still holds
                if index in self.replay:
                    self._keep(index, row, count=False)
                continue
            meta = self._keep(index, row, count=True)
            if meta is not None:
                packs = self.planner.add(index, meta.num_tokens, meta.num_images, meta.vision_patches)
                if packs:
                    yield from self._assign_groups(packs, process)
        # every row is read: the skip checks come before the last packs are yielded (a short run ends on those)
        check_yield(self.stats, groups=None, world=self.world, **self._hints())
        for source in self.stats.sources:
            self._check_skips(source, min_rows=0)
        yield from self._assign_groups(self.planner.flush(), process, final=True, spread=self.cfg.leftovers == "spread")
        self.stats.leftover_packs = len(self.unassigned)
        self.stats.leftover_samples = sum(len(p) for p in self.unassigned)
        self.stats.complete = 1
        check_yield(self.stats, groups=self.next_group, world=self.world, **self._hints())

    def _hints(self) -> dict[str, Any]:
        """What `check_yield` words its hints with: the first row of each skip reason, the settings, the longest."""
        return {"examples": self.skip_examples, "settings": self.settings, "longest": self.longest}

    def _keep(self, index: int, row: dict[str, Any], *, count: bool) -> SampleMeta | None:
        """Holds a row for planning and returns its metadata, or `None` when it is skipped (counted if `count`)."""
        source = row.pop(SOURCE_COLUMN, None)
        if count:
            self.stats.rows[source] += 1
        try:
            meta = self.preprocessors[source].planned_meta(row, index)
        except SampleError as err:  # a bad row; anything else (a bug, an API break) ends the pass
            if self.cfg.on_error == "raise":
                raise
            if count:
                self._skip(err, index, source=source, planning=True)
            else:  # planned before, failing now on resume: processing reports it
                self.held[index] = (row, None, source, 0.0)
            return None
        for reason, value, name in (
            ("too_many_images", meta.num_images, "max_images"),
            ("too_many_vision_patches", meta.vision_patches, "max_vision_patches"),
        ):
            limit = getattr(self.cfg, name)
            if limit is not None and value > limit:
                if count:
                    error = SampleError(reason, f"{value:,} > {name}={limit:,}; raise {name}")
                    self._skip(error, index, source=source, planning=True)
                return None
        cost = self.cost.sample(meta.num_tokens, meta.vision_patches, meta.vision_sq)
        self.held[index] = (row, meta.num_tokens, source, cost)
        if count:
            self.stats.add_padded(meta.num_tokens)
            self.stats.kept[source] += 1
            self.stats.features.update(meta.features)
        return meta

    def _skip(self, err: SampleError, index: int, *, source: str | None = None, planning: bool) -> None:
        """Counts a skip and logs the first of each kind: while planning by (source, reason), once per run (every
        replica plans every row), then checks the source's skip budget; while processing by reason, on this
        replica."""
        if not planning:
            self.stats.processing_skips.record(err.reason, index, str(err))
            return
        self.stats.planning_skips.record(err.reason, index, str(err), key=(source, err.reason))
        self.skip_examples.setdefault((source, err.reason), (index, str(err)))
        if err.reason == "overlong" and (tokens := overlong_tokens(str(err))) is not None:
            self.longest[source] = max(self.longest.get(source, 0), tokens)
        self._check_skips(source, min_rows=self.cfg.skip_check_rows)

    def _check_skips(self, source: str | None, *, min_rows: int) -> None:
        check_skips(
            self.stats,
            source,
            max_fraction=self.cfg.max_skipped_fraction,
            min_rows=min_rows,
            examples=self.skip_examples,
            settings=self.settings[source],
            longest=self.longest.get(source),
        )

    def _assign_groups(
        self,
        packs: list[list[int]],
        process: bool,
        *,
        final: bool = False,
        spread: bool = False,
    ) -> Iterator[Owned]:
        """Schedules each full balance window of closed packs (at the end, `final`, every full group of `world`) into
        groups of one pack per rank, then, when `process`, processes and yields this replica's with its position. With
        `spread` (``leftovers="spread"``, at the end) the last incomplete group goes one pack per rank, in rank order,
        ranks past its end getting a 1-token filler: every pack is yielded once and ranks take equal steps."""
        self.stats.planned_packs += len(packs)
        self.stats.closed_by = Counter(self.planner.closed_by)
        self.unassigned.extend(packs)
        self._prune()
        window = self.world * self.cfg.batch_size * self.cfg.balance_window if self.world > 1 else 1
        while len(self.unassigned) >= window or (final and len(self.unassigned) >= self.world):
            take = window if len(self.unassigned) >= window else len(self.unassigned) // self.world * self.world
            chunk, self.unassigned = self.unassigned[:take], self.unassigned[take:]
            costs = [sum(self.held[i][3] for i in pack) for pack in chunk]
            groups = schedule(costs, world=self.world, per_rank=self.cfg.batch_size)
            self.ready += [[chunk[k] for k in group] for group in groups]
        planner = None  # the planner's state does not change here: taken once, when a position first needs it
        while self.ready or (spread and self.unassigned):
            if self.ready:
                group = self.ready.pop(0)
                pack = group[self.rank]
            else:
                group, self.unassigned = self.unassigned, []
                pack = group[self.rank] if self.rank < len(group) else []
            mine = process and (self.next_group // self.cfg.batch_size) % self.workers == self.worker
            self.next_group += 1
            samples = self._process(pack) if mine else []
            for i in (i for p in group for i in p):
                self.held.pop(i, None)
            if mine:
                planner = planner or self.planner.state_dict()
                yield samples, self.position(planner)

    def _filler(self) -> dict[str, Any]:
        """A 1-token sample without targets: a pack that keeps ranks in step and adds nothing to the loss."""
        one = torch.ones(1, dtype=torch.long)
        return {
            "input_ids": one * self.pad_id,
            "labels": one * IGNORE_INDEX,
            "attention_mask": one,
            "mm_token_type_ids": one * 0,
            "num_tokens": 1,
            "index": -1,
            **({SOURCE_ID: 0} if self.tag_source else {}),  # no targets: adds nothing to source 0
        }

    def _oldest(self) -> int:
        return next(iter(self.held), self.next_row)  # rows are held in order

    def _prune(self) -> None:
        """Drops the source positions of rows older than the oldest row still held."""
        oldest = self._oldest()
        for row in [row for row in self.source_positions if row < oldest]:
            del self.source_positions[row]

    def _process(self, pack: list[int]) -> list[dict[str, Any]]:
        """The processed samples of `pack`; a filler instead when it is empty or none of its samples can be used."""
        samples = []
        for index in pack:
            row, planned, source, _ = self.held[index]
            try:
                raw = self.source.fetch(index) if self.source.lazy else row
                source_id = self.tag_source(source, raw) if self.tag_source else None
                sample = self.preprocessors[source].process(raw, index, planned_tokens=planned)
            except SampleError as err:  # a bad row; anything else (a bug, an API break) ends the pass
                if self.cfg.on_error == "raise":
                    raise
                self._skip(err, index, planning=False)
                continue
            if source_id is not None:
                sample[SOURCE_ID] = source_id
            samples.append(sample)
            self.stats.samples[source] += 1
            if "video_grid_thw" in sample:
                self.stats.videos += len(sample["video_grid_thw"])
                self.stats.video_tokens += int((sample["input_ids"] == self.preprocessors[source].video_id).sum())
        if not samples:  # keep ranks in step with a 1-token, unsupervised filler
            if pack:  # every sample failed to decode
                self.stats.processing_skips["empty_pack"] += 1
            samples = [self._filler()]
        self.stats.packs += 1
        self.stats.tokens += sum(s["num_tokens"] for s in samples)
        self.stats.images += sum(len(s["image_grid_thw"]) for s in samples if "image_grid_thw" in s)
        return samples
