"""PyTorch reference implementations of the attention methods (DESIGN.md §3.3).

These are the oracles the Triton kernels are tested against, and the implementation that runs on
any device where the kernels do not. Layout inside this module: (batch, heads, seq, head_dim),
float32 arithmetic. Nothing of size seq_q × seq_kv is materialized at once: the forward walks over
key tiles of :data:`KV_TILE` keys (the tile width is part of the ``nvfp4`` definition, because the
running maximum that P̃ is quantized against is taken tile by tile) and over chunks of queries; the
backward walks over chunks of queries.

Methods
-------
``nvfp4``   Q, K quantized per 16 along head_dim, V per 16 along tokens; P̃ = exp(S·scale − m) with m
            the running row maximum after the current key tile, fake-quantized per 16 keys with
            single-level scales; the normalizer l sums the UNquantized P̃; O = Σ P̃ᶠ Vᶠ / l.
``sage3``   SageAttention3's recipe: K minus its per-(batch, head) token mean, Q minus its
            128-query-block mean with the correction q̄·K_sᵀ added in float32, two-level P
            (the row's running maximum maps to 448·6 = 2688, then per-16 E4M3 scales; each element
            is divided by the UNROUNDED block scale and the scale rounded afterwards, as upstream
            does), V per 16 along tokens.
``attnqat`` forward as ``nvfp4``, plus O' = Σ P̃ Vᶠ / l and the log-sum-exp for the backward
            (:func:`attnqat_backward`).
``dropin``  forward as ``nvfp4``; ordinary FlashAttention backward (:func:`dropin_backward`).

Forward/backward quantization of P (a decision, with the measurements behind it). The forward
quantizes P̃ = exp(S·scale − m_running) ≤ 1. Quantizing the NORMALIZED P = exp(S·scale − LSE) in the
backward, literally, breaks at video lengths: normalized probabilities are about 1/seq_kv, so a
block's scale amax/6 falls below E4M3's smallest step 2^-9 and rounds to zero. Measured with
:func:`forward_backward_p_mismatch` (B=1, H=2, D=64, randn inputs, float32, CPU, 2026-11-22): at
seq 4096, 99.96% of the literally quantized normalized P is zero and it differs from the forward's
effective normalized P̃ᶠ·exp(m_tile − LSE) by ‖Δ‖/‖·‖ = 0.97 (0.41 at seq 512). The backward
therefore applies the forward's quantizer to P relative to the row's FINAL maximum m (saved with
the LSE): Pᶠ = Q(exp(S·scale − m)) · exp(m − LSE). That is the forward's quantizer on the forward's
kind of operand; it differs from the forward only in tiles processed before the row maximum was
reached. Residual, same setup: 0.045 at seq 512 and 0.052 at seq 4096 on randn inputs, about half
the forward's own P quantization error (0.093); 0.004 on outlier-heavy inputs (Student-t, ν=2,
K with a per-channel offset), against 0.031. ``tests/test_reference.py`` re-measures these bounds.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .kernels.formats import KV_TILE, SAGE_Q_BLOCK  # shared with the kernels, defined below both
from .nvfp4 import BLOCK, E2M1_MAX, E4M3_MAX, e2m1_round, e4m3_round, fake_quantize_nvfp4
SAGE_P_RANGE = E4M3_MAX * E2M1_MAX  # 2688: a row's running maximum maps here in sage3's level 1

#: the two forward recipes :func:`fp4_forward` implements (the methods' names in the registry,
#: :mod:`attnqat.methods`; ``attnqat`` and ``dropin`` use the ``nvfp4`` forward)
NVFP4 = "nvfp4"
SAGE3 = "sage3"
RECIPES = (NVFP4, SAGE3)

_FWD_BUDGET = 1 << 25   # float32 elements per (B, H, q_chunk, KV_TILE) temporary in the forward
_BWD_BUDGET = 1 << 25   # float32 elements per (B, H, q_chunk, seq_kv) temporary in the backward


# ----------------------------------------------------------------------------------------------
# P quantizers
# ----------------------------------------------------------------------------------------------

def quantize_p_nvfp4(p: torch.Tensor) -> torch.Tensor:
    """Fake-quantize non-negative probabilities per 16 along the last (key) axis, single-level."""
    return fake_quantize_nvfp4(p, dim=-1)


def quantize_p_sage3(p: torch.Tensor) -> torch.Tensor:
    """SageAttention3's two-level P quantizer on P̃ ≤ 1 (relative to the running maximum).

    Level 1 maps the running maximum (P̃ = 1) to 448·6; level 2 takes per-16-key scales
    s = amax/6, divides by the unrounded s and stores E4M3_RN(s). Dequantized: code·E4M3(s)/2688.
    """
    n = p.shape[-1]
    pad = (-n) % BLOCK
    p2 = p.to(torch.float32) * SAGE_P_RANGE
    if pad:
        p2 = torch.nn.functional.pad(p2, (0, pad))
    blocks = p2.reshape(*p2.shape[:-1], -1, BLOCK)
    s = blocks.amax(dim=-1, keepdim=True) / E2M1_MAX
    code = e2m1_round(torch.where(s > 0, blocks / torch.where(s > 0, s, 1.0), 0.0))
    deq = code * e4m3_round(s) / SAGE_P_RANGE
    return deq.reshape(*deq.shape[:-2], -1)[..., :n]


# ----------------------------------------------------------------------------------------------
# Operand preparation
# ----------------------------------------------------------------------------------------------

def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Fake-quantized float32 Q, K (per 16 along head_dim) and V (per 16 along tokens), all in
    (B, H, S, D) layout."""
    qf = fake_quantize_nvfp4(q.float(), dim=-1)
    kf = fake_quantize_nvfp4(k.float(), dim=-1)
    vf = fake_quantize_nvfp4(v.float(), dim=-2)
    return qf, kf, vf


