"""``attnqat eval import``: votes from elsewhere (published counts, other tools, our own export)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from attnqat.cli import main as cli_main
from attnqat.eval import importer, stats
from attnqat.eval.report import export_votes
from attnqat.eval.results import QUESTIONS, VoteRecord, analyze
from attnqat.eval.sources import InputError
from attnqat.eval.study import StudyConfig

PAPER_CSV = "method_a,method_b,overall,count\nattnqat,bf16,win,16\nattnqat,bf16,tie,64\nattnqat,bf16,lose,19\n"


def test_published_counts_are_analysed_like_a_study(tmp_path, capsys):
    src = tmp_path / "paper.csv"
    src.write_text(PAPER_CSV)
    assert cli_main(["eval", "import", str(src), "--n-boot", "300"]) == 0
    printed = capsys.readouterr().out
    results = json.loads((tmp_path / "paper-report" / "results.json").read_text())
    overall = results["pairs"]["attnqat vs bf16"]["questions"]["overall"]
    assert overall["counts"] == {"win": 16, "tie": 64, "lose": 19}
    assert overall["n_prompts"] == 99  # one vote per prompt, as the paper's design
    ref = stats.margin_test_counts(np.array(
        [[1, 0, 0]] * 16 + [[0, 1, 0]] * 64 + [[0, 0, 1]] * 19), 0.1)
    assert overall["margin_test"]["p"] == pytest.approx(ref.p)
    assert overall["margin_test"]["verdict"] == "not shown equivalent"
    assert "Δ = -3.0 pp, 90% interval [-14.0, +7.9] pp" in printed
    md = (tmp_path / "paper-report" / "report.md").read_text()
    assert "[-14.0, +7.9] pp vs ±10 pp" in md
    assert "Multiplicity: the study makes 1 margin test(s) with a verdict (1 pair(s) × 4 questions)" in md
    assert "agreement cannot be measured" in md  # one vote per prompt: no agreement to measure
    # Declared differently: not worse than BF16 by more than 15 points.
    assert cli_main(["eval", "import", str(src), "--non-inferiority", "--margin", "0.15",
                     "--out", str(tmp_path / "ni"), "--n-boot", "50"]) == 0
    ni = json.loads((tmp_path / "ni" / "results.json").read_text())
    assert ni["pairs"]["attnqat vs bf16"]["questions"]["overall"]["margin_test"]["verdict"] == \
        "non-inferior"


def _votes(seed: int = 0) -> list[VoteRecord]:
    rng = random.Random(seed)
    votes = []
    for item in range(24):
        for r in range(3):
            left = rng.random() < 0.5
            answers = {q: "tie" if rng.random() < 0.4 else rng.choice("ab") for q in QUESTIONS}
            sides = {q: "tie" if a == "tie" else ("left" if (a == "a") == left else "right")
                     for q, a in answers.items()}
            votes.append(VoteRecord(len(votes) + 1, f"r{(item + r) % 5}", item + 1, "main",
                                    f"prompt {item // 2}", item % 2, "attnqat", "bf16", None,
                                    None, None, left, None, None, answers, sides,
                                    view_seconds=3.0 + r))
    return votes


def test_our_own_export_round_trips(tmp_path):
    votes = _votes()
    config = StudyConfig(name="x", pairs=[("attnqat", "bf16")], n_boot=100, min_prompts=5)
    before = analyze(votes, config)
    csv_path, _ = export_votes(votes, tmp_path)
    again = importer.read_votes(csv_path)
    after = analyze(again, config)
    for q in QUESTIONS:
        a = before["pairs"]["attnqat vs bf16"]["questions"][q]
        b = after["pairs"]["attnqat vs bf16"]["questions"][q]
        assert a["counts"] == b["counts"] and a["n_prompts"] == b["n_prompts"] == 12
        assert a["margin_test"]["p"] == pytest.approx(b["margin_test"]["p"])
        assert a["krippendorff_alpha_ordinal"] == pytest.approx(b["krippendorff_alpha_ordinal"])
        assert a["position_bias"] == b["position_bias"]


@pytest.mark.parametrize("content,message", [
    ("method_a,method_b,result\nx,y,win\n", "no 'overall'"),
    ("overall\nwin\n", "give --pair"),
    ("method_a,method_b,overall\nx,y,maybe\n", ":2: overall 'maybe'"),
    ("method_a,method_b,overall,count\nx,y,win,-2\n", ":2: count must be at least 1"),
    ("method_a,method_b,overall,count\nx,y,win,2.5\n", "not a whole number"),
    ("method_a,method_b,overall,kind\nx,y,tie,check_identical\n", "needs expected"),
    ("method_a,method_b,overall,motion\nx,y,tie,both_bad\n", "only the overall"),
    ("method_a,method_b,overall,left_is_a\nx,y,tie,perhaps\n", "left_is_a"),
])
def test_bad_rows_name_their_line_and_write_nothing(tmp_path, capsys, content, message):
    src = tmp_path / "votes.csv"
    src.write_text(content)
    with pytest.raises(InputError, match=message.replace("(", "\\(")):
        importer.read_votes(src)
    assert cli_main(["eval", "import", str(src), "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_pair_option_fills_in_and_filters(tmp_path):
    src = tmp_path / "v.csv"
    src.write_text("overall,prompt,rater\nwin,p1,r1\nb,p1,r2\nboth_bad,p2,r1\n")
    votes = importer.read_votes(src, pair=("attnqat", "bf16"))
    assert [(v.method_a, v.answers["overall"], v.both_bad) for v in votes] == [
        ("attnqat", "a", False), ("attnqat", "b", False), ("attnqat", "tie", True)]
    assert {v.item_id for v in votes if v.prompt == "p1"} == {votes[0].item_id}
    mixed = tmp_path / "m.csv"
    mixed.write_text("method_a,method_b,overall\na1,b1,win\na2,b1,lose\n")
    assert [v.method_a for v in importer.read_votes(mixed, pair=("a2", "b1"))] == ["a2"]
    with pytest.raises(InputError, match="no votes for the pair"):
        importer.read_votes(mixed, pair=("zz", "b1"))
