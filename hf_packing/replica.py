"""One planner replica per (rank, DataLoader worker): read rows, estimate, plan, assign packs to ranks, process own.

Pure Python over a row source and a [`~hf_packing.data.Preprocessor`]; `pack_dataset` runs it in a producer thread.
Every replica reads the same rows and makes the same decisions, so replicas agree without communicating.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .data import META_COLUMNS, REASONS, OverlongError, Preprocessor, SampleError, SampleMeta, SkipCounter
from .formats import check_yield, per_source
from .planner import StreamingPlanner
from .sources import SOURCE_COLUMN

__all__ = ["ATTENTION_TOKENS", "SKIPS", "PackConfig", "Replica", "Window"]

ATTENTION_TOKENS = 65_536  # a sample of n tokens costs n + n**2 // ATTENTION_TOKENS (dense + attention FLOPs)
SKIPS = (*REASONS, "too_many_images", "too_many_vision_patches", "empty_pack", "unexpected_error")


@dataclass(frozen=True)
class PackConfig:
    """The settings of [`~hf_packing.stream.pack_dataset`] (see there)."""

    max_length: int = 8192
    strategy: str = "bfd"
    max_images: int | None = 16
    max_vision_patches: int | None = 65536
    buffer_size: int = 1000
    seed: int = 0
    media_root: Any = None  # per source: one value, or {source name: value}
    video_root: Any = None
    fps: Any = None
    row_format: Any = "auto"
    train_on: str = "assistant"
    on_overlong: str = "drop"
    on_error: str = "skip"
    prefetch: int = 4
    batch_size: int = 1
    stopping_strategy: str = "first_exhausted"
    max_image_pixels: int = 89_478_485
    disable_progress: bool = False
    leftovers: str = "drop"

    def preprocessors(self, processor: Any, names: list[str]) -> dict[str | None, Preprocessor]:
        """One [`Preprocessor`] per source (key `None` for a single dataset), with that source's format and roots."""
        per = {k: per_source(getattr(self, k), names, k) for k in ("media_root", "video_root", "fps")}
        fmt = per_source(self.row_format, names, "row_format", "auto")
        return {n: Preprocessor(processor, max_length=self.max_length, media_root=per["media_root"][n],
                                video_root=per["video_root"][n], fps=per["fps"][n], row_format=fmt[n],
                                train_on=self.train_on, on_overlong=self.on_overlong,
                                max_image_pixels=self.max_image_pixels) for n in fmt}


class Window:
    """What a resume needs that changes only when the planner closes packs; shared by that window's snapshots."""

    __slots__ = ("planner", "next_seq", "s0", "source_state", "packs", "counters")

    def __init__(self, *, planner: dict[str, Any] | None = None, next_seq: int = 0, s0: int = 0,
                 source_state: Any = None, packs: list[list[int]] | None = None,
                 counters: dict[str, Any] | None = None) -> None:
        self.planner, self.next_seq, self.s0, self.source_state = planner, next_seq, s0, source_state
        self.packs, self.counters = packs or [], counters or {}


