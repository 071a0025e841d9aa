"""`attnqat app` end to end on the CPU: the real command on loopback, called through gradio_client.

One server (the embedded tiny model, ``--keep 3``, the testing hook ``ATTNQAT_APP_FAULT=oom@sage3``)
serves every test of this module: generation with two methods, bad inputs, a failure inside
generation, two concurrent clients and the cleanup of old results.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from attnqat.video import probe_mp4, read_mp4

KEEP = 3
TINY = dict(seed=11, steps=2, guidance=5.0, shift=3.0, frames=5, negative_prompt="",
            fp4_scope="self")

pytestmark = pytest.mark.timeout(300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("app")
    port = free_port()
    env = dict(os.environ, ATTNQAT_APP_FAULT="oom@sage3", OMP_NUM_THREADS="1",
               GRADIO_TEMP_DIR=str(root / "gradio-tmp"))
    env.pop("ATTNQAT_APP_AUTH", None)
    log = open(root / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "attnqat.cli", "app", "--port", str(port),
                             "--output-dir", str(root / "out"), "--keep", str(KEEP),
                             "--queue-size", "4", "--threads", "1"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 180
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"attnqat app exited with {proc.returncode}:\n"
                                   + (root / "server.log").read_text())
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("attnqat app did not start:\n" + (root / "server.log").read_text())
            time.sleep(0.5)
        yield {"url": url, "out": root / "out", "downloads": root / "downloads", "proc": proc}
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


def check_clip(path, frames, height, width, fps=16.0):
    info = probe_mp4(path)
    assert (info["frames"], info["height"], info["width"]) == (frames, height, width)
    assert info["fps"] == pytest.approx(fps)


def test_generate_two_methods_through_gradio_client(server):
    c = client(server)
    record, clips, side_by_side, record_file = generate(c, "a red circle moves left",
                                                        ["bf16", "nvfp4"])
    # the clips: one per method, named after it, valid mp4s of the requested size
    assert [Path(p).name for p in clips] == ["bf16.mp4", "nvfp4.mp4"]
    for p in clips:
        check_clip(p, 5, 32, 48)
    sbs = probe_mp4(side_by_side)
    assert sbs["frames"] == 5 and sbs["width"] > 2 * 48 and sbs["height"] > 32
    # the record: settings as asked, timings per method, PSNR/SSIM against BF16
    assert json.loads(Path(record_file).read_text()) == record
    assert record["prompt"] == "a red circle moves left" and record["seed"] == 11
    s = record["settings"]
    assert (s["height"], s["width"], s["frames"], s["steps"], s["fps"]) == (32, 48, 5, 2, 16)
    assert list(record["methods"]) == ["bf16", "nvfp4"]
    for m, entry in record["methods"].items():
        t = entry["timings"]
        assert t["denoising_s"] > 0 and t["decoding_s"] > 0 and t["attention_s"] > 0
        assert entry["transformer_calls"] == 4 and entry["peak_memory_bytes"] > 0
    nv = record["methods"]["nvfp4"]
    assert nv["ssim"] is not None and (nv["psnr"] is not None or nv["identical_to_bf16"])
    assert record["methods"]["bf16"]["psnr"] is None
    assert record["model_weights_note"]  # the tiny model says its weights are random


def test_bad_inputs_are_refused_with_a_message_and_the_app_keeps_serving(server):
    from gradio_client.exceptions import ValidationError

    c = client(server)
    cases = [(dict(resolution="100x100"), "resolution", "multiple of 16"),
             (dict(resolution="wide"), "resolution", "height×width"),
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


def test_failure_inside_generation_then_the_next_request_works(server):
    from gradio_client.exceptions import AppError

    c = client(server)
    runs_before = sorted(p.name for p in (server["out"] / "runs").iterdir())
    with pytest.raises(AppError) as info:
        generate(c, "a red circle", ["bf16", "sage3"], resolution="32x32")
    assert "Out of memory while generating with sage3 at 32×32×5" in str(info.value)
    assert "fewer frames" in str(info.value)
    # nothing half-written is left, and the next request is served
    assert sorted(p.name for p in (server["out"] / "runs").iterdir()) == runs_before
    record, clips, _, _ = generate(c, "a red circle", ["bf16", "nvfp4"], resolution="32x32")
    assert set(record["methods"]) == {"bf16", "nvfp4"}
    check_clip(clips[1], 5, 32, 32)


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
