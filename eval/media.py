"""The clips a rater sees: one side-by-side video per item and display order, all of one size.

What a browser can read of a served clip must not name the method of either side. A study
therefore never serves one file per method: each item is served as ONE H.264 video with both
clips side by side (A|B or B|A, a separate encode for each order), so the bytes describe the pair
and are the same kind of thing whichever side holds which method. On top of that every served
file of a study has exactly the same size and the same container:

* every pair is encoded on its own with one set of settings: resolution, frame rate and frame
  count of the study (shorter sources hold their last frame, longer ones are cut), x264 with one
  constant quantizer (every pair quantized alike), one key frame, no B-frames, one slice per
  frame, no SEI (no encoder version string), bit-exact muxing without metadata;
* the picture is laid out so that neither side is coded differently for being left or right:
  both clips start on a macroblock boundary and each has black macroblocks on both sides (a
  16-pixel border outside, the 32-pixel gap between them), so intra prediction, motion search
  and skip runs see the same surroundings on both sides. Measured on the demo clips: a constant
  rate factor, or a gap off the macroblock grid, made the coded size depend on the order by
  0.3–3 % in one direction. (The border is shown, not cropped: Chromium ignores a left crop.);
* every access unit (frame) ends with an H.264 filler-data NAL unit that brings it to the
  study-wide size of that frame position, so the sample-size table, the ``moov`` box and the file
  size are byte-identical for every served file (checked after the build).

What padding cannot hide is how many bytes the pair as a whole needed; that is the complexity of
the two clips together, the same for A|B and B|A. Which side is which is only in the picture.

ffmpeg runs through ffmpeg-python on the binary shipped with ``imageio-ffmpeg`` (there is no
system ffmpeg), found through :func:`attnqat.video.ffmpeg_exe`.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import ffmpeg

from attnqat.video import ffmpeg_exe

#: Fixed modification time given to every served clip (2000-01-01 UTC): encoding order must not
#: leak through file times either.
FIXED_MTIME = 946684800
#: Bytes of the smallest filler NAL unit in an MP4 sample: 4-byte length, header, trailing bits.
FILLER_MIN = 6
NAL_FILLER = 12
_START_CODE = re.compile(b"\x00\x00\x01")


class MediaError(RuntimeError):
    """A clip could not be read, encoded or padded."""


@dataclass(frozen=True)
class VideoInfo:
    width: int
    height: int
    fps: float
    duration: float

    @property
    def frames(self) -> int:
        """Frame count implied by the duration and frame rate."""
        return max(1, round(self.duration * self.fps))


def probe(path: str | Path) -> VideoInfo:
    """Resolution, frame rate and duration of a clip (read from ffmpeg's header parse)."""
    path = Path(path)
    if not path.is_file():
        raise MediaError(f"clip not found: {path}")
    # ffmpeg with an input and no output parses the header, prints it and exits: nothing to
    # stop (closing imageio-ffmpeg's frame reader early killed ffmpeg and logged "We had to
    # kill ffmpeg to stop it." for every clip of a build).
    from imageio_ffmpeg._parsing import parse_ffmpeg_header

    done = subprocess.run([ffmpeg_exe(), "-nostdin", "-hide_banner", "-i", str(path)],
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    text = done.stderr.decode("utf-8", "replace")
    try:
        meta = parse_ffmpeg_header(text)
    except Exception as exc:  # noqa: BLE001 - not a video ffmpeg can read
        detail = text.strip().splitlines()[-1] if text.strip() else str(exc)
        raise MediaError(f"cannot read clip {path}: {detail}") from exc
    width, height = meta["size"]
    return VideoInfo(int(width), int(height), float(meta.get("fps") or 0.0),
                     float(meta.get("duration") or 0.0))


#: Width of the black border left of the left clip and right of the right clip (one
#: macroblock), and of the gap between them (two macroblocks: the same skip-run structure
#: after each clip, since a row's end joins the next row's start).
EDGE, GAP = 16, 32


@dataclass(frozen=True)
class EncodeSettings:
    """The one encoding of a study (stored in its configuration). ``width``/``height`` are one
    clip's; a served pair shows both with a black :data:`GAP` between them (``pair_size``)."""

    width: int
    height: int
    fps: float
    frames: int
    qp: int = 18
    preset: str = "medium"
    codec: str = "libx264"
    pix_fmt: str = "yuv420p"

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EncodeSettings:
        known = cls.__dataclass_fields__
        missing = {"width", "height", "fps", "frames"} - set(d)
        if missing:
            raise MediaError(f"encode settings lack {', '.join(sorted(missing))}")
        return cls(**{k: v for k, v in d.items() if k in known})

    @property
    def duration(self) -> float:
        """Seconds one served pair plays."""
        return self.frames / self.fps

    @property
    def panel(self) -> int:
        """Coded width of one clip: its width rounded up to whole macroblocks."""
        return -(-self.width // 16) * 16

    @property
    def pair_size(self) -> tuple[int, int]:
        """Size of a served pair: border, clip, gap, clip, border (clips rounded to whole
        macroblocks, black on their right)."""
        return (2 * (EDGE + self.panel) + GAP, self.height)


def _even(x: int) -> int:
    return max(2, int(x) // 2 * 2)


def common_settings(infos: Sequence[VideoInfo], qp: int = 18, preset: str = "medium"
                    ) -> EncodeSettings:
    """Settings for a study: the most common resolution (rounded to even, as yuv420p needs), frame
    rate and frame count among its source clips."""
    if not infos:
        raise MediaError("no clips to encode")
    (w, h), _ = Counter((i.width, i.height) for i in infos).most_common(1)[0]
    fps, _ = Counter(round(i.fps, 3) for i in infos).most_common(1)[0]
    if fps <= 0:
        raise MediaError("could not determine the clips' frame rate")
    frames, _ = Counter(max(1, round(i.duration * fps)) for i in infos).most_common(1)[0]
    return EncodeSettings(_even(w), _even(h), float(fps), frames, qp=qp, preset=preset)


#: Temporal noise (ffmpeg ``noise`` filter strength) of a degraded side unless the build
#: calibrates it (see :func:`attnqat.eval.study.build_study`).
DEGRADE_NOISE = 40.0


@dataclass(frozen=True)
class Side:
    """One half of a served pair: a source clip, optionally degraded (a check item's bad side)
    with temporal noise of strength ``noise`` on top of the lost detail."""

    path: Path
    degrade: bool = False
    noise: float = DEGRADE_NOISE


def _clip_stream(side: Side, settings: EncodeSettings, degrade_strength: int = 4):
    stream = ffmpeg.input(str(side.path)).video
    if side.degrade:
        # The "clearly degraded" side of a check item: detail thrown away (downscaled and blown
        # back up with nearest-neighbour) and strong temporal noise.
        s = max(2, int(degrade_strength))
        stream = stream.filter("scale", _even(settings.width // s), _even(settings.height // s))
        stream = stream.filter("scale", settings.width, settings.height, flags="neighbor")
        if side.noise > 0:
            stream = stream.filter("noise", alls=int(round(side.noise)), allf="t+u")
    stream = stream.filter("scale", settings.width, settings.height)
    stream = stream.filter("fps", fps=settings.fps)
    stream = stream.filter("setsar", 1)
    stream = stream.filter("tpad", stop=-1, stop_mode="clone")  # hold the last frame…
    stream = stream.filter("trim", end_frame=settings.frames)  # …up to the study's length
    return stream.filter("setpts", "PTS-STARTPTS")


def _x264_params(settings: EncodeSettings) -> str:
    keyint = settings.frames
    # One key frame (clips are short and loop from the start), no scene-cut key frames, no
    # B-frames and one slice per frame: the same frame structure for every clip of a study.
    return f"keyint={keyint}:min-keyint={keyint}:scenecut=0:bframes=0:slices=1"


def encode_pair(left: Side, right: Side, settings: EncodeSettings) -> list[list[bytes]]:
    """Encode ``left`` and ``right`` side by side; returns the access units (one per frame), each
    a list of NAL units (without start codes)."""
    if settings.frames < 1:
        raise MediaError("a served pair needs a frame count of at least 1")
    if left == right:  # one decode feeds both halves (an identical check item)
        split = _clip_stream(left, settings).split()
        lhs, rhs = split[0], split[1]
    else:
        lhs, rhs = _clip_stream(left, settings), _clip_stream(right, settings)
    # [border | left clip, rounded up to whole macroblocks | gap] [right clip, rounded | border]
    lhs = lhs.filter("pad", EDGE + settings.panel + GAP, settings.height, EDGE, 0, color="black")
    rhs = rhs.filter("pad", settings.panel + EDGE, settings.height, 0, 0, color="black")
    both = ffmpeg.filter([lhs, rhs], "hstack", inputs=2)
    out = ffmpeg.output(
        both, "pipe:", format="h264", vcodec=settings.codec, pix_fmt=settings.pix_fmt,
        qp=settings.qp, preset=settings.preset, an=None, sn=None, dn=None,
        **{"x264-params": _x264_params(settings), "frames:v": settings.frames,
           "bsf:v": "filter_units=remove_types=6"},
    ).global_args("-nostdin", "-loglevel", "error")
    try:
        data, _ = out.run(cmd=ffmpeg_exe(), capture_stdout=True, capture_stderr=True)
    except ffmpeg.Error as exc:
        detail = (exc.stderr or b"").decode("utf-8", "replace").strip()
        raise MediaError(f"ffmpeg failed on {left.path} | {right.path}: {detail or exc}") from exc
    units = access_units(data)
    if len(units) != settings.frames:
        raise MediaError(f"encoding {left.path} | {right.path} gave {len(units)} frames, "
                         f"expected {settings.frames}")
    return units


def nal_units(annexb: bytes) -> list[bytes]:
    """The NAL units of an Annex B byte stream (start codes and trailing zero bytes removed)."""
    starts = [m.end() for m in _START_CODE.finditer(annexb)]
    units = []
    for k, start in enumerate(starts):
        end = starts[k + 1] - 3 if k + 1 < len(starts) else len(annexb)
        unit = annexb[start:end]
        if k + 1 < len(starts):
            unit = unit.rstrip(b"\x00")  # the zero byte of a 4-byte start code
        if unit:
            units.append(unit)
    return units


def access_units(annexb: bytes) -> list[list[bytes]]:
    """NAL units grouped per frame: a new frame starts at each coded slice (one slice per frame)
    and the parameter sets before it."""
    frames: list[list[bytes]] = []
    pending: list[bytes] = []
    for unit in nal_units(annexb):
        pending.append(unit)
        if unit[0] & 0x1F in (1, 5):  # coded slice: closes the frame
            frames.append(pending)
            pending = []
    if pending and frames:
        frames[-1].extend(pending)  # trailing non-slice units (end of stream) stay with the last
    return frames


def sample_size(unit_list: Sequence[bytes]) -> int:
    """Bytes of an access unit as an MP4 sample (4-byte length before each NAL unit)."""
    return sum(4 + len(u) for u in unit_list)


def padded_sizes(per_file: Sequence[Sequence[int]]) -> list[int]:
    """The study-wide size of each frame position: the largest sample at that position plus a
    minimal filler NAL unit, so every frame of every file ends with one."""
    if not per_file:
        raise MediaError("no encoded clips")
    lengths = {len(s) for s in per_file}
    if len(lengths) != 1:
        raise MediaError(f"encoded clips differ in frame count: {sorted(lengths)}")
    return [max(col) + FILLER_MIN for col in zip(*per_file)]


def filler_unit(sample_bytes: int) -> bytes:
    """A filler-data NAL unit that takes ``sample_bytes`` bytes of an MP4 sample (length field
    included): header 0x0C, 0xFF bytes, RBSP trailing bits 0x80."""
    if sample_bytes < FILLER_MIN:
        raise MediaError(f"a filler NAL unit needs at least {FILLER_MIN} bytes, not {sample_bytes}")
    return bytes([NAL_FILLER]) + b"\xff" * (sample_bytes - FILLER_MIN) + b"\x80"


def write_padded(units: Sequence[Sequence[bytes]], sizes: Sequence[int], fps: float,
                 dst: str | Path) -> None:
    """Pad each access unit to ``sizes`` with a filler NAL unit and mux the stream into ``dst``
    (mp4, no metadata, bit-exact, ``moov`` first)."""
    if len(units) != len(sizes):
        raise MediaError("one target size per frame is needed")
    parts = []
    for unit_list, size in zip(units, sizes):
        for unit in (*unit_list, filler_unit(size - sample_size(unit_list))):
            parts += [b"\x00\x00\x00\x01", unit]
    out = ffmpeg.output(
        ffmpeg.input("pipe:", format="h264", framerate=fps), str(dst), vcodec="copy",
        map_metadata=-1, map_chapters=-1, movflags="+faststart", fflags="+bitexact",
        **{"flags:v": "+bitexact", "f": "mp4"},
    ).global_args("-nostdin", "-loglevel", "error")
    try:
        out.run(cmd=ffmpeg_exe(), input=b"".join(parts), overwrite_output=True,
                capture_stdout=True, capture_stderr=True)
    except ffmpeg.Error as exc:
        detail = (exc.stderr or b"").decode("utf-8", "replace").strip()
        raise MediaError(f"ffmpeg failed writing {dst}: {detail or exc}") from exc


def top_level_boxes(data: bytes) -> list[tuple[bytes, int, int]]:
    """(type, offset, size) of each top-level ISO-BMFF box; raises :class:`MediaError` when the
    boxes do not tile the file."""
    out, i = [], 0
    while i < len(data):
        if i + 8 > len(data):
            raise MediaError("truncated box header")
        size, kind = struct.unpack(">I4s", data[i:i + 8])
        if size == 1:
            size = struct.unpack(">Q", data[i + 8:i + 16])[0]
        if size < 8 or i + size > len(data):
            raise MediaError(f"malformed {kind!r} box at byte {i}")
        out.append((kind, i, size))
        i += size
    return out


def container_layout(path: str | Path) -> bytes:
    """Everything of an mp4 file except the coded samples (see :func:`container_layout_of`)."""
    return container_layout_of(Path(path).read_bytes())


def container_layout_of(data: bytes) -> bytes:
    """Everything of mp4 bytes except the coded samples: each top-level box in full, ``mdat`` by
    its header only. Two files with the same layout differ only inside the picture data."""
    return b"".join(data[o:o + (8 if kind == b"mdat" else size)]
                    for kind, o, size in top_level_boxes(data))


def freeze_mtime(path: str | Path) -> None:
    """Give a served clip the study-wide fixed modification time."""
    os.utime(path, (FIXED_MTIME, FIXED_MTIME))
