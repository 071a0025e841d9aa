"""The kernels' entry points, what :mod:`attnqat.kernels` exposes (it imports this module on first use).

Contract with :func:`attnqat.attention` (backend ``"triton"`` / ``"auto"``):

* ``triton_unsupported(q, k, v, method) -> str | None`` — None when the kernels can run these inputs,
  else a sentence saying why not (the caller falls back to the PyTorch reference of the same method).
* ``triton_attention(q, k, v, method, softmax_scale) -> Tensor`` — (B, Sq, H, D) in q's dtype,
  differentiable for ``attnqat`` and ``dropin``.

Supported: CUDA tensors (or the Triton interpreter, ``TRITON_INTERPRET=1``, through
:func:`triton_attention` directly), bfloat16 or float16, head_dim 64 or 128, any sequence lengths
(self- and cross-attention), any strides of the (batch, seq, heads, head_dim) views.
"""

from __future__ import annotations

import json
import math

import torch

from . import gluon_fwd, gluon_fwd_qat, sage3
from .attention_bwd import attention_backward
from .attention_fwd import KV_TILE as ATTENTION_FWD_KV_TILE
from .attention_fwd import P_NVFP4, attention_forward
from .formats import KV_TILE
from .gluon_fwd import check_schedule, choose_schedule
from .quantize import INTERPRET, fake_quantize_nvfp4, quantize_nvfp4
from .sagebwd import sagebwd_attention, sagebwd_unsupported

__all__ = ["triton_unsupported", "triton_attention", "quantize_nvfp4", "fake_quantize_nvfp4",
           "METHODS", "TRAINABLE", "HEAD_DIMS", "DTYPES", "sagebwd_attention", "sagebwd_unsupported"]

#: the methods these kernels implement (their names in :mod:`attnqat.methods`), and those of them
#: with a backward
METHODS = ("nvfp4", "sage3", "attnqat", "dropin")
TRAINABLE = ("attnqat", "dropin")
HEAD_DIMS = (64, 128)
DTYPES = (torch.bfloat16, torch.float16)

if KV_TILE != ATTENTION_FWD_KV_TILE.value:  # pragma: no cover - one definition, read by both
    raise ImportError(f"the kernels quantize P against {ATTENTION_FWD_KV_TILE.value}-key tiles, "
                      f"formats.KV_TILE says {KV_TILE}")


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``, read at
    import, as the kernels read it)."""
    return bool(INTERPRET.value)


def _why_not(q, k, v, method: str, allow_cpu: bool) -> str | None:
    if method not in METHODS:
        return (f"method {method!r} has no Triton kernel (kernels exist for {', '.join(METHODS)}; "
                "'bf16' runs PyTorch SDPA)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
        if t.dim() != 4:
            return f"{name} must be (batch, seq, heads, head_dim), got shape {tuple(t.shape)}"
        if t.dtype not in DTYPES:
            return f"{name} is {t.dtype}; the kernels take bfloat16 or float16"
        if t.device.type != "cuda" and not (allow_cpu and t.device.type == "cpu"):
            return f"{name} is on {t.device.type}; the kernels need CUDA tensors"
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        return "q, k, v must share one dtype and one device"
    if q.shape[0] != k.shape[0] or k.shape[0] != v.shape[0] or q.shape[2] != k.shape[2] or k.shape[2] != v.shape[2]:
        return f"batch or head counts differ: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if k.shape[1] != v.shape[1]:
        return f"k and v lengths differ: {k.shape[1]} and {v.shape[1]}"
    if not (q.shape[3] == k.shape[3] == v.shape[3]):
        return f"head_dim differs: q {q.shape[3]}, k {k.shape[3]}, v {v.shape[3]}"
    if q.shape[3] not in HEAD_DIMS:
        return f"head_dim {q.shape[3]} is not supported (the kernels take {' or '.join(map(str, HEAD_DIMS))})"
    if min(q.shape) == 0 or min(k.shape) == 0:
        return f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}"
    return None


def triton_unsupported(q, k, v, method: str) -> str | None:
    """None when :func:`triton_attention` can run these inputs, else why not (one sentence)."""
    return _why_not(q, k, v, method, allow_cpu=False)


def _default_formulation(device: torch.device) -> int:
    """0: dequantized operands (fastest on Hopper, docs/kernels_notes.md); 2: ``tl.dot_scaled``
    on GPUs with FP4 tensor cores (compute capability 10 and up)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10:
        return 2
    return 0


