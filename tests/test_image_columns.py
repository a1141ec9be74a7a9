"""The image columns people have: `image` (one image), the Hub's imagefolder directories and parquet files with an
`Image()` feature. Each row packs with nothing skipped, and its ids and pixels equal the processor's on the same local
file (the oracle); it trains, through the Trainer and through recipes/train.py."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.helpers import image, load_processor, sgd_training_args

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SIZES = [(56, 84), (84, 56), (112, 56), (56, 56), (84, 84), (140, 56)]


def messages(k: int, *, string: bool = False) -> list[dict]:
    """Row `k`'s conversation: one image part (the tag of the row's `image`), a question and an answer."""
    question = [{"type": "image"}, {"type": "text", "text": f"Describe picture {k}."}]
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": [{"type": "text", "text": "A picture " + "of noise " * (k + 1)}]},
    ]


def write_folder(root: Path, n: int = len(SIZES), metadata: str = "jsonl") -> list[Path]:
    """An imagefolder directory: `n` PNG / JPEG files (q=95) and their `metadata.jsonl` (or `.csv`, turns as JSON)."""
    root.mkdir(parents=True, exist_ok=True)
    files, rows = [], []
    for k in range(n):
        w, h = SIZES[k % len(SIZES)]
        name = f"img{k}.{'png' if k % 2 else 'jpg'}"
        image(w, h, seed=k).save(root / name, quality=95)
        files.append(root / name)
        rows.append({"file_name": name, "messages": messages(k)})
    if metadata == "jsonl":
        (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import csv

        with open(root / "metadata.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, ["file_name", "messages"])
            writer.writeheader()
            writer.writerows({"file_name": r["file_name"], "messages": json.dumps(r["messages"])} for r in rows)
    return files


def oracle(processor, k: int, path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The processor on row `k`'s conversation and its local file: input ids and pixel values."""
    text = processor.apply_chat_template(messages(k), tokenize=False)
    with Image.open(path) as img:
        out = processor(text=[text], images=[img.convert("RGB")], return_tensors="pt")
    return out["input_ids"][0], out["pixel_values"]


def packed(ds, processor, **kw) -> tuple[dict[int, dict], dict]:
    from hf_packing import pack_dataset

    data = pack_dataset(ds, processor, max_length=512, buffer_size=16, disable_progress=True, **kw)
    samples = {s["index"]: s for pack in data for s in pack}
    return samples, data.stats(log=False)


def assert_equal_to_the_processor(processor, samples: dict[int, dict], files: list[Path]) -> None:
    assert sorted(samples) == list(range(len(files)))
    for k, path in enumerate(files):
        ids, pixels = oracle(processor, k, path)
        assert torch.equal(samples[k]["input_ids"], ids), k
        assert torch.equal(samples[k]["pixel_values"], pixels), k
    # negative control: the comparison tells images apart (same size, other pixels)
    other = image(*SIZES[0], seed=99)
    text = processor.apply_chat_template(messages(0), tokenize=False)
    wrong = processor(text=[text], images=[other], return_tensors="pt")["pixel_values"]
    assert wrong.shape == samples[0]["pixel_values"].shape and not torch.equal(wrong, samples[0]["pixel_values"])


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streaming"])
@pytest.mark.parametrize("metadata", ["jsonl", "csv"])
def test_imagefolder_rows_pack_with_none_skipped_and_equal_the_processor(tmp_path, streaming, metadata):
    """`load_local` reads an image folder as `datasets.load_dataset("imagefolder", data_dir=...)` does (its `image`
    column holds `{"bytes": None, "path": ...}` undecoded); every row becomes the processor's own sample."""
    import datasets

    from hf_packing.packing.readers import load_local

    processor = load_processor("qwen2_5_vl")
    files = write_folder(tmp_path / "folder", metadata=metadata)
    ds = load_local(str(tmp_path / "folder"), streaming=streaming)
    reference = datasets.load_dataset("imagefolder", data_dir=str(tmp_path / "folder"), split="train")
    assert isinstance(ds, datasets.IterableDataset if streaming else datasets.Dataset)
    assert ds.features == reference.features and isinstance(ds.features["image"], datasets.Image)
    samples, stats = packed(ds, processor)
    assert stats["skipped"] == {} and stats["samples"] == len(files)
    assert_equal_to_the_processor(processor, samples, files)


