"""Rank balance: what a pack costs (text and vision work, from the model config) and which rank trains it.

Ranks synchronise at every micro-batch (DDP's all-reduce, FSDP's gathers), so a step lasts as long as its costliest
rank: what matters is the spread of work *within a step*, not over the epoch. [`schedule`] sorts a window of
`window` steps' packs by cost and cuts it into steps of `world · per_rank` packs, so packs of similar cost train
together; within a step each rank gets `per_rank` packs by balanced largest differencing (Karmarkar-Karp with equal
counts). Every rank gets the same number of packs, and the result depends only on the costs (no RNG, no state), so
every replica makes the same choice and a resumed run makes it again.

Measured (`benchmarks/bench_balance.py`, RESULTS.md, Qwen2.5-VL-7B weights): Σ over steps of the slowest rank /
Σ of the mean rank, 8 and 64 ranks, one or two packs per rank per step, on LLaVA-like, document and hi-res-photo
mixes: 1.023-1.123 for the former greedy by text cost over consecutive packs, 1.001-1.015 with a window of 16 steps
(32: 1.001-1.007; 8: 1.002-1.029). With sorted steps KK ties the other split methods the benchmark tries (LPT, snake,
LPT with swaps) to 4 decimals and is among the cheapest (~6 µs a pack with the sort). Without the vision terms the
same window scores 1.023-1.074.

Cost of a sample with n tokens, P = Σ t·h·w vision patches and Q = Σ t·(h·w)² (attention is per frame of each image
or video), in units of one text token's dense work (6·N FLOPs, N the text parameters per token, as telemetry.py)::

    n  +  a·n²  +  b·P  +  c·Q
    a = L·d / N                          text attention (6·L·d·n², causal) over dense work
    b = k·N_v / (6·N)                    vision tower per patch (+ windowed attention), k = 6 trained / 2 frozen
    c = 2k·L_v·d_v / (6·N)               full vision attention, not causal (twice the causal count)

For Qwen2.5-VL-7B (the default without a config): a = 1/70,455, b = 0.092 (an image token, 4 patches, costs 1.37
text tokens), c = 1/690,000 (a 2,000-token image's attention adds 93 tokens' worth). The text weight agrees with
telemetry's parameter count to 0.6% on the tiny models, the vision weight to 1% (Qwen2-VL; tests/test_balance.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

__all__ = ["WorkCost", "partition", "schedule", "step_spread"]

#: Qwen2.5-VL-7B-Instruct's config (the parts the cost needs): the default when no model config is given
_QWEN2_5_VL_7B = SimpleNamespace(
    model_type="qwen2_5_vl",
    text_config=SimpleNamespace(
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=18944,
        vocab_size=152064,
    ),
    vision_config=SimpleNamespace(
        hidden_size=1280,
        intermediate_size=3420,
        depth=32,
        out_hidden_size=3584,
        spatial_merge_size=2,
        patch_size=14,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
    ),
)


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
        config = _QWEN2_5_VL_7B if config is None else config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config.text_config
        h, layers, heads = text.hidden_size, text.num_hidden_layers, text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or h // heads
        kv = getattr(text, "num_key_value_heads", None) or heads
        experts = getattr(text, "num_experts", None)
        shared = getattr(text, "shared_expert_intermediate_size", 0) or 0
        # MoE: only the active experts (and a shared one) do work for a token
        mlp = text.num_experts_per_tok * text.moe_intermediate_size + shared if experts else text.intermediate_size
        n_text = layers * (h * head_dim * (2 * heads + 2 * kv) + 3 * h * mlp) + h * text.vocab_size
        softmax_layers = layers - list(getattr(text, "layer_types", None) or []).count("linear_attention")
        k = 6.0 if vision_trainable else 2.0
        v = getattr(config, "vision_config", None)
        patch = vision_attention = 0.0
        if v is not None:
            dim = getattr(v, "embed_dim", None) or v.hidden_size  # Qwen2-VL: embed_dim; hidden_size is its output
            out = getattr(v, "out_hidden_size", None) or v.hidden_size
            inter = getattr(v, "intermediate_size", None) or int(dim * getattr(v, "mlp_ratio", 4))
            gated = config.model_type.startswith("qwen2_5")  # SwiGLU: three matrices; Qwen2-VL / Qwen3-VL: two
            merge = v.spatial_merge_size
            full = getattr(v, "fullatt_block_indexes", None)
            full_layers = len(full) if full is not None else v.depth
            window = (getattr(v, "window_size", 0) or 0) // v.patch_size  # Qwen2.5-VL: patches per window side
            embed = getattr(v, "in_channels", 3) * getattr(v, "temporal_patch_size", 2) * v.patch_size**2 * dim
            merger = dim * dim * merge**2 + dim * out  # runs on merged tokens: per patch, its weights / merge²
            deepstack = len(getattr(v, "deepstack_visual_indexes", None) or []) * merger  # Qwen3-VL: more mergers
            per_patch = v.depth * (4 * dim * dim + (3 if gated else 2) * dim * inter) + embed + merger + deepstack
            per_patch += 2 * (v.depth - full_layers) * 2 * dim * window**2  # windowed attention: linear in patches
            patch = k * per_patch / (6.0 * n_text)
            vision_attention = 2 * k * full_layers * dim / (6.0 * n_text)
        return cls(softmax_layers * heads * head_dim / n_text, patch, vision_attention)

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
