"""PyTorch reference of ``sagebwd``: trainable INT8 attention (SageAttention3 §4, the SageBwd paper).

This is the oracle the Triton kernels (:mod:`attnqat.kernels.sagebwd`) are tested against and the
definition written out in docs/numerics.md ("sagebwd"). Public tensors are (batch, seq, heads,
head_dim) like :func:`attnqat.attention`; inside, (batch, heads, seq, head_dim), float32.

Definition (every block size is part of it; the kernels use the same tiles):

* INT8 per block: a block with amax ``a = max|x|`` has scale ``s = a / 127`` and codes
  ``round_half_even(x · (127 / a))`` (both divisions IEEE float32; ``a = 0`` gives codes 0, scale 0).
* Q per :data:`Q_BLOCK` queries × head_dim; K minus its float32 mean over tokens (per batch, head,
  channel; :func:`key_mean`), then per :data:`K_BLOCK` keys × head_dim; V per :data:`K_BLOCK` keys ×
  head_dim.
* S: ``t = acc · ((s_Q · s_K) · scale · log2 e)`` with ``acc`` the exact integer product of the codes
  (int32 in the kernel, exact float32 here), so ``t`` is S·scale in log2 units, bit for bit the same in
  kernel and reference. Online softmax over key tiles of :data:`K_BLOCK`; after a tile,
  ``m ← max(m, rowmax_tile(t))``.
* P̃ = exp2(t − m) per row of a tile, quantized with ``s_P = exp2(rowmax_tile(t) − m) / 127``: its codes
  are ``round_half_even(127 · exp2(t − rowmax_tile(t)))`` (the same quantity, with m cancelled).
  ``l`` sums the unquantized P̃; ``O = Σ_tiles s_P · s_V · (codes_P · codes_V) / l``.
* Backward (no S×S stored): t recomputed as above; ``P = exp2(t − LSE₂)`` (normalized);
  ``D = rowsum(dO ∘ O)`` with O the forward's output in float32 (the "high-precision O": before its
  rounding to the input dtype); ``dP = dO · Vᵀ`` in 16 bits (dO and the unquantized V in the input
  dtype, float32 accumulation); ``dS = P ∘ (dP − D)``.
  - ``dV = Pᵀ dO`` in INT8: P per key column over :data:`BWD_BLOCK_Q` queries (the column block's
    maximum), dO per :data:`BWD_BLOCK_Q` queries × head_dim.
  - dS per :data:`BWD_BLOCK_Q` queries × :data:`BWD_BLOCK_K` keys (one scale per block, shared by both
    products).
  - ``dK = scale · dSᵀ Q`` (INT8: dS blocks, Q's forward codes and scales).
  - ``dQ = scale · (dS K_s + rowsum(dS) ⊗ k̄)``: the INT8 product uses the smoothed K's forward codes,
    and the smoothing correction adds back the mean k̄ through the float32 row sums of the
    unquantized dS, so that dQ is the gradient with respect to the unsmoothed K (dS K).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from attnqat.kernels.formats import INT8_MAX as QMAX
from attnqat.kernels.formats import SAGEBWD_BWD_BLOCK_K as BWD_BLOCK_K
from attnqat.kernels.formats import SAGEBWD_BWD_BLOCK_Q as BWD_BLOCK_Q
from attnqat.kernels.formats import SAGEBWD_K_BLOCK as K_BLOCK
from attnqat.kernels.formats import SAGEBWD_Q_BLOCK as Q_BLOCK
from attnqat.kernels.formats import key_mean

LOG2E = 1.4426950408889634

_BUDGET = 1 << 22   # float32 elements per (B, H, q_chunk, K_BLOCK) temporary


def _chunks(total: int, size: int):
    for start in range(0, total, size):
        yield start, min(start + size, total)


def _pad_seq(x: torch.Tensor, mult: int, value: float = 0.0) -> torch.Tensor:
    """Pad dim 2 of a (B, H, S, ...) tensor to a multiple of ``mult``."""
    pad = (-x.shape[2]) % mult
    if not pad:
        return x
    shape = list(x.shape)
    shape[2] = pad
    return torch.cat([x, x.new_full(shape, value)], dim=2)


def int8_codes(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (float32 holding integers in [-127, 127]) and scale of ``x`` with block maximum ``amax``
    (broadcastable to x): ``round_half_even(x · (127 / amax))``, ``amax / 127``."""
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    # torch.div of two tensors (``127.0 / t`` would be 127 · (1/t), rounded twice)
    inv = torch.where(amax > 0, torch.div(torch.full_like(safe, QMAX), safe), torch.zeros_like(amax))
    # the scale too: a CUDA tensor divided by a Python number is multiplied by its reciprocal
    return torch.round(x * inv), torch.div(amax, torch.full_like(amax, QMAX))


