"""attnqat: 4-bit (NVFP4) attention for Wan 2.1 video generation.

Public surface:

* :func:`fake_quantize_nvfp4`, :func:`quantize_nvfp4`, :class:`NVFP4Tensor` — the NVFP4 format;
* :func:`attention` and :data:`METHODS` — attention with ``bf16``, ``nvfp4``, ``sage3``,
  ``attnqat`` or ``dropin`` numerics on (batch, seq, heads, head_dim) tensors; the methods are
  defined in one registry, :mod:`attnqat.methods` (where a new one is registered).
"""

from .attention import BACKENDS, FP4_METHODS, METHODS, attention
from .nvfp4 import NVFP4Tensor, fake_quantize_nvfp4, quantize_nvfp4

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "FP4_METHODS",
    "METHODS",
    "NVFP4Tensor",
    "attention",
    "fake_quantize_nvfp4",
    "quantize_nvfp4",
    "__version__",
]
