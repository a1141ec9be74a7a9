"""pack_dataset: map-style == streaming, budgets, workers, ranks, resume, errors, mixing, stats; a 2-process run."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from torch.utils.data import DataLoader

from hf_packing.packing.dataset import pack_dataset
from hf_packing.preprocess.errors import SampleError
from hf_packing.preprocess.preprocessor import Preprocessor
from tests.helpers import STREAM_ROWS as ROWS
from tests.helpers import image, image_rows, load_processor, torchrun
from tests.helpers import make_packs as make
from tests.helpers import pack_ids as ids


def test_map_style_and_streaming_give_the_same_packs(data, reference):
    for shards in (1, 4):
        streamed = list(make(data, data["ds"].to_iterable_dataset(num_shards=shards)))
        assert ids(streamed) == reference["ids"]
    for a, b in zip(streamed, reference["packs"], strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x if isinstance(x[k], torch.Tensor))


def test_packs_respect_budgets_and_hold_every_sample_once(data, reference):
    stats = reference["stats"]
    assert stats["skipped"] == {"missing_file": 1, "overlong": 1}
    flat = [i for p in reference["ids"] for i in p]
    assert sorted(flat) == [i for i in range(ROWS) if i not in (5, 9)]
    assert stats["samples"] == len(flat) == stats["rows_read"] - 2 and stats["leftover_packs"] == 0
    tight_train = make(data, max_images=2, max_vision_patches=600, max_skipped_fraction=1.0)  # 23% skipped
    tight = list(tight_train)
    three = sum(len(r["image"]) == 3 for k, r in enumerate(data["ds"]) if k not in (5, 9))
    assert three and tight_train.stats(log=False)["skipped"]["too_many_images"] == three
    assert len(tight) > len(reference["ids"]) - three // 2  # the patch budget splits packs further
    for pack in tight:
        assert sum(s["num_tokens"] for s in pack) <= 512
        assert sum(len(s.get("image_grid_thw", ())) for s in pack) <= 2
        assert sum(int(s["image_grid_thw"].prod(-1).sum()) for s in pack if "image_grid_thw" in s) <= 600
        for s in pack:
            assert s["input_ids"].dtype == torch.long and s["input_ids"].shape == s["labels"].shape
            assert s["num_tokens"] == s["input_ids"].numel() == int(s["attention_mask"].sum())
    assert 0.8 < stats["fill"] <= 1.0 and stats["padded_batch_fill"] < stats["fill"]
    assert stats["complete"] and stats["samples_per_s"] > 0 and stats["images_per_pack"] > 0


@pytest.mark.parametrize("batch_size", [1, 2])
def test_same_batches_whatever_num_workers(data, batch_size):
    def run(workers: int) -> list:
        loader = DataLoader(
            make(data, batch_size=batch_size),
            batch_size=batch_size,
            num_workers=workers,
            collate_fn=lambda packs: ids(packs),
        )
        return list(loader)

    base = run(0)
    assert len(base) > 4 and run(2) == base


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_split_is_equal_disjoint_and_complete(data, reference, world_size):
    ranks = [make(data, rank=r, world_size=world_size) for r in range(world_size)]
    packs = [ids(train) for train in ranks]
    stats = [train.stats(log=False) for train in ranks]
    assert len({len(p) for p in packs}) == 1  # every rank yields the same number of packs
    assert len(packs[0]) == len(reference["ids"]) // world_size
    seen = [i for rank_packs in packs for pack in rank_packs for i in pack]
    assert len(seen) == len(set(seen))  # disjoint
    leftover = {s["leftover_packs"] for s in stats}
    assert leftover == {len(reference["ids"]) % world_size}
    all_samples = {i for p in reference["ids"] for i in p}
    assert len(seen) + stats[0]["leftover_samples"] == len(all_samples) and set(seen) <= all_samples
    # same global plan on every rank: the ranks' packs are the reference packs minus the final incomplete group
    full = len(reference["ids"]) - stats[0]["leftover_packs"]
    assert sorted(map(tuple, (p for rank_packs in packs for p in rank_packs))) == sorted(
        map(tuple, reference["ids"][:full])
    )


@pytest.mark.parametrize("streaming", [False, True])
def test_resume_equals_the_uninterrupted_run(data, reference, streaming):
    ds = data["ds"].to_iterable_dataset(num_shards=3) if streaming else data["ds"]
    n = len(reference["ids"])
    for k in (0, 1, 5, n - 1, n):
        train = make(data, ds)
        it = iter(train)
        head = [next(it) for _ in range(k)]
        state = json.loads(json.dumps(train.state_dict()))  # plain data
        it.close()
        resumed = make(data, ds)
        resumed.load_state_dict(state)
        assert ids(head) + ids(resumed) == reference["ids"], k
        if k == n - 1:
            assert resumed.stats(log=False)["samples"] == reference["stats"]["samples"]


def test_resume_through_stateful_dataloader(data):
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader(train):
        return StatefulDataLoader(train, batch_size=2, num_workers=2, collate_fn=lambda packs: ids(packs))

    full = list(loader(make(data, batch_size=2)))
    first = loader(make(data, batch_size=2))
    it = iter(first)
    head = [next(it) for _ in range(3)]
    state = first.state_dict()
    del it, first
    second = loader(make(data, batch_size=2))
    second.load_state_dict(state)
    assert head + list(second) == full


def test_state_from_other_settings_is_refused(data):
    train = make(data)
    it = iter(train)
    next(it)
    state = train.state_dict()
    it.close()
    with pytest.raises(ValueError, match="max_length"):
        make(data, max_length=1024).load_state_dict(state)
    other = make(data, rank=0, world_size=2)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="world_size"):
        next(iter(other))


@pytest.mark.timeout(120)  # a pass that waited on a failed read instead of raising would hang: fail it instead
def test_errors_reach_the_consumer(data, monkeypatch):
    with pytest.raises(SampleError, match="not found"):  # on_error="raise": the first bad row ends the pass
        list(make(data, on_error="raise"))
    with pytest.raises(ValueError, match="on_overlong='truncate_text'"):  # on_overlong="error" always raises
        list(make(data, on_overlong="error"))
    train = make(data)
    rows = train._source.rows

    def failing(state, epoch):  # the storage fails mid-pass: not a per-row problem, so it must surface
        for n, item in enumerate(rows(state, epoch)):
            if n == 30:
                raise OSError("disk gone")
            yield item

    monkeypatch.setattr(train._source, "rows", failing)
    with pytest.raises(OSError, match="disk gone"):
        list(train)


@pytest.mark.timeout(120)  # the pass ends at the error: a hang fails here instead of reaching the suite's limit
@pytest.mark.parametrize("where", ["planning", "processing", "index"])
def test_an_error_that_is_not_a_bad_row_stops_the_run(data, monkeypatch, where):
    """A processor API break (any exception but a `SampleError`) is no row's fault: it ends the pass instead of being
    counted, while planning, processing or building the length index."""
    name = "process" if where == "processing" else "estimate"
    original = getattr(Preprocessor, name)

    def broken(self, row, index=None, **kwargs):
        if index == 3:
            raise TypeError("apply_chat_template() got an unexpected keyword argument")
        return original(self, row, index, **kwargs)

    monkeypatch.setattr(Preprocessor, name, broken)
    with pytest.raises(TypeError, match="unexpected keyword"):
        list(make(data, length_index="auto" if where == "index" else False))


def test_the_packer_starts_no_thread(data):
    """Reading, planning and pixel work run in the iterator itself (the DataLoader's workers are the asynchrony)."""
    before = set(threading.enumerate())
    it = iter(make(data))
    next(it)
    assert set(threading.enumerate()) <= before
    it.close()


def _pack_ids(pack: list[dict]) -> list[int]:
    return [s["index"] for s in pack]


def _started_by_hf_packing(thread: threading.Thread) -> bool:
    """Whether ``thread`` runs hf_packing code: its target's module, or its class's (other libraries' threads, e.g.
    tqdm's monitor or the DataLoader's queue feeders, come and go on their own schedule)."""
    target = getattr(thread, "_target", None)
    return (getattr(target, "__module__", None) or type(thread).__module__).startswith("hf_packing")


def test_the_thread_check_sees_a_thread_the_package_starts():
    """Negative control of the check below: a thread whose target is hf_packing code is seen, tqdm's monitor is not."""
    from hf_packing.packing import dataset

    ours = threading.Thread(target=dataset.pack_dataset, daemon=True)  # never started: only its target is read
    assert _started_by_hf_packing(ours)
    assert not _started_by_hf_packing(threading.Thread(target=time.sleep, args=(0,)))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iterator_dropped_mid_epoch_leaves_nothing_running(data, num_workers):
    """A DataLoader iterator abandoned after 2 batches (max_steps reached mid-epoch): after `gc.collect()` no thread
    of the package's runs in this process and no worker process is left."""
    import gc
    import multiprocessing

    threads = set(threading.enumerate())
    loader = DataLoader(make(data), batch_size=None, num_workers=num_workers, collate_fn=_pack_ids)
    it = iter(loader)
    next(it), next(it)
    if num_workers:
        workers = list(it._workers)
        assert len(workers) == 2 and all(w.is_alive() for w in workers)
    del it
    gc.collect()
    deadline = time.monotonic() + 30
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t for t in set(threading.enumerate()) - threads if _started_by_hf_packing(t)]
    assert not multiprocessing.active_children()
    if num_workers:
        assert not any(w.is_alive() for w in workers)


