"""NVFP4: 4-bit E2M1 elements in blocks of 16, one FP8 E4M3 scale per block.

This module is the numerical contract of the project (DESIGN.md §3.1). Every other implementation
(the Triton kernels included) must reproduce :func:`nvfp4_block_scale` and :func:`e2m1_round` bit
for bit, so both are written with operations that are exact on every path:

* ``scale = E4M3_RN(amax / 6)`` where ``amax / 6`` is an IEEE float32 division and the E4M3
  rounding is done with bit arithmetic (exponent read from the float32 bits, ``round`` on a
  power-of-two step, never below the E4M3 subnormal step 2^-9, saturating at 448). No FP8 cast is
  involved, because FP32→E4M3 casts disagree between PyTorch, Triton on the GPU and the Triton
  interpreter (DESIGN.md §7).
* ``code = E2M1_RNE(x / scale)`` with the ROUNDED scale and an IEEE float32 division. Equivalent
  formulation, exact and division-free: for ``t`` in the rounding thresholds
  {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5}, ``t * scale`` is exact in float32 (at most 7 significant
  bits), and ``fl(|x| / scale) <op> t`` ⇔ ``|x| <op> t * scale`` for ``<op>`` in {<, =, >}. A kernel
  may therefore compare against ``t * scale`` instead of dividing. (Multiplying by ``1 / scale`` is
  NOT equivalent: the reciprocal of an E4M3 value is rarely exact.)

Behaviour at the edges (decided here, tested in ``tests/test_nvfp4.py``):

* A block whose scale rounds to 0 (``amax < 6 * 2^-10``) dequantizes to all zeros, never NaN.
* Non-finite input: a block that contains NaN or ±Inf gets a NaN scale; its codes are 0 and every
  element of that block dequantizes to NaN. Other blocks are unaffected. (Silently saturating an
  Inf to ±6·448 would hide an overflow upstream; NaN makes it visible and is what an unquantized
  matmul would have produced too.)
* Sign: the code's sign bit is ``x``'s sign bit, as hardware conversions keep it: a small negative
  value that rounds to magnitude 0, and -0.0 itself, give code 0b1000 ("-0", dequantized -0.0).
  (Only blocks with a zero or NaN scale write code 0 for every element.)
* A quantized dimension whose length is not a multiple of 16 is padded with zeros for the block
  computation; zeros never raise a block's amax, so padding never changes a real element's scale.

Packing: two codes per uint8, the first (even-index) element in the low nibble, as
``tl.dot_scaled`` expects; code bit 3 is the sign, bits 0-2 index {0, .5, 1, 1.5, 2, 3, 4, 6}.
"""

from __future__ import annotations

import torch

from .kernels.formats import (BLOCK, E2M1_VALUES, NVFP4Tensor, e2m1_decode, pack_nibbles,  # noqa: F401
                              unpack_nibbles)

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_EXP = -6  # smallest normal exponent; the subnormal step is 2^(-6-3) = 2^-9
# Rounding thresholds of E2M1 round-to-nearest-even (the midpoints between neighbouring values).
E2M1_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# ----------------------------------------------------------------------------------------------
# Scalar formats
# ----------------------------------------------------------------------------------------------

def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2**e for an int32 tensor e with -126 <= e <= 127, exactly, as float32 (built from bits)."""
    return ((e + 127) << 23).to(torch.int32).view(torch.float32)


def e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """Round non-negative finite float32 values to the nearest E4M3 value (ties to even), saturating
    at 448. Subnormals (step 2^-9) are kept. Exact: the result is representable in E4M3."""
    v = v.to(torch.float32)
    exp = ((v.view(torch.int32) >> 23) & 0xFF) - 127
    step = _pow2(torch.clamp(exp, min=E4M3_MIN_EXP) - 3)
    return torch.clamp(torch.round(v / step) * step, max=E4M3_MAX)


def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """Round float32 values to the nearest signed E2M1 value (ties to even), saturating at ±6."""
    a = y.abs()
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    mag = torch.clamp(torch.round(a / step) * step, max=E2M1_MAX)
    return torch.where(torch.signbit(y), -mag, mag)


def e2m1_encode(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8, 0..15) of values already on the signed E2M1 grid. The sign bit follows
    the sign bit of ``q``, so -0.0 (a small negative value rounded to zero) encodes as 0b1000."""
    a = q.abs()
    idx = torch.where(a < 2.0, a * 2.0, torch.where(a < 4.0, a + 2.0, a * 0.5 + 4.0))
    code = idx.to(torch.uint8)
    return torch.where(torch.signbit(q), code | 0x8, code)


