"""Generate one Wan 2.1 clip per attention method, side by side: the Python API of ``attnqat generate``.

Methods (generation slots; the registry :mod:`attnqat.methods` defines them — a method registered with
``generation="base"`` or ``"finetuned"`` is a slot too):

=========== ======================== ===============================================
slot        transformer              attention at inference
=========== ======================== ===============================================
``bf16``    base                     ``bf16`` (the reference)
``nvfp4``   base                     ``nvfp4`` (4-bit attention dropped in)
``sage3``   base                     ``sage3`` (SageAttention3's recipe)
``attnqat`` Attn-QAT fine-tuned      ``nvfp4`` (the QAT model deploys plain NVFP4 attention)
=========== ======================== ===============================================

By default only self-attention is 4-bit and cross-attention stays unquantized (``fp4_scope="self"``,
the published recipe); ``fp4_scope="all"`` makes cross-attention 4-bit too.

The model computes in the dtype the device runs natively (:func:`attnqat.wan.resolve_dtype`: BF16 on
CUDA and on CPUs with BF16 instructions, FP32 on other CPUs, where BF16 is emulated and several times
slower); the record says which ran. Whatever the dtype, ``bf16`` is the method name of attention
without quantization, the reference the 4-bit methods are compared with.

Every slot starts from the same initial noise (drawn once from ``seed`` on the CPU) and the same prompt
embeddings (the text encoder runs once). The denoising loop is diffusers' ``WanPipeline.__call__``
(classifier-free guidance with two transformer calls per step, the UniPC flow scheduler), run here so
each phase can be timed and each slot can use its own transformer.

Inputs are validated once, before any model is loaded (:func:`resolve_settings`, which raises
:class:`InvalidInput` naming each bad field); :class:`StepEvent` callbacks report progress; the
result is a typed :class:`~attnqat.record.GenerationRecord`. Files are written to a temporary folder
beside ``out`` and moved into ``out`` only when everything succeeded. The output
format (``<method>.mp4``, ``side_by_side.mp4``, ``record.json``) is described in
``docs/development.md`` and ``docs/generate.md``.
"""

from __future__ import annotations

import copy
import math
import os
import platform
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from . import error_map as em
from . import methods as registry
from . import video as vid
from .attention import BACKENDS
from .family import WAN21_T2V, ModelFamily
from .record import (COMPARISON_NOTE, WEIGHTS_REFERENCE, GenerationRecord, MethodRecord, Precision,
                     QATRecord, Timings)
from .request import GenerationRequest
from .wan import (DEFAULT_MODEL, FP4_SCOPES, ModelInfo, ModelLoadError, WanModels, default_shift,
                  dtype_name, latent_shape, load_models, model_info, resolve_device, resolve_dtype,
                  set_method)

#: the built-in generation slots (the live list, methods registered later included, is
#: :func:`attnqat.methods.generation`)
GENERATION_METHODS = registry.generation()
#: attention method each built-in slot runs at inference (live: :func:`attnqat.methods.slot_attention`)
SLOT_ATTENTION = {m: registry.slot_attention(m) for m in GENERATION_METHODS}
#: Wan 2.1 pads the prompt embeddings to 512 tokens; a model folder's sidecar may set its own
#: ``max_sequence_length`` default (the embedded tiny model: 32, see docs/tiny_model.md)
MAX_SEQUENCE_LENGTH = 512


#: How each built-in method is named on the page and in summaries (``attnqat``: see
#: :func:`method_label`, it depends on the weights; live: :func:`attnqat.methods.label`).
METHOD_LABELS = {m: registry.label(m) for m in GENERATION_METHODS}
#: Largest seed (seeds are in [0, 2**63); −1 draws one).
MAX_SEED = 2 ** 63 - 1
#: Random seeds are drawn below this, so that they stay short enough to type back.
RANDOM_SEED_BOUND = 2 ** 32


