"""Wan 2.1 in diffusers with the project's attention methods.

Two jobs:

1. **Attention routing.** :class:`AttnQATProcessor` is a diffusers attention processor for
   :class:`~diffusers.WanTransformer3DModel`. Installed through the public
   ``transformer.set_attn_processor`` (:func:`install_attention`), it computes Q, K, V exactly as
   diffusers' ``WanAttnProcessor`` does (projections, RMSNorm, RoPE) and sends the attention itself to
   :func:`attnqat.attention` with the method it holds. Self-attention gets the processor's method;
   cross-attention (text keys) gets it too only when ``fp4_scope == "all"`` and plain ``bf16``
   attention otherwise (the published Attn-QAT recipe quantizes self-attention only). The method lives
   on the processor object of that one transformer: :func:`set_method` changes it in place, without
   reloading weights, and no module-level state is involved. The processor counts its calls and the
   time spent inside them (CUDA events on the GPU, ``perf_counter`` on the CPU).

2. **Loading.** :func:`load_models` loads a Wan 2.1 text-to-video pipeline in diffusers format from a
   local folder (offline) or a hub id, with the transformer and text encoder in the compute dtype the
   device runs natively (:func:`resolve_dtype`: BF16 on CUDA and on CPUs with BF16 instructions, FP32
   on other CPUs) and the VAE in FP32, and optionally a second, Attn-QAT transformer that shares the
   text encoder, VAE and scheduler (:func:`attnqat.convert.load_wan_transformer`: any of the three
   naming schemes, checked). :func:`model_info` reads a model's generation defaults without loading
   any weights, so inputs can be validated first.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from . import methods as registry
from .attention import BACKENDS, DispatchLog, attention, dispatch_log
from .convert import load_wan_transformer
from .family import WAN21_T2V, WAN_NEGATIVE_PROMPT, ModelFamily, by_pipeline_class, families
from .parallel import ulysses_attention
from .reference import check_ablation
from . import sidecar as sc
from .tiny import TINY_MODEL_DIR

FP4_SCOPES = ("self", "all")
_MAX_PENDING_EVENTS = 4096  # CUDA event pairs kept before they are summed (one sync per 4096 calls)
DEFAULT_MODEL = str(TINY_MODEL_DIR)

#: Generation defaults of the real Wan 2.1 text-to-video models (480p; shift 5 at 720p and above):
#: the family's (:data:`attnqat.family.WAN21_T2V`)
WAN_DEFAULTS: dict[str, Any] = dict(WAN21_T2V.defaults)


class ModelLoadError(RuntimeError):
    """A model could not be found or loaded; the message says which and why."""


# ----------------------------------------------------------------------------------------------
# Attention routing
# ----------------------------------------------------------------------------------------------

def _apply_rotary(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on (B, S, H, D), interleaved pairs; same arithmetic as diffusers."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def _check_method(method: str) -> None:
    registry.get(method)


def _check_scope(scope: str) -> None:
    if scope not in FP4_SCOPES:
        raise ValueError(f"unknown fp4 scope {scope!r}; expected 'self' (self-attention only, "
                         "cross-attention in bf16) or 'all'")


class AttnQATProcessor:
    """Attention processor for ``WanAttention`` that calls :func:`attnqat.attention`.

    One instance serves every attention module of a transformer (installed by
    :func:`install_attention`). Attributes ``method``, ``fp4_scope`` and ``backend`` may be changed
    at any time (:func:`set_method`); the next call uses them.

    Args:
        method: attention method for self-attention (a name of :mod:`attnqat.methods`).
        fp4_scope: ``"self"`` — cross-attention runs ``bf16``; ``"all"`` — cross-attention runs
            ``method`` too.
        backend: passed to :func:`attnqat.attention` (``auto`` | ``torch`` | ``triton``) for the
            4-bit calls; ``bf16`` calls always run PyTorch SDPA (no Triton kernel exists for them).
        timing: measure the time spent inside the attention calls (inference; training and
            ``torch.compile`` turn it off).
        ablation: an Attn-QAT backward ablation (:data:`attnqat.reference.ABLATIONS`) applied to
            the calls that run ``attnqat`` (training studies; PyTorch reference only).

    Attribute ``observer``, when set, is called as ``observer(q, k, v, out, kind)`` after every
    attention call (``kind``: ``"self"`` or ``"cross"``; tensors (B, S, H, D)) — measurements of
    what the attention sees, e.g. :mod:`attnqat.finetune.attn_probe`.

    Attribute ``sp_group`` (an :class:`attnqat.parallel.SPGroup`, set by
    :func:`attnqat.parallel.enable_sequence_parallel`) makes the calls sequence-parallel: this
    rank's tokens in, an all-to-all to the whole sequence for its heads around the attention (the
    observer then sees those (B, S, H/sp, D) tensors), this rank's tokens out.
    """

    def __init__(self, method: str = "bf16", fp4_scope: str = "self", backend: str = "auto",
                 timing: bool = True, ablation: str | None = None) -> None:
        _check_method(method)
        _check_scope(fp4_scope)
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
        check_ablation(ablation)
        self.method = method
        self.fp4_scope = fp4_scope
        self.backend = backend
        self.timing = timing
        self.ablation = ablation
        self.observer: Callable[..., None] | None = None
        self.sp_group = None  # attnqat.parallel.SPGroup: Ulysses sequence parallelism (parallel.py)
        self.reset_stats()

    # -- bookkeeping --------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Forget the call counts and timings gathered so far."""
        self.calls: dict[str, int] = {"self": 0, "cross": 0}
        self.calls_by_method: dict[str, int] = {}
        # what each call ran, by kind (attnqat.attention.dispatch_log; not kept without timing)
        self.dispatch = {"self": DispatchLog(), "cross": DispatchLog()}
        self._cpu_seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def method_for(self, kind: str) -> str:
        """The attention method a call of ``kind`` (``"self"`` or ``"cross"``) runs now."""
        if kind == "self" or self.fp4_scope == "all":
            return self.method
        return registry.REFERENCE

    def _fold_events(self) -> None:
        """Turn the recorded CUDA event pairs into seconds (one synchronization) and drop them."""
        if self._events:
            self._events[-1][1].synchronize()
            self._cpu_seconds += sum(a.elapsed_time(b) for a, b in self._events) / 1000.0
            self._events.clear()

    def attention_seconds(self) -> float:
        """Seconds spent inside attention calls since the last :meth:`reset_stats` (synchronizes
        CUDA when GPU events were recorded)."""
        self._fold_events()
        return self._cpu_seconds

    def stats(self) -> dict[str, Any]:
        """Counts and time: ``{"calls": {"self", "cross"}, "calls_by_method": {...},
        "attention_s": float | None, "dispatch": [...]}`` (``None`` when timing is off;
        ``dispatch``: :meth:`attnqat.attention.DispatchLog.entries`, each with its ``kind``)."""
        return {"calls": dict(self.calls), "calls_by_method": dict(self.calls_by_method),
                "attention_s": self.attention_seconds() if self.timing else None,
                "dispatch": [{"kind": kind, **e} for kind, log in self.dispatch.items()
                             for e in log.entries()]}

    # -- the processor ------------------------------------------------------------------------
    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str) -> torch.Tensor:
        method = self.method_for(kind)
        self.calls[kind] += 1
        key = f"{kind}:{method}"
        self.calls_by_method[key] = self.calls_by_method.get(key, 0) + 1
        if not self.timing:
            out = self._call(q, k, v, method)
        elif q.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            with dispatch_log(self.dispatch[kind]):
                out = self._call(q, k, v, method)
            end.record()
            self._events.append((start, end))
            if len(self._events) >= _MAX_PENDING_EVENTS:  # long runs (training): bounded memory
                self._fold_events()
        else:
            t0 = time.perf_counter()
            with dispatch_log(self.dispatch[kind]):
                out = self._call(q, k, v, method)
            self._cpu_seconds += time.perf_counter() - t0
        if self.observer is not None:
            self.observer(q, k, v, out, kind)
        return out

    def _call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, method: str) -> torch.Tensor:
        # a method without a fused kernel (plain attention: cross-attention under scope "self") runs
        # its PyTorch reference whatever the backend, so backend="triton" means "the kernels for the
        # calls of methods that have them"
        m = registry.get(method)
        backend = "auto" if m.kernel is None else self.backend
        if self.ablation is not None and self.ablation in m.ablations:
            return attention(q, k, v, method=method, backend=backend, ablation=self.ablation)
        return attention(q, k, v, method=method, backend=backend)

    def __call__(self, attn, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                 **kwargs: Any) -> torch.Tensor:
        if attention_mask is not None:
            raise NotImplementedError("AttnQATProcessor does not take an attention mask (Wan 2.1 "
                                      "text-to-video passes none)")
        if getattr(attn, "add_k_proj", None) is not None:
            raise NotImplementedError("image-conditioned Wan models (added K/V projections) are not "
                                      "supported; use a text-to-video checkpoint")
        kind = "self" if encoder_hidden_states is None else "cross"
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        if getattr(attn, "fused_projections", False):
            if kind == "self":
                query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
            else:
                query = attn.to_q(hidden_states)
                key, value = attn.to_kv(context).chunk(2, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)

        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query = _apply_rotary(query, *rotary_emb)
            key = _apply_rotary(key, *rotary_emb)

        if self.sp_group is None:
            out = self._attend(query, key, value, kind)  # (B, S, H, D)
        else:  # this rank's tokens; all-to-all to its heads over the whole sequence and back
            out = ulysses_attention(self._attend, query, key, value, kind, self.sp_group)
        out = out.flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)

    def __repr__(self) -> str:
        return (f"AttnQATProcessor(method={self.method!r}, fp4_scope={self.fp4_scope!r}, "
                f"backend={self.backend!r}" + (f", ablation={self.ablation!r})" if self.ablation else ")"))


