"""The backward's dK/dV and dQ kernels hand-scheduled in Gluon for Hopper (issue 17), for ``attnqat``
(the P quantizer in dK/dV) and ``dropin`` (none).

Same arithmetic as :func:`.attention_bwd._bwd_dkdv_kernel` on its untransposed tile (``NATURAL``:
S [queries, keys], P's 16-key blocks along a thread's row, the forward's quantizer
:func:`.attention_fwd.quantize_p_rows` on the same accumulator layout, so Pᶠ and dS are the same
values; the tensor cores then sum dK and dV in the same k-steps: on an H100 the gradients are
bit-identical to the Triton kernel's, tests/test_kernels_gluon.py):

    S = Q Kᵀ;  P̃ = exp2(S·scale − m₂);  c = exp2(m₂ − LSE₂);  P = P̃·c;  Pᶠ = quant(P̃)·c
    dP = dO Vᵀ;  dS = P ∘ (dP − D)
    dV += bf16(Pᶠ)ᵀ dO;  dK += bf16(dS)ᵀ Q;  dK ·= sm_scale at the end
    (dropin: P = exp2(S·scale − LSE₂), Pᶠ = P)

Why a kernel of its own: the Triton kernel's loop (64 × 64 tile, 4 warps, one stage) waits for
every load and every product in turn, two CTAs per SM, 38.9 ms at the Wan 1.3B 480p shape against
14.2 ms for the dQ kernel's three products (docs/kernels_notes.md). Here the loads are TMA into a
ring filled by a producer warp, and each consumer keeps the tensor cores fed:

* One CTA owns 128 keys of one (batch, head); K and V are loaded once. Two **consumer
  warpgroups** own 64 keys each and walk over all query blocks of 64 rows, reading Q_i and dO_i from
  a ``STAGES``-deep ring (ready / empty mbarriers as in :mod:`.gluon_fwd`); one **producer warp**
  issues the TMA loads (4-D descriptors, rows past the sequence zero-filled).
* Iteration i of a consumer: issue S_i = Q_i K_wᵀ and dP_i = dO_i V_wᵀ (asynchronous wgmma; dV_{i-1}
  and dK_{i-1} are still in flight ahead of them), wait for S_i (so dV_{i-1} and dK_{i-1} have
  finished too: the ring slot of i-1 and the Pᶠ / dS buffers are free), run the exponentials and
  the P quantizer while dP_i is on the tensor cores, wait for dP_i, form dS, store bf16 Pᶠ and dS
  to this warpgroup's shared-memory tiles and issue dV += Pᶠᵀ dO_i and dK += dSᵀ Q_i
  (m64n{D}k16, the transposes are shared-memory views) without waiting for them.
* The row statistics (LSE₂, m₂, D) of block i are loaded while S_i and dP_i are computed.

Iteration 0 is peeled, so that at the loop head the same products are in flight on every path
(dV and dK of the previous block): ptxas serializes every wgmma of a loop otherwise (what
:mod:`.gluon_fwd` found).

Status (H100, Triton 3.6, 2026-11-24): 27.1 ms against the Triton kernel's 38.9 at the Wan 1.3B
480p shape; ``backend="auto"`` runs it on sm_90 (:func:`.attention_bwd.choose_dkdv_schedule`).

**The dQ kernel** (:func:`gluon_dq_kernel`) is :func:`.attention_bwd._bwd_dq_kernel`'s arithmetic
(P = exp2(S·scale − LSE₂), dS = P ∘ (dP − D), dQ += bf16(dS) K, no quantizer; the same 64-key
blocks and k-steps, so the same bits) on the same kind of schedule: one CTA per 128 queries, Q and
dO loaded once, K_j and V_j of each 64-key block through a ``STAGES``-deep TMA ring, two consumer
warpgroups of 64 queries. Block j: issue S_j and dP_j behind dQ_{j−1}, wait for S_j, the
exponentials while dP_j runs, wait for dP_j, issue dQ += dS_j K_j with dS_j a register operand and
go on. On an H100 (2026-11-24, Wan 1.3B 480p) the attnqat backward alone took 40.1 ms with it
against 43.5 with the Triton dQ kernel (dropin 33.9 against 37.0), bit-identical dQ; at D = 64
(24 heads) it was slower (53.0 against 51.9), so the default runs it at D = 128 only
(:data:`DQ_AUTO_HEAD_DIMS`).
"""

