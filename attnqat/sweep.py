"""Seed sweeps: one prompt × N seeds, every method, and how far each method is from BF16.

A single seed says little about a 4-bit method: the same prompt gives a close clip on one seed and a
different one on the next. :func:`seed_sweep` runs one generation per seed
(:func:`attnqat.generate.run_methods`, every method from that seed's noise) and keeps, per method
and seed, the 4-bit error (PSNR/SSIM against BF16 attention with the same weights, as the record
defines it) and, when a ``score`` function is given, a score of the clip against the prompt (the
app passes the tiny model's procedural score, :func:`attnqat.eval.procedural.score_clip`).
:func:`summarize` gives the mean and the spread (sample standard deviation, min, max) per method;
:func:`format_table` prints them, :func:`render_plot` draws them.

Identical clips have an infinite PSNR: they are counted (``identical``) and left out of the PSNR
statistics, never averaged as a large number.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from . import methods as registry
from .generate import GenerationSettings, StepEvent, run_methods
from .wan import WanModels

#: Largest number of seeds one sweep runs.
MAX_SEEDS = 64
METRICS = ("psnr", "ssim", "score")


@dataclass
class SweepResult:
    """Per-seed metrics and their summary.

    ``rows``: one per (seed, method): ``{"seed", "method", "label", "psnr", "ssim",
    "identical", "score"}`` (``psnr``/``ssim`` None for BF16 itself; ``score`` None without a
    score function). ``summary``: :func:`summarize` of the rows.
    """

    prompt: str
    seeds: list[int]
    methods: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, dict[str, Any]] = field(default_factory=dict)
    score_name: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "seeds": self.seeds, "methods": self.methods,
                "score_name": self.score_name, "settings": self.settings,
                "seconds": self.seconds, "summary": self.summary, "rows": self.rows,
                "what": "psnr/ssim: each clip's 4-bit error (against BF16 attention with the same "
                        "weights); score: the clip against the prompt; mean and sample standard "
                        "deviation over the seeds"}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n"


def parse_seeds(seeds: Any, count: Any = None) -> list[int]:
    """Seeds given as a list, as text ``"0,1,2"`` / ``"0-7"``, or as a first seed with ``count``
    (``parse_seeds(10, 4)`` → 10, 11, 12, 13). Raises ValueError naming what is wrong."""
    if count is not None and not isinstance(seeds, (list, tuple)) and not (
            isinstance(seeds, str) and ("," in seeds or "-" in seeds.strip()[1:])):
        try:
            first, n = int(str(seeds).strip()), int(count)
        except (TypeError, ValueError):
            raise ValueError(f"first seed and count must be whole numbers, got {seeds!r} and "
                             f"{count!r}") from None
        if isinstance(count, float) and not float(count).is_integer():
            raise ValueError(f"the number of seeds must be a whole number, got {count!r}")
        out = list(range(first, first + n))
    elif isinstance(seeds, str):
        out = []
        for part in (p.strip() for p in seeds.split(",") if p.strip()):
            lo, sep, hi = part.partition("-") if not part.startswith("-") else (part, "", "")
            try:
                out.extend(range(int(lo), int(hi) + 1) if sep else [int(part)])
            except ValueError:
                raise ValueError(f"seeds: cannot read {part!r}; write e.g. 0,1,2 or 0-7") from None
    else:
        try:
            out = [int(s) for s in seeds]
        except (TypeError, ValueError):
            raise ValueError(f"seeds must be whole numbers, got {seeds!r}") from None
    if not 2 <= len(out) <= MAX_SEEDS:
        raise ValueError(f"a sweep needs 2 to {MAX_SEEDS} seeds, got {len(out)}")
    if any(s < 0 or s > 2 ** 63 - 1 for s in out):
        raise ValueError("seeds are from 0 to 2^63−1")
    if len(set(out)) != len(out):
        raise ValueError("a seed is listed twice")
    return out


def _stats(values: Sequence[float]) -> dict[str, float | int | None]:
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None}
    return {"n": len(vals), "mean": statistics.fmean(vals),
            "std": statistics.stdev(vals) if len(vals) > 1 else None,
            "min": min(vals), "max": max(vals)}


def summarize(rows: Sequence[dict[str, Any]], methods: Sequence[str]) -> dict[str, dict[str, Any]]:
    """method → {"label", "psnr", "ssim", "score": {"n", "mean", "std", "min", "max"},
    "identical": seeds whose clip equals its reference}."""
    out = {}
    for m in methods:
        mine = [r for r in rows if r["method"] == m]
        out[m] = {"label": mine[0]["label"] if mine else m,
                  **{k: _stats([r[k] for r in mine]) for k in METRICS},
                  "identical": sum(bool(r.get("identical")) for r in mine)}
    return out


def seed_sweep(models: WanModels, settings: GenerationSettings, seeds: Sequence[int], *,
               score: Callable[[str, np.ndarray], float] | None = None,
               score_name: str | None = None,
               on_step: Callable[[int, StepEvent], None] | None = None,
               progress: bool = False) -> SweepResult:
    """Run ``settings`` (every method) once per seed and gather the per-method metrics.

    ``score(prompt, frames)`` scores each clip (None: no score column). ``on_step(i, event)`` is
    called with the seed's index and generate's :class:`StepEvent`; raising in it stops the sweep.
    """

    t0 = time.perf_counter()
    res = SweepResult(prompt=settings.prompt, seeds=list(seeds), methods=list(settings.methods),
                      score_name=score_name if score is not None else None,
                      settings=settings.record())
    for i, seed in enumerate(seeds):
        cb = (lambda ev, i=i: on_step(i, ev)) if on_step is not None else None
        out = run_methods(models, replace(settings, seed=int(seed)), progress=progress, on_step=cb)
        for m in settings.methods:
            r = out.record.methods[m]
            res.rows.append({
                "seed": int(seed), "method": m, "label": r.label or m,
                "psnr": r.psnr, "ssim": r.ssim, "identical": bool(r.identical_to_bf16),
                "score": float(score(settings.prompt, out.videos[m])) if score is not None else None})
    res.summary = summarize(res.rows, settings.methods)
    res.seconds = time.perf_counter() - t0
    return res


def _fmt(s: dict[str, Any], digits: int) -> str:
    if s["mean"] is None:
        return "-"
    spread = f" ± {s['std']:.{digits}f}" if s["std"] is not None else ""
    return f"{s['mean']:.{digits}f}{spread}"


def table_rows(result: SweepResult) -> list[list[str]]:
    """The summary as text cells: method, PSNR, SSIM, score (mean ± sample std), range of PSNR."""
    out = []
    for m, s in result.summary.items():
        rng = (f"{s['psnr']['min']:.2f}–{s['psnr']['max']:.2f}" if s["psnr"]["mean"] is not None
               else "-")
        ident = f" ({s['identical']} identical)" if s["identical"] else ""
        ref = m == registry.REFERENCE
        out.append([s["label"], ("reference" if ref else _fmt(s["psnr"], 2) + ident),
                    "reference" if ref else _fmt(s["ssim"], 4),
                    _fmt(s["score"], 3) if result.score_name else "-",
                    "-" if ref else rng])
    return out


TABLE_HEADER = ["method", "PSNR dB vs BF16", "SSIM vs BF16", "score", "PSNR range"]


def format_table(result: SweepResult) -> str:
    """A plain-text table of :func:`table_rows` with the seeds and what the score is."""
    rows = [TABLE_HEADER] + table_rows(result)
    widths = [max(len(r[i]) for r in rows) for i in range(len(TABLE_HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(f"{len(result.seeds)} seeds ({', '.join(map(str, result.seeds))}); mean ± sample "
                 "standard deviation; PSNR/SSIM are the 4-bit error (vs BF16 attention, same "
                 "weights)" + (f"; score: {result.score_name}" if result.score_name else ""))
    return "\n".join(lines)


def render_plot(result: SweepResult, path: str | Path) -> Path:
    """Per-method PSNR, SSIM (and score) for every seed as dots, with the mean ± std as a bar."""
    import matplotlib  # noqa: PLC0415  (matplotlib: only when a sweep draws its plot)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("psnr", "PSNR vs BF16 (dB)"), ("ssim", "SSIM vs BF16")]
    if result.score_name:
        panels.append(("score", result.score_name))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False,
                             constrained_layout=True)
    labels = [result.summary[m]["label"] for m in result.methods]
    for ax, (key, title) in zip(axes[0], panels):
        for x, m in enumerate(result.methods):
            vals = [r[key] for r in result.rows if r["method"] == m and r[key] is not None]
            if not vals:
                continue
            jitter = np.linspace(-0.12, 0.12, len(vals)) if len(vals) > 1 else [0.0]
            ax.scatter(np.full(len(vals), x) + jitter, vals, s=14, alpha=0.7, color=f"C{x}")
            st = result.summary[m][key]
            if st["mean"] is not None:
                ax.errorbar([x + 0.28], [st["mean"]], yerr=[st["std"] or 0.0], fmt="o", color="k",
                            capsize=4, ms=4)
        ax.set_xticks(range(len(result.methods)), labels, rotation=20, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{len(result.seeds)} seeds: dots per seed, black: mean ± std", fontsize=9)
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


__all__ = ["MAX_SEEDS", "SweepResult", "TABLE_HEADER", "format_table", "parse_seeds",
           "render_plot", "seed_sweep", "summarize", "table_rows"]
