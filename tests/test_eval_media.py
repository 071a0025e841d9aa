"""Re-encoding, degradation and size padding of study clips."""

from __future__ import annotations

import struct

import imageio.v3 as iio
import numpy as np
import pytest

from attnqat.eval import media
from attnqat.eval.demo import synthetic_frames, write_clip


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(float) - b.astype(float)) ** 2)
    return float(10 * np.log10(255.0 ** 2 / mse)) if mse else float("inf")


def _boxes(data: bytes) -> list[tuple[bytes, int]]:
    out, i = [], 0
    while i < len(data):
        size, kind = struct.unpack(">I4s", data[i:i + 8])
        out.append((kind, size))
        assert size >= 8, "malformed box"
        i += size
    assert i == len(data), "boxes must tile the file exactly"
    return out


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    frames = synthetic_frames(2, n_frames=17, size=64)
    clean, noisy = root / "bf16_clip.mp4", root / "nvfp4_clip.mp4"
    write_clip(clean, frames)
    write_clip(noisy, synthetic_frames(2, n_frames=17, size=64, noise=20, seed=3))
    return root, frames, clean, noisy


def test_probe_reads_size_and_rate(clips):
    _, _, clean, _ = clips
    info = media.probe(clean)
    assert (info.width, info.height) == (64, 64)
    assert info.fps == pytest.approx(8.0)
    with pytest.raises(media.MediaError, match="not found"):
        media.probe(clean.parent / "missing.mp4")


def test_common_settings_pick_the_majority_and_even_sizes():
    infos = [media.VideoInfo(65, 33, 8.0, 2.0), media.VideoInfo(65, 33, 8.0, 2.0),
             media.VideoInfo(128, 128, 16.0, 1.0)]
    s = media.common_settings(infos)
    assert (s.width, s.height, s.fps) == (64, 32, 8.0)
    with pytest.raises(media.MediaError):
        media.common_settings([])


def test_uniform_encoding_padding_hides_method_and_size(clips):
    root, frames, clean, noisy = clips
    settings = media.common_settings([media.probe(clean), media.probe(noisy)])
    outs = [root / "out_a.mp4", root / "out_b.mp4", root / "out_c.mp4"]
    media.encode(clean, outs[0], settings)
    media.encode(noisy, outs[1], settings)
    media.encode(clean, outs[2], settings, degrade=True)
    sizes = [p.stat().st_size for p in outs]
    assert len(set(sizes)) > 1  # content differs, so raw sizes differ…
    target = media.padded_size(sizes)
    for p in outs:
        media.pad_to_size(p, target)
        media.freeze_mtime(p)
    assert {p.stat().st_size for p in outs} == {target}  # …until padded
    assert {int(p.stat().st_mtime) for p in outs} == {media.FIXED_MTIME}
    for p in outs:
        data = p.read_bytes()
        boxes = _boxes(data)
        assert boxes[0][0] == b"ftyp" and boxes[-1][0] == b"free"
        for needle in (b"bf16", b"nvfp4", b"clip", b"Lavf5", b"Lavf6", b"encoder"):
            assert needle not in data, needle
        decoded = iio.imread(p)
        assert decoded.shape == frames.shape  # still plays: same frames, same size
    # The clean re-encode stays close to the source; the degraded one is clearly worse.
    clean_psnr = _psnr(iio.imread(outs[0]), frames)
    degraded_psnr = _psnr(iio.imread(outs[2]), frames)
    assert clean_psnr > 30
    assert clean_psnr - degraded_psnr > 10


def test_padding_bytes_are_random_so_copies_differ(tmp_path, clips):
    _, _, clean, _ = clips
    a, b = tmp_path / "a.mp4", tmp_path / "b.mp4"
    settings = media.common_settings([media.probe(clean)])
    media.encode(clean, a, settings)
    b.write_bytes(a.read_bytes())
    size = media.padded_size([a.stat().st_size])
    media.pad_to_size(a, size)
    media.pad_to_size(b, size)
    assert a.stat().st_size == b.stat().st_size
    assert a.read_bytes() != b.read_bytes()
    with pytest.raises(media.MediaError, match="cannot pad"):
        media.pad_to_size(a, size + 3)


def test_encode_reports_ffmpeg_errors(tmp_path):
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"not a video")
    with pytest.raises(media.MediaError, match="ffmpeg failed"):
        media.encode(bad, tmp_path / "out.mp4", media.EncodeSettings(64, 64, 8.0))
