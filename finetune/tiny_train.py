"""Train the embedded tiny Wan 2.1 model on the synthetic shapes data: ``attnqat finetune tiny``.

One module, read top to bottom: arguments, data (GPU renderer of the synthetic clips), text
encoding, model loading and saving, the three stages, the command line.

Stages (``--stages``, run in this order; any subset):

``vae``
    Train the ``AutoencoderKLWan`` of :class:`attnqat.tiny.TinyWanConfig` on synthetic clips:
    L1 + L2 reconstruction (pixels of the objects weighted up) of the posterior mean plus a small
    KL term (``--vae-sample`` decodes a posterior sample instead). Then measure the per-channel
    mean and standard deviation of the latents over ``--stats-clips`` clips of ``--frames`` frames
    and write them into the VAE config (``latents_mean`` / ``latents_std``, which the pipeline
    uses to de-normalize before decoding). ``--vae-train decoder`` trains the decoder alone: the
    encoder, the latent statistics and what the transformer has learned stay valid.
``t2v``
    Freeze the VAE; train the UMT5 text encoder and the ``WanTransformer3DModel`` jointly with
    rectified-flow matching on normalized latents: ``x_t = (1 - σ) x0 + σ ε``, target ``ε - x0``,
    timestep ``1000 σ``, ``σ = s u / (1 + (s - 1) u)`` with ``u`` uniform and ``s`` the flow shift
    (as Wan's scheduler spaces its sigmas). Captions are replaced by the empty prompt (what the
    pipeline's default negative prompt encodes) with probability ``--caption-dropout``, so
    classifier-free guidance works. AdamW, linear warm-up, linear decay over the last part of the
    budget, bf16 autocast on CUDA, an exponential moving average (EMA) of the weights, which is
    what gets saved. The objective, the schedule, the EMA and the run log (``--log-dir``) are the
    ones ``attnqat finetune train`` uses (:mod:`attnqat.finetune.objective`,
    :mod:`~attnqat.finetune.schedule`, :mod:`~attnqat.finetune.runlog`); what is this module's own
    is the tiny model: the VAE stage, the text encoder trained jointly, the pool of latents. Latents come from a pool on the device: ``--pool`` clips are rendered and
    encoded first, then every ``--fresh-every`` steps ``--fresh`` new clips replace the oldest,
    and each step trains on ``--batch-size`` latents drawn from the pool at random.
    ``--two-objects`` sets the share of two-object clips (the stream's default is half);
    ``--grow-layers N`` deepens a resumed transformer without changing its function
    (:func:`grow_transformer`); ``--compile`` runs the transformer through ``torch.compile``.
``eval``
    Generate one clip per held-out prompt (:func:`attnqat.synthetic.heldout_prompts`,
    prompt ``i`` with seed ``i``; ``--eval-offset K`` starts at prompt ``K``) for each method
    through the project's generation code
    (:func:`attnqat.wan.load_models`, :func:`attnqat.generate.encode_prompts`,
    :func:`~attnqat.generate.initial_latents`, :func:`~attnqat.generate.denoise`,
    :func:`~attnqat.generate.decode`; prompts are denoised in batches), score them with
    :func:`attnqat.eval.procedural.score_clip`, and report colour, shape and motion accuracy per
    method plus PSNR/SSIM of the 4-bit methods against BF16, and whether the text encoder's states
    tell two-object captions with swapped motions apart (:func:`binding_signal`). Writes a JSON
    file and prints a table.
``export``
    Write ``--out`` (and ``--qat-out``) from ``--resume`` without training.

Budgets are in minutes (``--vae-minutes``, ``--t2v-minutes``) and/or steps (``--vae-steps``,
``--t2v-steps``): a stage stops at whichever comes first. ``--time-limit-minutes`` bounds the whole
process (training is cut short to leave ``--reserve-minutes`` for saving and evaluation).
``--resume DIR`` continues from a saved model folder: the weights only (the EMA weights, which
are what is saved). Unlike the fine-tuning trainer's checkpoints (:mod:`attnqat.finetune.checkpoint`:
model, optimizer, EMA, random states, data position), these saves are the shipped model folder
itself, small enough to carry between time-limited GPU calls. The optimizer restarts with a fresh state and a new warm-up: its state (twice
the float32 weights) is not saved, so that a checkpoint is the model folder itself and stays small
enough to carry between runs of a time-limited machine. The step counts of every run are kept in the
folder's ``attnqat.json`` (``training``).

Usage (``docs/tiny_model.md`` gives the runs that made the shipped model)::

    python -m attnqat.finetune.tiny_train --stages vae,t2v,eval --vae-minutes 15 \\
        --t2v-minutes 30 --out assets/tiny-wan --qat-out assets/tiny-wan-qat
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from attnqat import tiny
from attnqat.finetune.encode import latent_norm
from attnqat.finetune.objective import flow_matching_loss, noisy_input, predict, sample_sigma
from attnqat.finetune.runlog import RunLog, device_name, now
from attnqat.finetune.schedule import EMA, lr_factor
from attnqat.synthetic import (BACKGROUND_COLOURS, COLOURS, MAX_OBJECTS, MOTION_PHRASE,
                                        MOTIONS, OBJECT_COLOURS, SHAPES, ClipSpec, spec_at)

STAGES = ("vae", "t2v", "eval", "export")
TEXT_SEQ_LEN = 512        # Wan pads the prompt embeddings to 512 tokens (attnqat.generate); a
                          # model's sidecar default ``max_sequence_length`` overrides it
OBJ_FIELDS = 10           # present, r, g, b, shape, motion, x0, y0, extent, amount
PARAMS = MAX_OBJECTS * OBJ_FIELDS + 3   # + background r, g, b
# stream seeds of the training data, one per use, so no two uses share clips
STREAM_VAE, STREAM_STATS, STREAM_T2V = 1, 2, 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``attnqat finetune tiny``."""
    g = parser.add_argument_group("run")
    g.add_argument("--stages", default="vae,t2v,eval",
                   help=f"comma-separated stages to run, in order: {', '.join(STAGES)}")
    g.add_argument("--out", required=True, type=Path,
                   help="pipeline folder to write (diffusers layout + attnqat.json; replaced)")
    g.add_argument("--qat-out", type=Path, default=None,
                   help="also write the Attn-QAT slot here: a copy of the trained transformer, "
                        "marked as such in its attnqat.json")
    g.add_argument("--resume", type=Path, default=None,
                   help="start from this saved model folder instead of a random initialization")
    g.add_argument("--config", default=None,
                   help="JSON object of TinyWanConfig fields that differ from the defaults (new "
                        "models only; e.g. '{\"num_layers\": 1}')")
    g.add_argument("--defaults", default=None,
                   help="JSON object of generation defaults to write into attnqat.json (e.g. "
                        "'{\"guidance\": 4.0}')")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--seed", type=int, default=0, help="seed of the initialization, data and noise")
    g.add_argument("--workers", type=int, default=8,
                   help="DataLoader workers drawing clip specifications (0: in the main process); "
                        "also processes scoring the evaluation clips")
    g.add_argument("--size", type=int, default=128, help="training clip height and width (pixels)")
    g.add_argument("--frames", type=int, default=33, help="training clip length for the transformer")
    g.add_argument("--time-limit-minutes", type=float, default=0.0,
                   help="wall-clock limit of the whole process; training stops early to leave "
                        "--reserve-minutes (0: no limit)")
    g.add_argument("--reserve-minutes", type=float, default=1.5,
                   help="time kept for saving and evaluation under --time-limit-minutes")
    g.add_argument("--save-every-minutes", type=float, default=2.0,
                   help="save the model during the t2v stage this often")
    g.add_argument("--log-every", type=int, default=50, help="print a progress line every N steps")
    g.add_argument("--log-dir", type=Path, default=None,
                   help="also write the progress records there: log.jsonl and TensorBoard scalars "
                        "(attnqat.finetune.runlog, as `attnqat finetune train` does)")

    g = parser.add_argument_group("vae stage")
    g.add_argument("--vae-minutes", type=float, default=0.0, help="time budget (0: none)")
    g.add_argument("--vae-steps", type=int, default=0, help="step budget (0: none)")
    g.add_argument("--vae-batch-size", type=int, default=32,
                   help="clips per step (a step costs about 0.17 s on an H100 whatever its size, "
                        "so larger batches are nearly free)")
    g.add_argument("--vae-frames", type=int, default=13,
                   help="frames per training clip (4k+1: the first frame, then chunks of 4 that "
                        "each follow the previous one through the causal cache)")
    g.add_argument("--vae-lr", type=float, default=1e-3, help="AdamW learning rate")
    g.add_argument("--vae-train", choices=("all", "decoder"), default="all",
                   help="train the whole VAE, or only its decoder (the encoder, hence the latent "
                        "space, its statistics and what the transformer learned, stay as they are)")
    g.add_argument("--vae-sample", action="store_true",
                   help="decode a sample of the posterior in training instead of its mean (slower "
                        "to converge: the unit-variance noise of the untrained posterior drowns "
                        "the signal)")
    g.add_argument("--kl-weight", type=float, default=1e-4,
                   help="weight of the KL term (mean over latent elements)")
    g.add_argument("--fg-weight", type=float, default=3.0,
                   help="extra reconstruction weight of pixels covered by an object")
    g.add_argument("--stats-clips", type=int, default=512,
                   help="clips whose latents give the per-channel mean and std")

    g = parser.add_argument_group("t2v stage")
    g.add_argument("--t2v-minutes", type=float, default=0.0, help="time budget (0: none)")
    g.add_argument("--t2v-steps", type=int, default=0, help="step budget (0: none)")
    g.add_argument("--batch-size", type=int, default=128, help="latents per step")
    g.add_argument("--lr", type=float, default=8e-4, help="AdamW peak learning rate")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (matrices)")
    g.add_argument("--warmup", type=int, default=300, help="linear warm-up steps")
    g.add_argument("--decay-frac", type=float, default=0.3,
                   help="fraction of the budget at the end over which the learning rate falls "
                        "linearly to --final-lr-frac of its peak")
    g.add_argument("--final-lr-frac", type=float, default=0.1, help="see --decay-frac")
    g.add_argument("--ema", type=float, default=0.999, help="EMA decay (0: no EMA)")
    g.add_argument("--caption-dropout", type=float, default=0.1,
                   help="probability of training on the empty prompt")
    g.add_argument("--shift", type=float, default=3.0, help="flow shift of the sigma sampling")
    g.add_argument("--pool", type=int, default=8192,
                   help="latents kept on the device (filled before the first step)")
    g.add_argument("--fill-batch", type=int, default=64, help="clips encoded at once to fill the pool")
    g.add_argument("--fresh", type=int, default=128,
                   help="new clips rendered and encoded every --fresh-every steps, replacing the "
                        "oldest (0: train on the pool only)")
    g.add_argument("--fresh-every", type=int, default=8,
                   help="steps between two refreshes of the pool (encoding a batch of clips costs "
                        "about the same whatever its size, so refresh in larger, rarer batches)")
    g.add_argument("--text-len", type=int, default=32,
                   help="tokens the text encoder sees in training (captions are shorter; the "
                        "embeddings are zero-padded to the model's max_sequence_length, 32 for "
                        "a new model, as the pipeline pads them at inference)")
    g.add_argument("--two-objects", type=float, default=None, metavar="FRAC",
                   help="fraction of training clips with two objects (default: the stream's "
                        "uniform choice of one or two, i.e. 0.5, with the same draws)")
    g.add_argument("--grow-layers", type=int, default=0, metavar="N",
                   help="with --resume: deepen the loaded transformer to N blocks (up to twice "
                        "its depth) before training, inserting after an existing block a copy of "
                        "it whose output projections are zero, so the model starts from the same "
                        "function (0: keep the depth)")
    g.add_argument("--text-aux", type=float, default=0.0, metavar="W",
                   help="weight of the text-binding loss (TextBindingHead: the states of each "
                        "object's colour and shape words must predict its other attributes; "
                        "the head is not saved; 0: off)")
    g.add_argument("--object-weight", type=float, default=0.0, metavar="W",
                   help="extra flow-matching weight of the latent cells an object touches (about "
                        "an eighth of them: they weigh 1 + W; 0: all cells weigh the same)")
    g.add_argument("--text-attn-scale", type=float, default=1.0, metavar="F",
                   help="multiply the text encoder's self-attention logits by F before training "
                        "(F < 1 un-saturates an encoder whose attention went one-hot; 1: keep)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the transformer for training (faster steps after a "
                        "compilation of about a minute; numerics as eager up to rounding)")

    g = parser.add_argument_group("eval stage")
    g.add_argument("--eval-prompts", type=int, default=100,
                   help="held-out prompts (seed i for prompt i)")
    g.add_argument("--eval-offset", type=int, default=0,
                   help="skip the first K held-out prompts (score prompts K.. with seeds K..: a "
                        "set of prompts not looked at while training and choosing a checkpoint)")
    g.add_argument("--eval-methods", default="bf16,nvfp4,sage3", help="attention methods to score")
    g.add_argument("--eval-backend", default="torch",
                   help="attention backend of the 4-bit methods: torch (reference) | auto | triton")
    g.add_argument("--eval-batch", type=int, default=50, help="prompts denoised together")
    g.add_argument("--eval-steps", type=int, default=None,
                   help="denoising steps (default: the model's)")
    g.add_argument("--eval-guidance", type=float, default=None, help="guidance (default: the model's)")
    g.add_argument("--eval-size", type=int, default=None,
                   help="height and width (default: the model's)")
    g.add_argument("--eval-frames", type=int, default=None, help="frames (default: the model's)")
    g.add_argument("--sweep-guidance", default="",
                   help="comma-separated extra guidance values scored with bf16 only")
    g.add_argument("--eval-json", type=Path, default=None,
                   help="where to write the scores (default: <out>-eval.json)")
    g.add_argument("--eval-samples", type=int, default=0,
                   help="also save the clips of the first N prompts (<eval-json>-samples.npz)")


