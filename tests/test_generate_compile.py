"""transformers' ``test_generate_compile_model_forward_fullgraph``, run on each softmax family, plain and patched.

The upstream test (``GenerationTesterMixin`` in transformers' ``tests/generation/test_utils.py``, not shipped in the
sdist, so reproduced here step by step): two different input sets of one shape; ``generate`` with
``CompileConfig(fullgraph=True, dynamic=False)`` (``_compile_all_devices`` so it compiles on CPU too), first under
``torch.compiler.set_stance("force_eager")`` with the default dynamic cache, then with
``cache_implementation="static"``, which compiles the forward of every decoding step; the two must give the same
tokens and scores, and the compiled forward must not recompile between steps or between the two input sets.

Under the patch it failed with ``torch._dynamo.exc.Unsupported: mapping proxy affected by dictionary mutation``:
the patched forward bound its call with ``inspect.Signature.bind``, which reads a ``mappingproxy``, after
transformers' wrapper had mutated a dict in the traced frame. `ForwardSignature` binds with plain tuples; the negative
control puts ``Signature.bind`` back and sees the error again.

Inputs: the VLM testers' shape (image prompts, ``pixel_values`` + grids; the prefill runs uncompiled, the decode
steps compiled), left-padded by the tiny processor. Backend ``aot_eager`` by default (dynamo + AOT autograd, where
the error is raised), ``inductor`` as upstream runs it under ``-m slow`` (about a minute a family on 2 CPU cores).
"""

from __future__ import annotations

import pytest
import torch

import hf_packing
from hf_packing.patches._call import ForwardSignature
from hf_packing.testing.tiny import build_tiny_model
from tests.helpers import FIXTURES, conversations, image, load_processor, processed_batch

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


def _input_sets(model_type: str) -> list[dict[str, torch.Tensor]]:
    """Two left-padded batches of two image prompts each: same shapes, different pixels (upstream: two halves of one
    batch)."""
    processor = load_processor(model_type, padding_side="left")
    rows = [conversations(with_video=False)[i] for i in (1, 3)]
    sets = []
    for seed in (0, 10):
        reseeded = [(msgs, [image(*im.size, seed + k) for k, im in enumerate(ims)], []) for msgs, ims, _ in rows]
        batch = processed_batch(processor, reseeded)
        batch.pop("labels")
        sets.append(batch)
    assert all(sets[0][k].shape == sets[1][k].shape for k in sets[0])
    return sets


def _generate_eager_and_compiled(model_type: str, backend: str) -> tuple[list, list, int]:
    """Upstream's steps 2-5: (eager outputs, compiled outputs, graphs dynamo compiled)."""
    from transformers import CompileConfig, DynamicCache

    model = build_tiny_model(model_type, processor_dir=FIXTURES / model_type).eval()
    model.generation_config.eos_token_id = None  # upstream: no early stop, so the lengths are comparable
    model.generation_config.pad_token_id = model.config.get_text_config().pad_token_id or 0
    input_sets = _input_sets(model_type)
    torch.compiler.reset()
    compile_config = CompileConfig(fullgraph=True, dynamic=False, backend=backend)
    compile_config._compile_all_devices = True
    kwargs = dict(
        use_cache=True,
        do_sample=False,
        max_new_tokens=5,
        return_dict_in_generate=True,
        output_scores=True,
        compile_config=compile_config,
    )
    with torch.compiler.set_stance("force_eager"):
        eager = [model.generate(**inputs, **kwargs) for inputs in input_sets]
    assert isinstance(eager[0].past_key_values, DynamicCache) and not hasattr(model, "_compiled_call")
    torch._dynamo.utils.counters.clear()
    compiled = [model.generate(**inputs, **kwargs, cache_implementation="static") for inputs in input_sets]
    assert hasattr(model, "_compiled_call")  # the static cache did trigger compilation
    return eager, compiled, torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _check(model_type: str, backend: str) -> None:
    eager, compiled, graphs = _generate_eager_and_compiled(model_type, backend)
    diff = max((a - b).abs().max().item() for e, c in zip(eager, compiled) for a, b in zip(e.scores, c.scores))
    print(f"{model_type} {backend}: {graphs} graph(s), max |score diff| {diff:.2e}")
    assert graphs == 1  # upstream: no "Recompiling" in the guard log
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c.sequences, e.sequences, rtol=0, atol=0)
        for a, b in zip(e.scores, c.scores):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def _family(model_type: str):
    return model_type if model_type == "qwen2_5_vl" else pytest.param(model_type, marks=pytest.mark.slow)


@pytest.mark.parametrize("patched", [False, True], ids=["plain", "patched"])
@pytest.mark.parametrize("model_type", [_family(t) for t in FAMILIES])
def test_generate_compile_model_forward_fullgraph(model_type, patched):
    if patched:
        hf_packing.apply_rmpad(model_type)
    _check(model_type, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILIES)
def test_generate_compile_model_forward_fullgraph_inductor(model_type):
    hf_packing.apply_rmpad(model_type)
    _check(model_type, "inductor")


def test_signature_bind_breaks_the_fullgraph_generation(monkeypatch):
    """Negative control: the binding before the fix (``inspect.Signature.bind``) fails upstream's test again."""

    def signature_bind(self: ForwardSignature, args: tuple, kwargs: dict) -> dict:
        call = self.signature.bind(None, *args, **kwargs).arguments
        call.pop(next(iter(self.signature.parameters)))
        extra = call.pop("kwargs", {})
        return {**call, **extra}

    monkeypatch.setattr(ForwardSignature, "bind", signature_bind)
    hf_packing.apply_rmpad("qwen2_5_vl")
    with pytest.raises(torch._dynamo.exc.Unsupported, match="mapping proxy affected by dictionary mutation"):
        _check("qwen2_5_vl", "aot_eager")
