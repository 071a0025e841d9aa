"""Video files and video metrics: mp4 writing and reading, a labelled side-by-side, PSNR and SSIM.

Frames are ``numpy`` arrays of shape (frames, height, width, 3), ``uint8`` RGB. Encoding goes through
the ffmpeg binary that ``imageio-ffmpeg`` ships (no system ffmpeg needed), driven by
``ffmpeg-python``; mp4s are H.264, yuv420p, at a constant frame rate.

The side-by-side puts the clips next to each other, each under a header band that names it. The
label is drawn by ffmpeg's ``drawtext`` filter where that works with an installed font, and
otherwise rendered with Pillow into an image that ffmpeg overlays on the band.
"""

from __future__ import annotations

import functools
import logging
import math
import shutil
import subprocess
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Mapping

import numpy as np

GAP = 4  # pixels between panels of the side-by-side


def ffmpeg_exe() -> str:
    """Path of the ffmpeg binary (imageio-ffmpeg's, else one on PATH)."""
    try:
        import imageio_ffmpeg

        return imageio_ffmpeg.get_ffmpeg_exe()
    except Exception:  # noqa: BLE001 - fall back to a system binary
        exe = shutil.which("ffmpeg")
        if exe is None:
            raise RuntimeError("no ffmpeg binary found: install imageio-ffmpeg (pip) or ffmpeg") from None
        return exe


def to_uint8_frames(video) -> np.ndarray:
    """Frames as (T, H, W, 3) uint8 from floats in [0, 1] (rounded) or uint8, with or without a
    leading batch dimension of 1."""
    arr = np.asarray(video)
    if arr.ndim == 5:
        if arr.shape[0] != 1:
            raise ValueError(f"expected one video, got a batch of {arr.shape[0]}")
        arr = arr[0]
    if arr.ndim != 4 or arr.shape[-1] != 3:
        raise ValueError(f"expected frames of shape (T, H, W, 3), got {arr.shape}")
    if arr.dtype == np.uint8:
        return np.ascontiguousarray(arr)
    if not np.issubdtype(arr.dtype, np.floating):
        raise TypeError(f"frames must be uint8 or floating in [0, 1], got {arr.dtype}")
    return np.ascontiguousarray(np.clip(np.rint(arr * 255.0), 0, 255).astype(np.uint8))


def _check_fps(fps: float) -> Fraction:
    if not (isinstance(fps, (int, float, Fraction)) and math.isfinite(float(fps)) and float(fps) > 0):
        raise ValueError(f"fps must be a positive number, got {fps!r}")
    return Fraction(fps).limit_denominator(1001)


def write_mp4(frames, path: str | Path, fps: float, *, crf: int = 17) -> Path:
    """Encode frames (see :func:`to_uint8_frames`) to an H.264 mp4 at ``fps``.

    ``crf`` is x264's constant rate factor (0 lossless … 51; 17 is visually lossless). Height and
    width must be even (yuv420p).
    """
    import ffmpeg

    arr = to_uint8_frames(frames)
    t, h, w, _ = arr.shape
    if t == 0:
        raise ValueError("cannot write a video with no frames")
    if h % 2 or w % 2:
        raise ValueError(f"height and width must be even for H.264 yuv420p, got {h}x{w}")
    rate = _check_fps(fps)
    path = Path(path)
    stream = (ffmpeg.input("pipe:", format="rawvideo", pix_fmt="rgb24", s=f"{w}x{h}",
                           framerate=str(rate))
              .output(str(path), vcodec="libx264", pix_fmt="yuv420p", crf=crf, r=str(rate),
                      preset="medium", movflags="+faststart")
              .overwrite_output()
              .global_args("-nostdin", "-hide_banner", "-loglevel", "error"))
    try:
        stream.run(cmd=ffmpeg_exe(), input=arr.tobytes(), capture_stdout=True, capture_stderr=True)
    except ffmpeg.Error as exc:
        raise RuntimeError(f"ffmpeg failed writing {path}: {exc.stderr.decode(errors='replace')}") from exc
    return path


