"""The rater flow, independent of HTTP: invites, queues, the current item, votes, releases.

A rater is known only by an invite token (random, 128 bits); unknown and revoked tokens are
refused. After the instructions the rater's queue is fixed in one transaction:

* the practice items first (every rater, never counted);
* main items that still need ratings (fewer active assignments than ``ratings_per_item``),
  least-assigned first, at most ``items_per_rater`` of them (0: all), never one item twice (a
  unique constraint), never an item the organiser excluded;
* check items in proportion (the study's share of check items, at least one), both kinds;
* shuffled, and counterbalanced: within the rater's main items and within their check items, half
  show A on the left (±1); which half favours items whose earlier raters saw A more on the right.

The current item is the first open assignment in queue order, so a rater who closes the browser
resumes exactly where they were. An assignment stops being open when it gets its vote, or when it
is *released* without one:

* ``inactive`` — its rater did nothing for ``release_after_minutes`` (checked whenever another
  rater starts, and in the admin view): the item goes back to the pool. If the rater comes back,
  they get back those of their items that nobody else took;
* ``broken`` — the rater reported that the pair does not load (a :class:`Report` is stored);
* ``released``, ``revoked``, ``excluded`` — organiser actions (release a rater's queue, withdraw
  an invite, exclude an item).

A vote names its assignment token; it is refused when the assignment belongs to someone else, was
never shown, is no longer open, already has a vote (one vote per assignment, enforced by the
database too), or comes before the pair could have played through (``min_view_factor`` times its
duration after it was first shown).
"""

from __future__ import annotations

import random
import re
import secrets
import threading
from collections.abc import Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from .storage import (
    BOTH_BAD,
    CRITERIA,
    SIDES,
    Assignment,
    Clip,
    Item,
    Rater,
    Report,
    Study,
    Video,
    Vote,
    utcnow,
)

#: Most invites one request (admin form, admin API) may create.
MAX_INVITES = 500
#: Longest comment kept with a vote or a problem report.
MAX_COMMENT = 2000
#: Why a rater may report a pair.
REPORT_REASONS: tuple[str, ...] = ("not_loading", "other")


class RatingError(Exception):
    """A refused rater request; ``status`` is the HTTP status the app answers with."""

    status = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UnknownRater(RatingError):
    status = 403


class NotAssigned(RatingError):
    status = 403


class NotStarted(RatingError):
    status = 409


class NotShown(RatingError):
    status = 409


class AlreadyVoted(RatingError):
    status = 409


class Released(RatingError):
    status = 409


class TooEarly(RatingError):
    """A vote before the pair could have played through (HTTP 425 Too Early)."""

    status = 425

    def __init__(self, message: str, wait_seconds: float) -> None:
        super().__init__(message)
        self.wait_seconds = wait_seconds


class InvalidVote(RatingError):
    status = 422


class StudyFull(RatingError):
    status = 403


#: Serializes queue creation inside one server process (the database lock does across processes).
_QUEUE_LOCK = threading.Lock()


def add_raters(Session: sessionmaker, study_id: int, n: int, prefix: str = "rater",
               expires_days: float | None = None) -> list[tuple[str, str]]:
    """Create ``n`` invites; returns (label, token) pairs. Labels number on from existing raters.
    ``expires_days`` > 0: the links stop working that many days from now."""
    if n < 0:
        raise ValueError("the number of raters must be non-negative")
    expires = utcnow() + timedelta(days=expires_days) if expires_days else None
    out = []
    with Session.begin() as session:
        existing = session.scalar(select(func.count(Rater.id)).where(Rater.study_id == study_id)) or 0
        for k in range(n):
            label = f"{prefix}-{existing + k + 1:03d}"
            token = secrets.token_urlsafe(16)
            session.add(Rater(study_id=study_id, token=token, label=label, expires_at=expires))
            out.append((label, token))
    return out


#: What a crowd platform's worker id may look like.
WORKER_ID = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")


def claim_for_worker(rater: Rater, worker_id: str) -> None:
    """Record the worker id an invite is opened with; an invite opened by another worker id
    before is refused."""
    if not WORKER_ID.fullmatch(worker_id):
        raise InvalidVote("worker_id: 1 to 128 letters, digits or _ . : @ -")
    if rater.worker_id is None:
        rater.worker_id = worker_id
    elif rater.worker_id != worker_id:
        raise UnknownRater("this invite link belongs to another worker")


