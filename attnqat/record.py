"""The generation record: what ``attnqat generate`` writes as ``record.json``, typed.

One set of classes for everyone who writes or reads a generation: :func:`attnqat.generate.generate`
builds a :class:`GenerationRecord`, the app shows it and returns it from its API, and the blind
study's source reader (:mod:`attnqat.eval.sources`) reads the clips it lists. The JSON layout is
described in ``docs/generate.md``; :meth:`GenerationRecord.to_dict` gives it and
:meth:`GenerationRecord.from_dict` reads it back.

Reading is lenient where the study needs it to be: a record written by hand or by an older version
needs only ``prompt`` and ``methods`` (method → ``{"video": file}``); everything else takes a
neutral default. Every field holds plain JSON values, and no object in the record has a ``path``
key (API clients such as ``gradio_client`` take such objects for files to download).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any


#: The extra clip of an Attn-QAT generation: the fine-tuned weights with BF16 attention, the
#: reference of Attn-QAT's 4-bit error (:attr:`GenerationRecord.references`).
WEIGHTS_REFERENCE = "attnqat_bf16"
#: The one line that says which comparison is which (the app and ``generate`` print it).
COMPARISON_NOTE = ("PSNR/SSIM vs BF16 is each clip's 4-bit error: against BF16 attention with the "
                   "same weights (Attn-QAT: its fine-tuned weights in BF16). Fine-tuning drift — "
                   "the fine-tuned weights in BF16 against the base model in BF16 — is shown apart.")


class RecordError(ValueError):
    """A record that cannot be read: the message says which file and what is wrong."""


def _known(cls, data: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``data`` that are fields of the dataclass ``cls``."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclass
class Timings:
    """Seconds spent on one method. ``total_s`` is denoising plus decoding (the text encoding is
    shared by all methods and counted once, in :attr:`GenerationRecord.text_encoding_s`)."""

    text_encoding_s: float | None = None
    denoising_s: float | None = None
    decoding_s: float | None = None
    attention_s: float | None = None
    attention_share_of_denoising: float | None = None
    total_s: float | None = None


@dataclass
class MethodRecord:
    """One method's clip and measurements.

    ``psnr`` (dB) and ``ssim`` are the **4-bit error**: the clip against BF16 attention with the
    SAME weights — the base model's BF16 clip for ``nvfp4`` and ``sage3``, the Attn-QAT weights'
    own BF16 clip for ``attnqat`` (``reference`` names which: ``"bf16"`` or
    :data:`WEIGHTS_REFERENCE`). None for BF16 itself, when that reference was not run, and ``psnr``
    also when the clips are identical (``identical_to_bf16``). For ``attnqat``,
    ``psnr_vs_base_bf16`` / ``ssim_vs_base_bf16`` compare it with the base model's BF16 clip (4-bit
    error and fine-tuning drift together); the drift alone is :attr:`GenerationRecord.weights_drift`.

    ``dispatch`` is what the attention calls actually ran, as the processor logged it
    (:meth:`attnqat.wan.AttnQATProcessor.stats`: kind, method, implementation, SDPA backend or
    kernel, device, dtype, calls, fallback reason); ``fallbacks`` one line per distinct fallback
    (empty when nothing fell back).
    """

    video: str | None = None
    label: str | None = None
    transformer: str | None = None
    attention_method: str | None = None
    timings: Timings = field(default_factory=Timings)
    attention_calls: dict[str, int] = field(default_factory=dict)
    transformer_calls: int | None = None
    peak_memory_bytes: int | None = None
    peak_memory_kind: str | None = None
    psnr: float | None = None
    ssim: float | None = None
    identical_to_bf16: bool | None = None
    dispatch: list[dict[str, Any]] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    reference: str | None = None
    psnr_vs_base_bf16: float | None = None
    ssim_vs_base_bf16: float | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MethodRecord":
        values = _known(cls, data)
        values["timings"] = Timings(**_known(Timings, data.get("timings") or {}))
        return cls(**values)


@dataclass
class QATRecord:
    """The Attn-QAT weights a generation ran: where they were read from (``checkpoint``), the
    naming scheme found, whether they equal the base transformer's, whether they are fine-tuned,
    the name the method goes by (``label``) and the notes on them."""

    checkpoint: str | None = None
    scheme: str | None = None
    prefix_stripped: str | None = None
    identical_to_base: bool | None = None
    fine_tuned: bool | None = None
    label: str | None = None
    note: str | None = None
    folder_note: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "QATRecord":
        return cls(**_known(cls, data))


@dataclass
class Precision:
    """The compute dtype that ran (transformers and text encoder; the VAE runs in ``vae``) and why
    it was chosen (:func:`attnqat.wan.resolve_dtype`)."""

    dtype: str | None = None
    reason: str | None = None
    vae: str = "float32"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Precision":
        return cls(**_known(cls, data))


@dataclass
class GenerationRecord:
    """Everything about one generation: one prompt and seed, one clip per method.

    ``settings`` is :meth:`attnqat.generate.GenerationSettings.record` (every input, defaults filled
    in); ``methods`` maps each method, in display order, to its :class:`MethodRecord`.

    ``references`` holds the extra clips that are references, not methods (the Attn-QAT weights
    with BF16 attention, :data:`WEIGHTS_REFERENCE`); ``weights_drift`` compares that clip with the
    base model's BF16 clip (``{"psnr", "ssim", "identical", "compares"}``; None when either was
    not run); ``comparison_note`` is :data:`COMPARISON_NOTE`; ``error_map`` the summary of the
    attention-error map and its files (``{"summary", "note", "json", "png"}``, when it was
    collected: :mod:`attnqat.error_map`). Records without them (older ones) read with empty
    defaults.
    """

    prompt: str
    methods: dict[str, MethodRecord]
    negative_prompt: str = ""
    seed: int | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    precision: Precision = field(default_factory=Precision)
    versions: dict[str, Any] = field(default_factory=dict)
    created: str | None = None
    text_encoding_s: float | None = None
    model_kind: str | None = None
    model_weights_note: str | None = None
    qat: QATRecord | None = None
    qat_weights_note: str | None = None
    side_by_side: str | None = None
    references: dict[str, MethodRecord] = field(default_factory=dict)
    weights_drift: dict[str, Any] | None = None
    comparison_note: str | None = None
    error_map: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``record.json``)."""
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False, ensure_ascii=False) + "\n"

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_json(), encoding="utf-8")
        return path

    @classmethod
    def from_dict(cls, data: Any, where: str = "record") -> "GenerationRecord":
        """Read the JSON form; needs ``prompt`` (text) and ``methods`` (method → object).

        Raises:
            RecordError: naming ``where`` and what is missing.
        """
        if not isinstance(data, dict):
            raise RecordError(f"{where}: not a generation record (expected a JSON object)")
        prompt, methods = data.get("prompt"), data.get("methods")
        if not isinstance(prompt, str) or not prompt.strip() or not isinstance(methods, dict):
            raise RecordError(f"{where}: not a generation record (needs 'prompt' and 'methods')")
        seed = data.get("seed")
        if seed is not None and seed != "":
            try:
                seed = int(seed)
            except (TypeError, ValueError):
                raise RecordError(f"{where}: seed {seed!r} is not an integer") from None
        else:
            seed = None
        parsed: dict[str, MethodRecord] = {}
        for method, entry in methods.items():
            if not isinstance(entry, dict):
                raise RecordError(f"{where}: method {method!r} is not an object")
            parsed[str(method)] = MethodRecord.from_dict(entry)
        values = _known(cls, data)
        refs = data.get("references") if isinstance(data.get("references"), dict) else {}
        values["references"] = {str(k): MethodRecord.from_dict(v) for k, v in refs.items()
                                if isinstance(v, dict)}
        for name in ("weights_drift", "error_map"):
            if not isinstance(values.get(name), (dict, type(None))):
                values[name] = None
        values.update(prompt=prompt, methods=parsed, seed=seed,
                      precision=Precision.from_dict(data.get("precision") or {}),
                      qat=QATRecord.from_dict(data["qat"]) if isinstance(data.get("qat"), dict) else None)
        return cls(**values)

    @classmethod
    def load(cls, path: str | Path) -> "GenerationRecord":
        """Read a ``record.json``.

        Raises:
            RecordError: unreadable file, invalid JSON, or not a generation record.
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise RecordError(f"cannot read {path}: {exc}") from exc
        return cls.from_dict(data, where=str(path))

    def videos(self, folder: str | Path) -> dict[str, Path]:
        """Method → clip file, relative to ``folder`` (the record's folder).

        Raises:
            RecordError: a method without a ``video``.
        """
        out = {}
        for method, entry in self.methods.items():
            if not entry.video:
                raise RecordError(f"{Path(folder) / 'record.json'}: method {method!r} has no 'video'")
            out[method] = Path(folder) / entry.video
        return out


__all__ = ["COMPARISON_NOTE", "GenerationRecord", "WEIGHTS_REFERENCE", "MethodRecord", "Precision", "QATRecord", "RecordError", "Timings"]
