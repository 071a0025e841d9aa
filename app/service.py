"""What the comparison app does behind the page: one loaded model, checked inputs, one generation at
a time, a folder per request, old folders removed.

:class:`AppService` holds the models loaded once at start (:func:`attnqat.wan.load_models`). A request
is checked once by :func:`attnqat.generate.resolve_settings` (:meth:`AppService.check`, with the app's
own :class:`~attnqat.generate.Limits`), which gives the complete settings or an
:class:`~attnqat.generate.InvalidInput` naming each bad field; :meth:`AppService.run` then runs
exactly those settings (:func:`attnqat.generate.run_methods`, nothing validated again) and follows
them through the step callback (:class:`Progress`). The attention method is state on the loaded
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

from attnqat import methods as registry
from attnqat import synthetic as syn
from attnqat.generate import (GenerationError, GenerationSettings, InvalidInput, Limits, StepEvent,
                              method_label, resolve_settings, run_methods, write_outputs)
from attnqat.record import WEIGHTS_REFERENCE, GenerationRecord, Timings
from attnqat.request import GenerationRequest
from attnqat.sweep import seed_sweep
from attnqat.wan import DEFAULT_MODEL, WanModels, default_shift, dtype_name, load_models

#: One line under each built-in method's label (the registry's ``description``; Attn-QAT's depends on
#: its weights: :meth:`AppService.note`).
METHOD_NOTES = {m.name: m.description for m in registry.all_methods() if m.generation == "base"}
QAT_NOTE_FINE_TUNED = registry.get("attnqat").description
QAT_NOTE_BASE_COPY = "4-bit attention on a copy of the base weights: the same clip as NVFP4"


def method_note(method: str, qat_info: dict[str, Any] | None = None) -> str:
    """One line under the method's name (Attn-QAT's by whether ``qat_info`` — the loaded weights'
    :attr:`~attnqat.wan.WanModels.qat_info` or a record's ``qat`` — says they are fine-tuned)."""
    if method not in registry.names():
        return ""
    m = registry.get(method)
    if m.generation == "finetuned" and not (qat_info or {}).get("fine_tuned"):
        return QAT_NOTE_BASE_COPY
    return m.description


def attention_kind(slot: str) -> str:
    """The attention a progress row's steps run (the Attn-QAT weights' BF16 reference: bf16)."""
    return registry.slot_attention(slot) if slot in registry.names() else registry.REFERENCE


#: The progress row of the Attn-QAT weights' BF16 clip (the reference of Attn-QAT's 4-bit error).
REFERENCE_LABEL = "Attn-QAT weights, BF16 (reference)"

_WORD = re.compile(r"[a-z]+|[^\sa-z]")


def unknown_words(prompt: str, vocabulary: set[str]) -> list[str]:
    """The words of ``prompt`` that are not in ``vocabulary`` (lower case, each once, in order):
    what a model with a closed word list silently ignores."""
    words = _WORD.findall((prompt or "").lower())
    return list(dict.fromkeys(w for w in words if w.isalpha() and w not in vocabulary))


def slug(text: str, n: int = 60) -> str:
    """A file-name part of ``text``: lower-case words joined by hyphens, at most ``n`` characters,
    cut between words."""
    out = re.sub(r"[^a-z0-9]+", "-", (text or "").lower()).strip("-")
    if len(out) > n:
        cut = out[:n + 1]
        out = cut[:cut.rfind("-")] if "-" in cut else out[:n]
    return out or "clip"


#: Inputs of a generation, in the order of the API endpoint's parameters.
FIELDS = ("prompt", "methods", "seed", "steps", "guidance", "shift", "resolution", "frames",
          "negative_prompt", "fp4_scope")
FIELD_NAMES = {"prompt": "Prompt", "methods": "Methods", "seed": "Seed", "steps": "Steps",
               "guidance": "Guidance", "shift": "Shift", "resolution": "Resolution",
               "frames": "Frames", "negative_prompt": "Negative prompt", "fp4_scope": "FP4 scope"}
#: generate's fields that the page shows as one of its own.
_PAGE_FIELD = {"height": "resolution", "width": "resolution"}

#: Environment variable of the fault-injection hook used by the tests (off when unset).
FAULT_ENV = "ATTNQAT_APP_FAULT"
FAULT_KINDS = ("oom", "error")

