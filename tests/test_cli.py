"""The CLI checks its optional packages before any work, and names the extra to install."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from hf_packing._compat import require_extra
from hf_packing.cli.demo import DemoConfig, run_demo
from hf_packing.cli.stats import run_stats


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
