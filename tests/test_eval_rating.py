"""The rater flow without HTTP: invites, queues, counterbalancing, resuming and vote rules."""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from datetime import timedelta

from attnqat.eval import rating, sources
from attnqat.eval.demo import write_demo_outputs
from attnqat.eval.storage import (
    Assignment,
    Item,
    Rater,
    Report,
    Study,
    Vote,
    default_db_url,
    open_db,
    utcnow,
)
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
    # n items × 2 ratings at 4 per rater: that many raters fill the study, the rest find it full.
    needed = -(-2 * n_main // 4)
    assert started == [True] * needed + [False] * (8 - needed)
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


def _vote(Session, sid, token, tok, overall="tie", criteria=CRIT, **kw):
    with Session.begin() as s:
        return rating.record_vote(s, rating.get_rater(s, sid, token), tok, overall, criteria, **kw)


def _current(Session, sid, token):
    with Session.begin() as s:
        a = rating.current(s, rating.get_rater(s, sid, token))
        return None if a is None else (a.token, a.item_id, a.shown_at)


def test_both_bad_comment_and_view_time_are_stored(template, tmp_path):
    Session, sid = _open(template, tmp_path)
    (_, token), = rating.add_raters(Session, sid, 1)
    rating.start(Session, sid, token)
    tok, _, shown = _current(Session, sid, token)
    vote = _vote(Session, sid, token, tok, "both_bad", comment="  both blurry  ",
                 now=shown + timedelta(seconds=4.5))
    assert vote.both_bad and vote.overall == "tie" and vote.overall_side == "tie"
    assert vote.comment == "both blurry" and vote.view_seconds == pytest.approx(4.5)
    tok, _, _ = _current(Session, sid, token)
    with pytest.raises(rating.InvalidVote, match="longer than"):
        _vote(Session, sid, token, tok, comment="x" * (rating.MAX_COMMENT + 1))
    with pytest.raises(rating.InvalidVote, match="overall"):
        _vote(Session, sid, token, tok, "bad")


def test_minimum_viewing_time_is_enforced_server_side(template, tmp_path):
    Session, sid = _open(template, tmp_path)
    (_, token), = rating.add_raters(Session, sid, 1)
    rating.start(Session, sid, token)
    tok, _, shown = _current(Session, sid, token)
    with Session() as s:
        duration = rating.play_seconds(s, s.scalar(select(Assignment).where(Assignment.token == tok)))
    assert duration == pytest.approx(17 / 8)  # the demo clips: 17 frames at 8 fps
    with pytest.raises(rating.TooEarly) as refused:
        _vote(Session, sid, token, tok, min_view_factor=1.0, now=shown + timedelta(seconds=0.05))
    assert refused.value.status == 425
    assert refused.value.wait_seconds == pytest.approx(duration - 0.05)
    with pytest.raises(rating.TooEarly):  # two play-throughs asked for
        _vote(Session, sid, token, tok, min_view_factor=2.0, now=shown + timedelta(seconds=3))
    vote = _vote(Session, sid, token, tok, min_view_factor=1.0,
                 now=shown + timedelta(seconds=duration + 0.01))
    assert vote.view_seconds == pytest.approx(duration + 0.01)


def test_inactive_queues_are_released_and_given_back(template, tmp_path):
    Session, sid = _open(template, tmp_path, ratings_per_item=1, items_per_rater=3,
                         release_after_minutes=30)
    (_, idle), (_, busy), (_, late) = rating.add_raters(Session, sid, 3)
    assert rating.start(Session, sid, idle, seed=1)
    tok, _, shown = _current(Session, sid, idle)
    _vote(Session, sid, idle, tok)
    with Session() as s:
        idle_id = rating.get_rater(s, sid, idle).id
        mine = {a.item_id for a in s.scalars(select(Assignment).where(
            Assignment.rater_id == idle_id))}
    # Not yet stale: nothing is released.
    with Session.begin() as s:
        assert rating.release_inactive(s, sid, 30) == 0
    # 31 minutes without activity: the open items go back to the pool, the vote stays.
    with Session.begin() as s:
        rater = s.scalar(select(Rater).where(Rater.token == idle))
        rater.last_seen_at = utcnow() - timedelta(minutes=31)
    assert rating.start(Session, sid, busy, seed=2)  # starting a queue releases stale ones
    assert rating.start(Session, sid, late, seed=3)
    with Session() as s:
        released = list(s.scalars(select(Assignment).where(Assignment.rater_id == idle_id,
                                                           Assignment.release_reason == "inactive")))
        assert released and all(a.released_at is not None for a in released)
        assert s.query(Vote).count() == 1
        others = {a.item_id for a in s.scalars(select(Assignment).join(Rater).where(
            Rater.token.in_([busy, late])))}
        kinds = {it.id: it.kind for it in s.scalars(select(Item))}
    # The freed main items went to the next raters (each item needs only one rating).
    freed_main = {a.item_id for a in released if kinds[a.item_id] == "main"}
    assert freed_main and freed_main <= others
    with Session.begin() as s:  # a released assignment takes no vote
        with pytest.raises(rating.Released):
            rating.record_vote(s, rating.get_rater(s, sid, idle), released[0].token, "tie", CRIT)
    # The idle rater returns: they get back what nobody else took (here: practice and checks).
    back = _current(Session, sid, idle)
    with Session() as s:
        reopened = {a.item_id for a in s.scalars(select(Assignment).where(
            Assignment.rater_id == idle_id, Assignment.released_at.is_(None)))}
    assert back is not None and back[1] in reopened
    assert not (reopened & freed_main)
    assert reopened <= mine


def test_organiser_release_revoke_and_exclude(template, tmp_path):
    Session, sid = _open(template, tmp_path)
    (label, alice), (_, bob) = rating.add_raters(Session, sid, 2)
    rating.start(Session, sid, alice)
    rating.start(Session, sid, bob)
    with Session.begin() as s:
        n = rating.release_assignments(s, rating.find_rater(s, sid, label), "released")
        assert n > 0
    assert _current(Session, sid, alice) is None  # released by the organiser: not given back
    with Session.begin() as s:
        rating.revoke_rater(s, rating.find_rater(s, sid, label))
    with Session() as s, pytest.raises(rating.UnknownRater, match="withdrawn"):
        rating.get_rater(s, sid, alice)
    # Excluding an item releases its open assignments; nobody is given it any more.
    tok, item_id, _ = _current(Session, sid, bob)
    with Session.begin() as s:
        assert rating.set_item_excluded(s, rating.find_item(s, sid, item_id), True, "broken clip") == 1
    assert _current(Session, sid, bob)[1] != item_id
    (_, carol), = rating.add_raters(Session, sid, 1)
    rating.start(Session, sid, carol)
    with Session() as s:
        carols = {a.item_id for a in s.scalars(select(Assignment).join(Rater).where(
            Rater.token == carol))}
    assert item_id not in carols
    with Session() as s, pytest.raises(LookupError, match="no rater"):
        rating.find_rater(s, sid, "nobody")


def test_report_problem_skips_the_pair_and_keeps_the_report(template, tmp_path):
    Session, sid = _open(template, tmp_path)
    (_, token), = rating.add_raters(Session, sid, 1)
    rating.start(Session, sid, token)
    first, item_id, _ = _current(Session, sid, token)
    with Session.begin() as s:
        rater = rating.get_rater(s, sid, token)
        with pytest.raises(rating.InvalidVote, match="reason"):
            rating.report_problem(s, rater, first, "ugly")
        rating.report_problem(s, rater, first, "not_loading", "spinner forever")
    nxt, _, _ = _current(Session, sid, token)
    assert nxt != first
    with Session() as s:
        (report,) = s.scalars(select(Report))
        assert (report.item_id, report.reason, report.comment) == (item_id, "not_loading",
                                                                  "spinner forever")
    with pytest.raises(rating.Released):
        _vote(Session, sid, token, first)


def test_repeated_pairs_come_back_sides_swapped_and_reversals_fail(template, tmp_path):
    """Each rater sees two of their main items again, the other way round, served with the
    main item's own videos; reversing a decisive answer counts as a failed check."""
    from attnqat.eval.results import analyze, load_votes
    from attnqat.eval.storage import Video
    from attnqat.eval.study import StudyConfig

    Session, sid = _open(template, tmp_path)
    (_, token), = rating.add_raters(Session, sid, 1)
    rating.start(Session, sid, token, seed=4)
    rid = _rater_id(Session, sid, token)
    queue = _queue(Session, rid)
    with Session() as s:
        items = {it.id: it for it in s.scalars(select(Item))}
        videos = {(v.item_id, v.a_on_left): v.token for v in s.scalars(select(Video))}
    by_item = {a.item_id: a for a in queue}
    repeats = [a for a in queue if items[a.item_id].kind == "check_repeat"]
    assert len(repeats) == 2
    for a in repeats:
        original = by_item[items[a.item_id].repeat_of]
        assert items[original.item_id].kind == "main" and a.a_on_left != original.a_on_left
        assert abs(a.position - original.position) > 1
        with Session() as s:
            shown = rating.served_media(s, s.get(Assignment, a.id))
        assert shown["video"] == f"/media/{videos[(original.item_id, a.a_on_left)]}.mp4"
    # Answer everything: "left" always — which reverses the decisive answer on each repeat.
    while (cur := _current(Session, sid, token)) is not None:
        _vote(Session, sid, token, cur[0], overall="left")
    with Session() as s:
        votes = load_votes(s, sid)
        config = StudyConfig.from_dict(s.scalar(select(Study)).config)
    result = analyze(votes, config)
    rater = result["raters"]["rater-001"]
    n_other = sum(1 for a in queue if items[a.item_id].kind in ("check_identical", "check_degraded"))
    assert rater["checks_answered"] == n_other + 2
    # "left" is never right on an identical pair nor on a reversed repeat; on a degraded pair
    # it is right when the clean side was on the left.
    right = sum(1 for a in queue if items[a.item_id].kind == "check_degraded"
                and rating.resolve("left", a.a_on_left) == items[a.item_id].expected)
    assert rater["checks_correct"] == right
    assert "rater-001" in result["excluded_raters"]


def test_invites_expire(template, tmp_path):
    Session, sid = _open(template, tmp_path)
    (_, fresh), = rating.add_raters(Session, sid, 1, expires_days=7)
    (_, old), = rating.add_raters(Session, sid, 1, expires_days=7)
    (_, forever), = rating.add_raters(Session, sid, 1)
    with Session.begin() as s:
        s.scalar(select(Rater).where(Rater.token == old)).expires_at = utcnow() - timedelta(hours=1)
    with Session() as s:
        assert rating.get_rater(s, sid, fresh).expires_at > utcnow() + timedelta(days=6)
        assert rating.get_rater(s, sid, forever).expires_at is None
        with pytest.raises(rating.UnknownRater, match="expired"):
            rating.get_rater(s, sid, old)
    with pytest.raises(rating.UnknownRater, match="expired"):
        rating.start(Session, sid, old)


def test_organiser_release_is_not_reported_as_done_and_broken_practice_is_dropped(template, tmp_path):
    Session, sid = _open(template, tmp_path)
    (label, alice), (_, bob) = rating.add_raters(Session, sid, 2)
    rating.start(Session, sid, alice, seed=1)
    first, item_id, _ = _current(Session, sid, alice)
    with Session() as s:
        assert s.get(Item, item_id).kind == "practice"
    with Session.begin() as s:  # the first practice pair does not load for alice
        rating.report_problem(s, rating.get_rater(s, sid, alice), first, "not_loading")
    rating.start(Session, sid, bob, seed=2)
    bob_items = {a.item_id for a in _queue(Session, _rater_id(Session, sid, bob))}
    assert item_id not in bob_items  # a broken practice pair is not served again
    with Session.begin() as s:
        assert rating.release_assignments(s, rating.find_rater(s, sid, label), "released") > 0
    with Session() as s:
        assert rating.stage(s, rating.get_rater(s, sid, alice)) == "released"
    # Rating everything is still "done".
    while (cur := _current(Session, sid, bob)) is not None:
        _vote(Session, sid, bob, cur[0])
    with Session() as s:
        assert rating.stage(s, rating.get_rater(s, sid, bob)) == "done"
