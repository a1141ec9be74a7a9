"""Scaffolding for tests, the demo and benchmarks: tiny random Qwen-VL models and processors built locally
(`tiny`), a generated multimodal dataset (`synthetic`) and the host-sync counter (`syncs`). Nothing here is needed
to train.

Owns: what builds models, processors and data without the hub. May import: nothing else of the package (every
part may use it in its own tests), only torch, transformers and datasets.

Files:
    tiny.py       tiny random Qwen-VL configs, models and locally built processors (no hub)
    synthetic.py  generated multimodal dataset for the demo
    syncs.py      SyncCounter: a step's syncing ops, tolist reads and host-data tensors, by the frame that made them
"""