def test_parquet_rows_with_an_image_feature_pack_with_none_skipped(tmp_path):
    """A single-image parquet file (bytes embedded by `Image()`), read by `load_local`, packs as its source files."""
    import datasets

    from hf_packing.packing.readers import load_local

    processor = load_processor("qwen2_5_vl")
    files = write_folder(tmp_path / "files")
    features = datasets.Features({"image": datasets.Image(), "messages": datasets.Json()})
    # as the Hub's parquet files hold them: the bytes, and the original file name
    embedded = [{"bytes": f.read_bytes(), "path": f.name} for f in files]
    rows = {"image": embedded, "messages": [messages(k) for k in range(len(files))]}
    parquet = tmp_path / "train.parquet"
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(parquet))
    for f in files:  # the bytes are in the parquet file: nothing reads the files
        f.rename(f.with_suffix(".moved"))
    ds = load_local(str(parquet))
    assert isinstance(ds.features["image"], datasets.Image)
    samples, stats = packed(ds, processor)
    assert stats["skipped"] == {} and stats["samples"] == len(files)
    assert_equal_to_the_processor(processor, samples, [f.with_suffix(".moved") for f in files])


def test_an_image_column_holds_a_path_a_pil_image_or_an_undecoded_dict(tmp_path):
    """One row's `image` as a path, a decoded PIL image (`Image()`), `{"bytes", "path"}` (`Image(decode=False)`) and
    `images: [path]` gives one sample; both `image` and `images` is a counted skip."""
    from hf_packing.preprocess.errors import SampleError
    from hf_packing.preprocess.preprocessor import Preprocessor

    processor = load_processor("qwen2_5_vl")
    (path,) = write_folder(tmp_path, n=1)
    pre = Preprocessor(processor, max_length=512)
    with Image.open(path) as img:
        decoded = img.copy()
    forms = [
        {"image": str(path)},
        {"image": decoded},
        {"image": {"bytes": path.read_bytes(), "path": None}},
        {"image": {"bytes": None, "path": str(path)}},
        {"images": [str(path)]},
    ]
    ids, pixels = oracle(processor, 0, path)
    for form in forms:
        sample = pre.process({"messages": messages(0), **form}, 0)
        assert torch.equal(sample["input_ids"], ids) and torch.equal(sample["pixel_values"], pixels), form
    with pytest.raises(SampleError, match="both 'image' and 'images'") as err:
        pre.estimate({"messages": messages(0), "image": str(path), "images": [str(path)]}, 0)
    assert err.value.reason == "bad_row"


def test_image_column_rows_train_a_step_with_the_trainer(tmp_path):
    """Rows of an image folder train one step through `prepare_trainer` (every row of the step seen, finite loss)."""
    from transformers import Trainer

    import hf_packing
    from hf_packing import VisionCollator, pack_dataset
    from hf_packing.packing.readers import load_local
    from hf_packing.testing.tiny import build_tiny_model

    processor = load_processor("qwen2_5_vl")
    write_folder(tmp_path / "folder")
    ds = load_local(str(tmp_path / "folder"))
    hf_packing.apply_rmpad()
    try:
        model = build_tiny_model("qwen2_5_vl")
        train = pack_dataset(ds, processor, max_length=2048, disable_progress=True)
        args = sgd_training_args(tmp_path / "out", max_steps=1, per_device_train_batch_size=1)
        trainer = hf_packing.prepare_trainer(
            Trainer(
                model=model,
                args=args,
                train_dataset=train,
                data_collator=VisionCollator(processor, model_config=model.config),
            )
        )
        trainer.train()
    finally:
        hf_packing.revert_rmpad()
    assert trainer.state.global_step == 1
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(x) for x in losses)
    assert train.stats(log=False)["skipped"] == {}


@pytest.fixture(scope="module")
def train_py():
    spec = importlib.util.spec_from_file_location("recipes_train_image_columns", RECIPES / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def test_train_py_trains_on_an_imagefolder_directory(train_py, tmp_path, monkeypatch):
    """recipes/train.py with `dataset_path` pointing at an image folder: 2 steps and their evaluations, offline."""
    from hf_packing.testing.tiny import save_tiny_checkpoint

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model_dir = save_tiny_checkpoint("qwen2_5_vl", tmp_path / "tiny")
    folder = tmp_path / "folder"
    write_folder(folder, n=12)
    trainer = train_py.main(
        [
            str(RECIPES / "configs/tiny_cpu.yaml"),
            *("--model_name_or_path", str(model_dir), "--dataset_path", str(folder)),
            *("--image_root", str(folder), "--max_length", "512", "--output_dir", str(tmp_path / "out")),
        ]
    )
    assert trainer.state.global_step == 2
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)
    assert trainer.train_dataset.stats(log=False)["skipped"] == {}
    assert trainer.eval_dataset.stats(log=False)["samples"] == 4
