"""Procedural text-to-video data: flat-coloured shapes moving over plain backgrounds.

Each clip shows one or more objects (a circle, square or triangle in one of a few well separated
colours) that move left, right, up or down, grow or shrink, over a plain background. A caption
states all of it::

    a red circle moves left on a blue background
    an orange square grows and a white triangle moves up on a black background

Grammar (case-insensitive when parsed; a trailing full stop is allowed)::

    caption    := object (" and " object)* " on a " BACKGROUND " background"
    object     := ("a" | "an") " " COLOUR " " SHAPE " " motion
    motion     := "moves left" | "moves right" | "moves up" | "moves down" | "grows" | "shrinks"

Everything is deterministic from a seed. The training stream (:func:`sample_spec`,
:class:`SyntheticClips`) never shows a held-out colour × shape × motion triple
(:func:`is_heldout_triple`), and the held-out prompts (:func:`heldout_prompts`) are made only of
such triples, so no held-out caption can appear in training. Every colour × shape, colour × motion
and shape × motion pair is still seen in training; only the triples are new.

Clips are ``uint8`` arrays of shape ``(T, H, W, 3)``; the default is 33 frames of 128 × 128 at
:data:`FPS` = 16 frames per second. Objects are drawn with a one-pixel anti-aliased edge.

One renderer and one stream serve every user. :func:`render_batch` draws a batch of clip
specifications (:func:`spec_params` rows) on any PyTorch device: the tiny model's trainer draws on
the GPU, :func:`render` is the same function on the CPU for one clip. :class:`SpecStream` hands out
the specifications ``spec_at(seed, k)`` by index in batches, the same for any number of DataLoader
workers or ranks (:func:`spec_batches` for the trainer, :class:`SyntheticClips` rendered).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

FPS = 16
DEFAULT_FRAMES = 33
DEFAULT_SIZE = 128

#: Object colours (sRGB), in a fixed order that the held-out rule depends on.
OBJECT_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (225, 35, 35),
    "orange": (255, 140, 0),
    "yellow": (250, 225, 30),
    "green": (40, 185, 60),
    "cyan": (30, 205, 225),
    "blue": (30, 90, 240),
    "purple": (180, 50, 190),
    "white": (245, 245, 245),
}
#: Background colours (sRGB). Coloured backgrounds are darker than the object colour of that name.
BACKGROUND_COLOURS: dict[str, tuple[int, int, int]] = {
    "black": (15, 15, 15),
    "gray": (120, 120, 120),
    "white": (240, 240, 240),
    "blue": (30, 50, 150),
    "green": (30, 110, 50),
}
#: Shapes, in a fixed order that the held-out rule depends on.
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
#: Motions, in a fixed order that the held-out rule depends on.
MOTIONS: tuple[str, ...] = ("left", "right", "up", "down", "grow", "shrink")
TRANSLATIONS: tuple[str, ...] = ("left", "right", "up", "down")
COLOURS: tuple[str, ...] = tuple(OBJECT_COLOURS)
BACKGROUNDS: tuple[str, ...] = tuple(BACKGROUND_COLOURS)
MAX_OBJECTS = 3

#: How a caption says each motion.
MOTION_PHRASE = {"left": "moves left", "right": "moves right", "up": "moves up",
                 "down": "moves down", "grow": "grows", "shrink": "shrinks"}
_PHRASE_MOTION = {v: k for k, v in MOTION_PHRASE.items()}
_ALIASES = {"grey": "gray", "colour": "color"}

# Geometry ranges, as fractions of the shorter frame side.
SIZE_RANGE = (0.17, 0.28)          # object extent ("diameter") for translations: 22-36 px at 128
TRAVEL_RANGE = (0.35, 0.55)        # distance travelled over the clip: 45-70 px at 128
GROW_START_RANGE = (0.16, 0.19)    # extent at the small end of grow/shrink: 20-24 px at 128
GROW_RATIO_RANGE = (1.6, 2.0)      # large end / small end
MARGIN = 0.03                      # kept free at the frame border
GAP = 0.05                         # kept free between two objects at every frame

_HELDOUT_SEED = 20261122


# ----------------------------------------------------------------------------------------------
# Specifications and captions


@dataclass(frozen=True)
class ObjectSpec:
    """One object: what the caption states (colour, shape, motion) and, optionally, where it is.

    Geometry is in fractions of the frame: ``start`` is the centre at the first frame (x, y; y
    grows downwards), ``extent`` the object's size at the first frame as a fraction of the shorter
    side, and ``amount`` the travelled distance (a fraction of the width for left/right, of the
    height for up/down) or the end/start size ratio for grow/shrink. ``None`` means "not chosen";
    :func:`render` then uses a fixed layout derived from the caption.
    """

    colour: str
    shape: str
    motion: str
    start: tuple[float, float] | None = None
    extent: float | None = None
    amount: float | None = None

    def __post_init__(self) -> None:
        if self.colour not in OBJECT_COLOURS:
            raise ValueError(f"unknown colour {self.colour!r}; expected one of {', '.join(COLOURS)}")
        if self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r}; expected one of {', '.join(SHAPES)}")
        if self.motion not in MOTIONS:
            raise ValueError(f"unknown motion {self.motion!r}; expected one of {', '.join(MOTIONS)}")

    @property
    def triple(self) -> tuple[str, str, str]:
        """The (colour, shape, motion) combination the caption states."""
        return (self.colour, self.shape, self.motion)

    @property
    def has_geometry(self) -> bool:
        return self.start is not None and self.extent is not None and self.amount is not None

    def phrase(self) -> str:
        article = "an" if self.colour[0] in "aeiou" else "a"
        return f"{article} {self.colour} {self.shape} {MOTION_PHRASE[self.motion]}"


@dataclass(frozen=True)
class ClipSpec:
    """A clip: its objects (drawn in order, later ones on top) and its background colour."""

    objects: tuple[ObjectSpec, ...]
    background: str = "black"

    def __post_init__(self) -> None:
        objects = tuple(self.objects)
        object.__setattr__(self, "objects", objects)
        if not 1 <= len(objects) <= MAX_OBJECTS:
            raise ValueError(f"a clip has 1 to {MAX_OBJECTS} objects, got {len(objects)}")
        if not all(isinstance(o, ObjectSpec) for o in objects):
            raise TypeError("ClipSpec.objects must be ObjectSpec instances")
        if self.background not in BACKGROUND_COLOURS:
            raise ValueError(f"unknown background {self.background!r}; expected one of "
                             f"{', '.join(BACKGROUNDS)}")

    @property
    def caption(self) -> str:
        """The caption of this clip (see the module docstring for the grammar)."""
        return " and ".join(o.phrase() for o in self.objects) + f" on a {self.background} background"

    @property
    def triples(self) -> tuple[tuple[str, str, str], ...]:
        return tuple(o.triple for o in self.objects)

    def semantic(self) -> "ClipSpec":
        """The same clip without geometry (what the caption alone says)."""
        return ClipSpec(tuple(ObjectSpec(*o.triple) for o in self.objects), self.background)


_CAPTION_HELP = (
    "expected '<object> [and <object>] on a <background> background', where <object> is "
    "'a <colour> <shape> <motion>'; colour: " + "|".join(COLOURS) + "; shape: " + "|".join(SHAPES)
    + "; motion: " + "|".join(MOTION_PHRASE.values()) + "; background: " + "|".join(BACKGROUNDS)
)


def caption_of(spec: ClipSpec) -> str:
    """The caption of ``spec``."""
    return spec.caption


def parse_caption(caption: str) -> ClipSpec:
    """Read a caption written in this module's grammar back into a :class:`ClipSpec` (without
    geometry). Raises ``ValueError`` naming what was expected when the caption does not parse."""
    if not isinstance(caption, str):
        raise TypeError(f"caption must be a string, got {type(caption).__name__}")
    text = " ".join(caption.strip().lower().rstrip(".").split())
    for a, b in _ALIASES.items():
        text = re.sub(rf"\b{a}\b", b, text)
    m = re.fullmatch(r"(?P<objs>.+) on an? (?P<bg>[a-z]+) background", text)
    if m is None:
        raise ValueError(f"cannot parse caption {caption!r}: {_CAPTION_HELP}")
    bg = m.group("bg")
    if bg not in BACKGROUND_COLOURS:
        raise ValueError(f"cannot parse caption {caption!r}: unknown background {bg!r}; "
                         f"expected one of {', '.join(BACKGROUNDS)}")
    clauses = re.split(r" and (?=an? )", m.group("objs"))
    objects = []
    for clause in clauses:
        cm = re.fullmatch(r"an? (?P<colour>[a-z]+) (?P<shape>[a-z]+) (?P<motion>moves (?:to the )?"
                          r"[a-z]+|[a-z]+)", clause)
        if cm is None:
            raise ValueError(f"cannot parse {clause!r} in caption {caption!r}: {_CAPTION_HELP}")
        colour, shape = cm.group("colour"), cm.group("shape")
        motion = _PHRASE_MOTION.get(cm.group("motion").replace("to the ", ""))
        if colour not in OBJECT_COLOURS:
            raise ValueError(f"cannot parse caption {caption!r}: unknown colour {colour!r}; "
                             f"expected one of {', '.join(COLOURS)}")
        if shape not in SHAPES:
            raise ValueError(f"cannot parse caption {caption!r}: unknown shape {shape!r}; "
                             f"expected one of {', '.join(SHAPES)}")
        if motion is None:
            raise ValueError(f"cannot parse caption {caption!r}: unknown motion "
                             f"{cm.group('motion')!r}; expected one of "
                             f"{', '.join(MOTION_PHRASE.values())}")
        objects.append(ObjectSpec(colour, shape, motion))
    if len(objects) > MAX_OBJECTS:
        raise ValueError(f"cannot parse caption {caption!r}: at most {MAX_OBJECTS} objects")
    return ClipSpec(tuple(objects), bg)


# ----------------------------------------------------------------------------------------------
# The held-out split


def is_heldout_triple(colour: str, shape: str, motion: str) -> bool:
    """Whether a colour × shape × motion triple is held out of training.

    Rule: with ``c``, ``s``, ``m`` the indices in :data:`COLOURS`, :data:`SHAPES` and
    :data:`MOTIONS`, the triple is held out iff ``m == (c + 2 s) mod 6``. That holds out exactly
    one motion per colour × shape pair (24 of 144 triples) and at most one shape per colour ×
    motion pair, and leaves at least six of eight colours for every shape × motion pair, so every
    pair of attributes is still seen in training.
    """
    c, s, m = COLOURS.index(colour), SHAPES.index(shape), MOTIONS.index(motion)
    return m == (c + 2 * s) % len(MOTIONS)


HELDOUT_TRIPLES: tuple[tuple[str, str, str], ...] = tuple(
    (c, s, m) for c in COLOURS for s in SHAPES for m in MOTIONS if is_heldout_triple(c, s, m))
TRAIN_TRIPLES: tuple[tuple[str, str, str], ...] = tuple(
    (c, s, m) for c in COLOURS for s in SHAPES for m in MOTIONS if not is_heldout_triple(c, s, m))


def split_of(spec: ClipSpec | str) -> str:
    """``"train"`` when no object is a held-out triple, ``"heldout"`` when every object is, and
    ``"neither"`` for a mixture (such clips are never produced)."""
    if isinstance(spec, str):
        spec = parse_caption(spec)
    held = [is_heldout_triple(*t) for t in spec.triples]
    if not any(held):
        return "train"
    return "heldout" if all(held) else "neither"


# ----------------------------------------------------------------------------------------------
# Sampling


def _bound_radius(shape: str, extent: float) -> float:
    """Radius (fraction of the shorter side) of a circle around the drawn shape of that extent."""
    return extent * {"circle": 0.5, "square": 0.5 * 0.85 * math.sqrt(2), "triangle": 0.6}[shape]


def _track(obj: ObjectSpec, t: np.ndarray, aspect: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Centre (x, y as fractions of width/height) and extent (fraction of the shorter side) at
    times ``t`` in [0, 1]. ``aspect`` = width / height."""
    x0, y0 = obj.start  # type: ignore[misc]
    x = np.full_like(t, x0)
    y = np.full_like(t, y0)
    e = np.full_like(t, obj.extent)
    a = obj.amount
    if obj.motion == "left":
        x = x0 - a * t
    elif obj.motion == "right":
        x = x0 + a * t
    elif obj.motion == "up":
        y = y0 - a * t
    elif obj.motion == "down":
        y = y0 + a * t
    elif obj.motion == "grow":
        e = obj.extent * a ** t
    else:  # shrink
        e = obj.extent * a ** (-t)
    return x, y, e


