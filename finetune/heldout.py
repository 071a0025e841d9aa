"""Clips of the held-out synthetic prompts through the project's generation code, scored by the
procedural judge: the evaluation of ``attnqat finetune tiny --stages eval`` and of
``attnqat repro``.

Held-out prompt ``i`` (:func:`attnqat.synthetic.heldout_specs`: colour × shape × motion triples
never shown in training) is generated with seed ``i`` at the model's defaults, as
``attnqat generate`` would (:func:`attnqat.generate.encode_prompts`,
:func:`~attnqat.generate.initial_latents`, :func:`~attnqat.generate.denoise`,
:func:`~attnqat.generate.decode`), prompts denoised in batches; every clip is scored against its
caption (:func:`attnqat.eval.procedural.score_clip`) in worker processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SUMMARY_KEYS = ("colour", "shape", "motion", "background", "count", "all_correct", "prompt_score",
                "quality", "aggregate", "clips", "objects")

#: the held-out prompts' roles (docs/repro.md, "Evaluation discipline"): every choice is made on
#: the development prompts; the confirmatory ones are evaluated once, after the protocol is
#: committed; from ``OUTSIDE_FIRST`` on they are kept for checks from outside and never evaluated
DEVELOPMENT = range(0, 900)
CONFIRMATORY = range(900, 1400)
OUTSIDE_FIRST = 1400
#: the pre-registration a confirmatory evaluation needs, relative to the project root
PROTOCOL = "docs/repro/protocol.md"
#: the project's root (its git checkout when installed editable)
PROJECT_ROOT = Path(__file__).resolve().parents[1]


class PromptRangeError(ValueError):
    """A held-out prompt range the evaluation discipline forbids (the message says why, in one line)."""


#: for a copy of the tree without its ``.git`` (the lent GPU gets one): ``"COMMIT BLOB"``, the
#: commit that last changed ``PROTOCOL`` and the file's git blob id there (``git log -1
#: --format=%H -- docs/repro/protocol.md``; ``git rev-parse COMMIT:docs/repro/protocol.md``)
PROTOCOL_ENV = "ATTNQAT_PROTOCOL_COMMIT"


def git_blob_id(data: bytes) -> str:
    """The id git gives a file of these bytes (``git hash-object``)."""
    import hashlib

    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def protocol_committed(root: Path | None = None) -> tuple[bool, str]:
    """Whether ``PROTOCOL`` exists in ``root`` (default :data:`PROJECT_ROOT`) and is committed
    there, unmodified: ``(True, commit)`` or ``(False, the reason)``. Needs git and a checkout —
    or, in a copy without the project's ``.git``, :data:`PROTOCOL_ENV` naming the commit and the
    blob the file must be byte-identical to (checked first whenever it is set; the commit returned
    is then ``"COMMIT (blob BLOB, named in ATTNQAT_PROTOCOL_COMMIT)"``, to be checked against the
    project's history: ``git cat-file -p COMMIT:docs/repro/protocol.md``)."""
    import os
    import shutil
    import subprocess

    root = PROJECT_ROOT if root is None else Path(root)
    if not (root / PROTOCOL).is_file():
        return False, f"{PROTOCOL} does not exist in {root}"
    named = os.environ.get(PROTOCOL_ENV, "").split()
    if named:   # named explicitly: checked byte for byte, whatever .git the copy may have
        if len(named) != 2:
            return False, f"{PROTOCOL_ENV} must be 'COMMIT BLOB', got {' '.join(named)!r}"
        if git_blob_id((root / PROTOCOL).read_bytes()) != named[1]:
            return False, f"{PROTOCOL} differs from the committed copy {PROTOCOL_ENV} names (blob {named[1]})"
        return True, f"{named[0]} (blob {named[1]}, named in {PROTOCOL_ENV})"
    if shutil.which("git") is None:
        return False, f"git is not available to check that {PROTOCOL} is committed"

    def git(*a: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True)

    log = git("log", "-1", "--format=%H", "--", PROTOCOL)
    if log.returncode != 0:
        return False, (f"{root} is not a git checkout, so it cannot be shown that {PROTOCOL} is committed "
                       f"(a copy without .git: set {PROTOCOL_ENV})")
    if not log.stdout.strip():
        return False, f"{PROTOCOL} is not committed"
    status = git("status", "--porcelain", "--", PROTOCOL)
    if status.returncode != 0 or status.stdout.strip():
        return False, f"{PROTOCOL} has uncommitted changes"
    return True, log.stdout.strip()


def check_prompt_range(first: int, n: int, root: Path | None = None) -> str:
    """The role of held-out prompts ``first … first + n − 1``: ``"development"`` or
    ``"confirmatory"`` (the latter only when :func:`protocol_committed`). Raises
    :class:`PromptRangeError` for a range reaching :data:`OUTSIDE_FIRST` or beyond, and for a
    confirmatory range without a committed protocol."""
    last = first + n - 1
    if first < 0 or n < 1:
        raise PromptRangeError(f"held-out prompts {first}..{last}: need first >= 0 and at least one prompt")
    if last >= OUTSIDE_FIRST:
        raise PromptRangeError(f"held-out prompts {first}-{last} reach {OUTSIDE_FIRST} or beyond: prompts "
                               f">= {OUTSIDE_FIRST} are kept for outside checks and never evaluated "
                               "(docs/repro.md)")
    if last >= CONFIRMATORY.start:
        ok, why = protocol_committed(root)
        if not ok:
            raise PromptRangeError(f"held-out prompts {first}-{last} touch the confirmatory set "
                                   f"{CONFIRMATORY.start}-{CONFIRMATORY.stop - 1}, which is evaluated only "
                                   f"after a committed protocol: {why}")
        return "confirmatory"
    return "development"


@dataclass
class HeldoutInputs:
    """The prompts ``first … first + n − 1``, their settings, embeddings and starting noise."""

    first: int
    specs: list
    prompts: list[str]
    settings: list
    pe: torch.Tensor
    ne: torch.Tensor | None
    lat0: torch.Tensor


def inputs(models, first: int, n: int, *, steps: int | None = None, guidance: float | None = None,
           size: int | None = None, frames: int | None = None, backend: str = "torch") -> HeldoutInputs:
    """Settings (the model's defaults unless given), prompt embeddings and noise of held-out prompts
    ``first … first + n − 1`` (seed ``i`` for prompt ``i``). Raises :class:`PromptRangeError` for a
    range the evaluation discipline forbids (:func:`check_prompt_range`)."""
    from attnqat.generate import encode_prompts, initial_latents, resolve_settings
    from attnqat.synthetic import heldout_specs

    check_prompt_range(first, n)
    specs = heldout_specs(first + n)[first:]
    prompts = [s.caption for s in specs]
    settings = [resolve_settings(p, methods="bf16", seed=first + i, steps=steps, guidance=guidance,
                                 height=size, width=size, frames=frames, backend=backend,
                                 models=models)[0]
                for i, p in enumerate(prompts)]
    pairs = [encode_prompts(models, s.prompt, s.negative_prompt, s.guidance, s.max_sequence_length)
             for s in settings]
    pe = torch.cat([p for p, _ in pairs])
    ne = None if pairs[0][1] is None else torch.cat([n_ for _, n_ in pairs])
    lat0 = torch.cat([initial_latents(models, s) for s in settings])
    return HeldoutInputs(first, specs, prompts, settings, pe, ne, lat0)


def denoise_batches(models, transformer, inp: HeldoutInputs, batch: int,
                    on_step: Callable[[int], None] | None = None) -> Iterator[torch.Tensor]:
    """The final latents of the prompts of ``inp``, ``batch`` prompts denoised together per
    yielded tensor, with ``transformer`` as its attention is routed now (``on_step``: called after
    every denoising step of every batch with the step's index)."""
    from attnqat.generate import denoise

    s0 = inp.settings[0]
    for i in range(0, len(inp.settings), batch):
        sl = slice(i, i + batch)
        yield denoise(transformer, models.pipe.scheduler, inp.lat0[sl], inp.pe[sl],
                      None if inp.ne is None else inp.ne[sl], steps=s0.steps, guidance=s0.guidance,
                      shift=s0.shift, device=models.device, on_step=on_step)


def generate_clips(models, transformer, inp: HeldoutInputs, method: str, backend: str,
                   batch: int) -> list[np.ndarray]:
    """One clip per prompt of ``inp`` with ``transformer`` and attention ``method``, ``batch``
    prompts denoised together."""
    from attnqat.generate import decode
    from attnqat.wan import set_method

    set_method(transformer, method, backend=backend)
    return [decode(models, lat[j:j + 1]) for lat in denoise_batches(models, transformer, inp, batch)
            for j in range(lat.shape[0])]


def _score(item: tuple[str, np.ndarray]) -> dict:
    from attnqat.eval.procedural import score_clip

    return score_clip(*item)


def _one_thread() -> None:
    torch.set_num_threads(1)


def _pool_map(fn, items: list, workers: int) -> list:
    """``fn`` over ``items`` in ``workers`` forked processes of one thread each (0: here)."""
    if workers <= 0:
        return [fn(i) for i in items]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    ctx = mp.get_context("fork")
    with ProcessPoolExecutor(max_workers=min(workers, len(items)), mp_context=ctx,
                             initializer=_one_thread) as pool:
        return list(pool.map(fn, items, chunksize=2))


def score_all(prompts: list[str], clips: list[np.ndarray], workers: int) -> list[dict]:
    """:func:`attnqat.eval.procedural.score_clip` of every clip against its prompt, in ``workers``
    processes (0: here)."""
    return _pool_map(_score, list(zip(prompts, clips)), workers)


def _compare(item: tuple[np.ndarray, np.ndarray]) -> tuple[float, float]:
    from attnqat import video as vid

    return vid.psnr(*item), vid.ssim(*item)


def summary_row(scores: list[dict]) -> dict:
    """The headline numbers of :func:`attnqat.eval.procedural.summarize`."""
    from attnqat.eval.procedural import summarize

    s = summarize(scores)
    return {k: s[k] for k in SUMMARY_KEYS}


def pairwise_similarity(clips: list[np.ndarray], reference: list[np.ndarray],
                        workers: int = 0) -> list[tuple[float, float]]:
    """(PSNR, SSIM) of every clip against its reference (same prompts and seeds), in ``workers``
    processes (0: here); identical clips have an infinite PSNR."""
    if len(clips) != len(reference):
        raise ValueError(f"{len(clips)} clips against {len(reference)} references")
    return _pool_map(_compare, list(zip(clips, reference)), workers)


def summarize_similarity(pairs: list[tuple[float, float]]) -> dict:
    """Mean and median PSNR, mean SSIM of per-clip (PSNR, SSIM) pairs; clips identical to their
    reference are counted, not averaged (their PSNR is infinite)."""
    finite = [p for p, _ in pairs if math.isfinite(p)]
    return {"psnr": float(np.mean(finite)) if finite else None,
            "psnr_median": float(np.median(finite)) if finite else None,
            "identical": len(pairs) - len(finite),
            "ssim": float(np.mean([s for _, s in pairs]))}


def similarity(clips: list[np.ndarray], reference: list[np.ndarray], workers: int = 0) -> dict:
    """Mean and median PSNR, mean SSIM of ``clips`` against ``reference`` (same prompts and seeds),
    in ``workers`` processes (0: here); clips identical to their reference are counted, not
    averaged (their PSNR is infinite)."""
    pairs = pairwise_similarity(clips, reference, workers)
    finite = [p for p, _ in pairs if math.isfinite(p)]
    return {"psnr": float(np.mean(finite)) if finite else None,
            "psnr_median": float(np.median(finite)) if finite else None,
            "identical": len(pairs) - len(finite),
            "ssim": float(np.mean([s for _, s in pairs]))}


__all__ = ["CONFIRMATORY", "DEVELOPMENT", "HeldoutInputs", "OUTSIDE_FIRST", "PROTOCOL", "PROTOCOL_ENV",
           "PromptRangeError", "SUMMARY_KEYS", "check_prompt_range", "generate_clips", "git_blob_id", "inputs",
           "pairwise_similarity", "protocol_committed", "score_all", "similarity", "summarize_similarity",
           "summary_row"]