from __future__ import annotations

import triton

from .attention_fwd import quantize_p_rows
from .gluon_fwd import (
    HEAD_DIMS,
    LOG2E,
    _batch_head,
    _thread_barrier,
    _tma_load,
    fence_async_shared,
    gl,
    gluon,
    gluon_unavailable,
    mbarrier,
    tma_descriptor,
    tma_unaddressable,
    warpgroup_mma,
    warpgroup_mma_wait,
    wgmma_layout,
)

KEYS_PER_CTA = 128     # two consumer warpgroups of 64 keys
QUERY_BLOCK = 64       # queries per ring slot
#: default launch: ring depth; registers of the second consumer and of the producer warp (the
#: first consumer, Gluon's default partition, keeps ``MAXNREG``)
CONFIG = dict(STAGES=2, CONSUMER_REGS=240, LOADER_REGS=24, MAXNREG=168)
QUERIES_PER_CTA = 128  # the dQ kernel: two consumer warpgroups of 64 queries
KEY_BLOCK = 64         # keys per ring slot of the dQ kernel (the Triton dQ kernel's BN)
#: the dQ kernel's default launch (the same fields). At least 3 ring slots: slot j-1 is still read by
#: dQ_{j-1} while S_j and dP_j read slot j and the producer fills slot j+1; on an H100 (Wan 1.3B 480p,
#: the attnqat backward alone) 2 / 3 / 4 slots took 43.8 / 40.9 / 40.1 ms
DQ_CONFIG = dict(STAGES=4, CONSUMER_REGS=240, LOADER_REGS=24, MAXNREG=168)
#: head_dims at which the default schedule runs the Gluon dQ kernel: where it measured faster than
#: the Triton one (H100, the attnqat backward alone at the Wan 1.3B 480p shape: D = 128, 12 heads,
#: 40.1 against 43.5 ms; D = 64, 24 heads, 53.0 against 51.9 ms)
DQ_AUTO_HEAD_DIMS = (128,)


