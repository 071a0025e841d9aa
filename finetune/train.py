"""``attnqat finetune train``: fine-tune a Wan 2.1 transformer with Attn-QAT attention.

One file, read top to bottom: the configuration (recipes, config file and flags), the model, the
:class:`Trainer` (one optimizer step), validation, the loop (data, logs, checkpoints, signals), the
command line. Runs on one process or many (``torchrun --nproc-per-node N -m
attnqat.finetune.train ...``); every run is FSDP2-sharded, also a single process
(:mod:`attnqat.finetune.distributed`), so checkpoints resume on any number of GPUs.

The student's attention (``--attention``): ``attnqat`` (4-bit forward, Attn-QAT backward),
``dropin`` (4-bit forward, ordinary backward: the ablation the paper calls unstable) or ``bf16``
(the control); in self-attention only (``--scope self``, the published recipe) or cross-attention
too (``all``). ``--ablation d_from_o | p_unquantized`` switches one of Attn-QAT's two principles off
(PyTorch reference backend). The objective is rectified-flow matching as Wan is trained
(:mod:`attnqat.finetune.objective`); each global sample draws its noise level, noise and caption
dropout from its own seed (:func:`attnqat.finetune.data.sample_seed`), so a run gives the same
numbers on any number of GPUs and after a resume.

Configuration, lowest to highest precedence: built-in defaults, the recipe of the model's kind
(:data:`RECIPES`, each value's source in :data:`RECIPE_SOURCES`), the run's own ``config.json``
when resuming, ``--config FILE`` (JSON or TOML, keys as the flags' long names), the flags given.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from attnqat import methods as registry

from . import checkpoint as ckpt
from .cache import check_fps, model_fps
from .data import (CACHE_MANIFEST, DataError, DataOrder, LatentCache, data_fingerprint, loader,
                   mix_seed, open_source, pad_text, read_cache_manifest, sample_seed)
from . import mesh
from .distributed import PRECISIONS, DistContext, all_max, all_sum, local
from .objective import (OBJECTIVES, SIGMA_SAMPLINGS, distill_target, flow_matching_loss, make_teacher,
                        noisy_input, predict, sample_sigma)
from .runlog import RunLog, console_line, device_name, now
from .schedule import EMA, SCHEDULES, lr_factor

#: the built-in student attentions (live: :func:`attnqat.methods.trainable`)
STUDENT_METHODS = registry.trainable()
OPTIMIZERS = ("adamw", "adamw8bit")
#: the attention a student deploys at inference (validation clips, generate, the app)
DEPLOYED = {m: registry.get(m).deploys_as for m in STUDENT_METHODS}
EXIT_NONFINITE = 3
EXIT_CRASH = 1

#: Defaults that depend on the model: the published Attn-QAT recipe for the real Wan 2.1 models,
#: the project's own for the embedded tiny model.
RECIPES: dict[str, dict[str, Any]] = {
    "wan": dict(lr=1e-6, schedule="constant", warmup=0, weight_decay=0.01, grad_clip=1.0,
                caption_dropout=0.1, sigma_sampling="uniform", shift=1.0, steps=4000,
                batch_size=1, gradient_checkpointing=True, ema=0.0),
    "tiny-wan": dict(lr=2e-5, schedule="constant", warmup=20, weight_decay=0.01, grad_clip=1.0,
                     caption_dropout=0.1, sigma_sampling="uniform", shift=3.0, steps=500,
                     batch_size=16, gradient_checkpointing=False, ema=0.0),
}
RECIPE_SOURCES: dict[str, str] = {
    "wan": "Attn-QAT (arXiv 2603.00040) as released in FastVideo's Wan 2.1 launch scripts: full "
           "fine-tune, AdamW lr 1e-6 constant (no warm-up), weight decay 0.01, gradient clipping "
           "1.0, caption dropout 0.1, flow shift 1 with uniform noise levels, 4,000 steps, batch 1 "
           "per GPU (16 GPUs there), BF16 mixed precision with FP32 master weights, full gradient "
           "checkpointing. AdamW betas and epsilon are PyTorch's defaults (0.9, 0.999, 1e-8): the "
           "recipe does not state them.",
    "tiny-wan": "the embedded tiny model's own training (attnqat finetune tiny, docs/tiny_model.md): "
                "flow shift 3 with uniform noise levels, caption dropout 0.1, weight decay 0.01, "
                "clipping 1.0; a fine-tuning learning rate of 2e-5 constant after 20 warm-up steps "
                "(its last training run ended at 4e-5), batch 16, 500 steps; no gradient "
                "checkpointing (the model is small).",
}


@dataclass
class TrainConfig:
    """Every setting of a run (``RUN/config.json``). ``None`` means "the model's default"."""

    out: str = ""
    model: str = ""
    transformer: str | None = None
    data: str = "synthetic"
    height: int | None = None
    width: int | None = None
    frames: int | None = None
    stride: int = 1
    fps: float | None = None
    two_objects: float | None = None
    attention: str = "attnqat"
    scope: str = "self"
    lora_rank: int = 0
    lora_alpha: float | None = None
    backend: str = "auto"
    ablation: str | None = None
    objective: str = "flow"
    steps: int | None = None
    batch_size: int | None = None
    grad_accum: int = 1
    lr: float | None = None
    schedule: str | None = None
    warmup: int | None = None
    final_lr_frac: float = 0.0
    weight_decay: float | None = None
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float | None = None
    ema: float | None = None
    caption_dropout: float | None = None
    sigma_sampling: str | None = None
    shift: float | None = None
    logit_mean: float = 0.0
    logit_std: float = 1.0
    precision: str = "auto"
    optimizer: str = "adamw"
    offload: bool = False
    gradient_checkpointing: bool | None = None
    compile: bool = False
    seed: int = 0
    checkpoint_every: int = 500
    keep: int = 3
    time_limit: float = 0.0
    log_every: int = 1
    tensorboard: bool = True
    val_every: int = 0
    val_prompts: str | None = None
    val_steps: int | None = None
    val_guidance: float | None = None
    workers: int = 2
    device: str = "auto"
    progress: bool = True
    max_sequence_length: int | None = None
    recipe: str = ""
    sp: int = 1          # finetune/mesh.py
    replicate: int = 1
    resumed_from: str | None = None
    data_fingerprint: str | None = None

    def global_batch(self, world: int) -> int:
        return self.batch_size * self.grad_accum * world


#: settings a latent cache fixes (a run on a cache takes them from it)
CACHE_SIZES = ("height", "width", "frames", "fps", "max_sequence_length")


def cache_sizes(meta: dict) -> dict[str, Any]:
    """A cache manifest's :data:`CACHE_SIZES` (caches from before ``--fps``: frame for frame, 0)."""
    return {k: meta.get(k, 0 if k == "fps" else None) for k in CACHE_SIZES}

