"""Rank balance benchmark: per-step spread of work across ranks for the former and the new assignment.

Packs come from `plan_packs` (streaming BFD, buffer 1000) on the modelled mixes of `bench_packing.py` (LLaVA-like at
8k, documents and hi-res photos + long text at 16k). A pack's true work is `WorkCost.from_config()` (Qwen2.5-VL-7B:
text n + n²·a, vision tower per patch, vision attention per image) summed over its samples. A step is `per_rank`
packs per rank (the DataLoader batch); its time is its most loaded rank's work, so the score is Σ over steps of the
most loaded rank / Σ of the mean rank (1.0: no rank ever waits). Arms:

- `before`: today's `main`: consecutive groups of `world` packs, each rank one pack per group, the costliest pack
  (by text cost n + n² // 65,536) to the rank with the least cumulative cost;
- `greedy total`: the same greedy with the full cost (text + vision);
- `consecutive steps, <split>`: steps of consecutive packs, each split by `<split>` (`SPLITS`: `kk` is the library's
  `partition`; `lpt`, `snake` and `lpt_swap` live here only);
- `window K, <split>`: `schedule` over windows of K steps (sorted by cost, cut into steps, each split);
- `window 16, kk, by text cost`: the same with the vision terms left out of the cost (negative control).

Run: ``python benchmarks/bench_balance.py`` (about a minute, one core).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from bench_packing import docs_mix, hires_mix, llava_mix  # noqa: E402

CHOSEN = "window 16, kk"
TOLERANCE = 0.02


def packs_of(mix: dict[str, np.ndarray], max_length: int) -> tuple[list[float], list[float]]:
    """Full and text-only cost of every pack of the mix (Qwen2.5-VL-7B weights)."""
    from hf_packing import WorkCost
    from hf_packing.packing.planner import plan_packs

    keep = mix["lengths"] <= max_length
    lengths = mix["lengths"][keep]
    patches = (4 * (mix["lengths"] - mix["text"] - 2 * mix["images"]))[keep]
    squares = mix["vision_sq"][keep]
    cost = WorkCost.from_config()
    full = (
        lengths
        + cost.attention * lengths.astype(np.float64) ** 2
        + cost.patch * patches
        + cost.vision_attention * squares
    )
    old = lengths + lengths * lengths // 65_536  # main's text cost
    packs = plan_packs(lengths, max_length=max_length, buffer_size=1000)
    return [float(full[p].sum()) for p in packs], [float(old[p].sum()) for p in packs]


def lpt(costs: Sequence[float], world: int, *, swap: bool = False) -> list[list[int]]:
    """Costliest first to the least loaded rank with room (equal counts); with `swap`, then pairwise swaps out of the
    most loaded rank, best first, while they lower the larger of the two loads (at most 100)."""
    per, order = len(costs) // world, sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    parts, loads = [[] for _ in range(world)], [0.0] * world
    for i in order:
        r = min((r for r in range(world) if len(parts[r]) < per), key=lambda r: (loads[r], r))
        parts[r].append(i)
        loads[r] += costs[i]
    for _ in range(100 if swap else 0):
        top = max(range(world), key=lambda r: (loads[r], -r))
        best = None
        for r in range(world):
            for a, i in enumerate(parts[top]):
                for b, j in enumerate(parts[r]):
                    d = costs[i] - costs[j]
                    peak = max(loads[top] - d, loads[r] + d)
                    if d > 0 and peak < loads[top] and (best is None or peak < best[0]):
                        best = (peak, r, a, b, d)
        if best is None:
            break
        _, r, a, b, d = best
        parts[top][a], parts[r][b] = parts[r][b], parts[top][a]
        loads[top] -= d
        loads[r] += d
    return [sorted(p) for p in parts]


def snake(costs: Sequence[float], world: int) -> list[list[int]]:
    """Sorted by cost, dealt to ranks 0..W-1, then W-1..0, and so on."""
    parts: list[list[int]] = [[] for _ in range(world)]
    for k, i in enumerate(sorted(range(len(costs)), key=lambda i: (-costs[i], i))):
        row, col = divmod(k, world)
        parts[col if row % 2 == 0 else world - 1 - col].append(i)
    return [sorted(p) for p in parts]


def splits() -> dict[str, Callable[[Sequence[float], int], list[list[int]]]]:
    """The split methods compared: the library's (`kk`) first."""
    from hf_packing.packing.balance import partition

    return {"kk": partition, "lpt": lpt, "snake": snake, "lpt_swap": lambda c, w: lpt(c, w, swap=True)}


def before(costs: list[float], world: int, per_rank: int) -> list[list[int]]:
    """main's `_assign`: groups of `world` consecutive packs, costliest to the least cumulative cost."""
    groups, totals = [], [0.0] * world
    for start in range(0, len(costs) - len(costs) % world, world):
        group = list(range(start, start + world))
        order = sorted(group, key=lambda k: (-costs[k], k))
        ranks = sorted(range(world), key=lambda r: (totals[r], r))
        row = [0] * world
        for k, r in zip(order, ranks, strict=True):
            totals[r] += costs[k]
            row[r] = k
        groups.append(row)
    return groups


