"""Rank balance: the cost model against telemetry's FLOP count, exact splits and schedules on literal inputs, and the
vision term changing an assignment (negative control: text cost alone balances the image-heavy case worse)."""

from __future__ import annotations

import pytest

from hf_packing.packing.balance import WorkCost, partition, schedule, step_spread


def test_default_cost_is_qwen2_5_vl_7b():
    cost = WorkCost.from_config()
    assert round(1 / cost.attention) == 70_455  # L·d / N: 28 · 3,584 / 7.07e9
    assert cost.patch == pytest.approx(0.0922, abs=1e-4)  # vision tower (0.65B) per patch over text (7.07B)
    assert round(1 / cost.vision_attention, -3) == 690_000
    assert cost.sample(1000) == pytest.approx(1000 + 1e6 / 70_455, rel=1e-4)
    frozen = WorkCost.from_config(vision_trainable=False)
    assert frozen.patch == pytest.approx(cost.patch / 3) and frozen.attention == cost.attention


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_cost_weights_agree_with_telemetry(model_type):
    """The config-only count against telemetry's count of the real parameters (biases and norms are the gap)."""
    from hf_packing.testing.tiny import build_tiny_model
    from hf_packing.training.telemetry import ModelFlops

    model = build_tiny_model(model_type)
    flops, cost = ModelFlops.from_model(model), WorkCost.from_config(model.config)
    text = flops.n_layers * flops.attn_dim / flops.n_text
    print(model_type, "attention", text, cost.attention, "patch", flops.n_vision / flops.n_text, cost.patch)
    assert cost.attention == pytest.approx(text, rel=0.01)
    if model_type == "qwen2_vl":  # no windowed attention (Qwen2.5-VL) or deep-stack mergers (Qwen3-VL) to differ on
        assert cost.patch == pytest.approx(flops.n_vision / flops.n_text, rel=0.01)


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