if gluon is not None:
    _HN: gl.constexpr = gl.constexpr(KEYS_PER_CTA // 2)
    _HM: gl.constexpr = gl.constexpr(QUERY_BLOCK)
    _KB: gl.constexpr = gl.constexpr(KEY_BLOCK)

    @gluon.jit
    def _row_stats(LSE2, M2, DELTA, i, Sq, row: gl.constexpr, QUANT_P: gl.constexpr):
        """LSE₂, m₂ (attnqat) and D of query block i, in S's row layout; rows ≥ Sq: LSE₂ = m₂ = +inf,
        D = 0 (with c = 0 below, their P, Pᶠ and dS are 0)."""
        rows = i * _HM + gl.arange(0, _HM, layout=row)
        ok = rows < Sq
        lse2 = gl.load(LSE2 + rows, mask=ok, other=float("inf"))
        di = gl.load(DELTA + rows, mask=ok, other=0.0)
        if QUANT_P:
            m2 = gl.load(M2 + rows, mask=ok, other=float("inf"))
        else:
            m2 = lse2
        return ok, lse2, m2, di

    @gluon.jit
    def _p_tile(s, ok, lse2, m2, keys_ok, ragged, qk_scale, s_layout: gl.constexpr, QUANT_P: gl.constexpr):
        """P and Pᶠ of one [64 queries, 64 keys] tile (the Triton kernel's NATURAL step). The
        quantizer's reshapes hand back S's own register map as a linear layout: converting it to
        ``s_layout`` moves nothing."""
        if ragged:   # keys beyond Skv out of P
            s = gl.where(keys_ok[None, :], s, float("-inf"))
        if QUANT_P:
            c = gl.where(ok, gl.exp2(m2 - lse2), 0.0)
            p_tilde = gl.exp2(s * qk_scale - m2[:, None])      # relative to the final row max
            p = p_tilde * c[:, None]
            pf = gl.convert_layout(quantize_p_rows(p_tilde, _HM, _HN, 1), s_layout) * c[:, None]   # NVFP4
        else:
            p = gl.exp2(s * qk_scale - lse2[:, None])
            pf = p
        return p, pf

    @gluon.jit
    def _store_pf_ds(s, dp_tok, pf_buf, ds_buf, ok, lse2, m2, di, keys_ok, ragged, qk_scale,
                     s_layout: gl.constexpr, QUANT_P: gl.constexpr):
        """Pᶠ and dS of one block as bf16 in this warpgroup's shared-memory tiles, visible to the
        wgmma that reads them next: the exponentials and the quantizer run while dP is still on
        the tensor cores; then wait for dP, dS = P ∘ (dP − D), fence, and a barrier among the
        warpgroup's threads."""
        p, pf = _p_tile(s, ok, lse2, m2, keys_ok, ragged, qk_scale, s_layout, QUANT_P)
        pf_buf.store(pf.to(gl.bfloat16))
        dp = warpgroup_mma_wait(num_outstanding=0, deps=[dp_tok])
        ds_buf.store((p * (dp - di[:, None])).to(gl.bfloat16))
        fence_async_shared()
        _thread_barrier()

    @gluon.jit
    def _issue_sdp(q_buf, do_buf, k_w, v_w, zero_s):
        s_tok = warpgroup_mma(q_buf, k_w.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(do_buf, v_w.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        return s_tok, dp_tok

    @gluon.jit
    def _consumer(q_smem, do_smem, k_smem, v_smem, pf_smem, ds_smem, kv_bar, ready, empty,
                  DK, DV, sdkb, sdks, sdkh, sdvb, sdvs, sdvh, LSE2, M2, DELTA,
                  b, h, n0, Sq, Skv, qk_scale, sm_scale,
                  WG: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, QUANT_P: gl.constexpr):
        """Consumer warpgroup WG: dK, dV of keys [n0 + 64·WG, n0 + 64·WG + 64)."""
        s_layout: gl.constexpr = wgmma_layout(_HN)
        acc_layout: gl.constexpr = wgmma_layout(D)
        row: gl.constexpr = gl.SliceLayout(1, s_layout)
        k_w = k_smem.slice(WG * _HN, _HN)      # [64 keys, D]
        v_w = v_smem.slice(WG * _HN, _HN)
        pf_buf = pf_smem.index(WG)             # [64 queries, 64 keys]
        ds_buf = ds_smem.index(WG)
        keys = n0 + WG * _HN + gl.arange(0, _HN, layout=gl.SliceLayout(0, s_layout))
        keys_ok = keys < Skv
        ragged = n0 + WG * _HN + _HN > Skv
        zero_s = gl.zeros([_HM, _HN], gl.float32, layout=s_layout)   # ignored (use_acc=False)
        n_blocks = gl.cdiv(Sq, _HM)
        mbarrier.wait(kv_bar, 0)

        # block 0 (peeled: dV, dK start from its products)
        mbarrier.wait(ready.index(0), 0)
        s_tok, dp_tok = _issue_sdp(q_smem.index(0), do_smem.index(0), k_w, v_w, zero_s)
        ok, lse2, m2, di = _row_stats(LSE2, M2, DELTA, 0, Sq, row, QUANT_P)
        s = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])
        _store_pf_ds(s, dp_tok, pf_buf, ds_buf, ok, lse2, m2, di, keys_ok, ragged, qk_scale, s_layout, QUANT_P)
        zero_acc = gl.zeros([_HN, D], gl.float32, layout=acc_layout)
        dv_tok = warpgroup_mma(pf_buf.permute((1, 0)), do_smem.index(0), zero_acc, use_acc=False, is_async=True)
        dk_tok = warpgroup_mma(ds_buf.permute((1, 0)), q_smem.index(0), zero_acc, use_acc=False, is_async=True)

        for i in range(1, n_blocks):
            stage = i % STAGES
            mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
            s_tok, dp_tok = _issue_sdp(q_smem.index(stage), do_smem.index(stage), k_w, v_w, zero_s)
            ok, lse2, m2, di = _row_stats(LSE2, M2, DELTA, i, Sq, row, QUANT_P)
            # S_i done implies dV_{i-1}, dK_{i-1} done (groups complete in issue order)
            s, dv, dk = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok, dv_tok, dk_tok])
            mbarrier.arrive(empty.index((i - 1) % STAGES), count=1)
            _store_pf_ds(s, dp_tok, pf_buf, ds_buf, ok, lse2, m2, di, keys_ok, ragged, qk_scale, s_layout, QUANT_P)
            dv_tok = warpgroup_mma(pf_buf.permute((1, 0)), do_smem.index(stage), dv, is_async=True)
            dk_tok = warpgroup_mma(ds_buf.permute((1, 0)), q_smem.index(stage), dk, is_async=True)

        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=[dv_tok, dk_tok])
        mbarrier.arrive(empty.index((n_blocks - 1) % STAGES), count=1)
        offs_n = n0 + WG * _HN + gl.arange(0, _HN, layout=gl.SliceLayout(1, acc_layout))
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
        n_ok = (offs_n < Skv)[:, None]
        gl.store(DK + b.to(gl.int64) * sdkb + h.to(gl.int64) * sdkh + offs_n[:, None] * sdks + offs_d[None, :],
                 (dk * sm_scale).to(DK.dtype.element_ty), mask=n_ok)
        gl.store(DV + b.to(gl.int64) * sdvb + h.to(gl.int64) * sdvh + offs_n[:, None] * sdvs + offs_d[None, :],
                 dv.to(DV.dtype.element_ty), mask=n_ok)

    @gluon.jit
    def _loader(once_a, once_b, once_a_smem, once_b_smem, once_bar, row0,
                ring_a, ring_b, ring_a_smem, ring_b_smem, ready, empty, b, h, n_rows,
                BLOCK: gl.constexpr, STAGES: gl.constexpr):
        """The producer warp of both backward kernels: the CTA's own two tiles at row ``row0`` once
        (dK/dV: K and V; dQ: Q and dO), then the other pair's two tiles of every ``BLOCK``-row block
        through the ring (dK/dV: Q_i and dO_i; dQ: K_j and V_j)."""
        mbarrier.expect(once_bar, 2 * once_a.block_type.nbytes)
        _tma_load(once_a, [b, row0, h, 0], once_bar, once_a_smem)
        _tma_load(once_b, [b, row0, h, 0], once_bar, once_b_smem)
        for i in range(gl.cdiv(n_rows, BLOCK)):
            stage = i % STAGES
            mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)   # a fresh barrier passes phase 1
            mbarrier.expect(ready.index(stage), 2 * ring_a.block_type.nbytes)
            _tma_load(ring_a, [b, i * BLOCK, h, 0], ready.index(stage), ring_a_smem.index(stage))
            _tma_load(ring_b, [b, i * BLOCK, h, 0], ready.index(stage), ring_b_smem.index(stage))

    @gluon.jit
    def _ring_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
        """The backward kernels' mbarriers (these and :mod:`.gluon_sagebwd`'s), initialized: the
        once-loaded tiles'; ready / empty of each ring slot (every one of the ``CONSUMERS``
        partitions releases a slot). Returns (once_bar, ready, empty)."""
        once_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(once_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=CONSUMERS)
        return once_bar, ready, empty

    @gluon.jit
    def gluon_dkdv_kernel(q_desc, do_desc, k_desc, v_desc, DK, DV, sdkb, sdks, sdkh, sdvb, sdvs, sdvh,
                          LSE2, M2, DELTA, H, Sq, Skv, qk_scale, sm_scale,
                          D: gl.constexpr, STAGES: gl.constexpr, QUANT_P: gl.constexpr,
                          CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
        """Grid (cdiv(Skv, 128), B·H), ``num_warps=4`` (+ 4 + 1 worker warps). Q/dO descriptors:
        (B, Sq, H, D) views with a [1, 64, 1, D] box; K/V: (B, Skv, H, D) with [1, 128, 1, D]. dK, dV:
        (B, Skv, H, D), head_dim stride 1. LSE2, M2 (attnqat; else a placeholder), DELTA: (B, H, Sq)
        float32, contiguous."""
        gl.static_assert(D == 64 or D == 128, "head_dim must be 64 or 128")
        bh = gl.program_id(1)
        b, h = _batch_head(bh, H)
        n0 = gl.program_id(0) * (2 * _HN)
        row_base = bh.to(gl.int64) * Sq

        tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_HM, D], gl.bfloat16)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_HM, _HN], gl.bfloat16)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * _HN, D], tile_layout)
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * _HN, D], tile_layout)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, _HM, D], tile_layout)
        do_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, _HM, D], tile_layout)
        pf_smem = gl.allocate_shared_memory(gl.bfloat16, [2, _HM, _HN], p_layout)
        ds_smem = gl.allocate_shared_memory(gl.bfloat16, [2, _HM, _HN], p_layout)

        kv_bar, ready, empty = _ring_barriers(STAGES, 2)   # both consumers release a slot

        gl.warp_specialize([
            (_consumer, (q_smem, do_smem, k_smem, v_smem, pf_smem, ds_smem, kv_bar, ready, empty,
                         DK, DV, sdkb, sdks, sdkh, sdvb, sdvs, sdvh, LSE2 + row_base, M2 + row_base,
                         DELTA + row_base, b, h, n0, Sq, Skv, qk_scale, sm_scale, 0, D, STAGES, QUANT_P)),
            (_consumer, (q_smem, do_smem, k_smem, v_smem, pf_smem, ds_smem, kv_bar, ready, empty,
                         DK, DV, sdkb, sdks, sdkh, sdvb, sdvs, sdvh, LSE2 + row_base, M2 + row_base,
                         DELTA + row_base, b, h, n0, Sq, Skv, qk_scale, sm_scale, 1, D, STAGES, QUANT_P)),
            (_loader, (k_desc, v_desc, k_smem, v_smem, kv_bar, n0, q_desc, do_desc, q_smem, do_smem, ready, empty,
                       b, h, Sq, _HM, STAGES)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


    # ------------------------------------------------------------------------------------------
    # The dQ kernel
    # ------------------------------------------------------------------------------------------

    @gluon.jit
    def _ds_block(s, dp_tok, qdo_bar, lse2, di, start_n, Skv, qk_scale, s_layout: gl.constexpr):
        """dS = P ∘ (dP − D) of one [64 queries, 64 keys] block, P = exp2(S·scale − LSE₂) (the Triton
        dQ kernel's step; keys ≥ Skv out of P): the exponentials run while dP is on the tensor
        cores, then the wait for dP. (ptxas hoists a wgmma wait to the top of its basic block; the
        wait on ``qdo_bar``, whose only phase completed before the loop, passes at once and starts a
        new block, so the wait for dP stays after the exponentials.)"""
        if start_n + _KB > Skv:
            keys = start_n + gl.arange(0, _KB, layout=gl.SliceLayout(0, s_layout))
            s = gl.where((keys < Skv)[None, :], s, float("-inf"))
        p = gl.exp2(s * qk_scale - lse2[:, None])
        mbarrier.wait(qdo_bar, 0)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=[dp_tok])
        return p * (dp - di[:, None])

    @gluon.jit
    def _dq_consumer(q_smem, do_smem, k_smem, v_smem, qdo_bar, ready, empty, DQ, sdqb, sdqs, sdqh,
                     LSE2, DELTA, b, h, m0, Sq, Skv, qk_scale, sm_scale,
                     WG: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
        """Consumer warpgroup WG: dQ of queries [m0 + 64·WG, m0 + 64·WG + 64). Block j: issue S_j and
        dP_j behind dQ_{j-1}; wait for S_j (which retires dQ_{j-1}: the ring slot of j-1 is free),
        the exponentials while dP_j runs, wait for dP_j, dS_j, issue dQ += dS_j K_j (dS a register
        operand) without waiting."""
        s_layout: gl.constexpr = wgmma_layout(_KB)
        acc_layout: gl.constexpr = wgmma_layout(D)
        ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        row: gl.constexpr = gl.SliceLayout(1, s_layout)
        q = q_smem.slice(WG * _HM, _HM)        # [64 queries, D]
        do = do_smem.slice(WG * _HM, _HM)
        rows = m0 + WG * _HM + gl.arange(0, _HM, layout=row)
        ok = rows < Sq
        lse2 = gl.load(LSE2 + rows, mask=ok, other=float("inf"))   # rows ≥ Sq: P = 0
        di = gl.load(DELTA + rows, mask=ok, other=0.0)
        zero_s = gl.zeros([_HM, _KB], gl.float32, layout=s_layout)   # ignored (use_acc=False)
        n_blocks = gl.cdiv(Skv, _KB)
        mbarrier.wait(qdo_bar, 0)

        # block 0 (peeled: dQ starts from its product, which is in flight at the loop head)
        mbarrier.wait(ready.index(0), 0)
        s_tok, dp_tok = _issue_sdp(q, do, k_smem.index(0), v_smem.index(0), zero_s)
        s = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])
        ds = gl.convert_layout(_ds_block(s, dp_tok, qdo_bar, lse2, di, 0, Skv, qk_scale, s_layout).to(gl.bfloat16),
                               ds_layout)
        acc_tok = warpgroup_mma(ds, k_smem.index(0), gl.zeros([_HM, D], gl.float32, layout=acc_layout),
                                use_acc=False, is_async=True)

        for j in range(1, n_blocks):
            stage = j % STAGES
            mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
            s_tok, dp_tok = _issue_sdp(q, do, k_smem.index(stage), v_smem.index(stage), zero_s)
            s, acc = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok, acc_tok])   # S_j; dQ_{j-1} too
            mbarrier.arrive(empty.index((j - 1) % STAGES), count=1)
            ds = gl.convert_layout(_ds_block(s, dp_tok, qdo_bar, lse2, di, j * _KB, Skv, qk_scale, s_layout)
                                   .to(gl.bfloat16), ds_layout)
            acc_tok = warpgroup_mma(ds, k_smem.index(stage), acc, is_async=True)

        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc_tok])
        mbarrier.arrive(empty.index((n_blocks - 1) % STAGES), count=1)
        offs_m = m0 + WG * _HM + gl.arange(0, _HM, layout=gl.SliceLayout(1, acc_layout))
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
        gl.store(DQ + b.to(gl.int64) * sdqb + h.to(gl.int64) * sdqh + offs_m[:, None] * sdqs + offs_d[None, :],
                 (acc * sm_scale).to(DQ.dtype.element_ty), mask=(offs_m < Sq)[:, None])

    @gluon.jit
    def gluon_dq_kernel(q_desc, do_desc, k_desc, v_desc, DQ, sdqb, sdqs, sdqh, LSE2, DELTA,
                        H, Sq, Skv, qk_scale, sm_scale,
                        D: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                        LOADER_REGS: gl.constexpr):
        """Grid (cdiv(Sq, 128), B·H), ``num_warps=4`` (+ 4 + 1 worker warps). Q/dO descriptors:
        (B, Sq, H, D) views with a [1, 128, 1, D] box; K/V: (B, Skv, H, D) with [1, 64, 1, D]. dQ:
        (B, Sq, H, D), head_dim stride 1. LSE2, DELTA: (B, H, Sq) float32, contiguous."""
        gl.static_assert(D == 64 or D == 128, "head_dim must be 64 or 128")
        bh = gl.program_id(1)
        b, h = _batch_head(bh, H)
        m0 = gl.program_id(0) * (2 * _HM)
        row_base = bh.to(gl.int64) * Sq

        tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_KB, D], gl.bfloat16)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * _HM, D], tile_layout)
        do_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * _HM, D], tile_layout)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, _KB, D], tile_layout)
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, _KB, D], tile_layout)
        qdo_bar, ready, empty = _ring_barriers(STAGES, 2)

        gl.warp_specialize([
            (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, qdo_bar, ready, empty, DQ, sdqb, sdqs, sdqh,
                            LSE2 + row_base, DELTA + row_base, b, h, m0, Sq, Skv, qk_scale, sm_scale, 0, D, STAGES)),
            (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, qdo_bar, ready, empty, DQ, sdqb, sdqs, sdqh,
                            LSE2 + row_base, DELTA + row_base, b, h, m0, Sq, Skv, qk_scale, sm_scale, 1, D, STAGES)),
            (_loader, (q_desc, do_desc, q_smem, do_smem, qdo_bar, m0, k_desc, v_desc, k_smem, v_smem, ready, empty,
                       b, h, Skv, _KB, STAGES)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------

def gluon_dkdv_unsupported(q, k, v, do) -> str | None:
    """None when :func:`gluon_dkdv` runs these operands here, else why not (one sentence)."""
    import torch  # noqa: PLC0415

    for name, t in (("q", q), ("k", k), ("v", v), ("do", do)):
        if t.dim() != 4 or t.dtype != torch.bfloat16 or not t.is_cuda:
            return f"{name} must be a 4-D bfloat16 CUDA tensor, got {t.dtype} {tuple(t.shape)} on {t.device.type}"
        if why := tma_unaddressable(name, t):
            return why
    if q.shape[3] not in HEAD_DIMS:
        return f"head_dim {q.shape[3]} is not supported (64 or 128)"
    if do.shape != q.shape or k.shape != v.shape:
        return f"shapes differ: q {tuple(q.shape)}, do {tuple(do.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    return gluon_unavailable(q.device)


def gluon_dkdv(q, k, v, do, dk, dv, lse2, m2, delta, *, sm_scale: float, quant_p: bool,
               config: dict | None = None) -> None:
    """Writes dK and dV (``dk``, ``dv``: (B, Skv, H, D) with head_dim stride 1) of the attnqat
    (``quant_p``) or dropin backward, as :func:`.attention_bwd._bwd_dkdv_kernel` computes them.
    ``lse2``, ``m2``, ``delta``: (B, H, Sq) float32, contiguous (``m2`` None for dropin).
    ``config``: :data:`CONFIG` overrides."""
    why = gluon_dkdv_unsupported(q, k, v, do)
    if why is not None:
        raise RuntimeError(f"gluon_dkdv cannot run: {why}")
    cfg = dict(CONFIG)
    cfg.update(config or {})
    B, Sq, H, D = q.shape
    Skv = k.shape[1]
    grid = (triton.cdiv(Skv, KEYS_PER_CTA), B * H)
    gluon_dkdv_kernel[grid](
        tma_descriptor(q, QUERY_BLOCK), tma_descriptor(do, QUERY_BLOCK), tma_descriptor(k, KEYS_PER_CTA),
        tma_descriptor(v, KEYS_PER_CTA), dk, dv, dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2), lse2, m2 if m2 is not None else lse2, delta,
        H, Sq, Skv, sm_scale * LOG2E, sm_scale,
        D=D, STAGES=cfg["STAGES"], QUANT_P=quant_p, CONSUMER_REGS=cfg["CONSUMER_REGS"],
        LOADER_REGS=cfg["LOADER_REGS"], num_warps=4, maxnreg=cfg["MAXNREG"],
    )


