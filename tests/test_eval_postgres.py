"""The same study on PostgreSQL, unchanged code: build, concurrent votes over HTTP, report.

Runs only when ``ATTNQAT_TEST_POSTGRES_URL`` names an empty database that may be written, e.g.
``postgresql+psycopg://postgres@127.0.0.1:5432/study`` (and its driver is installed); skipped
otherwise.
"""

from __future__ import annotations

import csv
import json
import os
import threading
import uuid

import httpx
import pytest

from attnqat.cli import main as cli_main
from attnqat.eval import sources
from attnqat.eval.demo import LocalServer, write_demo_outputs

URL = os.environ.get("ATTNQAT_TEST_POSTGRES_URL")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not URL, reason="set ATTNQAT_TEST_POSTGRES_URL to run")]


@pytest.mark.timeout(300)
def test_study_on_postgres(tmp_path):
    from sqlalchemy import create_engine, text

    write_demo_outputs(tmp_path / "runs", sources.read_prompts()[:4], methods=("bf16", "attnqat"))
    name = f"pg-{uuid.uuid4().hex[:8]}"
    study = tmp_path / "study"
    assert cli_main(["eval", "build", str(tmp_path / "runs"), "--out", str(study), "--db", URL,
                     "--name", name, "--raters", "6", "--ratings-per-item", "6", "--quiet"]) == 0
    assert not (study / "study.db").exists()
    tokens = [r["token"] for r in csv.DictReader(open(study / "invites.csv"))]
    errors: list[str] = []
    clicks: dict[str, int] = {}

    def rater(token: str, url: str) -> None:
        try:
            with httpx.Client(base_url=url, timeout=30) as http:
                http.post(f"/api/r/{token}/start").raise_for_status()
                n = 0
                while not (cur := http.get(f"/api/r/{token}/current").json())["done"]:
                    body = {"assignment": cur["assignment"], "overall": "left",
                            "criteria": {k: "tie" for k in ("visual_quality", "motion",
                                                            "text_alignment")}}
                    codes = sorted(http.post(f"/api/r/{token}/vote", json=body).status_code
                                   for _ in range(2))
                    if codes != [200, 409]:
                        errors.append(str(codes))
                    n += 1
                clicks[token] = n
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    with LocalServer(study, db_url=URL, name=name) as server:
        threads = [threading.Thread(target=rater, args=(t, server.url)) for t in tokens]
        [t.start() for t in threads]
        [t.join(timeout=120) for t in threads]
    assert not errors and len(clicks) == len(tokens)
    engine = create_engine(URL)
    with engine.connect() as con:
        n_votes = con.execute(text(
            "SELECT COUNT(*) FROM votes v JOIN raters r ON r.id = v.rater_id JOIN studies s ON "
            "s.id = r.study_id WHERE s.name = :n"), {"n": name}).scalar()
    engine.dispose()
    assert n_votes == sum(clicks.values())
    out = tmp_path / "report"
    assert cli_main(["eval", "report", "--db", URL, "--name", name, "--out", str(out),
                     "--n-boot", "100"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["n_votes"]["all"] == n_votes
