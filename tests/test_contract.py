"""Drop-in fidelity: every contract of transformers' own forward, patched against unpatched, for the four families.

Each case runs the same call on the unpatched and the patched model: same output class, same shapes, same values
on real tokens, same exceptions. Position-id-packed rows (transformers' padding-free format) are compared with
the documents run one by one, since Qwen2-VL / Qwen2.5-VL's own sdpa path merges 2-D packed rows (upstream).
"""

from __future__ import annotations

import inspect
import typing

import pytest
import torch

import hf_packing
from tests.helpers import (
    GLM_TYPES,
    MODEL_TYPES,
    assert_equivalent,
    conversations,
    glm_params,
    loss_and_grads,
    model_and_processor,
    processed_batch,
)

DOCS = ("Hello there, how are you today my friend?", "The quick brown fox jumps over the lazy dog.", "Short one.")


def _documents(processor) -> list[list[int]]:
    return [processor.tokenizer(text)["input_ids"] for text in DOCS]


def _flattened(processor, **collator_kwargs) -> dict[str, torch.Tensor]:
    from transformers import DataCollatorWithFlattening

    features = [{"input_ids": ids, "labels": ids} for ids in _documents(processor)]
    return DataCollatorWithFlattening(**collator_kwargs)(features, return_tensors="pt")


def _per_document(model, processor) -> tuple[torch.Tensor, float]:
    """Logits of each document run alone, concatenated, and the token-level loss over all of them."""
    logits, loss_sum, count = [], 0.0, 0
    for ids in _documents(processor):
        ids_t = torch.tensor([ids])
        out = model(input_ids=ids_t, labels=ids_t, use_cache=False)
        n = len(ids) - 1
        logits.append(out.logits[0])
        loss_sum, count = loss_sum + out.loss.item() * n, count + n
    return torch.cat(logits), loss_sum / count


@pytest.mark.parametrize("model_type", MODEL_TYPES + GLM_TYPES)
@pytest.mark.parametrize("form", ["2d", "4row", "flash_kwargs"])
def test_position_id_packed_row_is_never_merged(model_type, form):
    model, processor = model_and_processor(model_type)
    model.eval()
    batch = _flattened(processor, return_flash_attn_kwargs=form == "flash_kwargs")
    if form == "4row":
        batch["position_ids"] = batch["position_ids"][None].expand(4, -1, -1)
    hf_packing.apply_rmpad(model_type)
    with torch.no_grad():
        ref_logits, ref_loss = _per_document(model, processor)
        out = model(**batch, use_cache=False)
    err = (out.logits[0] - ref_logits).abs().max().item()
    print(
        f"{model_type}/{form}: max |logit diff| vs documents alone {err:.2e}; loss {out.loss.item():.6f} vs "
        f"{ref_loss:.6f}"
    )
    assert err < 1e-4
    assert out.loss.item() == pytest.approx(ref_loss, rel=1e-5)


