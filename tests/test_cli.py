"""The CLI checks its optional packages before any work, and names the extra to install; `hf-packing stats` reads
what the recipes read (several files, globs, directories) and says in one line when a path is missing."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from hf_packing._compat import require_extra
from hf_packing.cli import main
from hf_packing.cli.demo import DemoConfig, run_demo
from hf_packing.cli.stats import predict_peak, run_stats
from hf_packing.config import PackingConfig
from hf_packing.ops.memory import ActivationMemory
from hf_packing.testing.tiny import build_tiny_model, save_tiny_checkpoint
from tests.helpers import FIXTURES, ROOT


def _without(monkeypatch, name: str) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == name else find_spec(n, *a))


def test_require_extra_names_the_extra_only_when_something_is_missing(monkeypatch):
    require_extra("cli", "matplotlib", "yaml", purpose="x")  # installed here (the dev extra): no error
    _without(monkeypatch, "matplotlib")
    with pytest.raises(ImportError, match=r"x needs matplotlib: pip install 'hf_packing\[cli\]'"):
        require_extra("cli", "matplotlib", "yaml", purpose="x")


def test_demo_without_matplotlib_fails_before_it_writes_or_trains(tmp_path, monkeypatch):
    _without(monkeypatch, "matplotlib")
    out = tmp_path / "demo"
    with pytest.raises(ImportError, match=r"hf-packing demo .* needs matplotlib: pip install 'hf_packing\[cli\]'"):
        run_demo(DemoConfig(output_dir=out))
    assert not out.exists()  # no checkpoint, no data, no training started


def test_stats_without_matplotlib_fails_before_it_reads(tmp_path, monkeypatch):
    _without(monkeypatch, "matplotlib")
    args = argparse.Namespace(data=str(tmp_path / "missing"), processor=str(tmp_path / "missing"))
    with pytest.raises(ImportError, match=r"hf-packing stats .* pip install 'hf_packing\[cli\]'"):
        run_stats(args)


# ------------------------------------------------------------------------------------------ hf-packing stats
def _jsonl(path, n: int, words: int = 10) -> str:  # 49 tokens a row
    row = {"conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "word " * words}]}
    path.write_text((json.dumps(row) + "\n") * n)
    return str(path)


def test_stats_reads_several_files_globs_and_directories(tmp_path, capsys):
    """Every row of every path counts (5 + 2·3 + 4 = 15 rows of 49 tokens); at max_length=100 two rows fill a pack,
    which the third closes by the token budget: 7 packs, and the last with its one row ends the data."""
    (tmp_path / "dir").mkdir()
    paths = [_jsonl(tmp_path / "a.jsonl", 5), str(tmp_path / "dir"), str(tmp_path / "g_*.jsonl")]
    for name in ("dir/x.jsonl", "dir/y.jsonl"):
        _jsonl(tmp_path / name, 3)
    _jsonl(tmp_path / "g_1.jsonl", 4)
    args = [*paths, "--processor", str(FIXTURES / "qwen2_vl"), "--max-length", "100", "--strategy", "next_fit"]
    assert main(["stats", *args, "--output", str(tmp_path / "h.png")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("15 rows, max_length=100, max_images=")
    (next_fit,) = [line for line in out if line.startswith("next_fit ")]
    assert "tokens: 7, end: 1  /  none" in next_fit  # 8 packs of 2, 2, ..., 1 rows
    assert "packs closed by: the budget a pack reached" in "\n".join(out)


def test_a_missing_stats_path_is_one_line_not_a_traceback(tmp_path):
    _jsonl(tmp_path / "a.jsonl", 2)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    for missing, said in (("nope.jsonl", "'nope.jsonl' does not exist"), ("x_*.jsonl", "no file matches 'x_*.jsonl'")):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "hf_packing.cli",
                "stats",
                "a.jsonl",
                missing,
                "--processor",
                str(FIXTURES / "qwen2_vl"),
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1] == f"hf-packing stats: error: {said}"


# ------------------------------------------------------------------------------------------ hf-packing plot
HISTORY = [
    {"loss": 2.0, "loss/a": 1.5, "token_accuracy/a": 0.25, "loss/b": 3.0, "packing/pack_fill": 0.9, "step": 1},
    {"loss": 1.0, "loss/a": 0.5, "token_accuracy/a": 0.5, "step": 2},  # b had no supervised token in this window
    {"eval_loss": 1.2, "eval_token_accuracy": 0.4, "eval_a_loss": 1.1, "eval_a_token_accuracy": 0.45, "step": 2},
    {"eval_runtime": 0.5, "eval_model_preparation_time": 0.1, "step": 2},
    {"train_loss": 1.5, "train_runtime": 3.0, "step": 2},
]


def test_training_curves_read_overall_and_per_source_keys():
    from hf_packing.cli.plots import source_names, training_curves

    assert source_names(HISTORY) == ["a", "b"]
    assert training_curves(HISTORY) == {
        "loss": {
            "train": [(1, 2.0), (2, 1.0)],
            "eval": [(2, 1.2)],
            "train a": [(1, 1.5), (2, 0.5)],
            "eval a": [(2, 1.1)],
            "train b": [(1, 3.0)],
        },
        "token accuracy": {"eval": [(2, 0.4)], "train a": [(1, 0.25), (2, 0.5)], "eval a": [(2, 0.45)]},
    }


def test_plot_command_draws_the_newest_checkpoints_state(tmp_path, capsys):
    import json

    from hf_packing.cli import main

    for step, history in ((2, HISTORY[:1]), (10, HISTORY)):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert main(["plot", str(tmp_path)]) == 0
    png = tmp_path / "checkpoint-10" / "curves.png"
    assert capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "checkpoint-2" / "curves.png").exists()
    with pytest.raises(FileNotFoundError, match=r"trainer.save_state\(\)"):
        main(["plot", str(tmp_path / "missing")])
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": HISTORY[3:4]}))
    with pytest.raises(ValueError, match="nothing to plot"):
        main(["plot", str(tmp_path)])


def test_plot_without_matplotlib_fails_before_it_reads(tmp_path, monkeypatch):
    from hf_packing.cli.plots import run_plot

    _without(monkeypatch, "matplotlib")
    with pytest.raises(ImportError, match=r"hf-packing plot needs matplotlib: pip install 'hf_packing\[cli\]'"):
        run_plot(tmp_path / "missing")


def test_demo_sources_are_rows_with_and_without_media():
    from datasets import Dataset

    from hf_packing.cli.demo import with_sources

    ds = Dataset.from_dict({"images": [["x.png"], [], None, ["a.png", "b.png"]], "messages": ["m"] * 4})
    tagged, column = with_sources(ds)
    assert column == "source" and tagged["source"] == ["images", "text", "text", "images"]
    assert with_sources(ds.select([0, 3]))[1] is None  # one kind only: untagged


@pytest.mark.slow
def test_demo_draws_per_source_curves(tmp_path):
    """The demo end to end, small: a two-source mix (rows with and without images), evaluated during training;
    curves.png holds both sources' training curves and the eval curve (about a minute on 2 loaded cores)."""
    import json

    from hf_packing.cli.plots import source_names

    out = tmp_path / "demo"
    summary = run_demo(DemoConfig(output_dir=out, num_samples=20, max_length=1024, epochs=1, eval_fraction=0.2))
    history = json.loads((out / "trainer" / "trainer_state.json").read_text())["log_history"]
    print(summary, source_names(history))
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"images", "text"} <= set(source_names(history))
    assert any("eval_images_loss" in h for h in history)
    assert set(summary["per-source loss (last log)"]) == {"images", "text"}


