"""Helpers shared by the test modules and the scripts they launch (tests/multiproc_*.py, benchmarks/bench_syncs.py).

Imported one way everywhere: ``from tests.helpers import ...`` (the repository root is on ``sys.path``: pytest's
``pythonpath``, `torchrun`'s ``PYTHONPATH``, or the script's own ``sys.path`` line). No test module imports another,
and none imports conftest.py, which holds only fixtures (tests/test_suite_imports.py checks both). What lives here:

- inputs: tiny local processors (tests/fixtures/<model_type>), conversations with images and a video, the padded
  batch and the per-sample tensors the processor makes of them, synthetic images, videos, clips, parquet and jsonl;
- oracles: loss and gradients of one batch, the equivalence tolerances, the 2x rule of STYLE.md, each sample alone;
- launches: `torchrun` with a timeout, and `launch` of tests/multiproc_train.py on a JSON config.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hf_packing.testing.tiny import GLM_TYPES, MODEL_TYPES, build_tiny_model

__all__ = ["GLM_TYPES", "MODEL_TYPES"]  # re-exported: the families tests parametrise over (the rest are used by name)

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FIXTURES = TESTS / "fixtures"
TRAIN_SCRIPT = TESTS / "multiproc_train.py"
#: the equivalence tolerances of patched against unpatched (fp32): loss, and each gradient's relative norm error
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
#: per-sample keys that take a leading batch dimension when a sample runs alone
ROW_KEYS = ("input_ids", "labels", "attention_mask", "mm_token_type_ids")


# ------------------------------------------------------------------------------------------ inputs
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


def glm_params(*fast: str) -> tuple:
    """`GLM_TYPES` as pytest parameters: those named in ``fast`` in the default suite, the others behind ``-m slow``.
    A per-architecture check needs GLM-4.1V and GLM-4.5V (its own copy of the modeling code); GLM-4.6V builds
    GLM-4.1V's text and vision models and differs only in its top-level classes."""
    return tuple(t if t in fast else pytest.param(t, marks=pytest.mark.slow) for t in GLM_TYPES)


def padded_rows(model_type: str) -> list[tuple[list[dict], list, list]]:
    """The conversations of a padded batch the unpatched ``model_type`` accepts: all of them, less the video for the
    GLM-V families, whose unpatched model refuses a padded batch holding images and a video (tests/test_glm.py)."""
    return conversations(with_video=model_type not in GLM_TYPES)


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
        samples.append({k: (v[0] if k in ROW_KEYS else v) for k, v in one.items()})
    return samples


