"""Misuse is loud (issue 31): every slip a user's first hour produced fails before the first optimizer step with an
error naming the fix, or trains correctly; nothing falls back silently inside the step.

One process, tiny models. The 2-process run without `prepare_trainer` is in tests/test_training.py (it rides on an
existing torchrun launch).
"""

from __future__ import annotations

import logging

import pytest
import torch

import hf_packing
from hf_packing import VisionCollator, pack_dataset, prepare_trainer
from hf_packing.testing.tiny import build_tiny_model, tiny_config
from tests.helpers import FIXTURES, load_processor, processed_samples, sgd_training_args

MAX_LENGTH = 160


def _rows(n: int = 6) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": "word " * (5 + 7 * i)},
                {"role": "assistant", "content": "ok " * (2 + i)},
            ]
        }
        for i in range(n)
    ]


def _packs(model_type: str = "qwen2_5_vl", processor=None, **kwargs):
    from datasets import Dataset

    processor = processor or load_processor(model_type)
    return pack_dataset(Dataset.from_list(_rows()), processor, max_length=MAX_LENGTH, disable_progress=True, **kwargs)


def _model(model_type: str = "qwen2_5_vl", **overrides):
    hf_packing.apply_rmpad(model_type)
    return build_tiny_model(model_type, processor_dir=FIXTURES / model_type, **overrides)


def _trainer(tmp_path, model, packs, *, collator=None, max_steps: int = 2, **args):
    from transformers import Trainer

    settings = {"max_steps": max_steps, "per_device_train_batch_size": 1, **args}
    collator = collator or VisionCollator(packs.processor, model_config=model.config)
    return Trainer(
        model=model, args=sgd_training_args(tmp_path, **settings), train_dataset=packs, data_collator=collator
    )


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------------------ forgetting prepare_trainer
@pytest.mark.parametrize(
    "accelerator_config, match",
    [
        (None, "dispatches this loader's batches"),  # accelerate's default for an IterableDataset
        ({"dispatch_batches": False, "split_batches": False}, "without hf_packing.prepare_trainer"),  # recipes' line
    ],
    ids=["default", "dispatch-off"],
)
def test_a_trainer_without_prepare_trainer_stops_at_its_first_step(tmp_path, accelerator_config, match):
    """Without `prepare_trainer` the first forward raises an error naming it, before any optimizer step (one process:
    unchecked, accelerate's dispatching fails deep inside, an IndexError or a rotary RuntimeError). Negative control:
    prepared, the same Trainer setup trains."""
    model = _model()
    before = _weights(model)
    extra = {} if accelerator_config is None else {"accelerator_config": accelerator_config}
    trainer = _trainer(tmp_path / "bare", model, _packs(), **extra)
    with pytest.raises(RuntimeError, match=match) as error:
        trainer.train()
    print(error.value)
    assert "prepare_trainer(trainer)" in str(error.value)
    assert trainer.state.global_step == 0 and all(torch.equal(p, before[n]) for n, p in _weights(model).items())

    model.train()
    model(**VisionCollator(trainer.train_dataset.processor)(next(iter(_packs()))[:1]))  # the failed loop is forgotten

    prepared = prepare_trainer(_trainer(tmp_path / "prepared", model, _packs(), **extra))
    prepared.train()
    assert prepared.state.global_step == 2
    assert any(not torch.equal(p, before[n]) for n, p in _weights(model).items())


def test_our_collator_on_a_plain_list_needs_no_prepare_trainer(tmp_path):
    """Not every Trainer needs it: `VisionCollator` batches of a map-style dataset are neither dispatched nor
    resharded by accelerate, so the check lets them train (tests/test_trainer.py relies on it)."""
    from transformers import Trainer

    model = _model()
    processor = load_processor("qwen2_5_vl")
    samples = processed_samples(processor)
    args = sgd_training_args(tmp_path, max_steps=1, per_device_train_batch_size=1)
    Trainer(model=model, args=args, train_dataset=[samples[:2]], data_collator=VisionCollator(processor)).train()