class GenerationError(ValueError):
    """A generation that cannot run as asked. ``field`` names the input it is about (a parameter
    of :func:`generate`, e.g. ``"frames"``; the CLI shows it as ``--frames``), None when it is
    about no single input."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field
        self.message = message


class InvalidInput(GenerationError):
    """One or more invalid inputs: ``errors`` maps each field to what is wrong with it (in the
    order of :func:`generate`'s parameters). Raised before anything is loaded or written."""

    def __init__(self, errors: dict[str, str]):
        self.errors = dict(errors)
        first = next(iter(self.errors))
        super().__init__("; ".join(f"{k}: {v}" for k, v in self.errors.items()), first)


@dataclass(frozen=True)
class Limits:
    """Upper bounds on the inputs (None: no bound). The CLI sets none; the app sets its own."""

    max_side: int | None = None
    max_frames: int | None = None
    max_steps: int | None = None
    max_prompt_chars: int | None = None
    max_guidance: float | None = None
    max_shift: float | None = None


@dataclass
class GenerationSettings:
    """Validated, complete settings of one generation (every default filled in).

    ``seed`` −1 means a seed is drawn when the generation runs (the record holds the one used).
    """

    prompt: str
    negative_prompt: str
    methods: tuple[str, ...]
    seed: int
    steps: int
    guidance: float
    shift: float
    height: int
    width: int
    frames: int
    fps: float
    model: str
    qat_transformer: str | None
    device: str
    dtype: str = "float32"
    dtype_reason: str = ""
    fp4_scope: str = "self"
    backend: str = "auto"
    offload: bool = False
    out: str | None = None
    overwrite: bool = False
    max_sequence_length: int = MAX_SEQUENCE_LENGTH

    def record(self) -> dict[str, Any]:
        """The settings as written to ``record.json`` (prompt, negative prompt and seed sit at its top
        level, the dtype's reason in its ``precision``)."""
        d = asdict(self)
        for k in ("prompt", "negative_prompt", "seed", "out", "overwrite", "dtype_reason"):
            d.pop(k)
        d["methods"] = list(self.methods)
        return d

    @property
    def transformer_calls_per_method(self) -> int:
        """Transformer forwards of one method: one per step, two with classifier-free guidance."""
        return self.steps * (2 if self.guidance > 1.0 else 1)


@dataclass
class GenerationResult:
    """What :func:`generate` returns.

    Attributes:
        record: the :class:`~attnqat.record.GenerationRecord` (``record.to_dict()`` is
            ``record.json``).
        videos: method → (frames, height, width, 3) uint8 RGB.
        out: the folder written, or None when ``out`` was None.
        initial_latents: the noise every method started from (CPU, float32).
        reference_videos: the reference clips that are not methods (:data:`WEIGHTS_REFERENCE`:
            the Attn-QAT weights with BF16 attention), frames as ``videos``; kept in memory for
            the comparisons, not written (the record holds their measurements).
        error_map: method → its attention-error map (``run_methods(error_map=True)``; written as
            ``error_map.json`` and ``error_map.png``), None when not collected.
    """

    record: GenerationRecord
    videos: dict[str, np.ndarray]
    out: Path | None = None
    initial_latents: torch.Tensor | None = field(default=None, repr=False)
    reference_videos: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    error_map: dict[str, dict[str, Any]] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class StepEvent:
    """What :func:`generate` passes to its ``on_step`` callback, as diffusers passes its
    ``callback_on_step_end``: where the generation stands.

    ``phase`` is ``"text"`` (before the prompt is encoded; ``method`` None), then for each method
    ``"denoising"`` (``step`` = steps done: 0 when the method starts, then after each step),
    ``"decoding"`` (the VAE runs) and ``"done"`` (the method's clip is ready; ``timings`` holds its
    measurements). ``elapsed_s`` counts from the start of the generation. Raising in the callback
    stops the generation: the exception propagates and nothing is written.
    """

    phase: str
    method: str | None
    step: int
    steps: int
    methods: tuple[str, ...]
    elapsed_s: float
    timings: Timings | None = None

    @property
    def index(self) -> int:
        """Position of :attr:`method` in :attr:`methods` (−1 before the first method)."""
        return self.methods.index(self.method) if self.method in self.methods else -1


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------

def parse_methods(methods: str | Sequence[str]) -> tuple[str, ...]:
    """``"bf16,nvfp4"`` or a sequence → a tuple of distinct generation methods, in order.

    Raises:
        GenerationError: with ``field="methods"``.
    """
    offered = registry.generation()
    if isinstance(methods, str):
        items = [m.strip() for m in methods.split(",")]
    elif isinstance(methods, (list, tuple)):
        items = [str(m).strip() for m in methods]
    else:
        raise GenerationError(f"expected some of {', '.join(offered)}, got {methods!r}", "methods")
    items = [m for m in items if m]
    if not items:
        raise GenerationError(f"select at least one method (some of {', '.join(offered)})", "methods")
    unknown = [m for m in items if m not in offered]
    if unknown:
        raise GenerationError(f"unknown method(s) {', '.join(map(repr, unknown))}; expected some of "
                              f"{', '.join(offered)}", "methods")
    dup = sorted({m for m in items if items.count(m) > 1})
    if dup:
        raise GenerationError(f"method(s) listed more than once: {', '.join(dup)}", "methods")
    return tuple(items)


def _whole(value: Any) -> int | None:
    """An integer given as int, as an integral float exactly representable (below 2**53), or as
    text ("42", " −1 "); None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        v = float(value)
        return int(v) if math.isfinite(v) and v.is_integer() and abs(v) < 2 ** 53 else None
    if isinstance(value, str):
        text = value.strip().replace("\u2212", "-")
        try:
            return int(text)
        except ValueError:
            return None
    return None


def _real(value: Any) -> float | None:
    """A finite number given as a number or as text; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float, np.integer, np.floating)):
        v = float(value)
    elif isinstance(value, str):
        try:
            v = float(value.strip().replace("\u2212", "-"))
        except ValueError:
            return None
    else:
        return None
    return v if math.isfinite(v) else None


def _bound(limit: float | None) -> str:
    return "" if limit is None else f" and at most {limit:g}"


class _Checker:
    """Collects one message per invalid field."""

    def __init__(self):
        self.errors: dict[str, str] = {}

    def fail(self, name: str, message: str) -> None:
        self.errors.setdefault(name, message)

    def whole(self, name: str, value: Any, lo: int, hi: int | None, what: str) -> int | None:
        v = _whole(value)
        if v is None or v < lo or (hi is not None and v > hi):
            self.fail(name, f"{what}; got {value!r}")
            return None
        return v

    def real(self, name: str, value: Any, ok, what: str) -> float | None:
        v = _real(value)
        if v is None or not ok(v):
            self.fail(name, f"{what}; got {value!r}")
            return None
        return v


def _check_out(out: str | Path | None, overwrite: bool) -> str | None:
    if out is None:
        return None
    p = Path(out).expanduser()
    if p.exists() and not p.is_dir():
        raise GenerationError(f"{out} exists and is not a folder", "out")
    if p.is_dir() and any(p.iterdir()) and not overwrite:
        raise GenerationError(f"{out} exists and is not empty; choose a new folder or pass "
                              "--overwrite to replace the files generate writes there", "out")
    p = p.resolve()
    parent = next((q for q in (p, *p.parents) if q.exists()), None)
    if parent is None or not os.access(parent, os.W_OK | os.X_OK):
        raise GenerationError(f"cannot write to {out}: {parent} is not writable", "out")
    return str(p)


