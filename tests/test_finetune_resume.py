"""Resuming a fine-tuning run (attnqat/finetune/train.py, checkpoint.py): from any working
directory, from any checkpoint, with the changes it allows recorded. The runs use the default data
workers (2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnqat.finetune import checkpoint as ckpt
from attnqat.finetune import train as T
from finetune_data import losses, small_model, write_clips

#: the default --workers (2), unlike most trainer tests
FLAGS = ["--device", "cpu", "--no-tensorboard", "--no-progress"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return small_model(tmp_path_factory.mktemp("resume") / "small-wan")


def train(model: Path, *args: str) -> int:
    return T.main(["--model", str(model), *FLAGS, *args])


@pytest.mark.slow   # 5-7 s on the 2-core machine (docs/development.md, Tests)
def test_resume_from_another_folder_with_paths_written_either_way(model, tmp_path, monkeypatch):
    write_clips(tmp_path / "clips", 4)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    assert train(model, "--out", "run", "--data", "clips", "--steps", "2", "--batch-size", "1") == 0
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["data"] == str(tmp_path / "clips") and cfg["out"] == str(tmp_path / "run")
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert train(model, "--out", str(tmp_path / "run"), "--resume", "--steps", "3") == 0
    assert train(model, "--out", str(tmp_path / "run"), "--resume", "--data", str(tmp_path / "clips"),
                 "--steps", "4") == 0
    monkeypatch.chdir(tmp_path / "clips")
    assert train(model, "--out", "../run", "--resume", "--data", ".", "--steps", "5") == 0
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3, 4, 5]


def test_resuming_an_older_checkpoint_sets_the_later_ones_aside(model, tmp_path):
    """Resumed from step 2 of a run that reached step 6, the checkpoints of steps 4 and 6 belong to
    an abandoned branch: neither the next plain --resume nor export may pick them, and TensorBoard
    drops that branch's scalars."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from attnqat.finetune.export import export

    run = tmp_path / "run"
    common = ["--out", str(run), "--batch-size", "1", "--checkpoint-every", "2", "--tensorboard"]
    assert train(model, *common, "--steps", "6") == 0
    first = losses(run)
    assert train(model, *common, "--resume", str(ckpt.checkpoint_dir(run, 2)), "--steps", "4",
                 "--lr", "1e-3") == 0
    assert [s for s, _ in ckpt.complete_checkpoints(run)] == [2, 4]
    assert sorted(p.name for p in (run / ckpt.ABANDONED).iterdir()) == ["step-0000004", "step-0000006"]
    resume = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()
              if '"resume"' in x][-1]
    assert resume["abandoned_checkpoints"] == ["step-0000004", "step-0000006"]
    assert ckpt.resolve(run, run) == ckpt.checkpoint_dir(run, 4)
    side = json.loads((export(run, tmp_path / "exported") / "attnqat.json").read_text())
    assert side["training"]["steps"] == 4
    assert side["training"]["checkpoint"] == str(ckpt.checkpoint_dir(run, 4))
    now = losses(run)
    assert sorted(now) == [1, 2, 3, 4] and now[4] != first[4]   # the new lr changed step 3's update
    tb = EventAccumulator(str(run / "tb"))
    tb.Reload()
    scalars = tb.Scalars("train/loss")
    assert [e.step for e in scalars] == [1, 2, 3, 4]
    assert [e.value for e in scalars] == pytest.approx([now[s] for s in (1, 2, 3, 4)])


def test_data_that_changed_under_a_run_is_refused_on_resume(model, tmp_path, capsys, monkeypatch):
    from attnqat.finetune import encode

    data = tmp_path / "clips"
    write_clips(data, 3)
    run = ["--out", str(tmp_path / "run"), "--data", str(data), "--batch-size", "1"]
    assert train(model, *run, "--steps", "2") == 0
    assert len(json.loads((tmp_path / "run" / "config.json").read_text())["data_fingerprint"]) == 64
    write_clips(tmp_path / "more", 4)
    for ext in (".mp4", ".txt"):   # a clip arrives
        (data / f"clip03{ext}").write_bytes((tmp_path / "more" / f"clip03{ext}").read_bytes())
    monkeypatch.setattr(encode, "load_components", lambda *a, **k: pytest.fail("the model loaded"))
    capsys.readouterr()
    assert train(model, *run, "--resume", "--steps", "4") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "changed since the run began" in err


def test_resume_keeps_the_noise_levels_and_logs_what_it_changed(model, tmp_path, capsys):
    run = ["--out", str(tmp_path / "run"), "--batch-size", "1", "--sigma-sampling", "logit_normal"]
    assert train(model, *run, "--steps", "2") == 0
    capsys.readouterr()
    assert train(model, *run, "--resume", "--steps", "3", "--logit-mean", "0.5") == 2
    assert "keeps its logit_mean" in capsys.readouterr().err
    assert train(model, *run, "--resume", "--steps", "3", "--lr", "1e-3") == 0
    resume = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()
              if '"resume"' in x][-1]
    assert resume["changed"] == {"steps": [2, 3], "lr": [2e-5, 1e-3]}
