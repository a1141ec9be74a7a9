"""The patched backbone ``XModel.forward`` (hf_packing/patches/_backbone.py) equals the unpatched one.

Callers with their own head (TRL's fused LM head, reward / value heads) run ``model.model``; under the patch its
decoder layers see only real tokens and ``last_hidden_state`` comes back as ``(B, L, H)``, zeros at pads.
"""

from __future__ import annotations

import pytest
import torch

import hf_packing
from hf_packing.ops.varlen import PackedSequences
from hf_packing.patches import _forward, revert_rmpad
from hf_packing.patches._spec import FAMILIES
from tests.helpers import (
    GLM_TYPES,
    MODEL_TYPES,
    first_layer_tokens,
    glm_params,
    model_and_processor,
    padded_rows,
    processed_batch,
)

HIDDEN_RTOL, GRAD_RTOL = 1e-5, 1e-4
VISION_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")


def packed_row(model, batch: dict) -> dict:
    """The right-padded ``batch`` as one row packed by position ids (transformers' 4-row form, no mask)."""
    mask = batch["attention_mask"].bool()
    rope_extra = {k: batch[k] for k in ("second_per_grid_ts",) if k in batch}
    mrope, _ = model.model.get_rope_index(
        batch["input_ids"],
        mm_token_type_ids=batch["mm_token_type_ids"],
        image_grid_thw=batch.get("image_grid_thw"),
        video_grid_thw=batch.get("video_grid_thw"),
        attention_mask=batch["attention_mask"],
        **rope_extra,
    )
    text = (mask.long().cumsum(1) - 1)[mask]
    positions = torch.cat([text[None], mrope[:, mask]])[:, None]
    row = {k: batch[k][mask][None] for k in ("input_ids", "mm_token_type_ids")}
    return row | {"position_ids": positions} | {k: batch[k] for k in VISION_KEYS if k in batch}


def hidden_and_grads(model, inputs: dict, real: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``last_hidden_state`` at the real positions ``(T, H)`` and the gradients of a fixed loss on them."""
    model.zero_grad(set_to_none=True)
    hidden = model.model(**inputs, use_cache=False).last_hidden_state
    packed = hidden.shape[:2].numel() != real.numel()  # one packed row holds the real tokens only
    flat = hidden[0] if packed else hidden.flatten(0, 1)[real]
    weights = torch.linspace(-1, 1, flat.numel(), dtype=flat.dtype).view_as(flat)
    (flat * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return flat.detach(), grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def compare(ref, got, label: str) -> tuple[float, float]:
    (ref_hidden, ref_grads), (hidden, grads) = ref, got
    assert ref_grads.keys() == grads.keys(), set(ref_grads) ^ set(grads)
    hidden_err = rel(hidden, ref_hidden)
    grad_err = max(rel(grads[n], g) for n, g in ref_grads.items())
    print(f"{label}: last_hidden_state rel {hidden_err:.2e}; worst grad rel {grad_err:.2e}")
    return hidden_err, grad_err


@pytest.mark.parametrize("layout", ["right", "left", "packed"])
@pytest.mark.parametrize("model_type", MODEL_TYPES + glm_params("glm4v", "glm4v_moe"))
def test_backbone_equals_unpatched(model_type, layout):
    """``model.model(...)`` on padded rows (right / left) or one position-id-packed row: the same hidden states at
    every real position and the same gradients as the unpatched backbone on the padded batch; the first decoder
    layer sees exactly the real tokens; pads come back as zeros in the caller's ``(B, L, H)``. GLM-V: the batch
    without the video, which its unpatched model refuses beside images."""
    model, processor = model_and_processor(model_type, "left" if layout == "left" else "right")
    batch = {k: v for k, v in processed_batch(processor, padded_rows(model_type)).items() if k != "labels"}
    real = batch["attention_mask"].flatten().bool()
    ref = hidden_and_grads(model, batch, real)
    inputs = packed_row(model, batch) if layout == "packed" else batch
    hf_packing.apply_rmpad(model_type)
    seen = first_layer_tokens(model)
    got = hidden_and_grads(model, inputs, real)
    hidden_err, grad_err = compare(ref, got, f"{model_type}/{layout}")
    assert seen == [int(real.sum())]
    assert hidden_err <= HIDDEN_RTOL and grad_err <= GRAD_RTOL
    with torch.no_grad():
        out = model.model(**inputs, use_cache=False)
    assert out.last_hidden_state.shape[:2] == inputs["input_ids"].shape
    if layout != "packed":
        assert not out.last_hidden_state.flatten(0, 1)[~real].any()


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "glm4v"])
def test_negative_control_boundaries_dropped_fail(model_type, monkeypatch):
    """The same comparison fails when the backbone's flat row loses its sequence boundaries (one sequence)."""
    model, processor = model_and_processor(model_type)
    batch = {k: v for k, v in processed_batch(processor, padded_rows(model_type)).items() if k != "labels"}
    real = batch["attention_mask"].flatten().bool()
    ref = hidden_and_grads(model, batch, real)
    hf_packing.apply_rmpad(model_type)
    flatten = _forward.flatten_batch

    def merged(*args, **kwargs):
        flat = flatten(*args, **kwargs)
        flat.seqs = PackedSequences.from_seqlens([sum(flat.seqs.seqlens)], device=flat.input_ids.device)
        return flat

    monkeypatch.setattr(_forward, "flatten_batch", merged)
    hidden_err, grad_err = compare(ref, hidden_and_grads(model, batch, real), "boundaries dropped")
    assert hidden_err > 1e-2 and grad_err > 1e-2


def test_top_level_flattens_once(monkeypatch):
    """The patched top-level forward runs the patched backbone without flattening again: one flatten per step."""
    model, processor = model_and_processor("qwen3_vl")
    batch = processed_batch(processor)
    hf_packing.apply_rmpad("qwen3_vl")
    calls: list[int] = []
    flatten = _forward.flatten_batch
    monkeypatch.setattr(_forward, "flatten_batch", lambda *a, **k: calls.append(1) or flatten(*a, **k))
    seen = first_layer_tokens(model)
    model(**batch).loss.backward()
    assert calls == [1] and seen == [int(batch["attention_mask"].sum())]


def test_generation_style_backbone_calls_run_the_original():
    """A backbone call with ``use_cache=True`` (or ``inputs_embeds``) is transformers' own code: padded tokens,
    a cache back."""
    model, processor = model_and_processor("qwen2_vl", "left")
    batch = {k: v for k, v in processed_batch(processor).items() if k != "labels"}
    model.eval()
    hf_packing.apply_rmpad("qwen2_vl")
    seen = first_layer_tokens(model)
    with torch.no_grad():
        cached = model.model(**batch, use_cache=True)
        embedded = model.model(inputs_embeds=model.model.get_input_embeddings()(batch["input_ids"]), use_cache=False)
    assert seen == [batch["input_ids"].numel()] * 2 and cached.past_key_values is not None
    assert embedded.last_hidden_state.shape[:2] == batch["input_ids"].shape


def test_return_dict_false_gives_the_tuple():
    model, processor = model_and_processor("qwen2_5_vl")
    batch = {k: v for k, v in processed_batch(processor).items() if k != "labels"}
    hf_packing.apply_rmpad("qwen2_5_vl")
    with torch.no_grad():
        as_dict = model.model(**batch, use_cache=False, output_hidden_states=True)
        as_tuple = model.model(**batch, use_cache=False, output_hidden_states=True, return_dict=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], as_dict.last_hidden_state)
    assert all(h.shape == as_dict.last_hidden_state.shape for h in as_dict.hidden_states)
    assert torch.equal(as_dict.hidden_states[-1], as_dict.last_hidden_state)


