"""Fused 4-bit attention forward: ``nvfp4`` inference, the ``attnqat`` training forward, and the
kernel body that ``sage3`` reuses (DESIGN.md §3.3).

Layout: Q, K, V, O are (batch, seq, heads, head_dim) tensors read through their strides. The
operands arrive already quantized: by default as their dequantized NVFP4 values in bfloat16/float16
(exact, DESIGN.md §3.1; written by :mod:`attnqat.kernels.quantize`), or, with ``FORMULATION`` 1/2,
as packed codes + E4M3 scales that the kernel dequantizes in registers (1) or hands to
``tl.dot_scaled`` (2, native block-scaled FP4 MMA on Blackwell; emulated on Hopper).

One program owns BLOCK_M queries of one (batch, head) and walks over key tiles of BLOCK_N = 128
keys — the tile width that defines the running maximum in the reference (``KV_TILE``):

    S = Q Kᵀ (+ the sage3 correction q̄·K_sᵀ);  m_new = max(m, rowmax(S)·scale)
    P̃ = exp2(S·scale·log2e − m_new)   (≤ 1; the normalizer l sums P̃ unquantized)
    O  ← α·O  + quant(P̃) V            (quant: NVFP4 per 16 keys, or sage3's two-level quantizer)
    O' ← O + Δ, Δ ← α·Δ + (P̃ − quant(P̃)) V      (attnqat only: O' = P̃ V / l)

The P quantizer runs in registers on the MMA accumulator layout: the (BLOCK_M, BLOCK_N) tile is
reshaped to (BLOCK_M, BLOCK_N/16, 16), which Triton maps onto the same registers (no data
movement), so the block maximum is a reduction over 4 registers and 2 lane shuffles; then one
scale per block and five operations per element (:func:`e2m1_round_fast`).

P's NVFP4 codes follow the reference up to the rounding of P̃ itself (exp2 on the GPU is not
bit-identical to torch.exp): the block scale uses ``amax · (1/6)`` instead of an IEEE division and
elements are scaled by an approximate reciprocal of the scale, so a value within a few units in the
last place of a rounding threshold may round the other way — the same size of perturbation as the
exponential's own error. Q, K and V codes are exact (quantize kernel).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .quantize import INTERPRET, e2m1_round_fast, e4m3_round, fast_rcp

LOG2E = 1.4426950408889634
KV_TILE: tl.constexpr = tl.constexpr(128)  # = attnqat.reference.KV_TILE (checked in kernels/__init__.py)

# Two pitfalls of the Triton interpreter (triton 3.9, measured 2026-11-22): tl.dot multiplies
# bfloat16 operands as raw 16-bit integers, and float32 → bfloat16 casts truncate instead of
# rounding to nearest even (a bias that gradients with per-channel offsets amplify). Under the
# interpreter :func:`mma` widens operands to float32 first (exact) and :func:`cast` rounds to
# nearest even with bit arithmetic; on the GPU both are the plain operations.

# P quantizer modes. 0-2 are methods; 3-4 exist to measure what each part of mode 1 costs.
P_NONE, P_NVFP4, P_SAGE3, P_AMAX_ONLY, P_ROUND_ONLY = 0, 1, 2, 3, 4


@triton.jit
def mma(a, b, acc):
    """``tl.dot(a, b, acc)`` with float32 accumulation."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def cast(x, dtype: tl.constexpr):
    """``x.to(dtype)`` rounding to nearest even on every path (float32 ``x``)."""
    if INTERPRET and dtype == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        x = b.to(tl.float32, bitcast=True)
    return x.to(dtype)


# ----------------------------------------------------------------------------------------------
# P quantizers (registers only)
# ----------------------------------------------------------------------------------------------