def _check_backend(backend: str, methods: Sequence[str], fp4_scope: str, device: torch.device,
                   dtype: torch.dtype) -> str | None:
    """Why ``backend`` cannot run these settings, or None. ``triton`` runs the 4-bit attention on
    the Triton kernels only (no fallback to the reference); those need CUDA and BF16. Plain
    attention — the ``bf16`` method, and cross-attention under ``fp4_scope="self"`` — has no Triton
    kernel and runs PyTorch SDPA whatever the backend (:class:`attnqat.wan.AttnQATProcessor`)."""
    if backend != "triton" or not any(registry.get(registry.slot_attention(m)).kernel for m in methods):
        return None
    if device.type != "cuda":
        return (f"the Triton kernels need a CUDA GPU and this run is on {device}; use "
                "--backend auto (the PyTorch reference on the CPU) or torch")
    if dtype != torch.bfloat16:
        return f"the Triton kernels take bfloat16 and this run computes in {dtype_name(dtype)}"
    return None


def _check_text(c: _Checker, prompt: Any, negative_prompt: Any, lim: Limits) -> None:
    if not isinstance(prompt, str) or not prompt.strip():
        c.fail("prompt", "enter a prompt (the text is empty)")
    elif lim.max_prompt_chars is not None and len(prompt) > lim.max_prompt_chars:
        c.fail("prompt", f"at most {lim.max_prompt_chars} characters, got {len(prompt)}")
    if negative_prompt is not None and not isinstance(negative_prompt, str):
        c.fail("negative_prompt", f"must be text, got {type(negative_prompt).__name__}")
    elif (negative_prompt is not None and lim.max_prompt_chars is not None
          and len(negative_prompt) > lim.max_prompt_chars):
        c.fail("negative_prompt", f"at most {lim.max_prompt_chars} characters, got {len(negative_prompt)}")


def _check_clip(c: _Checker, family: ModelFamily, height: Any, width: Any, frames: Any, lim: Limits) -> dict:
    """Height, width and frames against the model family's rule (:meth:`ModelFamily.clip_errors`);
    returns the whole numbers given."""
    got = {}
    for name, v in (("height", height), ("width", width)):
        if v is not None:
            got[name] = c.whole(name, v, family.size_multiple, lim.max_side, family.size_rule(lim.max_side))
    if frames is not None:
        got["frames"] = c.whole("frames", frames, 1, lim.max_frames, family.frames_rule(lim.max_frames))
    ints = {k: v for k, v in got.items() if v is not None}
    for name, message in family.clip_errors(**ints, max_side=lim.max_side, max_frames=lim.max_frames).items():
        c.fail(name, message)
    return got


def _check_sampling(c: _Checker, steps: Any, guidance: Any, shift: Any, fps: Any, lim: Limits) -> None:
    if steps is not None:
        c.whole("steps", steps, 1, lim.max_steps,
                f"a whole number of steps from 1{'' if lim.max_steps is None else f' to {lim.max_steps}'}")
    if guidance is not None:
        c.real("guidance", guidance,
               lambda v: 0 <= v and (lim.max_guidance is None or v <= lim.max_guidance),
               f"a number ≥ 0{_bound(lim.max_guidance)} (≤ 1 turns classifier-free guidance off)")
    if shift is not None:
        c.real("shift", shift, lambda v: 0 < v and (lim.max_shift is None or v <= lim.max_shift),
               f"a number above 0{_bound(lim.max_shift)}")
    if fps is not None:
        c.real("fps", fps, lambda v: v > 0, "a frame rate above 0")


def _check_runtime(c: _Checker, chosen: tuple[str, ...], fp4_scope: str, backend: str, device: str,
                   dtype: str, models: WanModels | None) -> tuple[torch.device | None, torch.dtype | None, str]:
    """fp4_scope, backend, device and dtype; returns (device, dtype, why that dtype)."""
    if fp4_scope not in FP4_SCOPES:
        c.fail("fp4_scope", f"one of {', '.join(FP4_SCOPES)}, got {fp4_scope!r}")
    if backend not in BACKENDS:
        c.fail("backend", f"one of {', '.join(BACKENDS)}, got {backend!r}")
    dev: torch.device | None = None
    dt: torch.dtype | None = None
    why = ""
    if models is not None:
        dev, dt, why = models.device, models.dtype, models.dtype_reason
        if dtype not in ("auto", None) and resolve_dtype(dtype, dev)[0] != dt:
            c.fail("dtype", f"the loaded models compute in {dtype_name(dt)}; load them with "
                            f"dtype={dtype!r} (attnqat.wan.load_models)")
    else:
        try:
            dev = resolve_device(device)
        except ValueError as exc:
            c.fail("device", str(exc))
        try:
            dt, why = resolve_dtype(dtype, dev or "cpu")
        except ValueError as exc:
            c.fail("dtype", str(exc))
    if dev is not None and dt is not None and chosen and "backend" not in c.errors \
            and "fp4_scope" not in c.errors:
        problem = _check_backend(backend, chosen, fp4_scope, dev, dt)
        if problem:
            c.fail("backend", problem)
    return dev, dt, why


