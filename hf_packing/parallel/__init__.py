"""Ulysses sequence parallelism: one pack split along the sequence over the ranks of a group.

Owns: the group and its collectives (`comm`), slicing a pack and its vision units over the group and the SP loss
(`shard`), the SP size and its ``(dp, sp)`` mesh (`state`), and the sharding swap around Qwen3.5's linear attention
(`linear`). May import: `hf_packing.ops` and torch.distributed, never the patches or transformers' models: the
patches call into it (`hf_packing.patches.sequence_parallel` reads the applied state). See docs/sequence_parallel.md.

Files:
    comm.py    SP group, all-to-all (seq ↔ head shards), all-gather / all-reduce with autograd, timer
    shard.py   SP slicing of a pack: tokens, positions, DeepStack, vision units, SP loss, MoE aux loss
    state.py   SequenceParallelState: size, (dp, sp) mesh, comm timer; data_parallel_rank_world
    linear.py  Ulysses SP for Gated DeltaNet: conv + delta rule on head shards, whole pack
"""
