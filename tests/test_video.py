"""mp4 writing and reading, the labelled side-by-side, PSNR and SSIM (attnqat/video.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnqat import video


def moving_square(frames: int = 9, h: int = 48, w: int = 64, colour=(255, 40, 40)) -> np.ndarray:
    """A smooth test clip: a square crossing a gradient background."""
    y, x = np.mgrid[0:h, 0:w]
    clip = np.zeros((frames, h, w, 3), np.uint8)
    for t in range(frames):
        clip[t, ..., 2] = (x * 255 // max(1, w - 1)).astype(np.uint8)
        clip[t, ..., 1] = (y * 255 // max(1, h - 1)).astype(np.uint8)
        x0 = 2 + t * 3
        clip[t, 10:26, x0:x0 + 16] = colour
    return clip


def test_write_read_roundtrip(tmp_path):
    clip = moving_square()
    path = video.write_mp4(clip, tmp_path / "a.mp4", fps=16)
    frames, fps = video.read_mp4(path)
    assert frames.shape == clip.shape
    assert fps == 16
    assert video.probe_mp4(path) == {"frames": 9, "height": 48, "width": 64, "fps": 16.0}
    assert video.psnr(frames, clip) > 30  # H.264 at crf 17 on a smooth clip


def test_float_frames_and_fractional_fps(tmp_path):
    clip = moving_square(frames=5).astype(np.float32) / 255.0
    path = video.write_mp4(clip[None], tmp_path / "f.mp4", fps=12.5)
    info = video.probe_mp4(path)
    assert info["frames"] == 5 and info["fps"] == 12.5


def test_write_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="even"):
        video.write_mp4(np.zeros((3, 15, 16, 3), np.uint8), tmp_path / "x.mp4", fps=8)
    with pytest.raises(ValueError, match="fps"):
        video.write_mp4(np.zeros((3, 16, 16, 3), np.uint8), tmp_path / "x.mp4", fps=0)
    with pytest.raises(ValueError, match=r"\(T, H, W, 3\)"):
        video.write_mp4(np.zeros((3, 16, 16), np.uint8), tmp_path / "x.mp4", fps=8)
    assert not (tmp_path / "x.mp4").exists()


@pytest.mark.parametrize("renderer", ["pillow", "drawtext"])
def test_side_by_side_size_frames_and_labels(tmp_path, renderer):
    if renderer == "drawtext" and video.drawtext_font() is None:
        pytest.skip("this ffmpeg's drawtext filter has no usable font here")
    a = video.write_mp4(moving_square(), tmp_path / "a.mp4", fps=16)
    b = video.write_mp4(moving_square(colour=(40, 255, 40)), tmp_path / "b.mp4", fps=16)
    out = video.side_by_side({"bf16": a, "nvfp4": b}, tmp_path / "sbs.mp4", renderer=renderer)
    frames, fps = video.read_mp4(out)
    band = video._band_height(48)
    assert frames.shape == (9, 48 + band, 64 * 2 + video.GAP, 3)
    assert fps == 16
    header = frames[0, :band].astype(int)
    left, right = header[:, :64], header[:, 64 + video.GAP:]
    assert left.max() > 128 and right.max() > 128  # a light label on each dark band
    assert (left > 128).any(axis=2).sum() != (right > 128).any(axis=2).sum()  # different words
    # below the band, each panel is its clip
    assert video.psnr(frames[:, band:, :64], moving_square()) > 28
    assert video.psnr(frames[:, band:, 64 + video.GAP:], moving_square(colour=(40, 255, 40))) > 28


def test_side_by_side_single_clip_and_size_mismatch(tmp_path):
    a = video.write_mp4(moving_square(), tmp_path / "a.mp4", fps=8)
    one = video.side_by_side({"bf16": a}, tmp_path / "one.mp4", renderer="pillow")
    info = video.probe_mp4(one)
    assert (info["width"], info["frames"], info["fps"]) == (64, 9, 8.0)
    c = video.write_mp4(moving_square(h=32), tmp_path / "c.mp4", fps=8)
    with pytest.raises(ValueError, match="differ in size"):
        video.side_by_side({"a": a, "c": c}, tmp_path / "bad.mp4")


def test_psnr_and_ssim():
    clip = moving_square()
    assert math.isinf(video.psnr(clip, clip))
    assert video.ssim(clip, clip) == pytest.approx(1.0)
    shifted = np.clip(clip.astype(int) + 4, 0, 255).astype(np.uint8)
    mse = np.mean((shifted.astype(float) - clip.astype(float)) ** 2)
    assert video.psnr(shifted, clip) == pytest.approx(10 * math.log10(255 ** 2 / mse))
    rng = np.random.default_rng(0)
    noisy = [np.clip(clip + rng.normal(0, s, clip.shape), 0, 255).astype(np.uint8) for s in (2, 10, 40)]
    ss = [video.ssim(n, clip) for n in noisy]
    ps = [video.psnr(n, clip) for n in noisy]
    assert 1 > ss[0] > ss[1] > ss[2] > 0
    assert ps[0] > ps[1] > ps[2]
    assert video.ssim(clip, noisy[2]) == pytest.approx(ss[2])  # symmetric
    with pytest.raises(ValueError, match="differ in shape"):
        video.psnr(clip, clip[:-1])


@pytest.mark.subprocess   # a Python child process whose stdin the test feeds
def test_ffmpeg_never_reads_the_callers_stdin(tmp_path):
    """Inside ``while read p; do attnqat generate …; done < prompts.txt`` every ffmpeg call
    inherits the loop's stdin; without ``-nostdin`` ffmpeg reads it as keyboard input and eats
    bytes of the prompt list. A child process with stdin on a pipe runs every ffmpeg call of
    this module and then reads its stdin: every byte must still be there."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        from attnqat import video
        video.drawtext_font.cache_clear()
        video.drawtext_font()
        # noise takes x264 long enough (> 0.1 s) for ffmpeg to poll its "keyboard"
        clip = np.random.default_rng(0).integers(0, 256, (48, 128, 192, 3), dtype=np.uint8)
        a = video.write_mp4(clip, {str(tmp_path / 'a.mp4')!r}, fps=16)
        b = video.write_mp4(clip[::-1], {str(tmp_path / 'b.mp4')!r}, fps=16)
        for renderer in ("pillow", "auto"):
            video.side_by_side({{"A": a, "B": b}}, {str(tmp_path / 'sbs.mp4')!r}, renderer=renderer)
        video.read_mp4(a)
        data = sys.stdin.buffer.read()
        sys.stdout.write(str(len(data)))
    """)
    payload = b"".join(f"a prompt number {i}: an orange circle moves right\n".encode()
                       for i in range(400))
    proc = subprocess.run([sys.executable, "-c", script], input=payload, capture_output=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert proc.stdout.decode().strip() == str(len(payload))
