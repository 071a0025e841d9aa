"""NVFP4 quantizer: every E2M1 tie and boundary, E4M3 scale rounding, saturation, subnormal
scales, zero and tiny blocks, padding, packing, non-finite inputs, and agreement with
torch.float8_e4m3fn where the two overlap."""

import itertools

import pytest
import torch

from attnqat import NVFP4Tensor, fake_quantize_nvfp4, quantize_nvfp4
from attnqat.nvfp4 import (
    E2M1_THRESHOLDS,
    E2M1_VALUES,
    e2m1_decode,
    e2m1_encode,
    e2m1_round,
    e4m3_round,
    nvfp4_block_scale,
    pack_nibbles,
    unpack_nibbles,
)

GRID = torch.tensor(E2M1_VALUES, dtype=torch.float64)


def brute_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Independent oracle: nearest E2M1 magnitude by exhaustive distance, ties to the value whose
    code index is even (the even mantissa), values beyond 6 saturate."""
    a = y.double().abs().clamp(max=6.0)
    d = (a[..., None] - GRID).abs()
    best = d.min(dim=-1, keepdim=True).values
    cand = (d == best)
    idx = torch.arange(8)
    # among tied candidates prefer an even index; otherwise the only candidate
    even = cand & (idx % 2 == 0)
    pick = torch.where(even.any(-1, keepdim=True), even, cand).int().argmax(-1)
    mag = GRID[pick]
    return torch.where(y < 0, -mag, mag).float()


def all_e4m3_values() -> torch.Tensor:
    """Every finite non-negative E4M3 (fn) value, ascending, from the bit patterns."""
    bits = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0x7F is NaN
    return bits.view(torch.float8_e4m3fn).float()


def block_with(values, amax=6.0):
    """A 16-element block whose amax is ``amax`` (so the scale is amax/6 when that is E4M3)."""
    vals = list(values)
    assert len(vals) < 16
    return torch.tensor(vals + [amax] + [0.0] * (15 - len(vals)), dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# E2M1 elements
# ---------------------------------------------------------------------------------------------

def test_e2m1_ties_round_to_even():
    # With amax = 6 the scale is exactly 1, so elements are rounded as they are.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    out = fake_quantize_nvfp4(block_with(ties))
    assert out[: len(ties)].tolist() == expected
    out_neg = fake_quantize_nvfp4(-block_with(ties))
    assert out_neg[: len(ties)].tolist() == [-e for e in expected]


def test_e2m1_just_either_side_of_every_threshold():
    for t in E2M1_THRESHOLDS:
        lo = torch.nextafter(torch.tensor(t), torch.tensor(0.0)).item()
        hi = torch.nextafter(torch.tensor(t), torch.tensor(10.0)).item()
        out = fake_quantize_nvfp4(block_with([lo, hi]))
        below = max(v for v in E2M1_VALUES if v < t)
        above = min(v for v in E2M1_VALUES if v > t)
        assert out[0].item() == below, (t, lo)
        assert out[1].item() == above, (t, hi)


def test_e2m1_grid_values_are_fixed_points_and_saturate():
    out = fake_quantize_nvfp4(block_with(list(E2M1_VALUES[:-1]) + [-6.0, -4.0]))
    assert out[:9].tolist() == list(E2M1_VALUES[:-1]) + [-6.0, -4.0]
    # e2m1_round on its own saturates at ±6
    assert e2m1_round(torch.tensor([7.0, 100.0, -1e30])).tolist() == [6.0, 6.0, -6.0]


def test_e2m1_round_matches_exhaustive_oracle():
    g = torch.Generator().manual_seed(0)
    y = torch.cat([
        torch.randn(20000, generator=g) * 3,
        torch.rand(20000, generator=g) * 8,
        torch.tensor(E2M1_THRESHOLDS), -torch.tensor(E2M1_THRESHOLDS),
        torch.linspace(-7, 7, 2801),  # a 0.005 lattice: hits every threshold exactly
    ])
    assert torch.equal(e2m1_round(y), brute_e2m1(y))


def test_encode_decode_all_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = e2m1_decode(codes)
    assert vals[:8].tolist() == list(E2M1_VALUES)
    assert vals[8:].abs().tolist() == list(E2M1_VALUES)
    assert torch.signbit(vals[8:]).all()
    assert torch.equal(e2m1_encode(vals), codes)


def test_sign_bit_follows_the_input_sign_bit():
    """A small negative value rounding to 0 and -0.0 itself keep the sign (code 0b1000, as hardware
    conversions do); +0.0 gives code 0; dequantized, the sign of zero survives."""
    x = block_with([-0.1, -0.0, 0.0])
    q = quantize_nvfp4(x)
    codes = q.unpacked_codes()
    assert codes[:3].tolist() == [0b1000, 0b1000, 0]
    deq = q.dequantize(torch.float32)
    assert torch.signbit(deq[:2]).all() and not torch.signbit(deq[2])
    assert torch.equal(torch.signbit(fake_quantize_nvfp4(x)[:3]), torch.tensor([True, True, False]))


# ---------------------------------------------------------------------------------------------
# E4M3 scales
# ---------------------------------------------------------------------------------------------

def test_e4m3_round_fixes_every_e4m3_value_and_rounds_midpoints_to_even():
    vals = all_e4m3_values()
    assert torch.equal(e4m3_round(vals), vals)
    lo, hi = vals[:-1], vals[1:]
    mid = (lo.double() + hi.double()) / 2
    assert torch.equal(mid.float().double(), mid)  # midpoints are exact in float32
    got = e4m3_round(mid.float())
    lo_bits = torch.arange(0, 0x7E)
    expected = torch.where(lo_bits % 2 == 0, lo, hi)  # ties go to the even mantissa
    assert torch.equal(got, expected)
    # either side of each midpoint
    assert torch.equal(e4m3_round(torch.nextafter(mid.float(), torch.tensor(0.0))), lo)
    assert torch.equal(e4m3_round(torch.nextafter(mid.float(), torch.tensor(1e9))), hi)


def test_e4m3_round_saturates_and_keeps_subnormals():
    assert e4m3_round(torch.tensor([448.0, 463.9, 464.0, 500.0, 1e30])).tolist() == [448.0] * 5
    sub = 2.0 ** -9
    assert e4m3_round(torch.tensor([sub, 3 * sub, 7 * sub, 0.4 * sub, 0.5 * sub, 0.51 * sub, 1.5 * sub])).tolist() == \
        [sub, 3 * sub, 7 * sub, 0.0, 0.0, sub, 2 * sub]
    # the smallest normal and the largest subnormal
    assert e4m3_round(torch.tensor([2.0 ** -6, 7 * 2.0 ** -9])).tolist() == [2.0 ** -6, 7 * 2.0 ** -9]


def test_scales_agree_with_torch_float8_cast_where_they_overlap():
    g = torch.Generator().manual_seed(1)
    amax = torch.cat([torch.rand(50000, generator=g) * 2688, torch.rand(50000, generator=g) * 0.05,
                      (torch.randn(50000, generator=g) * 4).exp()])
    ours = nvfp4_block_scale(amax)
    theirs = (amax / 6).clamp(max=448).to(torch.float8_e4m3fn).float()
    assert torch.equal(ours, theirs)


def test_block_scale_uses_rounded_scale_for_elements():
    # amax 7 → 7/6 = 1.1667 → E4M3 1.125; elements are divided by 1.125, not 1.1667.
    x = block_with([1.125 * 2.5, 1.125 * 0.75], amax=7.0)
    q = quantize_nvfp4(x)
    assert q.scales_float().item() == 1.125
    out = q.dequantize()
    assert out[0].item() == 1.125 * 2.0 and out[1].item() == 1.125 * 1.0
    assert out[2].item() == 1.125 * 6.0  # 7/1.125 = 6.22 saturates to 6


def test_scale_saturation_saturates_elements():
    x = block_with([3000.0], amax=6000.0)
    q = quantize_nvfp4(x)
    assert q.scales_float().item() == 448.0
    assert q.dequantize()[0].item() == 448.0 * 6  # 3000/448 = 6.7 → 6
    assert q.dequantize()[1].item() == 448.0 * 6


def test_subnormal_scale():
    sub = 2.0 ** -9
    x = block_with([sub * 3 * 1.5], amax=6 * 3 * sub)
    q = quantize_nvfp4(x)
    assert q.scales_float().item() == 3 * sub
    assert q.dequantize()[0].item() == 3 * sub * 1.5


def test_zero_and_tiny_blocks_give_zeros_not_nan():
    z = torch.zeros(32)
    assert torch.equal(fake_quantize_nvfp4(z), z)
    tiny = torch.full((16,), 6 * 2.0 ** -10)  # amax/6 is exactly half the smallest step: ties to 0
    out = fake_quantize_nvfp4(tiny)
    assert torch.equal(out, torch.zeros(16)) and not out.isnan().any()
    above = torch.full((16,), 6 * 2.0 ** -10 * 1.01)  # scale 2^-9; elements 3.03 steps → 3
    assert (fake_quantize_nvfp4(above) == 3 * 2.0 ** -9).all()


def test_non_finite_poisons_only_its_block():
    x = torch.randn(4, 32)
    x[0, 3] = float("nan")
    x[1, 20] = float("inf")
    x[2, 0] = float("-inf")
    out = fake_quantize_nvfp4(x)
    assert out[0, :16].isnan().all() and not out[0, 16:].isnan().any()
    assert out[1, 16:].isnan().all() and not out[1, :16].isnan().any()
    assert out[2, :16].isnan().all()
    assert torch.equal(out[3], fake_quantize_nvfp4(x[3]))
    q = quantize_nvfp4(x)
    assert q.scales_float()[0, 0].isnan() and q.scales_float()[1, 1].isnan()
    assert (q.unpacked_codes()[0, :16] == 0).all()
    assert torch.equal(q.dequantize().isnan(), out.isnan())


# ---------------------------------------------------------------------------------------------
# Blocks, padding, dims, packing
# ---------------------------------------------------------------------------------------------

def reference_fake_quant_1d(x: torch.Tensor) -> torch.Tensor:
    """Independent, loop-based NVFP4 of a 1-D float32 tensor (padding with zeros)."""
    out = []
    for i in range(0, x.numel(), 16):
        blk = x[i:i + 16]
        amax = blk.abs().max()
        s = (amax / 6).clamp(max=448).to(torch.float8_e4m3fn).float()
        if s == 0:
            out.append(torch.zeros_like(blk))
        else:
            out.append(brute_e2m1(blk / s) * s)
    return torch.cat(out)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 40, 64])
def test_matches_loop_oracle_and_padding_never_changes_real_scales(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(4) * 50
    assert torch.equal(fake_quantize_nvfp4(x), reference_fake_quant_1d(x))
    # padding explicitly with zeros gives the same values on the real elements
    xp = torch.cat([x, torch.zeros((-n) % 16)])
    assert torch.equal(fake_quantize_nvfp4(xp)[:n], fake_quantize_nvfp4(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_any_dim_any_dtype_and_round_trip(dtype, dim):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 33, 3, 20, generator=g) * 4).to(dtype)
    fq = fake_quantize_nvfp4(x, dim=dim)
    assert fq.shape == x.shape and fq.dtype == dtype
    # along dim == the same as moving dim last
    moved = fake_quantize_nvfp4(x.movedim(dim, -1), dim=-1).movedim(-1, dim)
    assert torch.equal(fq, moved)
    q = quantize_nvfp4(x, dim=dim)
    assert isinstance(q, NVFP4Tensor)
    assert q.codes.dtype == torch.uint8 and q.scales.dtype == torch.float8_e4m3fn
    padded = -(-x.shape[dim] // 16) * 16
    d = dim % x.dim()
    # x's own axis order; only the quantized axis shrinks (two codes a byte, one scale per 16)
    assert q.codes.shape == x.shape[:d] + (padded // 2,) + x.shape[d + 1:]
    assert q.scales.shape == x.shape[:d] + (padded // 16,) + x.shape[d + 1:]
    assert q.codes.is_contiguous() and q.scales.is_contiguous()
    assert torch.equal(q.unpacked_codes().movedim(d, -1),
                       quantize_nvfp4(x.movedim(d, -1), -1).unpacked_codes())
    assert torch.equal(q.dequantize(dtype), fq)
    # dequantized NVFP4 values are exact in bf16 / fp16: fake quant in fp32 then cast is lossless
    fq32 = fake_quantize_nvfp4(x.float(), dim=dim)
    assert torch.equal(fq32.to(dtype).float(), fq32)


def test_pack_unpack_round_trip_and_nibble_order():
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (7, 64), generator=g, dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (7, 32)
    assert torch.equal(unpack_nibbles(packed), codes)
    assert pack_nibbles(torch.tensor([[0x3, 0xA]], dtype=torch.uint8)).item() == 0xA3  # first → low
    with pytest.raises(ValueError, match="even"):
        pack_nibbles(torch.zeros(3, dtype=torch.uint8))


def test_division_equals_threshold_comparison():
    """The kernels may compare |x| against t·s instead of dividing (module docstring): check the
    claimed equivalence against the division on every E4M3 scale and values near thresholds."""
    scales = all_e4m3_values()[1:]  # every non-zero finite scale
    g = torch.Generator().manual_seed(5)
    t = torch.tensor(E2M1_THRESHOLDS)
    exact = (t[None, :] * scales[:, None])  # exact products
    near = torch.stack([exact, torch.nextafter(exact, torch.tensor(0.0)), torch.nextafter(exact, torch.tensor(1e9))], -1)
    x = torch.cat([near.reshape(len(scales), -1), torch.rand(len(scales), 64, generator=g) * 6 * scales[:, None]], 1)
    s = scales[:, None].expand_as(x)
    by_division = e2m1_round(x / s)
    above = (x[..., None] > s[..., None] * t)
    at = (x[..., None] == s[..., None] * t)
    # count thresholds passed; at a tie round to even: ties at 0.25, 1.25, 2.5, 5 go down, 0.75, 1.75, 3.5 go up
    tie_up = torch.tensor([False, True, False, True, False, True, False])
    idx = (above | (at & tie_up)).sum(-1)
    by_comparison = torch.tensor(E2M1_VALUES)[idx]
    assert torch.equal(by_division, by_comparison)


def test_bad_input_errors():
    with pytest.raises(TypeError, match="floating"):
        fake_quantize_nvfp4(torch.arange(16))
    with pytest.raises(TypeError, match="torch.Tensor"):
        quantize_nvfp4([1.0, 2.0])
    with pytest.raises(ValueError, match="at least one dimension"):
        fake_quantize_nvfp4(torch.tensor(1.0))
    with pytest.raises(IndexError):
        fake_quantize_nvfp4(torch.zeros(4, 4), dim=3)


@pytest.mark.parametrize("shape,dim", list(itertools.product([(3, 16), (2, 5, 48)], [0, -1])))
def test_values_are_on_block_grid(shape, dim):
    x = torch.randn(*shape) * 10
    q = quantize_nvfp4(x, dim=dim)
    fq = fake_quantize_nvfp4(x, dim=dim).movedim(dim, -1)
    n = fq.shape[-1]
    s = q.scales_float().movedim(dim, -1).repeat_interleave(16, dim=-1)[..., :n]
    ratio = torch.where(s > 0, fq / s, torch.zeros_like(fq))
    assert torch.isin(ratio.abs(), torch.tensor(E2M1_VALUES)).all()