def test_a_process_exiting_with_a_live_iterator_exits_cleanly(tmp_path):
    """A script ends while its iterator is still alive, held in a reference cycle (so no refcount drop closes it): the
    packer left no thread of its own running, and the interpreter finalises and exits 0."""
    import subprocess
    import sys

    script = tmp_path / "live.py"
    script.write_text(
        f"""
import sys, threading
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})  # this checkout: hf_packing, tests.helpers
from datasets import Dataset
from tests.helpers import load_processor
from hf_packing.packing import dataset as stream
rows = [{{"messages": [{{"role": "user", "content": "hi " * 20}}, {{"role": "assistant", "content": "ok " * 30}}]}}
        for _ in range(400)]
packs = stream.pack_dataset(Dataset.from_list(rows), load_processor("qwen2_vl"), max_length=256, buffer_size=8,
                            disable_progress=True)
before = set(threading.enumerate())
it = iter(packs)
next(it)
holder = {{"it": it}}
holder["self"] = holder
target = lambda t: getattr(getattr(t, "_target", None), "__module__", None) or type(t).__module__
ours = lambda t: target(t).startswith("hf_packing")
print("threads added:", len([t for t in set(threading.enumerate()) - before if ours(t)]), flush=True)
"""
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert "threads added: 0" in proc.stdout, proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_mixing_keeps_per_source_counts(data, tmp_path):
    other = Dataset.from_list(image_rows(tmp_path, 40, 1, tag="b"))
    for streaming in (False, True):
        sources = {"a": data["ds"], "b": other}
        if streaming:
            sources = {k: v.to_iterable_dataset(num_shards=2) for k, v in sources.items()}
        roots = tmp_path  # both sources' images under one root (copies: a symlink out of the root is refused)
        for name in os.listdir(data["root"]):
            if not (roots / name).exists():
                shutil.copy(data["root"] / name, roots / name)
        train = make(data, sources, weights={"a": 3.0, "b": 1.0}, image_root=str(roots))
        packs = list(train)
        stats = train.stats(log=False)
        per = stats["per_source"]
        assert per["a"]["rows"] + per["b"]["rows"] == stats["rows_read"]
        assert per["a"]["samples"] + per["b"]["samples"] == stats["samples"] == sum(len(p) for p in packs)
        assert 2 < per["a"]["rows"] / per["b"]["rows"] < 5  # ~3:1
        from_b = sum(
            s["input_ids"].numel() > 0 and "banswer" in data["processor"].tokenizer.decode(s["input_ids"])
            for p in packs
            for s in p
        )
        assert from_b == per["b"]["samples"]


def test_len_is_known_only_after_planning(data, reference):
    train = make(data)
    with pytest.raises(TypeError, match="count_packs"):
        len(train)
    assert train.count_packs() == len(reference["ids"]) == len(train)


def test_bad_rows_are_counted_by_reason_and_logged_once(data, tmp_path, caplog):
    root = tmp_path / "root"
    root.mkdir()
    image(40, 40).save(root / "good.png")
    (root / "empty.png").write_bytes(b"")
    good = (root / "good.png").read_bytes()
    (root / "cut.png").write_bytes(good[: len(good) // 2])
    (tmp_path / "secret.png").write_bytes(good)
    refs = ["good.png", "missing.png", "missing2.png", "empty.png", "cut.png", "../secret.png", "good.png"]
    rows = [
        {
            "image": [r],
            "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "A thing."}],
        }
        for r in refs
    ]
    rows.append(
        {
            "image": ["good.png"],
            "conversations": [{"from": "human", "value": "No placeholder"}, {"from": "gpt", "value": "x"}],
        }
    )
    rows.append({"image": [], "conversations": [{"from": "human", "value": "Only a question"}]})
    with caplog.at_level(logging.WARNING, logger="hf_packing"):
        train = make(data, Dataset.from_list(rows), image_root=str(root), max_skipped_fraction=1.0)
        packs = list(train)
    assert sorted(i for p in ids(packs) for i in p) == [0, 6]
    assert train.stats(log=False)["skipped"] == {
        "missing_file": 2,
        "empty_image": 1,
        "corrupt_image": 1,
        "path_outside_root": 1,
        "placeholder_mismatch": 1,
        "no_assistant_turn": 1,
    }
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 6 and any("sample 1 (missing_file)" in m for m in logged)


def test_a_pack_whose_samples_all_fail_to_decode_is_replaced_by_a_filler(data, tmp_path):
    import struct
    import zlib

    image(40, 30).save(tmp_path / "ok.png")
    raw = (tmp_path / "ok.png").read_bytes()
    out, pos = [raw[:8]], 8
    while pos < len(raw):  # flip the compressed pixel bytes, keep valid CRCs: header and end marker are fine
        (n,) = struct.unpack(">I", raw[pos : pos + 4])
        kind, body = raw[pos + 4 : pos + 8], raw[pos + 8 : pos + 8 + n]
        body = bytes(b ^ 0x5A for b in body) if kind == b"IDAT" else body
        out.append(struct.pack(">I", n) + kind + body + struct.pack(">I", zlib.crc32(kind + body)))
        pos += 12 + n
    (tmp_path / "bad.png").write_bytes(b"".join(out))
    row = {
        "image": ["bad.png"],
        "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "x"}],
    }
    train = make(data, Dataset.from_list([row]), image_root=str(tmp_path))
    (pack,) = list(train)
    assert len(pack) == 1 and pack[0]["num_tokens"] == 1 and (pack[0]["labels"] == -100).all()
    stats = train.stats(log=False)
    assert stats["skipped"] == stats["skipped_while_processing"] == {"corrupt_image": 1, "empty_pack": 1}
    assert stats["skipped_while_planning"] == {}


@pytest.mark.multiproc
def test_two_processes_with_uneven_shards(tmp_path):
    """torchrun --nproc_per_node 2 (gloo): equal pack counts, disjoint samples, totals add up; an all_reduce per
    pack would hang (and time out) if the ranks disagreed."""
    out = tmp_path / "out"
    proc = torchrun(Path(__file__).parent / "multiproc_stream.py", str(tmp_path), str(out))
    assert proc is not None, "the two ranks hung"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    a, b = (r["packs"] for r in results)
    assert len(a) == len(b) > 0
    assert {i for p in a for i in p}.isdisjoint({i for p in b for i in p})
    stats = results[0]["stats"]
    assert results[0]["shards"] == [5, 17, 44]
    assert stats["rows_read"] == 66 and stats["skipped"] == results[1]["stats"]["skipped"]
    assert stats["skipped"] == {"corrupt_image": 1, "overlong": 1}
    yielded = sum(len(p) for p in a + b)
    assert yielded + stats["leftover_samples"] + sum(stats["skipped"].values()) == stats["rows_read"]
    assert results[0]["all_reduce_steps"] == results[1]["all_reduce_steps"] == len(a)


def test_precomputed_metadata_columns_plan_the_same_packs(data, reference):
    pre = Preprocessor(data["processor"], image_root=str(data["root"]))
    with_meta = data["ds"].map(pre.metadata_columns, with_indices=True)
    assert with_meta[5]["hfp_skip"] == "missing_file" and with_meta[9]["hfp_num_tokens"] > 512
    train = make(data, with_meta)
    assert train._source.lazy and ids(train) == reference["ids"]
    assert train.stats(log=False)["skipped"] == reference["stats"]["skipped"]
    assert ids(make(data, with_meta.to_iterable_dataset(num_shards=2))) == reference["ids"]
    stale = with_meta.map(lambda row, k: {"hfp_num_tokens": row["hfp_num_tokens"] + (k == 0)}, with_indices=True)
    train = make(data, stale)
    assert 0 not in {i for p in ids(train) for i in p}  # a stale length is caught when the sample is processed
    assert train.stats(log=False)["skipped_while_processing"] == {"length_mismatch": 1}


@pytest.mark.parametrize("streaming", [False, True])
def test_messages_jsonl_with_mixed_part_keys(tmp_path, streaming):
    """datasets types content parts with differing keys as `Json`; raw Arrow reads give JSON strings to decode."""
    from datasets import load_dataset

    image(84, 56).save(tmp_path / "a.png")
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "A box."}]},
        ],
        "images": ["a.png"],
    }
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(row) for _ in range(3)))
    ds = load_dataset("json", data_files=str(tmp_path / "d.jsonl"), split="train", streaming=streaming)
    packs = list(
        pack_dataset(
            ds,
            load_processor("qwen2_5_vl"),
            max_length=512,
            image_root=tmp_path,
            on_error="raise",
            disable_progress=True,
        )
    )
    assert [len(p) for p in packs] == [3]
    assert all(int((s["input_ids"] == 151655).sum()) == 0 for p in packs for s in p)  # tiny vocab ids only
    assert all(s["image_grid_thw"].shape == (1, 3) for p in packs for s in p)