# ----------------------------------------------------------------------------------------------
# Small helpers


class Clock:
    """Seconds since the process started its work, and the process-wide deadline."""

    def __init__(self, limit_minutes: float = 0.0, reserve_minutes: float = 0.0) -> None:
        self.t0 = time.perf_counter()
        self.limit = limit_minutes * 60.0
        self.reserve = reserve_minutes * 60.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left_for_training(self) -> float:
        """Seconds training may still use (inf without a limit)."""
        if self.limit <= 0:
            return math.inf
        return self.limit - self.reserve - self.elapsed()


def log(msg: str) -> None:
    print(msg, flush=True)


def _autocast(dev: torch.device):
    return torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")


class Budget:
    """Steps and/or seconds; ``progress`` is the larger of the two fractions used."""

    def __init__(self, steps: int, minutes: float, clock: Clock) -> None:
        self.steps, self.seconds, self.clock = steps, minutes * 60.0, clock
        self.t0 = time.perf_counter()
        limit = clock.left_for_training()
        if math.isfinite(limit):
            self.seconds = min(self.seconds, limit) if self.seconds > 0 else limit
        if self.steps <= 0 and self.seconds <= 0 and not math.isfinite(limit):
            raise ValueError("a training stage needs a budget: give its --*-steps or --*-minutes")

    def progress(self, step: int) -> float:
        p = step / self.steps if self.steps > 0 else 0.0
        if self.seconds > 0 or math.isfinite(self.clock.left_for_training()):
            p = max(p, (time.perf_counter() - self.t0) / max(self.seconds, 1e-9))
        return p

    def done(self, step: int) -> bool:
        return self.progress(step) >= 1.0


# ----------------------------------------------------------------------------------------------
# Data: clip specifications from the synthetic stream, rendered on the device


