"""recipes/: every YAML parses, accelerate accepts its configs, and train.py trains 2 steps on CPU offline."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml

from tests.helpers import GLM_TYPES, MODEL_TYPES, torchrun, write_llava_jsonl

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
TRAIN_CONFIGS = sorted((RECIPES / "configs").glob("*.yaml"))
ACCELERATE_CONFIGS = sorted((RECIPES / "accelerate").glob("*.yaml"))
EXPECTED_TYPES = {
    "single_gpu": "NO",
    "ddp": "MULTI_GPU",
    "fsdp2": "FSDP",
    "deepspeed_zero2": "DEEPSPEED",
    "deepspeed_zero3": "DEEPSPEED",
    "multi_node": "FSDP",
    "sp": "FSDP",
}


@pytest.fixture(scope="module")
def train():
    spec = importlib.util.spec_from_file_location("recipes_train", RECIPES / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def test_every_file_is_there():
    assert {p.stem for p in TRAIN_CONFIGS} == {
        "qwen2_5_vl_3b",
        "qwen2_5_vl_7b",
        "qwen2_5_vl_7b_long_video",
        "qwen3_vl_8b",
        "qwen3_5_9b_long_video",
        "tiny_cpu",
    }
    assert {p.stem for p in ACCELERATE_CONFIGS} == set(EXPECTED_TYPES)
    assert (RECIPES / "README.md").exists()


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: p.stem)
def test_training_configs_parse_into_the_dataclasses(train, path):
    config = yaml.safe_load(path.read_text())
    assert isinstance(config, dict) and config["max_steps"] > 0
    # bf16 needs a GPU to validate; --use_cpu lets the GPU configs build their TrainingArguments here.
    model_args, data_args, packing, args = train.parse_args([str(path), "--use_cpu"])
    assert model_args.model_name_or_path == config["model_name_or_path"]
    assert data_args.dataset_path == config["dataset_path"] and packing.max_length == config["max_length"]
    if path.stem != "tiny_cpu":
        assert args.bf16 and args.gradient_checkpointing and model_args.dummy_vision  # both names set it on 5.23
        assert args.lr_scheduler_type == "cosine" and args.learning_rate in (1e-5, 2e-5) and args.warmup_steps > 0
        assert packing.max_length in (8192, 16384, 65536) and packing.max_vision_patches
        sp = model_args.sequence_parallel_size
        assert sp == (4 if path.stem.endswith("long_video") else 1) and packing.max_length // sp <= 16384


def test_cli_flags_override_the_yaml_and_unknown_keys_fail(train, tmp_path):
    _, _, packing, args = train.parse_args([str(RECIPES / "configs/tiny_cpu.yaml"), "--max_length", "128"])
    assert packing.max_length == 128 and args.max_steps == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_name_or_path: x\nlearnin_rate: 1.0e-5\n")
    with pytest.raises(ValueError, match="learnin_rate"):
        train.parse_args([str(bad)])


def test_prepare_training_args_forces_pack_settings(train, caplog):
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir="unused", use_cpu=True, per_device_train_batch_size=4, max_steps=3, report_to=[]
    )
    with caplog.at_level(logging.WARNING, logger="hf_packing.recipes"):
        args = train.prepare_training_args(args)
    assert "overridden to 1" in caplog.text and args.per_device_train_batch_size == 1
    assert args.remove_unused_columns is False
    assert args.accelerator_config.dispatch_batches is False and args.accelerator_config.split_batches is False
    assert args.accelerator_config.non_blocking is False  # use_cpu: transformers turns pinning off
    pinned = train.prepare_training_args(TrainingArguments(output_dir="unused", max_steps=3, report_to=[]))
    assert pinned.dataloader_pin_memory and pinned.accelerator_config.non_blocking  # copies not waited on
    with pytest.raises(ValueError, match="max_steps"):
        train.prepare_training_args(TrainingArguments(output_dir="unused", use_cpu=True, report_to=[]))


def test_gpu_memory_gib_turns_checkpointing_on_only_when_the_largest_pack_needs_it(train, tmp_path):
    """``gpu_memory_gib`` between the predicted peaks without and with checkpointing turns it on; above both it stays
    as set (off, or on when the user set it); below both the run stops naming the settings. The peaks are
    `predict_peak`'s (held against autograd's saved tensors in tests/test_memory.py)."""
    from transformers import AutoConfig, TrainingArguments

    from hf_packing.cli.stats import predict_peak
    from hf_packing.config import PackingConfig
    from hf_packing.testing.tiny import save_tiny_checkpoint

    path = str(save_tiny_checkpoint("qwen2_5_vl", tmp_path / "ckpt"))
    packing = PackingConfig(max_length=4096, max_vision_patches=2048)
    peak = predict_peak(AutoConfig.from_pretrained(path), packing)
    state = peak["weights"] + peak["grads"] + peak["optimizer"]
    off, on = ((state + peak[k]) / 2**30 for k in ("activations", "activations_ckpt"))

    def chosen(gib: float, **set_by_user) -> bool:
        args = TrainingArguments(output_dir="unused", use_cpu=True, max_steps=1, report_to=[], **set_by_user)
        model_args = train.ModelArguments(model_name_or_path=path, gpu_memory_gib=gib)
        train.choose_checkpointing(model_args, packing, args)
        return bool(args.gradient_checkpointing) and bool(getattr(args, "activation_checkpointing", True))

    assert chosen((off + on) / 2)
    assert not chosen(off * 1.01)
    assert chosen(off * 1.01, gradient_checkpointing=True)
    with pytest.raises(train.SettingError, match="max_length=4096, max_vision_patches=2048"):
        chosen(on * 0.99)


def test_per_source_data_settings_take_one_value_or_one_per_path(train):
    """PackingConfig's per-source settings from the YAML (image_root: media_root's alias) and flags (JSON lists);
    pack_dataset maps a list onto the sources in dataset_path order; eval files keep only what is one for all."""
    from hf_packing.preprocess.formats import per_source

    names = ["0:coco", "1:clips"]
    _, _, packing, _ = train.parse_args([str(RECIPES / "configs/tiny_cpu.yaml")])
    assert packing.media_root == "data"  # `image_root: data` in the YAML
    _, _, packing, _ = train.parse_args(
        [
            str(RECIPES / "configs/tiny_cpu.yaml"),
            "--media_root",
            '["/c", "/v"]',
            "--fps",
            "2",
            "--row_format",
            '["llava", "messages"]',
        ]
    )
    assert (packing.media_root, packing.fps, packing.row_format) == (["/c", "/v"], 2.0, ["llava", "messages"])
    assert per_source(packing.media_root, names, "media_root") == {"0:coco": "/c", "1:clips": "/v"}
    assert per_source(["/d"], names, "media_root") == {"0:coco": "/d", "1:clips": "/d"}
    with pytest.raises(ValueError, match=r"fps has 3 values for 2 source\(s\)"):
        per_source([1.0, 2.0, 3.0], names, "fps")
    assert [train.for_every_source(v) for v in (["/d"], ["/c", "/v"], {"0:coco": "/c"}, 2.0)] == ["/d", None, None, 2.0]


def test_load_one_reads_local_files_and_saved_dirs(train, tmp_path):
    import datasets

    rows = [{"messages": [{"role": "user", "content": "hi"}], "images": []}] * 3
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "p").mkdir()
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "p" / "0.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    assert len(train.load_one(str(tmp_path / "a.jsonl"), streaming=False)) == 3
    assert len(train.load_one(str(tmp_path / "p"), streaming=False)) == 3
    assert len(train.load_one(str(tmp_path / "saved"), streaming=False)) == 3
    assert len(list(train.load_one(str(tmp_path / "saved"), streaming=True))) == 3
    assert len(list(train.load_one(str(tmp_path / "a.jsonl"), streaming=True))) == 3
    with pytest.raises(FileNotFoundError):
        train.load_one(str(tmp_path / "missing.jsonl"), streaming=False)


def test_eval_rows_are_held_out_or_read_from_files(train, tmp_path):
    import datasets

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "images": []} for i in range(10)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    split = lambda value, **kw: train.DataArguments(dataset_path=[str(tmp_path / "a.jsonl")], eval_split=value, **kw)  # noqa: E731
    for streaming, value, n_eval in ((False, 0.2, 2), (False, 3, 3), (True, 3, 3)):
        sources = {"0:a": train.load_one(str(tmp_path / "a.jsonl"), streaming=streaming)}
        held = train.eval_sources(sources, split(value, streaming=streaming), seed=0)
        trained = {r["messages"][0]["content"] for r in sources["0:a"]}
        evaluated = {r["messages"][0]["content"] for r in held["0:a"]}  # under the source's name and settings
        assert len(evaluated) == n_eval and len(trained) == 10 - n_eval and not trained & evaluated
    with pytest.raises(ValueError, match="all 10 rows"):
        train.eval_sources({"0:a": datasets.Dataset.from_list(rows)}, split(10), seed=0)
    with pytest.raises(ValueError, match="number of rows"):
        train.eval_sources({"0:a": datasets.Dataset.from_list(rows).to_iterable_dataset()}, split(0.2), seed=0)
    files = train.eval_sources({}, train.DataArguments(eval_dataset_path=[str(tmp_path / "a.jsonl")] * 2), seed=0)
    assert list(files) == ["eval0:a", "eval1:a"] and all(len(ds) == 10 for ds in files.values())
    assert train.eval_sources({}, train.DataArguments(), seed=0) == {}
    with pytest.raises(ValueError, match="not both"):
        train.eval_sources({}, split(0.2, eval_dataset_path=[str(tmp_path / "a.jsonl")]), seed=0)


# ------------------------------------------------------------------------------------------ accelerate
def _launch_env(path: Path) -> tuple[object, dict[str, str]]:
    """What `accelerate launch --config_file path` validates and exports, without launching."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    args, defaults, mp_from_config = _validate_launch_command(
        launch_command_parser().parse_args(["--config_file", str(path), "recipes/train.py"])
    )
    if args.use_deepspeed:  # as launch_command does before deepspeed_launcher
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        return args, prepare_deepspeed_cmd_env(args)[1]
    if args.use_fsdp or args.multi_gpu:
        return args, prepare_multi_gpu_env(args)
    return args, prepare_simple_launcher_cmd_env(args)[1]


