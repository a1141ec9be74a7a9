"""Ulysses sequence parallelism: the sharding helpers on literal inputs, and SP = 2 / 4 against SP = 1 under gloo.

The multi-process tests launch tests/multiproc_sp.py with torchrun in their own process group with a timeout, so a
hang fails the test instead of hanging CI; one launch per process count and mode runs every comparison the tests of
that setting read (module-scoped fixtures), so each launch checks several things. Each compares, for Qwen2.5-VL and
Qwen3-VL (DeepStack), the loss the Trainer would log and every parameter's gradient as DDP / FSDP2 combine them,
against SP = 1 on the same packs (images and a video; lengths that are and are not multiples of P). The negative
controls (positions computed after sharding, boundaries dropped) must fail the same comparison. Qwen3.5 /
Qwen3.5-MoE (Gated DeltaNet layers on head shards) are also compared with the unpatched model run sample by sample,
on both linear-attention backends (FLA through the strict stand-ins); the MoE aux loss (router statistics summed
over the SP group) with SP = 1's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from hf_packing.ops.varlen import PackedSequences
from hf_packing.parallel import comm, shard
from hf_packing.parallel.comm import SPGroup
from hf_packing.parallel.state import data_parallel_rank_world
from hf_packing.patches import sequence_parallel as sp_mod
from tests.helpers import torchrun

HELPER = Path(__file__).parent / "multiproc_sp.py"
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4


def group(rank: int, size: int) -> SPGroup:
    return SPGroup(group=None, rank=rank, size=size)


# ------------------------------------------------------------------------------------------ helpers, exact


def test_padded_sequences_add_one_tail_segment():
    seqs = PackedSequences.from_seqlens([4, 6])
    padded = shard.padded_sequences(seqs, 4)
    assert padded.cu_seqlens.tolist() == [0, 4, 10, 12] and padded.seqlens == [4, 6, 2] and padded.max_seqlen == 6
    assert shard.padded_sequences(seqs, 2) is seqs  # 10 divides by 2: no padding at all
    assert [shard.padded_length(n, 4) for n in (1, 4, 10, 12)] == [4, 4, 12, 12]


def test_pad_and_shard_slices_like_the_module_picture():
    x = torch.arange(10)
    shards = [shard.pad_and_shard(x, group(r, 4), dim=0, value=-1).tolist() for r in range(4)]
    assert shards == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, -1, -1]]
    embeds = torch.arange(10.0).view(1, 10, 1)
    assert shard.pad_and_shard(embeds, group(1, 2), dim=1).flatten().tolist() == [5.0, 6.0, 7.0, 8.0, 9.0]


def test_targets_are_shifted_before_sharding():
    from hf_packing.ops.loss import shift_labels_per_sequence

    labels = torch.tensor([-100, 11, 12, -100, -100, 22, 23])  # sequences [0, 3) and [3, 7)
    targets = shift_labels_per_sequence(labels, torch.tensor([0, 3, 7]))
    shards = [shard.local_targets(targets, group(r, 4)).tolist() for r in range(4)]
    assert shards == [[11, 12], [-100, -100], [22, 23], [-100, -100]]


def test_position_ids_shard_with_a_counting_tail():
    pos = torch.tensor([[0, 1, 2, 2, 3], [0, 1, 1, 2, 3], [0, 1, 2, 1, 3]]).unsqueeze(1)  # (3, 1, 5) M-RoPE
    shards = [shard.shard_position_ids(pos, group(r, 2)) for r in range(2)]
    assert shards[0].squeeze(1).tolist() == [[0, 1, 2], [0, 1, 1], [0, 1, 2]]
    assert shards[1].squeeze(1).tolist() == [[2, 3, 0], [2, 3, 0], [1, 3, 0]]


def test_deepstack_features_follow_their_tokens():
    mask = torch.tensor([[False, True, True, False, True]])  # visual tokens at 1, 2, 4
    feats = [torch.tensor([[10.0], [20.0], [40.0]]), torch.tensor([[1.0], [2.0], [4.0]])]
    out = [shard.shard_deepstack(mask, feats, group(r, 2)) for r in range(2)]
    assert out[0][0].tolist() == [[False, True, True]] and [f.flatten().tolist() for f in out[0][1]] == [
        [10.0, 20.0],
        [1.0, 2.0],
    ]
    assert out[1][0].tolist() == [[False, True, False]] and [f.flatten().tolist() for f in out[1][1]] == [
        [40.0],
        [4.0],
    ]


def test_kv_heads_are_replicated_only_when_fewer_than_the_group():
    assert [comm.kv_replication(4, 2, p) for p in (1, 2, 4)] == [1, 1, 2]
    assert comm.kv_replication(32, 8, 16) == 2 and comm.kv_replication(28, 4, 4) == 1
    with pytest.raises(ValueError, match="not divisible by sequence_parallel_size=3"):
        comm.kv_replication(4, 2, 3)


def test_linear_key_heads_are_replicated_only_when_fewer_than_the_group():
    heads = comm.LinearHeads(key_heads=2, key_dim=16, value_heads=4, value_dim=16)  # the tiny Qwen3.5
    assert [comm.key_replication(heads, p) for p in (1, 2, 4)] == [1, 1, 2]
    real = comm.LinearHeads(key_heads=16, key_dim=128, value_heads=32, value_dim=128)  # Qwen3.5 / Qwen3-Next
    assert [comm.key_replication(real, p) for p in (2, 8, 16, 32)] == [1, 1, 1, 2]
    assert heads.channels() == (32, 32, 64)
    with pytest.raises(ValueError, match="linear_num_value_heads=4 is not divisible by sequence_parallel_size=8"):
        comm.key_replication(heads, 8)
    with pytest.raises(ValueError, match="linear_key_head_dim = 6 is not divisible by sequence_parallel_size=4"):
        comm.key_replication(comm.LinearHeads(key_heads=2, key_dim=3, value_heads=4, value_dim=4), 4)


def test_text_model_hook_carries_and_checks_the_linear_head_layout():
    """The hook hands attention the hybrid model's linear-attention layout, and refuses a size the value heads do
    not divide before any layer runs."""
    from types import SimpleNamespace

    config = SimpleNamespace(
        linear_num_key_heads=2, linear_key_head_dim=16, linear_num_value_heads=4, linear_value_head_dim=16
    )
    seqs = PackedSequences.from_seqlens([3, 2])
    kwargs = lambda: {"inputs_embeds": torch.zeros(1, 5, 8), "position_ids": torch.zeros(3, 1, 5)}  # noqa: E731
    _, out = shard.text_model_pre_hook(group(1, 2), seqs, "seqs")(SimpleNamespace(config=config), (), kwargs())
    assert out[comm.SP_KWARG].linear == comm.LinearHeads(2, 16, 4, 16) and out[comm.SP_KWARG].rank == 1
    assert out["inputs_embeds"].shape == (1, 3, 8) and out["seqs"].cu_seqlens.tolist() == [0, 3, 5, 6]
    _, dense = shard.text_model_pre_hook(group(0, 2), seqs, "seqs")(SimpleNamespace(config=object()), (), kwargs())
    assert dense[comm.SP_KWARG].linear is None  # no linear-attention layers: the group as it was
    with pytest.raises(ValueError, match="linear_num_value_heads=4 is not divisible by sequence_parallel_size=8"):
        shard.text_model_pre_hook(group(0, 8), seqs, "seqs")(SimpleNamespace(config=config), (), kwargs())


def test_telemetry_counts_the_padding_sp_adds():
    import hf_packing
    from hf_packing.training.telemetry import PackingTelemetry

    hf_packing.apply_rmpad("qwen2_vl", sequence_parallel_size=4)  # the telemetry reads the applied SP state
    try:
        telemetry = PackingTelemetry(all_reduce=False)
        mask = torch.tensor([[1] * 6 + [0] * 3, [1] * 4 + [0] * 5])  # one pack of 10 real tokens → 12
        telemetry.observe(torch.zeros(2, 9, dtype=torch.long), {"attention_mask": mask})
        telemetry.observe(torch.zeros(1, 8, dtype=torch.long), {})  # flat, 8 tokens: no padding
        counts = telemetry.counts()
        assert counts["real_tokens"] == 18 and counts["sp_padding_tokens"] == 2
    finally:
        hf_packing.revert_rmpad()


def test_without_a_process_group_sp_raises_a_named_error():
    import hf_packing
    from hf_packing.testing.tiny import build_tiny_model

    assert data_parallel_rank_world(2) == (0, 1)
    with pytest.raises(ValueError, match="sequence_parallel_size must be an int >= 1"):
        hf_packing.apply_rmpad("qwen2_vl", sequence_parallel_size=0)
    hf_packing.apply_rmpad("qwen2_vl", sequence_parallel_size=2)
    assert sp_mod.current_size() == 2
    model = build_tiny_model("qwen2_vl")
    ids = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="sequence_parallel_size=2 needs torch.distributed"):
        model(input_ids=ids, labels=ids)
    hf_packing.revert_rmpad()
    assert sp_mod.current_size() == 1 and sp_mod.current_state() is None


def test_sp_state_lives_in_the_applied_options():
    """`apply_rmpad` creates one `SequenceParallelState` and binds it into its options: the patched forward, the
    packer and the telemetry read that object; applying the same size again keeps it (and its mesh), another size
    replaces it, a state passed back survives a revert, and `revert_rmpad` drops it with the patches."""
    import hf_packing
    from hf_packing.patches import sequence_parallel_state
    from hf_packing.patches._forward import RmpadOptions
    from hf_packing.patches.sequence_parallel import SequenceParallelState

    assert sequence_parallel_state() is None and RmpadOptions().sequence_parallel == SequenceParallelState(1)
    try:
        hf_packing.apply_rmpad("qwen2_vl", sequence_parallel_size=2)
        state = sp_mod.current_state()
        assert state is sequence_parallel_state() and state.size == 2 and state.device_mesh is None
        hf_packing.apply_rmpad("qwen2_vl", sequence_parallel_size=2, attn_backend="reference")  # other options
        assert sp_mod.current_state() is state  # same size: the same state (a built mesh is kept)
        hf_packing.apply_rmpad("qwen2_vl", sequence_parallel_size=4)
        assert sp_mod.current_state() is not state and sp_mod.current_size() == 4
        hf_packing.revert_rmpad()
        assert sp_mod.current_state() is None and sp_mod.current_size() == 1
        hf_packing.apply_rmpad("qwen2_vl", sequence_parallel_size=state)  # a state handed back: kept
        assert sp_mod.current_state() is state
        with pytest.raises(ValueError, match="sequence parallelism of size 4 is not applied"):
            sp_mod.sp_group(4)
        assert sp_mod.sp_group(1) is None
    finally:
        hf_packing.revert_rmpad()
    with pytest.raises(ValueError, match="sequence_parallel_size must be an int >= 1, got 0"):
        SequenceParallelState(0)


# ------------------------------------------------------------------------------------------ gloo, 2 and 4 processes


def launch(tmp_path: Path, nproc: int, timeout: float, **config) -> list[dict]:
    """tests/multiproc_sp.py on ``nproc`` gloo processes (`tests.helpers.torchrun`); rank 0's results, one per run."""
    config = {"out": str(tmp_path / "out.json"), **config}
    (tmp_path / "config.json").write_text(json.dumps(config))
    t0 = time.perf_counter()
    proc = torchrun(HELPER, str(tmp_path / "config.json"), nproc=nproc, timeout=timeout)
    if proc is None:
        pytest.fail(f"torchrun hung past {timeout} s")
    start = proc.stderr.find("Traceback")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[max(start, 0) :][:6000]
    results = json.loads((tmp_path / "out.json").read_text())
    print(f"{nproc} processes, {time.perf_counter() - t0:.1f} s")
    for r in results:
        if "family" in r:
            keys = ("family", "sp", "world", "mode", "control", "lengths", "loss_rel", "grad_rel", "eval_loss_rel")
            shown = ("linear_backend", "oracle_rel", "aux_rel", "amp_errors")
            extra = {k: r[k] for k in shown if r.get(k) not in (None, 0.0, "auto")}
            print(
                {k: r[k] for k in keys + ("logits_rel", "pack_patches", "tower_patches_per_rank", "comm_seconds")},
                extra,
            )
        else:
            print(r)
    return results