def _check_qat(c: _Checker, chosen: tuple[str, ...], info: ModelInfo, qat_transformer: Any,
               models: WanModels | None) -> str | None:
    """The fine-tuned transformer the chosen slots need (``attnqat``), or None."""
    slot = next((m for m in chosen if registry.uses_finetuned(m)), None)
    if slot is None:
        return None
    if models is not None:
        if models.qat_info is None:
            c.fail("methods", "Attn-QAT needs Attn-QAT weights and none are loaded: load them "
                              "with --qat-transformer PATH (a diffusers transformer folder or a "
                              ".safetensors file)")
            return None
        return models.qat_info["checkpoint"]
    if qat_transformer is not None:
        qp = Path(qat_transformer).expanduser()
        if not qp.exists():
            c.fail("qat_transformer", f"{qat_transformer} does not exist (expected a diffusers "
                                      "transformer folder or a .safetensors file)")
            return None
        return str(qp.resolve())
    if info.qat_transformer is not None:
        if not info.qat_transformer.exists():
            c.fail("qat_transformer", f"the model names an Attn-QAT transformer at "
                                      f"{info.qat_transformer}, which does not exist; pass "
                                      "--qat-transformer")
            return None
        return str(info.qat_transformer)
    c.fail("methods", f"method {slot!r} needs Attn-QAT weights: pass --qat-transformer PATH "
                      "(a diffusers transformer folder or a .safetensors file in the "
                      f"diffusers, FastVideo or original Wan naming), or drop {slot} from "
                      "the methods")
    return None


def resolve_settings(request: GenerationRequest | Any, *, models: WanModels | None = None,
                     limits: Limits | None = None, **values: Any) -> tuple[GenerationSettings, ModelInfo]:
    """Check a :class:`~attnqat.request.GenerationRequest` and fill defaults from the model, without
    loading any weights.

    The one validation of a generation: the CLI, the Python API and the app all go through it.
    ``request`` may also be a prompt with the other fields as keywords (the older form).
    Numbers may come as numbers or as text (``"42"``); integers must be whole (2.5 steps is an
    error, not 2). None takes the model's default (:func:`attnqat.wan.model_info`): the embedded tiny
    model gives 128×128, 33 frames, 16 fps, 20 steps, guidance 5, shift 3 and no negative prompt; a
    real Wan 2.1 model 480×832, 81 frames, 16 fps, 50 steps, guidance 5, shift 3 below 720p and 5 at
    720p, and Wan's own negative prompt. ``methods`` None takes every generation method of the
    registry (:func:`attnqat.methods.generation`). ``seed`` −1 draws a seed when the generation runs.
    Clip sizes follow the model family's rule (:meth:`attnqat.family.ModelFamily.clip_errors`).

    ``models``, when given, are the already loaded models the generation will run on: their
    device, dtype and Attn-QAT transformer are used and nothing is looked up again.

    Raises:
        InvalidInput: every invalid input at once, each with its field (in the request's field
            order) and what is expected.
        GenerationError: a request that cannot run as asked (its ``field`` says which input).
    """
    r = GenerationRequest.of(request, **values)
    lim = limits or Limits()
    c = _Checker()
    info: ModelInfo | None = models.info if models is not None else None
    if info is None:
        try:
            info = model_info(r.model if r.model is not None else DEFAULT_MODEL)
        except ModelLoadError as exc:
            c.fail("model", str(exc))
    _check_text(c, r.prompt, r.negative_prompt, lim)
    chosen: tuple[str, ...] = ()
    try:
        chosen = parse_methods(registry.generation() if r.methods is None else r.methods)
    except GenerationError as exc:
        c.fail("methods", exc.message)
    seed_i = _whole(r.seed)
    if seed_i is None or not (seed_i == -1 or 0 <= seed_i <= MAX_SEED):
        c.fail("seed", f"an integer from 0 to 2^63−1 ({MAX_SEED}), or −1 for a random seed; "
                       f"got {r.seed!r}")
    hw = _check_clip(c, info.family if info is not None else WAN21_T2V, r.height, r.width, r.frames, lim)
    _check_sampling(c, r.steps, r.guidance, r.shift, r.fps, lim)
    dev, dt, why = _check_runtime(c, chosen, r.fp4_scope, r.backend, r.device, r.dtype, models)
    qat = _check_qat(c, chosen, info, r.qat_transformer, models) if info is not None else None
    out_s = None
    try:
        out_s = _check_out(r.out, r.overwrite)
    except GenerationError as exc:
        c.fail("out", exc.message)
    if c.errors:
        order = list(GenerationRequest.field_names())
        raise InvalidInput(dict(sorted(c.errors.items(),
                                       key=lambda kv: order.index(kv[0]) if kv[0] in order else 99)))

    d = info.defaults
    h = int(hw.get("height") or d["height"])
    w = int(hw.get("width") or d["width"])
    sh = _real(r.shift) if r.shift is not None else d.get("shift")
    settings = GenerationSettings(
        prompt=r.prompt, negative_prompt=(r.negative_prompt if r.negative_prompt is not None
                                        else d.get("negative_prompt", "")),
        methods=chosen, seed=seed_i,
        steps=_whole(r.steps) if r.steps is not None else int(d["steps"]),
        guidance=_real(r.guidance) if r.guidance is not None else float(d["guidance"]),
        shift=float(sh) if sh is not None else default_shift(h, w, info.family), height=h, width=w,
        frames=_whole(r.frames) if r.frames is not None else int(d["frames"]),
        fps=_real(r.fps) if r.fps is not None else float(d["fps"]), model=info.source,
        qat_transformer=qat, device=str(dev), dtype=dtype_name(dt), dtype_reason=why,
        fp4_scope=r.fp4_scope, backend=r.backend,
        offload=bool(models.offload if models is not None else r.offload), out=out_s,
        overwrite=bool(r.overwrite),
        max_sequence_length=int(d.get("max_sequence_length", MAX_SEQUENCE_LENGTH)))
    return settings, info


def method_label(method: str, qat_info: dict[str, Any] | None = None) -> str:
    """The name a method goes by: ``BF16``, ``NVFP4``, ``SageAttention3``; for ``attnqat`` the
    label of the loaded weights (``Attn-QAT fine-tuned`` or ``Attn-QAT (base weights copy — not
    fine-tuned)``, :func:`attnqat.wan.load_models`)."""
    if method in registry.names() and registry.uses_finetuned(method) and qat_info and qat_info.get("label"):
        return str(qat_info["label"])
    return registry.label(method)


