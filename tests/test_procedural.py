"""Tests of the procedural evaluator (attnqat.eval.procedural) on clips from the generator."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnqat.eval import procedural as P
from attnqat import synthetic as S

N_GT = 120          # ground-truth clips (training stream) ...
N_HELDOUT = 40      # ... plus held-out prompts
N_DEGRADED = 24
N_NOISE = 20


@pytest.fixture(scope="module")
def ground_truth():
    """(spec, clip, analysis) for clips of the training stream and of the held-out prompts."""
    specs = [S.spec_at(101, k) for k in range(N_GT)] + S.heldout_specs(N_HELDOUT)
    out = []
    for spec in specs:
        clip = S.render(spec)
        out.append((spec, clip, P.analyze_clip(clip)))
    return out


def _accuracy(scores):
    return P.summarize(scores)


@pytest.mark.slow
def test_ground_truth_is_scored_correct(ground_truth):
    scores = [P.score_analysis(spec, an) for spec, _, an in ground_truth]
    acc = _accuracy(scores)
    assert acc["objects"] > len(ground_truth)          # some clips have two objects
    for attr in ("colour", "shape", "motion", "background", "count"):
        assert acc[attr] >= 0.95, (attr, acc[attr])
    assert acc["all_correct"] >= 0.95
    # a clean, steady clip is also scored consistent and clean
    assert acc["presence"] >= 0.95
    assert acc["size_stability"] >= 0.9
    assert acc["path_smoothness"] >= 0.9
    assert acc["flicker_score"] >= 0.99
    assert acc["cleanliness"] >= 0.95
    assert acc["aggregate"] >= 0.95
    # each attribute is exercised with every value
    seen = {a: {p["stated"][a] for s in scores for p in s["objects"]} for a in P.ATTRIBUTES}
    assert seen["colour"] == set(S.COLOURS)
    assert seen["shape"] == set(S.SHAPES)
    assert seen["motion"] == set(S.MOTIONS)


@pytest.mark.slow   # the 160 rendered and analysed clips of ground_truth: about 10 s
def test_swapped_captions_score_at_chance(ground_truth):
    """Each clip against another clip's caption: the evaluator must agree with what a perfect
    judge (the true attributes) says, so its accuracy is the chance agreement of the pairs."""
    n = len(ground_truth)
    scores, chance = [], []
    agree = total = 0
    for k, (spec, _, an) in enumerate(ground_truth):
        other = ground_truth[(k + 7) % n][0]
        got = P.score_analysis(other, an)
        truth = P.compare(other, [o.triple for o in spec.objects], spec.background)
        scores.append(got)
        chance.append(truth)
        for pg, pt in zip(got["objects"], truth["objects"]):
            for a in P.ATTRIBUTES:
                agree += pg[a] == pt[a]
                total += 1
    assert agree / total >= 0.95
    acc = _accuracy(scores)
    ref = _accuracy([{**c, "temporal": s["temporal"], "cleanliness": 0.0, "quality": 0.0,
                      "aggregate": 0.0} for c, s in zip(chance, scores)])
    for attr in ("colour", "shape", "motion", "background", "count"):
        assert abs(acc[attr] - ref[attr]) <= 0.05, (attr, acc[attr], ref[attr])
    # chance is well below the ground-truth level, so the check above means something
    assert ref["colour"] < 0.4 and ref["motion"] < 0.4 and ref["shape"] < 0.6
    assert acc["all_correct"] < 0.1


@pytest.mark.parametrize("smooth", [0.0, 4.0])
def test_noise_scores_no_better_than_chance(smooth):
    rng = np.random.default_rng(3)
    specs = [S.spec_at(202, k) for k in range(N_NOISE)]
    scores = [P.score_clip(spec, P.noise_clip(rng, (33, 128, 128, 3), smooth=smooth)) for spec in specs]
    acc = _accuracy(scores)
    chance = {"colour": 1 / len(S.COLOURS), "shape": 1 / len(S.SHAPES), "motion": 1 / len(S.MOTIONS)}
    for attr, c in chance.items():
        assert acc[attr] <= c + 0.05, (attr, acc[attr])
    assert acc["all_correct"] == 0.0
    assert acc["cleanliness"] < 0.5


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mild", "blur2", "noise16", "shift", "fade", "down2", "down4"])
def test_degraded_ground_truth_is_still_scored_correct(kind):
    rng = np.random.default_rng(4)
    specs = [S.spec_at(303, k) for k in range(N_DEGRADED)]
    scores = [P.score_clip(spec, P.degrade(S.render(spec), kind, rng)) for spec in specs]
    acc = _accuracy(scores)
    for attr in ("colour", "shape", "motion", "background"):
        assert acc[attr] >= 0.9, (kind, attr, acc[attr])


def test_mp4_round_trip_is_still_scored_correct():
    specs = [S.spec_at(404, k) for k in range(6)]
    scores = [P.score_clip(spec, P._mp4_round_trip(S.render(spec))) for spec in specs]
    assert _accuracy(scores)["all_correct"] == 1.0


def test_each_attribute_is_checked_independently():
    spec = S.parse_caption("a red circle moves left and a yellow square grows on a blue background")
    an = P.analyze_clip(S.render(spec))
    good = P.score_analysis(spec, an)
    assert good["all_correct"]
    wrong = {
        "colour": "a green circle moves left and a yellow square grows on a blue background",
        "shape": "a red triangle moves left and a yellow square grows on a blue background",
        "motion": "a red circle moves up and a yellow square grows on a blue background",
        "background": "a red circle moves left and a yellow square grows on a black background",
    }
    for attr, caption in wrong.items():
        s = P.score_analysis(caption, an)
        assert not s["all_correct"], attr
        if attr == "background":
            assert not s["background"] and s["colour"] == s["shape"] == s["motion"] == 1.0
        else:
            assert s[attr] == 0.5, (attr, s[attr])      # one of the two objects is wrong
            others = [a for a in P.ATTRIBUTES if a != attr]
            assert all(s[a] == 1.0 for a in others), s
    # order of the objects in the caption does not matter
    swapped_order = "a yellow square grows and a red circle moves left on a blue background"
    assert P.score_analysis(swapped_order, an)["all_correct"]
    # an object that is not there
    missing = P.score_analysis("a red circle moves left and a yellow square grows and a white "
                               "triangle moves down on a blue background", an)
    assert missing["objects"][2]["detected"] is None and not missing["all_correct"]
    assert not missing["count"]
    # an extra object: what is stated is there, but the clip is not entirely right
    extra = P.score_analysis("a red circle moves left on a blue background", an)
    assert extra["colour"] == extra["shape"] == extra["motion"] == 1.0
    assert not extra["count"] and not extra["all_correct"]


def _frames_of(spec: S.ClipSpec) -> np.ndarray:
    return S.render(spec)


def test_still_objects_fail_the_motion_check():
    obj = S.ObjectSpec("orange", "triangle", "right", start=(0.5, 0.5), extent=0.25, amount=0.0)
    s = P.score_clip(S.ClipSpec((obj,), "gray"), _frames_of(S.ClipSpec((obj,), "gray")))
    assert s["colour"] == 1.0 and s["shape"] == 1.0
    assert s["motion"] == 0.0 and s["objects"][0]["detected"]["motion"] == "still"


def test_temporal_metrics_flag_unsteady_clips():
    spec = S.ClipSpec((S.ObjectSpec("white", "square", "right", start=(0.3, 0.5), extent=0.25,
                                    amount=0.4),), "black")
    clip = S.render(spec)
    base = P.score_clip(spec, clip)
    rng = np.random.default_rng(0)
    # jittery path: every frame shifted by a few pixels
    jitter = np.stack([np.roll(f, tuple(rng.integers(-4, 5, size=2)), axis=(0, 1)) for f in clip])
    s = P.score_clip(spec, jitter)
    assert s["temporal"]["path_smoothness"] < base["temporal"]["path_smoothness"] - 0.3
    # pulsing size: alternate frames from a larger object
    big = S.render(S.ClipSpec((S.ObjectSpec("white", "square", "right", start=(0.3, 0.5),
                                            extent=0.33, amount=0.4),), "black"))
    pulse = clip.copy()
    pulse[1::2] = big[1::2]
    s = P.score_clip(spec, pulse)
    assert s["temporal"]["size_stability"] < base["temporal"]["size_stability"] - 0.3
    # object missing from most frames
    gone = clip.copy()
    gone[5:25] = np.array(S.BACKGROUND_COLOURS["black"], dtype=np.uint8)
    s = P.score_clip(spec, gone)
    assert s["temporal"]["presence"] < 0.7
    # brightness flicker of the whole frame
    flick = np.clip(clip.astype(np.float32) * rng.uniform(0.7, 1.3, size=(33, 1, 1, 1)) + 20, 0, 255)
    s = P.score_clip(spec, flick.astype(np.uint8))
    assert s["temporal"]["flicker_score"] < base["temporal"]["flicker_score"] - 0.5
    # stray blobs make a clip less clean
    dirty = clip.copy()
    for k in range(33):
        y, x = rng.integers(0, 110, size=2)
        dirty[k, y:y + 10, x:x + 10] = (200, 40, 200)
    s = P.score_clip(spec, dirty)
    assert s["cleanliness"] < base["cleanliness"] - 0.1
    assert base["quality"] > max(P.score_clip(spec, c)["quality"] for c in (jitter, gone, flick.astype(np.uint8)))


def test_larger_and_non_square_clips():
    spec = S.spec_at(505, 1)
    for size in (256, (144, 256)):
        assert P.score_clip(spec, S.render(spec, 33, size))["all_correct"], size
    assert P.score_clip(spec, S.render(spec, 17, 128))["all_correct"]


def test_bad_input_is_reported_clearly():
    clip = S.render(S.spec_at(0, 0))
    caption = S.spec_at(0, 0).caption
    with pytest.raises(TypeError, match="uint8"):
        P.score_clip(caption, clip.astype(np.float32))
    with pytest.raises(ValueError, match=r"\(T, H, W, 3\)"):
        P.score_clip(caption, clip[..., 0])
    with pytest.raises(ValueError, match="T >= 4"):
        P.score_clip(caption, clip[:2])
    with pytest.raises(TypeError, match="numpy array"):
        P.score_clip(caption, clip.tolist())
    with pytest.raises(ValueError, match="expected '<object>"):
        P.score_clip("a cat sits on a mat", clip)
    with pytest.raises(ValueError, match="unknown degradation"):
        P.degrade(clip, "sepia", np.random.default_rng(0))
    with pytest.raises(ValueError, match="2 captions but 1 clips"):
        P.score_many([caption, caption], [clip])


def test_score_many_summarises_per_attribute():
    specs = [S.spec_at(606, k) for k in range(4)]
    clips = [S.render(s) for s in specs]
    clips[3] = P.noise_clip(np.random.default_rng(1), clips[3].shape)
    out = P.score_many([s.caption for s in specs], clips)
    assert len(out["clips"]) == 4
    expected_all = np.mean([c["all_correct"] for c in out["clips"]])
    assert out["summary"]["all_correct"] == pytest.approx(expected_all)
    assert 0.5 <= out["summary"]["all_correct"] <= 0.75
    n_obj = sum(len(s.objects) for s in specs)
    assert out["summary"]["objects"] == n_obj
    assert out["summary"]["colour"] == pytest.approx(
        sum(len(s.objects) for s in specs[:3]) / n_obj)


def test_score_command_reads_generate_folders_and_lists(tmp_path, capsys):
    from attnqat.cli import main
    from attnqat.video import write_mp4

    spec = S.spec_at(707, 2)
    folder = tmp_path / "run1"
    folder.mkdir()
    write_mp4(S.render(spec), folder / "bf16.mp4", S.FPS)
    write_mp4(P.noise_clip(np.random.default_rng(0), (33, 128, 128, 3)), folder / "nvfp4.mp4", S.FPS)
    record = {"prompt": spec.caption, "negative_prompt": "", "seed": 0, "settings": {},
              "versions": {}, "methods": {"bf16": {"video": "bf16.mp4"},
                                          "nvfp4": {"video": "nvfp4.mp4"}},
              "side_by_side": "side_by_side.mp4"}
    (folder / "record.json").write_text(json.dumps(record))
    out_json = tmp_path / "scores.json"
    assert main(["eval", "score", str(folder), "--json", str(out_json)]) == 0
    result = json.loads(out_json.read_text())
    assert result["by_method"]["bf16"]["all_correct"] == 1.0
    assert result["by_method"]["nvfp4"]["all_correct"] == 0.0
    assert "bf16:" in capsys.readouterr().out
    # --list, the format `attnqat finetune data` writes
    (tmp_path / "list.json").write_text(json.dumps([{"video": "run1/bf16.mp4", "caption": spec.caption}]))
    assert main(["eval", "score", "--list", str(tmp_path / "list.json"), "--json", str(out_json)]) == 0
    assert json.loads(out_json.read_text())["summary"]["all_correct"] == 1.0
    # a folder without a record is an error that says so
    with pytest.raises(SystemExit, match="record.json"):
        main(["eval", "score", str(tmp_path)])


def test_validate_prints_the_table(capsys):
    result = P.validate(n=4, seed=9, degradations=("blur1",))
    table = P.format_table(result)
    for row in ("ground_truth", "blur1", "noise", "smooth_noise", "swapped", "chance"):
        assert row in result["table"] and row in table
    assert result["table"]["ground_truth"]["colour"] == 1.0
    assert result["table"]["noise"]["all_correct"] == 0.0


def test_matching_is_one_to_one_and_independent_of_detection_order():
    stated = [("red", "circle", "left"), ("blue", "square", "up")]
    detected = [("blue", "square", "up"), ("green", "triangle", "down"), ("red", "circle", "left")]
    assert P.match_objects(stated, detected) == [2, 0]
    assert P.match_objects(stated, detected[::-1]) == [0, 2]
    # a tie is resolved by the detected triples, not by their order
    one = [("red", "circle", "left")]
    ties = [("blue", "circle", "up"), ("green", "circle", "up")]
    assert ties[P.match_objects(one, ties)[0]] == ties[::-1][P.match_objects(one, ties[::-1])[0]]
    # never two stated objects on one detected object
    assert P.match_objects(stated, [("red", "circle", "left")]) == [0, None]
    assert P.match_objects(stated, []) == [None, None]