def _sample_geometry(rng: np.random.Generator, obj: ObjectSpec, aspect: float) -> ObjectSpec:
    """Pick a start, extent and amount so that the object stays inside the frame."""
    short_w = min(1.0, 1.0 / aspect)   # shorter side as a fraction of the width
    short_h = min(1.0, aspect)         # ... of the height
    if obj.motion in TRANSLATIONS:
        extent = float(rng.uniform(*SIZE_RANGE))
        amount = float(rng.uniform(*TRAVEL_RANGE))
        max_extent = extent
    else:
        extent_small = float(rng.uniform(*GROW_START_RANGE))
        ratio = float(rng.uniform(*GROW_RATIO_RANGE))
        extent = extent_small if obj.motion == "grow" else extent_small * ratio
        amount = ratio
        max_extent = extent_small * ratio
    r = _bound_radius(obj.shape, max_extent)
    rx, ry = r * short_w + MARGIN, r * short_h + MARGIN
    lo_x, hi_x, lo_y, hi_y = rx, 1 - rx, ry, 1 - ry
    if obj.motion == "left":
        lo_x += amount
    elif obj.motion == "right":
        hi_x -= amount
    elif obj.motion == "up":
        lo_y += amount
    elif obj.motion == "down":
        hi_y -= amount
    x0 = float(rng.uniform(lo_x, max(lo_x, hi_x)))
    y0 = float(rng.uniform(lo_y, max(lo_y, hi_y)))
    return replace(obj, start=(x0, y0), extent=extent, amount=amount)


