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

import numpy as np
import torch

SUMMARY_KEYS = ("colour", "shape", "motion", "background", "count", "all_correct", "prompt_score",
                "quality", "aggregate", "clips", "objects")


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
    ``first … first + n − 1`` (seed ``i`` for prompt ``i``)."""
    from attnqat.generate import encode_prompts, initial_latents, resolve_settings
    from attnqat.synthetic import heldout_specs

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


def similarity(clips: list[np.ndarray], reference: list[np.ndarray], workers: int = 0) -> dict:
    """Mean and median PSNR, mean SSIM of ``clips`` against ``reference`` (same prompts and seeds),
    in ``workers`` processes (0: here); clips identical to their reference are counted, not
    averaged (their PSNR is infinite)."""
    pairs = _pool_map(_compare, list(zip(clips, reference)), workers)
    finite = [p for p, _ in pairs if math.isfinite(p)]
    return {"psnr": float(np.mean(finite)) if finite else None,
            "psnr_median": float(np.median(finite)) if finite else None,
            "identical": len(pairs) - len(finite),
            "ssim": float(np.mean([s for _, s in pairs]))}


__all__ = ["HeldoutInputs", "SUMMARY_KEYS", "generate_clips", "inputs", "score_all", "similarity",
           "summary_row"]