#: settings a resumed run may not change (the run would no longer be one run)
IDENTITY = ("model", "transformer", "data", "two_objects", "height", "width", "frames", "stride", "fps",
            "attention", "lora_rank", "lora_alpha", "optimizer",
            "scope", "ablation", "objective", "seed", "sigma_sampling", "shift", "logit_mean", "logit_std",
            "caption_dropout")


# ----------------------------------------------------------------------------------------------
# Configuration


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``attnqat finetune train``; every default is None so that the layers of
    the configuration (module docstring) can tell what was given."""
    bool_flag = argparse.BooleanOptionalAction
    g = parser.add_argument_group("run")
    g.add_argument("--out", help="run folder: config, logs, checkpoints, validation clips (required)")
    g.add_argument("--config", type=Path, help="JSON or TOML file of settings (keys: the long option "
                                               "names); flags given here override it")
    g.add_argument("--resume", nargs="?", const="latest",
                   help="continue from the latest checkpoint of --out, or from the checkpoint or "
                        "run folder named; the run's config.json is the starting configuration")
    g.add_argument("--device", help="auto | cpu | cuda | cuda:N (under torchrun: cuda means "
                                    "cuda:LOCAL_RANK) [auto]")
    g.add_argument("--seed", type=int, help="seed of the data order, of every sample's noise and of a LoRA "
                                           "adapter's initial A [0]")
    g.add_argument("--steps", type=int, help="optimizer steps of the whole run [recipe]")
    g.add_argument("--time-limit", type=float,
                   help="minutes of training after which the run saves a checkpoint and stops "
                        "(resume with --resume; 0: none) [0]")
    g.add_argument("--progress", action=bool_flag, help="show a progress bar [yes]")
    g = parser.add_argument_group("model and data")
    g.add_argument("--model", help="diffusers Wan 2.1 pipeline folder or hub id whose transformer is "
                                   "fine-tuned (its VAE and text encoder encode raw data and "
                                   "validation prompts) [the embedded tiny model]")
    g.add_argument("--transformer", help="start from these transformer weights instead of the "
                                         "model's: a diffusers folder or .safetensors in the "
                                         "diffusers, FastVideo or original Wan naming")
    g.add_argument("--data", help="'synthetic' (the shapes stream), a cache folder from `attnqat "
                                  "finetune cache`, a folder of clips with .txt captions, or a "
                                  ".csv/.jsonl manifest [synthetic]")
    g.add_argument("--height", type=int, help="training height, a multiple of 16 [model's]")
    g.add_argument("--width", type=int, help="training width, a multiple of 16 [model's]")
    g.add_argument("--frames", type=int, help="frames per clip, 4k+1 [model's]")
    g.add_argument("--stride", type=int, help="take every N-th frame of raw clips [1]")
    g.add_argument("--fps", type=float,
                   help="raw clips: resample to this frame rate before taking --frames (0: frame "
                        "for frame, whatever the clip's rate) [the model's: Wan 16]")
    g.add_argument("--two-objects", type=float, metavar="FRAC",
                   help="synthetic data: share of two-object clips [the stream's: 0.5]")
    g.add_argument("--max-sequence-length", type=int,
                   help="prompt embedding rows (Wan: 512) [model's]")
    g.add_argument("--workers", type=int, help="DataLoader workers decoding clips [2]")
    g = parser.add_argument_group("student attention")
    g.add_argument("--attention", choices=registry.trainable(),
                   help="; ".join(f"{m}: {registry.get(m).finetuned_note}" for m in registry.trainable())
                   + " [attnqat]")
    g.add_argument("--scope", choices=("self", "all"),
                   help="4-bit self-attention only (cross-attention in BF16), or all [self]")
    g.add_argument("--backend", choices=("auto", "torch", "triton"),
                   help="attention kernels: Triton where they run, else the PyTorch reference [auto]")
    g.add_argument("--ablation", choices=("d_from_o", "p_unquantized"),
                   help="attnqat only: principle 2 off (D from the 4-bit O) or principle 1 off (P "
                        "not re-quantized before dV); PyTorch reference backend")
    g.add_argument("--lora-rank", type=int,
                   help="train a LoRA adapter of this rank on the attention and FFN projections of "
                        "every block instead of all weights (0: full fine-tuning) [0]")
    g.add_argument("--lora-alpha", type=float, help="LoRA scale numerator (scale alpha/rank) [rank]")
    g = parser.add_argument_group("objective")
    g.add_argument("--objective", choices=OBJECTIVES,
                   help="flow: rectified-flow matching (target noise - clean latent); distill: the "
                        "frozen starting transformer's velocity with BF16 attention as the target "
                        "(quantization-aware distillation) [flow]")
    g.add_argument("--sigma-sampling", choices=SIGMA_SAMPLINGS, help="noise-level draw [recipe]")
    g.add_argument("--shift", type=float, help="flow shift of the noise levels [recipe]")
    g.add_argument("--logit-mean", type=float, help="logit-normal mean [0]")
    g.add_argument("--logit-std", type=float, help="logit-normal standard deviation [1]")
    g.add_argument("--caption-dropout", type=float,
                   help="probability of training on the empty prompt [recipe]")
    g = parser.add_argument_group("optimisation")
    g.add_argument("--batch-size", type=int, help="clips per GPU per micro-step [recipe]")
    g.add_argument("--grad-accum", type=int, help="micro-steps per optimizer step [1]")
    g.add_argument("--lr", type=float, help="peak learning rate [recipe]")
    g.add_argument("--schedule", choices=SCHEDULES, help="after the warm-up [recipe]")
    g.add_argument("--warmup", type=int, help="linear warm-up steps [recipe]")
    g.add_argument("--final-lr-frac", type=float, help="cosine / linear_tail end, × peak [0]")
    g.add_argument("--weight-decay", type=float, help="AdamW weight decay of matrices [recipe]")
    g.add_argument("--adam-beta1", type=float, help="[0.9]")
    g.add_argument("--adam-beta2", type=float, help="[0.999]")
    g.add_argument("--adam-eps", type=float, help="[1e-8]")
    g.add_argument("--grad-clip", type=float, help="global gradient-norm clip (0: off) [recipe]")
    g.add_argument("--ema", type=float, help="EMA decay of the weights (0: off) [recipe]")
    g.add_argument("--precision", choices=("auto",) + PRECISIONS,
                   help="bf16 (autocast, FSDP2 bfloat16 parameter gathering, FP32 master weights) "
                        "or fp32; auto: bf16 on CUDA, fp32 on the CPU [auto]")
    g.add_argument("--optimizer", choices=OPTIMIZERS,
                   help="adamw: float32 moments (8 bytes a parameter); adamw8bit: the moments of "
                        "matrices in 8 bits with stochastic rounding (2 bytes) [adamw]")
    g.add_argument("--offload", action=bool_flag,
                   help="FSDP2 CPU offload: master weights, gradients and optimizer state live in "
                        "CPU memory, each block is gathered to the GPU when it runs; the optimizer "
                        "steps on the CPU [no]")
    g.add_argument("--gradient-checkpointing", action=bool_flag,
                   help="recompute each WanTransformerBlock in the backward [recipe]")
    g.add_argument("--compile", action=bool_flag, help="torch.compile every block [no]")
    mesh.add_arguments(parser)
    g = parser.add_argument_group("checkpoints, logs, validation")
    g.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (also on "
                                                        "SIGTERM/SIGINT and at the end) [500]")
    g.add_argument("--keep", type=int, help="complete checkpoints kept [3]")
    g.add_argument("--log-every", type=int, help="steps between log records [1]")
    g.add_argument("--tensorboard", action=bool_flag, help="TensorBoard scalars in RUN/tb [yes]")
    g.add_argument("--val-every", type=int, help="steps between validations (0: none) [0]")
    g.add_argument("--val-prompts",
                   help="a text file of prompts (one per line), or 'heldout:K' for the first K "
                        "held-out synthetic prompts (scored procedurally) [tiny model: heldout:4]")
    g.add_argument("--val-steps", type=int, help="denoising steps of validation clips [model's]")
    g.add_argument("--val-guidance", type=float, help="guidance of validation clips [model's]")


def _read_config_file(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read --config {path}: {exc}") from exc
    try:
        if path.suffix.lower() == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--config {path} is not valid {'TOML' if path.suffix == '.toml' else 'JSON'}: "
                         f"{exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} must hold an object of settings")
    data = {k.replace("-", "_"): v for k, v in data.items()}
    known = {f.name for f in fields(TrainConfig)} - {"recipe", "resumed_from", "data_fingerprint"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"--config {path}: unknown setting(s) {', '.join(unknown)}")
    return data


#: settings naming a local file or folder: stored absolute, so that a run resumes from any working
#: directory and the same path written either way is the same setting
PATH_SETTINGS = ("out", "data", "model", "transformer", "val_prompts")


def _absolute_paths(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with each :data:`PATH_SETTINGS` value that names an existing path (``out``:
    any) made absolute; ``synthetic``, ``heldout:K`` and hub ids stay as they are."""
    out = dict(settings)
    for k in PATH_SETTINGS:
        v = out.get(k)
        if isinstance(v, str) and v and v != "synthetic" and not v.startswith("heldout:"):
            p = Path(v).expanduser()
            if k == "out" or p.exists():
                out[k] = str(p.resolve())
    return out


