"""Video files: tokens planned from the header equal the processed tokens, the planned frames are the decoded ones,
time reaches the positions, bad clips are counted skips, and a pack with a real file trains patched like unpatched.

Clips are encoded here with PyAV (mpeg4 / H.264 in mp4, VP9 in webm, VP8 in mkv); nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from hf_packing.preprocess import video as video_module
from hf_packing.preprocess.errors import SampleError
from hf_packing.preprocess.preprocessor import Preprocessor
from tests.helpers import FIXTURES, image, load_processor, write_clip

av = pytest.importorskip("av", reason="the 'video' extra (PyAV) decodes video files")

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
CLIPS = {  # name: (frames, width, height, fps, codec)
    "mpeg4.mp4": (24, 80, 64, 8, None),
    "h264.mp4": (30, 64, 48, 10, "libx264"),  # B-frames: decode order differs from display order
    "vp9.webm": (17, 80, 64, 10, None),  # no frame count in the header: duration · fps
    "vp8.mkv": (13, 48, 80, 6, None),  # portrait
    "long.mp4": (90, 64, 64, 30, None),
}
SETTINGS = (
    None,  # the processor's own rate (Qwen3-VL: 2 fps), else 2 fps (Qwen2/2.5-VL)
    {"fps": 1.0},
    {"fps": 4.0},
    {"num_frames": 6},
    {"max_frames": 4},
    {"max_pixels": 4096},
    {"min_pixels": 40000},
    {"fps": 8.0, "max_frames": 8, "max_pixels": 8192},
    {"do_sample_frames": False},
)


def turns(question: str = "<video>\nWhat happens?", answer: str = "It rains.") -> list[dict]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


def messages_row(ref) -> dict:
    content = [{"type": "video", "video": ref}, {"type": "text", "text": "What happens?"}]
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "It rains."}]}


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    root = tmp_path_factory.mktemp("clips")
    for name, (frames, width, height, fps, codec) in CLIPS.items():
        write_clip(root / name, frames, width, height, fps, codec=codec)
    return root


@pytest.fixture(scope="module")
def processors():
    return {family: load_processor(family) for family in (*FAMILIES, "qwen2_vl")}


def video_tokens(pre: Preprocessor, sample: dict) -> int:
    return int((sample["input_ids"] == pre.video_id).sum())


# ------------------------------------------------------------------------------------------------ estimate == processed
@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_from_the_header_equal_the_processed_tokens(processors, clips, family):
    """For every clip and setting, path (LLaVA row) and bytes (inline messages part): the estimate's tokens, video
    tokens and patches equal the processed sample's. Negative control: each setting changes some clip's count, so
    an estimate that ignored it would fail."""
    counts: dict[tuple, int] = {}
    for s, kwargs in enumerate(SETTINGS):
        pre = Preprocessor(processors[family], media_root=clips, videos_kwargs=kwargs)
        for c, name in enumerate(CLIPS):
            rows = [{"video": name, "conversations": turns()}]
            if (s + c) % 3 == 0:  # a third of the cases also as bytes, in the messages format
                rows.append(messages_row((clips / name).read_bytes()))
            for row in rows:
                meta = pre.estimate(row)
                sample = pre.process(row, planned_tokens=meta.num_tokens)
                grid = sample["video_grid_thw"]
                assert meta.num_tokens == sample["num_tokens"] == sample["input_ids"].numel()
                assert meta.video_tokens == video_tokens(pre, sample) == int(grid.prod(-1).sum()) // 4
                assert meta.vision_patches == int(grid.prod(-1).sum()) and meta.num_videos == 1
            counts[s, name] = meta.num_tokens
    print(f"{family}: {len(CLIPS)} clips x {len(SETTINGS)} settings, estimate == processed")
    for s in range(1, len(SETTINGS)):
        assert any(counts[s, n] != counts[0, n] for n in CLIPS), SETTINGS[s]


def test_settings_follow_the_processors_rules(processors, clips):
    """Qwen2.5-VL rounds sampled frames to temporal pairs; a clip of 24 frames at 8 fps sampled at 2 fps is 6 frames,
    3 temporal steps; `max_frames` caps it; `max_pixels` shrinks each frame to the 28 px grid."""
    pre = Preprocessor(processors["qwen2_5_vl"], media_root=clips)
    info = pre.videos.info("mpeg4.mp4")
    assert (info.frames, info.fps, info.duration, info.height, info.width) == (24, 8.0, 3.0, 64, 80)
    assert pre.sampling.indices(info) == [0, 4, 8, 12, 16, 20]
    capped = Preprocessor(processors["qwen2_5_vl"], media_root=clips, videos_kwargs={"max_frames": 4})
    assert capped.sampling.indices(info) == [0, 6, 12, 18]
    small = Preprocessor(processors["qwen2_5_vl"], media_root=clips, videos_kwargs={"max_pixels": 4096})
    row = {"video": "mpeg4.mp4", "conversations": turns()}
    assert pre.process(row)["video_grid_thw"].tolist() == [[3, 4, 6]]  # 56 x 84: the 28 px rule
    assert small.process(row)["video_grid_thw"].tolist() == [[3, 4, 4]]  # 56 x 56 <= 4096 px
    webm = pre.videos.info("vp9.webm")  # no count in a webm header: round(duration · fps)
    assert (webm.frames, webm.fps) == (17, 10.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_per_frame_pixel_cap_is_counted(clips, family):
    """`cap_pixels_per_frame=True` (qwen-vl-utils' bound, transformers' coming default) shrinks frames by how many there
    are; Qwen2-VL's patch helper leaves it out, so the estimate applies it. Negative control: uncapped counts differ."""
    counts = {}
    for cap in (True, False):
        proc = load_processor(family)
        proc.video_processor.cap_pixels_per_frame, proc.video_processor.max_video_tokens = cap, 2
        pre = Preprocessor(proc, media_root=clips, videos_kwargs={"do_sample_frames": False, "min_pixels": 1024})
        for name in ("mpeg4.mp4", "long.mp4"):
            row = {"video": name, "conversations": turns()}
            meta = pre.estimate(row)
            sample = pre.process(row, planned_tokens=meta.num_tokens)
            assert meta.num_tokens == sample["num_tokens"] and meta.vision_patches == sample["video_grid_thw"].prod()
            counts[cap, name] = meta.num_tokens
    print(family, counts)
    assert any(counts[True, n] != counts[False, n] for n in ("mpeg4.mp4", "long.mp4"))


