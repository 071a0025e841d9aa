"""The ``sagebwd`` backward hand-scheduled in Gluon for Hopper (issue 33): INT8 wgmma, TMA rings fed
by a producer warp, two consumer warpgroups a CTA.

The same quantities as :mod:`.sagebwd`'s Triton kernels, on the same tiles (docs/numerics.md), in
three launches (docs/benchmarks.md, "The Gluon backward"):

* **dV launch** (``PART`` 1 of :func:`gluon_kv_kernel`): one CTA owns 128 keys of one (batch, head)
  (INT8 K loaded once); two consumer warpgroups own 64 keys each and walk the 128-query steps, whose
  INT8 Q and dOᵀ tiles a producer warp loads through a ``STAGES``-deep ring. A step works on Sᵀ =
  K·Qᵀ (keys along the rows, so P's per-key scale over the step's queries is a row maximum), Pᵀ =
  exp2(Sᵀ·c − LSE₂), P's codes kept in registers as the A operand of dV += (P̃ᵀ·dO₈)·(s_P ⊗ s_dO)
  (:func:`_a_operand`: the launch reads a copy of dOᵀ₈ with its queries permuted within each 16,
  :func:`wgmma_order`, so that the accumulator's registers are the operand's as they are; no shared
  tile, fence or barrier).
* **dK launch** (``PART`` 2): the same CTA shape (also BF16 V; the ring holds INT8 Q, BF16 dO, INT8
  Qᵀ) on S = Q·Kᵀ with the queries along the rows (LSE₂ and D are then 4 registers a thread, not 32),
  dP = dO·Vᵀ in BF16, dS = P ∘ (dP − D), one code block of 128 queries × 64 keys written transposed
  for dK += (dS̃ᵀ·Q₈)·s_dS·s_Q. ``STORE`` (the default): the codes also go, as they are, to global
  memory by TMA, with each block's scale and row sums, for the dQ launch.
* **dQ launch** from them (:func:`gluon_dqs_kernel`): Σ_j s_dS·s_K (dS̃_j·K₈_j) + rowsum(dS) ⊗ k̄, two
  warpgroups of 64 queries. The recomputing dQ launch (:func:`gluon_dq_kernel`, ``"dq": {"stored":
  False}``: no memory for the codes) holds 128 queries in one 8-warp consumer, so that a step's dS
  block is reduced inside one partition, and recomputes S, P, dP and dS.

Two rules of the schedules, both read from the sm_90 machine code (:func:`.sass.gluon_sagebwd_facts`):
a wgmma issued in one loop iteration and read in the next while another is in flight makes ptxas
serialize every wgmma of the kernel, so each launch issues and retires its products within an
iteration; and a warpgroup's int32 product of [64 keys, D] is scaled into its float32 accumulator
every step (each step has its own scales), so a dK step holds the accumulator, S and dP (64
registers a thread each at D = 128) and waits for its product at once — with the product in flight
too, or both accumulators in one launch, it would spill.

Measured on an H200 (Wan 1.3B 480p, 2026-11-28, each launch alone, two rounds in one process,
outputs bit for bit the same; docs/benchmarks.md): P's codes in registers, dV 9.65 / 9.64 against
10.12 / 10.11 ms through the shared tile; int32 → float32 by the conversion instruction (I2FP on
sm_90: one ALU instruction, exact below 2^24) instead of :func:`_i2f`'s magic add (two) — for S in
the dV and dK launches and for the dK and stored-dS dQ folds: dV 8.78 / 8.72 against 9.58 / 9.67
ms, dK storing dS 18.15 / 18.48 against 18.81 / 18.90, dQ 5.52 / 5.80 against 6.06 / 6.29; the dV
fold by I2FP was slower (9.19 / 9.12 ms with S by I2FP), so it keeps the magic add.
"""

from __future__ import annotations

import triton

from . import gluon_bwd
from .gluon_fwd import (
    LOG2E,
    TensorDescriptor,
    _batch_head,
    _thread_barrier,
    _tma_async_load,
    _tma_load,
    fence_async_shared,
    gl,
    gluon,
    gluon_unavailable,
    mbarrier,
    tma,
    tma_descriptor,
    warpgroup_mma,
    warpgroup_mma_wait,
)

if tma is not None:   # triton ≥ 3.7 names it async_store
    _tma_async_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

KEYS_PER_CTA = 128     # dK/dV launches: two consumer warpgroups of 64 keys (one K/V scale block)
QUERY_STEP = 128       # dK/dV launches: queries per step (the dS and dO code blocks)
QUERIES_PER_CTA = 128  # dQ launches: one 8-warp consumer (recomputing), two of 64 queries (stored dS)
KEY_STEP = 64          # dQ launches: keys per step (the dS code block)
#: default launches: ring depth; registers of the second consumer and of the producer warp; the
#: launch's register cap ``MAXNREG`` (Gluon rounds the 9 warps up to 12, and 12 warps × 168 fill the
#: 64 K register file: a larger cap cannot launch — "out of resource: threads" on the H200 — while
#: the partitions move their own counts with setmaxnreg). dQ: ``stored`` (from the dK launch's
#: codes; its ring depth ``STORED_STAGES``, ``chunk_bytes`` over :data:`DS_CHUNK_BYTES`) or the
#: recomputing launch (ring depth ``STAGES``); dV: ``side_stream`` (:func:`gluon_backward`). H200, Wan
#: 1.3B 480p, 2026-11-28: dK 1, stored dQ 2 or 6, recomputing dQ 2 were within 0.3 ms or slower;
#: dV 2 stages, once its P codes stayed in registers, 8.60 against 8.92 ms for 3, 8.70 for 4
#: (docs/benchmarks.md).
DV_CONFIG = dict(STAGES=2, CONSUMER_REGS=240, LOADER_REGS=24, MAXNREG=168, side_stream=True)
DK_CONFIG = dict(STAGES=2, CONSUMER_REGS=240, LOADER_REGS=24, MAXNREG=168)
DQ_CONFIG = dict(stored=True, STORED_STAGES=4, STAGES=4, LOADER_REGS=24, MAXNREG=168)
HEAD_DIMS = (64, 128)


