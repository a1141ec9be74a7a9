"""The kernel path in the precision setups users run, through the strict kernel stand-ins (tests/kernels.py).

Tolerance rule (STYLE.md): the patched low-precision run's error against the fp32 unpatched run must be at most
2x the unpatched low-precision run's own error. Both numbers are printed before asserting. Setups:

- bf16 weights (no autocast);
- fp32 weights under ``torch.autocast("cpu", dtype=torch.bfloat16)``: the recipes' ``dtype: float32`` +
  ``bf16: true``. Rotary embeddings promote q/k back to fp32 there; the kernel must still get one half dtype;
- LoRA (PEFT) and gradient checkpointing under autocast.

GLM-V families run the batch without its video, which their unpatched model refuses beside images
(tests/test_glm.py); GLM-4.1V in bf16 and GLM-4.5V under autocast by default, the rest under ``-m slow``.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

import hf_packing
from hf_packing.ops.varlen import varlen_attention
from tests.helpers import (
    MODEL_TYPES,
    assert_within_2x,
    conversations,
    glm_params,
    model_and_processor,
    padded_rows,
    processed_batch,
    torchrun,
)
from tests.kernels import KernelContractError, install_kernel

KERNELS = ("flash_attn", "torch_varlen")


def _run(model, batch, autocast: bool) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext():
        out = model(**batch)
    out.loss.backward()
    grads = [p.grad.float().flatten() for _, p in sorted(model.named_parameters()) if p.grad is not None]
    return out.loss.float().item(), torch.cat(grads)


def _three_runs(model_type: str, monkeypatch, kernel: str, *, autocast: bool, rows=None, prepare=None):
    """(fp32 unpatched, low-precision unpatched, low-precision patched through the stand-in), and the kernel calls."""
    model, processor = model_and_processor(model_type)
    model = prepare(model) if prepare else model
    batch = processed_batch(processor, padded_rows(model_type) if rows is None else rows)
    ref = _run(model, batch, autocast=False)
    if not autocast:
        model = model.to(torch.bfloat16)
    plain = _run(model, batch, autocast)
    calls = install_kernel(monkeypatch, kernel)
    hf_packing.apply_rmpad(model_type, attn_backend=kernel)
    return ref, plain, _run(model, batch, autocast), calls, model


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("model_type", MODEL_TYPES + glm_params("glm4v"))
def test_bf16_weights_through_strict_kernel(model_type, kernel, monkeypatch):
    ref, plain, patched, calls, model = _three_runs(model_type, monkeypatch, kernel, autocast=False)
    assert_within_2x(ref, plain, patched, f"{model_type}/{kernel}/bf16")
    text = model.config.text_config
    n_text = getattr(text, "layer_types", ["full_attention"] * text.num_hidden_layers).count("full_attention")
    n_vision = model.config.vision_config.depth
    # one tower call for the images and the video together (patches/_vision.py): every vision block took the kernel
    # too (Qwen3.5's linear-attention layers take their own kernels: tests/test_qwen3_5.py)
    assert calls.count(True) == n_text and calls.count(False) == n_vision


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("model_type", MODEL_TYPES + glm_params("glm4v_moe"))
def test_fp32_weights_under_autocast_through_strict_kernel(model_type, kernel, monkeypatch):
    ref, plain, patched, calls, model = _three_runs(model_type, monkeypatch, kernel, autocast=True)
    assert_within_2x(ref, plain, patched, f"{model_type}/{kernel}/fp32+autocast")
    text = model.config.text_config
    full = getattr(text, "layer_types", ["full_attention"]).count("full_attention")
    # Qwen4-Exp has no full-attention text layer: its QSA layers attend over selected keys (ops.sparse_attention)
    assert (True in calls) == (full > 0) and False in calls


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "fp32+autocast"])
def test_glm_pack_with_a_video_through_strict_kernel(autocast, monkeypatch):
    """GLM-4.1V on a collator pack holding images and a video (its frames encoded as images, in the one tower call):
    the fp32 oracle is each sample alone on the unpatched model (which refuses the padded batch), the plain
    low-precision run is each sample alone in the same precision, and the patched pack goes through the strict
    ``flash_attn`` stand-in, every text and vision layer. Negative control (under autocast): the same pack with the
    text attention's boundaries dropped exceeds the tolerance."""
    from hf_packing import VisionCollator
    from hf_packing.ops.varlen import PackedSequences
    from hf_packing.patches import _attention
    from tests.helpers import each_sample_alone, processed_samples

    model, processor = model_and_processor("glm4v")
    samples = processed_samples(processor)
    pack = VisionCollator(processor, model_config=model.config)(samples)
    assert pack["pixel_values"] is not None and pack["pixel_values_videos"] is not None

    def flat(run: tuple[float, dict[str, torch.Tensor]]) -> tuple[float, torch.Tensor]:
        return run[0], torch.cat([run[1][n].float().flatten() for n in sorted(run[1])])

    ref = flat(each_sample_alone(model, samples))
    if not autocast:
        model = model.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext():
        plain = flat(each_sample_alone(model, samples))
    calls = install_kernel(monkeypatch, "flash_attn")
    hf_packing.apply_rmpad("glm4v", attn_backend="flash_attn")
    assert_within_2x(ref, plain, _run(model, pack, autocast), f"glm4v/pack with a video/{autocast=}")
    depth = model.config.vision_config.depth
    assert calls.count(True) == model.config.text_config.num_hidden_layers and calls.count(False) == depth
    if autocast:
        kernel = _attention.varlen_attention

        def merged(q, k, v, seqs, *, causal, **kwargs):
            if causal:  # the text attention sees the pack as one sequence
                seqs = PackedSequences.from_seqlens([sum(seqs.seqlens)], device=seqs.cu_seqlens.device)
            return kernel(q, k, v, seqs, causal=causal, **kwargs)

        monkeypatch.setattr(_attention, "varlen_attention", merged)
        with pytest.raises(AssertionError):
            assert_within_2x(ref, plain, _run(model, pack, autocast), "glm4v/pack with a video/boundaries dropped")


