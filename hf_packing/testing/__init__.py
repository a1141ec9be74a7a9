"""Scaffolding for tests, the demo and benchmarks: tiny random Qwen-VL models and processors built locally
(`tiny`), a generated multimodal dataset (`synthetic`) and the host-sync counter (`syncs`). Nothing here is needed
to train.

Owns: what builds models, processors and data without the hub. May import: nothing else of the package (every
part may use it in its own tests), only torch, transformers and datasets.
"""