def write_parquet(path: Path, n: int, *, seed: int, start: int, images: str, bad: dict[int, str] | None = None) -> None:
    """`n` LLaVA rows numbered from `start`; `images`: "none" (text-only), "all" (1-2 PNGs each) or "mixed" (half
    text-only); `bad`: {row: "corrupt_image" | "overlong"}, rows the packer must skip."""
    from datasets import Dataset, Features, Image, List, Value

    bad, rng = bad or {}, np.random.default_rng(seed)
    turn = {"from": Value("string"), "value": Value("string")}
    features = Features({"image": List(Image()), "conversations": List(turn)})
    rows = []
    for i in range(start, start + n):
        k = 0 if images == "none" else int(rng.integers(1, 3)) if images == "all" else int(rng.choice([0, 0, 1, 2]))
        k = max(k, bad.get(i) == "corrupt_image")
        pngs = []
        for j in range(k):
            buf = io.BytesIO()
            image(int(rng.integers(28, 120)), int(rng.integers(28, 120)), seed * 1000 + i * 10 + j).save(buf, "PNG")
            data = buf.getvalue()
            pngs.append({"bytes": data[: len(data) // 2] if bad.get(i) == "corrupt_image" else data, "path": None})
        question = "<image>\n" * k + f"Row {i}: describe " + "this " * int(rng.integers(0, 12))
        answer = "word " * (400 if bad.get(i) == "overlong" else int(rng.integers(2, 60)))
        rows.append(
            {"image": pngs, "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}
        )
    Dataset.from_list(rows, features=features).to_parquet(str(path))


def write_llava_jsonl(root: Path) -> Path:
    """A LLaVA-style jsonl (text-only, one- and two-image rows) and two PNGs under root/images."""
    (root / "images").mkdir(parents=True)
    image(56, 84, 1).save(root / "images" / "a.png")
    image(112, 56, 2).save(root / "images" / "b.png")
    turn = lambda human, gpt: [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]  # noqa: E731
    rows = [
        {"conversations": turn("<image>\nDescribe the image.", "A red car near a small house."), "images": ["a.png"]},
        {"conversations": turn("Hi", "Hello, how can I help?"), "images": []},
        {"conversations": turn("<image>\n<image>\nCompare them.", "The first is wider."), "images": ["a.png", "b.png"]},
        {"conversations": turn("What colour is the sky?", "Blue, mostly."), "images": []},
    ] * 4
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------ the packer's rows
#: rows of conftest.py's `data` fixture (tests/test_stream.py, tests/test_length_index.py)
STREAM_ROWS = 48


def image_rows(root: Path, n: int, seed: int, tag: str = "") -> list[dict]:
    """``n`` LLaVA rows with 0-3 JPEGs each (written under ``root``) and answers of 1-120 words starting with
    ``{tag}answer``."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        k = int(rng.choice([0, 1, 1, 1, 2, 3]))
        names = []
        for j in range(k):
            name = f"{tag}{i}_{j}.jpg"
            image(int(rng.integers(20, 300)), int(rng.integers(20, 300)), seed * 1000 + i * 10 + j).save(root / name)
            names.append(name)
        question = "<image>" * k + "\nDescribe " + "and this " * int(rng.integers(0, 20))
        answer = f"{tag}answer " + "word " * int(rng.integers(1, 120))
        rows.append(
            {"image": names, "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}
        )
    return rows


def make_packs(data, ds=None, **kw):
    """`pack_dataset` of the `data` fixture's rows (or ``ds``): 512 tokens, a 16-row buffer, its image root; ``kw``
    overrides any of them."""
    from hf_packing.packing.dataset import pack_dataset

    kw = {"max_length": 512, "buffer_size": 16, "image_root": str(data["root"]), "disable_progress": True, **kw}
    return pack_dataset(data["ds"] if ds is None else ds, data["processor"], **kw)


def pack_ids(packs) -> list[list[int]]:
    """The sample indices of each pack."""
    return [[s["index"] for s in pack] for pack in packs]


# ------------------------------------------------------------------------------------------ models and oracles
def model_and_processor(model_type: str, padding_side: str = "right"):
    """A fresh tiny model of ``model_type`` (fp32, seeded) and its local processor."""
    processor = load_processor(model_type, padding_side)
    return build_tiny_model(model_type, processor_dir=FIXTURES / model_type), processor


def loss_and_grads(model, batch) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, {parameter name: gradient}) of one forward and backward of ``batch``, from zeroed gradients."""
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_equivalent(ref, got, label: str = "") -> None:
    """``got`` equals the oracle ``ref`` (both `loss_and_grads` pairs): loss within LOSS_RTOL, every gradient's
    relative norm error within GRAD_RTOL, the same parameters with a gradient. Prints the numbers first."""
    (ref_loss, ref_grads), (loss, grads) = ref, got
    loss_err = abs(loss - ref_loss) / abs(ref_loss)
    assert ref_grads.keys() == grads.keys(), set(ref_grads) ^ set(grads)
    errs = {n: ((grads[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in ref_grads.items()}
    worst = max(errs, key=errs.get)
    print(
        f"{label}: loss {ref_loss:.6f} vs {loss:.6f} (rel {loss_err:.2e}); worst grad rel {errs[worst]:.2e} ({worst})"
    )
    assert loss_err <= LOSS_RTOL
    assert errs[worst] <= GRAD_RTOL, worst


def each_sample_alone(model, samples) -> tuple[float, dict[str, torch.Tensor]]:
    """Token-level loss and gradients of the samples run one by one, unpadded (on whatever model is given)."""
    counts = [int((s["labels"][1:] != -100).sum()) for s in samples]
    total, loss_sum = sum(counts), 0.0
    model.zero_grad(set_to_none=True)
    for sample, count in zip(samples, counts):
        out = model(**{k: (v[None] if k in ROW_KEYS else v) for k, v in sample.items()})
        (out.loss * count / total).backward()
        loss_sum += out.loss.item() * count
    return loss_sum / total, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _errors(ref, run) -> tuple[float, float]:
    (ref_loss, ref_grads), (loss, grads) = ref, run
    return abs(loss - ref_loss) / abs(ref_loss), ((grads - ref_grads).norm() / ref_grads.norm()).item()


def assert_within_2x(ref, plain, patched, label: str) -> None:
    """STYLE.md's low-precision rule: the patched run's (loss, flat gradient) error against the fp32 oracle ``ref``
    is at most 2x the plain low-precision run's (the loss with 1e-3 of slack). Prints both before asserting."""
    plain_err, patched_err = _errors(ref, plain), _errors(ref, patched)
    print(
        f"{label}: loss err plain {plain_err[0]:.2e} patched {patched_err[0]:.2e}; "
        f"grad err plain {plain_err[1]:.2e} patched {patched_err[1]:.2e}"
    )
    assert patched_err[0] <= 2 * plain_err[0] + 1e-3, "loss"
    assert patched_err[1] <= 2 * plain_err[1], "grads"


def first_layer_tokens(model) -> list[int]:
    """Tokens the first decoder layer receives, one entry per call."""
    seen: list[int] = []

    def hook(module, args, kwargs, out) -> None:
        seen.append((args[0] if args else kwargs["hidden_states"]).shape[:-1].numel())

    model.model.language_model.layers[0].register_forward_hook(hook, with_kwargs=True)
    return seen


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


# ------------------------------------------------------------------------------------------ processes
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
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
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


def launch(
    work: Path, timeout: float, *, helper: Path = TRAIN_SCRIPT, **config
) -> tuple[subprocess.CompletedProcess | None, list[dict], float]:
    """torchrun --nproc_per_node 2 ``helper`` on CONFIG.json (``config``); returns (process or None if it timed out,
    rank results, seconds)."""
    work.mkdir(parents=True, exist_ok=True)
    config = {
        "out": str(work / "out"),
        "output_dir": str(work / "trainer"),
        "max_length": 256,  # the packs of every launch unless the config says otherwise
        "pg_timeout": 120,  # well above a loaded 2-core machine's stalls, below the launcher's kill
        **config,
    }
    (work / "config.json").write_text(json.dumps(config))
    t0 = time.perf_counter()
    proc = torchrun(helper, str(work / "config.json"), timeout=timeout)
    seconds = time.perf_counter() - t0
    if proc is None:
        return None, [], seconds
    results = [json.loads(p.read_text()) for p in sorted((work / "out").glob("rank*.json"))]
    return proc, results, seconds


def failure(proc) -> str:
    """The first rank's traceback (torchrun's own summary hides it at the end of stderr)."""
    start = proc.stderr.find("Traceback")
    return proc.stdout[-2000:] + proc.stderr[max(start, 0) :][:6000] + "\n...\n" + proc.stderr[-1500:]


def check_ok(proc, results, seconds, label: str) -> None:
    """`launch` finished in time, exited 0, and both ranks wrote their results."""
    print(f"{label}: {seconds:.1f} s")
    assert proc is not None, f"{label}: torchrun hung past its timeout"
    assert proc.returncode == 0, failure(proc)
    assert [r["rank"] for r in results] == [0, 1]
