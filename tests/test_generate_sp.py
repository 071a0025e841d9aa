"""``torchrun … -m attnqat.cli generate --sp 2`` (attnqat/generate_sp.py) on two gloo CPU processes
gives every method's one-process clip; rank 0 alone writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from attnqat.video import read_mp4

REPO = Path(__file__).resolve().parents[1]
#: 32 × 32, 5 frames: 2 latent frames × 2 × 2 patches = 8 tokens; float32 and the PyTorch
#: reference so that both runs compute the same numbers
ARGS = ["--prompt", "a red ball rolls on the grass", "--seed", "7", "--steps", "3", "--height", "32",
        "--width", "32", "--frames", "5", "--dtype", "float32", "--backend", "torch",
        "--fp4-scope", "all", "--device", "cpu", "--no-progress", "--threads", "1"]
METHODS = ["bf16", "nvfp4", "sage3", "attnqat"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


@pytest.mark.slow
def test_generate_sp2_gives_the_one_process_clips(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    res = subprocess.run([sys.executable, "-m", "attnqat.cli", "generate", *ARGS, "--out", str(one)],
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=2", "-m", "attnqat.cli", "generate", *ARGS, "--sp", "2",
                          "--out", str(two)], cwd=REPO, env=_env(), capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("wrote ") == 1            # rank 0 alone writes and prints
    assert "sequence parallel: 2 processes" in res.stdout
    for m in METHODS:
        a, _ = read_mp4(one / f"{m}.mp4")
        b, _ = read_mp4(two / f"{m}.mp4")
        assert a.shape == b.shape == (5, 32, 32, 3)
        assert np.array_equal(a, b), (m, np.abs(a.astype(int) - b.astype(int)).max())
    ra = json.loads((one / "record.json").read_text())
    rb = json.loads((two / "record.json").read_text())
    assert ra["seed"] == rb["seed"] == 7


@pytest.mark.subprocess   # `attnqat generate` as a child process
def test_generate_sp_needs_torchrun(tmp_path):
    res = subprocess.run([sys.executable, "-m", "attnqat.cli", "generate", *ARGS, "--sp", "2",
                          "--out", str(tmp_path / "x")], cwd=REPO, env={
                              k: v for k, v in _env().items() if k not in ("WORLD_SIZE", "RANK")},
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert "--sp 2 needs 2 processes: launch with `torchrun --nproc-per-node 2" in res.stderr
    assert not (tmp_path / "x").exists()