# ------------------------------------------------------------------------------------------ checked up front
def test_prepare_trainer_refuses_packs_without_vision_collator(tmp_path):
    from transformers import default_data_collator

    trainer = _trainer(tmp_path, _model(), _packs(), collator=default_data_collator)
    with pytest.raises(ValueError, match=r"data_collator=VisionCollator\(processor, model_config=model.config\)"):
        prepare_trainer(trainer)


def test_prepare_trainer_accepts_a_wrapped_vision_collator(tmp_path):
    model = _model()
    packs = _packs()

    class Recording:  # as tests/multiproc_train.py wraps it
        def __init__(self, collator):
            self.collator = collator

        def __call__(self, features):
            return self.collator(features)

    prepare_trainer(_trainer(tmp_path, model, packs, collator=Recording(VisionCollator(packs.processor))))


def _losses_and_weights(trainer) -> tuple[list[float], dict[str, torch.Tensor]]:
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], _weights(trainer.model)


def test_a_function_around_vision_collator_trains_exactly_like_it(tmp_path):
    """A function that calls `VisionCollator`, logs and adds a key (a closure: nothing on it names the collator) is
    accepted, and each batch it returns is checked (`hf_packing.collator.batch_problem`): 2 SGD steps give the same
    losses and weights as `VisionCollator` passed itself."""
    packs = _packs()
    collator = VisionCollator(packs.processor)
    calls: list[int] = []

    def tagged(features):
        batch = collator(features)
        calls.append(len(batch["seqlens"]))
        return {**batch, "my_batch_index": len(calls)}

    torch.manual_seed(0)
    wrapped = _losses_and_weights(prepare_trainer(_trainer(tmp_path / "a", _model(), packs, collator=tagged)))
    torch.manual_seed(0)
    plain = _losses_and_weights(prepare_trainer(_trainer(tmp_path / "b", _model(), _packs(), collator=collator)))
    assert len(calls) >= 2 and wrapped[0] == plain[0] and len(wrapped[0]) == 2  # accelerate reads one batch ahead
    assert all(torch.equal(p, plain[1][n]) for n, p in wrapped[1].items())


def _one_row(features):  # the user's own collator: each pack concatenated into one unpadded row
    ids = torch.cat([torch.as_tensor(s["input_ids"]) for pack in features for s in pack])[None]
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize(
    "change, match",
    [
        ("own batch", r"has no \['seqlens', 'num_supervised_tokens'\]"),
        ("labels masked after", r"num_supervised_tokens is \d+, but \d+ labels are not -100"),
        ("columns cut after", r"seqlens \[\d+.*\] differs from the attention_mask's row lengths"),
    ],
)
def test_a_function_returning_a_batch_vision_collator_did_not_build_is_refused(tmp_path, change, match):
    """A function whose batch contradicts the host facts the patched forward trusts (sequence boundaries, the loss's
    token count) stops before the first step, and the error says why and to subclass `VisionCollator`. The passing
    wrapper above is the control: `VisionCollator`'s own batch with a key added passes the same check."""
    packs = _packs()
    collator = VisionCollator(packs.processor)

    def changed(features):
        if change == "own batch":
            return _one_row(features)
        batch = collator(features)
        if change == "labels masked after":  # the first answer token of row 0 no longer trains
            batch["labels"][0, (batch["labels"][0] != -100).nonzero()[0]] = -100
        else:
            batch = {
                **batch,
                **{k: batch[k][:, :8] for k in ("input_ids", "labels", "attention_mask", "mm_token_type_ids")},
            }
        return batch

    model = _model()
    before = _weights(model)
    trainer = prepare_trainer(_trainer(tmp_path, model, packs, collator=changed))
    with pytest.raises(ValueError, match=match) as error:
        trainer.train()
    print(error.value)
    assert "subclass VisionCollator" in str(error.value) and trainer.state.global_step == 0
    assert all(torch.equal(p, before[n]) for n, p in _weights(model).items())