def _separated(objects: Sequence[ObjectSpec], aspect: float, steps: int = 17) -> bool:
    """Whether every pair of objects keeps :data:`GAP` between their bounding circles throughout."""
    t = np.linspace(0.0, 1.0, steps)
    # positions in units of the shorter side
    sx, sy = (aspect, 1.0) if aspect >= 1 else (1.0, 1.0 / aspect)
    tracks = []
    for o in objects:
        x, y, e = _track(o, t, aspect)
        tracks.append((x * sx, y * sy, _bound_radius(o.shape, 1.0) * e))
    for i in range(len(tracks)):
        for j in range(i + 1, len(tracks)):
            (xi, yi, ri), (xj, yj, rj) = tracks[i], tracks[j]
            if np.any(np.hypot(xi - xj, yi - yj) < ri + rj + GAP):
                return False
    return True


def _choose_triples(rng: np.random.Generator, pool: Sequence[tuple[str, str, str]], n: int,
                    background: str) -> list[tuple[str, str, str]]:
    chosen: list[tuple[str, str, str]] = []
    used = {background}
    candidates = [t for t in pool if t[0] != background]
    while len(chosen) < n:
        options = [t for t in candidates if t[0] not in used]
        t = options[int(rng.integers(len(options)))]
        chosen.append(t)
        used.add(t[0])
    return chosen


