"""The rater flow without HTTP: invites, queues, counterbalancing, resuming and vote rules."""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from attnqat.eval import rating, sources
from attnqat.eval.demo import write_demo_outputs
from attnqat.eval.storage import Assignment, Item, Study, Vote, default_db_url, open_db, utcnow
from attnqat.eval.study import StudyConfig, build_study

CRIT = {"visual_quality": "tie", "motion": "left", "text_alignment": "right"}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    root = tmp_path_factory.mktemp("rating")
    write_demo_outputs(root / "runs", sources.read_prompts()[:10], methods=("bf16", "attnqat"))
    config = StudyConfig(name="rating", pairs=[("attnqat", "bf16")], ratings_per_item=2,
                         check_fraction=0.2)
    build_study(sources.load_sources([root / "runs"]), root / "study", config, progress=False)
    return root / "study"


def _open(template, tmp_path, **config_changes):
    study_dir = tmp_path / "study"
    shutil.copytree(template, study_dir)
    _, Session = open_db(default_db_url(study_dir))
    with Session.begin() as s:
        study = s.scalar(select(Study))
        if config_changes:
            cfg = study.config
            cfg.update(config_changes)
            import json
            study.config_json = json.dumps(cfg)
            if "ratings_per_item" in config_changes:
                for it in s.scalars(select(Item).where(Item.kind == "main")):
                    it.target_ratings = config_changes["ratings_per_item"]
        study_id = study.id
    return Session, study_id


def _queue(Session, rater_id):
    with Session() as s:
        return list(s.scalars(select(Assignment).where(Assignment.rater_id == rater_id)
                              .order_by(Assignment.position)))


def _kinds(Session):
    with Session() as s:
        return {it.id: it.kind for it in s.scalars(select(Item))}


def _rater_id(Session, study_id, token):
    with Session() as s:
        return rating.get_rater(s, study_id, token).id


def test_queue_practice_first_no_repeats_and_balanced(template, tmp_path):
    Session, sid = _open(template, tmp_path)
    (_, token), = rating.add_raters(Session, sid, 1)
    assert rating.start(Session, sid, token, seed=1)
    assert rating.start(Session, sid, token, seed=2)  # idempotent: the queue is fixed once
    kinds = _kinds(Session)
    queue = _queue(Session, _rater_id(Session, sid, token))
    items = [a.item_id for a in queue]
    assert len(items) == len(set(items))  # no item twice
    assert [kinds[i] for i in items[:2]] == ["practice", "practice"]
    assert [a.position for a in queue] == list(range(len(queue)))
    body = Counter(kinds[i] for i in items[2:])
    assert body["main"] == sum(k == "main" for k in kinds.values())
    assert body["check_identical"] >= 1 and body["check_degraded"] >= 1
    for group in (("main",), ("check_identical", "check_degraded")):
        sides = [a.a_on_left for a in queue[2:] if kinds[a.item_id] in group]
        assert abs(sides.count(True) - sides.count(False)) <= 1


def test_ratings_per_item_bound_and_full_study(template, tmp_path):
    Session, sid = _open(template, tmp_path, items_per_rater=4, ratings_per_item=2)
    kinds = _kinds(Session)
    n_main = sum(k == "main" for k in kinds.values())
    invites = rating.add_raters(Session, sid, 8)
    started = [rating.start(Session, sid, tok, seed=i) for i, (_, tok) in enumerate(invites)]
    with Session() as s:
        per_item = Counter(a.item_id for a in s.scalars(select(Assignment))
                           if kinds[a.item_id] == "main")
    assert max(per_item.values()) <= 2  # never more than k ratings planned per item
    assert sum(per_item.values()) == 2 * n_main  # every item reaches k
    # 10 items × 2 ratings at 4 per rater: five raters fill the study, the rest find it full.
    assert started == [True] * 5 + [False] * 3
    with Session() as s:
        late = rating.get_rater(s, sid, invites[-1][1])
        assert rating.stage(s, late) == "full"


