"""``attnqat finetune plot RUN...``: loss and gradient-norm curves of several runs in one PNG.

Reads each run's ``log.jsonl`` (:mod:`attnqat.finetune.runlog`). The loss panel shows the raw
per-step loss faintly and its moving average (``--smooth`` steps) boldly; the gradient-norm panel
is on a log scale (the drop-in ablation's instability shows there first). Runs are labelled by
their folder name, or by ``--labels``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from attnqat.video import palette_png

from .runlog import read_log


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (or their log.jsonl files)")
    parser.add_argument("--out", required=True, type=Path, help="PNG to write")
    parser.add_argument("--labels", default=None, help="comma-separated labels, one per run")
    parser.add_argument("--smooth", type=int, default=20, help="moving-average window in steps")
    parser.add_argument("--title", default=None, help="figure title")


def moving_average(x: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to ``window`` values (the first values average what exists)."""
    if window <= 1 or len(x) == 0:
        return x
    c = np.cumsum(np.insert(x, 0, 0.0))
    n = np.minimum(np.arange(1, len(x) + 1), window)
    return (c[1:] - c[np.arange(1, len(x) + 1) - n]) / n


def plot_runs(runs: list[Path], out: Path, *, labels: list[str] | None = None, smooth: int = 20,
              title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if labels is not None and len(labels) != len(runs):
        raise ValueError(f"{len(labels)} label(s) for {len(runs)} run(s)")
    fig, (ax_loss, ax_grad) = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, run in enumerate(runs):
        recs = read_log(run)
        if not recs:
            raise ValueError(f"{run} has no training records")
        step = np.array([r["step"] for r in recs])
        loss = np.array([float(r["loss"]) for r in recs])
        grad = np.array([float(r["grad_norm"]) for r in recs])
        label = labels[i] if labels else (run.name if run.is_dir() else run.parent.name)
        colour = f"C{i % 10}"
        ax_loss.plot(step, loss, color=colour, alpha=0.2, linewidth=0.7)
        ax_loss.plot(step, moving_average(loss, smooth), color=colour, label=label, linewidth=1.6)
        ax_grad.plot(step, grad, color=colour, alpha=0.25, linewidth=0.7)
        ax_grad.plot(step, moving_average(grad, smooth), color=colour, label=label, linewidth=1.6)
    ax_loss.set(xlabel="step", ylabel="training loss (the run's objective)", title=f"loss ({smooth}-step mean)")
    ax_grad.set(xlabel="step", ylabel="gradient norm (before clipping)", yscale="log",
                title="global gradient norm")
    for ax in (ax_loss, ax_grad):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return palette_png(out)


def run(args: argparse.Namespace) -> int:
    labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
    try:
        plot_runs(args.runs, args.out, labels=labels, smooth=args.smooth, title=args.title)
    except (FileNotFoundError, ValueError) as exc:
        print(f"attnqat finetune plot: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


__all__ = ["add_arguments", "moving_average", "plot_runs", "run"]
