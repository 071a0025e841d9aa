"""What a person asks ``attnqat generate`` for: one typed request, built by name.

The CLI (:mod:`attnqat.generate_cli`), the app's form and API (:mod:`attnqat.app.service`) and Python
callers build a :class:`GenerationRequest`; :func:`attnqat.generate.resolve_settings` checks it once
(every invalid field named) and fills the model's defaults into a
:class:`~attnqat.generate.GenerationSettings`; :func:`attnqat.generate.generate` takes it. Values are
kept as given (numbers may arrive as text from a form): checking is the validator's job, not this
record's.

Adding an input (say an image for image-to-video) is one field here, its control in the form or
the option in the CLI, and its use where the generation runs; nothing in between lists fields.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Sequence


@dataclass(frozen=True)
class GenerationRequest:
    """One generation as asked (None: the model's default, see
    :func:`attnqat.generate.resolve_settings`).

    Attributes:
        prompt, negative_prompt: the text (negative prompt None: the model's default).
        methods: generation methods (list or comma-separated; None: every one the registry offers).
        seed: seed of the initial noise shared by every method; −1 draws one.
        steps, guidance, shift, height, width, frames, fps: sampling and clip settings.
        model: local diffusers folder or hub id (None: the embedded tiny model).
        qat_transformer: Attn-QAT transformer (None: the one the model folder names).
        device, dtype: where and in which dtype the transformers run (``auto``: what the device
            runs natively).
        fp4_scope: ``self`` (cross-attention unquantized) or ``all``.
        backend: attention backend (``auto`` | ``torch`` | ``triton``).
        offload: keep models on the CPU, move each to the device while it runs.
        out: folder to write (None: write nothing); overwrite: allow a non-empty ``out``.
        error_map: also collect each 4-bit method's attention-error map (per layer × step relative
            error against BF16 attention on the same inputs; :mod:`attnqat.error_map`).
    """

    prompt: Any
    negative_prompt: Any = None
    methods: str | Sequence[str] | None = None
    seed: Any = -1
    steps: Any = None
    guidance: Any = None
    shift: Any = None
    height: Any = None
    width: Any = None
    frames: Any = None
    fps: Any = None
    model: str | Path | None = None
    qat_transformer: str | Path | None = None
    device: str = "auto"
    dtype: str = "auto"
    fp4_scope: str = "self"
    backend: str = "auto"
    offload: bool = False
    out: str | Path | None = None
    overwrite: bool = False
    error_map: bool = False

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The fields, in order (the order errors are reported in)."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def of(cls, request: "GenerationRequest | Any" = None, **values: Any) -> "GenerationRequest":
        """``request`` itself, or a request built from a prompt and keyword values (the older
        keyword form of :func:`attnqat.generate.generate`). Unknown names are a ``TypeError``."""
        if isinstance(request, cls):
            if values:
                raise TypeError(f"give either a GenerationRequest or keyword values, not both "
                                f"({', '.join(values)})")
            return request
        unknown = [k for k in values if k not in cls.field_names()]
        if unknown:
            raise TypeError(f"unknown generation field(s): {', '.join(unknown)}")
        return cls(prompt=request, **values)


__all__ = ["GenerationRequest"]
