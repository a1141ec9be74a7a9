"""The length index: built once, reused from the `datasets` cache, keyed by every setting that changes a row's
metadata; with it no replica (rank × DataLoader worker) estimates a row, and the packs are the same as without."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from hf_packing.packing.length_index import build_length_index, index_key
from hf_packing.packing.replica import preprocessors
from hf_packing.preprocess.preprocessor import META_COLUMNS, Preprocessor
from tests.helpers import STREAM_ROWS as ROWS
from tests.helpers import make_packs as make
from tests.helpers import pack_ids as ids


@pytest.fixture
def estimates(monkeypatch, tmp_path):
    """Counts `Preprocessor.estimate` calls in this process and in forked DataLoader workers (one byte per call)."""
    log = tmp_path / "estimates.log"
    log.touch()
    estimate = Preprocessor.estimate

    def counted(self, row, index=None):
        with open(log, "ab") as fh:
            fh.write(b".")
        return estimate(self, row, index)

    monkeypatch.setattr(Preprocessor, "estimate", counted)

    def count(reset: bool = True) -> int:
        n = log.stat().st_size
        if reset:
            log.write_bytes(b"")
        return n

    return count


@pytest.fixture
def on_disk(data, tmp_path):
    """The test rows as a dataset with cache files (as `load_dataset` / `load_from_disk` give)."""
    from datasets import load_from_disk

    data["ds"].save_to_disk(str(tmp_path / "ds"))
    return load_from_disk(str(tmp_path / "ds"))


def _rank_packs(data, ds, rank: int, **kw) -> list[list[int]]:
    loader = DataLoader(make(data, ds, rank=rank, world_size=2, **kw), batch_size=None, num_workers=2)
    return ids(loader)


def test_indexed_planning_estimates_no_row_in_any_replica(data, on_disk, estimates):
    trains = [make(data, on_disk, rank=r, world_size=2, length_index=True) for r in range(2)]
    assert estimates() == ROWS  # built once, by the first; the second read the cache file
    assert all(t._source.lazy for t in trains)
    folder = Path(on_disk.cache_files[0]["filename"]).parent
    (cached,) = [f for f in os.listdir(folder) if f.startswith("cache-") and f.endswith(".arrow")]
    assert index_key(on_disk, preprocessors(trains[0].cfg, data["processor"], [])[None]) in cached
    indexed = [_rank_packs(data, on_disk, r, length_index=True) for r in range(2)]
    assert estimates() == 0  # 2 ranks x 2 workers planned every row from the columns
    plain = [_rank_packs(data, on_disk, r, length_index=False) for r in range(2)]
    assert estimates() == 2 * 2 * ROWS  # negative control: every replica estimates every row
    assert indexed == plain and len(indexed[0]) == len(indexed[1]) > 0


def test_same_packs_and_skips_with_and_without_the_index(data, reference, estimates):
    plain = make(data, length_index=False)
    assert not plain._source.lazy and ids(plain) == reference["ids"]
    assert plain.stats(log=False)["skipped"] == reference["stats"]["skipped"] == {"missing_file": 1, "overlong": 1}
    estimates()
    indexed = make(data)  # "auto": a dataset held in memory gets an in-memory index
    assert estimates() == ROWS and indexed._source.lazy
    assert ids(indexed) == reference["ids"] and estimates() == 0
    assert indexed.stats(log=False)["skipped"] == reference["stats"]["skipped"]
    streamed = make(data, data["ds"].to_iterable_dataset(num_shards=2))
    assert ids(streamed) == reference["ids"] and estimates() == ROWS  # a stream estimates as it reads


def test_the_index_is_rebuilt_when_a_setting_changes(data, on_disk, estimates, tmp_path):
    pre = Preprocessor(data["processor"], max_length=512, media_root=data["root"])
    key = index_key(on_disk, pre)
    same = Preprocessor(data["processor"], max_length=512, media_root=str(data["root"]))
    assert index_key(on_disk, same) == key
    others = [
        Preprocessor(data["processor"], max_length=1024, media_root=data["root"]),
        Preprocessor(data["processor"], max_length=512, media_root=data["root"], on_overlong="truncate_text"),
        Preprocessor(data["processor"], max_length=512, media_root=data["root"], train_on="all"),
        Preprocessor(data["processor"], max_length=512, media_root=tmp_path),
        Preprocessor(data["processor"], max_length=512, media_root=data["root"], fps=2.0),
        Preprocessor(data["processor"], max_length=512, media_root=data["root"], max_image_pixels=10_000),
    ]
    assert len({key} | {index_key(on_disk, p) for p in others}) == 1 + len(others)
    assert index_key(on_disk.select(range(10)), pre) != key  # another dataset
    import copy

    templated = copy.deepcopy(data["processor"])
    templated.chat_template = templated.chat_template.replace("<|im_start|>", "<|im_start|> ")
    assert index_key(on_disk, Preprocessor(templated, max_length=512, media_root=data["root"])) != key
    resized = copy.deepcopy(data["processor"])
    resized.image_processor.size = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 64}
    assert index_key(on_disk, Preprocessor(resized, max_length=512, media_root=data["root"])) != key

    first = build_length_index(on_disk, pre, cache_dir=tmp_path / "index", progress=False)
    assert estimates() == ROWS and first.column_names == list(META_COLUMNS)
    again = build_length_index(on_disk, pre, cache_dir=tmp_path / "index", progress=False)
    assert estimates() == 0 and again["hfp_num_tokens"] == first["hfp_num_tokens"]
    build_length_index(on_disk, others[0], cache_dir=tmp_path / "index", progress=False)
    assert estimates() == ROWS  # max_length changed: rebuilt, into a second file
    assert sorted(os.listdir(tmp_path / "index")) == sorted(
        f"hf_packing-index-{index_key(on_disk, p)}.arrow" for p in (pre, others[0])
    )
    assert first[9]["hfp_skip"] == "overlong" and first[5]["hfp_skip"] == "missing_file"
    assert "not found" in first[5]["hfp_skip_message"]


def test_index_with_two_processes_equals_one(data, on_disk, tmp_path):
    pre = Preprocessor(data["processor"], max_length=512, media_root=data["root"])
    one = build_length_index(on_disk, pre, cache_dir=tmp_path / "a", num_proc=1, progress=False)
    two = build_length_index(on_disk, pre, cache_dir=tmp_path / "b", num_proc=2, progress=False)
    assert one.to_dict() == two.to_dict()
