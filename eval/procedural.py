"""Procedural evaluator for clips of the synthetic shapes benchmark (``attnqat.synthetic``).

Given a caption in the benchmark's grammar and a clip (``uint8 (T, H, W, 3)``), it says whether
the stated background, and for each stated object its colour, shape and motion, are what the clip
shows, and measures temporal consistency (object presence, size stability, path smoothness,
background flicker) and frame cleanliness. Classical image processing only:

1. background = median colour of the frame border; foreground = pixels (after a light Gaussian
   blur) farther than a fixed RGB distance from it;
2. objects = connected components per frame of a plausible size, linked over frames by position
   and colour into tracks; a track present in at least half of the frames is an object;
3. colour = nearest named colour (CIELAB) to the track's median interior colour; shape = from
   the angular profile of the outline (its 3rd and 4th circular harmonics and the fill of the
   circumscribed circle), which does not depend on size or rotation; motion = linear regression
   of the centroid track and of the log size over time (largest of horizontal, vertical or
   scale change);
4. stated objects are matched to detected ones (one to one, the assignment that agrees most).

The clip is analysed without looking at the caption (:func:`analyze_clip`), so the caption
cannot bias what is detected; :func:`score_analysis` then compares. :func:`validate` measures
the evaluator on ground-truth clips from the generator, on degraded ones, on noise and with
swapped captions (``attnqat eval score --validate N``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
from scipy import ndimage

from attnqat.synthetic import BACKGROUND_COLOURS, OBJECT_COLOURS, ClipSpec, parse_caption

ATTRIBUTES: tuple[str, ...] = ("colour", "shape", "motion")

# Every named colour an object could be classified as (a black or gray blob matches no object).
_NAMED_COLOURS: dict[str, tuple[int, int, int]] = {
    **OBJECT_COLOURS, "black": BACKGROUND_COLOURS["black"], "gray": BACKGROUND_COLOURS["gray"]}

WORK_SIZE = 128            # analysis resolution (shorter side) for larger inputs
FG_DISTANCE = 55.0         # RGB distance from the background that makes a pixel foreground
MIN_AREA = 0.004           # smallest object, fraction of the frame (66 px at 128 x 128)
MAX_AREA = 0.35            # largest object, fraction of the frame
MAX_BLOBS = 6              # components per frame considered, largest first
MIN_PRESENCE = 0.5         # fraction of frames an object must be seen in
N_BINS = 32                # angular bins of the outline profile
MIN_TRANSLATION = 0.08     # fraction of the frame travelled that counts as moving
MIN_SCALE = 0.15           # |log(size ratio)| that counts as growing/shrinking


# ----------------------------------------------------------------------------------------------
# Colour


def rgb_to_lab(rgb: np.ndarray) -> np.ndarray:
    """sRGB (0..255, last axis 3) → CIELAB (D65)."""
    c = np.asarray(rgb, dtype=np.float64) / 255.0
    c = np.where(c > 0.04045, ((c + 0.055) / 1.055) ** 2.4, c / 12.92)
    m = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]])
    xyz = c @ m.T / np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > 216 / 24389, np.cbrt(xyz), (24389 / 27 * xyz + 16) / 116)
    return np.stack([116 * f[..., 1] - 16, 500 * (f[..., 0] - f[..., 1]),
                     200 * (f[..., 1] - f[..., 2])], axis=-1)


def _palette(colours: dict[str, tuple[int, int, int]]) -> tuple[list[str], np.ndarray]:
    names = list(colours)
    return names, rgb_to_lab(np.array([colours[n] for n in names], dtype=np.float64))


_OBJ_NAMES, _OBJ_LAB = _palette(_NAMED_COLOURS)
_BG_NAMES, _BG_LAB = _palette(BACKGROUND_COLOURS)


def nearest_colour(rgb: Sequence[float], background: bool = False) -> str:
    """The named colour nearest (CIELAB distance) to ``rgb``: among the object colours plus black
    and gray, or among the background colours when ``background``."""
    names, lab = (_BG_NAMES, _BG_LAB) if background else (_OBJ_NAMES, _OBJ_LAB)
    d = np.linalg.norm(lab - rgb_to_lab(np.asarray(rgb, dtype=np.float64)), axis=-1)
    return names[int(np.argmin(d))]


# ----------------------------------------------------------------------------------------------
# Analysis (caption-independent)


@dataclass
class DetectedObject:
    """One object track found in a clip."""

    colour: str
    shape: str
    motion: str
    presence: float               # fraction of frames it was found in
    rgb: tuple[float, float, float]
    displacement: tuple[float, float]   # (dx, dy) over the clip, fractions of width / height
    log_scale: float              # log(size at last frame / size at first frame), fitted
    harmonics: tuple[float, float]      # 3rd and 4th harmonic of the outline profile
    fill: float                   # area / area of the circumscribed circle
    size_jitter: float            # std of log size around its linear fit
    path_jitter: float            # RMS distance of the centroid from a quadratic path, px at 128
    size_stability: float         # exp(-size_jitter / 0.05), 1 = steady size
    path_smoothness: float        # exp(-path_jitter / 1.0), 1 = smooth path
    frames: list[int] = field(default_factory=list)
    centroids: list[tuple[float, float]] = field(default_factory=list)   # (x, y), analysis pixels
    areas: list[float] = field(default_factory=list)                      # analysis pixels

    def attributes(self) -> tuple[str, str, str]:
        return (self.colour, self.shape, self.motion)


@dataclass
class ClipAnalysis:
    """What :func:`analyze_clip` found in a clip, independent of any caption."""

    background: str
    background_rgb: tuple[float, float, float]
    objects: list[DetectedObject]
    flicker: float          # mean |Δ luma| between consecutive frames over the background, 0..255
    background_noise: float  # RMS of background luma around its frame's background colour
    stray_fraction: float   # fraction of pixels that are foreground but belong to no object
    flicker_score: float    # exp(-flicker / 3)
    cleanliness: float      # exp(-background_noise / 10) * (1 - min(1, 25 * stray_fraction))
    frames: int
    height: int
    width: int


def check_frames(frames: np.ndarray) -> np.ndarray:
    """Validate a clip: a ``uint8`` numpy array ``(T, H, W, 3)`` with T ≥ 4 and H, W ≥ 32."""
    if not isinstance(frames, np.ndarray):
        raise TypeError(f"frames must be a numpy array of shape (T, H, W, 3), got "
                        f"{type(frames).__name__}")
    if frames.dtype != np.uint8:
        raise TypeError(f"frames must be uint8 (0..255) of shape (T, H, W, 3), got dtype {frames.dtype}")
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must have shape (T, H, W, 3), got {tuple(frames.shape)}")
    t, h, w, _ = frames.shape
    if t < 4 or h < 32 or w < 32:
        raise ValueError(f"frames must have T >= 4 and H, W >= 32, got {tuple(frames.shape)}")
    return frames


def _downscale(frames: np.ndarray) -> np.ndarray:
    t, h, w, _ = frames.shape
    f = min(h, w) // WORK_SIZE
    if f < 2:
        return frames.astype(np.float32)
    h2, w2 = h // f * f, w // f * f
    x = frames[:, :h2, :w2].astype(np.float32)
    return x.reshape(t, h2 // f, f, w2 // f, f, 3).mean(axis=(2, 4))


def _shape_features(labels: np.ndarray, ids: np.ndarray, cx: np.ndarray, cy: np.ndarray,
                    area: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per component: 3rd and 4th harmonic of the outline's radial profile (relative to its mean
    radius) and the fill of the circumscribed circle. Vectorised over all components."""
    n = len(ids)
    if n == 0:
        z = np.zeros(0)
        return z, z, z
    lookup = np.full(labels.max() + 1, -1, dtype=np.int64)
    lookup[ids] = np.arange(n)
    t_idx, y_idx, x_idx = np.nonzero(labels)
    k = lookup[labels[t_idx, y_idx, x_idx]]
    keep = k >= 0
    k, y_idx, x_idx = k[keep], y_idx[keep], x_idx[keep]
    dx = x_idx + 0.5 - cx[k]
    dy = y_idx + 0.5 - cy[k]
    r = np.hypot(dx, dy) + 0.5
    b = ((np.arctan2(dy, dx) + math.pi) / (2 * math.pi) * N_BINS).astype(np.int64) % N_BINS
    prof = np.zeros(n * N_BINS)
    np.maximum.at(prof, k * N_BINS + b, r)
    prof = prof.reshape(n, N_BINS)
    empty = prof <= 0
    if empty.any():
        filled = np.where(empty, np.nan, prof)
        fill_val = np.nanmean(filled, axis=1, keepdims=True)
        prof = np.where(empty, np.broadcast_to(fill_val, prof.shape), prof)
    mean = prof.mean(axis=1, keepdims=True)
    spec = np.abs(np.fft.rfft(prof / mean, axis=1)) * 2 / N_BINS
    fill = area / (math.pi * prof.max(axis=1) ** 2)
    return spec[:, 3], spec[:, 4], fill