def test_negative_control_merging_changes_the_logits():
    """The same comparison fails when the boundaries are dropped (one row, positions 0..T-1)."""
    model, processor = model_and_processor("qwen3_vl")
    model.eval()
    batch = _flattened(processor)
    batch["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]
    hf_packing.apply_rmpad("qwen3_vl")
    with torch.no_grad():
        ref_logits, _ = _per_document(model, processor)
        out = model(**batch, use_cache=False)
    assert (out.logits[0] - ref_logits).abs().max().item() > 1e-2


@pytest.mark.parametrize("model_type", ["qwen3_vl", "qwen3_vl_moe"])
@pytest.mark.parametrize("flash_kwargs", [False, True])
def test_data_collator_with_flattening_matches_unpatched(model_type, flash_kwargs):
    """transformers' own padding-free collator: the patched model gives the unpatched loss and gradients (these
    families detect 2-D packed positions themselves when use_cache=False)."""
    model, processor = model_and_processor(model_type)
    batch = _flattened(processor, return_flash_attn_kwargs=flash_kwargs) | {"use_cache": False}
    ref = loss_and_grads(model, batch)
    hf_packing.apply_rmpad(model_type)
    assert_equivalent(ref, loss_and_grads(model, batch), f"{model_type}/flattening/{flash_kwargs}")


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_data_collator_with_flattening_4row_matches_unpatched(model_type):
    """Qwen2-VL / Qwen2.5-VL detect packing only from the 4-row form; there patched == unpatched too."""
    model, processor = model_and_processor(model_type)
    batch = _flattened(processor) | {"use_cache": False}
    batch["position_ids"] = batch["position_ids"][None].expand(4, -1, -1)
    ref = loss_and_grads(model, batch)
    hf_packing.apply_rmpad(model_type)
    assert_equivalent(ref, loss_and_grads(model, batch), f"{model_type}/flattening-4row")


def test_ambiguous_packed_input_raises():
    model, processor = model_and_processor("qwen2_vl")
    batch = _flattened(processor)
    hf_packing.apply_rmpad("qwen2_vl")
    with pytest.raises(ValueError, match="attention_mask marks the row as one sequence"):
        model(**batch, attention_mask=torch.ones_like(batch["input_ids"]), use_cache=False)
    with pytest.raises(ValueError, match="4 rows: text positions first"):
        model(**batch | {"position_ids": batch["position_ids"][None].expand(3, -1, -1)}, use_cache=False)


@pytest.mark.parametrize("model_type", MODEL_TYPES + glm_params("glm4v", "glm4v_moe"))
def test_return_dict_false_and_hidden_states(model_type):
    model, processor = model_and_processor(model_type, "left")
    batch = processed_batch(processor, conversations(with_video=False)) | {"use_cache": False}
    model.eval()
    with torch.no_grad():
        ref = model(**batch, output_hidden_states=True)
        ref_tuple = model(**batch, return_dict=False)
        hf_packing.apply_rmpad(model_type)
        got = model(**batch, output_hidden_states=True)
        got_tuple = model(**batch, return_dict=False)
        model.config.return_dict = False
        got_config_tuple = model(**batch)
    mask = batch["attention_mask"].bool()
    assert type(got) is type(ref)
    assert len(got.hidden_states) == len(ref.hidden_states)
    for ours, theirs in zip(got.hidden_states, ref.hidden_states):
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours[mask], theirs[mask], rtol=1e-4, atol=1e-5)
    if getattr(ref, "rope_deltas", None) is not None:  # transformers < 5.20: a deprecated last field, not kept
        ref_tuple = ref_tuple[:-1]
    for tup in (got_tuple, got_config_tuple):
        assert isinstance(tup, tuple) and len(tup) == len(ref_tuple)
        for ours, theirs in zip(tup, ref_tuple):
            if isinstance(theirs, torch.Tensor) and theirs.dim() == 0:
                torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)
            elif isinstance(theirs, torch.Tensor):
                torch.testing.assert_close(ours[mask], theirs[mask], rtol=1e-4, atol=1e-5)


def test_moe_output_class_without_router_logits():
    model, processor = model_and_processor("qwen3_vl_moe")
    batch = processed_batch(processor, conversations(with_video=False))
    ref = model(**batch)
    hf_packing.apply_rmpad("qwen3_vl_moe")
    got = model(**batch)
    assert type(got) is type(ref) and got.router_logits is None and got.aux_loss is None


#: Qwen4-Exp routes to experts too
MOE_TYPES = [t for t in MODEL_TYPES + GLM_TYPES if t.endswith("_moe") or t == "qwen4_exp"]


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_moe_forward_declares_router_logits_in_its_annotations(model_type):
    """transformers' ``test_moe_models_record_router_logits`` reads ``forward.__annotations__["return"]`` and wants
    ``router_logits`` among the output class's fields. The patched forward had a ``__signature__`` but empty
    ``__annotations__``: "'router_logits' not found in set()". Now: the original annotations plus the packing
    keywords', resolvable by ``typing.get_type_hints``."""
    model, _ = model_and_processor(model_type)
    before = dict(type(model).forward.__annotations__)
    hf_packing.apply_rmpad(model_type)
    after = type(model).forward.__annotations__
    assert {k: after[k] for k in before} == before and list(after)[-1] == "return"
    fields = set().union(*(getattr(t, "__dataclass_fields__", {}) for t in typing.get_args(after["return"])))
    assert "router_logits" in fields
    assert typing.get_type_hints(type(model).forward)["cu_seqlens"] == (torch.Tensor | None)


def _router_outputs(model, batch, settings: list[dict]) -> list:
    with torch.no_grad():
        outputs = []
        for setting in settings:
            config = setting.get("config")
            model.config.text_config.output_router_logits = bool(config)
            kwargs = {k: v for k, v in setting.items() if k != "config"}
            outputs.append(model(**batch, **kwargs))
        model.config.text_config.output_router_logits = False
    return outputs