def test_list_flags_take_several_values_or_json(train):
    """recipes/README.md's ``--dataset_path a.jsonl b.parquet --weights 0.7 0.3`` (the usage error of #31) and its
    JSON spelling give the same weights; other per-source flags take several values too, one value stays one."""
    base = ["--model_name_or_path", "m", "--output_dir", "o", "--dataset_path", "a.jsonl", "b.parquet"]
    for flags in (["--weights", "0.7", "0.3"], ["--weights", "[0.7, 0.3]"]):
        _, data, packing, _ = train.parse_args([*base, *flags])
        assert packing.weights == [0.7, 0.3] and data.dataset_path == ["a.jsonl", "b.parquet"]
    _, _, packing, _ = train.parse_args([*base, "--media_root", "/a", "/b", "--fps", "2", "1", "--row_format", "llava"])
    assert (packing.media_root, packing.fps, packing.row_format) == (["/a", "/b"], [2.0, 1.0], "llava")
    with pytest.raises(ValueError, match="weights must be numbers"):
        train.parse_args([*base, "--weights", "0.7", "many"])


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.stem)
def test_accelerate_loads_and_launch_accepts_the_configs(path):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    config = load_config_from_file(str(path))  # rejects unknown top-level keys
    assert isinstance(config, ClusterConfig) and config.distributed_type.value == EXPECTED_TYPES[path.stem]
    assert config.mixed_precision == "bf16"
    # `accelerate launch` copies nested keys onto its namespace without checking them: check them here.
    launch_flags = {action.dest for action in launch_command_parser()._actions}
    nested = [k if k.startswith("fsdp_") else f"fsdp_{k}" for k in (config.fsdp_config or {})]
    nested += list(config.deepspeed_config or {})
    assert set(nested) <= launch_flags, set(nested) - launch_flags

    args, env = _launch_env(path)
    assert args.num_processes == (16 if path.stem == "multi_node" else 1 if path.stem == "single_gpu" else 8)
    with mock.patch.dict(os.environ, env, clear=True):  # the plugins the Trainer's Accelerator will build
        if args.use_fsdp:
            plugin = FullyShardedDataParallelPlugin()
            assert plugin.fsdp_version == 2 and plugin.cpu_ram_efficient_loading
            assert plugin.transformer_cls_names_to_wrap == ["Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock"]
            assert plugin.activation_checkpointing is False  # the Trainer's activation_checkpointing does it
        if args.use_deepspeed:
            ds = DeepSpeedPlugin().deepspeed_config
            assert ds["zero_optimization"]["stage"] == int(path.stem[-1])
            # left "auto" so the Trainer fills them from the training config: the two can never disagree
            assert ds["gradient_accumulation_steps"] == "auto" and ds["gradient_clipping"] == "auto"
    if path.stem == "multi_node":
        assert (config.num_machines, config.main_process_port) == (2, 29500) and config.main_process_ip


