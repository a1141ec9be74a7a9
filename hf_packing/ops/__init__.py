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
"""
