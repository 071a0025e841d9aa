"""The ``nvfp4`` and ``sage3`` attention forwards as a hand-scheduled Gluon kernel for Hopper (issue 17).

Same numerics as :func:`attention_fwd.attn_fwd_kernel` in mode ``P_NVFP4`` (formulation 0: Q, K, V
arrive as bf16 tensors holding their exact NVFP4-dequantized values; no O'; head_dim 64 or 128),
and in mode ``P_SAGE3`` on :func:`.sage3.sage3_prepare`'s operands, where sage3's correction row
q̄·K_sᵀ enters S as one more k-step of the S product (:func:`_issue_s`): the kernel reads it as three
bf16 parts (hi + mid + lo = the float32 row) that the producer loads with K_j.
The schedule is FlashAttention-3's, written out by hand because Triton 3.6 does not warp-specialize
the Triton kernel on sm_90 (docs/kernels_notes.md, "Closing the gap to cuDNN"):

* One CTA owns 128 queries of one (batch, head) and walks over key tiles of 128 keys (``KV_TILE``:
  the running maximum P̃ is quantized against is updated once per 128-key tile, as in the
  reference). It runs three partitions (``gl.warp_specialize``): two **consumer warpgroups** of 4
  warps, each owning 64 of the 128 query rows, and one **producer warp**.
* The producer issues TMA loads: Q once, then K_j and V_j into a ``STAGES``-deep shared-memory ring,
  each slot with a "ready" mbarrier (TMA transaction count) and an "empty" mbarrier that both
  consumers arrive on when their matrix multiplies have read the slot. The TMA descriptors are 4-D
  views of the (B, S, H, D) tensors with a [1, 128, 1, D] box, so the rows past the end of the
  sequence of *this* batch element are zero-filled by the hardware (never the next batch's rows).
* Each consumer pipelines its own key loop (intra-warpgroup overlap). Iteration j: wait for the
  PV group of tile j-2, issue S_j = Q K_jᵀ, rescale O by α_{j-1}, issue O += P̃ᶠ_{j-1} V_{j-1}, wait
  for S_j only, then run the softmax and the P quantizer of tile j while PV_{j-1} is still on the
  tensor cores. (FlashAttention-3 waits for PV at the end of the iteration instead; ptxas hoists a
  wgmma wait to the top of its basic block, which put that wait before the softmax and ended the
  overlap — seen in the SASS. At the top of the iteration, behind the mbarrier spin loops, the wait
  stays where it is written. ptxas also serializes every wgmma unless exactly one PV group is in
  flight at the loop head on every path, hence a zero product 0·V_0 before the loop.)
* The two consumers **ping-pong**: a pair of mbarriers hands the right to issue matrix multiplies
  back and forth, so that one warpgroup's softmax + quantizer overlaps the other one's MMAs.

Arithmetic, operation for operation as in the Triton kernel (the P quantizer is the Triton kernel's
own ``@triton.jit`` :func:`attention_fwd.quantize_p_blocks` — Gluon compiles its body with its own
semantics, which is how ``gl.max``/``gl.sum`` themselves are defined — so the E4M3 scale, the
reciprocal and the E2M1 rounding are the same operations in the same order, and the same rounding
decisions; at head_dim 128 rowmax(s) and amax₁₆ are taken from S's 16-key block maxima, the same
values, :func:`_softmax_tile`):

    s (fp32 wgmma, K-order as Triton's m64n128k16 chain; sage3: + 1·hi + 1·mid + 1·lo as a last
       k-step, where the Triton kernel adds the float32 row with an FADD);  tail keys ≥ Skv → −inf
    m_new = max(m, rowmax(s)·scale);  P̃ = exp2(s·scale − m_new);  α = exp2(m − m_new)
    l = l·α + rowsum(P̃);  P̃ᶠ = E2M1(P̃ · rcp(max(sc, 2⁻¹⁰)))·sc,  sc = E4M3(amax₁₆·(1/6))
                          (sage3: E2M1(P̃ · 6·rcp(amax₁₆))·E4M3(amax₁₆·448), 2688× too large)
    O = O·α + bf16(P̃ᶠ) V   (the rescale and product of tile j happen in iteration j+1; the
                             sequence of floating-point operations on O is the Triton kernel's)
    out = bf16(O · (1/l))   (sage3: bf16(O · (1/(l·2688))))

The accumulator layout is the Triton kernel's (wgmma m64n128k16, 4 warps per 64 rows, the same
thread ↔ element map), so the row reductions visit the same elements in the same order.

Status: on an H100 (Triton 3.6.0, 2026-11-24) its nvfp4 outputs are bit-identical to the Triton
kernel's, and its sage3 outputs within 1e-3 of them (bit-identical with the correction row zeroed;
tests/test_kernels_gluon.py, random and outlier-heavy inputs, ragged tiles, the Wan shape). At the
Wan 1.3B 480p shape: nvfp4 14.4 ms against the Triton kernel's 17.3–18.3, sage3 16.8–16.9 ms
(preparation included) against 22.7–22.8 (docs/benchmarks.md). ``backend="auto"`` runs it for
both wherever :func:`gluon_unsupported` accepts the operands (:func:`choose_schedule`). It also compiles
under Triton 3.9 (the two spellings of the TMA load and of the shared-memory reinterpretation are
picked at import); ``attnqat bench kernels --sass 90`` reads its machine code without a GPU
(:func:`.sass.gluon_report`).
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .attention_fwd import KV_TILE, P_NVFP4, P_SAGE3, quantize_p_blocks, quantize_p_rows
from .quantize import INTERPRET
from .receipt import note

try:  # Gluon is experimental: absent from older Triton builds
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    GLUON_IMPORT_ERROR: str | None = None
    # API renames after 3.6 (the GPU machine's version): both spellings are supported
    _PUBLIC_REINTERPRET: tl.constexpr = tl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
    _tma_async_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # a barrier among the calling partition's threads: gl.thread_barrier in 3.6, gl.barrier later
    _thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
except ImportError as _exc:  # pragma: no cover - depends on the installed Triton
    gluon = gl = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_init = warpgroup_mma_wait = None
    _thread_barrier = None
    TensorDescriptor = None
    GLUON_IMPORT_ERROR = f"{type(_exc).__name__}: {_exc}"

LOG2E = 1.4426950408889634
BLOCK_M = 128      # queries per CTA: two consumer warpgroups of 64 rows
BLOCK_N = 128      # keys per tile = KV_TILE, the running maximum's tile (fixed)
_BM: tl.constexpr = tl.constexpr(BLOCK_M)       # the same two, visible inside the kernels
_BN: tl.constexpr = tl.constexpr(BLOCK_N)
_P_NVFP4: tl.constexpr = tl.constexpr(P_NVFP4)    # the P quantizer's modes, visible inside the kernels
_P_SAGE3: tl.constexpr = tl.constexpr(P_SAGE3)
#: sage3's correction row enters S as one more k-step of the S product: A = [64, 16] with ones in its
#: first BIAS_PARTS columns, B = [16, 128] holding the row as BIAS_PARTS bf16 parts (hi, mid, lo),
#: the other rows zero-filled by the TMA unit
BIAS_PARTS = 3
BIAS_K = 16
_BIAS_PARTS: tl.constexpr = tl.constexpr(BIAS_PARTS)
_BIAS_K: tl.constexpr = tl.constexpr(BIAS_K)
HEAD_DIMS = (64, 128)
SCHEDULES = ("gluon", "triton")
assert BLOCK_N == KV_TILE.value, "the key tile is the running maximum's tile (KV_TILE = 128 keys)"
#: default launch: ring depth, registers of the second consumer and of the producer warp (the
#: first consumer, Gluon's "default partition", gets what is left of ``MAXNREG`` per warpgroup)
CONFIG = dict(STAGES=2, CONSUMER_REGS=240, LOADER_REGS=24, MAXNREG=168)


if gluon is not None:

    @gluon.constexpr_function
    def wgmma_layout(n):
        """The accumulator layout of one warpgroup's m64·n·k16 wgmma (4 warps along the rows): every
        [64, n] product tile of the Gluon kernels."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])

    @gluon.jit
    def _softmax_tile(s, m_i, l_i, start_n, Skv, qk_scale, s_layout: gl.constexpr,
                      BM: gl.constexpr, BN: gl.constexpr, P_MODE: gl.constexpr, D: gl.constexpr):
        """Online softmax of one key tile and the P quantizer of ``P_MODE`` (nvfp4, or sage3's
        two-level one, 2688× too large); returns (m, l, α, P̃ᶠ fp32, P̃). At head_dim ``D`` 128, S is
        reduced per 16-key block first (the same values; see below); at 64 not (an earlier
        arrangement of it gave wrong outputs there on the H100, cause not found;
        docs/kernels_notes.md "Block maxima of S first")."""
        if start_n + BN > Skv:  # the ragged last tile: keys beyond Skv masked out
            offs_n = start_n + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
            s = gl.where((offs_n < Skv)[None, :], s, float("-inf"))
        if D == 128:
            # the maxima of S per 16-key block first: the row maximum is their maximum (the same
            # value), and P̃'s block maxima are exp2(bmax·scale − m): FFMA and exp2 are monotone
            # non-decreasing, so max_k exp2(s_k·scale − m) = exp2(max_k s_k·scale − m) bit for bit
            # (ex2.approx.ftz checked over every float on the H100, docs/kernels_notes.md). Fewer
            # instructions than two reductions of their own, and the quantizer's scales no longer
            # wait for the last exponential.
            bmax = gl.max(gl.reshape(s, [BM, BN // 16, 16]), 2)
            m_new = gl.maximum(m_i, gl.convert_layout(gl.max(bmax, 1), m_i.type.layout) * qk_scale)
            p = gl.exp2(s * qk_scale - m_new[:, None])
            m_b = gl.convert_layout(m_new, gl.SliceLayout(1, bmax.type.layout))
            amax = gl.exp2(bmax * qk_scale - m_b[:, None])
            pq = gl.reshape(quantize_p_blocks(gl.reshape(p, [BM, BN // 16, 16]), amax, P_MODE), [BM, BN])
        else:
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            p = gl.exp2(s * qk_scale - m_new[:, None])
            pq = quantize_p_rows(p, BM, BN, P_MODE)
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        return m_new, l_i, alpha, pq, p

    @gluon.jit
    def _turn_wait(turn, WG: gl.constexpr, event):
        """Ping-pong: wait until this warpgroup may issue its ``event``-th group of MMAs. The
        warpgroups alternate strictly (0, 1, 0, 1, …); a fresh mbarrier counts as having completed
        the phase before phase 0, so warpgroup 0 passes its first wait at once."""
        mbarrier.wait(turn.index(WG), (event & 1) ^ (1 - WG))

    @gluon.jit
    def _turn_pass(turn, WG: gl.constexpr):
        """Ping-pong: hand the MMA issue slot to the other warpgroup (after issuing, not after
        completion: the tensor cores execute the groups in issue order)."""
        mbarrier.arrive(turn.index(1 - WG), count=1)

    @gluon.jit
    def _issue_s(q, k_tile, bias_tile, ones, s_init, HAS_BIAS: gl.constexpr):
        """Issue S_j = Q K_jᵀ as asynchronous wgmma; sage3 (HAS_BIAS): plus its correction row as
        one more k-step, ones[64, 16] · bias_tile[16, 128] = hi + mid + lo of each key's
        correction, accumulated onto Q K_jᵀ in float32 (the Triton kernel adds the float32 row after
        the product: the same sum, rounded by the tensor core instead of FADD)."""
        s_tok = warpgroup_mma(q, k_tile.permute((1, 0)), s_init, use_acc=False, is_async=True)
        if HAS_BIAS:
            s_tok = warpgroup_mma(ones, bias_tile, s_tok, is_async=True)
        return s_tok

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, b_smem, ones, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                  O, sob, sos, soh, b, h, m0, Sq, Skv, qk_scale,
                  WG: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, P_MODE: gl.constexpr,
                  HAS_BIAS: gl.constexpr):
        """One consumer warpgroup: query rows [m0 + 64·WG, m0 + 64·WG + 64). ``b_smem``: sage3's
        correction tiles (HAS_BIAS), else a placeholder never read."""
        HM: gl.constexpr = _BM // 2
        BN: gl.constexpr = _BN
        s_layout: gl.constexpr = wgmma_layout(BN)
        o_layout: gl.constexpr = wgmma_layout(D)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        m_i = gl.full([HM], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([HM], gl.float32, layout=gl.SliceLayout(1, s_layout))
        s_init = gl.zeros([HM, BN], gl.float32, layout=s_layout)   # ignored (use_acc=False)
        n_tiles = gl.cdiv(Skv, BN)
        mbarrier.wait(q_bar, 0)
        q = q_smem.slice(WG * HM, HM)                                 # [64, D]

        # prologue: S_0 and its softmax
        mbarrier.wait(k_ready.index(0), 0)
        _turn_wait(turn, WG, 0)
        s_tok = _issue_s(q, k_smem.index(0), b_smem.index(0), ones, s_init, HAS_BIAS)
        _turn_pass(turn, WG)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
        mbarrier.arrive(k_empty.index(0), count=1)
        m_i, l_i, alpha, pq, _ = _softmax_tile(s, m_i, l_i, 0, Skv, qk_scale, s_layout, HM, BN, P_MODE, D)
        p_next = gl.convert_layout(pq.to(gl.bfloat16), p_layout)   # exact: ≤ 6 significant bits
        # Exactly one PV group is in flight at the top of every iteration (ptxas serializes all
        # wgmma otherwise): before the first, a zero product 0·V_0 stands in for PV_{-1}. (0·V_0 = 0
        # exactly for finite V_0; a non-finite V_0 makes the output non-finite in both kernels.)
        mbarrier.wait(v_ready.index(0), 0)
        acc_tok = warpgroup_mma(gl.zeros([HM, BN], gl.bfloat16, layout=p_layout), v_smem.index(0),
                                gl.zeros([HM, D], gl.float32, layout=o_layout), use_acc=False, is_async=True)

        # Iteration j: wait for PV_{j-2}; issue S_j; O = O·α_{j-1}; issue PV_{j-1}; wait for S_j;
        # softmax + quantizer of tile j while PV_{j-1} runs. The PV wait sits at the top of the
        # iteration, after the mbarrier spin loops: ptxas hoists a wgmma wait to the top of its basic
        # block, so a wait placed after the softmax (FlashAttention-3's order) ends the overlap.
        for j in range(1, n_tiles):
            stage = j % STAGES
            pstage = (j - 1) % STAGES
            mbarrier.wait(k_ready.index(stage), (j // STAGES) & 1)
            mbarrier.wait(v_ready.index(pstage), ((j - 1) // STAGES) & 1)
            _turn_wait(turn, WG, j)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc_tok])             # PV_{j-2}
            mbarrier.arrive(v_empty.index((j + STAGES - 2) % STAGES), count=1, pred=j >= 2)
            s_tok = _issue_s(q, k_smem.index(stage), b_smem.index(stage), ones, s_init, HAS_BIAS)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            acc_tok = warpgroup_mma(p_next, v_smem.index(pstage), acc, is_async=True)  # PV_{j-1}
            _turn_pass(turn, WG)
            s = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])                   # S_j
            mbarrier.arrive(k_empty.index(stage), count=1)
            m_i, l_i, alpha, pq, _ = _softmax_tile(s, m_i, l_i, j * BN, Skv, qk_scale, s_layout, HM, BN, P_MODE, D)
            p_next = gl.convert_layout(pq.to(gl.bfloat16), p_layout)

        # epilogue: the last P̃ᶠ V
        last = n_tiles - 1
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        _turn_wait(turn, WG, n_tiles)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc_tok])
        mbarrier.arrive(v_empty.index((last + STAGES - 1) % STAGES), count=1, pred=last >= 1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        acc_tok = warpgroup_mma(p_next, v_smem.index(last % STAGES), acc, is_async=True)
        _turn_pass(turn, WG)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc_tok])
        mbarrier.arrive(v_empty.index(last % STAGES), count=1)

        if P_MODE == _P_SAGE3:
            inv_l = 1.0 / (l_i * 2688.0)  # sage3's level-1 scale, kept out of P̃ᶠ (the Triton epilogue's)
        else:
            inv_l = 1.0 / l_i
        out = (acc * gl.convert_layout(inv_l, row_o)[:, None]).to(gl.bfloat16)
        offs_m = m0 + WG * HM + gl.arange(0, HM, layout=row_o)
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        base = O + b.to(gl.int64) * sob + h.to(gl.int64) * soh
        gl.store(base + offs_m[:, None] * sos + offs_d[None, :], out, mask=(offs_m < Sq)[:, None])

    @gluon.jit
    def _tma_load(desc, coord, bar, buf):
        """TMA load of the descriptor's box at ``coord`` into ``buf`` (the box without its unit dims)."""
        _tma_async_load(desc, coord, bar, _as_box(buf, desc))   # 3.6: async_copy_global_to_shared

    @gluon.jit
    def _as_box(buf, desc):
        """A [128, D] buffer seen as the descriptor's [1, 128, 1, D] box (the same bytes and swizzle)."""
        if _PUBLIC_REINTERPRET:   # triton ≥ 3.7 (3.6 names it _reinterpret)
            return buf.reinterpret(desc.dtype, desc.block_type.shape, desc.layout)
        else:
            return buf._reinterpret(desc.dtype, desc.block_type.shape, desc.layout)

    @gluon.jit
    def _loader(q_desc, k_desc, v_desc, b_desc, q_smem, k_smem, v_smem, b_smem, q_bar, k_ready, k_empty,
                v_ready, v_empty, b, h, m0, bias_row, Skv, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr):
        """The producer warp: Q once, then K_j (sage3: with its correction tile, on K_j's barriers)
        and V_j through the ring (TMA, zero-filled past Skv)."""
        BN: gl.constexpr = _BN
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        _tma_load(q_desc, [b, m0, h, 0], q_bar, q_smem)
        # K_{j+1} is issued before V_j: V slots are released half an iteration later than K slots
        # (after PV, not after S), and K_{j+1} must not queue behind them
        n_tiles = gl.cdiv(Skv, BN)
        _load_k_tile(k_desc, k_smem, b_desc, b_smem, k_ready, k_empty, b, h, bias_row, 0, STAGES, HAS_BIAS)
        for j in range(n_tiles):
            if j + 1 < n_tiles:
                _load_k_tile(k_desc, k_smem, b_desc, b_smem, k_ready, k_empty, b, h, bias_row, j + 1, STAGES,
                             HAS_BIAS)
            _load_tile(v_desc, v_smem, v_ready, v_empty, b, h, j, STAGES)

    @gluon.jit
    def _load_k_tile(k_desc, k_smem, b_desc, b_smem, ready, empty, b, h, bias_row, j, STAGES: gl.constexpr,
                     HAS_BIAS: gl.constexpr):
        """K_j; sage3 (HAS_BIAS): and its correction tile [16 (3 parts, the rest zero-filled), 128]
        from row ``bias_row`` of the (B·H·⌈Sq/128⌉, 3, Skv') parts tensor, on the same barrier."""
        if HAS_BIAS:
            stage = j % STAGES
            mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(stage), k_desc.block_type.nbytes + b_desc.block_type.nbytes)
            _tma_load(k_desc, [b, j * _BN, h, 0], ready.index(stage), k_smem.index(stage))
            _tma_load(b_desc, [bias_row, 0, j * _BN], ready.index(stage), b_smem.index(stage))
        else:
            _load_tile(k_desc, k_smem, ready, empty, b, h, j, STAGES)

    @gluon.jit
    def _load_tile(desc, bufs, ready, empty, b, h, j, STAGES: gl.constexpr):
        """TMA load of key tile j into ring slot j % STAGES, once both consumers released it."""
        stage = j % STAGES
        mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
        mbarrier.expect(ready.index(stage), desc.block_type.nbytes)
        _tma_load(desc, [b, j * _BN, h, 0], ready.index(stage), bufs.index(stage))

    @gluon.jit
    def gluon_attn_fwd_kernel(q_desc, k_desc, v_desc, O, sob, sos, soh, H, Sq, Skv, qk_scale,
                              D: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                              LOADER_REGS: gl.constexpr):
        """The ``nvfp4`` forward. Grid (cdiv(Sq, 128), B·H), ``num_warps=4`` (+ 4 + 1 worker warps).
        Q/K/V descriptors: (B, S, H, D) views with a [1, 128, 1, D] box; O: (B, Sq, H, D) bf16 with
        head_dim stride 1."""
        _attn_fwd(q_desc, k_desc, v_desc, k_desc, O, sob, sos, soh, H, Sq, Skv, qk_scale,
                  D, STAGES, CONSUMER_REGS, LOADER_REGS, _P_NVFP4, False)

    @gluon.jit
    def gluon_sage3_fwd_kernel(q_desc, k_desc, v_desc, b_desc, O, sob, sos, soh, H, Sq, Skv, qk_scale,
                               D: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                               LOADER_REGS: gl.constexpr):
        """The ``sage3`` forward: :func:`gluon_attn_fwd_kernel`'s launch plus ``b_desc``, a 3-D
        descriptor of the correction's bf16 parts (B·H·⌈Sq/128⌉, 3, Skv rounded up to 8) with a
        [1, 16, 128] box (:func:`.sage3.sage3_prepare` with ``bias_parts=True``). A kernel of its own
        rather than flags on one: the nvfp4 kernel's signature and machine code stay as they were."""
        _attn_fwd(q_desc, k_desc, v_desc, b_desc, O, sob, sos, soh, H, Sq, Skv, qk_scale,
                  D, STAGES, CONSUMER_REGS, LOADER_REGS, _P_SAGE3, True)

    @gluon.jit
    def _ring_barriers(STAGES: gl.constexpr):
        """The forwards' mbarriers, initialized: Q's; ready / empty of each K and V ring slot (both
        consumers release a slot); the ping-pong pair. Returns (q_bar, k_ready, k_empty, v_ready,
        v_empty, turn)."""
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)   # both consumers release a slot
            mbarrier.init(v_empty.index(i), count=2)
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        return q_bar, k_ready, k_empty, v_ready, v_empty, turn

    @gluon.jit
    def _batch_head(bh, H):
        """(batch, head) of the grid's axis-1 index ``bh`` = batch·H + head (every Gluon kernel's grid)."""
        return bh // H, bh % H

    @gluon.jit
    def _qkv_smem(D: gl.constexpr, STAGES: gl.constexpr):
        """The forwards' shared-memory tiles: Q (128 rows) and the K/V ring (STAGES slots of 128
        keys), bf16 in the MMAs' swizzled layout (the TMA writes them through 4-D views of the same
        bytes). Returns (q_smem, k_smem, v_smem)."""
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BN, D], gl.bfloat16)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [_BM, D], layout)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, _BN, D], layout)
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, _BN, D], layout)
        return q_smem, k_smem, v_smem

    @gluon.jit
    def _attn_fwd(q_desc, k_desc, v_desc, b_desc, O, sob, sos, soh, H, Sq, Skv, qk_scale,
                  D: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                  LOADER_REGS: gl.constexpr, P_MODE: gl.constexpr, HAS_BIAS: gl.constexpr):
        """Both kernels' body: shared memory, barriers and the three partitions (without HAS_BIAS,
        ``b_desc`` is a placeholder never read)."""
        gl.static_assert(D == 64 or D == 128, "head_dim must be 64 or 128")
        pid_m = gl.program_id(0)
        bh = gl.program_id(1)
        b, h = _batch_head(bh, H)
        m0 = pid_m * _BM
        # sage3: the CTA's 128 queries are one smoothing block, whose correction is parts row
        # bh·⌈Sq/128⌉ + pid_m
        bias_row = bh * gl.num_programs(0) + pid_m

        q_smem, k_smem, v_smem = _qkv_smem(D, STAGES)
        if HAS_BIAS:
            b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BIAS_K, _BN], gl.bfloat16)
            b_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, _BIAS_K, _BN], b_layout)
            # the A operand of the correction's k-step, [64, 16] with ones in the first 3 columns,
            # in shared memory (a register operand there made newer ptxas serialize every wgmma)
            one_layout: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0])
            part = gl.arange(0, _BIAS_K, layout=gl.SliceLayout(0, one_layout))
            ones_val = gl.where((part < _BIAS_PARTS)[None, :],
                                gl.full([_BM // 2, _BIAS_K], 1.0, gl.bfloat16, one_layout),
                                gl.zeros([_BM // 2, _BIAS_K], gl.bfloat16, one_layout))
            ones = gl.allocate_shared_memory(gl.bfloat16, [_BM // 2, _BIAS_K],
                                             gl.NVMMASharedLayout.get_default_for([_BM // 2, _BIAS_K], gl.bfloat16),
                                             ones_val)
            fence_async_shared()
        else:
            b_smem = k_smem   # placeholders, never read
            ones = q_smem

        q_bar, k_ready, k_empty, v_ready, v_empty, turn = _ring_barriers(STAGES)

        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, b_smem, ones, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                         O, sob, sos, soh, b, h, m0, Sq, Skv, qk_scale, 0, D, STAGES, P_MODE, HAS_BIAS)),
            (_consumer, (q_smem, k_smem, v_smem, b_smem, ones, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                         O, sob, sos, soh, b, h, m0, Sq, Skv, qk_scale, 1, D, STAGES, P_MODE, HAS_BIAS)),
            (_loader, (q_desc, k_desc, v_desc, b_desc, q_smem, k_smem, v_smem, b_smem, q_bar, k_ready, k_empty,
                       v_ready, v_empty, b, h, m0, bias_row, Skv, STAGES, HAS_BIAS)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------

def gluon_unavailable(device=None) -> str | None:
    """None when the Gluon forward can run on ``device`` (default: the current CUDA device): Gluon
    importable and a Hopper (sm_90) GPU; else why not."""
    if GLUON_IMPORT_ERROR is not None:
        return f"triton {triton.__version__} has no usable Gluon ({GLUON_IMPORT_ERROR})"
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        return "no CUDA device"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return f"the Gluon forward is written for Hopper (sm_90); this device is sm_{cap[0]}{cap[1]}"
    return None


@functools.lru_cache(maxsize=None)
def _box_layout(box: tuple[int, ...]):
    """The shared-memory layout of a bf16 TMA box (the same object for every launch: building it
    took two thirds of a descriptor's host time, ~6 of 9 µs)."""
    return gl.NVMMASharedLayout.get_default_for(list(box), gl.bfloat16)


def tma_descriptor(t, rows: int = BLOCK_N):
    """4-D TMA descriptor of a (B, S, H, D) bf16 tensor with a [1, rows, 1, D] box."""
    box = (1, rows, 1, t.shape[3])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(box), _box_layout(box))


def tma_unaddressable(name: str, t) -> str | None:
    """Why the TMA unit cannot read (B, S, H, D) tensor ``t`` through :func:`tma_descriptor`, or None:
    it needs unit stride along head_dim and every other stride and the base 16-byte aligned."""
    if t.stride(3) != 1 or any(s % 8 for s in t.stride()[:3]) or t.data_ptr() % 16:
        return (f"{name} (strides {tuple(t.stride())}) is not TMA-addressable: head_dim must be "
                "contiguous and the other strides multiples of 8 elements (call .contiguous() first)")
    return None


def bias_descriptor(parts):
    """3-D TMA descriptor of sage3's correction parts (rows, 3, Skv'), box [1, 16, 128]: the rows
    past the 3 parts and the keys past Skv' are zero-filled by the TMA unit."""
    box = (1, BIAS_K, BLOCK_N)
    return TensorDescriptor(parts, list(parts.shape), list(parts.stride()), list(box), _box_layout(box))


def gluon_unsupported(q, k, v) -> str | None:
    """None when :func:`gluon_attention_forward` runs these operands here, else why not (one sentence)."""
    import torch  # noqa: PLC0415

    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            return f"{name} must be (batch, seq, heads, head_dim), got shape {tuple(t.shape)}"
        if t.dtype != torch.bfloat16:
            return f"{name} is {t.dtype}; the Gluon forward takes bfloat16 operands"
        if not t.is_cuda:
            return f"{name} is on {t.device.type}; the Gluon forward needs CUDA tensors"
        if why := tma_unaddressable(name, t):
            return why
    B, _, H, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2] != H or k.shape[3] != D:
        return f"shapes differ: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if D not in HEAD_DIMS:
        return f"head_dim {D} is not supported (64 or 128)"
    if min(q.shape) == 0 or k.shape[1] == 0:
        return f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}"
    return gluon_unavailable(q.device)


def bias_parts_shape(B: int, H: int, Sq: int, Skv: int) -> tuple[int, int, int]:
    """Shape of sage3's correction as the Gluon kernel reads it: one row of 3 bf16 parts (hi, mid,
    lo: float32's 24 bits) per (batch, head, 128-query block) and key, keys padded to a multiple
    of 8 (TMA row strides are multiples of 16 bytes)."""
    return (B * H * triton.cdiv(Sq, BLOCK_M), BIAS_PARTS, triton.cdiv(Skv, 8) * 8)


def _bias_unsupported(q, k, p_mode: int, bias) -> str | None:
    """Why ``p_mode`` and ``bias`` are not one of the two methods the kernel computes, or None:
    ``nvfp4`` without a bias; ``sage3`` with its correction in :func:`bias_parts_shape` form."""
    import torch  # noqa: PLC0415

    if p_mode not in (P_NVFP4, P_SAGE3):
        return f"p_mode {p_mode!r} is neither nvfp4 ({P_NVFP4}) nor sage3 ({P_SAGE3})"
    if p_mode == P_NVFP4:
        return None if bias is None else f"nvfp4 (p_mode {P_NVFP4}) takes no bias"
    if not isinstance(bias, torch.Tensor):
        return (f"sage3 (p_mode {P_SAGE3}) needs its correction as bf16 parts "
                f"(sage3_prepare(..., bias_parts=True)), got {type(bias).__name__}")
    B, Sq, H, _ = q.shape
    want = bias_parts_shape(B, H, Sq, k.shape[1])
    if bias.dtype != torch.bfloat16 or tuple(bias.shape) != want:
        return (f"sage3's correction must be bf16 parts of shape {want} (sage3_prepare(..., "
                f"bias_parts=True)), got {bias.dtype} {tuple(bias.shape)}")
    if bias.device != q.device or not bias.is_contiguous():
        return f"sage3's correction must be contiguous on {q.device}"
    return None


def check_schedule(schedule) -> None:
    """ValueError unless ``schedule`` is one of :data:`SCHEDULES` or None."""
    if schedule not in (None, *SCHEDULES):
        raise ValueError(f"schedule must be one of {SCHEDULES} or None (fastest here), got {schedule!r}")


def choose_schedule(qf, kf, vf, schedule: str | None, config) -> str:
    """Which kernel runs a forward on prepared operands (``nvfp4`` formulation 0, or ``sage3``):
    ``"gluon"`` (this module's kernel: on an H100 faster, docs/benchmarks.md) wherever it takes the
    operands, else ``"triton"``. Tile overrides (``config``) are the Triton kernel's, so they select
    it; so does the Triton interpreter. An explicit ``"gluon"`` that cannot run raises ValueError
    instead of silently running the other kernel."""
    check_schedule(schedule)
    if schedule == "triton" or (schedule is None and (config is not None or INTERPRET.value)):
        return note("triton")
    why = gluon_unsupported(qf, kf, vf)
    if why is None:
        return note("gluon")
    if schedule == "gluon":
        raise ValueError(f"the Gluon forward cannot run these inputs: {why}")
    return note("triton")


def gluon_attention_forward(q, k, v, *, sm_scale: float, p_mode: int = P_NVFP4, bias=None,
                            config: dict | None = None):
    """O (bf16, (B, Sq, H, D)) of the ``nvfp4`` forward (``p_mode=P_NVFP4``) or of the ``sage3``
    forward (``p_mode=P_SAGE3``, ``bias`` = the correction's bf16 parts) for bf16 operands that
    already hold their quantized values (the NVFP4-dequantized Q, K, V or those of
    :func:`.sage3.sage3_prepare`), as the Triton kernel's ``attention_forward(q, k, v, sm_scale=…,
    p_mode=…, bias=…)[0]`` (which takes the float32 correction). ``config``: :data:`CONFIG`
    overrides. Raises RuntimeError where Gluon or a Hopper GPU is missing, or the inputs do not fit."""
    import torch  # noqa: PLC0415

    why = gluon_unsupported(q, k, v) or _bias_unsupported(q, k, p_mode, bias)
    if why is not None:
        raise RuntimeError(f"gluon_attention_forward cannot run: {why}")
    cfg = dict(CONFIG)
    cfg.update(config or {})
    B, Sq, H, D = q.shape
    Skv = k.shape[1]
    o = torch.empty(B, Sq, H, D, device=q.device, dtype=torch.bfloat16)
    grid = (triton.cdiv(Sq, BLOCK_M), B * H)
    descs = (tma_descriptor(q), tma_descriptor(k), tma_descriptor(v))
    if bias is not None:
        descs += (bias_descriptor(bias),)
    kernel = gluon_sage3_fwd_kernel if bias is not None else gluon_attn_fwd_kernel
    kernel[grid](
        *descs, o, o.stride(0), o.stride(1), o.stride(2), H, Sq, Skv, sm_scale * LOG2E,
        D=D, STAGES=cfg["STAGES"], CONSUMER_REGS=cfg["CONSUMER_REGS"], LOADER_REGS=cfg["LOADER_REGS"],
        num_warps=4, maxnreg=cfg["MAXNREG"],
    )
    return o
