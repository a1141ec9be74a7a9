"""Evaluation through `prepare_trainer`: token-level eval_loss, metrics, before / during / after training, 2 processes.

The reference is always the unpatched model run on one sample at a time: Σ (mean CE × supervised tokens) / Σ tokens.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import hf_packing
import hf_packing.training.evaluation
from hf_packing import VisionCollator, pack_dataset, prepare_trainer
from hf_packing.training.trainer import keep_rank_packs, no_dispatch
from tests.helpers import FIXTURES, check_ok, conversations, launch, load_processor, processed_samples, write_parquet

HELPER = Path(__file__).parent / "multiproc_eval.py"
LENGTHS = (256, 1024)  # pack the same 12 samples into 7 and 2 packs
REL = 1e-5


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny Qwen2.5-VL after 6 Adam steps on other rows: token accuracy about 0.6, neither 0 nor 1."""
    from transformers import AutoProcessor

    from hf_packing.testing.tiny import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    path = save_tiny_checkpoint("qwen2_5_vl", root / "qwen2_5_vl")
    write_parquet(root / "train.parquet", 12, seed=3, start=0, images="none")
    model, processor = _load(path, patched=False), AutoProcessor.from_pretrained(path)
    collator = VisionCollator(processor, model_config=model.config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        for pack in _packs(str(root / "train.parquet"), processor, 512):
            model(**collator([pack])).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def eval_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("eval") / "eval.parquet"
    write_parquet(path, 12, seed=7, start=0, images="mixed")
    return str(path)


@pytest.fixture(scope="module")
def processor(tiny_model):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_model)


def _packs(eval_file: str, processor, max_length: int, rank: int = 0, world_size: int = 1, leftovers: str = "spread"):
    from datasets import load_dataset

    ds = load_dataset("parquet", data_files=eval_file, split="train")
    return pack_dataset(
        ds,
        processor,
        max_length=max_length,
        rank=rank,
        world_size=world_size,
        leftovers=leftovers,
        disable_progress=True,
    )