# ----------------------------------------------------------------------------------------------
# The generation
# ----------------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make_scheduler(template, shift: float):
    """A fresh scheduler of the model's class and config with the flow shift set."""
    cfg = dict(template.config)
    if "flow_shift" in cfg:
        cfg["flow_shift"] = shift
    elif "shift" in cfg:
        cfg["shift"] = shift
    return type(template).from_config(cfg)


def _peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_memory_allocated"
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "process_max_rss"


def encode_prompts(models: WanModels, prompt: str, negative_prompt: str, guidance: float,
                   max_sequence_length: int = MAX_SEQUENCE_LENGTH):
    """Prompt (and, with guidance > 1, negative prompt) embeddings in the transformer's dtype.

    Returns (prompt_embeds, negative_prompt_embeds or None).
    """
    pipe = models.pipe
    with torch.no_grad(), models.on_device(pipe.text_encoder):
        pe, ne = pipe.encode_prompt(prompt=prompt, negative_prompt=negative_prompt,
                                    do_classifier_free_guidance=guidance > 1.0,
                                    num_videos_per_prompt=1,
                                    max_sequence_length=max_sequence_length, device=models.device)
    dtype = pipe.transformer.dtype
    return pe.to(dtype), (ne.to(dtype) if ne is not None else None)


def initial_latents(models: WanModels, settings: GenerationSettings) -> torch.Tensor:
    """The starting noise, drawn on the CPU from ``settings.seed`` (float32, CPU)."""
    shape = latent_shape(models.pipe, settings.height, settings.width, settings.frames)
    gen = torch.Generator("cpu").manual_seed(settings.seed)
    return torch.randn(shape, generator=gen, dtype=torch.float32)


def denoise(transformer, scheduler_template, latents: torch.Tensor, prompt_embeds: torch.Tensor,
            negative_embeds: torch.Tensor | None, *, steps: int, guidance: float, shift: float,
            device: torch.device, on_step: Callable[[int], None] | None = None) -> torch.Tensor:
    """diffusers' Wan denoising loop: returns the final latents (float32).

    Same arithmetic as ``WanPipeline.__call__``: latents kept in float32, cast to the transformer's
    dtype for each call; guidance combines a conditional and an unconditional call.
    """
    sched = _make_scheduler(scheduler_template, shift)
    sched.set_timesteps(steps, device=device)
    sched.set_begin_index(0)
    x = latents.to(device=device, dtype=torch.float32)
    dtype = transformer.dtype
    use_cfg = guidance > 1.0 and negative_embeds is not None
    with torch.no_grad():
        for i, t in enumerate(sched.timesteps):
            inp = x.to(dtype)
            ts = t.expand(x.shape[0])
            noise = transformer(hidden_states=inp, timestep=ts, encoder_hidden_states=prompt_embeds,
                                return_dict=False)[0]
            if use_cfg:
                uncond = transformer(hidden_states=inp, timestep=ts,
                                     encoder_hidden_states=negative_embeds, return_dict=False)[0]
                noise = uncond + guidance * (noise - uncond)
            x = sched.step(noise, t, x, return_dict=False)[0]
            if on_step is not None:
                on_step(i)
    return x


