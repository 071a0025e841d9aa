"""Training logs: one JSON line per logged step, the same scalars in TensorBoard, one console line.

``RunLog(folder)`` appends to ``folder/log.jsonl`` (one object per record: ``{"step": N, "kind":
"train" | "val" | "event", ...}``) and, unless told not to, writes the numbers to TensorBoard
event files in ``folder/tb`` (``tensorboard --logdir RUN/tb``). Nested dicts become
slash-separated tags (``grad_norm/block_03``). On resume, :meth:`RunLog.truncate_after` drops the
records of steps a killed run made after its last checkpoint, so the file reads as one run.

Only rank 0 of a distributed run should hold a ``RunLog``; the trainers pass ``None`` elsewhere.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

LOG_FILE = "log.jsonl"


def now() -> str:
    """The current UTC time, ISO 8601 to the second (the date stamp of every run record)."""
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def device_name(dev) -> str:
    """A device in words for run records: the GPU's name, or the CPU's architecture and cores."""
    import os
    import platform

    import torch

    if torch.device(dev).type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _flat(prefix: str, value: Any, out: dict[str, float]) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flat(f"{prefix}/{k}" if prefix else str(k), v, out)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out[prefix] = float(value)


def _json_safe(value: Any) -> Any:
    """NaN and infinities as strings (JSON has no literal for them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


class RunLog:
    """Append-only JSONL log plus optional TensorBoard scalars of one run folder."""

    def __init__(self, folder: str | Path, *, tensorboard: bool = True,
                 purge_step: int | None = None) -> None:
        """``purge_step``: a resumed run's step; TensorBoard hides the scalars a killed or abandoned
        run wrote after it."""
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / LOG_FILE
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise RuntimeError("TensorBoard logging needs the `tensorboard` package "
                                   "(pip install tensorboard), or turn it off with "
                                   "--no-tensorboard") from exc
            self._tb = SummaryWriter(str(self.folder / "tb"), purge_step=purge_step)

    def write(self, step: int, kind: str = "train", **values: Any) -> None:
        """One record; numbers (also nested) go to TensorBoard under ``kind/…``."""
        record = {"step": int(step), "kind": kind, **values}
        with self.path.open("a") as f:
            f.write(json.dumps(_json_safe(record), allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self._tb is not None:
            flat: dict[str, float] = {}
            _flat(kind, values, flat)
            for tag, v in flat.items():
                self._tb.add_scalar(tag, v, global_step=int(step))
            self._tb.flush()

    def truncate_after(self, step: int) -> int:
        """Drop the records of steps after ``step`` (a resumed run re-makes them); returns how
        many were dropped. Events (``kind == "event"``) are kept."""
        if not self.path.is_file():
            return 0
        keep, dropped = [], 0
        for line in self.path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:   # a line cut short by kill -9
                dropped += 1
                continue
            if rec.get("kind") != "event" and rec.get("step", 0) > step:
                dropped += 1
                continue
            keep.append(line)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)
        return dropped

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def record_file(path: str | Path) -> Path | None:
    """``path``, or its gzipped twin ``path.gz`` (how docs/repro keeps its records small enough
    to travel with the tree), or None when neither is a file."""
    p = Path(path)
    for q in (p, p.with_name(p.name + ".gz")):
        if q.is_file():
            return q
    return None


def read_record_text(path: str | Path) -> str:
    """The text of a record file or of its ``.gz`` twin (:func:`record_file`)."""
    q = record_file(path)
    if q is None:
        raise FileNotFoundError(f"no record at {path} (nor {Path(path).name}.gz)")
    return gzip.decompress(q.read_bytes()).decode() if q.suffix == ".gz" else q.read_text()


def read_log(run: str | Path, kind: str | None = "train") -> list[dict]:
    """The records of a run folder's ``log.jsonl`` (or of that file itself, or its ``.gz`` twin),
    optionally of one ``kind``."""
    p = Path(run)
    path = p / LOG_FILE if p.is_dir() else p
    if record_file(path) is None:
        raise FileNotFoundError(f"no training log at {path}")
    return [rec for rec in _records(path) if kind is None or rec.get("kind") == kind]


def _records(path: Path) -> Iterator[dict]:
    for line in read_record_text(path).splitlines():
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def console_line(step: int, total: int | None, values: Mapping[str, Any]) -> str:
    """A compact progress line: ``step 120/4000 loss 0.1234 grad 0.56 lr 1.0e-06 ...``."""
    parts = [f"step {step}" + (f"/{total}" if total else "")]
    for k, v in values.items():
        if isinstance(v, float):
            parts.append(f"{k} {v:.3g}" if abs(v) < 1e-3 or abs(v) >= 1e4 else f"{k} {v:.4f}")
        elif v is not None and not isinstance(v, Mapping):
            parts.append(f"{k} {v}")
    return "  ".join(parts)


__all__ = ["LOG_FILE", "RunLog", "console_line", "device_name", "now", "read_log", "read_record_text",
           "record_file"]
