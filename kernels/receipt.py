"""What ran: the kernel each dispatch decision chose, noted where the decision is made.

:func:`attnqat.attention.attention` opens :func:`collect` around a kernel call; the decision points
(:func:`.gluon_fwd.choose_schedule`, :func:`.gluon_fwd_qat.choose_qat_schedule`,
:func:`.sagebwd.choose_forward_schedule` and :func:`.sagebwd.choose_backward_schedule`) call :func:`note`
with the kernel they return, which the caller then runs. Outside :func:`collect` a note costs one
context-variable read. Paths that make no such decision (the Triton-only kernels) note nothing.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

_NOTES: ContextVar[list[str] | None] = ContextVar("attnqat_kernel_notes", default=None)


def note(kernel: str) -> str:
    """Record that ``kernel`` (``"gluon"`` or ``"triton"``) was chosen; returns it."""
    notes = _NOTES.get()
    if notes is not None:
        notes.append(kernel)
    return kernel


@contextmanager
def collect() -> Iterator[list[str]]:
    """The kernels noted inside the ``with`` block, in order."""
    notes: list[str] = []
    token = _NOTES.set(notes)
    try:
        yield notes
    finally:
        _NOTES.reset(token)


__all__ = ["collect", "note"]
