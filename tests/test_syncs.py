"""The host-sync gate: one training step (forward + backward) on a VisionCollator pack, counted op by op.

Syncing ops (`hf_packing.testing.syncs`) are attributed to the Python frame that issued them. On the collator's
batches (boundaries, M-RoPE positions and the supervised count computed in the DataLoader worker) hf_packing
issues none; transformers' remaining ones (vision tower, placeholder checks) are printed with their origin, and
none of them grows with the number of layers or sequences.

``Tensor.tolist()`` host reads are counted apart (`SyncCounter.host_reads`; on a GPU each is a device-to-host copy
that waits too) and gated at 0 from hf_packing as well. The collator passes the host values the patch used to read
back (`bench_syncs.py`, one pack of 5 samples: 6 reads on Qwen2-VL / Qwen3-VL(-MoE), 7 on Qwen2.5-VL, now 0)::

    read, before                                  now, on VisionCollator batches
    varlen.validate_attention_mask     1          ``seqlens`` (host lengths); mask / cu_seqlens asserted on the device
    _flatten.sequence_boundaries       1*         ``seqlens`` (* cu_seqlens, when a row held several samples)
    _flatten.check_placeholders        3          `assert_placeholders`: the same rule, ``torch._assert_async``
    _vision.tower_calls (encode)       1          split by ``pixel_values``' rows, a shape (every caller)
    _attention._VisionBoundaries       1 (2.5: 2) ``vision_grids`` (host grids) → frame / window lengths, asserted

Other callers' batches (padded rows or position-id rows without ``seqlens`` / ``vision_grids``) keep the host
checks, once per step, never per layer: they name the offending row or sequence. The package's other host reads
are outside this step: evaluation totals (`evaluation.py`), the telemetry callback's log vector and FLOPs
(`telemetry.py`, `flops.py`, once per logging step), the vision split under sequence parallelism only
(`sequence_parallel.py`), and ``seqlens`` of `PackedSequences` made without them (`varlen.py`,
`linear_attention.py`: never on `flatten_batch`'s output, which always carries them).
"""

from __future__ import annotations

import pytest
import torch

import hf_packing
from hf_packing import VisionCollator
from hf_packing.patches import _attention
from hf_packing.testing.syncs import SyncCounter
from hf_packing.testing.tiny import MODEL_TYPES, build_tiny_model
from tests.conftest import FIXTURES, load_processor, processed_samples


