"""The fine-tuning mesh (attnqat/finetune/mesh.py) on gloo CPU processes: HSDP replicate × shard
against one process on the same global batch, its 4-rank checkpoint resumed on 2 and on 1, and
Ulysses sequence parallelism in training against one process."""

from __future__ import annotations

import json
import shutil

import pytest

from attnqat import tiny
from attnqat.finetune import checkpoint as ckpt
from attnqat.finetune import train as T
from finetune_data import DEFAULTS, RUN, SMALL, losses, small_model
from test_finetune_distributed import torchrun


def grad_norms(run) -> dict[int, float]:
    """step → global gradient norm (a gradient off by a factor would show here, not in Adam's
    scale-free losses)."""
    recs = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["grad_norm"] for r in recs if r["kind"] == "train"}


def _start(run) -> dict:
    return [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()][0]


@pytest.mark.slow
def test_hsdp_2x2_matches_one_process_and_resumes_on_2_and_on_1(tmp_path):
    model = small_model(tmp_path / "small-wan")
    common = ["--model", str(model), *RUN, "--lr", "1e-3", "--warmup", "0", "--checkpoint-every", "2"]
    one = tmp_path / "one"
    assert T.main([*common, "--out", str(one), "--steps", "4", "--batch-size", "4"]) == 0
    a = losses(one)
    four = tmp_path / "four"
    res = torchrun(4, *common, "--out", str(four), "--steps", "2", "--batch-size", "1",
                   "--replicate", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    assert ("mesh: 4 process(es) = replicate 2 × shard 2 × sp 1; global batch 4 = 2 replica(s) × "
            "2 shard(s) × 1 per GPU × 1 accumulation") in res.stdout + res.stderr
    state = ckpt.read_state(ckpt.checkpoint_dir(four, 2))
    assert state["world"] == 4 and state["samples"] == 8
    cfg = json.loads((four / "config.json").read_text())
    assert (cfg["replicate"], cfg["sp"]) == (2, 1)
    b = losses(four)
    assert sorted(b) == [1, 2]
    for s in b:
        assert b[s] == pytest.approx(a[s], rel=1e-5), (s, a[s], b[s])
        assert grad_norms(four)[s] == pytest.approx(grad_norms(one)[s], rel=1e-5)
    # the 4-rank checkpoint continues on 2 processes (plain FSDP) and on 1, same global batch
    on2, on1 = tmp_path / "on2", tmp_path / "on1"
    shutil.copytree(four, on2)
    shutil.copytree(four, on1)
    res = torchrun(2, *common, "--out", str(on2), "--resume", "--steps", "4", "--batch-size", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    assert T.main([*common, "--out", str(on1), "--resume", "--steps", "4", "--batch-size", "4"]) == 0
    for run in (on2, on1):
        c = losses(run)
        assert sorted(c) == [1, 2, 3, 4]
        for s in (3, 4):
            assert c[s] == pytest.approx(a[s], rel=1e-5), (run.name, s, a[s], c[s])
            assert grad_norms(run)[s] == pytest.approx(grad_norms(one)[s], rel=1e-5)


def test_mesh_degrees_are_checked(tmp_path):
    model = small_model(tmp_path / "small-wan")
    # one process: --replicate 2 cannot divide a world of one
    rc = T.main(["--model", str(model), *RUN, "--out", str(tmp_path / "x"), "--steps", "1",
                 "--replicate", "2"])
    assert rc != 0
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_sequence_parallel_training_matches_one_process(tmp_path):
    folder = tmp_path / "two-heads"
    cfg = tiny.TinyWanConfig(**{**SMALL, "num_attention_heads": 2}, defaults=DEFAULTS)
    tiny.save_pipeline(tiny.build_tiny_pipeline(0, cfg), folder,
                       sidecar={"kind": "tiny-wan", "weights": "random-init", "seed": 0,
                                "defaults": DEFAULTS, "config": tiny.config_dict(cfg)})
    common = ["--model", str(folder), *RUN, "--lr", "1e-3", "--warmup", "0", "--steps", "2",
              "--attention", "attnqat", "--backend", "torch"]
    one = tmp_path / "one"
    assert T.main([*common, "--out", str(one), "--batch-size", "2"]) == 0
    sp = tmp_path / "sp"
    res = torchrun(2, *common, "--out", str(sp), "--batch-size", "2", "--sp", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "replicate 1 × shard 1 × sp 2; global batch 2" in res.stdout + res.stderr
    assert _start(sp)["world"] == 2
    a, b = losses(one), losses(sp)
    assert sorted(b) == [1, 2]
    for s in b:
        assert b[s] == pytest.approx(a[s], rel=1e-5), (s, a[s], b[s])
        assert grad_norms(sp)[s] == pytest.approx(grad_norms(one)[s], rel=1e-5)
    # the 3-D mesh: 2 replicas × 1 shard × sp 2, one clip per sp group: the same global batch
    three = tmp_path / "three-d"
    res = torchrun(4, *common, "--out", str(three), "--batch-size", "1", "--sp", "2", "--replicate", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    assert ("replicate 2 × shard 1 × sp 2; global batch 2 = 2 replica(s) × 1 shard(s) × 1 per GPU"
            in res.stdout + res.stderr)
    c = losses(three)
    for s in (1, 2):
        assert c[s] == pytest.approx(a[s], rel=1e-5), (s, a[s], c[s])
        assert grad_norms(three)[s] == pytest.approx(grad_norms(one)[s], rel=1e-5)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_rehearsed_on_one_host(tmp_path):
    """Two torchrun launches meeting at one c10d rendezvous, as on two machines (README,
    fine-tuning on several machines): one HSDP replica per "node", equal to one process."""
    import os
    import subprocess
    import sys

    from test_finetune_distributed import REPO

    model = small_model(tmp_path / "small-wan")
    common = ["--model", str(model), *RUN, "--lr", "1e-3", "--warmup", "0", "--steps", "2"]
    one = tmp_path / "one"
    assert T.main([*common, "--out", str(one), "--batch-size", "2"]) == 0
    run = tmp_path / "nodes"
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "t36",
           "-m", "attnqat.finetune.train", *common, "--out", str(run), "--batch-size", "1",
           "--replicate", "2"]
    nodes = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(outs)
    assert "mesh: 2 process(es) = replicate 2 × shard 1 × sp 1" in "".join(outs)
    assert _start(run)["world"] == 2
    a, b = losses(one), losses(run)
    assert sorted(b) == [1, 2]
    for s in b:
        assert b[s] == pytest.approx(a[s], rel=1e-5), (s, a[s], b[s])
        assert grad_norms(run)[s] == pytest.approx(grad_norms(one)[s], rel=1e-5)


@pytest.mark.slow
def test_bench_train_sp2_gives_the_one_process_losses(tmp_path):
    """``attnqat bench train --sp 2`` (the GPU benchmark's sp rows) on two gloo processes: the same
    losses as one process, half the tokens per GPU."""
    import os
    import subprocess
    import sys

    from attnqat.cli import main
    from test_finetune_distributed import REPO

    args = ["bench", "train", "--config", "tiny", "--resolution", "32x32", "--frames", "5",
            "--steps", "1", "--warmup", "1", "--device", "cpu", "--methods", "bf16,attnqat"]
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    assert main([*args, "--json", str(one)]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=2", "-m", "attnqat.cli", *args, "--sp", "2",
                          "--json", str(two)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert (b["gpus"], b["sp"]) == (2, 2)
    for ra, rb in zip(a["rows"], b["rows"], strict=True):
        assert rb["tokens_per_step_per_gpu"] * 2 == ra["tokens_per_step_per_gpu"] == 8
        assert rb["losses"] == pytest.approx(ra["losses"], rel=1e-5), (ra["method"], ra["losses"], rb["losses"])