def test_lora_under_autocast_through_strict_kernel(monkeypatch):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    ref, plain, patched, calls, _ = _three_runs(
        "qwen2_5_vl",
        monkeypatch,
        "flash_attn",
        autocast=True,
        rows=conversations(with_video=False),
        prepare=lambda m: peft.get_peft_model(m, config),
    )
    assert_within_2x(ref, plain, patched, "qwen2_5_vl/lora/fp32+autocast")
    assert calls


def test_gradient_checkpointing_under_autocast_through_strict_kernel(monkeypatch):
    def checkpointed(model):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model.train()

    ref, plain, patched, calls, _ = _three_runs(
        "qwen3_vl",
        monkeypatch,
        "torch_varlen",
        autocast=True,
        rows=conversations(with_video=False),
        prepare=checkpointed,
    )
    assert_within_2x(ref, plain, patched, "qwen3_vl/grad-ckpt/fp32+autocast")
    assert calls.count(True) >= 2 * 2  # forward and recomputation both went through the kernel


def test_negative_control_merged_sequences_exceed_the_tolerance(monkeypatch):
    """The same check fails when two samples attend to each other (rows 0 and 1 given as one sequence)."""
    model, processor = model_and_processor("qwen2_5_vl")
    batch = processed_batch(processor, conversations(with_video=False))
    positions, _ = model.model.get_rope_index(
        batch["input_ids"],
        mm_token_type_ids=batch["mm_token_type_ids"],
        image_grid_thw=batch["image_grid_thw"],
        attention_mask=batch["attention_mask"],
    )
    lengths = batch["attention_mask"].sum(1).tolist()
    merged = torch.tensor(
        [0, lengths[0] + lengths[1], *torch.tensor(lengths).cumsum(0)[2:].tolist()], dtype=torch.int32
    )
    ref = _run(model, batch, autocast=False)
    plain = _run(model, batch, autocast=True)
    install_kernel(monkeypatch, "flash_attn")
    hf_packing.apply_rmpad("qwen2_5_vl", attn_backend="flash_attn")
    broken = _run(model, batch | {"position_ids": positions, "cu_seqlens": merged}, autocast=True)
    with pytest.raises(AssertionError):
        assert_within_2x(ref, plain, broken, "merged rows 0+1")


