"""What a person sees in the comparison app, in headless Debian Chromium (Playwright, no downloaded
browser): bad input and a failure explained in the page, a generation that plays in sync and
loops, the comparison view (frame stepping, scrubbing, the split and the zoom), blind mode, the
queue position while waiting, Stop, and no request leaving 127.0.0.1 (neither from the page nor
from the server)."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LABELS = ("bf16", "nvfp4", "sage3", "attnqat", "BF16", "NVFP4", "SageAttention3", "Attn-QAT")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which("chromium") is None and not Path(CHROMIUM).exists(),
                       reason="Debian chromium is not installed (make browser)"),
]

_LOCAL = {"127.0.0.1", "::1", "localhost", "", None}


class NetGuard:
    """Records every connection or name lookup of this process that is not loopback."""

    def __init__(self):
        self.hits: list[str] = []

    def install(self, monkeypatch):
        real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
        real_getaddrinfo = socket.getaddrinfo
        guard = self

        def check(sock, address):
            if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in _LOCAL:
                guard.hits.append(f"connect {address}")

        def connect(sock, address):
            check(sock, address)
            return real_connect(sock, address)

        def connect_ex(sock, address):
            check(sock, address)
            return real_connect_ex(sock, address)

        def getaddrinfo(host, *args, **kwargs):
            h = host.decode() if isinstance(host, bytes) else host
            if h not in _LOCAL:
                guard.hits.append(f"lookup {h}")
            return real_getaddrinfo(host, *args, **kwargs)

        monkeypatch.setattr(socket.socket, "connect", connect)
        monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
        monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from attnqat.app.service import load_service
    from attnqat.app.ui import build_app, launch

    mp = pytest.MonkeyPatch()
    guard = NetGuard()
    guard.install(mp)
    with socket.socket() as s:  # the guard sees a non-loopback address (0.0.0.0 stays local)
        s.settimeout(1)
        s.connect_ex(("0.0.0.0", 9))
    assert guard.hits == ["connect ('0.0.0.0', 9)"]
    guard.hits.clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("browser-app")
    service = load_service(device="cpu", output_dir=root / "out", keep=5)
    demo = build_app(service, queue_size=4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch(demo, service, host="127.0.0.1", port=port, block=False, quiet=True)
    try:
        yield {"url": f"http://127.0.0.1:{port}/", "service": service, "guard": guard,
               "root": root}
    finally:
        demo.close()
        service.close()
        mp.undo()
        torch.set_num_threads(threads)


def _wait_text(page, selector: str, text: str, timeout: int = 30_000) -> str:
    """Wait until ``selector``'s text contains ``text``; returns its text."""
    page.wait_for_function("([s, t]) => (document.querySelector(s) || {}).innerText?.includes(t)",
                           arg=[selector, text], timeout=timeout)
    return page.inner_text(selector)


def _wait_status(page, text: str, timeout: int = 120_000) -> str:
    """Wait until the status box contains ``text``; returns its text."""
    page.wait_for_function("t => (document.querySelector('#aq-status') || {}).innerText"
                           "?.includes(t)", arg=text, timeout=timeout)
    return page.inner_text("#aq-status")


def set_field(page, elem: str, value: str) -> None:
    """Type into a field and leave it (Gradio commits a number box on Enter and on blur)."""
    box = f"{elem} textarea, {elem} input"
    page.fill(box, value)
    page.press(box, "Enter")
    page.press(box, "Tab")


def _not_blank(png: Path, box: dict | None = None) -> None:
    from PIL import Image

    img = np.asarray(Image.open(png).convert("RGB")).astype(np.float32)
    assert img.std() > 10, "the screenshot is blank"
    if box is not None:  # the first video's area shows an image, not a flat colour
        x, y, w, h = (int(box[k]) for k in ("x", "y", "width", "height"))
        region = img[y:y + h, x:x + w]
        assert region.size and region.std() > 5, "the video area is flat"