def _check_object_weights(weights: Sequence[float] | None, max_objects: int) -> None:
    if weights is None:
        return
    if len(weights) != max_objects or any(not w >= 0 for w in weights) or not sum(weights) > 0:
        raise ValueError(f"object_weights must be {max_objects} non-negative numbers (for 1.."
                         f"{max_objects} objects) with a positive sum, got {list(weights)}")


def sample_spec(rng: np.random.Generator, split: str = "train", max_objects: int = 2,
                aspect: float = 1.0, object_weights: Sequence[float] | None = None) -> ClipSpec:
    """Draw one clip (caption and geometry) from ``split`` (``"train"`` or ``"heldout"``).

    The background is uniform over :data:`BACKGROUNDS`; the number of objects uniform in
    1..``max_objects``, or drawn with the relative ``object_weights`` (one per count, 1 first);
    each object's colour × shape × motion triple is uniform over the split's
    triples whose colour differs from the background and from the other objects'. Objects never
    overlap and stay inside the frame (``aspect`` = width / height). A ``"train"`` spec never
    contains a held-out triple.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if not 1 <= max_objects <= MAX_OBJECTS:
        raise ValueError(f"max_objects must be in 1..{MAX_OBJECTS}, got {max_objects}")
    _check_object_weights(object_weights, max_objects)
    pool = TRAIN_TRIPLES if split == "train" else HELDOUT_TRIPLES
    background = BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))]
    if object_weights is None:
        n = int(rng.integers(1, max_objects + 1))
    else:
        w = np.asarray(object_weights, dtype=np.float64)
        n = 1 + int(rng.choice(max_objects, p=w / w.sum()))
    triples = _choose_triples(rng, pool, n, background)
    for _ in range(200):
        objects = [_sample_geometry(rng, ObjectSpec(*t), aspect) for t in triples]
        if len(objects) == 1 or _separated(objects, aspect):
            return ClipSpec(tuple(objects), background)
    # Could not place them apart (very rare with two objects): fall back to fewer objects.
    return ClipSpec((objects[0],), background)


def _rng_at(seed: int, index: int, stream: int = 0) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(stream), int(index)]))


def spec_at(seed: int, index: int, split: str = "train", max_objects: int = 2,
            aspect: float = 1.0, object_weights: Sequence[float] | None = None) -> ClipSpec:
    """The ``index``-th clip spec of the stream with ``seed``: independent of every other index,
    so any worker can compute any item."""
    stream = 0 if split == "train" else 1
    return sample_spec(_rng_at(seed, index, stream), split, max_objects, aspect, object_weights)


def with_layout(spec: ClipSpec, seed: int = 0, aspect: float = 1.0) -> ClipSpec:
    """``spec`` with geometry filled in for objects that have none; the layout is a fixed
    function of the caption and ``seed``."""
    if all(o.has_geometry for o in spec.objects):
        return spec
    key = zlib.crc32(spec.caption.encode())
    for attempt in range(200):
        rng = _rng_at(seed, key, 2 + attempt)
        objects = [o if o.has_geometry else _sample_geometry(rng, o, aspect) for o in spec.objects]
        if len(objects) == 1 or _separated(objects, aspect):
            break
    return ClipSpec(tuple(objects), spec.background)


def heldout_specs(n: int, max_objects: int = 2, aspect: float = 1.0) -> list[ClipSpec]:
    """The first ``n`` distinct held-out clips (with geometry) of a fixed sequence: the list for
    ``n`` is a prefix of the list for any larger ``n``."""
    if n < 0:
        raise ValueError("n must be >= 0")
    out: list[ClipSpec] = []
    seen: set[str] = set()
    index = 0
    while len(out) < n:
        if index > 100 * n + 10_000:
            raise ValueError(f"cannot find {n} distinct held-out prompts with max_objects={max_objects}")
        spec = sample_spec(_rng_at(_HELDOUT_SEED, index, 1), "heldout", max_objects, aspect)
        index += 1
        if spec.caption not in seen:
            seen.add(spec.caption)
            out.append(spec)
    return out


def heldout_prompts(n: int, max_objects: int = 2) -> list[str]:
    """A fixed list of ``n`` distinct held-out captions (prefix-stable in ``n``). None of them
    can appear in the training stream: each object in them is a held-out triple."""
    return [s.caption for s in heldout_specs(n, max_objects)]


# ----------------------------------------------------------------------------------------------
# Rendering: one renderer, batched, on any PyTorch device (the CPU for single clips, the GPU for
# the tiny model's training batches)

OBJ_FIELDS = 10           # present, r, g, b, shape, motion, x0, y0, extent, amount
PARAMS = MAX_OBJECTS * OBJ_FIELDS + 3   # + background r, g, b


def _size_hw(size: int | tuple[int, int]) -> tuple[int, int]:
    if isinstance(size, (int, np.integer)):
        h = w = int(size)
    else:
        h, w = (int(v) for v in size)
    if h < 16 or w < 16:
        raise ValueError(f"size must be at least 16 x 16, got {h} x {w}")
    return h, w


def spec_params(spec: ClipSpec) -> np.ndarray:
    """A clip specification with geometry as the flat float64 vector :func:`render_batch` reads:
    :data:`OBJ_FIELDS` numbers per object slot (absent slots are zero), then the background."""
    p = np.zeros(PARAMS, dtype=np.float64)
    for j, o in enumerate(spec.objects):
        if not o.has_geometry:
            raise ValueError(f"object {j} of {spec.caption!r} has no geometry (see with_layout)")
        p[j * OBJ_FIELDS:(j + 1) * OBJ_FIELDS] = (
            1.0, *OBJECT_COLOURS[o.colour], SHAPES.index(o.shape), MOTIONS.index(o.motion),
            o.start[0], o.start[1], o.extent, o.amount)
    p[-3:] = BACKGROUND_COLOURS[spec.background]
    return p


def params_of(specs: Sequence[ClipSpec]) -> torch.Tensor:
    """``(B, PARAMS)`` float64 of :func:`spec_params` for each of ``specs``."""
    return torch.from_numpy(np.stack([spec_params(s) for s in specs]))


def _circle(px: torch.Tensor, py: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(px * px + py * py) - 0.5 * scale


def _square(px: torch.Tensor, py: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.maximum(px.abs(), py.abs()) - 0.5 * 0.85 * scale


def _triangle(px: torch.Tensor, py: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An equilateral triangle pointing up, circumradius 0.6 * extent, centred on its centroid."""
    s3 = math.sqrt(3.0) / 2.0
    return torch.maximum(torch.maximum(py, s3 * px - 0.5 * py), -s3 * px - 0.5 * py) - 0.3 * scale


