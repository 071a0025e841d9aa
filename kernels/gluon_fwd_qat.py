"""The ``attnqat`` training forward (O, O', row statistics) as a hand-scheduled Gluon kernel for Hopper.

Same numerics as :func:`attention_fwd.attn_fwd_kernel` with ``P_NVFP4``, ``need_o2`` and
``store_stats`` (formulation 0: bf16 Q, K, V holding their NVFP4-dequantized values; head_dim 64
or 128): per 128-key tile

    O  = O·α  + bf16(P̃ᶠ) V
    Δ  = Δ·α  + bf16(P̃ − P̃ᶠ) V            out: O = bf16(O/l),  O' = (O + Δ)/l (float32),
                                                  LSE₂ = m + log2(l),  m₂ = m

with the softmax and the P quantizer of :mod:`.gluon_fwd` (the same operations in the same order,
on the same accumulator layout).

Why a schedule of its own rather than the nvfp4 kernel plus a third product (docs/kernels_notes.md,
"The attnqat forward in Gluon"): with O, O' and S in registers a consumer warpgroup of 64 rows holds
192 of its 240 registers before any temporary, so nothing of its own stays in flight across the
softmax. Each consumer issues PV_{j−1}, ΔV_{j−1} and S_j together, waits for all three, then runs the
softmax and the quantizer of tile j; the overlap comes from the **ping-pong** alone: while one
warpgroup's softmax runs, the tensor cores execute the other one's three products (a pair of
mbarriers hands the right to issue back and forth, as in the nvfp4 kernel). Both A operands, bf16
P̃ᶠ_j and P̃_j − P̃ᶠ_j, go through shared memory (one tile each per warpgroup; a fence, then a barrier
among the warpgroup's threads before the wgmma reads them): as a register operand P̃ᶠ pushed ptxas
over the register budget and it serialized every wgmma of the loop (seen in the SASS). The producer
warp and the K/V ring are the nvfp4 kernel's (:func:`.gluon_fwd._loader`); shared memory: Q 32 KB,
the 2-slot K/V ring 128 KB, the two A tiles per warpgroup 64 KB (no room for a third ring slot).

Measured on an H100 (2026-11-24, an ad-hoc script calling both launchers, do_bench medians, Wan 1.3B 480p
shape): O, O', LSE₂ and m₂ bit-identical to the Triton kernel's (randn and outlier-heavy inputs,
ragged tiles, B = 2, D 64 and 128, the Wan shape); 23.3 ms against the Triton kernel's 25.3 at
D = 128, but 36.3 against 29.9 at D = 64 (24 heads), hence :data:`AUTO_HEAD_DIMS`. A variant that
waits for S_j alone and lets PV_{j−1} and ΔV_{j−1} run during the softmax (an mbarrier wait as a
basic-block boundary keeps ptxas from hoisting the second wgmma wait) measured 23.9 ms: not kept.
"""

from __future__ import annotations

import triton

from .attention_fwd import P_NVFP4
from .receipt import note
from .gluon_fwd import (
    _BM,
    _BN,
    BLOCK_M,
    CONFIG,
    GLUON_IMPORT_ERROR,
    LOG2E,
    check_schedule,
    choose_schedule,
    gluon_unsupported,
    tma_descriptor,
)

#: head_dims at which ``backend="auto"`` runs this kernel: where it measured faster than the Triton
#: kernel (H100, Wan 1.3B 480p: D = 128, 12 heads, 23.3 against 25.3 ms; D = 64, 24 heads, 36.3
#: against 29.9 ms — there the tensor-core work per tile halves and the softmax alone bounds both
#: warpgroups; docs/kernels_notes.md)
AUTO_HEAD_DIMS = (128,)

