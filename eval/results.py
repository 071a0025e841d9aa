"""From the database to the study's numbers: vote records, progress tables and the analysis.

Shared by ``attnqat eval report``, ``attnqat eval import`` and the admin view of the rater app.
The analysis follows the study's declared configuration: check-item accuracy per rater, the
exclusion rule (and the organiser's exclusions of raters and items), then per method pair and per
question (overall and each criterion) the W/T/L statistics of
:func:`attnqat.eval.stats.summarize_wtl`, the position-bias test and Krippendorff's alpha, view
times with fast voters flagged, and warnings where the data cannot carry a conclusion.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from . import rating, stats
from .storage import CRITERIA, Assignment, Clip, Item, Rater, Report, Video, Vote
from .study import StudyConfig

#: Resolved answer (a / b / tie) → outcome for method A.
OUTCOME_OF: dict[str, str] = {"a": "win", "tie": "tie", "b": "lose"}
QUESTIONS: tuple[str, ...] = ("overall", *CRITERIA)
#: Agreement below this Krippendorff alpha (0 = chance) is reported as chance level.
CHANCE_ALPHA = 0.1
#: A rater with at least this many timed votes, most of them fast, is flagged.
MIN_TIMED_VOTES = 3


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
    """One vote with everything needed to analyse or export it (times as ISO 8601 UTC).

    ``answers`` maps each answered question to a / b / tie (imported votes may answer only some
    questions); ``sides`` to what was clicked (left / right / tie, ``both_bad`` for the overall
    answer "both are bad"), or is empty when the displayed order is unknown.
    """

    vote_id: int
    rater: str
    item_id: int
    kind: str
    prompt: str
    seed: int | None
    method_a: str
    method_b: str
    expected: str | None
    left_method: str | None
    right_method: str | None
    left_is_a: bool | None
    shown_at: str | None
    voted_at: str | None
    answers: dict[str, str] = field(default_factory=dict)  # question -> a / b / tie
    sides: dict[str, str] = field(default_factory=dict)  # question -> left / right / tie
    both_bad: bool = False
    comment: str | None = None
    view_seconds: float | None = None
    play_seconds: float | None = None
    #: The organiser's exclusion of this vote's rater or item (with the reason), else None.
    excluded_by_organiser: str | None = None
    #: For a ``check_repeat`` vote: the main item it repeats.
    repeat_of: int | None = None
    #: The crowd platform's worker id of the rater (None for invites without one).
    worker_id: str | None = None

    def outcome(self, question: str = "overall") -> str:
        """win / tie / lose for method A."""
        return OUTCOME_OF[self.answers[question]]

    def flat(self) -> dict:
        """One flat row for CSV/JSON export (keyed by vote, rater and worker id first)."""
        d = asdict(self)
        d = {"vote_id": d.pop("vote_id"), "rater": d.pop("rater"),
             "worker_id": d.pop("worker_id"), **d}
        answers, sides = d.pop("answers"), d.pop("sides")
        for q in QUESTIONS:
            d[f"{q}_clicked"] = sides.get(q)
            d[q] = answers.get(q)
            d[f"{q}_outcome_for_a"] = OUTCOME_OF[answers[q]] if q in answers else None
        return d


def load_votes(session: Session, study_id: int) -> list[VoteRecord]:
    """All votes of a study (practice included; callers filter by ``kind``), in vote order."""
    degraded = set(session.scalars(select(Clip.id).where(Clip.study_id == study_id,
                                                         Clip.degraded.is_(True))))
    durations = {(item_id, left): d for item_id, left, d in session.execute(
        select(Video.item_id, Video.a_on_left, Video.duration_s).where(Video.study_id == study_id))}
    rows = session.execute(
        select(Vote, Item, Rater)
        .join(Item, Item.id == Vote.item_id)
        .join(Rater, Rater.id == Vote.rater_id)
        .where(Item.study_id == study_id)
        .order_by(Vote.id)).all()
    out = []
    for vote, item, rater in rows:
        answers = {"overall": vote.overall, **{c: getattr(vote, c) for c in CRITERIA}}
        sides = {"overall": "both_bad" if vote.both_bad else vote.overall_side,
                 **{c: getattr(vote, f"{c}_side") for c in CRITERIA}}
        name_a = item.method_a + (" (degraded)" if item.clip_a_id in degraded else "")
        name_b = item.method_b + (" (degraded)" if item.clip_b_id in degraded else "")
        left, right = (name_a, name_b) if vote.left_is_a else (name_b, name_a)
        view = vote.view_seconds
        if view is None and vote.shown_at and vote.voted_at:  # votes stored before view times
            view = (vote.voted_at - vote.shown_at).total_seconds()
        excluded = None
        if rater.excluded:
            excluded = f"rater excluded: {rater.exclusion_reason or 'no reason given'}"
        elif item.excluded:
            excluded = f"item excluded: {item.exclusion_reason or 'no reason given'}"
        out.append(VoteRecord(vote.id, rater.label, item.id, item.kind, item.prompt, item.seed,
                              item.method_a, item.method_b, item.expected, left, right,
                              vote.left_is_a, _iso(vote.shown_at), _iso(vote.voted_at),
                              answers, sides, bool(vote.both_bad), vote.comment, view,
                              durations.get((item.repeat_of or item.id, vote.left_is_a)), excluded,
                              item.repeat_of, rater.worker_id))
    return out


def rater_checks(votes: Sequence[VoteRecord], reports: Sequence[tuple[str, str]] = ()
                 ) -> dict[str, stats.CheckScore]:
    """Check-item score per rater (overall answer against the expected one). A check item the
    rater reported as broken (``reports``: (rater, item kind)) counts as answered and wrong:
    otherwise "report a problem and skip" would dodge every check."""
    answers = [(v.rater, v.answers["overall"], v.expected)
               for v in votes if v.kind.startswith("check") and v.kind != "check_repeat"
               and "overall" in v.answers]
    first = {(v.rater, v.item_id): v.answers.get("overall") for v in votes if v.kind == "main"}
    for v in votes:  # a repeat is right unless it reverses the rater's decisive answer
        if v.kind == "check_repeat" and "overall" in v.answers:
            before = first.get((v.rater, v.repeat_of))
            if before is not None:
                flipped = {before, v.answers["overall"]} == {"a", "b"}
                answers.append((v.rater, "reversed" if flipped else "consistent", "consistent"))
    answers += [(rater, "reported", "not reported") for rater, kind in reports
                if kind.startswith("check")]
    return stats.check_scores(answers)


def load_reports(session: Session, study_id: int) -> list[tuple[str, str]]:
    """(rater label, item kind) of every problem report of a study."""
    return [(label, kind) for label, kind in session.execute(
        select(Rater.label, Item.kind).join(Report, Report.rater_id == Rater.id)
        .join(Item, Item.id == Report.item_id).where(Report.study_id == study_id)
        .order_by(Report.id))]


def _question_summary(votes: Sequence[VoteRecord], question: str, config: StudyConfig) -> dict:
    votes = [v for v in votes if question in v.answers]
    summary = stats.summarize_wtl(
        [v.outcome(question) for v in votes], [v.prompt for v in votes],
        margin=config.equivalence_margin, alpha=config.alpha, n_boot=config.n_boot,
        seed=config.seed, confidence=config.confidence, test=config.test,
        min_prompts=config.min_prompts)
    n_left = sum(v.sides.get(question) == "left" for v in votes)
    n_right = sum(v.sides.get(question) == "right" for v in votes)
    summary["position_bias"] = {
        "left": n_left, "right": n_right,
        "left_share": n_left / (n_left + n_right) if n_left + n_right else None,
        "p": stats.position_bias_test(n_left, n_right),
    }
    matrix = stats.reliability_matrix(
        (v.rater, v.item_id, stats.SCORES[v.outcome(question)]) for v in votes)
    alpha = stats.krippendorff_alpha_ordinal(matrix) if matrix.size else float("nan")
    summary["krippendorff_alpha_ordinal"] = alpha
    if votes:
        if math.isnan(alpha):
            summary["warnings"].append("agreement cannot be measured (no item has ratings from "
                                       "two raters)")
        elif alpha < CHANCE_ALPHA:
            summary["warnings"].append(
                f"raters agree at chance level (Krippendorff's α = {alpha:.2f}); random answers "
                f"average to Δ ≈ 0, so a '{summary['margin_test']['test']}' verdict may be noise")
    if question == "overall":
        summary["both_bad"] = sum(v.both_bad for v in votes)
    return summary


def _rater_times(votes: Sequence[VoteRecord], margin: float) -> dict[str, dict]:
    """Per rater: median view-to-vote seconds, and how many timed votes were fast (less than
    ``margin`` seconds after one play-through)."""
    out: dict[str, dict] = {}
    for v in votes:
        r = out.setdefault(v.rater, {"times": [], "fast": 0})
        if v.view_seconds is not None:
            r["times"].append(v.view_seconds)
            if v.play_seconds is not None and v.view_seconds < v.play_seconds + margin:
                r["fast"] += 1
    result = {}
    for rater, r in out.items():
        timed = len(r["times"])
        result[rater] = {
            "median_view_seconds": statistics.median(r["times"]) if timed else None,
            "timed_votes": timed, "fast_votes": r["fast"],
            "fast": timed >= MIN_TIMED_VOTES and r["fast"] * 2 >= timed,
        }
    return result


def _check_rule_warning(checks: dict[str, stats.CheckScore], config: StudyConfig) -> str | None:
    answered = [s.answered for s in checks.values() if s.answered]
    if not answered:
        return "no rater answered a check item: the exclusion rule could not be applied"
    k = int(statistics.median(answered))
    keep_random, drop_careful = stats.exclusion_rule_error_rates(k, config.min_check_accuracy)
    if keep_random > 0.05 or drop_careful > 0.05:
        return (f"raters answered a median of {k} check item(s): a rater answering at random "
                f"passes the exclusion rule with probability {keep_random:.0%}, and a careful "
                f"rater (95% right) is excluded with probability {drop_careful:.0%}; serve more "
                "check items (--check-fraction) for a rule that separates them")
    return None


def analyze(votes: Sequence[VoteRecord], config: StudyConfig,
            reports: Sequence[tuple[str, str]] = ()) -> dict:
    """The study's results as one JSON-able dict (see the module docstring). ``reports`` are
    the problem reports as (rater, item kind): a reported check item counts as failed."""
    checks = rater_checks(votes, reports)
    excluded = stats.excluded_raters(checks, config.min_check_accuracy, config.min_checks)
    # The rule needs check items in the data; if nobody answered one, a warning says so.
    has_checks = (any(v.kind.startswith("check") for v in votes)
                  or any(kind.startswith("check") for _, kind in reports))
    too_few_checks = set()
    if has_checks and config.required_checks > 0:
        voters = {v.rater for v in votes if v.kind == "main"}
        too_few_checks = {r for r in voters
                          if checks.get(r, stats.CheckScore(0, 0)).answered < config.required_checks}
        excluded |= too_few_checks
    organiser = {}
    for v in votes:
        if v.excluded_by_organiser and v.excluded_by_organiser.startswith("rater"):
            organiser.setdefault(v.rater, v.excluded_by_organiser)
    times = _rater_times(votes, config.fast_vote_margin)
    raters: dict[str, dict] = {}
    for v in votes:
        r = raters.setdefault(v.rater, {"main_votes": 0, "check_votes": 0, "practice_votes": 0})
        key = ("practice_votes" if v.kind == "practice" else
               "check_votes" if v.kind.startswith("check") else "main_votes")
        r[key] += 1
    for name, r in raters.items():
        s = checks.get(name, stats.CheckScore(0, 0))
        r.update(checks_answered=s.answered, checks_correct=s.correct,
                 check_accuracy=s.accuracy if s.answered else None, excluded=name in excluded,
                 too_few_checks=name in too_few_checks,
                 excluded_by_organiser=organiser.get(name), **times.get(name, {}))
    main = [v for v in votes if v.kind == "main"]
    kept = [v for v in main if v.rater not in excluded and v.excluded_by_organiser is None]
    excluded_items = sorted({(v.item_id, v.excluded_by_organiser) for v in main
                             if v.excluded_by_organiser and v.excluded_by_organiser.startswith("item")})
    pairs = {}
    for a, b in config.pairs:
        sub = [v for v in kept if (v.method_a, v.method_b) == (a, b)]
        sub_all = [v for v in main if (v.method_a, v.method_b) == (a, b)]
        pairs[f"{a} vs {b}"] = {
            "method_a": a, "method_b": b,
            "questions": {q: _question_summary(sub, q, config) for q in QUESTIONS},
            "before_exclusion": {q: {o: sum(v.outcome(q) == o for v in sub_all if q in v.answers)
                                     for o in stats.OUTCOMES} for q in QUESTIONS},
        }
    multiplicity = _holm_across(pairs, config.alpha)
    ranking = None
    methods = {m for p in config.pairs for m in p}
    if len(methods) > 2:
        counts: dict[str, int] = {}
        for a, b in config.pairs:
            counts[a] = counts.get(a, 0) + 1
            counts[b] = counts.get(b, 0) + 1
        anchor = max(sorted(counts), key=counts.get)  # the reference most pairs share
        comparisons = [(v.method_a, v.method_b, v.outcome("overall"), v.prompt) for v in kept
                       if "overall" in v.answers and (v.method_a, v.method_b) in config.pairs]
        try:
            if not comparisons:
                raise ValueError("no votes to rank the methods by")
            ranking = stats.bradley_terry_ranking(comparisons, anchor=anchor,
                                                  n_boot=config.n_boot, seed=config.seed,
                                                  confidence=config.confidence)
        except ValueError as exc:
            ranking = {"error": str(exc)}
    warnings = _exclusion_warnings(main, kept, pairs, config)
    if any(v.kind.startswith("check") for v in votes) or config.check_fraction > 0:
        w = _check_rule_warning(checks, config)
        if w and votes:
            warnings.append(w)
    fast = sorted(r for r, t in times.items() if t["fast"])
    if fast:
        warnings.append(f"fast voters (most votes less than {config.fast_vote_margin:g} s after "
                        f"one play-through): {', '.join(fast)}")
    return {
        "study": config.name,
        "config": {k: v for k, v in asdict(config).items()
                   if k not in ("encode", "crowd_token", "completion_code")},
        "exclusion_rule": (f"exclude raters with at least {config.min_checks} answered check "
                           f"item(s) and check accuracy below {config.min_check_accuracy:.0%}"
                           + (f", and raters who answered fewer than {config.required_checks} "
                              "check item(s) (a reported check counts as wrong)"
                              if has_checks and config.required_checks else "")),
        "excluded_raters": sorted(excluded),
        "excluded_by_organiser": {"raters": organiser,
                                  "items": {str(i): why for i, why in excluded_items}},
        "fast_raters": fast,
        "raters": raters,
        "n_votes": {"all": len(votes), "main": len(main), "main_after_exclusion": len(kept)},
        "pairs": pairs,
        "multiplicity": multiplicity,
        "ranking": ranking,
        "warnings": warnings,
    }


def _exclusion_warnings(main: Sequence[VoteRecord], kept: Sequence[VoteRecord], pairs: dict,
                        config: StudyConfig) -> list[str]:
    """Warnings when the exclusions leave fewer raters than planned or change a verdict."""
    out = []
    before, after = {v.rater for v in main}, {v.rater for v in kept}
    if not main:
        return out
    per_item: dict[int, int] = {}
    for v in kept:
        per_item[v.item_id] = per_item.get(v.item_id, 0) + 1
    items = {v.item_id for v in main}
    short = [i for i in items if per_item.get(i, 0) < config.ratings_per_item]
    if short or len(after) < len(before):
        fewest = min((per_item.get(i, 0) for i in items), default=0)
        if short:
            out.append(f"after exclusion {len(after)} of {len(before)} rater(s) remain; {len(short)} "
                       f"of {len(items)} main item(s) have fewer than the planned "
                       f"{config.ratings_per_item} rating(s) (fewest: {fewest})")
        elif len(after) <= 2:
            out.append(f"after exclusion only {len(after)} rater(s) remain: the verdicts rest on "
                       "their votes alone")
    for name, data in pairs.items():
        a, b = data["method_a"], data["method_b"]
        sub_all = [v for v in main if (v.method_a, v.method_b) == (a, b) and "overall" in v.answers]
        if not sub_all:
            continue
        unexcluded = stats.summarize_wtl(
            [v.outcome("overall") for v in sub_all], [v.prompt for v in sub_all],
            margin=config.equivalence_margin, alpha=config.alpha, n_boot=0, test=config.test,
            min_prompts=config.min_prompts)["margin_test"]["verdict"]
        now = data["questions"]["overall"]["margin_test"]["verdict"]
        data["verdict_before_exclusion"] = unexcluded
        if unexcluded != now:
            out.append(f"{name}: the exclusions change the overall verdict (all votes: "
                       f"'{unexcluded}'; after exclusion: '{now}')")
    return out


def _holm_across(pairs: dict, alpha: float) -> dict:
    """Holm's adjustment over every margin test of the study (pairs × questions): each test
    gets ``p_holm`` and ``passed_holm`` (the verdict that holds for the whole family at
    ``alpha``); returns how many tests the family has."""
    tests = [s["margin_test"] for data in pairs.values() for s in data["questions"].values()]
    counted = [mt for mt in tests if mt["passed"] is not None]
    adjusted = stats.holm([mt["p"] for mt in counted])
    for mt, p in zip(counted, adjusted):
        mt["p_holm"] = p
        mt["passed_holm"] = bool(p < alpha)
    for mt in tests:
        mt.setdefault("p_holm", math.nan)
        mt.setdefault("passed_holm", None)
    return {"method": "Holm", "tests": len(counted), "alpha": alpha,
            "family": f"{len(pairs)} pair(s) × {len(QUESTIONS)} questions"}


def progress_tables(session: Session, study_id: int, config: StudyConfig
                    ) -> dict[str, list[dict]]:
    """Admin progress: per rater (started, done/total, checks, view times, status), per item
    (assigned, voted, excluded) and the problem reports."""
    votes = load_votes(session, study_id)
    checks = rater_checks(votes, load_reports(session, study_id))
    times = _rater_times(votes, config.fast_vote_margin)
    raters = []
    for rater in session.scalars(select(Rater).where(Rater.study_id == study_id).order_by(Rater.id)):
        p = rating.progress(session, rater)
        released = session.scalar(select(func.count(Assignment.id)).where(
            Assignment.rater_id == rater.id, Assignment.released_at.is_not(None))) or 0
        s = checks.get(rater.label)
        t = times.get(rater.label, {})
        raters.append({
            "label": rater.label, "token": rater.token, "started": rater.started_at is not None,
            "worker_id": rater.worker_id, "expires": _iso(rater.expires_at),
            "done": p["done"], "total": p["total"], "released": released,
            "practice_done": p["practice_done"],
            "checks_answered": s.answered if s else 0,
            "check_accuracy": s.accuracy if s and s.answered else None,
            "median_view_seconds": t.get("median_view_seconds"), "fast": t.get("fast", False),
            "last_seen": _iso(rater.last_seen_at),
            "revoked": rater.revoked_at is not None, "excluded": rater.excluded,
            "exclusion_reason": rater.exclusion_reason,
        })
    active = (select(Assignment.item_id, func.count(Assignment.id))
              .where(Assignment.released_at.is_(None)).group_by(Assignment.item_id))
    assigned = dict(session.execute(active).all())
    voted = dict(session.execute(select(Vote.item_id, func.count(Vote.id)).group_by(Vote.item_id)).all())
    items = [{
        "id": it.id, "kind": it.kind, "prompt": it.prompt, "seed": it.seed,
        "method_a": it.method_a, "method_b": it.method_b, "target": it.target_ratings,
        "assigned": int(assigned.get(it.id, 0)), "votes": int(voted.get(it.id, 0)),
        "excluded": it.excluded, "exclusion_reason": it.exclusion_reason,
    } for it in session.scalars(select(Item).where(Item.study_id == study_id).order_by(Item.id))]
    labels = dict(session.execute(select(Rater.id, Rater.label).where(Rater.study_id == study_id)).all())
    reports = [{
        "id": r.id, "rater": labels.get(r.rater_id), "item": r.item_id, "reason": r.reason,
        "comment": r.comment, "time": _iso(r.created_at),
    } for r in session.scalars(select(Report).where(Report.study_id == study_id).order_by(Report.id))]
    return {"raters": raters, "items": items, "reports": reports}
