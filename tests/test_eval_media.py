"""Side-by-side encoding of study pairs, degradation, and padding every frame to one size."""

from __future__ import annotations

import imageio.v3 as iio
import numpy as np
import pytest

from attnqat.eval import media
from attnqat.eval.demo import synthetic_frames
from attnqat.video import write_mp4


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(float) - b.astype(float)) ** 2)
    return float(10 * np.log10(255.0 ** 2 / mse)) if mse else float("inf")


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    clean_frames = synthetic_frames(2, n_frames=17, size=64)
    clean, noisy, short = root / "bf16_clip.mp4", root / "nvfp4_clip.mp4", root / "short.mp4"
    write_mp4(clean_frames, clean, fps=8)
    write_mp4(synthetic_frames(2, n_frames=17, size=64, noise=20, seed=3), noisy, fps=8)
    write_mp4(synthetic_frames(5, n_frames=9, size=64), short, fps=8)
    return root, clean_frames, clean, noisy, short


def test_probe_reads_size_rate_and_length(clips):
    _, _, clean, _, short = clips
    info = media.probe(clean)
    assert (info.width, info.height, info.frames) == (64, 64, 17)
    assert info.fps == pytest.approx(8.0)
    assert media.probe(short).frames == 9
    with pytest.raises(media.MediaError, match="not found"):
        media.probe(clean.parent / "missing.mp4")


def test_common_settings_pick_the_majority_and_even_sizes():
    infos = [media.VideoInfo(65, 33, 8.0, 2.0), media.VideoInfo(65, 33, 8.0, 2.0),
             media.VideoInfo(128, 128, 16.0, 1.0)]
    s = media.common_settings(infos)
    assert (s.width, s.height, s.fps, s.frames) == (64, 32, 8.0, 16)
    assert s.pair_size == (2 * (media.EDGE + 64) + media.GAP, 32) and s.duration == pytest.approx(2.0)
    with pytest.raises(media.MediaError):
        media.common_settings([])


def test_access_units_split_an_annexb_stream():
    sps, pps, idr, p1, p2 = b"\x67\x01", b"\x68\x02", b"\x65\x03\x80", b"\x41\x04", b"\x41\x05"
    stream = b"".join(b"\x00\x00\x00\x01" + u for u in (sps, pps, idr)) + b"\x00\x00\x01" + p1 + \
        b"\x00\x00\x00\x01" + p2
    units = media.access_units(stream)
    assert units == [[sps, pps, idr], [p1], [p2]]
    assert media.sample_size(units[0]) == 3 * 4 + 2 + 2 + 3
    assert media.padded_sizes([[10, 20], [12, 18]]) == [12 + media.FILLER_MIN, 20 + media.FILLER_MIN]
    with pytest.raises(media.MediaError, match="frame count"):
        media.padded_sizes([[10, 20], [12]])
    filler = media.filler_unit(10)
    assert filler[0] & 0x1F == media.NAL_FILLER and len(filler) + 4 == 10 and filler[-1] == 0x80
    with pytest.raises(media.MediaError, match="at least"):
        media.filler_unit(media.FILLER_MIN - 1)


def test_pairs_of_any_content_become_files_of_one_size_and_layout(clips, tmp_path):
    root, clean_frames, clean, noisy, short = clips
    settings = media.common_settings([media.probe(p) for p in (clean, noisy, short)])
    sides = {
        "clean|noisy": (media.Side(clean), media.Side(noisy)),
        "noisy|clean": (media.Side(noisy), media.Side(clean)),
        "clean|clean": (media.Side(clean), media.Side(clean)),
        "degraded|short": (media.Side(clean, degrade=True), media.Side(short)),
    }
    units = {k: media.encode_pair(a, b, settings) for k, (a, b) in sides.items()}
    raw = {k: [media.sample_size(au) for au in u] for k, u in units.items()}
    assert len({sum(r) for r in raw.values()}) > 1  # content differs, so coded sizes differ…
    assert raw["clean|noisy"] != raw["noisy|clean"]
    target = media.padded_sizes(list(raw.values()))
    paths = {}
    for k, u in units.items():
        paths[k] = tmp_path / f"{len(paths)}.mp4"
        media.write_padded(u, target, settings.fps, paths[k])
        media.freeze_mtime(paths[k])
    # …until every frame is padded: one size, one container, one modification time.
    assert {p.stat().st_size for p in paths.values()} == {paths["clean|noisy"].stat().st_size}
    assert len({media.container_layout(p) for p in paths.values()}) == 1
    assert {int(p.stat().st_mtime) for p in paths.values()} == {media.FIXED_MTIME}
    for p in paths.values():
        data = p.read_bytes()
        boxes = [kind for kind, _, _ in media.top_level_boxes(data)]
        assert boxes[0] == b"ftyp" and boxes.index(b"moov") < boxes.index(b"mdat")
        for needle in (b"bf16", b"nvfp4", b"clip", b"Lavf", b"x264", b"encoder"):
            assert needle not in data, needle
    # They still play: the study's length (the short clip holds its last frame), both halves.
    w, h = settings.pair_size
    decoded = {k: iio.imread(p) for k, p in paths.items()}
    assert all(v.shape == (17, h, w, 3) for v in decoded.values())
    e, g = media.EDGE, media.GAP
    left = decoded["clean|noisy"][:, :, e:e + 64]
    right = decoded["noisy|clean"][:, :, w - e - 64:w - e]
    assert _psnr(left, clean_frames) > 30 and _psnr(right, clean_frames) > 30
    for border in (slice(0, e), slice(e + 64, e + 64 + g), slice(w - e, w)):
        assert decoded["clean|noisy"][:, :, border].max() < 40  # black borders and gap
    # The degraded side of a check is clearly worse than the clean re-encode.
    degraded = decoded["degraded|short"][:, :, e:e + 64]
    assert _psnr(left, clean_frames) - _psnr(degraded, clean_frames) > 10
    held = decoded["degraded|short"][:, :, w - e - 64:w - e]
    assert _psnr(held[9], held[16]) > 35  # frames 9… repeat the short clip's last frame


def test_encode_reports_ffmpeg_errors(tmp_path, clips):
    _, _, clean, _, _ = clips
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"not a video")
    settings = media.EncodeSettings(64, 64, 8.0, 17)
    with pytest.raises(media.MediaError, match="ffmpeg failed"):
        media.encode_pair(media.Side(bad), media.Side(clean), settings)
    with pytest.raises(media.MediaError, match="frame count"):
        media.encode_pair(media.Side(clean), media.Side(clean), media.EncodeSettings(64, 64, 8.0, 0))
    with pytest.raises(media.MediaError, match="one target size per frame"):
        media.write_padded([[b"\x65\x00"]], [10, 10], 8.0, tmp_path / "x.mp4")
    with pytest.raises(media.MediaError, match="malformed"):
        media.top_level_boxes(b"\x00\x00\x00\x04free")
