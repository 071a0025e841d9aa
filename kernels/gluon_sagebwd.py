"""The ``sagebwd`` backward hand-scheduled in Gluon for Hopper (issue 33): INT8 wgmma, TMA rings fed
by a producer warp, the products kept in flight under the exponentials and the quantizers.

The same quantities as :mod:`.sagebwd`'s Triton kernels, on the same tiles (docs/numerics.md):

* **dV launch** (``PART`` 1) and **dK launch** (``PART`` 2) of :func:`gluon_kv_kernel`: one CTA owns
  128 keys of one (batch, head), loaded once (INT8 K; the dK launch also BF16 V); two consumer
  warpgroups own 64 keys each and walk over the 128-query steps, whose tiles a producer warp loads
  through a ``STAGES``-deep ring (dV: INT8 Q and dOᵀ; dK: INT8 Q, BF16 dO, INT8 Qᵀ). A step works on
  the transposed scores, keys along the rows: Sᵀ = K·Qᵀ (INT8 → int32), Pᵀ = exp2(Sᵀ·c − LSE₂);
  dV: P's codes per key over the 128 queries, dV += (P̃ᵀ·dO₈)·(s_P ⊗ s_dO); dK: dPᵀ = V·dOᵀ in BF16,
  dSᵀ = Pᵀ ∘ (dPᵀ − D), one code block of 64 keys × 128 queries, dK += (dS̃ᵀ·Q₈)·s_dS·s_Q. The codes go
  to this warpgroup's shared tile ([64 keys, 128 queries], queries contiguous: INT8 wgmma wants both
  operands K-major) and the product is issued without waiting for it.
* **dQ launch** (:func:`gluon_dq_kernel`): one CTA owns 128 queries (INT8 Q and BF16 dO, loaded
  once) in one 8-warp consumer, so that a step's dS block — 128 queries × 64 keys, the definition's
  — is reduced inside one partition; a producer warp rings INT8 K_j, BF16 V_j and INT8 K_jᵀ per
  64-key step. S = Q·K_jᵀ, P, dP = dO·V_jᵀ (BF16), dS, its row sums (the smoothing correction),
  codes, dQ += (dS̃·K₈)·s_dS·s_K.

Why two dK/dV launches and not one (the ordering of the products): a warpgroup's int32 product of
[64 keys, D] must be scaled into its float32 accumulator every step (each step has its own scales),
so a step holds the accumulator (64 registers a thread at D = 128), the product (64), Sᵀ (64) and dPᵀ
(64); with both dK and dV accumulators that is 320, more than the 255 a thread can have. Split, the
peak is the accumulator, the previous product and the next S in flight (192), and dPᵀ is issued only
once the previous product has been folded in.

Step i of a consumer (the products of step i−1 still in flight at the loop head, iteration 0
peeled so every path has the same wgmma in flight, which ptxas needs to keep them asynchronous):
issue Sᵀ_i; wait for product_{i−1} (issued before Sᵀ_i: groups retire in order), fold it in,
release ring slot i−1; (dK: issue dPᵀ_i;) wait for Sᵀ_i; exponentials; (dK: wait for dPᵀ_i;) codes
to shared memory, fence, warpgroup barrier; issue product_i.
"""

from __future__ import annotations

import triton

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
    tma_descriptor,
    warpgroup_mma,
    warpgroup_mma_wait,
)

KEYS_PER_CTA = 128     # dK/dV launches: two consumer warpgroups of 64 keys (one K/V scale block)
QUERY_STEP = 128       # dK/dV launches: queries per step (the dS and dO code blocks)
QUERIES_PER_CTA = 128  # dQ launch: one 8-warp consumer
KEY_STEP = 64          # dQ launch: keys per step (the dS code block)
#: default launches: ring depth; registers of the default partition (``MAXNREG``, the launch's cap:
#: 9 warps × 224 fit the 64 K register file), of the second consumer and of the producer warp
DV_CONFIG = dict(STAGES=3, CONSUMER_REGS=240, LOADER_REGS=24, MAXNREG=168)
DK_CONFIG = dict(STAGES=2, CONSUMER_REGS=240, LOADER_REGS=24, MAXNREG=168)
DQ_CONFIG = dict(STAGES=4, LOADER_REGS=24, MAXNREG=168)
HEAD_DIMS = (64, 128)