def spec_params(spec: ClipSpec) -> np.ndarray:
    """A clip specification (with geometry) as a flat float64 vector for :func:`render_batch`."""
    p = np.zeros(PARAMS, dtype=np.float64)
    for j, o in enumerate(spec.objects):
        p[j * OBJ_FIELDS:(j + 1) * OBJ_FIELDS] = (
            1.0, *OBJECT_COLOURS[o.colour], SHAPES.index(o.shape), MOTIONS.index(o.motion),
            o.start[0], o.start[1], o.extent, o.amount)
    p[-3:] = BACKGROUND_COLOURS[spec.background]
    return p


class SpecStream(IterableDataset):
    """Batches of the training stream: batch ``b`` holds items ``start + b * batch ...`` of
    ``spec_at(seed, k)`` as ``(params (batch, PARAMS) float64, captions)``. DataLoader worker
    ``w`` of ``n`` makes the batches ``b % n == w``, and the loader hands them out in order, so the
    stream is the same whatever the number of workers."""

    def __init__(self, seed: int, start: int, batch: int, max_objects: int = 2,
                 object_weights: tuple[float, ...] | None = None) -> None:
        self.seed, self.start, self.batch, self.max_objects = seed, start, batch, max_objects
        self.object_weights = object_weights

    def __iter__(self) -> Iterator[tuple[torch.Tensor, list[str]]]:
        info = get_worker_info()
        n, w = (info.num_workers, info.id) if info is not None else (1, 0)
        b = w
        while True:
            k0 = self.start + b * self.batch
            specs = [spec_at(self.seed, k, "train", self.max_objects,
                             object_weights=self.object_weights)
                     for k in range(k0, k0 + self.batch)]
            yield (torch.from_numpy(np.stack([spec_params(s) for s in specs])),
                   [s.caption for s in specs])
            b += n


def spec_batches(seed: int, start: int, batch: int, workers: int,
                 object_weights: tuple[float, ...] | None = None
                 ) -> Iterator[tuple[torch.Tensor, list[str]]]:
    """Endless ``(params (B, PARAMS) float64, captions)`` batches of the training stream from
    item ``start`` on (``object_weights``: see :func:`synthetic.sample_spec`)."""
    loader = DataLoader(SpecStream(seed, start, batch, object_weights=object_weights),
                        batch_size=None, num_workers=workers,
                        persistent_workers=workers > 0, prefetch_factor=4 if workers > 0 else None)
    yield from loader


