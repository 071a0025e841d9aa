"""The registry of attention methods: the one place a method is defined.

An :class:`AttentionMethod` says what a method is called (``name``, the ``label`` shown to people,
the app's one-line ``description``), what it is (``trainable`` or inference-only, ``four_bit``),
how it computes (its PyTorch ``reference`` and its fused ``kernel``, with the rule that
``backend="auto"`` follows), and what the rest of the project does with it (``deploys_as``: the
method a model trained with it runs at inference; ``generation``: whether ``attnqat generate`` and
the app offer it and on which weights; what ``attnqat finetune export`` writes about weights
trained with it).

Everything else reads this registry: :func:`attnqat.attention` (dispatch and validation), the
diffusers processor (:mod:`attnqat.wan`), ``attnqat generate``'s choices and labels
(:mod:`attnqat.generate`), the app's checkboxes and notes, the trainer's ``--attention`` choices
(:mod:`attnqat.finetune.train`), ``repro``'s configurations, the benchmarks' tables and the study.
Adding a method is one :func:`register` call (see docs/development.md, "Adding an attention
method"); nothing downstream lists method names.

The built-in methods (DESIGN.md §3.3) are registered when this module is imported, in the order
the project shows them: ``bf16``, ``nvfp4``, ``sage3``, ``attnqat``, ``dropin``, ``sagebwd``.

Lists such as :func:`names` are computed on each call, so a method registered later (a plug-in, a
test fixture) appears everywhere they are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch

from . import ops
from .reference import ABLATIONS

#: the method that is attention without quantization: the reference every other one is compared with
REFERENCE = "bf16"

#: ``generation`` values: which transformer a generation slot of the method runs
Weights = Literal["base", "finetuned"]


@dataclass(frozen=True)
class Kernel:
    """The fused kernels of a method, as :func:`attnqat.attention` reaches them.

    ``name`` is the method's name in :mod:`attnqat.kernels` (what ``triton_attention(method=...)``
    takes and what the kernel benchmark reports). ``run`` ((q, k, v, scale) → o on (B, S, H, D)
    CUDA tensors) and ``unsupported`` ((q, k, v) → None, or the sentence saying why the kernels
    cannot take these inputs) default to :func:`attnqat.kernels.triton_attention` and
    :func:`attnqat.kernels.triton_unsupported`; a method whose kernels live elsewhere passes its own.
    Inside ``run`` the kernels choose their schedule per GPU themselves (Gluon or Triton on
    Hopper, ``tl.dot_scaled`` on FP4 tensor cores: :mod:`attnqat.kernels`).

    ``backend="auto"`` runs the kernel for CUDA inputs it takes and the method's PyTorch reference
    otherwise (with a one-time warning on CUDA saying why); ``"triton"`` runs the kernel or raises.
    """

    name: str
    run: Callable[..., torch.Tensor] | None = None
    unsupported: Callable[..., str | None] | None = None


@dataclass(frozen=True)
class AttentionMethod:
    """One attention method.

    Attributes:
        name: what code, the CLI and files call it (``--methods nvfp4``, ``nvfp4.mp4``).
        label: what people read (``NVFP4``).
        description: one line for the app (what the method does).
        trainable: it has a backward (``False``: inference-only; asking it for gradients is an error).
        four_bit: it quantizes the attention to 4 bits.
        reference: the PyTorch implementation, ``reference(q, k, v, scale) -> o`` on (B, S, H, D)
            tensors of one floating dtype, on any device; differentiable when ``trainable``.
            Methods with ``ablations`` also take ``ablation=``.
        kernel: its fused kernels (:class:`Kernel`), or None: then every backend runs ``reference``
            (``backend="triton"`` asks for the kernels and is refused).
        deploys_as: the method a model trained with this one runs at inference (its own name for
            the inference methods; ``attnqat`` and ``dropin`` deploy plain ``nvfp4``).
        generation: None when ``attnqat generate`` and the app do not offer it; else the weights
            its clip runs: ``"base"`` (the model's transformer) or ``"finetuned"`` (a transformer
            fine-tuned with this method, ``--qat-transformer``), with ``deploys_as`` attention.
        ablations: names of the backward ablations it takes (:data:`attnqat.reference.ABLATIONS`).
        finetuned_weights: the ``weights`` value ``attnqat finetune export`` writes into the
            ``attnqat.json`` of a transformer fine-tuned with this method (trainable methods).
        finetuned_note: what ``export`` says such weights are (the sidecar's ``qat_weights_note``
            begins with it).
        finetuned_label: for weights fine-tuned with a method other than Attn-QAT, the label they
            get when loaded into the Attn-QAT slot (it says they are not Attn-QAT); None for
            Attn-QAT itself.
    """

    name: str
    label: str
    description: str
    trainable: bool
    four_bit: bool
    reference: Callable[..., torch.Tensor]
    kernel: Kernel | None = None
    deploys_as: str | None = None
    generation: Weights | None = None
    ablations: tuple[str, ...] = ()
    finetuned_weights: str | None = None
    finetuned_note: str | None = None
    finetuned_label: str | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").isalnum() or self.name != self.name.lower():
            raise ValueError(f"a method name is lower-case letters, digits and '_', got {self.name!r}")
        if self.deploys_as is None:
            object.__setattr__(self, "deploys_as", self.name)
        if self.generation not in (None, "base", "finetuned"):
            raise ValueError(f"generation must be None, 'base' or 'finetuned', got {self.generation!r}")
        if self.trainable and self.finetuned_weights is None:
            object.__setattr__(self, "finetuned_weights", f"{self.name}-finetuned")
        unknown = [a for a in self.ablations if a not in ABLATIONS]
        if unknown:
            raise ValueError(f"unknown ablation(s) {unknown} for method {self.name!r}")

    @property
    def inference(self) -> bool:
        """It runs at inference under its own name (``bf16``, ``nvfp4``, ``sage3``); ``attnqat``
        and ``dropin`` are training methods whose forward is ``nvfp4``'s."""
        return self.deploys_as == self.name


