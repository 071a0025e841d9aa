"""The 14B-on-one-GPU measurement's plumbing, on the CPU: the random transformer built on the meta
device and materialized where it lives (attnqat/bench_wan.py), ``bench train``'s one-line "does not
fit" record for an out-of-memory row (finetune/bench_train.py), and the device script that runs
each row as its own process (docs/benchmarks/14b_one_gpu.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnqat import bench_wan
from attnqat.cli import main

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "benchmarks" / "14b_one_gpu.sh"
TINY = ["--config", "tiny", "--resolution", "32x32", "--frames", "5", "--device", "cpu",
        "--methods", "attnqat", "--steps", "1", "--warmup", "1"]


def test_fast_build_is_the_model_diffusers_builds_in_float32():
    """The trainer's float32 master weights: every parameter and buffer of the model diffusers
    builds, same names, shapes and dtype, the RoPE tables equal; the same seed draws the same values,
    and ``home`` moves every parameter and buffer where it is asked."""
    from diffusers import WanTransformer3DModel

    cfg = bench_wan.model_config("tiny")
    model = bench_wan.build_random_transformer(cfg, torch.device("cpu"), dtype=torch.float32, seed=0)
    ref = WanTransformer3DModel(**cfg)
    got = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    assert got == {k: (tuple(v.shape), v.dtype) for k, v in ref.state_dict().items()}
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    assert torch.equal(model.rope.freqs_cos, ref.rope.freqs_cos)
    again = bench_wan.build_random_transformer(cfg, torch.device("cpu"), dtype=torch.float32, seed=0)
    other = bench_wan.build_random_transformer(cfg, torch.device("cpu"), dtype=torch.float32, seed=1)
    w = "blocks.0.ffn.net.0.proj.weight"
    assert torch.equal(model.state_dict()[w], again.state_dict()[w])
    assert not torch.equal(model.state_dict()[w], other.state_dict()[w])
    assert model.state_dict()[w].std().item() == pytest.approx(0.02, rel=0.05)
    moved = bench_wan.build_random_transformer(cfg, torch.device("cpu"), dtype=torch.float32,
                                               home=torch.device("meta"))
    assert {t.device.type for t in [*moved.parameters(), *moved.buffers()]} == {"meta"}


def test_parameter_bytes_counts_the_14b_model_without_building_it():
    n14 = bench_wan.parameter_bytes(bench_wan.model_config("14b"), torch.float32) // 4
    assert n14 == 14_288_491_584   # 14.3 B: docs/benchmarks.md
    cfg = bench_wan.model_config("tiny")
    model = bench_wan.build_random_transformer(cfg, torch.device("cpu"))   # bf16, some float32
    assert bench_wan.parameter_bytes(cfg) == sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("where,error,expect", [
    ("step", torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a "
                                    "total capacity of 79.19 GiB\nof which 1.2 GiB is free."),
     "GPU out of memory while warm-up step 1: forward and backward: CUDA out of memory. Tried to "
     "allocate 2.50 GiB. GPU 0 has a total capacity of 79.19 GiB"),
    ("build", RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't "
                           "allocate memory: you tried to allocate 283115520 bytes. Error code 12"),
     "host out of memory while building the model (9.1 M parameters, 35 MiB in float32, drawn on "
     "cpu, kept on cpu): [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator"),
])
def test_an_out_of_memory_row_ends_as_one_does_not_fit_line(monkeypatch, tmp_path, capsys, where,
                                                            error, expect):
    from attnqat.finetune import bench_train

    def boom(*a, **k):
        raise error

    if where == "step":
        monkeypatch.setattr(bench_train.Trainer, "micro_step", boom)
    else:
        monkeypatch.setattr(bench_train, "build_random_transformer", boom)
    out = tmp_path / "rec.json"
    assert main(["bench", "train", *TINY, "--lora-rank", "4", "--json", str(out)]) == 0
    printed = capsys.readouterr()
    line = next(x for x in printed.out.splitlines() if x.startswith("tiny attnqat ("))
    assert line.startswith(f"tiny attnqat (LoRA r4, adamw, no offload): does not fit: {expect}")
    assert "\n" not in line and "Traceback" not in printed.err
    row = json.loads(out.read_text())["rows"][0]
    assert row["fits"] is False and row["does_not_fit"] in line and row["step_s"] is None
    assert row["lora_rank"] == 4 and row["host_peak_rss_gib"] > 0
    assert ("build_s" in row) == (where == "step")   # the build had finished, or not


def test_other_errors_are_not_taken_for_out_of_memory(monkeypatch):
    from attnqat.finetune import bench_train

    assert bench_train.out_of_memory(ValueError("shape mismatch")) is None
    assert bench_train.out_of_memory(RuntimeError("CUDA error: an illegal memory access")) is None
    assert bench_train.out_of_memory(RuntimeError("CUDA error: out of memory")).startswith("out of memory")
    monkeypatch.setattr(bench_train.Trainer, "micro_step",
                        lambda *a, **k: (_ for _ in ()).throw(ValueError("not memory")))
    with pytest.raises(ValueError, match="not memory"):
        main(["bench", "train", *TINY])


@pytest.mark.slow
def test_bench_train_row_summary_and_record(tmp_path, capsys):
    """A row that fits: the one summary line, the build and set-up times, the host peaks."""
    out = tmp_path / "rec.json"
    assert main(["bench", "train", *TINY, "--offload", "--optimizer", "adamw8bit", "--json", str(out)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("tiny attnqat ("))
    assert line.startswith("tiny attnqat (full, adamw8bit, offload): step ") and "host peak RSS" in line
    rec = json.loads(out.read_text())
    row = rec["rows"][0]
    assert row["fits"] is True and row["build_s"] > 0 and row["trainer_setup_s"] > 0
    assert 0 < row["host_steps_peak_rss_gib"] <= row["host_peak_rss_gib"]
    assert rec["command"][:3] == ["attnqat", "bench", "train"] and rec["host_memory_gib"] > 0


def _script(tmp_path, fake: str, **env) -> tuple[subprocess.CompletedProcess, Path]:
    """Run the device script with a stand-in for ``python3 -m attnqat.cli`` (``fake``: bash run in
    its place; every other python call goes to this interpreter)."""
    shim = tmp_path / "python"
    shim.write_text(f'#!/bin/bash\nif [ "$1" = "-m" ]; then\n{fake}\nfi\nexec "{sys.executable}" "$@"\n')
    shim.chmod(0o755)
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OUT": str(out), "WORK": str(tmp_path / "work"),
                               "PYTHON": str(shim), **env})
    return done, out


def _records(out: Path) -> dict:
    """The script's records by row name; the script leaves three files in $OUT (the GPU returns 8)."""
    assert sorted(p.name for p in out.iterdir()) == ["14b_one_gpu.json", "14b_one_gpu.log", "env.txt"]
    return json.loads((out / "14b_one_gpu.json").read_text())


