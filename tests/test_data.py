"""Preprocessing: row formats, labels, lengths from metadata, truncation, and every bad-input case on real files."""

from __future__ import annotations

import io
import logging
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from hf_packing.preprocess.errors import SampleError, SkipCounter
from hf_packing.preprocess.formats import normalize_row
from hf_packing.preprocess.images import to_rgb
from hf_packing.preprocess.preprocessor import Preprocessor
from tests.helpers import image, load_processor, video

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


@pytest.fixture(scope="module")
def processors():
    return {family: load_processor(family) for family in FAMILIES}


def save(img: Image.Image, path, fmt: str = "PNG", **kw) -> str:
    img.save(path, fmt, **kw)
    return str(path)


def llava(images, question: str = "<image>\nWhat is this?", answer: str = "A dog.") -> dict:
    return {"image": images, "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}


def messages(n_images: int = 1, question: str = "What is this?", answer: str = "A dog.") -> list[dict]:
    parts = [{"type": "image"}] * n_images + [{"type": "text", "text": question}]
    return [{"role": "user", "content": parts}, {"role": "assistant", "content": [{"type": "text", "text": answer}]}]


def same(a: dict, b: dict) -> bool:
    assert a.keys() == b.keys()
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


# ------------------------------------------------------------------------------------------------------- formats
def test_llava_and_hf_messages_give_identical_samples(processors, tmp_path):
    paths = [save(image(90, 60, 1), tmp_path / "a.png"), save(image(40, 120, 2), tmp_path / "b.jpg", "JPEG")]
    hf = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "image"},
                    {"type": "text", "text": "Compare"},
                    {"type": "image"},
                    {"type": "text", "text": "them."},
                ],
            },
            {"role": "assistant", "content": "The first is wider."},
            {"role": "user", "content": [{"type": "text", "text": "Colours?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Both noisy."}]},
        ],
        "images": ["a.png", "b.jpg"],
    }
    lv = {
        "image": ["a.png", "b.jpg"],
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "<image>\nCompare<image>\nthem."},
            {"from": "gpt", "value": "The first is wider."},
            {"from": "human", "value": "Colours?"},
            {"from": "gpt", "value": "Both noisy."},
        ],
    }
    for family in FAMILIES:  # the formats spell turns differently; the template renders them the same
        render = processors[family].apply_chat_template
        assert render(normalize_row(hf).messages) == render(normalize_row(lv).messages)
        pre = Preprocessor(processors[family], image_root=tmp_path)
        a, b = pre.process(hf, 7), pre.process(lv, 7)
        assert same(a, b)
        # bytes, {"bytes", "path"} (HF Image(decode=False)), an absolute path and a PIL image: all the same sample
        raw = [Path(p).read_bytes() for p in paths]
        for refs in (raw, [{"bytes": r, "path": None} for r in raw], paths, [Image.open(p) for p in paths]):
            assert same(pre.process({**hf, "images": refs}, 7), a)


def test_inline_image_parts_are_collected_in_order(tmp_path):
    save(image(30, 30), tmp_path / "x.png")
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": "x.png"}, {"type": "text", "text": "?"}]},
            {"role": "assistant", "content": "ok"},
        ]
    }
    assert normalize_row(row).images == ["x.png"]