_SDF = (_circle, _square, _triangle)   # in the order of SHAPES


def render_batch(params: torch.Tensor, frames: int, size: int | tuple[int, int]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw a batch of clips (:func:`spec_params` rows) on ``params``' device.

    Motion is linear in time (sizes geometric for grow/shrink) from the first frame to the last;
    each object is a signed distance field with a one-pixel anti-aliased edge, drawn in order
    (later ones on top). ``size`` is an int (square) or ``(height, width)``.

    Returns:
        ``(clips, fg)``: clips ``(B, T, H, W, 3)`` float32 holding integers 0..255, and ``fg``
        ``(B, T, H, W)`` bool, the pixels any object touches.
    """
    dev = params.device
    b = params.shape[0]
    h, w = _size_hw(size)
    t = torch.from_numpy(np.linspace(0.0, 1.0, frames)).to(dev).view(1, frames)
    ys = (torch.arange(h, dtype=torch.float32, device=dev) + 0.5).view(1, 1, h, 1)
    xs = (torch.arange(w, dtype=torch.float32, device=dev) + 0.5).view(1, 1, 1, w)
    bg = params[:, -3:].float().view(b, 1, 1, 1, 3)
    img = bg.expand(b, frames, h, w, 3).clone()
    fg = torch.zeros(b, frames, h, w, dtype=torch.bool, device=dev)
    for j in range(MAX_OBJECTS):
        p = params[:, j * OBJ_FIELDS:(j + 1) * OBJ_FIELDS]
        present = p[:, 0] > 0
        if not bool(present.any()):
            continue
        colour = p[:, 1:4].float().view(b, 1, 1, 1, 3)
        shape, motion = p[:, 4].long().view(b, 1), p[:, 5].long().view(b, 1)
        x0, y0, ext, amt = (p[:, i:i + 1] for i in (6, 7, 8, 9))
        x, y, e = x0.expand(b, frames), y0.expand(b, frames), ext.expand(b, frames)
        # motions in the order of MOTIONS: left, right, up, down, grow, shrink
        x = torch.where(motion == 0, x0 - amt * t, torch.where(motion == 1, x0 + amt * t, x))
        y = torch.where(motion == 2, y0 - amt * t, torch.where(motion == 3, y0 + amt * t, y))
        e = torch.where(motion == 4, ext * amt ** t, torch.where(motion == 5, ext * amt ** (-t), e))
        cx = (x * w).float().view(b, frames, 1, 1)
        cy = (y * h).float().view(b, frames, 1, 1)
        scale = (e * min(h, w)).float().view(b, frames, 1, 1)   # extent in pixels
        px, py = xs - cx, ys - cy
        sdf = None
        sid = shape.view(b, 1, 1, 1)
        for k, shape_sdf in enumerate(_SDF):   # only the shapes this slot holds
            chosen = sid == k
            if bool(chosen.any()):
                d = shape_sdf(px, py, scale)
                sdf = d if sdf is None else torch.where(chosen, d, sdf)
        alpha = (0.5 - sdf).clamp(0.0, 1.0) * present.view(b, 1, 1, 1)
        fg |= alpha > 0
        img = img + alpha.unsqueeze(-1) * (colour - img)
    return torch.round(img).clamp(0.0, 255.0), fg


def render(spec: ClipSpec | str, frames: int = DEFAULT_FRAMES,
           size: int | tuple[int, int] = DEFAULT_SIZE) -> np.ndarray:
    """Draw ``spec`` (a :class:`ClipSpec` or a caption) as a ``uint8`` array ``(T, H, W, 3)``
    (:func:`render_batch` on the CPU, one clip).

    ``size`` is an int (square) or ``(height, width)``. Objects without geometry get the fixed
    layout of :func:`with_layout`.
    """
    if isinstance(spec, str):
        spec = parse_caption(spec)
    if frames < 2:
        raise ValueError(f"frames must be >= 2, got {frames}")
    h, w = _size_hw(size)
    spec = with_layout(spec, aspect=w / h)
    for o in spec.objects:
        if o.colour == spec.background:
            raise ValueError(f"a {o.colour} object on a {spec.background} background is invisible")
    with _one_thread():
        clips, _ = render_batch(params_of([spec]), frames, (h, w))
    return clips[0].to(torch.uint8).numpy()


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """PyTorch's intra-op threads limited to one: a single clip is too small to gain from them,
    and where other processes share the cores (DataLoader workers, scoring pools, a loaded
    machine) two threads made it up to 9x slower (33 x 128 x 128: 15 ms with one, 135 ms with
    two on the loaded 2-core machine, 2026-11-26). Only speed depends on it."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def clip_at(seed: int, index: int, split: str = "train", frames: int = DEFAULT_FRAMES,
            size: int | tuple[int, int] = DEFAULT_SIZE, max_objects: int = 2
            ) -> tuple[np.ndarray, str]:
    """The ``index``-th clip of the stream with ``seed``: ``(frames uint8 (T, H, W, 3), caption)``."""
    h, w = _size_hw(size)
    spec = spec_at(seed, index, split, max_objects, w / h)
    return render(spec, frames, (h, w)), spec.caption


