"""``TrainingArguments(use_liger_kernel=True)`` under `apply_rmpad`: Liger's inner kernels, never its forward.

Liger's kernels are Triton and need a GPU, so on CPU the wiring is tested: after `prepare_trainer` the model's
forward is still the patched one (no instance ``forward`` shadows the class's), and the decoder's norms, MLPs (or
MoE experts) and the family's rope function are Liger's; a ``liger_kernel_config`` asking for the fused-loss forward
is refused. The negative control applies Liger as the Trainer would without `prepare_trainer`: the forward is
replaced, which the same assertion sees. The GPU arm of benchmarks/bench_gpu.py runs them.

Liger patches module globals of transformers (its rope functions, norm and MLP classes); `restore_transformers`
puts every global of the families' modeling modules back after each test.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

import hf_packing
from hf_packing import _compat
from hf_packing.patches import is_patched
from hf_packing.testing.tiny import GLM_TYPES, MODEL_TYPES, build_tiny_model

liger = pytest.importorskip("liger_kernel.transformers", reason="liger-kernel (the 'liger' extra) is not installed")
from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN  # noqa: E402

#: the families Liger has kernels for (0.8.5: not Qwen4-Exp nor GLM-4.6V, refused below)
LIGER_TYPES = [m for m in MODEL_TYPES + GLM_TYPES if m in MODEL_TYPE_TO_APPLY_LIGER_FN]


@pytest.fixture(autouse=True)
def restore_transformers():
    modules = [importlib.import_module(f"transformers.models.{m}.modeling_{m}") for m in MODEL_TYPES + GLM_TYPES]
    saved = [(module, dict(vars(module))) for module in modules]
    yield
    for module, before in saved:
        for name in set(vars(module)) - set(before):
            delattr(module, name)
        for name, value in before.items():
            setattr(module, name, value)


def _trainer(tmp_path, model, **liger_config):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        max_steps=1,
        use_liger_kernel=True,
        liger_kernel_config=liger_config or None,
    )
    return Trainer(model=model, args=args, train_dataset=[])


def _forward_replaced(model) -> bool:
    """Whether something shadows the class's (patched) forward on the instance, as Liger's fused-loss path does."""
    return "forward" in vars(model) or not is_patched(model)


def _liger_parts(model, model_type: str) -> dict[str, bool]:
    """Which inner parts run Liger's code: every decoder norm, every MLP / experts module (Liger binds its forward on
    the instance), the rope function."""
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    modeling = sys.modules[f"transformers.models.{model_type}.modeling_{model_type}"]
    layers = model.model.language_model.layers
    norms = [m for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
    mlps = [getattr(layer.mlp, "experts", layer.mlp) for layer in layers]
    rope = getattr(modeling, "apply_multimodal_rotary_pos_emb", None) or modeling.apply_rotary_pos_emb
    return {
        "norms": all(getattr(n.forward, "__func__", None) is LigerRMSNorm.forward for n in norms),
        "mlps": all("forward" in vars(m) for m in mlps),
        "rope": rope.__module__.startswith("liger_kernel"),
    }


def _liger_defaults(model_type: str) -> dict[str, bool]:
    """What Liger applies to the family by default (its function's defaults: Qwen3-VL's SwiGLU is off)."""
    import inspect

    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    params = inspect.signature(MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]).parameters
    return {"norms": params["rms_norm"].default, "mlps": params["swiglu"].default, "rope": params["rope"].default}


@pytest.mark.parametrize("model_type", LIGER_TYPES)
def test_inner_kernels_applied_forward_kept(model_type, tmp_path):
    hf_packing.apply_rmpad(model_type)
    try:
        model = build_tiny_model(model_type)
        trainer = hf_packing.prepare_trainer(_trainer(tmp_path, model))
        parts = _liger_parts(model, model_type)
        print(f"{model_type}: Liger's {parts}; forward replaced: {_forward_replaced(model)}")
        assert parts == _liger_defaults(model_type) and parts["norms"]
        assert not _forward_replaced(model)
        config = trainer.args.liger_kernel_config
        assert config["fused_linear_cross_entropy"] is False and config["cross_entropy"] is False
        assert trainer.args.use_liger_kernel is False  # Trainer.train() applies nothing over them
        # a Liger fused-loss module that failed to import was stood in for during the call only
        assert not isinstance(sys.modules.get(f"liger_kernel.transformers.model.{model_type}"), _compat._NoLossForward)
    finally:
        hf_packing.revert_rmpad(model_type)


def test_liger_kernel_config_reaches_liger(tmp_path):
    """``liger_kernel_config`` options other than the loss's pass through: SwiGLU and rope off on Qwen2.5-VL (on by
    Liger's default)."""
    hf_packing.apply_rmpad("qwen2_5_vl")
    try:
        model = build_tiny_model("qwen2_5_vl")
        hf_packing.prepare_trainer(_trainer(tmp_path, model, swiglu=False, rope=False))
        assert _liger_parts(model, "qwen2_5_vl") == {"norms": True, "mlps": False, "rope": False}
        assert not _forward_replaced(model)
    finally:
        hf_packing.revert_rmpad("qwen2_5_vl")