# ------------------------------------------------------------------------------------------------------- labels
def test_labels_supervise_exactly_the_assistant_turns(processors):
    processor = processors["qwen2_vl"]
    tok = processor.tokenizer
    row = {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Ciao"},
        ]
    }
    pieces = [
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Hello!<|im_end|>", 1),
        ("\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Ciao<|im_end|>", 1),
        ("\n", 0),
    ]
    ids = [tok(text, add_special_tokens=False)["input_ids"] for text, _ in pieces]
    expected_mask = [flag for (_, flag), piece in zip(pieces, ids, strict=True) for _ in piece]
    sample = Preprocessor(processor).process(row, 0)
    assert sample["input_ids"].tolist() == [i for piece in ids for i in piece]
    assert ((sample["labels"] != -100).long()).tolist() == expected_mask
    assert torch.equal(
        sample["labels"][sample["labels"] != -100], sample["input_ids"][torch.tensor(expected_mask) == 1]
    )
    assert tok.decode(sample["labels"][sample["labels"] != -100]) == "Hello!<|im_end|>Ciao<|im_end|>"
    everything = Preprocessor(processor, train_on="all").process(row, 0)
    assert torch.equal(everything["labels"], everything["input_ids"])
    with pytest.raises(SampleError) as err:
        Preprocessor(processor).process({"messages": row["messages"][:1]}, 0)
    assert err.value.reason == "no_assistant_turn"
    assert Preprocessor(processor, train_on="all").process({"messages": row["messages"][:1]}, 0)["num_tokens"] > 0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_vision_tokens_are_never_supervised(processors, family, train_on):
    processor = processors[family]
    vision = torch.tensor([processor.tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS])
    turns = [
        {"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "And?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "See"}, {"type": "image"}]},
    ]
    row = {"messages": turns, "images": [image(60, 40, 1), image(40, 70, 2)], "videos": [video(frames=4)]}
    sample = Preprocessor(processor, train_on=train_on).process(row, 0)
    labels, ids = sample["labels"], sample["input_ids"]
    assert (labels[sample["mm_token_type_ids"] != 0] == -100).all()
    assert (labels[torch.isin(ids, vision)] == -100).all()
    assert (labels != -100).any()
    if train_on == "all" and family != "qwen3_vl":  # qwen3 video timestamps are text inside the vision span
        assert torch.equal(labels != -100, ~torch.isin(ids, vision))


# ------------------------------------------------------------------------------------------------------- lengths
SIZES = [
    (1, 1),
    (27, 29),
    (28, 28),
    (56, 56),
    (448, 448),
    (512, 512),
    (1000, 10),
    (10, 1000),
    (333, 777),
    (1920, 1080),
    (64, 4000),
    (4000, 4000),
    (17, 3000),
]


@pytest.mark.parametrize("family", FAMILIES)
def test_estimate_equals_processed_length(processors, family, tmp_path):
    pre = Preprocessor(processors[family], image_root=tmp_path)
    for k, (w, h) in enumerate(SIZES):
        save(Image.new("RGB", (w, h), (k * 20 % 255, 90, 200)), tmp_path / f"{k}.jpg", "JPEG")
    rows = [llava([f"{k}.jpg"]) for k in range(len(SIZES))]
    rows.append(llava([f"{k}.jpg" for k in range(4)], "<image>" * 4 + "\nAll of them?", "yes " * 30))
    rows.append(
        {
            "messages": messages(0)
            + [{"role": "user", "content": [{"type": "video"}]}, {"role": "assistant", "content": "moving"}],
            "videos": [[save(image(70, 50, f), tmp_path / f"f{f}.png") for f in range(6)]],
        }
    )
    rows.append(
        {
            "messages": [
                {"role": "user", "content": [{"type": "video"}, {"type": "image"}]},
                {"role": "assistant", "content": "ok"},
            ],
            "videos": [video(frames=5)],
            "images": ["3.jpg"],
        }
    )
    for i, row in enumerate(rows):
        meta = pre.estimate(row, i)
        sample = pre.process(row, i, planned_tokens=meta.num_tokens)
        assert meta.num_tokens == sample["num_tokens"] == sample["input_ids"].numel() == sample["labels"].numel()
        grids = [sample[k] for k in ("image_grid_thw", "video_grid_thw") if k in sample]
        assert meta.vision_patches == int(sum(g.prod(-1).sum() for g in grids))
        assert meta.num_images == (len(sample["image_grid_thw"]) if "image_grid_thw" in sample else 0)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(w=st.integers(1, 2500), h=st.integers(1, 2500), family=st.sampled_from(FAMILIES))
def test_estimate_equals_processed_length_property(processors, tmp_path, w, h, family):
    if max(w, h) / min(w, h) > 200:
        return
    path = save(Image.new("RGB", (w, h), (10, 200, 30)), tmp_path / f"{w}x{h}.jpg", "JPEG", quality=50)
    pre = Preprocessor(processors[family])
    row = llava(path)
    assert pre.estimate(row).num_tokens == pre.process(row)["num_tokens"]


