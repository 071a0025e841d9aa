"""Fused backward of the 4-bit training methods (DESIGN.md §3.3), FlashAttention-2 style: nothing
of size Sq×Skv is stored; S and P are recomputed tile by tile.

``attnqat`` (QUANT_P): the operands are the forward's quantized Qᶠ, Kᶠ, Vᶠ (dequantized, exact in
bfloat16/float16), and

    principle 1   P = exp2(S·scale·log2e − LSE₂);  Pᶠ = quant(exp2(S·scale·log2e − m₂)) · exp2(m₂ − LSE₂)
                  dV = (Pᶠ)ᵀ dO
    principle 2   D = rowsum(dO ∘ O')  (O' = P̃ Vᶠ / l from the forward)
                  dP = dO (Vᶠ)ᵀ;  dS = P ∘ (dP − D);  dQ = scale · dS Kᶠ;  dK = scale · dSᵀ Qᶠ

where m₂ and LSE₂ are the forward's final row maximum and log-sum-exp in log2 units, and ``quant`` is
the forward's NVFP4 quantizer per 16 keys (the decision documented in attnqat/reference.py: the
backward quantizes P relative to the row's final maximum). P is computed once as P̃·exp2(m₂ − LSE₂).

``dropin``: unquantized Q, K, V, D = rowsum(dO ∘ O) with the FP4 output O, Pᶠ = P.

Three launches: ``_bwd_preprocess`` (D), ``_bwd_dkdv_kernel`` (one program per key block, looping
over query blocks; S in either orientation, :func:`_dkdv_step`) and ``_bwd_dq_kernel`` (one program
per query block, looping over key blocks). No atomics: the result is deterministic. On Hopper the
dK/dV and dQ launches are :func:`.gluon_bwd.gluon_dkdv` and :func:`.gluon_bwd.gluon_dq` by default
(the same values bit for bit, faster; :func:`choose_dkdv_schedule`).
"""

from __future__ import annotations

import contextlib
import functools

import triton
import triton.language as tl

from .attention_fwd import cast, mma, quantize_p_cols, quantize_p_rows
from .quantize import INTERPRET


@triton.jit
def _bwd_preprocess(O, DO, DELTA,
                    sob, sos, soh, sod, sdob, sdos, sdoh, sdod,
                    H, Sq, D: tl.constexpr, BM: tl.constexpr):
    """D = rowsum(dO ∘ O) in float32, (B, H, Sq)."""
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = start_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    ok = offs_m < Sq
    o = tl.load(O + b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None] * sos + offs_d[None, :] * sod,
                mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh + offs_m[:, None] * sdos
                 + offs_d[None, :] * sdod, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * Sq + offs_m, tl.sum(o * do, axis=1), mask=ok)


@triton.jit
def _load_rows(ptrs, ok, MASK: tl.constexpr, other):
    """``tl.load(ptrs)``, masked by ``ok`` (filling ``other``) only where MASK says rows may be out of range."""
    if MASK:
        return tl.load(ptrs, mask=ok, other=other)
    else:
        return tl.load(ptrs)


