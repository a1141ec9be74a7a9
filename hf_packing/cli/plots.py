"""Pictures for the demo and ``hf-packing stats`` (matplotlib, Agg backend, imported lazily)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..pack_stats import PADDED_BATCH


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError(
            "the demo and `hf-packing stats` pictures need matplotlib: pip install 'hf_packing[cli]'"
        ) from err

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_packs(
    packs: Sequence[Sequence[tuple[int, int]]],
    path: str | Path,
    *,
    max_length: int,
    batch_size: int = PADDED_BATCH,
    max_rows: int = 12,
) -> Path:
    """Packed batches next to padded batches of the same samples.

    Each bar is one batch; a sample's real tokens have the same colour in both panels, padding is grey.
    Left: one pack per bar (length ``max_length``). Right: the same samples in dataset order (what a
    padded run batches together), ``batch_size`` rows per batch drawn row after row, so a bar's length
    is its slot count (``rows × longest``).

    Args:
        packs: per pack, ``(sample index, tokens)`` of its samples, in pack order.
    """
    plt = _pyplot()
    in_order = sorted(sample for pack in packs for sample in pack)
    padded = [in_order[i : i + batch_size] for i in range(0, len(in_order), batch_size)]
    rows = max(min(len(packs), max_rows), min(len(padded), max_rows))
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.45 * rows + 1.6), sharex=True)
    colours = plt.get_cmap("tab20").colors

    def bar(ax, row, start, width, index=None):
        colour = "0.85" if index is None else colours[index % len(colours)]
        ax.barh(row, width, left=start, color=colour, edgecolor="white" if index is not None else colour, linewidth=0.3)

    for row, pack in enumerate(packs[:max_rows]):
        start = 0
        for index, n in pack:
            bar(axes[0], row, start, n, index)
            start += n
        bar(axes[0], row, start, max_length - start)
    for row, batch in enumerate(padded[:max_rows]):
        width = max(n for _, n in batch)
        for k, (index, n) in enumerate(batch):
            bar(axes[1], row, k * width, n, index)
            bar(axes[1], row, k * width + n, width - n)
    real = sum(n for _, n in in_order)
    packed_fill = real / (len(packs) * max_length)
    padded_fill = real / sum(len(b) * max(n for _, n in b) for b in padded)
    axes[0].set_title(f"packed: {len(packs)} packs of {max_length} tokens, {packed_fill:.0%} real tokens")
    axes[1].set_title(f"padded batches of {batch_size}: {len(padded)} batches, {padded_fill:.0%} real tokens")
    for ax in axes:
        ax.invert_yaxis()
        ax.set_xlabel("token slots")
        ax.set_ylabel("batch")
    fig.suptitle(
        f"first {max_rows} batches of each; a colour is one sample's real tokens, grey is padding", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_loss(steps: Sequence[int], losses: Sequence[float], path: str | Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, losses, marker="o", markersize=2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title("demo training loss (tiny Qwen2.5-VL, rmpad)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_stats(
    fills: dict[str, Sequence[float]], sample_lengths: Sequence[int], path: str | Path, max_length: int
) -> Path:
    """Histogram of pack fill per strategy, and of sample lengths."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for name, values in fills.items():
        axes[0].hist(values, bins=40, range=(0, 1), histtype="step", linewidth=1.5, label=name)
    axes[0].set_xlabel("pack fill (real tokens / max_length)")
    axes[0].set_ylabel("packs")
    axes[0].legend()
    axes[1].hist(sample_lengths, bins=60, color="tab:blue")
    axes[1].axvline(max_length, color="tab:red", linestyle="--", label=f"max_length={max_length}")
    axes[1].set_xlabel("sample length (tokens, from metadata)")
    axes[1].set_ylabel("samples")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