def nvfp4_forward(q, k, v, sm_scale: float, formulation: int | None = None, config=None,
                  schedule: str | None = None):
    """``nvfp4`` inference forward on (B, S, H, D) inputs, quantization included.
    ``schedule`` (formulation 0 only): ``"gluon"`` | ``"triton"`` | None (:func:`.gluon_fwd.choose_schedule`)."""
    check_schedule(schedule)   # here too: formulations 1 and 2 never reach choose_schedule
    f = _default_formulation(q.device) if formulation is None else formulation
    if f not in (0, 1, 2):
        raise ValueError(f"formulation must be 0, 1 or 2, got {formulation!r}")
    if f == 2 and not (q.device.type == "cuda" and torch.cuda.get_device_capability(q.device)[0] >= 10):
        # Triton 3.6 rejects E4M3 block-16 scales in its Hopper emulation of tl.dot_scaled (the
        # compiler aborts); the interpreter decodes every scale as E8M0 (docs/kernels_notes.md)
        raise ValueError("formulation 2 (tl.dot_scaled with NVFP4 operands) needs FP4 tensor cores "
                         "(compute capability 10 or newer); use 0 or 1 here")
    if f == 0:
        qf = fake_quantize_nvfp4(q, -1)
        kf = fake_quantize_nvfp4(k, -1)
        vf = fake_quantize_nvfp4(v, 1)
        if choose_schedule(qf, kf, vf, schedule, config) == "gluon":
            return gluon_fwd.gluon_attention_forward(qf, kf, vf, sm_scale=sm_scale)
        o, _, _, _ = attention_forward(qf, kf, vf, sm_scale=sm_scale, p_mode=P_NVFP4, config=config)
    else:
        if schedule == "gluon":
            raise ValueError(f"the Gluon nvfp4 forward implements formulation 0 only, not {f}")
        packed = (quantize_nvfp4(q, -1), quantize_nvfp4(k, -1), quantize_nvfp4(v, 1))
        o, _, _, _ = attention_forward(q, k, v, sm_scale=sm_scale, p_mode=P_NVFP4, packed=packed,
                                       formulation=f, config=config)
    return o


# ``attnqat`` / ``dropin`` on the fused kernels as an operator registered with PyTorch: a fake
# implementation (shapes, dtypes and standard strides) and a registered backward, so torch.compile
# meets one op. ``config`` travels as JSON text (an op's schema takes no dicts).
_TrainOut = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@torch.library.custom_op("attnqat::triton_fp4_train_forward", mutates_args=())
def _train_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, method: str,
                   config: str | None, schedule: str | None) -> _TrainOut:
    """O (B, Sq, H, D) and what the backward needs — attnqat: Qᶠ, Kᶠ, Vᶠ (dequantized, exact in the
    input dtype), O' (float32), the row log-sum-exp and maximum; dropin: three empty tensors (its
    backward takes Q, K, V themselves), the FP4 O (float32), the log-sum-exp and an empty maximum."""
    attnqat = method == "attnqat"
    qf = fake_quantize_nvfp4(q, -1)
    kf = fake_quantize_nvfp4(k, -1)
    vf = fake_quantize_nvfp4(v, 1)
    fwd_config = (json.loads(config) if config else {}).get("fwd")
    if attnqat and gluon_fwd_qat.choose_qat_schedule(qf, kf, vf, schedule, fwd_config) == "gluon":
        o, o2, lse2, m2 = gluon_fwd_qat.gluon_attnqat_forward(qf, kf, vf, sm_scale=scale)
    else:
        # dropin's D = rowsum(dO ∘ O) takes O in float32, as attnqat's takes O' (float32)
        o, o2, lse2, m2 = attention_forward(qf, kf, vf, sm_scale=scale, p_mode=P_NVFP4, need_o2=attnqat,
                                            store_stats=True, out_dtype=None if attnqat else torch.float32,
                                            config=fwd_config)
    if attnqat:
        return (o.to(q.dtype).contiguous(), qf.contiguous(), kf.contiguous(), vf.contiguous(), o2.contiguous(),
                lse2.contiguous(), m2.contiguous())
    del qf, kf, vf
    e = q.new_empty(0)
    return (o.to(q.dtype).contiguous(), e, e.clone(), e.clone(), o.contiguous(), lse2.contiguous(),
            lse2.new_empty(0))


