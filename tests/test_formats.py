"""Row formats: LLaVA/Qwen `<image>` / `<video>` tags, per-source formats and roots, video files, frames with fps."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from hf_packing.collator import RopeIndex
from hf_packing.preprocess.errors import SampleError
from hf_packing.preprocess.formats import Conversation, normalize_row
from hf_packing.preprocess.preprocessor import Preprocessor
from hf_packing.testing.tiny import tiny_config
from tests.helpers import FIXTURES, image, load_processor


def turns(question: str, answer: str = "A dog.") -> list[dict]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


def frames(root, n: int = 4, width: int = 84, height: int = 56) -> list[str]:
    for k in range(n):
        image(width, height, k).save(root / f"frame{k}.png")
    return [f"frame{k}.png" for k in range(n)]


@pytest.fixture(scope="module")
def processor():
    return load_processor("qwen2_5_vl")


# ------------------------------------------------------------------------------------------------- normalising
def test_llava_video_tags_are_video_parts_never_text():
    row = {"video": "clip.mp4", "conversations": turns("<video>\nWhat happens?<image>", "It rains.")}
    conv = normalize_row({**row, "image": "a.png"})
    assert conv.messages == [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}, {"type": "image"}]},
        {"role": "assistant", "content": "It rains."},  # a turn without tags stays as written
    ]
    assert (conv.images, conv.videos) == (["a.png"], ["clip.mp4"])
    # `videos` holds one entry per video: a file, or a video's pre-sampled frames as a nested list
    two = {"videos": ["a.mp4", ["f0.png", "f1.png"]], "conversations": turns("<video><video>Both?")}
    assert normalize_row(two).videos == ["a.mp4", ["f0.png", "f1.png"]]


def test_a_row_is_normalised_by_its_sources_format_not_by_its_columns():
    # what interleave_datasets makes of a LLaVA row mixed with a messages source: every column, None where absent
    llava = {
        "messages": None,
        "images": None,
        "videos": None,
        "image": "a.png",
        "video": None,
        "conversations": turns("<image>\nWhat is this?"),
    }
    hf = {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
            {"role": "assistant", "content": "A dog."},
        ],
        "images": ["a.png"],
        "videos": None,
        "image": None,
        "video": None,
        "conversations": None,
    }
    expected = Conversation(
        [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
            {"role": "assistant", "content": "A dog."},
        ],
        ["a.png"],
        [],
    )
    for row, fmt in ((llava, "llava"), (hf, "messages")):
        assert normalize_row(row) == expected  # auto: the column that holds a value, never a None column
        assert normalize_row(row, row_format=fmt) == expected
    with pytest.raises(SampleError) as err:  # a source declared LLaVA never reads the messages column
        normalize_row({**hf, "conversations": None}, row_format="llava")
    assert err.value.reason == "empty_conversation"


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"conversations": turns("<video>\nWhat happens?")}, "placeholder_mismatch"),  # a tag and no video
        ({"video": "clip.mp4", "conversations": turns("What happens?")}, "placeholder_mismatch"),  # a video, no tag
        ({"video": "clip.mp4", "conversations": turns("<video><video>Twice?")}, "placeholder_mismatch"),  # more tags
        ({"image": "a.png", "images": ["b.png"], "conversations": turns("<image>?")}, "bad_row"),  # which one?
    ],
)
def test_tags_and_media_must_agree(row, reason):
    with pytest.raises(SampleError) as err:
        normalize_row(row)
    assert err.value.reason == reason


# ------------------------------------------------------------------------------------------------- videos
def test_bad_video_references_are_skipped_with_their_reason(processor, tmp_path):
    pytest.importorskip("av")  # the 'video' extra: a file is opened to be refused
    (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not a video")
    names = frames(tmp_path, 2)
    pre = Preprocessor(processor, media_root=tmp_path)
    cases = [
        ({"video": "missing.mp4", "conversations": turns("<video>\nWhat happens?")}, "missing_file"),
        ({"video": "clip.mp4", "conversations": turns("<video>\nWhat happens?")}, "corrupt_video"),
        ({"videos": [42], "conversations": turns("<video>\nWhat happens?")}, "unsupported_video"),
        ({"videos": [[names[0], "gone.png"]], "conversations": turns("<video>\nWhat happens?")}, "missing_file"),
        ({"video": "../clip.mp4", "conversations": turns("<video>?")}, "path_outside_root"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "video", "video": "clip.mp4"}]},
                    {"role": "assistant", "content": "Rain."},
                ]
            },
            "corrupt_video",
        ),
    ]
    for row, reason in cases:
        with pytest.raises(SampleError) as err:
            pre.estimate(row, 3)
        assert err.value.reason == reason, row
    ok = {"videos": [names], "conversations": turns("<video>\nWhat happens?")}
    assert pre.estimate(ok).num_tokens == pre.process(ok)["num_tokens"]


def test_video_frames_resolve_under_the_video_root(processor, tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "vid").mkdir()
    image(56, 56).save(tmp_path / "img" / "a.png")
    names = frames(tmp_path / "vid", 2)
    row = {"image": "a.png", "videos": [names], "conversations": turns("<image><video>\nSame?")}
    sample = Preprocessor(processor, media_root=tmp_path / "img", video_root=tmp_path / "vid").process(row)
    assert sample["video_grid_thw"].tolist() == [[1, 4, 6]] and sample["image_grid_thw"].tolist() == [[1, 4, 4]]
    with pytest.raises(SampleError) as err:
        Preprocessor(processor, media_root=tmp_path / "img").estimate(row)
    assert err.value.reason == "missing_file"


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_frames_fps_gives_the_processors_temporal_positions(family, tmp_path):
    """Frames taken 2 s apart (fps 0.5): Qwen2.5-VL's second_per_grid_ts and Qwen3-VL's timestamps, hence the M-RoPE
    positions, equal those of the processor given the same rate; without the rate both assume 24 fps."""
    proc, rope = load_processor(family), RopeIndex(tiny_config(family))
    names = frames(tmp_path, 4)
    row = {"videos": [names], "fps": 0.5, "conversations": turns("<video>\nWhat happens?", "It rains.")}
    pre = Preprocessor(proc, image_root=tmp_path)
    text = proc.apply_chat_template(normalize_row(row).messages, tokenize=False)
    clip = np.stack([np.asarray(Image.open(tmp_path / n).convert("RGB")) for n in names])

    def positions(sample):
        return rope(sample, sample["input_ids"].reshape(-1), sample["mm_token_type_ids"].reshape(-1))

    def direct(fps):
        kwargs = {"do_sample_frames": False}
        if fps is not None:
            kwargs["video_metadata"] = [{"total_num_frames": 4, "fps": fps, "frames_indices": [0, 1, 2, 3]}]
        out = proc(text=[text], videos=[clip], return_tensors="pt", videos_kwargs=kwargs)
        return {**out, "input_ids": out["input_ids"][0], "mm_token_type_ids": out["mm_token_type_ids"][0]}

    with_fps = pre.process(row, planned_tokens=pre.estimate(row).num_tokens)
    assert torch.equal(with_fps["input_ids"], direct(0.5)["input_ids"])
    assert torch.equal(positions(with_fps), positions(direct(0.5)))
    for per_source in (Preprocessor(proc, media_root=tmp_path, fps=0.5), pre):  # a source's fps; a row's own wins
        sample = per_source.process({**row, "fps": None} if per_source is not pre else {**row, "fps": [0.5]})
        assert torch.equal(positions(sample), positions(with_fps))
    without = pre.process({**row, "fps": None})
    assert torch.equal(positions(without), positions(direct(None)))  # the negative control: 24 fps
    if family == "qwen2_5_vl":  # time is in the temporal position: 2 / 0.5 s per grid step, 2 positions per second
        assert with_fps["second_per_grid_ts"].tolist() == [4.0] and without["second_per_grid_ts"].tolist() != [4.0]
        assert torch.equal(with_fps["input_ids"], without["input_ids"])
        assert not torch.equal(positions(with_fps), positions(without))
    else:  # time is in the frames' timestamp text, which the positions then follow
        assert "<1.0 seconds>" in proc.tokenizer.decode(with_fps["input_ids"])  # frames 0 and 1: (0 s + 2 s) / 2
        assert "<1.0 seconds>" not in proc.tokenizer.decode(without["input_ids"])


def test_a_bad_fps_is_a_bad_row(processor, tmp_path):
    names = frames(tmp_path, 2)
    pre = Preprocessor(processor, media_root=tmp_path)
    for fps in (0, -1, "fast", [1.0, 2.0]):
        with pytest.raises(SampleError) as err:
            pre.estimate({"videos": [names], "fps": fps, "conversations": turns("<video>?")})
        assert err.value.reason == "bad_row", fps


# ------------------------------------------------------------------------------------------------- hf-packing stats
def test_stats_cli_counts_video_rows_as_skips(tmp_path, capsys):
    from hf_packing.cli import main

    pytest.importorskip("av")
    image(56, 56).save(tmp_path / "a.png")
    (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    rows = [
        {"image": "a.png", "conversations": turns("<image>\nWhat is this?")},
        {"conversations": turns("Hello?", "Hi.")},
        {"video": "missing.mp4", "conversations": turns("<video>\nWhat happens?")},
        {"video": "clip.mp4", "conversations": turns("<video>\nWhat happens?")},
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert (
        main(
            [
                "stats",
                str(tmp_path / "d.jsonl"),
                "--processor",
                str(FIXTURES / "qwen2_5_vl"),
                "--max-length",
                "256",
                "--strategy",
                "bfd",
                "--image-root",
                str(tmp_path),
                "--output",
                str(tmp_path / "h.png"),
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert table.startswith("4 rows, max_length=256")
    (line,) = [x for x in table.splitlines() if x.startswith("bfd")]
    assert line.split()[2] == "1"  # the two usable rows fit one pack
    assert line.endswith("missing_file: 1, corrupt_video: 1")
    assert table.splitlines()[-2].startswith("videos: 0 in usable rows, 0 video tokens")


def test_frames_without_fps_warn_once_through_transformers_logger(caplog):
    """transformers' ``logger.warning_once`` (not a home-made flag): the first row of frames without an fps warns,
    the next ones do not; a row with an fps never does."""
    import logging

    import transformers.utils.logging  # noqa: F401  (it adds Logger.warning_once)

    from hf_packing.preprocess.formats import row_fps

    logging.Logger.warning_once.cache_clear()  # earlier tests may have warned in this process
    with caplog.at_level(logging.WARNING, logger="hf_packing.preprocess.formats"):
        assert row_fps({"fps": 2}, 1) == [2.0]
        assert not caplog.records
        for _ in range(3):
            assert row_fps({}, 1) == [None]
    assert [r.getMessage()[:28] for r in caplog.records] == ["video frames without fps: th"]
