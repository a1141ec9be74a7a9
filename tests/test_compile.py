"""Each text decoder layer of the patched model compiles as one graph, without recompiling per pack.

``torch.compile(layer, fullgraph=True, dynamic=True)`` on every decoder layer; 6 collator packs of different
lengths and sequence counts, a processor's padded batch and one row packed by position ids go through the
patched model. Under compile the CPU references run the whole pack at once with the boundaries as device-side
masks: one masked SDPA (`masked_reference_varlen`) and, for Qwen3.5's linear-attention layers, a masked conv and a
`scan` recurrence (`masked_causal_conv1d`, `scan_gated_delta_rule`).
Backend ``aot_eager``: dynamo + AOT autograd trace the forward and backward graphs exactly as for
inductor (a graph break or an unsupported op fails here too), without inductor's C++ codegen, which takes
minutes per graph on 2 CPU cores. Compilations are counted by a backend that wraps it.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import hf_packing
from hf_packing import VisionCollator
from hf_packing.testing.tiny import GLM_TYPES, MODEL_TYPES, build_tiny_model
from tests.helpers import (
    FIXTURES,
    conversations,
    load_processor,
    processed_batch,
    processed_samples,
    sgd_training_args,
)

#: which samples of `processed_samples` (text, 1 image, 2 images, multi-turn, video) form each pack
PACKS = ([0], [1, 2], [0, 1, 2, 3], [4], [2, 3, 4], [0, 1, 2, 3, 4])


class CountingBackend:
    """``aot_eager`` that counts compilations: each (frame, recompile) id once. A restarted analysis (dynamo
    retraces after `_tensorify_python_scalars` turns a float into a tensor) hands the backend a second graph
    under the same id, which is the same compilation."""

    def __init__(self) -> None:
        self.compile_ids: set[tuple[int, int]] = set()

    @property
    def graphs(self) -> int:
        return len(self.compile_ids)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        compile_id = torch._guards.CompileContext.current_compile_id()
        self.compile_ids.add((compile_id.frame_id, compile_id.frame_compile_id))
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


def _compiled_layers(model) -> list[torch.nn.Module]:
    return list(model.model.language_model.layers)


@pytest.mark.parametrize(
    "model_type",
    [t if t == "qwen2_5_vl" else pytest.param(t, marks=pytest.mark.slow) for t in MODEL_TYPES + GLM_TYPES],
)
def test_decoder_layers_compile_whole_and_match_eager(model_type):
    """Every decoder layer compiles whole: softmax attention (`masked_reference_varlen` under compile) and Qwen3.5's
    linear attention (`masked_causal_conv1d` and `scan_gated_delta_rule` under compile)."""
    processor = load_processor(model_type)
    model = build_tiny_model(model_type, processor_dir=FIXTURES / model_type).train()
    hf_packing.apply_rmpad(model_type)
    batches = _batches(model_type, processor, model.config)
    eager = [_step(model, b) for b in batches]
    torch._dynamo.reset()
    backend = CountingBackend()
    layers = _compiled_layers(model)
    for layer in layers:
        layer.compile(fullgraph=True, dynamic=True, backend=backend)
    compiled = [_step(model, b) for b in batches]
    print(f"{model_type}: {backend.graphs} compilations over {len(batches)} batches, {len(layers)} layers compiled")
    graphs = backend.graphs
    for batch in batches[::-1]:  # every pack again, in another order: each layer reuses what it compiled
        _step(model, batch)
    assert backend.graphs == graphs
    for (loss, grads), (ref_loss, ref_grads) in zip(compiled, eager):
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
        assert grads.keys() == ref_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    # Qwen4-Exp: three layer kinds share the decoder layer's forward (linear with PLE, linear, QSA), one graph each
    # (dynamo guards on the module's children), and the plain linear kind, compiled as a recompile, specialises on the
    # first pack's cu_seqlens size once (TORCH_LOGS=recompiles: "cu_seqlens size mismatch, expected 2, actual 3").
    # GLM-4.1V's text (glm4v, glm46v): its rotary returns cos / sin as views of a (1, T, d/2, 2) tensor
    # (``repeat_interleave(2)``), and duck sizing ties that 2 to the first pack's cu_seqlens size (one sequence):
    # one recompile at the first pack of another count, never again (TORCH_LOGS=recompiles: "cu_seqlens.size()[0] ==
    # position_embeddings[0]._base.size()[3]  # duck sizing added this equality")
    bound = {"qwen4_exp": 4, "glm4v": 3, "glm46v": 3}.get(model_type, 2)
    assert 1 <= backend.graphs <= bound


def test_qwen3_5_linear_attention_compiles_once_for_all_packs():
    """Qwen3.5's two linear-attention ops alone, compiled ``fullgraph=True, dynamic=True``: packs of different
    lengths and sequence counts (a 1-token sequence among them) reuse one graph (at most 2 compilations: dynamo's
    static first guess, then the dynamic graph), output and gradients equal to the per-sequence eager reference.
    Negative control: the loop form of the conv (transformers' conv on each sequence alone, what eager runs)
    compiles a new graph per pack, so the bound can fail (the chunk rule's loop form does too, at about a minute
    per graph)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from hf_packing.ops.linear_attention import reference_causal_conv1d, reference_gated_delta_rule
    from hf_packing.ops.varlen import PackedSequences

    chunk_rule = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
    conv = inspect.unwrap(modeling_qwen3_5.causal_conv1d_fn)

    def layer_ops(q, k, v, g, beta, x, weight, bias, seqs):
        mixed = reference_causal_conv1d(x, weight, bias, "silu", seqs, torch_fn=conv)
        out = reference_gated_delta_rule(q, k, v, g, beta, seqs, use_qk_l2norm=True, torch_fn=chunk_rule)
        return mixed, out

    def run(fn, seqlens, generator):
        total = sum(seqlens)
        inputs = [
            torch.randn(1, total, 2, 8, generator=generator),  # q, k: 2 key heads
            torch.randn(1, total, 2, 8, generator=generator),
            torch.randn(1, total, 4, 6, generator=generator),  # v: 4 value heads
            -torch.rand(1, total, 4, generator=generator),  # g, beta
            torch.rand(1, total, 4, generator=generator),
            torch.randn(1, 10, total, generator=generator),  # conv input (1, C, T), weight (C, 4), bias
            torch.randn(10, 4, generator=generator),
            torch.randn(10, generator=generator),
        ]
        for t in inputs:
            t.requires_grad_(True)
        mixed, out = fn(*inputs, PackedSequences.from_seqlens(seqlens))
        (mixed.square().sum() + out.square().sum()).backward()
        return [mixed.detach(), out.detach(), *(t.grad for t in inputs)]

    packs = ([5], [3, 6], [2, 4, 9], [12, 1], [7, 7, 7, 7], [1, 20])
    torch._dynamo.reset()
    backend = CountingBackend()
    compiled = torch.compile(layer_ops, fullgraph=True, dynamic=True, backend=backend)
    for seqlens in packs:
        got = run(compiled, seqlens, torch.Generator().manual_seed(len(seqlens)))
        want = run(layer_ops, seqlens, torch.Generator().manual_seed(len(seqlens)))
        for name, a, b in zip(("conv", "delta rule", "dq", "dk", "dv", "dg", "dbeta", "dx", "dw", "db"), got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"{name} on {seqlens}")
    print(f"qwen3_5 linear-attention ops: {backend.graphs} compilations over {len(packs)} packs")
    assert 1 <= backend.graphs <= 2

    # negative control: the eager (per-sequence) form under compile recompiles as the packs change
    torch._dynamo.reset()
    looped = CountingBackend()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.compiler, "is_compiling", lambda: False)
        loop_compiled = torch.compile(reference_causal_conv1d, fullgraph=True, dynamic=True, backend=looped)
        for seqlens in ([5], [3, 6], [2, 4, 9]):
            x, weight = torch.randn(1, 10, sum(seqlens)), torch.randn(10, 4)
            loop_compiled(x, weight, None, "silu", PackedSequences.from_seqlens(seqlens), torch_fn=conv)
    print(f"per-sequence conv loop: {looped.graphs} compilations over 3 packs")
    assert looped.graphs > 2


