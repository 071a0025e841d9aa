"""Training checkpoints: sharded, atomic, resumable on any number of processes.

A checkpoint is a folder ``RUN/checkpoints/step-NNNNNNN`` written with
``torch.distributed.checkpoint`` (each rank writes its shards of the model, the AdamW state and the
EMA; a later run re-shards them for its own number of processes) plus

* ``trainer.json`` (rank 0): the step, the data position (global samples read), the EMA's update
  count, the run's configuration and the loss of the step;
* ``rng-rank-R.pt``: each rank's Python, NumPy, torch and CUDA random states.

It is written under ``step-NNNNNNN.tmp`` and renamed once every rank has finished, so a run killed
while saving leaves the previous checkpoint as the latest complete one; then the oldest complete
checkpoints beyond the newest ``keep`` are deleted. The learning rate is a function of the step
(:func:`attnqat.finetune.schedule.lr_factor`), so the step is the schedule's whole state.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .distributed import DistContext, barrier

CHECKPOINTS = "checkpoints"
ABANDONED = "checkpoints-abandoned"
TRAINER_STATE = "trainer.json"


class CheckpointError(OSError):
    """A run folder or checkpoint that cannot be written; the message is one line."""


def check_writable(run: str | Path) -> None:
    """Raise ValueError (one line) unless the run folder can be created and written, without
    creating anything (the trainer checks this before a model loads)."""
    p = Path(run).absolute()
    q = p
    while not q.exists() and q != q.parent:
        q = q.parent
    if not q.is_dir():
        raise ValueError(f"--out {run}: {q} is not a folder")
    if not os.access(q, os.W_OK | os.X_OK):
        raise ValueError(f"--out {run}: {q} is not writable")


def _write_failure(exc: BaseException, step: int, folder: Path) -> CheckpointError:
    """One line for a checkpoint that could not be written: the cause and the disk's free space."""
    failures = getattr(exc, "failures", None)   # dcp's CheckpointException: rank -> (exception, trace)
    if isinstance(failures, dict) and failures:
        exc = next(iter(failures.values()))[0]
    cause = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).strip().splitlines()[0]
    try:
        free = f"; {shutil.disk_usage(folder.parent).free / 2**20:.0f} MiB free there"
    except OSError:
        free = ""
    return CheckpointError(f"cannot write the checkpoint of step {step} in {folder.parent} "
                           f"({type(exc).__name__}: {cause}{free}); nothing of it was kept, the "
                           "last complete checkpoint stays as it was")


def checkpoint_dir(run: str | Path, step: int) -> Path:
    return Path(run) / CHECKPOINTS / f"step-{step:07d}"


def complete_checkpoints(run: str | Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of the complete checkpoints of a run folder, oldest first."""
    root = Path(run) / CHECKPOINTS
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p.name.startswith("step-") and not p.name.endswith(".tmp") \
                    and (p / TRAINER_STATE).is_file() and (p / ".metadata").is_file():
                try:
                    out.append((int(p.name[5:]), p))
                except ValueError:
                    continue
    return sorted(out)


def set_aside_after(run: str | Path, step: int) -> list[Path]:
    """Move the complete checkpoints of ``run`` after ``step`` to ``RUN/checkpoints-abandoned/``
    (a run resumed from an older checkpoint abandons them: left in place, the next ``--resume``
    or export would pick them); returns their new folders."""
    later = [p for s, p in complete_checkpoints(run) if s > step]
    moved = []
    for p in later:
        dest = Path(run) / ABANDONED / p.name
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(p, dest)
        moved.append(dest)
    return moved


def resolve(resume: str | Path, run: str | Path) -> Path:
    """The checkpoint ``--resume`` names: a checkpoint folder, or a run folder (its latest)."""
    p = Path(resume)
    if (p / TRAINER_STATE).is_file():
        return p
    ckpts = complete_checkpoints(p)
    if not ckpts:
        raise FileNotFoundError(f"no complete checkpoint in {p} (expected {p}/{CHECKPOINTS}/step-N "
                                f"folders with {TRAINER_STATE}, or such a folder itself)")
    return ckpts[-1][1]


def read_state(folder: str | Path) -> dict:
    return json.loads((Path(folder) / TRAINER_STATE).read_text())


def _rng_state() -> dict:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available() and len(st["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(st["cuda"])


def _options(strict: bool = True):
    """Frozen weights (a LoRA run's base) are the model's, not the run's: not saved, not loaded
    (loading is not strict about them: dcp.load has already insisted on every saved key)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=strict)


def _state(model, optimizer, ema) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=_options())
    state: dict[str, Any] = {"model": msd, "optim": osd}
    if ema is not None:
        state["ema"] = ema.shadow
    return state


def save(run: str | Path, step: int, model, optimizer, ema, trainer_state: dict, ctx: DistContext,
         keep: int = 3) -> Path:
    """Write the checkpoint of ``step`` (every rank calls this); returns its folder."""
    import torch.distributed.checkpoint as dcp

    final = checkpoint_dir(run, step)
    tmp = final.with_name(final.name + ".tmp")
    try:
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier(ctx)
        dcp.save(_state(model, optimizer, ema), checkpoint_id=str(tmp))
        torch.save(_rng_state(), tmp / f"rng-rank-{ctx.rank}.pt")
        barrier(ctx)
        if ctx.is_main:
            (tmp / TRAINER_STATE).write_text(json.dumps({**trainer_state, "step": step,
                                                         "world": ctx.world}, indent=1) + "\n")
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)   # a partial checkpoint would keep the disk full
        from torch.distributed.checkpoint.api import CheckpointException

        # a full disk: OSError, RuntimeError from torch.save's writer, CheckpointException from dcp
        if isinstance(exc, (OSError, RuntimeError, CheckpointException)):
            raise _write_failure(exc, step, tmp) from exc
        raise
    if ctx.is_main:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for _, old in complete_checkpoints(run)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    barrier(ctx)
    return final


def load(folder: str | Path, model, optimizer, ema, ctx: DistContext) -> dict:
    """Restore model, optimizer, EMA (if ``ema`` is given and the checkpoint has one) and this
    rank's random states from ``folder``; returns its ``trainer.json``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    folder = Path(folder)
    meta = read_state(folder)
    if ema is not None and not meta.get("ema_updates"):
        raise ValueError(f"{folder} holds no EMA weights, but this run asks for --ema; resume "
                         "without --ema or start a new run")
    state = _state(model, optimizer, ema)
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_options(strict=False))
    if ema is not None:
        ema.load_state_dict({"shadow": state["ema"], "updates": meta["ema_updates"]})
    rng = folder / f"rng-rank-{ctx.rank}.pt"
    if rng.is_file() and meta.get("world") == ctx.world:
        _set_rng_state(torch.load(rng, weights_only=False))
    if dist.is_initialized():
        barrier(ctx)
    return meta


def load_full_state(folder: str | Path, names: dict[str, torch.Tensor], key: str = "model") -> None:
    """Fill plain (unsharded) tensors ``names`` (parameter name → tensor of the full shape) with
    the ``key`` part (``model`` or ``ema``) of a checkpoint, without a process group (export)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():   # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=r"torch.distributed is disabled")
        dcp.load({key: names}, checkpoint_id=str(folder), no_dist=True)


__all__ = ["ABANDONED", "CHECKPOINTS", "CheckpointError", "TRAINER_STATE", "check_writable",
           "checkpoint_dir", "complete_checkpoints", "load", "load_full_state", "read_state",
           "resolve", "save", "set_aside_after"]
