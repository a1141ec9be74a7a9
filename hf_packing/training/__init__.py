"""The HF Trainer side: `prepare_trainer` (`trainer`), packed evaluation (`evaluation`), telemetry and MFU
(`telemetry`) from the exact FLOPs count (`flops`), the end of a distributed run (`distributed`), and unwrapping what
the Trainer holds (`unwrap`).

Owns: everything that touches a ``Trainer`` or ``TrainingArguments``. May import: every other part of the package
(it is the top layer, below only `hf_packing.cli`).

Files:
    trainer.py      prepare_trainer: up-front checks, no batch dispatching, no double sharding, telemetry first
    evaluation.py   token-level eval_loss / eval_token_accuracy over packs and ranks, logits only when needed
    telemetry.py    PackingTelemetry TrainerCallback: tokens/s, fill, padding, images, dropped, MFU
    flops.py        training_flops(model, batch): the cost model's FLOPs of a step, text and vision (exact)
    distributed.py  end_distributed (barrier + destroy_process_group), end_process (exit without finalization)
    unwrap.py       packed_dataset (under a DataLoader); the model's unwrap is patches.unwrap_model
"""
