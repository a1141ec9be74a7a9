"""transformers' own MoE contract tests (``ModelTesterMixin`` in its ``tests/test_modeling_common.py``), run on the
tiny MoE families, unpatched and under `hf_packing.apply_rmpad`.

transformers' test files are not installed with the package; point ``HF_PACKING_TRANSFORMERS_TESTS`` at a ``tests/``
directory of the installed version (the sdist ships it: ``pip download transformers==5.23.0 --no-binary :all:
--no-deps`` and unpack), else these tests are skipped. Modules that file imports only for other mixins (exporters,
generation, ``parameterized``) are stubbed when missing; the tests run are transformers' own code, unchanged.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
import unittest
from pathlib import Path

import pytest

import hf_packing
from hf_packing.testing.tiny import build_tiny_model
from tests.helpers import FIXTURES, conversations, load_processor, processed_batch

UPSTREAM = os.environ.get("HF_PACKING_TRANSFORMERS_TESTS")
TESTS = ("test_moe_models_record_router_logits", "test_output_router_logits_from_config")
CLASSES = {"qwen3_vl_moe": "Qwen3VLMoe", "qwen3_5_moe": "Qwen3_5Moe"}

pytestmark = pytest.mark.skipif(
    not UPSTREAM or not (Path(UPSTREAM) / "test_modeling_common.py").exists(),
    reason="HF_PACKING_TRANSFORMERS_TESTS is not a transformers tests/ directory",
)


def _stub(name: str, **attrs) -> None:
    if name in sys.modules:
        return
    try:
        importlib.import_module(name)
    except ImportError:
        module = types.ModuleType(name)
        module.__path__ = []
        module.__dict__.update(attrs)
        sys.modules[name] = module


def _modeling_common() -> types.ModuleType:
    """transformers' ``tests/test_modeling_common.py``, imported as ``upstream_tests.test_modeling_common``."""
    if "upstream_tests.test_modeling_common" in sys.modules:
        return sys.modules["upstream_tests.test_modeling_common"]
    package = types.ModuleType("upstream_tests")
    package.__path__ = [UPSTREAM]
    sys.modules["upstream_tests"] = package
    _stub("parameterized", parameterized=types.SimpleNamespace(expand=lambda *a, **k: lambda f: f))
    for parent, child, mixin in (
        ("exporters", "test_export", "ExportTesterMixin"),
        ("generation", "test_utils", "GenerationTesterMixin"),
    ):
        _stub(f"upstream_tests.{parent}")
        _stub(f"upstream_tests.{parent}.{child}", **{mixin: type(mixin, (), {})})
    spec = importlib.util.spec_from_file_location(
        "upstream_tests.test_modeling_common", Path(UPSTREAM) / "test_modeling_common.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class _Tester:
    """What ``ModelTesterMixin`` asks of a model tester: a config and inputs (the tiny family's, a padded batch)."""

    def __init__(self, model_type: str) -> None:
        self.model_type = model_type

    def prepare_config_and_inputs_for_common(self):
        config = build_tiny_model(self.model_type, processor_dir=FIXTURES / self.model_type).config
        batch = processed_batch(load_processor(self.model_type), conversations(with_video=False))
        batch.pop("labels")
        return config, {**batch, "use_cache": False}


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
@pytest.mark.parametrize("model_type", list(CLASSES))
def test_transformers_moe_contract_tests(model_type, patched):
    """Before hf_packing set ``__annotations__`` on the patched forward, the first failed under the patch:
    "'router_logits' not found in set() : Qwen3VLMoeForConditionalGeneration does not return them"."""
    import transformers

    common = _modeling_common()
    name = CLASSES[model_type]
    classes = (getattr(transformers, f"{name}Model"), getattr(transformers, f"{name}ForConditionalGeneration"))

    class Case(common.ModelTesterMixin, unittest.TestCase):
        all_model_classes = classes
        all_generative_model_classes = classes[1:]

        def setUp(self) -> None:
            self.model_tester = _Tester(model_type)

    present = [t for t in TESTS if hasattr(common.ModelTesterMixin, t)]  # older transformers lack them
    if not present:
        pytest.skip(f"this transformers' ModelTesterMixin has none of {TESTS}")
    if patched:
        hf_packing.apply_rmpad(model_type)
    with open(os.devnull, "w") as devnull:
        result = unittest.TextTestRunner(stream=devnull).run(unittest.TestSuite(Case(t) for t in present))
    problems = [f"{case.id()}: {text.strip().splitlines()[-1]}" for case, text in result.failures + result.errors]
    print(f"{model_type} patched={patched}: ran {present}, skipped {len(result.skipped)}, problems {problems}")
    assert result.testsRun == len(present) and not result.skipped and not problems, problems


#: backbone results that differ from transformers' by design: the patched backbone returns zeros at padded
#: positions (the issue's contract), the original computes them; `inputs_embeds` calls run the original code
BACKBONE_REFUSALS = {"test_inputs_embeds_matches_input_ids"}
BACKBONES = {
    "qwen2_vl": "Qwen2VLModel",
    "qwen2_5_vl": "Qwen2_5_VLModel",
    "qwen3_vl": "Qwen3VLModel",
    "qwen3_vl_moe": "Qwen3VLMoeModel",
    "qwen3_5": "Qwen3_5Model",
    "qwen3_5_moe": "Qwen3_5MoeModel",
}


@pytest.mark.parametrize("model_type", list(BACKBONES))
def test_transformers_common_tests_pass_on_the_patched_backbone_as_plain(model_type):
    """Every `ModelTesterMixin` test on the backbone class (``XModel``) that passes plain passes under the patch,
    except `BACKBONE_REFUSALS` (``test_inputs_embeds_matches_input_ids`` differs at row 0's first pad)."""
    import transformers

    common = _modeling_common()
    backbone = getattr(transformers, BACKBONES[model_type])

    class Case(common.ModelTesterMixin, unittest.TestCase):
        all_model_classes = (backbone,)
        all_generative_model_classes = ()

        def setUp(self) -> None:
            self.model_tester = _Tester(model_type)

    names = sorted(n for n in dir(common.ModelTesterMixin) if n.startswith("test_"))

    def failures() -> set[str]:
        with open(os.devnull, "w") as devnull:
            result = unittest.TextTestRunner(stream=devnull).run(unittest.TestSuite(Case(n) for n in names))
        return {case.id().rsplit(".", 1)[-1].split(" ")[0] for case, _ in result.failures + result.errors}

    plain = failures()
    hf_packing.apply_rmpad(model_type)
    patched = failures()
    print(f"{model_type}: {len(names)} tests, plain failures {len(plain)}, new under the patch {patched - plain}")
    assert patched - plain <= BACKBONE_REFUSALS, patched - plain
