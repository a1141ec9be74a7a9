"""The HF Trainer side: `prepare_trainer` (`trainer`), packed evaluation (`evaluation`), telemetry and MFU
(`telemetry`) from the exact FLOPs count (`flops`), the end of a distributed run (`distributed`), and unwrapping what
the Trainer holds (`unwrap`).

Owns: everything that touches a ``Trainer`` or ``TrainingArguments``. May import: every other part of the package
(it is the top layer, below only `hf_packing.cli`).
"""
