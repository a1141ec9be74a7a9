"""Rows to samples: a dataset row in any supported format becomes token ids, labels, pixels and grids, exactly as
the checkpoint's own processor renders it, or a counted skip with a reason.

Owns: row formats (`formats`), the chat template's assistant turns (`templates`), the skip reasons (`errors`), image and
video loading (`images`, `video`, `video_sampling`), media by URL and data URI (`fetch`), the processor check
(`checks`) and the `Preprocessor` itself (`preprocessor`). May import: `hf_packing.config`, `hf_packing.ops` (the
ignore index) and `_compat`; never the packer, the patches or the Trainer side.
"""