def resolve_config(args: argparse.Namespace, world: int = 1) -> TrainConfig:
    """The run's configuration from the layers of the module docstring, validated, every
    model-dependent default filled in. Loads no weights.

    Raises:
        ValueError: a bad setting (the message names it); DataError, ModelLoadError.
    """
    from attnqat.wan import DEFAULT_MODEL, model_info

    given = {k: v for k, v in vars(args).items()
             if v is not None and k not in ("config", "resume", "_command", "_group_parser")}
    layers: dict[str, Any] = {}
    prior: dict[str, Any] | None = None
    out = given.get("out")
    if args.resume is not None:
        if not out:
            raise ValueError("--resume needs --out (the run folder to continue)")
        saved = Path(out) / "config.json"
        if not saved.is_file():
            raise ValueError(f"--resume: {saved} does not exist (is {out} a run folder?)")
        prior = _absolute_paths(json.loads(saved.read_text()))
        prior.setdefault("fps", 0)   # runs from before --fps read clips frame for frame
        layers.update({k: v for k, v in prior.items() if k not in ("recipe", "resumed_from")})
    if args.config is not None:
        layers.update(_absolute_paths(_read_config_file(args.config)))
    layers.update(_absolute_paths(given))
    if prior is not None:
        changed = [k for k in IDENTITY if layers.get(k) != prior.get(k)]
        if changed:
            raise ValueError(f"a resumed run keeps its {', '.join(changed)}: start a new run (new "
                             "--out) to change them")
        layers["resumed_from"] = _absolute_paths({"out": args.resume})["out"] \
            if args.resume != "latest" else args.resume
        layers["_changed"] = {k: [prior.get(k), v] for k, v in layers.items()
                              if k in prior and k not in ("recipe", "resumed_from") and v != prior[k]}
    if not layers.get("out"):
        raise ValueError("--out RUN_FOLDER is required")
    cfg = TrainConfig(**{k: v for k, v in layers.items() if k in {f.name for f in fields(TrainConfig)}})
    cfg._changed = layers.get("_changed", {})   # what a resume changed (logged), not a setting
    cfg.model = cfg.model or DEFAULT_MODEL
    info = model_info(cfg.model)
    kind = "tiny-wan" if info.kind == "tiny-wan" else "wan"
    for k, v in RECIPES[kind].items():
        if getattr(cfg, k) is None:
            setattr(cfg, k, v)
    cfg.recipe = f"{kind}: {RECIPE_SOURCES[kind]}"
    if cfg.data != "synthetic" and (Path(cfg.data) / CACHE_MANIFEST).is_file():
        for k, v in cache_sizes(read_cache_manifest(cfg.data)).items():   # no repeating them
            if getattr(cfg, k) is None:
                setattr(cfg, k, v)
    d = info.defaults
    cfg.height = cfg.height or d["height"]
    cfg.width = cfg.width or d["width"]
    cfg.frames = cfg.frames or d["frames"]
    cfg.fps = model_fps(d) if cfg.fps is None else check_fps(cfg.fps)
    cfg.max_sequence_length = cfg.max_sequence_length or int(d.get("max_sequence_length", 512))
    if cfg.val_prompts is None and kind == "tiny-wan":
        cfg.val_prompts = "heldout:4"
    _validate(cfg, world)
    return cfg


