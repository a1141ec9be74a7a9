"""Bin-packing planner for padding-free training: which samples go into which pack.

This package works on plain numbers (token counts, image counts, vision-patch counts) and never
imports torch, so it can run in a data-loading worker, a preprocessing script or a test without a
GPU stack. It answers one question: given per-sample lengths and per-pack budgets, which sample
indices form each pack?

Budgets (per pack):

- tokens: `max_length` (hard; a pack's Σ length never exceeds it),
- images: `max_images` (optional; Σ per-sample image counts),
- vision patches: `max_vision_patches` (optional; Σ per-sample `t·h·w` over its images/videos).

A sample that alone exceeds a budget is dropped (it is in no pack); every other sample is in exactly
one pack.

Strategies:

- `"next_fit"`: input order, one open pack; a new pack starts when the sample does not fit.
  Order-preserving, streaming-friendly, lowest fill.
- `"ffd"`: first-fit decreasing (longest first, earliest pack that fits; segment tree, O(n log n)).
- `"bfd"`: best-fit decreasing (longest first, the pack with the least remaining token room that
  still fits every budget, ties to the oldest pack; bisect over a sorted list of remaining
  capacities, O(n log n); with image/patch budgets, a segment tree over remaining token room finds
  the tightest pack that fits them all when the first few candidates do not).
- `"balanced"`: k = ceil(Σ tokens / max_length) packs (at least Σ images / max_images and
  Σ patches / max_vision_patches; more if infeasible), longest sample first to the currently
  least-loaded pack that fits (Eagle 2 / nanoVLM-style knapsack balancing). Packs come out with
  near-equal totals (without media budgets the spread is at most the longest sample), which
  matters when each rank/step should see the same work.

Streaming (`buffer_size=k`): the input is planned in windows of k samples. After each window
(`ffd`/`bfd`) a pack is closed when it is full -- token room <= `close_threshold` (default 0.5% of
`max_length`) or smaller than the shortest sample seen so far; with media budgets also when it can
no longer take any image-bearing sample -- or when it was carried over and received nothing during
the window. Closed packs are emitted in creation order; the others stay open and are offered to the
next window's samples, so the stream approaches whole-dataset fill. At most
`max_open_bins` (default `buffer_size`) packs stay open; beyond that the fullest are closed.
`bfd` also re-plans open packs (`repack_windows`, default 2): a pack created in this window that is
not full stays open even when no sample fits it any more, and the next window dissolves it and
plans its samples again together with the new ones (longest first), so leftovers get recombined
instead of being emitted with a gap. A sample is re-planned by at most `repack_windows` later
windows; a pack holding one that was re-planned that often is kept as a pack and follows the rules
above. At most `repack_budget` samples (default `buffer_size // 4`, emptiest packs first) are
re-planned per window, which bounds the extra work; with media budgets only packs whose fullest
budget is tokens are re-planned (when images/patches bind, re-planning cost 0.1-0.3% more packs).
`next_fit` streaming is identical to whole-dataset `next_fit`; `balanced` plans every window on its
own (no carry-over: it balances a fixed set of packs). Memory is O(buffer_size + max_open_bins).

Trade-off, measured with `python -m hf_packing.planner` (synthetic LLaVA-like mix of 1M samples:
lognormal lengths, median ~600 / p99 ~1800 tokens, 6% short text-only samples; fill = Σ tokens /
(packs · max_length); throughput on one core, lengths only, best of 3, noisy shared machine):

==================================  ============  =============  ====================
strategy                            fill @ 8192   fill @ 16384   items/s @ 8192
==================================  ============  =============  ====================
next_fit                            0.9493        0.9748         ~4.5M
ffd, whole dataset                  0.99997       0.99997        ~0.4M
bfd, whole dataset                  0.99997       0.99997        ~0.75M
bfd, buffer_size=1000               0.99976       0.99989        ~1.8M (>= 1.3M seen)
bfd, buffer_size=1000, no re-plan   0.99972       0.99986        ~2.2M (repack_windows=0)
bfd, buffer_size=1000, no carry     0.99345       0.98726        (max_open_bins=0)
balanced, whole dataset             0.9906        0.9977         ~0.2M
balanced, buffer_size=1000          0.9858        0.9852         ~1.2M
padded batches of 8, input order    0.5286 slot utilisation (no packing)
==================================  ============  =============  ====================

Streaming BFD, buffer_size=1000, on the mixes of `benchmarks/bench_packing.py` (llava: 100k samples,
docs: 20k high-resolution document samples of ~1,100-16,000 tokens; samples > max_length dropped
first), without -> with re-planning, whole dataset for reference:

=============  ===================  ===================  ==============
mix @ length   repack_windows=0     default              whole dataset
=============  ===================  ===================  ==============
llava @ 8192   0.99930 (8264 pk)    0.99954 (8262 pk)    0.99966
llava @ 16384  0.99954 (4131 pk)    0.99954 (4131 pk)    0.99978
docs @ 8192    0.95926 (9229 pk)    0.96072 (9215 pk)    0.96281
docs @ 16384   0.99430 (7186 pk)    0.99541 (7178 pk)    0.99597
=============  ===================  ===================  ==============

Items/s on llava @ 8192 (one core, best of 9, same machine): ~2.2M -> ~1.8M; docs @ 8192, where
many packs stay open, ~0.9M -> ~0.6M.

So streaming BFD over a 1000-sample window loses ~0.02% fill against planning the whole dataset
on the LLaVA-like mixes and ~0.06% on large document samples, and carrying unfinished packs over
is what gets it there (0.9935 -> 0.9998 at 8192, 0.9873 -> 0.9999 at 16384); re-planning them
is what closes most of the remaining gap on long samples (docs @ 16384: 0.9943 -> 0.9954, whole
dataset 0.9960). `next_fit` keeps input order but wastes ~5% of every step at 8192 tokens;
`balanced` trades ~1% fill for packs of near-equal size. With image/patch budgets set but not
binding, BFD with buffer 1000 gives the same packs at ~0.8M items/s; when a budget binds on most
packs (e.g. `max_images=8` here) an exact segment-tree query runs per sample, ~0.12M items/s. When
two media budgets bind at once, token-tightest best fit is not always better than `next_fit` (on
this mix with `max_images=12, max_vision_patches=20000` at 8192: bfd 19.6k packs, next_fit 18.9k,
lower bound 17.6k).
"""

from __future__ import annotations

from ._checks import STRATEGIES
from ._synthetic import _synthetic_llava_mix as _synthetic_llava_mix  # used by the tests
from .plan import plan_packs
from .stats import pack_stats, padded_fill_at_batch
from .streaming import StreamingPlanner

__all__ = [
    "STRATEGIES",
    "StreamingPlanner",
    "pack_stats",
    "padded_fill_at_batch",
    "plan_packs",
]
