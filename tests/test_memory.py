"""The activation-memory model (`hf_packing.ops.memory`) against what autograd keeps, measured.

The oracle: one training step under ``torch.autograd.graph.saved_tensors_hooks``, counting each saved storage once
(views share one) and leaving the parameters out, on tiny bf16 models of the families in ``MODELLED``, the attention and
linear-attention kernels replaced by stand-ins that keep exactly what the GPU kernels keep for backward
(`tests.kernels`, ``memory=True``): rows and flat batches, a text-only and an image pack, checkpointing off and on.
The model's terms come from the modules' shapes (`ActivationMemory.from_model`), never from these measurements.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import hf_packing
from hf_packing import VisionCollator
from hf_packing.ops.memory import MODELLED, ActivationMemory, training_state_bytes
from hf_packing.testing.tiny import GLM_TYPES, MODEL_TYPES, build_tiny_model
from tests.helpers import FIXTURES, load_processor, processed_samples
from tests.kernels import install_kernel, install_linear_kernels

RTOL = 0.10  # the bound; measured: within 0.3% in every setting


def saved_bytes(model, batch) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward + backward of ``batch``."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    loss.backward()
    return sum(seen.values())


def _checkpointing(model, on: bool) -> None:
    """Checkpointing every decoder layer and tower block (``activation_checkpointing_*`` from transformers 5.23)."""
    prefix = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    if on:
        getattr(model, f"{prefix}_checkpointing_enable")(**{f"{prefix}_checkpointing_kwargs": {"use_reentrant": False}})
    else:
        getattr(model, f"{prefix}_checkpointing_disable")()
    model.train()


def _counts(batch) -> dict:
    tokens = int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
    patches = batch["pixel_values"].shape[0] if "pixel_values" in batch else 0
    return {"tokens": tokens, "patches": patches, "supervised": int(batch["num_supervised_tokens"])}


def _steps(model_type: str, monkeypatch, *, memory: bool = True, modes=("rows", "flat"), checkpointing=(False, True)):
    """(setting, counts, checkpointing, measured bytes, model) for every setting of one family (``modes`` x the two
    packs x ``checkpointing``)."""
    install_kernel(monkeypatch, "flash_attn", memory=memory)
    install_linear_kernels(monkeypatch, memory=memory)
    processor = load_processor(model_type)
    samples = processed_samples(processor)
    model = build_tiny_model(model_type, processor_dir=FIXTURES / model_type).to(torch.bfloat16)
    packs = {"text": [samples[0]] * 3, "images": [samples[1], samples[2], samples[3]]}
    hf_packing.apply_rmpad(model_type, attn_backend="flash_attn", linear_backend="fla")
    try:
        for mode in modes:
            collate = VisionCollator(processor, mode=mode, model_config=model.config)
            for name, pack in packs.items():
                batch = collate(pack)
                batch = {k: v.to(torch.bfloat16) if k == "pixel_values" else v for k, v in batch.items()}
                for ckpt in checkpointing:
                    _checkpointing(model, ckpt)
                    yield (
                        f"{mode} {name} ckpt={ckpt}",
                        _counts(batch),
                        ckpt,
                        saved_bytes(model, batch),
                        model,
                    )
    finally:
        hf_packing.revert_rmpad(model_type)
        _checkpointing(model, False)


@pytest.mark.parametrize("model_type", MODELLED)
def test_predicts_saved_bytes(model_type, monkeypatch):
    memory = None
    for setting, counts, checkpointing, measured, model in _steps(model_type, monkeypatch):
        memory = memory or ActivationMemory.from_model(model)
        predicted = memory.saved_bytes(**counts, checkpointing=checkpointing)
        error = predicted / measured - 1
        print(f"{model_type} {setting} {counts}: measured {measured:,} B, predicted {predicted:,.0f} B ({error:+.2%})")
        assert abs(error) <= RTOL, setting
        # negative control: the other checkpointing mode is far off, so the bound can fail
        other = memory.saved_bytes(**counts, checkpointing=not checkpointing)
        assert abs(other / measured - 1) > RTOL, setting


def test_qsa_query_chunks_keep_the_same(monkeypatch):
    """Qwen4-Exp's gather backend runs its queries in chunks that bound the gathered workspace (2^26 values by
    default: one chunk in the tiny steps above); forced to chunks of 6 queries, the step keeps the same bytes, as
    the model says (the chunks' gathered keys and values are transient; the outputs and log-sum-exps join into one
    each)."""
    from hf_packing.ops import sparse_attention

    monkeypatch.setattr(sparse_attention, "CHUNK_ELEMENTS", 20_000)  # 6 queries of 11 keys · (2 · 128 + 2 · 4)
    chunks = []  # the gather backend's chunks, forward and backward: their query counts
    gather_chunk = sparse_attention._gather_chunk
    monkeypatch.setattr(
        sparse_attention, "_gather_chunk", lambda q, *a, **k: chunks.append(len(q)) or gather_chunk(q, *a, **k)
    )
    for setting, counts, _, measured, model in _steps(
        "qwen4_exp", monkeypatch, modes=("flat",), checkpointing=(False,)
    ):
        predicted = ActivationMemory.from_model(model).saved_bytes(**counts)
        print(f"qwen4_exp {setting}, chunked QSA: measured {measured:,} B, predicted {predicted:,.0f} B")
        assert abs(predicted / measured - 1) <= RTOL, setting
    assert len(chunks) > 2 * 10 and max(chunks) == 6  # 2 packs of > 60 tokens, one QSA layer: > 10 chunks each


def test_reference_kernels_keep_more(monkeypatch):
    """Negative control: with the CPU references (per-sequence copies, autograd through the reference) the step keeps
    more than the kernels' contract, and the model, which states the GPU kernels', misses it by more than 10%."""
    for setting, counts, checkpointing, measured, model in _steps("qwen2_5_vl", monkeypatch, memory=False):
        if checkpointing:
            continue
        predicted = ActivationMemory.from_model(model).saved_bytes(**counts)
        print(f"reference kernels, {setting}: measured {measured:,} B, predicted {predicted:,.0f} B")
        assert measured > predicted * (1 + RTOL), setting


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl", "glm4v"])
def test_frozen_tower(model_type, monkeypatch):
    """A frozen tower runs without autograd (the patch's frozen-tower path): the step keeps the decoder's tensors and
    an index per merged token, and the state counts no gradient or AdamW moment for the tower."""
    install_kernel(monkeypatch, "flash_attn", memory=True)
    install_linear_kernels(monkeypatch, memory=True)
    processor = load_processor(model_type)
    samples = processed_samples(processor)
    model = build_tiny_model(model_type, processor_dir=FIXTURES / model_type).to(torch.bfloat16)
    model.model.visual.requires_grad_(False)
    memory = ActivationMemory.from_model(model)
    assert not memory.vision_trainable
    batch = VisionCollator(processor, model_config=model.config)([samples[1], samples[2], samples[3]])
    batch = {k: v.to(torch.bfloat16) if k == "pixel_values" else v for k, v in batch.items()}
    hf_packing.apply_rmpad(model_type, attn_backend="flash_attn", linear_backend="fla")
    try:
        for checkpointing in (False, True):
            _checkpointing(model, checkpointing)
            measured = saved_bytes(model, batch)
            predicted = memory.saved_bytes(**_counts(batch), checkpointing=checkpointing)
            print(
                f"{model_type} frozen tower, ckpt={checkpointing}: measured {measured:,} B, predicted {predicted:,.0f}"
            )
            assert abs(predicted / measured - 1) <= RTOL
            trained = dataclasses.replace(memory, vision_trainable=True)
            # negative control: counting the tower misses by more than the bound
            assert trained.saved_bytes(**_counts(batch), checkpointing=checkpointing) > measured * (1 + RTOL)
    finally:
        hf_packing.revert_rmpad(model_type)
        _checkpointing(model, False)
    state = training_state_bytes(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert state["grads"] == 2 * trainable and state["optimizer"] == 4 * trainable


def test_every_family_is_modelled():
    assert set(MODELLED) == set(MODEL_TYPES + GLM_TYPES)


def test_a_family_not_modelled_is_refused():
    """A model type outside `MODELLED` (a family hf_packing does not patch) is refused with the setting to drop,
    not guessed from a lookalike module tree."""
    model = torch.nn.Linear(1, 1)
    model.config = types.SimpleNamespace(model_type="llava")
    with pytest.raises(ValueError, match=r"not model_type 'llava'.*gradient checkpointing yourself.*gpu_memory_gib"):
        ActivationMemory.from_model(model)
