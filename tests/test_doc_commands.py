"""Every command line of README.md, docs/ and recipes/README.md (```bash blocks and inline `python ...`,
`accelerate launch ...`, `hf-packing ...`, `make ...`, `pip install ...` and `--flag` spans) works as written.

What "works" means per kind (a line that needs GPUs or several hosts cannot run here, so it is checked by the
launcher's own validation and the script's own argument parsing, as far as a launch gets before any device):

- ``python -c ...``, ``hf-packing stats ...``: run, offline on CPU (``hf-packing X`` alone, in prose: X is a command).
- ``python recipes/train.py recipes/configs/tiny_cpu.yaml``: run (2 steps + evaluation) in a directory prepared as
  the smoke-test section says (the tiny checkpoint, ``data/tiny.jsonl`` of the section's LLaVA row, its image).
- ``python recipes/train.py CONFIG ...`` with a GPU config: train.py's own parser and settings checks (plus
  ``--use_cpu``: bf16 needs a GPU to validate).
- ``accelerate launch ...``: accelerate's launch parser and `_validate_launch_command` (which loads the config file),
  then train.py's parser on the script's arguments (``my_trl_sft.py`` is docs/trl.md's Python, run by
  tests/test_readme.py).
- ``hf-packing demo|plot ...``: the CLI's parser (a demo trains for minutes; plot needs a run).
- ``--flags``: accepted by train.py's parser, else accelerate launch's, else ``hf-packing stats``'s.
- ``make X``: ``make -n X`` (the target exists; running it builds a venv). ``pip install X``: each requirement
  parses and each ``hf_packing[extra]`` exists in pyproject.toml (installing needs the network).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import FIXTURES, ROOT, image

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "recipes" / "README.md"]
STARTS = ("python ", "accelerate launch ", "hf-packing ", "make ", "pip install ", "torchrun ", "--")
#: placeholders the docs write in capitals, and what stands for them here
PLACEHOLDERS = {
    "N": "2",
    "HOST0": "10.0.0.1",
    "JSON": '{"fps": 2}',
    "OUTPUT_DIR": "out",
    "CONFIG": "recipes/configs/qwen2_5_vl_3b.yaml",
}
SMOKE = "python recipes/train.py recipes/configs/tiny_cpu.yaml"
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}


def commands(page: Path) -> list[str]:
    """The command lines of `page`: each line of its ```bash blocks (continuations joined, comments dropped) and each
    inline code span that starts like a command, whitespace normalised."""
    text = page.read_text()
    found = []
    for block in re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            if shlex.split(line, comments=True):
                found.append(" ".join(line.split("#")[0].split()) if "#" in line else " ".join(line.split()))
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    found += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose) if span.startswith(STARTS)]
    return found


LINES = sorted({(str(page.relative_to(ROOT)), line) for page in PAGES for line in commands(page)})


@pytest.fixture(scope="module")
def train():
    spec = importlib.util.spec_from_file_location("recipes_train_docs", ROOT / "recipes" / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run(args: list[str], cwd: Path, timeout: float = 540) -> subprocess.CompletedProcess:
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def parses(parse, args: list[str]) -> bool:
    try:
        parse(args)
    except SystemExit:
        return False
    return True


def check_train_args(train, args: list[str]) -> None:
    """train.py's parser and settings checks on `args` (a YAML first, or flags); ``--use_cpu`` added, as bf16 needs a
    GPU to validate."""
    _, data, packing, training = train.parse_args([*args, "--use_cpu"])
    assert data.dataset_path or data.dataset_name, args
    train.prepare_training_args(training)


def check_accelerate(train, args: list[str], tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    parsed = launch_command_parser().parse_args(args)
    load_config_from_file(parsed.config_file)
    _validate_launch_command(parsed)
    if parsed.training_script == "recipes/train.py":
        check_train_args(train, [str(ROOT / a) if a.endswith(".yaml") else a for a in parsed.training_script_args])
    else:
        assert parsed.training_script == "my_trl_sft.py", parsed.training_script  # docs/trl.md's Python


def check_fragment(train, args: list[str]) -> None:
    from accelerate.commands.launch import launch_command_parser

    from hf_packing.cli import _parser

    base = ["--model_name_or_path", "m", "--output_dir", "o", "--dataset_path", "d.jsonl"]
    stats = ["stats", "d.jsonl", "--processor", "p"]
    assert (
        parses(lambda a: train.parse_args(base + a), args)
        or parses(lambda a: launch_command_parser().parse_args(["--config_file", "c.yaml", *a, "x.py"]), args)
        or parses(lambda a: _parser().parse_args(stats + a), args)
    ), f"no parser accepts {args}"


def smoke_directory(tmp_path: Path) -> Path:
    """What recipes/README.md's smoke test has before its last line: the tiny checkpoint, data/tiny.jsonl (its LLaVA
    row, 12 times: tiny_cpu.yaml holds 4 out for evaluation) and the image it names; recipes/ beside them."""
    from hf_packing.testing.tiny import save_tiny_checkpoint

    readme = (ROOT / "recipes" / "README.md").read_text()
    llava = json.loads(re.search(r"^```json\n(.*?)\n", readme, flags=re.M).group(1))
    save_tiny_checkpoint("qwen2_5_vl", tmp_path / "tiny-qwen2_5_vl")
    for name in llava["images"]:
        (tmp_path / "data" / name).parent.mkdir(parents=True, exist_ok=True)
        image(64, 48).save(tmp_path / "data" / name)
    (tmp_path / "data" / "tiny.jsonl").write_text((json.dumps(llava) + "\n") * 12)
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    return tmp_path


