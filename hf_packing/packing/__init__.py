"""The streaming packer: which samples train together, under token, image and vision-patch budgets.

Owns: `pack_dataset` and `PackedDataset` (`dataset`), the online bin planner (`planner`), the rank-identical replica
of the stream (`replica`), balancing packs over ranks (`balance`), fill and skip statistics (`stats`), row readers
(`readers`), the cached length index (`length_index`) and per-source tags (`source_ids`). May import:
`hf_packing.preprocess`, `hf_packing.parallel` (the data-parallel rank), `hf_packing.ops` and `hf_packing.config`;
never the patches or the Trainer side. It starts no thread: the DataLoader's workers are its asynchrony.
"""