# ------------------------------------------------------------------------------------------------ real-data formats
def _llava(question: str, answer: str, **media) -> dict:  # every key in every row: from_list reads the first's
    return {
        "image": None,
        "video": None,
        **media,
        "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}],
    }


def _messages(question: str, answer: str, images: list[str]) -> dict:
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    return {
        "messages": [
            {"role": "user", "content": parts},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ],
        "images": images,
    }


def test_video_rows_are_skipped_never_trained_as_text(data, tmp_path):
    image(56, 56).save(tmp_path / "a.png")
    (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not a video")
    rows = [
        _llava("<image>\nWhat is this?", "A square.", image="a.png"),
        _llava("Hello?", "Hi."),
        _llava("<video>\nWhat happens?", "Rain.", video="missing.mp4"),
        _llava("<video>\nWhat happens?", "Rain.", video="clip.mp4"),
    ]
    train = make(data, Dataset.from_list(rows), image_root=str(tmp_path), max_skipped_fraction=1.0)  # 2 of 4
    assert ids(train) == [[0, 1]]
    assert train.stats(log=False)["skipped"] == {"missing_file": 1, "corrupt_video": 1}


@pytest.mark.parametrize("streaming", [False, True])
def test_a_mix_of_row_formats_keeps_both_sources(data, tmp_path, streaming):
    (tmp_path / "coco").mkdir()
    (tmp_path / "web").mkdir()
    image(56, 84).save(tmp_path / "coco" / "a.png")
    image(84, 56).save(tmp_path / "web" / "b.png")
    llava = Dataset.from_list([_llava("<image>\nWhat is this?", f"llava {k}", image="a.png") for k in range(6)])
    hf = Dataset.from_list([_messages("What is this?", f"messages {k}", ["b.png"]) for k in range(6)])
    sources = {"llava": llava, "messages": hf}
    if streaming:
        sources = {k: v.to_iterable_dataset(num_shards=2) for k, v in sources.items()}
    roots = {"llava": str(tmp_path / "coco"), "messages": str(tmp_path / "web")}  # each source its own media root
    train = make(data, sources, image_root=None, media_root=roots, stopping_strategy="all_exhausted")  # alternate
    samples = [s for p in train for s in p]
    stats = train.stats(log=False)
    assert stats["skipped"] == {}
    assert {n: v["samples"] for n, v in stats["per_source"].items()} == {"llava": 6, "messages": 6}
    text = data["processor"].tokenizer.decode
    assert sorted(
        text(s["input_ids"]).split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0] for s in samples
    ) == sorted([f"llava {k}" for k in range(6)] + [f"messages {k}" for k in range(6)])
    # the same conversation gives the same tokens in either format
    rows = (_llava("<image>\nWhat is this?", "x", image="a.png"), _messages("What is this?", "x", ["a.png"]))
    one = [list(make(data, Dataset.from_list([r]), image_root=str(tmp_path / "coco")))[0][0]["input_ids"] for r in rows]
    assert torch.equal(*one)


