"""Error metrics used to report 4-bit attention against BF16 (never asserted equal)."""

from __future__ import annotations

import torch


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Cosine similarity, relative L1 (Σ|Δ| / Σ|ref|) and RMSE of ``out`` against ``ref``, in
    float64 over all elements."""
    if out.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(out.shape)} vs {tuple(ref.shape)}")
    a = out.detach().double().flatten()
    b = ref.detach().double().flatten()
    diff = a - b
    return {
        "cosine": (torch.dot(a, b) / (a.norm() * b.norm()).clamp_min(1e-300)).item(),
        "rel_l1": (diff.abs().sum() / b.abs().sum().clamp_min(1e-300)).item(),
        "rmse": diff.pow(2).mean().sqrt().item(),
    }


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ (Frobenius), in float64."""
    a, b = out.detach().double(), ref.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()
