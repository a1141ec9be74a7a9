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
from tests import upstream_testers
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


#: transformers' own GLM-V modeling test classes, in ``tests/models/<type>/test_modeling_<type>.py`` of a
#: transformers source tree (the sdist ships only the top-level ``tests/*.py``; see docs/verified.md)
GLM_CLASSES = {"glm4v": "Glm4vModelTest", "glm4v_moe": "Glm4vMoeModelTest", "glm46v": "Glm46VModelTest"}
#: the error of a model loaded with attn_implementation="eager": the patch routes only sdpa / flash attention
#: (docs/patches.md, "refused with a clear error")
EAGER_REFUSAL = "but this model was loaded with attn_implementation='eager'"
#: upstream GLM-V tests that pass plain and fail under the patch by design, and the error each must raise: both load
#: the model with eager attention to return attention weights (``output_attentions``)
GLM_REFUSALS = {"test_attention_outputs": EAGER_REFUSAL, "test_retain_grad_hidden_states_attentions": EAGER_REFUSAL}


def _upstream_module(model_type: str) -> types.ModuleType:
    """transformers' ``tests/models/<type>/test_modeling_<type>.py``, imported as part of ``upstream_tests``; the
    ``causal_lm_tester`` / ``vlm_tester`` modules newer test files build on come from `tests.upstream_testers` where
    the tests/ directory lacks them (the sdist does)."""
    path = Path(UPSTREAM) / "models" / model_type / f"test_modeling_{model_type}.py"
    if not path.exists():
        pytest.skip(f"{path} is missing (the sdist ships no tests/models/: use a transformers source checkout)")
    common = _modeling_common()
    _stub("upstream_tests.utils")  # only test_config reads config_common_kwargs; the patch does not touch configs
    _stub("upstream_tests.utils.test_configuration_utils", config_common_kwargs={})
    configuration = importlib.import_module("upstream_tests.test_configuration_common")
    for name, module in upstream_testers.testers(common, configuration).items():
        if not (Path(UPSTREAM) / f"{name}.py").exists():
            sys.modules.setdefault(f"upstream_tests.{name}", module)
    return importlib.import_module(f"upstream_tests.models.{model_type}.test_modeling_{model_type}")


def _rows_covering(mask, image):
    """A right-padding ``attention_mask`` whose rows reach at least past their last image placeholder.

    Upstream's VLM testers pad with ``tril`` of ones (row 0 keeps one token) and put an image placeholder at
    position 1, i.e. inside row 0's padding: the unpatched model encodes the image into a padded position, the patch
    drops padding and refuses the image that lost its placeholder ("image_grid_thw lists 3 images but the
    placeholders cover only 2"), a documented refusal that would hide every test behind it. Args: mask ``(B, T)``,
    image ``(B, T)`` bool. Returns ``(B, T)`` in ``mask``'s dtype."""
    import torch

    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(image, positions, -1).amax(dim=1)
    length = torch.maximum(mask.sum(dim=1), last + 1)
    return (positions < length[:, None]).to(mask.dtype)


def _upstream_case(model_type: str, class_name: str) -> type[unittest.TestCase]:
    """transformers' ``class_name`` test class whose tester builds the training call the patch takes: ``use_cache``
    off in the config (a call with a cache in effect runs the original forward by design), ``mm_token_type_ids``
    beside the pixels (transformers 5.23 requires them; testers written before that leave them out), and every
    image placeholder inside its row (`_rows_covering`)."""
    base = getattr(_upstream_module(model_type), class_name)

    class TrainingTester:
        def __init__(self, tester) -> None:
            self.tester = tester

        def __getattr__(self, name: str):
            return getattr(self.tester, name)

        def prepare_config_and_inputs_for_common(self):
            config, inputs = self.tester.prepare_config_and_inputs_for_common()
            config.get_text_config().use_cache = False
            if "pixel_values" not in inputs:
                return config, inputs
            image, mask = inputs["input_ids"] == self.tester.image_token_id, inputs.get("attention_mask")
            if "mm_token_type_ids" not in inputs:
                inputs["mm_token_type_ids"] = image.long()
            if mask is not None and (image & (mask == 0)).any():
                inputs["attention_mask"] = _rows_covering(mask, image)
            return config, inputs

    class Case(base):  # type: ignore[misc, valid-type]
        def setUp(self) -> None:
            super().setUp()
            self.model_tester = TrainingTester(self.model_tester)

    return Case