def test_fsdp_wrap_classes_exist_in_transformers():
    import transformers

    fsdp = yaml.safe_load((RECIPES / "accelerate/fsdp2.yaml").read_text())["fsdp_config"]
    names = fsdp["fsdp_transformer_layer_cls_to_wrap"].split(",")
    assert transformers.Qwen2_5_VLForConditionalGeneration._no_split_modules == names


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize(
    ("model_type", "precision"),
    [("qwen2_5_vl", []), ("qwen2_5_vl", ["--bf16", "true"]), ("glm4v", ["--bf16", "true"])],
    ids=["fp32", "fp32+bf16_autocast", "glm4v-fp32+bf16_autocast"],
)
def test_train_py_runs_two_steps_on_cpu_offline(train, tmp_path, monkeypatch, model_type, precision):
    """tiny_cpu: 2 training steps on 12 rows, each followed by an evaluation on the 4 rows held out; with ``--bf16
    true`` (the recipes' GPU setup) too, where the evaluation must still report eval_token_accuracy; and a tiny GLM-4.1V
    checkpoint (its own processor and template) in the recipes' setup."""
    try:
        from hf_packing.packing.dataset import pack_dataset  # noqa: F401
    except ImportError as error:
        pytest.skip(f"hf_packing.packing.dataset.pack_dataset is not importable yet ({error}); train.py needs it")
    from hf_packing.testing.tiny import save_tiny_checkpoint

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model_dir = save_tiny_checkpoint(model_type, tmp_path / "tiny")
    data = write_llava_jsonl(tmp_path / "data")
    trainer = train.main(
        [
            str(RECIPES / "configs/tiny_cpu.yaml"),
            "--model_name_or_path",
            str(model_dir),
            "--dataset_path",
            str(data),
            "--image_root",
            str(tmp_path / "data" / "images"),
            "--output_dir",
            str(tmp_path / "out"),
            *precision,
        ]
    )
    assert trainer.state.global_step == 2
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    for key in ("tokens_per_s", "padding_ratio", "pack_fill", "images_per_step", "tflops_per_s_per_device"):
        assert all(f"packing/{key}" in h for h in logs), key
    assert all(0 < h["packing/pack_fill"] <= 1 for h in logs)
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]  # tiny_cpu: 4 rows held out, eval every step
    assert len(evals) == 2 and all(math.isfinite(h["eval_loss"]) and 0 <= h["eval_token_accuracy"] <= 1 for h in evals)
    assert trainer.eval_dataset.stats(log=False)["samples"] == 4
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_train_py_fails_loudly_when_no_row_is_usable(train, tmp_path, monkeypatch):
    """Rows whose video files cannot be read are all skipped: the run must stop with the reason, not save an
    untrained model and exit 0."""
    from hf_packing.testing.tiny import save_tiny_checkpoint

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model_dir = save_tiny_checkpoint("qwen2_5_vl", tmp_path / "tiny")
    (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")  # not a video
    row = {
        "video": "clip.mp4",
        "conversations": [{"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "It rains."}],
    }
    (tmp_path / "videos.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="yielded 0 of 2 rows: 2 corrupt_video"):
        train.main(
            [
                str(RECIPES / "configs/tiny_cpu.yaml"),
                "--model_name_or_path",
                str(model_dir),
                "--dataset_path",
                str(tmp_path / "videos.jsonl"),
                "--image_root",
                str(tmp_path),
                "--output_dir",
                str(tmp_path / "out"),
                "--eval_split",
                "0",
                "--eval_strategy",
                "no",
            ]
        )
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.multiproc
def test_train_py_on_two_processes_trains_evaluates_and_exits_0(tmp_path):
    """`torchrun --nproc_per_node 2 recipes/train.py` (gloo): both ranks train, evaluate and save, then end the run
    with `end_distributed`, so the job exits 0 instead of aborting at interpreter exit (SIGABRT, exit code -6)."""
    from hf_packing.testing.tiny import save_tiny_checkpoint

    model_dir = save_tiny_checkpoint("qwen2_5_vl", tmp_path / "tiny")
    data = write_llava_jsonl(tmp_path / "data")
    args = ["--model_name_or_path", str(model_dir), "--dataset_path", str(data)]
    args += ["--image_root", str(tmp_path / "data" / "images"), "--output_dir", str(tmp_path / "out")]
    proc = torchrun(RECIPES / "train.py", str(RECIPES / "configs/tiny_cpu.yaml"), *args, timeout=300)
    assert proc is not None, "recipes/train.py on 2 processes hung past 300 s"
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "terminate called" not in proc.stderr
    assert proc.stdout.count("'eval_loss'") == 2, proc.stdout[-2000:]  # evaluated after each of the 2 steps
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_a_mistyped_dataset_path_is_a_setting_error_naming_it(train, tmp_path):
    """A dataset_path / eval_dataset_path that does not exist stops the run before the processor or model loads,
    with an error naming the setting and the closest file names (run as a script: that line, no traceback)."""
    real = write_llava_jsonl(tmp_path / "data")
    typo = real.with_name("trian.jsonl")
    base = [str(RECIPES / "configs/tiny_cpu.yaml"), "--model_name_or_path", str(tmp_path / "no-model")]
    base += ["--output_dir", str(tmp_path / "out")]
    with pytest.raises(
        train.SettingError,
        match=rf"^dataset_path: '{re.escape(str(typo))}' does not exist.*did you mean '{re.escape(str(real))}'",
    ):
        train.main([*base, "--dataset_path", str(typo)])
    with pytest.raises(train.SettingError, match=r"^eval_dataset_path: .*nothing\*\.jsonl' does not exist"):
        train.main([*base, "--dataset_path", str(real), "--eval_dataset_path", str(tmp_path / "nothing*.jsonl")])
    assert issubclass(train.SettingError, ValueError)
    assert "except SettingError" in (RECIPES / "train.py").read_text()


# ------------------------------------------------------------------------------------------ datasets by name
def saved_llava_splits(tmp_path: Path) -> Path:
    """write_llava_jsonl's 16 rows as a saved DatasetDict: 12 in ``train``, 4 in ``test``."""
    import datasets

    rows = datasets.load_dataset("json", data_files=str(write_llava_jsonl(tmp_path / "data")), split="train")
    splits = datasets.DatasetDict({"train": rows.select(range(12)), "test": rows.select(range(12, 16))})
    splits.save_to_disk(str(tmp_path / "saved"))
    return tmp_path / "saved"


def test_dataset_name_trains_from_a_local_dataset_directory_offline(train, tmp_path, monkeypatch):
    """TRL's `--dataset_name` on a saved DatasetDict, offline: the flag replaces the YAML's dataset_path, the train
    split trains and, with eval_strategy on and no eval_split, the test split is evaluated, row for row."""
    from hf_packing.testing.tiny import save_tiny_checkpoint

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model_dir = save_tiny_checkpoint("qwen2_5_vl", tmp_path / "tiny")
    saved = saved_llava_splits(tmp_path)
    trainer = train.main(
        [
            str(RECIPES / "configs/tiny_cpu.yaml"),  # dataset_path: [data/tiny.jsonl], which does not exist here
            *("--model_name_or_path", str(model_dir), "--dataset_name", str(saved), "--eval_split", "0"),
            *("--image_root", str(tmp_path / "data" / "images"), "--output_dir", str(tmp_path / "out")),
        ]
    )
    assert trainer.state.global_step == 2
    assert trainer.train_dataset.stats(log=False)["rows_read"] == 12  # the train split, read to its end
    assert trainer.eval_dataset.stats(log=False)["samples"] == 4  # the test split, every row
    assert len([h for h in trainer.state.log_history if "eval_loss" in h]) == 2
    with pytest.raises(train.SettingError, match=r"^set dataset_path \(local files\) or dataset_name .*, not both"):
        train.main(
            [
                str(RECIPES / "configs/tiny_cpu.yaml"),
                *("--model_name_or_path", str(tmp_path / "no-model"), "--dataset_name", str(saved)),
                *("--dataset_path", str(tmp_path / "data" / "train.jsonl"), "--output_dir", str(tmp_path / "o")),
            ]
        )
    with pytest.raises(train.SettingError, match=r"^dataset_test_split='validation' is not a split of .*'test'"):
        train.main(
            [
                str(RECIPES / "configs/tiny_cpu.yaml"),
                *("--model_name_or_path", str(tmp_path / "no-model"), "--dataset_name", str(saved)),
                *("--eval_split", "0", "--dataset_test_split", "validation", "--output_dir", str(tmp_path / "o")),
            ]
        )


@pytest.mark.parametrize("streaming", [False, True])
def test_dataset_name_reads_a_directory_of_data_files_by_split(train, tmp_path, streaming):
    """A Hub-style directory (data/train-*.parquet, data/test-*.parquet) by name: each split's own rows, as
    `datasets.load_dataset` reads them; a config it does not have is a SettingError naming dataset_config."""
    import datasets

    (tmp_path / "hub" / "data").mkdir(parents=True)
    for split, n in (("train", 5), ("test", 2)):
        rows = [{"messages": [{"role": "user", "content": f"{split} {i}"}]} for i in range(n)]
        datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "hub" / "data" / f"{split}-00000.parquet"))
    args = train.DataArguments(dataset_name=str(tmp_path / "hub"), streaming=streaming)
    for setting, n in (("dataset_train_split", 5), ("dataset_test_split", 2)):
        ds = train.load_named(args, setting)
        assert isinstance(ds, datasets.IterableDataset) == streaming
        assert [r["messages"][0]["content"] for r in ds] == [f"{setting.split('_')[1]} {i}" for i in range(n)]
    args.dataset_config = "nope"
    with pytest.raises(train.SettingError, match=r"^dataset_config='nope' is not a configuration of"):
        train.load_named(args, "dataset_train_split")
    # a saved DatasetDict streams too; a directory without data and a data file are named as what they are
    saved = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"messages": []}] * 3)})
    saved.save_to_disk(str(tmp_path / "saved"))
    ds = train.load_named(
        train.DataArguments(dataset_name=str(tmp_path / "saved"), streaming=streaming), "dataset_train_split"
    )
    assert isinstance(ds, datasets.IterableDataset) == streaming and len(list(ds)) == 3
    (tmp_path / "empty").mkdir()
    with pytest.raises(train.SettingError, match=r"^dataset_name: '.*empty' is a directory that datasets cannot read"):
        train.load_named(train.DataArguments(dataset_name=str(tmp_path / "empty")), "dataset_train_split")
    parquet = str(tmp_path / "hub" / "data" / "test-00000.parquet")
    with pytest.raises(train.SettingError, match=r"is a file; data files go in dataset_path"):
        train.load_named(train.DataArguments(dataset_name=parquet), "dataset_train_split")


