"""Every Trainer path that loads weights back loads every tensor of the checkpoint (issue 37).

transformers 5.23 loads ``model.safetensors`` with ``load_state_dict(strict=False)`` and no key conversion when it
resumes (``_load_from_checkpoint``) and at the end of ``train()`` with ``load_best_model_at_end``
(``_load_best_model``), while ``save_pretrained`` writes Qwen2-VL / Qwen2.5-VL in the original key layout: only
``lm_head`` matches.
`prepare_trainer` reloads both exactly. The oracle is the checkpoint's own file (``safetensors.torch.load_file``), its
names mapped to the runtime names by the two renamings written out below (not by transformers' conversion code, which
the fix itself runs), and each map covers every tensor of both sides. One process, a tiny Qwen2.5-VL, 3 SGD steps.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer, TrainerCallback

import hf_packing
from hf_packing import VisionCollator, pack_dataset, prepare_trainer
from hf_packing.testing.tiny import build_tiny_model
from tests.helpers import FIXTURES, load_processor, sgd_training_args

MODEL_TYPE = (
    "qwen2_5_vl"  # saved in the original layout (`model.layers.*`, `visual.*`), loaded as `model.language_model.*`
)
STEPS = 3


def _runtime_name(key: str) -> str:
    """Qwen2.5-VL's checkpoint name → its name in ``state_dict()``: the two renamings of the model's conversion."""
    key = re.sub(r"^visual\.", "model.visual.", key)
    return re.sub(r"^model\.(?!language_model\.|visual\.)", "model.language_model.", key)


def _checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's own tensors, under the runtime names."""
    return {_runtime_name(k): v for k, v in load_file(directory / "model.safetensors").items()}


def _matching(model, checkpoint: dict[str, torch.Tensor]) -> int:
    """How many of the model's tensors equal the checkpoint's (both sides hold the same names)."""
    state = model.state_dict()
    assert set(state) == set(checkpoint)  # the name map covers every tensor of both
    return sum(torch.equal(v, checkpoint[k]) for k, v in state.items())


def _model():
    hf_packing.apply_rmpad(MODEL_TYPE)
    return build_tiny_model(MODEL_TYPE, processor_dir=FIXTURES / MODEL_TYPE)


def _packs():
    from datasets import Dataset

    rows = [
        {
            "messages": [
                {"role": "user", "content": "word " * (5 + 7 * i)},
                {"role": "assistant", "content": "ok " * (2 + i)},
            ]
        }
        for i in range(6)
    ]
    return pack_dataset(Dataset.from_list(rows), load_processor(MODEL_TYPE), max_length=160, disable_progress=True)


class StepOneIsBest(TrainerCallback):
    """Adds ``eval_order`` (the step) to each evaluation's metrics; with ``metric_for_best_model="order"`` and
    ``greater_is_better=False`` the first step is the best, whatever the losses do."""

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics["eval_order"] = state.global_step


def _best_at_end_trainer(output_dir: Path, **kwargs) -> Trainer:
    packs = _packs()
    args = sgd_training_args(
        output_dir,
        max_steps=STEPS,
        per_device_train_batch_size=1,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="order",
        greater_is_better=False,
    )
    model = kwargs.pop("model", None) or (None if "model_init" in kwargs else _model())
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=packs,
        eval_dataset=packs,
        data_collator=VisionCollator(packs.processor),
        callbacks=[StepOneIsBest()],
        **kwargs,
    )
    return prepare_trainer(trainer, telemetry=False)


@pytest.mark.parametrize("how", ["model", "model_init"])
def test_load_best_model_at_end_loads_every_tensor_of_the_best_checkpoint(tmp_path, how):
    """After ``train()`` with ``load_best_model_at_end=True`` and step 1 the best of 3, every tensor equals the
    checkpoint-1 file and ``evaluate()`` gives checkpoint-1's logged ``eval_loss``; also when ``model_init`` builds
    the model inside ``train()``. Negative control: the Trainer's own ``_load_best_model`` on a model at the last
    step's weights leaves every tensor training moved but ``lm_head`` there, and ``evaluate()`` reports another loss.
    (Text-only packs: the vision tower's 30 tensors do not move, so they match either way.)"""
    trainer = _best_at_end_trainer(tmp_path, **({"model_init": _model} if how == "model_init" else {}))
    trainer.train()
    best, last = _checkpoint(tmp_path / "checkpoint-1"), _checkpoint(tmp_path / f"checkpoint-{STEPS}")
    assert Path(trainer.state.best_model_checkpoint) == tmp_path / "checkpoint-1"
    moved = sum(not torch.equal(best[k], last[k]) for k in best)  # text-only packs: the vision tower stays
    assert moved >= 20
    loaded = _matching(trainer.model, best)
    print(f"after train(): {loaded} of {len(best)} tensors equal checkpoint-1's file ({moved} differ from the last)")
    assert loaded == len(best)
    logged = next(h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h and h["step"] == 1)
    final = trainer.evaluate()["eval_loss"]
    print(f"eval_loss at step 1: {logged:.6f}, evaluate() after train(): {final:.6f}")
    assert final == pytest.approx(logged, rel=1e-6)

    # negative control: the model at the last step's weights, then transformers' own method
    trainer.model.load_state_dict(last)
    Trainer._load_best_model(trainer)
    plain = _matching(trainer.model, best)
    mixed = trainer.evaluate()["eval_loss"]
    print(f"transformers' own _load_best_model: {plain} of {len(best)} tensors, evaluate() {mixed:.6f}")
    assert plain < len(best) and mixed != pytest.approx(logged, rel=1e-3)


