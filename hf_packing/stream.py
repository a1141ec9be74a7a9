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
   one's tokens / images / patches from text and image headers ([`~hf_packing.data.Preprocessor.estimate`]) and
   feeds the same deterministic [`~hf_packing.planner.StreamingPlanner`] (windows of `buffer_size`), so all replicas
   see the same global sequence of packs. BFD over a 1,000-sample window loses < 0.05% fill against whole-dataset.
2. **Ranks.** Consecutive packs form groups of `world_size`; each rank gets exactly one pack per group, the most
   expensive pack to the rank with the least cumulative cost, where a pack costs Σ (n + n² // 65,536) over its
   samples' lengths n (dense FLOPs ∝ n, attention ∝ n²; the two are equal near n ≈ N / (layers · hidden), ~65k for
   a 7B model). Every rank yields exactly as many packs as the others whatever the shard sizes; a final incomplete
   group is left over and counted in `stats()` (never silently lost), or, with `leftovers="spread"` (for eval sets,
   where every sample must count once), handed out one pack per rank, ranks past its end getting a 1-token
   unsupervised filler.
3. **Workers.** DataLoader worker w of W takes the rank's packs j with (j // batch_size) % W == w; the DataLoader
   interleaves workers round-robin, so the batches are the same, in the same order, for any `num_workers`. Only a
   worker's own packs get pixel processing ([`~hf_packing.data.Preprocessor.process`]), which checks the processed
   length against the planned one.
4. **Producer thread.** Reading, planning and pixel work run in a background thread (torch ops single-threaded
   there) feeding a queue of `prefetch` packs; its exceptions re-raise in the consumer; it stops when the iterator
   is closed or garbage-collected. A bad row is skipped and counted, never fatal (unless `on_error="raise"`).
5. **Resume.** `state_dict()` is the state after the last pack *yielded*: the planner's open packs, the packs
   planned but not yet assigned, the rank costs, the counters, and the source position (`datasets` state_dict or a
   row number) of the oldest row still held plus the row where planning continues. Loading it re-reads only that
   span (typically a few windows) and continues with exactly the packs of an uninterrupted run.

The price of agreeing without communication is that every replica plans every row: per rank, W · N estimates
against N / R pixel jobs. Measured on 2 busy cores with the tiny processors and 256-1024 px JPEGs: an estimate
costs 0.4-1 ms per row, a processed sample ~8-15 ms. Past a few ranks, compute the lengths once instead:
`ds.map(Preprocessor(...).metadata_columns, with_indices=True, num_proc=...)`; planning then reads those columns
only (~120k rows/s for a `datasets.Dataset`), and stale values are caught when a sample is processed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from .formats import source_formats
from .replica import SKIPS, PackConfig, Replica
from .sources import make_source

__all__ = ["PackConfig", "PackedDataset", "pack_dataset"]
logger = logging.getLogger("hf_packing")

_STATE_VERSION = 1
_MAX_SLOTS = 65  # rows of the shared stats table: the main process + up to 64 DataLoader workers
_PLAN_KEYS = ("max_length", "strategy", "max_images", "max_vision_patches", "buffer_size", "seed", "train_on",
              "on_overlong", "batch_size", "stopping_strategy")  # settings a saved state must match


