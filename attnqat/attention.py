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

What ran is recorded, not inferred from the settings: inside :func:`dispatch_log` every call adds
one :class:`Dispatch` — the implementation that computed it (``sdpa`` with the SDPA backend torch's
own dispatcher picked, ``reference``, ``triton`` or ``gluon`` as the kernels' dispatch noted it),
device, dtype, and the reason when ``auto`` fell back from the kernels to the reference.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from typing import Iterator

import torch
from torch.nn.attention import SDPBackend

from . import methods as registry
from . import ops
from . import reference as ref
from .kernels import receipt

#: the built-in methods (registered by :mod:`attnqat.methods` at import); the live lists are
#: :func:`attnqat.methods.names` and friends, which include methods registered later
METHODS = registry.names()
FP4_METHODS = registry.four_bit()
TRAINABLE_METHODS = registry.trainable()
BACKENDS = ("auto", "torch", "triton")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_warned: set[str] = set()


@dataclass(frozen=True)
class Dispatch:
    """One kind of attention call as it ran: ``method``; ``implementation`` — ``"sdpa"`` (PyTorch
    scaled_dot_product_attention; ``detail`` is the backend torch's dispatcher chose for these
    inputs: FLASH_ATTENTION, EFFICIENT_ATTENTION, CUDNN_ATTENTION, MATH, ...), ``"reference"``
    (the PyTorch reference of :mod:`attnqat.reference`), ``"triton"`` or ``"gluon"`` (the fused
    kernels, as their own dispatch chose); ``fallback`` — why ``backend="auto"`` did not run the
    kernels it would have preferred (None when nothing fell back)."""

    method: str
    implementation: str
    device: str
    dtype: str
    backend: str
    detail: str | None = None
    fallback: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class DispatchLog:
    """Counts of :class:`Dispatch` records gathered by :func:`dispatch_log`."""

    def __init__(self) -> None:
        self.counts: Counter[Dispatch] = Counter()

    def add(self, d: Dispatch) -> None:
        self.counts[d] += 1

    def clear(self) -> None:
        self.counts.clear()

    def entries(self) -> list[dict]:
        """Each distinct dispatch with its ``calls``, most frequent first."""
        return [{**d.to_dict(), "calls": n} for d, n in self.counts.most_common()]


_LOG: ContextVar[DispatchLog | None] = ContextVar("attnqat_dispatch_log", default=None)


@contextmanager
def dispatch_log(log: DispatchLog | None = None) -> Iterator[DispatchLog]:
    """Record every :func:`attention` call inside the block into ``log`` (a new one if None)."""
    log = DispatchLog() if log is None else log
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


def _sdpa_backend(q, k, v, scale: float) -> str:
    """The SDPA backend torch's dispatcher picks for these (B, H, S, D) inputs (the function SDPA
    itself calls to choose)."""
    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, False, scale=scale)).name
    except Exception as exc:  # noqa: BLE001 - a private torch function; say that it is unknown
        return f"unknown ({type(exc).__name__})"


def _active_log() -> DispatchLog | None:
    """The log of the enclosing :func:`dispatch_log`, or None. None while ``torch.compile`` traces:
    a receipt is per call as it runs, which a compiled graph does not replay (and dynamo cannot
    trace a ``ContextVar`` read)."""
    if torch.compiler.is_compiling():
        return None
    return _LOG.get()


def _record(q, method: str, implementation: str, backend: str, detail: str | None = None,
            fallback: str | None = None) -> None:
    log = _active_log()
    if log is not None:
        log.add(Dispatch(method=method, implementation=implementation, device=str(q.device),
                         dtype=str(q.dtype).removeprefix("torch."), backend=backend, detail=detail,
                         fallback=fallback))


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


def _reference(m: registry.AttentionMethod, q, k, v, scale: float, backend: str,
               fallback: str | None = None) -> torch.Tensor:
    """``m``'s PyTorch reference, recorded as what ran: ``sdpa`` (with the SDPA backend torch's
    dispatcher picks) when the reference is PyTorch's SDPA, ``reference`` otherwise."""
    if _active_log() is not None:
        if m.reference is ops.sdpa_attention:
            qb, kb, vb = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            _record(q, m.name, "sdpa", backend, _sdpa_backend(qb, kb, vb, scale), fallback)
        else:
            _record(q, m.name, "reference", backend, None, fallback)
    return m.reference(q, k, v, scale)


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
        _record(q, method, "reference", backend, ablation)
        return m.reference(q, k, v, scale, ablation=ablation)
    if backend == "torch" or (backend == "auto" and (q.device.type != "cuda" or m.kernel is None)):
        # auto on a CPU: the kernels need CUDA, so the reference is what auto means there
        return _reference(m, q, k, v, scale, backend)
    run, why = _kernel(m, q, k, v)
    if why is None:
        if _active_log() is None:
            return run(q, k, v, scale)
        with receipt.collect() as ran:
            out = run(q, k, v, scale)
        # the kernels note each Gluon/Triton choice they make; the paths that have no Gluon
        # version make none, and are Triton kernels
        _record(q, method, "+".join(dict.fromkeys(ran)) or "triton", backend)
        return out
    if backend == "triton":
        raise RuntimeError(f"backend='triton' cannot run method {method!r} here: {why}")
    _warn_once(f"{method}:{why}", f"attnqat.attention: Triton kernel not used for method {method!r} "
               f"({why}); running the PyTorch reference of the same method instead")
    return _reference(m, q, k, v, scale, backend, fallback=why)