def classify_shape(h3: float, h4: float, fill: float) -> str:
    """Shape from the outline's 3rd/4th harmonics and circumscribed-circle fill.

    Ideal values: circle (0, 0, 1.0); square (≈0.01, 0.13, 0.64); triangle (0.26, ≈0.03, 0.41).
    """
    if max(h3, h4) < 0.045 and fill > 0.72:
        return "circle"
    return "triangle" if h3 > h4 else "square"


def classify_motion(dx: float, dy: float, log_scale: float) -> str:
    """Motion from the fitted displacement (fractions of width/height; y downwards) and log
    size change over the clip. ``"still"`` when nothing moves enough."""
    trans = max(abs(dx), abs(dy))
    if trans >= MIN_TRANSLATION and trans >= 0.5 * abs(log_scale):
        if abs(dx) >= abs(dy):
            return "right" if dx > 0 else "left"
        return "down" if dy > 0 else "up"
    if abs(log_scale) >= MIN_SCALE:
        return "grow" if log_scale > 0 else "shrink"
    return "still"


def _fit(t: np.ndarray, v: np.ndarray) -> tuple[float, np.ndarray]:
    """Least-squares slope and residuals of v against t."""
    if len(t) < 2:
        return 0.0, np.zeros_like(v)
    a = np.vstack([t, np.ones_like(t)]).T
    coef, *_ = np.linalg.lstsq(a, v, rcond=None)
    return float(coef[0]), v - a @ coef


