"""Clip handling for a blind study: probing, uniform re-encoding, degradation and size padding.

A rater must not be able to tell the methods apart by anything but the picture. So every clip of
a study is re-encoded with one set of encoder settings (codec, quality, resolution, frame rate),
with all metadata stripped and bit-exact muxing (no encoder version strings), and finally padded
to one common byte size with a trailing ISO-BMFF ``free`` box of random bytes (players skip
``free`` boxes), which also makes byte-identical copies differ by hash. ffmpeg runs through
ffmpeg-python on the binary shipped by ``imageio-ffmpeg`` (there is no system ffmpeg).
"""

from __future__ import annotations

import os
import struct
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import ffmpeg
import imageio_ffmpeg

#: Fixed modification time given to every served clip (2000-01-01 UTC): encoding order must not
#: leak through file times either.
FIXED_MTIME = 946684800


class MediaError(RuntimeError):
    """A clip could not be read or encoded."""


def ffmpeg_exe() -> str:
    """Path of the ffmpeg binary shipped with imageio-ffmpeg."""
    return imageio_ffmpeg.get_ffmpeg_exe()


@dataclass(frozen=True)
class VideoInfo:
    width: int
    height: int
    fps: float
    duration: float


def probe(path: str | Path) -> VideoInfo:
    """Resolution, frame rate and duration of a clip (read from ffmpeg's header parse)."""
    path = Path(path)
    if not path.is_file():
        raise MediaError(f"clip not found: {path}")
    try:
        reader = imageio_ffmpeg.read_frames(str(path))
        meta = next(reader)
        reader.close()
    except Exception as exc:  # imageio-ffmpeg raises plain RuntimeError/OSError
        raise MediaError(f"cannot read clip {path}: {exc}") from exc
    width, height = meta["size"]
    return VideoInfo(int(width), int(height), float(meta.get("fps") or 0.0),
                     float(meta.get("duration") or 0.0))


@dataclass(frozen=True)
class EncodeSettings:
    """The one encoding every clip of a study gets (stored in the study's configuration)."""

    width: int
    height: int
    fps: float
    crf: int = 18
    preset: str = "medium"
    codec: str = "libx264"
    pix_fmt: str = "yuv420p"

    def as_dict(self) -> dict:
        return asdict(self)


def _even(x: int) -> int:
    return max(2, int(x) // 2 * 2)


def common_settings(infos: Sequence[VideoInfo], crf: int = 18, preset: str = "medium"
                    ) -> EncodeSettings:
    """Settings for a study: the most common resolution (rounded to even, as yuv420p needs) and
    frame rate among its source clips."""
    if not infos:
        raise MediaError("no clips to encode")
    (w, h), _ = Counter((i.width, i.height) for i in infos).most_common(1)[0]
    fps, _ = Counter(round(i.fps, 3) for i in infos).most_common(1)[0]
    if fps <= 0:
        raise MediaError("could not determine the clips' frame rate")
    return EncodeSettings(_even(w), _even(h), float(fps), crf=crf, preset=preset)


def encode(src: str | Path, dst: str | Path, settings: EncodeSettings, *, degrade: bool = False,
           degrade_strength: int = 4) -> None:
    """Re-encode ``src`` to ``dst`` (mp4) with ``settings``; no audio, no metadata.

    ``degrade`` first throws away detail (downscale by ``degrade_strength`` and blow back up with
    nearest-neighbour) and adds strong temporal noise: the "clearly degraded" side of a check
    item. The encoder settings are the same as for every other clip.
    """
    stream = ffmpeg.input(str(src)).video
    if degrade:
        s = max(2, int(degrade_strength))
        stream = stream.filter("scale", _even(settings.width // s), _even(settings.height // s))
        stream = stream.filter("scale", settings.width, settings.height, flags="neighbor")
        stream = stream.filter("noise", alls=40, allf="t+u")
    stream = stream.filter("scale", settings.width, settings.height)
    stream = stream.filter("fps", fps=settings.fps)
    stream = stream.filter("setsar", 1)
    out = ffmpeg.output(
        stream, str(dst),
        vcodec=settings.codec, pix_fmt=settings.pix_fmt, crf=settings.crf, preset=settings.preset,
        an=None, sn=None, dn=None, map_metadata=-1, map_chapters=-1, movflags="+faststart",
        fflags="+bitexact", **{"flags:v": "+bitexact", "f": "mp4"},
    ).global_args("-nostdin", "-loglevel", "error")
    try:
        out.run(cmd=ffmpeg_exe(), overwrite_output=True, capture_stdout=True, capture_stderr=True)
    except ffmpeg.Error as exc:
        detail = (exc.stderr or b"").decode("utf-8", "replace").strip()
        raise MediaError(f"ffmpeg failed on {src}: {detail or exc}") from exc


FREE_BOX_HEADER = 8  # 32-bit size + b"free"
MIN_RANDOM_PADDING = 64  # every clip ends with at least this many random bytes


def pad_to_size(path: str | Path, size: int) -> None:
    """Append one top-level ``free`` box of random bytes so the file is exactly ``size`` bytes."""
    path = Path(path)
    extra = size - path.stat().st_size
    if extra == 0:
        return
    if extra < FREE_BOX_HEADER:
        raise MediaError(f"cannot pad {path} by {extra} bytes (a box needs at least 8)")
    with open(path, "ab") as fh:
        fh.write(struct.pack(">I", extra) + b"free" + os.urandom(extra - FREE_BOX_HEADER))


def padded_size(sizes: Sequence[int]) -> int:
    """The common size of a study's clips: room for a free box of random bytes after the
    largest one (so even the largest clip differs from a byte-identical copy)."""
    return max(sizes) + FREE_BOX_HEADER + MIN_RANDOM_PADDING


def freeze_mtime(path: str | Path) -> None:
    """Give a served clip the study-wide fixed modification time."""
    os.utime(path, (FIXED_MTIME, FIXED_MTIME))