def test_a_batch_checked_in_a_dataloader_worker_stops_the_run_with_its_reason(tmp_path):
    """With ``dataloader_num_workers=1`` the check runs where the batch is built, in the worker; its error reaches
    ``train()`` (as torch re-raises a worker's exception) before any step."""
    model = _model()
    trainer = prepare_trainer(_trainer(tmp_path, model, _packs(), collator=_one_row, dataloader_num_workers=1))
    with pytest.raises(ValueError, match=r"has no \['seqlens', 'num_supervised_tokens'\]") as error:
        trainer.train()
    assert "DataLoader worker" in str(error.value) and trainer.state.global_step == 0


@pytest.mark.parametrize("mode", ["rows", "flat"])
def test_batch_problem_finds_nothing_in_vision_collators_own_batches(mode):
    """The check passes every batch `VisionCollator` builds (images, a video, M-RoPE positions, both modes) and finds
    a boundary moved by one token."""
    from hf_packing.collator import batch_problem

    processor = load_processor("qwen2_5_vl")
    batch = VisionCollator(processor, mode=mode, model_config=tiny_config("qwen2_5_vl"), return_cu_seqlens=True)(
        [processed_samples(processor)]
    )
    assert "vision_grids" in batch and batch_problem(batch) is None
    key = "cu_seq_lens_q" if mode == "flat" else "cu_seqlens"
    batch[key] = batch[key].clone()
    batch[key][1] += 1
    assert f"{key} " in (batch_problem(batch) or "")


def test_processor_of_another_family_is_refused_up_front(tmp_path):
    """A Qwen3-VL processor (16-px patches) with a Qwen2.5-VL model (14-px): before, `shape '[-1, 3, 2, 14, 14]' is
    invalid` deep in the vision tower at the first step."""
    model = _model("qwen2_5_vl")
    wrong = load_processor("qwen3_vl")
    with pytest.raises(ValueError, match="patch_size=16.*patch_size=14.*same checkpoint"):
        VisionCollator(wrong, model_config=model.config)
    with pytest.raises(ValueError, match="pack_dataset: the processor .* is not this model's"):
        _packs(processor=wrong, model_config=model.config)
    packs = _packs(processor=wrong)
    collator = VisionCollator(wrong)  # no model_config: nothing to compare with here
    with pytest.raises(ValueError, match="pack_dataset: the processor .* is not this model's"):
        prepare_trainer(_trainer(tmp_path, model, packs, collator=collator))


def test_a_tokenizer_instead_of_the_processor_is_refused(tmp_path):
    """Before: `Qwen2Tokenizer has no attribute image_token` from inside the preprocessor."""
    tokenizer = load_processor("qwen2_5_vl").tokenizer
    with pytest.raises(ValueError, match=r"VisionCollator got a tokenizer \(.*\).*AutoProcessor.from_pretrained"):
        VisionCollator(tokenizer)
    with pytest.raises(ValueError, match=r"pack_dataset got a tokenizer \(.*\).*AutoProcessor.from_pretrained"):
        _packs(processor=tokenizer)


def test_vision_collator_names_the_supported_model_types():
    """A Llama config: before, a bare `KeyError: 'llama'`."""
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match=r"'llama' config.*qwen2_5_vl.*model.config"):
        VisionCollator(load_processor("qwen2_5_vl"), model_config=LlamaConfig())


def test_eager_attention_is_refused_at_prepare_time(tmp_path):
    """Before, only the first step said so, after the data and the model had loaded."""
    model = _model(attn_implementation="eager")
    model.config._attn_implementation = "eager"  # what from_pretrained(attn_implementation="eager") sets
    model.config.get_text_config()._attn_implementation = "eager"
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        prepare_trainer(_trainer(tmp_path, model, _packs()))


def test_per_device_train_batch_size_must_match_the_packers(tmp_path):
    """`per_device_train_batch_size=4` silently trained 4 packs per micro-batch."""
    model = _model()
    with pytest.raises(
        ValueError, match="per_device_train_batch_size=4.*batch_size=1.*Set per_device_train_batch_size=1"
    ):
        prepare_trainer(_trainer(tmp_path, model, _packs(), per_device_train_batch_size=4))
    prepare_trainer(_trainer(tmp_path, model, _packs(batch_size=4), per_device_train_batch_size=4))  # consistent


