"""Model families: what the project needs to know about a family of video diffusion transformers.

A :class:`ModelFamily` holds the family's pipeline class (``model_index.json``'s ``_class_name``),
its VAE's temporal and spatial compression and its transformer's patch size (read from the loaded
model's ``vae/config.json`` and ``transformer/config.json`` by :meth:`ModelFamily.with_configs`,
falling back to the family's published values), its generation defaults, which attention modules
of a block are self- and cross-attention, and the checkpoint naming schemes its transformer's
weights are published under (:mod:`attnqat.convert`).

The clip-size rule every command applies comes from it (:meth:`ModelFamily.clip_errors`): height
and width a multiple of ``vae_spatial × patch`` (16 for Wan 2.1), frames ``k·vae_temporal + 1``
(4k+1 for Wan 2.1), with one message per field that every command prints the same way.

Wan 2.1 text-to-video (:data:`WAN21_T2V`) is the first entry; :func:`register` adds another
(docs/development.md, "Adding a model family").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from .convert import SCHEMES, to_diffusers

#: The negative prompt Wan 2.1's own text-to-video demo uses by default (its shared config's
#: ``sample_neg_prompt``; in English: garish colours, overexposed, static, blurred details,
#: subtitles, style, artwork, painting, still frame, overall grey, worst quality, low quality, JPEG
#: artefacts, ugly, mutilated, extra fingers, badly drawn hands or faces, deformed, disfigured,
#: malformed limbs, fused fingers, motionless picture, cluttered background, three legs, crowded
#: background, walking backwards).
WAN_NEGATIVE_PROMPT = ("色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，"
                       "低质量，JPEG压缩残留，丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，"
                       "毁容的，形态畸形的肢体，手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走")


@dataclass(frozen=True)
class ModelFamily:
    """One family of models (e.g. Wan 2.1 text-to-video).

    Attributes:
        name: short id (``wan2.1-t2v``).
        label: what people read (``Wan 2.1 text-to-video``).
        pipeline_class: ``_class_name`` of the family's diffusers ``model_index.json``.
        vae_temporal: frames the VAE folds into one latent frame (after the first frame).
        vae_spatial: pixels per latent pixel along height and width.
        patch_size: the transformer's (time, height, width) patch.
        defaults: generation defaults (height, width, frames, fps, steps, guidance, shift — None:
            :attr:`shift_for` decides — and negative_prompt).
        self_attention, cross_attention: attribute names of a transformer block's self- and
            cross-attention modules.
        checkpoint_schemes: naming schemes its transformer checkpoints come in; ``to_diffusers``
            renames a state dict of any of them to diffusers' names.
        shift_for: the flow shift for a (height, width).
    """

    name: str
    label: str
    pipeline_class: str
    vae_temporal: int
    vae_spatial: int
    patch_size: tuple[int, int, int]
    defaults: Mapping[str, Any] = field(default_factory=dict, repr=False)
    self_attention: str = "attn1"
    cross_attention: str = "attn2"
    checkpoint_schemes: tuple[str, ...] = ()
    to_diffusers: Callable[..., Any] | None = field(default=None, repr=False)
    shift_for: Callable[[int, int], float] | None = field(default=None, repr=False)

    # -- read from the loaded model -------------------------------------------------------------
    def with_configs(self, folder: str | Path) -> "ModelFamily":
        """This family with the factors the model in ``folder`` (a diffusers pipeline folder)
        declares: ``vae/config.json``'s ``scale_factor_temporal`` / ``scale_factor_spatial`` and
        ``transformer/config.json``'s ``patch_size``; a value a config does not state keeps the
        family's."""
        folder = Path(folder)
        vae = _read_config(folder / "vae" / "config.json")
        tr = _read_config(folder / "transformer" / "config.json")
        patch = tr.get("patch_size", self.patch_size)
        return replace(self, vae_temporal=int(vae.get("scale_factor_temporal", self.vae_temporal)),
                       vae_spatial=int(vae.get("scale_factor_spatial", self.vae_spatial)),
                       patch_size=tuple(int(p) for p in patch))

    # -- the clip-size rule ---------------------------------------------------------------------
    @property
    def size_multiple(self) -> int:
        """Height and width are multiples of this: the VAE's factor times the patch."""
        return self.vae_spatial * max(self.patch_size[1], self.patch_size[2])

    @property
    def frame_step(self) -> int:
        """Frames are ``k · frame_step + 1``."""
        return self.vae_temporal * self.patch_size[0]

    def size_rule(self, max_side: int | None = None) -> str:
        """What a height or width must be, in words."""
        m = self.size_multiple
        return (f"a multiple of {m} from {m}{'' if max_side is None else f' to {max_side}'} (the VAE "
                f"downsamples by {self.vae_spatial} and the transformer patches by {self.patch_size[1]})")

    def frames_rule(self, max_frames: int | None = None) -> str:
        """What a frame count must be, in words."""
        s = self.frame_step
        return (f"{s}k+1 frames (1, {s + 1}, {2 * s + 1}, …{'' if max_frames is None else f', {max_frames}'}) "
                f"because the VAE compresses time by {self.vae_temporal}")

    def side_error(self, value: int, max_side: int | None = None) -> str | None:
        """Why ``value`` cannot be a height or width, or None."""
        m = self.size_multiple
        if value < m or (max_side is not None and value > max_side):
            return f"{self.size_rule(max_side)}; got {value!r}"
        if value % m:
            return (f"a multiple of {m} (the VAE downsamples by {self.vae_spatial} and the transformer "
                    f"patches by {self.patch_size[1]}: height and width are multiples of {m}); got {value!r}")
        return None

    def frames_error(self, value: int, max_frames: int | None = None) -> str | None:
        """Why ``value`` cannot be a frame count, or None."""
        s = self.frame_step
        if value < 1 or (max_frames is not None and value > max_frames):
            return f"{self.frames_rule(max_frames)}; got {value!r}"
        if (value - 1) % s:
            return (f"{s}k+1 frames (1, {s + 1}, {2 * s + 1}, …, {8 * s + 1}, …) because the VAE compresses time "
                    f"by {self.vae_temporal}; got {value!r}")
        return None

    def clip_errors(self, height: int | None = None, width: int | None = None, frames: int | None = None,
                    *, max_side: int | None = None, max_frames: int | None = None) -> dict[str, str]:
        """``{field: message}`` for each of height, width and frames that breaks the rule (None
        values are not checked); ``{}`` when the clip size is valid."""
        errors = {}
        for name, value in (("height", height), ("width", width)):
            why = None if value is None else self.side_error(value, max_side)
            if why:
                errors[name] = why
        why = None if frames is None else self.frames_error(frames, max_frames)
        if why:
            errors["frames"] = why
        return errors

    def check_clip(self, height: int | None = None, width: int | None = None, frames: int | None = None,
                   *, names: Mapping[str, str] | None = None, max_side: int | None = None,
                   max_frames: int | None = None) -> None:
        """Raise ``ValueError`` with one line, ``FIELD: message``, for the first field that breaks the
        rule. ``names`` maps a field to what the command calls it (``{"height": "--height"}``)."""
        errors = self.clip_errors(height, width, frames, max_side=max_side, max_frames=max_frames)
        if errors:
            name, message = next(iter(errors.items()))
            raise ValueError(f"{(names or {}).get(name, name)}: {message}")

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a clip of ``frames`` frames."""
        return (frames - 1) // self.vae_temporal + 1


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def wan_shift(height: int, width: int) -> float:
    """Wan 2.1's flow shift: 3 below 720p, 5 at 720p and above."""
    return 5.0 if min(height, width) >= 720 else 3.0


