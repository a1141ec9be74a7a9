"""Tensor operations on packed sequences: varlen attention and its boundaries (`varlen`), Qwen3.5's linear
attention per sequence (`linear_attention`), and the per-sequence shifted loss (`loss`).

Owns: functions of tensors and ``cu_seqlens``, each fast path beside its reference. May import: torch, the optional
kernels through `hf_packing._compat`, and nothing else of the package; never transformers (a test holds it), so the
ops run and are tested without a model.
"""
