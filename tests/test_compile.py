"""Each text decoder layer of the patched model compiles as one graph, without recompiling per pack.

``torch.compile(layer, fullgraph=True, dynamic=True)`` on every decoder layer; 6 collator packs of different
lengths and sequence counts, a processor's padded batch and one row packed by position ids go through the
patched model (on CPU the reference attention runs one masked SDPA under compile, `masked_reference_varlen`).
Backend ``aot_eager``: dynamo + AOT autograd trace the forward and backward graphs exactly as for
inductor (a graph break or an unsupported op fails here too), without inductor's C++ codegen, which takes
minutes per graph on 2 CPU cores. Compilations are counted by a backend that wraps it.
"""

from __future__ import annotations

import pytest
import torch

import hf_packing
from hf_packing import VisionCollator
from hf_packing.testing.tiny import MODEL_TYPES, build_tiny_model
from tests.conftest import FIXTURES, load_processor, processed_batch, processed_samples

#: which samples of `processed_samples` (text, 1 image, 2 images, multi-turn, video) form each pack
PACKS = ([0], [1, 2], [0, 1, 2, 3], [4], [2, 3, 4], [0, 1, 2, 3, 4])


class CountingBackend:
    """``aot_eager`` that counts the graphs it is given (one per compilation, recompilations included)."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)


def _batches(model_type: str, processor, config) -> list[dict]:
    samples = processed_samples(processor)
    rows = VisionCollator(processor, model_config=config)
    batches = [rows([samples[i] for i in pack]) for pack in PACKS]
    padded = processed_batch(processor)  # the processor's padded rows, no positions: the model computes them
    flat = VisionCollator(processor, mode="flat", model_config=config)(samples[:3])
    for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        flat.pop(key)  # boundaries from the text-position row's restarts only
    return [*batches, padded, flat]


def _step(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


#: softmax-attention families. Qwen3.5's Gated DeltaNet reference (the CPU path) runs a Python loop per sequence,
#: which dynamo unrolls and recompiles for every sequence count (over 10 minutes here): not bounded yet.
SOFTMAX = [t for t in MODEL_TYPES if not t.startswith("qwen3_5")]


@pytest.mark.parametrize(
    "model_type", [t if t == "qwen2_5_vl" else pytest.param(t, marks=pytest.mark.slow) for t in SOFTMAX]
)
def test_decoder_layers_compile_whole_and_match_eager(model_type):
    processor = load_processor(model_type)
    model = build_tiny_model(model_type, processor_dir=FIXTURES / model_type).train()
    hf_packing.apply_rmpad(model_type)
    batches = _batches(model_type, processor, model.config)
    eager = [_step(model, b) for b in batches]
    torch._dynamo.reset()
    backend = CountingBackend()
    layers = model.model.language_model.layers
    for layer in layers:
        layer.compile(fullgraph=True, dynamic=True, backend=backend)
    compiled = [_step(model, b) for b in batches]
    print(f"{model_type}: {backend.graphs} compilations over {len(batches)} batches, {len(layers)} layers")
    for (loss, grads), (ref_loss, ref_grads) in zip(compiled, eager):
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
        assert grads.keys() == ref_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    assert 1 <= backend.graphs <= 2