MARKER = ".attnqat-app"  # written in the output root
_NAME = re.compile(r"^\d{8}-\d{6}-\d{6}-[0-9a-f]{16}$")


def page_errors(exc: InvalidInput) -> dict[str, str]:
    """generate's field errors as the page's fields (height and width are the resolution)."""
    out: dict[str, str] = {}
    for name, message in exc.errors.items():
        page = _PAGE_FIELD.get(name, name)
        if name in _PAGE_FIELD:
            message = f"{name} {message}"
        out[page] = f"{out[page]}; {message}" if page in out else message
    return out


def describe_errors(errors: dict[str, str]) -> str:
    return "; ".join(f"{FIELD_NAMES.get(k, k)}: {v}" for k, v in errors.items())


class GenerationFailed(RuntimeError):
    """A generation failed; the message is written for the person using the page."""


class GenerationCancelled(RuntimeError):
    """The request was stopped (Stop, or the page was closed); raised from the step callback."""


#: The app's bounds (the model's defaults are always allowed; see :meth:`AppService.__init__`).
APP_LIMITS = Limits(max_side=1280, max_frames=81, max_steps=100, max_prompt_chars=2000,
                    max_guidance=30.0, max_shift=30.0)


@dataclass(frozen=True)
class Fault:
    """A failure injected inside generation, for tests: ``kind`` as ``method`` (any method when
    None) starts denoising. Parsed from ``ATTNQAT_APP_FAULT=KIND[@METHOD]``."""

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
        if method and method not in registry.generation():
            raise ValueError(f"{FAULT_ENV}={spec!r}: unknown method {method!r}; expected one of "
                             f"{', '.join(registry.generation())}")
        return cls(kind, method or None)

    def exception(self, method: str) -> BaseException:
        if self.kind == "oom":
            return torch.OutOfMemoryError(f"out of memory (simulated by {FAULT_ENV} during {method})")
        return RuntimeError(f"simulated failure ({FAULT_ENV}) during {method}")


def size_text(settings: GenerationSettings) -> str:
    """``"832×480×81"``: width × height × frames, as Wan writes sizes."""
    return f"{settings.width}×{settings.height}×{settings.frames}"


@dataclass
class RunOutput:
    """One finished generation.

    ``clips`` are the labelled files (``<method>.mp4``), ``media`` the same clips under random
    names for the players, ``downloads`` the same clips named by method, prompt and seed (in a
    folder of their own, so that no blind URL leads to them); ``settings`` what was asked.
    """

    run_id: str
    folder: Path
    record: GenerationRecord
    clips: dict[str, Path]
    side_by_side: Path
    record_path: Path
    media: dict[str, Path]
    seconds: float
    downloads: dict[str, Path] | None = None
    settings: GenerationSettings | None = None


# ----------------------------------------------------------------------------------------------
# Progress
# ----------------------------------------------------------------------------------------------

@dataclass
class _MethodProgress:
    state: str = "waiting"  # waiting → denoising → decoding → done
    step: int = 0
    started: float | None = None
    denoise_started: float | None = None
    timings: Timings | None = None