def to_tensor(frames: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Clips ``(..., T, H, W, 3)`` holding 0..255 (``uint8``, or float as :func:`render_batch`
    returns them) → ``float32 (..., 3, T, H, W)`` in [-1, 1] (the Wan VAE's input layout)."""
    x = torch.as_tensor(np.ascontiguousarray(frames) if isinstance(frames, np.ndarray) else frames)
    return x.movedim(-1, -4).float().div(127.5).sub(1.0).contiguous()


# ----------------------------------------------------------------------------------------------
# The stream: clip specifications by index, in batches, the same for any number of workers


class SpecStream(IterableDataset):
    """Batches of the stream ``spec_at(seed, k, split, ...)``: batch ``b`` holds items
    ``start + b * batch ...`` as ``(params (batch, PARAMS) float64, captions)``
    (:func:`spec_params`), ``batches`` of them (None: endless).

    DataLoader worker ``w`` of ``n`` on rank ``r`` of ``world_size`` makes the batches with
    ``b % (n * world_size) == r * n + w``; a loader hands its workers' batches out in order, so
    the stream is the same whatever the number of workers, and ranks never repeat a batch.
    ``object_weights``: see :func:`sample_spec`; ``aspect`` = width / height."""

    def __init__(self, seed: int, start: int = 0, batch: int = 1, split: str = "train",
                 max_objects: int = 2, object_weights: Sequence[float] | None = None,
                 aspect: float = 1.0, batches: int | None = None, rank: int = 0,
                 world_size: int = 1) -> None:
        if split not in ("train", "heldout"):
            raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        self.seed, self.start, self.batch, self.split = seed, start, batch, split
        self.max_objects, self.object_weights, self.aspect = max_objects, object_weights, aspect
        self.batches, self.rank, self.world_size = batches, rank, world_size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, list[str]]]:
        info = get_worker_info()
        n, w = (info.num_workers, info.id) if info is not None else (1, 0)
        b = self.rank * n + w
        while self.batches is None or b < self.batches:
            k0 = self.start + b * self.batch
            specs = [spec_at(self.seed, k, self.split, self.max_objects, self.aspect,
                             self.object_weights) for k in range(k0, k0 + self.batch)]
            yield params_of(specs), [s.caption for s in specs]
            b += n * self.world_size