def consecutive(method: str) -> Callable[[list[float], int, int], list[list[int]]]:
    split = splits()[method]

    def run(costs: list[float], world: int, per_rank: int) -> list[list[int]]:
        size, groups = world * per_rank, []
        for start in range(0, len(costs) - len(costs) % world, size):
            step = list(range(start, min(start + size, len(costs) - len(costs) % world)))
            parts = split([costs[i] for i in step], world)
            groups += [[step[parts[r][j]] for r in range(world)] for j in range(len(parts[0]))]
        return groups

    return run


def windowed(window: int, method: str) -> Callable[[list[float], int, int], list[list[int]]]:
    from hf_packing.packing.balance import schedule

    split = splits()[method]

    def run(costs: list[float], world: int, per_rank: int) -> list[list[int]]:
        usable, size, groups = len(costs) - len(costs) % world, window * world * per_rank, []
        for start in range(0, usable, size):
            chunk = list(range(start, min(start + size, usable)))
            groups += [
                [chunk[k] for k in g]
                for g in schedule([costs[i] for i in chunk], world=world, per_rank=per_rank, split=split)
            ]
        return groups

    return run


def spread(groups: list[list[int]], true: list[float], per_rank: int) -> float:
    from hf_packing.packing.balance import step_spread

    steps = [groups[k : k + per_rank] for k in range(0, len(groups), per_rank)]
    return step_spread([[sum(true[g[r]] for g in step) for r in range(len(step[0]))] for step in steps])


def main(argv: list[str] | None = None) -> None:
    methods = list(splits())
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    t0, load = time.time(), C.load_average()
    mixes = {
        "llava @ 8k": (llava_mix(100_000), 8192),
        "docs @ 16k": (docs_mix(20_000), 16384),
        "hires @ 16k": (hires_mix(40_000), 16384),
    }
    arms: dict[str, Callable] = {"before (main: greedy, text cost)": None}
    for method in methods:
        arms[f"consecutive steps, {method}"] = consecutive(method)
    for window in (2, 4, 8, 16, 32):
        arms[f"window {window}, kk"] = windowed(window, "kk")
    for method in methods[1:]:
        arms[f"window 8, {method}"] = windowed(8, method)
    arms["window 16, kk, by text cost (control)"] = "text"
    rows, checks, timing = [], [], {}
    cases = [(m, w, k) for m in mixes for w in (8, 64) for k in (1, 2)]
    results: dict[tuple, dict[str, float]] = {}
    for mix_name, (mix, max_length) in mixes.items():
        full, text = packs_of(mix, max_length)
        for world in (8, 64):
            for per_rank in (1, 2):
                got = {}
                for name, arm in arms.items():
                    start = time.perf_counter()
                    if arm is None:
                        groups = before(text, world, per_rank)
                    elif arm == "text":
                        groups = windowed(16, "kk")(text, world, per_rank)
                    else:
                        groups = arm(full, world, per_rank)
                    timing.setdefault(name, []).append((time.perf_counter() - start) / len(full))
                    got[name] = spread(groups, full, per_rank)
                results[(mix_name, world, per_rank)] = got
                best = min(got.values())
                checks.append(got[CHOSEN] <= best * (1 + TOLERANCE))
                print(f"[balance] {mix_name} world {world} x {per_rank}: {len(full)} packs done", flush=True)
    header = ["arm"] + [f"{m}, {w} ranks x {k}" for m, w, k in cases] + ["µs/pack"]
    for name in arms:
        row = [name] + [f"{results[c][name]:.4f}" for c in cases] + [f"{np.median(timing[name]) * 1e6:.1f}"]
        rows.append(row)
    best_row = ["best tried"] + [f"{min(results[c].values()):.4f}" for c in cases] + [""]
    rows.append(best_row)
    packs = {m: len(packs_of(mix, ml)[0]) for m, (mix, ml) in mixes.items()}
    verdict = "PASS" if all(checks) else "FAIL"
    body = f"""## Rank balance: per-step spread of text + vision work (`bench_balance.py`)

{C.footer(t0, C.machine("one process, one thread"), load_before=load)}
- Packs: `plan_packs` streaming BFD (buffer 1000) on the modelled mixes of `bench_packing.py` ({", ".join(f"{m}: {n:,} packs" for m, n in packs.items())}; **hires** is new: 50% text-only chats, lognormal median 1,500 tokens, 50% one 1-8 Mpx photo, see `hires_mix`). A pack's work: `WorkCost.from_config()` (Qwen2.5-VL-7B) over its samples, vision patches = 4 per image token, vision attention Σ patches² per image.
- Score: Σ over steps of the most loaded rank's work / Σ of the mean rank's work (1.0 = no rank waits; 1.10 = 10% of each step's wall time lost on average). A step is `per_rank` packs per rank (the DataLoader batch); columns are `ranks x per_rank`. Deterministic (no timing noise) except the µs/pack column, the median over cases of the arm's wall time per pack on a loaded shared machine.

{C.md_table(header, rows)}

Chosen for `pack_dataset`: **{CHOSEN}** (`balance_window=16`, `schedule(...)` with its default split, `partition`). Within {TOLERANCE:.0%} of the best arm tried in every column: **{verdict}**.
"""
    if args.no_write:
        print(body)
    else:
        C.write_section("bench_balance", body)
        print(body)


if __name__ == "__main__":
    main()
