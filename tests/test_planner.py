"""Tests for hf_packing.packing.planner (pure Python/numpy bin packing; CPU only, fast)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_packing.config import STRATEGIES
from hf_packing.packing.planner import StreamingPlanner, plan_packs
from hf_packing.packing.stats import pack_stats, padded_fill_at_batch


def _synthetic_llava_mix(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """LLaVA-like synthetic mix: lognormal lengths (median 600, p99 ~1800), ~6% short text-only.

    Returns `(lengths, images, vision_patches)`; image samples have one image whose vision tokens are
    ~70% of the sample and 4 patches per vision token (2x2 merge).
    """
    rng = np.random.default_rng(seed)
    sigma = math.log(3.0) / 2.3263  # p99 / median = 3
    lengths = np.exp(rng.normal(math.log(600.0), sigma, size=n))
    text = rng.random(n) < 0.06
    lengths[text] = rng.uniform(16, 256, size=int(text.sum()))
    lengths = np.maximum(lengths.round().astype(np.int64), 1)
    images = (~text).astype(np.int64)
    patches = np.where(text, 0, (lengths * 0.7).astype(np.int64) * 4)
    return lengths, images, patches


# --------------------------------------------------------------------------- hand-computed bins

LENGTHS = [5, 4, 3, 3, 2, 1]


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        # input order: 5 | 4+3 | 3+2+1
        ("next_fit", [[0], [1, 2], [3, 4, 5]]),
        # 5->b0(3 left), 4->b1(4), 3->b0 (tightest), 3->b1(1), 2->b2, 1->b1
        ("bfd", [[0, 2], [1, 3, 5], [4]]),
    ],
)
def test_hand_computed_whole(strategy: str, expected: list[list[int]]) -> None:
    assert plan_packs(LENGTHS, max_length=8, strategy=strategy) == expected


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        ("next_fit", [[0, 1], [2], [3]]),
        # sorted: 7(i2), 4(i0), 4(i3), 1(i1); bins 7 (3 left) and 4+4 (2 left)
        ("bfd", [[2], [0, 3, 1]]),  # 1 -> tightest bin (first fit would take the older 7)
    ],
)
def test_bfd_picks_tightest_bin(strategy: str, expected: list[list[int]]) -> None:
    assert plan_packs([4, 1, 7, 4], max_length=10, strategy=strategy) == expected


@pytest.mark.parametrize(
    ("strategy", "streamed", "whole"),
    [
        ("next_fit", [[0, 1], [2, 3], [4, 5, 6], [7]], [[0, 1], [2, 3], [4, 5, 6], [7]]),
        # window [6,2,5]: 6+2 closes (0 left), 5 (3 left) carries over and takes a 3 next window.
        ("bfd", [[0, 1], [2, 3], [5, 4], [7, 6]], [[0, 1], [2, 3], [5, 4, 6], [7]]),
    ],
)
def test_hand_computed_streaming(strategy: str, streamed: list[list[int]], whole: list[list[int]]) -> None:
    lengths = [6, 2, 5, 3, 3, 4, 1, 2]
    assert plan_packs(lengths, max_length=8, strategy=strategy, buffer_size=3) == streamed
    assert plan_packs(lengths, max_length=8, strategy=strategy) == whole


def test_idle_carried_bin_is_closed() -> None:
    # Window 1 [6, 1]: one bin with 3 left carries over. Window 2 [5, 5] puts nothing into it, so it
    # is closed at the end of window 2 (before the 3 of window 3 could fill it).
    assert plan_packs([6, 1, 5, 5, 3], max_length=10, buffer_size=2) == [[0, 1], [2, 3], [4]]


def test_max_open_bins_closes_fullest() -> None:
    planner = StreamingPlanner(max_length=10, buffer_size=3, max_open_bins=1)
    # 6+1 (3 left) and 5 (5 left) stay open; over the cap of 1, the fuller (6+1) is closed.
    assert planner.extend([6, 5, 1]) == [[0, 2]]
    assert planner.num_open_bins == 1
    assert planner.flush() == [[1]]


def test_close_threshold() -> None:
    # 17 + 1 leaves 2 tokens: with close_threshold=2 the bin closes after the window ...
    planner = StreamingPlanner(max_length=20, buffer_size=2, close_threshold=2)
    assert planner.extend([17, 1]) == [[0, 1]]
    # ... with 0 it stays open and the 2 of the next window fills it.
    planner = StreamingPlanner(max_length=20, buffer_size=2, close_threshold=0)
    assert planner.extend([17, 1]) == []
    assert planner.extend([5, 2]) == [[0, 1, 3]]
    assert planner.flush() == [[2]]


def test_open_packs_carry_over() -> None:
    # The picture in the module docstring: pack 0 (13 tokens) is open from the previous window; window
    # [10, 6, 5, 4, 2] closes it (room 1 < shortest sample 2) and the full 10+6, and keeps 5+4 open (room 7).
    planner = StreamingPlanner(max_length=16, buffer_size=5)
    state = planner.state_dict()
    state.update(open_bins=[[0, [100], [13], [], []]], next_bin_id=1, min_length_seen=13)
    planner.load_state_dict(state)
    assert planner.extend([10, 6, 5, 4, 2], indices=[1, 2, 3, 4, 5]) == [[100, 5], [1, 2]]
    assert planner.state_dict()["open_bins"] == [[2, [3, 4], [5, 4], [], []]]
    # 12, 11, 1, 1, 1 longest first: 12 and 11 each open a pack (room 7 is too small), the 1s go to the tightest
    # (the 12's, room 4); 5+4 got nothing this window and closes.
    assert planner.extend([12, 11, 1, 1, 1], indices=[6, 7, 8, 9, 10]) == [[3, 4]]
    assert planner.flush() == [[6, 8, 9, 10], [7]]


def test_carry_over() -> None:
    # Windows of one sample: open packs carried over fill up; without carry-over they cannot.
    assert plan_packs([3, 3, 3], max_length=10, buffer_size=1) == [[0, 1, 2]]
    planner = StreamingPlanner(max_length=10, buffer_size=1, max_open_bins=0)
    assert planner.extend([3, 3, 3]) + planner.flush() == [[0], [1], [2]]


# --------------------------------------------------------------------------- budgets


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        ("next_fit", [[0, 1], [2, 3]]),
        ("bfd", [[0, 1], [2, 3]]),
    ],
)
def test_image_budget(strategy: str, expected: list[list[int]]) -> None:
    packs = plan_packs([2, 2, 2, 2], max_length=100, strategy=strategy, images=[1, 1, 1, 1], max_images=2)
    assert packs == expected


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        ("next_fit", [[0, 1], [2]]),
        ("bfd", [[0, 1], [2]]),
    ],
)
def test_patch_budget(strategy: str, expected: list[list[int]]) -> None:
    packs = plan_packs([3, 3, 3], max_length=100, strategy=strategy, vision_patches=[5, 5, 5], max_vision_patches=10)
    assert packs == expected


def test_bfd_picks_tightest_bin_that_fits_images() -> None:
    # 6 (img) -> b0 (4 left, images full); 5 (text) -> b1 (5 left); 3 (img): b0 is tighter but has no
    # image room, so it goes to b1.
    packs = plan_packs([6, 5, 3], max_length=10, images=[1, 0, 1], max_images=1)
    assert packs == [[0], [1, 2]]
    # A text-only sample may still go into the image-full bin.
    packs = plan_packs([4, 3, 2, 1], max_length=10, images=[1, 1, 0, 1], max_images=2)
    assert packs == [[0, 1, 2], [3]]


@pytest.mark.parametrize("budget", ["images", "patches"])
def test_bfd_searches_past_packs_without_media_room(budget: str) -> None:
    # Ten packs of 12 tokens and one image each (room 8, no media room) are tighter than the text-only pack
    # of 10 (room 10). The 5-token sample with media walks past all ten to the pack that fits every budget.
    lengths, media = [12] * 10 + [10, 5], [1] * 10 + [0, 1]
    names = ("images", "max_images") if budget == "images" else ("vision_patches", "max_vision_patches")
    packs = plan_packs(lengths, max_length=20, **dict(zip(names, (media, 1))))  # type: ignore[arg-type]
    assert packs == [[i] for i in range(10)] + [[10, 11]]


def test_pack_without_media_room_closes() -> None:
    # 10 (one image) + 10 (text) leaves 80 tokens but no image room: closed after the window instead of
    # waiting indefinitely for text-only samples.
    planner = StreamingPlanner(max_length=100, buffer_size=2, max_images=1)
    assert planner.extend([10, 10], images=[1, 0]) == [[0, 1]]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("buffer_size", [None, 2])
def test_oversized_samples_dropped(strategy: str, buffer_size: int | None) -> None:
    lengths = [3, 20, 4, 2, 1]
    images = [0, 0, 0, 5, 1]
    patches = [0, 0, 99, 0, 1]
    packs = plan_packs(
        lengths,
        max_length=10,
        strategy=strategy,
        images=images,
        max_images=2,
        vision_patches=patches,
        max_vision_patches=50,
        buffer_size=buffer_size,
    )
    flat = sorted(i for p in packs for i in p)
    assert flat == [0, 4]  # 1: too long, 2: too many patches, 3: too many images
    stats = pack_stats(packs, lengths, 10, images)
    assert stats["dropped"] == 3


def test_planner_counts_dropped() -> None:
    planner = StreamingPlanner(max_length=5)
    assert planner.add(0, 9) == []
    assert planner.add(1, 5) == []
    assert planner.num_dropped == 1
    assert planner.flush() == [[1]]


def test_budgets_without_per_sample_counts_raise() -> None:
    with pytest.raises(ValueError, match="max_images"):
        plan_packs([1, 2], max_length=8, max_images=2)
    with pytest.raises(ValueError, match="max_vision_patches"):
        plan_packs([1, 2], max_length=8, max_vision_patches=2)


# --------------------------------------------------------------------------- validation


def test_errors_name_the_setting() -> None:
    with pytest.raises(ValueError, match="strategy.*'next_fit', 'bfd'"):
        plan_packs([1], max_length=8, strategy="first_fit")
    with pytest.raises(ValueError, match="max_length"):
        plan_packs([1], max_length=0)
    with pytest.raises(TypeError, match="max_length"):
        plan_packs([1], max_length=8.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="buffer_size"):
        plan_packs([1], max_length=8, buffer_size=0)
    with pytest.raises(ValueError, match="lengths"):
        plan_packs([1, -1], max_length=8)
    with pytest.raises(ValueError, match="images"):
        plan_packs([1, 2], max_length=8, images=[1], max_images=2)
    with pytest.raises(TypeError, match="positional"):
        plan_packs([1], 8)  # type: ignore[misc]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_empty_input(strategy: str) -> None:
    assert plan_packs([], max_length=8, strategy=strategy) == []
    assert plan_packs([], max_length=8, strategy=strategy, buffer_size=4) == []


def test_no_torch_import() -> None:
    code = "import sys, hf_packing.packing.planner; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_add_rejects_negative_counts() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        StreamingPlanner(max_length=8).add(0, 3, images=-1)


# --------------------------------------------------------------------------- properties

BUDGETS = st.fixed_dictionaries(
    {
        "max_length": st.integers(1, 40),
        "max_images": st.none() | st.integers(0, 4),
        "max_vision_patches": st.none() | st.integers(0, 60),
    }
)


@st.composite
def problems(draw: st.DrawFn) -> dict:
    budgets = draw(BUDGETS)
    n = draw(st.integers(0, 60))
    ml = budgets["max_length"]
    lengths = draw(st.lists(st.integers(0, ml + 5), min_size=n, max_size=n))
    images = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    patches = draw(st.lists(st.integers(0, 30), min_size=n, max_size=n))
    return {
        **budgets,
        "lengths": lengths,
        "images": images,
        "patches": patches,
        "strategy": draw(st.sampled_from(STRATEGIES)),
        "buffer_size": draw(st.none() | st.integers(1, 12)),
    }


def _check_plan(p: dict, packs: list[list[int]]) -> None:
    lengths, images, patches = p["lengths"], p["images"], p["patches"]
    mi, mp, ml = p["max_images"], p["max_vision_patches"], p["max_length"]

    def oversize(i: int) -> bool:
        return lengths[i] > ml or (mi is not None and images[i] > mi) or (mp is not None and patches[i] > mp)

    flat = [i for pack in packs for i in pack]
    assert len(flat) == len(set(flat)), "a sample is in two packs"
    assert sorted(flat) == [i for i in range(len(lengths)) if not oversize(i)]
    for pack in packs:
        assert pack, "empty pack"
        assert sum(lengths[i] for i in pack) <= ml
        if mi is not None:
            assert sum(images[i] for i in pack) <= mi
        if mp is not None:
            assert sum(patches[i] for i in pack) <= mp


def _plan(p: dict, **overrides: object) -> list[list[int]]:
    kwargs = {
        "max_length": p["max_length"],
        "strategy": p["strategy"],
        "images": p["images"] if p["max_images"] is not None else None,
        "max_images": p["max_images"],
        "vision_patches": p["patches"] if p["max_vision_patches"] is not None else None,
        "max_vision_patches": p["max_vision_patches"],
        "buffer_size": p["buffer_size"],
    }
    kwargs.update(overrides)
    return plan_packs(p["lengths"], **kwargs)  # type: ignore[arg-type]


def _planner(p: dict) -> StreamingPlanner:
    return StreamingPlanner(
        max_length=p["max_length"],
        strategy=p["strategy"],
        max_images=p["max_images"],
        max_vision_patches=p["max_vision_patches"],
        buffer_size=p["buffer_size"],
    )


FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(problems())
def test_property_cover_and_budgets(p: dict) -> None:
    packs = _plan(p)
    _check_plan(p, packs)
    assert packs == _plan(p), "not deterministic"


@FAST
@given(problems())
def test_property_add_equals_extend(p: dict) -> None:
    planner = _planner(p)
    packs: list[list[int]] = []
    for i, (length, im, pa) in enumerate(zip(p["lengths"], p["images"], p["patches"])):
        packs += planner.add(i, length, im, pa)
    packs += planner.flush()
    assert packs == _plan(p)


@FAST
@given(problems(), st.data())
def test_property_state_dict_resume(p: dict, data: st.DataObject) -> None:
    n = len(p["lengths"])
    cut = data.draw(st.integers(0, n))
    media = {"images": p["images"], "patches": p["patches"]}
    full = _planner(p)
    expected = full.extend(p["lengths"], **media) + full.flush()

    first = _planner(p)
    got = first.extend(p["lengths"][:cut], images=p["images"][:cut], patches=p["patches"][:cut])
    state = json.loads(json.dumps(first.state_dict()))
    resumed = _planner(p)
    resumed.load_state_dict(state)
    got += resumed.extend(p["lengths"][cut:], images=p["images"][cut:], patches=p["patches"][cut:])
    got += resumed.flush()
    assert got == expected
    assert resumed.num_dropped == full.num_dropped


@FAST
@given(problems())
def test_property_next_fit_streaming_equals_whole(p: dict) -> None:
    p = {**p, "strategy": "next_fit"}
    assert _plan(p) == _plan(p, buffer_size=None)


@FAST
@given(problems())
def test_property_next_fit_keeps_input_order(p: dict) -> None:
    packs = _plan({**p, "strategy": "next_fit"})
    flat = [i for pack in packs for i in pack]
    assert flat == sorted(flat)


COLUMNS = ("lengths", "images", "patches")


def _reference_bfd(p: dict) -> list[list[int]]:
    """Whole-dataset best fit decreasing, quadratic and obvious: longest first (stable), into the pack with the
    least token room that fits every budget (ties: the oldest), else a new pack."""
    ml, mi, mp = p["max_length"], p["max_images"], p["max_vision_patches"]
    size = [
        (p["lengths"][i], p["images"][i] if mi is not None else 0, p["patches"][i] if mp is not None else 0)
        for i in range(len(p["lengths"]))
    ]
    bins: list[list] = []  # [items, tokens, images, patches]
    for i in sorted(range(len(size)), key=lambda i: -size[i][0]):
        t, im, pa = size[i]
        if t > ml or (mi is not None and im > mi) or (mp is not None and pa > mp):
            continue
        fits = [
            b for b in bins if b[1] + t <= ml and (mi is None or b[2] + im <= mi) and (mp is None or b[3] + pa <= mp)
        ]
        if fits:
            b = min(fits, key=lambda b: ml - b[1])  # min keeps the first (oldest) among equal room
            b[0].append(i)
            b[1], b[2], b[3] = b[1] + t, b[2] + im, b[3] + pa
        else:
            bins.append([[i], t, im, pa])
    return [b[0] for b in bins]


@FAST
@given(problems())
def test_property_whole_dataset_bfd_matches_reference(p: dict) -> None:
    assert _plan(p, strategy="bfd", buffer_size=None) == _reference_bfd(p)


@FAST
@given(problems(), st.integers(1, 12))
def test_property_bfd_without_carry_over_plans_each_window_alone(p: dict, k: int) -> None:
    planner = StreamingPlanner(
        max_length=p["max_length"],
        max_images=p["max_images"],
        max_vision_patches=p["max_vision_patches"],
        buffer_size=k,
        max_open_bins=0,
    )
    got = planner.extend(p["lengths"], images=p["images"], patches=p["patches"]) + planner.flush()
    kept = [i for i in range(len(p["lengths"])) if _reference_bfd({**p, **{c: [p[c][i]] for c in COLUMNS}})]
    expected = []
    for start in range(0, len(kept), k):  # windows of k samples that fit the budgets
        window = kept[start : start + k]
        packs = _reference_bfd({**p, **{c: [p[c][i] for i in window] for c in COLUMNS}})
        expected += [[window[j] for j in pack] for pack in packs]
    assert got == expected


@FAST
@given(problems())
def test_property_slack_budgets_match_tokens_only(p: dict) -> None:
    # The media code path (the walk past packs without media room) must agree with the token-only fast path when
    # the image/patch budgets can never bind.
    tokens_only = _plan(p, images=None, max_images=None, vision_patches=None, max_vision_patches=None)
    slack = _plan(
        p,
        images=p["images"],
        max_images=10**6,
        vision_patches=p["patches"],
        max_vision_patches=10**9,
    )
    assert slack == tokens_only


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_mid_stream_with_add(strategy: str) -> None:
    lengths, images, patches = _synthetic_llava_mix(3000, seed=7)
    kwargs = {"max_length": 4096, "buffer_size": 100, "max_images": 6, "max_vision_patches": 9000}
    ref = StreamingPlanner(strategy=strategy, **kwargs)
    expected = ref.extend(lengths, images=images, patches=patches) + ref.flush()
    a = StreamingPlanner(strategy=strategy, **kwargs)
    got: list[list[int]] = []
    for i in range(1234):
        got += a.add(i, int(lengths[i]), int(images[i]), int(patches[i]))
    b = StreamingPlanner(strategy=strategy, **kwargs)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for i in range(1234, len(lengths)):
        got += b.add(i, int(lengths[i]), int(images[i]), int(patches[i]))
    got += b.flush()
    assert got == expected


def test_load_state_dict_rejects_other_settings() -> None:
    a = StreamingPlanner(max_length=64, buffer_size=4)
    a.extend([1, 2, 3])
    b = StreamingPlanner(max_length=128, buffer_size=4)
    with pytest.raises(ValueError, match="max_length"):
        b.load_state_dict(a.state_dict())
    state = {**a.state_dict(), "version": 2}
    with pytest.raises(ValueError, match="version 2"):
        StreamingPlanner(max_length=64, buffer_size=4).load_state_dict(state)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_state_dict_holds_every_sample_not_yet_emitted(strategy: str) -> None:
    # `stream.py` (the replica) relies on it: open packs list their sample indices second, pending samples
    # under "indices".
    lengths, images, _ = _synthetic_llava_mix(300, seed=1)
    planner = StreamingPlanner(max_length=4096, strategy=strategy, buffer_size=64, max_images=6)
    emitted = {i for pack in planner.extend(lengths, images=images) for i in pack}
    state = json.loads(json.dumps(planner.state_dict()))
    held = {i for b in state["open_bins"] for i in b[1]} | set(state["pending"]["indices"])
    assert held and emitted and held.isdisjoint(emitted)
    assert held | emitted == set(range(300))
    again = StreamingPlanner(max_length=4096, strategy=strategy, buffer_size=64, max_images=6)
    again.load_state_dict(state)
    assert again.state_dict() == state


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("buffer_size", [None, 128])
def test_determinism(strategy: str, buffer_size: int | None) -> None:
    lengths, images, patches = _synthetic_llava_mix(2000, seed=3)
    kw = {
        "max_length": 4096,
        "strategy": strategy,
        "buffer_size": buffer_size,
        "images": images,
        "max_images": 8,
        "vision_patches": patches,
        "max_vision_patches": 12000,
    }
    assert plan_packs(lengths, **kw) == plan_packs(lengths, **kw)


# --------------------------------------------------------------------------- quality / stats


@pytest.mark.parametrize("max_length", [8192, 16384])
def test_streaming_bfd_fill_target(max_length: int) -> None:
    lengths, _, _ = _synthetic_llava_mix(60_000, seed=0)
    packs = plan_packs(lengths, max_length=max_length, strategy="bfd", buffer_size=1000)
    stats = pack_stats(packs, lengths, max_length)
    assert stats["fill"] >= 0.995
    assert stats["dropped"] == 0
    whole = pack_stats(plan_packs(lengths, max_length=max_length), lengths, max_length)
    assert whole["fill"] >= stats["fill"] - 1e-3
    nf = pack_stats(plan_packs(lengths, max_length=max_length, strategy="next_fit"), lengths, max_length)
    assert nf["fill"] < stats["fill"]


def test_pack_stats_empty_plan() -> None:
    s = pack_stats([], [3, 4], 8)
    assert (s["num_packs"], s["dropped"], s["fill"], s["mean_images_per_pack"]) == (0, 2, 0.0, None)


def test_pack_stats_values() -> None:
    lengths = [5, 4, 3, 3, 2, 1, 100]
    images = [1, 0, 2, 0, 1, 0, 0]
    packs = [[0, 2], [1, 3, 5], [4]]
    s = pack_stats(packs, lengths, 8, images, batch_size=2)
    assert s["num_packs"] == 3
    assert s["num_samples"] == 6
    assert s["dropped"] == 1
    assert s["fill"] == pytest.approx(18 / 24)
    assert s["mean_images_per_pack"] == pytest.approx(4 / 3)
    assert s["max_images_per_pack"] == 3
    assert s["max_tokens_per_pack"] == 8
    # packed samples in input order: [5,4 | 3,3 | 2,1] -> slots 10 + 6 + 4 = 20
    assert s["padded_batch_fill"] == pytest.approx(18 / 20)
    assert s["padding_ratio_padded_batches"] == pytest.approx(2 / 20)
    assert pack_stats(packs, lengths, 8)["mean_images_per_pack"] is None


def test_padded_fill_at_batch() -> None:
    assert padded_fill_at_batch([4, 2, 1], batch_size=2) == pytest.approx(7 / (8 + 1))
    assert padded_fill_at_batch([], batch_size=8) == 1.0


def test_the_planner_records_which_budget_closed_each_pack():
    """Tiny literal plans with exact counts: tokens, images and patches each close packs, also at the flush when a pack
    can take no further sample; `end` is a pack the input left with room; the counts resume with the state."""
    lengths, images, patches = [6, 5, 5, 2, 2, 2, 1], [0, 0, 1, 1, 1, 0, 0], [0, 0, 4, 4, 4, 0, 0]
    nf = StreamingPlanner(max_length=10, strategy="next_fit", max_images=2)
    # 6+5 > 10 and 10+2 > 10: tokens; the flushed pack holds 2 of 2 images
    assert nf.extend(lengths, images=images, patches=patches) + nf.flush() == [[0], [1, 2], [3, 4, 5, 6]]
    assert nf.closed_by == {"tokens": 2, "images": 1, "patches": 0, "open_packs": 0, "end": 0}
    nf = StreamingPlanner(max_length=100, strategy="next_fit", max_images=2)
    assert nf.extend(lengths, images=images) + nf.flush() == [[0, 1, 2, 3], [4, 5, 6]]  # a 3rd image: images
    assert nf.closed_by == {"tokens": 0, "images": 1, "patches": 0, "open_packs": 0, "end": 1}
    nf = StreamingPlanner(max_length=100, strategy="next_fit", max_vision_patches=8)
    assert nf.extend(lengths, patches=patches) + nf.flush() == [[0, 1, 2, 3], [4, 5, 6]]  # 12 > 8 patches
    assert nf.closed_by == {"tokens": 0, "images": 0, "patches": 1, "open_packs": 0, "end": 1}
    # BFD, window [5, 5, 4i, 4i]: 5+5 full (tokens); each 4i alone, with no image room left (images); the flushed
    # [3, 3, 1] has room (end)
    bfd = StreamingPlanner(max_length=10, max_images=1, buffer_size=4)
    packs = bfd.extend([5, 5, 4, 4, 3, 3, 1], images=[0, 0, 1, 1, 0, 0, 0]) + bfd.flush()
    assert packs == [[0, 1], [2], [3], [4, 5, 6]]
    assert bfd.closed_by == {"tokens": 1, "images": 2, "patches": 0, "open_packs": 0, "end": 1}
    half = StreamingPlanner(max_length=10, max_images=1, buffer_size=4)
    assert half.extend([5, 5, 4, 4], images=[0, 0, 1, 1]) == packs[:3]
    resumed = StreamingPlanner(max_length=10, max_images=1, buffer_size=4)
    resumed.load_state_dict(half.state_dict())
    assert resumed.extend([3, 3, 1], indices=[4, 5, 6], images=[0, 0, 0]) + resumed.flush() == packs[3:]
    assert resumed.closed_by == bfd.closed_by
