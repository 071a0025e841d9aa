"""Generate one Wan 2.1 clip per attention method, side by side: the Python API of ``attnqat generate``.

Methods (generation slots):

=========== ======================== ===============================================
slot        transformer              attention at inference
=========== ======================== ===============================================
``bf16``    base                     ``bf16`` (the reference)
``nvfp4``   base                     ``nvfp4`` (4-bit attention dropped in)
``sage3``   base                     ``sage3`` (SageAttention3's recipe)
``attnqat`` Attn-QAT fine-tuned      ``nvfp4`` (the QAT model deploys plain NVFP4 attention)
=========== ======================== ===============================================

By default only self-attention is 4-bit and cross-attention stays BF16 (``fp4_scope="self"``, the
published recipe); ``fp4_scope="all"`` makes cross-attention 4-bit too.

Every slot starts from the same initial noise (drawn once from ``seed`` on the CPU) and the same prompt
embeddings (the text encoder runs once). The denoising loop is diffusers' ``WanPipeline.__call__``
(classifier-free guidance with two transformer calls per step, the UniPC flow scheduler), run here so
each phase can be timed and each slot can use its own transformer.

Inputs are validated before any model is loaded (:func:`resolve_settings`); files are written to a
temporary folder beside ``out`` and moved into ``out`` only when everything succeeded. The output
format (``<method>.mp4``, ``side_by_side.mp4``, ``record.json``) is described in
``docs/development.md`` and ``docs/generate.md``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from . import video as vid
from .wan import (DEFAULT_MODEL, FP4_SCOPES, ModelInfo, WanModels, default_shift, latent_shape,
                  load_models, model_info, resolve_device, set_method)

GENERATION_METHODS = ("bf16", "nvfp4", "sage3", "attnqat")
#: attention method each slot runs at inference
SLOT_ATTENTION = {"bf16": "bf16", "nvfp4": "nvfp4", "sage3": "sage3", "attnqat": "nvfp4"}
#: Wan 2.1 pads the prompt embeddings to 512 tokens; a model folder's sidecar may set its own
#: ``max_sequence_length`` default (the embedded tiny model: 32, see docs/tiny_model.md)
MAX_SEQUENCE_LENGTH = 512


class GenerationError(ValueError):
    """Invalid generation input; the message names the option and what was expected."""


@dataclass
class GenerationSettings:
    """Validated, complete settings of one generation (every default filled in)."""

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
    fp4_scope: str = "self"
    backend: str = "auto"
    offload: bool = False
    out: str | None = None
    overwrite: bool = False
    max_sequence_length: int = MAX_SEQUENCE_LENGTH

    def record(self) -> dict[str, Any]:
        """The settings as written to ``record.json`` (prompt, negative prompt and seed sit at its top
        level)."""
        d = asdict(self)
        for k in ("prompt", "negative_prompt", "seed", "out", "overwrite"):
            d.pop(k)
        d["methods"] = list(self.methods)
        return d


@dataclass
class GenerationResult:
    """What :func:`generate` returns.

    Attributes:
        record: the content of ``record.json``.
        videos: method → (frames, height, width, 3) uint8 RGB.
        out: the folder written, or None when ``out`` was None.
        initial_latents: the noise every method started from (CPU, float32).
    """

    record: dict[str, Any]
    videos: dict[str, np.ndarray]
    out: Path | None = None
    initial_latents: torch.Tensor | None = field(default=None, repr=False)


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------

def parse_methods(methods: str | Sequence[str]) -> tuple[str, ...]:
    """``"bf16,nvfp4"`` or a sequence → a tuple of distinct generation methods, in order."""
    items = [m.strip() for m in methods.split(",")] if isinstance(methods, str) else [str(m).strip() for m in methods]
    items = [m for m in items if m]
    if not items:
        raise GenerationError(f"--methods is empty; expected some of {', '.join(GENERATION_METHODS)}")
    unknown = [m for m in items if m not in GENERATION_METHODS]
    if unknown:
        raise GenerationError(f"unknown method(s) {', '.join(map(repr, unknown))}; expected some of "
                              f"{', '.join(GENERATION_METHODS)}")
    dup = sorted({m for m in items if items.count(m) > 1})
    if dup:
        raise GenerationError(f"method(s) listed more than once: {', '.join(dup)}")
    return tuple(items)


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise GenerationError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise GenerationError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise GenerationError(f"{name} must be finite, got {value!r}")
    return v


def _check_out(out: str | Path | None, overwrite: bool) -> str | None:
    if out is None:
        return None
    p = Path(out).expanduser()
    if p.exists() and not p.is_dir():
        raise GenerationError(f"--out {out} exists and is not a folder")
    if p.is_dir() and any(p.iterdir()) and not overwrite:
        raise GenerationError(f"--out {out} exists and is not empty; choose a new folder or pass "
                              "--overwrite to replace the files generate writes there")
    return str(p.resolve())


def resolve_settings(prompt: str, *, negative_prompt: str | None = None,
                     methods: str | Sequence[str] = GENERATION_METHODS, seed: int = 0,
                     steps: int | None = None, guidance: float | None = None,
                     shift: float | None = None, height: int | None = None,
                     width: int | None = None, frames: int | None = None,
                     fps: float | None = None, model: str | Path = DEFAULT_MODEL,
                     qat_transformer: str | Path | None = None, device: str = "auto",
                     fp4_scope: str = "self", backend: str = "auto", offload: bool = False,
                     out: str | Path | None = None, overwrite: bool = False,
                     info: ModelInfo | None = None,
                     loaded_qat: str | None = None) -> tuple[GenerationSettings, ModelInfo]:
    """Check every input and fill defaults from the model, without loading any weights.

    Defaults come from the model (:func:`attnqat.wan.model_info`): the embedded tiny model gives
    128×128, 33 frames, 16 fps, 20 steps, guidance 5, shift 3; a real Wan 2.1 model 480×832,
    81 frames, 16 fps, 50 steps, guidance 5, shift 3 below 720p and 5 at 720p.

    ``info`` and ``loaded_qat`` describe models that are already loaded (their ModelInfo and the
    path of their Attn-QAT transformer, if any); then nothing about the model is looked up again.

    Raises:
        GenerationError: an input is invalid (the message names it and says what is expected).
        attnqat.wan.ModelLoadError: the model folder does not exist or is not a Wan pipeline.
    """
    if not isinstance(prompt, str) or not prompt.strip():
        raise GenerationError("--prompt must be a non-empty text")
    if negative_prompt is not None and not isinstance(negative_prompt, str):
        raise GenerationError(f"--negative-prompt must be text, got {type(negative_prompt).__name__}")
    chosen = parse_methods(methods)
    seed = _int("--seed", seed)
    if not 0 <= seed < 2 ** 63:
        raise GenerationError(f"--seed must be in [0, 2**63), got {seed}")
    if fp4_scope not in FP4_SCOPES:
        raise GenerationError(f"--fp4-scope must be one of {', '.join(FP4_SCOPES)}, got {fp4_scope!r}")
    from .attention import BACKENDS
    if backend not in BACKENDS:
        raise GenerationError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    for name, v in (("--height", height), ("--width", width)):
        if v is not None:
            v = _int(name, v)
            if v <= 0 or v % 16:
                raise GenerationError(f"{name} must be a positive multiple of 16 (the VAE downsamples "
                                      f"by 8 and the transformer patches by 2), got {v}")
    if frames is not None:
        f = _int("--frames", frames)
        if f < 1 or (f - 1) % 4:
            raise GenerationError(f"--frames must be 4k+1 (1, 5, 9, …, 33, …, 81) because the VAE "
                                  f"compresses time by 4, got {f}")
    if steps is not None and _int("--steps", steps) <= 0:
        raise GenerationError(f"--steps must be a positive integer, got {steps}")
    if guidance is not None and _number("--guidance", guidance) < 0:
        raise GenerationError(f"--guidance must be ≥ 0 (≤ 1 turns classifier-free guidance off), got {guidance}")
    if shift is not None and _number("--shift", shift) <= 0:
        raise GenerationError(f"--shift must be > 0, got {shift}")
    if fps is not None and _number("--fps", fps) <= 0:
        raise GenerationError(f"--fps must be > 0, got {fps}")
    try:
        dev = resolve_device(device)
    except ValueError as exc:
        raise GenerationError(f"--device: {exc}") from exc
    out_s = _check_out(out, overwrite)

    info = info or model_info(model)  # raises ModelLoadError for a missing/invalid folder
    qat: str | None = None
    if "attnqat" in chosen:
        if loaded_qat is not None:
            qat = loaded_qat
        elif qat_transformer is not None:
            qp = Path(qat_transformer).expanduser()
            if not qp.exists():
                raise GenerationError(f"--qat-transformer {qat_transformer} does not exist (expected a "
                                      "diffusers transformer folder or a .safetensors file)")
            qat = str(qp.resolve())
        elif info.qat_transformer is not None:
            if not info.qat_transformer.exists():
                raise GenerationError(f"the model names an Attn-QAT transformer at {info.qat_transformer}, "
                                      "which does not exist; pass --qat-transformer")
            qat = str(info.qat_transformer)
        else:
            raise GenerationError("method 'attnqat' needs Attn-QAT weights: pass --qat-transformer PATH "
                                  "(a diffusers transformer folder or a .safetensors file in the "
                                  "diffusers, FastVideo or original Wan naming), or drop attnqat from "
                                  "--methods")
    d = info.defaults
    h = _int("--height", height if height is not None else d["height"])
    w = _int("--width", width if width is not None else d["width"])
    sh = shift if shift is not None else d.get("shift")
    settings = GenerationSettings(
        prompt=prompt, negative_prompt=negative_prompt or "", methods=chosen, seed=seed,
        steps=_int("--steps", steps if steps is not None else d["steps"]),
        guidance=_number("--guidance", guidance if guidance is not None else d["guidance"]),
        shift=float(sh) if sh is not None else default_shift(h, w), height=h, width=w,
        frames=_int("--frames", frames if frames is not None else d["frames"]),
        fps=_number("--fps", fps if fps is not None else d["fps"]), model=info.source,
        qat_transformer=qat, device=str(dev), fp4_scope=fp4_scope, backend=backend,
        offload=bool(offload), out=out_s, overwrite=bool(overwrite),
        max_sequence_length=int(d.get("max_sequence_length", MAX_SEQUENCE_LENGTH)))
    return settings, info


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


def run_methods(models: WanModels, settings: GenerationSettings, *, progress: bool = True,
                log: Callable[[str], None] | None = None) -> GenerationResult:
    """Run every method of ``settings`` on loaded ``models``; nothing is written to disk.

    Returns a :class:`GenerationResult` whose ``record`` is complete except for file names.
    """
    from tqdm.auto import tqdm

    if "attnqat" in settings.methods and models.qat_transformer is None:
        raise GenerationError("method 'attnqat' needs Attn-QAT weights, but none were loaded "
                              "(pass --qat-transformer)")
    dev = models.device
    pipe = models.pipe
    _sync(dev)
    t0 = time.perf_counter()
    pe, ne = encode_prompts(models, settings.prompt, settings.negative_prompt, settings.guidance,
                            settings.max_sequence_length)
    _sync(dev)
    t_text = time.perf_counter() - t0
    lat0 = initial_latents(models, settings)

    videos: dict[str, np.ndarray] = {}
    per_method: dict[str, dict[str, Any]] = {}
    for slot in settings.methods:
        transformer = models.transformer_for(slot)
        attn_method = SLOT_ATTENTION[slot]
        proc = set_method(transformer, attn_method, fp4_scope=settings.fp4_scope,
                          backend=settings.backend)
        proc.reset_stats()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        bar = tqdm(total=settings.steps, desc=f"{slot:>7}", unit="step", disable=not progress,
                   file=sys.stderr, dynamic_ncols=True)
        try:
            with models.on_device(transformer):
                _sync(dev)
                t1 = time.perf_counter()
                latents = denoise(transformer, pipe.scheduler, lat0, pe, ne, steps=settings.steps,
                                  guidance=settings.guidance, shift=settings.shift, device=dev,
                                  on_step=lambda _i: bar.update(1))
                _sync(dev)
                t_denoise = time.perf_counter() - t1
        finally:
            bar.close()
        stats = proc.stats()
        t2 = time.perf_counter()
        frames = decode(models, latents)
        _sync(dev)
        t_decode = time.perf_counter() - t2
        peak, peak_kind = _peak_memory(dev)
        videos[slot] = frames
        attn_s = stats["attention_s"]
        per_method[slot] = {
            "transformer": "attnqat" if slot == "attnqat" else "base",
            "attention_method": attn_method,
            "timings": {"text_encoding_s": t_text, "denoising_s": t_denoise, "decoding_s": t_decode,
                        "attention_s": attn_s,
                        "attention_share_of_denoising": (attn_s / t_denoise) if t_denoise > 0 else None},
            "attention_calls": stats["calls"],
            "transformer_calls": settings.steps * (2 if settings.guidance > 1.0 else 1),
            "peak_memory_bytes": peak, "peak_memory_kind": peak_kind,
            "psnr": None, "ssim": None, "identical_to_bf16": None,
        }
        if log is not None:
            log(f"{slot}: denoising {t_denoise:.2f} s (attention {attn_s:.2f} s), decoding {t_decode:.2f} s")

    if "bf16" in videos:
        ref = videos["bf16"]
        for slot, frames in videos.items():
            if slot == "bf16":
                continue
            p = vid.psnr(frames, ref)
            per_method[slot]["psnr"] = None if math.isinf(p) else p
            per_method[slot]["identical_to_bf16"] = math.isinf(p)
            per_method[slot]["ssim"] = vid.ssim(frames, ref)

    record = {
        "prompt": settings.prompt,
        "negative_prompt": settings.negative_prompt,
        "seed": settings.seed,
        "settings": settings.record(),
        "versions": versions(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "text_encoding_s": t_text,
        "model_kind": models.info.kind,
        "model_weights_note": models.info.weights_note,
        "qat": models.qat_info if "attnqat" in settings.methods else None,
        "qat_weights_note": (models.qat_info or {}).get("note") if "attnqat" in settings.methods else None,
        "methods": per_method,
        "side_by_side": None,
    }
    return GenerationResult(record=record, videos=videos, initial_latents=lat0)


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
        raise GenerationError(f"--out {out} exists and is not empty (pass --overwrite)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _chmod_like_mkdir(tmp)
        record = json.loads(json.dumps(result.record))
        for slot, frames in result.videos.items():
            vid.write_mp4(frames, tmp / f"{slot}.mp4", settings.fps)
            record["methods"][slot]["video"] = f"{slot}.mp4"
        vid.side_by_side({slot: tmp / f"{slot}.mp4" for slot in result.videos},
                         tmp / "side_by_side.mp4", fps=settings.fps)
        record["side_by_side"] = "side_by_side.mp4"
        (tmp / "record.json").write_text(json.dumps(record, indent=2, allow_nan=False) + "\n")
        if not out.exists():
            os.replace(tmp, out)
        else:
            # Replace the files of an earlier generation, including clips of methods not run now.
            for slot in GENERATION_METHODS:
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


def generate(prompt: str, *, negative_prompt: str | None = None,
             methods: str | Sequence[str] = GENERATION_METHODS, seed: int = 0,
             steps: int | None = None, guidance: float | None = None, shift: float | None = None,
             height: int | None = None, width: int | None = None, frames: int | None = None,
             fps: float | None = None, model: str | Path = DEFAULT_MODEL,
             qat_transformer: str | Path | None = None, device: str = "auto",
             out: str | Path | None = None, fp4_scope: str = "self", backend: str = "auto",
             offload: bool = False, overwrite: bool = False, progress: bool = True,
             models: WanModels | None = None,
             log: Callable[[str], None] | None = None) -> GenerationResult:
    """Generate one clip per method from one prompt — the Python form of ``attnqat generate``.

    Args:
        prompt, negative_prompt: the text (negative prompt default: empty).
        methods: some of ``bf16``, ``nvfp4``, ``sage3``, ``attnqat`` (list or comma-separated).
        seed: seed of the initial noise (shared by every method).
        steps, guidance, shift, height, width, frames, fps: sampling and clip settings; None takes
            the model's default (:func:`resolve_settings`). diffusers calls them
            ``num_inference_steps``, ``guidance_scale``, ``flow_shift``, ``height``, ``width``,
            ``num_frames``.
        model: local diffusers Wan folder or hub id (default: the embedded tiny model).
        qat_transformer: Attn-QAT transformer (folder or .safetensors, any naming scheme); None
            takes the one the model folder names (the tiny model has one).
        device: ``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``.
        out: folder to write (None: write nothing, return the frames).
        fp4_scope: ``self`` (cross-attention stays BF16) or ``all``.
        backend: attention backend (``auto`` | ``torch`` | ``triton``).
        offload: keep models on the CPU, move each to the device while it runs.
        overwrite: allow a non-empty ``out`` (only the files generate writes are replaced).
        progress: show a progress bar per method.
        models: already loaded :class:`~attnqat.wan.WanModels` to reuse (skips loading).
        log: called with one-line progress messages.

    Returns:
        :class:`GenerationResult`.
    """
    if models is not None and qat_transformer is not None:
        raise GenerationError("qat_transformer cannot be given with already loaded models; load it "
                              "with attnqat.wan.load_models(..., qat_transformer=...)")
    settings, info = resolve_settings(
        prompt, negative_prompt=negative_prompt, methods=methods, seed=seed, steps=steps,
        guidance=guidance, shift=shift, height=height, width=width, frames=frames, fps=fps,
        model=model if models is None else models.info.source, qat_transformer=qat_transformer,
        device=device if models is None else str(models.device), fp4_scope=fp4_scope,
        backend=backend, offload=offload if models is None else models.offload, out=out,
        overwrite=overwrite, info=None if models is None else models.info,
        loaded_qat=(None if models is None or models.qat_info is None else models.qat_info["path"]))
    if models is None:
        t0 = time.perf_counter()
        models = load_models(settings.model, qat_transformer=settings.qat_transformer,
                             device=settings.device, offload=settings.offload)
        if log is not None:
            log(f"loaded {settings.model} in {time.perf_counter() - t0:.1f} s")
    result = run_methods(models, settings, progress=progress, log=log)
    if settings.out is not None:
        write_outputs(result, settings, settings.out, overwrite=settings.overwrite)
    return result


__all__ = ["GENERATION_METHODS", "GenerationError", "GenerationResult", "GenerationSettings",
           "SLOT_ATTENTION", "decode", "denoise", "encode_prompts", "generate", "initial_latents",
           "parse_methods", "resolve_settings", "run_methods", "versions", "write_outputs"]
