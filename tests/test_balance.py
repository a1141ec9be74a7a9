"""Rank balance: a pack's cost against `training_flops` of the batch (the one cost model), exact splits and schedules
on literal inputs, and the vision term changing an assignment (negative control: text cost alone balances the
image-heavy case worse)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from hf_packing.packing.balance import WorkCost, model_flops, partition, schedule, step_spread
from hf_packing.testing.tiny import GLM_TYPES, MODEL_TYPES, build_tiny_model
from hf_packing.training.flops import cost_model, training_flops


def test_default_cost_is_qwen2_5_vl_7b():
    """The weights without a config, worked by hand from Qwen2.5-VL-7B's published shapes (not from the cost model).

    Text, per layer: q, o 3584²; k, v 3584·512; gated MLP 3·3584·18944 = 233,046,016; × 28 layers + the LM head
    3584·152064 = N = 7,070,285,824; one token's unit 6·N = 42,421,714,944 FLOPs; attention per n²: 6·28·3584.
    Tower: patch embedding 3·2·14·14·1280 = 1,505,280; per block qkv 1280·3840, proj 1280², gated MLP 3·1280·3420 =
    19,686,400, × 32 = 629,964,800; merger 5120² + 5120·3584 = 44,564,480 on a quarter of the patches. Forward per
    patch: 2·(1,505,280 + 629,964,800 + 44,564,480 / 4) = 1,285,222,400, and the 28 windowed blocks' attention over
    whole windows of 8×8 patches 4·1280·28·64 = 9,175,040: 1,294,397,440 frozen; trained ×3 less the pixels' gradient
    (2·1,505,280): 3,880,181,760. Frame attention per (h·w)²: 4·1280 in the 4 full blocks, ×3 trained."""
    unit = 42_421_714_944
    cost, frozen = WorkCost.from_config(), WorkCost.from_config(vision_trainable=False)
    assert WorkCost.unit(model_flops()) == unit
    assert cost.attention == pytest.approx(6 * 28 * 3584 / unit, rel=1e-12) and round(1 / cost.attention) == 70_455
    assert cost.patch == pytest.approx(3_880_181_760 / unit, rel=1e-12)  # 0.0915 of a text token
    assert frozen.patch == pytest.approx(1_294_397_440 / unit, rel=1e-12)
    assert cost.vision_attention == pytest.approx(3 * 4 * 1280 * 4 / unit, rel=1e-12)
    assert frozen.vision_attention == pytest.approx(4 * 1280 * 4 / unit, rel=1e-12)
    assert frozen.attention == cost.attention  # the text side does not depend on the tower
    # a 1000-token text sample: 1000 tokens' dense work and 1000² · 6·28·3584 FLOPs of attention, in token units
    assert cost.sample(1000) == pytest.approx(1000 + 1000**2 * 602_112 / unit, rel=1e-12)
    # one 1×16×16 image: 256 patches and one frame of 256² in the full blocks
    image = cost.sample(0, 256, 256**2)
    assert image == pytest.approx((256 * 3_880_181_760 + 256**2 * 61_440) / unit, rel=1e-12)


#: per family, two samples: (tokens, vision grids); the Qwen2.5-VL tiny tower's windows are 4×4 patches, so these
#: frames are whole windows (the packer's window estimate is then exact)
SAMPLES = {"qwen2_5_vl": [(40, [[1, 8, 12]]), (70, [[2, 4, 8], [1, 12, 4]])]}
EDGE = [(30, [[1, 6, 10]])]  # Qwen2.5-VL: windows cut at the frame's edge


def _batch(samples) -> dict:
    lengths = [n for n, _ in samples]
    return {
        "input_ids": torch.zeros(1, sum(lengths), dtype=torch.long),
        "cu_seqlens": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32),
        "image_grid_thw": torch.tensor([g for _, grids in samples for g in grids]),
    }


def _pack_flops(cost: WorkCost, unit: float, samples) -> float:
    """What the packer weighs a pack by, in FLOPs: Σ over samples of `WorkCost.sample` from its metadata × unit."""
    total = 0.0
    for tokens, grids in samples:
        patches = sum(t * h * w for t, h, w in grids)
        squares = sum(t * (h * w) ** 2 for t, h, w in grids)
        total += cost.sample(tokens, patches, squares)
    return total * unit


@pytest.mark.parametrize("model_type", MODEL_TYPES + GLM_TYPES)
@pytest.mark.parametrize("frozen", [False, True])
def test_a_packs_cost_is_its_training_flops(model_type, frozen):
    """The packer's cost of a pack (from metadata and the config alone) × one token's FLOPs = `training_flops` of the
    batch (from the loaded model; itself against FlopCounterMode in test_flops.py), every family, trained and frozen
    tower. Qwen4-Exp: the packer sees only Σ len², so it counts the QSA layers as dense causal attention (the
    documented upper bound, `hf_packing.ops.flops`): equal to `training_flops`' vision + the text with no QSA layer,
    above the exact count. Negative control: Qwen2.5-VL frames cut into edge windows, where the packer's estimate
    (whole windows) must be above the exact count, by more than the tolerance."""
    model = build_tiny_model(model_type)
    model.model.visual.requires_grad_(not frozen)
    cost = WorkCost.from_config(model.config, vision_trainable=not frozen)
    counts = model_flops(model.config, vision_trainable=not frozen)
    assert counts == cost_model(model)  # the meta-built model's weights are the loaded model's
    samples = SAMPLES.get(model_type, [(40, [[1, 6, 10]]), (70, [[2, 4, 8], [1, 12, 4]])])
    flops = training_flops(model, _batch(samples))
    exact = flops["total"]
    ours = _pack_flops(cost, WorkCost.unit(counts), samples)
    print(f"{model_type} frozen={frozen}: packer {ours:.6e} training_flops {exact:.6e}")
    if counts.qsa_layers:
        dense = dataclasses.replace(counts, qsa_layers=0).text_of([n for n, _ in samples]) + flops["vision"]
        assert ours == pytest.approx(dense, rel=1e-9) and ours > exact and ours != pytest.approx(exact, rel=1e-3)
    else:
        assert ours == pytest.approx(exact, rel=1e-9)
    if model_type == "qwen2_5_vl":
        edge_exact = training_flops(model, _batch(EDGE))["total"]
        edge = _pack_flops(cost, WorkCost.unit(counts), EDGE)
        print(f"edge windows: packer {edge:.6e} training_flops {edge_exact:.6e}")
        assert edge > edge_exact and edge != pytest.approx(edge_exact, rel=1e-3)


def test_partition_literal():
    costs = [8, 7, 6, 5, 4, 0]
    parts = partition(costs, 2)  # chunks (8,7) (6,5) (4,0): (4,0)+(7,8) -> 11/8, then +(5,6) -> 16/14
    assert [sum(costs[i] for i in p) for p in parts] == [16, 14]
    assert parts == [[1, 3, 4], [0, 2, 5]]


def test_partition_refuses_uneven_counts():
    with pytest.raises(ValueError, match="world=2"):
        partition([1, 2, 3], 2)


def test_schedule_literal():
    # sorted: 6 (9), 0 (5), 2 (4), 4 (3), 5 (3), 3 (2), 1 (1), 7 (0); steps of 2 ranks x 2 packs
    groups = schedule([5, 1, 4, 2, 3, 3, 9, 0], world=2, per_rank=2)
    assert groups == [[0, 4], [2, 6], [1, 5], [3, 7]]  # step 1: rank 0 {5, 4}, rank 1 {3, 9}; step 2: {1, 2}, {3, 0}
    assert schedule([3, 1, 2], world=1) == [[0], [1], [2]]  # one rank: data order
    with pytest.raises(ValueError, match="world=2"):
        schedule([1, 2, 3], world=2)


def test_vision_term_changes_the_assignment():
    """Four 4,000-token packs: 0 and 2 are one hi-res image each (15,000 patches), 1 and 3 text only. By text cost
    they tie and keep data order, so each step pairs an image pack with a text pack; the full cost pairs like with
    like."""
    cost = WorkCost.from_config()
    packs = [(4000, 15_000, 15_000**2), (4000, 0, 0), (4000, 15_000, 15_000**2), (4000, 0, 0)]
    full = [cost.sample(*p) for p in packs]
    text = [cost.sample(p[0]) for p in packs]
    by_full, by_text = schedule(full, world=2), schedule(text, world=2)
    assert by_full == [[0, 2], [1, 3]] and by_text == [[0, 1], [2, 3]]

    def spread(groups):
        return step_spread([[full[i] for i in g] for g in groups])

    print("max/mean: text cost", spread(by_text), "full cost", spread(by_full))
    assert spread(by_full) == 1.0 and spread(by_text) == pytest.approx(1.168, abs=1e-3)  # negative control