def test_a_dataset_name_not_in_the_cache_fails_offline_in_one_line_naming_it(tmp_path):
    """Run as a script, offline: a Hub id that is not cached is one line on stderr naming it and what to do, exit
    status 1, before any model loads (the model path does not exist either)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    env["PYTHONPATH"] = os.pathsep.join([str(RECIPES.parent), env.get("PYTHONPATH", "")])
    args = ["--model_name_or_path", str(tmp_path / "no-model"), "--dataset_name", "someone/no-such-dataset"]
    done = subprocess.run(
        [sys.executable, str(RECIPES / "train.py"), str(RECIPES / "configs/tiny_cpu.yaml"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[0].startswith("train.py: dataset_name: 'someone/no-such-dataset' is not a local dataset directory")
    assert "download it once with network access" in lines[0]


# ------------------------------------------------------------------------------------------ LLaMA-Factory configs
LLAMA_FACTORY_YAML = """\
### model
model_name_or_path: Qwen/Qwen2.5-VL-7B-Instruct
image_max_pixels: 262144
video_max_pixels: 16384
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

### dataset
dataset: mllm_demo,identity
template: qwen2_vl
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
buffer_size: 16384

### output
output_dir: saves/qwen2_5vl-7b/lora/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
val_size: 0.1
"""


def test_a_llama_factory_yaml_names_each_key_with_its_equivalent_in_one_error(train, tmp_path):
    """LLaMA-Factory's Qwen2.5-VL LoRA example as written: one ValueError (no argparse traceback) that names every
    key this parser lacks with the setting to write instead; the rewritten file parses into those settings."""
    path = tmp_path / "lf.yaml"
    path.write_text(LLAMA_FACTORY_YAML)
    with pytest.raises(train.SettingError) as err:  # run as a script: this one line, no traceback
        train.parse_args([str(path)])
    message = str(err.value)
    for key, equivalent in (
        ("cutoff_len", "max_length"),
        ("dataset", "dataset_path"),
        ("finetuning_type", "use_lora: true"),
        ("lora_rank", "lora_r"),
        ("lora_target", "lora_target_modules"),
        ("val_size", "eval_split"),
        ("warmup_ratio", "warmup_steps"),
        ("video_max_pixels", "videos_kwargs"),
        ("preprocessing_num_workers", "index_num_proc"),
    ):
        assert f"{key} -> {equivalent}" in message, key
    for key in ("image_max_pixels", "trust_remote_code", "stage", "template", "max_samples", "plot_loss"):
        assert f"{key} -> " in message, key
    assert "buffer_size here is the packer's planning window" in message  # same name, another meaning
    assert "freeze_vision_tower is true there, false here; lora_alpha is 2 x lora_rank there" in message
    assert "unknown keys in the config file" not in message  # every unknown key is LLaMA-Factory's
    assert message.count("\n") == 0
    rewritten = tmp_path / "ours.yaml"  # each line rewritten as the message says
    rewritten.write_text(
        "model_name_or_path: Qwen/Qwen2.5-VL-7B-Instruct\nuse_lora: true\nlora_r: 8\n"
        "dataset_path: [data/mllm_demo.json]\nmax_length: 2048\neval_split: 0.1\nwarmup_steps: 0.1\n"
        'videos_kwargs: {"max_pixels": 16384}\nindex_num_proc: 16\noutput_dir: out\nmax_steps: 10\n'
        "per_device_train_batch_size: 1\ngradient_accumulation_steps: 8\nlearning_rate: 1.0e-4\n"
        "lr_scheduler_type: cosine\nddp_timeout: 180000000\ndo_train: true\n"
    )
    model_args, data_args, packing, args = train.parse_args([str(rewritten), "--use_cpu"])
    assert (model_args.use_lora, model_args.lora_r, packing.max_length, data_args.eval_split) == (True, 8, 2048, 0.1)
    assert packing.videos_kwargs == {"max_pixels": 16384} and args.warmup_steps == 0.1
    # a key that is neither ours nor LLaMA-Factory's is still named as unknown, beside them
    path.write_text(LLAMA_FACTORY_YAML + "learnin_rate: 1.0\n")
    with pytest.raises(
        ValueError,
        match=r"^unknown keys in the config file: \['learnin_rate'\] \(closest: learnin_rate -> learning_rate\?\)\. "
        "LLaMA-Factory keys",
    ):
        train.parse_args([str(path)])


@pytest.mark.parametrize("mode", ["rows", "flat"])
@pytest.mark.parametrize("model_type", MODEL_TYPES + GLM_TYPES)
def test_the_collators_batch_is_pinnable_every_tensor_nested_ones_too(model_type, mode, monkeypatch):
    """The recipes pin the batch (``dataloader_pin_memory``) and copy it with ``non_blocking``: torch's DataLoader
    pinning (``pin_memory`` of ``torch.utils.data``) must reach every tensor of the collator's batch, the nested
    ``vision_inputs`` too, each a dense CPU tensor, and give the batch back in the same structure. Pinning needs an
    accelerator, so ``Tensor.pin_memory`` is a recording stand-in here."""
    from torch.utils.data._utils.pin_memory import pin_memory

    from hf_packing import VisionCollator
    from hf_packing.testing.tiny import tiny_config
    from tests.helpers import load_processor, processed_samples

    processor = load_processor(model_type)
    batch = VisionCollator(processor, mode=mode, model_config=tiny_config(model_type))(processed_samples(processor))
    assert "vision_inputs" in batch and any(isinstance(v, torch.Tensor) for v in batch["vision_inputs"].values())

    def tensors(obj, path=""):
        if isinstance(obj, torch.Tensor):
            yield path, obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                yield from tensors(v, f"{path}.{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                yield from tensors(v, f"{path}[{i}]")
        else:
            assert obj is None or isinstance(obj, (int, float, bool, str)), (path, type(obj))

    before = dict(tensors(batch))
    for path, t in before.items():
        assert t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous(), path
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a, **k: pinned.append(t) or t.clone())
    out = pin_memory(batch)
    assert sorted(map(id, pinned)) == sorted(map(id, before.values()))  # every tensor, once
    after = dict(tensors(out))
    assert after.keys() == before.keys() and type(out) is type(batch)
    for path, t in after.items():
        assert torch.equal(t, before[path]), path
    assert {k: v for k, v in out.items() if not isinstance(v, (torch.Tensor, dict))} == {
        k: v for k, v in batch.items() if not isinstance(v, (torch.Tensor, dict))
    }
