"""Qwen4-Exp: packed and padded batches equal every sample run alone, unpadded, on the unpatched model.

The tiny model has every token mixer of Qwen4-Exp switched on (`hf_packing.testing.tiny._qwen4_exp`): Gated DeltaNet
with PLE (hashed n-grams and a dilated conv), QSA-indexed attention (blocks of 4, budget 8: every sample but one
has more complete blocks than the budget, and one sample of 3 tokens is shorter than one block), MoE, 2
hyper-connection streams, images. The oracle is transformers' own code on each sample alone (its per-query indexer
loop, its PLE with the history restarting at EOS); the patched loss is Σ token CE / Σ supervised tokens, as in
tests/test_qwen3_5.py. Layouts: padded rows (right, left, as a processor pads them), `VisionCollator` rows and flat.
The video conversation is left out: the unpatched indexer's Python loop makes every token of the oracle slow.
"""

from __future__ import annotations

import functools

import pytest
import torch

import hf_packing
from hf_packing import VisionCollator
from hf_packing.ops import ple
from hf_packing.ops.varlen import PackedSequences
from hf_packing.patches import _qwen4_exp, is_applied
from tests.helpers import (
    GRAD_RTOL,
    LOSS_RTOL,
    ROW_KEYS,
    assert_equivalent,
    conversations,
    each_sample_alone,
    load_processor,
    loss_and_grads,
    model_and_processor,
    processed_samples,
)

MODEL_TYPE = "qwen4_exp"
LAYOUTS = ("padded_right", "padded_left", "collator_rows", "collator_flat")
#: keys a processor's padded batch has (the collator's host extras dropped)
PROCESSOR_KEYS = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "pixel_values", "image_grid_thw")

pytestmark = pytest.mark.skipif(
    not hf_packing.patches.FAMILIES[MODEL_TYPE].available(), reason="this transformers has no Qwen4-Exp"
)


def samples(processor) -> list[dict[str, torch.Tensor]]:
    """Four conversations (text, one image, two images, multi-turn) and a 3-token sample (shorter than a block)."""
    rows = processed_samples(processor, conversations(with_video=False))
    short = {k: rows[0][k][:3] for k in ROW_KEYS}
    return rows[:2] + [short] + rows[2:]


@functools.cache
def _oracle() -> tuple[float, dict[str, torch.Tensor]]:
    """Each sample alone on the unpatched model; tests take it before they patch anything."""
    assert not is_applied(MODEL_TYPE), "the oracle runs on the unpatched model"
    model, processor = model_and_processor(MODEL_TYPE)
    return each_sample_alone(model, samples(processor))


def layout_batch(model, layout: str) -> dict:
    """The samples as one batch in ``layout``."""
    processor = load_processor(MODEL_TYPE, "left" if layout == "padded_left" else "right")
    mode = "flat" if layout == "collator_flat" else "rows"
    batch = VisionCollator(processor, mode=mode, model_config=model.config)(samples(processor))
    if layout.startswith("padded"):
        return {k: v for k, v in batch.items() if k in PROCESSOR_KEYS}
    return batch


@pytest.mark.parametrize("layout", LAYOUTS)
def test_patched_equals_each_sample_alone_unpatched(layout):
    oracle, (model, _) = _oracle(), model_and_processor(MODEL_TYPE)
    batch = layout_batch(model, layout)
    if layout == "padded_left":
        assert (batch["attention_mask"][:, 0] == 0).any()
    hf_packing.apply_rmpad(MODEL_TYPE)
    assert_equivalent(oracle, loss_and_grads(model, batch), f"{MODEL_TYPE}/{layout} vs each alone")


def _logits_alone_and_packed(model, processor, packed_batch) -> tuple[list[torch.Tensor], torch.Tensor]:
    model.eval()
    with torch.no_grad():
        alone = [
            model(**{k: (v[None] if k in ROW_KEYS else v) for k, v in s.items() if k != "labels"}).logits[0]
            for s in samples(processor)
        ]
        packed = model(**{k: v for k, v in packed_batch.items() if k != "labels"} | {"use_cache": False}).logits[0]
    model.train()
    return alone, packed


