"""``sagebwd`` on Triton: trainable INT8 attention with INT8 tensor-core products (exact in int32).

The definition is :mod:`attnqat.sagebwd` (the PyTorch reference) and docs/numerics.md; this module
computes the same quantities with the same tiles:

* :func:`_quant_kernel` — one pass per operand: per-block INT8 codes and scales, written in the
  layouts the tensor cores want. INT8 products on Hopper need both operands K-major (the contraction
  axis contiguous; DESIGN.md §7), so an operand that is the right-hand side of a product over tokens
  (V in P̃V; Q in dSᵀQ; K in dS·K; dO in P̃ᵀdO) gets a transposed copy (B, H, D, S_padded); the
  copies that are contracted over head_dim (Q, K in S = QKᵀ) stay (B, H, S_padded, D). Token axes
  are zero-padded to a multiple of 128, so the kernels' INT8 loads need no masks.
* :func:`_fwd_kernel` — S = Q·Kᵀ (int8 → int32), online softmax over 128-key tiles, P̃ codes
  ``rne(127·exp2(t − rowmax_tile))``, O += s_P·s_V·(P̃·V) (int8 → int32).
* :func:`_dkdv_kernel` (one program per 64 keys, looping over 128-query tiles) and :func:`_dq_kernel`
  (one program per 128 queries, looping over 64-key tiles): S recomputed bit for bit, dP = dO·Vᵀ in
  16 bits, dS = P ∘ (dP − D); dV = Pᵀ·dO, dK = dSᵀ·Q, dQ = dS·K in int8 → int32.

On Hopper :func:`forward` runs the Gluon launch of :mod:`.gluon_sagebwd_fwd` instead (the same
operations on the same codes: bit for bit on an H200; :func:`choose_forward_schedule`) and
:func:`backward` those of :mod:`.gluon_sagebwd` (the same quantities; :func:`choose_backward_schedule`),
with dQ from the dS codes the dK launch stores.

Exact against the reference: the codes and scales of Q, K (smoothed), V and dO, and t = S·scale·log2e
(the debug output ``store_t``). Everything after an exp2 agrees to rounding (exp2 on the GPU is not
torch.exp2's, so a P or dS code may differ by one).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import formats as _ref

from .attention_fwd import cast, mma
from .quantize import INTERPRET
from .receipt import note

LOG2E = 1.4426950408889634
PAD = 128            # token axes of the INT8 copies are padded to this
RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5·2^23: (x + M) − M rounds |x| < 2^22 to the nearest integer, ties to even

if (_ref.SAGEBWD_Q_BLOCK, _ref.SAGEBWD_K_BLOCK, _ref.SAGEBWD_BWD_BLOCK_Q, _ref.SAGEBWD_BWD_BLOCK_K) != (128, 128, 128, 64):  # pragma: no cover
    raise ImportError("kernels/sagebwd.py tiles assume Q_BLOCK = K_BLOCK = BWD_BLOCK_Q = 128, BWD_BLOCK_K = 64")


LOG2_127 = tl.constexpr(6.988684686772166)
I2F_MAGIC = tl.constexpr(0x4B400000)  # the bits of RNE_MAGIC


@triton.jit
def _i2f(x):
    """int32 → float32, exact for |x| < 2^22 (every product here: 127²·128 < 2^21), without the
    conversion instruction (16 per clock per SM on Hopper, as slow as exp2): add the bits of
    1.5·2^23 as an integer, reinterpret, subtract 1.5·2^23."""
    return (x + I2F_MAGIC).to(tl.float32, bitcast=True) - RNE_MAGIC


@triton.jit
def _f2i8(x):
    """float32 with |x| <= 127.5 → int8 rounded to nearest, ties to even: after adding 1.5·2^23 the
    float's low mantissa byte is the rounded value in two's complement (one add, no conversion)."""
    return (x + RNE_MAGIC).to(tl.int32, bitcast=True).to(tl.int8)


# ----------------------------------------------------------------------------------------------
# Quantization pass
# ----------------------------------------------------------------------------------------------

@triton.jit
def _quant_kernel(X, MEAN, OUT, OUT_T, SCALE, O32, DELTA,
                  sxb, sxs, sxh, sxd, sob, sos, soh, sod,
                  H, S, Sp,
                  D: tl.constexpr, BLOCK: tl.constexpr, HAS_MEAN: tl.constexpr,
                  WRITE_N: tl.constexpr, WRITE_T: tl.constexpr, HAS_DELTA: tl.constexpr):
    """Grid (Sp/BLOCK, B·H). One block of BLOCK tokens × D of X (B, S, H, D) (minus MEAN (B, H, D)):
    amax, scale amax/127, codes rne(x·(127/amax)) to OUT (B, H, Sp, D) and/or OUT_T (B, H, D, Sp).
    HAS_DELTA (X = dO): also D = rowsum(dO ∘ O32) to DELTA (B, H, Sp), padded rows 0."""
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    ok = rows < S
    x = tl.load(X + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + rows[:, None].to(tl.int64) * sxs
                + offs_d[None, :] * sxd, mask=ok[:, None], other=0.0).to(tl.float32)
    if HAS_MEAN:
        mean = tl.load(MEAN + bh.to(tl.int64) * D + offs_d)
        x = tl.where(ok[:, None], x - mean[None, :], 0.0)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    inv = tl.where(amax > 0, tl.math.div_rn(127.0, tl.maximum(amax, 1e-30)), 0.0)
    codes = _f2i8(x * inv)   # launched with enable_fp_fusion=False: no FMA with the rounding add
    tl.store(SCALE + bh.to(tl.int64) * (Sp // BLOCK) + blk, tl.math.div_rn(amax, 127.0))
    if WRITE_N:
        tl.store(OUT + bh.to(tl.int64) * Sp * D + rows[:, None] * D + offs_d[None, :], codes)
    if WRITE_T:
        tl.store(OUT_T + bh.to(tl.int64) * Sp * D + offs_d[:, None] * Sp + rows[None, :], tl.trans(codes))
    if HAS_DELTA:
        o = tl.load(O32 + b.to(tl.int64) * sob + h.to(tl.int64) * soh + rows[:, None].to(tl.int64) * sos
                    + offs_d[None, :] * sod, mask=ok[:, None], other=0.0)
        tl.store(DELTA + bh.to(tl.int64) * Sp + rows, tl.sum(x * o, axis=1))


def _padded(n: int) -> int:
    return triton.cdiv(n, PAD) * PAD


def quantize(x, block: int, mean=None, normal: bool = True, transposed: bool = False, o32=None):
    """Per-block INT8 of a (B, S, H, D) tensor (minus ``mean`` (B, H, D)). Returns
    ``(codes (B, H, Sp, D) | None, codes_t (B, H, D, Sp) | None, scales (B, H, Sp/block), delta | None)``."""
    B, S, H, D = x.shape
    Sp = _padded(S)
    dev = x.device
    out = torch.empty(B, H, Sp, D, device=dev, dtype=torch.int8) if normal else None
    out_t = torch.empty(B, H, D, Sp, device=dev, dtype=torch.int8) if transposed else None
    scale = torch.empty(B, H, Sp // block, device=dev, dtype=torch.float32)
    delta = torch.empty(B, H, Sp, device=dev, dtype=torch.float32) if o32 is not None else None
    dummy = scale
    ost = o32.stride() if o32 is not None else (0, 0, 0, 0)
    _quant_kernel[(Sp // block, B * H)](
        x, mean if mean is not None else dummy, out if normal else dummy, out_t if transposed else dummy,
        scale, o32 if o32 is not None else dummy, delta if delta is not None else dummy,
        *x.stride(), *ost, H, S, Sp, D=D, BLOCK=block, HAS_MEAN=mean is not None, WRITE_N=normal,
        WRITE_T=transposed, HAS_DELTA=o32 is not None, num_warps=4, enable_fp_fusion=False)
    return out, out_t, scale, delta


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------

@triton.jit
def _fwd_tile(acc, l_i, m_i, q8, sq, K8, SK, V8T, SV, T, t_base, start_n, offs_m, offs_d, Skv, Skp, qk,
              D: tl.constexpr, BN: tl.constexpr, MASK: tl.constexpr, STORE_T: tl.constexpr):
    offs_n = start_n + tl.arange(0, BN)
    kt = tl.load(K8 + offs_n[None, :] * D + offs_d[:, None])            # [D, BN], K-major
    c = (sq * tl.load(SK + start_n // BN)) * qk
    a = _i2f(tl.dot(q8, kt))                       # exact integer-valued float32
    if MASK:
        a = tl.where((offs_n < Skv)[None, :], a, float("-inf"))
    if STORE_T:
        tl.store(T + t_base + offs_m[:, None] * Skp + offs_n[None, :], a * c)
    pc, m_new, l_i, alpha, s_p = p_codes(a, m_i, l_i, c)
    vt = tl.load(V8T + offs_d[:, None] * Skp + offs_n[None, :])          # [D, BN], K-major
    w = s_p * tl.load(SV + start_n // BN)
    acc = fold_pv(acc, tl.dot(pc, tl.trans(vt)), alpha, w)
    return acc, l_i, m_new


@triton.jit
def p_codes(a, m_i, l_i, c):
    """One key tile's online softmax and P̃'s codes from its integer-valued scores ``a`` (float32)
    and their scale ``c``: returns (codes, m, l, α, s_P). Shared by this module's forward and the
    Gluon one (:mod:`.gluon_sagebwd_fwd`: Gluon compiles this body with its own semantics), so the
    two run the same operations in the same order."""
    tmax = tl.max(a, 1) * c                        # = rowmax(t): x ↦ x·c is monotonic
    m_new = tl.maximum(m_i, tmax)
    # e = 127·exp2(t − rowmax) with t = a·c: one FMA and one exp2 per element
    e = tl.exp2(a * c - (tmax - LOG2_127)[:, None])
    pc = _f2i8(e)
    s_p = tl.exp2(tmax - m_new) / 127.0
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + s_p * tl.sum(e, 1)
    return pc, m_new, l_i, alpha, s_p


@triton.jit
def fold_pv(acc, pv, alpha, w):
    """acc·α + (P̃·V)·w (shared as :func:`p_codes` is), the int32 product x read through its bits as
    1.5·2^23 + x: bits·w − 1.5·2^23·w saves the exact conversion's subtraction; the cancellation adds
    at most ~1.5·w per element (1.5 units of the integer product), about 1 % of the P̃ codes' own
    rounding noise (~0.29·|v code|·√128 units)."""
    bits = (pv + I2F_MAGIC).to(tl.float32, bitcast=True)
    return acc * alpha[:, None] + (bits * w[:, None] - (w * RNE_MAGIC)[:, None])


@triton.jit
def _fwd_kernel(Q8, SQ, K8, SK, V8T, SV, O, LSE2, T,
                sob, sos, soh, sod,
                H, Sq, Skv, Sqp, Skp, qk,
                D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                STORE_LSE: tl.constexpr, STORE_T: tl.constexpr):
    """Grid (Sqp/BM, B·H), BM 64 or 128 (inside one 128-query Q block), BN = 128 (the K/V scale
    block and the key tile of the definition). O (B, Sq, H, D) in O's dtype; LSE2 (B, H, Sqp), padded rows +inf."""
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = start_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    bh64 = bh.to(tl.int64)
    q8 = tl.load(Q8 + bh64 * Sqp * D + offs_m[:, None] * D + offs_d[None, :])
    sq = tl.load(SQ + bh64 * (Sqp // 128) + (start_m * BM) // 128)
    K8 += bh64 * Skp * D
    V8T += bh64 * Skp * D
    SK += bh64 * (Skp // BN)
    SV += bh64 * (Skp // BN)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    t_base = bh64 * Sqp * Skp
    n_full = Skv // BN * BN
    for start_n in range(0, n_full, BN):
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q8, sq, K8, SK, V8T, SV, T, t_base, start_n, offs_m, offs_d,
                                  Skv, Skp, qk, D, BN, False, STORE_T)
    if n_full < Skv:   # the ragged last tile, keys beyond Skv masked
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q8, sq, K8, SK, V8T, SV, T, t_base, n_full, offs_m, offs_d,
                                  Skv, Skp, qk, D, BN, True, STORE_T)
    ok = offs_m < Sq
    o_ptr = O + b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None].to(tl.int64) * sos + offs_d[None, :] * sod
    tl.store(o_ptr, cast(acc / l_i[:, None], O.dtype.element_ty), mask=ok[:, None])
    if STORE_LSE:
        tl.store(LSE2 + bh64 * Sqp + offs_m, tl.where(ok, m_i + tl.log2(l_i), float("inf")))


# H200, Wan 1.3B 480p, 2026-11-26 (kernels/sagebwd_bench.py --variants): 128 queries / 8 warps / 3 stages
# 11.66 ms, 2 stages 12.24, 4 stages 11.51; 4 warps 19.0-19.7; 64 queries / 4 warps / 2 stages 11.02,
# 3 stages 10.38 (the Q scale block stays 128 queries: a 64-query program reads its block's scale)
FWD_CONFIG = dict(BM=64, num_warps=4, num_stages=3)


class Saved(tuple):
    pass


def forward(q, k, v, scale: float, *, training: bool, store_t: bool = False, config=None):
    """Quantize and run the forward on (B, S, H, D) inputs. Returns ``(o, state)``: o is float32 when
    ``training`` (the high-precision O the backward's D uses), else q's dtype; ``state`` holds the
    INT8 operands and statistics (and ``t`` with ``store_t``: (B, H, Sqp, Skp), tests only).

    ``config``: ``{"schedule": ..., "gluon": {...}}`` or the Triton kernel's options over
    :data:`FWD_CONFIG` (BM, num_warps, num_stages). ``schedule``: ``"gluon"`` the hand-scheduled
    Hopper launch of :mod:`.gluon_sagebwd_fwd` (``gluon``: its options), ``"triton"`` the kernel
    above, or None: the schedule whose options are given, else Gluon where it runs and ``store_t`` is
    not asked for (a debug output of the Triton kernel only; :func:`choose_forward_schedule`)."""
    B, Sq, H, D = q.shape
    Skv = k.shape[1]
    Sqp, Skp = _padded(Sq), _padded(Skv)
    schedule, gluon_cfg, cfg = _options(config, lambda s: choose_forward_schedule(q, s, store_t), "forward")
    kmean = _ref.key_mean(k).contiguous()
    q8, q8t, sq, _ = quantize(q, 128, transposed=training)
    k8, k8t, sk, _ = quantize(k, 128, mean=kmean, transposed=training)
    _, v8t, sv, _ = quantize(v, 128, normal=False, transposed=True)
    o = torch.empty(B, Sq, H, D, device=q.device, dtype=torch.float32 if training else q.dtype)
    lse2 = torch.empty(B, H, Sqp, device=q.device, dtype=torch.float32) if training else None
    if schedule == "gluon":
        from .gluon_sagebwd_fwd import gluon_forward  # noqa: PLC0415

        gluon_forward(q8, sq, k8, sk, v8t, sv, o, lse2, Skv=Skv, qk=float(scale) * LOG2E, config=gluon_cfg)
        t = None
    else:
        t = torch.empty(B, H, Sqp, Skp, device=q.device, dtype=torch.float32) if store_t else sq
        cfg = dict(FWD_CONFIG, **cfg)
        BM = cfg.pop("BM")
        _fwd_kernel[(Sqp // BM, B * H)](
            q8, sq, k8, sk, v8t, sv, o, lse2 if training else sq, t, *o.stride(), H, Sq, Skv, Sqp, Skp,
            float(scale) * LOG2E, D=D, BM=BM, BN=128, STORE_LSE=training, STORE_T=store_t, **cfg)
    state = dict(q8=q8, q8t=q8t, sq=sq, k8=k8, k8t=k8t, sk=sk, v8t=v8t, sv=sv, kmean=kmean,
                 lse2=lse2, t=t if store_t else None)
    return o, state


#: the default schedules where Gluon runs ("triton": the Triton kernels everywhere)
AUTO_FORWARD_SCHEDULE = "gluon"
AUTO_SCHEDULE = "gluon"


def _options(config, choose, what: str):
    """``(schedule, Gluon options, Triton options)`` of a forward's or backward's ``config``: the
    ``schedule`` given, else the one whose options are given, else ``choose(None)``; options of the
    schedule that does not run are an error, not ignored."""
    config = dict(config or {})
    schedule, has_gluon = config.pop("schedule", None), "gluon" in config
    gluon_cfg = config.pop("gluon", None)
    if schedule is None and (has_gluon or config):   # the options say which
        if has_gluon and config:
            raise ValueError(f"config has options of both {what} schedules (gluon; {', '.join(config)}): "
                             "say which runs with 'schedule'")
        schedule = "gluon" if has_gluon else "triton"
    schedule = choose(schedule)
    if (schedule == "gluon" and config) or (schedule == "triton" and has_gluon):
        raise ValueError(f"the {schedule} {what} runs, but config has options of the other one "
                         f"({'gluon' if has_gluon else ', '.join(config)})")
    return schedule, gluon_cfg, config


def _choose(schedule: str | None, auto: str, why_not, what: str) -> str:
    """``"gluon"`` or ``"triton"``: ``schedule`` when given (``"gluon"`` raises where it cannot run,
    saying why), else ``auto`` where ``why_not()`` finds nothing against Gluon, else ``"triton"``;
    noted (:func:`.receipt.note`: what the app and the generation records name as the kernel)."""
    if schedule not in (None, "gluon", "triton"):
        raise ValueError(f"schedule must be 'gluon', 'triton' or None, got {schedule!r}")
    if schedule == "triton" or (schedule is None and auto != "gluon"):
        return note("triton")
    why = why_not()
    if why is None:
        return note("gluon")
    if schedule == "gluon":
        raise RuntimeError(f"the Gluon sagebwd {what} cannot run: {why}")
    return note("triton")


def choose_forward_schedule(q, schedule: str | None, store_t: bool = False) -> str:
    """The forward's schedule (:func:`_choose`, :data:`AUTO_FORWARD_SCHEDULE`): Gluon where
    :func:`.gluon_sagebwd_fwd.gluon_forward_unsupported` finds nothing against it and ``store_t``
    (the Triton kernel's debug output) is not asked for."""
    def why_not():
        if store_t:
            return "store_t is a debug output of the Triton forward"
        from .gluon_sagebwd_fwd import gluon_forward_unsupported  # noqa: PLC0415

        return gluon_forward_unsupported(q)

    return _choose(schedule, AUTO_FORWARD_SCHEDULE, why_not, "forward")


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------

@triton.jit
def _pair_of_program(BH0, H):
    """The (batch, head) pair of a backward program (grid axis 1 counts pairs from BH0 on): its
    index in the launch and in the whole tensor (int64, for offsets), batch and head."""
    pair = tl.program_id(1)
    bh = BH0 + pair
    return pair.to(tl.int64), bh.to(tl.int64), bh // H, bh % H


@triton.jit
def _dkdv_loop(dk, dv, k8, sk, v, key_ok, Q8, Q8T, SQ, DO, DO8T, SDO, LSE2, DELTA, DS8, SDS, RS, start_n, offs_d,
               sds_, sdd, Sq, Sqp, Skp, qk, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               MASK: tl.constexpr, PART: tl.constexpr, STORE_DS: tl.constexpr):
    for start_m in range(0, Sqp, BM):
        offs_m = start_m + tl.arange(0, BM)
        qt = tl.load(Q8 + offs_m[None, :] * D + offs_d[:, None])                           # [D, BM]
        c = (tl.load(SQ + start_m // 128) * sk) * qk
        st = _i2f(tl.dot(k8, qt))                                                           # [BN, BM]
        if MASK:
            st = tl.where(key_ok[:, None], st, float("-inf"))
        lse = tl.load(LSE2 + offs_m)
        pt = tl.exp2(st * c - lse[None, :])                                                 # tᵀ = st·c
        if PART != 1:   # the order of the first version (measured on the H200) for PART 0
            do = tl.load(DO + offs_m[:, None].to(tl.int64) * sds_ + offs_d[None, :] * sdd,
                         mask=(offs_m < Sq)[:, None], other=0.0)                           # [BM, D]
            dpt = mma(v, tl.trans(do), tl.zeros([BN, BM], tl.float32))
            dst = pt * (dpt - tl.load(DELTA + offs_m)[None, :])
        if PART != 2:
            # dV = Pᵀ dO: P per key over the BM queries, dO per BM queries
            pmax = tl.max(pt, 1)
            pinv = tl.where(pmax > 0, 127.0 / tl.maximum(pmax, 1e-30), 0.0)
            pc = _f2i8(pt * pinv[:, None])
            do8 = tl.load(DO8T + offs_d[:, None] * Sqp + offs_m[None, :])                   # [D, BM]
            prod = _i2f(tl.dot(pc, tl.trans(do8)))
            dv += prod * ((pmax / 127.0) * tl.load(SDO + start_m // BM))[:, None]
        if PART != 1:
            # dK = dSᵀ Q: dS per BM×BN block
            amax = tl.max(tl.max(tl.abs(dst), 1), 0)
            inv = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
            dc = _f2i8(dst * inv)
            q8 = tl.load(Q8T + offs_d[:, None] * Sqp + offs_m[None, :])                      # [D, BM]
            prod = _i2f(tl.dot(dc, tl.trans(q8)))
            dk += prod * ((amax / 127.0) * tl.load(SQ + start_m // 128))
            if STORE_DS:   # for dQ = dS·K from memory (_dq_stored_kernel): codes [q, k], keys contiguous
                offs_n = start_n + tl.arange(0, BN)
                tl.store(DS8 + offs_m[None, :].to(tl.int64) * Skp + offs_n[:, None], dc)
                tl.store(SDS + (start_m // BM) * (Skp // BN) + start_n // BN, amax / 127.0)
                tl.atomic_add(RS + offs_m, tl.sum(dst, 0))   # rowsum of the unquantized dS, for the correction
    return dk, dv


@triton.jit
def _dkdv_kernel(Q8, Q8T, SQ, K8, SK, V, DO, DO8T, SDO, LSE2, DELTA, DK, DV, DS8, SDS, RS,
                 svb, svs, svh, svd, sdb, sds_, sdh, sdd, sob, sos, soh, sod,
                 H, Sq, Skv, Sqp, Skp, qk, sm_scale, BH0,
                 D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PART: tl.constexpr = 0,
                 STORE_DS: tl.constexpr = False):
    """Grid (Skp/BN, number of (batch, head) pairs from BH0 on), BN = 64 keys, BM = 128 queries per
    step (one dS block of the definition). dK, dV (B, Skv, H, D) in DK's dtype. PART 0: both; 1: dV
    only; 2: dK only (two launches that each recompute S, with one accumulator each: fewer registers
    live). STORE_DS (PART 0 or 2): also write dS's codes to DS8 (pairs, Sqp, Skp), its block scales
    to SDS (pairs, Sqp/BM, Skp/BN) and add its row sums into RS (pairs, Sqp), the pair counted
    from BH0, for :func:`_dq_stored_kernel`."""
    start_n = tl.program_id(0) * BN
    pair64, bh64, b, h = _pair_of_program(BH0, H)
    offs_n = start_n + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    key_ok = offs_n < Skv
    k8 = tl.load(K8 + bh64 * Skp * D + offs_n[:, None] * D + offs_d[None, :])             # [BN, D]
    sk = tl.load(SK + bh64 * (Skp // 128) + start_n // 128)
    v = tl.load(V + b.to(tl.int64) * svb + h.to(tl.int64) * svh + offs_n[:, None].to(tl.int64) * svs
                + offs_d[None, :] * svd, mask=key_ok[:, None], other=0.0)                  # [BN, D]
    Q8 += bh64 * Sqp * D
    Q8T += bh64 * Sqp * D
    DO8T += bh64 * Sqp * D
    DO += b.to(tl.int64) * sdb + h.to(tl.int64) * sdh
    SQ += bh64 * (Sqp // 128)
    SDO += bh64 * (Sqp // BM)
    LSE2 += bh64 * Sqp
    DELTA += bh64 * Sqp
    DS8 += pair64 * Sqp * Skp
    SDS += pair64 * (Sqp // BM) * (Skp // BN)
    RS += pair64 * Sqp
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    if start_n + BN <= Skv:
        dk, dv = _dkdv_loop(dk, dv, k8, sk, v, key_ok, Q8, Q8T, SQ, DO, DO8T, SDO, LSE2, DELTA, DS8, SDS, RS,
                            start_n, offs_d, sds_, sdd, Sq, Sqp, Skp, qk, D, BM, BN, False, PART, STORE_DS)
    else:   # the last key block: keys beyond Skv masked
        dk, dv = _dkdv_loop(dk, dv, k8, sk, v, key_ok, Q8, Q8T, SQ, DO, DO8T, SDO, LSE2, DELTA, DS8, SDS, RS,
                            start_n, offs_d, sds_, sdd, Sq, Sqp, Skp, qk, D, BM, BN, True, PART, STORE_DS)
    off = b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_n[:, None].to(tl.int64) * sos + offs_d[None, :] * sod
    if PART != 1:
        tl.store(DK + off, cast(dk * sm_scale, DK.dtype.element_ty), mask=key_ok[:, None])
    if PART != 2:
        tl.store(DV + off, cast(dv, DV.dtype.element_ty), mask=key_ok[:, None])


@triton.jit
def _dq_tile(dq, rs, start_n, q8, sq, do, lse, delta, K8, K8T, SK, V, offs_d, svs, svd, Skv, Skp, qk,
             D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, MASK: tl.constexpr):
    offs_n = start_n + tl.arange(0, BN)
    key_ok = offs_n < Skv
    kt = tl.load(K8 + offs_n[None, :] * D + offs_d[:, None])                           # [D, BN]
    sk = tl.load(SK + start_n // 128)
    a = _i2f(tl.dot(q8, kt))
    if MASK:
        a = tl.where(key_ok[None, :], a, float("-inf"))
    p = tl.exp2(a * ((sq * sk) * qk) - lse[:, None])
    vt = tl.load(V + offs_n[None, :].to(tl.int64) * svs + offs_d[:, None] * svd,
                 mask=key_ok[None, :], other=0.0)                                       # [D, BN]
    dp = mma(do, vt, tl.zeros([BM, BN], tl.float32))
    ds = p * (dp - delta[:, None])
    rs += tl.sum(ds, 1)
    amax = tl.max(tl.max(tl.abs(ds), 1), 0)
    inv = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
    dc = _f2i8(ds * inv)
    k8 = tl.load(K8T + offs_d[:, None] * Skp + offs_n[None, :])                          # [D, BN]
    prod = _i2f(tl.dot(dc, tl.trans(k8)))
    dq += prod * ((amax / 127.0) * sk)
    return dq, rs


@triton.jit
def _dq_kernel(Q8, SQ, K8, K8T, SK, KMEAN, V, DO, LSE2, DELTA, DQ,
               svb, svs, svh, svd, sdb, sds_, sdh, sdd, sob, sos, soh, sod,
               H, Sq, Skv, Sqp, Skp, qk, sm_scale,
               D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CORRECTION: tl.constexpr):
    """Grid (Sqp/BM, B·H), BM = 128 queries, BN = 64 keys per step (one dS block of the
    definition). dQ (B, Sq, H, D) in DQ's dtype. CORRECTION: add
    rowsum(dS) ⊗ k̄ (the smoothing correction)."""
    start_m = tl.program_id(0) * BM
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    bh64 = bh.to(tl.int64)
    offs_m = start_m + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    q8 = tl.load(Q8 + bh64 * Sqp * D + offs_m[:, None] * D + offs_d[None, :])             # [BM, D]
    sq = tl.load(SQ + bh64 * (Sqp // 128) + start_m // 128)
    q_ok = offs_m < Sq
    do = tl.load(DO + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh + offs_m[:, None].to(tl.int64) * sds_
                 + offs_d[None, :] * sdd, mask=q_ok[:, None], other=0.0)
    lse = tl.load(LSE2 + bh64 * Sqp + offs_m)
    delta = tl.load(DELTA + bh64 * Sqp + offs_m)
    K8 += bh64 * Skp * D
    K8T += bh64 * Skp * D
    SK += bh64 * (Skp // 128)
    V += b.to(tl.int64) * svb + h.to(tl.int64) * svh
    dq = tl.zeros([BM, D], tl.float32)
    rs = tl.zeros([BM], tl.float32)
    n_full = Skv // BN * BN
    for start_n in range(0, n_full, BN):
        dq, rs = _dq_tile(dq, rs, start_n, q8, sq, do, lse, delta, K8, K8T, SK, V, offs_d, svs, svd, Skv, Skp, qk,
                          D, BM, BN, False)
    if n_full < Skv:   # the ragged last key tile
        dq, rs = _dq_tile(dq, rs, n_full, q8, sq, do, lse, delta, K8, K8T, SK, V, offs_d, svs, svd, Skv, Skp, qk,
                          D, BM, BN, True)
    if CORRECTION:
        kmean = tl.load(KMEAN + bh64 * D + offs_d)
        dq = dq + rs[:, None] * kmean[None, :]
    dq = dq * sm_scale
    off = b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None].to(tl.int64) * sos + offs_d[None, :] * sod
    tl.store(DQ + off, cast(dq, DQ.dtype.element_ty), mask=q_ok[:, None])


@triton.jit
def _dq_stored_kernel(DS8, SDS, RS, K8T, SK, KMEAN, DQ, sob, sos, soh, sod,
                      H, Sq, Skv, Sqp, Skp, sm_scale, BH0,
                      D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CORRECTION: tl.constexpr):
    """Grid (Sqp/BM, pairs from BH0 on), BM = 128 queries, BN = 64 keys per step: dQ = dS·K from the
    codes and scales :func:`_dkdv_kernel` stored (STORE_DS), with no S, P or dP recomputed; the same
    products and the same order of accumulation as :func:`_dq_tile`."""
    start_m = tl.program_id(0) * BM
    pair64, bh64, b, h = _pair_of_program(BH0, H)
    offs_m = start_m + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    DS8 += pair64 * Sqp * Skp
    SDS += pair64 * (Sqp // BM) * (Skp // BN) + (start_m // BM) * (Skp // BN)
    K8T += bh64 * Skp * D
    SK += bh64 * (Skp // 128)
    dq = tl.zeros([BM, D], tl.float32)
    for start_n in range(0, tl.cdiv(Skv, BN) * BN, BN):   # blocks past Skv hold zeros
        offs_n = start_n + tl.arange(0, BN)
        dc = tl.load(DS8 + offs_m[:, None].to(tl.int64) * Skp + offs_n[None, :])          # [BM, BN]
        k8 = tl.load(K8T + offs_d[:, None] * Skp + offs_n[None, :])                       # [D, BN]
        prod = _i2f(tl.dot(dc, tl.trans(k8)))
        dq += prod * (tl.load(SDS + start_n // BN) * tl.load(SK + start_n // 128))
    if CORRECTION:
        kmean = tl.load(KMEAN + bh64 * D + offs_d)
        dq = dq + tl.load(RS + pair64 * Sqp + offs_m)[:, None] * kmean[None, :]
    dq = dq * sm_scale
    q_ok = offs_m < Sq
    off = b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None].to(tl.int64) * sos + offs_d[None, :] * sod
    tl.store(DQ + off, cast(dq, DQ.dtype.element_ty), mask=q_ok[:, None])


# sm_90 SASS of the main loops (triton 3.6 wheel here, compiled without a GPU), instructions per
# thread per 64×64 of S: dK/dV 64×64 tiles 4 warps 1,298 with 84 spill stores, 8 warps 975; 64 keys ×
# 128 queries, 8 warps: 754 (11 spill stores); dQ 64×64 4 warps 797, 128×64 8 warps 385.
# H200, same run (whole backward timed per variant, the other kernel at its then default): dK/dV at
# 8 warps 84.9 ms (profiled), at 4 warps ~45.6 (backward 74.7 ms minus dQ's 28.9); 2 stages need
# 354 KB of shared memory, over the 227 KB limit. dQ 8 warps / 2 stages 28.9 ms, 3 stages ~20.6
# (backward 105.7 minus dK/dV's 84.9); 4 warps slower (backward 119.9-145.2)
# H100, 2026-11-26 (`python3 -P -m attnqat.kernels.sagebwd_bench --variants --profile --rep-ms 250`,
# whole backward timed per variant): one dK/dV launch at 4 warps 45.2 ms of a 66 ms backward;
# split into a dV launch and a dK launch (one accumulator each; bit-identical) 61.9 ms in all.
DKDV_CONFIG = dict(split=True, num_warps=4, num_stages=1)
DQ_CONFIG = dict(num_warps=8, num_stages=3, stored=False)
#: the most bytes of dS codes one chunk of (batch, head) pairs keeps for ``stored`` dQ (the Wan 1.3B
#: 480p shape: 1.07 GB a head, so two heads a chunk; a chunk holds at least one pair)
DS_CHUNK_BYTES = 2 << 30


def _part_config(cfg: dict, part: int) -> dict:
    """The launch options of one dK/dV launch: ``cfg`` less its own keys, with the part's
    overrides (``dv`` for the dV launch, ``dk`` for the dK launch of a split) on top."""
    out = {k: v for k, v in cfg.items() if k not in ("split", "dv", "dk")}
    out.update(cfg.get({1: "dv", 2: "dk"}.get(part), None) or {})
    return out


def backward(q, k, v, o32, do, state, scale: float, config=None, smoothing_correction: bool = True):
    """dQ, dK, dV (B, S, H, D) in q's dtype. ``smoothing_correction=False``: dQ without the
    rowsum(dS) ⊗ k̄ term (a measurement, as in the reference).

    ``config``: ``{"schedule": ..., "gluon": {...}, "dkdv": {...}, "dq": {...}}``. ``schedule``:
    ``"gluon"`` the hand-scheduled Hopper launches of :mod:`.gluon_sagebwd` (``gluon``: their
    ``{"dv", "dk", "dq"}`` options), ``"triton"`` the Triton kernels below, or None: the schedule
    whose options are given, else Gluon where it takes the operands (:func:`choose_backward_schedule`);
    options of the schedule that does not run are an error, not ignored. ``dkdv``, ``dq``: the
    Triton launches' options over :data:`DKDV_CONFIG` and :data:`DQ_CONFIG`. dK/dV: ``split`` (a dV
    launch and a dK launch, each recomputing S, instead of one launch with both accumulators),
    ``dv``/``dk`` (options of one launch of a split). dQ: ``stored`` — the dK launch also writes
    dS's INT8 codes, block scales and row sums (per chunk of (batch, head) pairs, at most
    :data:`DS_CHUNK_BYTES` of codes or one pair's when that is more: 5.7 GB at 75,600 tokens), and
    dQ is their product with K, instead of a launch that recomputes S, P, dP and dS (the same
    values: the same arithmetic on the same operands, the row sums added in another order)."""
    B, Sq, H, D = q.shape
    Skv = k.shape[1]
    Sqp, Skp = _padded(Sq), _padded(Skv)
    schedule, gluon_cfg, config = _options(config, lambda s: choose_backward_schedule(v, do, s), "backward")
    _, do8t, sdo, delta = quantize(do, 128, normal=False, transposed=True, o32=o32)
    if schedule == "gluon":
        from . import gluon_sagebwd  # noqa: PLC0415

        dq, dk, dv = (torch.empty(x.shape, device=x.device, dtype=x.dtype) for x in (q, k, v))
        gluon_sagebwd.gluon_backward(v.contiguous(), do.contiguous(), state, do8t, sdo, delta, dq, dk, dv,
                                     scale=scale, smoothing_correction=smoothing_correction, config=gluon_cfg)
        return dq, dk, dv
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    cfg = dict(dkdv=dict(DKDV_CONFIG), dq=dict(DQ_CONFIG))
    for key, val in config.items():
        cfg[key].update(val)
    qk = float(scale) * LOG2E
    s = state
    dq_cfg = dict(cfg["dq"])
    stored = dq_cfg.pop("stored", False)
    parts = (1, 2) if cfg["dkdv"].get("split", False) else (0,)
    pairs = B * H
    chunk = max(1, DS_CHUNK_BYTES // (Sqp * Skp)) if stored else pairs
    dev = q.device
    if stored:
        ds8 = torch.empty(min(chunk, pairs), Sqp, Skp, device=dev, dtype=torch.int8)
        sds = torch.empty(min(chunk, pairs), Sqp // 128, Skp // 64, device=dev, dtype=torch.float32)
        rs = torch.empty(min(chunk, pairs), Sqp, device=dev, dtype=torch.float32)
    else:
        ds8 = sds = rs = delta   # not read
    for bh0 in range(0, pairs, chunk):
        n = min(chunk, pairs - bh0)
        if stored:
            rs.zero_()
        for part in parts:
            if part == 1 and bh0 > 0:
                continue   # the dV launch stores nothing: one launch over every pair
            _dkdv_kernel[(Skp // 64, pairs if part == 1 else n)](   # 64 keys per program, 128-query steps
                s["q8"], s["q8t"], s["sq"], s["k8"], s["sk"], v, do, do8t, sdo, s["lse2"], delta, dk, dv,
                ds8, sds, rs, *v.stride(), *do.stride(), *dk.stride(), H, Sq, Skv, Sqp, Skp, qk, float(scale),
                0 if part == 1 else bh0, D=D, BM=128, BN=64, PART=part, STORE_DS=stored and part != 1,
                **_part_config(cfg["dkdv"], part))
        if stored:
            _dq_stored_kernel[(Sqp // 128, n)](
                ds8, sds, rs, s["k8t"], s["sk"], s["kmean"], dq, *dq.stride(), H, Sq, Skv, Sqp, Skp,
                float(scale), bh0, D=D, BM=128, BN=64, CORRECTION=smoothing_correction, **dq_cfg)
    if not stored:
        _dq_kernel[(Sqp // 128, B * H)](    # 128 queries per program, 64-key steps: one dS block per step
            s["q8"], s["sq"], s["k8"], s["k8t"], s["sk"], s["kmean"], v, do, s["lse2"], delta, dq,
            *v.stride(), *do.stride(), *dq.stride(), H, Sq, Skv, Sqp, Skp, qk, float(scale),
            D=D, BM=128, BN=64, CORRECTION=smoothing_correction, **dq_cfg)
    return dq, dk, dv


def choose_backward_schedule(v, do, schedule: str | None) -> str:
    """The backward's schedule (:func:`_choose`, :data:`AUTO_SCHEDULE`): Gluon where
    :func:`.gluon_sagebwd.gluon_sagebwd_unsupported` finds nothing against it."""
    def why_not():
        from .gluon_sagebwd import gluon_sagebwd_unsupported  # noqa: PLC0415

        return gluon_sagebwd_unsupported(v, do)

    return _choose(schedule, AUTO_SCHEDULE, why_not, "backward")


class SageBwdAttention(torch.autograd.Function):
    """Saved for the backward: Q, K (INT8 in both layouts, scales, k̄), V (input dtype, for dP), the
    float32 O and the row log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, config=None, training: bool = True):
        o, state = forward(q, k, v, scale, training=training, config=(config or {}).get("fwd"))
        if not training:
            return o
        ctx.state = state
        ctx.save_for_backward(q, k, v, o)
        ctx.scale, ctx.config = scale, config
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o32 = ctx.saved_tensors
        cfg = {key: val for key, val in (ctx.config or {}).items() if key != "fwd"}
        dq, dk, dv = backward(q, k, v, o32, do, ctx.state, ctx.scale, config=cfg)
        ctx.state = None
        return dq, dk, dv, None, None, None


def sagebwd_unsupported(q, k, v) -> str | None:
    """None when :func:`sagebwd_attention` can run these inputs, else why not."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            return f"{name} must be a (batch, seq, heads, head_dim) tensor"
        if x.dtype not in (torch.bfloat16, torch.float16):
            return f"{name} is {x.dtype}; the kernels take bfloat16 or float16"
        if x.device.type != "cuda" and not (INTERPRET.value and x.device.type == "cpu"):
            return f"{name} is on {x.device.type}; the kernels need CUDA tensors (or TRITON_INTERPRET=1)"
    if not (q.dtype == k.dtype == v.dtype):
        return "q, k, v must share one dtype"
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3] or q.shape[2] != k.shape[2]:
        return f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if not (q.shape[3] == k.shape[3] == v.shape[3]) or q.shape[3] not in (64, 128):
        return f"head_dim must be 64 or 128 and equal for q, k, v, got {q.shape[3]}, {k.shape[3]}, {v.shape[3]}"
    if min(q.shape) == 0 or min(k.shape) == 0:
        return "empty input"
    return None


def sagebwd_attention(q, k, v, softmax_scale: float | None = None, *, config: dict | None = None):
    """``sagebwd`` attention on the Triton or Gluon kernels: (B, S, H, D) bfloat16/float16 in, the same out,
    differentiable. ``config``: ``{"fwd": {...}, ...}``, the forward's config (:func:`forward`) and
    the backward's keys (:func:`backward`); the block sizes are part of the definition."""
    why = sagebwd_unsupported(q, k, v)
    if why is not None:
        raise ValueError(f"attnqat.kernels.sagebwd_attention: {why}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return SageBwdAttention.apply(q, k, v, scale, config, training)