def test_left_right_counterbalanced_across_raters(template, tmp_path):
    Session, sid = _open(template, tmp_path)
    kinds = _kinds(Session)
    invites = rating.add_raters(Session, sid, 2)
    for i, (_, tok) in enumerate(invites):
        rating.start(Session, sid, tok, seed=10 + i)
    with Session() as s:
        left = Counter(a.item_id for a in s.scalars(select(Assignment)) if a.a_on_left
                       and kinds[a.item_id] == "main")
    # Two raters over an even number of items: each item shows A on the left exactly once.
    assert sorted(left.values()) == [1] * sum(k == "main" for k in kinds.values())


def test_current_item_resumes_and_votes_resolve_sides(template, tmp_path):
    Session, sid = _open(template, tmp_path)
    (_, token), = rating.add_raters(Session, sid, 1)
    with Session.begin() as s, pytest.raises(rating.NotStarted):
        rating.current(s, rating.get_rater(s, sid, token))
    rating.start(Session, sid, token)
    with Session.begin() as s:
        first = rating.current(s, rating.get_rater(s, sid, token))
        tok, shown, a_left = first.token, first.shown_at, first.a_on_left
    with Session.begin() as s:  # closing the browser and coming back: the same item
        again = rating.current(s, rating.get_rater(s, sid, token))
        assert again.token == tok and again.shown_at == shown
    with Session.begin() as s:
        vote = rating.record_vote(s, rating.get_rater(s, sid, token), tok, "left", CRIT)
        assert vote.overall == ("a" if a_left else "b")
        assert vote.motion == ("a" if a_left else "b") and vote.visual_quality == "tie"
        assert vote.text_alignment == ("b" if a_left else "a")
        assert vote.shown_at == shown and vote.voted_at >= shown
    with Session.begin() as s:
        nxt = rating.current(s, rating.get_rater(s, sid, token))
        assert nxt.token != tok and nxt.position == 1


def test_vote_rules(template, tmp_path):
    Session, sid = _open(template, tmp_path)
    (_, alice), (_, bob) = rating.add_raters(Session, sid, 2)
    for t in (alice, bob):
        rating.start(Session, sid, t)
    with Session.begin() as s:
        a_cur = rating.current(s, rating.get_rater(s, sid, alice)).token
    with Session.begin() as s:
        b_cur = rating.current(s, rating.get_rater(s, sid, bob)).token
    later = _queue(Session, _rater_id(Session, sid, alice))[3].token

    def vote(who, tok, overall="tie", criteria=CRIT):
        with Session.begin() as s:
            return rating.record_vote(s, rating.get_rater(s, sid, who), tok, overall, criteria)

    with pytest.raises(rating.NotAssigned):
        vote(alice, b_cur)  # Bob's item
    with pytest.raises(rating.NotAssigned):
        vote(alice, "made-up-token")
    with pytest.raises(rating.NotShown):
        vote(alice, later)  # assigned, but not reached yet
    with pytest.raises(rating.InvalidVote):
        vote(alice, a_cur, overall="A")
    with pytest.raises(rating.InvalidVote):
        vote(alice, a_cur, criteria={"motion": "tie"})
    vote(alice, a_cur)
    with pytest.raises(rating.AlreadyVoted):
        vote(alice, a_cur)
    with pytest.raises(rating.UnknownRater):
        vote("not-a-rater", a_cur)
    with Session() as s:
        assert s.query(Vote).count() == 1


def test_database_refuses_a_second_vote_for_one_assignment(template, tmp_path):
    Session, sid = _open(template, tmp_path)
    (_, token), = rating.add_raters(Session, sid, 1)
    rating.start(Session, sid, token)
    with Session.begin() as s:
        a = rating.current(s, rating.get_rater(s, sid, token))
        aid, rid, iid = a.id, a.rater_id, a.item_id
    fields = dict(assignment_id=aid, rater_id=rid, item_id=iid, left_is_a=True, shown_at=utcnow(),
                  voted_at=utcnow(), overall_side="tie", overall="tie",
                  **{f"{c}{suffix}": v for c in CRIT for suffix, v in (("_side", "tie"), ("", "tie"))})
    with Session.begin() as s:
        s.add(Vote(**fields))
    with pytest.raises(IntegrityError), Session.begin() as s:
        s.add(Vote(**fields))
