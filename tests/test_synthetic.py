"""Tests of the synthetic shapes data (attnqat.synthetic)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from attnqat import synthetic as S


def test_vocabulary_and_default_clip_format():
    assert {"circle", "square", "triangle"} <= set(S.SHAPES)
    assert {"left", "right", "up", "down"} <= set(S.MOTIONS)
    frames, caption = S.clip_at(0, 0)
    assert frames.dtype == np.uint8
    assert frames.shape == (33, 128, 128, 3)
    assert S.FPS == 16
    assert isinstance(caption, str) and caption.endswith("background")


def test_same_seed_same_clip_and_different_seed_differs():
    a, ca = S.clip_at(7, 3)
    b, cb = S.clip_at(7, 3)
    assert ca == cb
    assert np.array_equal(a, b)
    specs_a = [S.spec_at(7, k) for k in range(20)]
    specs_b = [S.spec_at(8, k) for k in range(20)]
    assert specs_a == [S.spec_at(7, k) for k in range(20)]
    assert specs_a != specs_b
    rng1, rng2 = np.random.default_rng(5), np.random.default_rng(5)
    assert S.sample_spec(rng1) == S.sample_spec(rng2)


def test_caption_round_trips_through_the_parser():
    for k in range(300):
        spec = S.spec_at(11, k, max_objects=3)
        parsed = S.parse_caption(spec.caption)
        assert parsed == spec.semantic()
        assert parsed.caption == spec.caption
    # all single-object captions
    for c, s, m in itertools.product(S.COLOURS, S.SHAPES, S.MOTIONS):
        spec = S.ClipSpec((S.ObjectSpec(c, s, m),), "black")
        assert S.parse_caption(spec.caption) == spec
    # tolerant of case, spacing, a full stop and "grey"
    assert S.parse_caption("  A Red  circle moves to the left on a GREY background.") == \
        S.ClipSpec((S.ObjectSpec("red", "circle", "left"),), "gray")
    assert S.caption_of(S.parse_caption("an orange square grows and a white triangle moves up "
                                        "on a black background")) == \
        "an orange square grows and a white triangle moves up on a black background"


@pytest.mark.parametrize("caption, expected", [
    ("a dog runs in the park", "expected '<object> [and <object>] on a <background> background'"),
    ("a pink circle moves left on a black background", "unknown colour 'pink'"),
    ("a red hexagon moves left on a black background", "unknown shape 'hexagon'"),
    ("a red circle spins on a black background", "unknown motion 'spins'"),
    ("a red circle moves left on a purple background", "unknown background 'purple'"),
    ("red circle moves left on a black background", "expected"),
])
def test_bad_captions_name_what_was_expected(caption, expected):
    with pytest.raises(ValueError, match="cannot parse") as err:
        S.parse_caption(caption)
    assert expected in str(err.value)


def test_bad_specs_and_sizes_are_rejected():
    with pytest.raises(ValueError, match="unknown colour"):
        S.ObjectSpec("pink", "circle", "left")
    with pytest.raises(ValueError, match="1 to"):
        S.ClipSpec((), "black")
    with pytest.raises(ValueError, match="invisible"):
        S.render("a white circle moves left on a white background")
    with pytest.raises(ValueError, match="at least 16"):
        S.render("a red circle moves left on a black background", size=8)
    with pytest.raises(ValueError, match="split"):
        S.sample_spec(np.random.default_rng(0), split="test")


def test_heldout_rule_keeps_every_pair_of_attributes_in_training():
    assert len(S.HELDOUT_TRIPLES) == 24
    assert len(S.TRAIN_TRIPLES) + len(S.HELDOUT_TRIPLES) == len(S.COLOURS) * len(S.SHAPES) * len(S.MOTIONS)
    train = set(S.TRAIN_TRIPLES)
    for c, s in itertools.product(S.COLOURS, S.SHAPES):
        assert any((c, s, m) in train for m in S.MOTIONS)
    for c, m in itertools.product(S.COLOURS, S.MOTIONS):
        assert any((c, s, m) in train for s in S.SHAPES)
    for s, m in itertools.product(S.SHAPES, S.MOTIONS):
        assert any((c, s, m) in train for c in S.COLOURS)


def test_training_stream_never_emits_a_heldout_combination():
    heldout = set(S.heldout_prompts(200))
    seen_triples = set()
    for k in range(5000):
        spec = S.spec_at(0, k)
        assert S.split_of(spec) == "train"
        assert spec.caption not in heldout
        assert not any(S.is_heldout_triple(*t) for t in spec.triples)
        seen_triples.update(spec.triples)
    # the stream covers the training triples (so the check above is not vacuous)
    assert len(seen_triples) > 0.9 * len(S.TRAIN_TRIPLES)
    for caption in heldout:
        assert S.split_of(caption) == "heldout"


def test_object_weights_set_the_share_of_two_object_clips():
    counts = [len(S.spec_at(4, k, object_weights=(1.0, 3.0)).objects) for k in range(2000)]
    assert abs(counts.count(2) / len(counts) - 0.75) < 0.04
    assert all(len(S.spec_at(4, k, object_weights=(0.0, 1.0)).objects) == 2 for k in range(50))
    assert all(len(S.spec_at(4, k, object_weights=(1.0, 0.0)).objects) == 1 for k in range(50))
    # weighted streams stay training-only and deterministic
    assert all(S.split_of(S.spec_at(4, k, object_weights=(1, 3))) == "train" for k in range(200))
    assert S.spec_at(4, 9, object_weights=(1, 3)) == S.spec_at(4, 9, object_weights=(1, 3))
    for bad in ((1.0,), (1.0, -1.0), (0.0, 0.0), (1.0, float("nan"))):
        with pytest.raises(ValueError, match="object_weights"):
            S.spec_at(4, 0, object_weights=bad)


def test_heldout_prompts_are_fixed_distinct_and_prefix_stable():
    a = S.heldout_prompts(60)
    assert len(set(a)) == 60
    assert S.heldout_prompts(25) == a[:25]
    assert S.heldout_prompts(60) == a
    single = S.heldout_prompts(30, max_objects=1)
    assert all(" and " not in c for c in single)
    specs = S.heldout_specs(10)
    assert [s.caption for s in specs] == a[:10]
    assert all(o.has_geometry for s in specs for o in s.objects)


def test_clips_respect_the_geometry_contract():
    # background colour at the border, objects inside the frame and apart, sizes 20-50 px
    for k in range(40):
        spec = S.spec_at(2, k)
        frames = S.render(spec)
        bg = np.array(S.BACKGROUND_COLOURS[spec.background], dtype=np.uint8)
        border = np.concatenate([frames[:, 0], frames[:, -1], frames[:, :, 0], frames[:, :, -1]], axis=1)
        assert np.all(border == bg), spec.caption
        for o in spec.objects:
            colour = np.array(S.OBJECT_COLOURS[o.colour], dtype=np.uint8)
            mask = np.all(frames == colour, axis=-1)              # fully covered pixels
            present = mask.reshape(len(frames), -1).sum(axis=1)
            assert present.min() > 100, (spec.caption, present.min())
            ys, xs = np.nonzero(mask[0])
            extent = max(np.ptp(xs), np.ptp(ys)) + 1
            assert 14 <= extent <= 52, (spec.caption, extent)
        if len(spec.objects) == 2:   # drawn alone, the two objects never share a pixel
            a, b = (np.any(S.render(S.ClipSpec((o,), spec.background)) != bg, axis=-1)
                    for o in spec.objects)
            assert a.any() and b.any() and not np.any(a & b), spec.caption


def test_motion_is_what_the_caption_says():
    def centroid_and_area(frames, colour):
        mask = np.all(frames == np.array(S.OBJECT_COLOURS[colour], dtype=np.uint8), axis=-1)
        ys, xs = np.nonzero(mask[0])
        return xs.mean(), ys.mean(), mask.sum()

    for motion in S.MOTIONS:
        frames = S.render(f"a red square {'moves ' + motion if motion in S.TRANSLATIONS else motion + 's'}"
                          " on a black background")
        x0, y0, a0 = centroid_and_area(frames[:1], "red")
        x1, y1, a1 = centroid_and_area(frames[-1:], "red")
        assert a0 > 0 and a1 > 0
        moved = {"left": x0 - x1, "right": x1 - x0, "up": y0 - y1, "down": y1 - y0,
                 "grow": a1 / a0 - 1, "shrink": a0 / a1 - 1}[motion]
        assert moved > (0.3 * 128 if motion in S.TRANSLATIONS else 1.0), (motion, moved)


def test_render_accepts_captions_other_sizes_and_lengths():
    cap = "a blue triangle moves right and a yellow circle shrinks on a gray background"
    a = S.render(cap)
    assert np.array_equal(a, S.render(cap))            # fixed layout for a caption
    b = S.render(cap, frames=17, size=(96, 160))
    assert b.shape == (17, 96, 160, 3)
    c = S.render(S.parse_caption(cap), frames=9, size=256)
    assert c.shape == (9, 256, 256, 3)


def test_dataset_tensors_and_worker_sharding():
    ds = S.SyntheticClips(seed=3, frames=9, size=32, length=6)
    items = list(ds)
    assert len(items) == 6
    video, caption = items[0]
    assert video.shape == (3, 9, 32, 32) and video.dtype == torch.float32
    assert -1.0 <= video.min() and video.max() <= 1.0
    frames, cap0 = S.clip_at(3 * 1_000_003, 0, frames=9, size=32)
    assert caption == cap0
    assert torch.allclose(video, S.to_tensor(frames))
    # two workers together yield exactly the single-process stream
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    got = sorted(c for _, c in loader)
    assert got == sorted(c for _, c in items)
    # ranks split the stream without overlap
    r0 = [c for _, c in S.SyntheticClips(seed=3, frames=9, size=32, length=6, rank=0, world_size=2)]
    r1 = [c for _, c in S.SyntheticClips(seed=3, frames=9, size=32, length=6, rank=1, world_size=2)]
    assert r0 == [c for _, c in items[0::2]] and r1 == [c for _, c in items[1::2]]
    # epochs differ
    e1 = S.SyntheticClips(seed=3, frames=9, size=32, length=6, epoch=1)
    assert [c for _, c in e1] != [c for _, c in items]


def test_heldout_dataset_only_yields_heldout_captions():
    ds = S.SyntheticClips(seed=0, frames=5, size=32, length=20, split="heldout")
    assert all(S.split_of(c) == "heldout" for _, c in ds)


def test_data_command_writes_clips_and_captions(tmp_path):
    import json

    from attnqat.cli import main

    assert main(["finetune", "data", "--out", str(tmp_path), "--n", "2", "--frames", "9",
                 "--size", "64"]) == 0
    index = json.loads((tmp_path / "captions.json").read_text())
    assert [e["caption"] for e in index] == [S.spec_at(0, k).caption for k in range(2)]
    import imageio.v2 as imageio

    reader = imageio.get_reader(str(tmp_path / index[0]["video"]))
    frames = np.stack([f for f in reader])
    reader.close()
    assert frames.shape == (9, 64, 64, 3)
