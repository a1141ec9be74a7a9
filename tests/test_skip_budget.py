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


# ------------------------------------------------------------------------------------------ hints that name the fix
def only_error(ds, processor, **kw) -> str:
    """The end-of-pass `NoSamplesError` of a source whose rows are all skipped (never the skip budget's error)."""
    with pytest.raises(NoSamplesError) as err:
        list(make(ds, processor, max_skipped_fraction=1.0, **kw))
    assert type(err.value) is NoSamplesError
    return str(err.value)


def test_images_all_over_max_length_end_with_the_max_length_hint_and_the_real_numbers(processor, tmp_path):
    """The user trial: every image is larger than max_length. The error names max_length and on_overlong with the
    longest sample's tokens as the processor counts them (the oracle: the processor on the file), never media_root or
    the row format; with truncate_text (which never cuts an image) it names max_length alone."""
    sizes = [(448, 448), (560, 448), (448, 336)]
    for i, size in enumerate(sizes):
        image(*size, seed=i).save(tmp_path / f"{i}.png")
    rows = [row(i, f"{i}.png") for i in range(len(sizes))]
    longest = 0
    for i, r in enumerate(rows):
        turns = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Question {i}?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": r["conversations"][1]["value"]}]},
        ]
        text = processor.apply_chat_template(turns)
        longest = max(longest, len(processor(text=[text], images=[image(*sizes[i], seed=i)]).input_ids[0]))
    message = only_error(Dataset.from_list(rows), processor, max_length=128, media_root=str(tmp_path))
    assert message.startswith("the dataset yielded 0 of 3 rows: 3 overlong")
    assert f"the longest has {longest:,} tokens > max_length=128: raise max_length or set on_overlong=" in message
    assert "media_root" not in message and "row_format" not in message
    cut = only_error(
        Dataset.from_list(rows), processor, max_length=128, media_root=str(tmp_path), on_overlong="truncate_text"
    )
    assert (
        "3 overlong_vision" in cut
        and "do not fit max_length=128 (truncate_text never cuts an image): raise max_length" in cut
    )
    assert "media_root" not in cut


def test_an_overlong_skip_without_a_count_prints_no_placeholder_number(processor):
    """truncate_text where the first max_length tokens hold no answer: "overlong" without a token count. The hint
    says what to change without a number it does not have ("the longest has ? tokens" before)."""
    rows = [
        {"messages": [{"role": "user", "content": "Question " * 60}, {"role": "assistant", "content": f"{i} words"}]}
        for i in range(3)
    ]
    message = only_error(Dataset.from_list(rows), processor, max_length=40, on_overlong="truncate_text")
    assert "3 overlong" in message and "nothing supervised within the first max_length=40 tokens" in message
    assert "no supervised token lies within the first max_length=40 tokens: raise max_length" in message
    assert "? tokens" not in message and "truncate_text'" not in message.split("first max_length=40 tokens;")[1]
    # the skip budget's error words it the same way
    with pytest.raises(TooManySkipsError) as err:
        list(make(Dataset.from_list(rows * 70), processor, max_length=40, on_overlong="truncate_text"))
    assert "? tokens" not in str(err.value) and "no supervised token lies within" in str(err.value)


def test_missing_media_ends_with_the_media_root_hint(processor, tmp_path):
    message = only_error(Dataset.from_list([row(i, f"coco/{i}.jpg") for i in range(3)]), processor)
    assert message.startswith("the dataset yielded 0 of 3 rows: 3 missing_file. missing_file (first: row 0, image file")
    assert "set media_root" in message and "max_length" not in message


def test_a_tag_media_mismatch_ends_with_the_row_format_hint(processor, tmp_path):
    image(56, 56).save(tmp_path / "a.png")
    rows = [{**row(i, "a.png"), "image": ["a.png", "a.png"]} for i in range(3)]  # two images, one <image> tag
    message = only_error(Dataset.from_list(rows), processor, media_root=str(tmp_path))
    assert "3 placeholder_mismatch" in message and "1 image / 0 video tags but 2 images / 0 videos" in message
    assert "each image/video needs exactly one tag in the text" in message and "row_format='llava'" in message
    assert "media_root" not in message


def test_a_video_given_as_a_flat_list_of_frames_is_told_to_nest_them(tmp_path):
    """A video's frames given flat (`videos: [f0, f1, f2, f3]`, as one would list images) is a skip whose reason
    says to nest them, whether the frames outnumber the video tags or one frame stands for the video; nested, the same
    row packs with nothing skipped (the positive control)."""
    processor = load_processor("qwen2_5_vl")
    frames = [f"f{i}.png" for i in range(4)]
    for i, name in enumerate(frames):
        image(64, 48, seed=i).save(tmp_path / name)

    def video_row(videos):
        turns = [
            {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "It rains."}]},
        ]
        return {"messages": turns, "videos": videos, "fps": 2.0}

    kw = {"media_root": str(tmp_path), "max_length": 1024}
    for videos, reason in ((frames, "placeholder_mismatch"), (frames[:1], "bad_row")):
        message = only_error(Dataset.from_list([video_row(videos)] * 2), processor, **kw)
        assert f"2 {reason}" in message and "a video's frames go in a nested list" in message, message
    nested = make(Dataset.from_list([video_row([frames])] * 2), processor, **kw)
    assert sum(len(pack) for pack in nested) == 2 and nested.stats(log=False)["skipped"] == {}