@pytest.mark.subprocess   # runs the device script, and commands under it
def test_script_records_a_row_killed_by_the_oom_killer(tmp_path):
    """SIGKILL (what the kernel's OOM killer sends) ends that row with a "does not fit" record naming
    the phase it was in; the next row still runs and the table comes last."""
    fake = ('echo "bench train [3.0 s] attnqat: timed step 1: forward and backward" >&2\n'
            'python3 -c "b = bytearray(50 * 2**20); import time; time.sleep(1.5)"\n'
            'case " $* " in *" --offload "*) kill -9 $$ ;; esac\nexit 0')
    done, out = _script(tmp_path, fake, ROWS="lora32-offload,lora32")
    assert done.returncode == 0, done.stderr
    recs = _records(out)
    row = recs["lora32-offload"]["rows"][0]
    assert row["fits"] is False and row["exit"] == 137
    assert row["does_not_fit"].startswith("host out of memory: killed by SIGKILL (exit 137)")
    assert "while timed step 1: forward and backward" in row["does_not_fit"]
    assert row["does_not_fit"] in done.stdout
    # the second row exited 0 without a record: a failure, not a "does not fit"
    second = recs["lora32"]["rows"][0]
    assert second["fits"] is None and second["error"].startswith("failed (exit 0)")
    assert list(recs) == ["lora32-offload", "lora32"]
    assert "=== lora32-offload: bench train --lora-rank 32 --offload" in (out / "14b_one_gpu.log").read_text()
    last = done.stdout.strip().splitlines()
    assert any(x.startswith("lora32-offload     no ") for x in last[-5:])


@pytest.mark.subprocess   # runs the device script, and commands under it
def test_script_stops_a_row_at_its_limit_and_skips_rows_out_of_budget(tmp_path):
    fake = 'echo "bench train [1.0 s] attnqat: trainer set up in 1.0 s" >&2\nsleep 60'
    done, out = _script(tmp_path, fake, ROWS="lora32,full-8bit", BUDGET_S="2", MIN_ROW_S="1")
    assert done.returncode == 0, done.stderr
    recs = _records(out)
    first = recs["lora32"]["rows"][0]
    assert first["fits"] is None and first["error"].startswith("did not finish within")
    assert "trainer set up" in first["error"]
    second = recs["full-8bit"]["rows"][0]
    assert second["fits"] is None and "out of time" in second["not_run"]


@pytest.mark.slow
def test_script_runs_real_rows_on_a_tiny_model(tmp_path):
    """The script end to end with bench train itself (tiny model, CPU): each row its own record."""
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OUT": str(out), "WORK": str(tmp_path / "work"),
                               "PYTHON": sys.executable, "CONFIG": "tiny",
                               "EXTRA": "--device cpu --resolution 32x32 --frames 5",
                               "ROWS": "lora32-offload,full-8bit"})
    assert done.returncode == 0, done.stderr
    recs = _records(out)
    for name, lora, offload in (("lora32-offload", 32, True), ("full-8bit", 0, False)):
        rec = recs[name]
        row = rec["rows"][0]
        assert row["fits"] is True and row["lora_rank"] == lora and row["offload"] is offload
        assert rec["exit"] == 0 and rec["config"] == "tiny"
        assert rec["command"][:5] == ["attnqat", "bench", "train", "--config", "tiny"]   # python -m attnqat.cli
    assert "tiny Attn-QAT training step, 32x32, 5 frames" in done.stdout
