"""The PyTorch reference of each attention method on (batch, seq, heads, head_dim) tensors.

:mod:`attnqat.reference` holds the numerics in (B, H, S, D) layout; these functions are what the
registry (:mod:`attnqat.methods`) calls each method's ``reference``: one signature,
``f(q, k, v, scale) -> o`` with q (B, Sq, H, D), k and v (B, Skv, H, D), o in q's dtype.
Inputs are checked by :func:`attnqat.attention` before they get here. The 4-bit methods run as
operators registered with PyTorch (``torch.ops.attnqat.fp4_attention`` and
``torch.ops.attnqat.fp4_train_forward``, with fake implementations and, for the trainable ones, a
registered backward), so ``torch.compile`` sees one op per attention call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import reference as ref
from . import sagebwd


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


# ----------------------------------------------------------------------------------------------
# Operators registered with PyTorch (torch.library): torch.compile meets one opaque op per call, with
# a fake (meta) implementation for shapes and a registered backward, instead of tracing the
# reference's Python loops or stopping at a plain autograd Function.
# ----------------------------------------------------------------------------------------------

#: (o, saved_a, saved_b, saved_c, d_src, lse, row_max) — see :func:`_fp4_train_forward`
_TrainOut = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@torch.library.custom_op("attnqat::fp4_attention", mutates_args=())
def _fp4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, recipe: str) -> torch.Tensor:
    """The 4-bit inference forward (``recipe``: ``nvfp4`` or ``sage3``) on (B, S, H, D) tensors."""
    o = ref.fp4_forward(_bhsd(q), _bhsd(k), _bhsd(v), scale, recipe).o
    return o.to(q.dtype).transpose(1, 2).contiguous()


@_fp4_attention.register_fake
def _(q, k, v, scale, recipe):
    return q.new_empty(q.shape)


@torch.library.custom_op("attnqat::fp4_train_forward", mutates_args=())
def _fp4_train_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, method: str,
                       ablation: str | None) -> _TrainOut:
    """The nvfp4 forward of ``attnqat`` / ``dropin`` and what their backward needs.

    Returns O (B, Sq, H, D, q's dtype) and, in (B, H, S, D) layout — attnqat: Qᶠ, Kᶠ, Vᶠ (dequantized,
    exact in q's dtype), the float32 output D is computed from (O', or O under the ablation
    ``d_from_o``), the log-sum-exp and the row maximum (empty under ``p_unquantized``: dV then uses P
    itself); dropin: three empty tensors (its backward takes the inputs themselves), the float32 O
    and the log-sum-exp, and an empty row maximum.
    """
    attnqat = method == "attnqat"
    f = ref.fp4_forward(_bhsd(q), _bhsd(k), _bhsd(v), scale, ref.NVFP4,
                        need_o_prime=attnqat and ablation != "d_from_o")
    # a copy always: with one head (or one query) the transposed O is already contiguous and would
    # alias the float32 O returned for the backward, which a custom op may not do
    o = f.o.to(q.dtype).transpose(1, 2).clone(memory_format=torch.contiguous_format)
    none = f.lse.new_empty(0)
    if not attnqat:
        e = q.new_empty(0)
        return o, e, e.clone(), e.clone(), f.o.contiguous(), f.lse.contiguous(), none
    dt = q.dtype
    d_src = f.o if ablation == "d_from_o" else f.o_prime
    row_max = none if ablation == "p_unquantized" else f.row_max
    # contiguous: the fake implementation promises standard strides
    return (o, *(t.to(dt).contiguous() for t in (f.qf, f.kf, f.vf)), d_src.contiguous(), f.lse.contiguous(),
            row_max.contiguous())


@_fp4_train_forward.register_fake
def _(q, k, v, scale, method, ablation):
    B, Sq, H, D = q.shape
    Skv = k.shape[1]
    f32 = torch.float32
    o = q.new_empty(B, Sq, H, D)
    lse = q.new_empty(B, H, Sq, dtype=f32)
    none = q.new_empty(0, dtype=f32)
    if method != "attnqat":
        e = q.new_empty(0)
        return o, e, e.clone(), e.clone(), q.new_empty(B, H, Sq, D, dtype=f32), lse, none
    row_max = none if ablation == "p_unquantized" else q.new_empty(B, H, Sq, dtype=f32)
    return (o, q.new_empty(B, H, Sq, D), k.new_empty(B, H, Skv, D), v.new_empty(B, H, Skv, D),
            q.new_empty(B, H, Sq, D, dtype=f32), lse, row_max)


def _train_setup_context(ctx, inputs, output) -> None:
    q, k, v, scale, method, ablation = inputs
    _, a, b, c, d_src, lse, row_max = output
    if method == "attnqat":
        ctx.save_for_backward(a, b, c, d_src, lse, row_max)
    else:
        ctx.save_for_backward(q, k, v, d_src, lse)
    ctx.scale, ctx.method, ctx.row_max = scale, method, ablation != "p_unquantized"


def _train_backward(ctx, do, *_unused):
    """The explicit backward (:func:`attnqat.reference.attnqat_backward` /
    :func:`attnqat.reference.dropin_backward`); the extra outputs get no gradient."""
    dob = _bhsd(do)
    if ctx.method == "attnqat":
        qf, kf, vf, d_src, lse, row_max = ctx.saved_tensors
        dq, dk, dv = ref.attnqat_backward(qf, kf, vf, d_src, lse, row_max if ctx.row_max else None, dob,
                                          ctx.scale)
    else:
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ref.dropin_backward(_bhsd(q), _bhsd(k), _bhsd(v), o, lse, dob, ctx.scale)
    dt = do.dtype
    return (dq.to(dt).transpose(1, 2), dk.to(dt).transpose(1, 2), dv.to(dt).transpose(1, 2),
            None, None, None)


_fp4_train_forward.register_autograd(_train_backward, setup_context=_train_setup_context)


def _inference_only(method: str, q, k, v) -> None:
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise RuntimeError(f"method {method!r} is inference-only and has no backward; use 'attnqat' "
                           "(Attn-QAT training) or 'dropin' (the ablation) to train with 4-bit attention, "
                           "or run under torch.no_grad()")


def sdpa_attention(q, k, v, scale: float) -> torch.Tensor:
    """``bf16``: plain softmax attention (PyTorch SDPA), differentiable by autograd."""
    return F.scaled_dot_product_attention(_bhsd(q), _bhsd(k), _bhsd(v), scale=scale).transpose(1, 2)


def _fp4_inference(q, k, v, scale: float, recipe: str) -> torch.Tensor:
    _inference_only(recipe, q, k, v)
    return torch.ops.attnqat.fp4_attention(q, k, v, float(scale), recipe)


def nvfp4_attention(q, k, v, scale: float) -> torch.Tensor:
    """``nvfp4``: 4-bit Q, K, V and P, no smoothing (inference only)."""
    return _fp4_inference(q, k, v, scale, ref.NVFP4)


def sage3_attention(q, k, v, scale: float) -> torch.Tensor:
    """``sage3``: SageAttention3's 4-bit recipe (inference only)."""
    return _fp4_inference(q, k, v, scale, ref.SAGE3)


def attnqat_attention(q, k, v, scale: float, ablation: str | None = None) -> torch.Tensor:
    """``attnqat``: the nvfp4 forward with the Attn-QAT backward (``ablation``: one principle off)."""
    return torch.ops.attnqat.fp4_train_forward(q, k, v, float(scale), "attnqat", ablation)[0]


def dropin_attention(q, k, v, scale: float) -> torch.Tensor:
    """``dropin``: the nvfp4 forward with an ordinary FlashAttention backward (the ablation)."""
    return torch.ops.attnqat.fp4_train_forward(q, k, v, float(scale), "dropin", None)[0]


def sagebwd_attention(q, k, v, scale: float) -> torch.Tensor:
    """``sagebwd``: INT8 Q·Kᵀ and P̃·V with K smoothed, its backward INT8 but for dP = dO·Vᵀ
    (:mod:`attnqat.sagebwd`; differentiable)."""
    return sagebwd.sagebwd_reference(q, k, v, scale)
