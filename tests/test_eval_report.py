"""``attnqat eval report``: analysis of known votes, exclusion, figure and exports."""

from __future__ import annotations

import csv
import json
import xml.etree.ElementTree as ET

import pytest
from sqlalchemy import select

from attnqat.cli import main as cli_main
from attnqat.eval import rating, sources
from attnqat.eval.demo import write_demo_outputs
from attnqat.eval.storage import Item, default_db_url, open_db
from attnqat.eval.study import StudyConfig, build_study

PAIRS = [("attnqat", "bf16"), ("nvfp4", "bf16")]


def side_for(answer: str, a_on_left: bool) -> str:
    """The click that means ``answer`` (a / b / tie) given the displayed order."""
    if answer == "tie":
        return "tie"
    return "left" if (answer == "a") == a_on_left else "right"


def intended(rater: str, item: Item) -> str:
    """What each simulated rater answers (a / b / tie), deterministic per rater and item."""
    if item.kind == "check_repeat":  # the same answer as to the main item it repeats…
        if rater == "rater-003":  # …except rater 3, who reverses it
            return "b"
        return ("a", "tie", "b", "tie", "a")[(item.repeat_of + int(rater[-1])) % 5]
    if item.kind.startswith("check"):
        if rater == "rater-003":  # rater 3 fails every check
            return {"tie": "a", "a": "b", "b": "a"}[item.expected]
        return item.expected
    if item.kind == "practice":
        return "tie"
    if rater == "rater-003":
        return "a"
    return ("a", "tie", "b", "tie", "a")[(item.id + int(rater[-1])) % 5]