if GLUON_IMPORT_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .gluon_fwd import (
        _batch_head,
        _loader,
        _qkv_smem,
        _ring_barriers,
        _softmax_tile,
        _thread_barrier,
        _turn_pass,
        _turn_wait,
        wgmma_layout,
    )

    _P_NVFP4: gl.constexpr = gl.constexpr(P_NVFP4)

    @gluon.jit
    def _consumer_qat(q_smem, k_smem, v_smem, d_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                      O, O2, LSE2, M2, sob, sos, soh, b, h, bh, m0, Sq, Skv, qk_scale,
                      WG: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
        """One consumer warpgroup: query rows [m0 + 64·WG, m0 + 64·WG + 64)."""
        HM: gl.constexpr = _BM // 2
        BN: gl.constexpr = _BN
        s_layout: gl.constexpr = wgmma_layout(BN)
        o_layout: gl.constexpr = wgmma_layout(D)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        m_i = gl.full([HM], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([HM], gl.float32, layout=gl.SliceLayout(1, s_layout))
        s_init = gl.zeros([HM, BN], gl.float32, layout=s_layout)   # ignored (use_acc=False)
        acc = gl.zeros([HM, D], gl.float32, layout=o_layout)
        acc2 = gl.zeros([HM, D], gl.float32, layout=o_layout)
        n_tiles = gl.cdiv(Skv, BN)
        dbuf = d_smem.index(WG)
        pbuf = d_smem.index(2 + WG)
        mbarrier.wait(q_bar, 0)
        q = q_smem.slice(WG * HM, HM)                                 # [64, D]

        # prologue: S_0, its softmax and quantizer
        mbarrier.wait(k_ready.index(0), 0)
        _turn_wait(turn, WG, 0)
        s_tok = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_init, use_acc=False, is_async=True)
        _turn_pass(turn, WG)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
        mbarrier.arrive(k_empty.index(0), count=1)
        m_i, l_i, alpha, pq, p = _softmax_tile(s, m_i, l_i, 0, Skv, qk_scale, s_layout, HM, BN, _P_NVFP4, D)
        pq = gl.convert_layout(pq, s_layout)                        # the same map: no data movement
        pbuf.store(pq.to(gl.bfloat16))                              # exact: ≤ 6 significant bits
        dbuf.store((p - pq).to(gl.bfloat16))
        fence_async_shared()
        _thread_barrier()

        # Iteration j: O, O' ·= α_{j-1}; issue PV_{j-1}, ΔV_{j-1}, S_j; wait for all three; softmax and
        # quantizer of tile j (while the other warpgroup's products run).
        for j in range(1, n_tiles):
            stage = j % STAGES
            pstage = (j - 1) % STAGES
            mbarrier.wait(k_ready.index(stage), (j // STAGES) & 1)
            mbarrier.wait(v_ready.index(pstage), ((j - 1) // STAGES) & 1)
            a_o = gl.convert_layout(alpha, row_o)[:, None]
            acc = acc * a_o
            acc2 = acc2 * a_o
            _turn_wait(turn, WG, j)
            acc_tok = warpgroup_mma(pbuf, v_smem.index(pstage), acc, is_async=True)            # PV_{j-1}
            acc2_tok = warpgroup_mma(dbuf, v_smem.index(pstage), acc2, is_async=True)          # ΔV_{j-1}
            s_tok = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s_init, use_acc=False,
                                  is_async=True)                                               # S_j
            _turn_pass(turn, WG)
            acc, acc2, s = warpgroup_mma_wait(num_outstanding=0, deps=[acc_tok, acc2_tok, s_tok])
            mbarrier.arrive(v_empty.index(pstage), count=1)
            mbarrier.arrive(k_empty.index(stage), count=1)
            m_i, l_i, alpha, pq, p = _softmax_tile(s, m_i, l_i, j * BN, Skv, qk_scale, s_layout, HM, BN,
                                                   _P_NVFP4, D)
            pq = gl.convert_layout(pq, s_layout)
            pbuf.store(pq.to(gl.bfloat16))
            dbuf.store((p - pq).to(gl.bfloat16))
            fence_async_shared()
            _thread_barrier()

        # epilogue: the last PV and ΔV
        last = n_tiles - 1
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        a_o = gl.convert_layout(alpha, row_o)[:, None]
        acc = acc * a_o
        acc2 = acc2 * a_o
        _turn_wait(turn, WG, n_tiles)
        acc_tok = warpgroup_mma(pbuf, v_smem.index(last % STAGES), acc, is_async=True)
        acc2_tok = warpgroup_mma(dbuf, v_smem.index(last % STAGES), acc2, is_async=True)
        _turn_pass(turn, WG)
        acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=[acc_tok, acc2_tok])
        mbarrier.arrive(v_empty.index(last % STAGES), count=1)

        inv_l = gl.convert_layout(1.0 / l_i, row_o)[:, None]
        offs_m = m0 + WG * HM + gl.arange(0, HM, layout=row_o)
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        off = b.to(gl.int64) * sob + h.to(gl.int64) * soh + offs_m[:, None] * sos + offs_d[None, :]
        row_ok = (offs_m < Sq)[:, None]
        gl.store(O + off, (acc * inv_l).to(gl.bfloat16), mask=row_ok)
        gl.store(O2 + off, (acc + acc2) * inv_l, mask=row_ok)
        offs_r = m0 + WG * HM + gl.arange(0, HM, layout=gl.SliceLayout(1, s_layout))
        stat = bh.to(gl.int64) * Sq + offs_r
        gl.store(LSE2 + stat, m_i + gl.log2(l_i), mask=offs_r < Sq)
        gl.store(M2 + stat, m_i, mask=offs_r < Sq)

    @gluon.jit
    def gluon_attnqat_fwd_kernel(q_desc, k_desc, v_desc, O, O2, LSE2, M2, sob, sos, soh, H, Sq, Skv, qk_scale,
                                 D: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                 LOADER_REGS: gl.constexpr):
        """Grid (cdiv(Sq, 128), B·H), ``num_warps=4`` (+ 4 + 1 worker warps). Descriptors as
        :func:`.gluon_fwd.gluon_attn_fwd_kernel`'s; O (bf16) and O2 (float32): (B, Sq, H, D) with the
        same strides, head_dim stride 1; LSE2, M2: (B, H, Sq) float32."""
        gl.static_assert(D == 64 or D == 128, "head_dim must be 64 or 128")
        bh = gl.program_id(1)
        b, h = _batch_head(bh, H)
        m0 = gl.program_id(0) * _BM
        q_smem, k_smem, v_smem = _qkv_smem(D, STAGES)
        d_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BM // 2, _BN], gl.bfloat16)
        d_smem = gl.allocate_shared_memory(gl.bfloat16, [4, _BM // 2, _BN], d_layout)   # Δ, P̃ᶠ per consumer
        q_bar, k_ready, k_empty, v_ready, v_empty, turn = _ring_barriers(STAGES)
        gl.warp_specialize([
            (_consumer_qat, (q_smem, k_smem, v_smem, d_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                             O, O2, LSE2, M2, sob, sos, soh, b, h, bh, m0, Sq, Skv, qk_scale, 0, D, STAGES)),
            (_consumer_qat, (q_smem, k_smem, v_smem, d_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                             O, O2, LSE2, M2, sob, sos, soh, b, h, bh, m0, Sq, Skv, qk_scale, 1, D, STAGES)),
            (_loader, (q_desc, k_desc, v_desc, k_desc, q_smem, k_smem, v_smem, k_smem, q_bar, k_ready, k_empty,
                       v_ready, v_empty, b, h, m0, 0, Skv, STAGES, False)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def choose_qat_schedule(qf, kf, vf, schedule: str | None, config) -> str:
    """Which kernel runs the attnqat forward on the quantized operands: ``"gluon"`` (this module's)
    where :func:`.gluon_fwd.choose_schedule` would run the Gluon nvfp4 forward and, unless asked for
    explicitly, only at the head_dims of :data:`AUTO_HEAD_DIMS`; else ``"triton"``. An explicit
    ``"gluon"`` that cannot run raises ValueError."""
    check_schedule(schedule)
    if schedule is None and qf.shape[-1] not in AUTO_HEAD_DIMS:
        return note("triton")
    return choose_schedule(qf, kf, vf, schedule, config)


def gluon_attnqat_forward(q, k, v, *, sm_scale: float, config: dict | None = None):
    """(O bf16, O' float32, LSE₂, m₂) of the attnqat training forward for bf16 operands holding their
    NVFP4-dequantized values — what :func:`.attention_fwd.attention_forward` returns with
    ``p_mode=P_NVFP4, need_o2=True, store_stats=True``. ``config``: :data:`.gluon_fwd.CONFIG`
    overrides. Raises RuntimeError where Gluon or a Hopper GPU is missing or the inputs do not fit."""
    import torch  # noqa: PLC0415

    why = gluon_unsupported(q, k, v)
    if why is not None:
        raise RuntimeError(f"gluon_attnqat_forward cannot run: {why}")
    cfg = dict(CONFIG)
    cfg.update(config or {})
    B, Sq, H, D = q.shape
    o = torch.empty(B, Sq, H, D, device=q.device, dtype=torch.bfloat16)
    o2 = torch.empty(B, Sq, H, D, device=q.device, dtype=torch.float32)
    lse2 = torch.empty(B, H, Sq, device=q.device, dtype=torch.float32)
    m2 = torch.empty_like(lse2)
    grid = (triton.cdiv(Sq, BLOCK_M), B * H)
    gluon_attnqat_fwd_kernel[grid](
        tma_descriptor(q), tma_descriptor(k), tma_descriptor(v), o, o2, lse2, m2,
        o.stride(0), o.stride(1), o.stride(2), H, Sq, k.shape[1], sm_scale * LOG2E,
        D=D, STAGES=cfg["STAGES"], CONSUMER_REGS=cfg["CONSUMER_REGS"], LOADER_REGS=cfg["LOADER_REGS"],
        num_warps=4, maxnreg=cfg["MAXNREG"],
    )
    return o, o2, lse2, m2
