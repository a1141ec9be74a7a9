"""The README and docs/ stay true: every ```python block runs as written (a fresh process, an empty directory, CPU,
offline), every relative link resolves, every docs/ page is linked from the README, the README's tree (at most
40 lines) names every part of the package and nothing that is not there, and the file maps below it name every file:
each part's ``__init__`` docstring (its ``Files:`` section) its modules, benchmarks/README.md and recipes/README.md
their scripts."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    (f"{page.relative_to(ROOT)}-{i}", block)
    for page in PAGES
    for i, block in enumerate(re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M))
]
#: what the README's tree must cover: the package's own modules and each part (its ``__init__.py``), by path relative
#: to the repository root; a part's files are mapped by its docstring (`part_map_problems`)
TREE_COVERS = ("hf_packing/*.py", "hf_packing/*/__init__.py")
#: the README's tree is an overview: the per-file maps live with the files
TREE_MAX_LINES = 40
#: the repository's folders, each a line of the tree
ROOT_FOLDERS = {"hf_packing/", "recipes/", "benchmarks/", "docs/", "tests/"}


def test_the_readme_has_python_blocks_and_the_first_trains():
    assert BLOCKS and BLOCKS[0][0] == "README.md-0" and ".train()" in BLOCKS[0][1]
    assert any(name.startswith("docs/trl.md") and "SFTTrainer" in block for name, block in BLOCKS)


@pytest.mark.parametrize("name", [name for name, _ in BLOCKS])
def test_readme_python_block_runs_as_written(tmp_path, name):
    """The README's first block (the Trainer example) must train a step and evaluate: its log lines carry
    train_loss and eval_token_accuracy."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "CUDA_VISIBLE_DEVICES": "",
    }
    (tmp_path / "block.py").write_text(dict(BLOCKS)[name])
    proc = subprocess.run(
        [sys.executable, "block.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    if name == "README.md-0":
        print(re.findall(r"\{'(?:eval|train)_.*?\}", proc.stdout + proc.stderr))
        assert "'train_loss'" in proc.stdout + proc.stderr and "'eval_token_accuracy'" in proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------------ links and the tree


def anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` (``[text](target)``, ``target#anchor``) whose file or heading is missing."""
    text = page.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto: — not checked offline
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif fragment and file.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", file.read_text(), flags=re.M)
            if fragment not in {anchor(h) for h in headings}:
                broken.append(target)
    return broken


def tree_block(readme: str) -> str:
    """The ```-block of the README's "## Layout" section (a paragraph may come before it)."""
    match = re.search(r"^## Layout\n(?:(?!^#).)*?^```\n(.*?)^```", readme, flags=re.S | re.M)
    assert match, 'the README has no "## Layout" section with a ```-block'
    return match.group(1)


def tree_entries(readme: str) -> list[str]:
    """The paths (relative to the root, globs allowed) named by the ```-block of the README's "## Layout" section:
    a line without indent names a root folder (``recipes/``) or a root file; indented lines name files in the folder
    above them, two spaces a level, and an indented ``name/`` line opens a subpackage and names its ``__init__.py``."""
    entries, folders = [], [""]
    for line in tree_block(readme).splitlines():
        if not line.strip():
            continue
        name, depth = line.split()[0], (len(line) - len(line.lstrip())) // 2
        if depth == 0:
            folders = [name if name.endswith("/") else ""]
            entries.append(name)
            continue
        folders = folders[:depth]
        path = "".join(folders) + name
        if name.endswith("/"):
            folders.append(name)
            path += "__init__.py"
        entries.append(path)
    return entries


def file_map(text: str) -> list[str]:
    """The file names a map lists: the first word of each line ``    name.ext   what it holds`` (4-space indent)."""
    return re.findall(r"^    ([\w.]+\.(?:py|sh))\s", text, flags=re.M)


def part_map_problems(package: Path) -> tuple[list[str], list[str]]:
    """(map entries that name no file, modules no map names) over ``package``'s ``__init__`` and each part's: the
    ``Files:`` section of each ``__init__`` docstring lists the modules beside it (``__init__.py`` itself aside)."""
    stale, missing = [], []
    for init in [package / "__init__.py", *sorted(package.glob("*/__init__.py"))]:
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        listed = set(file_map(doc.partition("\nFiles:\n")[2]))
        modules = {p.name for p in init.parent.glob("*.py")} - {"__init__.py"}
        stale += [str(init.parent / name) for name in sorted(listed - modules)]
        missing += [str(init.parent / name) for name in sorted(modules - listed)]
    return stale, missing


def tree_problems(root: Path, entries: list[str], covers: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(entries that name no existing file, files under ``covers`` that no entry names)."""
    stale = [e for e in entries if not (list(root.glob(e)) if "*" in e else (root / e).exists())]
    named = {p.resolve() for e in entries for p in (root.glob(e) if "*" in e else [root / e])}
    files = {p.resolve() for pattern in covers for p in root.glob(pattern) if "__pycache__" not in p.parts}
    missing = sorted(str(p.relative_to(root.resolve())) for p in files - named)
    return stale, missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert not broken_links(page), broken_links(page)


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages and [p.name for p in pages if f"](docs/{p.name})" not in readme] == []


def test_the_readme_tree_names_every_part_and_only_what_exists():
    readme = (ROOT / "README.md").read_text()
    lines = tree_block(readme).splitlines()
    assert len(lines) <= TREE_MAX_LINES, f"the README's tree has {len(lines)} lines (at most {TREE_MAX_LINES})"
    stale, missing = tree_problems(ROOT, tree_entries(readme), TREE_COVERS)
    assert not stale, f"the README's tree names files that do not exist: {stale}"
    assert not missing, f"parts or modules missing from the README's tree (one line each): {missing}"
    assert not ROOT_FOLDERS - set(tree_entries(readme)), ROOT_FOLDERS - set(tree_entries(readme))


def test_each_part_maps_its_files():
    """Each ``__init__`` docstring's ``Files:`` section names every module of its part and only those; the benchmarks'
    and the recipes' READMEs name each of their scripts."""
    stale, missing = part_map_problems(ROOT / "hf_packing")
    assert not stale, f"``Files:`` entries naming no module: {stale}"
    assert not missing, f"modules missing from their part's ``__init__`` docstring (``Files:``): {missing}"
    for folder in ("benchmarks", "recipes"):
        text = (ROOT / folder / "README.md").read_text()
        scripts = sorted(p.name for pattern in ("*.py", "*.sh") for p in (ROOT / folder).glob(pattern))
        assert scripts and [name for name in scripts if name not in text] == [], folder


def test_the_checks_find_a_missing_file_a_stale_entry_and_a_broken_link(tmp_path):
    """Negative control on a tiny repository: a module left out of the tree, an entry for a deleted file, a link to
    a missing page and one to a missing heading."""
    (tmp_path / "pkg").mkdir()
    for name in ("a.py", "b.py"):
        (tmp_path / "pkg" / name).write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text("# Topic X\n")
    readme = "## Layout\n\n```\npkg/\n  a.py    one\n  gone.py deleted\ndocs/*.md   pages\nMakefile\n```\n"
    (tmp_path / "README.md").write_text(readme + "[x](docs/x.md) [x](docs/x.md#topic-x) [y](docs/y.md) [z](#nope)\n")
    entries = tree_entries(readme)
    assert entries == ["pkg/", "pkg/a.py", "pkg/gone.py", "docs/*.md", "Makefile"]
    stale, missing = tree_problems(tmp_path, entries, ("pkg/*.py", "docs/*.md"))
    assert stale == ["pkg/gone.py", "Makefile"] and missing == ["pkg/b.py"]
    long = "## Layout\n\nParts.\n\n```\n" + "".join(f"f{i}.py  x\n" for i in range(41)) + "```\n"
    assert len(tree_block(long).splitlines()) == 41 > TREE_MAX_LINES
    assert broken_links(tmp_path / "README.md") == ["docs/y.md", "#nope"]
    assert anchor("Sequence parallelism (Ulysses) for packs") == "sequence-parallelism-ulysses-for-packs"


def test_the_part_map_check_finds_a_missing_and_a_stale_entry(tmp_path):
    """Negative control: a part whose ``Files:`` section leaves out a module and names a deleted one."""
    pkg = tmp_path / "pkg"
    (pkg / "part").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""The package.\n\nFiles:\n    top.py  here\n"""\n')
    (pkg / "top.py").write_text("")
    (pkg / "part" / "__init__.py").write_text('"""A part.\n\nFiles:\n    a.py     one\n    gone.py  deleted\n"""\n')
    for name in ("a.py", "b.py"):
        (pkg / "part" / name).write_text("")
    stale, missing = part_map_problems(pkg)
    assert stale == [str(pkg / "part" / "gone.py")] and missing == [str(pkg / "part" / "b.py")]
