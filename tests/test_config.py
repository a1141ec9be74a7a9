"""`PackingConfig`: one typed dataclass for every `pack_dataset` setting, read by `HfArgumentParser` from YAML or a
command line, resolved with keyword overrides, and the only place any setting's default is declared."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
from pathlib import Path

import pytest
import yaml
from datasets import Dataset
from transformers import HfArgumentParser

from hf_packing import PackingConfig
from hf_packing.packing.dataset import pack_dataset
from tests.helpers import load_processor

ROOT = Path(__file__).resolve().parents[1]
NAMES = PackingConfig.names()
DEFAULTS = {f.name: f.default for f in dataclasses.fields(PackingConfig)}
#: a config with every field off its default: ints, optional ints, strings, Literals, a bool, dicts, lists, JSON dicts
CUSTOM = PackingConfig(
    max_length=4096,
    strategy="next_fit",
    max_images=3,
    max_vision_patches=1024,
    buffer_size=50,
    seed=7,
    weights=[3.0, 1.0],
    media_root={"a": "/data/a", "b": "/data/b"},
    video_root="/frames",
    fps=[2.0, 1.0],
    videos_kwargs={"fps": 1.0, "max_frames": 8},
    row_format={"a": "llava", "b": "messages"},
    chat_template_kwargs={"add_vision_id": True},
    empty_thinking="train",
    train_on="all",
    on_overlong="truncate_text",
    on_error="raise",
    batch_size=2,
    stopping_strategy="all_exhausted",
    max_image_pixels=1_000_000,
    media_timeout=2.5,
    media_tries=1,
    media_max_bytes=1_000_000,
    media_cache_bytes=0,
    disable_progress=True,
    leftovers="spread",
    balance_window=4,
    length_index="/tmp/index",
    index_num_proc=2,
    source_column="kind",
    max_skipped_fraction=0.5,
    skip_check_rows=100,
)
ROWS = [{"messages": [{"role": "user", "content": "hi " * n}, {"role": "assistant", "content": "ok"}]} for n in (3, 5)]


def command_line(config: PackingConfig) -> list[str]:
    """`config` as flags: a dict or list as JSON, a bool as true/false (None fields are left at their default)."""
    argv = []
    for name, value in dataclasses.asdict(config).items():
        if value is not None:
            text = (
                json.dumps(value)
                if isinstance(value, (dict, list))
                else str(value).lower()
                if isinstance(value, bool)
                else str(value)
            )
            argv += [f"--{name}", text]
    return argv


def test_custom_touches_every_field():
    assert [n for n in NAMES if getattr(CUSTOM, n) == DEFAULTS[n]] == []


def test_round_trip_through_hf_argument_parser_from_yaml(tmp_path):
    path = tmp_path / "packing.yaml"
    path.write_text(yaml.safe_dump(dataclasses.asdict(CUSTOM)))
    (parsed,) = HfArgumentParser(PackingConfig).parse_yaml_file(str(path))
    assert dataclasses.asdict(parsed) == dataclasses.asdict(CUSTOM)
    assert HfArgumentParser(PackingConfig).parse_yaml_file(str(path))[0] != PackingConfig()  # negative control


def test_round_trip_through_hf_argument_parser_from_a_command_line():
    parser = HfArgumentParser(PackingConfig)
    argv = command_line(CUSTOM)
    (parsed,) = parser.parse_args_into_dataclasses(argv)
    assert dataclasses.asdict(parsed) == dataclasses.asdict(CUSTOM)
    # Negative control: the flags arrive as strings; without __post_init__'s decoding they would not round-trip.
    raw = vars(parser.parse_args(argv))
    assert raw["media_root"] == json.dumps(CUSTOM.media_root) != CUSTOM.media_root and raw["fps"] == "[2.0, 1.0]"
    assert [n for n in NAMES if raw[n] != getattr(CUSTOM, n)] == [
        "weights",
        "media_root",
        "fps",
        "videos_kwargs",
        "row_format",
        "chat_template_kwargs",
    ]
    # the dash spellings, the former name `image_root` and False from Python read the same
    (dashed,) = parser.parse_args_into_dataclasses(
        ["--max-length", "64", "--image-root", "/r", "--length_index", "False"]
    )
    assert (dashed.max_length, dashed.media_root, dashed.length_index) == (64, "/r", "false")
    assert PackingConfig(length_index=False).length_index == "false" and PackingConfig(fps="2").fps == 2.0


def test_bad_values_name_the_field():
    for kwargs, match in (
        ({"on_error": "ignore"}, r"on_error must be one of \('skip', 'raise'\), got 'ignore'"),
        ({"strategy": "ffd"}, r"strategy must be one of \('next_fit', 'bfd'\)"),
        ({"batch_size": 0}, "batch_size must be >= 1, got 0"),
        ({"fps": "fast"}, "fps must be a number"),
        ({"media_root": '{"a": '}, "media_root=.* is not valid JSON"),
    ):
        with pytest.raises(ValueError, match=match):
            PackingConfig(**kwargs)
    PackingConfig(on_error="raise", strategy="next_fit", batch_size=1, fps="2.5")  # the same fields, valid


def test_overrides_resolve_into_the_config_and_unknown_ones_fail():
    processor = load_processor("qwen2_vl")
    config = PackingConfig(max_length=128, buffer_size=4, length_index=False)
    packs = pack_dataset(Dataset.from_list(ROWS), processor, config, buffer_size=2, image_root="/r")
    assert (packs.cfg.max_length, packs.cfg.buffer_size, packs.cfg.media_root) == (128, 2, "/r")
    assert config.buffer_size == 4 and config.media_root is None  # the caller's config is left alone
    keywords = pack_dataset(Dataset.from_list(ROWS), processor, max_length=128, buffer_size=2, length_index=False)
    assert dataclasses.asdict(keywords.cfg) == {**dataclasses.asdict(packs.cfg), "media_root": None}
    with pytest.raises(TypeError, match=r"unknown pack_dataset setting\(s\) \['max_lenght'\].*max_length, strategy"):
        pack_dataset(Dataset.from_list(ROWS), processor, max_lenght=128)
    with pytest.raises(ValueError, match="image_root is the former name of media_root"):
        pack_dataset(Dataset.from_list(ROWS), processor, media_root="/a", image_root="/b")
    with pytest.raises(TypeError, match="config must be a PackingConfig"):
        pack_dataset(Dataset.from_list(ROWS), processor, {"max_length": 128})


# ------------------------------------------------------------------------------------------------ one default each
RUNTIME = ("config", "rank", "world_size", "sequence_parallel_size", "model_config")  # pack_dataset's own arguments


def restated(source: str, where: str = "<source>") -> list[str]:
    """Where `source` declares a PackingConfig setting again: a dataclass field of the same name, a function argument
    or keyword argument of the same name set to the setting's default, or a hand-written command-line flag for it."""

    def is_default(name: str | None, value: ast.expr | None) -> bool:  # None: "not given", not a value restated
        return name in DEFAULTS and isinstance(value, ast.Constant) and value.value == DEFAULTS[name] is not None

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            found += [
                f"{where}:{s.lineno} field {s.target.id}"
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.target.id in NAMES
            ]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            positional = node.args.posonlyargs + node.args.args
            pairs = list(zip(positional[len(positional) - len(node.args.defaults) :], node.args.defaults))
            pairs += list(zip(node.args.kwonlyargs, node.args.kw_defaults))
            found += [f"{where}:{a.lineno} {a.arg}={d.value!r}" for a, d in pairs if is_default(a.arg, d)]
        elif isinstance(node, ast.Call):
            found += [
                f"{where}:{node.lineno} {k.arg}={k.value.value!r}" for k in node.keywords if is_default(k.arg, k.value)
            ]
            if isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
                flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                found += [f"{where}:{node.lineno} flag {f}" for f in flags if f.lstrip("-").replace("-", "_") in NAMES]
    return found