@triton.jit
def quantize_p_rows(p, BM: tl.constexpr, BN: tl.constexpr, MODE: tl.constexpr):
    """Fake-quantize P̃ (float32, [BM, BN], 0 ≤ P̃ ≤ 1) per 16 consecutive keys along axis 1.
    Mode 2 (sage3) returns the values times 2688; the caller divides the output by it."""
    if MODE == 0:
        return p
    else:
        p3 = tl.reshape(p, [BM, BN // 16, 16])
        if MODE == 3:
            # measurement only: the block maximum and scale without the element rounding
            sc = e4m3_round(tl.max(p3, axis=2) * (1.0 / 6.0), False)
            q3 = p3 * (sc * 6.0)[:, :, None]
        elif MODE == 4:
            # measurement only: the element rounding against a fixed scale, no block maximum
            q3 = e2m1_round_fast(p3 * 6.0) * (1.0 / 6.0)
        else:
            q3 = quantize_p_blocks(p3, tl.max(p3, axis=2), MODE)
        return tl.reshape(q3, [BM, BN])


@triton.jit
def quantize_p_blocks(p3, amax, MODE: tl.constexpr):
    """:func:`quantize_p_rows`' modes 1 (nvfp4) and 2 (sage3) on P̃ as [rows, blocks, 16] with its
    block maxima ``amax`` [rows, blocks] given (a caller that knows them another way passes them)."""
    if MODE == 1:
        # NVFP4, single level: s = E4M3(amax/6), value = E2M1(P̃/s)·s. A zero scale (amax/6
        # below 2^-10) has every P̃ < 6·2^-10: dividing by 2^-10 instead keeps the rounding
        # finite and the product with s = 0 gives the all-zero block.
        sc = e4m3_round(amax * (1.0 / 6.0), False)
        inv = fast_rcp(tl.maximum(sc, 0.0009765625))
    else:
        # SageAttention3 two-level: element P̃·2688 divided by the UNROUNDED amax·2688/6, i.e.
        # 6·P̃/amax; dequantized with the rounded scale E4M3(amax·448). The level-1 factor
        # 1/2688 is applied to the output instead (so that this product stays exact in bf16).
        # The scale needs no saturation: P̃ ≤ 1 up to exp2's last-bit error, and every amax
        # below 464/448 rounds to at most 448 unsaturated (E4M3's step is 32 there, the tie at
        # 464 goes to 448's even mantissa), so clamping would change nothing and cost two
        # instructions per block
        inv = 6.0 * fast_rcp(tl.maximum(amax, 1e-30))
        sc = e4m3_round(amax * 448.0, False)
    return e2m1_round_fast(p3 * inv[:, :, None]) * sc[:, :, None]


@triton.jit
def quantize_p_cols(pt, BN: tl.constexpr, BM: tl.constexpr):
    """NVFP4 fake quantization of P̃ᵀ ([BN keys, BM queries]) per 16 consecutive keys along axis 0
    (the backward's transposed tiles); same arithmetic as :func:`quantize_p_rows` mode 1."""
    p3 = tl.reshape(pt, [BN // 16, 16, BM])
    sc = e4m3_round(tl.max(p3, axis=1) * (1.0 / 6.0), False)
    inv = fast_rcp(tl.maximum(sc, 0.0009765625))
    q3 = e2m1_round_fast(p3 * inv[:, None, :]) * sc[:, None, :]
    return tl.reshape(q3, [BN, BM])


@triton.jit
def p_codes_and_scales(p, BM: tl.constexpr, BN: tl.constexpr):
    """NVFP4 P̃ as ``tl.dot_scaled`` operands: packed E2M1 codes [BM, BN/2] (uint8, low nibble
    first) and E4M3 scales [BM, BN/16]."""
    p3 = tl.reshape(p, [BM, BN // 16, 16])
    sc = e4m3_round(tl.max(p3, axis=2) * (1.0 / 6.0), False)
    inv = fast_rcp(tl.maximum(sc, 0.0009765625))
    r = e2m1_round_fast(p3 * inv[:, :, None])
    idx = tl.where(r < 2.0, r * 2.0, tl.where(r < 4.0, r + 2.0, r * 0.5 + 4.0)).to(tl.int32)
    lo, hi = tl.split(tl.reshape(idx, [BM, BN // 2, 2]))
    codes = (lo | (hi << 4)).to(tl.uint8)
    return codes, sc.to(tl.float8e4nv)


@triton.jit
def dequant_tile(codes, scales, R: tl.constexpr, C: tl.constexpr, dtype: tl.constexpr):
    """Dequantize packed NVFP4 codes [R, C/2] with E4M3 scales [R, C/16] (blocks along axis 1) to
    ``dtype`` [R, C] in registers."""
    c = codes.to(tl.int32)
    nib = tl.reshape(tl.join(c & 15, c >> 4), [R, C])
    mag = nib & 7
    f = mag.to(tl.float32)
    v = tl.where(mag < 4, f * 0.5, tl.where(mag < 6, f - 2.0, f * 2.0 - 8.0))
    v = tl.where((nib & 8) != 0, -v, v)
    v3 = tl.reshape(v, [R, C // 16, 16]) * scales.to(tl.float32)[:, :, None]
    return tl.reshape(v3, [R, C]).to(dtype)


# ----------------------------------------------------------------------------------------------
# Inner step: one key tile
# ----------------------------------------------------------------------------------------------

@triton.jit
def _fwd_tile(acc, acc2, l_i, m_i, q, q_sc,
              K, Kc, Ks, V, Vc, Vs, BIAS,
              start_n, Skv, qk_scale,
              skn, skd, svn, svd, skcn, sksn, svct, svst,
              offs_d, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
              P_MODE: tl.constexpr, NEED_O2: tl.constexpr, HAS_BIAS: tl.constexpr,
              FORMULATION: tl.constexpr, MASK: tl.constexpr):
    offs_n = start_n + tl.arange(0, BN)
    kv_ok = offs_n < Skv
    # ---- S = Q Kᵀ ----
    if FORMULATION == 0:
        k_ptrs = K + offs_n[None, :] * skn + offs_d[:, None] * skd
        if MASK:
            kt = tl.load(k_ptrs, mask=kv_ok[None, :], other=0.0)
        else:
            kt = tl.load(k_ptrs)
        s = mma(q, kt, None)
    else:
        offs_c = tl.arange(0, D // 2)
        offs_b = tl.arange(0, D // 16)
        kc_ptrs = Kc + offs_n[:, None] * skcn + offs_c[None, :]
        ks_ptrs = Ks + offs_n[:, None] * sksn + offs_b[None, :]
        if MASK:
            kc = tl.load(kc_ptrs, mask=kv_ok[:, None], other=0)
            ks = tl.load(ks_ptrs, mask=kv_ok[:, None], other=0.0)
        else:
            kc = tl.load(kc_ptrs)
            ks = tl.load(ks_ptrs)
        if FORMULATION == 1:
            s = mma(q, tl.trans(dequant_tile(kc, ks, BN, D, tl.bfloat16)), None)
        else:
            s = tl.dot_scaled(q, q_sc, "e2m1", tl.trans(kc), ks, "e2m1")
    if HAS_BIAS:
        if MASK:
            s += tl.load(BIAS + offs_n, mask=kv_ok, other=0.0)[None, :]
        else:
            s += tl.load(BIAS + offs_n)[None, :]
    if MASK:
        s = tl.where(kv_ok[None, :], s, float("-inf"))
    # ---- online softmax over the 128-key tile ----
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    # ---- O += quant(P̃) V ----
    if FORMULATION == 0:
        v_ptrs = V + offs_n[:, None] * svn + offs_d[None, :] * svd
        if MASK:
            v = tl.load(v_ptrs, mask=kv_ok[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        pq = quantize_p_rows(p, BM, BN, P_MODE)
        acc = acc * alpha[:, None]
        acc = mma(pq.to(v.dtype), v, acc)  # exact: P̃ᶠ has at most 6 significant bits
        if NEED_O2:
            # O' = O + Σ (P̃ − P̃ᶠ) Vᶠ / l: the difference is small, so its bfloat16 rounding costs
            # far less than rounding P̃ itself would (D = rowsum(dO ∘ O') is cancellation-prone)
            acc2 = acc2 * alpha[:, None]
            acc2 = mma(cast(p - pq, v.dtype), v, acc2)
    else:
        # V is packed along tokens in its own layout: codes (S/2, D) and scales (S/16, D) per
        # (batch, head), channels contiguous (tl.dot_scaled's [K/2, N] right operand)
        offs_t = start_n // 2 + tl.arange(0, BN // 2)
        offs_tb = start_n // 16 + tl.arange(0, BN // 16)
        vc_ptrs = Vc + offs_t[:, None] * svct + offs_d[None, :]       # [BN/2, D]
        vs_ptrs = Vs + offs_tb[:, None] * svst + offs_d[None, :]      # [BN/16, D]
        if MASK:
            vc = tl.load(vc_ptrs, mask=(offs_t * 2 < Skv)[:, None], other=0)
            vs = tl.load(vs_ptrs, mask=(offs_tb * 16 < Skv)[:, None], other=0.0)
        else:
            vc = tl.load(vc_ptrs)
            vs = tl.load(vs_ptrs)
        acc = acc * alpha[:, None]
        if FORMULATION == 1:
            vt = dequant_tile(tl.trans(vc), tl.trans(vs), D, BN, tl.bfloat16)   # [D, BN]
            acc = mma(quantize_p_rows(p, BM, BN, P_MODE).to(tl.bfloat16), tl.trans(vt), acc)
        else:
            pc, ps = p_codes_and_scales(p, BM, BN)
            acc = tl.dot_scaled(pc, ps, "e2m1", vc, tl.trans(vs), "e2m1", acc)
    return acc, acc2, l_i, m_new


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------

@triton.jit
def attn_fwd_kernel(
    Q, K, V, O, O2, LSE2, M2, BIAS,
    Qc, Qs, Kc, Ks, Vc, Vs,
    sqb, sqs, sqh, sqd,
    skb, sks, skh, skd,
    svb, svs, svh, svd,
    sob, sos, soh, sod,
    sqcb, sqcs, sqch, sqsb, sqss, sqsh,
    skcb, skcs, skch, sksb, skss, sksh,
    svcb, svcs, svch, svsb, svss, svsh,
    H, Sq, Skv, qk_scale, n_qblk_bias,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    P_MODE: tl.constexpr, NEED_O2: tl.constexpr, HAS_BIAS: tl.constexpr,
    STORE_STATS: tl.constexpr, FORMULATION: tl.constexpr, WARP_SPEC: tl.constexpr = False,
):
    """Grid: (cdiv(Sq, BM), B·H). Writes O (and O' with NEED_O2) in (B, Sq, H, D) layout and, with
    STORE_STATS, the row log-sum-exp and row maximum in log2 units (B, H, Sq) for the backward.
    WARP_SPEC asks Triton to warp-specialize the key loop (``tl.range(..., warp_specialize=True)``:
    producer warps loading tiles, consumer warps computing; same arithmetic) — a variant for
    ``attnqat bench kernels --variants``, off by default until it is measured faster."""
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = start_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    row_ok = offs_m < Sq
    q_sc = None
    if FORMULATION == 0:
        q_base = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        q = tl.load(q_base + offs_m[:, None] * sqs + offs_d[None, :] * sqd, mask=row_ok[:, None], other=0.0)
        K += b.to(tl.int64) * skb + h.to(tl.int64) * skh
        V += b.to(tl.int64) * svb + h.to(tl.int64) * svh
    else:
        offs_c = tl.arange(0, D // 2)
        offs_b = tl.arange(0, D // 16)
        qc_base = Qc + b.to(tl.int64) * sqcb + h.to(tl.int64) * sqch
        qs_base = Qs + b.to(tl.int64) * sqsb + h.to(tl.int64) * sqsh
        qc = tl.load(qc_base + offs_m[:, None] * sqcs + offs_c[None, :], mask=row_ok[:, None], other=0)
        q_sc = tl.load(qs_base + offs_m[:, None] * sqss + offs_b[None, :], mask=row_ok[:, None], other=0.0)
        if FORMULATION == 1:
            q = dequant_tile(qc, q_sc, BM, D, tl.bfloat16)
        else:
            q = qc
        Kc += b.to(tl.int64) * skcb + h.to(tl.int64) * skch
        Ks += b.to(tl.int64) * sksb + h.to(tl.int64) * sksh
        Vc += b.to(tl.int64) * svcb + h.to(tl.int64) * svch
        Vs += b.to(tl.int64) * svsb + h.to(tl.int64) * svsh
    if HAS_BIAS:
        # sage3: one correction row q̄·K_sᵀ per 128-query block (BM divides 128)
        BIAS += (bh.to(tl.int64) * n_qblk_bias + (start_m * BM) // KV_TILE) * Skv

    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    if NEED_O2:
        acc2 = tl.zeros([BM, D], tl.float32)
    else:
        acc2 = acc
    n_full = Skv // BN * BN
    for start_n in tl.range(0, n_full, BN, warp_specialize=WARP_SPEC):
        acc, acc2, l_i, m_i = _fwd_tile(
            acc, acc2, l_i, m_i, q, q_sc, K, Kc, Ks, V, Vc, Vs, BIAS, start_n, Skv, qk_scale,
            sks, skd, svs, svd, skcs, skss, svcs, svss, offs_d,
            BM, BN, D, P_MODE, NEED_O2, HAS_BIAS, FORMULATION, False)
    if n_full < Skv:  # the ragged last tile: keys beyond Skv masked out
        acc, acc2, l_i, m_i = _fwd_tile(
            acc, acc2, l_i, m_i, q, q_sc, K, Kc, Ks, V, Vc, Vs, BIAS, n_full, Skv, qk_scale,
            sks, skd, svs, svd, skcs, skss, svcs, svss, offs_d,
            BM, BN, D, P_MODE, NEED_O2, HAS_BIAS, FORMULATION, True)

    if P_MODE == 2:
        inv_l = 1.0 / (l_i * 2688.0)  # sage3's level-1 scale, kept out of the quantized P
    else:
        inv_l = 1.0 / l_i
    o_off = b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None] * sos + offs_d[None, :] * sod
    tl.store(O + o_off, cast(acc * inv_l[:, None], O.dtype.element_ty), mask=row_ok[:, None])
    if NEED_O2:
        tl.store(O2 + o_off, cast((acc + acc2) * inv_l[:, None], O2.dtype.element_ty), mask=row_ok[:, None])
    if STORE_STATS:
        stat_off = bh.to(tl.int64) * Sq + offs_m
        tl.store(LSE2 + stat_off, m_i + tl.log2(l_i), mask=row_ok)
        tl.store(M2 + stat_off, m_i, mask=row_ok)


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------

# Tile configurations, measured on the H100 (docs/kernels_notes.md). BLOCK_N is fixed at 128 keys:
# it defines the running maximum P̃ is quantized against. Keys: (head_dim, with O').
FWD_CONFIGS = {
    (64, False): dict(BM=128, num_warps=8, num_stages=3),
    (64, True): dict(BM=128, num_warps=8, num_stages=3),
    (128, False): dict(BM=128, num_warps=8, num_stages=3),
    (128, True): dict(BM=128, num_warps=8, num_stages=3),
}


def _strides4(t):
    return (t.stride(0), t.stride(1), t.stride(2), t.stride(3)) if t is not None else (0, 0, 0, 0)


def attention_forward(q, k, v, *, sm_scale: float, p_mode: int = P_NVFP4, need_o2: bool = False,
                      store_stats: bool = False, bias=None, packed=None, formulation: int = 0,
                      out_dtype=None, config: dict | None = None):
    """Launch :func:`attn_fwd_kernel`.

    ``q, k, v``: (B, S, H, D) operand tensors (the dequantized NVFP4 values) for ``formulation=0``;
    for 1 and 2 only their shapes are used and ``packed = (Q, K, V)`` holds NVFP4Tensors (Q, K
    quantized along head_dim, V along tokens). ``bias``: sage3's (B, H, ceil(Sq/128), Skv) float32
    correction. Returns ``(o, o2, lse2, m2)``; o2/lse2/m2 are None unless requested. O' is float32:
    the backward's D = rowsum(dO ∘ O') cancels against dP where the softmax is peaked, and a
    bfloat16 O' costs several percent of dQ there (measured on outlier-heavy inputs).
    """
    import torch  # noqa: PLC0415

    B, Sq, H, D = q.shape
    Skv = k.shape[1]
    cfg = dict(FWD_CONFIGS[(D, need_o2)])
    cfg.update(config or {})
    BM = cfg.pop("BM")
    dt = out_dtype or q.dtype
    o = torch.empty(B, Sq, H, D, device=q.device, dtype=dt)
    o2 = torch.empty(B, Sq, H, D, device=q.device, dtype=torch.float32) if need_o2 else None
    lse2 = m2 = None
    if store_stats:
        lse2 = torch.empty(B, H, Sq, device=q.device, dtype=torch.float32)
        m2 = torch.empty_like(lse2)
    if formulation:
        qt, kt, vt = packed
        pk = (qt.codes, qt.scales, kt.codes, kt.scales, vt.codes, vt.scales)
        pstr = (qt.codes.stride()[:3] + qt.scales.stride()[:3] + kt.codes.stride()[:3]
                + kt.scales.stride()[:3] + vt.codes.stride()[:3] + vt.scales.stride()[:3])
    else:
        pk = (q,) * 6
        pstr = (0,) * 18
    n_qblk_bias = bias.shape[2] if bias is not None else 0
    grid = (triton.cdiv(Sq, BM), B * H)
    attn_fwd_kernel[grid](
        q, k, v, o, o2 if need_o2 else o, lse2 if store_stats else o, m2 if store_stats else o,
        bias if bias is not None else o, *pk,
        *_strides4(q), *_strides4(k), *_strides4(v), *_strides4(o), *pstr,
        H, Sq, Skv, sm_scale * LOG2E, n_qblk_bias,
        D=D, BM=BM, BN=128, P_MODE=p_mode, NEED_O2=need_o2, HAS_BIAS=bias is not None,
        STORE_STATS=store_stats, FORMULATION=formulation, **cfg,
    )
    return o, o2, lse2, m2