@pytest.mark.parametrize("model_type", MOE_TYPES)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_moe_router_logits_are_recorded_like_unpatched(model_type, training):
    """With output_router_logits off (argument or config), on (argument or config) or an explicit False winning
    over the config: router_logits and aux_loss as the unpatched model records them, one (B·L, experts) tensor per
    MoE layer, equal at real tokens, zeros at pads. Negative control: another batch's router logits differ."""
    model, processor = model_and_processor(model_type)
    model.train(training)
    batch = processed_batch(processor, conversations(with_video=False)) | {"use_cache": False}
    settings = [{}, {"output_router_logits": True}, {"config": True}, {"config": True, "output_router_logits": False}]
    ref = _router_outputs(model, batch, settings)
    other = _router_outputs(model, processed_batch(processor, conversations(with_video=False)[::-1]), settings[1:2])
    hf_packing.apply_rmpad(model_type)
    got = _router_outputs(model, batch, settings)
    real = batch["attention_mask"].bool().flatten()
    text = model.config.text_config
    experts = text.n_routed_experts if model_type in GLM_TYPES else text.num_experts  # GLM-V: DeepSeek's name
    for setting, theirs, ours in zip(settings, ref, got):
        on = setting.get("output_router_logits", setting.get("config", False))
        assert (theirs.router_logits is not None) == on and (ours.router_logits is not None) == on, setting
        assert ours.aux_loss is None if not on else torch.allclose(ours.aux_loss, theirs.aux_loss, rtol=1e-5)
        if not on:
            continue
        assert len(ours.router_logits) == len(theirs.router_logits) > 0
        for mine, reference in zip(ours.router_logits, theirs.router_logits):
            assert mine.shape == reference.shape == (real.numel(), experts)
            torch.testing.assert_close(mine[real], reference[real], rtol=1e-4, atol=1e-5)
            assert (mine[~real] == 0).all()
    control = (other[0].router_logits[0][real] - ref[1].router_logits[0][real]).abs().max().item()
    print(f"{model_type}: another batch's router logits differ by {control:.2e}")
    assert control > 1e-2


@pytest.mark.parametrize("model_type", MODEL_TYPES + GLM_TYPES)
def test_signature_and_annotations_are_the_original_ones(model_type):
    from transformers import Trainer, TrainingArguments

    model, _ = model_and_processor(model_type)
    before = inspect.signature(model.forward)
    hf_packing.apply_rmpad(model_type)
    after = inspect.signature(model.forward)
    assert after.return_annotation == before.return_annotation
    original = [p for p in before.parameters.values() if p.kind is not p.VAR_KEYWORD]
    assert list(after.parameters.values())[: len(original)] == original
    assert {"cu_seqlens", "max_seqlen", "skip_logits"} <= set(after.parameters)
    trainer = Trainer(model=model, args=TrainingArguments("/tmp/hf_packing_sig", report_to=[]))
    trainer._set_signature_columns_if_needed()
    kept = set(trainer._signature_columns)
    assert {"cu_seqlens", "max_seqlen", "pixel_values", "image_grid_thw", "mm_token_type_ids"} <= kept
    if model_type == "qwen2_5_vl":
        assert "second_per_grid_ts" in kept


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "glm4v"])
def test_use_cache_resolved_like_unpatched_forward(model_type):
    """No labels, use_cache left to the config (True): the cache comes back, and generation can continue from it."""
    model, processor = model_and_processor(model_type, "left")
    batch = processed_batch(processor, conversations(with_video=False)[:2])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    model.eval()
    with torch.no_grad():
        ref = model(**inputs)
        hf_packing.apply_rmpad(model_type)
        got = model(**inputs)
    assert ref.past_key_values is not None and type(got.past_key_values) is type(ref.past_key_values)
    assert got.past_key_values.get_seq_length() == ref.past_key_values.get_seq_length()
    torch.testing.assert_close(got.logits, ref.logits)


@pytest.mark.parametrize("model_type", MODEL_TYPES + GLM_TYPES)
def test_placeholder_errors_use_transformers_wording(model_type):
    model, processor = model_and_processor(model_type)
    batch = processed_batch(processor, conversations(with_video=False)[1:2])
    ids = batch["input_ids"].clone()
    ids[ids == model.config.image_token_id] = processor.tokenizer.pad_token_id or 0
    ids[0, -3] = model.config.image_token_id  # 1 image token for a whole image's features
    broken = batch | {"input_ids": ids, "mm_token_type_ids": (ids == model.config.image_token_id).long()}
    with pytest.raises(ValueError, match="Image features and image tokens do not match") as unpatched:
        model(**broken)
    hf_packing.apply_rmpad(model_type)
    with pytest.raises(ValueError, match="Image features and image tokens do not match") as patched:
        model(**broken)
    assert type(patched.value) is type(unpatched.value)


@pytest.mark.parametrize("model_type", ["qwen2_vl", "glm4v"])
def test_one_real_token_keeps_its_shape(model_type):
    """A batch with a single real token (e.g. the last, tiny eval pack): logits (1, L, V), not squeezed."""
    model, processor = model_and_processor(model_type)
    ids = torch.tensor([[processor.tokenizer("Hi")["input_ids"][0], 0]])
    batch = {
        "input_ids": ids,
        "attention_mask": torch.tensor([[1, 0]]),
        "labels": ids.masked_fill(ids == 0, -100),
        "use_cache": False,
    }
    model.eval()
    with torch.no_grad():
        ref = model(**batch)
        hf_packing.apply_rmpad(model_type)
        got = model(**batch, output_hidden_states=True)
    assert got.logits.shape == ref.logits.shape and got.hidden_states[-1].shape[:2] == (1, 2)
    torch.testing.assert_close(got.logits[0, 0], ref.logits[0, 0], rtol=1e-4, atol=1e-5)