def test_tokens_per_image_follow_the_family_cell_size(processors, tmp_path):
    # 28 px cells on Qwen2/2.5-VL, 32 px on Qwen3-VL, after smart_resize (DESIGN: 448² -> 256 tokens on Qwen2.5-VL)
    for family, side, cell in (("qwen2_5_vl", 448, 28), ("qwen2_vl", 448, 28), ("qwen3_vl", 512, 32)):
        pre = Preprocessor(processors[family])
        base = pre.estimate(llava([], "What is this?")).num_tokens
        meta = pre.estimate(llava(save(image(side, side), tmp_path / f"{family}.png")))
        assert meta.num_tokens - base == (side // cell) ** 2 + 2  # + <|vision_start|>, <|vision_end|>
        assert meta.vision_patches == (side // cell) ** 2 * 4


def test_exif_rotation_is_applied_from_the_header(processors, tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90°: a 200x40 file is a 40x200 image
    path = save(image(200, 40), tmp_path / "rot.jpg", "JPEG", exif=exif.tobytes())
    pre = Preprocessor(processors["qwen2_vl"])
    meta, sample = pre.estimate(llava(path)), pre.process(llava(path))
    assert meta.num_tokens == sample["num_tokens"]
    assert sample["image_grid_thw"][0, 1] > sample["image_grid_thw"][0, 2]  # taller than wide


# ------------------------------------------------------------------------------------------------------- truncation
def test_truncation_modes_never_cut_an_image(processors, tmp_path):
    processor = processors["qwen2_vl"]
    path = save(image(112, 112), tmp_path / "i.png")  # 16 image tokens
    row = llava(path, "<image>\nDescribe it.", "It is a long answer " * 20)
    full = Preprocessor(processor).process(row, 12)
    vision_end = int(torch.nonzero(full["mm_token_type_ids"])[-1]) + 2  # + <|vision_end|>
    first_supervised = int(torch.nonzero(full["labels"] != -100)[0])
    limit = first_supervised + 5
    with pytest.raises(SampleError) as err:
        Preprocessor(processor, max_length=limit).estimate(row, 12)
    assert err.value.reason == "overlong"
    with pytest.raises(
        ValueError,
        match=r"sample 12 has [\d,]+ tokens > max_length=\d+; raise max_length or set "
        r"on_overlong='truncate_text'",
    ):
        Preprocessor(processor, max_length=limit, on_overlong="error").estimate(row, 12)
    pre = Preprocessor(processor, max_length=limit, on_overlong="truncate_text")
    meta, cut = pre.estimate(row, 12), pre.process(row, 12)
    assert meta.num_tokens == cut["num_tokens"] == limit == cut["input_ids"].numel()
    for key in ("input_ids", "labels", "mm_token_type_ids"):
        assert torch.equal(cut[key], full[key][:limit])
    assert torch.equal(cut["pixel_values"], full["pixel_values"])
    assert int((cut["mm_token_type_ids"] == 1).sum()) == int(cut["image_grid_thw"].prod()) // 4  # image intact
    assert (cut["labels"] != -100).any()
    for too_small in (vision_end - 1, vision_end - 10):  # would cut through the image (or its end marker): dropped
        with pytest.raises(SampleError) as err:
            Preprocessor(processor, max_length=too_small, on_overlong="truncate_text").estimate(row, 12)
        assert err.value.reason == "overlong_vision"
    with pytest.raises(SampleError) as err:  # fits, but nothing supervised survives the cut
        Preprocessor(processor, max_length=first_supervised, on_overlong="truncate_text").estimate(row, 12)
    assert err.value.reason == "overlong"


# ------------------------------------------------------------------------------------------------------- bad input
def _png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    out, pos = [], 8
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        out.append((data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]))
        pos += 12 + n
    return out


def _png(chunks: list[tuple[bytes, bytes]]) -> bytes:
    body = b"".join(struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d)) for t, d in chunks)
    return b"\x89PNG\r\n\x1a\n" + body