def test_pack_fill_is_logged_without_max_length(tmp_path):
    """`prepare_trainer` reads `max_length` from the packs (before, `packing/pack_fill` needed it passed)."""
    trainer = prepare_trainer(_trainer(tmp_path, _model(), _packs(), max_steps=1))
    trainer.train()
    assert any("packing/pack_fill" in h for h in trainer.state.log_history)
    with pytest.raises(ValueError, match=r"max_length=99\) differs"):
        prepare_trainer(_trainer(tmp_path, _model(), _packs()), max_length=99)


# ------------------------------------------------------------------------------------------ no silent fallback
def _collated(model_type: str):
    processor = load_processor(model_type)
    model = build_tiny_model(model_type, processor_dir=FIXTURES / model_type)
    samples = processed_samples(processor)
    batch = VisionCollator(processor, model_config=model.config)([samples[:3]])
    return model, batch


def _drop_boundaries(layer):
    """A forward pre-hook on a decoder layer that drops every keyword it does not know (a careless wrapper)."""

    def hook(module, args, kwargs):
        return args, {k: v for k, v in kwargs.items() if not k.startswith("hf_packing")}

    return layer.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_5"])
def test_boundaries_dropped_between_layers_raise(model_type, monkeypatch):
    """The boundaries stop reaching layer 1's attention (Qwen3.5: layer 0 is linear attention, so the hook on it drops
    them for the conv / delta rule): the call raises naming the module. Negative control for the guard: with the
    guard off, the same forward runs silently with a different loss (attention across the samples)."""
    from contextlib import nullcontext

    from hf_packing.patches import _forward

    model, batch = _collated(model_type)
    hf_packing.apply_rmpad(model_type)
    model.eval()
    with torch.no_grad():
        reference = model(**batch).loss
    layer = model.model.language_model.layers[0 if model_type == "qwen3_5" else 1]
    handle = _drop_boundaries(layer)
    with pytest.raises(RuntimeError, match="without the pack's boundaries") as error, torch.no_grad():
        model(**batch)
    print(error.value)
    monkeypatch.setattr(_forward, "inside_packed_forward", nullcontext)  # the guard off
    with torch.no_grad():
        leaked = model(**batch).loss
    handle.remove()
    print(f"loss with boundaries {reference.item():.6f}, dropped without the guard {leaked.item():.6f}")
    assert (leaked - reference).abs() > 1e-5  # fp32 noise on a loss of ~6 is ~1e-6; the leak moves it further


def test_a_supervised_call_routed_to_the_original_forward_warns_once():
    from hf_packing.patches import _forward

    model, batch = _collated("qwen2_5_vl")
    hf_packing.apply_rmpad("qwen2_5_vl")
    _forward._WARNED.clear()
    embeds = model.get_input_embeddings()(batch["input_ids"])
    kwargs = {k: batch[k] for k in ("attention_mask", "labels")}
    with pytest.warns(UserWarning, match="inputs_embeds.*pass input_ids"):
        model(inputs_embeds=embeds, **kwargs)
    with pytest.warns(UserWarning, match="use_cache resolves to True"):
        model(input_ids=batch["input_ids"], use_cache=True, **kwargs)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(input_ids=batch["input_ids"], use_cache=True, **kwargs)  # once per reason
        model.eval()
        model.model(inputs_embeds=embeds, attention_mask=batch["attention_mask"])  # generation-style: no warning
    model.train()
    with pytest.warns(UserWarning, match="a training call runs the original .*Model.forward.*inputs_embeds"):
        model.model(inputs_embeds=embeds, attention_mask=batch["attention_mask"])  # a custom head's, training