def quantize_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block INT8 of a (B, H, S, D) float32 tensor over ``block`` tokens × D. Returns int8 codes
    (B, H, S padded to a multiple of block, D), zero-padded, and float32 scales (B, H, nblocks)."""
    xp = _pad_seq(x.float(), block)
    B, H, Sp, D = xp.shape
    xb = xp.view(B, H, Sp // block, block, D)
    amax = xb.abs().amax(dim=(3, 4))
    codes, scale = int8_codes(xb, amax[..., None, None])
    return codes.to(torch.int8).view(B, H, Sp, D), scale[..., 0, 0]


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


class Quantized(NamedTuple):
    """The forward's INT8 operands, (B, H, S_padded, D) int8 codes, float32 block scales."""

    q8: torch.Tensor
    sq: torch.Tensor          # (B, H, ceil(Sq/Q_BLOCK))
    k8: torch.Tensor          # codes of K − k̄
    sk: torch.Tensor          # (B, H, ceil(Skv/K_BLOCK))
    v8: torch.Tensor
    sv: torch.Tensor
    kmean: torch.Tensor       # (B, H, D)


def quantize_qkv(q, k, v) -> Quantized:
    """INT8 Q, smoothed K and V from (B, S, H, D) inputs."""
    kmean = key_mean(k)
    q8, sq = quantize_blocks(_bhsd(q).float(), Q_BLOCK)
    k8, sk = quantize_blocks(_bhsd(k).float() - kmean[:, :, None, :], K_BLOCK)
    v8, sv = quantize_blocks(_bhsd(v).float(), K_BLOCK)
    return Quantized(q8, sq, k8, sk, v8, sv, kmean)


class Forward(NamedTuple):
    o: torch.Tensor       # (B, H, Sq, D) float32
    lse2: torch.Tensor    # (B, H, Sq) log-sum-exp of t (log2 units)
    quant: Quantized


