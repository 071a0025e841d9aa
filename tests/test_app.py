"""`attnqat app` end to end on the CPU: the real command on loopback, called through gradio_client.

One server (``attnqat app`` as a process, ``--keep 3``) serves most tests of this module: every
method through the API with the client's defaults, generation with two methods, bad inputs, two
concurrent clients and the cleanup of old results. It runs a copy of the embedded tiny model whose
defaults are small (32×32, 5 frames, 2 steps), so that a call with the client's defaults — all four
methods — takes seconds. A second server, in this process, shows the queue bound and a failure
inside generation (its service's run and fault hook can be controlled from the test).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from attnqat.generate import GENERATION_METHODS
from attnqat.tiny import SIDECAR, TINY_MODEL_DIR, TINY_QAT_DIR
from attnqat.video import probe_mp4, read_mp4

KEEP = 3
TINY = dict(seed=11, steps=2, guidance=5.0, shift=3.0, frames=5, negative_prompt="",
            fp4_scope="self")
SMALL_DEFAULTS = {"height": 32, "width": 32, "frames": 5, "steps": 2, "fps": 16}

pytestmark = pytest.mark.timeout(300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def small_model(folder: Path) -> Path:
    """The embedded tiny model (its files linked, not copied) with small generation defaults."""
    folder.mkdir()
    for sub in TINY_MODEL_DIR.iterdir():
        if sub.name != SIDECAR:
            (folder / sub.name).symlink_to(sub)
    sidecar = json.loads((TINY_MODEL_DIR / SIDECAR).read_text())
    sidecar["defaults"].update(SMALL_DEFAULTS)
    sidecar["qat_transformer"] = str(TINY_QAT_DIR)
    (folder / SIDECAR).write_text(json.dumps(sidecar))
    return folder


def wait_until_up(url: str, proc: subprocess.Popen | None, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"attnqat app exited with {proc.returncode}:\n" + log.read_text())
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("attnqat app did not start:\n" + log.read_text())
        time.sleep(0.5)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("app")
    model = small_model(root / "model")
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", GRADIO_TEMP_DIR=str(root / "gradio-tmp"))
    env.pop("ATTNQAT_APP_AUTH", None)
    env.pop("ATTNQAT_APP_FAULT", None)
    log_path = root / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "attnqat.cli", "app", "--model", str(model),
                             "--port", str(port), "--output-dir", str(root / "out"), "--keep",
                             str(KEEP), "--queue-size", "4", "--threads", "1"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_until_up(url, proc, log_path)
        yield {"url": url, "out": root / "out", "downloads": root / "downloads", "proc": proc,
               "log": log_path}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def client(server):
    from gradio_client import Client

    return Client(server["url"], verbose=False, download_files=str(server["downloads"]))


def generate(c, prompt, methods, resolution="32x48", **kw):
    return c.predict(prompt=prompt, methods=methods, resolution=resolution, **{**TINY, **kw},
                     api_name="/generate")


def check_clip(path, frames, width, height, fps=16.0):
    info = probe_mp4(path)
    assert (info["frames"], info["width"], info["height"]) == (frames, width, height)
    assert info["fps"] == pytest.approx(fps)


@pytest.mark.subprocess
def test_the_server_says_where_it_listens_and_nothing_about_share_links(server):
    deadline = time.monotonic() + 30  # the line follows the server's start
    while f"serving on {server['url']}" not in server["log"].read_text():
        assert time.monotonic() < deadline, server["log"].read_text()
        time.sleep(0.2)
    text = server["log"].read_text()
    assert "share=True" not in text and "public link" not in text.lower()


@pytest.mark.subprocess
def test_every_method_through_the_api_with_the_clients_defaults(server):
    c = client(server)
    # Only the prompt: every available method (the default), the model's size, a random seed.
    record, clips, side_by_side, record_file = c.predict(prompt="a red circle moves left",
                                                         api_name="/generate")
    assert list(record["methods"]) == list(GENERATION_METHODS)
    assert [Path(p).name for p in clips] == [f"{m}.mp4" for m in GENERATION_METHODS]
    for p in clips:
        check_clip(p, 5, 32, 32)
    assert isinstance(record["seed"], int) and record["seed"] >= 0
    assert record["qat"]["label"] == "Attn-QAT fine-tuned"   # the shipped weights (docs/repro.md)
    assert "path" not in record["qat"]
    assert record["precision"]["dtype"] in ("bfloat16", "float32") and record["precision"]["reason"]
    assert json.loads(Path(record_file).read_text()) == record
    # Each method alone, the others' parameters left to the client's defaults.
    for method in GENERATION_METHODS:
        record, clips, _, _ = c.predict(prompt="a blue square", methods=[method],
                                        api_name="/generate")
        assert list(record["methods"]) == [method] and len(clips) == 1
        check_clip(clips[0], 5, 32, 32)


@pytest.mark.subprocess
def test_numbers_reach_the_app_as_sent(server):
    from gradio_client.exceptions import ValidationError

    c = client(server)
    record, _, _, _ = generate(c, "a red circle", ["bf16"], seed=2 ** 63 - 1, resolution="32x32")
    assert record["seed"] == 2 ** 63 - 1  # the largest seed, not rounded, not refused
    for change, field, fragment in [(dict(steps=2.5), "steps", "a whole number"),
                                    (dict(frames=0), "frames", "4k+1"),
                                    (dict(frames=10 ** 6), "frames", "4k+1"),
                                    (dict(steps=10 ** 6), "steps", "from 1 to"),
                                    (dict(seed="abc"), "seed", "an integer"),
                                    (dict(seed=2 ** 63), "seed", "2^63−1")]:
        with pytest.raises(ValidationError) as info:
            generate(c, "a red circle", ["bf16"], **change)
        assert f"- {field}: " in str(info.value) and fragment in str(info.value), str(info.value)


@pytest.mark.subprocess
def test_generate_two_methods_through_gradio_client(server):
    c = client(server)
    record, clips, side_by_side, record_file = generate(c, "a red circle moves left",
                                                        ["bf16", "nvfp4"])
    # the clips: one per method, named after it, valid mp4s of the requested size
    assert [Path(p).name for p in clips] == ["bf16.mp4", "nvfp4.mp4"]
    for p in clips:
        check_clip(p, 5, 32, 48)  # "32x48" is width × height
    sbs = probe_mp4(side_by_side)
    assert sbs["frames"] == 5 and sbs["width"] > 2 * 32 and sbs["height"] > 48
    # the record: settings as asked, timings per method, PSNR/SSIM against BF16
    assert json.loads(Path(record_file).read_text()) == record
    assert record["prompt"] == "a red circle moves left" and record["seed"] == 11
    s = record["settings"]
    assert (s["width"], s["height"], s["frames"], s["steps"], s["fps"]) == (32, 48, 5, 2, 16)
    assert list(record["methods"]) == ["bf16", "nvfp4"]
    for m, entry in record["methods"].items():
        t = entry["timings"]
        assert t["denoising_s"] > 0 and t["decoding_s"] > 0 and t["attention_s"] > 0
        assert t["total_s"] == pytest.approx(t["denoising_s"] + t["decoding_s"])
        assert entry["transformer_calls"] == 4 and entry["peak_memory_bytes"] > 0
    nv = record["methods"]["nvfp4"]
    assert nv["ssim"] is not None and (nv["psnr"] is not None or nv["identical_to_bf16"])
    assert record["methods"]["bf16"]["psnr"] is None
    assert record["model_weights_note"]  # the tiny model says its weights are random


@pytest.mark.subprocess
def test_bad_inputs_are_refused_with_a_message_and_the_app_keeps_serving(server):
    from gradio_client.exceptions import ValidationError

    c = client(server)
    cases = [(dict(resolution="100x100"), "resolution", "multiple of 16"),
             (dict(resolution="wide"), "resolution", "width×height"),
             (dict(frames=6), "frames", "4k+1"),
             (dict(steps=0), "steps", "from 1 to"),
             (dict(prompt="   "), "prompt", "enter a prompt"),
             (dict(methods=[]), "methods", "select at least one method")]
    for change, field, fragment in cases:
        kw = {"prompt": "a red circle", "methods": ["bf16"], **change}
        with pytest.raises(ValidationError) as info:
            generate(c, **kw)
        text = str(info.value)
        assert f"- {field}: " in text and fragment in text, text
    record, clips, _, _ = generate(c, "a blue square", ["bf16"], resolution="32x32")
    check_clip(clips[0], 5, 32, 32)


@pytest.mark.subprocess
def test_two_concurrent_clients_get_their_own_results(server):
    from gradio_client.exceptions import ValidationError

    a, b = client(server), client(server)
    job_a = a.submit(prompt="a red circle moves left", methods=["bf16", "nvfp4"],
                     resolution="64x48", **{**TINY, "seed": 1, "frames": 9},
                     api_name="/generate")
    job_b = b.submit(prompt="a green square moves up", methods=["nvfp4", "bf16"],
                     resolution="32x64", **{**TINY, "seed": 2}, api_name="/generate")
    # A bad request is answered before it queues: both jobs cannot have finished yet (they run
    # one after the other).
    with pytest.raises(ValidationError):
        generate(client(server), "x", ["bf16"], frames=2)
    assert not (job_a.done() and job_b.done())
    rec_a, clips_a, _, _ = job_a.result(timeout=240)
    rec_b, clips_b, _, _ = job_b.result(timeout=240)
    assert (rec_a["prompt"], rec_a["seed"]) == ("a red circle moves left", 1)
    assert (rec_b["prompt"], rec_b["seed"]) == ("a green square moves up", 2)
    for p in clips_a:
        check_clip(p, 9, 64, 48)
    for p in clips_b:
        check_clip(p, 5, 32, 64)
    assert {Path(p).parent for p in clips_a}.isdisjoint({Path(p).parent for p in clips_b})
    # The same request alone gives the same pixels: nothing of the other request leaked in.
    rec_b2, clips_b2, _, _ = generate(b, "a green square moves up", ["bf16", "nvfp4"],
                                      resolution="32x64", seed=2)
    for p, q in zip(clips_b, clips_b2):
        assert np.array_equal(read_mp4(p)[0], read_mp4(q)[0])


@pytest.mark.subprocess
def test_only_the_most_recent_results_stay_on_disk(server):
    c = client(server)
    for i in range(KEEP + 1):
        generate(c, f"a yellow circle {i}", ["bf16"], resolution="32x32")
    runs = sorted(p for p in (server["out"] / "runs").iterdir() if not p.name.startswith("."))
    media = sorted((server["out"] / "media").iterdir())
    assert len(runs) == KEEP and len(media) == KEEP
    last = json.loads((runs[-1] / "record.json").read_text())
    assert last["prompt"] == f"a yellow circle {KEEP}"
    assert server["proc"].poll() is None  # still serving


# ----------------------------------------------------------------------------------------------
# A server in this process: the queue bound, a failure inside generation
# ----------------------------------------------------------------------------------------------

QUEUE = 8


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    import torch

    from attnqat.app.service import load_service
    from attnqat.app.ui import build_app, launch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("local-app")
    service = load_service(str(small_model(root / "model")), device="cpu", output_dir=root / "out",
                           keep=3)
    demo = build_app(service, queue_size=QUEUE)
    port = free_port()
    launch(demo, service, host="127.0.0.1", port=port, block=False, quiet=True)
    try:
        yield {"url": f"http://127.0.0.1:{port}/", "service": service, "out": root / "out",
               "downloads": root / "downloads"}
    finally:
        demo.close()
        service.close()
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_the_queue_bound_holds_for_simultaneous_clients(local, monkeypatch):
    """One request generates (held back by the test), twelve more arrive at once: exactly
    ``--queue-size`` of them wait, the others are refused at once with "queue is full"."""
    from gradio_client.exceptions import AppError
    from gradio_client.utils import QueueError

    service = local["service"]
    gate, running = threading.Event(), threading.Event()
    real_run = service.run

    def held_run(settings, **kw):
        running.set()
        assert gate.wait(120), "the test never released the generation"
        return real_run(settings, **kw)

    monkeypatch.setattr(service, "run", held_run)
    first = client(local).submit(prompt="first", methods=["bf16"], resolution="32x32",
                                 api_name="/generate")
    assert running.wait(60)
    barrier = threading.Barrier(12)
    outcome: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        c = client(local)
        barrier.wait()
        try:
            job = c.submit(prompt=f"waiting {i}", methods=["bf16"], resolution="32x32",
                           api_name="/generate")
            job.result(timeout=240)
            result = "served"
        except QueueError:
            result = "refused"
        except AppError as exc:
            result = f"error: {exc}"
        with lock:
            outcome.append(result)

    workers = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for w in workers:
        w.start()
    # The refusals come back while the first request still holds the generation.
    deadline = time.monotonic() + 60
    while outcome.count("refused") < 12 - QUEUE and time.monotonic() < deadline:
        time.sleep(0.1)
    refused_while_busy = outcome.count("refused")
    gate.set()
    for w in workers:
        w.join(240)
    first.result(timeout=240)
    assert refused_while_busy == 12 - QUEUE
    assert sorted(outcome) == sorted(["served"] * QUEUE + ["refused"] * (12 - QUEUE)), outcome


@pytest.mark.slow   # the in-process app server: about 10 s with its start
def test_failure_inside_generation_then_the_next_request_works(local):
    from gradio_client.exceptions import AppError

    from attnqat.app.service import Fault

    service = local["service"]
    c = client(local)
    runs_before = sorted(p.name for p in (local["out"] / "runs").iterdir())
    service.fault = Fault("oom", "sage3")
    try:
        with pytest.raises(AppError) as info:
            c.predict(prompt="a red circle", methods=["bf16", "sage3"], resolution="32x32",
                      api_name="/generate")
    finally:
        service.fault = None
    assert "Out of memory while generating with sage3 at 32×32×5" in str(info.value)
    assert "fewer frames" in str(info.value)
    # nothing half-written is left, and the next request is served
    assert sorted(p.name for p in (local["out"] / "runs").iterdir()) == runs_before
    record, clips, _, _ = c.predict(prompt="a red circle", methods=["bf16", "nvfp4"],
                                    resolution="32x32", api_name="/generate")
    assert set(record["methods"]) == {"bf16", "nvfp4"}
    check_clip(clips[1], 5, 32, 32)


# ----------------------------------------------------------------------------------------------
# Round 3 (#34): the 4-bit error against the same weights, seed sweeps, the API page's types
# ----------------------------------------------------------------------------------------------

@pytest.mark.subprocess
def test_attnqat_error_is_against_its_own_weights_and_drift_is_apart(server):
    """Defect 4: Attn-QAT's PSNR/SSIM compare it with its own (fine-tuned) weights in BF16; the
    fine-tuning drift from the base BF16 clip is recorded apart, with a line saying which is
    which."""
    c = client(server)
    record, clips, _, _ = generate(c, "a red circle moves left", ["bf16", "nvfp4", "attnqat"],
                                   resolution="32x32")
    nv, qat = record["methods"]["nvfp4"], record["methods"]["attnqat"]
    assert nv["reference"] == "bf16"
    assert qat["reference"] == "attnqat_bf16"  # the same weights with BF16 attention
    ref = record["references"]["attnqat_bf16"]
    assert ref["transformer"] == "attnqat" and ref["attention_method"] == "bf16"
    assert ref["timings"]["denoising_s"] > 0 and ref["attention_calls"]["self"] > 0
    drift = record["weights_drift"]
    assert drift is not None and drift["ssim"] is not None and "drift" in drift["compares"]
    # the shipped weights are fine-tuned: they drift from the base, so the two comparisons differ
    assert not drift["identical"] and drift["psnr"] is not None
    assert qat["ssim_vs_base_bf16"] is not None and qat["ssim_vs_base_bf16"] != qat["ssim"]
    assert "4-bit error" in record["comparison_note"] and "drift" in record["comparison_note"]
    # what ran, per method (#34 feature 7): the receipts
    kinds = {(d["kind"], d["method"], d["implementation"]) for d in qat["dispatch"]}
    assert ("self", "nvfp4", "reference") in kinds and ("cross", "bf16", "sdpa") in kinds
    assert qat["fallbacks"] == []
    # older records (no new fields) still read, and this one reads back whole
    from attnqat.record import GenerationRecord

    assert GenerationRecord.from_dict(record).to_dict() == record
    old = {k: v for k, v in record.items() if k not in ("references", "weights_drift",
                                                        "comparison_note", "error_map")}
    assert GenerationRecord.from_dict(old).weights_drift is None


@pytest.mark.subprocess
def test_a_seed_sweep_through_the_api(server):
    """Feature 9: one prompt × N seeds, every method; per-method PSNR/SSIM vs BF16 and the tiny
    model's procedural score, with mean and spread, and a plot."""
    c = client(server)
    summary, plot = c.predict(prompt="a red circle moves left on a blue background",
                              methods=["bf16", "nvfp4"], seeds="3-4", steps=1, guidance=1.0,
                              shift=3.0, resolution="32x32", frames=5, negative_prompt="",
                              fp4_scope="self", api_name="/sweep")
    assert summary["seeds"] == [3, 4] and summary["methods"] == ["bf16", "nvfp4"]
    assert len(summary["rows"]) == 4
    nv = summary["summary"]["nvfp4"]
    psnrs = [r["psnr"] for r in summary["rows"] if r["method"] == "nvfp4"]
    finite = [p for p in psnrs if p is not None]
    assert nv["psnr"]["n"] == len(finite)
    if finite:
        assert nv["psnr"]["mean"] == pytest.approx(sum(finite) / len(finite))
    assert nv["ssim"]["n"] == 2 and nv["ssim"]["std"] is not None
    assert summary["score_name"] and "procedural" in summary["score_name"]
    for m in ("bf16", "nvfp4"):
        assert summary["summary"][m]["score"]["n"] == 2
        assert 0.0 <= summary["summary"][m]["score"]["mean"] <= 1.0
    assert summary["summary"]["bf16"]["psnr"]["n"] == 0  # the reference has no error against itself
    assert Path(plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from gradio_client.exceptions import AppError, ValidationError

    with pytest.raises((AppError, ValidationError)) as info:
        c.predict(prompt="a red circle", methods=["bf16"], seeds="5", steps=1, guidance=1.0,
                  shift=3.0, resolution="32x32", frames=5, negative_prompt="", fp4_scope="self",
                  api_name="/sweep")
    assert "seeds" in str(info.value) and "2 to" in str(info.value)


@pytest.mark.subprocess
def test_the_api_page_types_integers_and_shows_a_prompt_the_model_can_draw(server):
    """Defect 6: seed, steps and frames are integers on the API page; its example prompt is one of
    the model's, not gradio's "Hello!!"."""
    info = client(server).view_api(return_format="dict", print_info=False)
    params = {p["parameter_name"]: p for p in info["named_endpoints"]["/generate"]["parameters"]}
    for name in ("seed", "steps", "frames"):
        assert params[name]["type"]["type"] == "integer", params[name]
    assert params["guidance"]["type"]["type"] == "number"
    example = params["prompt"]["example_input"]
    assert example != "Hello!!" and " background" in example
    assert "/sweep" in info["named_endpoints"]