def crowd_rater(Session: sessionmaker, study_id: int, worker_id: str, max_raters: int,
                expires_days: float | None = None) -> str:
    """The invite token of ``worker_id``'s rater, made on the first visit through the study's
    crowd link (at most ``max_raters`` such raters: :class:`StudyFull` after that)."""
    if not WORKER_ID.fullmatch(worker_id):
        raise InvalidVote("worker_id: 1 to 128 letters, digits or _ . : @ -")
    with _QUEUE_LOCK, Session.begin() as session:
        session.execute(select(Study.id).where(Study.id == study_id).with_for_update())
        rater = session.scalar(select(Rater).where(Rater.study_id == study_id,
                                                   Rater.worker_id == worker_id))
        if rater is not None:
            return rater.token
        crowd = session.scalar(select(func.count(Rater.id)).where(
            Rater.study_id == study_id, Rater.label.like("worker-%"))) or 0
        if crowd >= max_raters:
            raise StudyFull("this study has all the workers it needs; thank you")
        existing = session.scalar(select(func.count(Rater.id)).where(Rater.study_id == study_id)) or 0
        token = secrets.token_urlsafe(16)
        expires = utcnow() + timedelta(days=expires_days) if expires_days else None
        session.add(Rater(study_id=study_id, token=token, label=f"worker-{existing + 1:03d}",
                          worker_id=worker_id, expires_at=expires))
        return token


def get_rater(session: Session, study_id: int, token: str, *, touch: bool = False) -> Rater:
    """The rater with this invite token in this study, or :class:`UnknownRater` (also for a
    withdrawn invite). ``touch`` records the request as the rater's latest activity."""
    rater = session.scalar(select(Rater).where(Rater.token == token, Rater.study_id == study_id))
    if rater is None:
        raise UnknownRater("unknown invite token")
    if rater.revoked_at is not None:
        raise UnknownRater("this invite has been withdrawn by the study organiser")
    if rater.expires_at is not None and utcnow() > rater.expires_at:
        raise UnknownRater("this invite has expired")
    if touch:
        rater.last_seen_at = utcnow()
    return rater


def _open(query):  # noqa: ANN001, ANN202 - a Select on Assignment
    """Restrict a query on assignments to open ones (no vote, not released)."""
    return (query.outerjoin(Vote, Vote.assignment_id == Assignment.id)
            .where(Vote.id.is_(None), Assignment.released_at.is_(None)))


def _assignment_counts(session: Session, study_id: int) -> dict[int, tuple[int, int]]:
    """item id -> (active assignments, active assignments with A on the left); released
    assignments free their slot."""
    rows = session.execute(
        select(Assignment.item_id, func.count(Assignment.id),
               func.sum(case((Assignment.a_on_left, 1), else_=0)))
        .join(Item, Item.id == Assignment.item_id)
        .where(Item.study_id == study_id, Assignment.released_at.is_(None))
        .group_by(Assignment.item_id))
    return {item_id: (int(n), int(left or 0)) for item_id, n, left in rows}


def release_inactive(session: Session, study_id: int, minutes: float,
                     now: datetime | None = None) -> int:
    """Release the open assignments of raters inactive for ``minutes`` (0: never); returns how
    many were released."""
    if not minutes or minutes <= 0:
        return 0
    now = now or utcnow()
    cutoff = now - timedelta(minutes=minutes)
    last = func.coalesce(Rater.last_seen_at, Rater.started_at)
    stale = select(Rater.id).where(Rater.study_id == study_id, Rater.started_at.is_not(None),
                                   last < cutoff)
    return _release(session, select(Assignment).where(Assignment.rater_id.in_(stale)), "inactive")


def _release(session: Session, query, reason: str) -> int:  # noqa: ANN001 - a Select
    rows = list(session.scalars(_open(query)))
    now = utcnow()
    for a in rows:
        a.released_at, a.release_reason = now, reason
    return len(rows)