class Replica:
    """The planner replica of (`rank`, `worker`); `run(put)` hands its own processed packs to `put`.

    Args:
        cfg ([`PackConfig`]): settings. processor: the model's processor. source: a row source (`sources.py`).
        names (`list[str]`): the sources of a mix (empty for one dataset). epoch (`int`): passed to the source.
        rank, world, worker, workers (`int`): who this replica serves.
        resume (`dict`, *optional*): the `position` of a `PackedDataset.state_dict()`.
        log (`bool`): log the first skip of each reason found while planning (one replica per run should).
    """

    def __init__(self, cfg: PackConfig, processor: Any, source: Any, *, names: list[str], epoch: int, rank: int,
                 world: int, worker: int, workers: int, resume: dict[str, Any] | None = None, log: bool = True) -> None:
        self.cfg, self.source, self.names, self.epoch = cfg, source, names, epoch
        self.rank, self.world, self.worker, self.workers = rank, world, worker, workers
        self.pres = cfg.preprocessors(processor, names)
        self.pre = next(iter(self.pres.values()))
        self.check_yield = True  # off when resuming a state saved before sources' kept rows were counted
        self.planner = StreamingPlanner(max_length=cfg.max_length, strategy=cfg.strategy, max_images=cfg.max_images,
                                        max_vision_patches=cfg.max_vision_patches, buffer_size=cfg.buffer_size)
        self.rows: dict[int, tuple[dict[str, Any], int | None, str | None]] = {}  # seq -> (row, planned tokens, source)
        self.unassigned: list[list[int]] = []  # closed packs waiting for a full group of `world`
        self.next_group, self.costs = 0, [0] * world
        self.src_states: dict[int, Any] = {0: None}  # seq -> source position before that row (seq >= oldest kept)
        self.g: Counter = Counter()  # identical on every replica: rows, rows/<source>, packs, leftovers, done
        self.meta_skips, self.proc_skips = SkipCounter(log=log), SkipCounter()
        self.mine: Counter = Counter()  # this replica's yielded work: packs, samples, tokens, images, pad_slots
        self.seq, self.resume_until, self.needed = 0, 0, set()
        self.stop = threading.Event()
        if resume is not None:
            self._restore(resume)

    def _restore(self, st: dict[str, Any]) -> None:
        self.planner.load_state_dict(st["planner"])
        self.unassigned = [list(p) for p in st["unassigned"]]
        self.next_group, self.costs = int(st["next_group"]), [int(c) for c in st["costs"]]
        self.seq, self.resume_until = int(st["source"]["s0"]), int(st["source"]["next_seq"])
        self.src_states = {self.seq: st["source"]["state"]}
        counters = st["counters"]
        self.g, self.mine = Counter(counters["global"]), Counter(counters["mine"])
        self.check_yield = "kept" in self.g
        self.meta_skips.update(counters["meta_skips"])
        self.proc_skips.update(counters["proc_skips"])
        self.needed = {int(i) for b in st["planner"]["open_bins"] for i in b[1]}
        self.needed |= {int(i) for p in self.unassigned for i in p} | set(st["planner"]["pending"]["indices"])

    def snapshot(self, window: Window, offset: int) -> dict[str, Any]:
        """The state right after the group ending at `window.packs[offset]` was assigned (cheap: no copies of bins)."""
        return {"window": window, "offset": offset, "next_group": self.next_group, "costs": list(self.costs),
                "mine": dict(self.mine), "proc_skips": dict(self.proc_skips)}

    def counters(self) -> Window:
        return Window(counters={"global": dict(self.g), "meta_skips": dict(self.meta_skips)})

    # ------------------------------------------------------------------------------------------------ main loop
    def run(self, put: Callable[[Any], bool] | None, *, progress: Any = None) -> None:
        """Reads the whole source. With `put=None` only plans (counts groups); else `put(("pack", samples,
        snapshot))` for each owned pack, stopping early when `put` returns `False` or `stop` is set."""
        for row, state_after in self.source.rows(self.src_states[self.seq], self.epoch):
            if self.stop.is_set():
                return
            i, self.seq = self.seq, self.seq + 1
            self.src_states[self.seq] = state_after
            if not self.seq % 4096:  # bounded even when rows keep being skipped and no pack closes
                self._prune()
            if progress is not None:
                progress.update(1)
            if i < self.resume_until:  # re-reading the rows a resumed planner still holds
                if i in self.needed:
                    self._keep(i, row, count=False)
                continue
            meta = self._keep(i, row, count=True)
            if meta is not None:
                packs = self.planner.add(i, meta.num_tokens, meta.num_images, meta.vision_patches)
                if packs and not self._emit(packs, put):
                    return
        if not self._emit(self.planner.flush(), put):
            return
        if self.cfg.leftovers == "spread" and self.unassigned:
            self._spread(put)
        self.g["leftover_packs"] = len(self.unassigned)
        self.g["leftover_samples"] = sum(len(p) for p in self.unassigned)
        self.g["done"] = 1
        if self.check_yield:
            check_yield(self.g, self.names, groups=self.next_group, world=self.world)

    def _keep(self, i: int, row: dict[str, Any], *, count: bool) -> Any:
        source = row.pop(SOURCE_COLUMN, None)
        if count:
            self.g["rows"] += 1
            if source is not None:
                self.g[f"rows/{source}"] += 1
        try:
            meta = self._meta(self.pres[source], row, i)
        except OverlongError:
            raise
        except Exception as err:  # noqa: BLE001 - never end an epoch on one bad row (unless on_error="raise")
            if self.cfg.on_error == "raise":
                raise
            if count:
                self._skip_planned(err, i, source)
            else:  # planned before, failing now on resume: processing reports it
                self.rows[i] = (row, None, source)
            return None
        for reason, value, limit, name in (("too_many_images", meta.num_images, self.cfg.max_images, "max_images"),
                                           ("too_many_vision_patches", meta.vision_patches,
                                            self.cfg.max_vision_patches, "max_vision_patches")):
            if limit is not None and value > limit:
                if count:
                    self._skip_planned(SampleError(reason, f"{value:,} > {name}={limit:,}; raise {name}"), i, source)
                return None
        self.rows[i] = (row, meta.num_tokens, source)
        if count:
            self._padded_baseline(meta.num_tokens)
            self.g.update(["kept"] if source is None else ["kept", f"kept/{source}"])
        return meta

    def _skip_planned(self, err: Exception, i: int, source: str | None) -> None:
        """Counted once per run (every replica plans every row), by reason and by source (see `check_yield`)."""
        self._skip(self.meta_skips, err, i)
        reason = err.reason if isinstance(err, SampleError) else "unexpected_error"
        self.g[f"skips/{reason}" if source is None else f"skips/{source}/{reason}"] += 1

    def _padded_baseline(self, n: int) -> None:
        """Slots that padded batches of 8 would use for the same samples in input order (what a plain padded
        Trainer run sees), kept as integers in the global counters so it resumes with them."""
        g = self.g
        g["in_tokens"] += n
        g["in_batch_n"] += 1
        g["in_batch_max"] = max(g["in_batch_max"], n)
        if g["in_batch_n"] == 8:
            g["in_pad_slots"] += 8 * g["in_batch_max"]
            g["in_batch_n"] = g["in_batch_max"] = 0

    def _meta(self, pre: Preprocessor, row: dict[str, Any], i: int) -> SampleMeta:
        """From precomputed [`META_COLUMNS`] when the row has them (see `Preprocessor.metadata_columns`)."""
        if META_COLUMNS[0] not in row:
            return pre.estimate(row, i)
        tokens, images, patches, skip = (row[c] for c in META_COLUMNS)
        if skip:
            raise SampleError(skip, f"refused when the metadata columns were computed ({skip})")
        if tokens > self.cfg.max_length:  # compute the columns with max_length=None; on_overlong applies here (a
            # truncate_text cut through an image is only found when processing: reason "overlong_vision" then)
            tokens = pre._truncate(i, np.array([tokens]), np.zeros(1, bool), np.ones(1, bool))
        return SampleMeta(tokens, images, patches)

    def _emit(self, packs: list[list[int]], put: Callable[[Any], bool] | None) -> bool:
        self.g["packs"] += len(packs)
        self.unassigned.extend(packs)
        if len(self.unassigned) < self.world:
            return True
        window = self._window() if put is not None else None
        offset = 0
        while len(self.unassigned) - offset >= self.world:
            group, offset = self.unassigned[offset : offset + self.world], offset + self.world
            q, pack = self.next_group, self._assign(group)
            self.next_group += 1
            if put is not None and (q // self.cfg.batch_size) % self.workers == self.worker:
                samples = self._process(pack)
                if not put(("pack", samples, self.snapshot(window, offset))):
                    return False
            for p in group:
                for i in p:
                    self.rows.pop(i, None)
        self.unassigned = self.unassigned[offset:]
        return True

    def _window(self) -> Window:
        s0 = self._prune()
        return Window(planner=self.planner.state_dict(), next_seq=self.seq, s0=s0, source_state=self.src_states[s0],
                      packs=self.unassigned, counters={"global": dict(self.g), "meta_skips": dict(self.meta_skips)})

    def _spread(self, put: Callable[[Any], bool] | None) -> None:
        """``leftovers="spread"``: the last incomplete group goes one pack per rank, in rank order; ranks past its end
        get an unsupervised 1-token filler. Every pack is yielded once and all ranks still take equal steps."""
        window, group = (self._window() if put is not None else None), self.unassigned
        q = self.next_group
        self.next_group += 1
        if put is not None and (q // self.cfg.batch_size) % self.workers == self.worker:
            if self.rank < len(group):
                samples = self._process(group[self.rank])
            else:
                samples = [self._filler()]
                self.mine.update(packs=1, tokens=1)
            if not put(("pack", samples, self.snapshot(window, len(group)))):
                return
        self.unassigned = []

    def _filler(self) -> dict[str, Any]:
        """A 1-token sample without targets: a pack that keeps ranks in step and adds nothing to the loss."""
        one = torch.ones(1, dtype=torch.long)
        return {"input_ids": one * (self.pre.tokenizer.pad_token_id or 0), "labels": one * -100,
                "attention_mask": one, "mm_token_type_ids": one * 0, "num_tokens": 1, "index": -1}

    def _prune(self) -> int:
        """Drops source positions older than the oldest row still held; returns that row's seq."""
        s0 = next(iter(self.rows), self.seq)  # rows are kept in seq order
        for k in [k for k in self.src_states if k < s0]:
            del self.src_states[k]
        return s0

    @staticmethod
    def _skip(counter: SkipCounter, err: Exception, i: int) -> None:
        if isinstance(err, SampleError):
            counter.record(err.reason, i, str(err))
        else:
            counter.record("unexpected_error", i, f"{type(err).__name__}: {err}", exc_info=err)

    def _assign(self, group: list[list[int]]) -> list[int]:
        """One pack per rank: the costliest pack to the rank with the least cumulative cost (ties: lower index)."""
        cost = [sum(n + n * n // ATTENTION_TOKENS for n in (self.rows[i][1] or 0 for i in p)) for p in group]
        packs = sorted(range(len(group)), key=lambda k: (-cost[k], k))
        ranks = sorted(range(self.world), key=lambda r: (self.costs[r], r))
        for k, r in zip(packs, ranks, strict=True):
            self.costs[r] += cost[k]
        low = min(self.costs)
        self.costs = [c - low for c in self.costs]
        return group[packs[ranks.index(self.rank)]]

    def _process(self, pack: list[int]) -> list[dict[str, Any]]:
        samples = []
        for i in pack:
            row, planned, source = self.rows[i]
            try:
                sample = self.pres[source].process(self.source.fetch(i) if self.source.lazy else row, i,
                                                   planned_tokens=planned)
            except Exception as err:  # noqa: BLE001 - never end an epoch on one bad row (unless on_error="raise")
                if self.cfg.on_error == "raise" or isinstance(err, OverlongError):
                    raise
                self._skip(self.proc_skips, err, i)
                continue
            samples.append(sample)
            if source is not None:
                self.mine[f"samples/{source}"] += 1
        if not samples:  # every sample failed to decode: keep ranks in step with a 1-token, unsupervised filler
            self.proc_skips["empty_pack"] += 1
            samples = [self._filler()]
        lengths = [s["num_tokens"] for s in samples]
        self.mine.update(packs=1, samples=len(samples), tokens=sum(lengths),
                         images=sum(len(s["image_grid_thw"]) for s in samples if "image_grid_thw" in s))
        return samples