def probe_mp4(path: str | Path) -> dict:
    """``{"frames", "width", "height", "fps"}`` of a video file, by decoding it."""
    frames, fps = read_mp4(path)
    return {"frames": int(frames.shape[0]), "height": int(frames.shape[1]),
            "width": int(frames.shape[2]), "fps": fps}


def read_mp4(path: str | Path) -> tuple[np.ndarray, float]:
    """Decode a video to (T, H, W, 3) uint8 RGB frames and its frame rate."""
    import imageio_ffmpeg

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such video: {path}")
    reader = imageio_ffmpeg.read_frames(str(path), pix_fmt="rgb24")
    try:
        meta = next(reader)
        w, h = meta["size"]
        frames = [np.frombuffer(buf, dtype=np.uint8).reshape(h, w, 3) for buf in reader]
    finally:
        reader.close()
    if not frames:
        raise ValueError(f"{path} holds no video frames")
    return np.stack(frames), float(meta["fps"])


def read_clip(path: str | Path, frames: int, height: int, width: int, *, stride: int = 1,
              fps: float | None = None) -> np.ndarray:
    """The first ``frames`` frames (every ``stride``-th) of a video file of any format ffmpeg reads,
    scaled so that it covers ``height`` × ``width`` and center-cropped to it: (frames, height,
    width, 3) uint8 RGB. Only the frames needed are decoded. ``fps``: resample the clip to this
    frame rate first (frames dropped or repeated as ffmpeg's ``fps`` filter does); None: frame for
    frame.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not a readable video, or holds fewer frames than asked for (the
            message says how many it has).
    """
    import imageio_ffmpeg

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such video: {path}")
    if frames < 1 or height < 1 or width < 1 or stride < 1:
        raise ValueError(f"frames, height, width and stride must be positive, got {frames}, "
                         f"{height}, {width}, {stride}")
    rate = f"fps={_check_fps(fps)}," if fps is not None else ""
    vf = (f"{rate}select=not(mod(n\\,{stride})),scale={width}:{height}:force_original_aspect_ratio=increase,"
          f"crop={width}:{height},setsar=1")
    out: list[np.ndarray] = []
    # imageio-ffmpeg logs a warning when the filter changes the frame size, which is the point here
    quiet = logging.getLogger("imageio_ffmpeg")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        reader = imageio_ffmpeg.read_frames(str(path), pix_fmt="rgb24",
                                            output_params=["-vf", vf, "-fps_mode", "passthrough",
                                                           "-frames:v", str(frames)])
        try:
            next(reader)   # the metadata
            for buf in reader:
                out.append(np.frombuffer(buf, dtype=np.uint8).reshape(height, width, 3))
        finally:
            reader.close()
    except (OSError, RuntimeError, StopIteration) as exc:
        raise ValueError(f"{path} is not a readable video ({type(exc).__name__}: "
                         f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else 'no detail'})") from exc
    finally:
        quiet.setLevel(level)
    if len(out) < frames:
        raise ValueError(f"{path} has {len(out)} frame(s) at stride {stride}, fewer than the "
                         f"{frames} asked for")
    return np.stack(out)


# ----------------------------------------------------------------------------------------------
# Side by side
# ----------------------------------------------------------------------------------------------

_SAFE_LABEL = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _-+.()/")


def _font_file() -> str | None:
    for cand in ("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
                 "/usr/share/fonts/dejavu/DejaVuSans.ttf",
                 "/usr/share/fonts/TTF/DejaVuSans.ttf"):
        if Path(cand).is_file():
            return cand
    try:
        out = subprocess.run(["fc-match", "-f", "%{file}", "sans"], capture_output=True, text=True,
                             timeout=10)
        if out.returncode == 0 and Path(out.stdout.strip()).is_file():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return None


