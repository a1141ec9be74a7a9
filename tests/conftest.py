"""Fixtures and hooks only; the helpers the test modules share are in tests/helpers.py. No module imports this.

Besides the autouse revert: `data` and `reference` (module-scoped), the packer's test rows and their packs, for
tests/test_stream.py and tests/test_length_index.py."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import STREAM_ROWS, image_rows, load_processor, make_packs, pack_ids


@pytest.fixture(autouse=True)
def _always_revert():
    """Patches are class-level; no test may leak them into the next."""
    yield
    if "hf_packing.patches" in sys.modules:
        sys.modules["hf_packing.patches"].revert_rmpad()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The packer's test rows (`image_rows`, qwen2_vl's processor); row 5 names a missing image and row 9 is
    overlong, so planning skips both."""
    from datasets import Dataset

    root = tmp_path_factory.mktemp("images")
    rows = image_rows(root, STREAM_ROWS, 0)
    rows[5]["image"] = ["missing.jpg"]  # skipped while planning: missing_file
    rows[9]["conversations"][1]["value"] = "long " * 900  # skipped while planning: overlong
    return {"root": root, "ds": Dataset.from_list(rows), "processor": load_processor("qwen2_vl")}


@pytest.fixture(scope="module")
def reference(data):
    """The packs of `data` with `make_packs`' defaults, their sample indices and stats: what every variant equals."""
    train = make_packs(data)
    packs = list(train)
    return {"packs": packs, "ids": pack_ids(packs), "stats": train.stats(log=False)}
