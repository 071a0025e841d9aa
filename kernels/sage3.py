"""``sage3`` forward: SageAttention3's numerics (DESIGN.md §3.3) on the fused forward kernel.

Smoothing in float32 as in the reference (:func:`attnqat.reference.sage3_smooth`): K minus its
per-(batch, head) token mean, Q minus the mean of its 128-query block (both subtracted inside the
quantize kernel, so no full-size float32 copy is made). The correction q̄·K_sᵀ is one float32 row
per 128-query block and key, (B, H, ceil(Sq/128), Skv), computed on the tensor cores with q̄ split
in two 16-bit parts (:func:`_sage3_bias_kernel`); the attention kernel adds it to Q_sᶠ K_sᶠᵀ before
the softmax (the Gluon kernel on Hopper: one more k-step of Q_sᶠ K_sᶠᵀ, the row as three bf16
parts). The smoothed Q, K are quantized along head_dim and V along tokens by the quantize kernel,
and P takes SageAttention3's two-level quantizer (``P_SAGE3`` in :mod:`attnqat.kernels.attention_fwd`).
The means may differ from the reference's in the last bit (summation order), which moves a code
only where a value sits on a rounding boundary: the outputs are compared within tolerance, not bit
for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import gluon_fwd
from .attention_fwd import P_SAGE3, attention_forward, mma
from .formats import SAGE_Q_BLOCK
from .gluon_fwd import check_schedule, choose_schedule
from .quantize import fake_quantize_nvfp4


@triton.jit
def _sage3_bias_kernel(QBAR, K, KBAR, BIAS, sqb, sqn, sqh, sqd, skb, sks, skh, skd, smb, sms, smh, smd,
                       H, NB, Skv, SKV_PAD, D: tl.constexpr, BQ: tl.constexpr, BN: tl.constexpr,
                       PARTS: tl.constexpr):
    """BIAS[b, h, j, n] = q̄_j · (k_n − k̄) in float32 on the tensor cores: q̄ (float32) is split
    into two 16-bit parts hi + lo that hold 16 of its 24 bits (the rest is below 2^-17 of it), K is
    exact in its 16-bit type, products are exact and accumulate in float32; the k̄ term is a
    float32 dot product per query block.

    PARTS: the same float32 values stored as three bfloat16 parts hi + mid + lo (each the rounded
    remainder of the previous: float32's 24 bits in 3 × 8), BIAS[(b·H + h)·NB + j, part, n] with
    SKV_PAD ≥ Skv keys per row, zeros past Skv (the Gluon kernel's layout, ``bias_parts=True``)."""
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
    if PARTS:
        acc = tl.where(n_ok[None, :], acc, 0.0)
        ptrs = BIAS + (bh.to(tl.int64) * NB + offs_j[:, None]) * (3 * SKV_PAD) + offs_n[None, :]
        ok = j_ok[:, None] & (offs_n < SKV_PAD)[None, :]
        hi = acc.to(tl.bfloat16)
        rest = acc - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        tl.store(ptrs, hi, mask=ok)
        tl.store(ptrs + SKV_PAD, mid, mask=ok)
        tl.store(ptrs + 2 * SKV_PAD, (rest - mid.to(tl.float32)).to(tl.bfloat16), mask=ok)
    else:
        tl.store(BIAS + (bh.to(tl.int64) * NB + offs_j[:, None]) * Skv + offs_n[None, :], acc,
                 mask=j_ok[:, None] & n_ok[None, :])


def _means(q: torch.Tensor, k: torch.Tensor):
    """q̄ per 128-query block (B, ⌈Sq/128⌉, H, D) and k̄ (B, 1, H, D), float32."""
    B, Sq, H, D = q.shape
    nb = -(-Sq // SAGE_Q_BLOCK)
    pad = nb * SAGE_Q_BLOCK - Sq
    qp = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, pad)) if pad else q
    counts = torch.full((nb,), float(SAGE_Q_BLOCK), device=q.device)
    counts[-1] = SAGE_Q_BLOCK - pad
    qbar = qp.reshape(B, nb, SAGE_Q_BLOCK, H, D).sum(dim=2, dtype=torch.float32) / counts[:, None, None]
    return qbar, k.mean(dim=1, keepdim=True, dtype=torch.float32)


def _correction(qbar, k, kbar, parts: bool) -> torch.Tensor:
    """q̄·(k − k̄): float32 (B, H, ⌈Sq/128⌉, Skv) for the Triton kernel, or with ``parts`` the Gluon
    kernel's three bf16 parts (:func:`.gluon_fwd.bias_parts_shape`)."""
    B, nb, H, D = qbar.shape
    Skv = k.shape[1]
    if parts:
        pad = triton.cdiv(Skv, 8) * 8
        bias = torch.empty(B * H * nb, 3, pad, device=k.device, dtype=torch.bfloat16)
    else:
        pad = Skv
        bias = torch.empty(B, H, nb, Skv, device=k.device, dtype=torch.float32)
    grid = (triton.cdiv(pad, 128), B * H, triton.cdiv(nb, 64))
    _sage3_bias_kernel[grid](qbar, k, kbar, bias, *qbar.stride(), *k.stride(), *kbar.stride(),
                             H, nb, Skv, pad, D=D, BQ=64, BN=128, PARTS=parts, num_warps=4)
    return bias


def _quantized(q, k, v, qbar, kbar):
    qf = fake_quantize_nvfp4(q, -1, shift=qbar, shift_group=SAGE_Q_BLOCK)
    kf = fake_quantize_nvfp4(k, -1, shift=kbar, shift_group=k.shape[1])
    return qf, kf, fake_quantize_nvfp4(v, 1)


def sage3_prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, bias_parts: bool = False):
    """(B, S, H, D) inputs → quantized operands (B, S, H, D) in q's dtype and the correction bias.

    The float32 arithmetic of :func:`attnqat.reference.sage3_smooth` without its full-size float32
    copies: the means are subtracted inside the quantize kernel, and the correction q̄·(k − k̄)
    comes from :func:`_sage3_bias_kernel` (float32-accurate to about 2^-17): float32
    (B, H, ⌈Sq/128⌉, Skv) for the Triton kernel, or with ``bias_parts`` the same values as the
    Gluon kernel reads them (three bf16 parts, :func:`.gluon_fwd.bias_parts_shape`).
    """
    qbar, kbar = _means(q, k)
    return (*_quantized(q, k, v, qbar, kbar), _correction(qbar, k, kbar, bias_parts))


