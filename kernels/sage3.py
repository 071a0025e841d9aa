"""``sage3`` forward: SageAttention3's numerics (DESIGN.md §3.3) on the fused forward kernel.

Smoothing in float32 as in the reference (:func:`attnqat.reference.sage3_smooth`): K minus its
per-(batch, head) token mean, Q minus the mean of its 128-query block (both subtracted inside the
quantize kernel, so no full-size float32 copy is made). The correction q̄·K_sᵀ is one float32 row
per 128-query block and key, (B, H, ceil(Sq/128), Skv), computed on the tensor cores with q̄ split
in two 16-bit parts (:func:`_sage3_bias_kernel`); the attention kernel adds it to Q_sᶠ K_sᶠᵀ before
the softmax. The smoothed Q, K are
quantized along head_dim and V along tokens by the quantize kernel, and P takes SageAttention3's
two-level quantizer (``P_SAGE3`` in :mod:`attnqat.kernels.attention_fwd`). The means may differ
from the reference's in the last bit (summation order), which moves a code only where a value sits
on a rounding boundary: the outputs are compared within tolerance, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnqat import reference as ref

from .attention_fwd import P_SAGE3, attention_forward, mma
from .quantize import fake_quantize_nvfp4

SAGE_Q_BLOCK = ref.SAGE_Q_BLOCK


@triton.jit
def _sage3_bias_kernel(QBAR, K, KBAR, BIAS, sqb, sqn, sqh, sqd, skb, sks, skh, skd, smb, sms, smh, smd,
                       H, NB, Skv, D: tl.constexpr, BQ: tl.constexpr, BN: tl.constexpr):
    """BIAS[b, h, j, n] = q̄_j · (k_n − k̄) in float32 on the tensor cores: q̄ (float32) is split
    into two 16-bit parts hi + lo that hold 16 of its 24 bits (the rest is below 2^-17 of it), K is
    exact in its 16-bit type, products are exact and accumulate in float32; the k̄ term is a
    float32 dot product per query block."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_j = tl.program_id(2) * BQ + tl.arange(0, BQ)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    j_ok = offs_j < NB
    n_ok = offs_n < Skv
    qbar = tl.load(QBAR + b.to(tl.int64) * sqb + h * sqh + offs_j[:, None] * sqn + offs_d[None, :] * sqd,
                   mask=j_ok[:, None], other=0.0)
    kt = tl.load(K + b.to(tl.int64) * skb + h * skh + offs_n[None, :] * sks + offs_d[:, None] * skd,
                 mask=n_ok[None, :], other=0.0)
    kbar = tl.load(KBAR + b.to(tl.int64) * smb + h * smh + offs_d * smd)
    hi = qbar.to(kt.dtype)
    lo = (qbar - hi.to(tl.float32)).to(kt.dtype)
    acc = mma(hi, kt, None)
    acc = mma(lo, kt, acc)
    acc -= tl.sum(qbar * kbar[None, :], axis=1)[:, None]
    tl.store(BIAS + (bh.to(tl.int64) * NB + offs_j[:, None]) * Skv + offs_n[None, :], acc,
             mask=j_ok[:, None] & n_ok[None, :])


def sage3_prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(B, S, H, D) inputs → quantized operands (B, S, H, D) in q's dtype and the correction bias.

    The float32 arithmetic of :func:`attnqat.reference.sage3_smooth` without its full-size float32
    copies: the means are subtracted inside the quantize kernel, and the correction q̄·(k − k̄)
    comes from :func:`_sage3_bias_kernel` (float32-accurate to about 2^-17).
    """
    B, Sq, H, D = q.shape
    nb = -(-Sq // SAGE_Q_BLOCK)
    pad = nb * SAGE_Q_BLOCK - Sq
    qp = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, pad)) if pad else q
    counts = torch.full((nb,), float(SAGE_Q_BLOCK), device=q.device)
    counts[-1] = SAGE_Q_BLOCK - pad
    qbar = qp.reshape(B, nb, SAGE_Q_BLOCK, H, D).sum(dim=2, dtype=torch.float32) / counts[:, None, None]
    kbar = k.mean(dim=1, keepdim=True, dtype=torch.float32)                     # (B, 1, H, D)
    bias = torch.empty(B, H, nb, k.shape[1], device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(k.shape[1], 128), B * H, triton.cdiv(nb, 64))
    _sage3_bias_kernel[grid](qbar, k, kbar, bias, *qbar.stride(), *k.stride(), *kbar.stride(),
                             H, nb, k.shape[1], D=D, BQ=64, BN=128, num_warps=4)
    qf = fake_quantize_nvfp4(q, -1, shift=qbar, shift_group=SAGE_Q_BLOCK)
    kf = fake_quantize_nvfp4(k, -1, shift=kbar, shift_group=k.shape[1])
    vf = fake_quantize_nvfp4(v, 1)
    return qf, kf, vf, bias


def sage3_forward(q, k, v, sm_scale: float, config: dict | None = None) -> torch.Tensor:
    """SageAttention3-numerics attention on (B, S, H, D) tensors; returns (B, Sq, H, D)."""
    qf, kf, vf, bias = sage3_prepare(q, k, v)
    cfg = dict(config or {})
    if SAGE_Q_BLOCK % cfg.get("BM", 128):
        raise ValueError("sage3 needs a query tile that divides the 128-query smoothing block")
    o, _, _, _ = attention_forward(qf, kf, vf, sm_scale=sm_scale, p_mode=P_SAGE3, bias=bias,
                                   out_dtype=q.dtype, config=cfg)
    return o
