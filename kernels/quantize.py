"""NVFP4 quantize/pack kernel, and the rounding helpers every other kernel shares.

The kernel reproduces :func:`attnqat.quantize_nvfp4` and :func:`attnqat.fake_quantize_nvfp4` bit for
bit (DESIGN.md §3.1), on the GPU and in the Triton interpreter alike, because no step depends on a
floating-point cast to FP8 or on a division other than IEEE ``div_rn``:

* scale ``s = E4M3_RN(amax / 6)``: ``amax / 6`` correctly rounded (:func:`div6_rn`); the E4M3 rounding adds and
  subtracts a "magic" power-of-two multiple whose unit in the last place is the E4M3 step of the
  value's binade (read from the float32 exponent bits, never below the subnormal step 2^-9), which
  is round-to-nearest-even by construction; saturation at 448.
* element code: E2M1_RNE of ``fl(|x| / s)``, the quotient correctly rounded without a division
  (:func:`div_correctly_rounded` from the correctly rounded reciprocal :func:`rcp_e4m3_rn`), then
  rounded to the E2M1 grid by the same magic-constant trick (:func:`e2m1_round_fast`).
* the E4M3 scale byte is assembled from the float32 bits (no FP8 conversion).

Any 1- to 4-dimensional tensor and any quantized axis: the kernel reads the input through its
strides (a (batch, seq, heads, dim) view quantized along ``seq`` — V along tokens — is read in
place, no transposed copy) and writes the NVFP4Tensor layout (the input's axis order, the quantized
axis halved for the codes and divided by 16 for the scales: V's codes rows are then as contiguous
as its input rows) and/or the dequantized values in the input's shape.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .formats import NVFP4Tensor

# Triton's interpreter (TRITON_INTERPRET=1) runs the kernels on the CPU; inline PTX is replaced there.
INTERPRET: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))

BLOCK = 16
_IN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# Rounding helpers (shared by the attention kernels)
# ----------------------------------------------------------------------------------------------

@triton.jit
def _pow2_magic(bits_exp, shift: tl.constexpr):
    """1.5 · 2^(e + shift) as float32, where ``bits_exp`` holds the biased exponent of 2^e in bits
    23-30. Adding and subtracting it rounds a value below 2^(e + shift - 1) to a multiple of
    2^(e + shift - 23), ties to even: that is the constant's unit in the last place."""
    return ((bits_exp + (shift << 23)) | 0x400000).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_round(v, SATURATE: tl.constexpr):
    """Round non-negative finite float32 ``v`` to the nearest E4M3 value, ties to even; subnormal
    step 2^-9. With ``SATURATE`` the result is clamped to 448 (values above 480 are clamped first
    so that the constant stays finite)."""
    if SATURATE:
        v = tl.minimum(v, 480.0)
    e = tl.maximum(v.to(tl.int32, bitcast=True) & 0x7F800000, 121 << 23)  # exponent, >= 2^-6
    magic = _pow2_magic(e, 20)  # ulp = 2^(e - 3): the E4M3 step of v's binade
    s = (v + magic) - magic
    if SATURATE:
        s = tl.minimum(s, 448.0)
    return s


@triton.jit
def e4m3_bits(s):
    """E4M3 byte (as int32) of an exact, finite, non-negative E4M3 value ``s`` (float32)."""
    b = s.to(tl.int32, bitcast=True)
    normal = (b >> 20) - (120 << 3)  # biased exponent - 120, then the top 3 mantissa bits
    sub = (s * 512.0).to(tl.int32)   # subnormal: s = k · 2^-9 exactly
    return tl.where(s >= 0.015625, normal, sub)


@triton.jit
def fast_rcp(x):
    """Approximate reciprocal (one MUFU.RCP on the GPU, relative error ~2^-23)."""
    if INTERPRET:
        return 1.0 / x
    else:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def rcp_e4m3_rn(s):
    """Correctly rounded float32 1/s for an E4M3 value s > 0 (at most 4 significant bits): one
    Newton step on the approximate reciprocal leaves an error near 2^-44, while 1/s of such an s
    lies at least 2^-28 (relative) away from every rounding midpoint (checked for all 15 mantissa
    patterns), so the single rounding of the Newton step is the correct one."""
    r0 = fast_rcp(s)
    return tl.fma(tl.fma(-s, r0, 1.0), r0, r0)