def spec_batches(seed: int, start: int, batch: int, workers: int,
                 object_weights: Sequence[float] | None = None
                 ) -> Iterator[tuple[torch.Tensor, list[str]]]:
    """Endless ``(params (B, PARAMS) float64, captions)`` batches of the training stream from
    item ``start`` on, drawn by ``workers`` DataLoader processes (0: this one)."""
    loader = DataLoader(SpecStream(seed, start, batch, object_weights=object_weights),
                        batch_size=None, num_workers=workers,
                        persistent_workers=workers > 0, prefetch_factor=4 if workers > 0 else None)
    yield from loader


class SyntheticClips(IterableDataset):
    """An unbounded (or ``length``-long) stream of ``(video, caption)`` pairs: the
    :class:`SpecStream` of one clip per batch, rendered.

    ``video`` is ``float32 (3, T, H, W)`` in [-1, 1]. Item ``k`` of the stream is
    ``clip_at(seed * 1_000_003 + epoch, k, split, ...)``, whatever the number of DataLoader
    workers or ranks: worker ``w`` of ``n`` on rank ``r`` of ``world_size`` yields the items with
    ``k % (n * world_size) == r * n + w`` (so each worker seeds itself from the item index, and
    no two workers or ranks repeat an item). Set ``epoch`` (or call :meth:`set_epoch`) to draw a
    fresh stream per epoch. With ``split="train"`` no item ever shows a held-out triple.
    """

    def __init__(self, seed: int = 0, frames: int = DEFAULT_FRAMES,
                 size: int | tuple[int, int] = DEFAULT_SIZE, split: str = "train",
                 max_objects: int = 2, length: int | None = None, rank: int = 0,
                 world_size: int = 1, epoch: int = 0) -> None:
        self.seed, self.frames, self.size, self.epoch = seed, frames, _size_hw(size), epoch
        h, w = self.size
        self.specs = SpecStream(seed * 1_000_003 + epoch, split=split, max_objects=max_objects,
                                aspect=w / h, batches=length, rank=rank, world_size=world_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.specs.seed = self.seed * 1_000_003 + epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, str]]:
        for params, captions in self.specs:
            clips, _ = render_batch(params, self.frames, self.size)
            yield to_tensor(clips[0]), captions[0]