def sage3_smooth(q: torch.Tensor, k: torch.Tensor):
    """SageAttention3 smoothing, float32, (B, H, S, D) layout.

    Returns (q_smoothed, q_block_mean_per_query, k_smoothed): K minus its token mean; Q minus the
    mean of its 128-query block (aligned at query 0, the ragged last block averages its real rows).
    """
    q = q.float()
    k = k.float()
    ks = k - k.mean(dim=-2, keepdim=True)
    B, H, S, D = q.shape
    nb = -(-S // SAGE_Q_BLOCK)
    pad = nb * SAGE_Q_BLOCK - S
    qp = torch.nn.functional.pad(q, (0, 0, 0, pad)).reshape(B, H, nb, SAGE_Q_BLOCK, D)
    counts = torch.full((nb,), float(SAGE_Q_BLOCK), device=q.device)
    counts[-1] = SAGE_Q_BLOCK - pad
    qmean = qp.sum(dim=3) / counts[:, None]
    qmean_rows = qmean.repeat_interleave(SAGE_Q_BLOCK, dim=2)[:, :, :S]
    return q - qmean_rows, qmean_rows, ks


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------

def _chunks(total: int, size: int):
    for start in range(0, total, size):
        yield start, min(start + size, total)


class FP4Forward(NamedTuple):
    """What the 4-bit forward produces, float32, (B, H, ...) layout."""

    o: torch.Tensor                   # (B, H, Sq, D) the 4-bit output Σ P̃ᶠ Vᶠ / l
    o_prime: torch.Tensor | None      # (B, H, Sq, D) Σ P̃ Vᶠ / l, when requested
    lse: torch.Tensor                 # (B, H, Sq) log-sum-exp of S·scale (unquantized P̃ sum)
    row_max: torch.Tensor             # (B, H, Sq) final row maximum m of S·scale
    qf: torch.Tensor                  # the operands as quantized (fake, float32)
    kf: torch.Tensor
    vf: torch.Tensor


def fp4_forward(q, k, v, scale: float, method: str = NVFP4, *, quantize: bool = True,
                need_o_prime: bool = False) -> FP4Forward:
    """Forward of the 4-bit methods on (B, H, S, D) tensors.

    ``quantize=False`` runs the same algorithm (tiling, smoothing) without any quantizer: it must
    equal exact attention, which the tests use to show the smoothing changes nothing by itself.
    """
    if method not in RECIPES:
        raise ValueError(f"fp4_forward handles {' and '.join(map(repr, RECIPES))}, got {method!r}")
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    qmean = ks = None
    sage = method == SAGE3
    if sage:
        q_in, qmean, k_in = sage3_smooth(q, k)
    else:
        q_in, k_in = q.float(), k.float()
    if quantize:
        qf, kf, vf = quantize_qkv(q_in, k_in, v)
        quant_p = quantize_p_sage3 if sage else quantize_p_nvfp4
    else:
        qf, kf, vf = q_in, k_in, v.float()
        quant_p = None
    if sage:
        ks = k_in  # the correction q̄·K_sᵀ uses the unquantized smoothed K, in float32

    o = torch.empty(B, H, Sq, D, device=q.device, dtype=torch.float32)
    o_prime = torch.empty_like(o) if need_o_prime else None
    lse = torch.empty(B, H, Sq, device=q.device, dtype=torch.float32)
    row_max = torch.empty_like(lse)
    q_chunk = max(KV_TILE, (_FWD_BUDGET // max(1, B * H * KV_TILE)) // KV_TILE * KV_TILE)
    for q0, q1 in _chunks(Sq, q_chunk):
        qc = qf[:, :, q0:q1]
        m = torch.full((B, H, q1 - q0), -math.inf, device=q.device)
        l = torch.zeros(B, H, q1 - q0, device=q.device)
        acc = torch.zeros(B, H, q1 - q0, D, device=q.device)
        acc2 = torch.zeros_like(acc) if need_o_prime else None
        for k0, k1 in _chunks(Skv, KV_TILE):
            s = qc @ kf[:, :, k0:k1].transpose(-1, -2)
            if qmean is not None:
                s = s + qmean[:, :, q0:q1] @ ks[:, :, k0:k1].transpose(-1, -2)
            s = s * scale
            m_new = torch.maximum(m, s.amax(dim=-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            l = l * alpha + p.sum(dim=-1)
            pf = quant_p(p) if quant_p is not None else p
            vt = vf[:, :, k0:k1]
            acc = acc * alpha[..., None] + pf @ vt
            if acc2 is not None:
                acc2 = acc2 * alpha[..., None] + p @ vt
            m = m_new
        o[:, :, q0:q1] = acc / l[..., None]
        if acc2 is not None:
            o_prime[:, :, q0:q1] = acc2 / l[..., None]
        lse[:, :, q0:q1] = m + torch.log(l)
        row_max[:, :, q0:q1] = m
    return FP4Forward(o, o_prime, lse, row_max, qf, kf, vf)


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------

def _flash_backward(q, k, v, lse, d_row, do, scale, row_max=None):
    """Shared FlashAttention-style backward on float32 (B, H, S, D) operands.

    P = exp(S·scale − LSE) with S = q kᵀ; dV = (Pᶠ)ᵀ dO; dP = dO vᵀ; dS = P ∘ (dP − D);
    dQ = scale·dS k; dK = scale·dSᵀ q. ``d_row`` is D (B, H, Sq), computed by the caller from
    whichever output the method prescribes. With ``row_max`` given, Pᶠ is the forward's quantizer
    applied relative to the row maximum, Q(exp(S·scale − m))·exp(m − LSE) (module docstring);
    without it Pᶠ = P.
    """
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    dq = torch.empty_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    q_chunk = max(BLOCK, (_BWD_BUDGET // max(1, B * H * Skv)) // BLOCK * BLOCK)
    for q0, q1 in _chunks(Sq, q_chunk):
        qc, doc = q[:, :, q0:q1], do[:, :, q0:q1]
        s = (qc @ k.transpose(-1, -2)) * scale
        p = torch.exp(s - lse[:, :, q0:q1, None])
        if row_max is None:
            pv = p
        else:
            m = row_max[:, :, q0:q1, None]
            pv = quantize_p_nvfp4(torch.exp(s - m)) * torch.exp(m - lse[:, :, q0:q1, None])
        dv += pv.transpose(-1, -2) @ doc
        ds = p * (doc @ v.transpose(-1, -2) - d_row[:, :, q0:q1, None])
        dq[:, :, q0:q1] = (ds @ k) * scale
        dk += (ds.transpose(-1, -2) @ qc) * scale
    return dq, dk, dv


#: Attn-QAT backward ablations (training studies; reference backend only): each switches one of the
#: method's two stability principles off.
ABLATIONS = {
    "d_from_o": "principle 2 off: D = rowsum(dO ∘ O) from the 4-bit output O instead of O'",
    "p_unquantized": "principle 1 off: dV = Pᵀ dO with P not re-quantized",
}


def check_ablation(ablation: str | None) -> None:
    if ablation is not None and ablation not in ABLATIONS:
        raise ValueError(f"unknown Attn-QAT ablation {ablation!r}; expected one of "
                         f"{', '.join(ABLATIONS)} (or None for the full method)")


def attnqat_backward(qf, kf, vf, o_prime, lse, row_max, do, scale):
    """Attn-QAT backward (both principles), straight-through for every quantizer.

    Principle 1: S is recomputed from Qᶠ, Kᶠ and P = exp(S·scale − LSE); P is fake-quantized with
    the forward's quantizer (relative to the row maximum ``row_max``, see the module docstring)
    before dV = (Pᶠ)ᵀ dO. Principle 2: D = rowsum(dO ∘ O') with O' the output of
    unquantized P and quantized V; dP = dO (Vᶠ)ᵀ; dS = P ∘ (dP − D); dQ = scale·dS Kᶠ;
    dK = scale·dSᵀ Qᶠ. Returns (dq, dk, dv) in float32, (B, H, S, D).

    The ablations of :data:`ABLATIONS` are this function fed differently: ``d_from_o`` passes the
    4-bit output O as ``o_prime``; ``p_unquantized`` passes ``row_max=None`` (dV from P itself).
    """
    do = do.float()
    d_row = (do * o_prime).sum(dim=-1)
    return _flash_backward(qf.float(), kf.float(), vf.float(), lse, d_row, do, scale, row_max=row_max)


def dropin_backward(q, k, v, o, lse, do, scale):
    """Drop-in ablation backward: the ordinary FlashAttention backward from unquantized Q, K, V,
    fed with the FP4 forward's output O (for D) and log-sum-exp."""
    do = do.float()
    d_row = (do * o.float()).sum(dim=-1)
    return _flash_backward(q.float(), k.float(), v.float(), lse, d_row, do, scale)


# ----------------------------------------------------------------------------------------------
# Exact attention (float32), for tests and the bf16 method's reference
# ----------------------------------------------------------------------------------------------

def exact_attention(q, k, v, scale: float) -> torch.Tensor:
    """Exact softmax attention in float32 on (B, H, S, D) tensors, chunked over queries."""
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    out = torch.empty(B, H, Sq, v.shape[-1], device=q.device, dtype=torch.float32)
    q_chunk = max(1, _BWD_BUDGET // max(1, B * H * Skv))
    for q0, q1 in _chunks(Sq, q_chunk):
        s = (q[:, :, q0:q1].float() @ k.float().transpose(-1, -2)) * scale
        out[:, :, q0:q1] = torch.softmax(s, dim=-1) @ v.float()
    return out


def forward_backward_p_mismatch(q, k, v, scale: float | None = None) -> dict:
    """Compare the backward's Pᶠ with the forward's effective normalized P̃ᶠ·exp(m_tile − LSE).

    Small (B, H, S, D) inputs only: it materializes S×S. Returns relative Frobenius norms:
    ``row_max`` (the backward this module implements), ``normalized`` (quantizing exp(S − LSE)
    literally), ``fwd_quant_error`` (the forward's own ‖P̃ᶠ_eff − P‖/‖P‖), and the fraction of zeros
    in each backward variant.
    """
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    qf, kf, _ = quantize_qkv(q, k, v)
    s = (qf @ kf.transpose(-1, -2)) * scale
    m = torch.full(s.shape[:-1], -math.inf, device=s.device)
    fwd_parts, m_parts = [], []
    for k0, k1 in _chunks(s.shape[-1], KV_TILE):
        m = torch.maximum(m, s[..., k0:k1].amax(dim=-1))
        fwd_parts.append(quantize_p_nvfp4(torch.exp(s[..., k0:k1] - m[..., None])))
        m_parts.append(m.clone())
    lse = torch.logsumexp(s, dim=-1)
    fwd = torch.cat([pf * torch.exp(mt - lse)[..., None] for pf, mt in zip(fwd_parts, m_parts)], dim=-1)
    p = torch.exp(s - lse[..., None])
    normalized = quantize_p_nvfp4(p)
    row_max = quantize_p_nvfp4(torch.exp(s - m[..., None])) * torch.exp(m - lse)[..., None]

    def rel(a, b):
        return (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()

    return {
        "row_max": rel(row_max, fwd),
        "normalized": rel(normalized, fwd),
        "fwd_quant_error": rel(fwd, p),
        "zeros_row_max": (row_max == 0).float().mean().item(),
        "zeros_normalized": (normalized == 0).float().mean().item(),
    }