@triton.jit
def div6_rn(a):
    """IEEE float32 a / 6 (Markstein: q0 = a·RN(1/6), then one FMA correction with the exact
    remainder), branch-free."""
    q0 = a * 0.16666667163372039795
    return tl.fma(tl.fma(-6.0, q0, a), 0.16666667163372039795, q0)


@triton.jit
def nvfp4_scale(amax):
    """Exact block scale E4M3_RN(amax / 6) of finite non-negative ``amax`` (IEEE division)."""
    return e4m3_round(div6_rn(amax), True)


@triton.jit
def div_correctly_rounded(a, s, r):
    """IEEE float32 ``a / s`` (round to nearest even) from ``r = div_rn(1, s)``: q0 = a·r, the exact
    remainder e = a − s·q0 by FMA, then q0 + e·r rounded once (Markstein's theorem: correct when r
    is the correctly rounded reciprocal). Three operations instead of a division."""
    q0 = a * r
    e = tl.fma(-s, q0, a)
    return tl.fma(e, r, q0)


@triton.jit
def e2m1_round_fast(y):
    """E2M1 round-to-nearest-even of non-negative float32 ``y``, saturated at 6, in five operations:
    the step (0.5 below 2, 1 below 4, else 2) is the unit in the last place of the magic constant
    1.5·2^(e+22), e the exponent of max(y, 1); adding it rounds y to that step, ties to even."""
    two_e = (tl.maximum(y, 1.0).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    t = tl.fma(two_e, 6291456.0, y)          # y + 1.5·2^(e+22), rounded once: the rounding step
    return tl.minimum(tl.fma(two_e, -6291456.0, t), 6.0)   # exact subtraction


# ----------------------------------------------------------------------------------------------
# The quantize/pack kernel
# ----------------------------------------------------------------------------------------------

@triton.jit
def _quantize_subtile(X, Y, SHIFT, x_base, y_base, sh_base, rows, row_ok, col0, L,
                      sx2, sxl, sy2, syl, ss2, shift_group,
                      TR: tl.constexpr, TL: tl.constexpr, WRITE_PACKED: tl.constexpr,
                      WRITE_DEQUANT: tl.constexpr, EVEN: tl.constexpr, HAS_SHIFT: tl.constexpr,
                      SHIFT_ALONG_ROWS: tl.constexpr):
    """Quantize x[rows, col0:col0+TL]; store the dequantized values, return (packed codes
    [TR, TL/2] uint8, E4M3 scale bytes [TR, TL/16] uint8)."""
    cols = col0 + tl.arange(0, TL)
    ok = row_ok[:, None] & (cols < L)[None, :]
    x_ptrs = X + x_base + rows[:, None] * sx2 + cols[None, :] * sxl
    if EVEN:
        x = tl.load(x_ptrs).to(tl.float32)
    else:
        x = tl.load(x_ptrs, mask=ok, other=0.0).to(tl.float32)
    if HAS_SHIFT:
        if SHIFT_ALONG_ROWS:   # rows are tokens: shift_group consecutive ones share a shift row
            sh_rows = rows // shift_group
        else:
            sh_rows = rows
        x = x - tl.load(SHIFT + sh_base + sh_rows[:, None] * ss2 + cols[None, :], mask=ok, other=0.0)
    x3 = tl.reshape(x, [TR, TL // 16, 16])
    bits = x3.to(tl.int32, bitcast=True)
    abits = bits & 0x7FFFFFFF                            # |x| as bits
    # the integer maximum of |x|'s bits is |x|'s maximum, and at least the Inf pattern if the
    # block holds an Inf or a NaN (NaN patterns are larger than Inf's)
    amax_bits = tl.max(abits, axis=2)
    finite = amax_bits < 0x7F800000
    s = nvfp4_scale(tl.where(finite, amax_bits.to(tl.float32, bitcast=True), 0.0))   # [TR, TL/16]
    usable = finite & (s > 0.0)
    # per-element work without predicates: a zeroed magnitude in unusable blocks (zero or NaN
    # scale) rounds to code 0; the sign survives only for x < 0 with x != 0 (-0.0 gives code 0)
    umask = tl.where(usable, -1, 0)[:, :, None]
    a3 = (abits & umask).to(tl.float32, bitcast=True)
    s1 = tl.where(usable, s, 1.0)
    q = div_correctly_rounded(a3, s1[:, :, None], rcp_e4m3_rn(s1)[:, :, None])  # fl(|x| / s)
    # E2M1 rounding as in e2m1_round_fast: t = M + k·step with M = 1.5·2^(e+22), step = 2^(e-1)
    two_e_bits = tl.maximum(q, 1.0).to(tl.int32, bitcast=True) & 0x7F800000
    two_e = two_e_bits.to(tl.float32, bitcast=True)
    t = tl.fma(two_e, 6291456.0, q)

    packed = tl.zeros([TR, TL // 2], tl.uint8)      # (unused without WRITE_PACKED)
    sbits = tl.zeros([TR, TL // 16], tl.uint8)
    if WRITE_PACKED:
        # the code is k + 2e (k = steps above M, read from the bits of t), saturated at 7
        code = tl.minimum(t.to(tl.int32, bitcast=True) - two_e_bits + (two_e_bits >> 22) - 188743934, 7)
        # sign: bit 31 of x moved to bit 3 (arithmetic shift), kept in usable blocks only
        code = code | ((bits >> 28) & tl.where(usable, 8, 0)[:, :, None])
        lo, hi = tl.split(tl.reshape(code, [TR, TL // 2, 2]))
        packed = (lo | (hi << 4)).to(tl.uint8)
        sbits = tl.where(finite, e4m3_bits(s), 0x7F).to(tl.uint8)  # 0x7F: the E4M3 NaN
    if WRITE_DEQUANT:
        mag = tl.minimum(tl.fma(two_e, -6291456.0, t), 6.0)
        val = mag * tl.where(finite, s, float("nan"))[:, :, None]  # NaN block → NaN values
        sign = bits & umask & -2147483648                  # x's sign bit, usable blocks only
        val = (val.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        y_ptrs = Y + y_base + rows[:, None] * sy2 + cols[None, :] * syl
        val = tl.reshape(val, [TR, TL]).to(Y.dtype.element_ty)
        if EVEN:
            tl.store(y_ptrs, val)
        else:
            tl.store(y_ptrs, val, mask=ok)
    return packed, sbits


@triton.jit
def _cat_cols(a, b, R: tl.constexpr, C: tl.constexpr):
    """[R, C] and [R, C] → [R, 2C], a's columns first."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), [R, 2 * C])


@triton.jit
def _quantize_nvfp4_kernel(
    X, CODES, SCALES, Y, SHIFT,
    R0R1, R1, R2, L, n_rtiles,
    sx0, sx1, sx2, sxl,
    sy0, sy1, sy2, syl,
    sc0, sc1, sc2, scl,
    sk0, sk1, sk2, skl,
    ss0, ss1, ss2, shift_group,
    TR: tl.constexpr, TL: tl.constexpr, SUB: tl.constexpr,
    WRITE_PACKED: tl.constexpr, WRITE_DEQUANT: tl.constexpr,
    EVEN: tl.constexpr, HAS_SHIFT: tl.constexpr, SHIFT_ALONG_ROWS: tl.constexpr,
):
    """One program quantizes a [TR, SUB·TL] tile: TR consecutive indices of the innermost
    non-quantized axis r2 at one (r0, r1), and SUB·TL positions along the quantized axis (length
    L, zero-padded to a multiple of 16), in SUB (1, 2 or 4) sub-tiles whose codes are stored
    together. Codes and scales are written through their own strides (sc*, sk*; the last one along
    the quantized axis), Lp/2 and Lp/16 entries along it (Lp = L rounded up to 16). With HAS_SHIFT
    the float32 SHIFT[r0, r1 // shift_group, r2, l] is subtracted first (sage3's smoothing), or
    with SHIFT_ALONG_ROWS SHIFT[r0, r1, r2 // shift_group, l] (r1 the head, r2 the token)."""
    pid = tl.program_id(0)
    pid_l = tl.program_id(1)
    r01 = pid // n_rtiles
    r0 = r01 // R1
    r1 = r01 % R1
    rows = (pid % n_rtiles) * TR + tl.arange(0, TR)
    row_ok = rows < R2
    x_base = r0.to(tl.int64) * sx0 + r1.to(tl.int64) * sx1
    y_base = r0.to(tl.int64) * sy0 + r1.to(tl.int64) * sy1
    if SHIFT_ALONG_ROWS:
        sh_base = r0.to(tl.int64) * ss0 + r1.to(tl.int64) * ss1
    else:
        sh_base = r0.to(tl.int64) * ss0 + (r1 // shift_group).to(tl.int64) * ss1
    col0 = pid_l * (TL * SUB)
    packed, sbits = _quantize_subtile(X, Y, SHIFT, x_base, y_base, sh_base, rows, row_ok, col0, L,
                                      sx2, sxl, sy2, syl, ss2, shift_group, TR, TL, WRITE_PACKED,
                                      WRITE_DEQUANT, EVEN, HAS_SHIFT, SHIFT_ALONG_ROWS)
    if SUB == 2:
        p1, s1 = _quantize_subtile(X, Y, SHIFT, x_base, y_base, sh_base, rows, row_ok, col0 + TL, L,
                                   sx2, sxl, sy2, syl, ss2, shift_group, TR, TL, WRITE_PACKED, WRITE_DEQUANT, EVEN,
                                   HAS_SHIFT, SHIFT_ALONG_ROWS)
        if WRITE_PACKED:
            packed = _cat_cols(packed, p1, TR, TL // 2)
            sbits = _cat_cols(sbits, s1, TR, TL // 16)
    if SUB == 4:
        p1, s1 = _quantize_subtile(X, Y, SHIFT, x_base, y_base, sh_base, rows, row_ok, col0 + TL, L,
                                   sx2, sxl, sy2, syl, ss2, shift_group, TR, TL, WRITE_PACKED, WRITE_DEQUANT, EVEN,
                                   HAS_SHIFT, SHIFT_ALONG_ROWS)
        p2, s2 = _quantize_subtile(X, Y, SHIFT, x_base, y_base, sh_base, rows, row_ok, col0 + 2 * TL, L,
                                   sx2, sxl, sy2, syl, ss2, shift_group, TR, TL, WRITE_PACKED, WRITE_DEQUANT, EVEN,
                                   HAS_SHIFT, SHIFT_ALONG_ROWS)
        p3, s3 = _quantize_subtile(X, Y, SHIFT, x_base, y_base, sh_base, rows, row_ok, col0 + 3 * TL, L,
                                   sx2, sxl, sy2, syl, ss2, shift_group, TR, TL, WRITE_PACKED, WRITE_DEQUANT, EVEN,
                                   HAS_SHIFT, SHIFT_ALONG_ROWS)
        if WRITE_PACKED:
            packed = _cat_cols(_cat_cols(packed, p1, TR, TL // 2), _cat_cols(p2, p3, TR, TL // 2), TR, TL)
            sbits = _cat_cols(_cat_cols(sbits, s1, TR, TL // 16), _cat_cols(s2, s3, TR, TL // 16), TR, TL // 8)

    if WRITE_PACKED:
        nbyte = (L + 15) // 16 * 8                        # Lp / 2
        nblk = (L + 15) // 16
        ccols = col0 // 2 + tl.arange(0, TL * SUB // 2)
        scols = col0 // 16 + tl.arange(0, TL * SUB // 16)
        c_ptrs = (CODES + r0.to(tl.int64) * sc0 + r1.to(tl.int64) * sc1 + rows[:, None] * sc2
                  + ccols[None, :] * scl)
        s_ptrs = (SCALES + r0.to(tl.int64) * sk0 + r1.to(tl.int64) * sk1 + rows[:, None] * sk2
                  + scols[None, :] * skl)
        if EVEN:
            tl.store(c_ptrs, packed)
            tl.store(s_ptrs, sbits)
        else:
            tl.store(c_ptrs, packed, mask=row_ok[:, None] & (ccols < nbyte)[None, :])
            tl.store(s_ptrs, sbits, mask=row_ok[:, None] & (scols < nblk)[None, :])


def _collapse(shape, *stride_lists):
    """Merge neighbouring axes that are contiguous with each other in every stride list, and drop
    size-1 axes (the flattened index order is unchanged). Returns exactly three sizes and, for each
    stride list, three strides (leading size-1 axes added)."""
    axes = [(n, [st[i] for st in stride_lists]) for i, n in enumerate(shape) if n != 1]
    merged: list[tuple[int, list[int]]] = []
    for n, st in reversed(axes):                       # innermost first
        if merged and all(s_out == s_in * merged[-1][0] for s_out, s_in in zip(st, merged[-1][1])):
            merged[-1] = (merged[-1][0] * n, merged[-1][1])
        else:
            merged.append((n, st))
    merged.reverse()
    if len(merged) > 3:
        raise ValueError(f"the quantize kernel takes tensors whose non-quantized axes collapse to at most "
                         f"3 strided axes, got sizes {tuple(shape)} with strides {tuple(stride_lists[0])}")
    while len(merged) < 3:
        merged.insert(0, (1, [0] * len(stride_lists)))
    sizes = [n for n, _ in merged]
    return sizes, [[st[j] for _, st in merged] for j in range(len(stride_lists))]


def _launch(x: torch.Tensor, dim: int, packed: bool, dequant_dtype: torch.dtype | None,
            shift: torch.Tensor | None = None, shift_group: int = 1, tile: tuple | None = None,
            shift_rows: str | None = None):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"the quantize kernel takes float32, float16 or bfloat16, got {x.dtype}")
    if dequant_dtype is not None and dequant_dtype not in _OUT_DTYPES:
        raise TypeError(f"dequantized output must be float32, float16 or bfloat16, got {dequant_dtype}")
    if not 1 <= x.dim() <= 4:
        raise ValueError(f"the quantize kernel takes 1- to 4-dimensional tensors, got {x.dim()} dimensions")
    if x.numel() == 0:
        raise ValueError(f"cannot quantize an empty tensor of shape {tuple(x.shape)}")
    d = dim % x.dim()
    L = x.shape[d]
    Lp = (L + BLOCK - 1) // BLOCK * BLOCK
    rest = [i for i in range(x.dim()) if i != d]
    rest_shape = [x.shape[i] for i in rest]
    y = codes = scales = None
    if dequant_dtype is not None:
        y = torch.empty(x.shape, dtype=dequant_dtype, device=x.device)
    if packed:   # the NVFP4Tensor layout: x's axis order, the quantized axis shortened
        codes = torch.empty(x.shape[:d] + (Lp // 2,) + x.shape[d + 1:], dtype=torch.uint8, device=x.device)
        scales = torch.empty(x.shape[:d] + (Lp // BLOCK,) + x.shape[d + 1:], dtype=torch.uint8,
                             device=x.device)
    ys = y.stride() if y is not None else x.stride()
    cs = codes.stride() if packed else x.stride()     # (x's strides: placeholders that merge alike)
    ks = scales.stride() if packed else x.stride()
    if shift is None:
        (n0, n1, n2), (xs, yst, cst, kst) = _collapse(
            rest_shape, [x.stride(i) for i in rest], [ys[i] for i in rest], [cs[i] for i in rest],
            [ks[i] for i in rest])
        sst = (0, 0, 0)
    else:
        # (B, S, H, D) along D minus shift (B, ceil(S / shift_group), H, D) float32, contiguous D
        if x.dim() != 4 or d != 3 or shift.dtype != torch.float32 or shift.stride(3) != 1:
            raise ValueError("a shift needs a (B, S, H, D) input quantized along D and a float32 "
                             "(B, S/group, H, D) shift with contiguous D")
        # Rows of a program's tile: the heads of one token (the GPU's layout and tiles, kept as
        # measured there), or under the interpreter the tokens of one head. The interpreter's
        # cost is per program, nearly whatever its tile holds: one program per token (200 + 300
        # for Q and K of a 200×300 test with 2 heads, ~10 ms each, 5.6 s) made sage3 the slowest
        # part of the CPU suite; tiles of up to 64 tokens launch 25-30× fewer programs (0.25 s;
        # quiet 2-core CPU, 2026-11-26). Every value is computed the same way in both layouts (the
        # 16-element blocks lie along D): the output is bit for bit the same
        # (test_kernels.py::test_quantize_with_a_shift_bit_identical_in_both_row_layouts).
        shift_rows = shift_rows or ("tokens" if INTERPRET.value else "heads")
        if shift_rows not in ("tokens", "heads"):
            raise ValueError(f"shift_rows must be 'tokens' or 'heads', got {shift_rows!r}")
        order = [0, 2, 1] if shift_rows == "tokens" else [0, 1, 2]   # (B, H, S) or (B, S, H)
        n0, n1, n2 = (rest_shape[i] for i in order)
        xs = [x.stride(rest[i]) for i in order]
        yst = [ys[rest[i]] for i in order]
        cst = [cs[rest[i]] for i in order]
        kst = [ks[rest[i]] for i in order]
        sst = [shift.stride(i) for i in order]
    # tiles: the fastest measured on the H100 for each output (docs/kernels_notes.md)
    sub = 1
    packed_only = packed and y is None
    if x.stride(d) == 1 or n2 == 1:
        # quantized axis contiguous (Q, K along head_dim): 16-byte loads along the blocks; packed
        # output: 16 rows of 128 with 2 warps, values: 32 rows with 4 warps
        TL = max(16, min(triton.next_power_of_2(L), 128))
        TR = max(1, min((2048 if packed_only else 4096) // TL, triton.next_power_of_2(n2)))
        warps = 2 if packed_only else 4
    else:
        # rows contiguous (V along tokens in (B, S, H, D)): 16 tokens by 256 channels a warp
        # (512 channels and 2 warps for the packed output, 256 and 1 for values), so that each
        # thread holds whole 16-token blocks of 8 channels (no shuffles) and writes rows of the
        # input's layout (16-byte pieces, coalesced)
        TL = 16
        TR = min(512 if packed_only else 256, max(16, triton.next_power_of_2(n2)))
        warps = max(1, TR // 256)
    if tile is not None:  # (TR, TL, num_warps, sub) override, for measurements
        TR, TL, warps, sub = tile
    n_rtiles = triton.cdiv(n2, TR)
    grid = (n0 * n1 * n_rtiles, triton.cdiv(Lp, TL * sub))
    dummy = x  # never dereferenced when the matching WRITE_* flag is off
    _quantize_nvfp4_kernel[grid](
        x, codes if packed else dummy, scales if packed else dummy, y if y is not None else dummy,
        shift if shift is not None else dummy,
        n0 * n1, n1, n2, L, n_rtiles, *xs, x.stride(d), *yst, ys[d], *cst, cs[d], *kst, ks[d],
        *sst, shift_group,
        TR=TR, TL=TL, SUB=sub, WRITE_PACKED=packed, WRITE_DEQUANT=y is not None,
        EVEN=(n2 % TR == 0) and (L % (TL * sub) == 0), HAS_SHIFT=shift is not None,
        SHIFT_ALONG_ROWS=shift is not None and shift_rows == "tokens", num_warps=warps,
    )
    return d, codes, scales, y


def quantize_nvfp4(x: torch.Tensor, dim: int = -1) -> NVFP4Tensor:
    """Triton twin of :func:`attnqat.quantize_nvfp4`: packed E2M1 codes and E4M3 scales along
    ``dim``, bit-identical to it. ``x`` is read through its strides (no copy)."""
    d, codes, scales, _ = _launch(x, dim, packed=True, dequant_dtype=None)
    return NVFP4Tensor(codes=codes, scales=scales.view(torch.float8_e4m3fn), shape=x.shape, dim=d)


def fake_quantize_nvfp4(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None,
                        shift: torch.Tensor | None = None, shift_group: int = 1) -> torch.Tensor:
    """Triton twin of :func:`attnqat.fake_quantize_nvfp4`: the dequantized NVFP4 values of ``x``
    along ``dim`` in a new contiguous tensor of ``x``'s shape (and ``dtype``, default ``x.dtype``).
    Exact in bfloat16 and float16: the attention kernels consume these as tensor-core operands.
    ``shift`` (float32, (B, ceil(S / shift_group), H, D)) is subtracted from a (B, S, H, D) ``x``
    before quantizing along D."""
    _, _, _, y = _launch(x, dim, packed=False, dequant_dtype=dtype or x.dtype, shift=shift,
                         shift_group=shift_group)
    return y


def quantize_nvfp4_both(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None):
    """Packed form and dequantized values from one pass: ``(NVFP4Tensor, Tensor)``."""
    d, codes, scales, y = _launch(x, dim, packed=True, dequant_dtype=dtype or x.dtype)
    return NVFP4Tensor(codes=codes, scales=scales.view(torch.float8_e4m3fn), shape=x.shape, dim=d), y