def test_stand_in_refuses_what_the_kernel_refuses(monkeypatch):
    install_kernel(monkeypatch, "flash_attn")
    q = torch.randn(5, 4, 16)
    seqs = hf_packing.ops.varlen.PackedSequences.from_seqlens([2, 3])
    with pytest.raises(KernelContractError, match="fp16 and bf16"):
        from tests import kernels

        kernels.flash_attn_varlen_func(q, q, q, seqs.cu_seqlens, seqs.cu_seqlens, 3, 3)
    with pytest.raises(KernelContractError, match="int32"):
        h = q.bfloat16()
        kernels.flash_attn_varlen_func(h, h, h, seqs.cu_seqlens.long(), seqs.cu_seqlens, 3, 3)
    with pytest.raises(KernelContractError, match="Python int"):
        kernels.flash_attn_varlen_func(h, h, h, seqs.cu_seqlens, seqs.cu_seqlens, torch.tensor(3), 3)
    with pytest.raises(KernelContractError, match="contiguous last dimension"):
        t = torch.randn(5, 16, 4).bfloat16().transpose(1, 2)
        kernels.flash_attn_varlen_func(t, t, t, seqs.cu_seqlens, seqs.cu_seqlens, 3, 3)
    # the library's own call casts mixed (fp32, fp32, bf16) inputs under autocast, as transformers' flash path does
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = varlen_attention(q, q, q.bfloat16(), seqs, causal=True, scale=0.25, backend="flash_attn")
    assert out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="needs fp16/bf16 attention inputs"):
        varlen_attention(q, q, q, seqs, causal=True, scale=0.25, backend="flash_attn")
    assert varlen_attention(q, q, q, seqs, causal=True, scale=0.25, backend="auto").dtype == torch.float32


def _trainer_step_update(model, micro_batches: list[dict], accumulation: int) -> dict[str, torch.Tensor]:
    """One SGD step of the real Trainer over ``micro_batches`` (gradient accumulation), as parameter deltas."""
    from transformers import Trainer, TrainingArguments

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = TrainingArguments(
        "/tmp/hf_packing_moe_step",
        per_device_train_batch_size=1,
        max_steps=1,
        gradient_accumulation_steps=accumulation,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        remove_unused_columns=False,
        max_grad_norm=0.0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=micro_batches, data_collator=lambda items: items[0])
    trainer.train()
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}


