"""Rectified-flow matching as Wan 2.1 is trained: the one objective of every trainer in the project.

A clean latent ``x0`` (normalized as the pipeline expects), Gaussian noise ``ε`` and a noise level
``σ ∈ [0, 1]`` give the model input and its target::

    x_t    = (1 − σ) x0 + σ ε          timestep = 1000 σ
    target = ε − x0                     loss = mean((v_θ(x_t, t, text) − target)²) in float32

``σ`` is drawn uniformly or logit-normally (``σ = sigmoid(n)``, ``n ~ N(mean, std)``) and then
mapped through the flow shift ``s`` as Wan's flow-matching scheduler spaces its sigmas,
``σ ← s σ / (1 + (s − 1) σ)`` (``s = 1`` leaves it unchanged; larger ``s`` spends more training on
noisy inputs).

Two objectives (``attnqat finetune train --objective``):

``flow``
    the target above, ``ε − x0``: Wan's own objective, the one the Attn-QAT paper fine-tunes with.
``distill``
    quantization-aware distillation: the target is the velocity a frozen copy of the starting
    transformer (the teacher) predicts for the same ``x_t``, timestep and text with **BF16
    attention** (:func:`distill_target`); the student, with its 4-bit attention, learns to match
    its own unquantized self. As FastVideo's FastWan-QAD does; the loss is the same squared error.

Used by :mod:`attnqat.finetune.train` (with one random generator per sample, so that a sample's
noise does not depend on how the batch is split over GPUs) and by
:mod:`attnqat.finetune.tiny_train` (one generator per batch).
"""

from __future__ import annotations

import torch

SIGMA_SAMPLINGS = ("uniform", "logit_normal")
OBJECTIVES = ("flow", "distill")


def shift_sigma(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """Map ``σ`` through the flow shift ``s``: ``s σ / (1 + (s − 1) σ)``."""
    if shift <= 0:
        raise ValueError(f"the flow shift must be > 0, got {shift}")
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def sample_sigma(n: int, generator: torch.Generator | None, *, sampling: str = "uniform",
                 shift: float = 1.0, mean: float = 0.0, std: float = 1.0,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """``n`` noise levels in [0, 1] (float32), drawn with ``generator``.

    ``uniform``: one ``torch.rand`` draw per sample. ``logit_normal``: ``sigmoid(mean + std·z)``
    with one ``torch.randn`` draw per sample. Both are then shifted (:func:`shift_sigma`).
    """
    if sampling == "uniform":
        u = torch.rand(n, generator=generator, device=device)
    elif sampling == "logit_normal":
        u = torch.sigmoid(mean + std * torch.randn(n, generator=generator, device=device))
    else:
        raise ValueError(f"unknown sigma sampling {sampling!r}; expected one of "
                         f"{', '.join(SIGMA_SAMPLINGS)}")
    return shift_sigma(u, shift)


def noisy_input(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_t, timestep, target)`` for clean latents ``x0`` (B, C, T, H, W), noise of the same
    shape and per-sample ``sigma`` (B,): ``x_t = (1 − σ) x0 + σ ε``, ``timestep = 1000 σ``,
    ``target = ε − x0`` (all float32)."""
    x0, noise, sigma = x0.float(), noise.float(), sigma.float()
    s = sigma.view(-1, *([1] * (x0.dim() - 1)))
    return (1.0 - s) * x0 + s * noise, sigma * 1000.0, noise - x0


def flow_matching_loss(pred: torch.Tensor, target: torch.Tensor,
                       weight: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error of the velocity in float32; with ``weight`` (broadcastable to
    ``target``) a weighted mean normalized by the mean weight."""
    err = (pred.float() - target.float()).square()
    if weight is None:
        return err.mean()
    weight = weight.float().expand_as(err)
    return (err * weight).mean() / weight.mean()


def predict(transformer, x_t: torch.Tensor, timestep: torch.Tensor,
            text: torch.Tensor) -> torch.Tensor:
    """The transformer's velocity for ``x_t`` at ``timestep`` given prompt embeddings ``text``
    (B, L, D), as diffusers' ``WanTransformer3DModel`` is called in the pipeline."""
    return transformer(hidden_states=x_t, timestep=timestep, encoder_hidden_states=text,
                       return_dict=False)[0]


def make_teacher(transformer, backend: str = "auto", dtype: torch.dtype | None = None):
    """A frozen copy of ``transformer`` (before it is trained or sharded) with BF16 attention in
    every attention module: the ``distill`` objective's teacher. ``dtype``: cast its weights
    (e.g. bfloat16 under mixed precision, to halve its memory); None keeps them."""
    import copy

    from attnqat.wan import install_attention

    teacher = copy.deepcopy(transformer)
    if dtype is not None:
        teacher = teacher.to(dtype)
    teacher.requires_grad_(False)
    teacher.eval()
    install_attention(teacher, "bf16", backend=backend, timing=False)
    return teacher


@torch.no_grad()
def distill_target(teacher, x_t: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """The ``distill`` objective's target: the frozen teacher's velocity for the student's input
    (float32, no gradient)."""
    return predict(teacher, x_t, timestep, text).float()


__all__ = ["OBJECTIVES", "SIGMA_SAMPLINGS", "distill_target", "make_teacher", "flow_matching_loss", "noisy_input", "predict", "sample_sigma",
           "shift_sigma"]