@pytest.mark.parametrize(
    "kwargs",
    [{"fps": 1, "num_frames": 4}, {"frames": 4}, {"fps": 0}, {"max_frames": 2.5}, {"do_sample_frames": "no"}],
)
def test_bad_videos_kwargs_are_refused(processors, kwargs):
    with pytest.raises(ValueError, match="videos_kwargs"):
        Preprocessor(processors["qwen2_5_vl"], videos_kwargs=kwargs)


# ------------------------------------------------------------------------------------------------ decoded frames
@pytest.mark.parametrize("name", ["levels.mp4", "levels.webm"])
def test_decoding_takes_exactly_the_planned_frames(processors, tmp_path, name):
    """Frame k is a grey of level 10·k: each decoded frame is the planned index's (not a neighbour's, 10 levels away).
    The webm's count is derived from duration · fps, the mp4's read from its header; both are the true count."""
    write_clip(tmp_path / name, 23, 64, 48, 10, levels=True)
    pre = Preprocessor(processors["qwen3_vl"], media_root=tmp_path, videos_kwargs={"fps": 3.0})
    info = pre.videos.info(name)
    indices = pre.sampling.indices(info)
    assert info.frames == 23 and len(indices) == 6 and indices[-1] == 22
    frames = pre.videos.load(name, info, indices)
    levels = frames.reshape(len(indices), -1).mean(1)
    print(f"{name}: indices {indices}, decoded levels {np.round(levels, 1).tolist()}")
    assert np.abs(levels - 10 * np.array(indices)).max() < 5  # lossy, but half-way to a neighbour's level
    assert frames.shape == (6, 48, 64, 3) and frames.dtype == np.uint8


def test_a_header_that_overstates_the_frames_is_filled_or_refused(tmp_path):
    """The stream ends 1 frame before a (made-up) header count: the planned last frame repeats the last real one,
    so the processed count still equals the planned one; 10 frames short is a truncated file."""
    write_clip(tmp_path / "a.mp4", 12, 48, 32, 6, levels=True)
    loader = video_module.VideoLoader(video_root=tmp_path)
    info = loader.info("a.mp4")
    longer = dataclasses.replace(info, frames=13)
    frames = video_module._decode_pyav(tmp_path / "a.mp4", [0, 6, 12], longer)
    assert np.abs(frames.reshape(3, -1).mean(1) - [0, 60, 110]).max() < 5  # frame 12 = frame 11 repeated
    with pytest.raises(SampleError) as err:
        video_module._decode_pyav(tmp_path / "a.mp4", [0, 21], dataclasses.replace(info, frames=22))
    assert err.value.reason == "corrupt_video"