def get_processor(transformer: torch.nn.Module) -> AttnQATProcessor | None:
    """The :class:`AttnQATProcessor` installed on ``transformer``, or None."""
    procs = list(transformer.attn_processors.values())
    if procs and all(isinstance(p, AttnQATProcessor) for p in procs):
        first = procs[0]
        if all(p is first for p in procs):
            return first
    return None


def install_attention(transformer: torch.nn.Module, method: str = "bf16", *,
                      fp4_scope: str = "self", backend: str = "auto",
                      timing: bool = True, ablation: str | None = None) -> AttnQATProcessor:
    """Install one :class:`AttnQATProcessor` on every attention module of a Wan transformer.

    Uses the public ``set_attn_processor`` (works with autograd and gradient checkpointing). Returns
    the processor; change its method with :func:`set_method`.
    """
    if not hasattr(transformer, "set_attn_processor"):
        raise TypeError(f"expected a diffusers WanTransformer3DModel, got {type(transformer).__name__}")
    proc = AttnQATProcessor(method, fp4_scope, backend, timing, ablation)
    transformer.set_attn_processor(proc)
    return proc


def set_method(transformer: torch.nn.Module, method: str, *, fp4_scope: str | None = None,
               backend: str | None = None) -> AttnQATProcessor:
    """Route ``transformer``'s attention to ``method`` (installing the processor on first use).

    Cheap: only the processor's attributes change. ``fp4_scope``/``backend`` left as None keep
    their current values (``"self"``/``"auto"`` on first install).
    """
    _check_method(method)
    if fp4_scope is not None:
        _check_scope(fp4_scope)
    proc = get_processor(transformer)
    if proc is None:
        return install_attention(transformer, method, fp4_scope=fp4_scope or "self",
                                 backend=backend or "auto")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    proc.method = method
    if fp4_scope is not None:
        proc.fp4_scope = fp4_scope
    if backend is not None:
        proc.backend = backend
    return proc


