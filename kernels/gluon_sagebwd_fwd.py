"""The ``sagebwd`` forward hand-scheduled in Gluon for Hopper (issue 33): INT8 wgmma for both
products, a producer warp feeding TMA rings, two consumer warpgroups a CTA.

The same quantities as :func:`.sagebwd._fwd_kernel` from the same INT8 operands
(:func:`.sagebwd.quantize`'s codes and scales; docs/numerics.md), operation for operation (bit for
bit on an H200: tests/test_sagebwd_gpu.py):

    a = int32 → float32 of S = Q₈·K₈ᵀ;  keys ≥ Skv → −inf;  c = (s_Q·s_K)·scale·log2e
    t_max = rowmax(a)·c;  m' = max(m, t_max);  e = exp2(a·c − (t_max − log2 127))
    P̃ = rne(e) (INT8);  s_P = exp2(t_max − m')/127;  α = exp2(m − m');  l = l·α + s_P·Σe
    O = O·α + (bits(P̃·V₈ + 1.5·2²³)·w − 1.5·2²³·w),  w = s_P·s_V
    out = O / l;  LSE₂ = m + log2 l (padded queries: +inf)

* One CTA owns 128 queries (one Q scale block) of one (batch, head): two consumer warpgroups of 64
  rows, key tiles of 128 keys (the K/V scale block and the definition's key tile).
* The producer warp loads Q₈ once, then K₈_j and V₈ᵀ_j ((B·H·D, Skp), keys contiguous: INT8 wgmma
  wants both operands K-major) into ``STAGES``-deep rings. The INT8 copies are padded with zero
  codes to a multiple of 128 tokens, so no load crosses into another (batch, head).
* An INT8 product is an int32 tile that is scaled into the float32 accumulator with its tile's own
  scales, so iteration j of a warpgroup issues S_j = Q·K_jᵀ and the previous tile's P̃_{j−1}·V_{j−1}
  together, waits for both, folds P̃V_{j−1} into O and runs tile j's softmax and quantizer; the
  other warpgroup's products run on the tensor cores meanwhile. Products never stay in flight
  across iterations (ptxas serializes every wgmma otherwise, its C7514). P̃'s codes go through a
  shared tile of the warpgroup; read as the register A operand of P̃·V instead, with V₈ᵀ's keys
  permuted as the dV launch permutes dO's queries (:func:`.gluon_sagebwd._a_operand`), the forward
  measured slower: 9.82 against 9.25 ms (H200, 2026-11-28). The ragged last key tile has an
  iteration of its own: the others skip the mask's compare and select.
* S's int32 → float32 by the conversion instruction (I2FP on sm_90, one ALU instruction, exact
  below 2^24) rather than the two-instruction magic add the Triton kernel uses: bit for bit the
  same, 9.25 / 9.32 against 9.55 / 9.63 ms (H200, Wan 1.3B 480p, 2026-11-28, two rounds).

Measured on an H200 (Wan 1.3B 480p, 2026-11-28, docs/benchmarks.md "The Gluon forward"): 9.2 ms
against the Triton kernel's 10.4 (quantization included). Slower, and removed: the two warpgroups
taking turns to issue their products (:mod:`.gluon_fwd`'s ping-pong; 9.7 against 9.4 ms at 3
stages); waiting for S_j alone, so that the softmax runs while P̃V_{j−1} does (codes in two tiles a
warpgroup; 9.9 ms); three consumer warpgroups of 160 registers, each issuing P̃V_{j−1} and S_j one
after the other so that one int32 tile is live at a time (10.3–11.3 ms).
"""

from __future__ import annotations