@triton.jit
def _dkdv_step(acc_k, acc_v, ka, va, Q, DO, LSE2, M2, DELTA, start_m, Sq, qk_scale,
               sqs, sqd, sdos, sdod, offs_n, kv_ok, offs_d,
               BM: tl.constexpr, BN: tl.constexpr, QUANT_P: tl.constexpr, NATURAL: tl.constexpr,
               MASK_N: tl.constexpr, MASK_M: tl.constexpr):
    """One query block of the dK/dV loop, in either orientation (same values):

    * NATURAL: S [BM queries, BN keys] = Q Kᵀ (``ka``, ``va`` = Kᵀ, Vᵀ), so P's 16-key blocks lie
      along a thread's row (4 scores per thread and block, 2 shuffle levels: the forward's
      quantizer); ``acc_k``, ``acc_v`` are dKᵀ, dVᵀ [D, BN], accumulated as Qᵀ dS and dOᵀ Pᶠ (Pᶠ and
      dS become shared-memory operands).
    * else Sᵀ [BN keys, BM queries] = K Qᵀ (``ka``, ``va`` = K, V): a 16-key block runs down a warp's
      rows (2 scores per thread and block, 3 shuffle levels); dK, dV [BN, D] with Pᶠᵀ and dSᵀ as
      register operands."""
    offs_m = start_m + tl.arange(0, BM)
    m_ok = offs_m < Sq
    if NATURAL:
        q = _load_rows(Q + offs_m[:, None] * sqs + offs_d[None, :] * sqd, m_ok[:, None], MASK_M, 0.0)
    else:
        q = _load_rows(Q + offs_m[None, :] * sqs + offs_d[:, None] * sqd, m_ok[None, :], MASK_M, 0.0)  # Qᵀ
    lse2 = _load_rows(LSE2 + offs_m, m_ok, MASK_M, float("inf"))
    di = _load_rows(DELTA + offs_m, m_ok, MASK_M, 0.0)
    if NATURAL:
        s = mma(q, ka, None)                                        # S [BM queries, BN keys]
        if MASK_N:
            s = tl.where(kv_ok[None, :], s, float("-inf"))
    else:
        s = mma(ka, q, None)                                        # Sᵀ [BN keys, BM queries]
        if MASK_N:
            s = tl.where(kv_ok[:, None], s, float("-inf"))
    if QUANT_P:
        m2 = _load_rows(M2 + offs_m, m_ok, MASK_M, float("inf"))
        if MASK_M:
            c = tl.where(m_ok, tl.exp2(m2 - lse2), 0.0)
        else:
            c = tl.exp2(m2 - lse2)
        if NATURAL:
            p_tilde = tl.exp2(s * qk_scale - m2[:, None])       # relative to the final row max
            p = p_tilde * c[:, None]
            pf = quantize_p_rows(p_tilde, BM, BN, 1) * c[:, None]   # mode 1: NVFP4 (P_NVFP4)
        else:
            p_tilde = tl.exp2(s * qk_scale - m2[None, :])
            p = p_tilde * c[None, :]
            pf = quantize_p_cols(p_tilde, BN, BM) * c[None, :]
    else:
        if NATURAL:
            p = tl.exp2(s * qk_scale - lse2[:, None])
        else:
            p = tl.exp2(s * qk_scale - lse2[None, :])
        pf = p
    do = _load_rows(DO + offs_m[:, None] * sdos + offs_d[None, :] * sdod, m_ok[:, None], MASK_M, 0.0)
    if NATURAL:
        acc_v = mma(tl.trans(do), cast(pf, do.dtype), acc_v)
        dp = mma(do, va, None)                                      # dP [BM, BN]
        ds = p * (dp - di[:, None])
        acc_k = mma(tl.trans(q), cast(ds, q.dtype), acc_k)
    else:
        acc_v = mma(cast(pf, do.dtype), do, acc_v)
        dp = mma(va, tl.trans(do), None)                            # dPᵀ
        ds = p * (dp - di[None, :])
        acc_k = mma(cast(ds, q.dtype), tl.trans(q), acc_k)
    return acc_k, acc_v


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE2, M2, DELTA,
                     sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                     sdob, sdos, sdoh, sdod, sdkb, sdks, sdkh, sdkd, sdvb, sdvs, sdvh, sdvd,
                     H, Sq, Skv, qk_scale, sm_scale,
                     D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, QUANT_P: tl.constexpr,
                     NATURAL: tl.constexpr = False):
    """Grid: (cdiv(Skv, BN), B·H). dK, dV of BN keys, accumulated over every query block.
    NATURAL: the untransposed tile, else Sᵀ (:func:`_dkdv_step`)."""
    start_n = tl.program_id(0) * BN
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_n = start_n + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    kv_ok = offs_n < Skv
    k = tl.load(K + b.to(tl.int64) * skb + h.to(tl.int64) * skh + offs_n[:, None] * sks + offs_d[None, :] * skd,
                mask=kv_ok[:, None], other=0.0)
    v = tl.load(V + b.to(tl.int64) * svb + h.to(tl.int64) * svh + offs_n[:, None] * svs + offs_d[None, :] * svd,
                mask=kv_ok[:, None], other=0.0)
    Q += b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    DO += b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh
    LSE2 += bh.to(tl.int64) * Sq
    M2 += bh.to(tl.int64) * Sq
    DELTA += bh.to(tl.int64) * Sq
    if NATURAL:   # the step's operands and accumulators in its orientation
        ka, va = tl.trans(k), tl.trans(v)
        acc_k = tl.zeros([D, BN], tl.float32)
        acc_v = tl.zeros([D, BN], tl.float32)
    else:
        ka, va = k, v
        acc_k = tl.zeros([BN, D], tl.float32)
        acc_v = tl.zeros([BN, D], tl.float32)
    m_full = Sq // BM * BM
    if start_n + BN <= Skv:
        for start_m in range(0, m_full, BM):
            acc_k, acc_v = _dkdv_step(acc_k, acc_v, ka, va, Q, DO, LSE2, M2, DELTA, start_m, Sq, qk_scale,
                                      sqs, sqd, sdos, sdod, offs_n, kv_ok, offs_d, BM, BN, QUANT_P, NATURAL,
                                      False, False)
    else:  # the ragged last key block: keys beyond Skv masked out of P
        for start_m in range(0, m_full, BM):
            acc_k, acc_v = _dkdv_step(acc_k, acc_v, ka, va, Q, DO, LSE2, M2, DELTA, start_m, Sq, qk_scale,
                                      sqs, sqd, sdos, sdod, offs_n, kv_ok, offs_d, BM, BN, QUANT_P, NATURAL,
                                      True, False)
    if m_full < Sq:
        acc_k, acc_v = _dkdv_step(acc_k, acc_v, ka, va, Q, DO, LSE2, M2, DELTA, m_full, Sq, qk_scale,
                                  sqs, sqd, sdos, sdod, offs_n, kv_ok, offs_d, BM, BN, QUANT_P, NATURAL,
                                  True, True)
    if NATURAL:
        dk, dv = tl.trans(acc_k), tl.trans(acc_v)
    else:
        dk, dv = acc_k, acc_v
    dk = dk * sm_scale
    tl.store(DK + b.to(tl.int64) * sdkb + h.to(tl.int64) * sdkh + offs_n[:, None] * sdks + offs_d[None, :] * sdkd,
             cast(dk, DK.dtype.element_ty), mask=kv_ok[:, None])
    tl.store(DV + b.to(tl.int64) * sdvb + h.to(tl.int64) * sdvh + offs_n[:, None] * sdvs + offs_d[None, :] * sdvd,
             cast(dv, DV.dtype.element_ty), mask=kv_ok[:, None])


