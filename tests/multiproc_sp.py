"""Helper for tests/test_sequence_parallel.py: Ulysses SP against SP = 1 on the same packs (CPU, gloo, fp32).

    python -m torch.distributed.run --standalone --nproc_per_node W tests/multiproc_sp.py CONFIG.json

CONFIG.json: ``sp`` (P), ``mode`` (``"ddp"``: torch DDP; ``"fsdp"``: FSDP2 ``fully_shard`` over all W ranks, per
decoder layer and vision block, then the root), ``runs``: a list of ``{"family", "control", "checkpointing"}``
(optional: non-reentrant gradient checkpointing), ``control`` being
``null`` or a negative control (``"positions"``: positions computed after sharding, 0..T/P-1 on every rank;
``"boundaries"``: the pack's sequence boundaries dropped; Qwen3.5 only, on the head shards of the linear-attention
layers: ``"conv_window"`` / ``"recurrent_state"``: the conv window / the delta rule's state not restarted at the
boundaries), ``out``. Optional per run: ``"linear_backend"`` (``"fla"``: the strict FLA stand-ins of
tests/kernels.py, for SP = 1 and SP = P), ``"oracle"`` (also compare SP = P with the unpatched model run sample by
sample), ``"router_aux"`` (MoE: ``output_router_logits`` on with this ``router_aux_loss_coef``; the per-pack
``aux_loss`` of SP = P against SP = 1), ``"aux_per_shard"`` (negative control: each rank's aux loss from its own
tokens, its router statistics not summed over the SP group), ``"autocast"`` (fp32 weights under bf16 autocast,
every kernel a strict stand-in (with ``"linear_backend": "fla"``): the errors of SP = 1 and of SP = P against fp32
SP = 1, for the 2x rule).

Every rank builds the same tiny model and the same packs (images and a video; some lengths not a multiple of P).
SP group d = rank // P trains packs [2d, 2d+1] as two accumulated micro-batches, the way the Trainer does with
``average_tokens_across_devices``: ``num_items_in_batch`` is every rank's label count summed over the world (each
pack counted P times), the loss is multiplied by W before backward, and DDP / FSDP average gradients over the W
ranks. The reference is SP = 1 in one process on all 2·D packs: ``Σ CE / N`` and its gradient. Rank 0 writes the
loss the Trainer would log, the reference loss, each parameter's max-abs gradient error relative to the reference's
max-abs, and an eval-mode check (loss without ``num_items_in_batch``, gathered logits) to ``out``, per run.
"""

from __future__ import annotations