def test_no_setting_is_declared_twice():
    """pack_dataset declares no setting (it takes them as **overrides); the recipe, the CLI and the demo declare none
    again. Negative control: each kind of restatement is found in a snippet."""
    parameters = inspect.signature(pack_dataset).parameters
    assert not set(parameters) & set(NAMES)
    assert [n for n, p in parameters.items() if p.default is not inspect.Parameter.empty] == list(RUNTIME)
    assert not set(RUNTIME) & set(NAMES)
    files = [ROOT / "recipes" / "train.py", *sorted((ROOT / "hf_packing" / "cli").glob("*.py"))]
    files += [
        ROOT / "hf_packing" / name
        for name in ("packing/dataset.py", "preprocess/preprocessor.py", "packing/planner.py")
    ]  # the layers below
    assert len(files) >= 8
    assert [hit for path in files for hit in restated(path.read_text(), path.name)] == []
    snippet = """
class Args:
    max_length: int = 8192
def pack(ds, buffer_size=1000, seed=3): ...
pack_dataset(ds, processor, strategy="bfd", max_length=2048, media_root=None)
parser.add_argument("--max-images", type=int, default=16)
"""
    assert restated(snippet) == [
        "<source>:3 field max_length",
        "<source>:4 buffer_size=1000",
        "<source>:5 strategy='bfd'",  # max_length=2048 and seed=3 are choices, media_root=None "not given"
        "<source>:6 flag --max-images",
    ]
