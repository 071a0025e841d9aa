"""A training run that fails ends, with its DataLoader workers, within seconds and a non-zero
status (attnqat/finetune/train.py, data.py). Every run here uses the default data workers (2):
the workers ignore the stop signals sent to the whole process group, which once made every
crash hang forever."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnqat.finetune import checkpoint as ckpt
from finetune_data import losses, small_model, write_clips

REPO = Path(__file__).resolve().parents[1]
#: the default --workers (2), unlike the other trainer tests
FLAGS = ["--device", "cpu", "--no-tensorboard", "--no-progress"]
#: seconds a failed run may take to end once it has failed (a hang is forever)
BOUND = 30


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return small_model(tmp_path_factory.mktemp("exit") / "small-wan")


def _group(pgid: int) -> list[int]:
    """The live processes of a process group (zombies excluded)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(d.name))
    return pids


class Run:
    """``attnqat finetune train`` in a process group of its own (as a shell job: Ctrl-C and a
    scheduler's SIGTERM reach the workers too)."""

    def __init__(self, model: Path, out: Path, *extra: str, env: dict | None = None,
                 preexec=None, stdout=subprocess.PIPE) -> None:
        cmd = [sys.executable, "-m", "attnqat.finetune.train", "--model", str(model), "--out",
               str(out), *FLAGS, *extra]
        self.out = out
        self.proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, cwd=REPO, text=True,
                                     start_new_session=True, env={**os.environ, **(env or {})},
                                     preexec_fn=preexec)
        self.stderr = ""

    def wait_for_step(self, step: int, limit: float = 240) -> None:
        deadline = time.time() + limit
        while time.time() < deadline:
            if (self.out / "log.jsonl").is_file() and max(losses(self.out) or [0]) >= step:
                return
            if self.proc.poll() is not None:
                pytest.fail(f"the run ended before step {step}: {self.proc.stderr.read()}")
            time.sleep(0.05)
        self.kill()
        pytest.fail(f"the run never reached step {step}")

    def end(self, bound: float) -> tuple[int, float]:
        """Wait for the run to end (at most ``bound`` s); returns its status and the seconds it
        took. Fails, killing the group, if it hangs or leaves a worker behind."""
        t0 = time.time()
        try:
            _, self.stderr = self.proc.communicate(timeout=bound)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the run did not end within {bound} s of failing")
        left = _group(self.proc.pid)
        if left:
            self.kill()
            pytest.fail(f"the run left processes behind: {left}")
        return self.proc.returncode, time.time() - t0

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)


def _end_record(out: Path) -> dict:
    recs = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    return [r for r in recs if r["kind"] == "event"][-1]


@pytest.mark.subprocess   # the trainer in a child process
def test_a_clip_that_cannot_be_read_ends_the_run_with_one_line(model, tmp_path):
    data = tmp_path / "clips"
    write_clips(data, 6)
    (data / "clip03.mp4").write_bytes(b"not a video" * 50)
    run = Run(model, tmp_path / "r", "--data", str(data), "--steps", "20", "--batch-size", "1")
    status, _ = run.end(BOUND + 120)   # model load included
    assert status == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert "clip03.mp4" in lines[-1] and "not a readable video" in lines[-1]
    assert "Traceback" not in run.stderr and "worker" not in run.stderr
    end = _end_record(tmp_path / "r")
    assert end["event"] == "end" and end["status"] == 2 and "clip03.mp4" in end["error"]


@pytest.mark.subprocess   # the trainer in a child process
def test_a_disk_that_fills_while_checkpointing_ends_the_run(model, tmp_path):
    """The files the run may write are limited to 256 KiB (RLIMIT_FSIZE): the checkpoint's model
    and AdamW shards (~1.6 MB here) fail to write as they would on a full disk."""
    limit = 256 * 1024

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    run = Run(model, tmp_path / "full", "--steps", "20", "--batch-size", "1", "--checkpoint-every", "3",
              preexec=small_files)
    status, _ = run.end(BOUND + 120)
    assert status == 1 == _end_record(tmp_path / "full")["status"], run.stderr
    line = "attnqat finetune train: cannot write the checkpoint of step 3 in "
    assert run.stderr.startswith(line) and run.stderr.count("\n") == 1, run.stderr
    assert "MiB free there" in run.stderr and "last complete checkpoint stays" in run.stderr
    assert not list((tmp_path / "full" / ckpt.CHECKPOINTS).iterdir())   # no partial step-3.tmp


