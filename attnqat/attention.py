"""The public attention entry point: ``attnqat.attention(q, k, v, method=..., backend=...)``.

Tensors are (batch, seq, heads, head_dim), as diffusers hands them to an attention processor and as
``flash_attn_func`` takes them. ``q`` may have a different sequence length from ``k``/``v``
(cross-attention). Methods (DESIGN.md §3.3):

========== ============================================================ ==================
method     what it computes                                             differentiable
========== ============================================================ ==================
bf16       plain softmax attention (PyTorch SDPA), the reference        yes (autograd)
nvfp4      4-bit attention: NVFP4 Q, K, V and P, no smoothing           no (inference)
sage3      SageAttention3's 4-bit recipe (smoothing, two-level P)       no (inference)
attnqat    forward as nvfp4; Attn-QAT backward (both principles)        yes (explicit)
dropin     forward as nvfp4; ordinary FlashAttention backward (ablation) yes (explicit)
========== ============================================================ ==================

Methods are defined in one place, the registry :mod:`attnqat.methods`; the table above lists the
built-in ones and this module reads the registry, so a registered method is accepted here too.

Backends: ``"torch"`` is the method's PyTorch reference (:mod:`attnqat.ops` over
:mod:`attnqat.reference`), ``"triton"`` its fused kernels (:mod:`attnqat.kernels`, CUDA), ``"auto"``
the kernels where they support the inputs and otherwise the PyTorch reference OF THE SAME METHOD,
with a one-time warning saying why. No backend ever substitutes a different method.
"""

from __future__ import annotations

import math
import warnings

import torch

from . import methods as registry
from . import reference as ref

#: the built-in methods (registered by :mod:`attnqat.methods` at import); the live lists are
#: :func:`attnqat.methods.names` and friends, which include methods registered later
METHODS = registry.names()
FP4_METHODS = registry.four_bit()
TRAINABLE_METHODS = registry.trainable()
BACKENDS = ("auto", "torch", "triton")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def validate(q, k, v, method: str, softmax_scale, backend: str) -> float:
    """Check the inputs at the boundary; return the softmax scale to use."""
    registry.get(method)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, seq, heads, head_dim), "
                             f"got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor (bfloat16, float16 or float32), got {t.dtype}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has unsupported dtype {t.dtype}; expected bfloat16, float16 or float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if not (q.shape[2] == k.shape[2] == v.shape[2]):
        raise ValueError(f"number of heads differs: q {q.shape[2]}, k {k.shape[2]}, v {v.shape[2]} "
                         "(dimension 2 of (batch, seq, heads, head_dim))")
    if not (q.shape[3] == k.shape[3] == v.shape[3]):
        raise ValueError(f"head_dim differs: q {q.shape[3]}, k {k.shape[3]}, v {v.shape[3]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same sequence length, got {k.shape[1]} and {v.shape[1]}")
    if min(q.shape) == 0 or min(k.shape) == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if softmax_scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    scale = float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return scale


def _kernels():
    """The fused kernel package's entry points, or None with the reason they cannot be used.

    Imported here, on first use, not at the top: it imports triton (0.3 s, and 1.6–2.5 s while
    other work ran, on the 2-core CI machine, 2026-11-26), which ``import attnqat`` and every CPU-only command would pay for nothing.
    """
    try:
        from .kernels import api  # noqa: PLC0415  (imports triton; optional on CPU machines)
    except Exception as exc:  # pragma: no cover - depends on the machine
        return None, f"the Triton kernels could not be imported ({type(exc).__name__}: {exc})"
    return api, None


def _kernel(m: registry.AttentionMethod, q, k, v):
    """(run, None) when ``m``'s kernel takes these inputs, else (None, why not)."""
    spec = m.kernel
    if spec is None:
        return None, f"method {m.name!r} has no fused kernel"
    if spec.run is not None:
        why = spec.unsupported(q, k, v) if spec.unsupported is not None else None
        return spec.run, why
    api, why = _kernels()
    if api is None:
        return None, why
    why = api.triton_unsupported(q, k, v, spec.name)
    return (lambda q, k, v, scale: api.triton_attention(q, k, v, method=spec.name, softmax_scale=scale)), why


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, method: str = "bf16",
              softmax_scale: float | None = None, backend: str = "auto",
              ablation: str | None = None) -> torch.Tensor:
    """Attention on (batch, seq, heads, head_dim) tensors with a method of :mod:`attnqat.methods`.

    Args:
        q: queries (B, Sq, H, D). k, v: keys and values (B, Skv, H, D). One floating dtype
            (bfloat16, float16 or float32) and one device for all three.
        method: ``bf16`` | ``nvfp4`` | ``sage3`` | ``attnqat`` | ``dropin`` (module docstring), or
            any other registered method.
        softmax_scale: multiplies Q Kᵀ before the softmax; default 1/sqrt(head_dim).
        backend: ``auto`` | ``torch`` | ``triton``.
        ablation: with ``method="attnqat"`` only, switch one stability principle off in the
            backward (:data:`attnqat.reference.ABLATIONS`: ``"d_from_o"``, ``"p_unquantized"``).
            The forward is unchanged. Runs on the PyTorch reference (``backend="triton"`` is an
            error; ``"auto"`` uses the reference, with a one-time warning on CUDA).

    Returns:
        (B, Sq, H, D) in the dtype of ``q``.
    """
    scale = validate(q, k, v, method, softmax_scale, backend)
    m = registry.get(method)
    if ablation is not None:
        ref.check_ablation(ablation)
        if ablation not in m.ablations:
            takers = " or ".join(repr(n) for n in registry.with_ablations())
            raise ValueError(f"ablation {ablation!r} applies to method {takers} only, not {method!r}")
        if backend == "triton":
            raise RuntimeError(f"backend='triton' cannot run the Attn-QAT ablation {ablation!r}: the "
                               "ablations exist on the PyTorch reference only (backend='torch')")
        if q.device.type == "cuda" and backend == "auto":
            _warn_once(f"ablation:{ablation}", f"attnqat.attention: the Attn-QAT ablation {ablation!r} "
                       "runs on the PyTorch reference (no Triton kernel implements it)")
        return m.reference(q, k, v, scale, ablation=ablation)
    if backend == "torch" or (backend == "auto" and (q.device.type != "cuda" or m.kernel is None)):
        return m.reference(q, k, v, scale)
    run, why = _kernel(m, q, k, v)
    if why is None:
        return run(q, k, v, scale)
    if backend == "triton":
        raise RuntimeError(f"backend='triton' cannot run method {method!r} here: {why}")
    _warn_once(f"{method}:{why}", f"attnqat.attention: Triton kernel not used for method {method!r} "
               f"({why}); running the PyTorch reference of the same method instead")
    return m.reference(q, k, v, scale)
