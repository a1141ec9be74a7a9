"""PackingTelemetry: exact counts from the model's own call kwargs, and real Trainer runs: the logged MFU is
``training_flops(model, batch)["total"]`` (itself against FlopCounterMode in test_flops.py) / time / peak."""

from __future__ import annotations

import types

import pytest
import torch

from hf_packing.collator import VisionCollator
from hf_packing.testing.tiny import TOKEN_IDS, build_tiny_model
from hf_packing.training import telemetry as telemetry_module
from hf_packing.training.telemetry import (
    PackingTelemetry,
    add_telemetry,
    default_peak_tflops,
    training_flops,
)
from tests.helpers import load_processor

VS, VE, IMG = TOKEN_IDS["<|vision_start|>"], TOKEN_IDS["<|vision_end|>"], TOKEN_IDS["<|image_pad|>"]


def _samples() -> list[list[dict]]:
    """Two packs: [a(5), b(9, one 4x4-patch image -> 4 placeholders)], [c(2)]."""
    a = {"input_ids": torch.tensor([1, 2, 3, 4, 5])}
    b = {
        "input_ids": torch.tensor([VS, IMG, IMG, IMG, IMG, VE, 7, 8, 9]),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
        "pixel_values": torch.randn(16, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(0)),
    }
    c = {"input_ids": torch.tensor([10, 11])}
    return [[a, b], [c]]


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("qwen2_5_vl").train()


@pytest.mark.parametrize("mode, slots", [("rows", 3 * 9), ("flat", 16)])
def test_exact_counts_through_a_tiny_model_forward(model, mode, slots):
    collator = VisionCollator(load_processor("qwen2_5_vl"), mode=mode, model_config=model.config)
    batch = collator(_samples())
    telemetry = PackingTelemetry(max_length=16)
    telemetry.attach(model)
    try:
        model(**batch)
        counts = telemetry.counts()
        model.eval()
        model(**batch)  # evaluation forwards are not counted
        assert telemetry.counts()["forwards"] == 1
    finally:
        model.train()
        telemetry.detach()
    assert not model._forward_pre_hooks
    expected = {
        "real_tokens": 16,
        "slots": slots,
        "sum_sq_lens": 5**2 + 9**2 + 2**2,
        "images": 1,
        "videos": 0,
        "vision_patches": 16,
        "forwards": 1,
    }
    assert {k: counts[k] for k in expected} == expected
    assert counts["vision_flops"] == training_flops(model, batch)["vision"] > 0  # exact, per item (test_flops.py)


def test_counts_any_collator_and_boundary_kwargs():
    """A dummy module taking **kwargs: flat rows with cu_seqlens, rows with a mask, rows with neither."""

    class Dummy(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return None

    module, telemetry = Dummy(), PackingTelemetry()
    telemetry.attach(module)
    module(
        input_ids=torch.zeros(1, 10, dtype=torch.long),
        cu_seqlens=torch.tensor([0, 3, 10], dtype=torch.int32),
        video_grid_thw=torch.tensor([[2, 4, 6]]),
    )
    module(input_ids=torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]))
    module(torch.zeros(2, 3, dtype=torch.long))  # positional input_ids, no boundaries: each row one document
    counts = telemetry.counts()
    telemetry.detach()
    assert counts["real_tokens"] == 10 + 5 + 6
    assert counts["slots"] == 10 + 8 + 6
    assert counts["sum_sq_lens"] == (9 + 49) + (9 + 4) + 2 * 9
    assert (counts["videos"], counts["images"], counts["vision_patches"], counts["forwards"]) == (1, 0, 48, 3)


