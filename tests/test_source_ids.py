"""Per-source ids: tagged by `pack_dataset`, collated into ``source_ids``, summed per source inside the chunked loss.

The loss's per-source sums are compared with a dense reference (full logits, per-token cross-entropy grouped by
source); the negative control shuffles the ids.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_packing import VisionCollator, pack_dataset
from hf_packing.ops.loss import linear_cross_entropy_sum, token_sources
from hf_packing.packing.source_ids import SourceTagger, per_source_metrics
from tests.helpers import load_processor


# ------------------------------------------------------------------------------------------ tagging
def _rows(tasks: list[str]):
    from datasets import Dataset

    def turns(i: int) -> list[dict]:
        return [{"from": "human", "value": f"Question {i}?"}, {"from": "gpt", "value": "An answer. " * (i % 3 + 1)}]

    return Dataset.from_list([{"conversations": turns(i), "task": t} for i, t in enumerate(tasks)])


def test_tagger_names_from_a_mix_a_column_and_a_class_label():
    from datasets import ClassLabel

    assert SourceTagger({"chart": None, "caption": None}).names == ["chart", "caption"]
    assert not SourceTagger(_rows(["x"]))  # one dataset, no column: untagged
    tagger = SourceTagger(_rows(["ocr", "chart", "ocr"]), "task")
    assert tagger.names == ["chart", "ocr"] and tagger(None, {"task": "ocr"}) == 1
    labelled = _rows(["ocr", "chart"]).cast_column("task", ClassLabel(names=["ocr", "chart"]))
    tagger = SourceTagger(labelled.to_iterable_dataset(), "task")
    assert tagger.names == ["ocr", "chart"] and tagger(None, {"task": 1}) == 1


def test_tagger_errors_name_the_setting():
    with pytest.raises(ValueError, match="source_column='nope' is not a column"):
        SourceTagger(_rows(["a"]), "nope")
    with pytest.raises(ValueError, match="needs a ClassLabel column"):
        SourceTagger(_rows(["a"]).to_iterable_dataset(), "task")
    with pytest.raises(ValueError, match="pass source_column=None"):
        SourceTagger({"a": _rows(["a"])}, "task")


def test_pack_dataset_tags_every_sample_with_its_source():
    """A mix: each sample's id is its dataset's key; ``source_column``: its row's value; the rank without a last
    pack gets a filler of source 0 (no targets)."""
    processor = load_processor("qwen2_5_vl")
    tasks = ["ocr", "chart", "chart", "ocr", "chart", "ocr"]
    by_column = pack_dataset(_rows(tasks), processor, max_length=4096, source_column="task", disable_progress=True)
    assert by_column.source_names == ["chart", "ocr"]
    got = sorted((int(s["index"]), s["source_id"]) for pack in by_column for s in pack)
    assert got == [(i, ["chart", "ocr"].index(t)) for i, t in enumerate(tasks)]

    mix = {"text": _rows(["-"] * 3), "more": _rows(["-"] * 3)}
    kwargs = dict(max_length=64, world_size=2, leftovers="spread", disable_progress=True)
    ranks = [list(pack_dataset(mix, processor, rank=r, **kwargs)) for r in (0, 1)]
    samples = [s for packs in ranks for pack in packs for s in pack]
    real = [s for s in samples if s["index"] >= 0]
    print([[[(s["index"], s["source_id"]) for s in pack] for pack in packs] for packs in ranks])
    assert sorted(s["source_id"] for s in real) == [0, 0, 0, 1, 1, 1]
    assert len(real) < len(samples)  # a filler was needed
    assert all(s["source_id"] == 0 and (s["labels"] == -100).all() for s in samples if s["index"] < 0)
    untagged = next(iter(pack_dataset(_rows(["-"]), processor, max_length=4096, disable_progress=True)))
    assert "source_id" not in untagged[0]


# ------------------------------------------------------------------------------------------ collation
A = {"input_ids": [1, 2, 3], "labels": [1, 2, 3], "source_id": 1}
B = {"input_ids": [4, 5, 6, 7, 8], "labels": [-100, -100, 6, 7, 8], "source_id": 0}
C = {"input_ids": [9], "labels": [9], "source_id": 1}


@pytest.mark.parametrize("mode", ["rows", "flat"])
def test_collator_gives_one_source_id_per_sequence(mode):
    from hf_packing.testing.tiny import tiny_config

    collate = VisionCollator(pad_token_id=0, mode=mode, model_config=tiny_config("qwen2_vl"))
    batch = collate([[A, B], [C]])
    assert batch["source_ids"].tolist() == [1, 0, 1] and batch["source_ids"].dtype == torch.long
    untagged = [{k: v for k, v in s.items() if k != "source_id"} for s in (A, B)]
    assert "source_ids" not in collate([untagged])
    with pytest.raises(ValueError, match="1 of 2 samples carry no 'source_id'"):
        collate([[A, untagged[1]]])


# ------------------------------------------------------------------------------------------ the loss
def test_token_sources_follow_the_boundaries():
    cu = torch.tensor([0, 3, 8, 9], dtype=torch.int32)
    assert token_sources(torch.tensor([1, 0, 1]), cu, 2, 9).tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 1]
    with pytest.raises(ValueError, match="2 sources for 3 sequences"):
        token_sources(torch.tensor([1, 0]), cu, 2, 9)


def _dense_per_source(hidden, head, targets, sources, k) -> torch.Tensor:
    logits = head(hidden).float()
    keep = targets != -100
    ce = F.cross_entropy(logits[keep], targets[keep], reduction="none")
    hit = (logits[keep].argmax(-1) == targets[keep]).float()
    rows = torch.stack([ce, torch.ones_like(ce), hit])
    return torch.zeros(3, k, dtype=torch.float32).index_add_(1, sources[keep], rows)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "checkpointed"])
def test_per_source_sums_equal_the_dense_reference(grad):
    """3 chunks of 4 rows; with gradients each chunk is recomputed in backward and must be counted once."""
    torch.manual_seed(0)
    t, k = 12, 3
    hidden = torch.randn(t, 8, requires_grad=grad)
    head = torch.nn.Linear(8, 5, bias=False)
    targets = torch.randint(0, 5, (t,))
    targets[[0, 5, 11]] = -100
    sources = torch.tensor([0, 0, 0, 2, 2, 2, 2, 0, 0, 1, 1, 1])
    with torch.set_grad_enabled(grad):
        ce = linear_cross_entropy_sum(
            hidden, head, targets, chunk_size=4, use_liger=False, sources=sources, num_sources=k
        )
        if grad:
            ce.loss_sum.backward()
    expected = _dense_per_source(hidden.detach(), head, targets, sources, k)
    print(ce.per_source, expected, sep="\n")
    assert torch.allclose(ce.per_source, expected, rtol=1e-6, atol=1e-5)
    assert ce.per_source[1].sum().item() == ce.num_supervised == 9
    assert torch.allclose(ce.per_source[0].sum(), ce.loss_sum.detach(), rtol=1e-6)
    shuffled = _dense_per_source(hidden.detach(), head, targets, sources[torch.randperm(t)], k)
    assert not torch.allclose(ce.per_source, shuffled, rtol=1e-3)  # negative control: ids matter
    plain = linear_cross_entropy_sum(hidden.detach(), head, targets, chunk_size=4, use_liger=False)
    assert plain.per_source is None and torch.allclose(plain.loss_sum, ce.loss_sum.detach(), rtol=1e-6)


def test_per_source_metrics_skip_sources_without_tokens():
    sums = [6.0, 0.0, 3.0, 0.0, 2.0, 0.0]  # Σ CE, n, correct for sources a, b
    got = per_source_metrics(["a", "b"], sums, loss_key="loss/{}", accuracy_key="token_accuracy/{}", count_key="n/{}")
    assert got == {"n/a": 3.0, "loss/a": 2.0, "token_accuracy/a": 2.0 / 3.0, "n/b": 0.0}
