"""The study's figure: stacked win/tie/lose bars (the layout of the paper's Figure 2).

One horizontal bar per method pair and question, split into the shares of win (A preferred), tie
and lose, each segment labelled with its percentage. Written as PNG and SVG; the SVG carries no
date and a fixed hash salt, so the same votes give the same file.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend first)

COLOURS = {"win": "#2e7d32", "tie": "#9e9e9e", "lose": "#c62828"}
QUESTION_LABELS = {"overall": "overall", "visual_quality": "visual quality", "motion": "motion",
                   "text_alignment": "text alignment"}


def wtl_rows(analysis: dict) -> list[tuple[str, dict[str, int]]]:
    """(label, counts) for each pair and question of an analysis, in report order."""
    rows = []
    for pair, data in analysis["pairs"].items():
        for question, summary in data["questions"].items():
            rows.append((f"{pair} — {QUESTION_LABELS.get(question, question)}", summary["counts"]))
    return rows


def plot_wtl(rows: list[tuple[str, dict[str, int]]], out_stem: str | Path, title: str = ""
             ) -> list[Path]:
    """Draw the stacked bars and write ``<out_stem>.png`` and ``<out_stem>.svg``."""
    out_stem = Path(out_stem)
    height = 0.6 + 0.45 * max(1, len(rows))
    with plt.rc_context({"svg.hashsalt": "attnqat-study", "font.size": 9}):
        fig, ax = plt.subplots(figsize=(8, height))
        labels = []
        for y, (label, counts) in enumerate(reversed(rows)):
            n = sum(counts.values())
            left = 0.0
            for outcome in ("win", "tie", "lose"):
                share = counts[outcome] / n if n else 0.0
                ax.barh(y, share, left=left, color=COLOURS[outcome], edgecolor="white",
                        label=outcome if y == 0 else None)
                if share >= 0.06:
                    ax.text(left + share / 2, y, f"{share:.0%}", ha="center", va="center",
                            color="white", fontsize=8)
                left += share
            labels.append(f"{label} (n={n})")
        ax.set_yticks(range(len(labels)), labels)
        ax.set_xlim(0, 1)
        ax.set_xlabel("share of votes (method A's view)")
        ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
        if title:
            fig.suptitle(title, y=0.995)
        fig.tight_layout()
        paths = [out_stem.with_suffix(".png"), out_stem.with_suffix(".svg")]
        fig.savefig(paths[0], dpi=150)
        fig.savefig(paths[1], metadata={"Date": None})
        plt.close(fig)
    return paths
