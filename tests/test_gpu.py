"""bf16 equivalence on CUDA (run with ``pytest -m gpu``; CI has no GPU).

Tolerance rule: the patched bf16 run's error against the fp32 unpatched run must be at most 2x the
unpatched bf16 run's own error against that fp32 run. Both numbers are printed before asserting.
"""

from __future__ import annotations

import pytest
import torch

import hf_packing
from hf_packing import _compat
from hf_packing.tiny import build_tiny_model
from tests.conftest import FIXTURES, MODEL_TYPES, load_processor, processed_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _run(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = torch.cat([p.grad.float().flatten() for _, p in sorted(model.named_parameters()) if p.grad is not None])
    return out.loss.float().item(), grads


def _backends() -> list[str]:
    names = ["torch_varlen"] if _compat.torch_varlen_attn() is not None else []
    return names + (["flash_attn"] if _compat.flash_attn_varlen_module() is not None else [])


@pytest.mark.parametrize("backend", _backends() or ["torch_varlen"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_bf16_patched_error_within_2x_of_plain_bf16(model_type, backend):
    if backend not in _backends():
        pytest.skip(f"{backend} not available")
    processor = load_processor(model_type)
    batch = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in processed_batch(processor).items()}
    model = build_tiny_model(model_type, processor_dir=FIXTURES / model_type).cuda()
    ref_loss, ref_grads = _run(model, batch)
    model = model.to(torch.bfloat16)
    bf16_loss, bf16_grads = _run(model, batch)
    hf_packing.apply_rmpad(model_type, attn_backend=backend)
    rmpad_loss, rmpad_grads = _run(model, batch)
    plain_err = ((bf16_grads - ref_grads).norm() / ref_grads.norm()).item()
    rmpad_err = ((rmpad_grads - ref_grads).norm() / ref_grads.norm()).item()
    print(f"{model_type}/{backend}: loss fp32 {ref_loss:.5f} bf16 {bf16_loss:.5f} rmpad {rmpad_loss:.5f}; "
          f"grad rel err plain bf16 {plain_err:.3e}, rmpad bf16 {rmpad_err:.3e}")
    assert abs(rmpad_loss - ref_loss) <= 2 * abs(bf16_loss - ref_loss) + 1e-3
    assert rmpad_err <= 2 * plain_err