def test_negative_control_liger_as_the_trainer_applies_it(tmp_path):
    """Without prepare_trainer, Trainer.train()'s ``apply_liger_kernel`` (Liger's defaults) replaces the forward.
    Qwen3.5: the one family whose Liger fused-loss module imports on transformers 5.23 (docs/performance.md)."""
    from transformers.integrations.liger import apply_liger_kernel

    hf_packing.apply_rmpad("qwen3_5")
    try:
        model = build_tiny_model("qwen3_5")
        assert not _forward_replaced(model)
        apply_liger_kernel(model, None)
        assert _forward_replaced(model)
    finally:
        hf_packing.revert_rmpad("qwen3_5")


@pytest.mark.parametrize("option", ["fused_linear_cross_entropy", "cross_entropy"])
def test_a_config_asking_for_liger_loss_is_refused(option, tmp_path):
    hf_packing.apply_rmpad("qwen2_vl")
    try:
        model = build_tiny_model("qwen2_vl")
        with pytest.raises(ValueError, match=f"drop {option} from liger_kernel_config"):
            hf_packing.prepare_trainer(_trainer(tmp_path, model, **{option: True}))
        assert not _forward_replaced(model)
    finally:
        hf_packing.revert_rmpad("qwen2_vl")


def test_unpatched_model_is_left_to_the_trainer(tmp_path):
    """An unpatched model keeps transformers' behaviour: prepare_trainer neither applies nor rewrites anything."""
    model = build_tiny_model("qwen2_vl")
    trainer = hf_packing.prepare_trainer(_trainer(tmp_path, model))
    assert trainer.args.liger_kernel_config in (None, {})
    assert not any("forward" in vars(m) for m in model.modules())
    assert isinstance(model.model.language_model.norm.weight, torch.nn.Parameter)


@pytest.mark.parametrize("model_type", ["qwen4_exp", "glm46v"])
def test_a_family_liger_does_not_know_is_refused(model_type, tmp_path):
    """Liger's own entry point logs and applies nothing for an unknown model_type; prepare_trainer says so instead
    (GLM-4.6V runs GLM-4.1V's text model, but Liger 0.8.5 knows it by neither name)."""
    assert model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN
    hf_packing.apply_rmpad(model_type)
    try:
        model = build_tiny_model(model_type)
        with pytest.raises(ValueError, match=rf"no kernels for model_type '{model_type}'.*use_liger_kernel=False"):
            hf_packing.prepare_trainer(_trainer(tmp_path, model))
        assert not _forward_replaced(model)
    finally:
        hf_packing.revert_rmpad(model_type)
