"""What a rater sees, in headless Debian Chromium (Playwright, no downloaded browser)."""

from __future__ import annotations

import csv
import shutil
import sqlite3
import time

import pytest

from attnqat.cli import main as cli_main
from attnqat.eval import sources
from attnqat.eval.demo import LocalServer, write_demo_outputs

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
METHODS = ("bf16", "attnqat")
QUESTIONS = ("overall", "visual_quality", "motion", "text_alignment")

# Runs before the page's scripts: a capture-phase listener sees the video's "ended" event before
# the page's own handler, so it records whether the answers were still locked then.
RECORD_ENDED = """
window.__ended = [];
document.addEventListener('ended', function (e) {
  var inputs = Array.from(document.querySelectorAll('#vote input, #submit'));
  window.__ended.push({id: e.target.id, locked: inputs.length > 0 && inputs.every(function (i) {
    return i.disabled; })});
}, true);
"""

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(shutil.which("chromium") is None and not shutil.os.path.exists(CHROMIUM),
                       reason="Debian chromium is not installed (make browser)"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    write_demo_outputs(root / "runs", sources.read_prompts()[:6], methods=METHODS)
    return root


def build(runs, name: str, *extra: str):
    out = runs / name
    assert cli_main(["eval", "build", str(runs / "runs"), "--out", str(out), "--raters", "1",
                     "--quiet", *extra]) == 0
    (token,) = [r["token"] for r in csv.DictReader(open(out / "invites.csv"))]
    return out, token


def db(study, sql, *params):
    con = sqlite3.connect(study / "study.db")
    try:
        return con.execute(sql, params).fetchall()
    finally:
        con.close()


@pytest.fixture()
def chromium():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_rater_sees_prompt_and_one_blind_pair_locked_until_played(runs, chromium):
    study, token = build(runs, "study")
    prompts = set(sources.read_prompts()[:6])
    requested: list[str] = []
    with LocalServer(study) as server:  # the declared minimum viewing time (one play) applies
        page = chromium.new_page()
        page.set_default_timeout(30_000)
        page.add_init_script(RECORD_ENDED)
        page.on("request", lambda req: requested.append(req.url))
        response = page.goto(f"{server.url}/r/{token}")
        raw_html = response.text()
        page.wait_for_selector("#instructions:not([hidden])")  # the study's state has arrived
        assert page.inner_text("#practice-line") == "The first 2 pairs are practice and are not counted."
        page.get_by_role("button", name="Start").click()
        page.wait_for_selector("#task:not([hidden])")

        # The prompt and one side-by-side video captioned only A (left) and B (right).
        assert page.inner_text("#prompt") in prompts
        assert page.inner_text("#banner").startswith("Practice 1 of 2")
        captions = page.eval_on_selector_all(".pair .captions span", "els => els.map(e => e.textContent)")
        assert captions == ["A", "B"]
        assert page.is_hidden("#two")
        src = page.eval_on_selector("#video-pair", "v => v.src")
        assert "/media/" in src
        state = page.evaluate("""() => ({
            ended: window.__ended.length,
            inputs: Array.from(document.querySelectorAll('#vote input')).map(i => i.disabled),
            submit: document.getElementById('submit').disabled })""")
        if state["ended"] == 0:  # the pair has not finished: everything must be locked
            assert state["inputs"] and all(state["inputs"]) and state["submit"]
        page.keyboard.press("a")  # shortcuts do nothing while locked
        assert page.eval_on_selector_all("#vote input:checked", "els => els.length") == 0

        # The pair plays through; the answers unlock only after that.
        page.wait_for_function("() => document.body.dataset.locked === 'no'")
        first = page.evaluate("window.__ended")[0]
        assert first["id"] == "video-pair" and first["locked"]
        size = page.evaluate("""() => { const v = document.getElementById('video-pair');
                                return [v.videoWidth, v.videoHeight, v.duration]; }""")
        assert size[:2] == [192, 64] and size[2] > 1.0  # border, clip, gap, clip, border
        assert page.inner_text("#vote fieldset[data-question=overall]").count("Both are bad") == 1

        # Answer and submit: the next pair appears and the vote is stored.
        for q in QUESTIONS:
            page.check(f'input[name="{q}"][value="tie"]')
        assert not page.is_disabled("#submit")
        page.click("#submit")
        page.wait_for_function("() => document.getElementById('banner').textContent"
                               ".startsWith('Practice 2 of 2')")
        page_source = page.content()

        # The admin view (password) shows the rater's progress, the results and the exports;
        # a refused invite request shows the server's reason instead of failing silently.
        admin = chromium.new_context(http_credentials={"username": "admin",
                                                       "password": server.admin_password})
        admin_page = admin.new_page()
        admin_page.goto(f"{server.url}/admin")
        admin_page.wait_for_selector("#results table")
        row = admin_page.locator("#raters tbody tr").first.inner_text()
        assert row.startswith("rater-001") and token in row
        assert admin_page.locator("#items tbody tr").count() > 0
        assert "attnqat vs bf16" in admin_page.inner_text("#results")
        assert admin_page.get_attribute("#invite-count", "max") == "500"
        admin_page.fill("#invite-count", "501")
        admin_page.click("#invite-form button")
        admin_page.wait_for_function("() => document.getElementById('invite-error').textContent")
        assert "500" in admin_page.inner_text("#invite-error")
        assert admin_page.input_value("#invite-count") == "501"  # nothing the admin typed is lost
        with admin_page.expect_download() as download:
            admin_page.click("#export-csv")
        assert download.value.suggested_filename == "votes.csv"
        assert "overall_clicked" in open(download.value.path()).read()
    assert db(study, "SELECT COUNT(*) FROM votes")[0][0] == 1
    # Nothing the browser loaded names a method: page source, DOM and every URL requested.
    media = [u for u in requested if "/media/" in u]
    assert len(media) >= 2
    haystack = "\n".join([raw_html, page_source, *requested]).lower()
    for name in METHODS:
        assert name not in haystack, name


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_pair_that_does_not_load_can_be_reported_and_skipped(runs, chromium):
    study, token = build(runs, "broken", "--min-view", "0")
    with LocalServer(study, extra_args=["--load-timeout", "2"]) as server:
        page = chromium.new_page()
        page.set_default_timeout(30_000)
        page.goto(f"{server.url}/r/{token}")
        page.get_by_role("button", name="Start").click()
        page.wait_for_selector("#task:not([hidden])")
        # The queue is fixed now: the first pair's file never answers (a stalled connection),
        # the second one is corrupt on disk.
        (first, second) = [t for (t,) in db(study, (
            "SELECT v.token FROM assignments a JOIN videos v ON v.item_id = a.item_id AND "
            "v.a_on_left = a.a_on_left ORDER BY a.position LIMIT 2"))]
        (study / "media" / f"{second}.mp4").write_bytes(b"\x00\x00\x00\x18ftypisom" + b"\x00" * 600)
        page.route(f"**/media/{first}.mp4", lambda route: None)  # never fulfilled
        page.reload()
        page.wait_for_selector("#task:not([hidden])")
        start = time.monotonic()
        page.wait_for_selector("#load-problem:not([hidden])")
        assert time.monotonic() - start >= 1.5
        assert "did not load within 2 s" in page.inner_text("#status")
        assert page.is_disabled("#submit")
        page.click("#reload-pair")  # trying again stalls again
        assert page.is_hidden("#load-problem")
        page.wait_for_selector("#load-problem:not([hidden])")
        banner = page.inner_text("#banner")
        page.click("#report-broken")
        page.wait_for_function(f"() => document.getElementById('banner').textContent !== {banner!r}")
        # The corrupt file fails at once (an error, not a timeout): report it as well.
        page.wait_for_selector("#load-problem:not([hidden])")
        assert "could not be played" in page.inner_text("#status")
        banner = page.inner_text("#banner")
        page.click("#report-broken")
        page.wait_for_function(f"() => document.getElementById('banner').textContent !== {banner!r}")
        page.wait_for_function("() => document.body.dataset.locked === 'no'")  # a good pair plays
        admin = chromium.new_context(http_credentials={"username": "admin",
                                                       "password": server.admin_password})
        admin_page = admin.new_page()
        admin_page.goto(f"{server.url}/admin")
        admin_page.wait_for_selector("#reports tbody tr")
        assert admin_page.locator("#reports tbody tr").count() == 2
        assert "not_loading" in admin_page.inner_text("#reports")
    reasons = db(study, "SELECT reason FROM reports")
    assert reasons == [("not_loading",), ("not_loading",)]
    assert db(study, "SELECT COUNT(*) FROM assignments WHERE release_reason = 'broken'")[0][0] == 2


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_phone_layout_and_keyboard_answers(runs, chromium):
    study, token = build(runs, "phone", "--min-view", "0", "--practice", "1")
    with LocalServer(study) as server:
        page = chromium.new_page(viewport={"width": 390, "height": 844}, device_scale_factor=2)
        page.set_default_timeout(30_000)
        page.goto(f"{server.url}/r/{token}")
        page.wait_for_selector("#instructions:not([hidden])")
        assert page.inner_text("#practice-line") == "The first pair is practice and is not counted."
        page.get_by_role("button", name="Start").click()
        page.wait_for_selector("#task:not([hidden])")
        page.wait_for_function("() => document.body.dataset.locked === 'no'")
        # One screen: the pair, the prompt, all four questions and the submit button are inside
        # the 390 × 844 viewport without scrolling, and the pair spans the width.
        boxes = page.evaluate("""() => ['#video-pair', '#prompt', '#submit',
            ...Array.from(document.querySelectorAll('#vote fieldset')).map(
              f => `fieldset[data-question=${f.dataset.question}]`)].map(s => {
            const r = document.querySelector(s).getBoundingClientRect();
            return [s, r.left, r.top, r.right, r.bottom]; })""")
        assert len(boxes) == 3 + len(QUESTIONS)
        for name, left, top, right, bottom in boxes:
            assert 0 <= left and right <= 390 and 0 <= top and bottom <= 844, (name, top, bottom)
        video = boxes[0]
        assert video[3] - video[1] > 300
        assert page.evaluate("window.scrollY") == 0
        # Keyboard: each key answers the next open question; Backspace takes one back.
        for key in ("x", "s", "ArrowLeft", "a", "Backspace", "b"):
            page.keyboard.press(key)
        checked = dict(page.eval_on_selector_all(
            "#vote input:checked", "els => els.map(e => [e.name, e.value])"))
        assert checked == {"overall": "both_bad", "visual_quality": "tie", "motion": "left",
                           "text_alignment": "right"}
        page.click("#comment-box summary")
        page.fill("#comment", "the left one flickers")
        page.keyboard.press("Enter")  # in the comment box: a line break, not a submit
        page.click("body", position={"x": 5, "y": 5})
        page.keyboard.press("Enter")
        page.wait_for_function("() => document.getElementById('banner').textContent"
                               ".startsWith('Pair 1 of')")
    (row,) = db(study, "SELECT both_bad, overall, visual_quality_side, motion_side, "
                       "text_alignment_side, comment, view_seconds FROM votes")
    assert row[:5] == (1, "tie", "tie", "left", "right")
    assert row[5].startswith("the left one flickers") and row[6] > 1.0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_page_on_another_origin_cannot_drive_the_admin(runs, chromium):
    """The organiser is logged in to the admin view (basic auth) and opens a page served from
    another origin (another loopback port) that auto-submits forms and fires no-cors requests
    at the admin actions. Nothing changes; the organiser's own page still works."""
    import functools
    import http.server
    import threading

    from attnqat.eval.demo import free_port

    study, token = build(runs, "csrf-study", "--min-view", "0")
    (label,) = [r["label"] for r in csv.DictReader(open(study / "invites.csv"))]
    with LocalServer(study) as server:
        target = server.url
        evil_dir = runs / "evil"
        evil_dir.mkdir(exist_ok=True)
        (evil_dir / "index.html").write_text(f"""<!doctype html><html><body>
<iframe name="sink" style="display:none"></iframe>
<form id="revoke" method="POST" target="sink" action="{target}/admin/api/raters/{label}/revoke"></form>
<form id="exclude" method="POST" target="sink" enctype="text/plain"
      action="{target}/admin/api/raters/{label}/exclude"><input name='{{"excluded": true, "x": "' value='"}}'></form>
<form id="item" method="POST" target="sink" action="{target}/admin/api/items/1/exclude"></form>
<script>
document.getElementById("revoke").submit();
setTimeout(function () {{ document.getElementById("exclude").submit(); }}, 300);
setTimeout(function () {{ document.getElementById("item").submit(); }}, 600);
fetch("{target}/admin/api/invites", {{method: "POST", mode: "no-cors", credentials: "include",
  headers: {{"Content-Type": "text/plain"}}, body: '{{"count": 5}}'}}).catch(function () {{}});
setTimeout(function () {{ document.title = "done"; }}, 1500);
</script></body></html>""")
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(evil_dir))
        evil = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
        thread = threading.Thread(target=evil.serve_forever, daemon=True)
        thread.start()
        try:
            context = chromium.new_context(http_credentials={
                "username": "admin", "password": server.admin_password})
            page = context.new_page()
            page.goto(f"{server.url}/admin")  # logged in: the browser holds the password
            page.wait_for_selector("#raters tbody tr")
            attack = context.new_page()
            attack.goto(f"http://127.0.0.1:{evil.server_address[1]}/index.html")
            attack.wait_for_function("() => document.title === 'done'", timeout=30000)
            time.sleep(0.5)
            assert db(study, "SELECT excluded, revoked_at FROM raters WHERE label = ?", label) == [
                (0, None)]
            assert db(study, "SELECT count(*) FROM items WHERE excluded") == [(0,)]
            assert db(study, "SELECT count(*) FROM raters") == [(1,)]  # no invites made
            # The organiser's own page: the same action goes through.
            page.on("dialog", lambda d: d.accept())
            page.locator("#raters tbody tr").first.locator("button[data-action=revoke]").click()
            page.wait_for_function("() => document.querySelector('#raters tbody').innerText"
                                   ".includes('revoked')")
            assert db(study, "SELECT revoked_at IS NOT NULL FROM raters WHERE label = ?",
                      label) == [(1,)]
            context.close()
        finally:
            evil.shutdown()
            evil.server_close()
