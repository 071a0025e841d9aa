"""Prompts a model can answer: the app's examples and a study's default prompt list.

The embedded tiny model was trained on the synthetic shapes captions only (``attnqat.synthetic``):
asked "a red fox trots across a snowy meadow" it can only draw a plain field. Its prompts are
therefore held-out synthetic captions — colour × shape × motion triples it never saw in training,
so they test it fairly — namely the first 200 evaluation prompts of ``attnqat repro`` (it scores
100–899) and those of ``attnqat finetune tiny --stages eval`` (0–99 chose the shipped checkpoint). A real Wan 2.1 model
gets the project's natural-language list, ``assets/prompts.txt``.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

#: the held-out synthetic prompts offered for the tiny model (the repro's test prompts)
TINY_PROMPTS = range(100, 300)


def natural_prompts() -> list[str]:
    """The natural-language prompt list shipped in ``assets/prompts.txt`` (one per line)."""
    text = resources.files("attnqat.assets").joinpath("prompts.txt").read_text(encoding="utf-8")
    return list(dict.fromkeys(line.strip() for line in text.splitlines() if line.strip()))


def _info(model):
    """``model`` (folder, hub id, :class:`attnqat.wan.ModelInfo` or None: the embedded tiny model)
    as its :class:`~attnqat.wan.ModelInfo`."""
    from .wan import DEFAULT_MODEL, ModelInfo, model_info

    return model if isinstance(model, ModelInfo) else model_info(model if model is not None else DEFAULT_MODEL)


def model_prompts(model=None) -> list[str]:
    """The prompts that fit ``model`` (a model folder, hub id or :class:`attnqat.wan.ModelInfo`;
    default: the embedded tiny model): held-out synthetic captions for a tiny-wan model, the
    natural-language list otherwise."""
    info = _info(model)
    if info.kind == "tiny-wan":
        from .synthetic import heldout_prompts

        return heldout_prompts(TINY_PROMPTS.stop)[TINY_PROMPTS.start:]
    return natural_prompts()


def prompt_list_name(model=None) -> str:
    """Where :func:`model_prompts` takes its prompts from, in words."""
    info = _info(model)
    if info.kind == "tiny-wan":
        return (f"held-out synthetic captions {TINY_PROMPTS.start}-{TINY_PROMPTS.stop - 1} "
                "(what the tiny model was trained to draw, in combinations it never saw)")
    return f"the natural-language list {Path('assets') / 'prompts.txt'}"


__all__ = ["TINY_PROMPTS", "model_prompts", "natural_prompts", "prompt_list_name"]