def test_a_stream_that_yields_nothing_is_an_error(data, tmp_path):
    from hf_packing.packing.stats import NoSamplesError

    (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    videos = Dataset.from_list(
        [_llava("<video>\nWhat happens?", "Rain.", video="clip.mp4")] * 3
        + [_llava("<video>\nAnd here?", "Sun.", video="gone.mp4")]
    )
    with pytest.raises(NoSamplesError, match=r"^the dataset yielded 0 of 4 rows: 3 corrupt_video, 1 missing_file"):
        list(make(data, videos, image_root=str(tmp_path)))
    with pytest.raises(NoSamplesError, match="yielded 0 of 4 rows"):
        make(data, videos, image_root=str(tmp_path)).count_packs()
    texts = Dataset.from_list([_llava("Hello?", "Hi.")] * 4)
    mix = make(
        data,
        {"text": texts, "videos": videos},
        image_root=None,
        media_root={"videos": str(tmp_path)},
        stopping_strategy="all_exhausted",
    )
    with pytest.raises(NoSamplesError, match=r"source 'videos' yielded 0 of 4 rows: 3 corrupt_video, 1 missing"):
        list(DataLoader(mix, batch_size=None, num_workers=1))  # raised in the worker, re-raised here
    with pytest.raises(NoSamplesError, match="1 pack planned, none for any of world_size=2 ranks"):
        list(make(data, texts, rank=1, world_size=2))


@pytest.mark.parametrize("batch_size", [1, 2])
def test_resume_with_ranks_and_a_balance_window(data, batch_size):
    """Two ranks, packs scheduled two steps at a time: a resumed rank continues with exactly its remaining packs, and
    both ranks get as many packs."""
    kw = {"world_size": 2, "batch_size": batch_size, "balance_window": 2}
    full = [ids(make(data, rank=r, **kw)) for r in range(2)]
    assert len(full[0]) == len(full[1]) > 3
    for rank in range(2):
        for k in (1, 3, len(full[rank]) - 1):
            train = make(data, rank=rank, **kw)
            it = iter(train)
            head = [next(it) for _ in range(k)]
            state = json.loads(json.dumps(train.state_dict()))
            it.close()
            resumed = make(data, rank=rank, **kw)
            resumed.load_state_dict(state)
            assert ids(head) + ids(resumed) == full[rank], (rank, k)