if gluon is not None:
    _ring_barriers = gluon_bwd._ring_barriers   # the once / ready / empty mbarriers of a backward kernel
    _MAGIC_I: gl.constexpr = gl.constexpr(0x4B400000)   # the bits of 1.5·2^23
    _MAGIC_F: gl.constexpr = gl.constexpr(12582912.0)   # 1.5·2^23

    @gluon.jit
    def _i2f(x):
        """int32 → float32, exact for |x| < 2^22 (:func:`.sagebwd._i2f`)."""
        return (x + _MAGIC_I).to(gl.float32, bitcast=True) - _MAGIC_F

    @gluon.jit
    def _f2i8(x):
        """float32 with |x| ≤ 127.5 → int8, nearest, ties to even (:func:`.sagebwd._f2i8`)."""
        return (x + _MAGIC_F).to(gl.int32, bitcast=True).to(gl.int8)

    _KC: gl.constexpr = gl.constexpr(KEYS_PER_CTA)
    _QS: gl.constexpr = gl.constexpr(QUERY_STEP)
    _QC: gl.constexpr = gl.constexpr(QUERIES_PER_CTA)
    _KS: gl.constexpr = gl.constexpr(KEY_STEP)

    @gluon.constexpr_function
    def _acc_layout(warps, n, k=32):
        """The accumulator layout of an m64·n·k wgmma over ``warps`` warps (4: one warpgroup's [64,
        n]; 8: two warpgroups' [128, n]); k = 32 for INT8 operands, 16 for BF16 (the same registers:
        converting between the two moves nothing)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, n, k])

    @gluon.jit
    def _codes_scale(x):
        """Codes of one block of ``x`` with one scale amax/127 (the Triton kernels' arithmetic):
        returns (codes int8, amax/127)."""
        amax = gl.max(gl.max(gl.abs(x), 1), 0)
        inv = gl.where(amax > 0, 127.0 / gl.maximum(amax, 1e-30), 0.0)
        return _f2i8(x * inv), amax / 127.0

    @gluon.jit
    def _a_operand(codes, N: gl.constexpr):
        """INT8 ``codes`` [64, K] in an m64 wgmma accumulator's register layout, as the register A
        operand of an INT8 wgmma with a [64, N] result, nothing moved between threads: column
        :func:`wgmma_order` (k) read as contraction index k, so the B operand's rows must be
        stored in that order (:func:`wgmma_ordered`). Instead of a shared tile, its fence and
        barrier."""
        M: gl.constexpr = codes.shape[0]
        K: gl.constexpr = codes.shape[1]
        x = codes.reshape([M, K // 16, 2, 2, 2, 2]).permute((0, 1, 3, 4, 2, 5)).reshape([M, K])
        return gl.convert_layout(x, gl.DotOperandLayout(0, _acc_layout(4, N), 4))

    @gluon.jit
    def _store_codes(codes, buf):
        """Codes into this partition's shared tile, visible to the wgmma that reads them next."""
        buf.store(codes)
        fence_async_shared()
        _thread_barrier()

    # ------------------------------------------------------------------------------------------
    # dV and dK launches
    # ------------------------------------------------------------------------------------------

    @gluon.jit
    def _kv_issue_s(k_w, q_tile, zero, PART: gl.constexpr):
        """dV: Sᵀ = K_w·Q_iᵀ [64 keys, 128 queries]; dK: S = Q_i·K_wᵀ [128 queries, 64 keys]."""
        if PART == 1:
            return warpgroup_mma(k_w, q_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
        else:
            return warpgroup_mma(q_tile, k_w.permute((1, 0)), zero, use_acc=False, is_async=True)

    @gluon.jit
    def _kv_stats(i, LSE2, DELTA, SQ, SDO, s_layout: gl.constexpr, PART: gl.constexpr):
        """Step i's per-query LSE₂ (and dK: D) along S's query axis, and its Q and dO scales: loaded
        ahead of the products that need them (a global load's latency is not hidden otherwise)."""
        if PART == 1:
            lse = gl.load(LSE2 + i * _QS + gl.arange(0, _QS, layout=gl.SliceLayout(0, s_layout)))
            di = lse   # unused
        else:
            offs = i * _QS + gl.arange(0, _QS, layout=gl.SliceLayout(1, s_layout))
            lse = gl.load(LSE2 + offs)
            di = gl.load(DELTA + offs)
        return lse, di, gl.load(SQ + i), gl.load(SDO + i)

    @gluon.jit
    def _opaque(x):
        """``x`` (int32), copied by inline asm that the compiler cannot hoist out of a loop."""
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _kv_scores(s, keys_ok, key_lim, ragged, c, lse, s_layout: gl.constexpr, PART: gl.constexpr):
        """P of a step from the int32 scores, exp2(S·c − LSE₂), keys past Skv out (padded queries have
        LSE₂ = +inf: P = 0). dV: transposed (keys along the rows); dK: queries along the rows, the
        mask (the same as ``keys_ok``: key n0 + 64·WG + j < Skv ⇔ j < ``key_lim``) made here in the
        ragged branch, not hoisted: held across the loop, its 16 flags a thread took registers that
        the dK launches spilled for (storing dS: 109 spill instructions against 24; not: 8 against 4,
        compiled by triton 3.6, the GPU machine's; H200: the storing launch 22.5 → 18.7 ms). Triton
        3.9 compiles the same source with more spills (47 and 143 against 15 and 70): measure again
        when the GPU machine's Triton moves."""
        a = s.to(gl.float32)   # I2FP, exact: the module docstring
        if PART == 1:
            if ragged:
                a = gl.where(keys_ok[:, None], a, float("-inf"))
            return gl.exp2(a * c - lse[None, :])
        else:
            if ragged:
                keys_ok = gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s_layout)) < _opaque(key_lim)
                a = gl.where(keys_ok[None, :], a, float("-inf"))
            return gl.exp2(a * c - lse[:, None])

    @gluon.jit
    def _kv_codes(p, dp_tok, kv_bar, buf, i, di, sq, sdo, ds_desc, ds_out, ds_row0, ds_col, RS, SDS, n_kb,
                  s_layout: gl.constexpr, acc_row: gl.constexpr, PART: gl.constexpr, STORE: gl.constexpr,
                  D: gl.constexpr):
        """A step's codes as its product's A operand, and the scale the product takes: dV — P per key
        over the step's queries, in registers (:func:`_a_operand`), scale s_P·s_dO per key; dK —
        waits for dP, dS = P ∘ (dP − D), one block, scale s_dS·s_Q, into ``buf`` ([64 keys, 128
        queries]) transposed (STORE: and as they are, [queries, keys], for the dQ launch: staged in
        ``ds_out`` and stored by TMA at rows ``ds_row0`` + 128·i, column ``ds_col``, with the block's
        row sums and scale, :func:`_store_sums`)."""
        if PART == 1:
            pmax = gl.max(p, 1)
            pinv = gl.where(pmax > 0, 127.0 / gl.maximum(pmax, 1e-30), 0.0)
            scale = gl.convert_layout((pmax / 127.0) * sdo, acc_row)
            return scale, _a_operand(_f2i8(p * pinv[:, None]), D)
        else:
            mbarrier.wait(kv_bar, 0)   # long passed: a new basic block, so ptxas keeps the wait for dP here
            dp = gl.convert_layout(warpgroup_mma_wait(num_outstanding=0, deps=[dp_tok]), s_layout)
            ds = p * (dp - di[:, None])
            if STORE:
                row_sums = gl.sum(ds, 1)
            else:
                row_sums = di   # unused
            codes, sds = _codes_scale(ds)
            if STORE:   # staged as they are, once the previous step's have left ds_out
                tma.store_wait(0)
                _thread_barrier()
                ds_out.store(codes)
                _store_sums(row_sums, sds, i, RS, SDS, n_kb, s_layout)
            _store_codes(gl.permute(codes, (1, 0)), buf)   # (its fence and barrier cover ds_out too)
            if STORE:
                _tma_async_store(ds_desc, [ds_row0 + i * _QS, ds_col], ds_out)
            return sds * sq, buf

    @gluon.jit
    def _store_sums(row_sums, sds, i, RS, SDS, n_kb, s_layout: gl.constexpr):
        """The row sums of step i's dS block (the smoothing correction's: RS, this key block's row of
        (pairs, Skp/64, Sqp)) and its scale (SDS, this key block's column of (pairs, Sqp/128,
        Skp/64), ``n_kb`` = Skp/64 apart)."""
        rows = i * _QS + gl.arange(0, _QS, layout=gl.SliceLayout(1, s_layout))
        gl.store(RS + rows, row_sums)
        gl.store(SDS + i * n_kb, sds)

    @gluon.jit
    def _kv_fold(acc, prod, scale, PART: gl.constexpr):
        """The step's int32 product scaled into the accumulator: dV by the magic add, dK by I2FP (each
        the faster on an H200: the module docstring)."""
        if PART == 1:
            return acc + _i2f(prod) * scale[:, None]
        else:
            return acc + prod.to(gl.float32) * scale

    @gluon.jit
    def _kv_consumer(k_smem, v_smem, q_ring, b_ring, c_ring, op_smem, kv_bar, ready, empty,
                     OUT, sob, sos, soh, SQ, SDO, LSE2, DELTA, sk, b, h, n0, Skv, n_steps, qk, out_scale,
                     ds_desc, ds_smem, RS, SDS, pair, Sqp, Skp,
                     WG: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, PART: gl.constexpr,
                     STORE: gl.constexpr):
        """Consumer warpgroup WG: dV (PART 1) or dK (PART 2) of keys [n0 + 64·WG, n0 + 64·WG + 64).
        The dV launch works on Sᵀ (its per-key P scales are row maxima); the dK launch on S with the
        queries along the rows (its per-query LSE₂ and D are then 4 registers a thread, not 32) and
        stores dS's codes transposed."""
        HK: gl.constexpr = _KC // 2
        if PART == 1:
            s_layout: gl.constexpr = _acc_layout(4, _QS)        # Sᵀ [64 keys, 128 queries]
            dp_layout: gl.constexpr = s_layout
            s_shape: gl.constexpr = [HK, _QS]
            key_slice: gl.constexpr = 1
        else:
            s_layout: gl.constexpr = _acc_layout(4, HK)         # S [128 queries, 64 keys]
            dp_layout: gl.constexpr = _acc_layout(4, HK, 16)
            s_shape: gl.constexpr = [_QS, HK]
            key_slice: gl.constexpr = 0
        acc_layout: gl.constexpr = _acc_layout(4, D)             # [64 keys, D]
        acc_row: gl.constexpr = gl.SliceLayout(1, acc_layout)
        k_w = k_smem.slice(WG * HK, HK)
        v_w = v_smem.slice(WG * HK, HK)
        buf = op_smem.index(WG)
        keys_ok = (n0 + WG * HK + gl.arange(0, HK, layout=gl.SliceLayout(key_slice, s_layout))) < Skv   # dV
        key_lim = Skv - (n0 + WG * HK)   # dK: its keys j < key_lim are below Skv (:func:`_kv_scores`)
        ragged = n0 + WG * HK + HK > Skv
        zero_s = gl.zeros(s_shape, gl.int32, layout=s_layout)     # ignored (use_acc=False)
        zero_dp = gl.zeros(s_shape, gl.float32, layout=dp_layout)
        zero_prod = gl.zeros([HK, D], gl.int32, layout=acc_layout)
        # STORE: where this warpgroup's dS goes (codes, row sums, scales of key block kb)
        kb = (n0 + WG * HK) // HK
        n_kb = Skp // HK
        ds_out = ds_smem.index(WG)
        ds_row0 = pair * Sqp
        ds_col = n0 + WG * HK
        RS = RS + (pair.to(gl.int64) * n_kb + kb) * Sqp
        SDS = SDS + pair.to(gl.int64) * (Sqp // _QS) * n_kb + kb
        mbarrier.wait(kv_bar, 0)

        # step i: S_i (and dP_i) issued; the exponentials; the codes; product_i issued and waited for at
        # once (the accumulator, S and dP in flight besides a product would not fit the registers:
        # the module's docstring), the next step's statistics loaded meanwhile
        acc = gl.zeros([HK, D], gl.float32, layout=acc_layout)
        lse, di, sq, sdo = _kv_stats(0, LSE2, DELTA, SQ, SDO, s_layout, PART)
        for i in range(n_steps):
            stage = i % STAGES
            mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
            s_tok = _kv_issue_s(k_w, q_ring.index(stage), zero_s, PART)
            if PART == 2:
                dp_tok = warpgroup_mma(b_ring.index(stage), v_w.permute((1, 0)), zero_dp, use_acc=False,
                                       is_async=True)
                s = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])
            else:
                s = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
                dp_tok = s_tok   # unused
            p = _kv_scores(s, keys_ok, key_lim, ragged, sq * sk * qk, lse, s_layout, PART)
            scale, a = _kv_codes(p, dp_tok, kv_bar, buf, i, di, sq, sdo, ds_desc, ds_out, ds_row0, ds_col, RS, SDS,
                                 n_kb, s_layout, acc_row, PART, STORE, D)
            prod_tok = _kv_issue_prod(a, b_ring, c_ring, stage, zero_prod, PART)
            # the next step's statistics, on their way while this step's product runs
            lse, di, sq, sdo = _kv_stats(gl.minimum(i + 1, n_steps - 1), LSE2, DELTA, SQ, SDO, s_layout, PART)
            prod = warpgroup_mma_wait(num_outstanding=0, deps=[prod_tok])
            acc = _kv_fold(acc, prod, scale, PART)
            mbarrier.arrive(empty.index(stage), count=1)
        if STORE:
            tma.store_wait(0)   # the last codes have left shared memory
        offs_n = n0 + WG * HK + gl.arange(0, HK, layout=acc_row)
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
        gl.store(OUT + b.to(gl.int64) * sob + h.to(gl.int64) * soh + offs_n[:, None] * sos + offs_d[None, :],
                 (acc * out_scale).to(OUT.dtype.element_ty), mask=(offs_n < Skv)[:, None])

    @gluon.jit
    def _kv_issue_prod(a, b_ring, c_ring, stage, zero, PART: gl.constexpr):
        """The step's INT8 product from its codes ``a`` (:func:`_kv_codes`): dV — P̃ᵀ·dO₈ (dOᵀ₈ in the b
        ring, in :func:`wgmma_order`); dK — dS̃ᵀ·Q₈ (Qᵀ₈ in the c ring)."""
        if PART == 1:
            return warpgroup_mma(a, b_ring.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
        else:
            return warpgroup_mma(a, c_ring.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)

    @gluon.jit
    def _kv_loader(k_desc, v_desc, k_smem, v_smem, kv_bar, q_desc, b_desc, c_desc, q_ring, b_ring, c_ring,
                   ready, empty, b, h, bh, n0, Skp, Sqp, n_steps,
                   D: gl.constexpr, STAGES: gl.constexpr, PART: gl.constexpr):
        """The producer warp: the CTA's INT8 K (and for dK its BF16 V) once, then per 128-query step
        INT8 Q and (dV) INT8 dOᵀ or (dK) BF16 dO and INT8 Qᵀ through the ring."""
        if PART == 2:
            mbarrier.expect(kv_bar, k_desc.block_type.nbytes + 2 * k_desc.block_type.nbytes)
            _tma_async_load(k_desc, [bh * Skp + n0, 0], kv_bar, k_smem)
            _tma_load(v_desc, [b, n0, h, 0], kv_bar, v_smem)
        else:
            mbarrier.expect(kv_bar, k_desc.block_type.nbytes)
            _tma_async_load(k_desc, [bh * Skp + n0, 0], kv_bar, k_smem)
        for i in range(n_steps):
            stage = i % STAGES
            mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)   # a fresh barrier passes phase 1
            bar = ready.index(stage)
            if PART == 2:
                mbarrier.expect(bar, 4 * q_desc.block_type.nbytes)   # Q₈ + Qᵀ₈ + BF16 dO (twice the bytes)
                _tma_async_load(q_desc, [bh * Sqp + i * _QS, 0], bar, q_ring.index(stage))
                _tma_load(b_desc, [b, i * _QS, h, 0], bar, b_ring.index(stage))
                _tma_async_load(c_desc, [bh * D, i * _QS], bar, c_ring.index(stage))
            else:
                mbarrier.expect(bar, 2 * q_desc.block_type.nbytes)
                _tma_async_load(q_desc, [bh * Sqp + i * _QS, 0], bar, q_ring.index(stage))
                _tma_async_load(b_desc, [bh * D, i * _QS], bar, b_ring.index(stage))

    @gluon.jit
    def gluon_kv_kernel(k_desc, v_desc, q_desc, b_desc, c_desc, OUT, sob, sos, soh, SQ, SK, SDO, LSE2, DELTA,
                        ds_desc, RS, SDS, H, Skv, Sqp, Skp, qk, out_scale, BH0,
                        D: gl.constexpr, STAGES: gl.constexpr, PART: gl.constexpr, STORE: gl.constexpr,
                        CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
        """Grid (Skp/128, B·H), ``num_warps=4`` (+ 4 + 1 worker warps). PART 1: dV into OUT; 2: dK
        (times ``out_scale`` = the softmax scale). Descriptors: K₈ (B·H·Skp, D) box [128, D]; V
        (B, Skv, H, D) BF16 box [1, 128, 1, D] (dK; else unused); Q₈ (B·H·Sqp, D) box [128, D];
        ``b_desc``: dV — dOᵀ₈ (B·H·D, Sqp) box [D, 128], dK — dO (B, Sq, H, D) BF16 box [1, 128, 1,
        D]; ``c_desc``: dK — Qᵀ₈ (B·H·D, Sqp) box [D, 128]. SQ, SDO (B, H, Sqp/128), SK (B, H,
        Skp/128), LSE2, DELTA (B, H, Sqp) float32."""
        gl.static_assert(D == 64 or D == 128, "head_dim must be 64 or 128")
        pair = gl.program_id(1)
        bh = BH0 + pair
        b, h = _batch_head(bh, H)
        n0 = gl.program_id(0) * _KC
        n_steps = Sqp // _QS
        rows8: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_KC, D], gl.int8)
        cols8: gl.constexpr = gl.NVMMASharedLayout.get_default_for([D, _QS], gl.int8)
        rows16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_KC, D], gl.bfloat16)
        op_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_KC // 2, _QS], gl.int8)
        k_smem = gl.allocate_shared_memory(gl.int8, [_KC, D], rows8)
        q_ring = gl.allocate_shared_memory(gl.int8, [STAGES, _QS, D], rows8)
        if PART == 2:
            v_smem = gl.allocate_shared_memory(gl.bfloat16, [_KC, D], rows16)
            b_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, _QS, D], rows16)
            c_ring = gl.allocate_shared_memory(gl.int8, [STAGES, D, _QS], cols8)
        else:
            v_smem = k_smem   # unused
            b_ring = gl.allocate_shared_memory(gl.int8, [STAGES, D, _QS], cols8)
            c_ring = b_ring   # unused
        if PART == 2:   # dS's codes, transposed (the dV launch's P codes stay in registers)
            op_smem = gl.allocate_shared_memory(gl.int8, [2, _KC // 2, _QS], op_layout)
        else:
            op_smem = q_ring   # unused
        if STORE:
            ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_QS, _KC // 2], gl.int8)
            ds_smem = gl.allocate_shared_memory(gl.int8, [2, _QS, _KC // 2], ds_layout)
        else:
            ds_smem = op_smem   # unused
        kv_bar, ready, empty = _ring_barriers(STAGES, 2)
        sk = gl.load(SK + bh.to(gl.int64) * (Skp // _KC) + gl.program_id(0))
        row0 = bh.to(gl.int64) * Sqp
        SQ = SQ + bh.to(gl.int64) * (Sqp // _QS)
        SDO = SDO + bh.to(gl.int64) * (Sqp // _QS)
        gl.warp_specialize([
            (_kv_consumer, (k_smem, v_smem, q_ring, b_ring, c_ring, op_smem, kv_bar, ready, empty,
                            OUT, sob, sos, soh, SQ, SDO, LSE2 + row0, DELTA + row0, sk, b, h, n0, Skv, n_steps,
                            qk, out_scale, ds_desc, ds_smem, RS, SDS, pair, Sqp, Skp, 0, D, STAGES, PART, STORE)),
            (_kv_consumer, (k_smem, v_smem, q_ring, b_ring, c_ring, op_smem, kv_bar, ready, empty,
                            OUT, sob, sos, soh, SQ, SDO, LSE2 + row0, DELTA + row0, sk, b, h, n0, Skv, n_steps,
                            qk, out_scale, ds_desc, ds_smem, RS, SDS, pair, Sqp, Skp, 1, D, STAGES, PART, STORE)),
            (_kv_loader, (k_desc, v_desc, k_smem, v_smem, kv_bar, q_desc, b_desc, c_desc, q_ring, b_ring, c_ring,
                          ready, empty, b, h, bh, n0, Skp, Sqp, n_steps, D, STAGES, PART)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])

    # ------------------------------------------------------------------------------------------
    # dQ launch
    # ------------------------------------------------------------------------------------------

    @gluon.jit
    def _dq_consumer(q_smem, do_smem, k_ring, v_ring, kt_ring, ds_smem, qdo_bar, ready, empty,
                     DQ, sob, sos, soh, SK, KMEAN, LSE2, DELTA, sq, b, h, m0, Sq, Skv, qk, sm_scale,
                     D: gl.constexpr, STAGES: gl.constexpr, CORRECTION: gl.constexpr):
        """The 8-warp consumer: dQ of queries [m0, m0 + 128)."""
        s_layout: gl.constexpr = _acc_layout(8, _KS)      # [128 queries, 64 keys]
        acc_layout: gl.constexpr = _acc_layout(8, D)           # [128 queries, D]
        row: gl.constexpr = gl.SliceLayout(1, s_layout)
        rows = m0 + gl.arange(0, _QC, layout=row)
        lse2 = gl.load(LSE2 + rows)       # padded rows: +inf (P = 0)
        di = gl.load(DELTA + rows)
        zero_s = gl.zeros([_QC, _KS], gl.int32, layout=s_layout)
        zero_dp = gl.zeros([_QC, _KS], gl.float32, layout=_acc_layout(8, _KS, 16))
        zero_prod = gl.zeros([_QC, D], gl.int32, layout=acc_layout)
        rs = gl.zeros([_QC], gl.float32, layout=row)
        n_steps = gl.cdiv(Skv, _KS)
        c0 = sq * qk
        mbarrier.wait(qdo_bar, 0)

        # step 0: its codes in ``ds_smem``; step j issues product_{j-1} ahead of S_j and dP_j
        mbarrier.wait(ready.index(0), 0)
        s_tok = warpgroup_mma(q_smem, k_ring.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(do_smem, v_ring.index(0).permute((1, 0)), zero_dp, use_acc=False, is_async=True)
        sk = gl.load(SK)
        s = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])
        ds = _dq_ds(s, dp_tok, qdo_bar, 0, Skv, c0 * sk, lse2, di, s_layout)
        rs += gl.sum(ds, 1)
        codes, sds = _codes_scale(ds)
        _store_codes(codes, ds_smem)
        scale = sds * sk
        acc = gl.zeros([_QC, D], gl.float32, layout=acc_layout)

        for j in range(1, n_steps):
            stage = j % STAGES
            prev = (j - 1) % STAGES
            mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
            prod_tok = warpgroup_mma(ds_smem, kt_ring.index(prev).permute((1, 0)), zero_prod, use_acc=False,
                                     is_async=True)
            s_tok = warpgroup_mma(q_smem, k_ring.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(do_smem, v_ring.index(stage).permute((1, 0)), zero_dp, use_acc=False,
                                   is_async=True)
            sk = gl.load(SK + j // 2)
            prod = warpgroup_mma_wait(num_outstanding=2, deps=[prod_tok])   # folded while S_j, dP_j run
            acc = acc + _i2f(prod) * scale
            mbarrier.arrive(empty.index(prev), count=1)
            s = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])
            ds = _dq_ds(s, dp_tok, qdo_bar, j * _KS, Skv, c0 * sk, lse2, di, s_layout)
            rs += gl.sum(ds, 1)
            codes, sds = _codes_scale(ds)
            _store_codes(codes, ds_smem)
            scale = sds * sk

        last = (n_steps - 1) % STAGES
        prod_tok = warpgroup_mma(ds_smem, kt_ring.index(last).permute((1, 0)), zero_prod, use_acc=False, is_async=True)
        prod = warpgroup_mma_wait(num_outstanding=0, deps=[prod_tok])
        acc = acc + _i2f(prod) * scale
        mbarrier.arrive(empty.index(last), count=1)
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
        if CORRECTION:
            kmean = gl.load(KMEAN + offs_d)
            acc = acc + gl.convert_layout(rs, gl.SliceLayout(1, acc_layout))[:, None] * kmean[None, :]
        offs_m = m0 + gl.arange(0, _QC, layout=gl.SliceLayout(1, acc_layout))
        gl.store(DQ + b.to(gl.int64) * sob + h.to(gl.int64) * soh + offs_m[:, None] * sos + offs_d[None, :],
                 (acc * sm_scale).to(DQ.dtype.element_ty), mask=(offs_m < Sq)[:, None])

    @gluon.jit
    def _dq_ds(s, dp_tok, qdo_bar, start_n, Skv, c, lse2, di, s_layout: gl.constexpr):
        """dS = P ∘ (dP − D) of one step, P = exp2(S·c − LSE₂), keys past Skv out; the exponentials
        run while dP is on the tensor cores (the wait on ``qdo_bar``, long passed, starts a new
        basic block so that ptxas does not hoist the wait for dP above them: :mod:`.gluon_bwd`)."""
        a = _i2f(s)
        if start_n + _KS > Skv:
            keys = start_n + gl.arange(0, _KS, layout=gl.SliceLayout(0, s_layout))
            a = gl.where((keys < Skv)[None, :], a, float("-inf"))
        p = gl.exp2(a * c - lse2[:, None])
        mbarrier.wait(qdo_bar, 0)
        dp = gl.convert_layout(warpgroup_mma_wait(num_outstanding=0, deps=[dp_tok]), s_layout)
        return p * (dp - di[:, None])

    @gluon.jit
    def _dq_loader(q_desc, do_desc, q_smem, do_smem, qdo_bar, k_desc, v_desc, kt_desc, k_ring, v_ring, kt_ring,
                   ready, empty, b, h, bh, m0, Sqp, Skp, Skv, D: gl.constexpr, STAGES: gl.constexpr):
        """The producer warp: the CTA's INT8 Q and BF16 dO once, then INT8 K_j, BF16 V_j and INT8 K_jᵀ
        per 64-key step through the ring."""
        mbarrier.expect(qdo_bar, 3 * q_desc.block_type.nbytes)
        _tma_async_load(q_desc, [bh * Sqp + m0, 0], qdo_bar, q_smem)
        _tma_load(do_desc, [b, m0, h, 0], qdo_bar, do_smem)
        for j in range(gl.cdiv(Skv, _KS)):
            stage = j % STAGES
            mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, 4 * k_desc.block_type.nbytes)   # K₈ + K₈ᵀ + BF16 V (twice the bytes)
            _tma_async_load(k_desc, [bh * Skp + j * _KS, 0], bar, k_ring.index(stage))
            _tma_load(v_desc, [b, j * _KS, h, 0], bar, v_ring.index(stage))
            _tma_async_load(kt_desc, [bh * D, j * _KS], bar, kt_ring.index(stage))

    @gluon.jit
    def gluon_dq_kernel(q_desc, do_desc, k_desc, v_desc, kt_desc, DQ, sob, sos, soh, SQ, SK, KMEAN, LSE2, DELTA,
                        H, Sq, Skv, Sqp, Skp, qk, sm_scale,
                        D: gl.constexpr, STAGES: gl.constexpr, CORRECTION: gl.constexpr,
                        LOADER_REGS: gl.constexpr):
        """Grid (Sqp/128, B·H), ``num_warps=8`` (+ 1 worker warp). Descriptors: Q₈ (B·H·Sqp, D) box
        [128, D]; dO (B, Sq, H, D) BF16 box [1, 128, 1, D]; K₈ (B·H·Skp, D) box [64, D]; V (B, Skv,
        H, D) BF16 box [1, 64, 1, D]; K₈ᵀ (B·H·D, Skp) box [D, 64]. SQ (B, H, Sqp/128), SK (B, H,
        Skp/128), KMEAN (B, H, D), LSE2, DELTA (B, H, Sqp) float32."""
        gl.static_assert(D == 64 or D == 128, "head_dim must be 64 or 128")
        bh = gl.program_id(1)
        b, h = _batch_head(bh, H)
        m0 = gl.program_id(0) * _QC
        bh64 = bh.to(gl.int64)
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_QC, D], gl.int8)
        do_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_QC, D], gl.bfloat16)
        k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_KS, D], gl.int8)
        v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_KS, D], gl.bfloat16)
        kt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([D, _KS], gl.int8)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_QC, _KS], gl.int8)
        q_smem = gl.allocate_shared_memory(gl.int8, [_QC, D], q_layout)
        do_smem = gl.allocate_shared_memory(gl.bfloat16, [_QC, D], do_layout)
        k_ring = gl.allocate_shared_memory(gl.int8, [STAGES, _KS, D], k_layout)
        v_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, _KS, D], v_layout)
        kt_ring = gl.allocate_shared_memory(gl.int8, [STAGES, D, _KS], kt_layout)
        ds_smem = gl.allocate_shared_memory(gl.int8, [_QC, _KS], ds_layout)
        qdo_bar, ready, empty = _ring_barriers(STAGES, 1)
        sq = gl.load(SQ + bh64 * (Sqp // _QC) + gl.program_id(0))
        gl.warp_specialize([
            (_dq_consumer, (q_smem, do_smem, k_ring, v_ring, kt_ring, ds_smem, qdo_bar, ready, empty,
                            DQ, sob, sos, soh, SK + bh64 * (Skp // 128), KMEAN + bh64 * D, LSE2 + bh64 * Sqp,
                            DELTA + bh64 * Sqp, sq, b, h, m0, Sq, Skv, qk, sm_scale, D, STAGES, CORRECTION)),
            (_dq_loader, (q_desc, do_desc, q_smem, do_smem, qdo_bar, k_desc, v_desc, kt_desc, k_ring, v_ring,
                          kt_ring, ready, empty, b, h, bh, m0, Sqp, Skp, Skv, D, STAGES)),
        ], [1], [LOADER_REGS])


    # ------------------------------------------------------------------------------------------
    # dQ from the stored dS codes
    # ------------------------------------------------------------------------------------------

    @gluon.jit
    def _dqs_consumer(ds_ring, kt_ring, ready, empty, DQ, sob, sos, soh, SDS, SK, RS, KMEAN, b, h, m0, Sq,
                      Sqp, n_steps, sm_scale, WG: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                      CORRECTION: gl.constexpr):
        """Consumer warpgroup WG: dQ of queries [m0 + 64·WG, m0 + 64·WG + 64) = Σ_j s_dS·s_K (dS̃_j·K₈_j)
        (+ rowsum(dS) ⊗ k̄), from the codes, scales and row sums the dK launch stored."""
        HQ: gl.constexpr = _QC // 2
        acc_layout: gl.constexpr = _acc_layout(4, D)           # [64 queries, D]
        row: gl.constexpr = gl.SliceLayout(1, acc_layout)
        rows = m0 + WG * HQ + gl.arange(0, HQ, layout=row)
        zero_prod = gl.zeros([HQ, D], gl.int32, layout=acc_layout)
        acc = gl.zeros([HQ, D], gl.float32, layout=acc_layout)
        rs = gl.zeros([HQ], gl.float32, layout=row)
        # two steps an iteration: the second's product runs while the first's is folded in (both
        # issued and waited for inside the iteration, as ptxas needs to keep them asynchronous); the
        # scales and row sums of the next two steps are loaded ahead
        sc0, sc1, rs0, rs1 = _dqs_stats(0, n_steps, SDS, SK, RS, Sqp, rows)
        for j in range(0, n_steps - 1, 2):
            st0 = j % STAGES
            st1 = (j + 1) % STAGES
            mbarrier.wait(ready.index(st0), (j // STAGES) & 1)
            tok0 = warpgroup_mma(ds_ring.index(st0).slice(WG * HQ, HQ), kt_ring.index(st0).permute((1, 0)),
                                 zero_prod, use_acc=False, is_async=True)
            mbarrier.wait(ready.index(st1), ((j + 1) // STAGES) & 1)
            tok1 = warpgroup_mma(ds_ring.index(st1).slice(WG * HQ, HQ), kt_ring.index(st1).permute((1, 0)),
                                 zero_prod, use_acc=False, is_async=True)
            if CORRECTION:
                rs += rs0
                rs += rs1
            scale0 = sc0
            scale1 = sc1
            sc0, sc1, rs0, rs1 = _dqs_stats(j + 2, n_steps, SDS, SK, RS, Sqp, rows)
            prod = warpgroup_mma_wait(num_outstanding=1, deps=[tok0])
            mbarrier.arrive(empty.index(st0), count=1)
            acc = acc + prod.to(gl.float32) * scale0   # I2FP: the module docstring
            prod = warpgroup_mma_wait(num_outstanding=0, deps=[tok1])
            mbarrier.arrive(empty.index(st1), count=1)
            acc = acc + prod.to(gl.float32) * scale1
        if n_steps % 2 == 1:   # the last step alone
            j = n_steps - 1
            st0 = j % STAGES
            mbarrier.wait(ready.index(st0), (j // STAGES) & 1)
            tok0 = warpgroup_mma(ds_ring.index(st0).slice(WG * HQ, HQ), kt_ring.index(st0).permute((1, 0)),
                                 zero_prod, use_acc=False, is_async=True)
            if CORRECTION:
                rs += rs0
            prod = warpgroup_mma_wait(num_outstanding=0, deps=[tok0])
            mbarrier.arrive(empty.index(st0), count=1)
            acc = acc + prod.to(gl.float32) * sc0
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
        if CORRECTION:
            acc = acc + rs[:, None] * gl.load(KMEAN + offs_d)[None, :]
        gl.store(DQ + b.to(gl.int64) * sob + h.to(gl.int64) * soh + rows[:, None] * sos + offs_d[None, :],
                 (acc * sm_scale).to(DQ.dtype.element_ty), mask=(rows < Sq)[:, None])

    @gluon.jit
    def _dqs_stats(j, n_steps, SDS, SK, RS, Sqp, rows):
        """The scales s_dS·s_K and the row sums of steps j and j + 1 (clamped to the last step)."""
        j0 = gl.minimum(j, n_steps - 1)
        j1 = gl.minimum(j + 1, n_steps - 1)
        return (gl.load(SDS + j0) * gl.load(SK + j0 // 2), gl.load(SDS + j1) * gl.load(SK + j1 // 2),
                gl.load(RS + j0.to(gl.int64) * Sqp + rows), gl.load(RS + j1.to(gl.int64) * Sqp + rows))

    @gluon.jit
    def _dqs_loader(ds_desc, kt_desc, ds_ring, kt_ring, ready, empty, ds_row, kt_row, n_steps,
                    STAGES: gl.constexpr):
        """The producer warp: per 64-key step the CTA's [128, 64] dS codes and K₈ᵀ_j."""
        for j in range(n_steps):
            stage = j % STAGES
            mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, ds_desc.block_type.nbytes + kt_desc.block_type.nbytes)
            _tma_async_load(ds_desc, [ds_row, j * _KS], bar, ds_ring.index(stage))
            _tma_async_load(kt_desc, [kt_row, j * _KS], bar, kt_ring.index(stage))

    @gluon.jit
    def gluon_dqs_kernel(ds_desc, kt_desc, DQ, sob, sos, soh, SDS, SK, RS, KMEAN, H, Sq, Skv, Sqp, Skp, sm_scale, BH0,
                         D: gl.constexpr, STAGES: gl.constexpr, CORRECTION: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
        """Grid (Sqp/128, pairs from BH0 on), ``num_warps=4`` (+ 4 + 1 worker warps). ``ds_desc``: the
        codes (pairs·Sqp, Skp) box [128, 64]; K₈ᵀ (B·H·D, Skp) box [D, 64]; SDS (pairs, Sqp/128,
        Skp/64), RS (pairs, Skp/64, Sqp), SK (B, H, Skp/128), KMEAN (B, H, D) float32."""
        gl.static_assert(D == 64 or D == 128, "head_dim must be 64 or 128")
        pair = gl.program_id(1)
        bh = BH0 + pair
        b, h = _batch_head(bh, H)
        m0 = gl.program_id(0) * _QC
        bh64 = bh.to(gl.int64)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_QC, _KS], gl.int8)
        kt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([D, _KS], gl.int8)
        ds_ring = gl.allocate_shared_memory(gl.int8, [STAGES, _QC, _KS], ds_layout)
        kt_ring = gl.allocate_shared_memory(gl.int8, [STAGES, D, _KS], kt_layout)
        unused, ready, empty = _ring_barriers(STAGES, 2)
        n_steps = gl.cdiv(Skv, _KS)
        n_kb = Skp // _KS
        SDS = SDS + (pair.to(gl.int64) * (Sqp // _QC) + gl.program_id(0)) * n_kb
        RS = RS + pair.to(gl.int64) * n_kb * Sqp
        gl.warp_specialize([
            (_dqs_consumer, (ds_ring, kt_ring, ready, empty, DQ, sob, sos, soh, SDS, SK + bh64 * (Skp // 128), RS,
                             KMEAN + bh64 * D, b, h, m0, Sq, Sqp, n_steps, sm_scale, 0, D, STAGES, CORRECTION)),
            (_dqs_consumer, (ds_ring, kt_ring, ready, empty, DQ, sob, sos, soh, SDS, SK + bh64 * (Skp // 128), RS,
                             KMEAN + bh64 * D, b, h, m0, Sq, Sqp, n_steps, sm_scale, 1, D, STAGES, CORRECTION)),
            (_dqs_loader, (ds_desc, kt_desc, ds_ring, kt_ring, ready, empty, pair * Sqp + m0, bh * D, n_steps,
                           STAGES)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------

def wgmma_order(k):
    """The token at position ``k`` (an int or an integer tensor) of dOᵀ₈ as the dV launch reads it
    (:func:`wgmma_ordered`): within each 16, position bits (k₃ k₂ k₁ k₀) hold token (k₁ k₃ k₂ k₀). An
    INT8 wgmma accumulator holds, per thread, columns {2c, 2c+1, 2c+8, 2c+9} (+16) of each 32, and
    its register A operand contraction indices {4c … 4c+3} (+16): P's codes, computed in the first
    layout, are read as the second with no data moved (:func:`_a_operand`) when dO's rows are in
    this order. The integer product is the same sum."""
    return (k & ~15) | (k & 1) | ((k >> 1) & 6) | ((k << 2) & 8)


def wgmma_ordered(x_t, out=None):
    """A (B, H, D, Sp) transposed INT8 tensor with its token axis in :func:`wgmma_order`, into ``out``
    (a new tensor when None)."""
    B, H, D, Sp = x_t.shape
    out = x_t.new_empty(x_t.shape) if out is None else out
    blocks = (B, H, D, Sp // 16, 2, 2, 2, 2)   # (…, k₃, k₂, k₁, k₀) ← token bits (k₁, k₃, k₂, k₀)
    out.view(blocks).copy_(x_t.view(blocks).permute(0, 1, 2, 3, 5, 6, 4, 7))
    return out


def _int8_descriptor(t2d, box):
    """2-D TMA descriptor of an INT8 operand seen as (rows, columns), box ``box``."""
    layout = gl.NVMMASharedLayout.get_default_for(list(box), gl.int8)
    return TensorDescriptor(t2d, list(t2d.shape), list(t2d.stride()), list(box), layout)


def gluon_sagebwd_unsupported(v, do) -> str | None:
    """None when :func:`gluon_backward` runs on these operands here (the INT8 ones are the
    forward's own), else why not (one sentence)."""
    import torch  # noqa: PLC0415

    for name, t in (("v", v), ("do", do)):
        if t.dim() != 4 or t.dtype != torch.bfloat16 or not t.is_cuda:
            return f"{name} must be a 4-D bfloat16 CUDA tensor, got {t.dtype} {tuple(t.shape)} on {t.device.type}"
    if v.shape[3] not in HEAD_DIMS:
        return f"head_dim {v.shape[3]} is not supported (64 or 128)"
    return gluon_unavailable(v.device)


LAUNCHES = ("dv", "dk", "dq")
#: the most bytes of dS codes one chunk of (batch, head) pairs keeps for the stored-dS dQ (at least
#: one pair's: 1.07 GB at the Wan 1.3B 480p shape, 5.7 GB at 720p)
DS_CHUNK_BYTES = 4 << 30


def gluon_backward(v, do, state, do8t, sdo, delta, dq, dk, dv, *, scale: float, smoothing_correction: bool = True,
                   config: dict | None = None, launches=LAUNCHES) -> None:
    """Writes dQ, dK, dV of :func:`.sagebwd.backward` with the Gluon launches: ``state`` is the
    forward's (INT8 Q, K in both layouts, scales, k̄, LSE₂); ``do8t``, ``sdo``, ``delta`` the dO
    quantization's (the dV launches read a copy of ``do8t`` in :func:`wgmma_order`, made on their
    stream). ``config``: ``{"dv": {...}, "dk": {...}, "dq": {...}}`` over :data:`DV_CONFIG`,
    :data:`DK_CONFIG`, :data:`DQ_CONFIG`; ``"dq": {"stored": True}``: the dK launch also stores dS
    (codes, block scales, row sums; per chunk of pairs, :data:`DS_CHUNK_BYTES` or ``chunk_bytes``)
    and dQ is their product with K (:func:`gluon_dqs_kernel`) instead of a launch that recomputes
    S, P, dP and dS. ``"dv": {"side_stream": True}`` (the default): the dV launches run on a stream
    of their own, a launch per chunk of pairs beside the chunk's dK and dQ launches (the caller's
    stream waits for them before this returns). ``launches``: which of the three to run (the tuning
    bench times them apart; a stored-dS "dq" alone reads whatever the buffers hold: for timing only)."""
    import torch  # noqa: PLC0415

    B, Sq, H, D = dq.shape
    Skv = dk.shape[1]
    Sqp, Skp = state["q8"].shape[2], state["k8"].shape[2]
    cfgs = {name: dict(base) for name, base in (("dv", DV_CONFIG), ("dk", DK_CONFIG), ("dq", DQ_CONFIG))}
    for key, val in (config or {}).items():
        if key not in cfgs:
            raise ValueError(f"unknown Gluon sagebwd launch {key!r} in config (dv, dk, dq)")
        cfgs[key].update(val)
    s = state
    qk = float(scale) * LOG2E
    q8 = _int8_descriptor(s["q8"].view(B * H * Sqp, D), (QUERY_STEP, D))
    k8 = _int8_descriptor(s["k8"].view(B * H * Skp, D), (KEYS_PER_CTA, D))
    q8t = _int8_descriptor(s["q8t"].view(B * H * D, Sqp), (D, QUERY_STEP))
    do8p = torch.empty_like(do8t)   # dOᵀ₈ in wgmma_order for the dV launches, copied on their stream
    do8 = _int8_descriptor(do8p.view(B * H * D, Sqp), (D, QUERY_STEP))
    k8t_step = _int8_descriptor(s["k8t"].view(B * H * D, Skp), (D, KEY_STEP))
    v_desc = tma_descriptor(v, KEYS_PER_CTA)
    do_desc = tma_descriptor(do, QUERY_STEP)
    pairs = B * H
    stored = cfgs["dq"].get("stored", False)

    def kv(part, out, b_desc, c_desc, out_scale, cfg, bh0=0, n=pairs, store=None):
        ds_desc, rs, sds = store if store is not None else (q8, delta, delta)   # placeholders, not read
        gluon_kv_kernel[(Skp // KEYS_PER_CTA, n)](
            k8, v_desc, q8, b_desc, c_desc, out, out.stride(0), out.stride(1), out.stride(2),
            s["sq"], s["sk"], sdo, s["lse2"], delta, ds_desc, rs, sds, H, Skv, Sqp, Skp, qk, out_scale, bh0,
            D=D, STAGES=cfg["STAGES"], PART=part, STORE=store is not None,
            CONSUMER_REGS=cfg["CONSUMER_REGS"], LOADER_REGS=cfg["LOADER_REGS"], num_warps=4,
            maxnreg=cfg["MAXNREG"])

    # ``side_stream``: the dV launches on a stream of their own, one per chunk of pairs beside that
    # chunk's dK and dQ launches, so that each launch's last, partly filled wave of blocks is filled
    # with the other stream's (one block an SM: none of the launches shares an SM with another)
    side = cfgs["dv"].get("side_stream", False) and "dv" in launches and len(launches) > 1
    main = torch.cuda.current_stream(dv.device)
    stream = torch.cuda.Stream(dv.device) if side else main
    if side:
        stream.wait_stream(main)

    def dv_launch(bh0, n):
        if "dv" in launches:
            with torch.cuda.stream(stream):
                if bh0 == 0:
                    wgmma_ordered(do8t, out=do8p)
                kv(1, dv, do8, do8, 1.0, cfgs["dv"], bh0, n)

    try:
        if not (stored and side):   # one dV launch over every pair
            dv_launch(0, pairs)
        if not stored:
            if "dk" in launches:
                kv(2, dk, do_desc, q8t, float(scale), cfgs["dk"])
            if "dq" in launches:
                cfg = cfgs["dq"]
                gluon_dq_kernel[(Sqp // QUERIES_PER_CTA, B * H)](
                    q8, do_desc, _int8_descriptor(s["k8"].view(B * H * Skp, D), (KEY_STEP, D)),
                    tma_descriptor(v, KEY_STEP), k8t_step, dq, dq.stride(0), dq.stride(1), dq.stride(2), s["sq"],
                    s["sk"], s["kmean"], s["lse2"], delta, H, Sq, Skv, Sqp, Skp, qk, float(scale), D=D,
                    STAGES=cfg["STAGES"], CORRECTION=smoothing_correction, LOADER_REGS=cfg["LOADER_REGS"],
                    num_warps=8, maxnreg=cfg["MAXNREG"])
            return
        cfg = cfgs["dq"]
        chunk = max(1, min(pairs, cfg.get("chunk_bytes", DS_CHUNK_BYTES) // (Sqp * Skp)))
        if "dk" not in launches and "dq" not in launches:
            return
        ds8 = torch.empty(chunk, Sqp, Skp, device=dq.device, dtype=torch.int8)
        rs = torch.empty(chunk, Skp // KEY_STEP, Sqp, device=dq.device, dtype=torch.float32)
        sds = torch.empty(chunk, Sqp // QUERY_STEP, Skp // KEY_STEP, device=dq.device, dtype=torch.float32)
        ds_desc = _int8_descriptor(ds8.view(chunk * Sqp, Skp), (QUERIES_PER_CTA, KEY_STEP))
        for bh0 in range(0, pairs, chunk):
            n = min(chunk, pairs - bh0)
            if side:
                dv_launch(bh0, n)
            if "dk" in launches:
                kv(2, dk, do_desc, q8t, float(scale), cfgs["dk"], bh0, n, store=(ds_desc, rs, sds))
            if "dq" in launches:
                gluon_dqs_kernel[(Sqp // QUERIES_PER_CTA, n)](
                    ds_desc, k8t_step, dq, dq.stride(0), dq.stride(1), dq.stride(2), sds, s["sk"], rs, s["kmean"],
                    H, Sq, Skv, Sqp, Skp, float(scale), bh0, D=D, STAGES=cfg["STORED_STAGES"],
                    CORRECTION=smoothing_correction, CONSUMER_REGS=cfgs["dk"]["CONSUMER_REGS"],
                    LOADER_REGS=cfg["LOADER_REGS"], num_warps=4, maxnreg=cfg["MAXNREG"])
    finally:
        if side:
            main.wait_stream(stream)
