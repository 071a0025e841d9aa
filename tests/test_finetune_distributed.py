"""Two CPU processes (gloo) against one: FSDP2 sharding, the data split and sharded checkpoints
(attnqat/finetune/distributed.py, checkpoint.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnqat.finetune import checkpoint as ckpt
from attnqat.finetune import train as T
from finetune_data import RUN, losses, small_model

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.subprocess   # torchrun


def torchrun(n: int, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           "-m", "attnqat.finetune.train", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_two_gloo_processes_match_one_and_their_checkpoint_resumes_on_one(tmp_path):
    model = small_model(tmp_path / "small-wan")
    common = ["--model", str(model), *RUN, "--lr", "1e-3", "--warmup", "0", "--checkpoint-every", "3"]
    one = tmp_path / "one"
    assert T.main([*common, "--out", str(one), "--steps", "6", "--batch-size", "4"]) == 0
    two = tmp_path / "two"
    res = torchrun(2, *common, "--out", str(two), "--steps", "3", "--batch-size", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    state = ckpt.read_state(ckpt.checkpoint_dir(two, 3))
    assert state["world"] == 2 and state["samples"] == 12
    shards = sorted(p.name for p in ckpt.checkpoint_dir(two, 3).iterdir() if p.suffix == ".distcp")
    assert shards == ["__0_0.distcp", "__1_0.distcp"]   # each rank wrote its shards
    start = [json.loads(x) for x in (two / "log.jsonl").read_text().splitlines()][0]
    assert start["world"] == 2
    a, b = losses(one), losses(two)
    assert sorted(b) == [1, 2, 3]
    for s in b:
        assert b[s] == pytest.approx(a[s], rel=1e-5), (s, a[s], b[s])
    # one process with the two processes' micro-batch, accumulated twice: the same global batch in
    # the shapes a GPU run compares (docs/benchmarks.md, several GPUs)
    acc = tmp_path / "accum"
    assert T.main([*common, "--out", str(acc), "--steps", "3", "--batch-size", "2", "--grad-accum", "2"]) == 0
    c = losses(acc)
    for s in (1, 2, 3):
        assert c[s] == pytest.approx(b[s], rel=1e-5), (s, b[s], c[s])
    # the two-process checkpoint continues on one process, with the same global batch
    assert T.main([*common, "--out", str(two), "--resume", "--steps", "6", "--batch-size", "4"]) == 0
    b = losses(two)
    assert sorted(b) == [1, 2, 3, 4, 5, 6]
    for s in (4, 5, 6):
        assert b[s] == pytest.approx(a[s], rel=1e-5), (s, a[s], b[s])