def render_batch(params: torch.Tensor, frames: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Render clips on ``params``' device, the arithmetic of
    :func:`attnqat.synthetic.render` (square frames).

    Returns:
        ``(clips, fg)``: clips ``(B, T, H, W, 3)`` float32 holding integers 0..255 (what ``render``
        returns as uint8), and ``fg`` ``(B, T, H, W)`` bool, the pixels any object touches.
    """
    dev = params.device
    b = params.shape[0]
    h = w = int(size)
    t = torch.from_numpy(np.linspace(0.0, 1.0, frames)).to(dev).view(1, frames)
    ys = (torch.arange(h, dtype=torch.float32, device=dev) + 0.5).view(1, 1, h, 1)
    xs = (torch.arange(w, dtype=torch.float32, device=dev) + 0.5).view(1, 1, 1, w)
    bg = params[:, -3:].float().view(b, 1, 1, 1, 3)
    img = bg.expand(b, frames, h, w, 3).clone()
    fg = torch.zeros(b, frames, h, w, dtype=torch.bool, device=dev)
    s3 = math.sqrt(3.0) / 2.0
    for j in range(MAX_OBJECTS):
        p = params[:, j * OBJ_FIELDS:(j + 1) * OBJ_FIELDS]
        present = p[:, 0] > 0
        if not bool(present.any()):
            continue
        colour = p[:, 1:4].float().view(b, 1, 1, 1, 3)
        shape, motion = p[:, 4].long().view(b, 1), p[:, 5].long().view(b, 1)
        x0, y0, ext, amt = (p[:, i:i + 1] for i in (6, 7, 8, 9))
        x, y, e = x0.expand(b, frames), y0.expand(b, frames), ext.expand(b, frames)
        x = torch.where(motion == 0, x0 - amt * t, torch.where(motion == 1, x0 + amt * t, x))
        y = torch.where(motion == 2, y0 - amt * t, torch.where(motion == 3, y0 + amt * t, y))
        e = torch.where(motion == 4, ext * amt ** t, torch.where(motion == 5, ext * amt ** (-t), e))
        cx = (x * w).float().view(b, frames, 1, 1)
        cy = (y * h).float().view(b, frames, 1, 1)
        scale = (e * min(h, w)).float().view(b, frames, 1, 1)
        px, py = xs - cx, ys - cy
        circle = torch.sqrt(px * px + py * py) - 0.5 * scale
        square = torch.maximum(px.abs(), py.abs()) - 0.5 * 0.85 * scale
        triangle = (torch.maximum(torch.maximum(py, s3 * px - 0.5 * py), -s3 * px - 0.5 * py)
                    - 0.3 * scale)
        sid = shape.view(b, 1, 1, 1)
        sdf = torch.where(sid == 0, circle, torch.where(sid == 1, square, triangle))
        alpha = (0.5 - sdf).clamp(0.0, 1.0) * present.view(b, 1, 1, 1)
        fg |= alpha > 0
        img = img + alpha.unsqueeze(-1) * (colour - img)
    return torch.round(img).clamp(0.0, 255.0), fg


def to_model_input(clips: torch.Tensor) -> torch.Tensor:
    """``(B, T, H, W, 3)`` 0..255 → ``(B, 3, T, H, W)`` in [-1, 1] (the VAE's input, as
    :func:`attnqat.synthetic.to_tensor`)."""
    return clips.permute(0, 4, 1, 2, 3).div(127.5).sub(1.0).contiguous()


# ----------------------------------------------------------------------------------------------
# Text: the pipeline's prompt encoding, differentiable


def tokenize(tokenizer, captions: list[str], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask, padded to ``length`` (as the pipeline tokenizes)."""
    enc = tokenizer(captions, padding="max_length", max_length=length, truncation=True,
                    add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    return enc.input_ids, enc.attention_mask


def encode_text(text_encoder, ids: torch.Tensor, mask: torch.Tensor,
                seq_len: int = TEXT_SEQ_LEN) -> torch.Tensor:
    """What ``WanPipeline.encode_prompt`` computes: the encoder's states of the real tokens, zeros
    after them, ``seq_len`` rows. The encoder masks the padding, so a shorter padded length gives
    the same states."""
    h = text_encoder(ids, attention_mask=mask).last_hidden_state
    h = h * mask.unsqueeze(-1).to(h.dtype)
    return F.pad(h, (0, 0, 0, seq_len - h.shape[1]))


@torch.no_grad()
def binding_signal(text_encoder, tokenizer, specs: list[ClipSpec], length: int = 32) -> float | None:
    """How far apart the prompt embeddings of a two-object caption and of the same caption with
    the two motions exchanged are, as the transformer sees them.

    Wan's cross-attention has no positions on the text side: it sees the encoder's token states
    as a set. If the two sets are equal, the transformer cannot tell which object moves how. Per
    caption: for each token state of the caption, the distance to the nearest state of the
    swapped caption relative to its norm; the largest over the tokens; averaged over the
    two-object ``specs`` (``None`` if there are none). 0 means order-blind (a bag of words)."""
    pairs = []
    for spec in specs:
        if len(spec.objects) == 2:
            a, b = spec.objects
            swapped = ClipSpec((replace(a, motion=b.motion), replace(b, motion=a.motion)),
                               spec.background)
            pairs.append((spec.caption, swapped.caption))
    if not pairs:
        return None
    dev = next(text_encoder.parameters()).device
    ids, mask = tokenize(tokenizer, [c for pair in pairs for c in pair], length)
    h = text_encoder(ids.to(dev), attention_mask=mask.to(dev)).last_hidden_state.float()
    n = mask.sum(1)
    gaps = []
    for k in range(len(pairs)):
        x, y = h[2 * k, :n[2 * k]], h[2 * k + 1, :n[2 * k + 1]]
        near = torch.cdist(x, y).min(dim=1).values / x.norm(dim=1).clamp_min(1e-12)
        gaps.append(float(near.max()))
    return float(np.mean(gaps))


# ----------------------------------------------------------------------------------------------
# Models: build, load, save


def _config_from(sidecar: dict) -> tiny.TinyWanConfig:
    fields = {k: v for k, v in sidecar.get("config", {}).items()
              if k in tiny.TinyWanConfig.__dataclass_fields__}
    cfg = tiny.TinyWanConfig(**fields)
    if "defaults" in sidecar:
        cfg = replace(cfg, defaults=dict(sidecar["defaults"]))
    return cfg


def load_for_training(folder: Path):
    """A saved tiny pipeline in float32 on the CPU, its config and its sidecar."""
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    from attnqat.wan import _quiet_loading

    folder = Path(folder)
    sidecar = json.loads((folder / tiny.SIDECAR).read_text())
    with _quiet_loading():
        vae = AutoencoderKLWan.from_pretrained(folder, subfolder="vae", local_files_only=True)
        te = UMT5EncoderModel.from_pretrained(folder, subfolder="text_encoder", local_files_only=True)
        tr = WanTransformer3DModel.from_pretrained(folder, subfolder="transformer",
                                                   local_files_only=True)
        pipe = WanPipeline.from_pretrained(folder, vae=vae, text_encoder=te, transformer=tr,
                                           local_files_only=True)
    for m in (pipe.vae, pipe.text_encoder, pipe.transformer):
        m.float()
    return pipe, _config_from(sidecar), sidecar


def grow_transformer(transformer, layers: int) -> list[int]:
    """Deepen a ``WanTransformer3DModel`` in place to ``layers`` blocks without changing what it
    computes: after some existing blocks (evenly spread; after every one when doubling) insert a
    copy of that block whose self-attention, cross-attention and feed-forward output projections
    are zero, so the copy adds nothing to the residual stream until training moves them. Returns
    the indices (in the new stack) of the inserted blocks."""
    blocks = transformer.blocks
    depth = len(blocks)
    if not depth < layers <= 2 * depth:
        raise ValueError(f"--grow-layers must be in {depth + 1}..{2 * depth} for a transformer of "
                         f"{depth} blocks (grow in several runs for more), got {layers}")
    extra = layers - depth
    after = {int((j + 0.5) * depth / extra) for j in range(extra)}   # distinct: extra <= depth
    new_blocks, inserted = [], []
    for i, block in enumerate(blocks):
        new_blocks.append(block)
        if i in after:
            twin = copy.deepcopy(block)
            for lin in (twin.attn1.to_out[0], twin.attn2.to_out[0], twin.ffn.net[-1]):
                torch.nn.init.zeros_(lin.weight)
                if lin.bias is not None:
                    torch.nn.init.zeros_(lin.bias)
            inserted.append(len(new_blocks))
            new_blocks.append(twin)
    transformer.blocks = torch.nn.ModuleList(new_blocks)
    transformer.register_to_config(num_layers=layers)
    return inserted


def weights_note(state: dict) -> str:
    v, t = state.get("vae", {}), state.get("t2v", {})
    runs = state.get("runs", [])
    last = runs[-1] if runs else {}
    return (f"trained on the synthetic shapes data (attnqat.synthetic, training split: no "
            f"held-out colour x shape x motion triple is ever shown) by `attnqat finetune tiny`: "
            f"VAE {v.get('steps', 0)} steps ({v.get('clips', 0)} clips), text encoder and "
            f"transformer {t.get('steps', 0)} steps ({t.get('samples', 0)} latents drawn from "
            f"{t.get('clips', 0)} clips), {len(runs)} run(s), last on {last.get('date', '?')} on "
            f"{last.get('device', '?')}; see docs/tiny_model.md")


def save_model(pipe, out: Path, qat_out: Path | None, cfg: tiny.TinyWanConfig, state: dict,
               seed: int) -> None:
    """Write the pipeline (its transformer and text encoder being the weights to ship) with a
    sidecar saying it is trained, and optionally the Attn-QAT slot as a copy of the transformer."""
    note = weights_note(state)
    sidecar = {"kind": "tiny-wan", "weights": "trained", "seed": seed, "weights_note": note,
               "defaults": dict(cfg.defaults), "config": tiny.config_dict(cfg), "training": state}
    qat_note = ("BASE weights: a copy of the trained tiny transformer (" + note.split(" by ")[0] +
                "); Attn-QAT fine-tuning has not been run on it yet, so the attnqat clip shows "
                "plain NVFP4 attention on the base model")
    from attnqat.wan import _quiet_loading

    with _quiet_loading():
        tiny.save_pipeline(pipe, out, qat_out, sidecar=sidecar,
                           qat_sidecar=tiny.copy_of_base_sidecar(seed, qat_note))


def ema_of(modules: list[torch.nn.Module], decay: float) -> EMA:
    """The shared :class:`attnqat.finetune.schedule.EMA` over several modules' parameters, named
    ``"<module index>.<parameter name>"``."""
    return EMA({f"{i}.{n}": p for i, m in enumerate(modules) for n, p in m.named_parameters()}, decay)


def averaged(modules: list[torch.nn.Module], ema: EMA | None) -> list[torch.nn.Module]:
    """Copies of ``modules`` holding the EMA weights (the modules themselves without an EMA)."""
    if ema is None:
        return modules
    out = []
    for i, m in enumerate(modules):
        c = copy.deepcopy(m).eval().requires_grad_(False)
        c._compiled_call_impl = None   # a copy to save, not to run compiled
        ema.copy_to(c, prefix=f"{i}.")
        out.append(c)
    return out


# ----------------------------------------------------------------------------------------------
# Stage 1: the VAE


def vae_loss(vae, x: torch.Tensor, fg: torch.Tensor, kl_weight: float, fg_weight: float,
             generator: torch.Generator | None = None, sample: bool = False
             ) -> tuple[torch.Tensor, dict]:
    """Reconstruction (L1 + L2, object pixels weighted ``1 + fg_weight``) of the posterior mean
    (or, with ``sample``, of a posterior sample), plus ``kl_weight`` times the KL to N(0, 1)
    averaged over latent elements. The text-to-video stage and the pipeline only ever use the
    mean."""
    post = vae.encode(x).latent_dist
    z = post.sample(generator=generator) if sample else post.mode()
    rec = vae.decode(z).sample.float()
    wgt = 1.0 + fg_weight * fg.unsqueeze(1).float()
    err = rec - x
    l1 = (err.abs() * wgt).mean() / wgt.mean()
    l2 = (err.square() * wgt).mean() / wgt.mean()
    mean, logvar = post.mean.float(), post.logvar.float()
    kl = 0.5 * (mean.square() + logvar.exp() - 1.0 - logvar).mean()
    loss = l1 + l2 + kl_weight * kl
    return loss, {"l1": l1.item(), "l2": l2.item(), "kl": kl.item()}


def train_vae(pipe, args, state: dict, dev: torch.device, clock: Clock, record: dict) -> None:
    """Train the VAE (or its decoder); totals go to ``state["vae"]``, this run's settings and
    counts to ``record``."""
    vae = pipe.vae.to(dev).train().requires_grad_(True)
    if args.vae_train == "decoder":
        vae.encoder.requires_grad_(False)
        vae.quant_conv.requires_grad_(False)
    trainable = [p for p in vae.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.vae_lr, betas=(0.9, 0.99), weight_decay=0.0)
    gen = torch.Generator(dev).manual_seed(args.seed * 7 + 1)
    st = state.setdefault("vae", {"steps": 0, "clips": 0, "seconds": 0.0})
    batches = spec_batches(args.seed * 1000 + STREAM_VAE, st["clips"], args.vae_batch_size,
                           args.workers)
    budget = Budget(args.vae_steps, args.vae_minutes, clock)
    log(f"vae: {sum(p.numel() for p in trainable) / 1e6:.2f} M parameters trained "
        f"({args.vae_train}), batch "
        f"{args.vae_batch_size} x {args.vae_frames} x {args.size}^2, budget "
        f"{args.vae_steps or '-'} steps / {budget.seconds / 60:.1f} min")
    step, t_last, t_data, seen = 0, time.perf_counter(), 0.0, 0
    while not budget.done(step):
        t_d = time.perf_counter()
        params, _ = next(batches)
        clips, fg = render_batch(params.to(dev), args.vae_frames, args.size)
        x = to_model_input(clips)
        t_data += time.perf_counter() - t_d
        for g in opt.param_groups:
            g["lr"] = args.vae_lr * lr_factor(step, budget.progress(step), warmup=100,
                                              schedule="linear_tail", decay_frac=0.2, final=0.1)
        with _autocast(dev):
            loss, parts = vae_loss(vae, x, fg, args.kl_weight, args.fg_weight, gen, args.vae_sample)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        step += 1
        seen += x.shape[0]
        if step % args.log_every == 0 or step == 1:
            dt = time.perf_counter() - t_last
            if args.runlog is not None:
                args.runlog.write(st["steps"] + step, "vae", loss=loss.item(), **parts,
                                  grad_norm=float(gnorm), lr=opt.param_groups[0]["lr"],
                                  clips_per_s=seen / dt)
            log(f"vae step {st['steps'] + step:6d}  loss {loss.item():.4f}  l1 {parts['l1']:.4f} "
                f"l2 {parts['l2']:.5f} kl {parts['kl']:.2f}  gnorm {float(gnorm):.2f}  "
                f"{seen / dt:.1f} clips/s  data {100 * t_data / dt:.0f}%  "
                f"t {clock.elapsed():.0f}s")
            t_last, t_data, seen = time.perf_counter(), 0.0, 0
    batches.close()
    st["steps"] += step
    st["clips"] += step * args.vae_batch_size
    st["seconds"] += time.perf_counter() - budget.t0
    st["final_loss"] = loss.item() if step else st.get("final_loss")
    st.setdefault("decoder_only_steps", 0)
    if args.vae_train == "decoder":
        st["decoder_only_steps"] += step
    record.update(steps=step, clips=step * args.vae_batch_size,
                  seconds=round(time.perf_counter() - budget.t0, 1), final_loss=st["final_loss"],
                  train=args.vae_train, batch_size=args.vae_batch_size, frames=args.vae_frames,
                  lr=args.vae_lr, kl_weight=args.kl_weight, fg_weight=args.fg_weight,
                  sample=args.vae_sample)
    vae.eval().requires_grad_(False)


@torch.no_grad()
def posterior_means(vae, params: torch.Tensor, frames: int, size: int,
                    dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Render a batch of clip specifications on ``dev`` and encode them: the posterior means and
    the rendered object masks ``(B, T, H, W)``."""
    clips, fg = render_batch(params.to(dev), frames, size)
    with _autocast(dev):
        return vae.encode(to_model_input(clips)).latent_dist.mode(), fg


def latent_object_mask(fg: torch.Tensor, latent_shape: tuple[int, ...]) -> torch.Tensor:
    """The latent cells ``(B, 1, T', H', W')`` whose pixels any object touches: a pixel mask
    ``(B, T, H, W)`` max-pooled the way the VAE compresses, the first frame alone and then
    groups of ``(T - 1) / (T' - 1)`` frames, ``H / H'`` x ``W / W'`` pixels."""
    t, h, w = latent_shape[-3:]
    b, frames = fg.shape[:2]
    first = fg[:, :1]
    rest = fg[:, 1:].reshape(b, t - 1, (frames - 1) // (t - 1), *fg.shape[2:]).any(2)
    m = torch.cat([first, rest], 1).float()
    return F.adaptive_max_pool2d(m, (h, w)).unsqueeze(1).bool()


@torch.no_grad()
def latent_stats(pipe, args, state: dict, dev: torch.device) -> None:
    """Per-channel mean and std of the posterior means over ``--stats-clips`` clips, written into
    the VAE config (``latents_mean`` / ``latents_std``)."""
    vae = pipe.vae.to(dev).eval()
    batch = max(1, min(32, args.stats_clips))
    batches = spec_batches(args.seed * 1000 + STREAM_STATS, 0, batch, args.workers)
    total, total_sq, count, clips = None, None, 0, 0
    while clips < args.stats_clips:
        params, _ = next(batches)
        mu = posterior_means(vae, params, args.frames, args.size, dev)[0].double()
        s = mu.sum(dim=(0, 2, 3, 4))
        sq = mu.square().sum(dim=(0, 2, 3, 4))
        total = s if total is None else total + s
        total_sq = sq if total_sq is None else total_sq + sq
        count += mu.numel() // mu.shape[1]
        clips += mu.shape[0]
    batches.close()
    mean = total / count
    std = (total_sq / count - mean.square()).clamp_min(1e-12).sqrt()
    vae.register_to_config(latents_mean=[round(float(v), 6) for v in mean],
                           latents_std=[round(float(v), 6) for v in std])
    state["latent_stats_clips"] = clips
    log("latents: mean " + " ".join(f"{v:+.2f}" for v in mean.tolist()))
    log("latents: std  " + " ".join(f"{v:.2f}" for v in std.tolist()))


# ----------------------------------------------------------------------------------------------
# Stage 2: text encoder + transformer


class TextBindingHead(torch.nn.Module):
    """An auxiliary loss that makes the text encoder's token states carry the binding of a caption.

    For every object of a caption, read from its words: the state of its shape word must predict
    the object's colour and motion, and the state of its colour word its shape and motion (one
    linear layer, cross-entropy). A bag-of-words encoder cannot do this for two-object captions
    (:func:`binding_signal`), so the loss pushes the encoder to attend along the word order. The
    head is used in training only and never saved; the labels come from the token ids (the
    caption grammar of :mod:`attnqat.synthetic`), so no extra data is needed."""

    def __init__(self, tokenizer, width: int) -> None:
        super().__init__()
        vocab = max(tokenizer.get_vocab().values()) + 1
        # a motion is named by the last word of its phrase ("moves left" -> left, "grows")
        phrases = [MOTION_PHRASE[m].split() for m in MOTIONS]
        words = {"colour_of": COLOURS, "shape_of": SHAPES, "motion_of": [w[-1] for w in phrases]}
        for table, names in words.items():   # token id -> attribute index, -1 for other words
            lookup = torch.full((vocab,), -1, dtype=torch.long)
            for k, w in enumerate(names):
                lookup[tokenizer.convert_tokens_to_ids(w)] = k
            self.register_buffer(table, lookup, persistent=False)
        (moves,) = {w[0] for w in phrases if len(w) == 2}   # the verb of two-word phrases
        self.moves = tokenizer.convert_tokens_to_ids(moves)
        self.proj = torch.nn.Linear(width, len(COLOURS) + len(SHAPES) + len(MOTIONS))

    def forward(self, states: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, accuracy) over the attribute predictions of the batch's objects (fixed shapes,
        no host synchronization: every position is scored, the non-shape ones masked out)."""
        nxt = F.pad(ids[:, 1:], (0, 1))
        nxt2 = F.pad(ids[:, 2:], (0, 2))
        # per shape word at p: its colour (p - 1), shape (p) and motion (p + 1, or p + 2 after "moves")
        shape = self.shape_of[ids[:, 1:]]
        colour = self.colour_of[ids[:, :-1]]
        motion = self.motion_of[torch.where(nxt == self.moves, nxt2, nxt)[:, 1:]]
        valid = (shape >= 0) & (colour >= 0) & (motion >= 0)
        logits = self.proj(states.float())
        at_shape, at_colour = logits[:, 1:], logits[:, :-1]
        nc, ns = len(COLOURS), len(SHAPES)
        preds = [(at_shape[..., :nc], colour), (at_shape[..., nc + ns:], motion),
                 (at_colour[..., nc:nc + ns], shape), (at_colour[..., nc + ns:], motion)]
        w = valid.float()
        n = w.sum().clamp_min(1.0)
        loss = sum((F.cross_entropy(lg.transpose(1, 2), y.clamp_min(0), reduction="none") * w).sum()
                   for lg, y in preds) / (len(preds) * n)
        with torch.no_grad():
            acc = sum(((lg.argmax(-1) == y).float() * w).sum() for lg, y in preds) / (len(preds) * n)
        return loss, acc


def scale_text_attention(text_encoder, factor: float) -> None:
    """Multiply every self-attention logit of a T5-style encoder by ``factor`` (its query and key
    weights by the square root): a way out of saturated, one-hot attention, whose gradients
    vanish. Changes the encoder's function; the training that follows has to adapt to it."""
    root = math.sqrt(factor)
    with torch.no_grad():
        for block in text_encoder.encoder.block:
            att = block.layer[0].SelfAttention
            att.q.weight.mul_(root)
            att.k.weight.mul_(root)


def flow_loss(transformer, text_encoder, z0: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
              generator: torch.Generator | None, shift: float,
              seq_len: int = TEXT_SEQ_LEN, text_aux: TextBindingHead | None = None,
              aux_weight: float = 0.0, aux_out: dict | None = None,
              weight: torch.Tensor | None = None) -> torch.Tensor:
    """Rectified-flow matching loss (:mod:`attnqat.finetune.objective`: uniform noise levels
    through the flow shift, then the noise, drawn from ``generator``) of one batch of normalized
    latents ``z0``, with the prompt embeddings computed differentiably by ``text_encoder``; with
    ``weight`` (broadcastable to ``z0``) a weighted mean; with ``text_aux``, plus ``aux_weight``
    times its binding loss (the parts go to ``aux_out``)."""
    sigma = sample_sigma(z0.shape[0], generator, sampling="uniform", shift=shift, device=z0.device)
    noise = torch.randn(z0.shape, generator=generator, device=z0.device)
    xt, timestep, target = noisy_input(z0, noise, sigma)
    emb = encode_text(text_encoder, ids, mask, seq_len)
    loss = flow_matching_loss(predict(transformer, xt, timestep, emb), target, weight)
    if text_aux is None:
        return loss
    aux, acc = text_aux(emb[:, :ids.shape[1]], ids)
    if aux_out is not None:
        aux_out.update(flow=loss.detach(), aux=aux.detach(), acc=acc.detach())
    return loss + aux_weight * aux


@torch.no_grad()
def encode_clips(vae, params: torch.Tensor, frames: int, size: int, mean: torch.Tensor,
                 std: torch.Tensor, dev: torch.device, object_mask: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Render, encode (posterior mean) and normalize a batch of clip specifications; with
    ``object_mask``, also the latent cells the objects touch (:func:`latent_object_mask`)."""
    z, fg = posterior_means(vae, params, frames, size, dev)
    return (z.float() - mean) / std, latent_object_mask(fg, z.shape) if object_mask else None


def _param_groups(modules: list[torch.nn.Module], weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for m in modules:
        for p in m.parameters():
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train_t2v(pipe, args, state: dict, dev: torch.device, clock: Clock,
              save: Callable[[list[torch.nn.Module]], None], record: dict) -> list[torch.nn.Module]:
    """Train; returns the modules to save (the EMA copies, or the live ones without EMA). Totals
    go to ``state["t2v"]``, this run's settings and counts to ``record``."""
    vae = pipe.vae.to(dev).eval().requires_grad_(False)
    te = pipe.text_encoder.to(dev).train().requires_grad_(True)
    tr = pipe.transformer.to(dev).train().requires_grad_(True)
    mean, std = latent_norm(vae, dev)
    st = state.setdefault("t2v", {"steps": 0, "samples": 0, "clips": 0, "seconds": 0.0})
    if args.text_attn_scale != 1.0:
        scale_text_attention(te, args.text_attn_scale)
        log(f"t2v: text encoder attention logits scaled by {args.text_attn_scale}")
    head = TextBindingHead(pipe.tokenizer, te.config.d_model).to(dev) if args.text_aux > 0 else None
    ema = ema_of([te, tr], args.ema) if args.ema > 0 else None
    trained = [te, tr] + ([head] if head is not None else [])
    opt = torch.optim.AdamW(_param_groups(trained, args.weight_decay), lr=args.lr,
                            betas=(0.9, 0.99), eps=1e-8)
    gen = torch.Generator(dev).manual_seed(args.seed * 7 + 2 + 1000 * len(state.get("runs", [])))
    empty_ids, empty_mask = tokenize(pipe.tokenizer, [""], args.text_len)
    empty_ids, empty_mask = empty_ids.to(dev), empty_mask.to(dev)

    # the pool of latents on the device (bf16): filled first, then a ring buffer refreshed with
    # --fresh new clips every --fresh-every steps (encoding is the expensive part of the data)
    fresh = max(0, args.fresh)
    pool_z: torch.Tensor | None = None
    pool_ids = torch.zeros(args.pool, args.text_len, dtype=torch.long, device=dev)
    pool_mask = torch.zeros_like(pool_ids)
    pool_fg: torch.Tensor | None = None   # latent cells the objects touch (--object-weight only)
    filled, ptr, clips_used = 0, 0, 0

    def add(batches) -> None:
        nonlocal pool_z, pool_fg, filled, ptr, clips_used
        params, captions = next(batches)
        z, fg = encode_clips(vae, params, args.frames, args.size, mean, std, dev,
                             object_mask=args.object_weight > 0)
        ids, msk = tokenize(pipe.tokenizer, captions, args.text_len)
        if pool_z is None:
            pool_z = torch.zeros((args.pool, *z.shape[1:]), dtype=torch.bfloat16, device=dev)
            if fg is not None:
                pool_fg = torch.zeros((args.pool, *fg.shape[1:]), dtype=torch.bool, device=dev)
        n = min(z.shape[0], args.pool - ptr)
        pool_z[ptr:ptr + n] = z[:n].to(torch.bfloat16)
        if fg is not None:
            pool_fg[ptr:ptr + n] = fg[:n]
        pool_ids[ptr:ptr + n], pool_mask[ptr:ptr + n] = ids[:n].to(dev), msk[:n].to(dev)
        ptr = (ptr + n) % args.pool
        filled = min(args.pool, filled + n)
        clips_used += n

    t_fill = time.perf_counter()
    fill_batch = max(1, min(args.fill_batch, args.pool))
    stream = args.seed * 1000 + STREAM_T2V
    weights = None if args.two_objects is None else (1.0 - args.two_objects, args.two_objects)
    fill = spec_batches(stream, st["clips"], fill_batch, args.workers, weights)
    while filled < args.pool:
        add(fill)
    fill.close()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t_fill = time.perf_counter() - t_fill
    batches = (spec_batches(stream, st["clips"] + clips_used, fresh, args.workers, weights)
               if fresh else None)
    log(f"t2v: pool of {filled} latents {tuple(pool_z.shape[1:])} filled in {t_fill:.1f} s "
        f"({filled / max(t_fill, 1e-9):.0f} clips/s); transformer "
        f"{sum(p.numel() for p in tr.parameters()) / 1e6:.2f} M, text encoder "
        f"{sum(p.numel() for p in te.parameters()) / 1e6:.2f} M parameters")

    if args.compile:
        tr.compile()   # in place: the parameters (which the EMA follows) stay the same
    budget = Budget(args.t2v_steps, args.t2v_minutes, clock)
    log(f"t2v: batch {args.batch_size}, {fresh} fresh clips every {args.fresh_every} steps, budget "
        f"{args.t2v_steps or '-'} steps / {budget.seconds / 60:.1f} min")
    params_all = [p for m in trained for p in m.parameters()]
    step, t_data, loss_sum, loss_n = 0, 0.0, 0.0, 0
    aux_out: dict = {}
    t_last = t_saved = time.perf_counter()
    loss = torch.zeros(())
    while not budget.done(step):
        t_d = time.perf_counter()
        if batches is not None and step % max(1, args.fresh_every) == 0:
            add(batches)
        t_data += time.perf_counter() - t_d
        idx = torch.randint(filled, (args.batch_size,), generator=gen, device=dev)
        z0 = pool_z[idx].float()
        weight = None if pool_fg is None else 1.0 + args.object_weight * pool_fg[idx].float()
        ids, msk = pool_ids[idx], pool_mask[idx]
        drop = torch.rand(args.batch_size, generator=gen, device=dev) < args.caption_dropout
        ids = torch.where(drop[:, None], empty_ids, ids)
        msk = torch.where(drop[:, None], empty_mask, msk)
        for g in opt.param_groups:
            g["lr"] = args.lr * lr_factor(step, budget.progress(step), warmup=args.warmup,
                                          schedule="linear_tail", decay_frac=args.decay_frac,
                                          final=args.final_lr_frac)
        try:
            with _autocast(dev):
                loss = flow_loss(tr, te, z0, ids, msk, gen, args.shift, args.seq_len, head,
                                 args.text_aux, aux_out, weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        except Exception as e:   # only the compilation may fail, at the first step
            if not (args.compile and step == 0):
                raise
            log(f"WARNING: torch.compile of the transformer failed ({type(e).__name__}: "
                f"{str(e)[:300]}); training this run eagerly (same numerics, slower)")
            tr._compiled_call_impl = None
            args.compile = False
            continue
        gnorm = torch.nn.utils.clip_grad_norm_(params_all, 1.0)
        opt.step()
        if ema is not None:
            ema.update()
        step += 1
        loss_sum, loss_n = loss_sum + loss.detach(), loss_n + 1
        if step % args.log_every == 0 or step == 1:
            dt = time.perf_counter() - t_last
            if args.runlog is not None:
                args.runlog.write(st["steps"] + step, "train", loss=float(loss_sum) / loss_n,
                                  grad_norm=float(gnorm), lr=opt.param_groups[0]["lr"],
                                  steps_per_s=loss_n / dt,
                                  **({k: float(v) for k, v in aux_out.items()} if aux_out else {}))
            log(f"t2v step {st['steps'] + step:6d}  loss {float(loss_sum) / loss_n:.4f}  gnorm "
                f"{float(gnorm):.2f}  lr {opt.param_groups[0]['lr']:.2e}  "
                f"{loss_n / dt:.1f} it/s  data {100 * t_data / dt:.0f}%  t {clock.elapsed():.0f}s"
                + (f"  (last step: flow {float(aux_out['flow']):.4f}, binding loss "
                   f"{float(aux_out['aux']):.3f}, accuracy {float(aux_out['acc']):.2f})" if aux_out else ""))
            t_last, t_data, loss_sum, loss_n = time.perf_counter(), 0.0, 0.0, 0
        if args.save_every_minutes > 0 and time.perf_counter() - t_saved > 60 * args.save_every_minutes:
            before = dict(st)   # the save carries this run so far; training goes on from before
            _t2v_account(st, record, step, args, clips_used, budget, loss.item())
            save(averaged([te, tr], ema))
            st.clear()
            st.update(before)
            t_saved = time.perf_counter()
    if batches is not None:
        batches.close()
    _t2v_account(st, record, step, args, clips_used, budget, loss.item())
    te.eval().requires_grad_(False)
    tr.eval().requires_grad_(False)
    return averaged([te, tr], ema)


def _t2v_account(st: dict, record: dict, step: int, args, clips: int, budget: Budget,
                 loss: float) -> None:
    seconds = time.perf_counter() - budget.t0
    st["steps"] += step
    st["samples"] += step * args.batch_size
    st["clips"] += clips
    st["seconds"] += seconds
    st["final_loss"] = loss
    record.update(steps=step, samples=step * args.batch_size, clips=clips,
                  seconds=round(seconds, 1), final_loss=loss, batch_size=args.batch_size,
                  lr=args.lr, warmup=args.warmup, decay_frac=args.decay_frac, ema=args.ema,
                  shift=args.shift, caption_dropout=args.caption_dropout, pool=args.pool,
                  fresh=args.fresh, fresh_every=args.fresh_every, text_len=args.text_len,
                  seq_len=args.seq_len, two_objects=args.two_objects,
                  grow_layers=args.grow_layers or None, compile=args.compile,
                  text_aux=args.text_aux, text_attn_scale=args.text_attn_scale,
                  object_weight=args.object_weight)


# ----------------------------------------------------------------------------------------------
# Stage 3: held-out evaluation through the generation code


def evaluate(model_dir: Path, args, dev: torch.device) -> dict:
    """Score the saved model on the held-out prompts (:mod:`attnqat.finetune.heldout`); returns
    (and writes) the result."""
    from attnqat.wan import load_models

    from . import heldout

    t0 = time.perf_counter()
    models = load_models(model_dir, device=dev)
    first = args.eval_offset
    methods = [m.strip() for m in args.eval_methods.split(",") if m.strip()]

    def prepare(guidance: float | None) -> heldout.HeldoutInputs:
        return heldout.inputs(models, first, args.eval_prompts, steps=args.eval_steps,
                              guidance=guidance, size=args.eval_size, frames=args.eval_frames,
                              backend=args.eval_backend)

    inp = prepare(args.eval_guidance)
    specs, prompts, s0 = inp.specs, inp.prompts, inp.settings[0]
    tr = models.pipe.transformer
    text_binding = binding_signal(models.pipe.text_encoder, models.pipe.tokenizer, specs,
                                  args.text_len)
    result = {"model": str(model_dir), "date": now(), "device": device_name(dev),
              "prompts": len(prompts), "first_prompt": first,
              "seeds": f"{first}..{first + len(prompts) - 1} (seed i for held-out prompt i)",
              "settings": {"steps": s0.steps, "guidance": s0.guidance, "shift": s0.shift,
                           "height": s0.height, "width": s0.width, "frames": s0.frames,
                           "negative_prompt": s0.negative_prompt, "backend": args.eval_backend,
                           "fp4_scope": "self", "batch": args.eval_batch},
              "weights_note": models.info.weights_note, "text_binding": text_binding,
              "methods": {}, "clips": []}
    clips: dict[str, list[np.ndarray]] = {}
    scores: dict[str, list[dict]] = {}
    n_objects = [len(s.objects) for s in specs]
    for m in methods:
        t1 = time.perf_counter()
        clips[m] = heldout.generate_clips(models, tr, inp, m, args.eval_backend, args.eval_batch)
        t2 = time.perf_counter()
        scores[m] = heldout.score_all(prompts, clips[m], args.workers)
        row = heldout.summary_row(scores[m])
        # where the errors are: one-object against two-object prompts
        row["by_objects"] = {str(n): heldout.summary_row([s for s, k in zip(scores[m], n_objects)
                                                          if k == n])
                             for n in sorted(set(n_objects))}
        row.update(generate_s=round(t2 - t1, 2), score_s=round(time.perf_counter() - t2, 2))
        if m != "bf16" and "bf16" in clips:
            sim = heldout.similarity(clips[m], clips["bf16"])
            row.update(psnr_vs_bf16=sim["psnr"], psnr_vs_bf16_median=sim["psnr_median"],
                       identical_to_bf16=sim["identical"], ssim_vs_bf16=sim["ssim"])
        result["methods"][m] = row
        log(f"eval {m}: {len(prompts)} clips generated in {t2 - t1:.1f} s, scored in "
            f"{time.perf_counter() - t2:.1f} s")
    for i, p in enumerate(prompts):
        result["clips"].append({"prompt": p, "seed": first + i, **{
            m: {"colour": scores[m][i]["colour"], "shape": scores[m][i]["shape"],
                "motion": scores[m][i]["motion"], "background": scores[m][i]["background"],
                "all_correct": scores[m][i]["all_correct"],
                "detected": [o.get("detected") for o in scores[m][i]["objects"]]}
            for m in methods}})
    sweep = [float(g) for g in args.sweep_guidance.split(",") if g.strip()]
    if sweep:
        result["guidance_sweep_bf16"] = {}
        for g in sweep:
            cg = heldout.generate_clips(models, tr, prepare(g), "bf16", args.eval_backend, args.eval_batch)
            result["guidance_sweep_bf16"][str(g)] = heldout.summary_row(
                heldout.score_all(prompts, cg, args.workers))
    result["seconds"] = round(time.perf_counter() - t0, 1)
    path = args.eval_json or Path(str(args.out) + "-eval.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    if args.eval_samples > 0:
        k = min(args.eval_samples, len(prompts))
        np.savez_compressed(path.with_name(path.stem + "-samples.npz"), prompts=np.array(prompts[:k]),
                            **{m: np.stack(clips[m][:k]) for m in methods})
    log(format_table(result))
    return result


def format_table(result: dict) -> str:
    """The evaluation result as an aligned text table."""
    cols = ("colour", "shape", "motion", "background", "all_correct")
    lines = [f"held-out prompts: {result['prompts']} ({result['seeds']}); settings "
             + ", ".join(f"{k} {v}" for k, v in result["settings"].items()),
             f"{'method':<10}" + "".join(f"{c:>12}" for c in cols) + f"{'PSNR dB':>10}{'SSIM':>8}"]
    for m, row in result["methods"].items():
        psnr = row.get("psnr_vs_bf16")
        ssim = row.get("ssim_vs_bf16")
        lines.append(f"{m:<10}" + "".join(f"{100 * row[c]:>11.1f}%" for c in cols)
                     + (f"{psnr:>10.2f}" if psnr is not None else f"{'-':>10}")
                     + (f"{ssim:>8.3f}" if ssim is not None else f"{'-':>8}"))
    for m, row in result["methods"].items():
        for n, sub in row.get("by_objects", {}).items():
            lines.append(f"{m + ' ' + n + ' obj':<10}" + "".join(f"{100 * sub[c]:>11.1f}%" for c in cols)
                         + f"   ({sub['clips']} prompts)")
    for g, row in result.get("guidance_sweep_bf16", {}).items():
        lines.append(f"{'bf16 g' + g:<10}" + "".join(f"{100 * row[c]:>11.1f}%" for c in cols))
    if result.get("text_binding") is not None:
        lines.append(f"text binding signal {result['text_binding']:.2e} (prompt states with the two "
                     "motions swapped vs not; 0: the text encoder is order-blind)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The command


def _refuse(message: str) -> int:
    """Report a bad argument or state on stderr; the command's exit status 2."""
    print(f"attnqat finetune tiny: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from attnqat.wan import resolve_device

    clock = Clock(args.time_limit_minutes, args.reserve_minutes)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        return _refuse(f"unknown stage(s) {', '.join(bad)}; expected some of {', '.join(STAGES)}")
    if "export" in stages and args.resume is None:
        return _refuse("--stages export needs --resume")
    if args.frames < 1 or (args.frames - 1) % 4 or args.vae_frames < 1 or (args.vae_frames - 1) % 4:
        return _refuse("--frames and --vae-frames must be 4k+1")
    if args.eval_offset < 0 or args.eval_prompts < 1:
        return _refuse("--eval-offset must be >= 0 and --eval-prompts >= 1")
    if not (args.text_aux >= 0.0 and args.text_attn_scale > 0.0 and args.object_weight >= 0.0):
        return _refuse("--text-aux and --object-weight must be >= 0 and --text-attn-scale > 0")
    if args.two_objects is not None and not 0.0 <= args.two_objects <= 1.0:
        return _refuse(f"--two-objects must be in [0, 1], got {args.two_objects}")
    dev = resolve_device(args.device)
    args.runlog = RunLog(args.log_dir) if getattr(args, "log_dir", None) else None
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True   # fixed shapes: the VAE's 3-D convolutions gain

    if args.resume is not None:
        pipe, cfg, sidecar = load_for_training(args.resume)
        state = copy.deepcopy(sidecar.get("training", {}))
        done = {k: state.get(k, {}).get("steps", 0) for k in ("vae", "t2v")}
        log(f"resumed from {args.resume}: {done['vae']} VAE steps, {done['t2v']} t2v steps")
    else:
        overrides = json.loads(args.config) if args.config else {}
        cfg = replace(tiny.TinyWanConfig(), **overrides)
        pipe = tiny.build_tiny_pipeline(args.seed, cfg)
        state = {}
    if args.grow_layers:
        if args.resume is None or "t2v" not in stages:
            return _refuse("--grow-layers needs --resume and the t2v stage")
        try:
            inserted = grow_transformer(pipe.transformer, args.grow_layers)
        except ValueError as e:
            return _refuse(str(e))
        cfg = replace(cfg, num_layers=args.grow_layers)
        log(f"transformer grown to {args.grow_layers} blocks (new, zero-output blocks at "
            f"{inserted})")
    if args.defaults:
        cfg = replace(cfg, defaults={**cfg.defaults, **json.loads(args.defaults)})
    # the padded length of the prompt embeddings, as the pipeline will pad them at inference
    args.seq_len = int(cfg.defaults.get("max_sequence_length", TEXT_SEQ_LEN))
    if args.text_len > args.seq_len:
        return _refuse(f"--text-len {args.text_len} exceeds the model's max_sequence_length "
                       f"{args.seq_len}")
    run_rec = {"date": now(), "device": device_name(dev), "stages": stages,
               "command": "attnqat finetune tiny " + shlex.join(sys.argv[1:])
               if sys.argv and not sys.argv[0].endswith("pytest") else None}
    state.setdefault("runs", [])
    n_runs = len(state["runs"])
    log(f"device {run_rec['device']}; stages {', '.join(stages)}; "
        f"config {json.dumps(tiny.config_dict(cfg))}")

    trained = False
    training = "vae" in stages or "t2v" in stages
    if "vae" in stages:
        run_rec["vae"] = {}
        train_vae(pipe, args, state, dev, clock, run_rec["vae"])
        if args.vae_train == "all":   # a frozen encoder keeps its latent statistics
            latent_stats(pipe, args, state, dev)
        trained = True
    to_save = [pipe.text_encoder, pipe.transformer]

    def save(modules: list[torch.nn.Module]) -> None:
        from diffusers import WanPipeline

        out_pipe = WanPipeline(tokenizer=pipe.tokenizer, text_encoder=modules[0], vae=pipe.vae,
                               scheduler=pipe.scheduler, transformer=modules[1])
        if training:   # an export adds no run
            state["runs"] = state["runs"][:n_runs] + [dict(run_rec, seconds=round(clock.elapsed(), 1))]
        save_model(out_pipe, args.out, args.qat_out, cfg, state, args.seed)
        log(f"saved {args.out}" + (f" and {args.qat_out}" if args.qat_out else "")
            + f" (t {clock.elapsed():.0f}s)")

    if "t2v" in stages:
        run_rec["t2v"] = {}
        to_save = train_t2v(pipe, args, state, dev, clock, save, run_rec["t2v"])
        trained = True
    if trained or "export" in stages:
        save(to_save)
    if "eval" in stages:
        if not (Path(args.out) / "model_index.json").is_file():
            return _refuse(f"nothing to evaluate at {args.out}")
        evaluate(Path(args.out), args, dev)
    log(f"done in {clock.elapsed():.0f} s")
    if args.runlog is not None:
        args.runlog.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attnqat.finetune.tiny_train",
        description="Train the embedded tiny Wan 2.1 model (VAE, text encoder, transformer) on the "
                    "synthetic shapes data, save it in diffusers format and score it on the "
                    "held-out prompts.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
