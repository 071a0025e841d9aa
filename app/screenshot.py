"""Take the README's and docs/app.md's screenshot of the app: ``python -m attnqat.app.screenshot``.

Starts the app on loopback with the embedded tiny model on the CPU, drives headless Chromium
(Playwright with Debian's ``/usr/bin/chromium``, or ``--chromium``) through one generation with
every method and the attention-error map, pauses the players on one frame and saves a full-page
PNG. Needs no GPU and no network; takes a few minutes on a small CPU.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnqat.app.screenshot", description=__doc__)
    p.add_argument("--out", default="docs/app_screenshot.png", help="PNG to write")
    p.add_argument("--chromium", default="/usr/bin/chromium", help="Chromium executable")
    p.add_argument("--prompt", default="a red circle moves left on a blue background")
    p.add_argument("--resolution", default="128x128", help="width x height of the clips")
    p.add_argument("--frames", default="17")
    p.add_argument("--steps", default="12")
    p.add_argument("--seed", default="7")
    p.add_argument("--width", type=int, default=1320, help="browser window width")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if not Path(args.chromium).exists():
        print(f"screenshot: error: no Chromium at {args.chromium} (apt install chromium, or "
              "--chromium PATH)", file=sys.stderr)
        return 2

    import torch
    from playwright.sync_api import sync_playwright

    from attnqat.video import palette_png

    from .service import load_service
    from .ui import build_app, launch

    torch.set_num_threads(args.threads)
    service = load_service(device="cpu", keep=2)
    demo = build_app(service)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch(demo, service, host="127.0.0.1", port=port, block=False, quiet=True)
    t0 = time.monotonic()
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium, args=ARGS)
            page = browser.new_page(viewport={"width": args.width, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_selector("#aq-generate")
            page.fill("#aq-prompt textarea", args.prompt)
            page.click("#aq-advanced .label-wrap")
            for elem, value in (("#aq-seed", args.seed), ("#aq-steps", args.steps),
                                ("#aq-frames", args.frames), ("#aq-resolution", args.resolution)):
                box = f"{elem} textarea, {elem} input"
                page.fill(box, value)
                page.press(box, "Enter")
                page.press(box, "Tab")
            page.check("#aq-errmap-on input")
            page.click("#aq-generate")
            page.wait_for_function("() => (document.querySelector('#aq-status') || {})"
                                   ".innerText?.includes('Generated')", timeout=1_800_000)
            page.wait_for_selector("#aq-errmap .aq-heat")
            page.wait_for_function("() => Number(document.querySelector('.aq-player')"
                                   ".dataset.loops || 0) >= 1", timeout=60_000)
            page.eval_on_selector(".aq-scrub", "el => { el.value = String(Math.floor(el.max * 0.6));"
                                  " el.dispatchEvent(new Event('input', {bubbles: true})); }")
            page.eval_on_selector_all(".aq-receipt", "els => els.forEach(e => { e.open = true; })")
            page.click("#aq-advanced .label-wrap")  # fold the settings again
            page.wait_for_timeout(800)
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out), full_page=True)
            browser.close()
        palette_png(out)   # a 256-colour palette: a third of the bytes
    finally:
        demo.close()
        service.close()
    print(f"wrote {args.out} in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