class Progress:
    """Progress of one generation, per method and per denoising step, fed by generate's step
    callback (:meth:`on_step`); safe to read from another thread (:meth:`snapshot`)."""

    def __init__(self, methods: Sequence[str], steps: int, labels: dict[str, str] | None = None,
                 cost_ratio: dict[str, float] | None = None):
        self.methods = tuple(methods)
        # seconds per step of each kind of attention relative to BF16, from earlier generations
        self.cost_ratio = dict(cost_ratio or {})
        self.steps = steps
        self.labels = {m: (labels or {}).get(m, registry.label(m)) for m in self.methods}
        self._lock = threading.Lock()
        self._per = {m: _MethodProgress() for m in self.methods}
        self.phase = "waiting"  # waiting → text → denoising → decoding → writing → done | failed
        self.current: str | None = None
        self.started = time.monotonic()
        self.listeners: list[Callable[["Progress"], None]] = []

    def _notify(self) -> None:
        for fn in list(self.listeners):
            try:
                fn(self)
            except Exception:  # noqa: BLE001 - a display problem never stops a generation
                traceback.print_exc()

    def set_phase(self, phase: str) -> None:
        with self._lock:
            self.phase = phase
            if phase == "text":
                self.started = time.monotonic()
        self._notify()

    def current_method(self) -> str | None:
        with self._lock:
            return self.current

    def on_step(self, event: StepEvent) -> None:
        """generate's step callback: record where the generation stands."""
        now = time.monotonic()
        with self._lock:
            if event.phase == "text":
                self.phase = "text"
            elif event.method in self._per:
                row = self._per[event.method]
                self.current = event.method
                self.phase = event.phase if event.phase != "done" else "denoising"
                if event.phase == "denoising":
                    if event.step == 0:
                        row.started = row.denoise_started = now
                    row.state, row.step = "denoising", event.step
                elif event.phase == "decoding":
                    row.state, row.step = "decoding", event.steps
                elif event.phase == "done":
                    row.state, row.step, row.timings = "done", event.steps, event.timings
                    if all(r.state == "done" for r in self._per.values()):
                        self.phase, self.current = "writing", None
        self._notify()

    def _eta_locked(self, now: float) -> tuple[float | None, bool]:
        """(seconds left, rough). Each method's steps are costed by the time per step of its own
        kind of attention (:func:`attention_kind`): measured in this generation once a method of
        that kind has run a step, else scaled from a measured kind by the ratio earlier
        generations of this app measured (``cost_ratio``), else taken as the measured time per
        step — then ``rough`` is True. Decodes cost what the decodes so far took."""
        per_kind: dict[str, float] = {}
        decodes = []
        for m, r in self._per.items():
            t = r.timings
            if t is not None and t.denoising_s:
                per_kind[attention_kind(m)] = t.denoising_s / self.steps
            if t is not None and t.decoding_s is not None:
                decodes.append(t.decoding_s)
        cur = self._per.get(self.current) if self.current else None
        if cur is not None and cur.state == "denoising" and cur.step > 0 and cur.denoise_started:
            per_kind[attention_kind(self.current)] = (now - cur.denoise_started) / cur.step
        if not per_kind:
            return None, False
        last_kind = attention_kind(self.current) if self.current in self._per and \
            attention_kind(self.current) in per_kind else next(reversed(per_kind))
        rough = False

        def per_step(kind: str) -> float:
            nonlocal rough
            if kind in per_kind:
                return per_kind[kind]
            for known, sec in per_kind.items():
                if kind in self.cost_ratio and known in self.cost_ratio and self.cost_ratio[known] > 0:
                    return sec * self.cost_ratio[kind] / self.cost_ratio[known]
            rough = True
            return per_kind[last_kind]

        decode = sum(decodes) / len(decodes) if decodes else per_kind[last_kind] * 2
        left = 0.0
        for m, r in self._per.items():
            if r.state in ("waiting", "denoising"):
                left += (self.steps - r.step) * per_step(attention_kind(m)) + decode
            elif r.state == "decoding":
                left += decode / 2
        return left, rough

    def snapshot(self) -> dict[str, Any]:
        """``{"phase", "elapsed_s", "eta_s", "eta_rough", "fraction", "current", "methods":
        [{"method", "label", "state", "step", "steps", "fraction", "timings"}]}`` with state one
        of waiting, denoising, decoding, done; ``eta_s`` None until one step has been timed,
        ``eta_rough`` True while some kind of attention still to run has no timing to go by."""
        now = time.monotonic()
        with self._lock:
            per = []
            units = 0.0
            for m in self.methods:
                r = self._per[m]
                done_units = r.step + (1 if r.state == "done" else 0)
                units += done_units
                per.append({"method": m, "label": self.labels[m], "state": r.state, "step": r.step,
                            "steps": self.steps, "fraction": done_units / (self.steps + 1),
                            "timings": r.timings})
            total = len(self.methods) * (self.steps + 1)
            eta, rough = self._eta_locked(now)
            return {"phase": self.phase, "elapsed_s": now - self.started,
                    "eta_s": eta, "eta_rough": rough, "fraction": units / total if total else 0.0,
                    "current": self.current, "methods": per}

    def describe(self, snap: dict[str, Any] | None = None) -> str:
        """One line for a progress bar: ``"NVFP4 · step 7/20"`` (of ``snap``, a :meth:`snapshot`
        already taken, or of a new one)."""
        snap = self.snapshot() if snap is None else snap
        if snap["phase"] == "waiting":
            return "waiting for the previous generation to finish"
        if snap["phase"] == "text":
            return "encoding the prompt"
        if snap["phase"] == "writing":
            return "writing the videos"
        for row in snap["methods"]:
            if row["state"] == "decoding":
                return f"{row['label']} · decoding"
            if row["state"] == "denoising":
                return f"{row['label']} · step {min(row['step'] + 1, row['steps'])}/{row['steps']}"
        return snap["phase"]


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------