def test_the_chosen_backends_are_logged_once(caplog):
    model, batch = _collated("qwen3_5")
    hf_packing.apply_rmpad("qwen3_5")
    with caplog.at_level(logging.INFO, logger="hf_packing"):
        model(**batch)
        model(**batch)
    lines = [r.getMessage() for r in caplog.records if "runs on" in r.getMessage()]
    print("\n".join(lines))
    assert any(line.startswith("hf_packing: text attention runs on reference") for line in lines)
    assert any(line.startswith("hf_packing: vision attention runs on reference") for line in lines)
    assert any("linear attention (gated delta rule) runs on reference" in line for line in lines)
    assert len(lines) == len(set(lines))  # once each


def test_an_installed_kernel_that_fails_to_import_is_logged(monkeypatch, caplog):
    import importlib

    from hf_packing import _compat

    real_find, real_import = importlib.util.find_spec, importlib.import_module

    def find_spec(name, *args):
        return object() if name == "flash_attn_interface" else real_find(name, *args)

    def import_module(name, *args):
        if name == "flash_attn_interface":
            raise ImportError("libcudart.so.12: cannot open shared object file")
        return real_import(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(importlib, "import_module", import_module)
    with caplog.at_level(logging.WARNING, logger="hf_packing"):
        _compat.flash_attn_varlen_module.__wrapped__()
    assert "flash_attn_interface is installed but failed to import (ImportError: libcudart.so.12" in caplog.text


def test_revert_rmpad_is_refused_while_a_prepared_trainer_trains(tmp_path):
    from transformers import TrainerCallback

    from hf_packing.patches.prepared import training

    class Revert(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            hf_packing.revert_rmpad()

    trainer = prepare_trainer(_trainer(tmp_path, _model(), _packs(), max_steps=1))
    trainer.add_callback(Revert())
    with pytest.raises(RuntimeError, match=r"revert_rmpad\(\) while Trainer.train\(\) runs"):
        trainer.train()
    assert not training()
    hf_packing.revert_rmpad()  # after train() it is fine


# ------------------------------------------------------------------------------------------ resume
def test_resume_logs_one_line_instead_of_the_key_lists(tmp_path, caplog):
    """The Trainer's non-strict load lists transformers' "missing keys" / "unexpected keys" (on every rank) before
    `prepare_trainer`'s exact reload: with it, one line says the weights were reloaded exactly. Negative control: a
    plain Trainer logs the lists."""
    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    checkpoint = tmp_path / "checkpoint"
    build_tiny_model("qwen2_5_vl", seed=1).save_pretrained(checkpoint)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.INFO):
            Trainer(model=build_tiny_model("qwen2_5_vl"), args=args)._load_from_checkpoint(str(checkpoint))
            plain = caplog.text
            caplog.clear()
            model = build_tiny_model("qwen2_5_vl")
            prepare_trainer(Trainer(model=model, args=args), telemetry=False)._load_from_checkpoint(str(checkpoint))
            prepared = caplog.text
    finally:
        hf_logging.disable_propagation()
    print(prepared)
    assert "missing keys" in plain
    assert "missing keys" not in prepared and "unexpected keys" not in prepared
    assert prepared.count("reloaded exactly") == 1
    assert model.config.model_type == tiny_config("qwen2_5_vl").model_type


def test_the_loader_guard_knows_the_packs_by_their_mark():
    """The guard sits below the packer, so it tests `PACKS_ATTR`, not the class: it finds the packs directly and in
    accelerate's shard, and a dataset without the mark (a map-style list, an IterableDataset) is not taken for them."""
    from accelerate.data_loader import IterableDatasetShard
    from torch.utils.data import DataLoader, IterableDataset

    from hf_packing.packing.dataset import PackedDataset
    from hf_packing.patches import prepared

    assert getattr(PackedDataset, prepared.PACKS_ATTR) is True
    packs = _packs()
    assert prepared._packs(DataLoader(packs, batch_size=None), IterableDatasetShard) is packs
    shard = IterableDatasetShard(packs, batch_size=1, num_processes=2)
    assert prepared._packs(DataLoader(shard, batch_size=None), IterableDatasetShard) is packs

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    assert prepared._packs(DataLoader(Stream(), batch_size=None), IterableDatasetShard) is None
    assert prepared._packs(DataLoader([1, 2, 3]), IterableDatasetShard) is None