def _png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def write_bad_files(root) -> dict[str, str]:
    """Real files for every bad-image case; returns {case: path relative to root (or outside it)}."""
    root.mkdir(exist_ok=True)
    outside = root.parent / "outside.png"
    save(image(20, 20), outside)
    good = _png_bytes(image(40, 30))
    jpeg = io.BytesIO()
    image(64, 48).save(jpeg, "JPEG")
    chunks = _png_chunks(good)
    ihdr = chunks[0][1]
    files = {
        "truncated.jpg": jpeg.getvalue()[: len(jpeg.getvalue()) // 2],
        "truncated.png": good[: len(good) // 2],
        "empty.png": b"",
        "zero_width.png": _png([(b"IHDR", struct.pack(">II", 0, 30) + ihdr[8:])] + chunks[1:]),
        "garbage.png": b"this is not an image at all",
        "bomb.png": _png([(b"IHDR", struct.pack(">II", 100_000, 100_000) + ihdr[8:])] + chunks[1:]),
        "big.png": _png([(b"IHDR", struct.pack(">II", 12_000, 9_000) + ihdr[8:])] + chunks[1:]),
        "corrupt_body.png": _png([(t, bytes(b ^ 0x5A for b in d) if t == b"IDAT" else d) for t, d in chunks]),
        "good.png": good,
    }
    for name, data in files.items():
        (root / name).write_bytes(data)
    os.symlink(outside, root / "link_out.png")
    os.symlink(root / "good.png", root / "link_in.png")
    return {"outside": str(outside), **{name: name for name in files}}


BAD_IMAGES = [  # (image reference, reason); references are relative to image_root unless absolute
    ("missing.png", "missing_file"),
    ("truncated.jpg", "corrupt_image"),
    ("truncated.png", "corrupt_image"),
    ("empty.png", "empty_image"),
    ("zero_width.png", "corrupt_image"),
    ("garbage.png", "corrupt_image"),
    ("bomb.png", "image_too_large"),
    ("big.png", "image_too_large"),
    ("../outside.png", "path_outside_root"),
    ("OUTSIDE", "path_outside_root"),
    ("link_out.png", "path_outside_root"),
]


def test_bad_images_are_refused_while_planning(processors, tmp_path):
    files = write_bad_files(tmp_path / "root")
    pre = Preprocessor(processors["qwen2_vl"], image_root=tmp_path / "root", max_image_pixels=100_000_000)
    for ref, reason in BAD_IMAGES:
        with pytest.raises(SampleError) as err:
            pre.estimate(llava(files["outside"] if ref == "OUTSIDE" else ref), ref)
        assert err.value.reason == reason, ref
    for ok in ("good.png", "link_in.png", str(tmp_path / "root" / "good.png")):
        assert pre.estimate(llava(ok)).num_images == 1
    tight = Preprocessor(processors["qwen2_vl"], image_root=tmp_path / "root", max_image_pixels=1_000)
    with pytest.raises(SampleError) as err:  # a 40x30 image over a lowered pixel limit
        tight.estimate(llava("good.png"))
    assert err.value.reason == "image_too_large"
    # header and end marker intact, body corrupt: only full decoding can tell, at processing time
    meta = pre.estimate(llava("corrupt_body.png"))
    assert meta.num_images == 1
    with pytest.raises(SampleError) as err:
        pre.process(llava("corrupt_body.png"))
    assert err.value.reason == "corrupt_image"


def test_bad_rows_are_refused_with_a_reason(processors, tmp_path):
    save(image(30, 30), tmp_path / "a.png")
    (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")  # not a video: refused by its header
    pre = Preprocessor(processors["qwen2_vl"], image_root=tmp_path)
    cases = [
        (llava(["a.png"], "<image><image>\nTwo?"), "placeholder_mismatch"),
        (llava(["a.png", "a.png"], "<image>\nOne?"), "placeholder_mismatch"),
        (llava([], "<image>\nNone?"), "placeholder_mismatch"),
        ({"messages": messages(2), "images": ["a.png"]}, "placeholder_mismatch"),
        ({"messages": messages(0, "<|image_pad|> sneaky"), "images": []}, "placeholder_mismatch"),
        ({"messages": [], "images": []}, "empty_conversation"),
        ({"conversations": []}, "empty_conversation"),
        ({"conversations": [{"from": "human", "value": ""}]}, "no_assistant_turn"),  # empty turns are kept
        ({"messages": messages(0)[:1]}, "no_assistant_turn"),
        (
            {"messages": [{"role": "user", "content": b"caf\xe9 au lait"}, {"role": "assistant", "content": "ok"}]},
            "bad_text",
        ),
        ({"conversations": [{"from": "human", "value": b"\xff\xfe"}, {"from": "gpt", "value": "ok"}]}, "bad_text"),
        (
            {"messages": [{"role": "user", "content": "bad \udcff surrogate"}, {"role": "assistant", "content": "ok"}]},
            "bad_text",
        ),
        ({"messages": [{"role": 3, "content": "hi"}]}, "bad_row"),
        ({"conversations": [{"from": "wizard", "value": "hi"}]}, "bad_row"),
        ({"text": "no conversation at all"}, "bad_row"),
        (
            {"messages": messages(0) + [{"role": "user", "content": [{"type": "video"}]}], "videos": ["clip.mp4"]},
            "corrupt_video",
        ),
        (llava(save(image(1000, 4), tmp_path / "thin.png")), "bad_aspect_ratio"),
    ]
    for row, reason in cases:
        with pytest.raises(SampleError) as err:
            pre.estimate(row, "case")
        assert err.value.reason == reason, row
    ok = {"messages": [{"role": "user", "content": "café".encode()}, {"role": "assistant", "content": "ok"}]}
    assert pre.estimate(ok).num_tokens > 0  # valid UTF-8 bytes are decoded, not refused


def test_image_modes_are_converted_not_refused(processors, tmp_path):
    rgb = np.zeros((8, 8, 3), np.uint8)
    rgb[..., 0] = 255  # red
    rgba = np.zeros((8, 8, 4), np.uint8)
    rgba[:4] = (255, 0, 0, 255)  # top half opaque red, bottom half fully transparent (black under the alpha)
    i16 = np.zeros((8, 8), np.uint16)
    i16[:, :4], i16[:, 4:] = 32768, 65535
    p_img = Image.fromarray(rgba).convert("P")
    paths = {
        "CMYK": save(Image.fromarray(rgb).convert("CMYK"), tmp_path / "cmyk.jpg", "JPEG", quality=100),
        "RGBA": save(Image.fromarray(rgba), tmp_path / "rgba.png"),
        "P": save(Image.fromarray(rgb).convert("P"), tmp_path / "p.png"),
        "PT": save(p_img, tmp_path / "pt.png", transparency=int(p_img.getpixel((0, 7)))),
        "LA": save(Image.fromarray(rgba).convert("LA"), tmp_path / "la.png"),
        "I;16": save(Image.fromarray(i16), tmp_path / "i16.png"),
        "L": save(Image.fromarray(rgb).convert("L"), tmp_path / "l.png"),
        "1": save(Image.fromarray(rgb).convert("1"), tmp_path / "one.png"),
    }
    pre = Preprocessor(processors["qwen2_vl"])
    for mode, path in paths.items():
        assert Image.open(path).mode == (mode if mode != "PT" else "P")
        out = np.asarray(pre.images.load_rgb(path))
        assert out.dtype == np.uint8 and out.shape == (8, 8, 3), mode
        if mode in ("CMYK", "P"):
            assert np.abs(out.astype(int) - rgb).max() <= 8, mode
        if mode in ("RGBA", "PT", "LA"):
            assert (out[7] == 255).all(), mode  # transparent -> white, not black
        if mode in ("RGBA", "PT"):
            assert tuple(out[0, 0]) == (255, 0, 0), mode
        if mode == "I;16":
            assert (out[:, :4] == 128).all() and (out[:, 4:] == 255).all()  # scaled, not clipped
        meta = pre.estimate(llava(path))
        assert pre.process(llava(path), planned_tokens=meta.num_tokens)["num_tokens"] == meta.num_tokens
    assert np.asarray(to_rgb(Image.fromarray(np.full((2, 2), 0.5, np.float32), "F"))).max() == 128


def test_skip_counter_logs_each_reason_once(caplog):
    counter = SkipCounter()
    with caplog.at_level(logging.WARNING, logger="hf_packing"):
        for i in range(5):
            counter.record("corrupt_image", i, "boom")
        counter.record("missing_file", 9, "gone")
    assert counter == {"corrupt_image": 5, "missing_file": 1}
    messages_ = [r.getMessage() for r in caplog.records]
    assert len(messages_) == 2 and "sample 0" in messages_[0] and "sample 9" in messages_[1]
