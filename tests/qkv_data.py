"""Attention inputs shared by the reference and kernel tests."""

import torch


def make_qkv(B, Sq, Skv, H, D, outliers=False, seed=0, dtype=torch.float32, device="cpu"):
    """Random (B, S, H, D) q, k, v drawn on ``device``: Gaussian, or heavy-tailed (Student-t, ν=2,
    clamped at ±60) with K offset by a large per-channel constant, as in real models."""
    g = torch.Generator(device=device).manual_seed(seed)
    if outliers:
        torch.manual_seed(seed)
        t = torch.distributions.StudentT(torch.tensor(2.0, device=device))
        q = t.sample((B, Sq, H, D)).clamp(-60, 60)
        k = t.sample((B, Skv, H, D)).clamp(-60, 60) + 8.0 * torch.randn(1, 1, H, D, device=device, generator=g)
        v = t.sample((B, Skv, H, D)).clamp(-60, 60)
    else:
        q = torch.randn(B, Sq, H, D, device=device, generator=g)
        k = torch.randn(B, Skv, H, D, device=device, generator=g)
        v = torch.randn(B, Skv, H, D, device=device, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def bhsd(t):
    """(B, S, H, D) → (B, H, S, D) float32, the layout of the einsum-based checks."""
    return t.transpose(1, 2).float()
