"""`pack_dataset`: a stream of packs (lists of processed samples), rank-equal, worker-invariant and resumable.

A pack holds whole samples whose tokens sum to at most `max_length` (and within the image / vision-patch budgets);
the collator later pads each sample to a row or flattens the pack. A full pack at `max_length=20`::

                   |<------------ #40: 14 ------------>|<--- #51: 6 --->|     boundaries come from lengths
    input_ids       S  u  V  I  I  I  I  E  t  e  S  a  a  e   S  t  e  S  a  e
    mm_token_type   0  0  0  1  1  1  1  0  0  0  0  0  0  0   0  0  0  0  0  0     1: image (never cut)
    labels          -  -  -  -  -  -  -  -  -  -  -  a  a  e   -  -  -  -  a  e     -: -100

    S: <|im_start|>role\n   u t: user text   V I I E: <|vision_start|> <|image_pad|>... <|vision_end|>
    a: assistant text   e: <|im_end|>, supervised with its turn

How it works, without any collective (1.-3. and 5. are a [`~hf_packing.packing.replica.Replica`]'s work):

1. **Plan on metadata, everywhere.** Every worker of every rank reads the same rows in the same order, gets each
   one's tokens / images / patches from the length index of a `datasets.Dataset` (built once, see
   [`~hf_packing.packing.length_index`]) or, for a stream, from text and image headers
   ([`~hf_packing.preprocess.preprocessor.Preprocessor.estimate`]) and feeds the same deterministic
   [`~hf_packing.packing.planner.StreamingPlanner`] (windows of `buffer_size`), so all replicas see the same global
   sequence of packs (fill against whole-dataset planning, measured: benchmarks/RESULTS.md, 'Fill and planner
   speed').
2. **Ranks.** Closed packs wait until `balance_window` steps' worth (`world_size · batch_size` packs a step) are
   there; [`~hf_packing.packing.balance.schedule`] then sorts them by cost (text and vision work, weighted from the
   model config: [`~hf_packing.packing.balance.WorkCost`]), cuts them into steps of similar packs and splits each step
   over the ranks, so no rank stalls a step. Every rank yields as many packs whatever the shard sizes; a final
   incomplete group is left over (counted in `stats()`) or, with `leftovers="spread"` (eval sets), handed out one pack
   per rank, with a 1-token filler for the ranks past its end.
3. **Workers.** DataLoader worker w of W takes the rank's packs j with (j // batch_size) % W == w; the DataLoader
   interleaves workers round-robin, so the batches are the same, in the same order, for any `num_workers`. Only a
   worker's own packs get pixel processing ([`~hf_packing.preprocess.preprocessor.Preprocessor.process`]), which checks
   the processed length against the planned one.
4. **Where the work runs.** Reading, planning and pixel work run in the iterator itself: in each DataLoader worker
   process (which the DataLoader already runs ahead of training, `prefetch_factor` batches each), or in the training
   process with `num_workers=0`. A bad row (a `SampleError`) is skipped and counted ([`PackStats`]), never fatal (unless
   `on_error="raise"`) until its source has skipped more than `max_skipped_fraction` of its rows; any other exception
   is not a bad row and ends the pass.
5. **Resume.** `state_dict()` is the state after the last pack *yielded*: the planner's open packs, the packs
   planned but not yet assigned, the steps scheduled but not yet yielded, the counters, and the source position
   (`datasets` state_dict or a row number) of the oldest row still held plus the row where planning continues.
   Loading it re-reads only that span (typically a few windows) and continues with exactly the packs of an
   uninterrupted run.

The price of agreeing without communication is that every replica plans every row. From a stream that means W · N
estimates per rank against N / R pixel jobs, and an estimate (text and headers) costs a small fraction of a pixel job
(measured: docs/packer.md, 'What a row costs'); a `datasets.Dataset` is estimated once (`length_index="auto"`) and
each replica reads columns (measured: benchmarks/RESULTS.md, 'Length index').
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch

from ..config import PackingConfig
from ..parallel.state import data_parallel_rank_world
from ..preprocess.checks import check_processor
from ..preprocess.errors import REASONS
from ..preprocess.formats import FEATURES, source_formats
from ..preprocess.preprocessor import Preprocessor
from .balance import WorkCost
from .length_index import with_length_index
from .planner import CLOSE_REASONS
from .readers import make_source
from .replica import Replica, preprocessors
from .source_ids import SourceTagger
from .stats import PADDED_BATCH, PackStats

__all__ = ["PackStats", "PackedDataset", "PackingConfig", "pack_dataset"]
logger = logging.getLogger(__name__)

_STATE_VERSION = 6  # 3: scheduled steps and cost weights; 4: video skip reasons and counters in the PackStats row;
# 5: a mix without weights reads every row (stopping_strategy=None); closed_by, no unexpected_error in PackStats; rows
# reach the chat template whole (lengths change), chat_template_kwargs and empty_thinking in the plan
# 6: the planner no longer re-plans (other packs; planner state version 5)
_MAX_SLOTS = 65  # rows of the shared stats table: the main process + up to 64 DataLoader workers

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
    "chat_template_kwargs",
    "empty_thinking",
)  # settings a saved state must match (and the cost weights)


class PackedDataset(torch.utils.data.IterableDataset):
    """The iterable of packs made by [`pack_dataset`] (see there and the module docstring), from a validated
    [`~hf_packing.config.PackingConfig`] and the process topology.

    Each item is a pack: a `list` of sample dicts (see [`~hf_packing.preprocess.preprocessor.Preprocessor.process`]).
    Works with `torch.utils.data.DataLoader` (any `num_workers`) and torchdata's `StatefulDataLoader`.
    """

    #: the mark `hf_packing.patches.prepared.PACKS_ATTR` by which the loader guard (below the packer) knows the packs
    hf_packing_packs: ClassVar[bool] = True

    def __init__(
        self,
        ds: Any,
        processor: Any,
        cfg: PackingConfig,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        sequence_parallel_size: int = 1,
        model_config: Any = None,
    ) -> None:
        super().__init__()
        self.cost = model_config if isinstance(model_config, WorkCost) else WorkCost.from_config(model_config)
        names = [str(n) for n in ds] if isinstance(ds, Mapping) else []
        # the formats once per source, from its own columns
        cfg = cfg.resolve(row_format=source_formats(ds, cfg.row_format))
        self.cfg, self.processor, self.rank, self.world_size = cfg, processor, rank, world_size
        self.sequence_parallel_size = sequence_parallel_size
        weights = cfg.weights
        self.weights = dict(weights) if isinstance(weights, Mapping) else list(weights) if weights is not None else None
        self.source_tagger = SourceTagger(ds, cfg.source_column)
        #: the sources samples are tagged with (``sample["source_id"]`` indexes it); empty when untagged
        self.source_names = list(self.source_tagger.names)
        pres = preprocessors(cfg, processor, names)  # validates the settings here rather than in a worker
        if isinstance(ds, Mapping):
            ds = {name: self._indexed(part, pres[str(name)]) for name, part in ds.items()}
        else:
            ds = self._indexed(ds, pres[None])
        self._source, self._names = make_source(ds, self.weights, cfg.seed, cfg.stopping_strategy)
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
        if mode == "false" or not isinstance(ds, datasets.Dataset):
            return ds
        if not isinstance(mode, str):
            raise ValueError(f"length_index must be 'auto', True, False or a directory, got {mode!r}")
        cache_dir = None if mode in ("auto", "true") else mode
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
        view = getattr(self, "_eval_view", None)
        if view is None:
            view = copy.copy(self)
            view.cfg = dataclasses.replace(self.cfg, leftovers="spread")
            view._shared = torch.zeros_like(self._shared).share_memory_()
            view._next_start = view._state = view._len = view._eval_view = None
            self._eval_view = view
        return view

    def _config(self) -> dict[str, Any]:
        return {
            **{k: getattr(self.cfg, k) for k in _PLAN_KEYS},
            "cost": self.cost.to_list(),
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
        for key, value in where.items() if start is not None and position is not None else ():
            if start is not None and start[key] != value:
                raise ValueError(
                    f"state was saved with {key}={start[key]} but this run has {key}={value}; resume "
                    f"with the same {key} (DataLoader num_workers, torch.distributed world)"
                )
        replica = self._replica(where["worker"], where["num_workers"], position)
        self._state = start  # now, not at the first next(): state_dict() right after iter() describes this pass
        return self._iterate(replica, position, where, in_worker=info is not None)

    def _replica(self, worker: int, workers: int, position: dict[str, Any] | None) -> Replica:
        rank, world = self._rank_world()
        return Replica(
            self.cfg,
            self.processor,
            self._source,
            self._names,
            cost=self.cost,
            epoch=self._epoch,
            rank=rank,
            world=world,
            worker=worker,
            workers=workers,
            position=position,
            tag_source=self.source_tagger,
        )

    def _iterate(
        self,
        replica: Replica,
        start: dict[str, Any] | None,
        where: dict[str, int],
        *,
        in_worker: bool,
    ) -> Iterator[list[dict[str, Any]]]:
        slot = replica.worker + 1 if in_worker else 0
        self._shared[slot] = 0
        self._shared[slot, 0] = time.time()
        if start is not None:
            self._publish(slot, start["stats"])
        for samples, position in replica.run():
            self._publish(slot, position["stats"])
            self._state = {**self._header(), **where, "position": position}
            yield samples
        self._publish(slot, replica.stats.to_row())
        if not in_worker:
            self._len = replica.next_group
        if replica.rank == 0 and replica.worker == 0:
            self.stats(log=True)

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
            `rows_read`, `planned_packs` (all ranks) and `closed_by` (why they closed: the budget they reached,
            `tokens`, `images` or `patches`, else `open_packs` or `end`, see
            `hf_packing.packing.planner.CLOSE_REASONS`), `leftover_packs` / `leftover_samples` (the last incomplete
            group of `world_size` packs, yielded by no rank); `complete`; `per_source` (`{name: {rows, samples}}`);
            `rows_with` (kept rows carrying reasoning, tool calls, tool turns or tools:
            `hf_packing.preprocess.formats.FEATURES`).
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
            "closed_by": {reason: stats.closed_by[reason] for reason in CLOSE_REASONS if stats.closed_by[reason]},
            "rows_with": {feature: stats.features[feature] for feature in FEATURES},
            "leftover_packs": stats.leftover_packs,
            "leftover_samples": stats.leftover_samples,
            "complete": bool(stats.complete),
            "per_source": {n: {"rows": stats.rows[n], "samples": stats.samples[n]} for n in self._names},
        }
        if log:
            logger.info(
                "pack_dataset rank %s: %d packs, %d samples, fill %.4f (padded batches of %d: %.4f), %.1f "
                "samples/s, %.2f images/pack, %d videos (%d tokens), skipped %s, packs closed by %s, %d packs left "
                "over; rows with %s",
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
                out["closed_by"] or "none",
                out["leftover_packs"],
                out["rows_with"],
            )
        return out

    def count_packs(self, *, disable_progress: bool | None = None) -> int:
        """Plans the whole source here from metadata (no pixels; tqdm bar on rank 0) and returns the packs per rank;
        afterwards `len()` works. Costs one metadata pass (see the module docstring for what a row costs)."""
        from tqdm.auto import tqdm

        replica = self._replica(0, 1, None)
        disable = self.cfg.disable_progress if disable_progress is None else disable_progress
        with tqdm(
            total=self._source.size,
            desc="hf_packing: planning",
            unit=" rows",
            disable=disable or replica.rank != 0 or not sys.stderr.isatty(),
        ) as bar:
            for _ in replica.run(process=False, progress=bar):
                pass
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
    config: PackingConfig | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    sequence_parallel_size: int = 1,
    model_config: Any = None,
    **overrides: Any,
) -> PackedDataset:
    """Streams packs of processed multimodal samples: rank-equal, the same for any `num_workers`, resumable.

    Args:
        ds (`datasets.Dataset`, `datasets.IterableDataset`, or a `dict` of them): HF-messages or LLaVA rows (see
            docs/row_formats.md). A dict is mixed with `datasets.interleave_datasets` (without `weights` every row of
            every source once, alternating; with them until `stopping_strategy`), counting rows and samples per
            source; each source keeps its own format. Rows are not shuffled here: shuffle `ds` first.
        processor: the model's processor (Qwen2-VL, Qwen2.5-VL and Qwen3-VL families).
        config ([`~hf_packing.config.PackingConfig`], *optional*): the settings (each documented, with its default, in
            `PackingConfig`); its defaults when not given.
        **overrides: any `PackingConfig` field by name (`max_length=4096`), applied over `config`; `image_root` is
            `media_root`'s former name. An unknown name raises `TypeError` listing the fields.
        rank, world_size (`int`, *optional*): the data-parallel rank and size; default to torch.distributed's
            rank and world size divided by `sequence_parallel_size` if initialized, else 0 and 1. With a process
            group every rank must call `pack_dataset` (the length index build waits at a barrier).
        sequence_parallel_size (`int`, defaults to 1): ranks that split one pack, the same number as
            `apply_rmpad(sequence_parallel_size=...)` (`prepare_trainer` checks the two agree): consecutive ranks
            `[d·P, (d+1)·P)` get the same packs.
        model_config (`PretrainedConfig` or [`~hf_packing.packing.balance.WorkCost`], *optional*): the model's config
            (`model.config`), which weighs a pack's text and vision work for rank balance; Qwen2.5-VL-7B's without it.
            Pass `WorkCost.from_config(model.config, vision_trainable=False)` for a frozen vision tower.

        These four are arguments rather than `PackingConfig` fields because they describe the run, not the data: the
        topology comes from torch.distributed / accelerate and `apply_rmpad`, the model from the checkpoint, so a
        config file would only restate (or contradict) them.

    Returns:
        [`PackedDataset`]: a `torch.utils.data.IterableDataset` of packs with `state_dict()`, `load_state_dict()`,
        `stats()`, `count_packs()`, and `len()` once counted. Each sample also carries `index`, its position in the
        (mixed) input stream, and, from a mix or with `source_column`, `source_id` (into `source_names`). A pass in
        which a source that had rows kept none of them, or no rank got a pack, ends with
        [`~hf_packing.packing.stats.NoSamplesError`] naming the source and its top skip reasons; a source that skips
        more than `max_skipped_fraction` of its rows ends it early with
        [`~hf_packing.packing.stats.TooManySkipsError`] (a `NoSamplesError`), with a hint per reason.

    Example:

    ```python
    >>> train = pack_dataset({"llava": llava, "video": clips}, processor, max_length=8192,
    ...                      weights={"llava": 3, "video": 1}, fps={"video": 2.0},
    ...                      media_root={"llava": "/data/llava", "video": "/data/frames"})
    >>> loader = DataLoader(train, batch_size=1, num_workers=4, collate_fn=VisionCollator(processor))
    ```
    """
    if config is not None and not isinstance(config, PackingConfig):
        raise TypeError(f"config must be a PackingConfig, got {type(config).__name__}; pass settings as keywords")
    check_processor(processor, model_config, where="pack_dataset")  # a tokenizer or another family: say so
    return PackedDataset(
        ds,
        processor,
        (config or PackingConfig()).resolve(**overrides),
        rank=rank,
        world_size=world_size,
        sequence_parallel_size=sequence_parallel_size,
        model_config=model_config,
    )
