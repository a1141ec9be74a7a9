"""Shared helpers: tiny local processors (tests/fixtures/<model_type>) and mixed padded batches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hf_packing.testing.tiny import MODEL_TYPES  # noqa: F401  (the families every test parametrises over)

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).resolve().parents[1]


def torchrun(script: Path, *args: str, nproc: int = 2, timeout: float = 240) -> subprocess.CompletedProcess | None:
    """``torchrun --standalone --nproc_per_node nproc script *args`` (gloo on CPU, offline, one thread a rank).

    Returns the finished process, or None when it ran past ``timeout``: then every rank is killed (the run has its
    own process group), so a hang fails the test instead of hanging CI.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), str(script)]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        # the caller's entries stay (a transformers version under test, say), after the repository's
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONFAULTHANDLER": "1",  # an abort prints every Python thread's stack: which thread was still busy
    }
    proc = subprocess.Popen(
        cmd + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    return subprocess.CompletedProcess(cmd + list(args), proc.returncode, stdout, stderr)


def image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


def video(frames: int = 4, width: int = 84, height: int = 56, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (frames, height, width, 3), dtype=np.uint8)


def write_clip(
    path: Path,
    frames: int = 12,
    width: int = 48,
    height: int = 32,
    rate: int = 6,
    *,
    codec: str | None = None,
    levels: bool = False,
    options: dict[str, str] | None = None,
) -> Path:
    """A synthetic clip encoded with PyAV (mp4: mpeg4, webm: VP9, mkv: VP8 unless `codec`); frame k is noise, or with
    `levels` a solid grey of level 10·k (k < 25), so a decoded frame tells its index."""
    import av

    fmt = {".mp4": "mp4", ".webm": "webm", ".mkv": "matroska"}[Path(path).suffix]
    rng = np.random.default_rng(frames)
    with av.open(str(path), "w", format=fmt, options=options or {}) as out:
        stream = out.add_stream(codec or {"mp4": "mpeg4", "webm": "libvpx-vp9", "matroska": "libvpx"}[fmt], rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for k in range(frames):
            if levels:
                pixels = np.full((height, width, 3), 10 * k, dtype=np.uint8)
            else:
                pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        out.mux(stream.encode())
    return Path(path)


def load_processor(model_type: str, padding_side: str = "right"):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(FIXTURES / model_type)
    processor.tokenizer.padding_side = padding_side
    return processor


def conversations(with_video: bool = True) -> list[tuple[list[dict], list, list]]:
    """(messages, images, videos) of very different lengths: text-only, 1 image, 2 images, multi-turn, video."""
    user = lambda *parts: {"role": "user", "content": list(parts)}  # noqa: E731
    bot = lambda text: {"role": "assistant", "content": [{"type": "text", "text": text}]}  # noqa: E731
    txt = lambda text: {"type": "text", "text": text}  # noqa: E731
    img = {"type": "image"}
    rows = [
        ([user(txt("Hi")), bot("Hello, how can I help?")], [], []),
        (
            [user(img, txt("Describe the image in detail.")), bot("A red car near a small house.")],
            [image(56, 84, 1)],
            [],
        ),
        (
            [user(img, img, txt("Compare them.")), bot("The first is wider than the second one by far, and darker.")],
            [image(112, 56, 2), image(56, 56, 3)],
            [],
        ),
        (
            [user(txt("What is this?"), img), bot("A dog."), user(txt("And the colour?")), bot("Brown and white.")],
            [image(84, 84, 4)],
            [],
        ),
    ]
    if with_video:
        rows.append(
            (
                [
                    user({"type": "video"}, txt("What happens?")),
                    bot(
                        "A person walks along the beach, then the camera turns to the sea and follows the waves "
                        "for a while."
                    ),
                ],
                [],
                [video()],
            )
        )
    return rows


def processed_batch(processor, rows=None) -> dict[str, torch.Tensor]:
    """A padded batch straight from the processor; labels supervise text, never padding, vision or a row's first
    token."""
    rows = conversations() if rows is None else rows
    texts = [processor.apply_chat_template(messages, tokenize=False) for messages, _, _ in rows]
    images = [im for _, ims, _ in rows for im in ims] or None
    videos = [v for _, _, vs in rows for v in vs] or None
    batch = dict(
        processor(
            text=texts,
            images=images,
            videos=videos,
            padding=True,
            return_tensors="pt",
            videos_kwargs={"do_sample_frames": False},
        )
    )
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    labels = labels.masked_fill(batch["mm_token_type_ids"] != 0, -100)
    first = batch["attention_mask"].long().argmax(dim=1)
    labels[torch.arange(labels.shape[0]), first] = -100
    batch["labels"] = labels
    return batch


def processed_samples(processor, rows=None) -> list[dict[str, torch.Tensor]]:
    """The same conversations processed one by one (1-D tensors), as the packer yields them."""
    rows = conversations() if rows is None else rows
    samples = []
    for messages, images, videos in rows:
        one = processed_batch(processor, [(messages, images, videos)])
        samples.append(
            {
                k: (v[0] if k in ("input_ids", "labels", "attention_mask", "mm_token_type_ids") else v)
                for k, v in one.items()
            }
        )
    return samples


def sgd_training_args(output_dir, **overrides):
    """`TrainingArguments` for exact CPU comparisons: plain SGD, constant LR 1.0, no clipping or decay, no saving,
    one log line per step, in-process data loading; ``overrides`` replace any of them."""
    from transformers import TrainingArguments

    settings = dict(
        output_dir=str(output_dir),
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        logging_steps=1,
        seed=0,
    )
    return TrainingArguments(**{**settings, **overrides})


@pytest.fixture(autouse=True)
def _always_revert():
    """Patches are class-level; no test may leak them into the next."""
    yield
    import sys

    if "hf_packing.patches" in sys.modules:
        sys.modules["hf_packing.patches"].revert_rmpad()