def test_transformers_packed_format_leaks():
    """transformers' own padding-free format (one row, the 4-row position ids restarting per sample, no
    ``cu_seq_lens``) on the unpatched model: the first sample is exact, every later one reads the samples before it
    (GDN state and conv, PLE n-grams and conv), far beyond the tolerance; the gradients too. Patched, the same batch
    equals each sample alone."""
    model, processor = model_and_processor(MODEL_TYPE)
    batch = layout_batch(model, "collator_flat")
    batch = {k: v for k, v in batch.items() if not k.startswith(("cu_seq_lens", "max_length"))}
    alone, packed = _logits_alone_and_packed(model, processor, batch)
    bounds = torch.tensor([0] + [a.shape[0] for a in alone]).cumsum(0).tolist()
    diffs = [
        ((packed[lo:hi] - a).abs().max() / a.abs().max()).item() for a, lo, hi in zip(alone, bounds[:-1], bounds[1:])
    ]
    print(f"{MODEL_TYPE}, unpatched, transformers' packed format: logits max rel diff per sample {diffs}")
    assert diffs[0] < 1e-5 and min(diffs[1:]) > 1e-2
    with pytest.raises(AssertionError):
        assert_equivalent(_oracle(), loss_and_grads(model, batch), f"{MODEL_TYPE}/unpatched packed vs each alone")
    hf_packing.apply_rmpad(MODEL_TYPE)
    assert_equivalent(_oracle(), loss_and_grads(model, batch), f"{MODEL_TYPE}/patched packed vs each alone")


def _merged(seqs: PackedSequences) -> PackedSequences:
    return PackedSequences.from_seqlens([sum(seqs.seqlens)], device=seqs.cu_seqlens.device)


@pytest.mark.parametrize("ignored", ["ple_conv", "ngram_history"])
def test_negative_control_ple_reaching_the_previous_sample(ignored, monkeypatch):
    """The same pack, patched, with the PLE conv window (or the n-gram history) allowed to reach into the previous
    sample (the boundaries merged there only): the gradients differ from each sample alone far beyond the tolerance.
    """
    oracle, (model, _) = _oracle(), model_and_processor(MODEL_TYPE)
    batch = layout_batch(model, "collator_flat")
    hf_packing.apply_rmpad(MODEL_TYPE)
    if ignored == "ple_conv":
        conv = _qwen4_exp.masked_causal_conv1d
        monkeypatch.setattr(
            _qwen4_exp, "masked_causal_conv1d", lambda x, w, b, act, seqs, **kw: conv(x, w, b, act, _merged(seqs), **kw)
        )
    else:
        history = ple.ngram_history
        monkeypatch.setattr(ple, "ngram_history", lambda ids, seqs, **kw: history(ids, _merged(seqs), **kw))
    loss, grads = loss_and_grads(model, batch)
    loss_err = abs(loss - oracle[0]) / abs(oracle[0])
    grad_err = max(((grads[n] - g).norm() / g.norm()).item() for n, g in oracle[1].items())
    print(
        f"{MODEL_TYPE}, {ignored} across samples: loss rel {loss_err:.2e} (tolerance {LOSS_RTOL:.0e}); worst grad "
        f"rel {grad_err:.2e} (tolerance {GRAD_RTOL:.0e})"
    )
    assert grad_err > 100 * GRAD_RTOL


def test_ngram_history_restarts_at_sample_start_and_after_eos():
    """The docstring's picture of `ple.ngram_history`, element by element."""
    eos = 9
    ids = torch.tensor([1, 2, 3, 4, 5, eos, 6])
    history = ple.ngram_history(ids, PackedSequences.from_seqlens([3, 4]), context=2, eos=eos)
    assert history.tolist() == [
        [1, 2, 3, 4, 5, eos, 6],
        [eos, 1, 2, eos, 4, 5, eos],
        [eos, eos, 1, eos, eos, 4, eos],
    ]


