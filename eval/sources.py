"""Where a study's clips come from, and prompt lists.

Two input formats (docs/development.md fixes the first):

* a folder written by ``attnqat generate``: ``record.json`` (prompt, seed, methods → video file)
  next to ``<method>.mp4``; a parent folder is searched recursively for ``record.json`` files;
* a CSV manifest with columns ``prompt,seed,method,path`` for any other folder of clips (relative
  paths are relative to the manifest).

Prompt lists are plain text, one prompt per line (e.g. VBench's ``all_dimension.txt``); the
project ships its own in ``assets/prompts.txt``. :func:`sample_prompts` draws N of them
reproducibly from a seed.
"""

from __future__ import annotations

import os

import csv
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from attnqat.record import GenerationRecord, RecordError


class InputError(ValueError):
    """Bad study input: a missing file, an unreadable record, an unknown method, no items."""


@dataclass(frozen=True)
class ClipSource:
    """One generated clip: which prompt and seed, which method, which file."""

    prompt: str
    seed: int | None
    method: str
    path: Path

    @property
    def group(self) -> tuple[str, int | None]:
        """Clips of one group show the same content (same prompt, same seed)."""
        return (self.prompt, self.seed)


def _seed(value: object, where: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InputError(f"{where}: seed {value!r} is not an integer") from None


def _find_records(root: Path) -> list[Path]:
    """Every ``record.json`` under ``root``, following symbolic links to folders (each real
    folder visited once, so a link loop ends)."""
    found, seen = [], set()
    for folder, dirs, files in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        if "record.json" in files:
            found.append(Path(folder) / "record.json")
    return sorted(found)


def read_record(record_path: Path) -> list[ClipSource]:
    """The clips listed by one ``record.json`` of ``attnqat generate`` (read as the typed
    :class:`attnqat.record.GenerationRecord` that generate writes)."""
    try:
        record = GenerationRecord.load(record_path)
        videos = record.videos(record_path.parent)
    except RecordError as exc:
        raise InputError(str(exc)) from exc
    return [ClipSource(record.prompt.strip(), record.seed, method, path)
            for method, path in videos.items()]


def read_manifest(csv_path: Path) -> list[ClipSource]:
    """The clips of a CSV manifest with columns prompt, seed, method, path."""
    try:
        with open(csv_path, newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            missing = {"prompt", "seed", "method", "path"} - set(reader.fieldnames or ())
            if missing:
                raise InputError(f"{csv_path}: missing column(s) {', '.join(sorted(missing))} "
                                 "(expected prompt,seed,method,path)")
            clips = []
            for line, row in enumerate(reader, start=2):
                where = f"{csv_path}:{line}"
                prompt, method, path = (row.get(k) or "" for k in ("prompt", "method", "path"))
                if not prompt.strip() or not method.strip() or not path.strip():
                    raise InputError(f"{where}: empty prompt, method or path")
                p = Path(path.strip())
                clips.append(ClipSource(prompt.strip(), _seed(row.get("seed"), where),
                                        method.strip(), p if p.is_absolute() else csv_path.parent / p))
    except OSError as exc:
        raise InputError(f"cannot read {csv_path}: {exc}") from exc
    return clips


def load_sources(inputs: Sequence[str | Path]) -> list[ClipSource]:
    """All clips of the given record folders (searched recursively) and CSV manifests.

    Raises :class:`InputError` for inputs that do not exist, folders without any record, missing
    clip files and duplicate (prompt, seed, method) entries.
    """
    if not inputs:
        raise InputError("no inputs given (folders from `attnqat generate` or CSV manifests)")
    clips: list[ClipSource] = []
    for raw in inputs:
        path = Path(raw)
        if path.is_dir():
            records = _find_records(path)
            if not records:
                raise InputError(f"{path}: no record.json found (searched recursively)")
            for record in records:
                clips.extend(read_record(record))
        elif path.is_file() and path.suffix.lower() == ".csv":
            clips.extend(read_manifest(path))
        elif path.is_file() and path.name == "record.json":
            clips.extend(read_record(path))
        else:
            raise InputError(f"{path}: not a folder, record.json or .csv manifest")
    missing = [c.path for c in clips if not c.path.is_file()]
    if missing:
        shown = "\n  ".join(str(p) for p in missing[:10])
        more = f"\n  … and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise InputError(f"{len(missing)} clip file(s) not found:\n  {shown}{more}")
    seen: set[tuple[str, int | None, str]] = set()
    for c in clips:
        key = (c.prompt, c.seed, c.method)
        if key in seen:
            raise InputError(f"duplicate clip for prompt {c.prompt!r}, seed {c.seed}, "
                             f"method {c.method!r}")
        seen.add(key)
    return clips


def methods_of(clips: Iterable[ClipSource]) -> list[str]:
    """The methods present, in first-seen order."""
    return list(dict.fromkeys(c.method for c in clips))


# --------------------------------------------------------------------------------------------
# Prompt lists
# --------------------------------------------------------------------------------------------

def default_prompt_file() -> Path:
    """The project's own prompt list (``assets/prompts.txt``)."""
    return Path(str(resources.files("attnqat.assets").joinpath("prompts.txt")))


def read_prompts(path: str | Path | None = None) -> list[str]:
    """Prompts of a one-per-line file (blank lines skipped, duplicates dropped, order kept)."""
    path = Path(path) if path is not None else default_prompt_file()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InputError(f"cannot read prompt list {path}: {exc}") from exc
    prompts = list(dict.fromkeys(line.strip() for line in lines if line.strip()))
    if not prompts:
        raise InputError(f"prompt list {path} is empty")
    return prompts


def sample_prompts(prompts: Sequence[str], n: int, seed: int = 0) -> list[str]:
    """``n`` distinct prompts drawn uniformly without replacement; the same (list, n, seed) always
    gives the same prompts in the same order."""
    if n <= 0:
        raise InputError("the number of prompts to sample must be positive")
    if n > len(prompts):
        raise InputError(f"cannot sample {n} prompts from a list of {len(prompts)}")
    return random.Random(seed).sample(list(prompts), n)
