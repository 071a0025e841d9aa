"""Study inputs (generation records, CSV manifests, prompt lists) and the study builder."""

from __future__ import annotations

import csv
import json
import re
import sqlite3

import imageio.v3 as iio
import pytest

from attnqat.cli import main as cli_main
from attnqat.eval import media, sources
from attnqat.eval.demo import write_demo_outputs
from attnqat.eval.sources import InputError
from attnqat.eval.study import StudyConfig, build_study, parse_pairs, plan_items

METHODS = ("bf16", "attnqat", "nvfp4")


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    root = tmp_path_factory.mktemp("generated")
    prompts = sources.read_prompts()[:10]
    write_demo_outputs(root / "runs", prompts, methods=METHODS)
    return root / "runs", prompts


# ---------------------------------------------------------------------------- inputs

def test_records_are_found_recursively(generated):
    runs, prompts = generated
    clips = sources.load_sources([runs])
    assert len(clips) == len(prompts) * len(METHODS)
    assert sources.methods_of(clips) == list(METHODS)
    assert {c.prompt for c in clips} == set(prompts)
    assert all(c.path.is_file() for c in clips)
    first = json.loads((runs / "prompt_000" / "record.json").read_text())
    assert {(c.prompt, c.seed) for c in clips if c.path.parent.name == "prompt_000"} == {
        (first["prompt"], first["seed"])}


def test_csv_manifest_with_relative_paths(generated, tmp_path):
    runs, _ = generated
    manifest = tmp_path / "clips.csv"
    with open(manifest, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["prompt", "seed", "method", "path"])
        w.writerow(["a cat", "1", "ref", str(runs / "prompt_000" / "bf16.mp4")])
        (tmp_path / "x").mkdir()
        (tmp_path / "x" / "c.mp4").write_bytes((runs / "prompt_000" / "nvfp4.mp4").read_bytes())
        w.writerow(["a cat", "1", "fast", "x/c.mp4"])
    clips = sources.load_sources([manifest])
    assert [(c.method, c.seed) for c in clips] == [("ref", 1), ("fast", 1)]
    assert clips[1].path == tmp_path / "x" / "c.mp4"


def test_input_errors_are_clear(generated, tmp_path):
    runs, _ = generated
    with pytest.raises(InputError, match="not a folder"):
        sources.load_sources([tmp_path / "nope"])
    with pytest.raises(InputError, match="no record.json"):
        sources.load_sources([tmp_path])
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt,method\nx,y\n")
    with pytest.raises(InputError, match="missing column"):
        sources.load_sources([bad])
    missing = tmp_path / "missing.csv"
    missing.write_text("prompt,seed,method,path\nx,1,bf16,gone.mp4\n")
    with pytest.raises(InputError, match="1 clip file\\(s\\) not found"):
        sources.load_sources([missing])
    with pytest.raises(InputError, match="duplicate clip"):
        sources.load_sources([runs, runs])
    with pytest.raises(InputError, match="no inputs"):
        sources.load_sources([])


def test_pairs_default_to_reference_and_reject_unknown_methods():
    assert parse_pairs(None, METHODS, "bf16") == [("attnqat", "bf16"), ("nvfp4", "bf16")]
    assert parse_pairs("nvfp4:attnqat", METHODS, "bf16") == [("nvfp4", "attnqat")]
    with pytest.raises(InputError, match="unknown method\\(s\\) sage3; the inputs have bf16"):
        parse_pairs("sage3:bf16", METHODS, "bf16")
    with pytest.raises(InputError, match="reference method"):
        parse_pairs(None, METHODS, "fp8")
    with pytest.raises(InputError, match="bad pair"):
        parse_pairs("attnqat-bf16", METHODS, "bf16")


# ---------------------------------------------------------------------------- prompts

def test_project_prompt_list_and_reproducible_sampler(tmp_path):
    prompts = sources.read_prompts()
    assert len(prompts) >= 60 and len(set(prompts)) == len(prompts)
    a = sources.sample_prompts(prompts, 20, seed=4)
    assert a == sources.sample_prompts(prompts, 20, seed=4)
    assert a != sources.sample_prompts(prompts, 20, seed=5)
    assert len(set(a)) == 20 and set(a) <= set(prompts)
    with pytest.raises(InputError, match="cannot sample"):
        sources.sample_prompts(prompts, len(prompts) + 1)
    user_list = tmp_path / "all_dimension.txt"
    user_list.write_text("one\n\ntwo\none\nthree\n")
    assert sources.read_prompts(user_list) == ["one", "two", "three"]