def _train_three_steps(tmp_path, model_type: str, packs: list, *, compile: bool):
    """3 SGD steps of the patched tiny model through the HF Trainer; (logged losses, final weights, dynamo counters)."""
    from transformers import Trainer

    processor = load_processor(model_type)
    model = build_tiny_model(model_type, processor_dir=FIXTURES / model_type)
    hf_packing.apply_rmpad(model_type)
    args = sgd_training_args(
        tmp_path / f"compile{compile}",
        per_device_train_batch_size=1,
        max_steps=3,
        learning_rate=0.1,
        torch_compile=compile,
        torch_compile_backend="aot_eager" if compile else None,  # see the module docstring
    )
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    collator = VisionCollator(processor, model_config=model.config)
    trainer = Trainer(model=model, args=args, train_dataset=packs, data_collator=collator)
    trainer.train()
    hf_packing.revert_rmpad(model_type)
    losses = torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h])
    counters = torch._dynamo.utils.counters
    stats = {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values())}
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, stats


@pytest.mark.slow  # dynamo traces the vision tower piece by piece
def test_trainer_with_torch_compile_trains_like_eager(tmp_path):
    """``TrainingArguments(torch_compile=True)`` (the Trainer wraps the model in ``torch.compile``, graph breaks
    allowed) on the patched model: 3 steps on 3 collator packs (text; 2 images; multi-turn with an image) give the
    eager losses and weights. Prints how many graphs dynamo compiled and how many breaks it took."""
    samples = processed_samples(load_processor("qwen2_5_vl"), conversations(with_video=False))
    packs = [samples[:1], samples[1:3], samples[3:]]
    eager_losses, eager_weights, eager_stats = _train_three_steps(tmp_path, "qwen2_5_vl", packs, compile=False)
    losses, weights, stats = _train_three_steps(tmp_path, "qwen2_5_vl", packs, compile=True)
    print(f"losses eager {eager_losses.tolist()} compiled {losses.tolist()}; compiled: {stats}")
    assert eager_stats["graphs"] == 0 and stats["graphs"] > 0  # the compiled run did compile
    assert len(losses) == 3
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-6)
    for name, weight in weights.items():
        torch.testing.assert_close(weight, eager_weights[name], rtol=1e-4, atol=1e-5, msg=name)
