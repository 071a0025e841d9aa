"""What the comparison app does behind the page: one loaded model, checked inputs, one generation at
a time, a folder per request, old folders removed.

:class:`AppService` holds the models loaded once at start (:func:`attnqat.wan.load_models`) and calls
:func:`attnqat.generate.generate` with them. The attention method is state on the loaded
transformer, so generations never overlap: :meth:`AppService.run` holds a lock for the whole
generation (the web app also limits the generate events to one at a time).

Files, under the output root (``--output-dir``)::

    runs/<time>-<random>/    the generation's own output: <method>.mp4, side_by_side.mp4, record.json
    media/<time>-<random>/   the same clips under random names, for the players

The page plays the clips from ``media/`` only, so neither a URL nor a file name it shows names a
method (blind mode shuffles and hides the labels; see :mod:`attnqat.app.player`). The two folder
names are drawn independently. After each generation only the ``keep`` most recent results are
kept; only folders named like the app's own are ever deleted.
"""

from __future__ import annotations

import gc
import math
import os
import re
import secrets
import shutil
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from attnqat.generate import (GENERATION_METHODS, GenerationError, generate, resolve_settings)
from attnqat.wan import FP4_SCOPES, WanModels

#: How each method is named in the page.
METHOD_LABELS = {"bf16": "BF16", "nvfp4": "NVFP4", "sage3": "SageAttention3", "attnqat": "Attn-QAT"}
#: One line under each label.
METHOD_NOTES = {"bf16": "reference", "nvfp4": "4-bit attention dropped in",
                "sage3": "4-bit with outlier smoothing", "attnqat": "4-bit, QAT fine-tuned model"}

#: Inputs of a generation, in the order of the API endpoint's parameters.
FIELDS = ("prompt", "methods", "seed", "steps", "guidance", "shift", "resolution", "frames",
          "negative_prompt", "fp4_scope")

#: Environment variable of the fault-injection hook used by the tests (off when unset).
FAULT_ENV = "ATTNQAT_APP_FAULT"
FAULT_KINDS = ("oom", "error")

MARKER = ".attnqat-app"  # written in the output root
_NAME = re.compile(r"^\d{8}-\d{6}-\d{6}-[0-9a-f]{16}$")


class InputError(ValueError):
    """Invalid inputs: ``errors`` maps a field of :data:`FIELDS` to a message for the page."""

    def __init__(self, errors: dict[str, str]):
        self.errors = dict(errors)
        super().__init__("; ".join(f"{FIELD_NAMES.get(k, k)}: {v}" for k, v in errors.items()))


FIELD_NAMES = {"prompt": "Prompt", "methods": "Methods", "seed": "Seed", "steps": "Steps",
                      "guidance": "Guidance", "shift": "Shift", "resolution": "Resolution",
                      "frames": "Frames", "negative_prompt": "Negative prompt",
                      "fp4_scope": "FP4 scope"}


class GenerationFailed(RuntimeError):
    """A generation failed; the message is written for the person using the page."""


class GenerationCancelled(RuntimeError):
    """The request was abandoned (the page was closed); raised inside the denoising loop."""


@dataclass(frozen=True)
class Limits:
    """Largest inputs the app accepts (the model's defaults are always allowed)."""

    max_side: int = 1280
    max_frames: int = 81
    max_steps: int = 100
    max_prompt_chars: int = 2000
    max_guidance: float = 30.0
    max_shift: float = 30.0