#: Wan 2.1 text-to-video (1.3B and 14B; 480p and 720p), in diffusers' layout.
WAN21_T2V = ModelFamily(
    name="wan2.1-t2v", label="Wan 2.1 text-to-video", pipeline_class="WanPipeline",
    vae_temporal=4, vae_spatial=8, patch_size=(1, 2, 2),
    defaults={"height": 480, "width": 832, "frames": 81, "fps": 16, "steps": 50, "guidance": 5.0,
              "shift": None, "negative_prompt": WAN_NEGATIVE_PROMPT},
    checkpoint_schemes=SCHEMES, to_diffusers=to_diffusers, shift_for=wan_shift)

_FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    """Add a family (its ``pipeline_class`` identifies it in a model folder)."""
    if family.name in _FAMILIES:
        raise ValueError(f"model family {family.name!r} is already registered")
    if any(f.pipeline_class == family.pipeline_class for f in _FAMILIES.values()):
        raise ValueError(f"a family with pipeline class {family.pipeline_class!r} is already registered")
    _FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    del _FAMILIES[name]


def families() -> tuple[ModelFamily, ...]:
    return tuple(_FAMILIES.values())


def by_pipeline_class(cls: str | None) -> ModelFamily | None:
    """The family whose pipeline class is ``cls``, or None."""
    return next((f for f in _FAMILIES.values() if f.pipeline_class == cls), None)


def for_folder(folder: str | Path | None) -> ModelFamily:
    """The family of a diffusers pipeline folder, with the factors its configs declare (a hub id
    or None: Wan 2.1 text-to-video with its published factors)."""
    if folder is None:
        return WAN21_T2V
    folder = Path(folder)
    if not (folder / "model_index.json").is_file():   # a hub id, or not a model: checked where it loads
        return WAN21_T2V
    cls = _read_config(folder / "model_index.json").get("_class_name")
    fam = by_pipeline_class(cls)
    if fam is None:
        raise ValueError(f"{folder} holds a {cls!r}; the families this project knows are "
                         + ", ".join(f"{f.label} ({f.pipeline_class!r})" for f in _FAMILIES.values()))
    return fam.with_configs(folder)


register(WAN21_T2V)

__all__ = ["ModelFamily", "WAN21_T2V", "WAN_NEGATIVE_PROMPT", "by_pipeline_class", "families", "for_folder",
           "register", "unregister", "wan_shift"]