class PackedDataset(torch.utils.data.IterableDataset):
    """The iterable of packs made by [`pack_dataset`] (see the module docstring for the design).

    Each item is a pack: a `list` of sample dicts (see [`~hf_packing.data.Preprocessor.process`]). Works with
    `torch.utils.data.DataLoader` (any `num_workers`) and torchdata's `StatefulDataLoader`.

    Args:
        ds: rows (see [`pack_dataset`]). processor: the model's processor. cfg ([`PackConfig`]): the settings.
        weights (*optional*): mixing weights. rank, world_size (`int`, *optional*): default to torch.distributed.
    """

    def __init__(self, ds: Any, processor: Any, cfg: PackConfig, *, weights: Mapping[str, float] | Sequence[float] | None
                 = None, rank: int | None = None, world_size: int | None = None) -> None:
        super().__init__()
        if cfg.on_error not in ("skip", "raise"):
            raise ValueError(f"on_error must be 'skip' or 'raise', got {cfg.on_error!r}")
        if cfg.leftovers not in ("drop", "spread"):
            raise ValueError(f"leftovers must be 'drop' or 'spread', got {cfg.leftovers!r}")
        if cfg.batch_size < 1 or cfg.prefetch < 1 or cfg.buffer_size < 1:
            raise ValueError("batch_size, prefetch and buffer_size must be >= 1")
        cfg = dataclasses.replace(cfg, row_format=source_formats(ds, cfg.row_format))  # once per source, own columns
        self.cfg, self.processor, self.rank, self.world_size = cfg, processor, rank, world_size
        self.weights = dict(weights) if isinstance(weights, Mapping) else list(weights) if weights is not None else None
        self._source, self._names = make_source(ds, weights, cfg.seed, cfg.stopping_strategy)
        cfg.preprocessors(processor, self._names)  # validates the settings here rather than in a worker
        self._fields = ["rows", "packs", "leftover_packs", "leftover_samples", "done", "packs_yielded", "samples",
                        "tokens", "images", "in_tokens", "in_pad_slots", "in_batch_n", "in_batch_max", "t0", "t1"]
        self._fields += [f"{k}/{n}" for k in ("rows", "samples") for n in self._names]
        self._fields += [f"{k}/{r}" for k in ("skip", "pskip") for r in SKIPS]
        self._col = {name: k for k, name in enumerate(self._fields)}
        self._shared = torch.zeros((_MAX_SLOTS, len(self._fields)), dtype=torch.float64).share_memory_()
        self._resume: dict[str, Any] | None = None
        self._live: dict[str, Any] | None = None
        self._len: int | None = None
        self._epoch = 0

    def _rank_world(self) -> tuple[int, int]:
        if self.rank is None or self.world_size is None:
            dist = torch.distributed
            on = dist.is_available() and dist.is_initialized()
            self.rank = self.rank if self.rank is not None else dist.get_rank() if on else 0
            self.world_size = self.world_size if self.world_size is not None else dist.get_world_size() if on else 1
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} must be in [0, world_size={self.world_size})")
        return self.rank, self.world_size

    def __getstate__(self) -> dict[str, Any]:
        self._rank_world()  # resolve in the main process: a spawned DataLoader worker has no process group
        return {**self.__dict__, "_live": None}

    def _config(self) -> dict[str, Any]:
        return {**{k: getattr(self.cfg, k) for k in _PLAN_KEYS}, "sources": list(self._names), "weights": self.weights}

    def set_epoch(self, epoch: int) -> None:
        """Passes `epoch` to a `datasets.IterableDataset` source (reshuffles its shards if it was shuffled)."""
        self._epoch = int(epoch)

    # ------------------------------------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        rank, world = self._rank_world()
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        start, self._resume = self._resume, None
        position = start.get("position") if start else None
        if position is not None:
            for key, value in (("rank", rank), ("world_size", world), ("worker", worker), ("num_workers", workers)):
                if start[key] != value:
                    raise ValueError(f"state was saved with {key}={start[key]} but this run has {key}={value}; resume "
                                     f"with the same {key} (DataLoader num_workers, torch.distributed world)")
        replica = Replica(self.cfg, self.processor, self._source, names=self._names, epoch=self._epoch, rank=rank,
                          world=world, worker=worker, workers=workers, resume=position, log=rank == 0 and worker == 0)
        # set now, not at the first next(): state_dict() right after iter() must describe this pass
        self._live = {"start": start, "snapshot": None, "where": (rank, world, worker, workers)}
        return self._iterate(replica, self._live, worker + 1 if info is not None else 0, info is not None)

    def _iterate(self, replica: Replica, live: dict[str, Any], slot: int, in_worker: bool,
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
                put(("done", replica.snapshot(replica.counters(), 0)))
            except BaseException as err:  # noqa: BLE001 - re-raised in the consumer
                put(("error", err))

        thread = threading.Thread(target=produce, name=f"hf_packing-r{replica.rank}w{replica.worker}", daemon=True)
        table = self._shared.numpy()
        table[slot] = 0
        table[slot, self._col["t0"]] = time.time()
        if live["start"] is not None and live["start"].get("position") is not None:
            self._publish(slot, live["start"]["position"]["counters"])
        thread.start()
        try:
            while True:
                try:
                    item = items.get(timeout=1.0)
                except queue.Empty:
                    if not thread.is_alive():
                        raise RuntimeError("the hf_packing producer thread ended without a result") from None
                    continue
                if item[0] == "error":
                    raise item[1]
                snap = item[-1]
                self._publish(slot, {**snap["window"].counters, **snap})
                if item[0] == "done":
                    if not in_worker:
                        self._len = replica.next_group
                    if replica.rank == 0 and replica.worker == 0:
                        self.stats(log=True)
                    return
                live["snapshot"] = snap
                yield item[1]
        finally:
            replica.stop.set()
            thread.join(timeout=10)

    def _publish(self, slot: int, counters: Mapping[str, Any]) -> None:
        row, col = self._shared.numpy()[slot], self._col
        values = {**counters["global"], **{f"skip/{k}": v for k, v in counters["meta_skips"].items()},
                  **{f"pskip/{k}": v for k, v in counters["proc_skips"].items()}, **counters["mine"]}
        values["packs_yielded"] = counters["mine"].get("packs", 0)
        values["packs"] = counters["global"].get("packs", 0)
        values["t1"] = time.time()
        for key, value in values.items():
            if key in col:
                row[col[key]] = value

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The state after the last pack yielded to the consumer (not merely produced): plain Python data.

        Loading it into a new `pack_dataset(...)` with the same settings, rank, world size and worker count yields
        exactly the packs that would have followed. It holds the planner's open packs, the planned but unassigned
        packs, the rank costs, counters, and the source position (a `datasets` state_dict or a row number) at the
        oldest row still needed plus the row where planning continues.
        """
        live = self._live
        if live is not None and live["snapshot"] is not None:
            snap, (rank, world, worker, workers) = live["snapshot"], live["where"]
            w = snap["window"]
            position = {"planner": w.planner, "unassigned": w.packs[snap["offset"]:], "next_group": snap["next_group"],
                        "costs": snap["costs"], "source": {"state": w.source_state, "s0": w.s0, "next_seq": w.next_seq},
                        "counters": {**w.counters, **{k: snap[k] for k in ("mine", "proc_skips")}}}
            return {"version": _STATE_VERSION, "config": self._config(), "epoch": self._epoch, "rank": rank,
                    "world_size": world, "worker": worker, "num_workers": workers, "position": position}
        if live is not None and live["start"] is not None:
            return live["start"]
        if self._resume is not None:
            return self._resume
        return {"version": _STATE_VERSION, "config": self._config(), "epoch": self._epoch, "position": None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a [`~PackedDataset.state_dict`]; the next iteration continues after its last yielded pack."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported pack_dataset state version {state.get('version')!r}")
        mine = self._config()
        for key, value in state["config"].items():
            if mine.get(key) != value:
                raise ValueError(f"state was saved with {key}={value!r} but this dataset has {key}={mine.get(key)!r}; "
                                 f"pass {key}={value!r} to pack_dataset to resume")
        self._resume, self._live, self._epoch = dict(state), None, int(state.get("epoch", 0))

    # ------------------------------------------------------------------------------------------------ stats
    def stats(self, log: bool = True) -> dict[str, Any]:
        """Statistics of the current or last pass on this rank, summed over this process's DataLoader workers.

        Returns:
            `dict`: `packs`, `samples`, `tokens` yielded; `fill` (tokens / (packs · max_length));
            `padded_batch_fill` / `padding_ratio_padded_batches` (the same samples in padded batches of 8, in input
            order: what a padded Trainer run would use);
            `packs_per_s`, `samples_per_s`; `images_per_pack`; `skipped` (reason → count, `overlong` included),
            split into `skipped_while_planning` (the same on every rank: count it once) and
            `skipped_while_processing` (this rank's pixel-time failures: sum over ranks);
            `rows_read`, `planned_packs` (all ranks), `leftover_packs` / `leftover_samples` (the last incomplete
            group of `world_size` packs, yielded by no rank); `complete`; `per_source` (`{name: {rows, samples}}`).
        """
        table = self._shared.numpy().copy()
        used = table[table[:, self._col["t0"]] > 0]
        used = used if len(used) else table[:1]
        top, total = used.max(axis=0), used.sum(axis=0)  # planning counters are the same on every replica

        def get(key: str, agg: Any = total) -> int:
            return int(agg[self._col[key]])

        packs, samples, tokens = get("packs_yielded"), get("samples"), get("tokens")
        elapsed = max(float(used[:, self._col["t1"]].max() - used[:, self._col["t0"]].min()), 1e-9)
        planning = {r: get(f"skip/{r}", top) for r in SKIPS if get(f"skip/{r}", top)}
        processing = {r: get(f"pskip/{r}") for r in SKIPS if get(f"pskip/{r}")}
        skipped = {r: planning.get(r, 0) + processing.get(r, 0) for r in SKIPS}
        in_slots = get("in_pad_slots", top) + get("in_batch_n", top) * get("in_batch_max", top)
        padded = get("in_tokens", top) / in_slots if in_slots else 1.0
        out = {"packs": packs, "samples": samples, "tokens": tokens,
               "fill": tokens / (packs * self.cfg.max_length) if packs else 0.0,
               "padded_batch_fill": padded, "padding_ratio_padded_batches": 1.0 - padded,
               "packs_per_s": packs / elapsed, "samples_per_s": samples / elapsed,
               "images_per_pack": get("images") / packs if packs else 0.0,
               "skipped": {r: n for r, n in skipped.items() if n}, "skipped_while_planning": planning,
               "skipped_while_processing": processing, "rows_read": get("rows", top),
               "planned_packs": get("packs", top), "leftover_packs": get("leftover_packs", top),
               "leftover_samples": get("leftover_samples", top), "complete": bool(get("done", top)),
               "per_source": {n: {"rows": get(f"rows/{n}", top), "samples": get(f"samples/{n}")} for n in self._names}}
        if log:
            logger.info("pack_dataset rank %s: %d packs, %d samples, fill %.4f (padded batches of 8: %.4f), %.1f "
                        "samples/s, %.2f images/pack, skipped %s, %d packs left over", self.rank, packs, samples,
                        out["fill"], padded, out["samples_per_s"], out["images_per_pack"], out["skipped"] or "none",
                        out["leftover_packs"])
        return out

    def count_packs(self, *, disable_progress: bool | None = None) -> int:
        """Plans the whole source here from metadata (no pixels; tqdm bar on rank 0) and returns the packs per rank.

        Afterwards `len()` works. Costs one metadata pass (~0.1-0.3 ms per row on one core).
        """
        from tqdm.auto import tqdm

        rank, world = self._rank_world()
        disable = self.cfg.disable_progress if disable_progress is None else disable_progress
        replica = Replica(self.cfg, self.processor, self._source, names=self._names, epoch=self._epoch, rank=rank,
                          world=world, worker=0, workers=1, log=rank == 0)
        with tqdm(total=self._source.size, desc="hf_packing: planning", unit=" rows",
                  disable=disable or rank != 0 or not sys.stderr.isatty()) as bar:
            replica.run(None, progress=bar)
        self._len = replica.next_group
        return self._len

    def __len__(self) -> int:
        if self._len is None:
            raise TypeError("the number of packs is unknown until planned: call count_packs() (a metadata-only pass) "
                            "or set max_steps")
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
    max_image_pixels: int = 89_478_485,
    disable_progress: bool = False,
    leftovers: str = "drop",
) -> PackedDataset:
    """Streams packs of processed multimodal samples: rank-equal, the same for any `num_workers`, resumable.

    Args:
        ds (`datasets.Dataset`, `datasets.IterableDataset`, or a `dict` of them): HF-messages or LLaVA rows (see the
            README's "Row formats"). A dict is mixed with `datasets.interleave_datasets`, counting rows and samples
            per source; each source keeps its own format. Rows are not shuffled here: shuffle `ds` first.
        processor: the model's processor (Qwen2-VL, Qwen2.5-VL and Qwen3-VL families).
        max_length (`int`, defaults to 8192): token budget per pack.
        strategy (`str`, defaults to `"bfd"`): `"bfd"` or `"next_fit"` (see `planner.py`).
        max_images (`int`, *optional*, defaults to 16): images per pack; a sample with more is skipped.
        max_vision_patches (`int`, *optional*, defaults to 65536): Σ t·h·w per pack (bounds the vision tower's memory).
        buffer_size (`int`, defaults to 1000): planner window (memory ≈ window + open packs, in rows).
        seed (`int`, defaults to 0): mixing seed.
        weights (`dict` or `list`, *optional*): sampling probabilities of a dict `ds`'s sources.
        media_root (`str` or `dict`, *optional*): root of relative image and video paths, one for all sources or
            `{source: root}`; paths escaping it are refused. `image_root` is its former name (one root).
        video_root (`str` or `dict`, *optional*): root of relative video (frame) paths where it is not `media_root`.
        fps (`float` or `dict`, *optional*): sampling rate of pre-sampled video frames, one or `{source: fps}`; a
            row's own `fps` wins. Without it the processor assumes 24 fps (wrong temporal positions for sparse frames).
        row_format (`str` or `dict`, defaults to `"auto"`): `"messages"`, `"llava"` or `"auto"` (detected from each
            source's own columns), one or `{source: format}`.
        train_on (`str`, defaults to `"assistant"`): supervise assistant turns, or `"all"` text.
        on_overlong (`str`, defaults to `"drop"`): `"drop"`, `"error"` or `"truncate_text"` (never cuts an image).
        on_error (`str`, defaults to `"skip"`): skip bad rows and count them by reason, or `"raise"`.
        rank, world_size (`int`, *optional*): default to torch.distributed if initialized, else 0 and 1.
        prefetch (`int`, defaults to 4): packs the producer thread may run ahead of the consumer.
        batch_size (`int`, defaults to 1): the DataLoader's batch size in packs; workers take packs in blocks of it so
            batches do not depend on `num_workers`.
        stopping_strategy (`str`, defaults to `"first_exhausted"`): when mixing (`"all_exhausted"` oversamples).
        max_image_pixels (`int`, defaults to 89,478,485): images larger than this (by header) are skipped.
        disable_progress (`bool`, defaults to `False`): no tqdm bar for planning passes.
        leftovers (`str`, defaults to `"drop"`): the last group of fewer than `world_size` packs: `"drop"` leaves it
            over (counted in `stats()`); `"spread"` gives it one pack per rank and the remaining ranks a 1-token
            unsupervised filler, so each pack is yielded exactly once: use it for eval sets.

    Returns:
        [`PackedDataset`]: a `torch.utils.data.IterableDataset` of packs with `state_dict()`, `load_state_dict()`,
        `stats()`, `count_packs()`, and `len()` once counted. Each sample also carries `index`, its position in the
        (mixed) input stream. A pass in which a source that had rows kept none of them, or no rank got a pack, ends
        with [`~hf_packing.formats.NoSamplesError`] naming the source and its top skip reasons.

    Example:

    ```python
    >>> train = pack_dataset({"llava": llava, "video": clips}, processor, max_length=8192,
    ...                      weights={"llava": 3, "video": 1}, fps={"video": 2.0},
    ...                      media_root={"llava": "/data/llava", "video": "/data/frames"})
    >>> loader = DataLoader(train, batch_size=1, num_workers=4, collate_fn=VisionCollator(processor))
    ```
    """
    if image_root is not None and media_root is not None:
        raise ValueError("image_root is the former name of media_root: pass one of them")
    cfg = PackConfig(max_length=max_length, strategy=strategy, max_images=max_images,
                     max_vision_patches=max_vision_patches, buffer_size=buffer_size, seed=seed,
                     media_root=image_root if media_root is None else media_root, video_root=video_root, fps=fps,
                     row_format=row_format, train_on=train_on, on_overlong=on_overlong, on_error=on_error,
                     prefetch=prefetch, batch_size=batch_size, stopping_strategy=stopping_strategy,
                     max_image_pixels=max_image_pixels, disable_progress=disable_progress, leftovers=leftovers)
    return PackedDataset(ds, processor, cfg, weights=weights, rank=rank, world_size=world_size)