_REGISTRY: dict[str, AttentionMethod] = {}


def register(method: AttentionMethod, *, replace: bool = False) -> AttentionMethod:
    """Add ``method`` to the registry (at the end of every list); returns it.

    Raises ``ValueError`` when the name is taken (unless ``replace``) or when ``deploys_as`` names
    an unregistered method.
    """
    if method.name in _REGISTRY and not replace:
        raise ValueError(f"attention method {method.name!r} is already registered")
    if method.deploys_as != method.name and method.deploys_as not in _REGISTRY:
        raise ValueError(f"method {method.name!r} deploys as {method.deploys_as!r}, which is not registered")
    _REGISTRY[method.name] = method
    return method


def unregister(name: str) -> None:
    """Remove a method (tests and plug-ins that registered one)."""
    get(name)
    if any(m.deploys_as == name and m.name != name for m in _REGISTRY.values()):
        raise ValueError(f"method {name!r} is what other methods deploy as; unregister them first")
    del _REGISTRY[name]


def get(name: str) -> AttentionMethod:
    """The method called ``name``; ``ValueError`` naming the registered ones otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown attention method {name!r}; expected one of {', '.join(_REGISTRY)}") from None


def all_methods() -> tuple[AttentionMethod, ...]:
    """Every registered method, in registration order."""
    return tuple(_REGISTRY.values())


def names() -> tuple[str, ...]:
    """Names of every registered method."""
    return tuple(_REGISTRY)


def four_bit() -> tuple[str, ...]:
    """Names of the 4-bit methods."""
    return tuple(m.name for m in _REGISTRY.values() if m.four_bit)


def trainable() -> tuple[str, ...]:
    """Names of the methods with a backward: the trainer's ``--attention`` choices."""
    return tuple(m.name for m in _REGISTRY.values() if m.trainable)


def inference() -> tuple[str, ...]:
    """Names of the methods that run at inference under their own name (the benchmarks' and
    ``repro``'s base configurations)."""
    return tuple(m.name for m in _REGISTRY.values() if m.inference)


def generation() -> tuple[str, ...]:
    """Names ``attnqat generate`` and the app offer (their slots), in display order."""
    return tuple(m.name for m in _REGISTRY.values() if m.generation is not None)


def with_ablations() -> tuple[str, ...]:
    """Names of the methods that take a backward ablation."""
    return tuple(m.name for m in _REGISTRY.values() if m.ablations)


def label(name: str) -> str:
    """The method's label, or ``name`` itself for a name not registered (old records)."""
    m = _REGISTRY.get(name)
    return m.label if m is not None else name