def release_assignments(session: Session, rater: Rater, reason: str) -> int:
    """Release the open assignments of ``rater`` now, with ``reason``; returns how many."""
    return _release(session, select(Assignment).where(Assignment.rater_id == rater.id), reason)


def _least_used(items: list[Item], counts: Mapping[int, tuple[int, int]], rng: random.Random
                ) -> list[Item]:
    items = list(items)
    rng.shuffle(items)
    return sorted(items, key=lambda it: counts.get(it.id, (0, 0))[0])


def _balanced_sides(items: list[Item], counts: Mapping[int, tuple[int, int]], rng: random.Random
                    ) -> dict[int, bool]:
    """A-on-left for half of ``items`` (the half whose A was least often on the left so far)."""
    def imbalance(it: Item) -> int:
        n, left = counts.get(it.id, (0, 0))
        return left - (n - left)

    order = list(items)
    rng.shuffle(order)
    order.sort(key=imbalance)
    n_left = len(order) // 2 + (rng.random() < 0.5 if len(order) % 2 else 0)
    return {it.id: i < n_left for i, it in enumerate(order)}


def start(Session: sessionmaker, study_id: int, token: str, seed: int | None = None, *,
          release_after_minutes: float | None = None) -> bool:
    """The rater read the instructions: fix their queue (idempotent). False if the study has no
    items left for them. Stale queues of other raters are released first, after
    ``release_after_minutes`` of inactivity (None: the study's declared value; the server passes
    its own, which ``attnqat eval serve --release-after`` may override)."""
    with _QUEUE_LOCK, Session.begin() as session:
        # Serializes queue creation across server processes on databases with row locks.
        session.execute(select(Study.id).where(Study.id == study_id).with_for_update())
        rater = get_rater(session, study_id, token, touch=True)
        if rater.started_at is not None:
            return _queue_size(session, rater) > 0
        rater.started_at = utcnow()
        study = session.get(Study, study_id)
        config = study.config
        if release_after_minutes is None:
            release_after_minutes = float(config.get("release_after_minutes", 0) or 0)
        release_inactive(session, study_id, release_after_minutes)
        rng = random.Random(seed if seed is not None else secrets.randbits(64))
        items = list(session.scalars(select(Item).where(Item.study_id == study_id,
                                                        Item.excluded.is_(False))
                                     .order_by(Item.id)))
        counts = _assignment_counts(session, study_id)
        main_all = [it for it in items if it.kind == "main"]
        candidates = [it for it in main_all if counts.get(it.id, (0, 0))[0] < it.target_ratings]
        per_rater = int(config.get("items_per_rater") or 0)
        chosen = _least_used(candidates, counts, rng)[: per_rater or None]
        if not chosen:
            return False
        identical = _least_used([it for it in items if it.kind == "check_identical"], counts, rng)
        degraded = _least_used([it for it in items if it.kind == "check_degraded"], counts, rng)
        n_checks_all = len(identical) + len(degraded)
        checks: list[Item] = []
        if n_checks_all:
            n = max(1, int(config.get("required_checks", 0) or 0),
                    round(len(chosen) * n_checks_all / max(1, len(main_all))))
            pools = [identical, degraded] if rng.random() < 0.5 else [degraded, identical]
            while len(checks) < min(n, n_checks_all):
                for pool in pools:
                    if pool and len(checks) < n:
                        checks.append(pool.pop(0))
        # A practice pair some rater reported as not loading is not served to anyone again.
        broken = set(session.scalars(select(Report.item_id).where(
            Report.study_id == study_id, Report.reason == "not_loading")))
        practice = [it for it in items if it.kind == "practice" and it.id not in broken]
        sides = {**_balanced_sides(chosen, counts, rng), **_balanced_sides(checks, counts, rng)}
        repeats_of = {it.repeat_of: it for it in items if it.kind == "check_repeat"}
        originals = [it for it in chosen if it.id in repeats_of]
        rng.shuffle(originals)
        repeats = [repeats_of[it.id] for it in originals[:int(config.get("repeat_checks", 0) or 0)]]
        for rep in repeats:  # the same pair, the other way round
            sides[rep.id] = not sides[rep.repeat_of]
        queue = chosen + checks + repeats
        rng.shuffle(queue)
        if repeats:  # never back to back with its original
            for rep in repeats:
                i = queue.index(rep)
                j = queue.index(next(it for it in chosen if it.id == rep.repeat_of))
                if abs(i - j) == 1 and len(queue) > 3:
                    queue.remove(rep)
                    queue.insert((max(i, j) + len(queue) // 2) % len(queue), rep)
        position = 0
        for it in practice:
            session.add(Assignment(token=secrets.token_urlsafe(12), rater_id=rater.id,
                                   item_id=it.id, position=position, a_on_left=rng.random() < 0.5))
            position += 1
        for it in queue:
            session.add(Assignment(token=secrets.token_urlsafe(12), rater_id=rater.id,
                                   item_id=it.id, position=position, a_on_left=sides[it.id]))
            position += 1
        return True


def _queue_size(session: Session, rater: Rater) -> int:
    return session.scalar(select(func.count(Assignment.id)).where(Assignment.rater_id == rater.id)) or 0


def progress(session: Session, rater: Rater) -> dict[str, int]:
    """Counts for the progress bar: practice and rated items, done and total (released items
    leave the total)."""
    rows = session.execute(
        select(Item.kind, func.count(Assignment.id), func.count(Vote.id))
        .join(Item, Item.id == Assignment.item_id)
        .outerjoin(Vote, Vote.assignment_id == Assignment.id)
        .where(Assignment.rater_id == rater.id,
               (Assignment.released_at.is_(None)) | (Vote.id.is_not(None)))
        .group_by(Item.kind))
    out = {"practice_total": 0, "practice_done": 0, "total": 0, "done": 0}
    for kind, n, voted in rows:
        if kind == "practice":
            out["practice_total"] += n
            out["practice_done"] += voted
        else:
            out["total"] += n
            out["done"] += voted
    return out


def stage(session: Session, rater: Rater) -> str:
    """``instructions`` (not started), ``practice``, ``rating``, ``done``, ``released`` (the
    organiser gave the rest of the queue to others), or ``full`` (started, but the study had
    nothing left to assign)."""
    if rater.started_at is None:
        return "instructions"
    if _queue_size(session, rater) == 0:
        return "full"
    _resume(session, rater)
    p = progress(session, rater)
    if p["practice_done"] < p["practice_total"]:
        return "practice"
    if p["done"] < p["total"]:
        return "rating"
    released = session.scalar(select(func.count(Assignment.id)).where(
        Assignment.rater_id == rater.id, Assignment.release_reason.in_(("released", "excluded"))))
    return "released" if released else "done"


def _reopen_inactive(session: Session, rater: Rater) -> int:
    """A rater back after their queue was released for inactivity gets back the items nobody
    else took (every practice and check item, main items still short of their ratings); returns
    how many."""
    released = list(session.scalars(
        select(Assignment).where(Assignment.rater_id == rater.id,
                                 Assignment.release_reason == "inactive")
        .order_by(Assignment.position)))
    if not released:
        return 0
    counts = _assignment_counts(session, rater.study_id)
    reopened = 0
    for a in released:
        item = a.item
        if item.excluded:
            continue
        if item.kind == "main" and counts.get(item.id, (0, 0))[0] >= item.target_ratings:
            continue
        a.released_at, a.release_reason = None, None
        n, left = counts.get(item.id, (0, 0))
        counts[item.id] = (n + 1, left)
        reopened += 1
    return reopened


def _first_open(session: Session, rater: Rater) -> Assignment | None:
    return session.scalar(_open(select(Assignment)).where(Assignment.rater_id == rater.id)
                          .order_by(Assignment.position).limit(1))


def _resume(session: Session, rater: Rater) -> Assignment | None:
    """The rater's first open assignment; when nothing is open any more, first take back what
    was released while the rater was away."""
    first = _first_open(session, rater)
    if first is None:
        reopened = _reopen_inactive(session, rater)
        session.flush()
        if reopened:
            first = _first_open(session, rater)
    return first


def current(session: Session, rater: Rater) -> Assignment | None:
    """The rater's first open assignment (marked shown now if it never was), or None."""
    if rater.started_at is None:
        raise NotStarted("read the instructions first")
    assignment = _resume(session, rater)
    if assignment is not None and assignment.shown_at is None:
        assignment.shown_at = utcnow()
    return assignment


def served_media(session: Session, assignment: Assignment, media_dir: Path | None = None
                 ) -> dict[str, Any]:
    """What the page plays for an assignment: ``{"video": url}`` (one side-by-side file) or, in a
    study built before side-by-side serving, ``{"left": url, "right": url}``; and the seconds one
    play-through takes (``duration``; in such an older study the longer of its two clips, read
    once from the files in ``media_dir``; None when unknown)."""
    item_id = assignment.item.repeat_of or assignment.item_id
    video = session.scalar(select(Video).where(Video.item_id == item_id,
                                               Video.a_on_left == assignment.a_on_left))
    if video is not None:
        return {"video": f"/media/{video.token}.mp4", "duration": video.duration_s}
    item = assignment.item
    left, right = ((item.clip_a, item.clip_b) if assignment.a_on_left else (item.clip_b, item.clip_a))
    return {"left": f"/media/{left.token}.mp4", "right": f"/media/{right.token}.mp4",
            "duration": _legacy_seconds((left, right), media_dir)}


def resolve(side: str, a_on_left: bool) -> str:
    """What a click on ``side`` means for the item: ``a``, ``b`` or ``tie``."""
    if side in ("tie", BOTH_BAD):
        return "tie"
    return "a" if (side == "left") == a_on_left else "b"


def _own_unvoted_assignment(session: Session, rater: Rater, assignment_token: str) -> Assignment:
    assignment = session.scalar(select(Assignment).where(Assignment.token == assignment_token))
    if assignment is None or assignment.rater_id != rater.id:
        raise NotAssigned("this item is not assigned to you")
    if session.scalar(select(Vote.id).where(Vote.assignment_id == assignment.id)) is not None:
        raise AlreadyVoted("this item already has your vote")
    return assignment


def _own_open_assignment(session: Session, rater: Rater, assignment_token: str) -> Assignment:
    assignment = _own_unvoted_assignment(session, rater, assignment_token)
    if assignment.released_at is not None:
        raise Released("this item is no longer in your queue; reload the page to continue")
    if assignment.shown_at is None:
        raise NotShown("this item has not been shown yet")
    return assignment


def _clean_comment(comment: str | None) -> str | None:
    if comment is None:
        return None
    if not isinstance(comment, str):
        raise InvalidVote("comment must be text")
    comment = comment.strip()
    if len(comment) > MAX_COMMENT:
        raise InvalidVote(f"comment is longer than {MAX_COMMENT} characters")
    return comment or None


def record_vote(session: Session, rater: Rater, assignment_token: str, overall: str,
                criteria: Mapping[str, str], comment: str | None = None, *,
                min_view_factor: float = 0.0, media_dir: Path | None = None,
                now: datetime | None = None) -> Vote:
    """Store one vote after every check that makes it count once and only for its rater.

    ``overall`` is ``left``, ``right``, ``tie`` or ``both_bad`` (a tie that says neither is
    good); each criterion ``left``, ``right`` or ``tie``. With ``min_view_factor`` > 0 the vote is
    refused (:class:`TooEarly`) until that many play-throughs of the pair have passed since it
    was first shown.
    """
    assignment = _own_open_assignment(session, rater, assignment_token)
    if overall not in (*SIDES, BOTH_BAD):
        raise InvalidVote(f"overall must be one of {', '.join((*SIDES, BOTH_BAD))}")
    if not isinstance(criteria, Mapping) or set(criteria) != set(CRITERIA):
        raise InvalidVote(f"criteria must answer exactly: {', '.join(CRITERIA)}")
    for key, side in criteria.items():
        if side not in SIDES:
            raise InvalidVote(f"{key} must be one of {', '.join(SIDES)}")
    comment = _clean_comment(comment)
    now = now or utcnow()
    seconds = (now - assignment.shown_at).total_seconds()
    if min_view_factor > 0:
        duration = play_seconds(session, assignment, media_dir)
        needed = min_view_factor * duration if duration else 0.0
        if seconds < needed:
            raise TooEarly(f"too early: watch the pair through first (it plays {duration:.1f} s)",
                           needed - seconds)
    left_a = assignment.a_on_left
    fields: dict[str, Any] = {}
    for key in CRITERIA:
        fields[f"{key}_side"] = criteria[key]
        fields[key] = resolve(criteria[key], left_a)
    vote = Vote(assignment_id=assignment.id, rater_id=rater.id, item_id=assignment.item_id,
                left_is_a=left_a, shown_at=assignment.shown_at, voted_at=now,
                overall_side="tie" if overall == BOTH_BAD else overall,
                overall=resolve(overall, left_a), both_bad=overall == BOTH_BAD, comment=comment,
                view_seconds=seconds, **fields)
    session.add(vote)
    try:
        session.flush()
    except IntegrityError:
        raise AlreadyVoted("this item already has your vote") from None
    return vote


def play_seconds(session: Session, assignment: Assignment, media_dir: Path | None = None
                 ) -> float | None:
    """Seconds one play-through of an assignment's pair takes (see :func:`served_media`)."""
    return served_media(session, assignment, media_dir)["duration"]


_LEGACY_DURATIONS: dict[Path, float] = {}


def _legacy_seconds(clips: tuple[Clip, Clip], media_dir: Path | None) -> float | None:
    """The longer of two separately served clips, probed once per file (None when ``media_dir``
    is not given or the files cannot be read)."""
    if media_dir is None:
        return None
    from . import media  # only legacy studies need to probe files

    seconds = []
    for clip in clips:
        path = Path(media_dir) / f"{clip.token}.mp4"
        if path not in _LEGACY_DURATIONS:
            try:
                _LEGACY_DURATIONS[path] = media.probe(path).duration
            except media.MediaError:
                _LEGACY_DURATIONS[path] = 0.0
        seconds.append(_LEGACY_DURATIONS[path])
    return max(seconds) or None


def report_problem(session: Session, rater: Rater, assignment_token: str, reason: str,
                   comment: str | None = None) -> Report:
    """The rater reports the pair in front of them (e.g. it does not load): the report is kept
    for the organiser and the assignment is released, so the rater moves on."""
    if reason not in REPORT_REASONS:
        raise InvalidVote(f"reason must be one of {', '.join(REPORT_REASONS)}")
    assignment = _own_unvoted_assignment(session, rater, assignment_token)
    report = Report(study_id=rater.study_id, assignment_id=assignment.id, rater_id=rater.id,
                    item_id=assignment.item_id, reason=reason, comment=_clean_comment(comment))
    session.add(report)
    if assignment.released_at is None:
        assignment.released_at, assignment.release_reason = utcnow(), "broken"
    session.flush()
    return report


# --------------------------------------------------------------------------------------------
# Organiser actions
# --------------------------------------------------------------------------------------------

def find_rater(session: Session, study_id: int, label: str) -> Rater:
    rater = session.scalar(select(Rater).where(Rater.study_id == study_id, Rater.label == label))
    if rater is None:
        raise LookupError(f"no rater {label!r} in this study")
    return rater


def find_item(session: Session, study_id: int, item_id: int) -> Item:
    item = session.get(Item, item_id)
    if item is None or item.study_id != study_id:
        raise LookupError(f"no item {item_id} in this study")
    return item


def revoke_rater(session: Session, rater: Rater) -> int:
    """Withdraw an invite: the token stops working and the open assignments go back to the
    pool. Votes already given stay (exclude the rater to drop them from the analysis)."""
    rater.revoked_at = rater.revoked_at or utcnow()
    return release_assignments(session, rater, "revoked")


def set_rater_excluded(rater: Rater, excluded: bool, reason: str | None = None) -> None:
    """Exclude (or re-include) a rater's votes from the analysis, with the organiser's reason."""
    rater.excluded = bool(excluded)
    rater.exclusion_reason = (reason or "").strip() or None if excluded else None


def set_item_excluded(session: Session, item: Item, excluded: bool, reason: str | None = None
                      ) -> int:
    """Exclude (or re-include) an item: its votes leave the analysis and it is assigned to no
    one any more (open assignments are released). Returns how many were released."""
    item.excluded = bool(excluded)
    item.exclusion_reason = (reason or "").strip() or None if excluded else None
    if not excluded:
        return 0
    return _release(session, select(Assignment).where(Assignment.item_id == item.id), "excluded")