@dataclass
class _Blobs:
    """The kept foreground components of a clip (one per frame and object at most :data:`MAX_BLOBS`
    a frame), indexed by component label: where, how large, what colour and shape."""
    ids: np.ndarray          # kept labels, ascending
    frame_of: np.ndarray     # frame of each label
    area: np.ndarray         # pixels of each label
    cx: np.ndarray           # pixel centroid
    cy: np.ndarray
    rgb: np.ndarray          # interior colour (label, 3)
    lab: np.ndarray          # the same in CIELAB
    feat: dict               # label -> (3rd harmonic, 4th harmonic, fill)
    soft_area: np.ndarray    # coverage-weighted area and centroid
    cx_soft: np.ndarray
    cy_soft: np.ndarray


def _background(x: np.ndarray, short: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-frame background colour (the median of the smoothed border; (3, T)), the clip's, and
    each pixel's colour distance from its frame's background (T, H, W)."""
    _, t_n, _, _ = x.shape
    sigma = max(0.7, short / 128.0)
    smooth = ndimage.gaussian_filter(x, sigma=(0, 0, sigma, sigma), mode="nearest", truncate=3.0)
    border = np.concatenate([smooth[:, :, :2].reshape(3, t_n, -1), smooth[:, :, -2:].reshape(3, t_n, -1),
                             smooth[:, :, :, :2].reshape(3, t_n, -1),
                             smooth[:, :, :, -2:].reshape(3, t_n, -1)], axis=2)
    frame_bg = np.median(border, axis=2).astype(np.float32)          # (3, T)
    bg_rgb = np.median(frame_bg, axis=1)
    diff_c = smooth - frame_bg[:, :, None, None]
    dist = np.sqrt(diff_c[0] ** 2 + diff_c[1] ** 2 + diff_c[2] ** 2)  # (T, H, W)
    return frame_bg, bg_rgb, dist


def _blobs(x: np.ndarray, dist: np.ndarray, fg: np.ndarray) -> _Blobs:
    """Label the foreground per frame and measure the components worth tracking."""
    _, _, h, w = x.shape
    structure = np.zeros((3, 3, 3), dtype=bool)
    structure[1] = True
    labels, n_lab = ndimage.label(fg, structure=structure)
    area = np.bincount(labels.ravel(), minlength=n_lab + 1).astype(np.float64)
    frame_of = np.zeros(n_lab + 1, dtype=np.int64)
    frame_of[1:] = [sl[0].start for sl in ndimage.find_objects(labels)]
    ok = (area >= MIN_AREA * h * w) & (area <= MAX_AREA * h * w)
    ok[0] = False
    # keep the largest MAX_BLOBS per frame
    cand = np.nonzero(ok)[0]
    order = cand[np.lexsort((-area[cand], frame_of[cand]))]
    kept: list[int] = []
    count: dict[int, int] = {}
    for lab in order:
        f = int(frame_of[lab])
        if count.get(f, 0) < MAX_BLOBS:
            kept.append(int(lab))
            count[f] = count.get(f, 0) + 1
    ids = np.array(sorted(kept), dtype=np.int64)
    keep_mask = np.zeros(n_lab + 1, dtype=bool)
    keep_mask[ids] = True
    kept_labels = np.where(keep_mask[labels], labels, 0)

    size = n_lab + 1
    cnt = np.maximum(area, 1)
    pix = np.flatnonzero(kept_labels)                    # pixels of kept components
    lab_p = kept_labels.ravel()[pix]
    y_p = (pix // w) % h + 0.5
    x_p = pix % w + 0.5
    cx_all = np.bincount(lab_p, weights=x_p, minlength=size) / cnt
    cy_all = np.bincount(lab_p, weights=y_p, minlength=size) / cnt
    # interior colour: pixels at least 2 px inside the component (all of it if it is too thin)
    core = ndimage.binary_erosion(kept_labels > 0, structure=structure, iterations=2).ravel()[pix]
    lab_core = lab_p[core]
    core_n = np.bincount(lab_core, minlength=size)
    use_core = core_n >= 4
    rgb_all = np.zeros((size, 3))
    for c in range(3):
        v = x[c].ravel()[pix]
        s_core = np.bincount(lab_core, weights=v[core], minlength=size)
        s_all = np.bincount(lab_p, weights=v, minlength=size)
        rgb_all[:, c] = np.where(use_core, s_core / np.maximum(core_n, 1), s_all / cnt)
    h3, h4, fill = _shape_features(kept_labels, ids, cx_all[ids], cy_all[ids], area[ids])
    # soft area and centroid: coverage from the distance to the background, over the component
    # grown by 2 px (steadier than pixel counts when edges are anti-aliased or blurred)
    d_p = dist.ravel()[pix]
    obj_d = np.where(use_core, np.bincount(lab_core, weights=d_p[core], minlength=size) / np.maximum(core_n, 1),
                     np.bincount(lab_p, weights=d_p, minlength=size) / cnt)
    floor = FG_DISTANCE / 3
    grown = ndimage.maximum_filter(kept_labels, footprint=np.ones((1, 5, 5), dtype=bool), mode="constant")
    gpix = np.flatnonzero(grown)
    g_lab = grown.ravel()[gpix]
    cover = np.clip((dist.ravel()[gpix] - floor) / np.maximum(obj_d[g_lab] - floor, 1.0), 0.0, 1.0)
    soft_area = np.bincount(g_lab, weights=cover, minlength=size)
    soft_n = np.maximum(soft_area, 1e-6)
    return _Blobs(
        ids=ids, frame_of=frame_of, area=area, cx=cx_all, cy=cy_all, rgb=rgb_all, lab=rgb_to_lab(rgb_all),
        feat={int(i): (h3[j], h4[j], fill[j]) for j, i in enumerate(ids)}, soft_area=soft_area,
        cx_soft=np.bincount(g_lab, weights=cover * (gpix % w + 0.5), minlength=size) / soft_n,
        cy_soft=np.bincount(g_lab, weights=cover * ((gpix // w) % h + 0.5), minlength=size) / soft_n)


def _tracks(b: _Blobs, t_n: int, short: int) -> list[list[int]]:
    """Link components over frames into tracks (greedy, by position and colour)."""
    by_frame: dict[int, list[int]] = {}
    for lab in b.ids:
        by_frame.setdefault(int(b.frame_of[lab]), []).append(int(lab))
    tracks: list[list[int]] = []
    last: list[tuple[int, int]] = []       # (frame, label) of each track's last component
    gate = 0.2 * short
    for f in range(t_n):
        blobs = by_frame.get(f, [])
        pairs = []
        for ti, (lf, ll) in enumerate(last):
            if f - lf > 4:
                continue
            for k in blobs:
                d = math.hypot(b.cx[k] - b.cx[ll], b.cy[k] - b.cy[ll])
                de = float(np.linalg.norm(b.lab[k] - b.lab[ll]))
                if d <= gate * (f - lf) and de <= 45:
                    pairs.append((d / short + de / 150, ti, k))
        pairs.sort()
        used_t, used_b = set(), set()
        for _, ti, k in pairs:
            if ti in used_t or k in used_b:
                continue
            used_t.add(ti)
            used_b.add(k)
            tracks[ti].append(k)
            last[ti] = (f, k)
        for k in blobs:
            if k not in used_b:
                tracks.append([k])
                last.append((f, k))
    return tracks


def _track_object(tr: list[int], b: _Blobs, t_n: int, h: int, w: int, px_scale: float) -> DetectedObject:
    """One track as an object: its colour, shape and motion, and how steady it is."""
    arr = np.array(tr)
    fr = b.frame_of[arr].astype(np.float64)
    med_lab = np.median(b.lab[arr], axis=0)
    rgb = np.median(b.rgb[arr], axis=0)
    d = np.linalg.norm(_OBJ_LAB - med_lab, axis=-1)
    colour = _OBJ_NAMES[int(np.argmin(d))]
    f3, f4, fl = (float(np.median([b.feat[int(k)][i] for k in tr])) for i in range(3))
    shape = classify_shape(f3, f4, fl)
    span = t_n - 1
    slope_x, res_x = _fit(fr, b.cx_soft[arr])
    slope_y, res_y = _fit(fr, b.cy_soft[arr])
    log_size = 0.5 * np.log(np.maximum(b.soft_area[arr], 1.0))
    slope_s, res_s = _fit(fr, log_size)
    dx, dy, ls = slope_x * span / w, slope_y * span / h, slope_s * span
    motion = classify_motion(dx, dy, ls)
    size_jitter = float(np.std(res_s))
    if len(arr) >= 4:
        # RMS distance of the centroid from a smooth (quadratic) path
        c = np.stack([b.cx_soft[arr], b.cy_soft[arr]], axis=1)
        tt = (fr - fr.mean()) / max(1.0, span)
        basis = np.vstack([np.ones_like(tt), tt, tt * tt]).T
        coef, *_ = np.linalg.lstsq(basis, c, rcond=None)
        path_jitter = float(np.sqrt(np.mean(np.sum((c - basis @ coef) ** 2, axis=1))) * px_scale)
    else:
        path_jitter = 0.0
    return DetectedObject(
        colour=colour, shape=shape, motion=motion, presence=len(tr) / t_n,
        rgb=tuple(float(v) for v in rgb), displacement=(float(dx), float(dy)),
        log_scale=float(ls), harmonics=(f3, f4), fill=fl, size_jitter=size_jitter,
        path_jitter=path_jitter, size_stability=float(math.exp(-size_jitter / 0.05)),
        path_smoothness=float(math.exp(-path_jitter / 1.0)),
        frames=[int(v) for v in fr], centroids=[(float(a), float(c)) for a, c in
                                                zip(b.cx_soft[arr], b.cy_soft[arr])],
        areas=[float(v) for v in b.soft_area[arr]])


def analyze_clip(frames: np.ndarray) -> ClipAnalysis:
    """Find the background and the object tracks of a clip and measure its consistency and
    cleanliness. ``frames``: ``uint8 (T, H, W, 3)``."""
    check_frames(frames)
    x = np.ascontiguousarray(_downscale(frames).transpose(3, 0, 1, 2))   # (3, T, H, W) float32
    _, t_n, h, w = x.shape
    short = min(h, w)
    frame_bg, bg_rgb, dist = _background(x, short)
    fg = dist > FG_DISTANCE
    blobs = _blobs(x, dist, fg)
    objects: list[DetectedObject] = []
    object_pixels = 0.0
    for tr in sorted(_tracks(blobs, t_n, short), key=len, reverse=True):
        if len(tr) < max(3, MIN_PRESENCE * t_n):
            continue
        object_pixels += float(blobs.area[np.array(tr)].sum())
        objects.append(_track_object(tr, blobs, t_n, h, w, 128.0 / short))

    # background statistics, away from anything foreground
    bg_mask = ~ndimage.maximum_filter(fg, footprint=np.ones((1, 7, 7), dtype=bool), mode="constant")
    luma = np.array([0.299, 0.587, 0.114], dtype=np.float32)
    gray = np.tensordot(luma, x, axes=1)                             # (T, H, W)
    resid = gray - (luma @ frame_bg)[:, None, None]
    bg_noise = float(np.sqrt(np.mean(resid[bg_mask] ** 2))) if bg_mask.any() else 255.0
    both = bg_mask[1:] & bg_mask[:-1]
    flicker = float(np.abs(gray[1:] - gray[:-1])[both].mean()) if both.any() else 255.0
    stray = max(0.0, float(fg.sum()) - object_pixels) / fg.size
    cleanliness = math.exp(-bg_noise / 10.0) * (1.0 - min(1.0, 25.0 * stray))
    return ClipAnalysis(
        background=nearest_colour(bg_rgb, background=True),
        background_rgb=tuple(float(v) for v in bg_rgb), objects=objects, flicker=flicker,
        background_noise=bg_noise, stray_fraction=stray,
        flicker_score=float(math.exp(-flicker / 3.0)), cleanliness=float(cleanliness),
        frames=t_n, height=h, width=w)


# ----------------------------------------------------------------------------------------------
# Scoring against a caption


def match_objects(stated: Sequence[tuple[str, str, str]], detected: Sequence[tuple[str, str, str]]
                  ) -> list[int | None]:
    """One-to-one assignment of stated to detected (colour, shape, motion) triples that agrees on
    the most attributes (colour breaking ties, then the order of the triples, never the order of
    ``detected``). Returns, per stated object, the index of its detected object or ``None``."""
    n, m = len(stated), len(detected)
    best_key: tuple = ()
    best: list[int | None] = [None] * n
    for perm in itertools.permutations(range(m + n), n):   # indices >= m mean "unmatched"
        score = 0.0
        for s, d in zip(stated, perm):
            if d < m:
                o = detected[d]
                score += 1.001 * (s[0] == o[0]) + (s[1] == o[1]) + (s[2] == o[2])
        # ties go to the lexicographically first matched triples, so the result does not depend
        # on the order in which objects were detected
        key = (-score, tuple(tuple(detected[d]) if d < m else ("~",) for d in perm))
        if not best_key or key < best_key:
            best_key, best = key, [d if d < m else None for d in perm]
    return best


def compare(spec: ClipSpec, detected: Sequence[tuple[str, str, str]], background: str
            ) -> dict:
    """Per stated object and attribute, whether the matched detected object agrees, whether the
    background agrees and whether as many objects were found as stated (``count``). With
    ``detected`` = the true objects this is the agreement a perfect evaluator would report."""
    stated = [o.triple for o in spec.objects]
    assign = match_objects(stated, detected)
    per = []
    for s, d in zip(stated, assign):
        o = detected[d] if d is not None else None
        per.append({
            "stated": dict(zip(ATTRIBUTES, s)),
            "detected": dict(zip(ATTRIBUTES, o)) if o is not None else None,
            "detected_index": d,
            **{a: bool(o is not None and s[i] == o[i]) for i, a in enumerate(ATTRIBUTES)},
        })
    out = {"objects": per, "background": bool(spec.background == background),
           "count": bool(len(detected) == len(stated))}
    for a in ATTRIBUTES:
        out[a] = float(np.mean([p[a] for p in per]))
    checks = [p[a] for p in per for a in ATTRIBUTES] + [out["background"]]
    out["prompt_score"] = float(np.mean(checks))
    out["all_correct"] = bool(all(checks) and out["count"])
    return out


def _as_spec(caption: str | ClipSpec) -> ClipSpec:
    if isinstance(caption, ClipSpec):
        return caption
    return parse_caption(caption)


def score_analysis(caption: str | ClipSpec, analysis: ClipAnalysis) -> dict:
    """Score an analysed clip against a caption (see :func:`score_clip` for the keys)."""
    spec = _as_spec(caption)
    detected = [o.attributes() for o in analysis.objects]
    out = compare(spec, detected, analysis.background)
    out["caption"] = spec.caption
    out["detected_background"] = analysis.background
    out["n_detected"] = len(analysis.objects)
    matched = [analysis.objects[p["detected_index"]] if p["detected_index"] is not None else None
               for p in out["objects"]]

    def mean_of(attr: str) -> float:
        return float(np.mean([getattr(o, attr) if o is not None else 0.0 for o in matched]))

    temporal = {
        "presence": mean_of("presence"),
        "size_stability": mean_of("size_stability"),
        "path_smoothness": mean_of("path_smoothness"),
        "flicker": analysis.flicker,
        "flicker_score": analysis.flicker_score,
    }
    out["temporal"] = temporal
    out["cleanliness"] = analysis.cleanliness
    out["stray_fraction"] = analysis.stray_fraction
    out["background_noise"] = analysis.background_noise
    quality = float(np.mean([temporal["presence"], temporal["size_stability"],
                             temporal["path_smoothness"], temporal["flicker_score"],
                             analysis.cleanliness]))
    out["quality"] = quality
    out["aggregate"] = 0.75 * out["prompt_score"] + 0.25 * quality
    return out


def score_clip(caption: str | ClipSpec, frames: np.ndarray) -> dict:
    """Score a clip against its caption.

    Returns a dict with, per stated object (``"objects"``), the stated and matched detected
    attributes and a bool per attribute (``colour``, ``shape``, ``motion``); clip-level fractions
    of objects correct per attribute (``colour``, ``shape``, ``motion``); ``background`` (bool);
    ``count`` (bool: as many objects found as stated); ``prompt_score`` (fraction of the colour,
    shape, motion and background checks right) and ``all_correct`` (all of them and the count);
    ``temporal``
    (``presence``, ``size_stability``, ``path_smoothness`` of the matched objects, in [0, 1];
    ``flicker`` in 0..255 and its ``flicker_score``); ``cleanliness`` in [0, 1]; ``quality``
    (mean of the five [0, 1] consistency and cleanliness scores) and ``aggregate`` =
    0.75 · prompt_score + 0.25 · quality.
    """
    spec = _as_spec(caption)
    return score_analysis(spec, analyze_clip(frames))


def summarize(scores: Sequence[dict]) -> dict:
    """Accuracy per attribute over all stated objects (per clip for the background and the object
    count), the fraction of clips entirely right, and mean consistency/cleanliness/aggregate."""
    if not scores:
        raise ValueError("no scores to summarise")
    objs = [p for s in scores for p in s["objects"]]
    out = {a: float(np.mean([p[a] for p in objs])) for a in ATTRIBUTES}
    out["background"] = float(np.mean([s["background"] for s in scores]))
    out["count"] = float(np.mean([s["count"] for s in scores]))
    out["all_correct"] = float(np.mean([s["all_correct"] for s in scores]))
    out["prompt_score"] = float(np.mean([s["prompt_score"] for s in scores]))
    for k in ("presence", "size_stability", "path_smoothness", "flicker", "flicker_score"):
        out[k] = float(np.mean([s["temporal"][k] for s in scores]))
    for k in ("cleanliness", "quality", "aggregate"):
        out[k] = float(np.mean([s[k] for s in scores]))
    out["clips"] = len(scores)
    out["objects"] = len(objs)
    return out


def score_many(captions: Sequence[str | ClipSpec], clips: Iterable[np.ndarray]) -> dict:
    """Score clips against their captions: ``{"summary": summarize(...), "clips": [score, ...]}``."""
    captions = list(captions)
    scores = []
    for i, frames in enumerate(clips):
        if i >= len(captions):
            raise ValueError(f"more clips than captions ({len(captions)})")
        scores.append(score_clip(captions[i], frames))
    if len(scores) != len(captions):
        raise ValueError(f"{len(captions)} captions but {len(scores)} clips")
    return {"summary": summarize(scores), "clips": scores}


# ----------------------------------------------------------------------------------------------
# Degradations and validation


def _linear_upsample_matrix(n_small: int, factor: int) -> np.ndarray:
    """(n_small * factor, n_small) matrix of linear interpolation between pixel centres."""
    n = n_small * factor
    pos = np.clip((np.arange(n) + 0.5) / factor - 0.5, 0, n_small - 1)
    lo = np.floor(pos).astype(int)
    hi = np.minimum(lo + 1, n_small - 1)
    frac = pos - lo
    m = np.zeros((n, n_small), dtype=np.float32)
    m[np.arange(n), lo] += 1 - frac
    m[np.arange(n), hi] += frac
    return m


def _down_up(frames: np.ndarray, factor: int) -> np.ndarray:
    """Area-average downscale by ``factor``, then bilinear upscale back (float32)."""
    t, h, w, _ = frames.shape
    h2, w2 = h // factor, w // factor
    x = frames[:, : h2 * factor, : w2 * factor].astype(np.float32)
    small = x.reshape(t, h2, factor, w2, factor, 3).mean(axis=(2, 4))
    up = np.einsum("yi,tijc,xj->tyxc", _linear_upsample_matrix(h2, factor), small,
                   _linear_upsample_matrix(w2, factor), optimize=True)
    out = frames.astype(np.float32)
    out[:, : h2 * factor, : w2 * factor] = up
    return out


def degrade(frames: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """A degraded copy of a clip. ``kind``: ``blur1``/``blur2`` (Gaussian σ = 1/2 px),
    ``noise8``/``noise16`` (Gaussian pixel noise σ = 8/16), ``shift`` (per-channel offset up to
    ±20 and gain 0.9–1.1), ``down2``/``down4`` (area downscale ×2/×4 then bilinear upscale),
    ``fade`` (objects blended 30 % towards the background colour), ``mild`` (down2 + blur 1 +
    colour shift up to ±12 + noise 6: roughly what a small model's output looks like)."""
    x = frames.astype(np.float32)
    if kind.startswith("blur"):
        s = float(kind[4:])
        x = ndimage.gaussian_filter(x, sigma=(0, s, s, 0), mode="nearest")
    elif kind.startswith("noise"):
        x = x + rng.normal(0.0, float(kind[5:]), size=x.shape).astype(np.float32)
    elif kind == "shift":
        x = x * rng.uniform(0.9, 1.1, size=3).astype(np.float32) + rng.uniform(-20, 20, size=3).astype(np.float32)
    elif kind.startswith("down"):
        x = _down_up(frames, int(kind[4:]))
    elif kind == "fade":
        t, h, w, _ = frames.shape
        border = np.concatenate([x[:, 0], x[:, -1], x[:, :, 0], x[:, :, -1]], axis=1)
        bg = np.median(border.reshape(-1, 3), axis=0)
        x = bg + 0.7 * (x - bg)
    elif kind == "mild":
        x = _down_up(frames, 2)
        x = ndimage.gaussian_filter(x, sigma=(0, 1, 1, 0), mode="nearest")
        x = x * rng.uniform(0.93, 1.07, size=3).astype(np.float32) + rng.uniform(-12, 12, size=3).astype(np.float32)
        x = x + rng.normal(0.0, 6.0, size=x.shape).astype(np.float32)
    else:
        raise ValueError(f"unknown degradation {kind!r}; expected one of {', '.join(DEGRADATIONS)}")
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


DEGRADATIONS: tuple[str, ...] = ("blur1", "blur2", "noise8", "noise16", "shift", "fade", "down2",
                                  "down4", "mild")


def noise_clip(rng: np.random.Generator, shape: tuple[int, ...], smooth: float = 0.0) -> np.ndarray:
    """Uniform random frames; with ``smooth`` > 0, Gaussian-blurred (σ px, per frame) and
    stretched back to the full range (blobby noise)."""
    x = rng.uniform(0, 255, size=shape).astype(np.float32)
    if smooth > 0:
        x = ndimage.gaussian_filter(x, sigma=(0, smooth, smooth, 0), mode="wrap")
        x = (x - x.mean()) / (x.std() + 1e-6) * 64 + 128
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


def _row(scores: Sequence[dict]) -> dict:
    s = summarize(scores)
    return {k: s[k] for k in ("colour", "shape", "motion", "background", "count", "all_correct")}


def validate(n: int = 200, seed: int = 1, frames: int = 33, size: int = 128,
             split: str = "train", degradations: Sequence[str] = DEGRADATIONS,
             mp4: bool = False, progress: Callable[[str], None] | None = None) -> dict:
    """Measure the evaluator on ``n`` generated clips (stream ``seed`` of ``split``).

    Rows: ``ground_truth``; one per degradation; ``mp4`` (an H.264 round trip, when ``mp4``);
    ``noise`` and ``smooth_noise`` (random frames scored against the clips' captions);
    ``swapped`` (each clip scored against the next clip's caption) and ``chance`` (what a perfect
    evaluator reports for those swapped pairs: the agreement that is due to chance). Each row
    holds accuracies per attribute (over objects), per clip for the background, and the fraction
    of clips entirely right.
    """
    from attnqat.synthetic import heldout_specs, render, spec_at

    if n < 2:
        raise ValueError("n must be >= 2")
    specs = heldout_specs(n) if split == "heldout" else [spec_at(seed, k, "train") for k in range(n)]
    rng = np.random.default_rng(seed)
    rows: dict[str, list[dict]] = {k: [] for k in ("ground_truth", *degradations, "noise",
                                                   "smooth_noise", "swapped", "chance")}
    if mp4:
        rows["mp4"] = []
    for k, spec in enumerate(specs):
        clip = render(spec, frames, size)
        other = specs[(k + 1) % n]
        an = analyze_clip(clip)
        rows["ground_truth"].append(score_analysis(spec, an))
        rows["swapped"].append(score_analysis(other, an))
        rows["chance"].append(compare(other, [o.triple for o in spec.objects], spec.background))
        for kind in degradations:
            rows[kind].append(score_clip(spec, degrade(clip, kind, rng)))
        rows["noise"].append(score_clip(spec, noise_clip(rng, clip.shape)))
        rows["smooth_noise"].append(score_clip(spec, noise_clip(rng, clip.shape, smooth=4.0)))
        if mp4:
            rows["mp4"].append(score_clip(spec, _mp4_round_trip(clip)))
        if progress is not None and (k + 1) % 50 == 0:
            progress(f"{k + 1}/{n} clips")
    table = {}
    for name, scores in rows.items():
        if name == "chance":
            objs = [p for s in scores for p in s["objects"]]
            table[name] = {**{a: float(np.mean([p[a] for p in objs])) for a in ATTRIBUTES},
                           "background": float(np.mean([s["background"] for s in scores])),
                           "count": float(np.mean([s["count"] for s in scores])),
                           "all_correct": float(np.mean([s["all_correct"] for s in scores]))}
        else:
            table[name] = _row(scores)
    return {"n": n, "seed": seed, "frames": frames, "size": size, "split": split, "table": table}


def format_table(result: dict) -> str:
    """The accuracy table of :func:`validate` as aligned text."""
    cols = ("colour", "shape", "motion", "background", "count", "all_correct")
    lines = [f"{'condition':<14}" + "".join(f"{c:>12}" for c in cols)]
    for name, row in result["table"].items():
        lines.append(f"{name:<14}" + "".join(f"{100 * row[c]:>11.1f}%" for c in cols))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Video files and the command line


def read_video(path: str | Path) -> np.ndarray:
    """All frames of a video file as ``uint8 (T, H, W, 3)``."""
    import imageio.v2 as imageio

    reader = imageio.get_reader(str(path))
    try:
        frames = [np.asarray(f)[..., :3] for f in reader]
    finally:
        reader.close()
    if not frames:
        raise ValueError(f"{path}: no frames")
    return np.stack(frames).astype(np.uint8)


def _mp4_round_trip(clip: np.ndarray) -> np.ndarray:
    import tempfile

    from attnqat.video import write_mp4

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "clip.mp4"
        write_mp4(clip, p, 16)
        return read_video(p)


def _items_from_args(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(label, video path, caption) for every clip named on the command line."""
    items: list[tuple[str, str, str]] = []
    for folder in args.folders or []:
        rec_path = Path(folder) / "record.json"
        if not rec_path.is_file():
            raise SystemExit(f"attnqat eval score: {folder} has no record.json")
        rec = json.loads(rec_path.read_text())
        if "prompt" not in rec or "methods" not in rec:
            raise SystemExit(f"attnqat eval score: {rec_path} lacks 'prompt' or 'methods'")
        for method, info in rec["methods"].items():
            video = Path(folder) / (info.get("video") or f"{method}.mp4")
            items.append((f"{Path(folder).name}/{method}", str(video), rec["prompt"]))
    if args.videos:
        if not args.captions or len(args.captions) != len(args.videos):
            raise SystemExit("attnqat eval score: give one --captions entry per --videos entry")
        items += [(Path(v).name, v, c) for v, c in zip(args.videos, args.captions)]
    if args.list:
        base = Path(args.list).parent
        for entry in json.loads(Path(args.list).read_text()):
            v = Path(entry["video"])
            items.append((v.name, str(v if v.is_absolute() else base / v), entry["caption"]))
    return items


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folders", nargs="*",
                        help="output folders of `attnqat generate` (record.json + <method>.mp4); "
                             "each method's clip is scored against the record's prompt")
    parser.add_argument("--videos", nargs="+", help="video files to score")
    parser.add_argument("--captions", nargs="+", help="one caption per --videos entry")
    parser.add_argument("--list", help="JSON list of {\"video\", \"caption\"} (paths relative to "
                                       "the file), e.g. captions.json of `attnqat finetune data`")
    parser.add_argument("--json", help="write every score and the summary to this JSON file")
    parser.add_argument("--validate", type=int, metavar="N", default=0,
                        help="instead of scoring files, measure the evaluator on N generated clips "
                             "(ground truth, degraded, noise, swapped captions) and print the table")
    parser.add_argument("--split", choices=("train", "heldout"), default="train",
                        help="clips used by --validate")
    parser.add_argument("--seed", type=int, default=1, help="stream seed used by --validate")
    parser.add_argument("--mp4", action="store_true", help="--validate: add an H.264 round-trip row")


def run(args: argparse.Namespace) -> int:
    if args.validate:
        result = validate(args.validate, seed=args.seed, split=args.split, mp4=args.mp4,
                          progress=lambda m: print(m, file=sys.stderr))
        print(f"{result['n']} clips of the {result['split']} stream (seed {result['seed']}), "
              f"{result['frames']} frames at {result['size']}x{result['size']}")
        print(format_table(result))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return 0
    items = _items_from_args(args)
    if not items:
        print("attnqat eval score: nothing to score (give folders, --videos/--captions or --list)",
              file=sys.stderr)
        return 2
    scores, groups = [], {}
    for label, video, caption in items:
        s = score_clip(caption, read_video(video))
        s["video"] = video
        s["label"] = label
        scores.append(s)
        if "/" in label:   # <folder>/<method>: also summarise per method
            groups.setdefault(label.rsplit("/", 1)[1], []).append(s)
        print(f"{label:<28} colour {s['colour']:.2f} shape {s['shape']:.2f} motion {s['motion']:.2f} "
              f"bg {int(s['background'])} quality {s['quality']:.2f} aggregate {s['aggregate']:.2f}"
              f"  | {s['caption']}")

    def line(name: str, summary: dict) -> str:
        return (f"{name}: {summary['clips']} clips, {summary['objects']} objects: "
                + ", ".join(f"{k} {100 * summary[k]:.1f}%" for k in
                            ("colour", "shape", "motion", "background", "all_correct"))
                + f", quality {summary['quality']:.3f}, aggregate {summary['aggregate']:.3f}")

    summary = summarize(scores)
    by_method = {m: summarize(v) for m, v in groups.items()}
    for m, v in by_method.items():
        print(line(m, v))
    print(line("all", summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "by_method": by_method,
                                               "clips": scores}, indent=1))
    return 0
