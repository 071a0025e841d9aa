"""The attention-error map: where 4-bit attention departs from BF16 attention, per layer × step.

During a 4-bit method's generation an observer on the attention processor
(:attr:`attnqat.wan.AttnQATProcessor.observer`) receives every call's q, k, v and output, runs BF16
attention (the ``bf16`` method, PyTorch SDPA) on the SAME q, k, v and accumulates the relative error

    ‖O_4bit − O_bf16‖₂ / ‖O_bf16‖₂

per denoising step × transformer layer (the squared norms of a step's calls — the conditional and
unconditional passes of classifier-free guidance — are summed before the ratio). The inputs are the
method's own: after the first step the trajectories differ, so the map shows the error of each
attention call where that method's generation actually went, not an accumulated drift.

The reference attention runs outside the processor's timing, but it adds to the denoising time of
a generation that collects the map (the record says so).

:func:`write_error_map` writes ``error_map.json`` and a heatmap ``error_map.png`` (one panel per
method, layers down, steps across, one shared logarithmic colour scale).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from . import methods as registry
from .attention import attention

#: the files :func:`write_error_map` writes
JSON_NAME = "error_map.json"
PNG_NAME = "error_map.png"


class ErrorMapObserver:
    """Collects the relative error of one method's attention calls against BF16 attention on the
    same inputs, per (step, layer), for the call kinds in ``kinds`` (``"self"``, ``"cross"``).

    Call :meth:`next_step` after each denoising step (calls are assigned to layers in the order a
    transformer forward makes them: call ``i`` of a kind within a step is layer ``i mod layers``).
    """

    def __init__(self, layers: int, steps: int, kinds: tuple[str, ...] = ("self",)):
        if layers < 1 or steps < 1:
            raise ValueError(f"layers and steps must be at least 1, got {layers}, {steps}")
        self.layers, self.steps, self.kinds = layers, steps, tuple(kinds)
        self.step = 0
        self._calls = {k: 0 for k in self.kinds}
        # kind -> [step][layer] -> [sum of squared error, sum of squared reference]
        self._sums = {k: [[[0.0, 0.0] for _ in range(layers)] for _ in range(steps)]
                      for k in self.kinds}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 kind: str) -> None:
        if kind not in self._sums or self.step >= self.steps:
            return
        layer = self._calls[kind] % self.layers
        self._calls[kind] += 1
        with torch.no_grad():
            ref = attention(q, k, v, method=registry.REFERENCE).float()
            err = float((out.float() - ref).square().sum())
            den = float(ref.square().sum())
        cell = self._sums[kind][self.step][layer]
        cell[0] += err
        cell[1] += den

    def next_step(self) -> None:
        self.step += 1
        self._calls = {k: 0 for k in self.kinds}

    def result(self) -> dict[str, list[list[float | None]]]:
        """kind → [step][layer] relative error (None where no call was seen)."""
        return {kind: [[math.sqrt(e / d) if d > 0 else None for e, d in row] for row in grid]
                for kind, grid in self._sums.items()}


def summarize(maps: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """method → {"mean", "max", "first_step_mean", "last_step_mean"} of its self-attention map."""
    out = {}
    for method, m in maps.items():
        grid = m["rel_error"].get("self") or next(iter(m["rel_error"].values()), [])
        vals = [x for row in grid for x in row if x is not None]
        first = [x for x in (grid[0] if grid else []) if x is not None]
        last = [x for x in (grid[-1] if grid else []) if x is not None]
        mean = (lambda xs: sum(xs) / len(xs) if xs else None)
        out[method] = {"mean": mean(vals), "max": max(vals) if vals else None,
                       "first_step_mean": mean(first), "last_step_mean": mean(last)}
    return out


def render_png(maps: dict[str, dict[str, Any]], path: str | Path, *, kind: str = "self",
               labels: dict[str, str] | None = None) -> Path:
    """A heatmap per method (layers down, steps across) on one log colour scale, written to
    ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import MaxNLocator

    methods = [m for m in maps if kind in maps[m]["rel_error"]]
    if not methods:
        raise ValueError(f"no {kind}-attention map to draw")
    grids = {m: np.array([[np.nan if x is None else x for x in row]
                          for row in maps[m]["rel_error"][kind]], dtype=float).T for m in methods}
    vals = np.concatenate([g[np.isfinite(g) & (g > 0)] for g in grids.values()])
    lo, hi = (float(vals.min()), float(vals.max())) if vals.size else (1e-3, 1.0)
    if hi <= lo:
        hi = lo * 1.01
    fig, axes = plt.subplots(1, len(methods), figsize=(2.2 + 3.0 * len(methods), 3.6),
                             squeeze=False, constrained_layout=True)
    im = None
    for ax, m in zip(axes[0], methods):
        g = grids[m]
        im = ax.imshow(g, aspect="auto", origin="upper", cmap="magma", norm=LogNorm(lo, hi),
                       interpolation="nearest", extent=(0.5, g.shape[1] + 0.5, g.shape[0] - 0.5, -0.5))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title((labels or {}).get(m, m), fontsize=10)
        ax.set_xlabel("denoising step")
        ax.set_ylabel("layer")
    fig.colorbar(im, ax=axes[0].tolist(), label="‖O₄ − O_bf16‖ / ‖O_bf16‖")
    fig.suptitle(f"{kind}-attention relative error against BF16 attention on the same inputs",
                 fontsize=10)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_error_map(maps: dict[str, dict[str, Any]], folder: str | Path, *,
                    labels: dict[str, str] | None = None) -> dict[str, str]:
    """Write ``error_map.json`` (the maps and their summary) and ``error_map.png`` into
    ``folder``; returns {"json": name, "png": name}."""
    folder = Path(folder)
    data = {"what": "relative error ‖O_4bit − O_bf16‖/‖O_bf16‖ of each 4-bit method's attention "
                    "output against BF16 attention on the same q, k, v, per denoising step × "
                    "layer (rel_error[kind][step][layer])",
            "summary": summarize(maps), "methods": maps}
    (folder / JSON_NAME).write_text(json.dumps(data, indent=1, allow_nan=False) + "\n",
                                    encoding="utf-8")
    render_png(maps, folder / PNG_NAME, labels=labels)
    return {"json": JSON_NAME, "png": PNG_NAME}


__all__ = ["ErrorMapObserver", "JSON_NAME", "PNG_NAME", "render_png", "summarize",
           "write_error_map"]
