"""From the database to the study's numbers: vote records, progress tables and the analysis.

Shared by ``attnqat eval report`` and the admin view of the rater app. The analysis follows the
study's declared configuration: check-item accuracy per rater, the exclusion rule, then per method
pair and per question (overall and each criterion) the W/T/L statistics of
:func:`attnqat.eval.stats.summarize_wtl`, the position-bias test and Krippendorff's alpha.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from . import stats
from .storage import CRITERIA, Assignment, Clip, Item, Rater, Vote
from .study import StudyConfig

#: Resolved answer (a / b / tie) → outcome for method A.
OUTCOME_OF: dict[str, str] = {"a": "win", "tie": "tie", "b": "lose"}
QUESTIONS: tuple[str, ...] = ("overall", *CRITERIA)


def json_safe(obj):
    """JSON-safe copy of an analysis: NaN → null, tuples → lists, keys → strings."""
    if isinstance(obj, float):
        return None if math.isnan(obj) else obj
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def _iso(t: datetime | None) -> str | None:
    return t.isoformat(timespec="milliseconds") + "Z" if t is not None else None


@dataclass(frozen=True)
class VoteRecord:
    """One vote with everything needed to analyse or export it (times as ISO 8601 UTC)."""

    vote_id: int
    rater: str
    item_id: int
    kind: str
    prompt: str
    seed: int | None
    method_a: str
    method_b: str
    expected: str | None
    left_method: str
    right_method: str
    left_is_a: bool
    shown_at: str
    voted_at: str
    answers: dict[str, str] = field(default_factory=dict)  # question -> a / b / tie
    sides: dict[str, str] = field(default_factory=dict)  # question -> left / right / tie

    def outcome(self, question: str = "overall") -> str:
        """win / tie / lose for method A."""
        return OUTCOME_OF[self.answers[question]]

    def flat(self) -> dict:
        """One flat row for CSV/JSON export."""
        d = asdict(self)
        answers, sides = d.pop("answers"), d.pop("sides")
        for q in QUESTIONS:
            d[f"{q}_clicked"] = sides[q]
            d[q] = answers[q]
            d[f"{q}_outcome_for_a"] = OUTCOME_OF[answers[q]]
        return d


def load_votes(session: Session, study_id: int) -> list[VoteRecord]:
    """All votes of a study (practice included; callers filter by ``kind``), in vote order."""
    degraded = set(session.scalars(select(Clip.id).where(Clip.study_id == study_id,
                                                         Clip.degraded.is_(True))))
    rows = session.execute(
        select(Vote, Item, Rater.label)
        .join(Item, Item.id == Vote.item_id)
        .join(Rater, Rater.id == Vote.rater_id)
        .where(Item.study_id == study_id)
        .order_by(Vote.id)).all()
    out = []
    for vote, item, label in rows:
        answers = {"overall": vote.overall, **{c: getattr(vote, c) for c in CRITERIA}}
        sides = {"overall": vote.overall_side, **{c: getattr(vote, f"{c}_side") for c in CRITERIA}}
        name_a = item.method_a + (" (degraded)" if item.clip_a_id in degraded else "")
        name_b = item.method_b + (" (degraded)" if item.clip_b_id in degraded else "")
        left, right = (name_a, name_b) if vote.left_is_a else (name_b, name_a)
        out.append(VoteRecord(vote.id, label, item.id, item.kind, item.prompt, item.seed,
                              item.method_a, item.method_b, item.expected, left, right,
                              vote.left_is_a, _iso(vote.shown_at), _iso(vote.voted_at),
                              answers, sides))
    return out


def rater_checks(votes: Sequence[VoteRecord]) -> dict[str, stats.CheckScore]:
    """Check-item score per rater (overall answer against the expected one)."""
    return stats.check_scores((v.rater, v.answers["overall"], v.expected)
                              for v in votes if v.kind.startswith("check"))


def _question_summary(votes: Sequence[VoteRecord], question: str, config: StudyConfig) -> dict:
    summary = stats.summarize_wtl(
        [v.outcome(question) for v in votes], [v.prompt for v in votes],
        margin=config.equivalence_margin, alpha=config.alpha, n_boot=config.n_boot,
        seed=config.seed, confidence=config.confidence)
    n_left = sum(v.sides[question] == "left" for v in votes)
    n_right = sum(v.sides[question] == "right" for v in votes)
    summary["position_bias"] = {
        "left": n_left, "right": n_right,
        "left_share": n_left / (n_left + n_right) if n_left + n_right else None,
        "p": stats.position_bias_test(n_left, n_right),
    }
    matrix = stats.reliability_matrix(
        (v.rater, v.item_id, stats.SCORES[v.outcome(question)]) for v in votes)
    alpha = stats.krippendorff_alpha_ordinal(matrix) if matrix.size else float("nan")
    summary["krippendorff_alpha_ordinal"] = alpha
    return summary


def analyze(votes: Sequence[VoteRecord], config: StudyConfig) -> dict:
    """The study's results as one JSON-able dict (see the module docstring)."""
    checks = rater_checks(votes)
    excluded = stats.excluded_raters(checks, config.min_check_accuracy, config.min_checks)
    raters: dict[str, dict] = {}
    for v in votes:
        r = raters.setdefault(v.rater, {"main_votes": 0, "check_votes": 0, "practice_votes": 0})
        key = "practice_votes" if v.kind == "practice" else "check_votes" if v.kind.startswith("check") else "main_votes"
        r[key] += 1
    for name, r in raters.items():
        s = checks.get(name, stats.CheckScore(0, 0))
        r.update(checks_answered=s.answered, checks_correct=s.correct,
                 check_accuracy=s.accuracy if s.answered else None, excluded=name in excluded)
    main = [v for v in votes if v.kind == "main"]
    kept = [v for v in main if v.rater not in excluded]
    pairs = {}
    for a, b in config.pairs:
        sub = [v for v in kept if (v.method_a, v.method_b) == (a, b)]
        sub_all = [v for v in main if (v.method_a, v.method_b) == (a, b)]
        pairs[f"{a} vs {b}"] = {
            "method_a": a, "method_b": b,
            "questions": {q: _question_summary(sub, q, config) for q in QUESTIONS},
            "before_exclusion": {q: {o: sum(v.outcome(q) == o for v in sub_all)
                                     for o in stats.OUTCOMES} for q in QUESTIONS},
        }
    return {
        "study": config.name,
        "config": {k: v for k, v in asdict(config).items() if k != "encode"},
        "exclusion_rule": (f"exclude raters with at least {config.min_checks} answered check "
                           f"item(s) and check accuracy below {config.min_check_accuracy:.0%}"),
        "excluded_raters": sorted(excluded),
        "raters": raters,
        "n_votes": {"all": len(votes), "main": len(main), "main_after_exclusion": len(kept)},
        "pairs": pairs,
    }