@_train_forward.register_fake
def _(q, k, v, scale, method, config, schedule):
    B, Sq, H, D = q.shape
    f32 = torch.float32
    lse = q.new_empty(B, H, Sq, dtype=f32)
    if method == "attnqat":
        return (q.new_empty(q.shape), q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
                q.new_empty(q.shape, dtype=f32), lse, q.new_empty(B, H, Sq, dtype=f32))
    e = q.new_empty(0)
    return q.new_empty(q.shape), e, e.clone(), e.clone(), q.new_empty(q.shape, dtype=f32), lse, lse.new_empty(0)


def _train_setup_context(ctx, inputs, output) -> None:
    q, k, v, scale, method, config, schedule = inputs
    _, qf, kf, vf, o2, lse2, m2 = output
    if method == "attnqat":
        ctx.save_for_backward(qf, kf, vf, o2, lse2, m2)
    else:
        ctx.save_for_backward(q, k, v, o2, lse2)
    ctx.scale, ctx.method, ctx.schedule = scale, method, schedule
    ctx.config = (json.loads(config) if config else {}).get("bwd")


def _train_backward(ctx, do, *_unused):
    if ctx.method == "attnqat":
        qf, kf, vf, o2, lse2, m2 = ctx.saved_tensors
        dq, dk, dv = attention_backward(qf, kf, vf, o2, do, lse2, m2, sm_scale=ctx.scale, quant_p=True,
                                        config=ctx.config, schedule=ctx.schedule)
    else:
        q, k, v, o, lse2 = ctx.saved_tensors
        dq, dk, dv = attention_backward(q, k, v, o, do, lse2, None, sm_scale=ctx.scale, quant_p=False,
                                        config=ctx.config, schedule=ctx.schedule)
    return dq, dk, dv, None, None, None, None


_train_forward.register_autograd(_train_backward, setup_context=_train_setup_context)


def fp4_training_attention(q, k, v, scale: float, method: str, config: dict | None = None,
                           schedule: str | None = None) -> torch.Tensor:
    """``attnqat`` / ``dropin`` on the fused kernels, (B, S, H, D) in and out, differentiable
    (``torch.ops.attnqat.triton_fp4_train_forward``)."""
    cfg = json.dumps(config, sort_keys=True) if config else None
    return torch.ops.attnqat.triton_fp4_train_forward(q, k, v, float(scale), method, cfg, schedule)[0]


def triton_attention(q, k, v, method: str = "nvfp4", softmax_scale: float | None = None, *,
                     formulation: int | None = None, config: dict | None = None,
                     schedule: str | None = None) -> torch.Tensor:
    """4-bit attention on the fused kernels. (B, Sq, H, D) in q's dtype.

    Raises ``ValueError`` naming the reason for inputs the kernels do not take (see
    :func:`triton_unsupported`; CPU tensors are accepted only under the Triton interpreter), and
    ``RuntimeError`` when gradients are requested from an inference-only method.
    ``formulation`` (nvfp4 only): 0 dequantized bfloat16 operands, 1 packed operands dequantized in
    registers, 2 ``tl.dot_scaled``; default: the fastest on this GPU. ``config``: tile overrides.
    ``schedule`` (nvfp4 formulation 0, sage3, attnqat, dropin): ``"gluon"`` the hand-scheduled Hopper
    kernels, ``"triton"`` the Triton kernels; default: Gluon wherever it takes the inputs (faster on
    an H100; nvfp4, attnqat and dropin: the same bits; sage3: the same arithmetic, its correction row
    added by the tensor cores; the attnqat forward and the dQ kernel at head_dim 128 only, where
    they measured faster: :data:`.gluon_fwd_qat.AUTO_HEAD_DIMS`, :data:`.gluon_bwd.DQ_AUTO_HEAD_DIMS`).
    attnqat: the forward (O, O', statistics) and the backward's dK/dV and dQ kernels; dropin: the
    backward's two kernels (its forward, with a float32 O, has no Gluon version and is always the
    Triton kernel).
    """
    check_schedule(schedule)
    why = _why_not(q, k, v, method, allow_cpu=interpreting())
    if why is not None:
        raise ValueError(f"attnqat.kernels.triton_attention cannot run method {method!r}: {why}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    if method not in TRAINABLE:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            raise RuntimeError(f"method {method!r} is inference-only and has no backward; use 'attnqat' "
                               "(Attn-QAT training) or 'dropin' (the ablation) to train with 4-bit attention, "
                               "or run under torch.no_grad()")
        if method == "nvfp4":
            return nvfp4_forward(q, k, v, scale, formulation=formulation, config=config, schedule=schedule)
        return sage3.sage3_forward(q, k, v, scale, config=config, schedule=schedule)
    return fp4_training_attention(q, k, v, scale, method, config, schedule)
