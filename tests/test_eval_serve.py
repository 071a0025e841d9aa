"""The rater app over real HTTP on loopback: end to end, blindness, refusals, load and faults.

Every server runs in a child process (``attnqat eval serve``) on 127.0.0.1 and a free port, so a
test can kill it with SIGKILL and start it again on the same study.
"""

from __future__ import annotations

import csv
import json
import sqlite3
import struct
import threading
import time
from pathlib import Path

import httpx
import pytest

from attnqat.cli import main as cli_main
from attnqat.eval import sources
from attnqat.eval.demo import LocalServer, write_demo_outputs

METHODS = ("bf16", "attnqat", "nvfp4")
CRIT_KEYS = ("visual_quality", "motion", "text_alignment")
TIMEOUT = httpx.Timeout(30.0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_runs")
    write_demo_outputs(root, sources.read_prompts()[:6], methods=METHODS)
    return root


def build(runs: Path, out: Path, *extra: str) -> Path:
    args = ["eval", "build", str(runs), "--out", str(out), "--quiet", *extra]
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

    def vote(self, assignment: str, click: str, criteria: dict | None = None) -> httpx.Response:
        criteria = criteria or {k: click for k in CRIT_KEYS}
        return self.http.post(f"{self.base}/vote", json={"assignment": assignment,
                                                          "overall": click, "criteria": criteria})

    def close(self) -> None:
        self.http.close()


def db_rows(study: Path, sql: str, *params) -> list[tuple]:
    con = sqlite3.connect(study / "study.db", timeout=30)
    try:
        return con.execute(sql, params).fetchall()
    finally:
        con.close()


def mp4_metadata(data: bytes) -> bytes:
    """Every top-level MP4 box except the compressed picture data (mdat) and the trailing
    random padding (free): what could carry names, dates or encoder strings."""
    out, i = [], 0
    while i < len(data):
        size, kind = struct.unpack(">I4s", data[i:i + 8])
        assert size >= 8
        if kind not in (b"mdat", b"free"):
            out.append(data[i:i + size])
        i += size
    assert kind == b"free"  # the size padding is last
    return b"".join(out)


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
                  "attnqat-vs-bf16-and-nvfp4", "--raters", "3")
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
    sizes = set()
    while not (cur := rater.current())["done"]:
        seen.append(json.dumps(cur).encode())
        for side in ("left", "right"):
            assert cur[side].startswith("/media/") and len(cur[side]) == len("/media/") + 36
            clip = http.get(cur[side])
            assert clip.status_code == 200 and clip.headers["content-type"] == "video/mp4"
            assert "etag" not in clip.headers and "last-modified" not in clip.headers
            sizes.add(int(clip.headers["content-length"]))
            seen += [mp4_metadata(clip.content), str(clip.headers).encode(), cur[side].encode()]
            last_url = cur[side]
        r = rater.vote(cur["assignment"], "tie")
        seen += [r.content, str(r.headers).encode()]
    assert len(sizes) == 1  # every clip has the same byte size
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
        new = http.post("/admin/api/invites", json={"count": 2},
                        auth=("x", server.admin_password)).json()["invites"]
        assert len(new) == 2
        assert http.get(new[0]["link"]).status_code == 200  # a new invite works at once
    assert {t for _, t in invites(study)} >= {i["token"] for i in new}


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
