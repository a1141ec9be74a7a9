"""The host-sync gate: one training step (forward + backward) on a VisionCollator pack, counted op by op.

Three kinds of event are counted (`hf_packing.testing.syncs.SyncCounter`), each attributed to the Python frame that
issued it: syncing ops (``.item()``, ``nonzero``, boolean-mask indexing, ...), ``Tensor.tolist()`` host reads (on
a GPU a device-to-host copy that waits), and tensors created from host data (``torch.tensor(list, device=...)``,
``new_tensor(float)``, ``.to(cuda)`` of a CPU tensor: on a GPU a host-to-device copy from pageable memory, which
waits too). The gate runs each family in rows mode (2 and 4 layers, 2 and 8 sequences), flat mode and with gradient
checkpointing, with ``num_items_in_batch`` as the Trainer passes it, and requires:

- none of the three from hf_packing;
- the same totals, every origin, in every setting (nothing grows with layers or sequences, nothing is added by a
  mode or by recomputation);
- at most `REMAINING` in all, every origin: a sync or a host-data tensor added anywhere, transformers' helpers
  included, fails (the negative controls plant one).

On VisionCollator batches the collator passes the host values the step would otherwise read back or copy in
(docs/patches.md has the counts without them; `bench_syncs.py` measures both, benchmarks/RESULTS.md)::

    event                              on VisionCollator batches
    varlen.validate_attention_mask     ``seqlens`` (host lengths); device boundaries from the batch's
    PackedSequences.from_seqlens       ``cu_seq_lens_q`` or the mask's running row sums (no host data)
    _flatten.check_placeholders        checked by the collator per sample (``VisionCollator._check``)
    _flatten._placeholder_counts       per-token sequence ids from the device ``cu_seqlens``
    _vision.tower_calls (encode)       split by ``pixel_values``' rows, a shape (every caller)
    _attention._VisionBoundaries       ``vision_grids`` (host grids) → frame / window lengths, trusted
    MoE aux weight (_forward)          ``n_local / num_items_in_batch`` without ``new_tensor``
    transformers' vision helpers       ``vision_inputs``: computed in the worker by the same helpers
    get_image_features' split          the collator's item sizes (`_vision.ITEM_TOKENS`)
    get_placeholder_mask's checks      asked for the masks alone (the collator checked the counts)
    Qwen3-VL DeepStack update / merge  ``index_add`` at ``nonzero_static``; images ‖ videos in row order

Other callers' batches (padded rows or position-id rows without ``seqlens`` / ``vision_grids``) keep the host
checks, once per step, never per layer: they name the offending row or sequence. The package's other host reads
are outside this step: evaluation totals (`evaluation.py`), the telemetry callback's log vector and FLOPs
(`telemetry.py`, `flops.py`, once per logging step), the vision split under sequence parallelism only
(`sequence_parallel.py`), and ``seqlens`` of `PackedSequences` made without them (`varlen.py`,
`linear_attention.py`: never on `flatten_batch`'s output, which always carries them).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_packing
from hf_packing import VisionCollator
from hf_packing.ops.flops import num_experts
from hf_packing.patches import _attention, _flatten
from hf_packing.testing.syncs import SyncCounter
from hf_packing.testing.tiny import GLM_TYPES, MODEL_TYPES, build_tiny_model
from tests.helpers import FIXTURES, load_processor, processed_samples


def _layers(model_type: str, n: int) -> dict:
    text = {"num_hidden_layers": n}
    if model_type.startswith("qwen3_5"):
        text["layer_types"] = ["linear_attention", "full_attention"] * (n // 2)
    elif model_type == "qwen4_exp":  # PLE on the first linear layer, QSA on every indexed one
        text["layer_types"] = ["linear_attention", "indexed_attention"] * (n // 2)
    return {"text_config": text}


def _step(model, batch, num_items: bool = False) -> SyncCounter:
    """One training step under the counter; ``num_items``: pass ``num_items_in_batch`` as the Trainer does (a tensor
    already on the device, made outside the step). MoE models return their router logits (the aux loss term)."""
    model.train()
    model.zero_grad(set_to_none=True)
    extra = {"num_items_in_batch": torch.tensor(batch["num_supervised_tokens"])} if num_items else {}
    if num_experts(model.config.get_text_config()):
        extra["output_router_logits"] = True
    with SyncCounter() as counter:
        model(**batch, **extra).loss.backward()
    return counter


#: What still happens in one patched step on the gate's pack (an image and a video), per family, on transformers 5.23:
#: (syncing ops, ``tolist`` reads, host-data creations), every origin: nothing. The gate fails when a step does more,
#: from any origin. (Before the collator passed ``vision_inputs`` and its batches were trusted: (5, 3, 4), (8, 6, 6),
#: (22, 3, 4), (22, 3, 5), (9, 3, 4), (9, 3, 5), all the syncs and reads transformers' helpers', 3 to 4 of the
#: host-data tensors ours, one more on MoE with the aux loss.) A transformers version not listed is gated on
#: hf_packing's own events only.
REMAINING = {"5.23": dict.fromkeys(MODEL_TYPES + GLM_TYPES, (0, 0, 0))}
KINDS = ("syncs", "host_reads", "creations")


def _checkpointing(model, on: bool) -> None:
    """Gradient checkpointing on or off (``activation_checkpointing_*`` from transformers 5.23, the old names
    before)."""
    prefix = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    if on:
        getattr(model, f"{prefix}_checkpointing_enable")(**{f"{prefix}_checkpointing_kwargs": {"use_reentrant": False}})
    else:
        getattr(model, f"{prefix}_checkpointing_disable")()
    assert model.model.language_model.gradient_checkpointing is on


def _counts(counter: SyncCounter, package: str = "") -> tuple[int, int, int]:
    return tuple(counter.by(package, kind) for kind in KINDS)


def remaining(model_type: str) -> tuple[int, int, int] | None:
    """The gate's budget for transformers' own events (`REMAINING`); ``None`` for a transformers version not
    measured."""
    import transformers

    version = ".".join(transformers.__version__.split(".")[:2])
    return REMAINING.get(version, {}).get(model_type)


def _unpatched_syncs(model, processor, pack: list, model_type: str) -> int:
    """The unpatched model's syncs on ``pack`` as padded rows; GLM-V refuses a padded batch holding images and a
    video (an image and a video frame share one token), so its baseline is each sample alone, summed."""
    if model_type not in GLM_TYPES:
        return _step(model, VisionCollator(processor)(pack)).total
    return sum(_step(model, VisionCollator(processor)([sample])).total for sample in pack)


def _warm_imports() -> None:
    """Import what the first patched step imports lazily: the loss's probe for Liger-Kernel's fused cross-entropy
    (`hf_packing._compat.liger_fused_linear_cross_entropy`), whose import chain (peft's LoHa layers) makes tensors from
    host data once, at import; a gate run first in its process would count them."""
    from hf_packing import _compat

    _compat.liger_fused_linear_cross_entropy()


def gate(model_type: str) -> list[str]:
    """Run the gate for one family; returns the failed conditions (empty: the gate holds).

    Patched steps on collator packs: rows mode at 2 and 4 layers and 2 and 8 sequences, flat mode, and rows with
    gradient checkpointing; each must make no sync, ``tolist`` read or host-data creation from hf_packing, the same
    totals (every origin) as the others, at most `REMAINING` in all, and no more syncs than the unpatched model."""
    _warm_imports()
    processor = load_processor(model_type)
    samples = processed_samples(processor)
    packs = {2: [samples[1], samples[4]], 8: [samples[1], samples[4]] + [samples[0]] * 6}  # same vision, more text
    budget = remaining(model_type)
    totals, failures = {}, []
    for layers in (2, 4):
        model = build_tiny_model(model_type, processor_dir=FIXTURES / model_type, **_layers(model_type, layers))
        rows = VisionCollator(processor, model_config=model.config)  # as recipes/train.py builds it
        flat = VisionCollator(processor, mode="flat", model_config=model.config)
        settings = [("rows", 2, rows, False), ("rows", 8, rows, False), ("flat", 2, flat, False)]
        settings = settings + [("rows+checkpointing", 2, rows, True)] if layers == 2 else [("rows", 2, rows, False)]
        unpatched = _unpatched_syncs(model, processor, packs[2], model_type) if layers == 2 else None
        for name, n_seqs, collate, checkpointing in settings:
            if checkpointing:
                _checkpointing(model, True)
            hf_packing.apply_rmpad(model_type)
            try:
                patched = _step(model, collate(packs[n_seqs]), num_items=True)
            finally:
                hf_packing.revert_rmpad(model_type)
                _checkpointing(model, False)
            where = f"{name} layers={layers} seqs={n_seqs}"
            totals[where] = _counts(patched)
            base = "-" if unpatched is None else f"{unpatched} syncs"
            print(f"\n{model_type} {where}: unpatched {base}; patched (syncs, tolist reads, creations) {totals[where]}")
            print(patched.report())
            for kind, ours in zip(KINDS, _counts(patched, "hf_packing/")):
                if ours:
                    failures.append(f"{ours} {kind} from hf_packing at {where}")
            if unpatched is not None and patched.total > unpatched:
                failures.append(f"patched {patched.total} > unpatched {unpatched} syncs at {where}")
            if budget is not None:
                for kind, n, most in zip(KINDS, totals[where], budget):
                    if n > most:
                        failures.append(f"{n} {kind} in all at {where}, more than transformers' remaining {most}")
    first = "rows layers=2 seqs=2"
    for where, counts in totals.items():
        if counts != totals[first]:
            failures.append(f"totals differ: {counts} at {where}, {totals[first]} at {first}")
    return failures


#: four families in the default run, the others under -m slow (each family is a whole gate run); Qwen4-Exp for its
#: own token mixers (PLE, the QSA indexer), GLM-4.1V for its frames-as-images vision path, which no other family runs
FAST = ("qwen2_5_vl", "qwen3_vl", "glm4v", "qwen4_exp")


@pytest.mark.parametrize(
    "model_type", [t if t in FAST else pytest.param(t, marks=pytest.mark.slow) for t in MODEL_TYPES + GLM_TYPES]
)
def test_training_step_makes_no_host_sync_of_its_own(model_type):
    assert gate(model_type) == []


def test_a_per_layer_item_in_attention_fails_the_gate(monkeypatch):
    """Negative control: one ``.item()`` per attention call (per layer) must fail the gate."""
    original = _attention.varlen_attention

    def syncing(q, k, v, seqs, **kwargs):
        if q.abs().sum().item() < 0:  # never true; the read is the point
            raise AssertionError
        return original(q, k, v, seqs, **kwargs)

    monkeypatch.setattr(_attention, "varlen_attention", syncing)
    failures = gate("qwen2_5_vl")
    print(failures)
    assert any("totals differ" in f and "layers=4" in f for f in failures)


def test_a_host_data_tensor_in_a_decoder_layer_fails_the_gate(monkeypatch):
    """Negative control: ``torch.tensor(list, device=...)`` in every decoder layer (on a GPU, a host-to-device copy
    per layer) must fail the gate, though it issues no syncing op."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as modeling

    layer = modeling.Qwen2_5_VLDecoderLayer
    original = layer.forward

    def forward(self, hidden_states, *args, **kwargs):
        hidden_states = hidden_states + torch.tensor([0.0], device=hidden_states.device)
        return original(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(layer, "forward", forward)
    failures = gate("qwen2_5_vl")
    print(failures)
    assert any("totals differ" in f and "layers=4" in f for f in failures)
    if remaining("qwen2_5_vl") is not None:
        assert any("creations in all" in f for f in failures)


def test_an_item_in_transformers_helpers_fails_the_gate(monkeypatch):
    """Negative control: one ``.item()`` in transformers' vision helper path (once per step: it does not grow with
    layers or sequences) must fail the gate by its total from every origin."""
    if remaining("qwen2_5_vl") is None:
        pytest.skip("no measured budget of transformers' own syncs for this transformers version")
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as modeling

    original = modeling.get_vision_position_ids

    def get_vision_position_ids(grid_thw, *args, **kwargs):
        if grid_thw.sum().item() < 0:  # never true; the read is the point
            raise AssertionError
        return original(grid_thw, *args, **kwargs)

    monkeypatch.setattr(modeling, "get_vision_position_ids", get_vision_position_ids)
    failures = gate("qwen2_5_vl")
    print(failures)
    assert any("syncs in all" in f for f in failures)


def test_a_host_read_on_the_collator_path_fails_the_gate(monkeypatch):
    """Negative control: the host placeholder check back on the collator's batches (3 ``tolist`` per step, none
    of them a syncing op) must fail the gate."""
    monkeypatch.setattr(_flatten, "collated_placeholders", _flatten.check_placeholders)
    failures = gate("qwen2_5_vl")
    print(failures)
    assert any("3 host_reads from hf_packing" in f for f in failures)


@pytest.mark.parametrize(
    ("filename", "expected"),
    [
        ("/ci/hf_packing/tests/test_x.py", "tests/test_x.py"),  # a checkout whose folder is named hf_packing
        ("/ci/hf_packing/hf_packing/ops/loss.py", "hf_packing/ops/loss.py"),
        ("/ci/hf_packing/.venv/lib/python3.11/site-packages/transformers/m.py", "transformers/m.py"),
        (
            "/usr/lib/python3.11/site-packages/hf_packing/ops/loss.py",
            "hf_packing/ops/loss.py",
        ),  # installed, not editable
    ],
)
def test_origins_are_relative_to_the_checkout(monkeypatch, filename, expected):
    """Which syncs are "ours" is read off the origin's path: a test file in a checkout named ``hf_packing`` must
    not read as ``hf_packing/tests/...`` (it did, and failed the gate in a clone made as ``git clone ...
    hf_packing``)."""
    from hf_packing.testing import syncs

    monkeypatch.setattr(syncs, "_REPO_DIR", "/ci/hf_packing/")
    namespace: dict = {"origin": syncs.origin}
    exec(compile("def where():\n    return origin()\n", filename, "exec"), namespace)
    assert namespace["where"]() == f"{expected}:2 where"


def test_counter_sees_each_kind_of_sync():
    """The counter itself: each listed op counts once, its sync-free forms and `_assert_async` do not."""
    x = torch.tensor([0, 2, 1, 3])
    with SyncCounter() as counter:
        x.sum().item()
        x.nonzero()
        x[x > 1]
        torch.masked_select(x, x > 1)
        x.unique()
        x.repeat_interleave(x)
        x.repeat_interleave(x, output_size=6)  # sync-free forms below
        x.repeat_interleave(2)
        torch.nonzero_static(x, size=3)
        torch._assert_async(x.sum() == 6)
        x.tolist()
    ops = sorted(op for op, _ in counter.syncs)
    print(counter.report())
    assert ops == ["_local_scalar_dense", "_unique2", "index", "masked_select", "nonzero", "repeat_interleave"]
    assert all(where.startswith("tests/test_syncs.py") for _, where in counter.syncs)
    assert list(counter.host_reads.values()) == [1]
    assert counter.created == 0


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")
def test_counter_sees_each_host_data_creation():
    """Tensors made from host data count once each (with their origin); tensors made from tensors, device factories
    and copies that stay on the host do not. A copy to an accelerator counts (checked on the rule itself: no GPU)."""
    import numpy as np

    from hf_packing.testing.syncs import _creation

    x = torch.tensor([0, 2, 1, 3])
    with SyncCounter() as counter:
        torch.tensor([1, 2], device="cpu")
        torch.tensor(3.0)
        torch.as_tensor([1, 2])
        torch.asarray([1])
        torch.from_numpy(np.zeros(2))
        x.new_tensor([1.0])
        torch.tensor(x)  # sync-free forms below: from a tensor, device factories, host-to-host copies
        torch.as_tensor(x)
        x.new_tensor(x)
        torch.full((2,), 3)
        torch.zeros(3)
        torch.arange(4)
        x.to("cpu")
        x.to(torch.float64)
    print(counter.report())
    ops = sorted(op for op, _ in counter.creations.elements())
    assert ops == ["as_tensor", "asarray", "from_numpy", "new_tensor", "tensor", "tensor"]
    assert all(where.startswith("tests/test_syncs.py") for _, where in counter.creations)
    assert counter.total == 0 and torch.from_numpy is not None and torch.from_numpy.__module__ == "torch"
    assert _creation(torch.Tensor.to, (x, "cuda"), {}) == "h2d"
    assert _creation(torch.Tensor.to, (x,), {"device": torch.device("cuda", 0), "non_blocking": True}) == "h2d"
    assert _creation(torch.Tensor.to, (x, 0), {}) == "h2d"
    assert _creation(torch.Tensor.cuda, (x,), {}) == "h2d"
    assert _creation(torch.Tensor.to, (x, torch.float16), {}) is None
    assert _creation(torch.Tensor.to, (x, "cpu"), {}) is None


def _per_source_step(processor, model, collate, sources: bool) -> SyncCounter:
    """One training step on a two-source pack with `PackingTelemetry` attached, per-source logging on or off."""
    from hf_packing.training.telemetry import PackingTelemetry

    samples = processed_samples(processor)
    pack = [{**s, "source_id": k % 2} if sources else s for k, s in enumerate([samples[1], samples[4], samples[0]])]
    telemetry = PackingTelemetry(sources=["a", "b"] if sources else None)
    telemetry.attach(model)
    try:
        counter = _step(model, collate([pack]))
        if sources:  # the sums arrived, on the device, and match the loss's supervised count
            assert telemetry._per_source[1].sum().item() == collate([pack])["num_supervised_tokens"]
    finally:
        telemetry.detach()
    return counter


def test_per_source_logging_adds_no_host_sync(monkeypatch):
    """The same pack with and without per-source sums (source_ids, `counting_sources` opened by the telemetry's
    hooks, `index_add_` in every loss chunk): the same number of syncs, none of them hf_packing's. Negative control:
    expanding the ids with a data-dependent ``repeat_interleave`` adds one."""
    from hf_packing.ops import loss

    processor = load_processor("qwen2_5_vl")
    model = build_tiny_model("qwen2_5_vl", processor_dir=FIXTURES / "qwen2_5_vl")
    collate = VisionCollator(processor, model_config=model.config)
    hf_packing.apply_rmpad("qwen2_5_vl")
    try:
        off = _per_source_step(processor, model, collate, sources=False)
        on = _per_source_step(processor, model, collate, sources=True)
        print(f"\nper-source off: {off.total} syncs, on: {on.total}\n{on.report()}")
        assert on.total == off.total and on.by("hf_packing/") == 0
        assert on.host_reads == off.host_reads  # no extra .tolist() either

        def syncing(source_ids, cu_seqlens, num_sources, total):
            return source_ids.to(cu_seqlens.device).repeat_interleave((cu_seqlens[1:] - cu_seqlens[:-1]).long())

        monkeypatch.setattr(loss, "token_sources", syncing)
        control = _per_source_step(processor, model, collate, sources=True)
        print(f"control: {control.total} syncs")
        assert control.total == off.total + 1
    finally:
        hf_packing.revert_rmpad("qwen2_5_vl")


def test_collated_boundaries_are_trusted_and_other_batches_checked():
    """The collator's ``seqlens`` replace the mask's host read, and its tensors give the device boundaries: no read,
    no tensor from host data, the boundaries equal the collator's. Without ``seqlens`` (another caller's batch) the
    patch reads and checks the mask itself, naming the row."""
    processor = load_processor("qwen2_vl")
    model = build_tiny_model("qwen2_vl", processor_dir=FIXTURES / "qwen2_vl")
    samples = processed_samples(processor)
    hf_packing.apply_rmpad("qwen2_vl")
    try:
        for return_cu_seqlens in (False, True):
            collate = VisionCollator(processor, model_config=model.config, return_cu_seqlens=return_cu_seqlens)
            batch = collate([samples[0], samples[1]])
            with SyncCounter() as counter:
                indices, seqs = _flatten.sequence_boundaries(
                    batch["input_ids"], batch["attention_mask"], None, batch.get("cu_seqlens"), batch["seqlens"]
                )
            assert (counter.total, counter.created, sum(counter.host_reads.values())) == (0, 0, 0), counter.report()
            assert seqs.cu_seqlens.tolist() == [0, *itertools.accumulate(batch["seqlens"])]
            assert seqs.cu_seqlens.dtype == torch.int32 and seqs.max_seqlen == max(batch["seqlens"])
            assert indices.numel() == sum(batch["seqlens"])
        holed = dict(batch, attention_mask=batch["attention_mask"].clone())
        holed["attention_mask"][0, 1] = 0
        with pytest.raises(ValueError, match="attention_mask row 0 has a hole"):
            model(**{k: v for k, v in holed.items() if k not in ("seqlens", "cu_seqlens")})
        with SyncCounter() as counter:
            model(**{k: v for k, v in batch.items() if k not in ("seqlens", "cu_seqlens")})
        assert [at for _, at in counter.host_reads if at.endswith("validate_attention_mask")]  # the control reads
    finally:
        hf_packing.revert_rmpad("qwen2_vl")


def test_collated_placeholders_are_checked_by_the_collator():
    """On the collator's batches the per-sequence placeholder check is the collator's, on the host in the worker (no
    ``tolist``, no copy in the step): a sample whose grid moves tokens between images fails there, naming it.
    Without ``seqlens`` the patch's host check names the sequence."""
    processor = load_processor("qwen2_vl")
    model = build_tiny_model("qwen2_vl", processor_dir=FIXTURES / "qwen2_vl")
    samples = processed_samples(processor)
    collate = VisionCollator(processor, model_config=model.config)
    batch = collate([samples[2], samples[3]])  # images 8 + 4 | 9 tokens
    swapped = dict(batch, image_grid_thw=batch["image_grid_thw"][[2, 1, 0]])  # 9 + 4 | 8: same total of 21
    wrong = dict(samples[3], image_grid_thw=batch["image_grid_thw"][[0]])  # 8 tokens' grid for a 9-token sample
    hf_packing.apply_rmpad("qwen2_vl")
    try:
        with SyncCounter() as counter:
            model(**batch)
        assert not [at for _, at in [*counter.host_reads, *counter.creations] if "placeholders" in at]
        with pytest.raises(ValueError, match="sample 1: 9 image placeholder tokens but image_grid_thw implies 8"):
            collate([samples[2], wrong])
        with pytest.raises(ValueError, match="sequence 0 has 12 image placeholder tokens"):
            model(**{k: v for k, v in swapped.items() if k != "seqlens"})
    finally:
        hf_packing.revert_rmpad("qwen2_vl")


class _Argmax(TorchDispatchMode):
    """Counts ``aten::argmax`` calls inside the block."""

    calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func._schema.name == "aten::argmax"
        return func(*args, **(kwargs or {}))


def test_training_step_computes_no_argmax_unless_read():
    """A training step whose token accuracy nobody reads (no evaluation, no per-source telemetry) runs no argmax;
    inside `recording_token_counts` (what evaluation and the telemetry open) the hits are counted, and equal the
    argmax of the step's own logits."""
    from hf_packing.patches.recording import recording_token_counts

    processor = load_processor("qwen2_vl")
    model = build_tiny_model("qwen2_vl", processor_dir=FIXTURES / "qwen2_vl").train()
    samples = processed_samples(processor)
    batch = VisionCollator(processor, model_config=model.config)([samples[0], samples[1], samples[4]])
    hf_packing.apply_rmpad("qwen2_vl")
    try:
        with _Argmax() as counter:
            out = model(**batch)
            out.loss.backward()
        assert counter.calls == 0 and out.num_correct_tokens is None
        with recording_token_counts() as counts, _Argmax() as counter:
            model(**batch).loss.backward()
        assert counter.calls > 0 and len(counts) == 1
        with torch.no_grad():
            logits = model(**batch, skip_logits=False).logits
        targets = batch["labels"][:, 1:]
        hits = ((logits[:, :-1].argmax(-1) == targets) & (targets != -100)).sum().item()
        assert counts[0].num_correct.item() == hits
    finally:
        hf_packing.revert_rmpad("qwen2_vl")


@pytest.mark.parametrize("model_type", ["qwen3_vl", "qwen3_5"])
def test_a_pack_of_images_makes_no_sync_at_all(model_type):
    """A pack of images and text, no video (DeepStack's update without the image/video merge): the whole step, every
    origin, makes no syncing op, no ``tolist`` read and no host-data tensor (transformers 5.23; rows and flat)."""
    if remaining(model_type) is None:
        pytest.skip("no measured budget of transformers' own syncs for this transformers version")
    processor = load_processor(model_type)
    samples = processed_samples(processor)
    model = build_tiny_model(model_type, processor_dir=FIXTURES / model_type)
    pack = [samples[1], samples[2], samples[0]]  # 1 image, 2 images, text
    hf_packing.apply_rmpad(model_type)
    try:
        for mode in ("rows", "flat"):
            collate = VisionCollator(processor, mode=mode, model_config=model.config)
            counter = _step(model, collate(pack), num_items=True)
            assert _counts(counter) == (0, 0, 0), counter.report()
    finally:
        hf_packing.revert_rmpad(model_type)