@pytest.fixture(scope="module")
def voted_study(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    write_demo_outputs(root / "runs", sources.read_prompts()[:6], methods=("bf16", "attnqat", "nvfp4"))
    config = StudyConfig(name="report-test", pairs=PAIRS, ratings_per_item=3, n_boot=300,
                         equivalence_margin=0.2)
    build_study(sources.load_sources([root / "runs"]), root / "study", config, n_raters=3,
                progress=False)
    _, Session = open_db(default_db_url(root / "study"))
    expected = []  # (rater, kind, method_a, method_b, prompt, answer, clicked)
    with Session() as s:
        from attnqat.eval.storage import Rater
        raters = [(r.label, r.token) for r in s.scalars(select(Rater).order_by(Rater.id))]
    for label, token in raters:
        rating.start(Session, 1, token, seed=len(label))
        while True:
            with Session.begin() as s:
                rater = rating.get_rater(s, 1, token)
                a = rating.current(s, rater)
                if a is None:
                    break
                answer = intended(label, a.item)
                click = side_for(answer, a.a_on_left)
                crit = {"visual_quality": click, "motion": "tie",
                        "text_alignment": "left"}
                rating.record_vote(s, rater, a.token, click, crit)
                expected.append((label, a.item.kind, a.item.method_a, a.item.method_b,
                                 a.item.prompt, answer, click, a.a_on_left))
    return root / "study", expected


def test_report_reproduces_known_votes(voted_study, capsys):
    study, expected = voted_study
    assert cli_main(["eval", "report", "--study", str(study)]) == 0
    printed = capsys.readouterr().out
    out = study / "report"
    results = json.loads((out / "results.json").read_text())
    assert results["excluded_raters"] == ["rater-003"]
    assert results["raters"]["rater-003"]["check_accuracy"] == 0.0
    assert results["raters"]["rater-001"]["check_accuracy"] == 1.0
    word = {"a": "win", "tie": "tie", "b": "lose"}
    for a, b in PAIRS:
        pair = results["pairs"][f"{a} vs {b}"]
        mine = [e for e in expected if e[1] == "main" and (e[2], e[3]) == (a, b)]
        kept = [e for e in mine if e[0] != "rater-003"]
        overall = pair["questions"]["overall"]
        assert overall["counts"] == {w: sum(word[e[5]] == w for e in kept)
                                     for w in ("win", "tie", "lose")}
        assert pair["before_exclusion"]["overall"] == {w: sum(word[e[5]] == w for e in mine)
                                                       for w in ("win", "tie", "lose")}
        assert overall["n_prompts"] == len({e[4] for e in kept})
        assert overall["position_bias"]["left"] == sum(e[6] == "left" for e in kept)
        # Per criterion: "motion" was always answered "about the same".
        assert pair["questions"]["motion"]["counts"] == {"win": 0, "tie": len(kept), "lose": 0}
        # "text_alignment" was always "left": A wins exactly where A was on the left.
        ta = pair["questions"]["text_alignment"]["counts"]
        assert ta["win"] == sum(e[7] for e in kept) and ta["tie"] == 0
        assert f"{a} vs {b}: {overall['counts']['win']} win" in printed
    md = (out / "report.md").read_text()
    assert "### attnqat vs bf16" in md and "rater-003 | 0 |" not in md
    assert "Excluded: rater-003" in md
    # Two prompts per pair are far from the declared minimum of 10: no verdict, and it says so.
    assert results["pairs"]["attnqat vs bf16"]["questions"]["overall"]["margin_test"]["verdict"] \
        == "not enough data"
    assert "not enough data (2 prompts; a verdict needs at least 10)" in md
    assert "equivalent: yes" not in md and " pp" in md
    # The simulated raters voted the instant a pair was shown: all flagged as fast voters.
    assert results["fast_raters"] == ["rater-001", "rater-002", "rater-003"]
    assert all(r["fast"] for r in results["raters"].values())
    assert "fast voters" in md
    # With a handful of checks each, the exclusion rule cannot separate careful from random.
    assert any("a rater answering at random passes the exclusion rule" in w
               for w in results["warnings"])
    assert "not enough data" in printed


def test_exports_hold_every_raw_vote(voted_study):
    study, expected = voted_study
    out = study / "report"
    if not (out / "votes.csv").exists():
        assert cli_main(["eval", "report", "--study", str(study)]) == 0
    rows = list(csv.DictReader(open(out / "votes.csv", encoding="utf-8")))
    data = json.loads((out / "votes.json").read_text())
    assert len(rows) == len(data) == len(expected)
    got = sorted((r["rater"], r["kind"], r["overall"], r["overall_clicked"]) for r in rows)
    assert got == sorted((e[0], e[1], e[5], e[6]) for e in expected)
    for r in rows:  # the displayed order is kept and consistent with the resolved answer
        left_is_a = r["left_is_a"] == "True"
        assert r["left_method"].split(" ")[0] == (r["method_a"] if left_is_a else r["method_b"])
        assert r["shown_at"] <= r["voted_at"]
    assert {"visual_quality", "motion", "text_alignment", "motion_clicked"} <= set(rows[0])


def test_figure_and_html_are_written(voted_study):
    study, _ = voted_study
    out = study / "report"
    if not (out / "wtl.png").exists():
        assert cli_main(["eval", "report", "--study", str(study)]) == 0
    assert (out / "wtl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = ET.parse(out / "wtl.svg").getroot()
    assert svg.tag.endswith("svg")
    text = (out / "wtl.svg").read_text()
    assert "attnqat vs bf16" in text and "nvfp4 vs bf16" in text
    html = (out / "report.html").read_text()
    assert html.startswith("<!doctype html>") and "<table>" in html and 'src="wtl.png"' in html


def test_report_errors_are_clear(tmp_path, capsys):
    assert cli_main(["eval", "report"]) == 2
    assert "--study" in capsys.readouterr().err
    assert cli_main(["eval", "report", "--study", str(tmp_path)]) == 2
    assert "no study.db" in capsys.readouterr().err


def test_organiser_exclusions_leave_the_analysis_with_their_reason(voted_study, tmp_path):
    from attnqat.eval.report import load_analysis
    from attnqat.eval.storage import Rater

    study, expected = voted_study
    copy = tmp_path / "study"
    import shutil
    shutil.copytree(study, copy)
    _, Session = open_db(default_db_url(copy))
    with Session.begin() as s:
        rater = s.scalar(select(Rater).where(Rater.label == "rater-001"))
        rating.set_rater_excluded(rater, True, "left the room")
    analysis, _ = load_analysis(default_db_url(copy))
    assert analysis["excluded_by_organiser"]["raters"] == {
        "rater-001": "rater excluded: left the room"}
    kept = [e for e in expected if e[1] == "main" and e[0] == "rater-002"]
    assert analysis["n_votes"]["main_after_exclusion"] == len(kept)


# ------------------------------------------------------------------------------- check rules

def _record(i, rater, item, kind, prompt, answer, expected=None):
    from attnqat.eval.results import VoteRecord

    return VoteRecord(i, rater, item, kind, prompt, 0, "attnqat", "bf16", expected, None, None,
                      True, None, None, {"overall": answer}, {})


def test_dodged_and_reported_checks_exclude_and_the_report_warns():
    """A rater cannot dodge the checks: "report a problem and skip" on a check item counts as a
    wrong answer, and a rater with fewer answered checks than required is excluded. When the
    exclusions leave items short of their planned raters, or change a verdict, the report
    says so."""
    from attnqat.eval.results import analyze

    votes, i = [], 0
    # Three raters rate 12 prompts; the careful one answers both checks right and votes tie;
    # the dodger skips (reports) both checks; the absent one never meets a check. Both vote "a".
    for rater, answer in (("careful", "tie"), ("dodger", "a"), ("absent", "a")):
        for p in range(12):
            i += 1
            votes.append(_record(i, rater, p, "main", f"prompt {p}", answer))
    for item, expected in ((100, "tie"), (101, "a")):
        i += 1
        votes.append(_record(i, "careful", item, "check_identical", f"check {item}", expected,
                             expected))
    reports = [("dodger", "check_identical"), ("dodger", "check_degraded"), ("absent", "main")]
    config = StudyConfig(name="rules", pairs=[("attnqat", "bf16")], ratings_per_item=3,
                         n_boot=0, equivalence_margin=0.5)
    result = analyze(votes, config, reports)
    assert result["excluded_raters"] == ["absent", "dodger"]
    assert result["raters"]["dodger"]["checks_answered"] == 2
    assert result["raters"]["dodger"]["checks_correct"] == 0
    assert result["raters"]["absent"]["too_few_checks"] is True
    assert "fewer than 2 check item(s)" in result["exclusion_rule"]
    warnings = " | ".join(result["warnings"])
    assert "after exclusion 1 of 3 rater(s) remain; 12 of 12 main item(s) have fewer than the " \
           "planned 3 rating(s)" in warnings
    assert "the exclusions change the overall verdict" in warnings
    # Without the reports the dodger keeps their votes only through the required-checks rule.
    config.required_checks = 0
    assert analyze(votes, config, [])["excluded_raters"] == []


def test_exports_are_formula_safe_and_the_markdown_escapes_html(tmp_path):
    from attnqat.eval import importer
    from attnqat.eval.report import report_blocks, votes_csv, _md
    from attnqat.eval.results import VoteRecord, analyze

    hostile = "=HYPERLINK(\"http://x.example\",\"click\")"
    votes = [VoteRecord(i + 1, "@rater" if i % 2 else "-r2", i, "main", f"+prompt {i}", 0,
                        "attnqat", "bf16", None, None, None, True, None, None,
                        {"overall": ("a", "tie", "b")[i % 3]}, {}, comment=hostile,
                        excluded_by_organiser="rater excluded: <img src=x onerror=alert(1)>"
                        if i == 0 else None) for i in range(12)]
    text = votes_csv([v.flat() for v in votes])
    cells = [c for row in csv.reader(text.splitlines()) for c in row]
    assert not [c for c in cells if c[:1] in ("=", "+", "-", "@")], cells[:20]
    assert "'=HYPERLINK" in text and "'@rater" in text and "'+prompt 0" in text
    # The export reads back as it was.
    path = tmp_path / "votes.csv"
    path.write_text(text)
    back = importer.read_votes(path)
    assert [v.comment for v in back] == [hostile] * 12
    assert {v.rater for v in back} == {"@rater", "-r2"} and back[0].prompt == "+prompt 0"
    config = StudyConfig(name="<script>alert(1)</script>", pairs=[("attnqat", "bf16")], n_boot=0)
    md = _md(report_blocks(analyze(votes, config)))
    assert "<img" not in md and "<script" not in md
    assert "&lt;img src=x onerror=alert(1)>" in md and "&lt;script>" in md


def test_more_than_two_methods_get_a_bradley_terry_ranking(voted_study):
    study, expected = voted_study
    out = study.parent / "ranking-report"
    assert cli_main(["eval", "report", "--study", str(study), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    ranking = results["ranking"]
    assert ranking["anchor"] == "bf16" and set(ranking["methods"]) == {"bf16", "attnqat", "nvfp4"}
    assert sorted(m["rank"] for m in ranking["methods"].values()) == [1, 2, 3]
    for m in ranking["methods"].values():
        lo, hi = m["interval"]
        assert lo <= m["score"] <= hi
    md = (out / "report.md").read_text()
    assert "Ranking of all methods (Bradley–Terry)" in md
    # Two methods: the pairwise table says it all, no ranking.
    from attnqat.eval.results import analyze, VoteRecord

    two = [VoteRecord(i, "r", i, "main", f"p{i}", 0, "attnqat", "bf16", None, None, None, True,
                      None, None, {"overall": "tie"}, {}) for i in range(5)]
    assert analyze(two, StudyConfig(name="two", pairs=[("attnqat", "bf16")], n_boot=0))[
        "ranking"] is None