def _load(tiny_model: Path, *, patched: bool, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForImageTextToText

    if patched:
        hf_packing.apply_rmpad("qwen2_5_vl")
    model = AutoModelForImageTextToText.from_pretrained(tiny_model, dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


def _trainer(tmp_path, model, processor, *, train=None, eval_dataset=None, prepare: bool = True, **kwargs):
    from transformers import Trainer, TrainingArguments

    args = dict(
        output_dir=str(tmp_path / "run"),
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=1,
        per_device_eval_batch_size=1,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        max_steps=2,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    args.update({k: kwargs.pop(k) for k in list(kwargs) if k in TrainingArguments.__dataclass_fields__})
    trainer = Trainer(
        model=model,
        args=TrainingArguments(**args),
        train_dataset=train,
        eval_dataset=eval_dataset,
        data_collator=VisionCollator(processor, model_config=model.config),
        **kwargs,
    )
    return prepare_trainer(trainer, max_length=LENGTHS[0]) if prepare else no_dispatch(keep_rank_packs(trainer))


def _reference(model, processor, samples) -> tuple[float, float, int]:
    """(token-level mean CE, token accuracy, supervised tokens) of the unpatched model, one sample at a time."""
    collator = VisionCollator(processor, model_config=model.config)
    model.eval()
    ce = correct = n = 0.0
    with torch.no_grad():
        for sample in samples:
            batch = collator([[sample]])
            out = model(**batch)
            targets = batch["labels"][:, 1:]
            mask = targets != -100
            ce += out.loss.double().item() * mask.sum().item()
            correct += ((out.logits[:, :-1].argmax(-1) == targets) & mask).sum().item()
            n += mask.sum().item()
    return ce / n, correct / n, int(n)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.fixture(scope="module")
def reference(tiny_model, processor, eval_file):
    hf_packing.revert_rmpad()
    samples = [s for pack in _packs(eval_file, processor, max(LENGTHS)) for s in pack]
    loss, accuracy, n = _reference(_load(tiny_model, patched=False), processor, samples)
    print(
        f"reference: {len(samples)} samples, {n} supervised tokens, token-level CE {loss:.6f}, accuracy {accuracy:.4f}"
    )
    return {"loss": loss, "accuracy": accuracy, "n": n, "indices": sorted(int(s["index"]) for s in samples)}


# ------------------------------------------------------------------------------------------ one process
def test_evaluate_before_train_works_with_telemetry(tmp_path, tiny_model, processor, eval_file):
    """`PackingTelemetry.on_evaluate` ran before `on_train_begin` had set its timers: AttributeError."""
    packs = _packs(eval_file, processor, LENGTHS[0])
    trainer = _trainer(tmp_path, _load(tiny_model, patched=False), processor, train=packs, eval_dataset=packs)
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"])


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
def test_eval_loss_is_the_token_level_mean_at_any_max_length(
    tmp_path, tiny_model, processor, eval_file, reference, patched
):
    """The same 12 samples in 5 packs (256) or 2 packs (1024): eval_loss = Σ CE / Σ tokens of the unpatched model
    sample by sample. Negative control: the Trainer's own eval_loss (mean of per-pack means) differs."""
    model = _load(tiny_model, patched=patched)
    results = {}
    for max_length in LENGTHS:
        packs = _packs(eval_file, processor, max_length)
        assert sorted(int(s["index"]) for p in packs for s in p) == reference["indices"]
        ours = _trainer(tmp_path, model, processor, eval_dataset=packs).evaluate()
        plain = _trainer(tmp_path, model, processor, eval_dataset=packs, prepare=False).evaluate()
        results[max_length] = (len(list(packs)), ours, plain["eval_loss"])
    for max_length, (n_packs, ours, plain) in results.items():
        print(
            f"max_length {max_length}: {n_packs} packs, eval_loss {ours['eval_loss']:.6f} "
            f"(reference {reference['loss']:.6f}), mean of pack means {plain:.6f}, "
            f"token accuracy {ours['eval_token_accuracy']:.4f}"
        )
        assert _rel(ours["eval_loss"], reference["loss"]) < REL
        assert _rel(ours["eval_token_accuracy"], reference["accuracy"]) < REL
    assert results[LENGTHS[0]][0] != results[LENGTHS[1]][0]
    assert max(_rel(plain, reference["loss"]) for _, _, plain in results.values()) > 1e-3


def test_eval_during_and_after_training_is_token_level(tmp_path, tiny_model, processor, eval_file, reference):
    """eval_strategy="steps" inside train(), then evaluate() and predict() after it (lr 0: the model stays put)."""
    packs = _packs(eval_file, processor, LENGTHS[0])
    trainer = _trainer(
        tmp_path,
        _load(tiny_model, patched=False),
        processor,
        train=packs,
        eval_dataset=packs,
        eval_strategy="steps",
        eval_steps=1,
        logging_steps=1,
        learning_rate=0.0,
    )
    trainer.train()
    during = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    after = trainer.evaluate()["eval_loss"]
    predicted = trainer.predict(packs).metrics["test_loss"]
    print(f"during training {during}, after {after:.6f}, predict {predicted:.6f}, reference {reference['loss']:.6f}")
    assert len(during) == 2
    assert max(_rel(x, reference["loss"]) for x in [*during, after, predicted]) < REL


def test_two_packs_per_step_and_a_second_evaluation_keep_every_row(
    tmp_path, tiny_model, processor, eval_file, reference
):
    """per_device_eval_batch_size=2 over 7 packs, evaluated twice. Once a pass has counted the stream, accelerate's
    gather_for_metrics cut the last step to 7 % 2 = 1 row: compute_metrics lost labels on the second evaluate()."""
    packs = _packs(eval_file, processor, LENGTHS[0])
    trainer = _trainer(
        tmp_path,
        _load(tiny_model, patched=False),
        processor,
        eval_dataset=packs,
        per_device_eval_batch_size=2,
        compute_metrics=lambda p: {"label_tokens": int((p.label_ids != -100).sum())},
    )
    for _ in range(2):
        metrics = trainer.evaluate()
        print(f"eval_loss {metrics['eval_loss']:.6f}, label tokens {metrics['eval_label_tokens']}")
        assert metrics["eval_label_tokens"] == reference["n"]
        assert _rel(metrics["eval_loss"], reference["loss"]) < REL


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
def test_compute_metrics_gets_the_unpatched_models_predictions(tmp_path, tiny_model, processor, eval_file, patched):
    """Logits handed to compute_metrics, at supervised positions, equal the unpatched model's on the same packs.
    Negative control: a model with one weight moved by 1e-2 fails the same comparison."""
    packs = _packs(eval_file, processor, LENGTHS[0])

    def predictions(model):
        seen = {}

        def compute_metrics(p):
            seen["predictions"], seen["labels"] = p.predictions, p.label_ids
            return {}

        _trainer(tmp_path, model, processor, eval_dataset=packs, compute_metrics=compute_metrics).evaluate()
        return seen

    hf_packing.revert_rmpad()
    expected = predictions(_load(tiny_model, patched=False))
    moved = _load(tiny_model, patched=False)
    with torch.no_grad():
        moved.lm_head.weight[0, 0] += 1e-2
    control = predictions(moved)
    got = predictions(_load(tiny_model, patched=patched))
    labels = expected["labels"]
    assert isinstance(got["predictions"], np.ndarray) and got["predictions"].shape == expected["predictions"].shape
    np.testing.assert_array_equal(got["labels"], labels)
    supervised = np.zeros_like(labels, dtype=bool)
    supervised[:, :-1] = labels[:, 1:] != -100  # the logits at t predict label t+1
    diff = np.abs(got["predictions"][supervised] - expected["predictions"][supervised]).max()
    control_diff = np.abs(control["predictions"][supervised] - expected["predictions"][supervised]).max()
    print(f"max |logit diff| at {supervised.sum()} supervised positions: {diff:.2e} (moved weight: {control_diff:.2e})")
    assert diff < 1e-4 < control_diff


def test_loss_only_evaluation_skips_the_logits_under_the_patch(tmp_path, tiny_model, processor, eval_file, reference):
    """Without compute_metrics the patched forward gets skip_logits=True: no (tokens × vocab) logits, and the token
    accuracy comes from the chunked loss."""
    model = _load(tiny_model, patched=True)
    shapes = []
    model.register_forward_hook(lambda m, a, out: shapes.append(getattr(out, "logits", None)))
    metrics = _trainer(tmp_path, model, processor, eval_dataset=_packs(eval_file, processor, LENGTHS[0])).evaluate()
    assert shapes and all(logits is None for logits in shapes)
    assert _rel(metrics["eval_token_accuracy"], reference["accuracy"]) < REL


def test_compiled_model_is_patched_and_evaluation_skips_the_logits(tmp_path, tiny_model, processor, eval_file):
    """``TrainingArguments(torch_compile=True)``: the Trainer hands `compute_loss` a compiled module (``_orig_mod``);
    `is_patched` sees through it, so loss-only evaluation still skips the logits, with the uncompiled model's loss
    and token accuracy (two packs). Backend ``eager`` (dynamo traces, no codegen). Negative controls: the compiled
    wrapper's own class carries no patch marker (reading it unwrapped is what makes this pass), and an unpatched
    compiled model is not patched."""
    from hf_packing.patches import is_patched, unwrap_model

    packs = list(_packs(eval_file, processor, LENGTHS[0]))[:2]  # dynamo traces each new shape: keep it short
    expected = _trainer(tmp_path, _load(tiny_model, patched=True), processor, eval_dataset=packs).evaluate()
    model = _load(tiny_model, patched=True)
    shapes, compiled = [], []
    model.register_forward_hook(lambda m, a, out: shapes.append(getattr(out, "logits", None)))
    trainer = _trainer(
        tmp_path,
        model,
        processor,
        eval_dataset=packs,
        torch_compile=True,
        torch_compile_backend="eager",
    )
    loss = trainer.compute_loss

    def compute_loss(model, inputs, **kwargs):
        compiled.append(model)
        return loss(model, inputs, **kwargs)

    trainer.compute_loss = compute_loss
    metrics = trainer.evaluate()
    assert compiled and all(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in compiled)
    assert is_patched(compiled[0]) and unwrap_model(compiled[0]) is model
    assert not hasattr(type(compiled[0]).forward, "hf_packing_original")
    assert shapes and all(logits is None for logits in shapes)
    assert _rel(metrics["eval_loss"], expected["eval_loss"]) < REL
    assert metrics["eval_token_accuracy"] == expected["eval_token_accuracy"]
    hf_packing.revert_rmpad()
    assert not is_patched(torch.compile(_load(tiny_model, patched=False), backend="eager"))


#: The precision setups docs/evaluation.md lists as verified: (weights' dtype, TrainingArguments(bf16=...): autocast).
PRECISIONS = {"fp32": (torch.float32, False), "bf16": (torch.bfloat16, False), "autocast": (torch.float32, True)}


def _plain(tiny_model: Path, processor, eval_file: str, precision: str) -> tuple[float, float, int]:
    """`_reference` of the unpatched model in ``precision`` (plain PyTorch: bf16 weights, or torch.autocast)."""
    dtype, autocast = PRECISIONS[precision]
    samples = [s for pack in _packs(eval_file, processor, max(LENGTHS)) for s in pack]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return _reference(_load(tiny_model, patched=False, dtype=dtype), processor, samples)


def within_twice_plain(name: str, fast: float, plain: float, exact: float, n: int) -> bool:
    """STYLE.md's rule for low precision: |fast - exact| <= 2 |plain - exact|, printed first (an accuracy is a count
    over ``n`` tokens: both errors are printed in tokens too; a loss passes ``n=1``)."""
    fast_err, plain_err = abs(fast - exact), abs(plain - exact)
    unit = "" if n == 1 else f" ({fast_err * n:.1f} / {plain_err * n:.1f} tokens)"
    print(
        f"{name}: fast {fast:.6f}, plain {plain:.6f}, fp32 {exact:.6f}; "
        f"error fast {fast_err:.2e}, plain {plain_err:.2e}{unit}"
    )
    return fast_err <= 2 * plain_err + 1e-12


@pytest.mark.parametrize("precision", PRECISIONS)
def test_token_accuracy_in_every_precision(tmp_path, tiny_model, processor, eval_file, reference, precision):
    """evaluate() reports eval_token_accuracy with fp32 weights, bf16 weights and fp32 + bf16 autocast
    (``bf16=True``), with and without compute_metrics: fp32 equal to the unpatched model's argmax accuracy sample by
    sample, low precision within 2x the plain (unpatched, same precision) error. Under autocast accelerate's
    ``convert_outputs_to_fp32`` rebuilds the output and drops the patched forward's count attributes.
    Negative control: reading the counts from the output alone (no recording) loses the metric under autocast."""
    dtype, autocast = PRECISIONS[precision]
    packs = _packs(eval_file, processor, LENGTHS[0])
    model = _load(tiny_model, patched=True, dtype=dtype)
    plain = _plain(tiny_model, processor, eval_file, precision) if precision != "fp32" else None
    for metrics_fn in (None, lambda p: {}):
        name = f"{precision}, {'with' if metrics_fn else 'without'} compute_metrics"
        kwargs = dict(eval_dataset=packs, bf16=autocast, compute_metrics=metrics_fn)
        metrics = _trainer(tmp_path, model, processor, **kwargs).evaluate()
        assert "eval_token_accuracy" in metrics, name
        accuracy, exact = metrics["eval_token_accuracy"], reference["accuracy"]
        if plain is None:
            print(f"{name}: {accuracy:.6f} (unpatched fp32 {exact:.6f}, {reference['n']} tokens)")
            assert accuracy == exact
        else:
            assert within_twice_plain(name, accuracy, plain[1], exact, reference["n"])
            assert within_twice_plain(f"{name}, eval_loss", metrics["eval_loss"], plain[0], reference["loss"], 1)
    if autocast:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(hf_packing.training.evaluation, "recording_token_counts", contextlib.nullcontext)
            control = _trainer(tmp_path, model, processor, eval_dataset=packs, bf16=True).evaluate()
        assert "eval_token_accuracy" not in control


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
def test_moe_eval_loss_is_the_cross_entropy_without_the_router_aux_loss(tmp_path, patched):
    """Qwen3-VL-MoE with output_router_logits: its loss adds router_aux_loss_coef · aux_loss; eval_loss does not.
    Negative control: the Trainer's own eval_loss includes it."""
    from hf_packing.testing.tiny import build_tiny_model

    processor = load_processor("qwen3_vl_moe")
    samples = processed_samples(processor, conversations(with_video=False))
    packs = [samples[:1], samples[1:]]
    model = build_tiny_model("qwen3_vl_moe", processor_dir=FIXTURES / "qwen3_vl_moe")
    expected, _, _ = _reference(model, processor, samples)  # output_router_logits off: cross-entropy only
    if patched:
        hf_packing.apply_rmpad("qwen3_vl_moe")
    model.config.text_config.output_router_logits = True
    ours = _trainer(tmp_path, model, processor, eval_dataset=packs).evaluate()["eval_loss"]
    plain = _trainer(tmp_path, model, processor, eval_dataset=packs, prepare=False).evaluate()["eval_loss"]
    print(f"eval_loss {ours:.6f}, cross-entropy {expected:.6f}, the Trainer's (with the aux term) {plain:.6f}")
    assert _rel(ours, expected) < REL < _rel(plain, expected)


def test_prepare_trainer_refuses_liger_loss_on_a_patched_model(tmp_path):
    """Liger's fused-loss forward would replace the patched forward; prepare_trainer says which setting to change (its
    inner kernels are accepted: tests/test_liger.py)."""
    from transformers import Trainer, TrainingArguments

    from hf_packing.testing.tiny import build_tiny_model

    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        max_steps=1,
        use_liger_kernel=True,
        liger_kernel_config={"fused_linear_cross_entropy": True},
    )
    prepare_trainer(Trainer(model=build_tiny_model("qwen2_vl"), args=args, train_dataset=[]))  # unpatched: fine
    hf_packing.apply_rmpad("qwen2_vl")
    with pytest.raises(ValueError, match="drop fused_linear_cross_entropy from liger_kernel_config"):
        prepare_trainer(Trainer(model=build_tiny_model("qwen2_vl"), args=args, train_dataset=[]))


# ------------------------------------------------------------------------------------------ two processes
def _two_process_eval(work, label: str, timeout: float = 240, **config) -> list[dict]:
    """tests/multiproc_eval.py on 2 gloo processes (``config`` as its docstring says); both ranks' results."""
    proc, results, seconds = launch(work, timeout, helper=HELPER, **config)
    check_ok(proc, results, seconds, label)
    return results


def _evaluated(results: list[dict], key: str) -> list[int]:
    """The sample indices both ranks evaluated under ``key``, sorted, fillers left out."""
    return sorted(i for r in results for batch in r["evaluated"][key] for i in batch if i >= 0)


def test_spread_leftovers_give_every_eval_pack_to_exactly_one_rank(processor, eval_file, reference):
    """7 packs on 2 ranks: "drop" (training's default) leaves the 7th out; "spread" gives it to rank 0 and rank 1 an
    unsupervised 1-token filler, so both ranks still take 4 steps."""
    for leftovers in ("drop", "spread"):
        ranks = [
            list(_packs(eval_file, processor, LENGTHS[0], rank=r, world_size=2, leftovers=leftovers)) for r in (0, 1)
        ]
        indices = sorted(int(s["index"]) for packs in ranks for p in packs for s in p if s["index"] >= 0)
        print(f"{leftovers}: packs per rank {[len(p) for p in ranks]}, samples {len(indices)}")
        assert len(ranks[0]) == len(ranks[1])
        if leftovers == "drop":
            assert len(indices) < len(reference["indices"])
    assert indices == reference["indices"]
    filler = ranks[1][-1]
    assert [s["index"] for s in filler] == [-1] and (filler[0]["labels"] == -100).all()


@pytest.mark.multiproc
@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
def test_two_processes_evaluate_every_pack_once_and_match_one_process(
    tmp_path, tiny_model, eval_file, reference, patched
):
    """2 gloo processes, the eval set packed at two max_lengths: each pack is evaluated by exactly one rank, and
    eval_loss equals the one-process token-level reference; compute_metrics gets every label once. Negative control:
    without the eval half of `keep_rank_packs` accelerate re-shards each rank's stream: unpatched, packs are skipped
    and eval_loss moves; patched, the forward refuses the re-sharded loader, naming `prepare_trainer` (issue 31)."""
    runs = {
        fix: _two_process_eval(
            tmp_path / f"fix{fix}",
            f"2-process evaluation, keep_eval_packs={fix}",
            model=str(tiny_model),
            data=[eval_file],
            lengths=list(LENGTHS),
            keep_eval_packs=fix,
            patched=patched,
        )
        for fix in (True, False)
    }
    for max_length in LENGTHS:
        key = f"eval_{max_length}"
        r0, r1 = runs[True]
        evaluated, loss = _evaluated(runs[True], key), r0["metrics"][f"{key}_loss"]
        print(
            f"max_length {max_length}: {len(r0['evaluated'][key])}+{len(r1['evaluated'][key])} packs, eval_loss "
            f"{loss:.6f} (reference {reference['loss']:.6f})"
        )
        assert evaluated == reference["indices"]  # every sample once, over both ranks
        assert all(r0["metrics"][k] == r1["metrics"][k] for k in r0["metrics"])
        assert _rel(loss, reference["loss"]) < REL
        assert _rel(r0["metrics"][f"{key}_token_accuracy"], reference["accuracy"]) < REL
        assert r0["metrics"][f"{key}_label_tokens"] == reference["n"]  # compute_metrics got every pack's labels once
    # At 256 each rank has 4 packs; accelerate's re-sharding keeps every second one (at 1024 each rank has one).
    key = f"eval_{LENGTHS[0]}"
    if patched:
        for rank in runs[False]:
            print(f"rank {rank['rank']} without the fix: {rank['errors'][key]}")
            assert "keeps 1 of every 2 packs" in rank["errors"][key] and "prepare_trainer" in rank["errors"][key]
        return
    broken = runs[False][0]["metrics"]
    unfixed = _evaluated(runs[False], key)
    print(f"without the fix {len(unfixed)} of {len(reference['indices'])} samples, eval_loss {broken[f'{key}_loss']}")
    assert unfixed != reference["indices"] and broken[f"{key}_label_tokens"] < reference["n"]
    assert _rel(broken[f"{key}_loss"], reference["loss"]) > REL


@pytest.mark.multiproc
def test_two_processes_evaluate_default_packs_exactly_once(tmp_path, tiny_model, eval_file, reference):
    """2 gloo processes, the eval set packed with `pack_dataset`'s defaults (training's ``leftovers="drop"``), passed
    to ``evaluate()`` and as the Trainer's own eval set that is also its training set: `prepare_trainer` evaluates
    through `PackedDataset.for_evaluation`, so every sample is evaluated once and eval_loss equals the one-process
    token-level mean. Negative control: without the view the last pack (7 packs of 256 tokens over 2 ranks) is left
    out and eval_loss moves."""
    runs = {
        view: _two_process_eval(
            tmp_path / f"view{view}",
            f"2-process evaluation of default packs, view={view}",
            model=str(tiny_model),
            data=[eval_file],
            lengths=[LENGTHS[0]],
            keep_eval_packs=True,
            patched=True,
            default_leftovers=True,
            no_eval_view=not view,
        )
        for view in (True, False)
    }
    for key in (f"eval_{LENGTHS[0]}", f"eval_{LENGTHS[0]}_as_train"):
        (r0, r1), broken = runs[True], runs[False][0]["metrics"]
        loss = r0["metrics"][f"{key}_loss"]
        unviewed = len(_evaluated(runs[False], key))
        print(
            f"{key}: eval_loss {loss:.6f} (reference {reference['loss']:.6f}, rel {_rel(loss, reference['loss']):.1e});"
            f" without the view {unviewed} of 12 samples, eval_loss {broken[f'{key}_loss']:.6f}"
        )
        assert _evaluated(runs[True], key) == reference["indices"]
        assert r0["metrics"] == r1["metrics"]
        assert _rel(loss, reference["loss"]) <= 1e-6
        assert _evaluated(runs[False], key) != reference["indices"]
        assert _rel(broken[f"{key}_loss"], reference["loss"]) > 1e-6


@pytest.mark.multiproc
def test_two_processes_report_token_accuracy_in_every_precision(tmp_path, tiny_model, processor, eval_file, reference):
    """2 gloo processes, fp32 / bf16 weights / fp32 + bf16 autocast, with and without compute_metrics: both ranks
    report the same eval_token_accuracy, fp32 equal to the unpatched model sample by sample, low precision within 2x
    the plain error. Negative control: under autocast without the recorded counts the metric is missing."""
    results = _two_process_eval(
        tmp_path,
        "2-process evaluation in 3 precisions",
        timeout=300,
        model=str(tiny_model),
        data=[eval_file],
        lengths=[LENGTHS[0]],
        keep_eval_packs=True,
        patched=True,
        precisions=list(PRECISIONS),
        loss_only=True,
    )
    (r0, r1), n = results, reference["n"]
    assert r0["metrics"] == r1["metrics"]
    for precision in PRECISIONS:
        plain = _plain(tiny_model, processor, eval_file, precision) if precision != "fp32" else None
        for mode in ("", "_loss_only"):
            key = f"eval_{LENGTHS[0]}" + ("" if precision == "fp32" else f"_{precision}") + mode
            assert _evaluated(results, key) == reference["indices"]
            accuracy = r0["metrics"][f"{key}_token_accuracy"]
            if plain is None:
                print(f"{key}: {accuracy:.6f} (unpatched fp32 {reference['accuracy']:.6f}, {n} tokens)")
                assert accuracy == reference["accuracy"]
            else:
                assert within_twice_plain(key, accuracy, plain[1], reference["accuracy"], n)
                assert within_twice_plain(f"{key}_loss", r0["metrics"][f"{key}_loss"], plain[0], reference["loss"], 1)
    control = f"eval_{LENGTHS[0]}_autocast_control"
    assert f"{control}_loss" in r0["metrics"] and f"{control}_token_accuracy" not in r0["metrics"]


# ------------------------------------------------------------------------------------------ per source
SOURCES = ("images", "text")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("eval_text") / "text.parquet"
    write_parquet(path, 6, seed=11, start=100, images="none")
    return str(path)


def _mix(eval_file: str, text_file: str, processor, max_length: int):
    """The 12 eval rows and 6 text-only rows as a ``{name: dataset}`` mix (no weights: every row of both)."""
    from datasets import load_dataset

    files = dict(zip(SOURCES, (eval_file, text_file), strict=True))
    mix = {name: load_dataset("parquet", data_files=f, split="train") for name, f in files.items()}
    return pack_dataset(mix, processor, max_length=max_length, leftovers="spread", disable_progress=True)


@pytest.fixture(scope="module")
def source_reference(tiny_model, processor, eval_file, text_file) -> dict[str, dict]:
    """Per source: the unpatched model's token-level (CE, accuracy, tokens) over that source's samples alone."""
    hf_packing.revert_rmpad()
    packs = _mix(eval_file, text_file, processor, max(LENGTHS))
    assert packs.source_names == list(SOURCES)
    samples = [s for p in packs for s in p]
    model = _load(tiny_model, patched=False)
    out = {}
    for k, name in enumerate(SOURCES):
        loss, accuracy, n = _reference(model, processor, [s for s in samples if s["source_id"] == k])
        out[name] = {"loss": loss, "accuracy": accuracy, "n": n}
        print(f"reference {name}: {n} supervised tokens, CE {loss:.6f}, accuracy {accuracy:.4f}")
    return out


class _RolledSources:
    """Negative control: each batch's source ids rolled by one (a sequence charged to its neighbour's source)."""

    def __init__(self, collator) -> None:
        self.collator = collator

    def __call__(self, features):
        batch = self.collator(features)
        batch["source_ids"] = batch["source_ids"].roll(1)
        return batch


def _check_per_source(metrics: dict, reference: dict, prefix: str = "eval") -> None:
    for name in SOURCES:
        loss, accuracy = metrics[f"{prefix}_{name}_loss"], metrics[f"{prefix}_{name}_token_accuracy"]
        ref = reference[name]
        print(f"{prefix} {name}: loss {loss:.6f} (reference {ref['loss']:.6f}, rel {_rel(loss, ref['loss']):.1e})")
        assert _rel(loss, ref["loss"]) < REL
        assert _rel(accuracy, ref["accuracy"]) < REL
    n = sum(reference[name]["n"] for name in SOURCES)
    weighted = sum(reference[name]["n"] * metrics[f"{prefix}_{name}_loss"] for name in SOURCES) / n
    assert _rel(weighted, metrics[f"{prefix}_loss"]) < REL


def test_per_source_eval_loss_is_each_sources_unpatched_mean(
    tmp_path, tiny_model, processor, eval_file, text_file, source_reference
):
    """A two-source mix packed at 256 tokens, evaluated under the patch: ``eval_<source>_loss`` and
    ``eval_<source>_token_accuracy`` equal the unpatched model on that source's samples alone. Negative control: the
    ids rolled within each batch move them. An unpatched model gives no per-source keys (its loss has no per-source
    sums)."""
    packs = _mix(eval_file, text_file, processor, LENGTHS[0])
    plain = _trainer(tmp_path, _load(tiny_model, patched=False), processor, eval_dataset=packs).evaluate()
    assert not any(k.startswith(("eval_images", "eval_text")) for k in plain)
    trainer = _trainer(tmp_path, _load(tiny_model, patched=True), processor, eval_dataset=packs)
    _check_per_source(trainer.evaluate(), source_reference)
    trainer.data_collator = _RolledSources(trainer.data_collator)
    rolled = trainer.evaluate()
    moved = max(_rel(rolled[f"eval_{name}_loss"], source_reference[name]["loss"]) for name in SOURCES)
    print(f"rolled source ids: {rolled}, largest rel error {moved:.1e}")
    assert moved > 1e-3


@pytest.mark.multiproc
def test_two_processes_report_per_source_eval_loss(tmp_path, tiny_model, eval_file, text_file, source_reference):
    """The same mix on 2 gloo processes: one all-reduce gives both ranks every source's token-level loss."""
    (r0, r1) = _two_process_eval(
        tmp_path,
        "2-process per-source evaluation",
        model=str(tiny_model),
        data=[eval_file],
        mix=[[name, f] for name, f in zip(SOURCES, (eval_file, text_file), strict=True)],
        lengths=[LENGTHS[0]],
        keep_eval_packs=True,
        patched=True,
    )
    assert r0["metrics"] == r1["metrics"]
    _check_per_source(r0["metrics"], source_reference, prefix=f"eval_{LENGTHS[0]}")