def test_page_generates_plays_in_sync_blind_mode_and_stays_local(app, tmp_path):
    from playwright.sync_api import sync_playwright

    from attnqat.app.service import Fault

    url, service = app["url"], app["service"]
    requested: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 1000})
            page.set_default_timeout(60_000)
            page.on("request", lambda r: requested.append(r.url))
            page.goto(url)
            page.wait_for_selector("#aq-generate")
            # The page says what the loaded weights are and which precision runs.
            header = page.inner_text("#aq-header")
            # (#34: the note is shown for people — dates, thousands separators — its first
            # clause in the box and the counts in a fold)
            from attnqat.app.player import humanize_note, note_parts

            what = note_parts(humanize_note(f"Model: {service.info.weights_note}"))[1]
            assert what in header and "About these weights" in header
            assert f"Precision: {str(service.models.dtype).removeprefix('torch.')}" in header
            assert "Attn-QAT fine-tuned" in page.inner_text("#aq-methods")

            # Empty prompt: a message in the page, nothing generated.
            page.click("#aq-generate")
            _wait_status(page, "enter a prompt")
            assert page.locator(".aq-player video").count() == 0

            # The Advanced accordion: numbers are refused on their field, never clamped or rounded.
            page.fill("#aq-prompt textarea", "a red circle moves left on a blue background")
            page.click("#aq-advanced .label-wrap")
            for elem, value, fragment in (("#aq-steps", "2.5", "a whole number"),
                                          ("#aq-frames", "0", "4k+1"),
                                          ("#aq-seed", "12abc", "an integer")):
                set_field(page, elem, value)
                _wait_text(page, "#aq-plan", fragment)  # what will (not) run, as it is typed
                page.click("#aq-generate")
                _wait_status(page, fragment)
                _wait_text(page, elem, fragment)  # the message sits on the field
                set_field(page, elem, {"#aq-steps": "2", "#aq-frames": "17", "#aq-seed": "-1"}[elem])
            big = str(2 ** 63 - 1)
            set_field(page, "#aq-seed", big)
            set_field(page, "#aq-resolution", "64x64")
            plan = _wait_text(page, "#aq-plan", "64×64 (width×height), 17 frames")
            assert f"seed {big}" in plan and "2 steps" in plan

            # A failure inside generation (simulated out-of-memory in SageAttention3): a message.
            service.fault = Fault("oom", "sage3")
            page.click("#aq-generate")
            text = _wait_status(page, "Out of memory")
            assert "Out of memory while generating with sage3 at 64×64×17" in text
            assert "ready for the next request" in text
            service.fault = None

            # The next request: two methods, the largest seed exactly as typed.
            for name in ("SageAttention3", "Attn-QAT", "SageBwd (INT8)"):
                page.locator(f"#aq-methods label:has-text('{name}') input").uncheck()
            page.click("#aq-generate")
            _wait_status(page, "Generated 2 clips")
            assert page.locator(".aq-player video.aq-main").count() == 2
            # both clips play, loop, and stay together
            page.wait_for_function("() => Number(document.querySelector('.aq-player')"
                                   ".dataset.loops || 0) >= 2", timeout=30_000)
            state = page.evaluate("""() => Array.from(document.querySelectorAll('.aq-player video'))
                .map(v => ({t: v.currentTime, paused: v.paused, w: v.videoWidth, h: v.videoHeight,
                            d: v.duration}))""")
            assert len(state) == 4  # two in the row, two in the comparison view
            assert all(not s["paused"] for s in state)
            assert all((s["w"], s["h"]) == (64, 64) for s in state)
            assert all(abs(s["d"] - 17 / 16) < 0.1 for s in state)
            assert max(s["t"] for s in state) - min(s["t"] for s in state) < 0.25
            labels = page.eval_on_selector_all(".aq-clip", "els => els.map(e => e.dataset.method)")
            assert labels == ["bf16", "nvfp4"]
            cards = page.inner_text(".aq-row")
            for row in ("PSNR vs BF16", "Total", "Denoising", "Decoding"):
                assert row in cards
            seed_used = page.input_value("#aq-seed-used input, #aq-seed-used textarea")
            assert seed_used == big and f"seed {big}" in page.inner_text("#aq-status")
            assert page.is_visible("#aq-files")
            shot = tmp_path / "page.png"
            page.screenshot(path=str(shot), full_page=True)
            _not_blank(shot, page.locator(".aq-player video").first.bounding_box())

            # Frame by frame: every clip (the comparison view's too) shows the same frame.
            page.click(".aq-player .aq-next")
            page.wait_for_selector(".aq-player[data-state='paused']")
            first = int(page.get_attribute(".aq-player", "data-frame"))
            for _ in range(3):
                page.click(".aq-player .aq-next")
            assert int(page.get_attribute(".aq-player", "data-frame")) == min(first + 3, 16)
            page.click(".aq-player .aq-prev")
            frame = min(first + 3, 16) - 1
            times = page.evaluate("() => Array.from(document.querySelectorAll('.aq-player video'))"
                                  ".map(v => v.currentTime)")
            assert all(abs(t - (frame + 0.5) / 16) < 1e-3 for t in times), (frame, times)
            assert page.inner_text(".aq-player .aq-frame") == f"frame {frame + 1}/17"
            # Scrubbing to the last frame.
            page.eval_on_selector(".aq-scrub", "el => { el.value = '16'; "
                                  "el.dispatchEvent(new Event('input', {bubbles: true})); }")
            assert page.get_attribute(".aq-player", "data-frame") == "16"
            times = page.evaluate("() => Array.from(document.querySelectorAll('.aq-player video'))"
                                  ".map(v => v.currentTime)")
            assert all(abs(t - 16.5 / 16) < 1e-3 for t in times)
            # The comparison view: the split wipes between the two clips, the zoom enlarges them.
            page.eval_on_selector(".aq-split", "el => { el.value = '25'; "
                                  "el.dispatchEvent(new Event('input', {bubbles: true})); }")
            assert page.get_attribute(".aq-stage", "data-split") == "25"
            assert "75%" in page.eval_on_selector(".aq-cmp-a", "v => v.style.clipPath")
            page.select_option(".aq-zoom", "4")
            assert page.eval_on_selector(".aq-cmp-b", "v => v.style.transform") == "scale(4)"
            srcs = page.eval_on_selector_all(".aq-player video.aq-main", "vs => vs.map(v => v.src)")
            assert page.eval_on_selector(".aq-cmp-a", "v => v.src") == srcs[0]
            assert page.eval_on_selector(".aq-cmp-b", "v => v.src") == srcs[1]
            page.select_option(".aq-cmp-left", "1")  # NVFP4 on both sides now
            page.wait_for_function("s => document.querySelector('.aq-cmp-a').src === s", arg=srcs[1])
            # Reuse this seed.
            set_field(page, "#aq-seed", "-1")
            page.click("#aq-reuse-seed")
            page.wait_for_function("s => document.querySelector('#aq-seed textarea, #aq-seed input')"
                                   ".value === s", arg=big)

            # Blind mode: shuffled, unlabelled, no method in the player's HTML or its URLs.
            page.check("#aq-blind input")
            page.wait_for_selector(".aq-player[data-blind='yes']")
            blind_html = page.inner_html("#aq-player")
            assert not any(lab in blind_html for lab in LABELS)
            assert page.eval_on_selector_all(".aq-label", "els => els.map(e => e.textContent)") \
                == ["Clip A", "Clip B"]
            srcs = page.eval_on_selector_all(".aq-player video", "els => els.map(v => v.src)")
            assert len(srcs) == 4 and not any(lab.lower() in s.lower() for s in srcs for lab in LABELS)
            assert not page.is_visible("#aq-files")
            page.wait_for_function("() => Array.from(document.querySelectorAll('.aq-player video'))"
                                   ".every(v => !v.paused && v.currentTime > 0)")
            page.click("#aq-reveal")
            page.wait_for_selector(".aq-player[data-blind='no'] .aq-clip[data-method]")
            revealed = page.eval_on_selector_all(".aq-clip", "els => els.map(e => e.dataset.method)")
            assert sorted(revealed) == ["bf16", "nvfp4"]
        finally:
            browser.close()
    # Nothing left 127.0.0.1: not the page, not the server.
    outside = [u for u in requested if not u.startswith((url, "data:", "blob:"))]
    assert outside == [], outside
    assert app["guard"].hits == []