@functools.lru_cache(maxsize=1)
def drawtext_font() -> str | None:
    """A font file with which this ffmpeg's ``drawtext`` filter works, or None (then labels are
    rendered with Pillow)."""
    font = _font_file()
    if font is None:
        return None
    cmd = [ffmpeg_exe(), "-nostdin", "-hide_banner", "-loglevel", "error", "-f", "lavfi", "-i",
           "color=c=black:s=32x16:d=0.1", "-vf",
           f"drawtext=fontfile={font}:text=ok:fontcolor=white:fontsize=8", "-frames:v", "1",
           "-f", "null", "-"]
    try:
        ok = subprocess.run(cmd, capture_output=True, stdin=subprocess.DEVNULL,
                            timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return font if ok else None


def _band_height(height: int) -> int:
    return max(16, int(round(height * 0.1 / 2)) * 2)


def _label_png(label: str, width: int, band: int, path: Path) -> Path:
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("RGB", (width, band), (0, 0, 0))
    draw = ImageDraw.Draw(img)
    size = max(8, int(band * 0.7))
    font = ImageFont.load_default(size=size)
    box = draw.textbbox((0, 0), label, font=font)
    tw, th = box[2] - box[0], box[3] - box[1]
    draw.text(((width - tw) / 2 - box[0], (band - th) / 2 - box[1]), label, fill=(255, 255, 255),
              font=font)
    img.save(path)
    return path


def palette_png(path: str | Path) -> Path:
    """Re-save a PNG (a plot, a screenshot) with a 256-colour palette: a third of the bytes or less
    for flat-coloured images, which keeps the records a GPU call carries small (docs/development.md)."""
    from PIL import Image

    with Image.open(path) as im:
        q = im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    q.save(path, optimize=True)
    return Path(path)


def side_by_side(videos: Mapping[str, str | Path], out: str | Path, *, fps: float | None = None,
                 crf: int = 17, renderer: str = "auto") -> Path:
    """Stack mp4 clips horizontally, each under a header band with its label.

    Args:
        videos: label → mp4 path, in display order. All clips must have the same size.
        out: the mp4 to write.
        fps: output frame rate (default: the first clip's).
        crf: x264 constant rate factor.
        renderer: ``auto`` (ffmpeg ``drawtext`` when it works, else Pillow), ``drawtext`` or
            ``pillow``.

    Returns:
        ``out``. Its size is (sum of widths + gaps) × (height + band).
    """
    import ffmpeg

    if not videos:
        raise ValueError("side_by_side needs at least one video")
    if renderer not in ("auto", "drawtext", "pillow"):
        raise ValueError(f"renderer must be auto, drawtext or pillow, got {renderer!r}")
    infos = {label: probe_header(p) for label, p in videos.items()}
    sizes = {(i["width"], i["height"]) for i in infos.values()}
    if len(sizes) != 1:
        listing = ", ".join(f"{label} {i['width']}x{i['height']}" for label, i in infos.items())
        raise ValueError(f"clips differ in size: {listing}")
    w, h = sizes.pop()
    band = _band_height(h)
    rate = _check_fps(fps if fps is not None else next(iter(infos.values()))["fps"])
    font = drawtext_font() if renderer in ("auto", "drawtext") else None
    if renderer == "drawtext" and font is None:
        raise RuntimeError("ffmpeg's drawtext filter does not work here (no usable font)")
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="attnqat-sbs-") as tmp:
        panels = []
        labels = list(videos)
        for i, label in enumerate(labels):
            s = ffmpeg.input(str(videos[label])).video
            gap = GAP if i < len(labels) - 1 else 0
            s = s.filter("pad", w=w + gap, h=h + band, x=0, y=band, color="white" if gap else "black")
            if gap:  # white gap on the right, black header band over the clip's width
                s = s.filter("drawbox", x=0, y=0, w=w, h=band, color="black", t="fill")
            use_drawtext = font is not None and set(label) <= _SAFE_LABEL
            if use_drawtext:
                s = s.drawtext(text=label, fontfile=font, fontcolor="white",
                               fontsize=max(8, int(band * 0.6)), x=f"({w}-text_w)/2",
                               y=f"({band}-text_h)/2")
            else:
                png = _label_png(label, w, band, Path(tmp) / f"label{i}.png")
                s = ffmpeg.overlay(s, ffmpeg.input(str(png)).video, x=0, y=0)
            panels.append(s)
        joined = panels[0] if len(panels) == 1 else ffmpeg.filter(panels, "hstack", inputs=len(panels))
        stream = (joined.output(str(out), vcodec="libx264", pix_fmt="yuv420p", crf=crf, r=str(rate),
                                movflags="+faststart")
                  .overwrite_output().global_args("-nostdin", "-hide_banner", "-loglevel", "error"))
        try:
            stream.run(cmd=ffmpeg_exe(), capture_stdout=True, capture_stderr=True)
        except ffmpeg.Error as exc:
            raise RuntimeError(f"ffmpeg failed writing {out}: {exc.stderr.decode(errors='replace')}") from exc
    return out


