"""Bad rows against code errors, and how a mix ends: a source that skips more than `max_skipped_fraction` of its rows
stops the run early (every replica at the same row) with its top reasons and a hint each; a few bad rows train with
their count logged; a mix without weights reads every row of every source once, resumably."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from datasets import Dataset
from torch.utils.data import DataLoader

from hf_packing.packing.dataset import pack_dataset
from hf_packing.packing.stats import NoSamplesError, TooManySkipsError
from tests.helpers import image, load_processor, torchrun


def row(i: int, picture: str | None = None, words: int = 3) -> dict:
    question = ("<image>\n" if picture else "") + f"Question {i}?"
    return {
        "image": [picture] if picture else [],
        "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": "word " * words}],
    }


@pytest.fixture(scope="module")
def processor():
    return load_processor("qwen2_vl")


def make(ds, processor, **kw):
    kw = {"max_length": 256, "buffer_size": 16, "disable_progress": True, "length_index": False, **kw}
    return pack_dataset(ds, processor, **kw)


def test_a_source_mostly_missing_its_files_stops_within_its_first_rows_with_the_media_root_hint(processor, tmp_path):
    """The user trial: media_root forgotten. 9 of 10 rows name a file that is not there (relative to the working
    directory): the pass stops at the source's 200th row, on every rank and DataLoader worker alike, naming
    `missing_file`, the resolved path of the first and media_root."""
    rows = [row(i, None if i % 10 == 0 else f"coco/{i}.jpg") for i in range(1000)]
    ds = Dataset.from_list(rows)
    first = str((tmp_path / "coco/1.jpg").resolve())
    for streaming in (False, True):
        data = ds.to_iterable_dataset(num_shards=2) if streaming else ds
        for rank in (0, 1):
            train = make(data, processor, rank=rank, world_size=2, media_root=str(tmp_path))
            with pytest.raises(TooManySkipsError) as err:
                list(DataLoader(train, batch_size=None, num_workers=2 if streaming else 0))
            message = str(err.value)
            assert "the dataset skipped 180 of the 200 rows read so far (90% > max_skipped_fraction" in message
            assert "180 missing_file (first: row 1, image file " + repr(first) in message
            assert f"media_root={str(tmp_path)!r}" in message and "set media_root" in message
    assert isinstance(err.value, NoSamplesError)  # one except clause catches "no usable data" of either kind


def test_in_a_mix_the_budget_is_per_source_and_names_the_source(processor, tmp_path):
    good = Dataset.from_list([row(i) for i in range(300)])
    bad = Dataset.from_list([row(i, "gone.jpg") for i in range(300)])
    train = make({"text": good, "photos": bad}, processor)  # alternating: 200 rows of 'photos' after 400 read
    with pytest.raises(TooManySkipsError, match=r"^source 'photos' skipped 200 of the 200 rows read so far") as err:
        list(train)
    assert "media_root=None" in str(err.value)
    assert train.stats(log=False)  # the counters stay readable after the error
    # 1.0 never stops on the fraction; a source that keeps no row still ends the pass, with its reasons
    with pytest.raises(NoSamplesError, match="source 'photos' yielded 0 of 300 rows: 300 missing_file"):
        list(make({"text": good, "photos": bad}, processor, max_skipped_fraction=1.0))


def test_overlong_rows_name_the_longest_sample_and_max_length(processor):
    """The same with max_length too small (checked at the end of a short pass): the hint names the longest sample."""
    rows = [row(i, words=5 + i) for i in range(26)]
    from hf_packing.preprocess.preprocessor import Preprocessor

    lengths = [Preprocessor(processor).estimate(r).num_tokens for r in rows]
    with pytest.raises(TooManySkipsError) as err:
        list(make(Dataset.from_list(rows), processor, max_length=lengths[1]))
    assert str(err.value).startswith("the dataset skipped 24 of the 26 rows read so far (92% > max_skipped_fraction")
    assert f"the longest has {max(lengths):,} tokens > max_length={lengths[1]}" in str(err.value)
    assert "on_overlong='truncate_text'" in str(err.value)


def test_one_percent_bad_rows_train_and_their_count_is_logged(processor, caplog):
    rows = [row(i, "gone.jpg" if i in (7, 150) else None) for i in range(200)]
    with caplog.at_level(logging.INFO, logger="hf_packing"):
        train = make(Dataset.from_list(rows), processor)
        samples = sorted(s["index"] for pack in train for s in pack)
    assert samples == [i for i in range(200) if i not in (7, 150)]
    assert train.stats(log=False)["skipped"] == {"missing_file": 2}
    logged = [r.getMessage() for r in caplog.records]
    assert any("skipping sample 7 (missing_file)" in m for m in logged)
    assert any("198 samples" in m and "skipped {'missing_file': 2}" in m for m in logged)  # the pass's summary


@pytest.mark.parametrize("streaming", [False, True])
def test_a_mix_without_weights_uses_every_row_of_every_source_once(processor, streaming):
    a = Dataset.from_list([row(i) for i in range(11)])
    b = Dataset.from_list([row(100 + i) for i in range(20)])
    sources = {"a": a, "b": b}
    if streaming:
        sources = {k: v.to_iterable_dataset(num_shards=2) for k, v in sources.items()}
    train = make(sources, processor)
    packs = list(train)
    stats = train.stats(log=False)
    assert stats["per_source"] == {"a": {"rows": 11, "samples": 11}, "b": {"rows": 20, "samples": 20}}
    assert stats["rows_read"] == 31 and sum(len(p) for p in packs) == 31
    # with weights the documented default stops at the first exhausted source; all_exhausted_without_replacement
    # reads every row in the weights' order
    weighted = make(sources, processor, weights=[1, 1])
    list(weighted)
    rows = weighted.stats(log=False)["per_source"]
    assert rows["a"]["rows"] == 11 and rows["b"]["rows"] < 20
    every = make(sources, processor, weights=[1, 1], stopping_strategy="all_exhausted_without_replacement")
    list(every)
    assert every.stats(log=False)["rows_read"] == 31


def test_a_mix_without_weights_resumes_exactly(processor):
    a = Dataset.from_list([row(i, words=3 + i % 7) for i in range(40)])
    b = Dataset.from_list([row(100 + i, words=20 + i % 5) for i in range(25)])
    full = [[s["index"] for s in p] for p in make({"a": a, "b": b}, processor, max_length=128)]
    train = make({"a": a, "b": b}, processor, max_length=128)
    it = iter(train)
    head = [[s["index"] for s in next(it)] for _ in range(3)]
    state = train.state_dict()
    again = make({"a": a, "b": b}, processor, max_length=128)
    again.load_state_dict(state)
    assert head + [[s["index"] for s in p] for p in again] == full
    assert sorted(i for p in full for i in p) == list(range(65))
    old = {**state, "version": 4}
    with pytest.raises(ValueError, match="unsupported pack_dataset state version 4"):
        make({"a": a, "b": b}, processor, max_length=128).load_state_dict(old)


def test_closed_by_counts_every_planned_pack(processor, tmp_path):
    """stats() names the budget that closed each pack; on small images with max_images=2 it is images."""
    image(40, 40).save(tmp_path / "small.png")
    rows = [row(i, "small.png") for i in range(13)]
    train = make(Dataset.from_list(rows), processor, media_root=str(tmp_path), max_images=2, max_length=4096)
    list(train)
    stats = train.stats(log=False)
    assert stats["closed_by"] == {"images": 6, "end": 1} and stats["planned_packs"] == 7  # the last: 1 image
    assert stats["fill"] < 0.1


@pytest.mark.multiproc
def test_two_processes_stop_at_the_same_row(tmp_path):
    """torchrun --nproc_per_node 2 (gloo, 2 DataLoader workers each, an all_reduce per batch): both ranks take the same
    steps, then raise at the same row; the run ends with an error instead of hanging in a collective."""
    proc = torchrun(Path(__file__).parent / "multiproc_skips.py", str(tmp_path / "out"), timeout=180)
    assert proc is not None, "the two ranks hung"
    assert proc.returncode != 0 and "TooManySkipsError" in proc.stderr, proc.stderr[-3000:]
    results = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0]["steps"] == results[1]["steps"] > 0
    for result in results:
        assert "skipped 180 of the 200 rows read so far" in result["error"] and "media_root=None" in result["error"]