def test_a_waiting_request_shows_its_queue_position_and_stop_cancels(app):
    from playwright.sync_api import sync_playwright

    url = app["url"]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            first, second = (browser.new_page(viewport={"width": 1300, "height": 1000})
                             for _ in range(2))
            for page in (first, second):
                page.set_default_timeout(60_000)
                page.goto(url)
                page.wait_for_selector("#aq-generate")
                page.fill("#aq-prompt textarea", "a blue square moves up")
                page.click("#aq-advanced .label-wrap")
                set_field(page, "#aq-resolution", "32x32")
                set_field(page, "#aq-frames", "5")
            set_field(first, "#aq-steps", "100")  # long enough to be waited for
            set_field(second, "#aq-steps", "2")
            first.click("#aq-generate")
            _wait_status(first, "step ")
            second.click("#aq-generate")
            text = _wait_status(second, "queue: 1/")  # the position, while it waits
            assert "Queued" in text
            # the running one has an estimate of the time left
            first.wait_for_function("() => /about \\d+ s left/.test("
                                    "document.querySelector('#aq-status').innerText)")
            first.click("#aq-stop")
            _wait_status(first, "Stopped")
            # the waiting one starts and finishes; the stopped one left no result
            _wait_status(second, "Generated 5 clips")  # every method the registry offers
            assert first.locator(".aq-player video").count() == 0
            # long after the stop, Stopped is still the last word (not a progress update the
            # stopped stream had already sent)
            assert "Stopped" in first.inner_text("#aq-status")
        finally:
            browser.close()