def gluon_dq(q, k, v, do, dq, lse2, delta, *, sm_scale: float, config: dict | None = None) -> None:
    """Writes dQ (``dq``: (B, Sq, H, D) with head_dim stride 1) of the attnqat or dropin backward, as
    :func:`.attention_bwd._bwd_dq_kernel` computes it (the same operands: ``lse2``, ``delta`` (B, H,
    Sq) float32, contiguous). ``config``: :data:`DQ_CONFIG` overrides."""
    why = gluon_dkdv_unsupported(q, k, v, do)
    if why is not None:
        raise RuntimeError(f"gluon_dq cannot run: {why}")
    cfg = dict(DQ_CONFIG)
    cfg.update(config or {})
    B, Sq, H, D = q.shape
    grid = (triton.cdiv(Sq, QUERIES_PER_CTA), B * H)
    gluon_dq_kernel[grid](
        tma_descriptor(q, QUERIES_PER_CTA), tma_descriptor(do, QUERIES_PER_CTA), tma_descriptor(k, KEY_BLOCK),
        tma_descriptor(v, KEY_BLOCK), dq, dq.stride(0), dq.stride(1), dq.stride(2), lse2, delta,
        H, Sq, k.shape[1], sm_scale * LOG2E, sm_scale,
        D=D, STAGES=cfg["STAGES"], CONSUMER_REGS=cfg["CONSUMER_REGS"], LOADER_REGS=cfg["LOADER_REGS"],
        num_warps=4, maxnreg=cfg["MAXNREG"],
    )