def check_equal(result: dict, size: int) -> None:
    assert result["loss_rel"] <= LOSS_TOL and result["grad_rel"] <= GRAD_TOL, result
    assert result["eval_loss_rel"] <= LOSS_TOL and result["logits_rel"] <= GRAD_TOL and result["eval_count_ok"], result
    assert any(n % size for n in result["lengths"]), result["lengths"]  # a pack that needed padding
    # the tower's work is split: every rank encodes fewer patches than its group's packs hold (+ dummy images)
    for rank, encoded in enumerate(result["tower_patches_per_rank"]):
        d = rank // size
        assert encoded < sum(result["pack_patches"][2 * d : 2 * d + 2]), result
    assert result["tower_calls_per_rank"] == [2] * result["world"], result  # one call per micro-batch on every rank
    assert result["telemetry_tokens_ok"] and result["telemetry_sp_padding_ok"] and result["comm_seconds"] > 0, result


#: the runs of each launch, by name; a test reads the results of its own runs (the launch fixtures run them all)
SP2_DENSE = {
    "qwen2_5_vl": {"family": "qwen2_5_vl", "control": None},
    "qwen3_vl": {"family": "qwen3_vl", "control": None},
    "control_positions": {"family": "qwen2_5_vl", "control": "positions"},
    "control_boundaries": {"family": "qwen3_vl", "control": "boundaries"},
}
SP4_DENSE = {
    "qwen2_5_vl": {"family": "qwen2_5_vl", "control": None},
    "qwen3_vl_checkpointing": {"family": "qwen3_vl", "control": None, "checkpointing": True},
}
SP2_LINEAR = {
    "qwen3_5": {"family": "qwen3_5", "control": None, "oracle": True},
    "qwen3_5_moe_checkpointing": {"family": "qwen3_5_moe", "control": None, "oracle": True, "checkpointing": True},
    "qwen3_5_fla": {"family": "qwen3_5", "control": None, "oracle": True, "linear_backend": "fla"},
    "qwen3_5_moe_fla_autocast": {"family": "qwen3_5_moe", "control": None, "linear_backend": "fla", "autocast": True},
    "control_conv_window": {"family": "qwen3_5", "control": "conv_window"},
    "control_recurrent_state": {"family": "qwen3_5_moe", "control": "recurrent_state", "linear_backend": "fla"},
}
SP4_LINEAR = {
    "qwen3_5": {"family": "qwen3_5", "control": None, "oracle": True},
    "qwen3_5_moe_fla": {"family": "qwen3_5_moe", "control": None, "oracle": True, "linear_backend": "fla"},
}
SP2_MOE_AUX = {
    "qwen3_vl_moe": {"family": "qwen3_vl_moe", "control": None, "router_aux": 0.01},
    "qwen3_5_moe": {"family": "qwen3_5_moe", "control": None, "router_aux": 0.01},
    "control_aux_per_shard": {"family": "qwen3_vl_moe", "control": None, "router_aux": 0.01, "aux_per_shard": True},
}