def uninstall_attention(transformer: torch.nn.Module) -> None:
    """Put diffusers' own ``WanAttnProcessor`` back on every attention module."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    transformer.set_attn_processor(WanAttnProcessor())


# ----------------------------------------------------------------------------------------------
# Devices
# ----------------------------------------------------------------------------------------------

def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` → ``cuda`` if available else ``cpu``; ``cuda[:N]`` checked to exist."""
    name = str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {name!r}; expected auto, cpu, cuda or cuda:N") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this PyTorch build has no CUDA support" if torch.version.cuda is None
                   else "no CUDA GPU is visible")
            raise ValueError(f"device {name!r} requested but CUDA is not available on this machine "
                             f"({why}); use --device cpu or --device auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} requested but only {torch.cuda.device_count()} CUDA "
                             "device(s) are visible")
    elif dev.type != "cpu":
        raise ValueError(f"unsupported device {name!r}; expected auto, cpu, cuda or cuda:N")
    return dev


# ----------------------------------------------------------------------------------------------
# Compute dtype
# ----------------------------------------------------------------------------------------------

#: ``dtype`` values :func:`resolve_dtype` takes (``auto``: what the device runs natively).
DTYPE_CHOICES = ("auto", "bfloat16", "float32")
_DTYPE_NAMES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
                "fp32": torch.float32}