def test_ple_pieces_equal_transformers_on_each_sample_alone():
    """The patched n-gram embedding and dilated conv on a pack of random ids (EOS among them) equal transformers'
    modules on each sample alone; a pack shorter than the conv's reach and a 1-token sample included."""
    model, _ = model_and_processor(MODEL_TYPE)
    layer = model.model.language_model.layers[0].ple
    eos = layer.ple_embedding.eos_token_id
    lengths = [1, 5, 17, 2, 30]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 40, (sum(lengths),), generator=generator)
    ids[ids % 7 == 0] = eos
    x = torch.randn(1, sum(lengths), layer.conv1d.in_channels, generator=generator)
    with torch.no_grad():
        alone_emb = torch.cat([layer.ple_embedding(piece[None], None) for piece in ids.split(lengths)], dim=1)
        alone_conv = torch.cat([layer._short_conv(piece, None) for piece in x.split(lengths, dim=1)], dim=1)
        hf_packing.apply_rmpad(MODEL_TYPE)
        seqs = PackedSequences.from_seqlens(lengths)
        packed_emb = layer.ple_embedding(ids[None], seqs)
        packed_conv = layer._short_conv(x, seqs)
    torch.testing.assert_close(packed_emb, alone_emb, rtol=0, atol=0)
    torch.testing.assert_close(packed_conv, alone_conv)


def test_sequence_parallel_is_refused_with_the_reason():
    model, _ = model_and_processor(MODEL_TYPE)
    batch = layout_batch(model, "collator_flat")
    hf_packing.apply_rmpad(MODEL_TYPE, sequence_parallel_size=2)
    with pytest.raises(ValueError, match="QSA indexer selects"):
        model(**batch)


def test_original_indexer_refused_inside_a_packed_forward(monkeypatch):
    """A packed forward whose attention module lost the boundaries reaches transformers' indexer, which raises
    instead of running its per-query loop on one flat row of several samples."""
    model, _ = model_and_processor(MODEL_TYPE)
    batch = layout_batch(model, "collator_flat")
    hf_packing.apply_rmpad(MODEL_TYPE)
    attention = type(model.model.language_model.layers[1].self_attn)
    patched = attention.forward

    def dropping(self, *args, **kwargs):
        kwargs.pop("hf_packing_seqs", None)
        return patched(self, *args, **kwargs | {"attention_mask": torch.ones((), dtype=torch.bool)})

    monkeypatch.setattr(attention, "forward", dropping)
    with pytest.raises(RuntimeError, match="without the pack's boundaries"):
        model(**batch)


def test_apply_and_revert_restore_the_qwen4_exp_classes():
    from transformers.models.qwen4_exp import modeling_qwen4_exp as mod

    assert MODEL_TYPE in hf_packing.supported_model_types()
    names = [
        (_qwen4_exp.DECODER, "forward"),
        (_qwen4_exp.PLE_LAYER, "forward"),
        (_qwen4_exp.PLE_LAYER, "_short_conv"),
        (_qwen4_exp.NGRAM, "forward"),
        (_qwen4_exp.ATTENTION, "forward"),
        (_qwen4_exp.INDEXER, "forward"),
    ]
    before = [getattr(mod, cls).__dict__[attr] for cls, attr in names]
    hf_packing.apply_rmpad(MODEL_TYPE)
    hf_packing.apply_rmpad(MODEL_TYPE)
    assert all(getattr(mod, cls).__dict__[attr] is not b for (cls, attr), b in zip(names, before))
    hf_packing.revert_rmpad()
    assert all(getattr(mod, cls).__dict__[attr] is b for (cls, attr), b in zip(names, before))


def _counted(checkpoint, index: int, calls: list[int]):
    def counted(function, *args, **kwargs):
        calls.append(index)
        return checkpoint(function, *args, **kwargs)

    return counted


def test_patched_decoder_layers_still_checkpoint():
    """Under gradient checkpointing every decoder layer hands its forward to the checkpoint function, patched as
    plain. transformers 5.x checkpoints inside a wrapper around the class's own ``forward``; before the patched
    forward carried that wrapper (`_qwen4_exp.with_checkpointing`) the patched layers ran unchecked, 0 calls
    (found by transformers' own ``test_training_gradient_checkpointing``, tests/test_upstream.py)."""
    model, _ = model_and_processor(MODEL_TYPE)
    batch = layout_batch(model, "padded_right")
    model.train()
    model.gradient_checkpointing_enable()
    layers = model.model.language_model.layers
    counts = []
    for patched in (False, True):
        if patched:
            hf_packing.apply_rmpad(MODEL_TYPE)
        calls: list[int] = []
        for index, layer in enumerate(layers):
            layer._gradient_checkpointing_func = _counted(layer._gradient_checkpointing_func, index, calls)
        model(**batch).loss.backward()
        counts.append(sorted(set(calls)))
    assert counts[0] == counts[1] == list(range(len(layers))), counts