# ----------------------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------------------

def _check_float(x: torch.Tensor, what: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{what} must be a floating tensor (float32, float16, bfloat16 or float64), "
                        f"got {x.dtype}")


def _to_blocks(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    """Move ``dim`` last, pad it to a multiple of 16 with zeros, return float32 (..., nb, 16)."""
    xt = x.movedim(dim, -1).to(torch.float32)
    n = xt.shape[-1]
    pad = (-n) % BLOCK
    if pad:
        xt = torch.nn.functional.pad(xt, (0, pad))
    return xt.reshape(*xt.shape[:-1], -1, BLOCK), n


def nvfp4_block_scale(amax: torch.Tensor) -> torch.Tensor:
    """Block scale from the block's absolute maximum: E4M3_RN(amax / 6) as float32; NaN where amax
    is not finite."""
    amax = amax.to(torch.float32)
    finite = torch.isfinite(amax)
    s = e4m3_round(torch.where(finite, amax, 0.0) / E2M1_MAX)
    return torch.where(finite, s, torch.nan)


def _quantize_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., nb, 16) float32 → (values on the E2M1 grid (..., nb, 16), scales (..., nb))."""
    scale = nvfp4_block_scale(blocks.abs().amax(dim=-1))
    s = scale.unsqueeze(-1)
    usable = (s > 0) & torch.isfinite(s)  # NaN scale (non-finite block) or zero scale → code 0
    q = e2m1_round(torch.where(usable, blocks / torch.where(usable, s, 1.0), 0.0))
    return q, scale


def fake_quantize_nvfp4(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Round every element of ``x`` to the NVFP4 grid of its 16-element block along ``dim``.

    Returns a tensor of the same shape and dtype whose values are ``code × scale``. For BF16 the
    result is exact (a dequantized NVFP4 value has at most 6 significant bits). See the module
    docstring for the rounding rules and the handling of zeros, padding and non-finite values.
    """
    _check_float(x)
    if x.dim() == 0:
        raise ValueError("fake_quantize_nvfp4 needs at least one dimension")
    blocks, n = _to_blocks(x, dim)
    q, scale = _quantize_blocks(blocks)
    deq = q * scale.unsqueeze(-1)  # NaN scale → NaN block
    deq = deq.reshape(*deq.shape[:-2], -1)[..., :n]
    return deq.movedim(-1, dim).to(x.dtype)


def quantize_nvfp4(x: torch.Tensor, dim: int = -1) -> NVFP4Tensor:
    """Quantize ``x`` to NVFP4 along ``dim``: packed E2M1 codes and E4M3 block scales.

    ``quantize_nvfp4(x, d).dequantize(x.dtype)`` equals ``fake_quantize_nvfp4(x, d)`` exactly.
    """
    _check_float(x)
    if x.dim() == 0:
        raise ValueError("quantize_nvfp4 needs at least one dimension")
    d = dim % x.dim()
    blocks, _ = _to_blocks(x, d)
    q, scale = _quantize_blocks(blocks)
    codes = e2m1_encode(q).reshape(*q.shape[:-2], -1)
    # Exact: every finite scale is an E4M3 value in [0, 448]; NaN maps to the E4M3 NaN.
    scales = scale.to(torch.float8_e4m3fn)
    return NVFP4Tensor(codes=pack_nibbles(codes).movedim(-1, d).contiguous(),
                       scales=scales.movedim(-1, d).contiguous(), shape=x.shape, dim=d)
