"""The real kernels on CUDA (run with ``pytest -m gpu``; CI has no GPU).

The same setups as tests/test_precision.py runs through strict stand-ins on CPU, here on the real
``torch_varlen`` / ``flash_attn`` kernels: bf16 weights, and fp32 weights under bf16 autocast (the recipes'
``dtype: float32`` + ``bf16: true``). Tolerance rule: the patched run's error against the fp32 unpatched run is
at most 2x the unpatched low-precision run's own error; both numbers are printed before asserting. Also a model
split over two devices (``device_map``): the loss follows the head's device. And the sync gate on the device: a
patched training step under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import sys
import traceback
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

import hf_packing
from hf_packing import _compat
from hf_packing.testing.tiny import build_tiny_model
from tests.helpers import FIXTURES, MODEL_TYPES, conversations, load_processor, padded_rows, processed_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _run(model, batch, autocast: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else nullcontext():
        out = model(**batch)
    out.loss.backward()
    grads = torch.cat([p.grad.float().flatten() for _, p in sorted(model.named_parameters()) if p.grad is not None])
    return out.loss.float().item(), grads


def _backends() -> list[str]:
    names = ["torch_varlen"] if _compat.torch_varlen_attn() is not None else []
    return names + (["flash_attn"] if _compat.flash_attn_varlen_module() is not None else [])


@pytest.mark.parametrize("setup", ["bf16_weights", "fp32_weights_autocast"])
@pytest.mark.parametrize("backend", ["torch_varlen", "flash_attn"])
@pytest.mark.parametrize("model_type", MODEL_TYPES + ("glm4v",))
def test_real_kernel_error_within_2x_of_plain_low_precision(model_type, backend, setup):
    if backend not in _backends():
        pytest.skip(f"{backend} not available")
    autocast = setup == "fp32_weights_autocast"
    processor = load_processor(model_type)
    rows = padded_rows(model_type)  # GLM-V: no video beside the images, which its unpatched model refuses
    batch = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in processed_batch(processor, rows).items()}
    model = build_tiny_model(model_type, processor_dir=FIXTURES / model_type).cuda()
    ref_loss, ref_grads = _run(model, batch, autocast=False)
    if not autocast:
        model = model.to(torch.bfloat16)
    plain_loss, plain_grads = _run(model, batch, autocast)
    hf_packing.apply_rmpad(model_type, attn_backend=backend)
    rmpad_loss, rmpad_grads = _run(model, batch, autocast)
    plain_err = ((plain_grads - ref_grads).norm() / ref_grads.norm()).item()
    rmpad_err = ((rmpad_grads - ref_grads).norm() / ref_grads.norm()).item()
    print(
        f"{model_type}/{backend}/{setup}: loss fp32 {ref_loss:.5f} plain {plain_loss:.5f} rmpad {rmpad_loss:.5f}; "
        f"grad rel err plain {plain_err:.3e}, rmpad {rmpad_err:.3e}"
    )
    assert abs(rmpad_loss - ref_loss) <= 2 * abs(plain_loss - ref_loss) + 1e-3
    assert rmpad_err <= 2 * plain_err


def test_device_map_split_model_loss_follows_the_head():
    """Backbone on the GPU, lm_head on the CPU (accelerate hooks move the head's input): targets and indices
    follow, and the loss equals the unpatched one."""
    from accelerate import dispatch_model

    processor = load_processor("qwen2_5_vl")
    batch = {
        k: (v.cuda() if isinstance(v, torch.Tensor) else v)
        for k, v in processed_batch(processor, conversations(with_video=False)).items()
    }
    model = build_tiny_model("qwen2_5_vl", processor_dir=FIXTURES / "qwen2_5_vl")
    model = dispatch_model(model, device_map={"model": 0, "lm_head": "cpu"})
    ref = model(**batch).loss.item()
    hf_packing.apply_rmpad("qwen2_5_vl")
    got = model(**batch).loss
    got.backward()
    print(f"device_map split: loss unpatched {ref:.6f} patched {got.item():.6f}")
    assert got.item() == pytest.approx(ref, rel=1e-4)


@pytest.mark.parametrize("setup", ["bf16_weights", "fp32_weights_autocast"])
@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_fla_linear_attention_equals_each_sample_alone_within_2x(model_type, setup):
    """Qwen3.5 on the real flash-linear-attention kernels: a packed row (VisionCollator mode='flat') through the
    patched model against the fp32 oracle (each sample alone, unpadded, unpatched; CPU tests prove the exact
    reference path equal to it), at most 2x the error of each sample alone, unpatched, in the same precision."""
    if _compat.fla_linear_ops() is None:
        pytest.skip("flash-linear-attention not installed (pip install 'hf_packing[linear]')")
    from hf_packing import VisionCollator
    from tests.helpers import assert_within_2x, each_sample_alone, processed_samples

    autocast = setup == "fp32_weights_autocast"
    processor = load_processor(model_type)
    cuda = lambda d: {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}  # noqa: E731
    samples = [cuda(s) for s in processed_samples(processor)]
    model = build_tiny_model(model_type, processor_dir=FIXTURES / model_type).cuda()
    hf_packing.apply_rmpad(model_type, attn_backend="reference", linear_backend="reference")  # exact, fp32
    packed = cuda(VisionCollator(processor, mode="flat", model_config=model.config)(processed_samples(processor)))
    ref_loss, ref_grads = _run(model, packed, autocast=False)
    hf_packing.revert_rmpad()
    if not autocast:
        model = model.to(torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else nullcontext():
        plain_loss, by_name = each_sample_alone(model, samples)
    plain_grads = torch.cat([by_name[n].float().flatten() for n in sorted(by_name)])
    hf_packing.apply_rmpad(model_type, linear_backend="fla")
    assert_within_2x(
        (ref_loss, ref_grads),
        (plain_loss, plain_grads),
        _run(model, packed, autocast),
        f"{model_type}/fla/{setup}, packed vs each alone (plain)",
    )


def _cuda(obj):
    """``obj`` on the GPU, nested dicts (the collator's ``vision_inputs``) too, as the Trainer moves a batch."""
    if isinstance(obj, torch.Tensor):
        return obj.cuda()
    if isinstance(obj, dict):
        return {k: _cuda(v) for k, v in obj.items()}
    return obj


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("mode", ["rows", "flat"])
@pytest.mark.parametrize("model_type", MODEL_TYPES + ("glm4v",))
def test_patched_training_step_makes_no_host_sync_on_the_device(model_type, mode, checkpointing):
    """The CPU gate (tests/test_syncs.py) on the real device: one patched training step (forward, loss, backward) on
    a collator pack in bf16, after one warm-up step, under ``torch.cuda.set_sync_debug_mode("error")``. A sync fails
    it with its origin: the Python lines that issued it, or, raised inside backward (autograd's engine, no frame of
    the op), the backward node and the forward line that created it (benchmarks/bench_gpu.py's diagnosis under
    ``detect_anomaly``)."""
    from hf_packing import VisionCollator
    from tests.helpers import processed_samples

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_gpu

    processor = load_processor(model_type)
    model = build_tiny_model(model_type, processor_dir=FIXTURES / model_type).cuda().to(torch.bfloat16).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_packing.apply_rmpad(model_type)  # auto backends: bf16 on CUDA picks the varlen kernels
    batch = _cuda(VisionCollator(processor, mode=mode, model_config=model.config)(processed_samples(processor)))
    extra = {"num_items_in_batch": torch.tensor(batch["num_supervised_tokens"], device="cuda")}
    text = model.config.get_text_config()
    if getattr(text, "num_experts", None) or getattr(text, "n_routed_experts", None):  # GLM-4.5V: DeepSeek's name
        extra["output_router_logits"] = True  # MoE: the aux loss term

    def step() -> None:
        model(**batch, **extra).loss.backward()

    step()  # warm-up: lazy initialisation (handles, kernels) stays outside the gate
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    try:
        with bench_gpu.sync_debug_mode("error"):
            step()
    except RuntimeError as exc:
        if not bench_gpu.is_sync_error(exc):
            raise
        model.zero_grad(set_to_none=True)
        if bench_gpu._in_backward(exc):
            where = bench_gpu.backward_sync_origin(step)
        else:
            where = bench_gpu._frames(traceback.extract_tb(exc.__traceback__), 6)
        print(f"\nsync gate {model_type}/{mode}/checkpointing={checkpointing}: {where}")
        pytest.fail(f"{model_type} ({mode}, checkpointing {checkpointing}): a host sync in the patched step: {where}")
