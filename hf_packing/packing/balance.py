"""Rank balance: what a pack costs (text and vision work, from the model config) and which rank trains it.

Ranks synchronise at every micro-batch (DDP's all-reduce, FSDP's gathers), so a step lasts as long as its costliest
rank: what matters is the spread of work *within a step*, not over the epoch. [`schedule`] sorts a window of
`window` steps' packs by cost and cuts it into steps of `world · per_rank` packs, so packs of similar cost train
together; within a step each rank gets `per_rank` packs by balanced largest differencing (Karmarkar-Karp with equal
counts). Every rank gets the same number of packs, and the result depends only on the costs (no RNG, no state), so
every replica makes the same choice and a resumed run makes it again.

Why a window of sorted steps, KK, and the vision terms (measured: benchmarks/RESULTS.md, 'Rank balance',
`bench_balance.py`, scored as Σ over steps of the slowest rank / Σ of the mean rank): sorting a window of steps by cost
is what evens out the ranks of a step, and a larger window evens them more; once the steps are sorted, KK ties the
other split methods the benchmark tries and is among the cheapest; weighing text cost alone leaves most of the
imbalance of image-heavy packs.

Cost of a sample with n tokens, P = Σ t·h·w vision patches and Q = Σ t·(h·w)² (attention is per frame of each image
or video), in units of one text token's dense work (6·N FLOPs, + 18·L_lin·S on Qwen3.5; `WorkCost.unit`)::

    n  +  a·n²  +  b·P  +  c·Q

Each weight is a term of the one cost model (`hf_packing.ops.flops.ModelFlops`, where the formula is) over the unit,
and `model_flops` counts the weights of the config's model built on the meta device, as ``training_flops`` counts a
loaded model's: a pack's cost × unit is ``training_flops`` of its batch (tests/test_balance.py), except in
Qwen2.5-VL's windowed blocks, where the packer (without the grids) counts every patch in a whole window (exact when
the frames are whole windows, above otherwise). For Qwen2.5-VL-7B (the default without a config):
a = 1/70,455, b = 0.0915 (an image token, 4 patches, costs 1.37 text tokens), c = 1/690,000 (a 2,000-token image's
attention adds 93 tokens' worth).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import heapq
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..ops.flops import ModelFlops

__all__ = ["WorkCost", "model_flops", "partition", "schedule", "step_spread"]

#: Qwen2.5-VL-7B-Instruct's config (what the weights' shapes need): the default when no model config is given
_QWEN2_5_VL_7B: dict[str, Any] = {
    "text_config": {
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    "vision_config": {
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "depth": 32,
        "out_hidden_size": 3584,
        "spatial_merge_size": 2,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
    },
}


@functools.cache
def _default_config() -> Any:
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(**_QWEN2_5_VL_7B)


def model_flops(config: Any = None, *, vision_trainable: bool = True) -> ModelFlops:
    """The cost model (`hf_packing.ops.flops.ModelFlops`) of the model of ``config`` (Qwen2.5-VL-7B's without one):
    the model is built on the meta device (no memory, no initialisation) and its weights counted as ``training_flops``
    counts a loaded model's, so the two agree exactly; any family transformers builds from a config needs no edit."""
    config = _default_config() if config is None else config
    key = (type(config), config.to_json_string(use_diff=False), vision_trainable)
    if key not in _COUNTED:
        from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

        config = copy.deepcopy(config)
        config._attn_implementation = "eager"  # the shapes only: a flash_attention_2 config builds without flash-attn
        model_class: Any = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]
        with torch.device("meta"), _outside_zero3_init():
            model = model_class(config)
        _COUNTED[key] = dataclasses.replace(ModelFlops.from_model(model), vision_trainable=vision_trainable)
    return _COUNTED[key]


_COUNTED: dict[tuple, ModelFlops] = {}


