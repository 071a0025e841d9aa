"""Triton kernels (installed as ``attnqat.kernels``).

Entry points (:mod:`.api`, imported on first use of any of them):

* ``triton_unsupported(q, k, v, method) -> str | None`` — None when the kernels can run these inputs,
  else a sentence saying why not (the caller falls back to the PyTorch reference of the same method).
* ``triton_attention(q, k, v, method, softmax_scale) -> Tensor`` — (B, Sq, H, D) in q's dtype,
  differentiable for ``attnqat`` and ``dropin``.

Modules: :mod:`.formats` (what the kernels and the PyTorch reference share: tile sizes, the
packed NVFP4 container; torch only), :mod:`.api` (the entry points), :mod:`.quantize` (NVFP4 quantize/pack), :mod:`.attention_fwd` (the fused 4-bit forward:
``nvfp4`` inference and the ``attnqat`` training forward with O'), :mod:`.attention_bwd` (the
``attnqat`` and ``dropin`` backward), :mod:`.gluon_fwd` (the ``nvfp4`` and ``sage3`` forwards
hand-scheduled in Gluon for Hopper: what ``backend="auto"`` runs there), :mod:`.gluon_fwd_qat` (the
``attnqat`` training forward in Gluon, likewise), :mod:`.gluon_bwd` (the
backward's dK/dV and dQ kernels in Gluon for Hopper: same bits, likewise), :mod:`.sage3` (SageAttention3
numerics), :mod:`.sagebwd` (``sagebwd``, trainable INT8 attention: forward, backward and its
quantization pass), :mod:`.gluon_sagebwd` (the ``sagebwd`` backward in Gluon for Hopper, its default
there), :mod:`.sagebwd_bench` (its tuning bench), :mod:`.bench` (``attnqat bench kernels``), :mod:`.sass` (machine code read without a GPU).

Imports point one way: the rest of the project imports this package, never the reverse (the
shared definitions live in :mod:`.formats`, below both).
"""

from __future__ import annotations

import importlib

_API = ("triton_unsupported", "triton_attention", "quantize_nvfp4", "fake_quantize_nvfp4", "METHODS",
        "TRAINABLE", "HEAD_DIMS", "DTYPES", "interpreting", "nvfp4_forward",
        "fp4_training_attention", "sagebwd_attention", "sagebwd_unsupported")

__all__ = list(_API)


def __getattr__(name: str):
    """Resolve the entry points and submodules on first use (PEP 562).

    Lazy on purpose: :mod:`attnqat.nvfp4` imports :mod:`.formats` at every ``import attnqat``, and
    the entry points import triton and compile-time kernel definitions (0.3 s, and 1.6–2.5 s while
    other work ran, measured on the 2-core CI machine, 2026-11-26, after ``import attnqat``), which CPU-only commands would pay for nothing.
    """
    if name in _API:
        return getattr(importlib.import_module(".api", __name__), name)
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