@triton.jit
def _dq_step(dq, q, do, lse2, di, K, V, start_n, Skv, qk_scale, sks, skd, svs, svd, offs_d,
             BN: tl.constexpr, MASK: tl.constexpr):
    offs_n = start_n + tl.arange(0, BN)
    kv_ok = offs_n < Skv
    kt_ptrs = K + offs_n[None, :] * sks + offs_d[:, None] * skd
    vt_ptrs = V + offs_n[None, :] * svs + offs_d[:, None] * svd
    if MASK:
        kt = tl.load(kt_ptrs, mask=kv_ok[None, :], other=0.0)
        vt = tl.load(vt_ptrs, mask=kv_ok[None, :], other=0.0)
    else:
        kt = tl.load(kt_ptrs)
        vt = tl.load(vt_ptrs)
    s = mma(q, kt, None)
    if MASK:
        s = tl.where(kv_ok[None, :], s, float("-inf"))
    p = tl.exp2(s * qk_scale - lse2[:, None])
    dp = mma(do, vt, None)
    ds = p * (dp - di[:, None])
    dq = mma(cast(ds, kt.dtype), tl.trans(kt), dq)
    return dq


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, DQ, LSE2, DELTA,
                   sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                   sdob, sdos, sdoh, sdod, sdqb, sdqs, sdqh, sdqd,
                   H, Sq, Skv, qk_scale, sm_scale,
                   D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Grid: (cdiv(Sq, BM), B·H). dQ of BM queries, accumulated over every key block."""
    start_m = tl.program_id(0) * BM
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = start_m + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    m_ok = offs_m < Sq
    q = tl.load(Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + offs_m[:, None] * sqs + offs_d[None, :] * sqd,
                mask=m_ok[:, None], other=0.0)
    do = tl.load(DO + b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh + offs_m[:, None] * sdos
                 + offs_d[None, :] * sdod, mask=m_ok[:, None], other=0.0)
    lse2 = tl.load(LSE2 + bh.to(tl.int64) * Sq + offs_m, mask=m_ok, other=float("inf"))
    di = tl.load(DELTA + bh.to(tl.int64) * Sq + offs_m, mask=m_ok, other=0.0)
    K += b.to(tl.int64) * skb + h.to(tl.int64) * skh
    V += b.to(tl.int64) * svb + h.to(tl.int64) * svh
    dq = tl.zeros([BM, D], tl.float32)
    n_full = Skv // BN * BN
    for start_n in range(0, n_full, BN):
        dq = _dq_step(dq, q, do, lse2, di, K, V, start_n, Skv, qk_scale, sks, skd, svs, svd, offs_d, BN, False)
    if n_full < Skv:
        dq = _dq_step(dq, q, do, lse2, di, K, V, n_full, Skv, qk_scale, sks, skd, svs, svd, offs_d, BN, True)
    dq = dq * sm_scale
    tl.store(DQ + b.to(tl.int64) * sdqb + h.to(tl.int64) * sdqh + offs_m[:, None] * sdqs + offs_d[None, :] * sdqd,
             cast(dq, DQ.dtype.element_ty), mask=m_ok[:, None])


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------

# Tile configurations by head_dim, measured on the H100 (docs/kernels_notes.md). attnqat's dK/dV
# runs the untransposed tile (its P quantizer is the forward's: half the cost of the transposed
# tile's), 64 × 64 on 4 warps: 53.2 against 57.5 ms at 32,760 queries (D 128), 298.9 against
# 329.5 at 75,600, with 2 stages at D 64 (60.3 against 92.3 ms, H 24) — bit-identical results.
# dropin (no quantizer) stays on the transposed tile (46.2 against 47.1 ms), without prefetching
# (1 stage) up to 32K queries and with 2 stages beyond: measured 59.6 vs 67.5 ms at 32,760
# queries, 536 vs 467 ms (forward+backward) at 75,600.
BWD_CONFIGS = {
    64: dict(dkdv=dict(BM=64, BN=64, num_warps=4, num_stages=2, NATURAL=True),
             dkdv_dropin=dict(BM=64, BN=128, num_warps=8, num_stages=1, NATURAL=False),
             dq=dict(BM=128, BN=64, num_warps=8, num_stages=3)),
    128: dict(dkdv=dict(BM=64, BN=64, num_warps=4, num_stages=1, NATURAL=True),
              dkdv_dropin=dict(BM=64, BN=128, num_warps=8, num_stages=1, NATURAL=False),
              dq=dict(BM=128, BN=64, num_warps=8, num_stages=3)),
}
LONG_QUERIES = 32768  # above this the transposed dK/dV loop prefetches (num_stages=2)

#: run the dQ kernel on a second CUDA stream, concurrently with the dK/dV kernel (both read only the
#: forward's outputs and D): its CTAs fill the SMs that the dK/dV kernel's last, partial wave leaves
#: idle. The arithmetic of each kernel is unchanged.
OVERLAP_DQ = True


@functools.lru_cache(maxsize=None)
def _side_stream(device):
    """The second stream of ``device`` (a tensor's ``.device``: always indexed) for the dQ kernel,
    made once."""
    import torch  # noqa: PLC0415

    return torch.cuda.Stream(device=device)


def dkdv_config(D: int, Sq: int, quant_p: bool) -> dict:
    """The dK/dV kernel's default launch configuration (tiles, warps, stages, orientation)."""
    cfg = dict(BWD_CONFIGS[D]["dkdv" if quant_p else "dkdv_dropin"])
    if not cfg["NATURAL"] and Sq > LONG_QUERIES:
        cfg["num_stages"] = 2
    return cfg


def _s4(t):
    return t.stride(0), t.stride(1), t.stride(2), t.stride(3)


def choose_dkdv_schedule(q, k, v, do, schedule: str | None, config, kernel: str = "dkdv") -> str:
    """Which kernel computes dK and dV (``kernel="dkdv"``) or dQ (``"dq"``): ``"gluon"``
    (:mod:`.gluon_bwd`, Hopper; on an H100 faster, docs/benchmarks.md) wherever it takes the
    operands, else ``"triton"``. A ``"dkdv"`` (``"dq"``) tile override is the Triton kernel's, so it
    selects it; so does the Triton interpreter; the default dQ kernel is the Gluon one only at the
    head_dims of :data:`.gluon_bwd.DQ_AUTO_HEAD_DIMS`. An explicit ``"gluon"`` that cannot run
    raises ValueError instead of silently running the other kernel."""
    from .gluon_bwd import DQ_AUTO_HEAD_DIMS, gluon_dkdv_unsupported  # noqa: PLC0415
    from .gluon_fwd import check_schedule  # noqa: PLC0415

    check_schedule(schedule)
    if schedule == "triton" or (schedule is None and (kernel in (config or {}) or INTERPRET.value)):
        return "triton"
    if schedule is None and kernel == "dq" and q.shape[-1] not in DQ_AUTO_HEAD_DIMS:
        return "triton"
    why = gluon_dkdv_unsupported(q, k, v, do)
    if why is None:
        return "gluon"
    if schedule == "gluon":
        name = "dK/dV" if kernel == "dkdv" else "dQ"
        raise ValueError(f"the Gluon {name} kernel cannot run these inputs: {why}")
    return "triton"


def attention_backward(q, k, v, o, do, lse2, m2, *, sm_scale: float, quant_p: bool, config=None,
                       schedule: str | None = None):
    """dQ, dK, dV (in q's dtype, (B, S, H, D)) of the 4-bit training methods.

    ``q, k, v``: the operands the backward recomputes S from (Qᶠ, Kᶠ, Vᶠ for attnqat; the inputs for
    dropin). ``o``: the output D is taken from (O' for attnqat, the FP4 O for dropin). ``lse2``,
    ``m2``: the forward's log-sum-exp and final row maximum in log2 units, (B, H, Sq) float32.
    ``config``: overrides of the ``"dkdv"`` (:func:`dkdv_config`; ``NATURAL`` picks the tile's
    orientation; selects the Triton kernel), ``"gluon"`` (:data:`.gluon_bwd.CONFIG`), ``"dq"``
    (selects the Triton dQ kernel) and ``"gluon_dq"`` (:data:`.gluon_bwd.DQ_CONFIG`) launch
    configurations. ``schedule``: ``"gluon"`` | ``"triton"`` | None for the dK/dV and the dQ kernel
    (:func:`choose_dkdv_schedule`). On a GPU the dQ kernel runs on a second stream beside the dK/dV
    kernel (:data:`OVERLAP_DQ`); the caller's stream waits for it before this returns.
    """
    import torch  # noqa: PLC0415

    B, Sq, H, D = q.shape
    Skv = k.shape[1]
    cfg = dict(dkdv=dkdv_config(D, Sq, quant_p), dq=dict(BWD_CONFIGS[D]["dq"]), gluon={}, gluon_dq={})
    for key, val in (config or {}).items():
        cfg[key].update(val)
    delta = torch.empty(B, H, Sq, device=q.device, dtype=torch.float32)
    _bwd_preprocess[(triton.cdiv(Sq, 64), B * H)](o, do, delta, *_s4(o), *_s4(do), H, Sq, D=D, BM=64,
                                                   num_warps=4)
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    dk = torch.empty(k.shape, device=q.device, dtype=q.dtype)
    dv = torch.empty(v.shape, device=q.device, dtype=q.dtype)
    qk_scale = sm_scale * 1.4426950408889634
    main = side = None
    if OVERLAP_DQ and q.is_cuda and not INTERPRET.value:
        main, side = torch.cuda.current_stream(q.device), _side_stream(q.device)
        side.wait_stream(main)      # D and the allocations above; not the dK/dV kernel below
    if choose_dkdv_schedule(q, k, v, do, schedule, config) == "gluon":
        from .gluon_bwd import gluon_dkdv  # noqa: PLC0415

        gluon_dkdv(q, k, v, do, dk, dv, lse2, m2, delta, sm_scale=sm_scale, quant_p=quant_p, config=cfg["gluon"])
    else:
        c1 = cfg["dkdv"]
        _bwd_dkdv_kernel[(triton.cdiv(Skv, c1["BN"]), B * H)](
            q, k, v, do, dk, dv, lse2, m2 if m2 is not None else lse2, delta,
            *_s4(q), *_s4(k), *_s4(v), *_s4(do), *_s4(dk), *_s4(dv),
            H, Sq, Skv, qk_scale, sm_scale, D=D, QUANT_P=quant_p, **c1)
    with contextlib.nullcontext() if side is None else torch.cuda.stream(side):
        if choose_dkdv_schedule(q, k, v, do, schedule, config, "dq") == "gluon":
            from .gluon_bwd import gluon_dq  # noqa: PLC0415

            gluon_dq(q, k, v, do, dq, lse2, delta, sm_scale=sm_scale, config=cfg["gluon_dq"])
        else:
            c2 = cfg["dq"]
            _bwd_dq_kernel[(triton.cdiv(Sq, c2["BM"]), B * H)](
                q, k, v, do, dq, lse2, delta,
                *_s4(q), *_s4(k), *_s4(v), *_s4(do), *_s4(dq),
                H, Sq, Skv, qk_scale, sm_scale, D=D, **c2)
    if side is not None:
        # Everything the caller does next runs after dQ; the operands and dq were allocated on
        # ``main`` and stay referenced until here, so the caching allocator cannot hand them out
        # while the dQ kernel still reads or writes them.
        main.wait_stream(side)
    return dq, dk, dv
