"""The options of ``attnqat finetune tiny`` and the typed configuration a run reads them into.

:func:`add_arguments` declares the command line; :meth:`TinyTrainConfig.from_args` turns the parsed
namespace into one frozen :class:`TinyTrainConfig` (options of the whole run, and of each stage),
and :func:`problem` names the first option a run refuses. Nothing else reads the namespace: a stage
gets its options from the config and what changes while it runs from
:class:`attnqat.finetune.tiny_context.Context`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from attnqat.family import WAN21_T2V

STAGES = ("vae", "t2v", "eval", "export")
TEXT_SEQ_LEN = 512        # Wan pads the prompt embeddings to 512 tokens (attnqat.generate); a
                          # model's sidecar default ``max_sequence_length`` overrides it
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
# The typed configuration: one dataclass per option group. A field reads the option named
# ``<group prefix><field>`` when the parser has one, else ``<field>`` (``VaeOptions.lr`` is
# ``--vae-lr``, ``VaeOptions.kl_weight`` is ``--kl-weight``); a test checks that every option is
# read exactly once.


def _json_object(text: str | None, flag: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {text!r}")
    return value


def _names(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


class _Options:
    PREFIX = ""

    @classmethod
    def dests(cls, args: argparse.Namespace) -> dict[str, str]:
        """Field name → the parser's destination it reads."""
        return {f.name: cls.PREFIX + f.name if hasattr(args, cls.PREFIX + f.name) else f.name
                for f in fields(cls)}

    @classmethod
    def from_args(cls, args: argparse.Namespace, **parsed: Any):
        return cls(**{name: parsed[name] if name in parsed else getattr(args, dest)
                      for name, dest in cls.dests(args).items()})


@dataclass(frozen=True)
class RunOptions(_Options):
    """The ``run`` group: what the whole process does."""

    stages: tuple[str, ...]
    out: Path
    qat_out: Path | None
    resume: Path | None
    config: dict[str, Any]       # TinyWanConfig fields of a new model
    defaults: dict[str, Any]     # generation defaults written into attnqat.json
    device: str
    seed: int
    workers: int
    size: int
    frames: int
    time_limit_minutes: float
    reserve_minutes: float
    save_every_minutes: float
    log_every: int
    log_dir: Path | None


@dataclass(frozen=True)
class VaeOptions(_Options):
    """The ``vae stage`` group."""

    PREFIX = "vae_"
    minutes: float
    steps: int
    batch_size: int
    frames: int
    lr: float
    train: str                   # "all" | "decoder"
    sample: bool
    kl_weight: float
    fg_weight: float
    stats_clips: int


@dataclass(frozen=True)
class T2VOptions(_Options):
    """The ``t2v stage`` group."""

    PREFIX = "t2v_"
    minutes: float
    steps: int
    batch_size: int
    lr: float
    weight_decay: float
    warmup: int
    decay_frac: float
    final_lr_frac: float
    ema: float
    caption_dropout: float
    shift: float
    pool: int
    fill_batch: int
    fresh: int
    fresh_every: int
    text_len: int
    two_objects: float | None
    grow_layers: int
    text_aux: float
    object_weight: float
    text_attn_scale: float
    compile: bool


@dataclass(frozen=True)
class EvalOptions(_Options):
    """The ``eval stage`` group."""

    PREFIX = "eval_"
    prompts: int
    offset: int
    methods: tuple[str, ...]
    backend: str
    batch: int
    steps: int | None
    guidance: float | None
    size: int | None
    frames: int | None
    sweep_guidance: tuple[float, ...]
    json: Path | None
    samples: int


@dataclass(frozen=True)
class TinyTrainConfig:
    """Everything ``attnqat finetune tiny`` was asked to do."""

    run: RunOptions
    vae: VaeOptions
    t2v: T2VOptions
    eval: EvalOptions

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TinyTrainConfig":
        """The configuration of parsed options; ``ValueError`` (naming the option) for a value
        that does not parse."""
        try:
            sweep = tuple(float(g) for g in _names(args.sweep_guidance))
        except ValueError:
            raise ValueError(f"--sweep-guidance must be comma-separated numbers, got "
                             f"{args.sweep_guidance!r}") from None
        return cls(
            run=RunOptions.from_args(args, stages=_names(args.stages),
                                     config=_json_object(args.config, "--config"),
                                     defaults=_json_object(args.defaults, "--defaults")),
            vae=VaeOptions.from_args(args),
            t2v=T2VOptions.from_args(args),
            eval=EvalOptions.from_args(args, methods=_names(args.eval_methods),
                                       sweep_guidance=sweep))


def problem(cfg: TinyTrainConfig) -> str | None:
    """The first option (or combination) a run refuses, in words; None if there is none. (What
    depends on the model, ``--text-len`` against its prompt length and ``--grow-layers`` against
    its depth, is checked once it is loaded.)"""
    run, t2v = cfg.run, cfg.t2v
    bad = [s for s in run.stages if s not in STAGES]
    if bad:
        return f"unknown stage(s) {', '.join(bad)}; expected some of {', '.join(STAGES)}"
    if "export" in run.stages and run.resume is None:
        return "--stages export needs --resume"
    for flag, frames in (("--frames", run.frames), ("--vae-frames", cfg.vae.frames)):
        why = WAN21_T2V.frames_error(frames)
        if why is not None:
            return f"{flag}: {why}"
    if cfg.eval.offset < 0 or cfg.eval.prompts < 1:
        return "--eval-offset must be >= 0 and --eval-prompts >= 1"
    if not (t2v.text_aux >= 0.0 and t2v.text_attn_scale > 0.0 and t2v.object_weight >= 0.0):
        return "--text-aux and --object-weight must be >= 0 and --text-attn-scale > 0"
    if t2v.two_objects is not None and not 0.0 <= t2v.two_objects <= 1.0:
        return f"--two-objects must be in [0, 1], got {t2v.two_objects}"
    if t2v.grow_layers and (run.resume is None or "t2v" not in run.stages):
        return "--grow-layers needs --resume and the t2v stage"
    return None