# ----------------------------------------------------------------------------------------------
# Command line: dump sample clips


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="folder to write clips and captions.json into")
    parser.add_argument("--n", type=int, default=8, help="number of clips")
    parser.add_argument("--split", choices=("train", "heldout"), default="train",
                        help="training stream or the fixed held-out prompts")
    parser.add_argument("--seed", type=int, default=0, help="stream seed (train split only)")
    parser.add_argument("--frames", type=int, default=DEFAULT_FRAMES, help="frames per clip")
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE, help="height and width in pixels")
    parser.add_argument("--max-objects", type=int, default=2, help="objects per clip, at most")


def run(args: argparse.Namespace) -> int:
    from .video import write_mp4

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.split == "heldout":
        specs = heldout_specs(args.n, args.max_objects)
    else:
        specs = [spec_at(args.seed, k, "train", args.max_objects) for k in range(args.n)]
    index = []
    for k, spec in enumerate(specs):
        name = f"{args.split}_{k:05d}.mp4"
        write_mp4(render(spec, args.frames, args.size), out / name, FPS)
        index.append({"video": name, "caption": spec.caption})
        print(f"{name}  {spec.caption}")
    (out / "captions.json").write_text(json.dumps(index, indent=1))
    return 0


__all__ = [
    "FPS", "COLOURS", "SHAPES", "MOTIONS", "BACKGROUNDS", "OBJECT_COLOURS", "BACKGROUND_COLOURS",
    "ObjectSpec", "ClipSpec", "caption_of", "parse_caption", "is_heldout_triple", "split_of",
    "HELDOUT_TRIPLES", "TRAIN_TRIPLES", "sample_spec", "spec_at", "with_layout", "heldout_specs",
    "heldout_prompts", "OBJ_FIELDS", "PARAMS", "spec_params", "params_of", "render_batch", "render",
    "clip_at", "to_tensor", "SpecStream", "spec_batches", "SyntheticClips",
]
