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
