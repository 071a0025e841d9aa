"""The rater flow, independent of HTTP: invites, queues, the current item, votes.

A rater is known only by an invite token (random, 128 bits); unknown tokens are refused. After the
instructions the rater's queue is fixed in one transaction:

* the practice items first (every rater, never counted);
* main items that still need ratings (fewer assignments than ``ratings_per_item``), least-assigned
  first, at most ``items_per_rater`` of them (0: all), never one item twice (a unique constraint);
* check items in proportion (the study's share of check items, at least one), both kinds;
* shuffled, and counterbalanced: within the rater's main items and within their check items, half
  show A on the left (±1); which half favours items whose earlier raters saw A more on the right.

The current item is the first unvoted assignment in queue order, so a rater who closes the browser
resumes exactly where they were. A vote names its assignment token; it is refused when the
assignment belongs to someone else, was never shown, or already has a vote (one vote per
assignment, enforced by the database too).
"""

from __future__ import annotations

import random
import secrets
import threading
from collections.abc import Mapping
from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from .storage import CRITERIA, SIDES, Assignment, Item, Rater, Study, Vote, utcnow


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


class InvalidVote(RatingError):
    status = 422


#: Serializes queue creation inside one server process (the database lock does across processes).
_QUEUE_LOCK = threading.Lock()


def add_raters(Session: sessionmaker, study_id: int, n: int, prefix: str = "rater"
               ) -> list[tuple[str, str]]:
    """Create ``n`` invites; returns (label, token) pairs. Labels number on from existing raters."""
    if n < 0:
        raise ValueError("the number of raters must be non-negative")
    out = []
    with Session.begin() as session:
        existing = session.scalar(select(func.count(Rater.id)).where(Rater.study_id == study_id)) or 0
        for k in range(n):
            label = f"{prefix}-{existing + k + 1:03d}"
            token = secrets.token_urlsafe(16)
            session.add(Rater(study_id=study_id, token=token, label=label))
            out.append((label, token))
    return out


def get_rater(session: Session, study_id: int, token: str) -> Rater:
    """The rater with this invite token in this study, or :class:`UnknownRater`."""
    rater = session.scalar(select(Rater).where(Rater.token == token, Rater.study_id == study_id))
    if rater is None:
        raise UnknownRater("unknown invite token")
    return rater


def _assignment_counts(session: Session, study_id: int) -> dict[int, tuple[int, int]]:
    """item id -> (assignments, assignments with A on the left)."""
    rows = session.execute(
        select(Assignment.item_id, func.count(Assignment.id),
               func.sum(case((Assignment.a_on_left, 1), else_=0)))
        .join(Item, Item.id == Assignment.item_id)
        .where(Item.study_id == study_id)
        .group_by(Assignment.item_id))
    return {item_id: (int(n), int(left or 0)) for item_id, n, left in rows}


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


def start(Session: sessionmaker, study_id: int, token: str, seed: int | None = None) -> bool:
    """The rater read the instructions: fix their queue (idempotent). False if the study has no
    items left for them."""
    with _QUEUE_LOCK, Session.begin() as session:
        # Serializes queue creation across server processes on databases with row locks.
        session.execute(select(Study.id).where(Study.id == study_id).with_for_update())
        rater = get_rater(session, study_id, token)
        if rater.started_at is not None:
            return _queue_size(session, rater) > 0
        rater.started_at = utcnow()
        study = session.get(Study, study_id)
        config = study.config
        rng = random.Random(seed if seed is not None else secrets.randbits(64))
        items = list(session.scalars(select(Item).where(Item.study_id == study_id).order_by(Item.id)))
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
            n = max(1, round(len(chosen) * n_checks_all / max(1, len(main_all))))
            pools = [identical, degraded] if rng.random() < 0.5 else [degraded, identical]
            while len(checks) < min(n, n_checks_all):
                for pool in pools:
                    if pool and len(checks) < n:
                        checks.append(pool.pop(0))
        practice = [it for it in items if it.kind == "practice"]
        sides = {**_balanced_sides(chosen, counts, rng), **_balanced_sides(checks, counts, rng)}
        queue = chosen + checks
        rng.shuffle(queue)
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
    """Counts for the progress bar: practice and rated items, done and total."""
    rows = session.execute(
        select(Item.kind, func.count(Assignment.id), func.count(Vote.id))
        .join(Item, Item.id == Assignment.item_id)
        .outerjoin(Vote, Vote.assignment_id == Assignment.id)
        .where(Assignment.rater_id == rater.id)
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
    """``instructions`` (not started), ``practice``, ``rating``, ``done``, or ``full`` (started,
    but the study had nothing left to assign)."""
    if rater.started_at is None:
        return "instructions"
    p = progress(session, rater)
    if p["total"] == 0:
        return "full"
    if p["practice_done"] < p["practice_total"]:
        return "practice"
    return "rating" if p["done"] < p["total"] else "done"


def current(session: Session, rater: Rater) -> Assignment | None:
    """The rater's first unvoted assignment (marked shown now if it never was), or None."""
    if rater.started_at is None:
        raise NotStarted("read the instructions first")
    assignment = session.scalar(
        select(Assignment)
        .outerjoin(Vote, Vote.assignment_id == Assignment.id)
        .where(Assignment.rater_id == rater.id, Vote.id.is_(None))
        .order_by(Assignment.position)
        .limit(1))
    if assignment is not None and assignment.shown_at is None:
        assignment.shown_at = utcnow()
    return assignment


def resolve(side: str, a_on_left: bool) -> str:
    """What a click on ``side`` means for the item: ``a``, ``b`` or ``tie``."""
    if side == "tie":
        return "tie"
    return "a" if (side == "left") == a_on_left else "b"


def record_vote(session: Session, rater: Rater, assignment_token: str, overall: str,
                criteria: Mapping[str, str]) -> Vote:
    """Store one vote after every check that makes it count once and only for its rater."""
    assignment = session.scalar(select(Assignment).where(Assignment.token == assignment_token))
    if assignment is None or assignment.rater_id != rater.id:
        raise NotAssigned("this item is not assigned to you")
    if session.scalar(select(Vote.id).where(Vote.assignment_id == assignment.id)) is not None:
        raise AlreadyVoted("this item already has your vote")
    if assignment.shown_at is None:
        raise NotShown("this item has not been shown yet")
    if overall not in SIDES:
        raise InvalidVote(f"overall must be one of {', '.join(SIDES)}")
    if set(criteria) != set(CRITERIA):
        raise InvalidVote(f"criteria must answer exactly: {', '.join(CRITERIA)}")
    for key, side in criteria.items():
        if side not in SIDES:
            raise InvalidVote(f"{key} must be one of {', '.join(SIDES)}")
    left_a = assignment.a_on_left
    fields: dict[str, Any] = {}
    for key in CRITERIA:
        fields[f"{key}_side"] = criteria[key]
        fields[key] = resolve(criteria[key], left_a)
    vote = Vote(assignment_id=assignment.id, rater_id=rater.id, item_id=assignment.item_id,
                left_is_a=left_a, shown_at=assignment.shown_at, voted_at=utcnow(),
                overall_side=overall, overall=resolve(overall, left_a), **fields)
    session.add(vote)
    try:
        session.flush()
    except IntegrityError:
        raise AlreadyVoted("this item already has your vote") from None
    return vote