def sage3_forward(q, k, v, sm_scale: float, config: dict | None = None, schedule: str | None = None) -> torch.Tensor:
    """SageAttention3-numerics attention on (B, S, H, D) tensors; returns (B, Sq, H, D).
    ``schedule``: ``"gluon"`` | ``"triton"`` | None (:func:`.gluon_fwd.choose_schedule`; ``config``
    holds Triton tile overrides, so it selects the Triton kernel)."""
    check_schedule(schedule)
    cfg = dict(config or {})
    if SAGE_Q_BLOCK % cfg.get("BM", 128):
        raise ValueError("sage3 needs a query tile that divides the 128-query smoothing block")
    qbar, kbar = _means(q, k)
    qf, kf, vf = _quantized(q, k, v, qbar, kbar)
    if choose_schedule(qf, kf, vf, schedule, config) == "gluon":
        return gluon_fwd.gluon_attention_forward(qf, kf, vf, sm_scale=sm_scale, p_mode=P_SAGE3,
                                       bias=_correction(qbar, k, kbar, parts=True))
    o, _, _, _ = attention_forward(qf, kf, vf, sm_scale=sm_scale, p_mode=P_SAGE3,
                                   bias=_correction(qbar, k, kbar, parts=False), out_dtype=q.dtype, config=cfg)
    return o