def decode(models: WanModels, latents: torch.Tensor) -> np.ndarray:
    """Latents → (T, H, W, 3) uint8 frames, as ``WanPipeline`` decodes (latents de-normalized
    with the VAE's mean and std, decoded in the VAE's dtype, post-processed to [0, 1])."""
    pipe = models.pipe
    vae = pipe.vae
    with torch.no_grad(), models.on_device(vae):
        dev = next(vae.parameters()).device
        z = latents.to(dev, dtype=vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(dev, z.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(dev, z.dtype)
        z = z / inv_std + mean
        video = vae.decode(z, return_dict=False)[0]
        frames = pipe.video_processor.postprocess_video(video, output_type="np")
    return vid.to_uint8_frames(frames)


def _timed_denoise(models: WanModels, transformer, settings: GenerationSettings, lat0: torch.Tensor, pe,
                   ne, desc: str, progress: bool, on_step: Callable[[int], None]) -> tuple[torch.Tensor, float]:
    """Denoise ``lat0`` with ``transformer`` on its device, a progress bar named ``desc`` and
    ``on_step(i)`` after each step; the latents and the seconds it took (device-synchronized)."""
    from tqdm.auto import tqdm  # noqa: PLC0415  (tqdm.auto probes for notebooks: only when generating)

    dev = models.device
    bar = tqdm(total=settings.steps, desc=desc, unit="step", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)

    def stepped(i: int) -> None:
        bar.update(1)
        on_step(i)

    try:
        with models.on_device(transformer):
            _sync(dev)
            t1 = time.perf_counter()
            latents = denoise(transformer, models.pipe.scheduler, lat0, pe, ne, steps=settings.steps,
                              guidance=settings.guidance, shift=settings.shift, device=dev,
                              on_step=stepped)
            _sync(dev)
            return latents, time.perf_counter() - t1
    finally:
        bar.close()


def _run_slot(models: WanModels, settings: GenerationSettings, slot: str, pe, ne, lat0: torch.Tensor,
              emit: Callable[..., None], *, t_text: float, progress: bool,
              log: Callable[[str], None] | None,
              error_map: bool = False) -> tuple[np.ndarray, MethodRecord, dict[str, Any] | None]:
    """Denoise and decode one generation slot; its frames, its record (without comparisons) and,
    with ``error_map`` for a method other than the reference, its attention-error map."""

    dev = models.device
    transformer = models.transformer_for(slot)
    attn_method = registry.slot_attention(slot)
    proc = set_method(transformer, attn_method, fp4_scope=settings.fp4_scope,
                      backend=settings.backend)
    proc.reset_stats()
    observer, previous_observer = None, proc.observer
    if error_map and attn_method != registry.REFERENCE:
        observer = error_map_observer(transformer, settings)
        proc.observer = observer
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    def stepped(i: int) -> None:
        if observer is not None:
            observer.next_step()
        emit("denoising", slot, i + 1)

    try:
        emit("denoising", slot, 0)
        latents, t_denoise = _timed_denoise(models, transformer, settings, lat0, pe, ne, f"{slot:>7}",
                                            progress, stepped)
    finally:
        proc.observer = previous_observer
    emap = None
    if observer is not None:
        emap = {"attention_method": attn_method, "layers": observer.layers,
                "steps": observer.steps, "rel_error": observer.result()}
    stats = proc.stats()
    emit("decoding", slot, settings.steps)
    t2 = time.perf_counter()
    frames = decode(models, latents)
    _sync(dev)
    t_decode = time.perf_counter() - t2
    peak, peak_kind = _peak_memory(dev)
    attn_s = stats["attention_s"]
    timings = Timings(text_encoding_s=t_text, denoising_s=t_denoise, decoding_s=t_decode,
                      attention_s=attn_s,
                      attention_share_of_denoising=(attn_s / t_denoise) if attn_s is not None
                      and t_denoise > 0 else None,
                      total_s=t_denoise + t_decode)
    record = MethodRecord(
        label=method_label(slot, models.qat_info),
        transformer="attnqat" if registry.uses_finetuned(slot) else "base", attention_method=attn_method,
        timings=timings, attention_calls=stats["calls"],
        transformer_calls=settings.transformer_calls_per_method, peak_memory_bytes=peak,
        peak_memory_kind=peak_kind, dispatch=stats["dispatch"],
        fallbacks=dispatch_fallbacks(stats["dispatch"]))
    emit("done", slot, settings.steps, timings)
    if log is not None:
        log(f"{slot}: denoising {t_denoise:.2f} s (attention {attn_s:.2f} s), decoding {t_decode:.2f} s")
    return frames, record, emap


def run_methods(models: WanModels, settings: GenerationSettings, *, progress: bool = True,
                log: Callable[[str], None] | None = None,
                on_step: Callable[[StepEvent], None] | None = None,
                error_map: bool = False) -> GenerationResult:
    """Run every method of ``settings`` (from :func:`resolve_settings` with these ``models``) on
    loaded ``models``; nothing is written to disk and nothing is validated again.

    ``on_step`` is called with a :class:`StepEvent` as the generation goes (after each denoising
    step, around decoding); raising in it stops the generation.

    ``error_map``: also collect each 4-bit method's attention-error map (:mod:`attnqat.error_map`;
    ``result.error_map``, its summary in the record).

    Returns a :class:`GenerationResult` whose ``record`` is complete except for file names.
    """
    finetuned = [m for m in settings.methods if registry.uses_finetuned(m)]
    if finetuned and models.qat_transformer is None:
        raise GenerationError(f"method {finetuned[0]!r} needs Attn-QAT weights, but none were loaded "
                              "(pass --qat-transformer)", "methods")
    seed = settings.seed if settings.seed >= 0 else secrets.randbelow(RANDOM_SEED_BOUND)
    settings = replace(settings, seed=seed)
    dev = models.device
    started = time.perf_counter()

    def emit(phase: str, method: str | None, step: int, timings: Timings | None = None) -> None:
        if on_step is not None:
            on_step(StepEvent(phase=phase, method=method, step=step, steps=settings.steps,
                              methods=settings.methods, elapsed_s=time.perf_counter() - started,
                              timings=timings))

    emit("text", None, 0)
    _sync(dev)
    t0 = time.perf_counter()
    pe, ne = encode_prompts(models, settings.prompt, settings.negative_prompt, settings.guidance,
                            settings.max_sequence_length)
    _sync(dev)
    t_text = time.perf_counter() - t0
    lat0 = initial_latents(models, settings)

    videos: dict[str, np.ndarray] = {}
    per_method: dict[str, MethodRecord] = {}
    maps: dict[str, dict[str, Any]] = {}
    for slot in settings.methods:
        videos[slot], per_method[slot], emap = _run_slot(
            models, settings, slot, pe, ne, lat0, emit, t_text=t_text, progress=progress, log=log,
            error_map=error_map)
        if emap is not None:
            maps[slot] = emap

    references: dict[str, MethodRecord] = {}
    ref_videos: dict[str, np.ndarray] = {}
    ran_finetuned = [slot for slot in videos if registry.uses_finetuned(slot)]
    if ran_finetuned:
        base_ref = videos.get(registry.REFERENCE)
        if models.qat_info and models.qat_info.get("identical_to_base") and base_ref is not None:
            ref_videos[WEIGHTS_REFERENCE] = base_ref  # the same weights: the same clip
            references[WEIGHTS_REFERENCE] = MethodRecord(
                label=f"{per_method[ran_finetuned[0]].label} weights, "
                      f"{registry.label(registry.REFERENCE)} attention (= the "
                      f"{registry.label(registry.REFERENCE)} clip: the weights equal the base model's)",
                transformer="attnqat", attention_method=registry.REFERENCE)
        else:
            ref_videos[WEIGHTS_REFERENCE], references[WEIGHTS_REFERENCE] = weights_reference_clip(
                models, settings, lat0, pe, ne, emit=emit, progress=progress, slot=ran_finetuned[0])
    drift = four_bit_errors(videos, per_method, ref_videos)

    with_qat = bool(finetuned) and models.qat_info is not None
    record = GenerationRecord(
        prompt=settings.prompt, negative_prompt=settings.negative_prompt, seed=settings.seed,
        settings=settings.record(),
        precision=Precision(dtype=settings.dtype, reason=settings.dtype_reason),
        versions=versions(), created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        text_encoding_s=t_text, model_kind=models.info.kind,
        model_weights_note=models.info.weights_note,
        qat=QATRecord.from_dict(models.qat_info) if with_qat else None,
        qat_weights_note=models.qat_info.get("note") if with_qat else None,
        methods=per_method, references=references, weights_drift=drift,
        comparison_note=COMPARISON_NOTE,
        error_map={"summary": em.summarize(maps),
                   "note": "collected during this generation: the 4-bit methods' denoising times "
                           "include the BF16 reference attention it runs"} if maps else None)
    return GenerationResult(record=record, videos=videos, initial_latents=lat0,
                            reference_videos=ref_videos, error_map=maps or None)


def error_map_observer(transformer, settings: GenerationSettings) -> "em.ErrorMapObserver":
    """The observer that collects a method's attention-error map (:mod:`attnqat.error_map`):
    one row per transformer block, one column per step, self-attention (and cross-attention when
    it is 4-bit too)."""
    kinds = ("self", "cross") if settings.fp4_scope == "all" else ("self",)
    return em.ErrorMapObserver(len(transformer.blocks), settings.steps, kinds)


def _compare(frames: np.ndarray, ref: np.ndarray) -> tuple[float | None, float, bool]:
    """(PSNR or None when identical, SSIM, identical) of ``frames`` against ``ref``."""
    p = vid.psnr(frames, ref)
    return (None if math.isinf(p) else p), vid.ssim(frames, ref), math.isinf(p)


def four_bit_errors(videos: dict[str, np.ndarray], per_method: dict[str, MethodRecord],
                    ref_videos: dict[str, np.ndarray]) -> dict[str, Any] | None:
    """Fill each 4-bit method's 4-bit error — PSNR/SSIM against BF16 attention with the same
    weights: slots on the base weights (``nvfp4``/``sage3``) against the reference method's clip
    (``bf16``), slots on fine-tuned weights (``attnqat``, :func:`attnqat.methods.uses_finetuned`)
    against those weights' own BF16 clip (``ref_videos[WEIGHTS_REFERENCE]``) — and, for the latter,
    their difference from the base BF16 clip. Returns the fine-tuning drift (the fine-tuned
    weights' BF16 clip against the base BF16 clip), or None when either clip is missing."""
    base = videos.get(registry.REFERENCE)
    for slot, frames in videos.items():
        if slot == registry.REFERENCE:
            continue
        finetuned = registry.uses_finetuned(slot)
        ref_name = WEIGHTS_REFERENCE if finetuned else registry.REFERENCE
        ref = ref_videos.get(ref_name) if finetuned else base
        if ref is not None:
            rec = per_method[slot]
            rec.psnr, rec.ssim, rec.identical_to_bf16 = _compare(frames, ref)
            rec.reference = ref_name
        if finetuned and base is not None:
            p, q, _ = _compare(frames, base)
            per_method[slot].psnr_vs_base_bf16, per_method[slot].ssim_vs_base_bf16 = p, q
    if WEIGHTS_REFERENCE in ref_videos and base is not None:
        p, q, same = _compare(ref_videos[WEIGHTS_REFERENCE], base)
        return {"psnr": p, "ssim": q, "identical": same,
                "compares": "Attn-QAT weights with BF16 attention vs the base weights with BF16 "
                            "attention (fine-tuning drift, no 4-bit error in it)"}
    return None


def weights_reference_clip(models: WanModels, settings: GenerationSettings, lat0: torch.Tensor,
                           pe: torch.Tensor, ne: torch.Tensor | None, *,
                           emit: Callable[..., None] | None = None,
                           progress: bool = False,
                           slot: str | None = None) -> tuple[np.ndarray, MethodRecord]:
    """The Attn-QAT weights with BF16 attention, from the same noise and embeddings: the reference
    of Attn-QAT's 4-bit error (:data:`~attnqat.record.WEIGHTS_REFERENCE`). Reports its steps to
    ``emit(phase, WEIGHTS_REFERENCE, step)`` as a method would. ``slot``: the generation slot on
    the fine-tuned weights whose reference this is (its label names the weights; None: the first
    such slot of the registry)."""

    if slot is None:
        slot = next(m for m in registry.generation() if registry.uses_finetuned(m))

    dev = models.device
    transformer = models.qat_transformer
    proc = set_method(transformer, registry.REFERENCE, fp4_scope=settings.fp4_scope,
                      backend=settings.backend)
    proc.reset_stats()
    def stepped(i: int) -> None:
        if emit is not None:
            emit("denoising", WEIGHTS_REFERENCE, i + 1)

    if emit is not None:
        emit("denoising", WEIGHTS_REFERENCE, 0)
    latents, t_denoise = _timed_denoise(models, transformer, settings, lat0, pe, ne, "ref bf16", progress,
                                        stepped)
    stats = proc.stats()
    if emit is not None:
        emit("decoding", WEIGHTS_REFERENCE, settings.steps)
    t2 = time.perf_counter()
    frames = decode(models, latents)
    _sync(dev)
    t_decode = time.perf_counter() - t2
    timings = Timings(denoising_s=t_denoise, decoding_s=t_decode, attention_s=stats["attention_s"],
                      total_s=t_denoise + t_decode)
    if emit is not None:
        emit("done", WEIGHTS_REFERENCE, settings.steps, timings)
    rec = MethodRecord(label=f"{method_label(slot, models.qat_info)} weights, "
                             f"{registry.label(registry.REFERENCE)} attention",
                       transformer="attnqat", attention_method=registry.REFERENCE, timings=timings,
                       attention_calls=stats["calls"],
                       transformer_calls=settings.transformer_calls_per_method,
                       dispatch=stats["dispatch"], fallbacks=dispatch_fallbacks(stats["dispatch"]))
    return frames, rec


def dispatch_fallbacks(dispatch: Sequence[dict[str, Any]]) -> list[str]:
    """One line per distinct fallback in a processor's dispatch log (empty: nothing fell back)."""
    return [f"{d['kind']}-attention {d['method']} ran the {d['implementation']} instead of the "
            f"kernels ({d['calls']} calls): {d['fallback']}"
            for d in dispatch if d.get("fallback")]


def versions() -> dict[str, Any]:
    """Versions of everything that shapes the output."""
    import diffusers
    import transformers

    from . import __version__

    v = {"attnqat": __version__, "python": platform.python_version(), "torch": torch.__version__,
         "diffusers": diffusers.__version__, "transformers": transformers.__version__,
         "numpy": np.__version__, "cuda": torch.version.cuda, "platform": platform.platform()}
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name()
    return v


def _chmod_like_mkdir(path: Path) -> None:
    """Give a ``mkdtemp`` folder (0700) the permissions a plain ``mkdir`` would."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)


def write_outputs(result: GenerationResult, settings: GenerationSettings, out: str | Path, *,
                  overwrite: bool = False) -> Path:
    """Write ``<method>.mp4``, ``side_by_side.mp4`` and ``record.json`` into ``out``.

    Everything is written to a temporary folder beside ``out`` first and moved in at the end; on
    failure nothing is left behind.
    """
    out = Path(out).expanduser().resolve()
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise GenerationError(f"{out} exists and is not empty (pass --overwrite)", "out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    record = copy.deepcopy(result.record)
    try:
        _chmod_like_mkdir(tmp)
        for slot, frames in result.videos.items():
            vid.write_mp4(frames, tmp / f"{slot}.mp4", settings.fps)
            record.methods[slot].video = f"{slot}.mp4"
        vid.side_by_side({(record.methods[slot].label or slot): tmp / f"{slot}.mp4"
                          for slot in result.videos}, tmp / "side_by_side.mp4", fps=settings.fps)
        record.side_by_side = "side_by_side.mp4"
        if result.error_map:
            files = em.write_error_map(result.error_map, tmp, labels={
                m: record.methods[m].label or m for m in result.error_map})
            record.error_map = {**(record.error_map or {}), **files}
        record.save(tmp / "record.json")
        if not out.exists():
            os.replace(tmp, out)
        else:
            # Replace the files of an earlier generation, including clips of methods not run now.
            for slot in registry.generation():
                stale = out / f"{slot}.mp4"
                if slot not in result.videos and stale.is_file():
                    stale.unlink()
            for f in tmp.iterdir():
                os.replace(f, out / f.name)
            tmp.rmdir()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.record = record
    result.out = out
    return out


def generate(request: GenerationRequest | str, *, progress: bool = True, models: WanModels | None = None,
             log: Callable[[str], None] | None = None, on_step: Callable[[StepEvent], None] | None = None,
             **values: Any) -> GenerationResult:
    """Generate one clip per method from one request — the Python form of ``attnqat generate``.

    Args:
        request: a :class:`~attnqat.request.GenerationRequest` (prompt, methods, seed, sizes, model,
            device, ``out``, ...: its fields are documented there and in :func:`resolve_settings`),
            or a prompt with the request's other fields as keywords (``generate("a cat",
            methods="bf16,nvfp4", steps=20)``). diffusers calls the sampling fields
            ``num_inference_steps``, ``guidance_scale``, ``flow_shift``, ``height``, ``width``,
            ``num_frames``.
        progress: show a progress bar per method.
        models: already loaded :class:`~attnqat.wan.WanModels` to reuse (skips loading).
        log: called with one-line progress messages.
        on_step: called with a :class:`StepEvent` after each denoising step and around decoding
            (as diffusers' ``callback_on_step_end``); raising in it stops the generation.
            The request's ``error_map`` also collects the attention-error map of each 4-bit
            method (per layer × step relative error against BF16 attention on the same inputs;
            ``out`` gets ``error_map.json`` and ``error_map.png``).

    Returns:
        :class:`GenerationResult`.

    Raises:
        InvalidInput: invalid inputs, each named (before anything is loaded).
    """
    r = GenerationRequest.of(request, **values)
    if models is not None and r.qat_transformer is not None:
        raise GenerationError("qat_transformer cannot be given with already loaded models; load it "
                              "with attnqat.wan.load_models(..., qat_transformer=...)", "qat_transformer")
    settings, _info = resolve_settings(r, models=models)
    if models is None:
        t0 = time.perf_counter()
        models = load_models(settings.model, qat_transformer=settings.qat_transformer,
                             device=settings.device, offload=settings.offload, dtype=settings.dtype)
        if log is not None:
            log(f"loaded {settings.model} in {time.perf_counter() - t0:.1f} s ({settings.dtype}: "
                f"{settings.dtype_reason})")
    result = run_methods(models, settings, progress=progress, log=log, on_step=on_step,
                         error_map=bool(r.error_map))
    if settings.out is not None:
        write_outputs(result, settings, settings.out, overwrite=settings.overwrite)
    return result


__all__ = ["GENERATION_METHODS", "GenerationError", "GenerationRequest", "GenerationResult", "GenerationSettings",
           "InvalidInput", "Limits", "METHOD_LABELS", "MAX_SEED", "SLOT_ATTENTION", "StepEvent",
           "decode", "denoise", "dispatch_fallbacks", "encode_prompts", "error_map_observer", "four_bit_errors", "generate", "initial_latents", "method_label",
           "parse_methods", "resolve_settings", "run_methods", "versions", "weights_reference_clip", "write_outputs"]