def probe_header(path: str | Path) -> dict:
    """``{"width", "height", "fps"}`` of a video from its header (no full decode)."""
    import imageio_ffmpeg

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such video: {path}")
    reader = imageio_ffmpeg.read_frames(str(path))
    try:
        meta = next(reader)
    finally:
        reader.close()
    w, h = meta["size"]
    return {"width": int(w), "height": int(h), "fps": float(meta["fps"])}


# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------

def _pair(a, b) -> tuple[np.ndarray, np.ndarray]:
    x, y = to_uint8_frames(a), to_uint8_frames(b)
    if x.shape != y.shape:
        raise ValueError(f"clips differ in shape: {x.shape} vs {y.shape}")
    return x, y


def psnr(a, b) -> float:
    """PSNR in dB of clip ``a`` against clip ``b`` (uint8 frames, peak 255), over all frames,
    pixels and channels; ``inf`` for identical clips."""
    x, y = _pair(a, b)
    mse = float(np.mean((x.astype(np.float64) - y.astype(np.float64)) ** 2))
    return math.inf if mse == 0.0 else 10.0 * math.log10(255.0 ** 2 / mse)


def _gaussian_window(size: int = 11, sigma: float = 1.5) -> np.ndarray:
    r = np.arange(size, dtype=np.float64) - (size - 1) / 2
    g = np.exp(-(r ** 2) / (2 * sigma ** 2))
    return g / g.sum()


def ssim(a, b, *, frames_per_chunk: int = 8) -> float:
    """Mean SSIM of clip ``a`` against clip ``b`` (Wang et al. 2004: Gaussian window 11, σ 1.5,
    K1 0.01, K2 0.03, L 255, valid region), computed per frame and channel and averaged."""
    import torch
    import torch.nn.functional as F

    x, y = _pair(a, b)
    t, h, w, _ = x.shape
    if min(h, w) < 11:
        raise ValueError(f"SSIM needs frames of at least 11x11 pixels, got {h}x{w}")
    g = torch.from_numpy(_gaussian_window())
    kh, kw = g.view(1, 1, -1, 1), g.view(1, 1, 1, -1)
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2

    def blur(z):
        return F.conv2d(F.conv2d(z, kh), kw)

    total, count = 0.0, 0
    for s in range(0, t, frames_per_chunk):
        xa = torch.from_numpy(x[s:s + frames_per_chunk]).double().permute(0, 3, 1, 2).reshape(-1, 1, h, w)
        ya = torch.from_numpy(y[s:s + frames_per_chunk]).double().permute(0, 3, 1, 2).reshape(-1, 1, h, w)
        mx, my = blur(xa), blur(ya)
        sxx = blur(xa * xa) - mx * mx
        syy = blur(ya * ya) - my * my
        sxy = blur(xa * ya) - mx * my
        smap = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx * mx + my * my + c1) * (sxx + syy + c2))
        per_plane = smap.mean(dim=(1, 2, 3))
        total += float(per_plane.sum())
        count += per_plane.numel()
    return total / count


__all__ = ["drawtext_font", "ffmpeg_exe", "palette_png", "probe_header", "probe_mp4", "psnr", "read_mp4",
           "side_by_side", "ssim", "to_uint8_frames", "write_mp4"]
