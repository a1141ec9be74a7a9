"""Tensor operations on packed sequences: varlen attention and its boundaries (`varlen`), Qwen3.5's linear
attention per sequence (`linear_attention`), Qwen4-Exp's QSA sparse attention (block selection per sample and
attention over the selected keys, `sparse_attention`), Qwen4-Exp's Per-Layer Embedding n-gram history per sample
(`ple`), the per-sequence shifted loss (`loss`), and the one cost model: model FLOPs of a training step from a pack's
counts (`flops`), shared by the telemetry, ``training_flops`` and rank balance, and its memory counterpart: the bytes
autograd keeps for backward from the same counts (`memory`), which ``hf-packing stats`` turns into a predicted peak
per GPU.

Owns: functions of tensors and ``cu_seqlens``, each fast path beside its reference; the attention units of a
vision grid (`varlen.vision_seqlens`). May import: torch, the optional
kernels through `hf_packing._compat`, and nothing else of the package; never transformers (a test holds it), so the
ops run and are tested without a model.

Files:
    varlen.py            unpad/pad, cu_seqlens, attention mask validation, varlen backends, dense block-causal oracle
    linear_attention.py  Gated DeltaNet conv1d + delta rule over packed sequences: fla, per-sequence ref, compile form
    sparse_attention.py  Qwen4-Exp's QSA: blocks per sample, top-k selection (no sync), attention over selected keys
    loss.py              per-sequence label shift, chunked linear + cross-entropy, num_items_in_batch reduction
    flops.py             ModelFlops: the one cost model, training FLOPs from a pack's counts (telemetry, balance)
    ple.py               Qwen4-Exp's PLE n-gram history per sample: restarts at sample starts and after EOS
    memory.py            ActivationMemory: bytes autograd keeps per step from a pack's counts (hf-packing stats)
"""