def test_qwen4_exp_qsa_counts_are_exact_on_every_boundary_kwarg():
    """Qwen4-Exp: the telemetry counts what its QSA layers attend and score per document (flat rows with
    cu_seqlens, rows with a mask, rows with neither), on the device; they equal a per-query count of the rule
    (``r·min(k, ⌊m/r⌋) + m mod r`` keys, ``⌊m/r⌋`` blocks scored, at ``m`` = offset + 1) and give the text FLOPs of
    `ModelFlops.text_of` on the same documents. Negative control: Σ len² alone (QSA as dense attention) is far off."""
    from hf_packing.ops.flops import ModelFlops

    class Dummy(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return None

    flops = ModelFlops.from_model(build_tiny_model("qwen4_exp"))
    r, k = flops.compress_ratio, flops.block_topk
    assert flops.qsa_layers and (r, k) == (4, 2)
    module, telemetry = Dummy(), PackingTelemetry(model_flops=flops)
    telemetry.attach(module)
    module(input_ids=torch.zeros(1, 45, dtype=torch.long), cu_seqlens=torch.tensor([0, 40, 43, 45], dtype=torch.int32))
    module(
        input_ids=torch.zeros(2, 30, dtype=torch.long), attention_mask=(torch.arange(30) < torch.tensor([[30], [7]]))
    )
    module(torch.zeros(2, 11, dtype=torch.long))  # no boundaries: each row one document
    counts = telemetry.counts()
    telemetry.detach()
    documents = [40, 3, 2, 30, 7, 11, 11]
    keys = sum(r * min(k, m // r) + m % r for n in documents for m in range(1, n + 1))
    scored = sum(m // r for n in documents for m in range(1, n + 1))
    assert (counts["qsa_keys"], counts["qsa_scored"]) == (keys, scored)
    text = flops.text_counts(
        tokens=counts["real_tokens"],
        sum_sq_lens=counts["sum_sq_lens"],
        qsa_keys=counts["qsa_keys"],
        qsa_scored=counts["qsa_scored"],
    )
    assert text == pytest.approx(flops.text_of(documents), rel=1e-12)
    dense = flops.text(tokens=counts["real_tokens"], sum_sq_lens=counts["sum_sq_lens"])
    print(f"qwen4_exp text FLOPs: exact {text:.4e}, QSA as dense {dense:.4e}")
    assert abs(dense / text - 1) > 0.05


def test_peak_from_device_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, peak in [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA GeForce RTX 4090", None),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, n=name: n)
        assert default_peak_tflops() == peak


class _Packs(torch.utils.data.Dataset):
    def __init__(self, packs):
        self.packs = packs

    def __len__(self):
        return len(self.packs)

    def __getitem__(self, i):
        return self.packs[i]

    def stats(self, log=True):
        return {"skipped": {"overlong": 3, "missing_file": 1}, "leftover_samples": 2}


def _args(tmp_path, **overrides):
    """Two optimizer steps on the CPU, a log after each, no reporters or checkpoints."""
    from transformers import TrainingArguments

    defaults = dict(per_device_train_batch_size=1, max_steps=2, logging_steps=1, report_to=[], save_strategy="no")
    defaults.update(use_cpu=True, remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True)
    return TrainingArguments(output_dir=str(tmp_path), **{**defaults, **overrides})


def test_trainer_logs_keys_before_reporters(tmp_path):
    from transformers import Trainer, TrainerCallback

    seen = []

    class Reporter(TrainerCallback):  # stands in for WandB/TensorBoard: a callback after the defaults
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))

    packs = [_samples()[0], _samples()[1]]  # one pack per optimizer step: 14 tokens in 2 rows, then 2 in 1 row
    args = _args(tmp_path)
    tiny = build_tiny_model("qwen2_5_vl")
    collator = VisionCollator(load_processor("qwen2_5_vl"), model_config=tiny.config)
    trainer = Trainer(
        model=tiny, args=args, train_dataset=_Packs(packs), data_collator=collator, callbacks=[Reporter()]
    )
    telemetry = add_telemetry(trainer, max_length=16, peak_tflops=1.0)
    assert trainer.callback_handler.callbacks[0] is telemetry and telemetry.dataset is trainer.train_dataset
    trainer.train()

    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and [s for s in seen if "loss" in s] == [
        {k: v for k, v in h.items() if k != "step"} for h in logs
    ]
    first, second = logs
    assert first["packing/pack_fill"] == pytest.approx(14 / 16) and second["packing/pack_fill"] == pytest.approx(2 / 16)
    assert first["packing/padding_ratio"] == pytest.approx(1 - 14 / 18) and second["packing/padding_ratio"] == 0.0
    assert (first["packing/images_per_step"], first["packing/vision_patches_per_step"]) == (1.0, 16.0)
    assert (second["packing/images_per_step"], second["packing/videos_per_step"]) == (0.0, 0.0)
    assert first["packing/dropped_samples"] == 3 + 1 + 2  # stats(): skipped (every reason) + leftover samples
    assert first["packing/mfu"] < first["packing/mfu_with_vision"]  # the first pack's image adds the tower
    for log in logs:
        # their values: test_logged_mfu_is_training_flops_over_time_and_peak (a fake clock, training_flops)
        assert log["packing/tokens_per_s"] > 0 and 0 < log["packing/mfu"] <= log["packing/mfu_with_vision"]
    assert telemetry._handle is None and not tiny._forward_pre_hooks


def test_logged_mfu_is_training_flops_over_time_and_peak(tmp_path, monkeypatch):
    """Two optimizer steps of two micro-batches each (padded rows with images, one cut into edge windows) through a
    Trainer; the telemetry's clock advances 2.5 s per forward and nothing else, the peak is 3 TFLOP/s. Each logged
    ``mfu_with_vision`` must be Σ ``training_flops(model, batch)["total"]`` over the step's batches (as the model got
    them) / 5 s / peak, and ``mfu`` the text part. Negative control: the same quotient with each padded row counted
    as one document (the mask dropped) misses by more than the tolerance."""
    from transformers import Trainer

    clock = [100.0]
    monkeypatch.setattr(telemetry_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    wide = {  # a 4x6-patch image: Qwen2.5-VL's 4x4-patch windows cut at its edge
        "input_ids": torch.tensor([3, VS, *[IMG] * 6, VE, 4]),
        "image_grid_thw": torch.tensor([[1, 4, 6]]),
        "pixel_values": torch.randn(24, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1)),
    }
    a, b, c = (sample for pack in _samples() for sample in pack)
    packs = [[a, b], [c], [wide, c], [b]]
    args = _args(tmp_path, gradient_accumulation_steps=2)
    tiny = build_tiny_model("qwen2_5_vl")
    seen = []

    def record(module, args, kwargs):  # the kwargs the telemetry's own hook counts
        seen.append({k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
        clock[0] += 2.5

    collator = VisionCollator(load_processor("qwen2_5_vl"), model_config=tiny.config)
    trainer = Trainer(model=tiny, args=args, train_dataset=_Packs(packs), data_collator=collator)
    telemetry = add_telemetry(trainer, max_length=16, peak_tflops=3.0)
    tiny.register_forward_pre_hook(record, with_kwargs=True)
    trainer.train()

    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and len(seen) == 4 and telemetry.model_flops is not None
    for log, batches in zip(logs, (seen[:2], seen[2:])):
        flops = [training_flops(tiny, batch) for batch in batches]
        total, text = sum(f["total"] for f in flops), sum(f["text"] for f in flops)
        per_second_and_peak = 1.0 / (2 * 2.5) / (3.0 * 1e12)
        rows = [training_flops(tiny, {k: v for k, v in b.items() if k != "attention_mask"}) for b in batches]
        control = sum(f["total"] for f in rows) * per_second_and_peak
        print(
            f"mfu_with_vision {log['packing/mfu_with_vision']:.6e}, expected {total * per_second_and_peak:.6e}, "
            f"rows as documents {control:.6e}"
        )
        assert log["packing/mfu_with_vision"] == pytest.approx(total * per_second_and_peak, rel=1e-9)
        assert log["packing/mfu"] == pytest.approx(text * per_second_and_peak, rel=1e-9)
        assert log["packing/tflops_per_s_per_device"] == pytest.approx(total / (2 * 2.5) / 1e12, rel=1e-9)
        assert log["packing/flops_per_step"] == pytest.approx(total, rel=1e-9)  # one optimizer step per log
        assert control != pytest.approx(log["packing/mfu_with_vision"], rel=1e-3)
    assert any(b.get("image_grid_thw") is not None and b["image_grid_thw"][0].tolist() == [1, 4, 6] for b in seen)


def test_per_source_sums_are_kept_only_when_every_training_forward_gave_them():
    """Two micro-batches with ``source_ids`` under the patch: the per-source token counts add up to the collator's
    supervised counts; the sums are the loss's own (Σ over sources = the summed loss). A third forward without ids
    (as under Liger or sequence parallelism) makes the window's per-source numbers unknown: left out, not wrong."""
    import hf_packing
    from tests.helpers import processed_samples

    processor = load_processor("qwen2_5_vl")
    samples = processed_samples(processor)
    model = build_tiny_model("qwen2_5_vl")
    collate = VisionCollator(processor, model_config=model.config)
    batches = [collate([[{**s, "source_id": k % 2} for k, s in enumerate(samples[i : i + 2])]]) for i in (0, 2)]
    telemetry = PackingTelemetry(sources=["a", "b"])
    hf_packing.apply_rmpad("qwen2_5_vl")
    try:
        telemetry.attach(model)
        model.train()
        losses = [float(model(**b).loss.detach()) * b["num_supervised_tokens"] for b in batches]
        per = telemetry.counts()["per_source"]  # Σ CE of a, b; tokens of a, b; hits of a, b
        print(per, losses)
        assert per[2] + per[3] == sum(b["num_supervised_tokens"] for b in batches) and min(per[2:4]) > 0
        assert abs(per[0] + per[1] - sum(losses)) < 1e-5 * sum(losses)
        model(**{k: v for k, v in batches[0].items() if k != "source_ids"})
        assert telemetry.counts()["per_source"] == []
    finally:
        telemetry.detach()
        hf_packing.revert_rmpad("qwen2_5_vl")


@pytest.mark.multiproc
def test_sp2_comm_share_and_vision_flops_exact(tmp_path):
    """SP = 2 on 2 gloo processes (tests/multiproc_sp_telemetry.py): one group, one pack of 9 tokens (documents 4 + 5)
    and one 1×4×4 image, a 10 s window on a fake clock in which rank 0 spends 2 s and rank 1 4 s in SP collectives.

    Worked by hand from the helper's counts (N = 1000, L = 2, d = 8; N_pe = 10, N_blk = 100, N_mrg = 20, m = 2,
    D = 4, one full-attention block; P = 16 patches, one frame of 16):
        text   6·1000·9 + 6·2·8·(4² + 5²)                          = 54000 + 3936          = 57936
        vision 3·(2·(10 + 100 + 20/4)·16 + 4·4·16²) − 2·10·16      = 3·(3680 + 4096) − 320 = 23008
    The group trains the pack once, so a step is 80944 FLOPs on 2 devices for 10 s; the share of the SP collectives
    is the mean over ranks of each rank's share, (2/10 + 4/10) / 2 = 0.3. Counting the tower on each SP rank
    (103952 FLOPs) or dividing the summed comm time by the SP size (0.15) fails this test."""
    import json
    from pathlib import Path

    from tests.helpers import torchrun

    out = tmp_path / "logs.json"
    proc = torchrun(Path(__file__).parent / "multiproc_sp_telemetry.py", str(out), nproc=2, timeout=240)
    assert proc is not None, "torchrun hung past 240 s"
    assert proc.returncode == 0, proc.stderr[-6000:]
    log = json.loads(out.read_text())
    print(log)
    text, vision, seconds, world, peak = 57936.0, 23008.0, 10.0, 2, 100.0
    assert log["packing/sp_all_to_all_share"] == pytest.approx(0.3, rel=1e-12)
    assert log["packing/flops_per_step"] == pytest.approx(text + vision, rel=1e-12)
    assert log["packing/tflops_per_s_per_device"] == pytest.approx(80944.0 / seconds / world / 1e12, rel=1e-12)
    assert log["packing/mfu_with_vision"] == pytest.approx(80944.0 / seconds / world / 1e12 / peak, rel=1e-12)
    assert log["packing/mfu"] == pytest.approx(text / seconds / world / 1e12 / peak, rel=1e-12)
    # the pack's counts once, not once per SP rank
    assert log["packing/tokens_per_s"] == pytest.approx(0.9, rel=1e-12)
    assert log["packing/tokens_per_s_per_gpu"] == pytest.approx(0.45, rel=1e-12)
    assert log["packing/tokens_per_s_per_sp_group"] == pytest.approx(0.9, rel=1e-12)
    assert log["packing/sp_padding_tokens"] == 1 and log["packing/pack_fill"] == pytest.approx(9 / 16, rel=1e-12)
    assert log["packing/images_per_step"] == 1 and log["packing/vision_patches_per_step"] == 16