import copy
import json
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hf_packing.training.distributed import end_distributed, end_process

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MONKEYPATCH = pytest.MonkeyPatch()
#: sample indices of helpers.conversations(): 0 text, 1 one image, 2 two images, 3 multi-turn + image, 4 video
PACKS = [[1, 4, 0], [2, 3, 1], [4, 2], [3, 0]]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def full_grad(p: torch.nn.Parameter) -> torch.Tensor:
    grad = p.grad
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def main(config_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    results = []
    for spec in config["runs"]:  # one launch runs several comparisons: a failure's output names the one that failed
        if dist.get_rank() == 0:
            print(f"run {len(results)}: {spec}", flush=True)
        results.append(run(config, **spec))
    if config.get("packer"):
        results.append(packer_groups(config["sp"]))
    if dist.get_rank() == 0:
        Path(config["out"]).write_text(json.dumps(results))
    end_distributed()  # barrier, gc, destroy_process_group: no abort at interpreter exit


def each_sample_alone(model, samples: list[dict], total: int) -> float:
    """Σ over the samples run one by one, unpadded, of their token CE, over ``total``; gradients accumulated."""
    rows = ("input_ids", "labels", "attention_mask", "mm_token_type_ids")
    loss_sum = 0.0
    for sample in samples:
        count = int((sample["labels"][1:] != -100).sum())
        out = model(**{k: (v[None] if k in rows else v) for k, v in sample.items()}, use_cache=False)
        (out.loss * count / total).backward()
        loss_sum += out.loss.item() * count
    return loss_sum / total


def linear_controls(control: str | None) -> None:
    """Qwen3.5's negative controls: the linear-attention ops see the whole (padded) pack as one sequence."""
    from hf_packing.ops import linear_attention

    def merged(fn, at: int):
        def call(*args, **kwargs):
            args = list(args)
            seqs = args[at]
            args[at] = type(seqs).from_seqlens([int(seqs.cu_seqlens[-1])])
            return fn(*args, **kwargs)

        return call

    if control == "conv_window":
        MONKEYPATCH.setattr(linear_attention, "causal_conv1d", merged(linear_attention.causal_conv1d, 4))
    elif control == "recurrent_state":
        MONKEYPATCH.setattr(linear_attention, "gated_delta_rule", merged(linear_attention.gated_delta_rule, 5))


def run(
    config: dict,
    family: str,
    control: str | None,
    checkpointing: bool = False,
    linear_backend: str = "auto",
    oracle: bool = False,
    router_aux: float | None = None,
    aux_per_shard: bool = False,
    autocast: bool = False,
) -> dict:
    """One comparison (see the module docstring); returns rank 0's numbers, with the worst over ranks."""
    rank, world, size = dist.get_rank(), dist.get_world_size(), config["sp"]
    group = rank // size

    import hf_packing
    from hf_packing import VisionCollator
    from hf_packing.parallel import shard as sequence_parallel_shard
    from hf_packing.patches import sequence_parallel
    from hf_packing.testing.tiny import build_tiny_model
    from tests.helpers import FIXTURES, load_processor, processed_samples

    MONKEYPATCH.undo()
    hf_packing.revert_rmpad()
    processor = load_processor(family)
    model = build_tiny_model(family, processor_dir=FIXTURES / family, seed=0)
    model.config.use_cache = False
    if router_aux is not None:
        model.config.text_config.output_router_logits = True
        model.config.text_config.router_aux_loss_coef = router_aux
    samples = processed_samples(processor)
    collate = VisionCollator(processor, model_config=model.config)
    packs = [collate([[samples[i] for i in pack]]) for pack in PACKS[: 2 * world // size]]
    counts = [int((b["labels"][..., 1:] != -100).sum()) for b in packs]
    lengths = [int(b["attention_mask"].sum()) for b in packs]
    if router_aux is not None:  # asked for in the call too: 5.17's forward has no output_router_logits parameter
        packs = [b | {"output_router_logits": True} for b in packs]

    if oracle:  # the unpatched model, every sample of every pack alone
        alone = copy.deepcopy(model)
        alone_loss = each_sample_alone(alone, [samples[i] for pack in PACKS[: len(packs)] for i in pack], sum(counts))

    if autocast:  # the fp32 oracle of the 2x rule: SP = 1, exact reference kernels, every pack
        hf_packing.apply_rmpad(family)
        exact = copy.deepcopy(model)
        exact_loss = 0.0
        for batch in packs:
            loss = exact(**batch, num_items_in_batch=sum(counts)).loss
            loss.backward()
            exact_loss += loss.item()

    fla_calls: dict[str, list] = {}
    if linear_backend == "fla":
        from tests.kernels import install_linear_kernels

        fla_calls = install_linear_kernels(MONKEYPATCH)
    attn_backend = "auto"
    if autocast:  # the recipes' setup: fp32 weights, bf16 autocast, every kernel a strict stand-in
        from tests.kernels import install_kernel

        install_kernel(MONKEYPATCH, "flash_attn")
        attn_backend = "flash_attn"
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)

    # ---- reference: SP = 1, one process, every pack
    hf_packing.apply_rmpad(family, linear_backend=linear_backend, attn_backend=attn_backend)
    ref = copy.deepcopy(model)
    ref_loss, ref_aux = 0.0, []
    for batch in packs:
        with amp:
            out = ref(**batch, num_items_in_batch=sum(counts))
        out.loss.backward()
        ref_loss += out.loss.item()
        ref_aux.append(out.aux_loss.item() if router_aux is not None else 0.0)
    ref.eval()
    with torch.no_grad(), amp:
        ref_eval = ref(**packs[2 * group])

    # ---- SP = P
    hf_packing.apply_rmpad(
        family, sequence_parallel_size=size, linear_backend=linear_backend, attn_backend=attn_backend
    )
    ref_calls = {k: len(v) for k, v in fla_calls.items()}
    linear_controls(control)
    if aux_per_shard:  # each rank's aux loss from its own tokens only (transformers' function on the shard)
        MONKEYPATCH.setattr(sequence_parallel_shard, "load_balancing_loss", _per_shard_aux)
    # the controls replace the functions where the text-model hook looks them up: the shard module
    if control == "positions":
        MONKEYPATCH.setattr(
            sequence_parallel_shard,
            "shard_position_ids",
            lambda pos, sp: torch.arange(
                sequence_parallel_shard.padded_length(pos.shape[-1], sp.size) // sp.size, dtype=pos.dtype
            ).expand(pos.shape[0], 1, -1),
        )
    elif control == "boundaries":
        MONKEYPATCH.setattr(
            sequence_parallel_shard,
            "padded_sequences",
            lambda seqs, p: type(seqs).from_seqlens(
                [sequence_parallel_shard.padded_length(int(seqs.cu_seqlens[-1]), p)]
            ),
        )
    state = sequence_parallel.current_state()  # apply_rmpad's: its timer is the one the telemetry reads
    if checkpointing:  # non-reentrant: backward recomputes each layer, its all-to-alls included
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config["mode"] == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in [*model.model.language_model.layers, *model.model.visual.blocks]:
            fully_shard(block, mesh=mesh)
        trained = fully_shard(model, mesh=mesh)
    else:
        trained = torch.nn.parallel.DistributedDataParallel(model)
    mine = packs[2 * group : 2 * group + 2]
    num_items = torch.tensor(sum(counts[2 * group : 2 * group + 2]))
    dist.all_reduce(num_items)  # the Trainer's gather: every rank's count, each pack counted P times
    from hf_packing.training.telemetry import PackingTelemetry

    telemetry = PackingTelemetry()
    tower_rows: list[int] = []  # pixel rows (patches) this rank's tower encodes per call
    counting = model.model.visual.register_forward_pre_hook(lambda m, args: tower_rows.append(args[0].shape[0]))
    state.timer.enable()
    logged, aux_rel = torch.zeros(()), 0.0
    for batch, aux in zip(mine, ref_aux[2 * group : 2 * group + 2]):
        telemetry.observe(batch["input_ids"], batch)
        with amp:
            out = trained(**batch, num_items_in_batch=num_items)
        loss = out.loss * world  # Trainer: loss *= num_processes
        loss.backward()
        logged += loss.detach()
        if router_aux is not None:
            aux_rel = max(aux_rel, abs(out.aux_loss.item() - aux) / abs(aux))
    dist.all_reduce(logged)
    logged /= world  # the Trainer logs the mean over processes of the summed micro-batch losses
    grads = {name: relative(full_grad(p), q.grad) for (name, p), q in zip(model.named_parameters(), ref.parameters())}
    amp_errors = None
    if autocast:  # (loss, gradient norm) errors against fp32: SP = 1 under autocast, and SP = P under autocast
        flat = lambda grads: torch.cat([g.flatten() for g in grads])  # noqa: E731
        exact_grads = flat(p.grad for p in exact.parameters())
        amp_errors = {
            name: [
                abs(value - exact_loss) / abs(exact_loss),
                float((flat(g) - exact_grads).norm() / exact_grads.norm()),
            ]
            for name, value, g in (
                ("sp1", ref_loss, (q.grad for q in ref.parameters())),
                ("sp", float(logged), (full_grad(p) for p in model.parameters())),
            )
        }
    oracle_rel = None
    if oracle:  # SP = P directly against the unpatched model run sample by sample: (loss, worst gradient)
        oracle_rel = [
            abs(float(logged) - alone_loss) / abs(alone_loss),
            max(relative(full_grad(p), q.grad) for p, q in zip(model.parameters(), alone.parameters())),
        ]

    counted = telemetry.counts()
    counting.remove()
    patches = [int(sum(b[k].shape[0] for k in ("pixel_values", "pixel_values_videos") if k in b)) for b in mine]
    share = torch.tensor([sum(tower_rows), max(patches), len(tower_rows)], dtype=torch.float64)
    everyone = [torch.zeros_like(share) for _ in range(world)]
    dist.all_gather(everyone, share)
    state.timer.enable(False)
    pad = sum(sequence_parallel_shard.padded_length(n, size) - n for n in lengths)
    trained.eval()
    with torch.no_grad(), amp:
        sp_eval = trained(**packs[2 * group])
    MONKEYPATCH.undo()
    n_local = torch.tensor(float(sp_eval.num_supervised_tokens))
    dist.all_reduce(n_local, group=state.group().group)
    worst = torch.tensor(
        [
            abs(float(sp_eval.loss) - float(ref_eval.loss)) / abs(float(ref_eval.loss)),
            relative(sp_eval.logits, ref_eval.logits),
            float(int(n_local) != int(ref_eval.num_supervised_tokens)),
            aux_rel,
        ]
    )
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {
        "family": family,
        "sp": size,
        "world": world,
        "mode": config["mode"],
        "control": control,
        "checkpointing": checkpointing,
        "lengths": lengths,
        "loss": float(logged),
        "ref_loss": ref_loss,
        "loss_rel": abs(float(logged) - ref_loss) / abs(ref_loss),
        "grad_rel": max(grads.values()),
        "worst_param": max(grads, key=grads.get),
        "params": len(grads),
        "eval_loss_rel": float(worst[0]),
        "logits_rel": float(worst[1]),
        "eval_count_ok": not bool(worst[2]),
        "aux_rel": float(worst[3]),
        "oracle_rel": oracle_rel,
        "amp_errors": amp_errors,
        "linear_backend": linear_backend,
        "fla_calls_sp": {k: len(v) - ref_calls[k] for k, v in fla_calls.items()},  # train + eval forwards
        "fla_dtypes_sp": sorted({str(d) for k, v in fla_calls.items() for d in v[ref_calls[k] :]}),
        "telemetry_tokens_ok": counted["real_tokens"] == sum(lengths),  # every pack once, not once per SP rank
        "telemetry_sp_padding_ok": counted["sp_padding_tokens"] == pad,
        "comm_seconds": counted["comm_seconds"],
        "tower_patches_per_rank": [int(e[0]) for e in everyone],  # dummy images included (4 patches each)
        "tower_calls_per_rank": [int(e[2]) for e in everyone],
        "pack_patches": [
            sum(int(b[k].shape[0]) for k in ("pixel_values", "pixel_values_videos") if k in b) for b in packs
        ],
    }


def _per_shard_aux(router_logits, num_experts: int, top_k: int, sp, total: int):
    """The negative control of `sequence_parallel_shard.load_balancing_loss`: transformers'
    function on this rank's shard alone, its router statistics never summed over the SP group."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

    return load_balancing_loss_func(router_logits, num_experts, top_k, None)


def packer_groups(size: int) -> dict:
    """`pack_dataset(sequence_parallel_size=P)` without rank / world arguments: which samples each rank gets. Ranks
    of one SP group must get the same packs, groups disjoint ones."""
    from datasets import Dataset

    from hf_packing import pack_dataset
    from hf_packing.patches import sequence_parallel
    from tests.helpers import load_processor

    assert sequence_parallel.current_size() == size
    rows = [
        {"conversations": [{"from": "human", "value": f"Row {i} " + "this " * (i % 7)}, {"from": "gpt", "value": "ok"}]}
        for i in range(24)
    ]
    packs = pack_dataset(
        Dataset.from_list(rows),
        load_processor("qwen2_5_vl"),
        max_length=64,
        disable_progress=True,
        sequence_parallel_size=size,
    )
    mine = [[int(s["index"]) for s in pack] for pack in packs]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    groups = [everyone[d * size : (d + 1) * size] for d in range(len(everyone) // size)]
    firsts = [{i for pack in g[0] for i in pack} for g in groups]
    return {
        "packer": True,
        "rank_world": [packs.rank, packs.world_size],
        "same_in_group": all(all(r == g[0] for r in g) for g in groups),
        "disjoint_groups": all(not (a & b) for j, a in enumerate(firsts) for b in firsts[j + 1 :]),
        "packs": [len(m) for m in everyone],
    }


if __name__ == "__main__":
    main(sys.argv[1])
    end_process()  # skip interpreter finalization, as multiprocessing's children do (hf_packing.training.distributed)