def test_revert_restores_backbone_forwards():
    """Every family's backbone forward is patched by `apply_rmpad` and comes back ``is``-identical on revert."""
    before = {}
    for spec in FAMILIES.values():
        module = spec.load()
        for cls_name in (spec.model_class, spec.backbone_class):
            before[cls_name] = getattr(module, cls_name), getattr(module, cls_name).__dict__["forward"]
    hf_packing.apply_rmpad()
    for cls, original in before.values():
        assert cls.__dict__["forward"] is not original and cls.__dict__["forward"].hf_packing_original is original
    revert_rmpad()
    assert all(cls.__dict__["forward"] is original for cls, original in before.values())


@pytest.mark.parametrize("model_type", ["qwen3_vl_moe", "qwen3_5_moe", "glm4v_moe"])
def test_moe_router_logits_and_aux_loss_as_unpatched(model_type):
    """Router logits come back in the unpatched ``(B·L, E)`` rows (zeros at pads), equal at real rows; the
    load-balancing loss with the caller's attention mask (what TRL adds) equals the unpatched one."""
    model, processor = model_and_processor(model_type)
    batch = {k: v for k, v in processed_batch(processor, padded_rows(model_type)).items() if k != "labels"}
    real = batch["attention_mask"].flatten().bool()
    text = model.config.text_config
    experts = text.n_routed_experts if model_type in GLM_TYPES else text.num_experts  # GLM-V: DeepSeek's name
    module = FAMILIES[model_type].load()

    def router_and_aux():
        with torch.no_grad():
            router = model.model(**batch, use_cache=False, output_router_logits=True).router_logits
        mask = batch["attention_mask"]
        return router, module.load_balancing_loss_func(router, experts, text.num_experts_per_tok, mask)

    ref_router, ref_aux = router_and_aux()
    hf_packing.apply_rmpad(model_type)
    router, aux = router_and_aux()
    assert [r.shape for r in router] == [r.shape for r in ref_router]
    worst = max(rel(r[real], q[real]) for r, q in zip(router, ref_router))
    print(f"{model_type}: router logits rel {worst:.2e}; aux {ref_aux.item():.7f} vs {aux.item():.7f}")
    assert worst <= HIDDEN_RTOL and not any(r[~real].any() for r in router)
    torch.testing.assert_close(aux, ref_aux, rtol=1e-5, atol=0)