def _validate(cfg: TrainConfig, world: int) -> None:
    from .cache import check_size

    check_size(cfg.height, cfg.width, cfg.frames, cfg.stride)
    ints = {"steps": 1, "batch_size": 1, "grad_accum": 1, "warmup": 0, "checkpoint_every": 0,
            "keep": 1, "log_every": 1, "val_every": 0, "workers": 0, "max_sequence_length": 1,
            "lora_rank": 0}
    for k, lo in ints.items():
        v = getattr(cfg, k)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"--{k.replace('_', '-')} must be an integer >= {lo}, got {v!r}")
    pos = {"lr": (0, False), "adam_eps": (0, False), "shift": (0, False), "logit_std": (0, False),
           "weight_decay": (0, True), "grad_clip": (0, True), "time_limit": (0, True),
           "final_lr_frac": (0, True)}
    for k, (lo, inclusive) in pos.items():
        v = getattr(cfg, k)
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo or (v == lo and not inclusive):
            raise ValueError(f"--{k.replace('_', '-')} must be {'>=' if inclusive else '>'} {lo}, got {v!r}")
    for k in ("caption_dropout", "adam_beta1", "adam_beta2"):
        v = getattr(cfg, k)
        if not 0.0 <= v < 1.0 or (k == "caption_dropout" and v > 1.0):
            raise ValueError(f"--{k.replace('_', '-')} must be in [0, 1), got {v!r}")
    if cfg.lora_alpha is not None and not (cfg.lora_rank and math.isfinite(cfg.lora_alpha)
                                           and cfg.lora_alpha > 0):
        raise ValueError(f"--lora-alpha must be > 0 and needs --lora-rank, got {cfg.lora_alpha!r}")
    if cfg.two_objects is not None and not 0.0 <= cfg.two_objects <= 1.0:
        raise ValueError(f"--two-objects must be in [0, 1], got {cfg.two_objects}")
    if cfg.ema and not 0.0 < cfg.ema < 1.0:
        raise ValueError(f"--ema must be in (0, 1) or 0 (off), got {cfg.ema}")
    choices = {"attention": registry.trainable(), "scope": ("self", "all"),
               "backend": ("auto", "torch", "triton"), "schedule": SCHEDULES,
               "sigma_sampling": SIGMA_SAMPLINGS, "precision": ("auto",) + PRECISIONS,
               "objective": OBJECTIVES, "optimizer": OPTIMIZERS}
    for k, allowed in choices.items():
        if getattr(cfg, k) not in allowed:
            raise ValueError(f"unknown --{k.replace('_', '-')} {getattr(cfg, k)!r}; expected one of "
                             f"{', '.join(allowed)}")
    if cfg.ablation is not None:
        if cfg.ablation not in ("d_from_o", "p_unquantized"):
            raise ValueError(f"unknown --ablation {cfg.ablation!r}; expected d_from_o or p_unquantized")
        if cfg.ablation not in registry.get(cfg.attention).ablations:
            takers = " or ".join(registry.with_ablations())
            raise ValueError(f"--ablation applies to --attention {takers} only")
        if cfg.backend == "triton":
            raise ValueError("--ablation runs on the PyTorch reference: use --backend torch or auto")
    if cfg.val_every and not cfg.val_prompts:
        raise ValueError("--val-every needs --val-prompts (a file of prompts, one per line)")
    if cfg.val_prompts and not cfg.val_prompts.startswith("heldout:") and not Path(cfg.val_prompts).is_file():
        raise ValueError(f"--val-prompts {cfg.val_prompts}: no such file (or use heldout:K)")


def val_prompt_list(spec: str) -> list[str]:
    if spec.startswith("heldout:"):
        from attnqat.synthetic import heldout_prompts

        try:
            k = int(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"--val-prompts {spec}: expected heldout:K with an integer K") from None
        return heldout_prompts(k)
    prompts = [line.strip() for line in Path(spec).read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--val-prompts {spec} holds no prompts")
    return prompts


# ----------------------------------------------------------------------------------------------
# The model


def transformer_config(model: str) -> dict:
    """The base transformer's config (``transformer/config.json`` of the pipeline)."""
    from diffusers import WanTransformer3DModel

    from attnqat.wan import model_info

    info = model_info(model)
    where = str(info.path) if info.path is not None else info.source
    local_only = {"local_files_only": True} if info.path is not None else {}
    cfg = WanTransformer3DModel.load_config(where, subfolder="transformer", **local_only)
    return {k: v for k, v in cfg.items() if not k.startswith("_")}


def load_transformer(cfg: TrainConfig):
    """The transformer to fine-tune, float32 on the CPU: the model's, or ``--transformer``'s
    weights (any naming scheme, checked against the model's config)."""
    from diffusers import WanTransformer3DModel

    from attnqat.convert import load_wan_transformer
    from attnqat.wan import ModelLoadError, _dtype_kwarg, _quiet_loading, model_info

    if cfg.transformer:
        model, _ = load_wan_transformer(cfg.transformer, config=transformer_config(cfg.model),
                                        dtype=torch.float32)
        return model
    info = model_info(cfg.model)
    where = str(info.path) if info.path is not None else info.source
    local_only = {"local_files_only": True} if info.path is not None else {}
    try:
        with _quiet_loading():
            return WanTransformer3DModel.from_pretrained(where, subfolder="transformer",
                                                         **_dtype_kwarg(torch.float32), **local_only)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"could not load the transformer of {info.source}: "
                             f"{type(exc).__name__}: {exc}") from exc


