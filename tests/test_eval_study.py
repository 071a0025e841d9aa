"""Study inputs (generation records, CSV manifests, prompt lists) and the study builder."""

from __future__ import annotations

import csv
import json
import re
import sqlite3

import pytest

from attnqat.cli import main as cli_main
from attnqat.eval import sources
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


def test_cli_writes_a_sampled_prompt_file(tmp_path, capsys):
    out = tmp_path / "p.txt"
    assert cli_main(["eval", "build", "--sample", "7", "--seed", "3", "--write-prompts", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines == sources.sample_prompts(sources.read_prompts(), 7, seed=3)


# ---------------------------------------------------------------------------- planning and building

def test_plan_has_main_check_and_practice_items(generated):
    runs, prompts = generated
    clips = sources.load_sources([runs])
    config = StudyConfig(name="s", pairs=[("attnqat", "bf16"), ("nvfp4", "bf16")], seed=1)
    plan = plan_items(clips, config)
    kinds = [p.kind for p in plan]
    n_main = kinds.count("main")
    assert n_main == len(prompts) * 2
    assert kinds.count("check_identical") + kinds.count("check_degraded") == max(2, round(0.1 * n_main))
    assert kinds.count("practice") == 2
    for p in plan:
        if p.kind == "check_identical":
            assert p.a == p.b and p.expected == "tie"
        if p.kind == "check_degraded":
            assert p.a == p.b and p.degrade_a != p.degrade_b
            assert p.expected == ("b" if p.degrade_a else "a")
        if p.kind == "main":
            assert (p.a.method, p.b.method) in config.pairs and p.a.group == p.b.group
    assert plan == plan_items(clips, config)  # reproducible from the seed
    with pytest.raises(InputError, match="empty study"):
        plan_items([c for c in clips if c.method != "bf16"], config)


def test_build_study_writes_opaque_uniform_media_and_records(generated, tmp_path):
    runs, prompts = generated
    clips = sources.load_sources([runs])
    config = StudyConfig(name="pilot attnqat-vs-bf16", pairs=[("attnqat", "bf16")], seed=2,
                         ratings_per_item=2)
    out = tmp_path / "study"
    result = build_study(clips, out, config, n_raters=3, progress=False)
    files = sorted((out / "media").iterdir())
    assert all(re.fullmatch(r"[0-9a-f]{32}\.mp4", f.name) for f in files)
    assert len({f.stat().st_size for f in files}) == 1
    assert len(files) == result.n_clips == 2 * sum(result.counts.values())
    assert result.counts["main"] == len(prompts)
    db = sqlite3.connect(out / "study.db")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tokens = {t for (t,) in db.execute("SELECT token FROM clips")}
    assert tokens == {f.stem for f in files}
    rows = db.execute("SELECT i.kind, i.method_a, i.method_b, ca.method, cb.method, ca.degraded, "
                      "cb.degraded, i.target_ratings FROM items i JOIN clips ca ON ca.id = "
                      "i.clip_a_id JOIN clips cb ON cb.id = i.clip_b_id").fetchall()
    for kind, ma, mb, ca, cb, da, dbg, target in rows:
        assert (ma, mb) == (ca, cb)  # the clip behind each side is the item's method
        assert target == (2 if kind == "main" else 0)
        assert (da or dbg) == (kind == "check_degraded") or kind == "practice"
    # Each item side has its own file: no URL is shared between two comparisons.
    assert db.execute("SELECT COUNT(*) FROM clips").fetchone()[0] == 2 * len(rows)
    assert db.execute("SELECT COUNT(*) FROM raters").fetchone()[0] == 3
    saved = json.loads((out / "study.json").read_text())
    assert saved["equivalence_margin"] == 0.1 and saved["pairs"] == [["attnqat", "bf16"]]
    invites = list(csv.DictReader(open(out / "invites.csv")))
    assert [i["link"] for i in invites] == [f"/r/{i['token']}" for i in invites]
    with pytest.raises(InputError, match="not empty"):
        build_study(clips, out, config, progress=False)


def test_cli_build_and_its_errors(generated, tmp_path, capsys):
    runs, _ = generated
    out = tmp_path / "s"
    code = cli_main(["eval", "build", str(runs), "--out", str(out), "--pairs", "nvfp4:bf16",
                     "--sample", "4", "--raters", "2", "--quiet"])
    assert code == 0
    db = sqlite3.connect(out / "study.db")
    assert db.execute("SELECT COUNT(DISTINCT prompt) FROM items WHERE kind='main'").fetchone()[0] == 4
    assert "2 rater invites" in capsys.readouterr().out
    assert cli_main(["eval", "build", str(runs), "--out", str(tmp_path / "t"), "--pairs",
                     "sage3:bf16", "--quiet"]) == 2
    assert "unknown method(s) sage3" in capsys.readouterr().err
    assert cli_main(["eval", "build", str(tmp_path / "none"), "--out", str(tmp_path / "u")]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert cli_main(["eval", "build", str(runs)]) == 2
    assert "--out" in capsys.readouterr().err


def test_every_build_option_has_help():
    import argparse

    from attnqat.eval import build, report, serve

    for module in (build, report, serve):
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
    config = StudyConfig(name="s", pairs=[("nvfp4", "bf16")], encode={"width": 64, "height": 64,
                                                                      "fps": 8.0})
    from attnqat.eval.media import MediaError
    with pytest.raises(MediaError, match="ffmpeg failed"):
        build_study(bad, out, config, progress=False)
    assert not out.exists()


def test_study_in_another_database_url(generated, tmp_path):
    runs, _ = generated
    db = tmp_path / "elsewhere" / "all-studies.db"
    db.parent.mkdir()
    url = f"sqlite:///{db}"
    assert cli_main(["eval", "build", str(runs), "--out", str(tmp_path / "s1"), "--db", url,
                     "--name", "first", "--sample", "2", "--quiet"]) == 0
    assert cli_main(["eval", "build", str(runs), "--out", str(tmp_path / "s2"), "--db", url,
                     "--name", "second", "--sample", "3", "--quiet"]) == 0
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