if gluon is not None:
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
    def _kv_scores(s, i, keys_ok, ragged, c, LSE2, s_layout: gl.constexpr, PART: gl.constexpr):
        """P of step i from the int32 scores, exp2(S·c − LSE₂), keys past Skv out (padded queries have
        LSE₂ = +inf: P = 0). dV: transposed (keys along the rows); dK: queries along the rows."""
        a = _i2f(s)
        if PART == 1:
            if ragged:
                a = gl.where(keys_ok[:, None], a, float("-inf"))
            lse = gl.load(LSE2 + i * _QS + gl.arange(0, _QS, layout=gl.SliceLayout(0, s_layout)))
            return gl.exp2(a * c - lse[None, :])
        else:
            if ragged:
                a = gl.where(keys_ok[None, :], a, float("-inf"))
            lse = gl.load(LSE2 + i * _QS + gl.arange(0, _QS, layout=gl.SliceLayout(1, s_layout)))
            return gl.exp2(a * c - lse[:, None])

    @gluon.jit
    def _kv_codes(p, dp_tok, kv_bar, buf, i, SDO, DELTA, sq, s_layout: gl.constexpr, acc_row: gl.constexpr,
                  PART: gl.constexpr):
        """Step i's codes into ``buf`` ([64 keys, 128 queries]) and the scale their product takes: dV —
        P per key over the step's queries, scale s_P·s_dO per key; dK — waits for dP, dS = P ∘ (dP −
        D), one block, scale s_dS·s_Q, stored transposed."""
        if PART == 1:
            pmax = gl.max(p, 1)
            pinv = gl.where(pmax > 0, 127.0 / gl.maximum(pmax, 1e-30), 0.0)
            _store_codes(_f2i8(p * pinv[:, None]), buf)
            return gl.convert_layout((pmax / 127.0) * gl.load(SDO + i), acc_row)
        else:
            di = gl.load(DELTA + i * _QS + gl.arange(0, _QS, layout=gl.SliceLayout(1, s_layout)))
            mbarrier.wait(kv_bar, 0)   # long passed: a new basic block, so ptxas keeps the wait for dP here
            dp = gl.convert_layout(warpgroup_mma_wait(num_outstanding=0, deps=[dp_tok]), s_layout)
            codes, sds = _codes_scale(p * (dp - di[:, None]))
            _store_codes(gl.permute(codes, (1, 0)), buf)
            return sds * sq

    @gluon.jit
    def _kv_fold(acc, prod, scale, PART: gl.constexpr):
        if PART == 1:
            return acc + _i2f(prod) * scale[:, None]
        else:
            return acc + _i2f(prod) * scale

    @gluon.jit
    def _kv_consumer(k_smem, v_smem, q_ring, b_ring, c_ring, op_smem, kv_bar, ready, empty,
                     OUT, sob, sos, soh, SQ, SDO, LSE2, DELTA, sk, b, h, n0, Skv, n_steps, qk, out_scale,
                     WG: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, PART: gl.constexpr):
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
        keys_ok = (n0 + WG * HK + gl.arange(0, HK, layout=gl.SliceLayout(key_slice, s_layout))) < Skv
        ragged = n0 + WG * HK + HK > Skv
        zero_s = gl.zeros(s_shape, gl.int32, layout=s_layout)     # ignored (use_acc=False)
        zero_dp = gl.zeros(s_shape, gl.float32, layout=dp_layout)
        zero_prod = gl.zeros([HK, D], gl.int32, layout=acc_layout)
        mbarrier.wait(kv_bar, 0)

        acc = gl.zeros([HK, D], gl.float32, layout=acc_layout)
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
            sq = gl.load(SQ + i)
            p = _kv_scores(s, i, keys_ok, ragged, sq * sk * qk, LSE2, s_layout, PART)
            scale = _kv_codes(p, dp_tok, kv_bar, buf, i, SDO, DELTA, sq, s_layout, acc_row, PART)
            prod_tok = _kv_issue_prod(buf, b_ring, c_ring, stage, zero_prod, PART)
            prod = warpgroup_mma_wait(num_outstanding=0, deps=[prod_tok])
            acc = _kv_fold(acc, prod, scale, PART)
            mbarrier.arrive(empty.index(stage), count=1)
        offs_n = n0 + WG * HK + gl.arange(0, HK, layout=acc_row)
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
        gl.store(OUT + b.to(gl.int64) * sob + h.to(gl.int64) * soh + offs_n[:, None] * sos + offs_d[None, :],
                 (acc * out_scale).to(OUT.dtype.element_ty), mask=(offs_n < Skv)[:, None])

    @gluon.jit
    def _kv_issue_prod(buf, b_ring, c_ring, stage, zero, PART: gl.constexpr):
        """The step's INT8 product from its codes: dV — P̃ᵀ·dO₈ (dOᵀ₈ in the b ring); dK — dS̃ᵀ·Q₈ (Qᵀ₈
        in the c ring)."""
        if PART == 1:
            return warpgroup_mma(buf, b_ring.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
        else:
            return warpgroup_mma(buf, c_ring.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)

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
    def _ring_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
        once_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(once_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=CONSUMERS)
        return once_bar, ready, empty

    @gluon.jit
    def gluon_kv_kernel(k_desc, v_desc, q_desc, b_desc, c_desc, OUT, sob, sos, soh, SQ, SK, SDO, LSE2, DELTA,
                        H, Skv, Sqp, Skp, qk, out_scale,
                        D: gl.constexpr, STAGES: gl.constexpr, PART: gl.constexpr,
                        CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
        """Grid (Skp/128, B·H), ``num_warps=4`` (+ 4 + 1 worker warps). PART 1: dV into OUT; 2: dK
        (times ``out_scale`` = the softmax scale). Descriptors: K₈ (B·H·Skp, D) box [128, D]; V
        (B, Skv, H, D) BF16 box [1, 128, 1, D] (dK; else unused); Q₈ (B·H·Sqp, D) box [128, D];
        ``b_desc``: dV — dOᵀ₈ (B·H·D, Sqp) box [D, 128], dK — dO (B, Sq, H, D) BF16 box [1, 128, 1,
        D]; ``c_desc``: dK — Qᵀ₈ (B·H·D, Sqp) box [D, 128]. SQ, SDO (B, H, Sqp/128), SK (B, H,
        Skp/128), LSE2, DELTA (B, H, Sqp) float32."""
        gl.static_assert(D == 64 or D == 128, "head_dim must be 64 or 128")
        bh = gl.program_id(1)
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
        op_smem = gl.allocate_shared_memory(gl.int8, [2, _KC // 2, _QS], op_layout)
        kv_bar, ready, empty = _ring_barriers(STAGES, 2)
        sk = gl.load(SK + bh.to(gl.int64) * (Skp // _KC) + gl.program_id(0))
        row0 = bh.to(gl.int64) * Sqp
        SQ = SQ + bh.to(gl.int64) * (Sqp // _QS)
        SDO = SDO + bh.to(gl.int64) * (Sqp // _QS)
        gl.warp_specialize([
            (_kv_consumer, (k_smem, v_smem, q_ring, b_ring, c_ring, op_smem, kv_bar, ready, empty,
                            OUT, sob, sos, soh, SQ, SDO, LSE2 + row0, DELTA + row0, sk, b, h, n0, Skv, n_steps,
                            qk, out_scale, 0, D, STAGES, PART)),
            (_kv_consumer, (k_smem, v_smem, q_ring, b_ring, c_ring, op_smem, kv_bar, ready, empty,
                            OUT, sob, sos, soh, SQ, SDO, LSE2 + row0, DELTA + row0, sk, b, h, n0, Skv, n_steps,
                            qk, out_scale, 1, D, STAGES, PART)),
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
            prod, s = warpgroup_mma_wait(num_outstanding=1, deps=[prod_tok, s_tok])
            acc = acc + _i2f(prod) * scale
            mbarrier.arrive(empty.index(prev), count=1)
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


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------

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


def gluon_backward(v, do, state, do8t, sdo, delta, dq, dk, dv, *, scale: float, smoothing_correction: bool = True,
                   config: dict | None = None) -> None:
    """Writes dQ, dK, dV of :func:`.sagebwd.backward` with the Gluon launches: ``state`` is the
    forward's (INT8 Q, K in both layouts, scales, k̄, LSE₂); ``do8t``, ``sdo``, ``delta`` the dO
    quantization's. ``config``: ``{"dv": {...}, "dk": {...}, "dq": {...}}`` over :data:`DV_CONFIG`,
    :data:`DK_CONFIG`, :data:`DQ_CONFIG`."""
    B, Sq, H, D = dq.shape
    Skv = dk.shape[1]
    Sqp, Skp = state["q8"].shape[2], state["k8"].shape[2]
    cfgs = {name: dict(base) for name, base in (("dv", DV_CONFIG), ("dk", DK_CONFIG), ("dq", DQ_CONFIG))}
    for key, val in (config or {}).items():
        cfgs[key].update(val)
    s = state
    qk = float(scale) * LOG2E
    q8 = _int8_descriptor(s["q8"].view(B * H * Sqp, D), (QUERY_STEP, D))
    k8 = _int8_descriptor(s["k8"].view(B * H * Skp, D), (KEYS_PER_CTA, D))
    q8t = _int8_descriptor(s["q8t"].view(B * H * D, Sqp), (D, QUERY_STEP))
    do8 = _int8_descriptor(do8t.view(B * H * D, Sqp), (D, QUERY_STEP))
    v_desc = tma_descriptor(v, KEYS_PER_CTA)
    do_desc = tma_descriptor(do, QUERY_STEP)
    for part, out, b_desc, c_desc, out_scale, cfg in ((1, dv, do8, do8, 1.0, cfgs["dv"]),
                                                       (2, dk, do_desc, q8t, float(scale), cfgs["dk"])):
        gluon_kv_kernel[(Skp // KEYS_PER_CTA, B * H)](
            k8, v_desc, q8, b_desc, c_desc, out, out.stride(0), out.stride(1), out.stride(2),
            s["sq"], s["sk"], sdo, s["lse2"], delta, H, Skv, Sqp, Skp, qk, out_scale,
            D=D, STAGES=cfg["STAGES"], PART=part, CONSUMER_REGS=cfg["CONSUMER_REGS"],
            LOADER_REGS=cfg["LOADER_REGS"], num_warps=4, maxnreg=cfg["MAXNREG"])
    cfg = cfgs["dq"]
    gluon_dq_kernel[(Sqp // QUERIES_PER_CTA, B * H)](
        q8, do_desc, _int8_descriptor(s["k8"].view(B * H * Skp, D), (KEY_STEP, D)), tma_descriptor(v, KEY_STEP),
        _int8_descriptor(s["k8t"].view(B * H * D, Skp), (D, KEY_STEP)), dq, dq.stride(0), dq.stride(1),
        dq.stride(2), s["sq"], s["sk"], s["kmean"], s["lse2"], delta, H, Sq, Skv, Sqp, Skp, qk, float(scale),
        D=D, STAGES=cfg["STAGES"], CORRECTION=smoothing_correction, LOADER_REGS=cfg["LOADER_REGS"],
        num_warps=8, maxnreg=cfg["MAXNREG"])