@dataclass(frozen=True)
class Fault:
    """A failure injected inside generation, for tests: ``kind`` at the first transformer call of
    ``method`` (any method when None). Parsed from ``ATTNQAT_APP_FAULT=KIND[@METHOD]``."""

    kind: str
    method: str | None = None

    @classmethod
    def parse(cls, spec: str | None) -> "Fault | None":
        if spec is None or not spec.strip():
            return None
        kind, _, method = spec.strip().partition("@")
        if kind not in FAULT_KINDS:
            raise ValueError(f"{FAULT_ENV}={spec!r}: expected KIND[@METHOD] with KIND one of "
                             f"{', '.join(FAULT_KINDS)}")
        if method and method not in GENERATION_METHODS:
            raise ValueError(f"{FAULT_ENV}={spec!r}: unknown method {method!r}; expected one of "
                             f"{', '.join(GENERATION_METHODS)}")
        return cls(kind, method or None)

    def exception(self, method: str) -> BaseException:
        if self.kind == "oom":
            return torch.OutOfMemoryError(f"out of memory (simulated by {FAULT_ENV} during {method})")
        return RuntimeError(f"simulated failure ({FAULT_ENV}) during {method}")


@dataclass(frozen=True)
class GenerationRequest:
    """Checked inputs of one generation (``seed`` −1 means: draw one when it runs)."""

    prompt: str
    methods: tuple[str, ...]
    seed: int
    steps: int
    guidance: float
    shift: float
    height: int
    width: int
    frames: int
    negative_prompt: str = ""
    fp4_scope: str = "self"

    @property
    def size(self) -> str:
        return f"{self.height}×{self.width}×{self.frames}"


@dataclass
class RunOutput:
    """One finished generation.

    ``clips`` are the labelled files (``<method>.mp4``), ``media`` the same clips under random
    names for the players.
    """

    run_id: str
    folder: Path
    record: dict[str, Any]
    clips: dict[str, Path]
    side_by_side: Path
    record_path: Path
    media: dict[str, Path]
    seconds: float


# ----------------------------------------------------------------------------------------------
# Progress
# ----------------------------------------------------------------------------------------------