def test_load_best_model_at_end_with_lora_loads_the_best_adapter(tmp_path):
    """PEFT keeps transformers' own path (``load_adapter``, under the runtime names): after ``train()`` every LoRA
    tensor equals checkpoint-1's ``adapter_model.safetensors`` (names plus the adapter name ``default``), and
    ``evaluate()`` gives step 1's ``eval_loss``. Control: the adapters of checkpoint-1 and the last one differ."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trainer = _best_at_end_trainer(tmp_path, model=get_peft_model(_model(), lora))
    trainer.train()

    def adapter(step: int) -> dict[str, torch.Tensor]:
        saved = load_file(tmp_path / f"checkpoint-{step}" / "adapter_model.safetensors")
        return {re.sub(r"\.(lora_[AB])\.", r".\1.default.", k): v for k, v in saved.items()}

    best, last = adapter(1), adapter(STEPS)
    state = {k: v for k, v in trainer.model.state_dict().items() if "lora_" in k}
    assert set(state) == set(best) and all(not torch.equal(best[k], last[k]) for k in best)
    assert all(torch.equal(v, best[k]) for k, v in state.items())
    logged = next(h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h and h["step"] == 1)
    assert trainer.evaluate()["eval_loss"] == pytest.approx(logged, rel=1e-6)


class AtTrainBegin(TrainerCallback):
    """Keeps a copy of the weights when the training loop starts: after the resume load, before any step."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_resume_from_the_last_checkpoint_of_the_output_dir_loads_every_tensor(tmp_path):
    """``train(resume_from_checkpoint=True)`` with a new model finds the last checkpoint in ``output_dir``; when the
    loop starts, every tensor equals that checkpoint's file. Negative control: a plain Trainer's resume leaves all but
    ``lm_head`` at the new model's initial weights."""
    _best_at_end_trainer(tmp_path).train()  # writes checkpoint-1..3
    saved = _checkpoint(tmp_path / f"checkpoint-{STEPS}")
    loaded = {}
    for prepared in (True, False):
        model, packs, begin = _model(), _packs(), AtTrainBegin()
        args = sgd_training_args(tmp_path, max_steps=STEPS + 1, per_device_train_batch_size=1)
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=packs,
            data_collator=VisionCollator(packs.processor),
            callbacks=[begin],
        )
        if prepared:
            prepare_trainer(trainer, telemetry=False).train(resume_from_checkpoint=True)
        else:  # unprepared, train() would refuse the packs; the load it starts with is this call
            trainer._load_from_checkpoint(str(tmp_path / f"checkpoint-{STEPS}"))
            begin.state = model.state_dict()
        state = begin.state
        assert set(state) == set(saved)
        loaded[prepared] = sum(torch.equal(v, saved[k]) for k, v in state.items())
    print(
        f"tensors equal to checkpoint-{STEPS}'s file as the loop starts: prepared {loaded[True]}, plain {loaded[False]}"
    )
    assert loaded[True] == len(saved) and loaded[False] < len(saved)


def test_a_sharded_best_checkpoint_loads_every_tensor(tmp_path):
    """A checkpoint in several safetensors shards (``model.safetensors.index.json``, as large models are saved):
    transformers' ``_load_best_model`` takes its ``load_sharded_checkpoint(strict=False)`` branch, equally without key
    conversion. Prepared, every tensor equals the shards' own files; plain, not."""
    import json

    checkpoint = tmp_path / "checkpoint-7"
    build_tiny_model(MODEL_TYPE, seed=1).save_pretrained(checkpoint, max_shard_size="200KB")
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    saved = {_runtime_name(k): v for shard in shards for k, v in load_file(checkpoint / shard).items()}
    assert len(shards) > 1
    loaded = {}
    for prepared in (True, False):
        model = _model()
        trainer = Trainer(model=model, args=sgd_training_args(tmp_path / "out"))
        if prepared:
            prepare_trainer(trainer, telemetry=False)
        trainer.state.best_model_checkpoint = str(checkpoint)
        trainer._load_best_model()
        loaded[prepared] = _matching(model, saved)
    print(f"tensors equal to the {len(shards)} shards: prepared {loaded[True]}, plain {loaded[False]} of {len(saved)}")
    assert loaded[True] == len(saved) and loaded[False] < len(saved)