def _layers(model_type: str, n: int) -> dict:
    text = {"num_hidden_layers": n}
    if model_type.startswith("qwen3_5"):
        text["layer_types"] = ["linear_attention", "full_attention"] * (n // 2)
    return {"text_config": text}


def _step(model, batch) -> SyncCounter:
    model.train()
    model.zero_grad(set_to_none=True)
    with SyncCounter() as counter:
        model(**batch).loss.backward()
    return counter


def gate(model_type: str) -> list[str]:
    """Run the gate for one family; returns the failed conditions (empty: the gate holds)."""
    processor = load_processor(model_type)
    samples = processed_samples(processor)
    packs = {2: [samples[1], samples[4]], 8: [samples[1], samples[4]] + [samples[0]] * 6}  # same vision, more text
    totals, failures = {}, []
    for layers in (2, 4):
        model = build_tiny_model(model_type, processor_dir=FIXTURES / model_type, **_layers(model_type, layers))
        collate = VisionCollator(processor, model_config=model.config)  # as recipes/train.py builds it
        for n_seqs in (2, 8) if layers == 2 else (2,):
            unpatched = _step(model, VisionCollator(processor)(packs[n_seqs])) if layers == 2 else None
            hf_packing.apply_rmpad(model_type)
            try:
                patched = _step(model, collate(packs[n_seqs]))
            finally:
                hf_packing.revert_rmpad(model_type)
            totals[layers, n_seqs] = patched.total
            reads = sum(n for (_, at), n in patched.host_reads.items() if at.startswith("hf_packing/"))
            base = "-" if unpatched is None else unpatched.total
            print(f"\n{model_type} layers={layers} seqs={n_seqs}: unpatched {base}, patched {patched.total}")
            print(patched.report())
            if patched.by("hf_packing/"):
                failures.append(f"{patched.by('hf_packing/')} syncs from hf_packing at layers={layers} seqs={n_seqs}")
            if reads:
                failures.append(f"{reads} tolist host reads from hf_packing at layers={layers} seqs={n_seqs}")
            if unpatched is not None and patched.total > unpatched.total:
                failures.append(f"patched {patched.total} > unpatched {unpatched.total} (layers={layers})")
    if totals[2, 2] != totals[4, 2]:
        failures.append(f"syncs grow with layers: {totals[2, 2]} at 2, {totals[4, 2]} at 4")
    if totals[2, 2] != totals[2, 8]:
        failures.append(f"syncs grow with sequences: {totals[2, 2]} at 2, {totals[2, 8]} at 8")
    return failures


#: two families in the default run (about 30 s each on CPU), the others under -m slow
FAST = ("qwen2_5_vl", "qwen3_vl")


@pytest.mark.parametrize(
    "model_type", [t if t in FAST else pytest.param(t, marks=pytest.mark.slow) for t in MODEL_TYPES]
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
    assert any("grow with layers" in f for f in failures)


def test_a_host_read_on_the_collator_path_fails_the_gate(monkeypatch):
    """Negative control: the host placeholder check back on the collator's batches (3 ``tolist`` per step, none
    of them a syncing op) must fail the gate."""
    from hf_packing.patches import _flatten

    monkeypatch.setattr(_flatten, "assert_placeholders", _flatten.check_placeholders)
    failures = gate("qwen2_5_vl")
    print(failures)
    assert any("3 tolist host reads from hf_packing" in f for f in failures)


@pytest.mark.parametrize(
    ("filename", "expected"),
    [
        ("/ci/hf_packing/tests/test_x.py", "tests/test_x.py"),  # a checkout whose folder is named hf_packing
        ("/ci/hf_packing/hf_packing/loss.py", "hf_packing/loss.py"),
        ("/ci/hf_packing/.venv/lib/python3.11/site-packages/transformers/m.py", "transformers/m.py"),
        ("/usr/lib/python3.11/site-packages/hf_packing/loss.py", "hf_packing/loss.py"),  # installed, not editable
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


def _per_source_step(processor, model, collate, sources: bool) -> SyncCounter:
    """One training step on a two-source pack with `PackingTelemetry` attached, per-source logging on or off."""
    from hf_packing.telemetry import PackingTelemetry

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
    from hf_packing import loss

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


def test_collated_boundaries_are_checked_on_the_device():
    """The collator's ``seqlens`` replace the mask's host read; a batch whose mask or boundaries disagree with them
    still fails (``torch._assert_async``), and without them the patch reads and checks the mask itself."""
    processor = load_processor("qwen2_vl")
    model = build_tiny_model("qwen2_vl", processor_dir=FIXTURES / "qwen2_vl")
    samples = processed_samples(processor)
    batch = VisionCollator(processor, model_config=model.config, return_cu_seqlens=True)([samples[0], samples[1]])
    hf_packing.apply_rmpad("qwen2_vl")
    try:
        with SyncCounter() as counter:
            model(**batch)
        boundary_reads = ("validate_attention_mask", "sequence_boundaries")
        assert not [at for _, at in counter.host_reads if at.endswith(boundary_reads)]
        short = dict(batch, attention_mask=batch["attention_mask"].clone())
        short["attention_mask"][0, batch["seqlens"][0] - 1] = 0
        with pytest.raises(RuntimeError, match="attention_mask does not match VisionCollator's seqlens"):
            model(**short)
        shifted = dict(batch, cu_seqlens=batch["cu_seqlens"] + torch.tensor([0, 1, 0], dtype=torch.int32))
        with pytest.raises(RuntimeError, match="cu_seqlens does not match VisionCollator's seqlens"):
            model(**shifted)
        with SyncCounter() as counter:
            model(**{k: v for k, v in batch.items() if k != "seqlens"})
        assert [at for _, at in counter.host_reads if at.endswith(boundary_reads)]  # the control reads
    finally:
        hf_packing.revert_rmpad("qwen2_vl")


def test_collated_placeholders_are_checked_on_the_device():
    """On the collator's batches the per-sequence placeholder check runs on the device (no ``tolist``); grids that
    keep the image total but move tokens between sequences still fail. Without ``seqlens`` the host check names
    the sequence."""
    processor = load_processor("qwen2_vl")
    model = build_tiny_model("qwen2_vl", processor_dir=FIXTURES / "qwen2_vl")
    samples = processed_samples(processor)
    batch = VisionCollator(processor, model_config=model.config)([samples[2], samples[3]])  # images 8 + 4 | 9 tokens
    swapped = dict(batch, image_grid_thw=batch["image_grid_thw"][[2, 1, 0]])  # 9 + 4 | 8: same total of 21
    hf_packing.apply_rmpad("qwen2_vl")
    try:
        with SyncCounter() as counter:
            model(**batch)
        assert not [at for _, at in counter.host_reads if "placeholders" in at]
        with pytest.raises(RuntimeError, match="Image features and image tokens do not match.*sequence's image"):
            model(**swapped)
        with pytest.raises(ValueError, match="sequence 0 has 12 image placeholder tokens"):
            model(**{k: v for k, v in swapped.items() if k != "seqlens"})
    finally:
        hf_packing.revert_rmpad("qwen2_vl")