# ------------------------------------------------------------------------------------------------ time
@pytest.mark.parametrize("family", FAMILIES)
def test_the_files_frame_rate_reaches_the_temporal_positions(processors, clips, family):
    """24 frames at 8 fps sampled at 2 fps: Qwen2.5-VL takes frames 0, 4, ..., 20 and its second_per_grid_ts is
    2 / 2 fps = 1 s; Qwen3-VL takes linspace(0, 23, 6) and its timestamps are their times (index / 8 fps, averaged
    per temporal pair). Negative control: the same frames without the file's metadata get transformers' 24 fps."""
    proc = processors[family]
    pre = Preprocessor(proc, media_root=clips, videos_kwargs={"fps": 2.0})
    row = {"video": "mpeg4.mp4", "conversations": turns()}
    sample = pre.process(row)
    prep = pre._prepare(row, None)
    frames = pre.videos.load(prep.videos[0].ref, prep.videos[0].info, prep.videos[0].indices)
    blind = proc(text=[prep.text], videos=[frames], return_tensors="pt", videos_kwargs={"do_sample_frames": False})
    if family == "qwen2_5_vl":
        assert prep.videos[0].indices == [0, 4, 8, 12, 16, 20]
        assert sample["second_per_grid_ts"].tolist() == [1.0]
        assert blind["second_per_grid_ts"].tolist() != [1.0]
    else:
        text = proc.tokenizer.decode(sample["input_ids"])
        assert prep.videos[0].indices == [0, 5, 9, 14, 18, 23]
        times = [(a / 8 + b / 8) / 2 for a, b in ((0, 5), (9, 14), (18, 23))]
        assert all(f"<{t:.1f} seconds>" in text for t in times), text
        assert proc.tokenizer.decode(blind["input_ids"][0]) != text