def tokens_per_sample(transformer_cfg: dict, latent_shape: tuple[int, ...]) -> int:
    """Self-attention tokens of one clip: latent frames × height × width over the patch."""
    pt, ph, pw = transformer_cfg["patch_size"]
    _, t, h, w = latent_shape
    return (t // pt) * (h // ph) * (w // pw)


class NonFiniteError(RuntimeError):
    """The loss or a gradient is NaN or infinite."""


class Trainer:
    """The student transformer sharded over the ranks, its optimizer and EMA: one optimizer step
    at a time (:meth:`micro_step` for each micro-batch, then :meth:`optimizer_step`)."""

    def __init__(self, cfg: TrainConfig, transformer, ctx: DistContext, empty_text: torch.Tensor) -> None:
        from attnqat.wan import install_attention

        from .distributed import shard_transformer

        self.cfg, self.ctx = cfg, ctx
        self.precision = cfg.precision if cfg.precision != "auto" else (
            "bf16" if ctx.device.type == "cuda" else "fp32")
        if any(p.dtype != torch.float32 for p in transformer.parameters()):
            raise ValueError("the transformer to train must hold float32 (master) weights")
        # the distill objective's teacher: the starting weights, frozen, BF16 attention, unsharded
        self.teacher = None if cfg.objective != "distill" else make_teacher(
            transformer, cfg.backend, torch.bfloat16 if self.precision == "bf16" else None).to(ctx.device)
        # LoRA: the adapter (float32, drawn from --seed: the same on every rank and in every run)
        # goes on where the weights are; under bf16 autocast the frozen base's linear and
        # convolution weights are then stored in bfloat16, which autocast casts them to anyway:
        # the same numbers, and the base is moved and kept at half the size
        # (attnqat.lora.frozen_base_to; docs/finetune.md, "LoRA")
        self.base_bf16 = 0
        if cfg.lora_rank:
            from attnqat.lora import add_lora, frozen_base_to

            add_lora(transformer, cfg.lora_rank, cfg.lora_alpha, seed=mix_seed(cfg.seed, 0x10A))
            if self.precision == "bf16":
                self.base_bf16 = frozen_base_to(transformer, torch.bfloat16)
        # offloaded, the weights stay in CPU memory and FSDP2 moves each block in when it runs;
        # buffers (the RoPE tables) are no parameters of FSDP2's and go to the device themselves
        self.model = transformer if cfg.offload else transformer.to(ctx.device)
        if cfg.offload:
            for module in self.model.modules():
                for name, buf in list(module._buffers.items()):
                    if buf is not None:
                        module._buffers[name] = buf.to(ctx.device)
        self.proc = install_attention(self.model, cfg.attention, fp4_scope=cfg.scope,
                                      backend=cfg.backend, timing=False, ablation=cfg.ablation)
        mesh.apply_sp(self.model, ctx)
        if cfg.gradient_checkpointing:
            self.model.enable_gradient_checkpointing()
        self.model.train()
        if not cfg.lora_rank:
            self.model.requires_grad_(True)
        shard_transformer(self.model, ctx, self.precision, offload=cfg.offload)
        # diffusers' transformer returns a view of its output; nothing here modifies it in place,
        # which is what FSDP2 warns about on every forward
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        if cfg.compile:
            for block in self.model.blocks:
                block.compile()
        self.named = {k: p for k, p in self.model.named_parameters() if p.requires_grad}
        n_blocks = len(self.model.blocks)
        self.group_names = [f"block_{i:02d}" for i in range(n_blocks)] + ["embed_head"]
        self.group_of = [int(k.split(".")[1]) if k.startswith("blocks.") else n_blocks
                         for k in self.named]
        decay = [p for p in self.named.values() if p.dim() >= 2]
        no_decay = [p for p in self.named.values() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        if cfg.optimizer == "adamw8bit":
            from .optim import AdamW8bit

            self.optimizer = AdamW8bit(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                       eps=cfg.adam_eps, seed=cfg.seed)
        else:
            self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                               eps=cfg.adam_eps)
        self.ema = EMA(self.named, cfg.ema) if cfg.ema else None
        self.empty_text = empty_text.to(ctx.device, torch.float32)
        self.parameters = sum(p.numel() for p in self.named.values())

    def autocast(self):
        return torch.autocast(device_type=self.ctx.device.type, dtype=torch.bfloat16,
                              enabled=self.precision == "bf16")

    def draws(self, samples: torch.Tensor, shape: tuple[int, ...]):
        """Per global sample: noise level, noise and the caption-dropout coin (module docstring)."""
        cfg, dev = self.cfg, self.ctx.device
        sig, noise, coin = [], [], []
        for g in samples.tolist():
            gen = torch.Generator(dev).manual_seed(sample_seed(cfg.seed, g))
            sig.append(sample_sigma(1, gen, sampling=cfg.sigma_sampling, shift=cfg.shift,
                                    mean=cfg.logit_mean, std=cfg.logit_std, device=dev))
            noise.append(torch.randn(shape, generator=gen, device=dev))
            coin.append(torch.rand(1, generator=gen, device=dev))
        return torch.cat(sig), torch.stack(noise), torch.cat(coin) < cfg.caption_dropout

    def micro_step(self, latents: torch.Tensor, text: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one micro-batch (latents (B, C, T, H, W), prompt embeddings
        (B, L, D), their global sample indices); returns the micro-batch's loss (detached)."""
        sigma, noise, drop = self.draws(samples, tuple(latents.shape[1:]))
        text = torch.where(drop.view(-1, 1, 1), self.empty_text.expand_as(text), text)
        x_t, timestep, target = noisy_input(latents, noise, sigma)
        last = True
        if self.cfg.grad_accum > 1:
            self._micro = getattr(self, "_micro", 0) + 1
            last = self._micro % self.cfg.grad_accum == 0
            self.model.set_requires_gradient_sync(last)
        with self.autocast():
            if self.teacher is not None:
                target = distill_target(self.teacher, x_t, timestep, text)
            pred = predict(self.model, x_t, timestep, text)
        loss = flow_matching_loss(pred, target)
        (loss * self.ctx.sp / self.cfg.grad_accum).backward()   # × sp: finetune/mesh.py
        return loss.detach()

    def optimizer_step(self, step: int) -> dict:
        """Clip, step, average; returns the gradient norms and the learning rate. Raises
        :class:`NonFiniteError` (the weights untouched) for a non-finite gradient norm."""
        cfg = self.cfg
        params = [p for p in self.named.values()]
        grads = [local(p.grad) if p.grad is not None else torch.zeros(1, device=self.ctx.device)
                 for p in params]
        norms = torch.stack([n.float() for n in torch._foreach_norm(grads)]).to(self.ctx.device)
        sq = torch.zeros(len(self.group_names), device=self.ctx.device, dtype=torch.float32)
        sq.index_add_(0, torch.tensor(self.group_of, device=self.ctx.device), norms.square())
        sq = all_sum(sq, self.ctx) / self.ctx.replicate   # HSDP replicas hold the same shards
        total = float(sq.sum().sqrt())
        if not math.isfinite(total):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(f"non-finite gradient norm ({total})")
        if cfg.grad_clip > 0 and total > cfg.grad_clip:
            torch._foreach_mul_([local(p.grad) for p in params if p.grad is not None],
                                cfg.grad_clip / (total + 1e-6))
        lr = cfg.lr * lr_factor(step, step / cfg.steps, warmup=cfg.warmup, schedule=cfg.schedule,
                                final=cfg.final_lr_frac)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update()
        return {"grad_norm": total, "lr": lr,
                "grad_norm_blocks": {n: float(v.sqrt()) for n, v in zip(self.group_names, sq)}}


# ----------------------------------------------------------------------------------------------
# Validation


class Validator:
    """Clips of fixed prompts with the student's deployed attention, written as mp4 (rank 0) and,
    for synthetic captions, scored procedurally. Every rank runs the denoising (the model is
    sharded); rank 0 decodes, moving the VAE to the GPU for it when it lives on the CPU."""

    def __init__(self, cfg: TrainConfig, parts, prompts: list[str], prompt_text: torch.Tensor,
                 negative_text: torch.Tensor, latent_shape: tuple[int, ...], ctx: DistContext) -> None:
        from diffusers import WanPipeline

        from attnqat.synthetic import parse_caption
        from attnqat.wan import WanModels, default_shift, model_info

        info = model_info(cfg.model)
        d = info.defaults
        self.cfg, self.ctx, self.parts, self.prompts = cfg, ctx, parts, prompts
        self.prompt_text, self.negative_text = prompt_text, negative_text
        self.latent_shape = latent_shape
        self.steps = cfg.val_steps or int(d["steps"])
        self.guidance = cfg.val_guidance if cfg.val_guidance is not None else float(d["guidance"])
        self.shift = float(d["shift"]) if d.get("shift") is not None else default_shift(cfg.height, cfg.width)
        self.fps = float(d.get("fps", 16))
        pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=parts.vae, scheduler=parts.scheduler)
        self.decoder = WanModels(pipe=pipe, device=ctx.device, info=info,
                                 offload=next(parts.vae.parameters()).device != ctx.device)
        try:
            for p in prompts:
                parse_caption(p)
            self.scored = True
        except ValueError:
            self.scored = False

    def run(self, trainer: Trainer, step: int) -> dict:
        from attnqat.eval.procedural import score_clip, summarize
        from attnqat.generate import decode, denoise
        from attnqat.video import write_mp4

        model, dev = trainer.model, self.ctx.device
        method = trainer.proc.method
        trainer.proc.method = registry.get(self.cfg.attention).deploys_as
        model.eval()
        folder = Path(self.cfg.out) / "val" / f"step-{step:07d}"
        scores = []
        try:
            with torch.no_grad(), trainer.autocast():
                for i, prompt in enumerate(self.prompts):
                    # the noise of seed i, drawn as attnqat.generate.initial_latents draws it
                    lat0 = torch.randn((1, *self.latent_shape),
                                       generator=torch.Generator("cpu").manual_seed(i))
                    lat = denoise(model, self.parts.scheduler, lat0, self.prompt_text[i:i + 1].to(dev),
                                  self.negative_text.to(dev)[None], steps=self.steps,
                                  guidance=self.guidance, shift=self.shift, device=dev)
                    if not self.ctx.is_main:
                        continue
                    frames = decode(self.decoder, lat)
                    folder.mkdir(parents=True, exist_ok=True)
                    write_mp4(frames, folder / f"{i:02d}.mp4", self.fps)
                    if self.scored:
                        scores.append(score_clip(prompt, frames))
        finally:
            trainer.proc.method = method
            model.train()
        out: dict = {"clips": len(self.prompts), "folder": str(folder)}
        if scores:
            s = summarize(scores)
            out.update({k: s[k] for k in ("colour", "shape", "motion", "all_correct")})
        return out


# ----------------------------------------------------------------------------------------------
# The loop


def _peak_memory(dev: torch.device) -> float:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def exit_status(exc: BaseException) -> int:
    """The exit status of a run ended by ``exc``: 2 bad input (found late, e.g. an unreadable
    clip), 130 a second Ctrl-C, :data:`EXIT_CRASH` anything else."""
    from attnqat.wan import ModelLoadError

    if isinstance(exc, KeyboardInterrupt):
        return 128 + signal.SIGINT
    if isinstance(exc, (ValueError, DataError, ModelLoadError, FileNotFoundError)):
        return 2
    return EXIT_CRASH


def one_line(exc: BaseException) -> str:
    """``exc`` as one line for logs: its type and the first line of its message."""
    msg = str(exc).strip().splitlines()
    return type(exc).__name__ + (f": {msg[0]}" if msg else "")


class _Stop:
    """SIGTERM / SIGINT set a flag; the loop saves a checkpoint at the end of the step. A second
    SIGINT interrupts at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old = {}
        for s in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:   # not the main thread (e.g. a test runner's worker)
                pass

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def _open_data(cfg: TrainConfig, *, resuming: bool):
    """The run's data source, checked against the run before any model loads: a resumed run's data
    must be the data it began with (its fingerprint), and a latent cache must hold the run's clip size."""
    source = open_source(cfg.data, frames=cfg.frames, height=cfg.height, width=cfg.width,
                         stride=cfg.stride, seed=cfg.seed, two_objects=cfg.two_objects, fps=cfg.fps)
    fingerprint = data_fingerprint(source)
    if cfg.data_fingerprint and cfg.data_fingerprint != fingerprint and resuming:
        raise DataError(f"the data {cfg.data} changed since the run began (fingerprint "
                        f"{cfg.data_fingerprint[:12]} then, {fingerprint[:12]} now: clips added, removed "
                        "or re-encoded): the data order would not be the run's; start a new run (new --out)")
    cfg.data_fingerprint = fingerprint
    if isinstance(source, LatentCache):
        diff = [f"{k} {v} (cache) vs {getattr(cfg, k)} (run)"
                for k, v in cache_sizes(source.meta).items() if v != getattr(cfg, k)]
        if diff:
            raise DataError(f"the cache {cfg.data} does not fit this run: {'; '.join(diff)}")
    return source


class _TextInputs:
    """The frozen text side of a run: the model's components (``parts``), the encoder of raw clips
    and captions (None for a latent cache without validation prompts, or once a cache's run has
    encoded what it needs), the empty caption's embedding (caption dropout), and the validation
    prompts with theirs and the negative prompt's (the one `generate` uses: Wan's own)."""

    def __init__(self, cfg: TrainConfig, ctx: DistContext, source) -> None:
        from attnqat.wan import model_info

        from .encode import Encoder, load_components

        cached = isinstance(source, LatentCache)
        self.prompts = val_prompt_list(cfg.val_prompts) if cfg.val_every else []
        need = not cached or bool(self.prompts)
        self.parts = load_components(cfg.model, text=need, vae=need)
        encoder = Encoder(self.parts, ctx.device, cfg.max_sequence_length) if need else None
        if cached:
            self.empty = pad_text([source.empty_text()], cfg.max_sequence_length)[0]
        else:
            self.empty = encoder.text([""])[0].cpu()
        self.prompt_text = encoder.text(self.prompts).cpu() if self.prompts else None
        negative = model_info(cfg.model).defaults.get("negative_prompt", "")
        self.negative_text = encoder.text([negative])[0].cpu() if self.prompts and negative else self.empty
        if cached and encoder is not None:   # the text encoder and VAE leave the GPU
            encoder.text_encoder.to("cpu")
            encoder.vae.to("cpu")
            encoder = None
            self.parts.text_encoder = None
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
        self.encoder = encoder


def _start_log(cfg: TrainConfig, ctx: DistContext, run_dir: Path, tcfg: dict, step: int, resume_from,
               say) -> RunLog:
    """The main rank's run folder and log at ``step``: the configs written, on a resume the later
    checkpoints set aside and the log's later records dropped, and a start or resume event."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=1) + "\n")
    (run_dir / "transformer_config.json").write_text(json.dumps(tcfg, indent=1) + "\n")
    abandoned = [p.name for p in ckpt.set_aside_after(run_dir, step)] if resume_from else []
    if abandoned:
        say(f"resumed from an older checkpoint: the later {', '.join(abandoned)} moved to "
            f"{run_dir / ckpt.ABANDONED}")
    runlog = RunLog(run_dir, tensorboard=cfg.tensorboard, purge_step=step + 1 if resume_from else None)
    dropped = runlog.truncate_after(step)
    runlog.write(step, "event", event="resume" if resume_from else "start", date=now(),
                 world=ctx.world, device=device_name(ctx.device), dropped_records=dropped,
                 checkpoint=str(resume_from) if resume_from else None,
                 changed=getattr(cfg, "_changed", {}) or None,
                 **({"abandoned_checkpoints": abandoned} if abandoned else {}))
    return runlog


def _describe(cfg: TrainConfig, ctx: DistContext, transformer, trainer: Trainer, source, gb: int,
              step: int) -> str:
    """The line a run starts with: what trains, with which attention, where, on what data."""
    return (f"training {sum(p.numel() for p in transformer.parameters()) / 1e6:.1f} M parameters "
            + (f"({trainer.parameters / 1e6:.2f} M of them a LoRA adapter of rank {cfg.lora_rank}"
               + (f"; {trainer.base_bf16 / 1e6:.1f} M frozen linear weights kept in bfloat16"
                  if trainer.base_bf16 else "") + ") " if cfg.lora_rank else "")
            + f"({cfg.attention} attention, scope {cfg.scope}"
            + (f", ablation {cfg.ablation}" if cfg.ablation else "") + f") on {ctx.world} × "
            f"{device_name(ctx.device)}, {trainer.precision}; data {source.description}; global batch "
            f"{gb}; steps {step}..{cfg.steps}; " + mesh.describe(ctx, cfg.batch_size, cfg.grad_accum))


def _non_finite(exc: NonFiniteError, trainer: Trainer, run_dir: Path, step: int, runlog, say) -> int:
    """A non-finite loss or gradient before step ``step + 1``'s update: the update is dropped, the
    last checkpoint kept as it was, the event logged; returns :data:`EXIT_NONFINITE`."""
    trainer.optimizer.zero_grad(set_to_none=True)
    kept = ckpt.complete_checkpoints(run_dir)
    msg = (f"{exc} at step {step + 1}: the run stops; the weights were not updated and "
           f"the last checkpoint ({kept[-1][1].name if kept else 'none yet'}) is kept as it was")
    say(f"attnqat finetune train: {msg}")
    if runlog is not None:
        runlog.write(step + 1, "event", event="non-finite", message=msg, date=now())
    return EXIT_NONFINITE


def _stopped(cfg: TrainConfig, signum: int | None, step: int, run_dir: Path, say) -> int:
    """A run stopped after ``step`` (its checkpoint saved) by the signal ``signum`` or, with
    ``signum`` None, by ``--time-limit``; returns the exit status."""
    if signum is None:
        say(f"time limit of {cfg.time_limit} min reached after step {step}; checkpoint "
            f"saved; continue with --resume --out {run_dir}")
        return 0
    say(f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint "
        f"saved; continue with --resume --out {run_dir}")
    return 128 + signum


def train(cfg: TrainConfig, ctx: DistContext, *, transformer=None, log=print) -> int:
    """Run (or continue) the training of ``cfg`` on this rank; returns the exit status: 0 done (or
    stopped at ``--time-limit``), 128 + signal number when stopped by SIGTERM/SIGINT (after saving
    a checkpoint), :data:`EXIT_NONFINITE` for a non-finite loss or gradient (no checkpoint
    written for that step)."""
    from tqdm.auto import tqdm

    say = log if ctx.is_main else (lambda *_a, **_k: None)
    run_dir = Path(cfg.out)
    resume_from = None
    if cfg.resumed_from:
        resume_from = ckpt.resolve(run_dir if cfg.resumed_from == "latest" else cfg.resumed_from, run_dir)
    elif ckpt.complete_checkpoints(run_dir):
        raise ValueError(f"{run_dir} already holds checkpoints: pass --resume to continue that run, "
                         "or choose a new --out")
    if ctx.is_main:
        ckpt.check_writable(run_dir)
    source = _open_data(cfg, resuming=resume_from is not None)
    frozen = _TextInputs(cfg, ctx, source)
    parts, encoder, prompts = frozen.parts, frozen.encoder, frozen.prompts

    if transformer is None:
        transformer = load_transformer(cfg)
    tcfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dict(transformer.config).items()
            if not k.startswith("_")}
    trainer = Trainer(cfg, transformer, ctx, frozen.empty)
    gb = cfg.global_batch(ctx.data_world)
    step, samples = 0, 0
    if resume_from is not None:
        state = ckpt.load(resume_from, trainer.model, trainer.optimizer, trainer.ema, ctx)
        step, samples = int(state["step"]), int(state["samples"])
        if samples % gb:
            raise ValueError(f"the checkpoint's data position {samples} is not a multiple of this "
                             f"run's global batch {gb}")
        say(f"resumed from {resume_from} at step {step} ({samples} samples read)"
            + (f"; it was written by {state['world']} process(es), this run has {ctx.world}"
               if state.get("world") != ctx.world else ""))
    runlog = _start_log(cfg, ctx, run_dir, tcfg, step, resume_from, say) if ctx.is_main else None
    order = DataOrder(source.size, cfg.seed)
    batches = None
    validator = None
    lat_shape: tuple[int, ...] | None = None

    def prepare(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if "latents" in batch:
            return (batch["latents"].to(ctx.device, torch.float32),
                    pad_text(batch["text"], cfg.max_sequence_length).to(ctx.device, torch.float32))
        return encoder.latents(batch["video"]), encoder.text(batch["captions"])

    say(_describe(cfg, ctx, transformer, trainer, source, gb, step))
    stop = _Stop()
    t_start = time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=step, desc="train", unit="step", file=sys.stderr,
               disable=not (cfg.progress and ctx.is_main), dynamic_ncols=True)
    last_saved, status, loss, error = step, 0, float("nan"), None
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    try:
        batches = loader(source, order, start=samples, batch=cfg.batch_size, rank=ctx.data_rank,
                         world=ctx.data_world, accum=cfg.grad_accum, workers=cfg.workers)
        while step < cfg.steps:
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), device=ctx.device)
            names: list[str] = []
            for _ in range(cfg.grad_accum):
                batch = next(batches)
                latents, text = prepare(batch)
                if lat_shape is None:
                    lat_shape = tuple(latents.shape[1:])
                names += batch["names"]
                loss_sum += trainer.micro_step(latents, text, batch["samples"].to(ctx.device))
            limit_hit = cfg.time_limit > 0 and time.perf_counter() - t_start > 60 * cfg.time_limit
            flags = all_sum(torch.stack([loss_sum.double(), torch.tensor(float(stop.signum or 0),
                                                                          device=ctx.device).double(),
                                         torch.tensor(float(limit_hit and ctx.is_main),
                                                      device=ctx.device).double()]), ctx)
            loss = float(flags[0]) / (ctx.world * cfg.grad_accum)
            if not math.isfinite(float(loss_sum)):
                print(f"rank {ctx.rank}: non-finite loss at step {step + 1} in samples "
                      f"{', '.join(names)}", file=sys.stderr, flush=True)
            try:
                if not math.isfinite(loss):
                    raise NonFiniteError(f"non-finite loss ({loss})")
                info = trainer.optimizer_step(step)
            except NonFiniteError as exc:
                status = _non_finite(exc, trainer, run_dir, step, runlog, say)
                break
            step += 1
            samples += gb
            dt = time.perf_counter() - t0
            tokens = tokens_per_sample(tcfg, lat_shape) * gb
            if step % cfg.log_every == 0 or step == cfg.steps:
                peak = float(all_max([_peak_memory(ctx.device)], ctx)[0])
                rec = {"loss": loss, "grad_norm": info["grad_norm"], "lr": info["lr"],
                       "step_s": dt, "tokens_per_s": tokens / dt, "samples_per_s": gb / dt,
                       "peak_memory_gib": peak, "samples": samples,
                       "epoch": order.epoch(samples), "grad_norm_blocks": info["grad_norm_blocks"]}
                if runlog is not None:
                    runlog.write(step, "train", **rec)
                bar.set_postfix(loss=f"{loss:.4f}", grad=f"{info['grad_norm']:.3f}", refresh=False)
            bar.update(1)
            if cfg.val_every and (step % cfg.val_every == 0 or step == cfg.steps) and prompts:
                if validator is None:
                    validator = Validator(cfg, parts, prompts, frozen.prompt_text, frozen.negative_text,
                                          lat_shape, ctx)
                vres = validator.run(trainer, step)
                if runlog is not None:
                    runlog.write(step, "val", **vres)
                    bar.write(console_line(step, cfg.steps, {"val": "", **{k: v for k, v in vres.items()
                                                                            if isinstance(v, float)}}))
            stop_now = bool(flags[1] > 0) or bool(flags[2] > 0)
            if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps or stop_now:
                ckpt.save(run_dir, step, trainer.model, trainer.optimizer, trainer.ema,
                          {"samples": samples, "loss": loss, "ema_updates": trainer.ema.updates
                           if trainer.ema else 0, "date": now(), "config": asdict(cfg),
                           "transformer_config": tcfg}, ctx, keep=cfg.keep)
                last_saved = step
            if stop_now:
                signum = int(stop.signum or signal.SIGTERM) if flags[1] > 0 else None   # a peer's: SIGTERM
                status = _stopped(cfg, signum, step, run_dir, say)
                break
    except BaseException as exc:
        status, error = exit_status(exc), one_line(exc)
        raise
    finally:
        if batches is not None:   # the workers end with the run, also when it crashed
            batches.close()
        bar.close()
        stop.restore()
        if runlog is not None:
            runlog.write(step, "event", event="end", status=status, date=now(),
                         seconds=round(time.perf_counter() - t_start, 1), last_checkpoint=last_saved,
                         **({"error": error} if status and error else {}))
            runlog.close()
    if status == 0 and step >= cfg.steps:
        say(f"done: {step} steps, final loss {loss:.4f}; checkpoints in {run_dir / ckpt.CHECKPOINTS}; "
            f"export with `attnqat finetune export {run_dir} --out DIR`")
    return status


# ----------------------------------------------------------------------------------------------
# Command line


def run(args: argparse.Namespace) -> int:
    from attnqat.wan import ModelLoadError

    from . import distributed

    prog = "attnqat finetune train"
    try:
        ctx = mesh.setup(distributed.init(args.device or "auto"), args.sp, args.replicate)
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    try:
        try:
            cfg = resolve_config(args, ctx.world)
            cfg.sp, cfg.replicate = ctx.sp, ctx.replicate   # this run's mesh (finetune/mesh.py)
            return train(cfg, ctx)
        except (ValueError, DataError, ModelLoadError, FileNotFoundError) as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return exit_status(exc)
        except KeyboardInterrupt as exc:
            print(f"{prog}: interrupted (second Ctrl-C); the last complete checkpoint is kept",
                  file=sys.stderr)
            return exit_status(exc)
        except ckpt.CheckpointError as exc:   # an unwritable --out, a full disk
            print(f"{prog}: {exc}", file=sys.stderr)
            return exit_status(exc)
        except BrokenPipeError as exc:
            # the output was closed (e.g. `| head`): stop, and keep Python's exit from failing on
            # the same pipe again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            print(f"{prog}: the output was closed; the run stops (the last complete checkpoint "
                  "is kept)", file=sys.stderr)
            return exit_status(exc)
    finally:
        distributed.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attnqat.finetune.train",
        description="Fine-tune a Wan 2.1 transformer with Attn-QAT (or drop-in FP4, or BF16) "
                    "attention; run under torchrun for several GPUs.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