def test_cli_writes_a_sampled_prompt_file_that_fits_the_model(tmp_path, capsys):
    """The embedded tiny model (the default) gets held-out synthetic captions it can draw; a real
    Wan model the natural-language list; --prompt-file wins."""
    from attnqat.prompts import model_prompts, natural_prompts
    from attnqat.synthetic import heldout_prompts, parse_caption

    out = tmp_path / "p.txt"
    assert cli_main(["eval", "build", "--sample", "7", "--seed", "3", "--write-prompts", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines == sources.sample_prompts(heldout_prompts(300)[100:], 7, seed=3)
    assert all(parse_caption(p) for p in lines) and "held-out synthetic" in capsys.readouterr().out
    assert model_prompts("Wan-AI/Wan2.1-T2V-1.3B-Diffusers") == natural_prompts()   # a hub id: kind wan
    assert cli_main(["eval", "build", "--sample", "7", "--seed", "3", "--write-prompts", str(out),
                     "--model", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"]) == 0
    assert out.read_text().splitlines() == sources.sample_prompts(sources.read_prompts(), 7, seed=3)
    assert cli_main(["eval", "build", "--sample", "7", "--write-prompts", str(out), "--model",
                     str(tmp_path / "nothing")]) == 2
    assert "model folder not found" in capsys.readouterr().err


# ---------------------------------------------------------------------------- planning and building

def test_plan_sets_prompts_aside_for_checks_and_practice(generated):
    runs, prompts = generated
    clips = sources.load_sources([runs])
    config = StudyConfig(name="s", pairs=[("attnqat", "bf16"), ("nvfp4", "bf16")], seed=1)
    plan = plan_items(clips, config)
    kinds = [p.kind for p in plan]
    n_checks = kinds.count("check_identical") + kinds.count("check_degraded")
    n_main = kinds.count("main")
    assert kinds.count("practice") == 2
    # Checks and practice never show a study prompt, and each has its own prompt.
    held = [p.a.prompt for p in plan if p.kind != "main"]
    main_prompts = {p.a.prompt for p in plan if p.kind == "main"}
    assert len(set(held)) == len(held) == n_checks + 2
    assert not set(held) & main_prompts
    assert n_main == 2 * (len(prompts) - len(held))
    assert n_checks == max(2, round(0.1 * n_main))
    for p in plan:
        if p.kind == "check_identical":
            assert p.a == p.b and p.expected == "tie" and not (p.degrade_a or p.degrade_b)
        if p.kind == "check_degraded":
            assert p.a == p.b and p.degrade_a != p.degrade_b
            assert p.expected == ("b" if p.degrade_a else "a")
        if p.kind == "main":
            assert (p.a.method, p.b.method) in config.pairs and p.a.group == p.b.group
    assert plan == plan_items(clips, config)  # reproducible from the seed
    with pytest.raises(InputError, match="empty study"):
        plan_items([c for c in clips if c.method != "bf16"], config)
    few = [c for c in clips if c.prompt in prompts[:4]]
    with pytest.raises(InputError, match="need 4 of their own"):
        plan_items(few, config)
    # Without checks and practice every prompt is a study prompt.
    bare = StudyConfig(name="s", pairs=[("attnqat", "bf16")], check_fraction=0, practice_items=0)
    assert [p.kind for p in plan_items(few, bare)] == ["main"] * 4


def test_plan_with_separate_check_inputs(generated, tmp_path):
    runs, prompts = generated
    clips = sources.load_sources([runs])
    study = [c for c in clips if c.prompt in prompts[:6]]
    spare = [c for c in clips if c.prompt in prompts[6:]]
    config = StudyConfig(name="s", pairs=[("attnqat", "bf16")], seed=3)
    plan = plan_items(study, config, check_clips=spare)
    assert {p.a.prompt for p in plan if p.kind == "main"} == set(prompts[:6])
    assert {p.a.prompt for p in plan if p.kind != "main"} <= set(prompts[6:])
    with pytest.raises(InputError, match="prompt\\(s\\) of the study"):
        plan_items(study, config, check_clips=clips)
    with pytest.raises(InputError, match="need one prompt each"):
        plan_items(study, config, check_clips=[c for c in spare if c.prompt == prompts[6]])


def test_build_study_serves_one_uniform_side_by_side_video_per_item_and_order(generated, tmp_path):
    runs, prompts = generated
    clips = sources.load_sources([runs])
    config = StudyConfig(name="pilot attnqat-vs-bf16", pairs=[("attnqat", "bf16")], seed=2,
                         ratings_per_item=2)
    out = tmp_path / "study"
    result = build_study(clips, out, config, n_raters=3, progress=False)
    files = sorted((out / "media").iterdir())
    assert all(re.fullmatch(r"[0-9a-f]{32}\.mp4", f.name) for f in files)
    n_items = sum(result.counts.values())
    assert len(files) == result.n_videos == 2 * n_items  # A|B and B|A, each its own encode
    # One byte size, one container layout (ftyp, moov with its sample table): only the coded
    # picture data differs, and no two files are the same bytes, except the two orders of an
    # identical check (A|A swapped is the same picture; a rater sees only one of them).
    assert {f.stat().st_size for f in files} == {result.video_size}
    assert len({media.container_layout(f) for f in files}) == 1
    assert len({f.read_bytes() for f in files}) == len(files) - result.counts["check_identical"]
    w, h = result.settings.pair_size
    assert iio.imread(files[0]).shape == (result.settings.frames, h, w, 3)
    db = sqlite3.connect(out / "study.db")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tokens = {t for (t,) in db.execute("SELECT token FROM videos")}
    assert tokens == {f.stem for f in files}
    orders = db.execute("SELECT item_id, SUM(a_on_left), COUNT(*), MIN(duration_s) FROM videos "
                        "GROUP BY item_id").fetchall()
    assert len(orders) == n_items
    assert all((left, n, d) == (1, 2, pytest.approx(17 / 8)) for _, left, n, d in orders)
    rows = db.execute("SELECT i.kind, i.method_a, i.method_b, ca.method, cb.method, ca.degraded, "
                      "cb.degraded, i.target_ratings FROM items i JOIN clips ca ON ca.id = "
                      "i.clip_a_id JOIN clips cb ON cb.id = i.clip_b_id").fetchall()
    for kind, ma, mb, ca, cb, da, dbg, target in rows:
        assert (ma, mb) == (ca, cb)  # the clip behind each side is the item's method
        assert target == (2 if kind == "main" else 0)
        assert (da or dbg) == (kind == "check_degraded") or kind == "practice"
    # Clip tokens are records, never served names.
    assert not {t for (t,) in db.execute("SELECT token FROM clips")} & tokens
    assert db.execute("SELECT COUNT(*) FROM raters").fetchone()[0] == 3
    saved = json.loads((out / "study.json").read_text())
    assert saved["equivalence_margin"] == 0.1 and saved["pairs"] == [["attnqat", "bf16"]]
    assert saved["encode"]["frames"] == 17 and saved["test"] == "equivalence"
    invites = list(csv.DictReader(open(out / "invites.csv")))
    assert [i["link"] for i in invites] == [f"/r/{i['token']}" for i in invites]
    with pytest.raises(InputError, match="not empty"):
        build_study(clips, out, config, progress=False)


def test_cli_build_and_its_errors(generated, tmp_path, capsys):
    runs, _ = generated
    out = tmp_path / "s"
    code = cli_main(["eval", "build", str(runs), "--out", str(out), "--pairs", "nvfp4:bf16",
                     "--sample", "6", "--raters", "2", "--quiet"])
    assert code == 0
    db = sqlite3.connect(out / "study.db")
    # 6 prompts: 2 checks and 2 practice items take one each, 2 are the study.
    assert db.execute("SELECT COUNT(DISTINCT prompt) FROM items WHERE kind='main'").fetchone()[0] == 2
    printed = capsys.readouterr().out
    assert "2 rater invites" in printed and "side-by-side videos (192x64, 17 frames" in printed
    assert cli_main(["eval", "build", str(runs), "--out", str(tmp_path / "few"), "--sample",
                     "3", "--quiet"]) == 2
    assert "need 4 of their own" in capsys.readouterr().err
    assert not (tmp_path / "few").exists()
    assert cli_main(["eval", "build", str(runs), "--out", str(tmp_path / "t"), "--pairs",
                     "sage3:bf16", "--quiet"]) == 2
    assert "unknown method(s) sage3" in capsys.readouterr().err
    assert cli_main(["eval", "build", str(tmp_path / "none"), "--out", str(tmp_path / "u")]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert cli_main(["eval", "build", str(runs)]) == 2
    assert "--out" in capsys.readouterr().err
    assert cli_main(["eval", "build", str(runs), "--out", str(tmp_path / "q"), "--qp", "60"]) == 2
    assert "--qp must be in 0" in capsys.readouterr().err
    assert cli_main(["eval", "build", str(runs), "--out", str(tmp_path / "q"), "--min-view",
                     "-1"]) == 2
    assert "--min-view must be 0" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()
    assert cli_main(["eval", "serve", "--study", str(out), "--load-timeout", "0"]) == 2
    assert "--load-timeout must be positive" in capsys.readouterr().err
    assert cli_main(["eval", "serve", "--study", str(tmp_path)]) == 2
    assert "no media/ folder" in capsys.readouterr().err


def test_every_build_option_has_help():
    import argparse

    from attnqat.eval import build, importer, plan, report, serve

    for module in (build, report, serve, plan, importer):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        for action in parser._actions:
            if action.dest != "help":
                assert action.help, f"{module.__name__}: --{action.dest} has no help"


def test_failed_build_leaves_no_half_study(generated, tmp_path):
    runs, _ = generated
    clips = sources.load_sources([runs])
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"not a video")
    bad = [c if c.method != "nvfp4" or c.prompt != clips[0].prompt else
           sources.ClipSource(c.prompt, c.seed, c.method, broken) for c in clips]
    out = tmp_path / "study"
    config = StudyConfig(name="s", pairs=[("nvfp4", "bf16")], check_fraction=0, practice_items=0,
                         encode={"width": 64, "height": 64, "fps": 8.0, "frames": 17})
    from attnqat.eval.media import MediaError
    # Every source is probed first (for the length warnings), so the broken clip is named there.
    with pytest.raises(MediaError, match=f"cannot read clip {broken}"):
        build_study(bad, out, config, progress=False)
    assert not out.exists()


def test_study_in_another_database_url(generated, tmp_path):
    runs, _ = generated
    db = tmp_path / "elsewhere" / "all-studies.db"
    db.parent.mkdir()
    url = f"sqlite:///{db}"
    assert cli_main(["eval", "build", str(runs), "--out", str(tmp_path / "s1"), "--db", url,
                     "--name", "first", "--sample", "5", "--quiet"]) == 0
    assert cli_main(["eval", "build", str(runs), "--out", str(tmp_path / "s2"), "--db", url,
                     "--name", "second", "--sample", "6", "--quiet"]) == 0
    assert not (tmp_path / "s1" / "study.db").exists()
    names = [n for (n,) in sqlite3.connect(db).execute("SELECT name FROM studies ORDER BY id")]
    assert names == ["first", "second"]
    # Same name twice in one database is refused, and leaves nothing behind.
    assert cli_main(["eval", "build", str(runs), "--out", str(tmp_path / "s3"), "--db", url,
                     "--name", "first", "--quiet"]) == 2
    assert not (tmp_path / "s3").exists()
    # The report needs --name when a database holds several studies.
    assert cli_main(["eval", "report", "--db", url, "--out", str(tmp_path / "r")]) == 2
    assert cli_main(["eval", "report", "--db", url, "--name", "second", "--n-boot", "50",
                     "--out", str(tmp_path / "r")]) == 0
    assert json.loads((tmp_path / "r" / "results.json").read_text())["study"] == "second"


# ---------------------------------------------------------------------------- round 3 (#35)

def test_symlinked_folders_are_followed(generated, tmp_path):
    runs, prompts = generated
    linked = tmp_path / "linked"
    (linked / "batch").mkdir(parents=True)
    for folder in sorted(runs.iterdir())[:3]:
        (linked / "batch" / folder.name).symlink_to(folder, target_is_directory=True)
    (linked / "loop").symlink_to(linked, target_is_directory=True)  # a cycle ends
    (tmp_path / "top").symlink_to(linked, target_is_directory=True)
    clips = sources.load_sources([tmp_path / "top"])
    assert len(clips) == 3 * len(METHODS)


def test_clips_cut_or_held_to_the_study_length_are_warned(tmp_path, capsys):
    runs = tmp_path / "runs"
    prompts = sources.read_prompts()[:6]
    write_demo_outputs(runs / "short", prompts[:5], methods=("bf16", "attnqat"), n_frames=9)
    write_demo_outputs(runs / "long", prompts[5:], methods=("bf16", "attnqat"), n_frames=17)
    assert cli_main(["eval", "build", str(runs), "--out", str(tmp_path / "s"), "--quiet",
                     "--check-fraction", "0", "--practice", "0"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"warning: 2 clip\(s\) are longer than the study's 9 frames and are cut to "
                     r"them \(e\.g\. .*: 17 frames\)", out), out


def test_probing_a_clip_stops_ffmpeg_cleanly(generated, caplog, monkeypatch):
    """The build probes every source. Closing imageio-ffmpeg's frame reader after the first
    frame kills ffmpeg when it does not stop in time (a loaded machine, large clips) and logs
    "We had to kill ffmpeg to stop it." into the build output: the probe reads the header
    without a frame reader, so nothing is left to kill."""
    runs, _ = generated
    import logging

    import imageio_ffmpeg

    def no_reader(*_args, **_kwargs):
        raise AssertionError("probe started a frame reader")

    monkeypatch.setattr(imageio_ffmpeg, "read_frames", no_reader)
    caplog.set_level(logging.WARNING)
    for path in sorted(runs.rglob("*.mp4")):
        info = media.probe(path)
        assert (info.width, info.height, info.fps) == (64, 64, 8.0)
    assert not [r for r in caplog.records if "kill" in r.getMessage()]
