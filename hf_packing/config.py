"""`PackingConfig`: every setting of [`~hf_packing.packing.dataset.pack_dataset`], once, with its default, type and
help.

`transformers.HfArgumentParser` reads it from YAML or the command line (`recipes/train.py`, `hf-packing stats`), and
`pack_dataset(ds, processor, config, **overrides)` resolves keyword overrides into it, so no option is declared twice.

Per-source settings (`media_root`, `video_root`, `fps`, `videos_kwargs`, `row_format`, `chat_template_kwargs`) and
`weights` take one value, a list (one per source of a `{name: dataset}` mix, in its order) or a `{source name: value}`
dict. From YAML or Python they are given as such; on a command line a list is several values or JSON (``--weights 0.7
0.3``, ``--weights '[0.7, 0.3]'``, see [`per_source_flags`]) and a dict is JSON (``--media_root '{"coco":
"/data/coco", "clips": "/data/clips"}'``), decoded by `__post_init__`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["PackingConfig", "per_source_flags"]

# HfArgumentParser gives a union flag the type of the union's second member, so `str` stands second in these: the flag
# is then a string (a value or JSON), decoded in __post_init__.
PathSetting = os.PathLike | str | list | dict | None
NumberSetting = float | str | list | dict | None
DictSetting = dict | str | list | None

#: fields whose command-line string may be JSON (a dict or a list)
JSON_FIELDS = ("weights", "media_root", "video_root", "fps", "videos_kwargs", "row_format", "chat_template_kwargs")
#: fields that must be >= 1
POSITIVE_FIELDS = ("buffer_size", "batch_size", "balance_window", "skip_check_rows", "media_tries", "media_max_bytes")
#: how a mix ends: `None` (every row once without weights, "first_exhausted" with them) or datasets' own names
STRATEGIES: tuple[str, ...] = ("next_fit", "bfd")  # the planner's bin-packing strategies
DEFAULT_STRATEGY = "bfd"  # plan_packs', StreamingPlanner's and PackingConfig's
MAX_IMAGE_PIXELS = 89_478_485  # PIL's decompression-bomb limit
STOPPING_STRATEGIES = (None, "first_exhausted", "all_exhausted", "all_exhausted_without_replacement")


def _help(text: str, **extra: Any) -> dict[str, Any]:
    """A field's metadata: its help on one line (``%`` doubled: argparse formats help strings) and `extra`."""
    return {"help": " ".join(text.split()).replace("%", "%%"), **extra}