def test_no_space_left_is_one_line_and_leaves_no_partial_checkpoint(model, tmp_path, capsys, monkeypatch):
    """ENOSPC from the writer of the random states (the last file of a checkpoint): the run stops
    with one line, the earlier checkpoint intact, nothing of the failed one on disk."""
    import errno

    from attnqat.finetune import train as T

    real_save = ckpt.torch.save

    def save(obj, f, *a, **k):
        if isinstance(f, Path) and f.name == "rng-rank-0.pt" and f.parent.name == "step-0000004.tmp":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", save)
    out = tmp_path / "nospace"
    assert T.main(["--model", str(model), "--out", str(out), *FLAGS, "--steps", "6",
                   "--batch-size", "1", "--checkpoint-every", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "checkpoint of step 4" in err and "No space left on device" in err
    assert [p.name for p in (out / ckpt.CHECKPOINTS).iterdir()] == ["step-0000002"]
    assert [s for s, _ in ckpt.complete_checkpoints(out)] == [2]
    assert _end_record(out)["status"] == 1


def test_an_unwritable_out_is_refused_before_the_model_loads(model, tmp_path, capsys, monkeypatch):
    from attnqat.finetune import encode
    from attnqat.finetune import train as T

    monkeypatch.setattr(encode, "load_components", lambda *a, **k: pytest.fail("the model loaded"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert T.main(["--model", str(model), "--out", str(blocker / "run"), *FLAGS, "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{blocker} is not a folder" in err


@pytest.mark.subprocess   # the trainer in a child process
def test_an_error_in_a_step_ends_the_run_and_the_logs_say_so(model, tmp_path):
    """Any exception escaping the loop (here one raised by the 3rd micro-step) ends the run; the
    log's and TensorBoard's `end` record its status."""
    out = tmp_path / "bug"
    driver = ("import sys\n"
              "from attnqat.finetune import train as T\n"
              "step = T.Trainer.micro_step\n"
              "def failing(self, *a):\n"
              "    self.n = getattr(self, 'n', 0) + 1\n"
              "    if self.n == 3:\n"
              "        raise RuntimeError('a bug in the step')\n"
              "    return step(self, *a)\n"
              "T.Trainer.micro_step = failing\n"
              "sys.exit(T.main(sys.argv[1:]))\n")
    cmd = [sys.executable, "-c", driver, "--model", str(model), "--out", str(out), "--device", "cpu",
           "--no-progress", "--steps", "20", "--batch-size", "1"]
    run = Run.__new__(Run)
    run.out = out
    run.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                                text=True, start_new_session=True)
    status, _ = run.end(BOUND + 120)
    assert status == 1 and "RuntimeError: a bug in the step" in run.stderr
    end = _end_record(out)
    assert end["event"] == "end" and end["status"] == 1 and end["step"] == 2
    assert end["error"] == "RuntimeError: a bug in the step"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(out / "tb"))
    tb.Reload()
    assert [(e.step, e.value) for e in tb.Scalars("event/status")] == [(2, 1.0)]


@pytest.mark.subprocess   # the trainer in a child process
def test_a_closed_output_pipe_ends_the_run(model, tmp_path):
    """`PYTHONUNBUFFERED=1 attnqat finetune train ... | head -1`: the first line is read, the
    pipe closed; the next line (a validation result) cannot be written."""
    run = Run(model, tmp_path / "head", "--steps", "50", "--batch-size", "1", "--val-every", "1",
              "--val-prompts", "heldout:1", env={"PYTHONUNBUFFERED": "1"})
    first = run.proc.stdout.readline()
    assert first.startswith("training")
    run.proc.stdout.close()
    status, _ = run.end(BOUND + 120)
    assert status == 1 == _end_record(tmp_path / "head")["status"], run.stderr
    assert "the output was closed" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.subprocess   # the trainer in a child process
def test_a_second_ctrl_c_ends_the_run_at_once(model, tmp_path):
    """Ctrl-C reaches the whole foreground process group. The first asks for a checkpoint at the
    end of the step (a long one: 20 micro-steps); the second ends the run."""
    run = Run(model, tmp_path / "int", "--steps", "200", "--batch-size", "2", "--grad-accum", "20",
              "--checkpoint-every", "1000")
    run.wait_for_step(1)
    os.killpg(run.proc.pid, signal.SIGINT)
    time.sleep(0.3)
    os.killpg(run.proc.pid, signal.SIGINT)
    status, seconds = run.end(BOUND)
    assert status == 128 + signal.SIGINT, run.stderr
    assert "interrupted" in run.stderr and "Traceback" not in run.stderr
    assert _end_record(tmp_path / "int")["status"] == 130
    assert not list((tmp_path / "int").rglob("*.tmp"))   # a checkpoint cut short is removed


@pytest.mark.subprocess   # the trainer in a child process
def test_sigterm_to_the_group_still_saves_a_checkpoint_with_workers(model, tmp_path):
    """The workers ignore a scheduler's SIGTERM while the loop saves; then everything ends."""
    run = Run(model, tmp_path / "term", "--steps", "400", "--batch-size", "2",
              "--checkpoint-every", "1000")
    run.wait_for_step(3)
    os.killpg(run.proc.pid, signal.SIGTERM)
    status, _ = run.end(BOUND + 30)
    assert status == 128 + signal.SIGTERM, run.stderr
    assert 3 <= ckpt.complete_checkpoints(tmp_path / "term")[-1][0] < 400