def test_moe_aux_loss_keeps_its_weight_under_accumulation_in_the_trainer():
    """qwen3_vl_moe with the router aux loss, gradient accumulation 2: one Trainer step of the patched model equals
    the unpatched model's (micro-batches with equal supervised counts, so mean-of-means == token-level CE). Before
    the aux term was scaled, it weighed ``accumulation`` times too much there."""
    from tests.helpers import assert_equivalent

    model, processor = model_and_processor("qwen3_vl_moe")
    model.config.text_config.output_router_logits = True
    model.config.text_config.router_aux_loss_coef = 0.5  # large enough that a wrong weight shows
    rows = conversations(with_video=False)
    micro = [processed_batch(processor, rows[:2]), processed_batch(processor, rows[2:])]
    counts = [int((b["labels"][:, 1:] != -100).sum()) for b in micro]
    first = micro[0]["labels"]
    while counts[0] > counts[1]:  # equalise the supervised counts by masking labels of the first micro-batch
        row, col = (first != -100).nonzero()[-1].tolist()
        first[row, col] = -100
        counts[0] -= 1
    while counts[1] > counts[0]:
        second = micro[1]["labels"]
        row, col = (second != -100).nonzero()[-1].tolist()
        second[row, col] = -100
        counts[1] -= 1
    state = {n: p.detach().clone() for n, p in model.state_dict().items()}
    ref = _trainer_step_update(model, micro, accumulation=2)
    model.load_state_dict(state)
    hf_packing.apply_rmpad("qwen3_vl_moe")
    got = _trainer_step_update(model, micro, accumulation=2)
    norm = lambda d: {n: t for n, t in d.items() if t.norm() > 0}  # noqa: E731
    assert_equivalent((1.0, norm(ref)), (1.0, norm(got)), "moe aux, accumulation 2")


@pytest.mark.multiproc
def test_ddp_with_an_unsupervised_micro_batch(tmp_path):
    """DDP, find_unused_parameters=False: a rank whose micro-batch has no supervised token still gives lm_head a
    (zero) gradient, so the next step does not fail with "Expected to have finished reduction"; a step with no
    supervised token anywhere gives loss 0, not NaN."""
    import json
    from pathlib import Path

    out = tmp_path / "ddp.json"
    proc = torchrun(Path(__file__).parent / "multiproc_ddp.py", str(out), timeout=300)
    assert proc is not None, "DDP run hung"
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = json.loads(out.read_text())["losses"]
    assert losses[0] > 0 and losses[1] == 0.0


def _recipe_setups() -> set[tuple[str, bool, bool]]:
    """(dtype, bf16, activation checkpointing) of every GPU recipe config in recipes/configs."""
    from pathlib import Path

    import yaml

    configs = sorted((Path(__file__).resolve().parents[1] / "recipes" / "configs").glob("qwen*.yaml"))
    assert configs
    setups = set()
    for path in configs:
        config = yaml.safe_load(path.read_text())
        checkpointing = config.get("activation_checkpointing", config.get("gradient_checkpointing", False))
        setups.add((config["dtype"], bool(config.get("bf16")), bool(checkpointing)))
    return setups


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_the_recipes_precision_setup_through_strict_flash_attn(model_type, monkeypatch):
    """Exactly what recipes/configs/qwen*.yaml run: fp32 weights, bf16 autocast, non-reentrant activation
    checkpointing, attn_implementation sdpa with attn_backend auto (flash_attn where installed)."""
    assert _recipe_setups() == {("float32", True, True)}, "a recipe changed its precision setup: test that one"

    def checkpointed(model):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model.train()

    ref, plain, patched, calls, _ = _three_runs(
        model_type, monkeypatch, "flash_attn", autocast=True, prepare=checkpointed
    )
    assert_within_2x(ref, plain, patched, f"{model_type}/recipe setup")
    assert True in calls and False in calls


def test_loss_follows_the_heads_device_like_device_map():
    """device_map puts lm_head on another device than the last layer (accelerate's hook moves the head's input):
    targets and indices must follow to the head's device, as transformers' ForCausalLMLoss does. A CPU machine has
    one device, so the head goes to ``meta`` here: mixing meta and CPU tensors in the loss raises like two GPUs."""
    model, processor = model_and_processor("qwen2_5_vl")
    batch = processed_batch(processor, conversations(with_video=False))
    model.lm_head.to("meta")
    model.lm_head.register_forward_pre_hook(lambda module, args: tuple(a.to("meta") for a in args))
    assert model(**batch).loss.device.type == "meta"  # the unpatched model's contract
    hf_packing.apply_rmpad("qwen2_5_vl")
    assert model(**batch).loss.device.type == "meta"
    assert model(**batch, num_items_in_batch=torch.tensor(7)).loss.device.type == "meta"