def _glm_case(model_type: str) -> type[unittest.TestCase]:
    """transformers' ``<Family>ModelTest`` of a GLM-V family (`_upstream_case`)."""
    return _upstream_case(model_type, GLM_CLASSES[model_type])


def _outcomes(case: type[unittest.TestCase], names: list[str]) -> tuple[dict[str, str], int, int]:
    """Run ``names`` of ``case``: (each failed or errored name, subtests included, with its traceback; the number
    run; the number skipped)."""
    with open(os.devnull, "w") as devnull:
        result = unittest.TextTestRunner(stream=devnull).run(unittest.TestSuite(case(n) for n in names))
    failed = {getattr(c, "test_case", c)._testMethodName: text for c, text in result.failures + result.errors}
    skipped = {getattr(c, "test_case", c)._testMethodName for c, _ in result.skipped}
    return failed, result.testsRun, len(skipped)


class _TextAttentionCalls:
    """Counts the patched text attention's varlen calls, dense or QSA (proof the packed path ran); with ``merge``, a
    call of several sequences attends as one span, both ways (the negative control: transformers' batching test
    compares the first row only, which a causal merge leaves exact)."""

    def __init__(self, monkeypatch, merge: bool = False) -> None:
        from hf_packing.ops.varlen import PackedSequences
        from hf_packing.patches import _attention

        kernel, sparse, self.calls = _attention.varlen_attention, _attention.qsa_attention, 0

        def counted(q, k, v, seqs, *, causal, **kwargs):
            self.calls += causal
            if causal and merge and len(seqs.seqlens) > 1:
                seqs, causal = PackedSequences.from_seqlens([sum(seqs.seqlens)], device=seqs.cu_seqlens.device), False
            return kernel(q, k, v, seqs, causal=causal, **kwargs)

        def counted_sparse(*args, **kwargs):  # Qwen4-Exp's QSA layers attend through the sparse varlen path
            self.calls += 1
            return sparse(*args, **kwargs)

        monkeypatch.setattr(_attention, "varlen_attention", counted)
        monkeypatch.setattr(_attention, "qsa_attention", counted_sparse)


def _plain_then_patched(case, model_type: str, label: str, monkeypatch) -> tuple[int, int, dict[str, str], list[str]]:
    """Every test of ``case`` plain (through no packed text attention), then under ``apply_rmpad(model_type)``;
    prints the tally. Returns (tests passing plain, packed text attention calls patched, the patched failures with
    their tracebacks, the names that fail only patched)."""
    names = unittest.TestLoader().getTestCaseNames(case)
    attention = _TextAttentionCalls(monkeypatch)
    plain, ran, skipped = _outcomes(case, names)
    assert attention.calls == 0
    hf_packing.apply_rmpad(model_type)
    patched, _, patched_skipped = _outcomes(case, names)
    passed, new = ran - skipped - len(plain), sorted(set(patched) - set(plain))
    print(
        f"{label}: {ran} tests, plain passed {passed} / failed {len(plain)} / skipped {skipped}; patched failed "
        f"{len(patched)} / skipped {patched_skipped}, packed text attention calls {attention.calls}; new under the "
        f"patch {new}; plain failures {sorted(plain)}"
    )
    return passed, attention.calls, patched, new