def test_stats_predicts_the_peak_and_whether_checkpointing_is_needed(tmp_path, capsys):
    """With a checkpoint's config, `hf-packing stats` prints the predicted peak of the largest pack (max_length
    tokens, max_vision_patches patches) and the checkpointing verdict for a GPU of the given memory; the state is a
    loaded model's own count and the activations `ActivationMemory`'s (held against autograd in test_memory.py)."""
    path = save_tiny_checkpoint("qwen2_5_vl", tmp_path / "ckpt")
    args = [_jsonl(tmp_path / "a.jsonl", 4), "--processor", str(FIXTURES / "qwen2_5_vl"), "--model", str(path)]
    settings = ["--max-length", "4096", "--max_vision_patches", "1024", "--output", str(tmp_path / "h.png")]
    peak = predict_peak(build_tiny_model("qwen2_5_vl").config, PackingConfig(max_length=4096, max_vision_patches=1024))
    model = build_tiny_model("qwen2_5_vl").to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    assert (peak["weights"], peak["grads"], peak["optimizer"]) == (2 * params, 2 * params, 4 * params)
    memory = ActivationMemory.from_model(model)
    assert peak["activations"] == memory.saved_bytes(tokens=4096, patches=1024)
    assert peak["activations_ckpt"] == memory.saved_bytes(tokens=4096, patches=1024, checkpointing=True)
    state = peak["weights"] + peak["grads"] + peak["optimizer"]
    verdicts = {
        (state + peak["activations"]) / 2**30 * 1.01: "not needed",
        (state + peak["activations_ckpt"]) / 2**30 * 1.01: "needed: turn gradient checkpointing on",
        state / 2**30: "does not fit",
    }
    for gib, verdict in verdicts.items():
        assert main(["stats", *args, *settings, "--gpu_memory_gib", str(gib)]) == 0
        out = capsys.readouterr().out
        assert "predicted peak per GPU, largest pack (4,096 tokens, 1,024 vision patches" in out
        assert f"gradient checkpointing on a {gib:g} GiB GPU: {verdict}" in out
