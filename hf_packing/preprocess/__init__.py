"""Rows to samples: a dataset row in any supported format becomes token ids, labels, pixels and grids, exactly as
the checkpoint's own processor renders it, or a counted skip with a reason.

Owns: row formats (`formats`), the chat template's assistant turns (`templates`), the skip reasons (`errors`), image and
video loading (`images`, `video`, `video_sampling`), media by URL and data URI (`fetch`), the processor check
(`checks`) and the `Preprocessor` itself (`preprocessor`). May import: `hf_packing.config`, `hf_packing.ops` (the
ignore index) and `_compat`; never the packer, the patches or the Trainer side.

Files:
    formats.py         row formats (HF messages, LLaVA, LLaMA-Factory, TRL) → the conversation the template gets
    templates.py       the checkpoint's chat template: rendering as written, assistant turns located by probing
    preprocessor.py    Preprocessor: rendered text, assistant-only labels, lengths from metadata, pixels
    errors.py          why a row is skipped: REASONS, SampleError, OverlongError, SkipCounter
    images.py          safe image paths, header-only sizes, decoding any mode to 8-bit RGB
    fetch.py           http(s) URLs and data URIs: urllib with a time budget, bounded tries and size, a byte cache
    video.py           video files: header metadata, decoding chosen frames (torchcodec, else PyAV); frame lists
    video_sampling.py  videos_kwargs: the Qwen video processors' frame sampling and patch counts per source
    checks.py          the processor against the model (family, tokenizer), before any data: collator, packer, trainer
"""