_RES = re.compile(r"^\s*(\d+)\s*[x×*,]\s*(\d+)\s*$", re.IGNORECASE)


def parse_resolution(text: Any) -> tuple[int, int]:
    """``"832x480"`` (width × height, as Wan writes it; ``×``, ``*`` and spaces accepted) →
    (width, height) = (832, 480).

    Raises ValueError with a message for the page."""
    if not isinstance(text, str) or not _RES.match(text.split("(")[0]):
        raise ValueError(f"expected width×height such as 832x480, got {text!r}")
    m = _RES.match(text.split("(")[0])
    return int(m.group(1)), int(m.group(2))


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
        self.downloads_root = root / "downloads"
        self.sweeps_root = root / "sweeps"
        for sub in (self.runs_root, self.media_root, self.downloads_root, self.sweeps_root):
            sub.mkdir(parents=True, exist_ok=True)
        (root / MARKER).write_text("output folder of `attnqat app`; it deletes old results here\n")
        d = self.info.defaults
        if limits is None:
            tiny = self.info.kind == "tiny-wan"
            limits = Limits(max_side=512 if tiny else APP_LIMITS.max_side,
                            max_frames=max(APP_LIMITS.max_frames, int(d["frames"])),
                            max_steps=max(APP_LIMITS.max_steps, int(d["steps"])),
                            max_prompt_chars=APP_LIMITS.max_prompt_chars,
                            max_guidance=APP_LIMITS.max_guidance, max_shift=APP_LIMITS.max_shift)
        self.limits = limits
        self._lock = threading.Lock()
        self.runs_done = 0
        #: seconds per denoising step of each kind of attention relative to BF16 (last measured)
        self.cost_ratio: dict[str, float] = {}
        self.prune()

    # -- what the model offers ----------------------------------------------------------------
    def availability(self) -> dict[str, str | None]:
        """Method → None when it can run, else the reason it cannot."""
        out: dict[str, str | None] = {m: None for m in registry.generation()}
        if self.models.qat_transformer is None:
            for m in out:
                if registry.uses_finetuned(m):
                    out[m] = ("needs Attn-QAT weights: start the app with --qat-transformer PATH "
                              "(a diffusers transformer folder or a .safetensors file)")
        return out

    def available_methods(self) -> list[str]:
        return [m for m, why in self.availability().items() if why is None]

    def label(self, method: str) -> str:
        """The method's name on the page (Attn-QAT's says which weights it runs)."""
        return method_label(method, self.models.qat_info)

    def note(self, method: str) -> str:
        """One line under the method's name."""
        return method_note(method, self.models.qat_info)

    @property
    def defaults(self) -> dict[str, Any]:
        """The model's generation defaults, shift filled in."""
        d = dict(self.info.defaults)
        if d.get("shift") is None:
            d["shift"] = default_shift(int(d["height"]), int(d["width"]))
        return d

    def resolution_presets(self) -> list[tuple[str, str]]:
        """(label, value) choices, value ``"WxH"`` (width × height, as Wan writes it), the model's
        default first."""
        d = self.info.defaults
        default = (int(d["width"]), int(d["height"]))
        if self.info.kind == "tiny-wan":
            sizes = [(128, 128, "square"), (224, 128, "landscape"), (128, 224, "portrait"),
                     (64, 64, "quick"), (32, 32, "quickest")]
        else:
            layers = getattr(self.models.pipe.transformer.config, "num_layers", 0)
            sizes = [(832, 480, "480p landscape"), (480, 832, "480p portrait")]
            if layers >= 40:  # 14B: trained at 720p as well
                sizes += [(1280, 720, "720p landscape"), (720, 1280, "720p portrait")]
        out: list[tuple[str, str]] = []
        if default not in [(w, h) for w, h, _ in sizes]:
            sizes.insert(0, (*default, "model default"))
        sizes.sort(key=lambda s: (s[0], s[1]) != default)
        for w, h, what in sizes:
            tag = f"{what}, default" if (w, h) == default else what
            out.append((f"{w}×{h} ({tag})", f"{w}x{h}"))
        return out

    def vocabulary(self) -> set[str] | None:
        """The words the model was trained on, when that is a closed list (the tiny model: the
        words of the synthetic captions, :mod:`attnqat.synthetic`; its tokenizer has more words,
        but it never saw them in training); None for a real Wan model (UMT5 reads any text)."""
        if self.info.kind != "tiny-wan":
            return None
        words = {"a", "an", "on", "and", "background", "grey"}
        for group in (syn.COLOURS, syn.BACKGROUNDS, syn.SHAPES):
            words.update(group)
        for phrase in syn.MOTION_PHRASE.values():
            words.update(phrase.split())
        return words

    def prompt_warning(self, prompt: Any) -> str | None:
        """A warning naming the words of ``prompt`` the model does not know (None: none, or a
        model that reads any text)."""
        vocab = self.vocabulary()
        if vocab is None or not isinstance(prompt, str) or not prompt.strip():
            return None
        unknown = unknown_words(prompt, vocab)
        if not unknown:
            return None
        return (f"The embedded tiny model does not know {', '.join(repr(w) for w in unknown[:12])}"
                f"{' …' if len(unknown) > 12 else ''}: it ignores "
                f"{'them' if len(unknown) > 1 else 'it'}. It draws coloured shapes that move on a "
                "plain background; use the prompt builder or an example.")

    def sweep(self, settings: GenerationSettings, seeds: Sequence[int], *,
              on_step: Callable[[int, StepEvent], None] | None = None,
              cancel: threading.Event | None = None):
        """A seed sweep of ``settings`` (:func:`attnqat.sweep.seed_sweep`) under the generation
        lock, with the procedural score for the tiny model."""
        score, name = None, None
        if self.info.kind == "tiny-wan":
            from attnqat.eval.procedural import score_clip  # noqa: PLC0415  (scipy: only for a sweep of the tiny model)

            score = (lambda prompt, frames: score_clip(prompt, frames)["aggregate"])
            name = "procedural score (tiny model: 0.75·prompt + 0.25·quality)"

        def step(i: int, ev: StepEvent) -> None:
            if cancel is not None and cancel.is_set():
                raise GenerationCancelled("the sweep was stopped")
            if on_step is not None:
                on_step(i, ev)

        with self._lock:
            try:
                return seed_sweep(self.models, settings, seeds, score=score, score_name=name,
                                  on_step=step)
            except GenerationCancelled:
                raise
            except torch.OutOfMemoryError as exc:
                self._after_failure(self.root / ".none")
                raise GenerationFailed(f"Out of memory in the seed sweep at "
                                       f"{size_text(settings)}: try fewer frames or a smaller "
                                       "resolution.") from exc
            except Exception as exc:  # noqa: BLE001 - one message for the page
                traceback.print_exc(file=sys.stderr)
                raise GenerationFailed(f"The seed sweep failed: {type(exc).__name__}: {exc}") from exc

    # -- inputs -------------------------------------------------------------------------------
    def check(self, prompt: Any, methods: Any, seed: Any = -1, steps: Any = None,
              guidance: Any = None, shift: Any = None, resolution: Any = None, frames: Any = None,
              negative_prompt: Any = None, fp4_scope: Any = "self") -> GenerationSettings:
        """The settings a request will run (nothing heavy runs), checked by
        :func:`attnqat.generate.resolve_settings` with the app's limits. None (or an empty text)
        takes the model's default; seed −1 draws one when it runs.

        Raises:
            InvalidInput: with one message per invalid field of :data:`FIELDS`.
        """
        errors: dict[str, str] = {}
        width = height = None
        if resolution is not None and resolution != "":
            try:
                width, height = parse_resolution(resolution)
            except ValueError as exc:
                errors["resolution"] = str(exc)
        if isinstance(methods, str):
            methods = [m for m in methods.split(",") if m.strip()]
        if isinstance(methods, (list, tuple)):
            avail = self.availability()
            blocked = [m for m in methods if avail.get(m)]
            if blocked:
                errors["methods"] = "; ".join(f"{self.label(m)} cannot run: {avail[m]}" for m in blocked)
            elif len(set(methods)) == len(methods) and set(methods) <= set(registry.generation()):
                methods = [m for m in registry.generation() if m in methods]  # display order
        blank = (lambda v: None if v is None or (isinstance(v, str) and not v.strip()) else v)
        request = GenerationRequest(
            prompt=prompt if not isinstance(prompt, str) else prompt.strip(),
            negative_prompt=negative_prompt, methods=methods if methods is not None else [],
            seed=-1 if blank(seed) is None else seed, steps=blank(steps), guidance=blank(guidance),
            shift=blank(shift), height=height, width=width, frames=blank(frames), fp4_scope=fp4_scope)
        try:
            settings, _ = resolve_settings(request, models=self.models, limits=self.limits)
        except InvalidInput as exc:
            for k, v in page_errors(exc).items():
                errors.setdefault(k, v)
            settings = None
        if errors:
            raise InvalidInput({k: errors[k] for k in FIELDS if k in errors})
        return settings

    def field_errors(self, *values: Any) -> dict[str, str]:
        """``check`` on values in :data:`FIELDS` order; {} when they are valid."""
        try:
            self.check(*values[:len(FIELDS)])
        except InvalidInput as exc:
            return exc.errors
        return {}

    # -- generation ---------------------------------------------------------------------------
    def runs_weights_reference(self, settings: GenerationSettings) -> bool:
        """Whether a generation of ``settings`` also runs the Attn-QAT weights with BF16 attention
        (the reference of Attn-QAT's 4-bit error; :func:`attnqat.generate.run_methods`)."""
        qat = self.models.qat_info or {}
        return (any(registry.uses_finetuned(m) for m in settings.methods)
                and not (qat.get("identical_to_base") and registry.REFERENCE in settings.methods))

    def new_progress(self, settings: GenerationSettings) -> Progress:
        rows = list(settings.methods)
        labels = {m: self.label(m) for m in settings.methods}
        if self.runs_weights_reference(settings):
            rows.append(WEIGHTS_REFERENCE)
            labels[WEIGHTS_REFERENCE] = REFERENCE_LABEL
        return Progress(rows, settings.steps, labels, cost_ratio=self.cost_ratio)

    def _learn_costs(self, record: GenerationRecord) -> None:
        """Remember each kind of attention's time per step relative to BF16 (for estimates)."""
        per = {}
        for m, r in [*record.methods.items(), *record.references.items()]:
            if r.timings.denoising_s:
                per[attention_kind(m)] = r.timings.denoising_s
        base = per.get(registry.REFERENCE)
        if base:
            self.cost_ratio.update({k: v / base for k, v in per.items()})

    def run(self, settings: GenerationSettings, *, progress: Progress | None = None,
            cancel: threading.Event | None = None, error_map: bool = False) -> RunOutput:
        """Generate ``settings`` (from :meth:`check`) into a new request folder (one generation at
        a time).

        Raises:
            GenerationFailed: with a message for the page (out of memory, any other failure).
            GenerationCancelled: ``cancel`` was set (checked at every step).
        """
        progress = progress or self.new_progress(settings)
        with self._lock:
            if cancel is not None and cancel.is_set():
                raise GenerationCancelled("the request was stopped before it started")
            progress.set_phase("text")
            try:
                out = self._run_locked(settings, progress, cancel, error_map)
            except BaseException:
                progress.set_phase("failed")
                raise
            progress.set_phase("done")
            return out

    def _step_callback(self, progress: Progress, cancel: threading.Event | None):
        fault = self.fault
        fired: list[bool] = []

        def on_step(event: StepEvent) -> None:
            if cancel is not None and cancel.is_set():
                raise GenerationCancelled("the request was stopped")
            progress.on_step(event)
            if (fault is not None and not fired and event.phase == "denoising" and event.step == 0
                    and fault.method in (None, event.method)):
                fired.append(True)
                raise fault.exception(event.method)

        return on_step

    def _run_locked(self, settings: GenerationSettings, progress: Progress,
                    cancel: threading.Event | None, error_map: bool = False) -> RunOutput:
        run_id = _stamp()
        folder = self.runs_root / run_id
        t0 = time.monotonic()
        try:
            result = run_methods(self.models, settings, progress=False,
                                 on_step=self._step_callback(progress, cancel), error_map=error_map)
            write_outputs(result, settings, folder)
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
            raise GenerationFailed(f"Out of memory {where} at {size_text(settings)} "
                                   f"(width×height×frames): {hint}.") from exc
        except GenerationError as exc:
            self._after_failure(folder)
            raise GenerationFailed(str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - every failure becomes one message
            method = progress.current_method()
            self._after_failure(folder)
            traceback.print_exc(file=sys.stderr)
            where = f" with {method}" if method else " while encoding the prompt"
            raise GenerationFailed(f"Generation failed{where} at {size_text(settings)}: "
                                   f"{type(exc).__name__}: {exc}") from exc
        folder = Path(result.out)
        media_dir = self.media_root / _stamp()
        media_dir.mkdir()
        clips = {m: folder / result.record.methods[m].video for m in settings.methods}
        media = {}
        for m, path in clips.items():
            dst = media_dir / f"{secrets.token_hex(8)}.mp4"
            _link_or_copy(path, dst)
            media[m] = dst
        downloads_dir = self.downloads_root / _stamp()  # drawn apart from the media folder
        downloads_dir.mkdir()
        downloads = {}
        for m, path in clips.items():
            dst = downloads_dir / f"{m}_{slug(settings.prompt)}_seed{result.record.seed}.mp4"
            _link_or_copy(path, dst)
            downloads[m] = dst
        self.runs_done += 1
        self._learn_costs(result.record)
        out = RunOutput(run_id=run_id, folder=folder, record=result.record, clips=clips,
                        side_by_side=folder / result.record.side_by_side,
                        record_path=folder / "record.json", media=media,
                        seconds=time.monotonic() - t0, downloads=downloads, settings=settings)
        self.prune()
        return out

    def _after_failure(self, folder: Path) -> None:
        shutil.rmtree(folder, ignore_errors=True)  # generate writes nothing on failure; be sure
        gc.collect()
        if self.models.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- files --------------------------------------------------------------------------------
    def sweeps_folder(self) -> Path:
        """A new folder for a seed sweep's table and plot (old ones are pruned like results)."""
        folder = self.sweeps_root / _stamp()
        folder.mkdir()
        self.prune()
        return folder

    def prune(self) -> list[Path]:
        """Delete all but the ``keep`` newest results (only folders named like the app's own).
        Returns the folders deleted."""
        removed: list[Path] = []
        for sub in (self.runs_root, self.media_root, self.downloads_root, self.sweeps_root):
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
                 device: str = "auto", dtype: str = "auto", offload: bool = False,
                 output_dir: str | Path | None = None, keep: int = 20, fault: Fault | None = None,
                 log: Callable[[str], None] | None = None) -> AppService:
    """Load the models once and return the service (``qat_transformer="auto"``: the one the model
    folder names, if any; ``dtype="auto"``: what the device runs natively)."""
    t0 = time.perf_counter()
    models = load_models(model or DEFAULT_MODEL, qat_transformer=qat_transformer, device=device,
                         offload=offload, dtype=dtype)
    if log is not None:
        log(f"loaded {models.info.source} on {models.device} in {time.perf_counter() - t0:.1f} s, "
            f"computing in {dtype_name(models.dtype)} ({models.dtype_reason})")
    return AppService(models, output_dir=output_dir, keep=keep, fault=fault)


__all__ = ["APP_LIMITS", "AppService", "REFERENCE_LABEL", "attention_kind", "slug", "unknown_words", "FAULT_ENV", "FIELDS", "FIELD_NAMES", "Fault",
           "GenerationCancelled", "GenerationFailed", "METHOD_NOTES", "Progress", "RunOutput",
           "describe_errors", "load_service", "method_note", "page_errors", "parse_resolution",
           "size_text"]
