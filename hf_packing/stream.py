"""`pack_dataset`: a stream of packs (lists of processed samples), rank-equal, worker-invariant and resumable.

A pack holds whole samples whose tokens sum to at most `max_length` (and within the image / vision-patch budgets);
the collator later pads each sample to a row or flattens the pack. A full pack at `max_length=20`::

                   |<------------ #40: 14 ------------>|<--- #51: 6 --->|     boundaries come from lengths
    input_ids       S  u  V  I  I  I  I  E  t  e  S  a  a  e   S  t  e  S  a  e
    mm_token_type   0  0  0  1  1  1  1  0  0  0  0  0  0  0   0  0  0  0  0  0     1: image (never cut)
    labels          -  -  -  -  -  -  -  -  -  -  -  a  a  e   -  -  -  -  a  e     -: -100

    S: <|im_start|>role\n   u t: user text   V I I E: <|vision_start|> <|image_pad|>... <|vision_end|>
    a: assistant text   e: <|im_end|>, supervised with its turn

How it works, without any collective:

1. **Plan on metadata, everywhere.** Every worker of every rank reads the same rows in the same order, gets each
   one's tokens / images / patches from the length index of a `datasets.Dataset` (built once, see
   [`~hf_packing.length_index`]) or, for a stream, from text and image headers
   ([`~hf_packing.data.Preprocessor.estimate`]) and feeds the same deterministic
   [`~hf_packing.planner.StreamingPlanner`] (windows of `buffer_size`), so all replicas see the same global sequence
   of packs. BFD over a 1,000-sample window loses < 0.05% fill against whole-dataset.
2. **Ranks.** Closed packs wait until `balance_window` steps' worth (`world_size · batch_size` packs a step) are
   there; [`~hf_packing.balance.schedule`] then sorts them by cost (text and vision work, weighted from the model
   config: [`~hf_packing.balance.WorkCost`]), cuts them into steps of similar packs and splits each step over the
   ranks, so no rank stalls a step. Every rank yields as many packs whatever the shard sizes; a final incomplete
   group is left over (counted in `stats()`) or, with `leftovers="spread"` (eval sets), handed out one pack per
   rank, with a 1-token filler for the ranks past its end.
3. **Workers.** DataLoader worker w of W takes the rank's packs j with (j // batch_size) % W == w; the DataLoader
   interleaves workers round-robin, so the batches are the same, in the same order, for any `num_workers`. Only a
   worker's own packs get pixel processing ([`~hf_packing.data.Preprocessor.process`]), which checks the processed
   length against the planned one.
4. **Producer thread.** Reading, planning and pixel work run in a background thread feeding a queue of `prefetch`
   packs; its exceptions re-raise in the consumer; it stops when the iterator is closed or garbage-collected. A bad
   row is skipped and counted ([`PackStats`]), never fatal (unless `on_error="raise"`).
5. **Resume.** `state_dict()` is the state after the last pack *yielded*: the planner's open packs, the packs
   planned but not yet assigned, the steps scheduled but not yet yielded, the counters, and the source position
   (`datasets` state_dict or a row number) of the oldest row still held plus the row where planning continues.
   Loading it re-reads only that span (typically a few windows) and continues with exactly the packs of an
   uninterrupted run.

The price of agreeing without communication is that every replica plans every row. From a stream that means W · N
estimates per rank against N / R pixel jobs (with the tiny test processors and 256-1024 px JPEGs, one thread, ~1.5
ms of CPU per row estimated, ~26 ms per sample processed); a `datasets.Dataset` is estimated once
(`length_index="auto"`) and each replica reads columns (see `benchmarks/RESULTS.md`, `bench_index.py`).
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import logging
import os
import queue
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .balance import WorkCost, schedule
from .data import REASONS, OverlongError, Preprocessor, SampleError, SampleMeta
from .formats import per_source, source_formats
from .images import MAX_IMAGE_PIXELS
from .length_index import with_length_index
from .loss import IGNORE_INDEX
from .pack_stats import PADDED_BATCH, PackStats, check_yield
from .planner import StreamingPlanner
from .source_ids import SOURCE_ID, SourceTagger
from .sources import SOURCE_COLUMN, make_source
from .video_sampling import per_source_videos_kwargs

__all__ = ["PackConfig", "PackStats", "PackedDataset", "pack_dataset"]
logger = logging.getLogger("hf_packing")

_STATE_VERSION = 4  # 3: scheduled steps and cost weights; 4: video skip reasons and counters in the PackStats row
_MAX_SLOTS = 65  # rows of the shared stats table: the main process + up to 64 DataLoader workers
#: live producer threads -> their stop events (every thread registers itself; `_stop_producers` ends them at exit)
_PRODUCERS: dict[threading.Thread, threading.Event] = {}


@atexit.register
def _stop_producers(timeout: float = 30.0) -> None:
    """Stops and joins every producer thread while the interpreter is still whole.

    Why at exit: an iterator kept alive to the end (a DataLoader iterator stored on an object, a generator in a
    reference cycle) leaves its daemon producer running, possibly inside torch or PIL C++ code with the GIL released.
    When the interpreter finalises, a daemon thread that reacquires the GIL is ended by `pthread_exit`, whose unwinding
    through a C++ ``noexcept`` frame aborts the whole process ("terminate called without an active exception",
    SIGABRT) after the work is done. atexit handlers run before that, while every thread can still return normally.
    """
    for stop in list(_PRODUCERS.values()):
        stop.set()
    for thread in list(_PRODUCERS):
        if thread.is_alive():
            thread.join(timeout)


_PLAN_KEYS = (
    "max_length",
    "strategy",
    "max_images",
    "max_vision_patches",
    "buffer_size",
    "seed",
    "train_on",
    "on_overlong",
    "batch_size",
    "stopping_strategy",
    "balance_window",
    "videos_kwargs",
)  # settings a saved state must match (and the cost weights)


@dataclasses.dataclass(frozen=True)
class PackConfig:
    """The settings of [`pack_dataset`] (see there); `media_root`, `video_root`, `fps`, `videos_kwargs` and
    `row_format` are one value or `{source name: value}`."""

    max_length: int
    strategy: str
    max_images: int | None
    max_vision_patches: int | None
    buffer_size: int
    seed: int
    media_root: Any
    video_root: Any
    fps: Any
    videos_kwargs: Any
    row_format: Any
    train_on: str
    on_overlong: str
    on_error: str
    prefetch: int
    batch_size: int
    stopping_strategy: str
    max_image_pixels: int
    disable_progress: bool
    leftovers: str
    model_config: Any  # a WorkCost once the dataset is built
    balance_window: int
    length_index: Any
    index_num_proc: int | None
    source_column: str | None = None

    def preprocessors(self, processor: Any, names: list[str]) -> dict[str | None, Preprocessor]:
        """One [`Preprocessor`] per source (key `None` for a single dataset), with that source's format and roots."""
        per = {k: per_source(getattr(self, k), names, k) for k in ("media_root", "video_root", "fps")}
        videos_kwargs = per_source_videos_kwargs(self.videos_kwargs, names)
        fmt = per_source(self.row_format, names, "row_format", "auto")
        return {
            n: Preprocessor(
                processor,
                max_length=self.max_length,
                media_root=per["media_root"][n],
                video_root=per["video_root"][n],
                fps=per["fps"][n],
                videos_kwargs=videos_kwargs[n],
                row_format=fmt[n],
                train_on=self.train_on,
                on_overlong=self.on_overlong,
                max_image_pixels=self.max_image_pixels,
            )
            for n in fmt
        }