# ------------------------------------------------------------------------------------------------ bad clips
@pytest.mark.timeout(120)  # a truncated file must end, never block
def test_bad_clips_are_skipped_with_their_reason(processors, tmp_path):
    write_clip(tmp_path / "ok.mp4", 20, 48, 32, 10)
    write_clip(tmp_path / "fast.mp4", 40, 48, 32, 10, options={"movflags": "+faststart"})  # header first
    write_clip(tmp_path / "ok.webm", 30, 48, 32, 10)
    write_clip(tmp_path / "one.mp4", 1, 48, 32, 10)
    (tmp_path / "garbage.mp4").write_bytes(np.random.default_rng(0).bytes(5000))
    (tmp_path / "empty.mp4").write_bytes(b"")
    for name in ("ok.mp4", "fast.mp4", "ok.webm"):
        data = (tmp_path / name).read_bytes()
        (tmp_path / f"cut_{name}").write_bytes(data[: len(data) // 2])
    planning = {  # refused from the header, while planning
        "garbage.mp4": "corrupt_video",
        "empty.mp4": "empty_video",
        "cut_ok.mp4": "corrupt_video",  # the index (moov) was at the end: gone
        "one.mp4": "empty_video",  # fewer frames than one temporal patch
        "missing.mp4": "missing_file",
        "../ok.mp4": "path_outside_root",
    }
    processing = {"cut_fast.mp4": "corrupt_video", "cut_ok.webm": "corrupt_video"}  # the header is intact
    for family in FAMILIES:
        pre = Preprocessor(processors[family], media_root=tmp_path, videos_kwargs={"fps": 10.0})
        for name, reason in planning.items():
            for ref in (name, (tmp_path / name).read_bytes() if (tmp_path / name).is_file() else None):
                if ref is None or (isinstance(ref, bytes) and name.startswith("..")):
                    continue
                with pytest.raises(SampleError) as err:
                    pre.estimate({"video": ref, "conversations": turns()})
                assert err.value.reason == reason, (family, name)
        for name, reason in processing.items():
            row = {"video": name, "conversations": turns()}
            pre.estimate(row)
            with pytest.raises(SampleError) as err:
                pre.process(row)
            assert err.value.reason == reason, (family, name)
    tight = Preprocessor(processors["qwen2_5_vl"], media_root=tmp_path, max_image_pixels=48 * 32 - 1)
    with pytest.raises(SampleError) as err:
        tight.estimate({"video": "ok.mp4", "conversations": turns()})
    assert err.value.reason == "video_too_large"


def test_a_missing_decoder_is_an_error_naming_the_extra(processors, clips, monkeypatch):
    monkeypatch.setattr(video_module._compat, "pyav", lambda: None)
    monkeypatch.setattr(video_module._compat, "torchcodec_decoder", lambda: None)
    pre = Preprocessor(processors["qwen2_5_vl"], media_root=clips)
    with pytest.raises(ImportError, match=r"pip install 'hf_packing\[video\]'"):
        pre.estimate({"video": "mpeg4.mp4", "conversations": turns()})
    frames = {"videos": [np.zeros((4, 28, 28, 3), np.uint8)], "fps": 2.0, "conversations": turns()}
    assert pre.estimate(frames).num_videos == 1  # pre-sampled frames need no decoder


# ------------------------------------------------------------------------------------------------ stream + stats
def test_pack_dataset_counts_videos_and_skips(processors, clips, tmp_path):
    from datasets import Dataset

    from hf_packing.packing.dataset import pack_dataset

    data = (clips / "vp9.webm").read_bytes()
    (tmp_path / "cut.webm").write_bytes(data[: len(data) // 2])
    (tmp_path / "bad.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not a video")
    for name in ("mpeg4.mp4", "vp8.mkv"):
        (tmp_path / name).write_bytes((clips / name).read_bytes())
    rows = [
        {"video": "mpeg4.mp4", "conversations": turns()},
        {"video": "vp8.mkv", "conversations": turns("<video>\nAnd here?", "Sun.")},
        {"video": "bad.mp4", "conversations": turns()},  # refused while planning
        {"video": "cut.webm", "conversations": turns()},  # refused while processing
        {"video": None, "conversations": turns("Hello?", "Hi.")},
    ]
    proc = processors["qwen3_vl"]
    kwargs = {"fps": 4.0, "max_frames": 6}
    settings = {"max_length": 4096, "media_root": str(tmp_path), "videos_kwargs": kwargs}
    settings["max_skipped_fraction"] = 1.0  # 1 of 5 rows is skipped on purpose
    train = pack_dataset(Dataset.from_list(rows), proc, **settings)
    samples = [s for pack in train for s in pack]
    stats = train.stats(log=False)
    pre = Preprocessor(proc, media_root=tmp_path, videos_kwargs=kwargs)
    expected = [pre.estimate(rows[i]) for i in (0, 1)]
    assert sorted(s["index"] for s in samples) == [0, 1, 4]
    assert stats["skipped"] == {"corrupt_video": 2}
    assert stats["skipped_while_processing"] == {"corrupt_video": 1}
    assert stats["videos"] == 2 and stats["video_tokens"] == sum(m.video_tokens for m in expected) > 0
    # the length index (built by default) holds the videos' counts; planning without it gives the same samples
    from hf_packing.packing.length_index import build_length_index
    from hf_packing.preprocess.preprocessor import META_COLUMNS

    index = build_length_index(Dataset.from_list(rows), pre, progress=False)
    assert index["hfp_num_videos"] == [1, 1, 0, 1, 0] and index["hfp_skip"][2] == "corrupt_video"
    assert [pre.planned_meta(dict(zip(META_COLUMNS, r)), i) for i, r in enumerate(zip(*index[:2].values()))] == expected
    unindexed = pack_dataset(Dataset.from_list(rows), proc, **settings, length_index=False)
    assert [s["index"] for pack in unindexed for s in pack] == [s["index"] for s in samples]
    assert unindexed.stats(log=False)["video_tokens"] == stats["video_tokens"]
    # per source: each source samples with its own videos_kwargs
    mix = pack_dataset(
        {"a": Dataset.from_list(rows[:1]), "b": Dataset.from_list(rows[:1])},
        proc,
        max_length=4096,
        media_root=str(tmp_path),
        videos_kwargs={"a": {"num_frames": 4}, "b": {"num_frames": 8}},
        stopping_strategy="all_exhausted",
    )
    grids = sorted(s["video_grid_thw"][0, 0].item() for pack in mix for s in pack)
    assert grids == [2, 4]


def test_stats_cli_reports_videos_and_their_tokens(processors, clips, tmp_path, capsys):
    from hf_packing.cli import main

    image(56, 56).save(tmp_path / "a.png")
    for name in ("mpeg4.mp4", "vp9.webm"):
        (tmp_path / name).write_bytes((clips / name).read_bytes())
    rows = [
        {"image": "a.png", "video": None, "conversations": turns("<image>\nWhat is this?")},
        {"image": None, "video": "mpeg4.mp4", "conversations": turns()},
        {"image": None, "video": "vp9.webm", "conversations": turns()},
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    kwargs = {"fps": 4.0}
    args = ["stats", str(tmp_path / "d.jsonl"), "--processor", str(FIXTURES / "qwen2_5_vl"), "--max-length", "4096"]
    args += ["--strategy", "bfd", "--media-root", str(tmp_path), "--output", str(tmp_path / "h.png")]
    assert main([*args, "--videos-kwargs", json.dumps(kwargs)]) == 0
    pre = Preprocessor(processors["qwen2_5_vl"], media_root=tmp_path, videos_kwargs=kwargs)
    tokens = sum(pre.estimate(r).video_tokens for r in rows[1:])
    line = capsys.readouterr().out.splitlines()[-2]
    assert line.startswith(f"videos: 2 in usable rows, {tokens:,} video tokens"), line


# ------------------------------------------------------------------------------------------------ training
def test_a_pack_with_a_video_file_trains_patched_like_unpatched(clips, tmp_path):
    """pack_dataset → VisionCollator → the tiny Qwen2.5-VL: the patched forward's loss and gradients equal the
    unpatched one's on a pack holding a real video file, an image and text. Negative control: the video's time
    (second_per_grid_ts at transformers' 24 fps default instead of the file's) changes the loss."""
    from datasets import Dataset

    import hf_packing
    from hf_packing.collator import VisionCollator
    from hf_packing.packing.dataset import pack_dataset
    from tests.helpers import assert_equivalent, loss_and_grads, model_and_processor

    model, proc = model_and_processor("qwen2_5_vl")
    image(84, 56).save(tmp_path / "a.png")
    (tmp_path / "clip.mp4").write_bytes((clips / "mpeg4.mp4").read_bytes())
    rows = [
        {"image": None, "video": "clip.mp4", "conversations": turns("<video>\nWhat happens?", "A walk on the beach.")},
        {"image": "a.png", "video": None, "conversations": turns("<image>\nDescribe the image.", "A red car.")},
        {"image": None, "video": None, "conversations": turns("Hi", "Hello, how can I help?")},
    ]
    packs = list(pack_dataset(Dataset.from_list(rows), proc, max_length=1024, media_root=str(tmp_path)))
    assert [len(p) for p in packs] == [3] and packs[0][0]["second_per_grid_ts"].tolist() == [1.0]
    collate = VisionCollator(proc, model_config=model.config)  # M-RoPE positions per sample, from the video's time
    batch = collate(packs)
    ref = loss_and_grads(model, batch)
    at_24_fps = [[{**packs[0][0], "second_per_grid_ts": torch.tensor([2 / 24])}, *packs[0][1:]]]
    assert not math.isclose(loss_and_grads(model, collate(at_24_fps))[0], ref[0], rel_tol=1e-6)
    hf_packing.apply_rmpad("qwen2_5_vl")
    assert_equivalent(ref, loss_and_grads(model, batch), "qwen2_5_vl pack with a video file")


# ------------------------------------------------------------------------------------------------ torchcodec
def test_torchcodec_matches_pyav_and_transformers_own_decoding(processors, clips, monkeypatch):
    """Where torchcodec loads its FFmpeg: it plans the same frames as PyAV, and our samples equal transformers' own
    path given the file (its torchcodec reader and sampler): tokens, Qwen3-VL timestamps included, and pixels."""
    if video_module._compat.torchcodec_decoder() is None:
        pytest.skip("torchcodec is not installed or cannot load a system FFmpeg (libavcodec)")
    for family in FAMILIES:
        proc = processors[family]
        for name in CLIPS:
            for kwargs in ({"fps": 2.0}, {"num_frames": 4}):
                row = {"video": name, "conversations": turns()}
                got = {}
                for backend in ("pyav", "torchcodec"):
                    monkeypatch.setattr(video_module, "BACKEND", backend)
                    pre = Preprocessor(proc, media_root=clips, videos_kwargs=kwargs)
                    got[backend] = (pre.videos.info(name), pre.process(row))
                assert got["pyav"][0] == got["torchcodec"][0], name
                sample = got["torchcodec"][1]
                assert torch.equal(got["pyav"][1]["input_ids"], sample["input_ids"])
                if name.endswith(".mp4"):  # transformers' reader reads the header's count, absent in webm/mkv
                    native = {"do_sample_frames": True, "fps": None, **kwargs}
                    prep = pre._prepare(row, None)
                    out = proc(text=[prep.text], videos=[str(clips / name)], return_tensors="pt", videos_kwargs=native)
                    assert torch.equal(out["input_ids"][0], sample["input_ids"]), (family, name, kwargs)
                    assert torch.equal(out["pixel_values_videos"], sample["pixel_values_videos"])