@dataclass
class PackingConfig:
    """The settings of [`~hf_packing.packing.dataset.pack_dataset`]: what a pack holds, how rows are read and mixed,
    what happens to bad rows, and how the stream is split over ranks and DataLoader workers (each field's help says
    what it does and what it costs). The process topology (`rank`, `world_size`, `sequence_parallel_size`) and the model
    (`model_config`) are not settings of the data: they are `pack_dataset` arguments (see there).

    Example:

    ```python
    >>> from transformers import HfArgumentParser
    >>> (config,) = HfArgumentParser(PackingConfig).parse_args_into_dataclasses(["--max_length", "4096"])
    >>> train = pack_dataset(ds, processor, config, buffer_size=500)  # overrides win over the config
    ```
    """

    max_length: int = field(default=8192, metadata=_help("token budget per pack"))
    strategy: str = field(
        default=DEFAULT_STRATEGY,
        metadata=_help(f"bin packing over the planner window: one of {STRATEGIES} (see hf_packing/packing/planner.py)"),
    )
    max_images: int | None = field(
        default=None,
        metadata=_help(
            """images per pack (a sample with more is skipped); None: no limit, max_vision_patches bounds the vision
            work; a small limit closes packs by image count long before they fill (measured: benchmarks/RESULTS.md,
            'Packing: the max_images default'; docs/packer.md)"""
        ),
    )
    max_vision_patches: int | None = field(
        default=65536, metadata=_help("Σ t·h·w vision patches per pack (bounds the vision tower's memory)")
    )
    buffer_size: int = field(
        default=1000, metadata=_help("planner window in rows (memory ≈ window + open packs, in rows)")
    )
    seed: int = field(default=0, metadata=_help("seed of the mix of a {name: dataset} source (rows are not shuffled)"))
    weights: DictSetting = field(
        default=None,
        metadata=_help(
            """sampling probabilities of a {name: dataset} mix's sources: a {name: weight} dict or a list in the mix's
            order (JSON on a command line); default: equal"""
        ),
    )
    media_root: PathSetting = field(
        default=None,
        metadata=_help(
            """root of relative image and video paths: one for all sources, one per source (a list) or
            {source: root}; a path escaping it (`..`, absolute, symlink) is refused ("path_outside_root"). Without it
            paths are used as given. `image_root` is its former name""",
            aliases=["--image_root", "--image-root"],
        ),
    )
    video_root: PathSetting = field(
        default=None,
        metadata=_help("root of relative video (frame) paths where it is not media_root: one, a list or a dict"),
    )
    fps: NumberSetting = field(
        default=None,
        metadata=_help(
            """sampling rate of pre-sampled video frames: one, a list or {source: fps}; a row's own `fps` wins. It
            reaches the processor as `video_metadata` (Qwen2.5-VL second_per_grid_ts, Qwen3-VL timestamps); without
            it the processor assumes 24 fps (wrong for sparse frames). A video file's rate is read from its header"""
        ),
    )
    videos_kwargs: DictSetting = field(
        default=None,
        metadata=_help(
            """how video files are sampled and resized, in the video processors' names: fps (frames per second of
            video; default the processor's, else 2.0) or num_frames, min_frames, max_frames, min_pixels, max_pixels
            (per video, the processor's `size`), do_sample_frames; one dict for all sources, a list or {source: dict}
            (JSON on a command line, e.g. '{"fps": 2, "max_frames": 64}'). See
            hf_packing/preprocess/video_sampling.py"""
        ),
    )
    row_format: DictSetting = field(
        default="auto",
        metadata=_help(
            """"messages" (HF, LLaMA-Factory), "llava" (LLaVA / ShareGPT conversations), "prompt_completion" (TRL)
            or "auto" (detected from each source's own columns): one, a list or {source: format}; see
            docs/row_formats.md"""
        ),
    )
    chat_template_kwargs: DictSetting = field(
        default=None,
        metadata=_help(
            """extra variables of the checkpoint's chat template, as apply_chat_template(**kwargs) takes them (e.g.
            {"add_vision_id": true, "enable_thinking": false}): one dict for all sources, a list or {source: dict}
            (JSON on a command line). A row's tools come from its own "tools" column"""
        ),
    )
    empty_thinking: Literal["mask", "train"] = field(
        default="mask",
        metadata=_help(
            """an empty thinking block (<think>\n\n</think>\n\n) that the template inserts before an answer
            without reasoning (Qwen3.5): "mask" leaves it out of the labels (the data says nothing about thinking
            there), "train" supervises it (teaches the model to skip thinking)"""
        ),
    )
    train_on: Literal["assistant", "all"] = field(
        default="assistant",
        metadata=_help(
            """supervise each assistant turn as the chat template renders it (thinking, tool calls, content and its
            end-of-turn token; a TRL prompt's turns are context), or "all" text. Vision tokens (pads,
            <|vision_start|> / <|vision_end|>, video timestamps) never are"""
        ),
    )
    on_overlong: Literal["drop", "error", "truncate_text"] = field(
        default="drop",
        metadata=_help(
            """a sample longer than max_length: "drop" (reason "overlong"), "error" (raise) or "truncate_text": keep
            the first max_length tokens if every vision span ends inside them, else drop (reason "overlong_vision");
            an image is never cut"""
        ),
    )
    on_error: Literal["skip", "raise"] = field(
        default="skip", metadata=_help("skip bad rows and count them by reason, or raise")
    )
    batch_size: int = field(
        default=1,
        metadata=_help(
            """the DataLoader's batch size in packs; workers take packs in blocks of it so batches do not depend on
            num_workers"""
        ),
    )
    stopping_strategy: str | None = field(
        default=None,
        metadata=_help(
            """when a {name: dataset} mix ends (datasets.interleave_datasets). Default: without weights every row of
            every source once per epoch, sources alternating row by row ("all_exhausted_without_replacement"); with
            weights "first_exhausted" (the weights hold exactly, the other sources' remaining rows are not read).
            "all_exhausted" oversamples the shorter sources until the longest is used up"""
        ),
    )
    max_image_pixels: int = field(
        default=MAX_IMAGE_PIXELS,
        metadata=_help(
            """images larger than this (by header) are skipped before anything is decoded; PIL's decompression-bomb
            limit applies too"""
        ),
    )
    media_timeout: float = field(
        default=10.0,
        metadata=_help(
            """seconds one http(s):// URL may take in all (every try and pause included) before its row is skipped
            ("fetch_failed", naming the URL); URLs are read in the DataLoader workers, never in the training step
            (hf_packing/preprocess/fetch.py)"""
        ),
    )
    media_tries: int = field(
        default=3,
        metadata=_help(
            "attempts per URL for failures that may pass (timeout, refused or reset connection, HTTP 408/429/5xx)"
        ),
    )
    media_max_bytes: int = field(
        default=50_000_000,
        metadata=_help("the largest image or video a URL or data URI may hold; a larger one is skipped (fetch_failed)"),
    )
    media_cache_bytes: int = field(
        default=64 * 1024 * 1024,
        metadata=_help(
            """whole fetched bodies each DataLoader worker keeps per source (least recently used out first), so a URL
            planned shortly before its pack is processed is fetched once; 0: none"""
        ),
    )
    disable_progress: bool = field(default=False, metadata=_help("no tqdm bar for planning and indexing passes"))
    leftovers: Literal["drop", "spread"] = field(
        default="drop",
        metadata=_help(
            """the last group of fewer than world_size packs: "drop" leaves it over (counted in stats()); "spread"
            gives it one pack per rank and the remaining ranks a 1-token unsupervised filler, so each pack is yielded
            exactly once (evaluation does this by itself, see PackedDataset.for_evaluation)"""
        ),
    )
    balance_window: int = field(
        default=16,
        metadata=_help(
            """steps (of world_size · batch_size packs) sorted by cost together, so each step holds packs of similar
            cost, so the slowest rank of a step waits less (measured: benchmarks/RESULTS.md, 'Rank balance'). A
            replica holds that many steps' packs' rows (with 64 ranks, ~12k LLaVA rows: metadata only for an indexed
            datasets.Dataset, whole rows from a stream: lower it for streams that embed image bytes)"""
        ),
    )
    length_index: str = field(
        default="auto",
        metadata=_help(
            """for a datasets.Dataset (or a mix's map-style sources): "auto" or "true" estimate every row once into
            cached columns next to the dataset's cache files (hf_packing/packing/length_index.py), a directory puts them
            there; the first process of each node builds it, the others wait and read it. "false" (or False): every
            replica estimates every row. Streaming sources always estimate as they read"""
        ),
    )
    index_num_proc: int | None = field(
        default=None,
        metadata=_help(
            "processes building the length index (default: 1 below 20,000 rows, else the usable cores, at most 32)"
        ),
    )
    source_column: str | None = field(
        default=None,
        metadata=_help(
            "the column naming each row's source, for per-source loss and accuracy (a {name: dataset} mix is tagged "
            "by its keys without it); see hf_packing/packing/source_ids.py"
        ),
    )

    # ---- bad rows: how many a source may skip before the run stops
    max_skipped_fraction: float = field(
        default=0.1,
        metadata=_help(
            """stop the run when a source skips more than this fraction of its rows while planning (missing files,
            overlong, bad rows), naming its top reasons with a hint each: checked from the skip_check_rows-th row of
            the source on, and at the end of a pass; 1.0 never stops (a source that keeps no row still does)"""
        ),
    )
    skip_check_rows: int = field(
        default=200,
        metadata=_help("rows of a source read before max_skipped_fraction is checked (then at every skip of it)"),
    )

    def __post_init__(self) -> None:
        for name in JSON_FIELDS:
            value = getattr(self, name)
            if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):  # one flag value
                value = value[0]
                setattr(self, name, value)
            if isinstance(value, str) and value.lstrip().startswith(("{", "[")):
                try:
                    setattr(self, name, json.loads(value))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{name}={value!r} is not valid JSON ({err}); give a value or JSON") from None
        for name in ("weights", "fps"):  # several flag values are strings
            value = getattr(self, name)
            if isinstance(value, list) and any(isinstance(x, str) for x in value):
                try:
                    setattr(self, name, [float(x) if isinstance(x, str) else x for x in value])
                except ValueError:
                    raise ValueError(f"{name} must be numbers, got {value!r}") from None
        if isinstance(self.fps, str):
            try:
                self.fps = float(self.fps)
            except ValueError:
                raise ValueError(f"fps must be a number, a list or a {{source: fps}} dict, got {self.fps!r}") from None
        index = os.fspath(self.length_index) if isinstance(self.length_index, os.PathLike) else self.length_index
        self.length_index = str(index).lower() if isinstance(index, bool) or index in ("True", "False") else index
        for name, choices in literal_choices(type(self)).items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.stopping_strategy not in STOPPING_STRATEGIES:
            raise ValueError(f"stopping_strategy must be one of {STOPPING_STRATEGIES}, got {self.stopping_strategy!r}")
        if not 0.0 <= float(self.max_skipped_fraction) <= 1.0:
            raise ValueError(f"max_skipped_fraction must be in [0, 1], got {self.max_skipped_fraction}")
        if not float(self.media_timeout) > 0 or self.media_cache_bytes < 0:
            raise ValueError(
                f"media_timeout must be > 0 and media_cache_bytes >= 0, got {self.media_timeout}, "
                f"{self.media_cache_bytes}"
            )
        for name in POSITIVE_FIELDS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def names(cls) -> list[str]:
        """The settings' names, in declaration order."""
        return [f.name for f in dataclasses.fields(cls)]

    def resolve(self, **overrides: Any) -> PackingConfig:
        """A copy with `overrides` (setting names) applied and validated; an unknown name is a `TypeError` that lists
        the settings. `image_root` is `media_root`'s former name."""
        image_root = overrides.pop("image_root", None)
        if image_root is not None:
            if overrides.get("media_root") is not None:
                raise ValueError("image_root is the former name of media_root: pass one of them")
            overrides["media_root"] = image_root
        unknown = sorted(set(overrides) - set(self.names()))
        if unknown:
            raise TypeError(
                f"unknown pack_dataset setting(s) {unknown}; the settings (PackingConfig fields) are "
                f"{', '.join(self.names())}"
            )
        return dataclasses.replace(self, **overrides)


def per_source_flags(parser: Any) -> Any:
    """Lets the per-source flags of `parser` (an `argparse` / `HfArgumentParser` holding `PackingConfig`) take several
    values: ``--weights 0.7 0.3`` and ``--media_root /a /b`` give lists, as JSON (``--weights '[0.7, 0.3]'``) does;
    one value stays one value. Returns `parser`."""
    for action in parser._actions:
        if action.dest in JSON_FIELDS and action.option_strings:
            action.nargs = "+"
    return parser


def literal_choices(cls: type) -> dict[str, tuple[Any, ...]]:
    """{field name: its allowed values} for `cls`'s `Literal` fields."""
    hints = typing.get_type_hints(cls)
    return {n: typing.get_args(t) for n, t in hints.items() if typing.get_origin(t) is Literal}