def slot_attention(name: str) -> str:
    """The attention method a generation slot runs at inference."""
    return get(name).deploys_as


def uses_finetuned(name: str) -> bool:
    """A generation slot that runs a fine-tuned transformer (``attnqat``), not the base one."""
    return get(name).generation == "finetuned"


def by_finetuned_weights(weights: str | None) -> AttentionMethod | None:
    """The trainable method whose exports write ``weights`` into ``attnqat.json``, if any."""
    return next((m for m in _REGISTRY.values() if weights and m.finetuned_weights == weights), None)


# ----------------------------------------------------------------------------------------------
# The built-in methods (DESIGN.md §3.3)
# ----------------------------------------------------------------------------------------------

register(AttentionMethod(
    name=REFERENCE, label="BF16", description="reference: attention without quantization",
    trainable=True, four_bit=False, reference=ops.sdpa_attention, generation="base",
    finetuned_weights="bf16-attention-finetuned",
    finetuned_note=("fine-tuned with BF16 attention (the control: no quantization in training, "
                    "not Attn-QAT)"),
    finetuned_label="not Attn-QAT: fine-tuned with BF16 attention (the control)"))
register(AttentionMethod(
    name="nvfp4", label="NVFP4", description="4-bit attention dropped in",
    trainable=False, four_bit=True, reference=ops.nvfp4_attention, kernel=Kernel("nvfp4"),
    generation="base"))
register(AttentionMethod(
    name="sage3", label="SageAttention3", description="4-bit with outlier smoothing",
    trainable=False, four_bit=True, reference=ops.sage3_attention, kernel=Kernel("sage3"),
    generation="base"))
register(AttentionMethod(
    name="attnqat", label="Attn-QAT", description="4-bit attention in the model fine-tuned with Attn-QAT",
    trainable=True, four_bit=True, reference=ops.attnqat_attention, kernel=Kernel("attnqat"),
    deploys_as="nvfp4", generation="finetuned", ablations=tuple(ABLATIONS),
    finetuned_note="Attn-QAT fine-tuned (4-bit attention in training, Attn-QAT backward)"))
register(AttentionMethod(
    name="dropin", label="drop-in FP4", description="4-bit forward, ordinary backward (the ablation)",
    trainable=True, four_bit=True, reference=ops.dropin_attention, kernel=Kernel("dropin"),
    deploys_as="nvfp4",
    finetuned_note=("fine-tuned with drop-in 4-bit attention (4-bit forward, ordinary backward: "
                    "the ablation, not Attn-QAT)"),
    finetuned_label="not Attn-QAT: fine-tuned with drop-in FP4 attention (the ablation)"))



def _sagebwd_kernel(q, k, v, scale: float) -> torch.Tensor:
    from .kernels import sagebwd as kernel  # noqa: PLC0415  (imports triton: kept off ``import attnqat``)

    return kernel.sagebwd_attention(q, k, v, softmax_scale=scale)


def _sagebwd_unsupported(q, k, v) -> str | None:
    try:
        from .kernels import sagebwd as kernel  # noqa: PLC0415  (as above)
    except Exception as exc:  # pragma: no cover - depends on the machine
        return f"the Triton kernels could not be imported ({type(exc).__name__}: {exc})"
    return kernel.sagebwd_unsupported(q, k, v)


register(AttentionMethod(
    name="sagebwd", label="SageBwd (INT8)",
    description="8-bit attention: INT8 Q·Kᵀ and P·V (K smoothed), trainable with an INT8 backward",
    trainable=True, four_bit=False, reference=ops.sagebwd_attention,
    kernel=Kernel("sagebwd", run=_sagebwd_kernel, unsupported=_sagebwd_unsupported),
    generation="base",
    finetuned_note=("fine-tuned with SageBwd INT8 attention (8-bit forward and backward, dP in 16 bits; "
                    "not Attn-QAT)"),
    finetuned_label="not Attn-QAT: fine-tuned with SageBwd INT8 attention"))


__all__ = ["AttentionMethod", "Kernel", "REFERENCE", "all_methods", "by_finetuned_weights", "four_bit",
           "generation", "get", "inference", "label", "names", "register", "slot_attention", "trainable",
           "unregister", "uses_finetuned", "with_ablations"]