class Progress:
    """Progress of one generation, per method and per denoising step; safe to read from another
    thread (:meth:`snapshot`).

    It counts transformer calls (a forward pre-hook, ``calls_per_step`` per denoising step) and
    the one-line log that :func:`attnqat.generate.run_methods` writes after each method's decode.
    """

    def __init__(self, methods: Sequence[str], steps: int, calls_per_step: int):
        self.methods = tuple(methods)
        self.steps = steps
        self.calls_per_step = calls_per_step
        self._lock = threading.Lock()
        self._calls = 0
        self._decoded: set[str] = set()
        self.phase = "waiting"  # waiting → text → denoising → writing → done | failed
        self.started = time.monotonic()
        self.listeners: list[Callable[["Progress"], None]] = []

    @property
    def calls_per_method(self) -> int:
        return self.steps * self.calls_per_step

    def _notify(self) -> None:
        for fn in list(self.listeners):
            try:
                fn(self)
            except Exception:  # noqa: BLE001 - a display problem never stops a generation
                traceback.print_exc()

    def set_phase(self, phase: str) -> None:
        with self._lock:
            self.phase = phase
        self._notify()

    def current_method(self) -> str | None:
        with self._lock:
            return self._current_locked()

    def _current_locked(self) -> str | None:
        if self._calls == 0:
            return None
        return self.methods[min((self._calls - 1) // self.calls_per_method, len(self.methods) - 1)]

    def on_transformer_call(self) -> str:
        """Called before each transformer forward; returns the method it belongs to."""
        with self._lock:
            self.phase = "denoising"
            i = min(self._calls // self.calls_per_method, len(self.methods) - 1)
            for m in self.methods[:i]:
                self._decoded.add(m)
            self._calls += 1
            method = self.methods[i]
        self._notify()
        return method

    def on_log(self, message: str) -> None:
        """``run_methods`` logs ``"<method>: denoising … decoding …"`` once a method is decoded."""
        slot = message.split(":", 1)[0].strip()
        with self._lock:
            if slot in self.methods:
                self._decoded.add(slot)
                if len(self._decoded) == len(self.methods):
                    self.phase = "writing"
        self._notify()

    def snapshot(self) -> dict[str, Any]:
        """``{"phase", "elapsed_s", "fraction", "current", "methods": [{"method", "state", "step",
        "steps", "fraction"}]}`` with state one of waiting, denoising, decoding, done."""
        with self._lock:
            per = []
            units_done = 0
            cpm = self.calls_per_method
            for i, m in enumerate(self.methods):
                calls = min(max(self._calls - i * cpm, 0), cpm)
                if m in self._decoded:
                    state, calls = "done", cpm
                elif calls == cpm:
                    state = "decoding"
                elif calls > 0:
                    state = "denoising"
                else:
                    state = "waiting"
                step = calls // self.calls_per_step
                frac = (calls + (1 if state == "done" else 0)) / (cpm + 1)
                units_done += calls + (1 if state == "done" else 0)
                per.append({"method": m, "state": state, "step": step, "steps": self.steps,
                            "fraction": frac})
            total = len(self.methods) * (cpm + 1)
            return {"phase": self.phase, "elapsed_s": time.monotonic() - self.started,
                    "fraction": units_done / total if total else 0.0,
                    "current": self._current_locked() if self.phase == "denoising" else None,
                    "methods": per}

    def describe(self) -> str:
        """One line for a progress bar: ``"nvfp4 · step 7/20"``."""
        snap = self.snapshot()
        if snap["phase"] == "waiting":
            return "waiting for the previous generation to finish"
        if snap["phase"] == "text":
            return "encoding the prompt"
        if snap["phase"] == "writing":
            return "writing the videos"
        for row in snap["methods"]:
            if row["state"] in ("denoising", "decoding"):
                label = METHOD_LABELS[row["method"]]
                if row["state"] == "decoding":
                    return f"{label} · decoding"
                return f"{label} · step {row['step'] + 1}/{row['steps']}"
        return snap["phase"]


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------

_RES = re.compile(r"^\s*(\d+)\s*[x×*,]\s*(\d+)\s*$", re.IGNORECASE)


def parse_resolution(text: Any) -> tuple[int, int]:
    """``"480x832"`` (height × width; ``×``, ``*`` and spaces accepted) → (480, 832).

    Raises ValueError with a message for the page."""
    if not isinstance(text, str) or not _RES.match(text.split("(")[0]):
        raise ValueError(f"expected height×width such as 480x832, got {text!r}")
    m = _RES.match(text.split("(")[0])
    return int(m.group(1)), int(m.group(2))


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return _as_int(float(value)) if value.strip() else None
        except ValueError:
            return None
    return None


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)) and math.isfinite(float(value)):
        return float(value)
    if isinstance(value, str):
        try:
            v = float(value)
        except ValueError:
            return None
        return v if math.isfinite(v) else None
    return None


_OPTION_FIELD = {"--prompt": "prompt", "--methods": "methods", "method": "methods",
                 "--seed": "seed", "--steps": "steps", "--guidance": "guidance",
                 "--shift": "shift", "--height": "resolution", "--width": "resolution",
                 "--frames": "frames", "--negative-prompt": "negative_prompt",
                 "--fp4-scope": "fp4_scope"}


def _field_of(message: str) -> str:
    """The app field a :class:`GenerationError` message is about (it names a CLI option)."""
    for option, name in _OPTION_FIELD.items():
        if message.startswith(option) or f" {option}" in message or f"'{option}" in message:
            return name
    return "methods"


def _page_message(message: str) -> str:
    """A CLI-worded message of :mod:`attnqat.generate` reworded for the page."""
    for option in ("--height", "--width", "--frames", "--steps", "--guidance", "--shift",
                   "--prompt", "--seed", "--fp4-scope"):
        message = message.replace(option, option[2:].replace("-", " "))
    return message.replace("pass --qat-transformer", "start the app with --qat-transformer")


# ----------------------------------------------------------------------------------------------
# The service
# ----------------------------------------------------------------------------------------------

def _stamp() -> str:
    return f"{datetime.now().strftime('%Y%m%d-%H%M%S-%f')}-{secrets.token_hex(8)}"


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


class AppService:
    """The loaded models, the input checks and the generations of the app.

    Args:
        models: loaded once (:func:`attnqat.wan.load_models`).
        output_dir: the output root (created; None: a new folder in the system temp dir, removed
            by :meth:`close`).
        keep: number of recent results kept on disk (older ones are deleted after each run).
        fault: failure to inject (tests only; see :data:`FAULT_ENV`).
        limits: largest accepted inputs (None: chosen from the model).
    """

    def __init__(self, models: WanModels, *, output_dir: str | Path | None = None, keep: int = 20,
                 fault: Fault | None = None, limits: Limits | None = None):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.models = models
        self.info = models.info
        self.keep = keep
        self.fault = fault
        self._own_root = output_dir is None
        root = Path(tempfile.mkdtemp(prefix="attnqat-app-")) if output_dir is None else Path(output_dir)
        root = root.expanduser().resolve()
        if root.exists() and not root.is_dir():
            raise ValueError(f"--output-dir {root} exists and is not a folder")
        self.root = root
        self.runs_root = root / "runs"
        self.media_root = root / "media"
        self.runs_root.mkdir(parents=True, exist_ok=True)
        self.media_root.mkdir(parents=True, exist_ok=True)
        (root / MARKER).write_text("output folder of `attnqat app`; it deletes old results here\n")
        d = self.info.defaults
        if limits is None:
            tiny = self.info.kind == "tiny-wan"
            limits = Limits(max_side=512 if tiny else 1280,
                            max_frames=max(81, int(d["frames"])),
                            max_steps=max(100, int(d["steps"])))
        self.limits = limits
        self._lock = threading.Lock()
        self.runs_done = 0
        self.prune()

    # -- what the model offers ----------------------------------------------------------------
    def availability(self) -> dict[str, str | None]:
        """Method → None when it can run, else the reason it cannot."""
        out: dict[str, str | None] = {m: None for m in GENERATION_METHODS}
        if self.models.qat_transformer is None:
            out["attnqat"] = ("needs Attn-QAT weights: start the app with --qat-transformer PATH "
                              "(a diffusers transformer folder or a .safetensors file)")
        return out

    def available_methods(self) -> list[str]:
        return [m for m, why in self.availability().items() if why is None]

    @property
    def defaults(self) -> dict[str, Any]:
        """The model's generation defaults, shift filled in."""
        from attnqat.wan import default_shift

        d = dict(self.info.defaults)
        if d.get("shift") is None:
            d["shift"] = default_shift(int(d["height"]), int(d["width"]))
        return d

    def resolution_presets(self) -> list[tuple[str, str]]:
        """(label, value) choices, value ``"HxW"``, the model's default first."""
        d = self.info.defaults
        default = (int(d["height"]), int(d["width"]))
        if self.info.kind == "tiny-wan":
            sizes = [(128, 128, "square"), (128, 224, "landscape"), (224, 128, "portrait"),
                     (64, 64, "quick"), (32, 32, "quickest")]
        else:
            layers = getattr(self.models.pipe.transformer.config, "num_layers", 0)
            sizes = [(480, 832, "480p landscape"), (832, 480, "480p portrait")]
            if layers >= 40:  # 14B: trained at 720p as well
                sizes += [(720, 1280, "720p landscape"), (1280, 720, "720p portrait")]
        out: list[tuple[str, str]] = []
        if default not in [(h, w) for h, w, _ in sizes]:
            sizes.insert(0, (*default, "model default"))
        sizes.sort(key=lambda s: (s[0], s[1]) != default)
        for h, w, what in sizes:
            tag = f"{what}, default" if (h, w) == default else what
            out.append((f"{h}×{w} ({tag})", f"{h}x{w}"))
        return out

    # -- inputs -------------------------------------------------------------------------------
    def check(self, prompt: Any, methods: Any, seed: Any = -1, steps: Any = None,
              guidance: Any = None, shift: Any = None, resolution: Any = None, frames: Any = None,
              negative_prompt: Any = "", fp4_scope: Any = "self") -> GenerationRequest:
        """Check every input (nothing heavy runs). None takes the model's default.

        Raises:
            InputError: with one message per invalid field.
        """
        errors: dict[str, str] = {}
        lim = self.limits
        d = self.defaults

        if not isinstance(prompt, str) or not prompt.strip():
            errors["prompt"] = "enter a prompt (the text is empty)"
        elif len(prompt) > lim.max_prompt_chars:
            errors["prompt"] = f"at most {lim.max_prompt_chars} characters, got {len(prompt)}"

        chosen: list[str] = []
        if isinstance(methods, str):
            methods = [m for m in methods.split(",") if m.strip()]
        if not isinstance(methods, (list, tuple)) or not methods:
            errors["methods"] = "select at least one method"
        else:
            unknown = [m for m in methods if m not in GENERATION_METHODS]
            avail = self.availability()
            blocked = [m for m in methods if m in avail and avail[m] is not None]
            if unknown:
                errors["methods"] = (f"unknown method(s) {', '.join(map(repr, unknown))}; expected "
                                     f"some of {', '.join(GENERATION_METHODS)}")
            elif len(set(methods)) != len(methods):
                errors["methods"] = "a method is listed more than once"
            elif blocked:
                errors["methods"] = "; ".join(f"{METHOD_LABELS[m]} cannot run: {avail[m]}"
                                              for m in blocked)
            else:
                chosen = [m for m in GENERATION_METHODS if m in methods]  # display order

        seed_i = -1 if seed is None or seed == "" else _as_int(seed)
        if seed_i is None or not (seed_i == -1 or 0 <= seed_i < 2 ** 63):
            errors["seed"] = f"an integer from 0 to 2^63−1, or −1 for a random seed; got {seed!r}"

        steps_i = int(d["steps"]) if steps is None else _as_int(steps)
        if steps_i is None or not 1 <= steps_i <= lim.max_steps:
            errors["steps"] = f"a whole number from 1 to {lim.max_steps}, got {steps!r}"

        guid = float(d["guidance"]) if guidance is None else _as_float(guidance)
        if guid is None or not 0 <= guid <= lim.max_guidance:
            errors["guidance"] = (f"a number from 0 to {lim.max_guidance:g} (≤ 1 turns "
                                  f"classifier-free guidance off), got {guidance!r}")

        sh = float(d["shift"]) if shift is None else _as_float(shift)
        if sh is None or not 0 < sh <= lim.max_shift:
            errors["shift"] = f"a number above 0 and at most {lim.max_shift:g}, got {shift!r}"

        h = w = 0
        if resolution is None or resolution == "":
            h, w = int(d["height"]), int(d["width"])
        else:
            try:
                h, w = parse_resolution(resolution)
            except ValueError as exc:
                errors["resolution"] = str(exc)
            else:
                bad = [f"{name} {v}" for name, v in (("height", h), ("width", w))
                       if v < 16 or v % 16 or v > lim.max_side]
                if bad:
                    errors["resolution"] = (f"{', '.join(bad)}: each side must be a multiple of 16 "
                                            f"from 16 to {lim.max_side} (the VAE downsamples by 8 "
                                            "and the transformer patches by 2)")

        frames_i = int(d["frames"]) if frames is None else _as_int(frames)
        if frames_i is None or frames_i < 1 or (frames_i - 1) % 4 or frames_i > lim.max_frames:
            errors["frames"] = (f"4k+1 frames (1, 5, 9, …, {lim.max_frames}) because the VAE "
                                f"compresses time by 4; got {frames!r}")

        if negative_prompt is None:
            negative_prompt = ""
        if not isinstance(negative_prompt, str):
            errors["negative_prompt"] = "must be text"
        elif len(negative_prompt) > lim.max_prompt_chars:
            errors["negative_prompt"] = f"at most {lim.max_prompt_chars} characters"

        if fp4_scope not in FP4_SCOPES:
            errors["fp4_scope"] = f"one of {', '.join(FP4_SCOPES)}, got {fp4_scope!r}"

        if errors:
            raise InputError(errors)
        req = GenerationRequest(prompt=prompt.strip(), methods=tuple(chosen), seed=seed_i,
                                steps=steps_i, guidance=guid, shift=sh, height=h, width=w,
                                frames=frames_i, negative_prompt=negative_prompt,
                                fp4_scope=fp4_scope)
        # The generation's own checks (the same ones `attnqat generate` runs).
        try:
            self._resolve(req, seed=max(req.seed, 0))
        except GenerationError as exc:
            raise InputError({_field_of(str(exc)): _page_message(str(exc))}) from exc
        return req

    def field_errors(self, *values: Any) -> dict[str, str]:
        """``check`` on values in :data:`FIELDS` order; {} when they are valid."""
        try:
            self.check(*values[:len(FIELDS)])
        except InputError as exc:
            return exc.errors
        return {}

    def _resolve(self, req: GenerationRequest, seed: int):
        qat = self.models.qat_info["path"] if self.models.qat_info else None
        return resolve_settings(
            req.prompt, negative_prompt=req.negative_prompt, methods=req.methods, seed=seed,
            steps=req.steps, guidance=req.guidance, shift=req.shift, height=req.height,
            width=req.width, frames=req.frames, model=self.info.source,
            device=str(self.models.device), fp4_scope=req.fp4_scope, offload=self.models.offload,
            info=self.info, loaded_qat=qat)

    # -- generation ---------------------------------------------------------------------------
    def new_progress(self, req: GenerationRequest) -> Progress:
        return Progress(req.methods, req.steps, 2 if req.guidance > 1.0 else 1)

    def run(self, req: GenerationRequest, *, progress: Progress | None = None,
            cancel: threading.Event | None = None) -> RunOutput:
        """Generate ``req`` into a new request folder (one generation at a time).

        Raises:
            GenerationFailed: with a message for the page (out of memory, any other failure).
            GenerationCancelled: ``cancel`` was set.
        """
        progress = progress or self.new_progress(req)
        with self._lock:
            if cancel is not None and cancel.is_set():
                raise GenerationCancelled("the request was abandoned before it started")
            progress.started = time.monotonic()
            progress.set_phase("text")
            try:
                out = self._run_locked(req, progress, cancel)
            except BaseException:
                progress.set_phase("failed")
                raise
            progress.set_phase("done")
            return out

    def _hooks(self, progress: Progress, cancel: threading.Event | None):
        fault = self.fault
        fired: list[bool] = []

        def pre_hook(_module, _args):
            if cancel is not None and cancel.is_set():
                raise GenerationCancelled("the request was abandoned")
            method = progress.on_transformer_call()
            if fault is not None and not fired and fault.method in (None, method):
                fired.append(True)
                raise fault.exception(method)

        handles = []
        seen: set[int] = set()
        for t in (self.models.pipe.transformer, self.models.qat_transformer):
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                handles.append(t.register_forward_pre_hook(pre_hook))
        return handles

    def _run_locked(self, req: GenerationRequest, progress: Progress,
                    cancel: threading.Event | None) -> RunOutput:
        seed = req.seed if req.seed >= 0 else secrets.randbelow(2 ** 31)
        run_id = _stamp()
        folder = self.runs_root / run_id
        handles = self._hooks(progress, cancel)
        t0 = time.monotonic()
        try:
            result = generate(req.prompt, negative_prompt=req.negative_prompt, methods=req.methods,
                              seed=seed, steps=req.steps, guidance=req.guidance, shift=req.shift,
                              height=req.height, width=req.width, frames=req.frames,
                              fp4_scope=req.fp4_scope, models=self.models, out=folder,
                              progress=False, log=progress.on_log)
        except GenerationCancelled:
            self._after_failure(folder)
            raise
        except torch.OutOfMemoryError as exc:
            method = progress.current_method()
            where = f"while generating with {method}" if method else "while encoding the prompt"
            self._after_failure(folder)
            hint = "try fewer frames or a smaller resolution"
            if self.models.device.type == "cuda" and not self.models.offload:
                hint = "try fewer frames, a smaller resolution, or restart the app with --offload"
            raise GenerationFailed(f"Out of memory {where} at {req.size} "
                                   f"(height×width×frames): {hint}.") from exc
        except GenerationError as exc:
            self._after_failure(folder)
            raise GenerationFailed(_page_message(str(exc))) from exc
        except Exception as exc:  # noqa: BLE001 - every failure becomes one message
            method = progress.current_method()
            self._after_failure(folder)
            traceback.print_exc(file=sys.stderr)
            where = f" with {method}" if method else " while encoding the prompt"
            raise GenerationFailed(f"Generation failed{where} at {req.size}: "
                                   f"{type(exc).__name__}: {exc}") from exc
        finally:
            for h in handles:
                h.remove()
        folder = Path(result.out)
        media_dir = self.media_root / _stamp()
        media_dir.mkdir()
        clips = {m: folder / result.record["methods"][m]["video"] for m in req.methods}
        media = {}
        for m, path in clips.items():
            dst = media_dir / f"{secrets.token_hex(8)}.mp4"
            _link_or_copy(path, dst)
            media[m] = dst
        self.runs_done += 1
        out = RunOutput(run_id=run_id, folder=folder, record=result.record, clips=clips,
                        side_by_side=folder / result.record["side_by_side"],
                        record_path=folder / "record.json", media=media,
                        seconds=time.monotonic() - t0)
        self.prune()
        return out

    def _after_failure(self, folder: Path) -> None:
        shutil.rmtree(folder, ignore_errors=True)  # generate writes nothing on failure; be sure
        gc.collect()
        if self.models.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- files --------------------------------------------------------------------------------
    def prune(self) -> list[Path]:
        """Delete all but the ``keep`` newest results (only folders named like the app's own).
        Returns the folders deleted."""
        removed: list[Path] = []
        for sub in (self.runs_root, self.media_root):
            names = sorted(p.name for p in sub.iterdir() if p.is_dir() and _NAME.match(p.name))
            for name in names[:-self.keep] if len(names) > self.keep else []:
                shutil.rmtree(sub / name, ignore_errors=True)
                removed.append(sub / name)
            for p in sub.iterdir():  # leftovers of generate's temporary folders
                if p.is_dir() and p.name.startswith(".") and ".tmp-" in p.name and not self._lock.locked():
                    shutil.rmtree(p, ignore_errors=True)
        return removed

    def close(self) -> None:
        """Remove the output root when the service created it."""
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)


def load_service(model: str | None = None, *, qat_transformer: str | None = "auto",
                 device: str = "auto", offload: bool = False, output_dir: str | Path | None = None,
                 keep: int = 20, fault: Fault | None = None,
                 log: Callable[[str], None] | None = None) -> AppService:
    """Load the models once and return the service (``qat_transformer="auto"``: the one the model
    folder names, if any)."""
    from attnqat.wan import DEFAULT_MODEL, load_models

    t0 = time.perf_counter()
    models = load_models(model or DEFAULT_MODEL, qat_transformer=qat_transformer, device=device,
                         offload=offload)
    if log is not None:
        log(f"loaded {models.info.source} on {models.device} in {time.perf_counter() - t0:.1f} s")
    return AppService(models, output_dir=output_dir, keep=keep, fault=fault)


__all__ = ["AppService", "FAULT_ENV", "FIELDS", "Fault", "GenerationCancelled", "GenerationFailed",
           "GenerationRequest", "InputError", "Limits", "METHOD_LABELS", "METHOD_NOTES", "Progress",
           "RunOutput", "load_service", "parse_resolution"]
