"""What the kernels and the PyTorch reference share, below both: tile sizes that are part of the
methods' definitions and the packed NVFP4 container.

Dependency-free (torch only): :mod:`attnqat.nvfp4` and :mod:`attnqat.reference` import it from
here, and so do the kernels, so imports point one way (app/finetune/eval → attnqat → kernels) and
importing it never imports triton (:mod:`attnqat.kernels` resolves its kernel entry points lazily).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 16             # NVFP4 block: 16 elements along the contraction axis share one E4M3 scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
KV_TILE = 128          # key-tile width that defines the running maximum of the nvfp4 forward
SAGE_Q_BLOCK = 128     # query block over which sage3 subtracts the mean of Q

# sagebwd (INT8, trainable): its block sizes are part of its definition (docs/numerics.md, "sagebwd")
SAGEBWD_Q_BLOCK = 128      # queries per Q scale (and per forward query tile)
SAGEBWD_K_BLOCK = 128      # keys per K and V scale; the forward's key tile that defines the running maximum
SAGEBWD_BWD_BLOCK_Q = 128  # backward: dO per 128 queries; P per key over 128 queries; dS per 128 queries ×
SAGEBWD_BWD_BLOCK_K = 64   # 64 keys (the kernels' backward tiles: dK/dV 64 keys × 128 queries, dQ 128 × 64)
INT8_MAX = 127.0           # s = max|X| / 127


def key_mean(k: torch.Tensor) -> torch.Tensor:
    """k̄: K's float32 mean over tokens, (B, H, D), from (B, S, H, D) ``k`` — what sagebwd subtracts
    from K. The reference and the kernels' wrapper call this one function, so the smoothed K agrees
    bit for bit."""
    return torch.mean(k, dim=1, dtype=torch.float32)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """float32 values of 4-bit E2M1 codes (uint8, 0..15)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=code.device)
    mag = table[(code & 0x7).long()]
    return torch.where((code & 0x8) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes (0..15) along the last dimension (even length): element 2i in the low
    nibble of byte i, element 2i+1 in the high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"the last dimension must be even to pack nibbles, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], -1)


@dataclass
class NVFP4Tensor:
    """A tensor quantized to NVFP4 along one dimension.

    ``codes``  uint8, packed two per byte along ``dim`` (low nibble first)
    ``scales`` float8_e4m3fn (NaN for non-finite blocks)
    Both keep the original tensor's axis order and sizes except along ``dim``, whose length
    becomes ``padded_len // 2`` for the codes and ``padded_len // 16`` for the scales
    (``padded_len``: the length of ``dim`` rounded up to a multiple of 16). Quantized along the
    last axis, a row's codes are contiguous; quantized along another axis (V along tokens in
    (batch, seq, heads, dim)), a byte holds two consecutive positions of that axis and the
    other axes stay contiguous, the ``[K/2, N]`` right operand ``tl.dot_scaled`` takes.
    ``shape`` and ``dim`` describe the original tensor; ``dim`` is non-negative.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    dim: int

    def scales_float(self) -> torch.Tensor:
        return self.scales.to(torch.float32)

    def unpacked_codes(self) -> torch.Tensor:
        """uint8 codes (0..15), the original shape with ``dim`` padded to ``padded_len``."""
        return unpack_nibbles(self.codes.movedim(self.dim, -1)).movedim(-1, self.dim)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        vals = e2m1_decode(unpack_nibbles(self.codes.movedim(self.dim, -1)))
        scales = self.scales_float().movedim(self.dim, -1)
        vals = vals.reshape(*vals.shape[:-1], -1, BLOCK) * scales.unsqueeze(-1)
        vals = vals.reshape(*vals.shape[:-2], -1)[..., : self.shape[self.dim]]
        return vals.movedim(-1, self.dim).to(dtype)
