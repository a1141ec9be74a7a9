"""Pictures for the demo, ``hf-packing stats`` and ``hf-packing plot`` (matplotlib, Agg backend, imported lazily)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from ..packing.stats import PADDED_BATCH


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
    fills: Mapping[str, Sequence[float]], sample_lengths: Sequence[int], path: str | Path, max_length: int
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


#: (panel, training key, evaluation key, per-source training key, per-source evaluation key) that
#: ``hf-packing plot`` draws; ``{}`` is a source name
CURVES = (
    ("loss", "loss", "eval_loss", "loss/{}", "eval_{}_loss"),
    ("token accuracy", None, "eval_token_accuracy", "token_accuracy/{}", "eval_{}_token_accuracy"),
)


def source_names(log_history: Sequence[dict]) -> list[str]:
    """The sources in a Trainer's ``log_history``: from ``loss/<name>`` (training) and ``eval_<name>_loss`` with
    ``eval_<name>_token_accuracy`` (evaluation), in order of appearance."""
    names: dict[str, None] = {}
    for entry in log_history:
        for key in entry:
            if key.startswith("loss/"):
                names[key[len("loss/") :]] = None
            elif key.startswith("eval_") and key.endswith("_loss") and len(key) > len("eval_loss"):
                name = key[len("eval_") : -len("_loss")]
                if f"eval_{name}_token_accuracy" in entry:
                    names[name] = None
    return list(names)


def training_curves(log_history: Sequence[dict]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """``{panel: {label: [(step, value), ...]}}`` from a Trainer's ``log_history`` (``trainer_state.json``).

    Labels: ``train`` / ``eval`` (overall), ``train <source>`` / ``eval <source>``; a label without points is left
    out (no overall training accuracy: the Trainer logs none).
    """
    sources = source_names(log_history)
    curves: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for panel, train_key, eval_key, train_source, eval_source in CURVES:
        keys = {"train": train_key, "eval": eval_key}
        for name in sources:
            keys[f"train {name}"], keys[f"eval {name}"] = train_source.format(name), eval_source.format(name)
        lines = {
            label: [(int(e["step"]), float(e[key])) for e in log_history if key and key in e and "step" in e]
            for label, key in keys.items()
        }
        curves[panel] = {label: points for label, points in lines.items() if points}
    return curves


def plot_curves(log_history: Sequence[dict], path: str | Path, *, title: str = "") -> Path:
    """Loss and token accuracy, overall (black) and per source (one colour each), training (solid) and evaluation
    (dashed, dots), against the optimizer step."""
    plt = _pyplot()
    curves = training_curves(log_history)
    if not any(curves.values()):
        raise ValueError("the log history has no loss or eval_loss entries: nothing to plot (set logging_steps)")
    sources = source_names(log_history)
    colours = {name: plt.get_cmap("tab10").colors[i % 10] for i, name in enumerate(sources)}
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 3.8))
    for ax, (panel, lines) in zip(axes, curves.items(), strict=True):
        for label, points in lines.items():
            split, name = label.split(" ", 1) if " " in label else (label, "")
            style = {"linestyle": "-", "marker": "."} if split == "train" else {"linestyle": "--", "marker": "o"}
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, color=colours.get(name, "black"), label=label, linewidth=1.2, markersize=3, **style)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(panel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "overall (black) and per source; training solid, evaluation dashed", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def find_trainer_state(output_dir: str | Path) -> Path:
    """``trainer_state.json`` of a Trainer run: the file itself, ``OUTPUT_DIR/trainer_state.json`` (``save_state()``),
    else the newest ``checkpoint-*/trainer_state.json``."""
    path = Path(output_dir)
    if path.is_file():
        return path
    if (path / "trainer_state.json").is_file():
        return path / "trainer_state.json"
    checkpoints = sorted(path.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[-1]))
    if not checkpoints:
        raise FileNotFoundError(
            f"no trainer_state.json in {path} or its checkpoint-*/ dirs: pass the Trainer's output_dir (it is written "
            "by trainer.save_state() and at every checkpoint)"
        )
    return checkpoints[-1]


def run_plot(output_dir: str | Path, output: str | Path | None = None) -> Path:
    """``hf-packing plot OUTPUT_DIR``: the curves of the run's ``trainer_state.json`` to ``output`` (default
    ``curves.png`` next to it). Returns the PNG's path."""
    import json

    from .._compat import require_extra

    require_extra("cli", "matplotlib", purpose="hf-packing plot")
    state = find_trainer_state(output_dir)
    history = json.loads(state.read_text())["log_history"]
    return plot_curves(history, output or state.parent / "curves.png", title=f"{state}")
