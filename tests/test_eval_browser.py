"""What a rater sees, in headless Debian Chromium (Playwright, no downloaded browser)."""

from __future__ import annotations

import csv
import shutil
import sqlite3

import pytest

from attnqat.cli import main as cli_main
from attnqat.eval import sources
from attnqat.eval.demo import LocalServer, write_demo_outputs

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
METHODS = ("bf16", "attnqat")

# Runs before the page's scripts: a capture-phase listener sees each video's "ended" event
# before the page's own handler, so it records whether the answers were still locked then.
RECORD_ENDED = """
window.__ended = [];
document.addEventListener('ended', function (e) {
  var inputs = Array.from(document.querySelectorAll('#vote input, #submit'));
  var other = document.getElementById(e.target.id === 'video-left' ? 'video-right' : 'video-left');
  window.__ended.push({id: e.target.id, locked: inputs.length > 0 && inputs.every(function (i) {
    return i.disabled; }), otherLeft: other.ended ? 0 : other.duration - other.currentTime});
}, true);
"""

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(shutil.which("chromium") is None and not shutil.os.path.exists(CHROMIUM),
                       reason="Debian chromium is not installed (make browser)"),
]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    write_demo_outputs(root / "runs", sources.read_prompts()[:3], methods=METHODS)
    out = root / "study"
    assert cli_main(["eval", "build", str(root / "runs"), "--out", str(out), "--raters", "1",
                     "--quiet"]) == 0
    return out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_rater_sees_prompt_and_two_blind_videos_locked_until_played(study):
    from playwright.sync_api import sync_playwright

    (token,) = [r["token"] for r in csv.DictReader(open(study / "invites.csv"))]
    prompts = set(sources.read_prompts()[:3])
    requested: list[str] = []
    with LocalServer(study) as server, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(30_000)
            page.add_init_script(RECORD_ENDED)
            page.on("request", lambda req: requested.append(req.url))
            response = page.goto(f"{server.url}/r/{token}")
            raw_html = response.text()
            page.get_by_role("button", name="Start").click()
            page.wait_for_selector("#task:not([hidden])")

            # The prompt and two videos labelled only A and B.
            assert page.inner_text("#prompt") in prompts
            assert page.inner_text("#banner").startswith("Practice 1 of 2")
            captions = page.eval_on_selector_all("figcaption", "els => els.map(e => e.textContent)")
            assert captions == ["A", "B"]
            sources_ = page.eval_on_selector_all("video", "els => els.map(v => v.src)")
            assert len(sources_) == 2 and all("/media/" in s for s in sources_)
            state = page.evaluate("""() => ({
                ended: window.__ended.length,
                inputs: Array.from(document.querySelectorAll('#vote input')).map(i => i.disabled),
                submit: document.getElementById('submit').disabled })""")
            if state["ended"] == 0:  # neither clip has finished: everything must be locked
                assert state["inputs"] and all(state["inputs"]) and state["submit"]

            # Both clips play through; the answers unlock only after that.
            page.wait_for_function("() => document.body.dataset.locked === 'no'")
            ended = page.evaluate("window.__ended")
            first_two = ended[:2]
            assert {e["id"] for e in first_two} == {"video-left", "video-right"}
            assert all(e["locked"] for e in first_two)  # still locked when each clip ended
            # Started in sync: when the first clip ends, the other is (almost) at its end too.
            assert first_two[0]["otherLeft"] < 0.5
            times = page.evaluate("""() => [document.getElementById('video-left').duration,
                                            document.getElementById('video-right').duration]""")
            assert all(t > 1.0 for t in times)  # they really are the 17-frame clips

            # Answer and submit: the next pair appears and the vote is stored.
            for q in ("overall", "visual_quality", "motion", "text_alignment"):
                page.check(f'input[name="{q}"][value="tie"]')
            assert not page.is_disabled("#submit")
            page.click("#submit")
            page.wait_for_function("() => document.getElementById('banner').textContent"
                                   ".startsWith('Practice 2 of 2')")
            page_source = page.content()

            # The admin view (password) shows the rater's progress and the results table.
            admin = browser.new_context(http_credentials={"username": "admin",
                                                          "password": server.admin_password})
            admin_page = admin.new_page()
            admin_page.goto(f"{server.url}/admin")
            admin_page.wait_for_selector("#results table")
            row = admin_page.locator("#raters tbody tr").first.inner_text()
            assert row.startswith("rater-001") and token in row
            assert admin_page.locator("#items tbody tr").count() > 0
            assert "attnqat vs bf16" in admin_page.inner_text("#results")
        finally:
            browser.close()
    con = sqlite3.connect(study / "study.db")
    assert con.execute("SELECT COUNT(*) FROM votes").fetchone()[0] == 1
    con.close()
    # Nothing the browser loaded names a method: page source, DOM and every URL requested.
    media = [u for u in requested if "/media/" in u]
    assert len(media) >= 4
    haystack = "\n".join([raw_html, page_source, *requested]).lower()
    for name in METHODS:
        assert name not in haystack, name