def progress_tables(session: Session, study_id: int) -> dict[str, list[dict]]:
    """Admin progress: per rater (started, done/total, checks) and per item (assigned, voted)."""
    votes = load_votes(session, study_id)
    checks = rater_checks(votes)
    raters = []
    for rater in session.scalars(select(Rater).where(Rater.study_id == study_id).order_by(Rater.id)):
        rows = session.execute(
            select(Item.kind, func.count(Assignment.id), func.count(Vote.id))
            .join(Item, Item.id == Assignment.item_id)
            .outerjoin(Vote, Vote.assignment_id == Assignment.id)
            .where(Assignment.rater_id == rater.id)
            .group_by(Item.kind)).all()
        total = sum(n for k, n, _ in rows if k != "practice")
        done = sum(d for k, _, d in rows if k != "practice")
        s = checks.get(rater.label)
        raters.append({
            "label": rater.label, "token": rater.token, "started": rater.started_at is not None,
            "done": done, "total": total,
            "practice_done": sum(d for k, _, d in rows if k == "practice"),
            "checks_answered": s.answered if s else 0,
            "check_accuracy": s.accuracy if s and s.answered else None,
        })
    assigned = dict(session.execute(select(Assignment.item_id, func.count(Assignment.id))
                                    .group_by(Assignment.item_id)).all())
    voted = dict(session.execute(select(Vote.item_id, func.count(Vote.id)).group_by(Vote.item_id)).all())
    items = [{
        "id": it.id, "kind": it.kind, "prompt": it.prompt, "seed": it.seed,
        "method_a": it.method_a, "method_b": it.method_b, "target": it.target_ratings,
        "assigned": int(assigned.get(it.id, 0)), "votes": int(voted.get(it.id, 0)),
    } for it in session.scalars(select(Item).where(Item.study_id == study_id).order_by(Item.id))]
    return {"raters": raters, "items": items}