def _assert_only_refusals(new: list[str], patched: dict[str, str], refusals: dict[str, str]) -> None:
    """The tests failing only patched are documented refusals, each failing with its documented error."""
    last_lines = {n: patched[n].strip().splitlines()[-1] for n in new}
    assert set(new) <= set(refusals), last_lines
    assert all(refusals[n] in patched[n] for n in new), last_lines


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(GLM_CLASSES))
def test_transformers_glm_modeling_tests_pass_under_the_patch_as_plain(model_type, monkeypatch):
    """Every test of transformers' own ``<Family>ModelTest`` (the model tester's call with ``use_cache`` off) that
    passes plain passes under `hf_packing.apply_rmpad`, except `GLM_REFUSALS`; the patched run goes through the
    packed text attention, the plain one never."""
    passed, calls, patched, new = _plain_then_patched(_glm_case(model_type), model_type, model_type, monkeypatch)
    assert passed > 0 and calls > 0
    _assert_only_refusals(new, patched, GLM_REFUSALS)


@pytest.mark.slow
def test_negative_control_glm_batching_equivalence_fails_with_text_boundaries_merged(monkeypatch):
    """The comparison above can fail: with the rows' boundaries dropped in the patched text attention (the rows
    attend to each other), transformers' own batching-equivalence test (the first row alone equals it in the
    batch) fails on GLM-4.1V; plain and correctly patched, it passes."""
    case = _glm_case("glm4v")
    assert _outcomes(case, ["test_batching_equivalence"])[0] == {}
    hf_packing.apply_rmpad("glm4v")
    assert _outcomes(case, ["test_batching_equivalence"])[0] == {}
    attention = _TextAttentionCalls(monkeypatch, merge=True)
    assert set(_outcomes(case, ["test_batching_equivalence"])[0]) == {"test_batching_equivalence"}
    assert attention.calls > 0


#: transformers' own Qwen4-Exp modeling test classes (``tests/models/qwen4_exp/test_modeling_qwen4_exp.py``), each
#: with whether the patch packs its models: the composite one (``Qwen4ExpModel``, ``...ForConditionalGeneration``,
#: what `apply_rmpad` patches) does; the text-only one (``Qwen4ExpTextModel``, ``Qwen4ExpForCausalLM``) runs
#: transformers' forward through the patched layers, which must stay out of its way
QWEN4_EXP_CLASSES = {"Qwen4ExpVisionText2TextModelTest": True, "Qwen4ExpTextModelTest": False}
#: upstream Qwen4-Exp tests that pass plain and fail under the patch by design, and the error each must raise: the
#: two eager-attention ones as for GLM-V, and `BACKBONE_REFUSALS`' (the patched backbone returns zeros at padded
#: positions, the original computes them; it differs there only: docs/verified.md)
QWEN4_EXP_REFUSALS = {**GLM_REFUSALS, "test_inputs_embeds_matches_input_ids": "Tensor-likes are not close"}


@pytest.mark.slow
@pytest.mark.parametrize("class_name", list(QWEN4_EXP_CLASSES))
def test_transformers_qwen4_exp_modeling_tests_pass_under_the_patch_as_plain(class_name, monkeypatch):
    """Every test of transformers' own Qwen4-Exp test classes (their testers' tiny configs: PLE on layer 1, QSA
    budget 4 in blocks of 2, MoE, 2 streams; the call with ``use_cache`` off) that passes plain passes under
    `hf_packing.apply_rmpad`, except `QWEN4_EXP_REFUSALS`; the composite class's patched run goes through the packed
    text attention (QSA included). Before the patched decoder layer carried transformers' checkpointing wrapper,
    ``test_training_gradient_checkpointing`` (and its two ``use_reentrant`` variants) failed here on both classes."""
    case = _upstream_case("qwen4_exp", class_name)
    passed, calls, patched, new = _plain_then_patched(case, "qwen4_exp", class_name, monkeypatch)
    assert passed > 0 and (calls > 0) == QWEN4_EXP_CLASSES[class_name]
    _assert_only_refusals(new, patched, QWEN4_EXP_REFUSALS)