def _t_tile(q8c, sqc, qt: Quantized, k0: int, k1: int, Skv: int, qk: float):
    """t = acc · ((s_Q · s_K) · qk) for a query chunk against keys [k0, k1) (k1 - k0 = K_BLOCK),
    keys at or beyond Skv set to −inf."""
    acc = q8c @ qt.k8[:, :, k0:k1].float().transpose(-1, -2)
    sk = qt.sk[:, :, k0 // K_BLOCK][:, :, None, None]
    t = acc * ((sqc * sk) * qk)
    if k1 > Skv:
        t[..., Skv - k0:] = float("-inf")
    return t


def _row_scales(qt: Quantized, q0: int, q1: int):
    return qt.sq.repeat_interleave(Q_BLOCK, dim=2)[:, :, q0:q1, None]


def forward(q, k, v, scale: float, collect: dict | None = None) -> Forward:
    """The sagebwd forward on (B, S, H, D) inputs. ``collect`` (small inputs only: S×S): receives
    ``p`` = the normalized probabilities as the forward uses them, s_P·codes/l, (B, H, Sq, Skv)."""
    B, Sq, H, D = q.shape
    Skv = k.shape[1]
    qt = quantize_qkv(q, k, v)
    qk = float(scale) * LOG2E
    Sqp = qt.q8.shape[2]
    o = torch.empty(B, H, Sqp, D, device=q.device, dtype=torch.float32)
    lse2 = torch.empty(B, H, Sqp, device=q.device, dtype=torch.float32)
    chunk = max(Q_BLOCK, _BUDGET // max(1, B * H * K_BLOCK) // Q_BLOCK * Q_BLOCK)
    for q0, q1 in _chunks(Sqp, chunk):
        q8c = qt.q8[:, :, q0:q1].float()
        sqc = _row_scales(qt, q0, q1)
        m = torch.full((B, H, q1 - q0, 1), float("-inf"), device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(B, H, q1 - q0, D, device=q.device)
        for k0 in range(0, qt.k8.shape[2], K_BLOCK):
            k1 = k0 + K_BLOCK
            t = _t_tile(q8c, sqc, qt, k0, k1, Skv, qk)
            tmax = t.amax(dim=-1, keepdim=True)
            m_new = torch.maximum(m, tmax)
            e = torch.exp2(t - tmax) * QMAX
            codes = torch.round(e)
            s_p = torch.exp2(tmax - m_new) / QMAX
            alpha = torch.exp2(m - m_new)
            l = l * alpha + s_p * e.sum(dim=-1, keepdim=True)
            pv = codes @ qt.v8[:, :, k0:k1].float()
            sv = qt.sv[:, :, k0 // K_BLOCK][:, :, None, None]
            acc = acc * alpha + pv * (s_p * sv)
            m = m_new
        o[:, :, q0:q1] = acc / l
        lse2[:, :, q0:q1] = (m + torch.log2(l))[..., 0]
    if collect is not None:
        collect["p"] = _collect_p(qt, Sq, Skv, qk, lse2)
    return Forward(o[:, :, :Sq], lse2[:, :, :Sq], qt)


def _collect_p(qt: Quantized, Sq: int, Skv: int, qk: float, lse2):
    """Dense (B, H, Sq, Skv) normalized P as the forward multiplies it into V: per tile
    s_P · codes / l = codes · exp2(rowmax_tile − m) / 127 · exp2(m − LSE₂), i.e.
    codes · exp2(rowmax_tile − LSE₂) / 127 (m cancels)."""
    B, H = qt.q8.shape[:2]
    q8 = qt.q8.float()
    out = torch.zeros(B, H, q8.shape[2], qt.k8.shape[2], device=q8.device)
    sqr = _row_scales(qt, 0, q8.shape[2])
    lsep = _pad_seq(lse2, Q_BLOCK, float("inf"))[..., None]
    for k0 in range(0, qt.k8.shape[2], K_BLOCK):
        t = _t_tile(q8, sqr, qt, k0, k0 + K_BLOCK, Skv, qk)
        tmax = t.amax(dim=-1, keepdim=True)
        out[..., k0:k0 + K_BLOCK] = torch.round(torch.exp2(t - tmax) * QMAX) * (torch.exp2(tmax - lsep) / QMAX)
    return out[:, :, :Sq, :Skv]


def backward(fwd: Forward, q, k, v, do, scale: float, collect: dict | None = None,
             smoothing_correction: bool = True):
    """dQ, dK, dV (float32, (B, S, H, D)) of the sagebwd forward ``fwd`` for the output gradient ``do``
    (B, Sq, H, D). ``collect`` (small inputs only): receives ``ds`` = dS as quantized
    (codes · block scale), (B, H, Sq, Skv). ``smoothing_correction=False`` leaves out the
    rowsum(dS) ⊗ k̄ term of dQ (a measurement of what it does, not the method)."""
    B, Sq, H, D = q.shape
    Skv = k.shape[1]
    qt = fwd.quant
    qk = float(scale) * LOG2E
    Sqp, Skp = qt.q8.shape[2], qt.k8.shape[2]
    do_f = _pad_seq(_bhsd(do).float(), Q_BLOCK)
    o = _pad_seq(fwd.o, Q_BLOCK)
    delta = (do_f * o).sum(-1, keepdim=True)
    lse2 = _pad_seq(fwd.lse2, Q_BLOCK, float("inf"))[..., None]
    do8, sdo = quantize_blocks(_bhsd(do).float(), BWD_BLOCK_Q)
    vv = _pad_seq(_bhsd(v), K_BLOCK).to(do.dtype).float()   # dP's 16-bit V
    do16 = _pad_seq(_bhsd(do), Q_BLOCK).float()
    dq = torch.zeros(B, H, Sqp, D, device=q.device)
    dk = torch.zeros(B, H, Skp, D, device=q.device)
    dv = torch.zeros(B, H, Skp, D, device=q.device)
    rs = torch.zeros(B, H, Sqp, 1, device=q.device)
    nq_, nk_ = BWD_BLOCK_Q, BWD_BLOCK_K
    if collect is not None:
        dsfull = torch.zeros(B, H, Sqp, Skp, device=q.device)
    chunk = max(Q_BLOCK, _BUDGET // max(1, B * H * K_BLOCK) // Q_BLOCK * Q_BLOCK)
    for q0, q1 in _chunks(Sqp, chunk):
        C = q1 - q0
        nq = C // nq_
        q8c = qt.q8[:, :, q0:q1].float()
        sqc = _row_scales(qt, q0, q1)
        q8b = q8c.view(B, H, nq, nq_, D)
        do8b = do8[:, :, q0:q1].float().view(B, H, nq, nq_, D)
        sdo_c = sdo[:, :, q0 // nq_:q1 // nq_]
        sq_c = qt.sq[:, :, q0 // Q_BLOCK:q1 // Q_BLOCK]
        for k0 in range(0, Skp, K_BLOCK):
            k1 = k0 + K_BLOCK
            t = _t_tile(q8c, sqc, qt, k0, k1, Skv, qk)
            p = torch.exp2(t - lse2[:, :, q0:q1])
            dp = do16[:, :, q0:q1] @ vv[:, :, k0:k1].transpose(-1, -2)
            ds = p * (dp - delta[:, :, q0:q1])
            rs[:, :, q0:q1] += ds.sum(-1, keepdim=True)
            # dV = Pᵀ dO: P per key column over BWD_BLOCK_Q queries, dO per BWD_BLOCK_Q queries
            pb = p.view(B, H, nq, nq_, K_BLOCK)
            pc, sp = int8_codes(pb, pb.amax(dim=3, keepdim=True))            # sp (B,H,nq,1,K)
            prod = torch.einsum("bhnqk,bhnqd->bhnkd", pc, do8b)
            dv[:, :, k0:k1] += (prod * (sp[:, :, :, 0, :, None] * sdo_c[..., None, None])).sum(2)
            # dS per BWD_BLOCK_Q × BWD_BLOCK_K block
            dsb = ds.view(B, H, nq, nq_, K_BLOCK // nk_, nk_)
            dc, sds = int8_codes(dsb, dsb.abs().amax(dim=(3, 5), keepdim=True))  # sds (B,H,nq,1,kb,1)
            sds = sds[:, :, :, 0, :, 0]                                        # (B,H,nq,kb)
            sk = qt.sk[:, :, k0 // K_BLOCK][:, :, None, None]
            for kb in range(K_BLOCK // nk_):
                c = dc[:, :, :, :, kb, :]                                      # (B,H,nq,128q,64k)
                ks = slice(k0 + kb * nk_, k0 + (kb + 1) * nk_)
                dkp = torch.einsum("bhnqk,bhnqd->bhnkd", c, q8b)
                dk[:, :, ks] += (dkp * (sds[:, :, :, kb] * sq_c)[..., None, None]).sum(2)
                dqp = c @ qt.k8[:, :, ks].float()[:, :, None]                   # (B,H,nq,128q,D)
                dq[:, :, q0:q1] += (dqp * (sds[:, :, :, kb, None, None] * sk[..., None])).reshape(B, H, C, D)
            if collect is not None:
                dsfull[:, :, q0:q1, k0:k1] = (dc * sds[:, :, :, None, :, None]).reshape(B, H, C, K_BLOCK)
    if smoothing_correction:
        dq = dq + rs * qt.kmean[:, :, None, :]
    dq = dq * scale
    dk = dk * scale
    if collect is not None:
        collect["ds"] = dsfull[:, :, :Sq, :Skv]
    return (_bhsd(dq[:, :, :Sq]), _bhsd(dk[:, :, :Skv]), _bhsd(dv[:, :, :Skv]))


class _SageBwdReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale: float):
        fwd = forward(q, k, v, scale)
        ctx.save_for_backward(q, k, v)
        ctx.fwd, ctx.scale = fwd, scale
        return _bhsd(fwd.o).to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = backward(ctx.fwd, q, k, v, do.contiguous(), ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def sagebwd_reference(q, k, v, softmax_scale: float | None = None) -> torch.Tensor:
    """The PyTorch reference of ``sagebwd`` on (B, S, H, D) tensors, differentiable; output in q's
    dtype (the float32 O rounded once)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return _SageBwdReference.apply(q, k, v, scale)