def test_the_docs_have_command_lines_of_every_kind():
    kinds = {line.split()[0] if not line.startswith("--") else "--" for _, line in LINES}
    assert {"python", "accelerate", "hf-packing", "make", "pip", "--"} <= kinds, kinds
    assert ("recipes/README.md", "--dataset_path a.jsonl b.parquet --weights 0.7 0.3") in LINES
    assert ("recipes/README.md", SMOKE) in LINES


@pytest.mark.parametrize(("page", "line"), LINES, ids=[f"{page}: {line[:70]}" for page, line in LINES])
def test_doc_command_line_works(train, tmp_path, page, line):
    raw = shlex.split(line)
    args = [PLACEHOLDERS.get(a, a) for a in raw]
    head = args[0]
    if head == "make":
        assert run(["make", "-n", *args[1:]], ROOT).returncode == 0
    elif head == "pip":
        from packaging.requirements import Requirement

        table = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
        extras = re.findall(r"^([\w-]+) = \[", table, flags=re.M)  # tomllib is 3.11+
        for spec in (a for a in args[2:] if not a.startswith("-")):
            requirement = Requirement(spec.replace(".[", "hf_packing[", 1) if spec.startswith(".[") else spec)
            if requirement.name == "hf_packing":
                assert requirement.extras <= set(extras), requirement
    elif head == "accelerate":
        check_accelerate(train, args[2:], tmp_path)
    elif head.startswith("--"):
        check_fragment(train, args)
    elif head == "hf-packing" and args[1:2] == ["stats"] and len(args) > 2:
        turns = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]
        (tmp_path / "d.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
        args = [{"DATA": "d.jsonl", "P": str(FIXTURES / "qwen2_vl"), "N": "4096"}.get(a, a) for a in raw]
        done = run([sys.executable, "-m", "hf_packing.cli", *args[1:]], tmp_path)
        assert done.returncode == 0 and "packs closed by" in done.stdout, done.stderr[-3000:]
    elif head == "hf-packing":
        from hf_packing.cli import _parser

        if len(args) == 2:  # the command's name, in prose
            assert args[1] in _parser()._subparsers._group_actions[0].choices
        else:
            _parser().parse_args(args[1:])
    elif head == "python" and args[1] == "-c":
        assert run([sys.executable, *args[1:]], tmp_path).returncode == 0
    elif line == SMOKE:
        done = run([sys.executable, *args[1:]], smoke_directory(tmp_path))
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        assert (tmp_path / "out" / "tiny_cpu" / "model.safetensors").exists()
    elif head == "python" and args[1] == "recipes/train.py":
        check_train_args(train, [str(ROOT / a) if a.endswith(".yaml") else a for a in args[2:]])
    else:
        pytest.fail(f"{page}: no check for {line!r}: add one")