#: oneDNN ISA caps (``ONEDNN_MAX_CPU_ISA``) that still include the BF16 instructions.
_ONEDNN_BF16_ISAS = ("ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX",
                     "AVX512_CORE_AMX_FP16", "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16",
                     "AVX10_2_512", "AVX10_2_512_AMX_2")


def cpu_bf16_support() -> tuple[bool, str]:
    """Whether this CPU runs BF16 matrix products natively, and a sentence saying why.

    Native means AVX512-BF16 or AMX instructions that PyTorch's CPU kernels (and oneDNN) are allowed
    to use: ``ATEN_CPU_CAPABILITY`` below AVX512 or an ``ONEDNN_MAX_CPU_ISA`` cap without BF16 turn
    them off. Without them a BF16 matmul is emulated and several times slower than FP32 (measured on
    an AVX2 CPU: a 1152×256×1024 linear layer 38–60 ms in BF16, 5–7 ms in FP32).
    """
    capability = str(torch.backends.cpu.get_cpu_capability())
    has_bf16 = any(bool(getattr(torch.cpu, name, lambda: False)())
                   for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    if not has_bf16:
        return False, f"this CPU has no BF16 instructions (PyTorch CPU capability {capability})"
    if not capability.upper().startswith("AVX512"):
        return False, (f"PyTorch runs this CPU at capability {capability}, without its BF16 "
                       "instructions")
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    if cap and cap not in _ONEDNN_BF16_ISAS:
        return False, f"oneDNN is capped at {cap} (ONEDNN_MAX_CPU_ISA), below its BF16 instructions"
    return True, f"this CPU has BF16 instructions (AVX512-BF16/AMX, PyTorch capability {capability})"


def resolve_dtype(dtype: str | torch.dtype = "auto",
                  device: str | torch.device = "cpu") -> tuple[torch.dtype, str]:
    """The compute dtype of the transformer and text encoder, and why it was chosen.

    ``auto`` picks what ``device`` runs natively: BF16 on CUDA GPUs that support it (FP32 on older
    ones) and on CPUs with BF16 instructions (:func:`cpu_bf16_support`), FP32 on other CPUs. An
    explicit ``bfloat16``/``float32`` (or the torch dtype) is taken as asked. The VAE always runs
    in FP32. Whatever the dtype, the ``bf16`` attention method means attention without quantization.

    Raises:
        ValueError: an unknown ``dtype``.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"dtype must be bfloat16 or float32, got {dtype}")
        return dtype, "asked for"
    name = str(dtype).lower()
    if name in _DTYPE_NAMES:
        return _DTYPE_NAMES[name], "asked for"
    if name != "auto":
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_CHOICES)}")
    dev = torch.device(device)
    if dev.type == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return torch.bfloat16, "CUDA GPU with BF16 support"
        return torch.float32, "this CUDA GPU has no BF16 support"
    native, why = cpu_bf16_support()
    return (torch.bfloat16 if native else torch.float32), why


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------------------------
# Model information (no weights loaded)
# ----------------------------------------------------------------------------------------------

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass
class ModelInfo:
    """What is known about a model before loading it.

    Attributes:
        family: the model's family (:mod:`attnqat.family`) with the factors its configs declare.
        source: the ``--model`` value as given.
        path: the local folder, or None for a hub id.
        kind: ``"tiny-wan"`` for the embedded model (or one built like it), else ``"wan"``.
        defaults: generation defaults (height, width, frames, fps, steps, guidance, shift; shift
            None means "3 below 720p, 5 at 720p and above").
        qat_transformer: the Attn-QAT transformer the model folder names in its sidecar, if any.
        weights_note: the sidecar's note on the weights, if any.
    """

    source: str
    path: Path | None
    kind: str
    defaults: dict[str, Any]
    qat_transformer: Path | None = None
    weights_note: str | None = None
    sidecar: sc.Sidecar | None = None
    family: ModelFamily = WAN21_T2V


def model_info(model: str | Path = DEFAULT_MODEL) -> ModelInfo:
    """Locate ``model`` (a local diffusers folder or a hub id) and read its defaults, without
    loading any weights.

    Raises:
        ModelLoadError: the folder does not exist (and the name is not a hub id), or is not a
            diffusers Wan text-to-video pipeline folder.
    """
    source = str(model)
    path = Path(source).expanduser()
    if not path.exists():
        looks_local = (source.startswith((".", "/", "~")) or source.count("/") != 1
                       or not _HUB_ID.match(source))
        if looks_local:
            raise ModelLoadError(f"model folder not found: {source} (expected a diffusers Wan 2.1 "
                                 "pipeline folder with a model_index.json, or a hub id such as "
                                 "Wan-AI/Wan2.1-T2V-1.3B-Diffusers)")
        return ModelInfo(source=source, path=None, kind="wan", defaults=dict(WAN21_T2V.defaults))
    if not path.is_dir():
        raise ModelLoadError(f"--model must be a folder in diffusers format, got a file: {source}")
    index = path / "model_index.json"
    if not index.is_file():
        raise ModelLoadError(f"{source} is not a diffusers pipeline folder: model_index.json is missing")
    try:
        cls = json.loads(index.read_text()).get("_class_name")
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {index}: {exc}") from exc
    fam = by_pipeline_class(cls)
    if fam is None:
        known = " or ".join(f"a {f.label} {f.pipeline_class!r}" for f in families())
        raise ModelLoadError(f"{source} holds a {cls!r}, expected {known}")
    fam = fam.with_configs(path)
    try:
        side = sc.read(path) or sc.Sidecar()
    except sc.SidecarError as exc:
        raise ModelLoadError(str(exc)) from exc
    defaults = dict(fam.defaults)
    if side.kind != "wan":  # Wan's negative prompt is written for Wan's text encoder, not for others
        defaults["negative_prompt"] = ""
    defaults.update(side.defaults)
    qat = side.qat_transformer
    return ModelInfo(source=source, path=path.resolve(), kind=side.kind,
                     defaults=defaults,
                     qat_transformer=(path / qat).resolve() if qat else None,
                     weights_note=side.weights_note, sidecar=side, family=fam)


def default_shift(height: int, width: int, family: ModelFamily = WAN21_T2V) -> float:
    """The family's flow shift for this size (Wan 2.1: 3 below 720p, 5 at 720p and above)."""
    return family.shift_for(height, width)


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------

def _dtype_kwarg(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Recent diffusers name the ``from_pretrained`` argument ``dtype`` (``torch_dtype`` is
    deprecated); older releases only know ``torch_dtype``."""
    try:
        from diffusers.utils.deprecation_utils import _resolve_dtype  # noqa: F401
    except ImportError:
        return {"torch_dtype": dtype}
    return {"dtype": dtype}


def _hf_dtype_kwarg(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """transformers ≥ 4.56 takes ``dtype``; older releases ``torch_dtype``."""
    import transformers
    from packaging.version import Version

    new = Version(transformers.__version__).release >= (4, 56)
    return {"dtype": dtype} if new else {"torch_dtype": dtype}


@contextlib.contextmanager
def _quiet_loading() -> Iterator[None]:
    """Silence diffusers' and transformers' loading progress bars and info logs."""
    from diffusers.utils import logging as dlog
    from transformers.utils import logging as tlog

    dv, tv = dlog.get_verbosity(), tlog.get_verbosity()
    dbar, tbar = dlog.is_progress_bar_enabled(), tlog.is_progress_bar_enabled()
    dlog.set_verbosity_error()
    tlog.set_verbosity_error()
    dlog.disable_progress_bar()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        dlog.set_verbosity(dv)
        tlog.set_verbosity(tv)
        if dbar:
            dlog.enable_progress_bar()
        if tbar:
            tlog.enable_progress_bar()


@dataclass
class WanModels:
    """A loaded Wan pipeline plus, optionally, its Attn-QAT transformer.

    ``pipe`` is a diffusers :class:`~diffusers.WanPipeline`; ``qat_transformer`` shares its text
    encoder, VAE and scheduler. ``dtype`` is the compute dtype of the transformers and the text
    encoder (the VAE runs in FP32) and ``dtype_reason`` why it was chosen (:func:`resolve_dtype`).
    With ``offload`` the components stay on the CPU and :meth:`on_device` moves each to ``device``
    only while it is used.
    """

    pipe: Any
    device: torch.device
    info: ModelInfo
    qat_transformer: Any = None
    qat_info: dict[str, Any] | None = None
    offload: bool = False
    dtype: torch.dtype = torch.bfloat16
    dtype_reason: str = ""

    @contextlib.contextmanager
    def on_device(self, module: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """Context in which ``module`` is on :attr:`device` (a no-op unless offloading)."""
        if not self.offload:
            yield module
            return
        module.to(self.device)
        try:
            yield module
        finally:
            module.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def transformer_for(self, slot: str):
        """The transformer a generation slot runs: the Attn-QAT one for ``attnqat``, else the base."""
        if registry.uses_finetuned(slot):
            if self.qat_transformer is None:
                raise ValueError(f"method {slot!r} needs an Attn-QAT transformer (--qat-transformer)")
            return self.qat_transformer
        return self.pipe.transformer


def _onednn_conv3d(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """``Conv3d._conv_forward`` through oneDNN for FP32 inference on the CPU.

    PyTorch's convolution dispatch sends small 5-D FP32 inputs (batch × channels × time × height
    below 20,480) to its single-threaded ``slow_conv3d`` path, and Wan's VAE decodes one latent frame
    at a time, so every convolution of the decoder lands there. oneDNN computes the same convolution
    3–6× faster on these shapes (the same numbers up to summation order); anything else
    (CUDA, other dtypes, autograd) takes the module's own path.
    """
    if (input.device.type == "cpu" and input.dtype == torch.float32 and weight.dtype == torch.float32
            and not torch.is_grad_enabled()):
        return torch.mkldnn_convolution(input.contiguous(), weight, bias, self.padding, self.stride,
                                        self.dilation, self.groups)
    return torch.nn.Conv3d._conv_forward(self, input, weight, bias)


def _fast_cpu_vae(vae: torch.nn.Module) -> int:
    """Route the FP32 CPU convolutions of a Wan VAE through oneDNN (:func:`_onednn_conv3d`).

    Returns the number of convolutions rerouted (0 where oneDNN is not available)."""
    if not (hasattr(torch, "mkldnn_convolution") and torch.backends.mkldnn.is_available()):
        return 0
    n = 0
    for m in vae.modules():
        if isinstance(m, torch.nn.Conv3d) and m.padding_mode == "zeros" and isinstance(m.padding, tuple):
            m._conv_forward = types.MethodType(_onednn_conv3d, m)
            n += 1
    return n


def load_pipeline(model: str | Path = DEFAULT_MODEL, *, device: str | torch.device = "auto",
                  offload: bool = False, dtype: str | torch.dtype = "auto"):
    """Load a Wan 2.1 text-to-video :class:`~diffusers.WanPipeline` (local folder or hub id).

    The transformer and text encoder are loaded in ``dtype`` (:func:`resolve_dtype`; ``auto``: what
    the device runs natively; diffusers keeps the transformer's norms, time embedder and modulation
    tables in FP32), the VAE in FP32. A local folder is read with ``local_files_only``. Without
    ``offload`` the whole pipeline is moved to ``device``.

    Raises:
        ModelLoadError: with the model name and the reason.
    """
    info = model_info(model)
    dev = resolve_device(device)
    dt, _ = resolve_dtype(dtype, dev)
    return _load_pipeline(info, dev, offload, dt)


def _load_pipeline(info: ModelInfo, dev: torch.device, offload: bool, dtype: torch.dtype):
    from diffusers import AutoencoderKLWan, WanPipeline
    from transformers import UMT5EncoderModel

    where = str(info.path) if info.path is not None else info.source
    local = {"local_files_only": True} if info.path is not None else {}
    try:
        with _quiet_loading():
            vae = AutoencoderKLWan.from_pretrained(where, subfolder="vae",
                                                   **_dtype_kwarg(torch.float32), **local)
            text_encoder = UMT5EncoderModel.from_pretrained(where, subfolder="text_encoder",
                                                            **_hf_dtype_kwarg(dtype), **local)
            pipe = WanPipeline.from_pretrained(where, vae=vae, text_encoder=text_encoder,
                                               **_dtype_kwarg(dtype), **local)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear message
        hint = "" if info.path is not None else (
            " (not a local folder; fetching it from the hub failed — pass a local folder to work "
            "offline)")
        raise ModelLoadError(f"could not load the Wan pipeline from {info.source}{hint}: "
                             f"{type(exc).__name__}: {exc}") from exc
    if pipe.transformer is None:
        raise ModelLoadError(f"{info.source} has no transformer")
    for m in (pipe.transformer, pipe.text_encoder, pipe.vae):
        m.eval()
        m.requires_grad_(False)
    _fast_cpu_vae(pipe.vae)
    pipe.set_progress_bar_config(disable=True)
    if not offload:
        pipe.to(dev)
    return pipe


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys():
        return False
    return all(sa[k].shape == sb[k].shape and torch.equal(sa[k], sb[k].to(sa[k].device)) for k in sa)


#: The Attn-QAT method's name on the page and in summaries, by what its weights are.
QAT_LABEL_FINE_TUNED = "Attn-QAT fine-tuned"
QAT_LABEL_BASE_COPY = "Attn-QAT (base weights copy — not fine-tuned)"
#: ``weights`` of a transformer folder's ``attnqat.json`` as ``attnqat finetune export`` writes
#: it, by the student attention it was fine-tuned with (the built-in methods; the registry,
#: :attr:`attnqat.methods.AttentionMethod.finetuned_weights`, has every method's)
FINETUNED_WEIGHTS = {m.name: m.finetuned_weights for m in registry.all_methods() if m.trainable}
#: labels of fine-tuned weights that are not Attn-QAT (loaded in the Attn-QAT slot, they say so)
QAT_LABEL_NOT_ATTNQAT = {m.finetuned_weights: m.finetuned_label for m in registry.all_methods()
                         if m.trainable and m.finetuned_label}


def load_models(model: str | Path = DEFAULT_MODEL, *, qat_transformer: str | Path | None = None,
                device: str | torch.device = "auto", offload: bool = False,
                dtype: str | torch.dtype = "auto") -> WanModels:
    """Load the base pipeline and, if given, an Attn-QAT transformer beside it.

    Args:
        model: local diffusers folder or hub id (default: the embedded tiny model).
        qat_transformer: a diffusers transformer folder or one ``.safetensors`` file in the
            diffusers, FastVideo or original-Wan naming scheme; ``"auto"`` takes the one the model
            folder names in its ``attnqat.json`` (the embedded tiny model has one).
        device: ``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``.
        offload: keep components on the CPU and move each to the device only while it runs.
        dtype: compute dtype of both transformers and the text encoder: ``auto`` (what the device
            runs natively, :func:`resolve_dtype`), ``bfloat16`` or ``float32``.

    Returns:
        :class:`WanModels`. ``qat_info`` holds the checkpoint's location (``checkpoint``), the naming
        scheme found, the folder's note on the weights, whether they are identical to the base
        transformer's (``identical_to_base``), whether they are fine-tuned (``fine_tuned``: False
        when identical to the base or when the folder says they are a copy of the base) and the
        name the method goes by (``label``).
    """
    info = model_info(model)
    dev = resolve_device(device)
    dt, why = resolve_dtype(dtype, dev)
    qat_path: Path | None = None
    if qat_transformer == "auto":
        qat_path = info.qat_transformer
    elif qat_transformer is not None:
        qat_path = Path(qat_transformer).expanduser()
        if not qat_path.exists():
            raise ModelLoadError(f"Attn-QAT transformer not found: {qat_transformer}")
    pipe = _load_pipeline(info, dev, offload, dt)
    models = WanModels(pipe=pipe, device=dev, info=info, offload=offload, dtype=dt, dtype_reason=why)
    if qat_path is not None and is_lora(qat_path):
        models.qat_transformer, models.qat_info = _lora_transformer(pipe, qat_path)
    elif qat_path is not None:
        qat, ckpt = load_wan_transformer(qat_path, config=dict(pipe.transformer.config), dtype=dt)
        qat.eval()
        qat.requires_grad_(False)
        base_device = next(pipe.transformer.parameters()).device
        qat.to(base_device)
        identical = _same_weights(qat, pipe.transformer)
        note = ckpt.note
        if identical:
            note = ("the Attn-QAT transformer's weights are identical to the base transformer's: "
                    "no QAT fine-tuning has been applied, so the attnqat clip is plain NVFP4 "
                    "attention on the base model (the same clip as nvfp4)")
        kind = ckpt.weights  # what the folder's attnqat.json says they are, if it says
        # weights without a record (e.g. a published checkpoint) count as Attn-QAT fine-tuned
        # when they differ from the base; a record that says otherwise is believed
        trained_with = registry.by_finetuned_weights(kind)
        not_attnqat = trained_with.finetuned_label if trained_with is not None else None
        fine_tuned = not identical and kind != "copy-of-base" and not_attnqat is None
        label = (not_attnqat if not identical and not_attnqat
                 else QAT_LABEL_FINE_TUNED if fine_tuned else QAT_LABEL_BASE_COPY)
        models.qat_transformer = qat
        models.qat_info = {"checkpoint": str(qat_path.resolve()), "scheme": ckpt.scheme,
                           "prefix_stripped": ckpt.prefix, "note": note, "folder_note": ckpt.note,
                           "identical_to_base": identical, "fine_tuned": fine_tuned, "label": label}
    return models


def is_lora(path: Path) -> bool:
    """A LoRA adapter (diffusers' ``pytorch_lora_weights.safetensors``, or a folder holding one)
    rather than transformer weights."""
    from .lora import LORA_FILE

    return path.name == LORA_FILE or (path.is_dir() and (path / LORA_FILE).is_file())


def _lora_transformer(pipe, path: Path):
    """The base transformer with the adapter at ``path`` fused in, through diffusers'
    ``load_lora_weights``; and its ``qat_info`` (label from the adapter folder's attnqat.json)."""
    import copy

    from diffusers import WanPipeline

    from .lora import fuse_lora_file

    qat = copy.deepcopy(pipe.transformer)
    holder = WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=qat,
                         scheduler=pipe.scheduler)
    try:
        fuse_lora_file(holder, path)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load the LoRA adapter {path}: {type(exc).__name__}: "
                             f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from exc
    qat.eval()
    qat.requires_grad_(False)
    folder = path if path.is_dir() else path.parent
    try:
        record = sc.read(folder) or sc.Sidecar()
    except sc.SidecarError as exc:
        raise ModelLoadError(str(exc)) from exc
    kind = record.weights
    fine_tuned = kind not in QAT_LABEL_NOT_ATTNQAT
    note = record.qat_weights_note or f"a LoRA adapter ({path}) fused into the base transformer"
    return qat, {"checkpoint": str(path.resolve()), "scheme": "lora", "prefix_stripped": None,
                 "note": note, "folder_note": record.qat_weights_note,
                 "identical_to_base": False, "fine_tuned": fine_tuned,
                 "label": QAT_LABEL_NOT_ATTNQAT[kind] if not fine_tuned else QAT_LABEL_FINE_TUNED}


def latent_shape(pipe, height: int, width: int, frames: int, batch: int = 1) -> tuple[int, ...]:
    """Shape of the initial noise for ``pipe`` at the given size: (B, C, (F-1)/4+1, H/8, W/8)."""
    t = pipe.vae_scale_factor_temporal
    s = pipe.vae_scale_factor_spatial
    return (batch, pipe.transformer.config.in_channels, (frames - 1) // t + 1, height // s, width // s)


__all__ = [
    "AttnQATProcessor", "DEFAULT_MODEL", "DTYPE_CHOICES", "FP4_SCOPES", "ModelInfo", "ModelLoadError",
    "FINETUNED_WEIGHTS", "QAT_LABEL_BASE_COPY", "QAT_LABEL_FINE_TUNED", "QAT_LABEL_NOT_ATTNQAT", "WAN_DEFAULTS", "WAN_NEGATIVE_PROMPT", "WanModels",
    "cpu_bf16_support", "default_shift", "dtype_name", "get_processor", "install_attention",
    "latent_shape", "load_models", "load_pipeline", "model_info", "resolve_device", "resolve_dtype",
    "set_method", "uninstall_attention",
]
