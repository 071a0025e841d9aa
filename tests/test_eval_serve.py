"""The rater app over real HTTP on loopback: end to end, blindness, refusals, load and faults.

Every server runs in a child process (``attnqat eval serve``) on 127.0.0.1 and a free port, so a
test can kill it with SIGKILL and start it again on the same study.
"""

from __future__ import annotations

import csv
import json
import shutil
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest

from attnqat.cli import main as cli_main
from attnqat.eval import media, sources
from attnqat.eval.demo import LocalServer, write_demo_outputs

pytestmark = pytest.mark.subprocess   # every test talks to `attnqat eval serve` in a child process

METHODS = ("bf16", "attnqat", "nvfp4")
CRIT_KEYS = ("visual_quality", "motion", "text_alignment")
TIMEOUT = httpx.Timeout(30.0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_runs")
    write_demo_outputs(root, sources.read_prompts()[:6], methods=METHODS)
    return root


def build(runs: Path, out: Path, *extra: str) -> Path:
    """A study of the demo runs. Votes in these tests come at once, so the minimum viewing time
    is off unless a test asks for it (``--min-view`` in ``extra`` wins: argparse keeps the last)."""
    args = ["eval", "build", str(runs), "--out", str(out), "--quiet", "--min-view", "0", *extra]
    assert cli_main(args) == 0
    return out


def invites(study: Path) -> list[tuple[str, str]]:
    return [(r["label"], r["token"]) for r in csv.DictReader(open(study / "invites.csv"))]


class RaterClient:
    """A rater speaking the documented JSON API."""

    def __init__(self, url: str, token: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=TIMEOUT)
        self.token = token
        self.base = f"/api/r/{token}"

    def state(self) -> dict:
        return self.http.get(f"{self.base}/state").raise_for_status().json()

    def start(self) -> dict:
        return self.http.post(f"{self.base}/start").raise_for_status().json()

    def current(self) -> dict:
        return self.http.get(f"{self.base}/current").raise_for_status().json()

    def vote(self, assignment: str, click: str, criteria: dict | None = None,
             comment: str | None = None) -> httpx.Response:
        criteria = criteria or {k: ("tie" if click == "both_bad" else click) for k in CRIT_KEYS}
        body = {"assignment": assignment, "overall": click, "criteria": criteria}
        if comment is not None:
            body["comment"] = comment
        return self.http.post(f"{self.base}/vote", json=body)

    def report(self, assignment: str, reason: str = "not_loading") -> httpx.Response:
        return self.http.post(f"{self.base}/report", json={"assignment": assignment,
                                                            "reason": reason})

    def close(self) -> None:
        self.http.close()


def db_rows(study: Path, sql: str, *params) -> list[tuple]:
    con = sqlite3.connect(study / "study.db", timeout=30)
    try:
        return con.execute(sql, params).fetchall()
    finally:
        con.close()


def admin_client(server: LocalServer) -> httpx.Client:
    """The organiser's API client: the password, and the CSRF token every POST must carry."""
    auth = ("admin", server.admin_password)
    csrf = httpx.get(f"{server.url}/admin/api/csrf", auth=auth, timeout=TIMEOUT).raise_for_status().json()
    return httpx.Client(base_url=server.url, auth=auth, timeout=TIMEOUT,
                        headers={csrf["header"]: csrf["token"]})


# ------------------------------------------------------------------------------- end to end

@pytest.mark.slow
def test_two_raters_end_to_end_and_report_reproduces_votes(runs, tmp_path, capsys):
    study = build(runs, tmp_path / "study", "--pairs", "attnqat:bf16", "--raters", "2",
                  "--ratings-per-item", "2", "--min-check-accuracy", "0", "--n-boot", "200")
    clicks: list[tuple[str, str, str]] = []  # (rater label, assignment token, click)
    with LocalServer(study) as server:
        for n, (label, token) in enumerate(invites(study)):
            rater = RaterClient(server.url, token)
            assert rater.state()["stage"] == "instructions"
            assert rater.start()["stage"] == "practice"
            i = 0
            while not (cur := rater.current())["done"]:
                click = "left" if n == 0 else ("left", "tie", "right")[i % 3]
                assert rater.vote(cur["assignment"], click).status_code == 200
                clicks.append((label, cur["assignment"], click))
                i += 1
            assert rater.state()["stage"] == "done"
            rater.close()
        admin = httpx.get(server.url + "/admin/api/results", auth=("admin", server.admin_password),
                          timeout=TIMEOUT).json()
    # Independent resolution of each click from the raw tables.
    meaning = {tok: (kind, a_left) for tok, kind, a_left in db_rows(
        study, "SELECT a.token, i.kind, a.a_on_left FROM assignments a JOIN items i ON i.id = a.item_id")}
    expected = {"win": 0, "tie": 0, "lose": 0}
    for _, tok, click in clicks:
        kind, a_left = meaning[tok]
        if kind == "main":
            expected["tie" if click == "tie" else "win" if (click == "left") == bool(a_left) else "lose"] += 1
    capsys.readouterr()
    assert cli_main(["eval", "report", "--study", str(study)]) == 0
    results = json.loads((study / "report" / "results.json").read_text())
    assert results["pairs"]["attnqat vs bf16"]["questions"]["overall"]["counts"] == expected
    assert admin["pairs"]["attnqat vs bf16"]["questions"]["overall"]["counts"] == expected
    exported = list(csv.DictReader(open(study / "report" / "votes.csv")))
    assert sorted((r["rater"], r["overall_clicked"]) for r in exported) == sorted(
        (label, click) for label, _, click in clicks)


# ------------------------------------------------------------------------------- blindness and refusals

@pytest.fixture(scope="module")
def served(runs, tmp_path_factory):
    study = build(runs, tmp_path_factory.mktemp("served") / "study", "--name",
                  "attnqat-vs-bf16-and-nvfp4", "--raters", "3", "--ratings-per-item", "20")
    server = LocalServer(study).start()
    yield study, server
    server.stop()


def test_unknown_tokens_are_refused(served):
    _, server = served
    http = httpx.Client(base_url=server.url, timeout=TIMEOUT)
    assert http.get("/r/not-a-real-token").status_code == 403
    for method, path in [("GET", "state"), ("POST", "start"), ("GET", "current")]:
        assert http.request(method, f"/api/r/guess/{path}").status_code == 403
    r = http.post("/api/r/guess/vote", json={"assignment": "x", "overall": "tie",
                                             "criteria": {k: "tie" for k in CRIT_KEYS}})
    assert r.status_code == 403 and r.json() == {"error": "unknown invite token"}


def test_vote_for_an_item_not_assigned_is_refused(served):
    study, server = served
    (_, t1), (_, t2), _ = invites(study)
    alice, bob = RaterClient(server.url, t1), RaterClient(server.url, t2)
    alice.start(), bob.start()
    bobs_item = bob.current()["assignment"]
    r = alice.vote(bobs_item, "left")
    assert r.status_code == 403 and "not assigned" in r.json()["error"]
    r = alice.vote("forged-assignment-token", "left")
    assert r.status_code == 403
    assert db_rows(study, "SELECT COUNT(*) FROM votes")[0][0] == 0
    # Malformed answers are refused too, and the item stays open.
    mine = alice.current()["assignment"]
    assert alice.vote(mine, "A").status_code == 422
    assert alice.vote(mine, "left", {"motion": "tie"}).status_code == 422
    assert alice.vote(mine, "left").status_code == 200
    assert alice.vote(mine, "left").status_code == 409  # a second vote never counts
    assert db_rows(study, "SELECT COUNT(*) FROM votes")[0][0] == 1


@pytest.mark.parametrize("path", [
    "/media/../study.db", "/media/..%2Fstudy.db", "/media/%2e%2e/study.db", "/media/%2e%2e%2fstudy.db",
    "/media/..%5cstudy.db", "/media/study.db", "/media//etc/passwd", "/media/%2Fetc%2Fpasswd",
    "/media/../../../../etc/passwd", "/media/" + "0" * 32 + ".mp4", "/static/../study.db",
    "/static/..%2F..%2Fstudy.db", "/study.db", "/invites.csv", "/media/../invites.csv",
])
def test_paths_outside_the_study_media_cannot_be_requested(served, path):
    _, server = served
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        r = http.get(path)
    assert r.status_code in (400, 403, 404)
    assert b"SQLite format" not in r.content and b"root:" not in r.content
    assert b"token" not in r.content


def test_nothing_a_rater_receives_names_a_method(served):
    study, server = served
    _, _, (_, token) = invites(study)
    rater = RaterClient(server.url, token)
    seen: list[bytes] = []
    http = rater.http
    for path in (f"/r/{token}", "/", "/static/compare.js", "/static/compare.css",
                 "/static/enter.js"):
        r = http.get(path)
        assert r.status_code == 200
        seen += [r.content, str(r.headers).encode()]
    seen.append(json.dumps(rater.state()).encode())
    seen.append(json.dumps(rater.start()).encode())
    sizes, layouts = set(), set()
    while not (cur := rater.current())["done"]:
        seen.append(json.dumps(cur).encode())
        assert "left" not in cur and "right" not in cur  # one side-by-side video per pair
        assert cur["video"].startswith("/media/") and len(cur["video"]) == len("/media/") + 36
        clip = http.get(cur["video"])
        assert clip.status_code == 200 and clip.headers["content-type"] == "video/mp4"
        assert "etag" not in clip.headers and "last-modified" not in clip.headers
        sizes.add(int(clip.headers["content-length"]))
        layout = media.container_layout_of(clip.content)
        layouts.add(layout)
        seen += [layout, str(clip.headers).encode(), cur["video"].encode()]
        last_url = cur["video"]
        r = rater.vote(cur["assignment"], "tie")
        seen += [r.content, str(r.headers).encode()]
    assert len(sizes) == 1 and len(layouts) == 1  # every video: one size, one container
    blob = b"\n".join(seen).lower()
    for name in (*METHODS, "degraded", "check_identical", "study.db"):
        assert name.encode() not in blob, name
    # Range requests work (browsers seek and loop with them).
    part = http.get(last_url, headers={"Range": "bytes=0-99"})
    assert part.status_code == 206 and len(part.content) == 100


def test_admin_needs_the_password(served):
    study, server = served
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        for path in ("/admin", "/admin/api/progress", "/admin/api/results", "/admin/api/votes"):
            assert http.get(path).status_code == 401
            assert http.get(path, auth=("admin", "wrong")).status_code == 401
            assert http.get(path, auth=("admin", server.admin_password)).status_code == 200
        progress = http.get("/admin/api/progress", auth=("admin", server.admin_password)).json()
        assert progress["study"] == "attnqat-vs-bf16-and-nvfp4"
        assert {r["label"] for r in progress["raters"]} >= {"rater-001", "rater-002", "rater-003"}
        assert {i["kind"] for i in progress["items"]} >= {"main", "practice", "check_identical"}
        assert http.post("/admin/api/invites", json={"count": 2}).status_code == 401
        csrf = http.get("/admin/api/csrf", auth=("x", server.admin_password)).json()
        new = http.post("/admin/api/invites", json={"count": 2}, auth=("x", server.admin_password),
                        headers={csrf["header"]: csrf["token"]}).json()["invites"]
        assert len(new) == 2
        assert http.get(new[0]["link"]).status_code == 200  # a new invite works at once
    assert {t for _, t in invites(study)} >= {i["token"] for i in new}


def test_admin_actions_need_this_origin_the_csrf_token_and_a_json_body(served):
    """The organiser's browser sends the basic-auth password with any request to the server,
    a form on another site included: the password alone changes nothing."""
    study, server = served
    with admin_client(server) as admin:
        (new,) = admin.post("/admin/api/invites", json={"count": 1}).json()["invites"]
        label = new["label"]
        token = admin.headers["X-CSRF-Token"]
    password = ("admin", server.admin_password)
    with httpx.Client(base_url=server.url, auth=password, timeout=TIMEOUT) as http:
        # No token (what a cross-site form sends): refused, nothing revoked or excluded.
        for action in ("revoke", "release", "exclude"):
            r = http.post(f"/admin/api/raters/{label}/{action}")
            assert r.status_code == 403 and "CSRF" in r.json()["error"], r.text
        r = http.post("/admin/api/invites", json={"count": 1})
        assert r.status_code == 403
        # The token, but from another origin: refused.
        for headers in ({"Origin": "http://127.0.0.1:1"}, {"Origin": "null"},
                        {"Sec-Fetch-Site": "cross-site"}, {"Referer": "http://evil.example/x"}):
            r = http.post(f"/admin/api/raters/{label}/revoke",
                          headers={"X-CSRF-Token": token, **headers})
            assert r.status_code == 403 and "cross-origin" in r.json()["error"], headers
        # The token and this origin, but an empty or non-JSON body: nobody is excluded.
        same = {"X-CSRF-Token": token, "Origin": server.url}
        r = http.post(f"/admin/api/raters/{label}/exclude", headers=same)
        assert r.status_code == 422 and "excluded" in r.json()["error"]
        r = http.post(f"/admin/api/raters/{label}/exclude", headers=same, json={})
        assert r.status_code == 422 and "excluded" in r.json()["error"]
        r = http.post(f"/admin/api/raters/{label}/exclude", content=b"excluded=true",
                      headers={**same, "Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 415
        r = http.post("/admin/api/items/1/exclude", headers=same)
        assert r.status_code == 422
    assert db_rows(study, "SELECT excluded, revoked_at FROM raters WHERE label = ?", label) == [
        (0, None)]
    assert db_rows(study, "SELECT excluded FROM items WHERE id = 1") == [(0,)]
    with admin_client(server) as admin:  # the organiser's own page and API still work
        r = admin.post(f"/admin/api/raters/{label}/exclude", headers={"Origin": server.url},
                       json={"excluded": True, "reason": "test"})
        assert r.status_code == 200 and r.json()["excluded"] is True


def test_errors_are_json_with_an_error_key_and_one_invite_limit(served):
    study, server = served
    (_, token), *_ = invites(study)
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        for body, where in [({"overall": "tie"}, "assignment"), ({"assignment": "x"}, "overall"),
                            ({"assignment": "x", "overall": "tie", "criteria": "all"}, "criteria")]:
            r = http.post(f"/api/r/{token}/vote", json=body)
            assert r.status_code == 422 and where in r.json()["error"], r.text
            assert set(r.json()) == {"error"}
        r = http.post(f"/api/r/{token}/vote", content=b"{not json", headers={
            "Content-Type": "application/json"})
        assert r.status_code == 422 and "error" in r.json() and "detail" not in r.json()
        r = http.get("/no/such/page")
        assert r.status_code == 404 and r.json() == {"error": "Not Found"}
    with admin_client(server) as admin:
        limit = admin.get("/admin/api/progress").json()["invite_limit"]
        assert limit == 500  # the admin form reads its maximum from here
        for count in (0, limit + 1):
            r = admin.post("/admin/api/invites", json={"count": count})
            assert r.status_code == 422 and r.json()["error"].startswith("count:"), r.text
        assert "500" in admin.post("/admin/api/invites", json={"count": 501}).json()["error"]
        assert admin.get("/admin/api/export/secrets.db").status_code == 404
        assert admin.post("/admin/api/raters/rater-001/delete").status_code == 404
        r = admin.post("/admin/api/raters/nobody/release")
        assert r.status_code == 404 and "no rater" in r.json()["error"]
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        r = http.get("/admin/api/progress")
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")


def test_server_refuses_votes_before_the_pair_has_played(served):
    study, _ = served
    with LocalServer(study, extra_args=["--min-view", "1"]) as server, admin_client(server) as admin:
        (new,) = admin.post("/admin/api/invites", json={"count": 1}).json()["invites"]
        rater = RaterClient(server.url, new["token"])
        rater.start()
        cur = rater.current()
        assert cur["duration"] == pytest.approx(17 / 8)
        r = rater.vote(cur["assignment"], "left")
        assert r.status_code == 425 and "too early" in r.json()["error"]
        assert 0 < r.json()["wait_seconds"] <= cur["duration"]
        time.sleep(r.json()["wait_seconds"] + 0.2)
        assert rater.vote(cur["assignment"], "left").status_code == 200
        rater.close()
    seconds = db_rows(study, "SELECT v.view_seconds FROM votes v JOIN raters r ON r.id = "
                             "v.rater_id WHERE r.token = ?", new["token"])
    assert seconds and seconds[0][0] >= 17 / 8


def test_reports_actions_and_exports_reach_the_admin(served):
    study, server = served
    with admin_client(server) as admin:
        (a, b) = admin.post("/admin/api/invites", json={"count": 2}).json()["invites"]
        alice, bob = RaterClient(server.url, a["token"]), RaterClient(server.url, b["token"])
        alice.start(), bob.start()
        broken = alice.current()
        r = alice.report(broken["assignment"])
        assert r.status_code == 200 and r.json()["ok"]
        assert alice.current()["assignment"] != broken["assignment"]  # moved on
        assert alice.report(broken["assignment"], "ugly").status_code in (409, 422)
        cur = alice.current()
        assert alice.vote(cur["assignment"], "both_bad", comment="both flicker").status_code == 200
        progress = admin.get("/admin/api/progress").json()
        (report,) = [x for x in progress["reports"] if x["rater"] == a["label"]]
        assert report["reason"] == "not_loading"
        # Release, revoke, exclude.
        r = admin.post(f"/admin/api/raters/{b['label']}/release").json()
        assert r["released"] > 0
        assert bob.http.get(f"{bob.base}/current").json()["done"] is True
        r = admin.post(f"/admin/api/raters/{a['label']}/exclude",
                       json={"excluded": True, "reason": "clicked at random"}).json()
        assert r["excluded"] is True
        assert admin.post(f"/admin/api/raters/{a['label']}/revoke").json()["revoked"] is True
        r = alice.http.get(f"{alice.base}/state")
        assert r.status_code == 403 and "withdrawn" in r.json()["error"]
        results = admin.get("/admin/api/results").json()
        assert "clicked at random" in results["excluded_by_organiser"]["raters"][a["label"]]
        item = progress["items"][0]["id"]
        r = admin.post(f"/admin/api/items/{item}/exclude", json={"excluded": True}).json()
        assert r["excluded"] is True
        assert admin.post(f"/admin/api/items/{item}/exclude",
                          json={"excluded": False}).json()["excluded"] is False
        # The export buttons' downloads: every vote, with the comment and "both are bad".
        r = admin.get("/admin/api/export/votes.csv")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
        assert r.headers["content-disposition"] == 'attachment; filename="votes.csv"'
        rows = list(csv.DictReader(r.text.splitlines()))
        mine = [x for x in rows if x["rater"] == a["label"]]
        assert [(x["overall_clicked"], x["overall"], x["comment"]) for x in mine] == [
            ("both_bad", "tie", "both flicker")]
        assert len(rows) == len(admin.get("/admin/api/votes").json())
        assert admin.get("/admin/api/export/results.json").json()["study"] == "attnqat-vs-bf16-and-nvfp4"
        alice.close(), bob.close()


# ------------------------------------------------------------------------------- old studies

#: The schema of studies built before this version (one file per item side, a free box of
#: padding), as SQLAlchemy created it: such study folders exist and must keep working.
LEGACY_SCHEMA = """
CREATE TABLE studies (id INTEGER NOT NULL, name VARCHAR(200) NOT NULL, created_at DATETIME NOT NULL, config_json TEXT NOT NULL, PRIMARY KEY (id), UNIQUE (name));
CREATE TABLE clips (id INTEGER NOT NULL, study_id INTEGER NOT NULL, token VARCHAR(64) NOT NULL, method VARCHAR(100) NOT NULL, prompt TEXT NOT NULL, seed INTEGER, source TEXT NOT NULL, degraded BOOLEAN NOT NULL, PRIMARY KEY (id), FOREIGN KEY(study_id) REFERENCES studies (id));
CREATE UNIQUE INDEX ix_clips_token ON clips (token);
CREATE TABLE raters (id INTEGER NOT NULL, study_id INTEGER NOT NULL, token VARCHAR(64) NOT NULL, label VARCHAR(200) NOT NULL, created_at DATETIME NOT NULL, started_at DATETIME, PRIMARY KEY (id), FOREIGN KEY(study_id) REFERENCES studies (id));
CREATE UNIQUE INDEX ix_raters_token ON raters (token);
CREATE TABLE items (id INTEGER NOT NULL, study_id INTEGER NOT NULL, kind VARCHAR(20) NOT NULL, prompt TEXT NOT NULL, seed INTEGER, method_a VARCHAR(100) NOT NULL, method_b VARCHAR(100) NOT NULL, clip_a_id INTEGER NOT NULL, clip_b_id INTEGER NOT NULL, expected VARCHAR(4), target_ratings INTEGER NOT NULL, PRIMARY KEY (id), FOREIGN KEY(study_id) REFERENCES studies (id), FOREIGN KEY(clip_a_id) REFERENCES clips (id), FOREIGN KEY(clip_b_id) REFERENCES clips (id));
CREATE TABLE assignments (id INTEGER NOT NULL, token VARCHAR(64) NOT NULL, rater_id INTEGER NOT NULL, item_id INTEGER NOT NULL, position INTEGER NOT NULL, a_on_left BOOLEAN NOT NULL, shown_at DATETIME, PRIMARY KEY (id), CONSTRAINT uq_assignment_rater_item UNIQUE (rater_id, item_id), CONSTRAINT uq_assignment_rater_position UNIQUE (rater_id, position), FOREIGN KEY(rater_id) REFERENCES raters (id), FOREIGN KEY(item_id) REFERENCES items (id));
CREATE UNIQUE INDEX ix_assignments_token ON assignments (token);
CREATE TABLE votes (id INTEGER NOT NULL, assignment_id INTEGER NOT NULL, rater_id INTEGER NOT NULL, item_id INTEGER NOT NULL, left_is_a BOOLEAN NOT NULL, shown_at DATETIME NOT NULL, voted_at DATETIME NOT NULL, overall_side VARCHAR(5) NOT NULL, overall VARCHAR(4) NOT NULL, visual_quality_side VARCHAR(5) NOT NULL, visual_quality VARCHAR(4) NOT NULL, motion_side VARCHAR(5) NOT NULL, motion VARCHAR(4) NOT NULL, text_alignment_side VARCHAR(5) NOT NULL, text_alignment VARCHAR(4) NOT NULL, PRIMARY KEY (id), UNIQUE (assignment_id), FOREIGN KEY(assignment_id) REFERENCES assignments (id), FOREIGN KEY(rater_id) REFERENCES raters (id), FOREIGN KEY(item_id) REFERENCES items (id));
"""


def legacy_study(runs: Path, out: Path) -> tuple[Path, str]:
    """A study folder as the previous version wrote it: old schema, two files per item, one
    vote already given. Returns the folder and the invite token of a rater who has not started."""
    (out / "media").mkdir(parents=True)
    con = sqlite3.connect(out / "study.db")
    con.executescript(LEGACY_SCHEMA)
    config = {"name": "legacy", "pairs": [["attnqat", "bf16"]], "ratings_per_item": 2,
              "equivalence_margin": 0.1, "alpha": 0.05, "confidence": 0.95, "n_boot": 100,
              "min_check_accuracy": 0.7, "min_checks": 1, "seed": 0, "items_per_rater": 0,
              "check_fraction": 0.1, "practice_items": 0, "criteria": list(CRIT_KEYS),
              "encode": {"width": 64, "height": 64, "fps": 8.0, "crf": 18}}
    con.execute("INSERT INTO studies VALUES (1, 'legacy', '2026-01-01 00:00:00', ?)",
                (json.dumps(config),))
    folders = sorted(p for p in runs.iterdir() if p.is_dir())[:3]
    for i, folder in enumerate(folders):
        record = json.loads((folder / "record.json").read_text())
        ids = []
        for method in ("attnqat", "bf16"):
            token = f"{i:02d}{method:0>6}".encode().hex()[:32].ljust(32, "0")
            shutil.copyfile(folder / f"{method}.mp4", out / "media" / f"{token}.mp4")
            cur = con.execute("INSERT INTO clips (study_id, token, method, prompt, seed, source, "
                              "degraded) VALUES (1, ?, ?, ?, ?, ?, 0)",
                              (token, method, record["prompt"], record["seed"], str(folder)))
            ids.append(cur.lastrowid)
        con.execute("INSERT INTO items (study_id, kind, prompt, seed, method_a, method_b, "
                    "clip_a_id, clip_b_id, expected, target_ratings) VALUES (1, 'main', ?, ?, "
                    "'attnqat', 'bf16', ?, ?, NULL, 2)", (record["prompt"], record["seed"], *ids))
    con.execute("INSERT INTO raters VALUES (1, 1, 'old-rater', 'rater-001', '2026-01-01', "
                "'2026-01-01 00:00:01')")
    con.execute("INSERT INTO raters VALUES (2, 1, 'new-rater', 'rater-002', '2026-01-01', NULL)")
    con.execute("INSERT INTO assignments VALUES (1, 'a1', 1, 1, 0, 1, '2026-01-01 00:00:02')")
    con.execute("INSERT INTO votes VALUES (1, 1, 1, 1, 1, '2026-01-01 00:00:02', "
                "'2026-01-01 00:00:09', 'left', 'a', 'left', 'a', 'tie', 'tie', 'right', 'b')")
    con.commit()
    con.close()
    return out, "new-rater"


def test_a_study_from_the_previous_version_opens_reports_and_serves(runs, tmp_path):
    study, token = legacy_study(runs, tmp_path / "legacy")
    # The report upgrades the schema in place (new columns get their defaults)…
    assert cli_main(["eval", "report", "--study", str(study)]) == 0
    results = json.loads((study / "report" / "results.json").read_text())
    assert results["pairs"]["attnqat vs bf16"]["questions"]["overall"]["counts"] == {
        "win": 1, "tie": 0, "lose": 0}
    assert results["raters"]["rater-001"]["median_view_seconds"] == pytest.approx(7.0)
    columns = {c for (_, c, *_) in db_rows(study, "PRAGMA table_info(votes)")}
    assert {"both_bad", "comment", "view_seconds"} <= columns
    assert db_rows(study, "SELECT both_bad FROM votes") == [(0,)]
    # …and its raters carry on with the two-video player's API, min viewing time included.
    with LocalServer(study, extra_args=["--min-view", "1"]) as server:
        rater = RaterClient(server.url, token)
        assert rater.start()["stage"] == "rating"
        cur = rater.current()
        assert "video" not in cur and cur["duration"] == pytest.approx(17 / 8, abs=0.01)
        for side in ("left", "right"):
            r = rater.http.get(cur[side])
            assert r.status_code == 200 and r.content[4:8] == b"ftyp"
        assert rater.vote(cur["assignment"], "right").status_code == 425
        rater.close()
    assert cli_main(["eval", "report", "--db", f"sqlite:///{tmp_path / 'nothing.db'}"]) == 2


# ------------------------------------------------------------------------------- load

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_twenty_concurrent_raters_lose_no_vote_and_count_none_twice(runs, tmp_path):
    n_raters = 20
    study = build(runs, tmp_path / "study", "--pairs", "attnqat:bf16", "--raters", str(n_raters),
                  "--ratings-per-item", str(n_raters))
    errors: list[str] = []
    accepted: dict[str, int] = {}
    refused_dupes: dict[str, int] = {}

    def one_rater(label: str, token: str, server_url: str) -> None:
        rater = RaterClient(server_url, token)
        twin_clients = [RaterClient(server_url, token) for _ in range(2)]
        try:
            rater.start()
            n_ok = n_dupe = 0
            while not (cur := rater.current())["done"]:
                codes: list[int] = []
                barrier = threading.Barrier(2)

                def send(client: RaterClient, barrier: threading.Barrier, codes: list[int],
                         assignment: str) -> None:
                    barrier.wait(timeout=30)  # both copies leave together
                    codes.append(client.vote(assignment, "tie").status_code)

                twins = [threading.Thread(target=send, args=(c, barrier, codes, cur["assignment"]))
                         for c in twin_clients]
                [t.start() for t in twins]
                [t.join(timeout=60) for t in twins]
                if sorted(codes) != [200, 409]:
                    errors.append(f"{label}: duplicate submission answered {codes}")
                    return
                n_ok += 1
                n_dupe += 1
            accepted[label], refused_dupes[label] = n_ok, n_dupe
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"{label}: {exc!r}")
        finally:
            for client in (rater, *twin_clients):
                client.close()

    with LocalServer(study) as server:
        threads = [threading.Thread(target=one_rater, args=(label, tok, server.url))
                   for label, tok in invites(study)]
        [t.start() for t in threads]
        deadline = time.monotonic() + 240
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "raters did not finish in time"
        progress = httpx.get(server.url + "/admin/api/progress",
                             auth=("admin", server.admin_password), timeout=TIMEOUT).json()
    assert not errors, errors[:5]
    assert len(accepted) == n_raters
    queue = dict(db_rows(study, "SELECT r.label, COUNT(a.id) FROM raters r JOIN assignments a "
                                "ON a.rater_id = r.id GROUP BY r.id"))
    votes = dict(db_rows(study, "SELECT r.label, COUNT(v.id) FROM raters r JOIN votes v "
                                "ON v.rater_id = r.id GROUP BY r.id"))
    assert votes == queue == accepted  # every accepted vote stored, every assignment voted once
    assert db_rows(study, "SELECT COUNT(*), COUNT(DISTINCT assignment_id) FROM votes")[0] == (
        sum(accepted.values()),) * 2
    assert all(r["done"] == r["total"] > 0 for r in progress["raters"])


# ------------------------------------------------------------------------------- faults

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killed_server_keeps_every_vote_and_raters_resume(runs, tmp_path):
    study = build(runs, tmp_path / "study", "--pairs", "attnqat:bf16", "--raters", "2")
    (_, t1), (_, t2) = invites(study)
    server = LocalServer(study).start()
    try:
        alice, bob = RaterClient(server.url, t1), RaterClient(server.url, t2)
        alice.start(), bob.start()
        for _ in range(3):
            cur = alice.current()
            assert alice.vote(cur["assignment"], "left").status_code == 200
        bob_cur = bob.current()
        assert bob.vote(bob_cur["assignment"], "right").status_code == 200
        alice_open = alice.current()  # shown, not yet voted
        bob_open = bob.current()
        alice.close(), bob.close()
        server.kill()  # SIGKILL: no shutdown handlers, no flush
        assert server.process.returncode == -9
        server = LocalServer(study, port=server.port, admin_password=server.admin_password).start()
        alice, bob = RaterClient(server.url, t1), RaterClient(server.url, t2)
        # Every acknowledged vote survived; each rater is back on the item they had open.
        assert db_rows(study, "SELECT COUNT(*) FROM votes")[0][0] == 4
        again = alice.current()
        assert again["assignment"] == alice_open["assignment"]
        assert again["progress"] == alice_open["progress"]
        assert bob.current()["assignment"] == bob_open["assignment"]
        # A vote sent just before a crash and retried after it counts once.
        assert alice.vote(again["assignment"], "tie").status_code == 200
        server.kill()
        server = LocalServer(study, port=server.port, admin_password=server.admin_password).start()
        alice = RaterClient(server.url, t1)
        assert alice.vote(again["assignment"], "tie").status_code == 409
        while not (cur := alice.current())["done"]:
            assert alice.vote(cur["assignment"], "tie").status_code == 200
        total = db_rows(study, "SELECT COUNT(*) FROM assignments a JOIN raters r ON r.id = "
                               "a.rater_id WHERE r.token = ?", t1)[0][0]
        voted = db_rows(study, "SELECT COUNT(*) FROM votes v JOIN raters r ON r.id = v.rater_id "
                               "WHERE r.token = ?", t1)[0][0]
        assert voted == total
        assert db_rows(study, "SELECT COUNT(*) - COUNT(DISTINCT assignment_id) FROM votes")[0][0] == 0
    finally:
        server.stop()


# ------------------------------------------------------------------------------- serve options

def test_serve_release_after_overrides_the_declared_value(runs, tmp_path):
    """``attnqat eval serve --release-after`` is the value the server releases stale queues
    with, not the one declared at build time (120 minutes here)."""
    from datetime import timedelta

    from fastapi.testclient import TestClient

    from attnqat.eval import serve
    from attnqat.eval.storage import utcnow

    study = build(runs, tmp_path / "study", "--pairs", "attnqat:bf16", "--raters", "2",
                  "--release-after", "120")
    (_, idle), (_, busy) = invites(study)
    server = serve.open_study(study, admin_password="pw", release_after=5)
    with TestClient(serve.create_app(server)) as http:
        assert http.post(f"/api/r/{idle}/start").status_code == 200
        con = sqlite3.connect(study / "study.db")
        stale = (utcnow() - timedelta(minutes=10)).isoformat(sep=" ")
        con.execute("UPDATE raters SET last_seen_at = ? WHERE token = ?", (stale, idle))
        con.commit()
        con.close()
        assert http.post(f"/api/r/{busy}/start").status_code == 200
    released = db_rows(study, "SELECT a.release_reason FROM assignments a JOIN raters r ON "
                              "r.id = a.rater_id WHERE r.token = ?", idle)
    assert released and {r for (r,) in released} == {"inactive"}


def test_request_bodies_are_limited_and_released_raters_are_told_so(runs, tmp_path):
    """An unauthenticated 256 MiB POST was read whole (RSS +690 MB): bodies over the limit are
    refused with 413 from the Content-Length, or once that many bytes arrived without one.
    A rater whose queue the organiser released is told so, not "you rated everything"."""
    from fastapi.testclient import TestClient

    from attnqat.eval import serve

    study = build(runs, tmp_path / "study", "--pairs", "attnqat:bf16", "--raters", "1")
    ((label, token),) = invites(study)
    server = serve.open_study(study, admin_password="pw")
    with TestClient(serve.create_app(server)) as http:
        big = b"x" * (serve.MAX_BODY_BYTES + 1)
        r = http.post(f"/api/r/{token}/vote", content=big,
                      headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "larger than" in r.json()["error"]
        r = http.post(f"/api/r/{token}/vote", headers={"Content-Type": "application/json",
                                                       "Content-Length": str(256 << 20)},
                      content=b"{}")
        assert r.status_code == 413

        def chunks():  # no Content-Length: the server stops reading at the limit
            for _ in range(64):
                yield b"y" * 8192

        r = http.post(f"/api/r/{token}/report", content=chunks(),
                      headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        # A normal request still works; then the organiser releases the rater's queue.
        assert http.post(f"/api/r/{token}/start").status_code == 200
        cur = http.get(f"/api/r/{token}/current").json()
        assert cur["done"] is False
        csrf = {"X-CSRF-Token": server.csrf_token}
        r = http.post(f"/admin/api/raters/{label}/release", auth=("a", "pw"), headers=csrf)
        assert r.status_code == 200 and r.json()["released"] > 0
        cur = http.get(f"/api/r/{token}/current").json()
        assert cur["done"] is True and cur["stage"] == "released"
        assert http.get(f"/api/r/{token}/state").json()["stage"] == "released"
        # New invites expire after the study's invite_days unless the request says otherwise.
        r = http.post("/admin/api/invites", json={"count": 1, "days": 0}, auth=("a", "pw"),
                      headers=csrf)
        assert r.status_code == 200
    rows = dict(db_rows(study, "SELECT label, expires_at FROM raters"))
    assert rows[label] is not None and rows["rater-002"] is None


def test_crowd_link_worker_ids_completion_code_and_export(runs, tmp_path):
    """Crowd platforms: one study link with the worker id; one rater per worker id, at most
    --crowd-raters; an invite opened by one worker id refuses another; who finishes gets the
    completion code (and the platform's link); every exported vote carries its worker id."""
    from fastapi.testclient import TestClient

    from attnqat.eval import serve

    url = "https://app.prolific.com/submissions/complete?cc=C0DE42"
    study = build(runs, tmp_path / "study", "--pairs", "attnqat:bf16", "--raters", "1",
                  "--crowd-raters", "2", "--completion-code", "C0DE42", "--completion-url", url,
                  "--items-per-rater", "2")
    config = json.loads((study / "study.json").read_text())
    crowd = config["crowd_token"]
    ((_, invite),) = invites(study)
    server = serve.open_study(study, admin_password="pw")
    with TestClient(serve.create_app(server), follow_redirects=False) as http:
        r = http.get(f"/c/{crowd}?PROLIFIC_PID=worker_A")
        assert r.status_code == 303 and r.headers["location"].startswith("/r/")
        token_a = r.headers["location"][3:]
        assert http.get(f"/c/{crowd}?worker_id=worker_A").headers["location"] == f"/r/{token_a}"
        assert http.get(f"/c/{crowd}?worker_id=worker_B").status_code == 303
        r = http.get(f"/c/{crowd}?worker_id=worker_C")  # the quota of two workers is reached
        assert r.status_code == 403 and "all the workers" in r.json()["error"]
        assert http.get(f"/c/{crowd}").status_code == 400
        assert http.get("/c/wrong?worker_id=x").status_code == 404
        assert http.get(f"/c/{crowd}?worker_id=<script>").status_code == 422
        # A personal invite takes the worker id it is first opened with, and only that one.
        assert http.get(f"/r/{invite}?worker_id=worker_D").status_code == 200
        assert http.get(f"/r/{invite}?worker_id=worker_E").status_code == 403
        assert http.get(f"/r/{invite}").status_code == 200
        # worker A rates everything and gets the completion code.
        state = http.post(f"/api/r/{token_a}/start").json()
        assert "completion_code" not in state
        while not (cur := http.get(f"/api/r/{token_a}/current").json())["done"]:
            body = {"assignment": cur["assignment"], "overall": "tie",
                    "criteria": {k: "tie" for k in CRIT_KEYS}}
            assert http.post(f"/api/r/{token_a}/vote", json=body).status_code == 200
        assert cur["completion_code"] == "C0DE42" and cur["completion_url"] == url
        state = http.get(f"/api/r/{token_a}/state").json()
        assert state["stage"] == "done" and state["completion_code"] == "C0DE42"
        rows = list(csv.DictReader(http.get("/admin/api/export/votes.csv",
                                            auth=("a", "pw")).text.splitlines()))
        assert rows and list(rows[0])[:3] == ["vote_id", "rater", "worker_id"]
        assert {r["worker_id"] for r in rows} == {"worker_A"}
        progress = http.get("/admin/api/progress", auth=("a", "pw")).json()
        assert {r["worker_id"] for r in progress["raters"]} == {"worker_A", "worker_B", "worker_D"}
        results = http.get("/admin/api/results", auth=("a", "pw")).json()
        assert "crowd_token" not in results["config"]


def test_scripted_raters_cannot_dodge_checks_and_the_report_warns(runs, tmp_path):
    """The audit's scripted raters, re-run through the HTTP API: a bot that decodes each served
    pair, reports the pairs whose halves are identical (the identical checks) as broken and
    votes at random otherwise, next to careful raters. Reporting a check counts as failing it,
    so the bot is excluded; when exclusions leave items short of their planned raters the
    report says so."""
    import random

    from fastapi.testclient import TestClient

    from attnqat.eval import serve
    from attnqat.video import read_mp4

    study = build(runs, tmp_path / "study", "--pairs", "attnqat:bf16", "--raters", "3",
                  "--ratings-per-item", "3", "--check-fraction", "0.5", "--n-boot", "0")
    width = json.loads((study / "study.json").read_text())["encode"]["width"]
    server = serve.open_study(study, admin_password="pw")
    con = sqlite3.connect(study / "study.db")
    expected = dict(con.execute("SELECT a.token, i.expected FROM assignments a JOIN items i ON "
                                "i.id = a.item_id"))

    def halves_identical(http, video: str) -> bool:
        path = tmp_path / "pair.mp4"
        path.write_bytes(http.get(video).content)
        frames, _ = read_mp4(path)
        frames = frames.astype(float)
        left = frames[:, :, media.EDGE:media.EDGE + width]
        right = frames[:, :, -media.EDGE - width:frames.shape[2] - media.EDGE]
        return float(abs(left - right).mean()) < 2.0

    rng = random.Random(0)
    (_, careful_1), (_, careful_2), (bot_label, bot) = invites(study)
    with TestClient(serve.create_app(server)) as http:
        for token in (careful_1, careful_2, bot):
            http.post(f"/api/r/{token}/start")
            while not (cur := http.get(f"/api/r/{token}/current").json())["done"]:
                a = cur["assignment"]
                if token == bot and halves_identical(http, cur["video"]):
                    r = http.post(f"/api/r/{token}/report", json={"assignment": a,
                                                                   "reason": "not_loading"})
                    assert r.status_code == 200
                    continue
                if token == bot:
                    click = rng.choice(["left", "right"])
                else:  # careful: the check's answer, else "about the same"
                    exp = expected.get(a) or "tie"
                    a_on_left = con.execute("SELECT a_on_left FROM assignments WHERE token = ?",
                                            (a,)).fetchone()[0]
                    click = "tie" if exp == "tie" else (
                        "left" if (exp == "a") == bool(a_on_left) else "right")
                body = {"assignment": a, "overall": click,
                        "criteria": {k: "tie" for k in CRIT_KEYS}}
                assert http.post(f"/api/r/{token}/vote", json=body).status_code == 200
        results = http.get("/admin/api/results", auth=("a", "pw")).json()
    con.close()
    bot_row = results["raters"][bot_label]
    assert bot_row["checks_answered"] >= 1 and bot_label in results["excluded_raters"]
    assert bot_row["checks_correct"] < bot_row["checks_answered"]
    assert len(results["excluded_raters"]) == 1
    assert any("fewer than the planned 3 rating(s)" in w for w in results["warnings"])