def launch_runs(tmp_path: Path, nproc: int, sp: int, groups: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """One DDP launch of every run of ``groups`` ({group: {run: spec}}); {group: {run: rank 0's result}}."""
    specs = [(group, name, spec) for group, runs in groups.items() for name, spec in runs.items()]
    results = launch(tmp_path, nproc, 540, sp=sp, mode="ddp", runs=[spec for _, _, spec in specs])
    out: dict[str, dict] = {group: {} for group in groups}
    for (group, name, _), result in zip(specs, results, strict=True):
        out[group][name] = result
    return out


@pytest.fixture(scope="module")
def sp2_ddp(tmp_path_factory) -> dict[str, dict]:
    """SP = 2 on 2 processes under DDP: one launch for the dense, linear-attention and MoE aux-loss tests."""
    groups = {"dense": SP2_DENSE, "linear": SP2_LINEAR, "moe_aux": SP2_MOE_AUX}
    return launch_runs(tmp_path_factory.mktemp("sp2_ddp"), 2, 2, groups)


@pytest.fixture(scope="module")
def sp4_ddp(tmp_path_factory) -> dict[str, dict]:
    """SP = 4 on 4 processes under DDP: one launch for the dense and linear-attention tests."""
    return launch_runs(tmp_path_factory.mktemp("sp4_ddp"), 4, 4, {"dense": SP4_DENSE, "linear": SP4_LINEAR})


@pytest.mark.multiproc
def test_sp2_equals_sp1_and_negative_controls_fail(sp2_ddp):
    results = sp2_ddp["dense"]
    for name in ("qwen2_5_vl", "qwen3_vl"):
        check_equal(results[name], 2)
    for name in ("control_positions", "control_boundaries"):
        result = results[name]
        assert result["loss_rel"] > LOSS_TOL or result["grad_rel"] > GRAD_TOL, result
        assert result["grad_rel"] > 100 * GRAD_TOL, result


@pytest.mark.multiproc
def test_sp4_equals_sp1_with_replicated_kv_heads(sp4_ddp):
    """4 query heads, 2 KV heads: P = 4 replicates each KV head twice. Qwen3-VL with gradient checkpointing (the
    backward recomputes the all-to-alls)."""
    assert set(sp4_ddp["dense"]) == set(SP4_DENSE)
    for result in sp4_ddp["dense"].values():
        check_equal(result, 4)


@pytest.mark.multiproc
def test_fsdp2_dp2_x_sp2_equals_sp1(tmp_path):
    """FSDP2 over all 4 ranks (2 data-parallel groups × 2 SP ranks), each group on its own packs; Qwen3.5 too (the
    recipes' setup for its long-video config)."""
    runs = [
        {"family": "qwen2_5_vl", "control": None},
        {"family": "qwen3_vl", "control": None},
        {"family": "qwen3_5", "control": None},
    ]
    *results, packer = launch(tmp_path, 4, 300, sp=2, mode="fsdp", runs=runs, packer=True)
    for result in results:
        assert result["world"] == 4 and len(result["lengths"]) == 4
        check_equal(result, 2)
    # pack_dataset took its data-parallel rank and size from the SP setting: 2 groups, same packs inside one
    assert packer["rank_world"] == [0, 2] and packer["same_in_group"] and packer["disjoint_groups"], packer
    assert min(packer["packs"]) > 0, packer


@pytest.mark.multiproc
@pytest.mark.slow
def test_trainer_recipe_with_sp2_equals_sp1(tmp_path):
    """recipes/train.py (Trainer, prepare_trainer, telemetry, token-level eval) on 2 processes with SP=2 against 1
    process: the same packs, the same 3 optimizer steps and evaluations."""
    import sys

    from hf_packing.testing.tiny import save_tiny_checkpoint
    from tests.helpers import write_llava_jsonl

    model = save_tiny_checkpoint("qwen2_5_vl", tmp_path / "tiny")
    data = write_llava_jsonl(tmp_path / "data").parent
    helper = Path(__file__).parent / "multiproc_sp_trainer.py"
    hist = {}
    for nproc, sp in ((1, "1"), (2, "2")):
        out = tmp_path / f"sp{sp}"
        proc = torchrun(helper, str(out), str(model), str(data), sp, nproc=nproc, timeout=300)
        assert proc is not None and proc.returncode == 0, proc and proc.stderr[-6000:]
        hist[sp] = json.loads((out / "hist.json").read_text())
    train = {sp: [h for h in hist[sp] if "loss" in h] for sp in hist}
    evals = {sp: [h["eval_loss"] for h in hist[sp] if "eval_loss" in h] for sp in hist}
    print({sp: [h["loss"] for h in train[sp]] for sp in train}, evals, file=sys.stderr)
    assert len(train["2"]) == 3 and len(evals["2"]) == 3
    for a, b in zip(train["1"], train["2"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
    assert evals["1"] == pytest.approx(evals["2"], rel=1e-5)
    last = train["2"][-1]
    assert last["packing/tokens_per_s_per_sp_group"] == pytest.approx(last["packing/tokens_per_s"])
    assert 0 < last["packing/sp_all_to_all_share"] < 1 and "packing/sp_padding_tokens" in last


# ------------------------------------------------------------------------------------------ Qwen3.5, MoE aux loss


def check_linear(result: dict, size: int) -> None:
    """SP = P equals SP = 1, and the unpatched model run sample by sample (loss, every gradient)."""
    check_equal(result, size)
    oracle_loss, oracle_grad = result["oracle_rel"]
    assert oracle_loss <= LOSS_TOL and oracle_grad <= GRAD_TOL, result
    if result["linear_backend"] == "fla":  # every linear layer called both stand-ins, in 2 train + 1 eval forwards
        assert result["fla_calls_sp"] == {"chunk_gated_delta_rule": 3, "causal_conv1d": 3}, result


@pytest.mark.multiproc
def test_qwen3_5_sp2_equals_sp1_and_each_sample_alone(sp2_ddp):
    """2 key / 4 value heads: one of each per rank; Qwen3.5-MoE under non-reentrant gradient checkpointing (the
    backward recomputes the linear layers' all-to-alls), and under bf16 autocast. Negative controls: on the head
    shards, the conv window (exact reference) or the recurrent state (FLA stand-ins) not restarted at the pack's
    boundaries."""
    results = sp2_ddp["linear"]
    for name in ("qwen3_5", "qwen3_5_moe_checkpointing", "qwen3_5_fla"):
        check_linear(results[name], 2)
    # fp32 weights + bf16 autocast (the recipes' setup), FLA and flash_attn stand-ins: bf16 reaches the linear
    # kernels, and SP's error against fp32 is within 2x of SP = 1's under the same autocast
    autocast = results["qwen3_5_moe_fla_autocast"]
    amp = autocast["amp_errors"]
    assert autocast["fla_dtypes_sp"] == ["torch.bfloat16"] and autocast["fla_calls_sp"]["causal_conv1d"] == 3
    assert amp["sp"][0] <= 2 * amp["sp1"][0] + 1e-3 and amp["sp"][1] <= 2 * amp["sp1"][1], amp
    for name in ("control_conv_window", "control_recurrent_state"):
        # (the loss of a random tiny model, near ln(vocab) for any input, moves less)
        result = results[name]
        assert result["grad_rel"] > 100 * GRAD_TOL and result["logits_rel"] > 100 * GRAD_TOL, result


@pytest.mark.multiproc
def test_qwen3_5_sp4_equals_sp1_with_replicated_key_heads(sp4_ddp):
    """P = 4 > 2 key heads: each key head is replicated twice after the conv (all-gathered q / k channels)."""
    assert set(sp4_ddp["linear"]) == set(SP4_LINEAR)
    for result in sp4_ddp["linear"].values():
        check_linear(result, 4)


@pytest.mark.multiproc
def test_moe_aux_loss_sp2_equals_sp1(sp2_ddp):
    """output_router_logits on, router_aux_loss_coef 0.01 (the issue's setting): each pack's aux_loss at SP = 2
    equals SP = 1's, and so do the loss and every gradient. Negative control: the aux loss from each rank's own
    tokens (transformers' function on the shard)."""
    results = sp2_ddp["moe_aux"]
    for name in ("qwen3_vl_moe", "qwen3_5_moe"):
        check_equal(results[name], 2)
        assert results[name]["aux_rel"] <= 1e-6, results[name]
    per_shard = results["control_aux_per_shard"]
    assert per_shard["aux_rel"] > 1e-4 and per_shard["grad_rel"] > 100 * GRAD_TOL, per_shard