class _Replica:
    """The planner replica of (`dataset`'s rank, `worker`): reads every row, plans, assigns packs to ranks, processes
    its own. Every replica reads the same rows and makes the same decisions, so replicas agree without communicating.
    `position` is a saved [`~_Replica.position`] to resume from."""

    def __init__(self, dataset: PackedDataset, worker: int, workers: int, position: dict[str, Any] | None) -> None:
        cfg = self.cfg = dataset.cfg
        self.source, self.epoch, (self.rank, self.world) = dataset._source, dataset._epoch, dataset._rank_world()
        self.worker, self.workers = worker, workers
        self.preprocessors = cfg.preprocessors(dataset.processor, dataset._names)
        self.tag_source = dataset.source_tagger
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
        self.next_row, self.replay_until, self.replay = 0, 0, set()  # rows before replay_until: re-read, not planned
        self.stats = PackStats(dataset._names)
        self.stop = threading.Event()
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
    def run(self, put: Callable[[Any], bool] | None, *, progress: Any = None) -> None:
        """Reads the whole source. With `put=None` only plans (counts groups); else `put(("pack", samples,
        position))` for each owned pack, stopping early when `put` returns `False` or `stop` is set."""
        for row, state_after in self.source.rows(self.source_positions[self.next_row], self.epoch):
            if self.stop.is_set():
                return
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
                if packs and not self._assign_groups(packs, put):
                    return
        if not self._assign_groups(self.planner.flush(), put, final=True, spread=self.cfg.leftovers == "spread"):
            return
        self.stats.leftover_packs = len(self.unassigned)
        self.stats.leftover_samples = sum(len(p) for p in self.unassigned)
        self.stats.complete = 1
        check_yield(self.stats, groups=self.next_group, world=self.world)

    def _keep(self, index: int, row: dict[str, Any], *, count: bool) -> SampleMeta | None:
        """Holds a row for planning and returns its metadata, or `None` when it is skipped (counted if `count`)."""
        source = row.pop(SOURCE_COLUMN, None)
        if count:
            self.stats.rows[source] += 1
        try:
            meta = self.preprocessors[source].planned_meta(row, index)
        except (OverlongError, ImportError):  # a setting or a missing video decoder: no row's fault, never skipped
            raise
        except Exception as err:  # noqa: BLE001 - never end an epoch on one bad row (unless on_error="raise")
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
        cost = self.cfg.model_config.sample(meta.num_tokens, meta.vision_patches, meta.vision_sq)
        self.held[index] = (row, meta.num_tokens, source, cost)
        if count:
            self.stats.add_padded(meta.num_tokens)
            self.stats.kept[source] += 1
        return meta

    def _skip(self, err: Exception, index: int, *, source: str | None = None, planning: bool) -> None:
        """Counts a skip and logs the first of each kind: while planning by (source, reason), once per run (every
        replica plans every row); while processing by reason, on this replica."""
        known = isinstance(err, SampleError)
        reason = err.reason if known else "unexpected_error"
        counter = self.stats.planning_skips if planning else self.stats.processing_skips
        counter.record(
            reason,
            index,
            str(err) if known else f"{type(err).__name__}: {err}",
            key=(source, reason) if planning else reason,
            exc_info=None if known else err,
        )

    def _assign_groups(
        self,
        packs: list[list[int]],
        put: Callable[[Any], bool] | None,
        *,
        final: bool = False,
        spread: bool = False,
    ) -> bool:
        """Schedules each full balance window of closed packs (at the end, `final`, every full group of `world`) into
        groups of one pack per rank, then processes and `put`s this replica's. With `spread` (``leftovers="spread"``,
        at the end) the last incomplete group goes one pack per rank, in rank order, ranks past its end getting a
        1-token filler: every pack is yielded once and ranks take equal steps."""
        self.stats.planned_packs += len(packs)
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
            mine = put is not None and (self.next_group // self.cfg.batch_size) % self.workers == self.worker
            self.next_group += 1
            samples = self._process(pack) if mine else []
            for i in (i for p in group for i in p):
                self.held.pop(i, None)
            if mine:
                planner = planner or self.planner.state_dict()
                if not put(("pack", samples, self.position(planner))):
                    return False
        return True

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
            except Exception as err:  # noqa: BLE001 - never end an epoch on one bad row (unless on_error="raise")
                if self.cfg.on_error == "raise" or isinstance(err, (OverlongError, ImportError)):
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


class PackedDataset(torch.utils.data.IterableDataset):
    """The iterable of packs made by [`pack_dataset`], from its arguments (see there and the module docstring).

    Each item is a pack: a `list` of sample dicts (see [`~hf_packing.data.Preprocessor.process`]). Works with
    `torch.utils.data.DataLoader` (any `num_workers`) and torchdata's `StatefulDataLoader`.
    """

    def __init__(
        self,
        ds: Any,
        processor: Any,
        cfg: PackConfig,
        *,
        weights: Mapping[str, float] | Sequence[float] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        sequence_parallel_size: int | None = None,
    ) -> None:
        super().__init__()
        if cfg.on_error not in ("skip", "raise"):
            raise ValueError(f"on_error must be 'skip' or 'raise', got {cfg.on_error!r}")
        if cfg.leftovers not in ("drop", "spread"):
            raise ValueError(f"leftovers must be 'drop' or 'spread', got {cfg.leftovers!r}")
        if cfg.batch_size < 1 or cfg.prefetch < 1 or cfg.buffer_size < 1 or cfg.balance_window < 1:
            raise ValueError("batch_size, prefetch, buffer_size and balance_window must be >= 1")
        cost = cfg.model_config if isinstance(cfg.model_config, WorkCost) else WorkCost.from_config(cfg.model_config)
        # the formats once per source, from its own columns
        cfg = dataclasses.replace(cfg, row_format=source_formats(ds, cfg.row_format), model_config=cost)
        self.cfg, self.processor, self.rank, self.world_size = cfg, processor, rank, world_size
        self.sequence_parallel_size = sequence_parallel_size
        self.weights = dict(weights) if isinstance(weights, Mapping) else list(weights) if weights is not None else None
        names = [str(n) for n in ds] if isinstance(ds, Mapping) else []
        self.source_tagger = SourceTagger(ds, cfg.source_column)
        #: the sources samples are tagged with (``sample["source_id"]`` indexes it); empty when untagged
        self.source_names = list(self.source_tagger.names)
        pres = cfg.preprocessors(processor, names)  # validates the settings here rather than in a worker
        if isinstance(ds, Mapping):
            ds = {name: self._indexed(part, pres[str(name)]) for name, part in ds.items()}
        else:
            ds = self._indexed(ds, pres[None])
        self._source, self._names = make_source(ds, weights, cfg.seed, cfg.stopping_strategy)
        # one row per replica of this process: start and last-update times, then its PackStats row
        width = 2 + len(PackStats(self._names).to_row())
        self._shared = torch.zeros((_MAX_SLOTS, width), dtype=torch.float64).share_memory_()
        self._next_start: dict[str, Any] | None = None  # a loaded state: where the next iteration starts
        self._state: dict[str, Any] | None = None  # after the last pack yielded, or where this iteration started
        self._len: int | None = None
        self._epoch = 0
        self._eval_view: PackedDataset | None = None  # `for_evaluation`'s view, made on first use

    def _indexed(self, ds: Any, preprocessor: Preprocessor) -> Any:
        """`ds` with its length index (a `datasets.Dataset` under `length_index="auto"`, `True` or a directory), built
        by the first process of each node while the others wait, then read from its cache file by them."""
        import datasets

        mode = self.cfg.length_index
        if mode is False or not isinstance(ds, datasets.Dataset):
            return ds
        if mode not in ("auto", True) and not isinstance(mode, (str, os.PathLike)):
            raise ValueError(f"length_index must be 'auto', True, False or a directory, got {mode!r}")
        cache_dir = None if mode in ("auto", True) else mode
        dist = torch.distributed
        wait = dist.is_available() and dist.is_initialized() and (cache_dir is not None or bool(ds.cache_files))
        first = int(os.environ.get("LOCAL_RANK", dist.get_rank() if wait else 0)) == 0
        if wait and not first:
            dist.barrier()  # the node's first process builds the file; this one then reads it
        try:
            return with_length_index(
                ds,
                preprocessor,
                cache_dir=cache_dir,
                num_proc=self.cfg.index_num_proc,
                progress=not self.cfg.disable_progress and first,
            )
        finally:
            if wait and first:
                dist.barrier()

    def _rank_world(self) -> tuple[int, int]:
        if self.rank is None or self.world_size is None:
            # data-parallel rank and size: the ranks of one sequence-parallel group share every pack
            from .sequence_parallel import data_parallel_rank_world

            rank, world = data_parallel_rank_world(self.sequence_parallel_size)
            self.rank = self.rank if self.rank is not None else rank
            self.world_size = self.world_size if self.world_size is not None else world
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} must be in [0, world_size={self.world_size})")
        return self.rank, self.world_size

    def __getstate__(self) -> dict[str, Any]:
        self._rank_world()  # resolve in the main process: a spawned DataLoader worker has no process group
        return {**self.__dict__, "_state": None, "_eval_view": None}

    def for_evaluation(self) -> PackedDataset:
        """This stream as an eval set: the same packs, with its last incomplete group of ranks' packs spread one per
        rank (``leftovers="spread"``), so every sample is evaluated exactly once on any number of processes. It has its
        own counters and position, so evaluating the training set leaves the training state alone. Itself when it
        already spreads; the same view on every call otherwise (`hf_packing.prepare_trainer` evaluates through it).
        """
        if self.cfg.leftovers == "spread":
            return self
        if getattr(self, "_eval_view", None) is None:
            view = copy.copy(self)
            view.cfg = dataclasses.replace(self.cfg, leftovers="spread")
            view._shared = torch.zeros_like(self._shared).share_memory_()
            view._next_start = view._state = view._len = view._eval_view = None
            self._eval_view = view
        return self._eval_view

    def _config(self) -> dict[str, Any]:
        return {
            **{k: getattr(self.cfg, k) for k in _PLAN_KEYS},
            "cost": self.cfg.model_config.to_list(),
            "sources": list(self._names),
            "weights": self.weights,
        }

    def _header(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "config": self._config(), "epoch": self._epoch}

    def set_epoch(self, epoch: int) -> None:
        """Passes `epoch` to a `datasets.IterableDataset` source (reshuffles its shards if it was shuffled)."""
        self._epoch = int(epoch)

    # ------------------------------------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        rank, world = self._rank_world()
        info = torch.utils.data.get_worker_info()
        where = {
            "rank": rank,
            "world_size": world,
            "worker": info.id if info else 0,
            "num_workers": info.num_workers if info else 1,
        }
        start, self._next_start = self._next_start, None
        position = start.get("position") if start else None
        for key, value in where.items() if position is not None else ():
            if start[key] != value:
                raise ValueError(
                    f"state was saved with {key}={start[key]} but this run has {key}={value}; resume "
                    f"with the same {key} (DataLoader num_workers, torch.distributed world)"
                )
        replica = _Replica(self, where["worker"], where["num_workers"], position)
        self._state = start  # now, not at the first next(): state_dict() right after iter() describes this pass
        return self._iterate(replica, position, where, in_worker=info is not None)

    def _iterate(
        self,
        replica: _Replica,
        start: dict[str, Any] | None,
        where: dict[str, int],
        *,
        in_worker: bool,
    ) -> Iterator[list[dict[str, Any]]]:
        items: queue.Queue = queue.Queue(maxsize=self.cfg.prefetch)

        def put(item: Any) -> bool:
            while not replica.stop.is_set():
                try:
                    items.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    pass
            return False

        def produce() -> None:
            if not in_worker and "parallel backend: OpenMP" in torch.__config__.parallel_info():
                torch.set_num_threads(1)  # per thread under OpenMP: small image ops stay off training's cores
            try:
                replica.run(put)
                put(("done", replica.stats.to_row()))
            except BaseException as err:  # noqa: BLE001 - re-raised in the consumer
                put(("error", err))
            finally:
                _PRODUCERS.pop(threading.current_thread(), None)

        thread = threading.Thread(target=produce, name=f"hf_packing-r{replica.rank}w{replica.worker}", daemon=True)
        _PRODUCERS[thread] = replica.stop
        slot = replica.worker + 1 if in_worker else 0
        self._shared[slot] = 0
        self._shared[slot, 0] = time.time()
        if start is not None:
            self._publish(slot, start["stats"])
        thread.start()
        try:
            while True:
                try:
                    kind, *payload = items.get(timeout=1.0)
                except queue.Empty:
                    if not thread.is_alive():
                        raise RuntimeError("the hf_packing producer thread ended without a result") from None
                    continue
                if kind == "error":
                    raise payload[0]
                if kind == "done":
                    self._publish(slot, payload[0])
                    if not in_worker:
                        self._len = replica.next_group
                    if replica.rank == 0 and replica.worker == 0:
                        self.stats(log=True)
                    return
                samples, position = payload
                self._publish(slot, position["stats"])
                self._state = {**self._header(), **where, "position": position}
                yield samples
        finally:  # the iterator was exhausted, closed or garbage-collected: the thread ends with it
            replica.stop.set()
            thread.join(timeout=30)

    def _publish(self, slot: int, stats_row: list[int]) -> None:
        self._shared[slot, 1] = time.time()
        self._shared[slot, 2:] = torch.tensor(stats_row, dtype=torch.float64)

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The state after the last pack yielded to the consumer (not merely produced), as plain Python data: loaded
        into a new `pack_dataset(...)` with the same settings, rank, world size and worker count, it yields exactly the
        packs that would have followed (see the module docstring, 5.)."""
        return self._state or self._next_start or {**self._header(), "position": None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a [`~PackedDataset.state_dict`]; the next iteration continues after its last yielded pack."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"unsupported pack_dataset state version {state.get('version')!r} (this version reads {_STATE_VERSION})"
            )
        ours = self._config()
        for key, value in state["config"].items():
            if ours.get(key) != value:
                raise ValueError(
                    f"state was saved with {key}={value!r} but this dataset has {key}={ours.get(key)!r}; "
                    f"pass {key}={value!r} to pack_dataset to resume"
                )
        self._next_start, self._state, self._epoch = dict(state), None, int(state.get("epoch", 0))

    # ------------------------------------------------------------------------------------------------ stats
    def stats(self, log: bool = True) -> dict[str, Any]:
        """Statistics of the current or last pass on this rank, summed over this process's DataLoader workers.

        Returns:
            `dict`: `packs`, `samples`, `tokens` yielded; `fill` (tokens / (packs · max_length));
            `padded_batch_fill` / `padding_ratio_padded_batches` (the same samples in padded batches of 8, in input
            order: what a padded Trainer run would use);
            `packs_per_s`, `samples_per_s`; `images_per_pack`; `videos` and `video_tokens` (their `<|video_pad|>`
            tokens) yielded; `skipped` (reason → count, `overlong` included),
            split into `skipped_while_planning` (the same on every rank: count it once) and
            `skipped_while_processing` (this rank's pixel-time failures: sum over ranks);
            `rows_read`, `planned_packs` (all ranks), `leftover_packs` / `leftover_samples` (the last incomplete
            group of `world_size` packs, yielded by no rank); `complete`; `per_source` (`{name: {rows, samples}}`).
        """
        table = self._shared.numpy().copy()
        used = table[table[:, 0] > 0]
        used = used if len(used) else table[:1]
        stats = PackStats.merge(self._names, used[:, 2:])
        packs, samples, tokens = stats.packs, sum(stats.samples.values()), stats.tokens
        elapsed = max(float(used[:, 1].max() - used[:, 0].min()), 1e-9)
        planning: Counter = Counter()
        for (_, reason), n in stats.planning_skips.items():
            planning[reason] += n

        def by_reason(counter: Counter) -> dict[str, int]:
            return {reason: counter[reason] for reason in REASONS if counter[reason]}

        slots = stats.padded_slots + stats.batch_rows * stats.batch_longest
        padded = stats.padded_tokens / slots if slots else 1.0
        out = {
            "packs": packs,
            "samples": samples,
            "tokens": tokens,
            "fill": tokens / (packs * self.cfg.max_length) if packs else 0.0,
            "padded_batch_fill": padded,
            "padding_ratio_padded_batches": 1.0 - padded,
            "packs_per_s": packs / elapsed,
            "samples_per_s": samples / elapsed,
            "images_per_pack": stats.images / packs if packs else 0.0,
            "videos": stats.videos,
            "video_tokens": stats.video_tokens,
            "skipped": by_reason(planning + stats.processing_skips),
            "skipped_while_planning": by_reason(planning),
            "skipped_while_processing": by_reason(stats.processing_skips),
            "rows_read": sum(stats.rows.values()),
            "planned_packs": stats.planned_packs,
            "leftover_packs": stats.leftover_packs,
            "leftover_samples": stats.leftover_samples,
            "complete": bool(stats.complete),
            "per_source": {n: {"rows": stats.rows[n], "samples": stats.samples[n]} for n in self._names},
        }
        if log:
            logger.info(
                "pack_dataset rank %s: %d packs, %d samples, fill %.4f (padded batches of %d: %.4f), %.1f "
                "samples/s, %.2f images/pack, %d videos (%d tokens), skipped %s, %d packs left over",
                self.rank,
                packs,
                samples,
                out["fill"],
                PADDED_BATCH,
                padded,
                out["samples_per_s"],
                out["images_per_pack"],
                out["videos"],
                out["video_tokens"],
                out["skipped"] or "none",
                out["leftover_packs"],
            )
        return out

    def count_packs(self, *, disable_progress: bool | None = None) -> int:
        """Plans the whole source here from metadata (no pixels; tqdm bar on rank 0) and returns the packs per rank;
        afterwards `len()` works. Costs one metadata pass (see the module docstring for what a row costs)."""
        from tqdm.auto import tqdm

        replica = _Replica(self, 0, 1, None)
        disable = self.cfg.disable_progress if disable_progress is None else disable_progress
        with tqdm(
            total=self._source.size,
            desc="hf_packing: planning",
            unit=" rows",
            disable=disable or replica.rank != 0 or not sys.stderr.isatty(),
        ) as bar:
            replica.run(None, progress=bar)
        self._len = replica.next_group
        return self._len

    def __len__(self) -> int:
        if self._len is None:
            raise TypeError(
                "the number of packs is unknown until planned: call count_packs() (a metadata-only pass) "
                "or set max_steps"
            )
        return self._len


def pack_dataset(
    ds: Any,
    processor: Any,
    *,
    max_length: int = 8192,
    strategy: str = "bfd",
    max_images: int | None = 16,
    max_vision_patches: int | None = 65536,
    buffer_size: int = 1000,
    seed: int = 0,
    weights: Mapping[str, float] | Sequence[float] | None = None,
    media_root: str | os.PathLike | Mapping[str, str | os.PathLike] | None = None,
    video_root: str | os.PathLike | Mapping[str, str | os.PathLike] | None = None,
    fps: float | Mapping[str, float] | None = None,
    videos_kwargs: Mapping[str, Any] | None = None,
    row_format: str | Mapping[str, str] = "auto",
    image_root: str | os.PathLike | None = None,
    train_on: str = "assistant",
    on_overlong: str = "drop",
    on_error: str = "skip",
    rank: int | None = None,
    world_size: int | None = None,
    prefetch: int = 4,
    batch_size: int = 1,
    stopping_strategy: str = "first_exhausted",
    max_image_pixels: int = MAX_IMAGE_PIXELS,
    disable_progress: bool = False,
    leftovers: str = "drop",
    model_config: Any = None,
    balance_window: int = 16,
    length_index: bool | str | os.PathLike = "auto",
    index_num_proc: int | None = None,
    sequence_parallel_size: int | None = None,
    source_column: str | None = None,
) -> PackedDataset:
    """Streams packs of processed multimodal samples: rank-equal, the same for any `num_workers`, resumable.

    Args:
        ds (`datasets.Dataset`, `datasets.IterableDataset`, or a `dict` of them): HF-messages or LLaVA rows (see the
            README's "Row formats"). A dict is mixed with `datasets.interleave_datasets`, counting rows and samples
            per source; each source keeps its own format. Rows are not shuffled here: shuffle `ds` first.
        processor: the model's processor (Qwen2-VL, Qwen2.5-VL and Qwen3-VL families).
        max_length (`int`, defaults to 8192): token budget per pack.
        strategy (`str`, defaults to `"bfd"`): one of `hf_packing.planner.STRATEGIES` (see `hf_packing/planner.py`).
        max_images (`int`, *optional*, defaults to 16): images per pack; a sample with more is skipped.
        max_vision_patches (`int`, *optional*, defaults to 65536): Σ t·h·w per pack (bounds the vision tower's memory).
        buffer_size (`int`, defaults to 1000): planner window (memory ≈ window + open packs, in rows).
        seed (`int`, defaults to 0): mixing seed.
        weights (`dict` or `list`, *optional*): sampling probabilities of a dict `ds`'s sources.
        media_root (`str` or `dict`, *optional*): root of relative image and video paths, one for all sources or
            `{source: root}`; a path escaping it (`..`, absolute, symlink) is refused (`"path_outside_root"`). Without
            it paths are used as given. `image_root` is its former name (one root).
        video_root (`str` or `dict`, *optional*): root of relative video (frame) paths where it is not `media_root`.
        fps (`float` or `dict`, *optional*): sampling rate of pre-sampled video frames, one or `{source: fps}`; a
            row's own `fps` wins. It reaches the processor as `video_metadata` (Qwen2.5-VL `second_per_grid_ts`,
            Qwen3-VL timestamps); without it the processor assumes 24 fps (wrong for sparse frames). A video file's
            rate is read from its header.
        videos_kwargs (`dict`, *optional*): how video files are sampled and resized, in the video processors' names:
            `fps` (frames per second of video; default the processor's, else 2.0) or `num_frames`, `min_frames`,
            `max_frames`, `min_pixels`, `max_pixels` (per video, the processor's `size`), `do_sample_frames`; one
            dict for all sources or `{source: dict}`. See `hf_packing/video_sampling.py`.
        row_format (`str` or `dict`, defaults to `"auto"`): `"messages"`, `"llava"` or `"auto"` (detected from each
            source's own columns), one or `{source: format}`.
        train_on (`str`, defaults to `"assistant"`): supervise each assistant turn's content and its `<|im_end|>`, or
            `"all"` text. Vision tokens (pads, `<|vision_start|>` / `<|vision_end|>`, video timestamps) never are.
        on_overlong (`str`, defaults to `"drop"`): `"drop"` (reason `"overlong"`), `"error"` (raise) or
            `"truncate_text"`: keep the first `max_length` tokens if every vision span ends inside them, else drop
            (reason `"overlong_vision"`); an image is never cut.
        on_error (`str`, defaults to `"skip"`): skip bad rows and count them by reason, or `"raise"`.
        rank, world_size (`int`, *optional*): the data-parallel rank and size; default to torch.distributed's
            rank and world size divided by `sequence_parallel_size` if initialized, else 0 and 1. With a process
            group every rank must call `pack_dataset` (the length index build waits at a barrier).
        prefetch (`int`, defaults to 4): packs the producer thread may run ahead of the consumer.
        batch_size (`int`, defaults to 1): the DataLoader's batch size in packs; workers take packs in blocks of it so
            batches do not depend on `num_workers`.
        stopping_strategy (`str`, defaults to `"first_exhausted"`): when mixing (`"all_exhausted"` oversamples).
        max_image_pixels (`int`, defaults to 89,478,485): images larger than this (by header) are skipped before
            anything is decoded; PIL's decompression-bomb limit applies too.
        disable_progress (`bool`, defaults to `False`): no tqdm bar for planning passes.
        leftovers (`str`, defaults to `"drop"`): the last group of fewer than `world_size` packs: `"drop"` leaves it
            over (counted in `stats()`); `"spread"` gives it one pack per rank and the remaining ranks a 1-token
            unsupervised filler, so each pack is yielded exactly once: use it for eval sets.
        model_config (`PretrainedConfig` or [`~hf_packing.balance.WorkCost`], *optional*): the model's config
            (`model.config`), which weighs a pack's text and vision work for rank balance; Qwen2.5-VL-7B's without it.
            Pass `WorkCost.from_config(model.config, vision_trainable=False)` for a frozen vision tower.
        balance_window (`int`, defaults to 16): steps (of `world_size · batch_size` packs) sorted by cost together, so
            each step holds packs of similar cost (with 64 ranks the slowest rank's excess drops from 4-12% to
            0.2-1.5%, `benchmarks/RESULTS.md`). A replica holds that many steps' packs' rows (with 64 ranks, ~12k
            LLaVA rows: metadata only for an indexed `datasets.Dataset`, whole rows from a stream: lower it for
            streams that embed image bytes).
        length_index (`"auto"`, `bool` or `str`, defaults to `"auto"`): for a `datasets.Dataset` (or a mix's
            map-style sources), estimate every row once into cached columns ([`~hf_packing.length_index`]; next to
            the dataset's cache files, or in the directory given here) that every worker of every rank plans from;
            the first process of each node builds it, the others wait and read the file. `False`: every replica
            estimates every row. Streaming sources always estimate as they read.
        index_num_proc (`int`, *optional*): processes building the index (default: 1 below 20,000 rows, else the
            usable cores, at most 32).
        sequence_parallel_size (`int`, *optional*): ranks that split one pack (`apply_rmpad`'s
            `sequence_parallel_size`, its default): consecutive ranks `[d·P, (d+1)·P)` get the same packs.
        source_column (`str`, *optional*): the column naming each row's source, for per-source loss and accuracy
            (a dict `ds` is tagged by its keys without it); see `hf_packing/source_ids.py`.

    Returns:
        [`PackedDataset`]: a `torch.utils.data.IterableDataset` of packs with `state_dict()`, `load_state_dict()`,
        `stats()`, `count_packs()`, and `len()` once counted. Each sample also carries `index`, its position in the
        (mixed) input stream, and, from a mix or with `source_column`, `source_id` (into `source_names`). A pass in
        which a source that had rows kept none of them, or no rank got a pack, ends with
        [`~hf_packing.pack_stats.NoSamplesError`] naming the source and its top skip reasons.

    Example:

    ```python
    >>> train = pack_dataset({"llava": llava, "video": clips}, processor, max_length=8192,
    ...                      weights={"llava": 3, "video": 1}, fps={"video": 2.0},
    ...                      media_root={"llava": "/data/llava", "video": "/data/frames"})
    >>> loader = DataLoader(train, batch_size=1, num_workers=4, collate_fn=VisionCollator(processor))
    ```
    """
    settings = dict(locals())  # first: only the arguments
    if image_root is not None and media_root is not None:
        raise ValueError("image_root is the former name of media_root: pass one of them")
    settings["media_root"] = image_root if media_root is None else media_root
    cfg = PackConfig(**{field.name: settings[field.name] for field in dataclasses.fields(PackConfig)})
    return PackedDataset(
        ds,
        processor,
        cfg,
        weights=weights,
        rank=rank,
        world_size=world_size,
        sequence_parallel_size=sequence_parallel_size,
    )
