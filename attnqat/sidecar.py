"""The ``attnqat.json`` beside a model: one typed record, one reader, one writer.

diffusers ignores the file; the project writes it next to a pipeline folder (the embedded tiny
model: its kind, generation defaults, architecture, where its Attn-QAT transformer is) and next to a
transformer folder (what its weights are: a copy of the base, or fine-tuned with which attention,
and how: ``training``). Written by :func:`attnqat.tiny.save_pipeline` and ``attnqat finetune
export``; read by :func:`attnqat.wan.model_info`, :func:`attnqat.convert.load_wan_transformer`,
``python -m attnqat.tiny`` and ``attnqat finetune tiny``.

Versioned: files written before the version field existed (version 1: a plain JSON object with
the same keys) read as they are; keys this version does not know are kept in ``extra`` and written
back unchanged. ``weights_sha256`` (file name → SHA-256 of its bytes) is recorded when weights are
exported, so a later reader can tell the weights are the ones the record describes
(:meth:`Sidecar.verify`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

#: the file name, in a pipeline or transformer folder
SIDECAR = "attnqat.json"
#: the version this module writes (1: the untyped files written before it, without ``version``)
VERSION = 2


class SidecarError(ValueError):
    """An ``attnqat.json`` that cannot be read; the message names the file and why."""


@dataclass
class Sidecar:
    """What a model folder's ``attnqat.json`` says.

    Attributes:
        kind: ``"tiny-wan"`` (the embedded pipeline or one built like it), ``"tiny-wan-qat"`` (its
            Attn-QAT transformer folder), ``"attnqat-transformer"`` (an exported fine-tuned
            transformer) or ``"wan"``.
        weights: what the weights are: ``"random-init"``, ``"trained"``, ``"copy-of-base"``, or a
            fine-tuned method's :attr:`attnqat.methods.AttentionMethod.finetuned_weights`.
        weights_note: a pipeline folder's one-line note on its weights.
        qat_weights_note: a transformer folder's one-line note on its weights.
        defaults: generation defaults the folder overrides (height, width, frames, ...).
        config: the tiny model's architecture (:class:`attnqat.tiny.TinyWanConfig` fields).
        qat_transformer: the pipeline's Attn-QAT transformer folder, relative to the pipeline's.
        seed: the seed of a random initialization.
        training: how fine-tuned weights were trained (method, steps, data, ...).
        exported: when the weights were exported (ISO 8601).
        weights_sha256: weight file name → SHA-256, recorded at export.
        extra: keys of the file this version does not know (kept, written back).
        version: the file's version (1 for files without one).
    """

    kind: str = "wan"
    weights: str | None = None
    weights_note: str | None = None
    qat_weights_note: str | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    qat_transformer: str | None = None
    seed: int | None = None
    training: dict[str, Any] | None = None
    exported: str | None = None
    weights_sha256: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    version: int = VERSION

    @property
    def note(self) -> str | None:
        """The folder's note on its weights (a transformer folder's, else a pipeline folder's)."""
        return self.qat_weights_note or self.weights_note

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sidecar":
        """From the JSON object of any version (unknown keys go to ``extra``)."""
        if not isinstance(d, dict):
            raise SidecarError(f"expected a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)} - {"extra"}
        version = d.get("version", 1)
        if not isinstance(version, int) or version < 1:
            raise SidecarError(f"version must be a positive integer, got {version!r}")
        if version > VERSION:
            raise SidecarError(f"written by a newer attnqat (version {version}; this one reads up to {VERSION})")
        kw = {k: v for k, v in d.items() if k in known and v is not None}
        kw["version"] = version
        return cls(**kw, extra={k: v for k, v in d.items() if k not in known})

    def to_dict(self) -> dict[str, Any]:
        """The JSON object written (empty and None fields left out; ``version`` always there)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        out = {k: v for k, v in out.items() if v is not None and v != {}}
        out.update(self.extra)
        out["version"] = VERSION
        return out

    def verify(self, folder: str | Path) -> list[str]:
        """Names of the recorded weight files whose bytes no longer match their SHA-256 (missing
        files included); [] when all match or none were recorded."""
        folder = Path(folder)
        return [name for name, digest in self.weights_sha256.items()
                if not (folder / name).is_file() or sha256(folder / name) != digest]


def read(folder: str | Path) -> Sidecar | None:
    """The ``attnqat.json`` of ``folder`` (None when it has none).

    Raises:
        SidecarError: the file exists and cannot be read (the message names it).
    """
    path = Path(folder) / SIDECAR
    if not path.is_file():
        return None
    try:
        return Sidecar.from_dict(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError, SidecarError, TypeError) as exc:
        raise SidecarError(f"cannot read {path}: {exc}") from exc


def write(folder: str | Path, sidecar: Sidecar | dict[str, Any]) -> Path:
    """Write ``sidecar`` (a :class:`Sidecar`, or the dict of an older caller) as ``folder``'s
    ``attnqat.json``; returns the path."""
    if isinstance(sidecar, dict):
        sidecar = Sidecar.from_dict(sidecar)
    path = Path(folder) / SIDECAR
    path.write_text(json.dumps(sidecar.to_dict(), indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    return path


def sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    """SHA-256 of a file's bytes, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def weights_sha256(folder: str | Path, pattern: str = "*.safetensors") -> dict[str, str]:
    """``{file name: SHA-256}`` of the weight files directly in ``folder``."""
    return {p.name: sha256(p) for p in sorted(Path(folder).glob(pattern)) if p.is_file()}


__all__ = ["SIDECAR", "Sidecar", "SidecarError", "VERSION", "read", "sha256", "weights_sha256", "write"]
