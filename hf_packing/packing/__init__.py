"""The streaming packer: which samples train together, under token, image and vision-patch budgets.

Owns: `pack_dataset` and `PackedDataset` (`dataset`), the online bin planner (`planner`), the rank-identical replica
of the stream (`replica`), balancing packs over ranks (`balance`), fill and skip statistics (`stats`), row readers
(`readers`), the cached length index (`length_index`) and per-source tags (`source_ids`). May import:
`hf_packing.preprocess`, `hf_packing.parallel` (the data-parallel rank), `hf_packing.ops` and `hf_packing.config`;
never the patches or the Trainer side. It starts no thread: the DataLoader's workers are its asynchrony.

Files:
    dataset.py       pack_dataset / PackedDataset: config + overrides, replicas per rank/worker, state_dict, stats
    planner.py       plan_packs / StreamingPlanner: streaming BFD / next_fit under token, image, patch budgets
    replica.py       the planner replica of one rank/worker: reads every row, plans, schedules, processes its own
    balance.py       rank balance: a pack's text + vision work from the model config, steps of similar packs
    stats.py         statistics of a plan (fill, pack sizes, padded baseline) and of a pass: PackStats, NoSamplesError
    readers.py       row sources with resumable positions (map-style, streaming, mixtures), load_local
    length_index.py  the length index: each row's planning metadata once (datasets.map, cached Arrow, keyed)
    source_ids.py    each sample's source (mix key or source_column) as an id for per-source loss and accuracy
"""