@contextlib.contextmanager
def _outside_zero3_init() -> Iterator[None]:
    """Builds a model as if no DeepSpeed ZeRO-3 config were registered. `TrainingArguments` with a stage-3 config
    registers it with transformers (a weak reference in ``transformers.integrations.deepspeed``), and from then on
    every model transformers builds, the meta one counted here too, is built inside ``deepspeed.zero.Init``, which
    partitions and initialises real weights (copying out of a meta tensor fails); the cost model needs shapes only.
    The registration is restored on exit. transformers keeps it in a module global with no public getter, hence the
    private name (checked by tests/test_balance.py)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    registered = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = registered


@dataclass(frozen=True)
class WorkCost:
    """Weights of a sample's work in text-token units (see the module docstring): `attention` per n², `patch` per
    vision patch, `vision_attention` per Σ t·(h·w)². Plain floats, so they travel in a `state_dict()`."""

    attention: float
    patch: float
    vision_attention: float

    @classmethod
    def from_config(cls, config: Any = None, *, vision_trainable: bool = True) -> WorkCost:
        """Weights from a transformers Qwen-VL config (`model.config`); Qwen2.5-VL-7B's without one.

        Args:
            config (`PretrainedConfig`, *optional*): the model's config, with `text_config` and `vision_config`.
            vision_trainable (`bool`, defaults to `True`): `False` counts the vision tower forward only (frozen).
        """
        return cls.from_flops(model_flops(config, vision_trainable=vision_trainable))

    @classmethod
    def from_flops(cls, flops: ModelFlops) -> WorkCost:
        """The weights of the cost model ``flops``: each term's FLOPs over one text token's (`unit`)."""
        unit = cls.unit(flops)
        return cls(
            attention=flops.text(tokens=0, sum_sq_lens=1) / unit,
            patch=flops.vision(patches=1, frame_sq=0) / unit,  # + the windowed blocks' estimate (module docstring)
            vision_attention=flops.vision(patches=0, frame_sq=1, window_sq=0) / unit,
        )

    @staticmethod
    def unit(flops: ModelFlops) -> float:
        """FLOPs of one text token's dense work, the unit of the weights: 6·N (+ 18·L_lin·S on Qwen3.5)."""
        return flops.text(tokens=1, sum_sq_lens=0)

    def sample(self, tokens: int, patches: int = 0, vision_sq: int = 0) -> float:
        """The cost of one sample (`tokens` after truncation, `patches` = Σ t·h·w, `vision_sq` = Σ t·(h·w)²)."""
        return tokens + self.attention * tokens * tokens + self.patch * patches + self.vision_attention * vision_sq

    def to_list(self) -> list[float]:
        return list(asdict(self).values())


def partition(costs: Sequence[float], world: int) -> list[list[int]]:
    """Splits `len(costs)` packs (a multiple of `world`) into `world` lists of equal length, balancing the sums by
    balanced largest differencing: each run of `world` packs (in cost order) is a partial split, one pack per rank; the
    two splits with the largest spread merge, heaviest part of one with lightest of the other.

    Args:
        costs (`Sequence[float]`): one cost per pack.
        world (`int`): number of ranks.

    Returns:
        `list[list[int]]`: positions into `costs` per rank, each list ascending.
    """
    n = len(costs)
    if n % world:
        raise ValueError(f"{n} packs do not split evenly over world={world} ranks")
    order = sorted(range(n), key=lambda i: (-costs[i], i))
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for k in range(0, n, world):
        parts = sorted(((costs[i], [i]) for i in order[k : k + world]), key=lambda p: -p[0])
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), k, parts))
    while len(heap) > 1:
        _, k, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(x[0] + y[0], x[1] + y[1]) for x, y in zip(a, reversed(b))]
        merged.sort(key=lambda p: (-p[0], p[1]))
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), k, merged))
    return [sorted(p[1]) for p in heap[0][2]] if heap else [[] for _ in range(world)]


#: a split of one step's packs over the ranks: `split(costs, world)` -> positions into `costs` per rank
Split = Callable[[Sequence[float], int], list[list[int]]]


def schedule(costs: Sequence[float], *, world: int, per_rank: int = 1, split: Split = partition) -> list[list[int]]:
    """Which pack each rank trains at each step: sorted by cost, cut into steps of `world · per_rank`, each split by
    `split`; steps in the order of their first pack (data order, roughly). A final step of fewer packs takes
    a multiple of `world`.

    Args:
        costs (`Sequence[float]`): one cost per pack, in creation order; `len(costs)` a multiple of `world`.
        world (`int`): number of ranks.
        per_rank (`int`, defaults to 1): packs per rank per step (the DataLoader's `batch_size`).
        split (`Callable`, defaults to [`partition`]): divides one step's costs over the `world` ranks.

    Returns:
        `list[list[int]]`: groups of `world` positions into `costs`, the pack of rank r at [r]; every `per_rank`
        consecutive groups are one step. With `world == 1` the packs keep their order.
    """
    n = len(costs)
    if n % world:
        raise ValueError(f"{n} packs do not split evenly over world={world} ranks")
    if world == 1:
        return [[i] for i in range(n)]
    order = sorted(range(n), key=lambda i: (-costs[i], i))
    size = world * per_rank
    steps = [order[k : k + size] for k in range(0, n, size)]
    groups = []
    for step in sorted(steps, key=min):
        parts = sorted(sorted(step[i] for i in p) for p in split([costs[i] for i in step], world))
        # ranks take the parts in data order, so no rank always gets the heaviest pack
        groups += [[parts[r][j] for r in range(world)] for j in range(len(parts[0]))]
    return groups


def step_spread(loads: Sequence[Sequence[float]]) -> float:
    """Σ over steps of the most loaded rank / Σ of the mean rank: wall time against perfect balance (1.0 is best).

    Args:
        loads (`Sequence[Sequence[float]]`): per step, each rank's work.
    """
    top = sum(max(step) for step in loads)
    mean = sum(sum(step) / len(step) for step in loads)
    return top / mean if mean else 1.0
