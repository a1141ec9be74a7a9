"""Length index benchmark: what planning costs a replica with and without the index, and what the index costs once.

Data: ``--rows`` HF-messages rows (94% with one JPEG of 300-1000 px a side, as `bench_packing.py`'s end-to-end rows)
cycling over ``--images`` distinct files, saved with `save_to_disk` and loaded back (so the dataset has cache files,
as `load_dataset` gives); the tiny Qwen2.5-VL processor (`tests/fixtures/qwen2_5_vl`); `max_length=8192`.

Measured, one process pinned to one core, torch and pyarrow one thread, arms interleaved round by round:

- `Preprocessor.estimate` rows/s (what every replica does per row without the index);
- one replica's planning pass, `PackedDataset.count_packs()` (read, estimate or read columns, plan), rows/s, with
  `length_index=False` and with the index;
- the index build (`build_length_index`) rows/s with `num_proc` 1 and 2 into a fresh directory, and the second
  call that finds the file (reuse), in seconds.

Then R = 1, 2, 4, 8 replicas at once (forked processes, as DataLoader workers of ranks on one machine, not pinned:
the machine has few cores, so wall time grows past them; each replica's CPU time is reported). Beyond 8 the table is
modelled from the per-core rates: a replica's planning CPU is N × (time per row), the index adds one build.

Run: ``PYTHONPATH=. python benchmarks/bench_index.py`` (about 2 minutes; ``--quick`` writes nothing).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from bench_packing import FIXTURE, _jpeg_rows  # noqa: E402

LLAVA_ROWS = 665_000
MODELLED = ((1, 1), (8, 1), (8, 4), (64, 1), (64, 4))  # (GPUs, DataLoader workers per GPU)


def make_dataset(rows: int, images: int, folder: Path) -> Any:
    from datasets import Dataset, load_from_disk

    unique = _jpeg_rows(images, folder)
    Dataset.from_list([unique[k % images] for k in range(rows)]).save_to_disk(str(folder / "ds"))
    return load_from_disk(str(folder / "ds"))


def pack(ds: Any, processor: Any, root: Path, **kw: Any) -> Any:
    from hf_packing.packing.dataset import pack_dataset

    return pack_dataset(ds, processor, max_length=8192, media_root=str(root), disable_progress=True, **kw)


def _replica(ds: Any, processor: Any, root: Path, indexed: bool, out: Any) -> None:
    train = pack(ds, processor, root, length_index=indexed)
    start = time.process_time()
    train.count_packs(disable_progress=True)
    out.put(time.process_time() - start)


def replicas(ds: Any, processor: Any, root: Path, count: int, indexed: bool) -> tuple[float, float]:
    """Wall seconds and mean CPU seconds per replica of `count` replicas planning the whole dataset at once."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_replica, args=(ds, processor, root, indexed, out)) for _ in range(count)]
    start = time.perf_counter()
    for p in procs:
        p.start()
    cpu = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return time.perf_counter() - start, sum(cpu) / count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.images, args.repeats = 300, 30, 1

    import datasets
    import pyarrow as pa
    import torch
    from transformers import AutoProcessor

    from hf_packing.packing.length_index import build_length_index
    from hf_packing.packing.readers import MapSource
    from hf_packing.preprocess.preprocessor import Preprocessor

    torch.set_num_threads(1)
    pa.set_cpu_count(1)
    datasets.disable_progress_bars()
    t0, load = time.time(), C.load_average()
    processor = AutoProcessor.from_pretrained(str(FIXTURE))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ds = make_dataset(args.rows, args.images, root)
        pre = Preprocessor(processor, max_length=8192, media_root=str(root))
        core = C.idlest_core()
        os.sched_setaffinity(0, {core})
        rows = [row for row, _ in MapSource(ds).rows(None, 0)]
        pack(ds, processor, root, length_index=True)  # the index file exists from here on: its arms time reading
        builds = iter(range(10**6))

        def estimate() -> float:
            start = time.perf_counter()
            for k, row in enumerate(rows):
                pre.estimate(row, k)
            return len(rows) / (time.perf_counter() - start)

        def plan(indexed: bool):
            def run() -> float:
                train = pack(ds, processor, root, length_index=indexed)
                start = time.perf_counter()
                train.count_packs(disable_progress=True)
                return len(rows) / (time.perf_counter() - start)

            return run

        def build(num_proc: int):
            def run() -> float:
                where = root / f"index-{next(builds)}"
                start = time.perf_counter()
                build_length_index(ds, pre, cache_dir=where, num_proc=num_proc, progress=False)
                first = time.perf_counter() - start
                start = time.perf_counter()
                build_length_index(ds, pre, cache_dir=where, num_proc=num_proc, progress=False)
                reuse.setdefault(num_proc, []).append(time.perf_counter() - start)
                return len(rows) / first

            return run

        reuse: dict[int, list[float]] = {}
        rates = C.interleaved(
            {
                "estimate": estimate,
                "plan without index": plan(False),
                "plan with index": plan(True),
                "build num_proc=1": build(1),
                "build num_proc=2": build(2),
            },
            warmup=1,
            repeats=args.repeats,
        )
        rate = {k: C.median(v) for k, v in rates.items()}
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        measured = []
        for count in (1, 2, 4, 8):
            for indexed in (False, True):
                wall, cpu = replicas(ds, processor, root, count, indexed)
                measured.append((count, indexed, wall, cpu))
                print(f"[index] {count} replicas, index {indexed}: wall {wall:.2f} s, cpu {cpu:.2f} s", flush=True)

    n = args.rows
    rows_table = [
        ["`Preprocessor.estimate`", f"{rate['estimate']:,.0f}", f"{1e3 / rate['estimate']:.2f} ms"],
        ["planning pass, `length_index=False`", f"{rate['plan without index']:,.0f}", ""],
        ["planning pass, with the index", f"{rate['plan with index']:,.0f}", ""],
        ["index build, `num_proc=1` (first run)", f"{rate['build num_proc=1']:,.0f}", ""],
        ["index build, `num_proc=2` (first run)", f"{rate['build num_proc=2']:,.0f}", ""],
    ]
    reuse_text = ", ".join(f"num_proc={k}: {C.median(v) * 1e3:.0f} ms" for k, v in reuse.items())
    per_replica = [
        [
            str(count),
            "index" if indexed else "no index",
            f"{cpu:.2f}",
            f"{count * cpu:.2f}",
            f"{wall:.2f}",
        ]
        for count, indexed, wall, cpu in measured
    ]
    t_est, t_col = 1 / rate["plan without index"], 1 / rate["plan with index"]
    t_build = 1 / rate["build num_proc=1"]
    modelled = []
    for gpus, workers in MODELLED:
        r = gpus * workers
        without = LLAVA_ROWS * t_est
        with_ = LLAVA_ROWS * t_col
        build_cpu = LLAVA_ROWS * t_build
        modelled.append(
            [
                f"{gpus} x {workers} = {r}",
                f"{without / 60:,.1f} min",
                f"{r * without / 3600:,.1f} h",
                f"{with_:,.1f} s",
                f"{(r * with_ + build_cpu) / 3600:,.2f} h",
                f"{build_cpu / 32 / 60:,.1f} min",
            ]
        )
    body = f"""## Length index: planning cost per replica, with and without (`bench_index.py`)

{C.footer(t0, C.machine(f"rates pinned to core {core}, torch / pyarrow 1 thread; replicas not pinned"), load_before=load, extra=["pyarrow"])}
- Data: {n:,} HF-messages rows over {args.images} JPEGs of 300-1000 px (94% with an image), `save_to_disk` + `load_from_disk`; tiny Qwen2.5-VL processor (its tokenizer has a 500-token vocabulary: a real one tokenizes slower, so real estimates cost more and the index saves more), `max_length=8192`. Other engineers' jobs shared the 2 cores: compare arms within this run (they are interleaved, {args.repeats} measured rounds after one warm-up, medians).

Per core (rows/s):

{C.md_table(["what", "rows/s", "per row"], rows_table)}

The index build's second call with the same settings finds its Arrow file and reads it: {reuse_text} for {n:,} rows (first runs: {n / rate["build num_proc=1"]:.2f} s with 1 process, {n / rate["build num_proc=2"]:.2f} s with 2).

R replicas planning the whole dataset at once (forked processes, like DataLoader workers of ranks on one node): CPU per replica stays flat (each replica plans every row); wall time grows once replicas outnumber the 2 cores.

{C.md_table(["replicas", "path", "CPU s per replica", "CPU s, all replicas", "wall s"], per_replica)}

Modelled for LLaVA-665k ({LLAVA_ROWS:,} rows) from the per-core rates above: a replica's planning CPU is rows × time per row of its planning pass; with the index add one build (its CPU at the `num_proc=1` rate; its wall time with 32 processes). Without a shared file system each node's first process builds its own copy: add one build's CPU per further node.

{C.md_table(["GPUs x workers = replicas", "no index: CPU per replica", "no index: CPU, all", "index: CPU per replica", "index: CPU, all (+ 1 build)", "index build wall (32 procs)"], modelled)}
"""
    if args.quick:
        print(body)
    else:
        C.write_section("bench_index", body)
        print(body)


if __name__ == "__main__":
    main()