from .gluon_fwd import (
    _BM,
    _BN,
    CONFIG as _FWD_CONFIG,
    _batch_head,
    _ring_barriers,
    _tma_async_load,
    gl,
    gluon,
    gluon_unavailable,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from .gluon_sagebwd import HEAD_DIMS, _acc_layout, _int8_descriptor, _store_codes
from .sagebwd import fold_pv, p_codes

#: default launch: ring depth, registers of the second consumer and of the producer warp, the
#: launch's cap (:data:`.gluon_fwd.CONFIG`'s split: 9 warps padded to 12 × 168 registers). H200,
#: Wan 1.3B 480p, 2026-11-28: 4 stages 9.17 ms, 3 stages 9.40, 2 stages 9.25 (docs/benchmarks.md)
CONFIG = dict(_FWD_CONFIG, STAGES=4)


if gluon is not None:

    @gluon.jit
    def _softmax(s, m_i, l_i, c, sv, start_n, Skv, s_layout: gl.constexpr, MASK: gl.constexpr):
        """Tile j's online softmax and P̃'s codes from its int32 scores: returns (codes, m, l, α, w =
        s_P·s_V), the Triton kernel's own arithmetic (:func:`.sagebwd.p_codes`). ``MASK``: the ragged
        last tile, keys beyond Skv out (the other tiles skip its compare and select, two instructions
        an element)."""
        a = s.to(gl.float32)   # I2FP: exact (|S| < 2^24), one instruction (module docstring)
        if MASK:
            offs_n = start_n + gl.arange(0, _BN, layout=gl.SliceLayout(0, s_layout))
            a = gl.where((offs_n < Skv)[None, :], a, float("-inf"))
        codes, m_new, l_i, alpha, s_p = p_codes(a, m_i, l_i, c)
        return codes, m_new, l_i, alpha, s_p * sv

    @gluon.jit
    def _fold(acc, pv, alpha, w, row_o: gl.constexpr):
        """O·α + (P̃·V)·w (:func:`.sagebwd.fold_pv`), α and w moved to the accumulator's rows."""
        return fold_pv(acc, pv, gl.convert_layout(alpha, row_o), gl.convert_layout(w, row_o))

    @gluon.jit
    def _step(j, q, k_smem, v_smem, buf, k_ready, k_empty, v_ready, v_empty, zero_s, zero_o, acc, m_i, l_i, alpha, w,
              SK, SV, sq, qk, Skv, STAGES: gl.constexpr, s_layout: gl.constexpr, row_o: gl.constexpr,
              MASK: gl.constexpr):
        """Iteration j ≥ 1: issue S_j and P̃_{j−1}·V_{j−1}; wait for both; fold P̃V_{j−1} into O;
        tile j's softmax and codes (its scales loaded while the products run). Returns (O, m, l,
        α_j, w_j)."""
        stage = j % STAGES
        pstage = (j - 1) % STAGES
        sk = gl.load(SK + j)
        sv = gl.load(SV + j)
        mbarrier.wait(k_ready.index(stage), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index(pstage), ((j - 1) // STAGES) & 1)
        s_tok = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        pv_tok = warpgroup_mma(buf, v_smem.index(pstage).permute((1, 0)), zero_o, use_acc=False, is_async=True)
        s, pv = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok, pv_tok])
        mbarrier.arrive(k_empty.index(stage), count=1)
        mbarrier.arrive(v_empty.index(pstage), count=1)
        acc = _fold(acc, pv, alpha, w, row_o)
        codes, m_i, l_i, alpha, w = _softmax(s, m_i, l_i, (sq * sk) * qk, sv, j * _BN, Skv, s_layout, MASK)
        _store_codes(codes, buf)
        return acc, m_i, l_i, alpha, w

    @gluon.jit
    def _fwd_consumer(q_smem, k_smem, v_smem, p_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                      O, sob, sos, soh, LSE2, SK, SV, sq, b, h, m0, Sq, Skv, qk,
                      WG: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, STORE_LSE: gl.constexpr):
        """Consumer warpgroup WG: queries [m0 + 64·WG, m0 + 64·WG + 64)."""
        HM: gl.constexpr = _BM // 2
        s_layout: gl.constexpr = _acc_layout(4, _BN)
        o_layout: gl.constexpr = _acc_layout(4, D)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        m_i = gl.full([HM], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([HM], gl.float32, layout=gl.SliceLayout(1, s_layout))
        zero_s = gl.zeros([HM, _BN], gl.int32, layout=s_layout)     # ignored (use_acc=False)
        zero_o = gl.zeros([HM, D], gl.int32, layout=o_layout)
        acc = gl.zeros([HM, D], gl.float32, layout=o_layout)
        n_tiles = gl.cdiv(Skv, _BN)
        buf = p_smem.index(WG)
        sk = gl.load(SK)
        sv = gl.load(SV)
        mbarrier.wait(q_bar, 0)
        q = q_smem.slice(WG * HM, HM)                                  # [64, D]

        # prologue: S_0, its softmax, P̃_0's codes into this warpgroup's tile
        mbarrier.wait(k_ready.index(0), 0)
        s_tok = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
        mbarrier.arrive(k_empty.index(0), count=1)
        if Skv < _BN:
            codes, m_i, l_i, alpha, w = _softmax(s, m_i, l_i, (sq * sk) * qk, sv, 0, Skv, s_layout, True)
        else:
            codes, m_i, l_i, alpha, w = _softmax(s, m_i, l_i, (sq * sk) * qk, sv, 0, Skv, s_layout, False)
        _store_codes(codes, buf)

        # the full tiles, then the ragged last one (keys beyond Skv masked)
        ragged = Skv % _BN != 0
        for j in range(1, n_tiles - ragged.to(gl.int32)):
            acc, m_i, l_i, alpha, w = _step(j, q, k_smem, v_smem, buf, k_ready, k_empty, v_ready, v_empty, zero_s,
                                            zero_o, acc, m_i, l_i, alpha, w, SK, SV, sq, qk, Skv, STAGES, s_layout,
                                            row_o, False)
        if ragged and n_tiles > 1:
            acc, m_i, l_i, alpha, w = _step(n_tiles - 1, q, k_smem, v_smem, buf, k_ready, k_empty, v_ready, v_empty,
                                            zero_s, zero_o, acc, m_i, l_i, alpha, w, SK, SV, sq, qk, Skv, STAGES,
                                            s_layout, row_o, True)

        # epilogue: the last P̃·V
        last = n_tiles - 1
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        pv_tok = warpgroup_mma(buf, v_smem.index(last % STAGES).permute((1, 0)), zero_o, use_acc=False,
                               is_async=True)
        pv = warpgroup_mma_wait(num_outstanding=0, deps=[pv_tok])
        mbarrier.arrive(v_empty.index(last % STAGES), count=1)
        acc = _fold(acc, pv, alpha, w, row_o)

        offs_m = m0 + WG * HM + gl.arange(0, HM, layout=row_o)
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        out = acc / gl.convert_layout(l_i, row_o)[:, None]
        base = O + b.to(gl.int64) * sob + h.to(gl.int64) * soh
        gl.store(base + offs_m[:, None] * sos + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=(offs_m < Sq)[:, None])
        if STORE_LSE:
            rows = m0 + WG * HM + gl.arange(0, HM, layout=gl.SliceLayout(1, s_layout))
            gl.store(LSE2 + rows, gl.where(rows < Sq, m_i + gl.log2(l_i), float("inf")))

    @gluon.jit
    def _ring_load(desc, coord, bufs, ready, empty, j, STAGES: gl.constexpr):
        """TMA load of tile j into ring slot j % STAGES, once both consumers released it."""
        stage = j % STAGES
        mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)   # a fresh barrier passes phase 1
        mbarrier.expect(ready.index(stage), desc.block_type.nbytes)
        _tma_async_load(desc, coord, ready.index(stage), bufs.index(stage))

    @gluon.jit
    def _fwd_loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                    q_row, k_row, vt_row, Skv, STAGES: gl.constexpr):
        """The producer warp: Q₈ once, then K₈_j and V₈ᵀ_j through the rings (K_{j+1} ahead of V_j:
        V slots are released with the next tile's S, K slots a tile earlier)."""
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        _tma_async_load(q_desc, [q_row, 0], q_bar, q_smem)
        n_tiles = gl.cdiv(Skv, _BN)
        _ring_load(k_desc, [k_row, 0], k_smem, k_ready, k_empty, 0, STAGES)
        for j in range(n_tiles):
            if j + 1 < n_tiles:
                _ring_load(k_desc, [k_row + (j + 1) * _BN, 0], k_smem, k_ready, k_empty, j + 1, STAGES)
            _ring_load(v_desc, [vt_row, j * _BN], v_smem, v_ready, v_empty, j, STAGES)

    @gluon.jit
    def gluon_sagebwd_fwd_kernel(q_desc, k_desc, v_desc, O, sob, sos, soh, LSE2, SQ, SK, SV, H, Sq, Skv, Sqp, Skp,
                                 qk, D: gl.constexpr, STAGES: gl.constexpr, STORE_LSE: gl.constexpr,
                                 CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
        """Grid (Sqp/128, B·H), ``num_warps=4`` (+ 4 + 1 worker warps). Descriptors: Q₈ (B·H·Sqp, D)
        and K₈ (B·H·Skp, D) with a [128, D] box, V₈ᵀ (B·H·D, Skp) with a [D, 128] box. O (B, Sq, H,
        D) with head_dim stride 1; LSE2 (B, H, Sqp) float32 (STORE_LSE); SQ (B, H, Sqp/128), SK, SV
        (B, H, Skp/128); ``qk`` = softmax scale · log2e."""
        gl.static_assert(D == 64 or D == 128, "head_dim must be 64 or 128")
        pid_m = gl.program_id(0)
        bh = gl.program_id(1)
        b, h = _batch_head(bh, H)
        m0 = pid_m * _BM
        rows8: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BN, D], gl.int8)
        cols8: gl.constexpr = gl.NVMMASharedLayout.get_default_for([D, _BN], gl.int8)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BM // 2, _BN], gl.int8)
        q_smem = gl.allocate_shared_memory(gl.int8, [_BM, D], rows8)
        k_smem = gl.allocate_shared_memory(gl.int8, [STAGES, _BN, D], rows8)
        v_smem = gl.allocate_shared_memory(gl.int8, [STAGES, D, _BN], cols8)
        p_smem = gl.allocate_shared_memory(gl.int8, [2, _BM // 2, _BN], p_layout)
        q_bar, k_ready, k_empty, v_ready, v_empty, _ = _ring_barriers(STAGES)   # (no ping-pong pair used)
        bh64 = bh.to(gl.int64)
        sq = gl.load(SQ + bh64 * (Sqp // _BM) + pid_m)
        SK = SK + bh64 * (Skp // _BN)
        SV = SV + bh64 * (Skp // _BN)
        LSE2 = LSE2 + bh64 * Sqp
        gl.warp_specialize([
            (_fwd_consumer, (q_smem, k_smem, v_smem, p_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                             O, sob, sos, soh, LSE2, SK, SV, sq, b, h, m0, Sq, Skv, qk, 0, D, STAGES, STORE_LSE)),
            (_fwd_consumer, (q_smem, k_smem, v_smem, p_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                             O, sob, sos, soh, LSE2, SK, SV, sq, b, h, m0, Sq, Skv, qk, 1, D, STAGES, STORE_LSE)),
            (_fwd_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready,
                           v_empty, bh * Sqp + m0, bh * Skp, bh * D, Skv, STAGES)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------

def gluon_forward_unsupported(q) -> str | None:
    """None when :func:`gluon_forward` runs here for inputs like ``q`` (its INT8 operands are the
    quantization pass's), else why not (one sentence)."""
    if q.dim() != 4 or not q.is_cuda:
        return f"q must be a 4-D CUDA tensor, got {tuple(q.shape)} on {q.device.type}"
    if q.shape[3] not in HEAD_DIMS:
        return f"head_dim {q.shape[3]} is not supported (64 or 128)"
    return gluon_unavailable(q.device)


def gluon_forward(q8, sq, k8, sk, v8t, sv, o, lse2, *, Skv: int, qk: float, config: dict | None = None) -> None:
    """Writes O (``o``: (B, Sq, H, D), float32 or 16-bit) and, when ``lse2`` is given, LSE₂ (B, H,
    Sqp) of :func:`.sagebwd.forward` from its INT8 operands: ``q8`` (B, H, Sqp, D), ``k8`` (B, H,
    Skp, D), ``v8t`` (B, H, D, Skp), their scales; ``qk`` = softmax scale · log2e. ``config``: the
    launch's options over :data:`CONFIG` (STAGES, CONSUMER_REGS, LOADER_REGS, MAXNREG)."""
    B, Sq, H, D = o.shape
    Sqp, Skp = q8.shape[2], k8.shape[2]
    cfg = dict(CONFIG)
    unknown = set(config or {}) - set(cfg)
    if unknown:
        raise ValueError(f"unknown Gluon sagebwd forward option(s) {sorted(unknown)} (one of {', '.join(cfg)})")
    cfg.update(config or {})
    gluon_sagebwd_fwd_kernel[(Sqp // 128, B * H)](
        _int8_descriptor(q8.view(B * H * Sqp, D), (128, D)), _int8_descriptor(k8.view(B * H * Skp, D), (128, D)),
        _int8_descriptor(v8t.view(B * H * D, Skp), (D, 128)), o, o.stride(0), o.stride(1), o.stride(2),
        lse2 if lse2 is not None else sq, sq, sk, sv, H, Sq, Skv, Sqp, Skp, float(qk),
        D=D, STAGES=cfg["STAGES"], STORE_LSE=lse2 is not None, CONSUMER_REGS=cfg["CONSUMER_REGS"],
        LOADER_REGS=cfg["LOADER_REGS"], num_warps=4, maxnreg=cfg["MAXNREG"])
