"""Building a blind study: items from generated clips, opaque side-by-side media, the database.

A study folder holds:

* ``media/<32 hex>.mp4`` — every video a rater can see, under a random name: one side-by-side
  encode per item and display order (A|B and B|A), all of one byte size and one container layout
  (:mod:`attnqat.eval.media`);
* ``study.db`` — the SQLite database (unless another SQLAlchemy URL is given), the only place that
  maps videos to methods;
* ``study.json`` — the declared configuration (margin, exclusion rule, …) for people to read;
* ``invites.csv`` — rater invite tokens and links.

Items are (prompt, seed, method A, method B) for each requested pair, where A is the method under
test and B the reference. About ``check_fraction`` of the main items are added as check items,
alternating an identical pair (expected answer: tie) and a pair where one side is clearly degraded
(expected: the clean side). ``practice_items`` practice items (one degraded pair first, so the
first practice has an obvious answer) are shown to every rater before the queue and never counted.
Check and practice items never show a prompt of the study: they use clips given separately
(``check_clips``) or prompts set aside from the inputs, each check its own prompt.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import sessionmaker
from tqdm.auto import tqdm

from . import media
from .sources import ClipSource, InputError, methods_of
from .storage import CRITERIA, Clip, Item, Study, Video, default_db_url, open_db


TESTS: tuple[str, ...] = ("equivalence", "non-inferiority")


@dataclass
class StudyConfig:
    """What a study declares before any vote. Stored with the study; the report obeys it."""

    name: str
    pairs: list[tuple[str, str]]
    ratings_per_item: int = 3
    items_per_rater: int = 0  # 0: every main item that still needs ratings
    check_fraction: float = 0.1
    practice_items: int = 2
    #: Margin δ on the net preference Δ = win share − lose share (Δ ∈ [−1, 1]), tested by a
    #: score test for paired win/tie/lose votes, prompt-clustered, at level ``alpha``.
    #: ``equivalence`` (two one-sided tests): "as good as" means −δ < Δ < δ;
    #: ``non-inferiority``: "not worse than" means Δ > −δ.
    equivalence_margin: float = 0.1
    test: str = "equivalence"
    alpha: float = 0.05
    confidence: float = 0.95
    #: Fewer prompts than this (with votes) give "not enough data" instead of a verdict.
    min_prompts: int = 10
    #: Exclusion rule, applied before the headline numbers: a rater with at least ``min_checks``
    #: answered check items and an accuracy below ``min_check_accuracy`` is excluded.
    min_check_accuracy: float = 0.7
    min_checks: int = 1
    #: In a study with check items, a rater who answered fewer check items than this is
    #: excluded too (a reported check counts as answered, and failed); every rater's queue
    #: holds at least this many checks when the study has them.
    required_checks: int = 2
    #: Main items each rater sees a second time, sides swapped (``check_repeat`` items, when the
    #: study has checks): opposite decisive answers count as a failed check.
    repeat_checks: int = 2
    n_boot: int = 2000
    seed: int = 0
    criteria: list[str] = field(default_factory=lambda: list(CRITERIA))
    encode: dict = field(default_factory=dict)
    #: An open assignment of a rater inactive this long goes back to the pool (0: never).
    release_after_minutes: float = 120.0
    #: A vote is refused until the pair has been on screen this many times its duration.
    min_view_factor: float = 1.0
    #: A vote is "fast" when it comes less than this many seconds after the earliest moment it
    #: could (one play-through); raters with mostly fast votes are flagged in the report.
    fast_vote_margin: float = 3.0
    #: Invite links stop working this many days after they are made (0: never).
    invite_days: float = 30.0
    #: Crowd platforms: the study link ``/c/CROWD_TOKEN?worker_id=ID`` makes one rater per
    #: worker id, at most ``crowd_raters`` of them (0: no crowd link); raters who finish are
    #: shown ``completion_code`` (and a link to ``completion_url``, if set).
    crowd_raters: int = 0
    crowd_token: str = ""
    completion_code: str = ""
    completion_url: str = ""

    def validate(self) -> None:
        if not self.name.strip():
            raise InputError("the study needs a name")
        if not self.pairs:
            raise InputError("no method pairs to compare")
        for a, b in self.pairs:
            if a == b:
                raise InputError(f"pair {a}:{b} compares a method with itself")
        if self.ratings_per_item < 1:
            raise InputError("--ratings-per-item must be at least 1")
        if self.items_per_rater < 0:
            raise InputError("--items-per-rater must be 0 (all) or positive")
        if not 0 <= self.check_fraction < 1:
            raise InputError("--check-fraction must be in [0, 1)")
        if self.practice_items < 0:
            raise InputError("--practice must be 0 or positive")
        if not 0 < self.equivalence_margin <= 1:
            raise InputError("--equivalence-margin must be in (0, 1] (it bounds win share − lose share)")
        if self.test not in TESTS:
            raise InputError(f"the test must be one of {', '.join(TESTS)}")
        if not 0 < self.alpha < 0.5:
            raise InputError("--alpha must be in (0, 0.5)")
        if self.min_prompts < 2:
            raise InputError("--min-prompts must be at least 2 (a spread needs two prompts)")
        if not 0 <= self.min_check_accuracy <= 1:
            raise InputError("--min-check-accuracy must be in [0, 1]")
        if self.min_checks < 1:
            raise InputError("--min-checks must be at least 1")
        if self.repeat_checks < 0:
            raise InputError("--repeat-checks must be 0 or positive")
        if self.required_checks < 0:
            raise InputError("--required-checks must be 0 or positive")
        if self.n_boot < 0:
            raise InputError("--n-boot must be 0 or positive")
        if self.release_after_minutes < 0:
            raise InputError("--release-after must be 0 (never) or positive")
        if self.min_view_factor < 0:
            raise InputError("--min-view must be 0 (no minimum) or positive")
        if self.fast_vote_margin < 0:
            raise InputError("--fast-vote-margin must be 0 or positive")
        if self.invite_days < 0:
            raise InputError("--invite-days must be 0 (never expire) or positive")
        if self.crowd_raters < 0:
            raise InputError("--crowd-raters must be 0 (no crowd link) or positive")
        if self.completion_url and not self.completion_url.startswith(("https://", "http://")):
            raise InputError("--completion-url must be an http(s) URL")

    def to_json(self) -> str:
        d = asdict(self)
        d["pairs"] = [list(p) for p in self.pairs]
        return json.dumps(d, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> StudyConfig:
        """The configuration of a stored study; settings added later take their defaults."""
        d = dict(d)
        d["pairs"] = [tuple(p) for p in d.get("pairs", [])]
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in known})


def add_margin_arguments(parser) -> None:  # noqa: ANN001 - argparse.ArgumentParser
    """The options of the declared margin test, shared by build, plan and import."""
    import argparse

    parser.add_argument("--margin", "--equivalence-margin", dest="equivalence_margin",
                        type=float, default=0.1, metavar="DELTA",
                        help="margin δ on the net preference Δ = win share − lose share (0.1 = 10 "
                             "percentage points)")
    parser.add_argument("--test", choices=TESTS, default="equivalence",
                        help="the claim: equivalence ('as good as': −δ < Δ < δ, two one-sided tests) or "
                             "non-inferiority ('not worse than': Δ > −δ)")
    parser.add_argument("--non-inferiority", dest="test", action="store_const",
                        const="non-inferiority", default=argparse.SUPPRESS,
                        help="short for --test non-inferiority")
    parser.add_argument("--alpha", type=float, default=0.05,
                        help="significance level (the test is decided by the 1 − 2α interval)")
    parser.add_argument("--min-prompts", type=int, default=10,
                        help="fewer prompts with votes than this give 'not enough data' instead "
                             "of a verdict")


def parse_pairs(spec: str | None, methods: Sequence[str], reference: str) -> list[tuple[str, str]]:
    """Method pairs from ``"a:b,c:b"``; by default every method against ``reference``.

    Raises :class:`InputError` naming the methods available when a pair names an unknown one.
    """
    available = list(methods)
    if spec:
        pairs = []
        for chunk in spec.split(","):
            parts = [p.strip() for p in chunk.split(":")]
            if len(parts) != 2 or not all(parts):
                raise InputError(f"bad pair {chunk!r}; write METHOD_A:METHOD_B")
            pairs.append((parts[0], parts[1]))
    else:
        if reference not in available:
            raise InputError(f"reference method {reference!r} not among the inputs' methods "
                             f"({', '.join(available)}); set --reference or --pairs")
        pairs = [(m, reference) for m in available if m != reference]
    unknown = sorted({m for p in pairs for m in p} - set(available))
    if unknown:
        raise InputError(f"unknown method(s) {', '.join(unknown)}; the inputs have "
                         f"{', '.join(available) or 'none'}")
    return list(dict.fromkeys(pairs))


@dataclass(frozen=True)
class PlannedItem:
    kind: str
    a: ClipSource
    b: ClipSource
    degrade_a: bool = False
    degrade_b: bool = False
    expected: str | None = None


Group = dict[str, ClipSource]  # method -> clip of one (prompt, seed)


def _groups(clips: Sequence[ClipSource]) -> list[Group]:
    groups: dict[tuple[str, int | None], Group] = {}
    for c in clips:
        groups.setdefault(c.group, {})[c.method] = c
    return list(groups.values())


def _pairs_in(group: Group, pairs: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(a, b) for a, b in pairs if a in group and b in group]


def _n_checks(n_main: int, fraction: float) -> int:
    return 0 if fraction <= 0 or n_main == 0 else max(2, round(fraction * n_main))


def plan_items(clips: Sequence[ClipSource], config: StudyConfig,
               check_clips: Sequence[ClipSource] | None = None) -> list[PlannedItem]:
    """Main, check and practice items (in that order), reproducible from ``config.seed``.

    Check and practice items must not show a prompt the study asks about: they are made from
    ``check_clips`` when given, otherwise from prompts set aside from ``clips`` (as many as there
    are check and practice items, drawn at random; the rest are the study). Every check and
    practice item has its own prompt, so no two of them show the same clip.
    """
    rng = random.Random(config.seed)
    used = set(m for p in config.pairs for m in p)
    groups = [g for g in _groups(clips) if _pairs_in(g, config.pairs)]
    if not groups:
        raise InputError("empty study: no prompt has clips for both methods of any pair "
                         f"({', '.join(f'{a}:{b}' for a, b in config.pairs)})")
    n_practice = config.practice_items
    if check_clips is not None:
        study_prompts = {c.prompt for g in groups for c in g.values()}
        shared = sorted({c.prompt for c in check_clips} & study_prompts)
        if shared:
            raise InputError(f"the check inputs show {len(shared)} prompt(s) of the study (e.g. "
                             f"{shared[0]!r}); check and practice items need prompts of their own")
        spare = [g for g in _groups(check_clips) if used & set(g)]
        main_groups = groups
        n_checks = _n_checks(sum(len(_pairs_in(g, config.pairs)) for g in groups),
                             config.check_fraction)
        if len(spare) < n_checks + n_practice:
            raise InputError(f"the check inputs have {len(spare)} prompt(s) with clips of the "
                             f"compared methods; {n_checks} check and {n_practice} practice "
                             "item(s) need one prompt each")
        rng.shuffle(spare)
    else:
        order = list(groups)
        rng.shuffle(order)
        fewest = n_practice + (2 if config.check_fraction > 0 else 0)
        if len(order) < fewest + 1:
            raise InputError(
                f"{len(order)} prompt(s) with clips to compare, but check and practice items "
                f"need {fewest} of their own (they must not show a prompt of the study) and the "
                "study at least 1: add prompts, give separate --check-inputs, or lower "
                "--check-fraction / --practice")
        held = fewest
        while True:  # setting prompts aside shrinks the study, and with it the number of checks
            n_checks = _n_checks(sum(len(_pairs_in(g, config.pairs)) for g in order[held:]),
                                 config.check_fraction)
            if n_practice + n_checks <= held:
                break
            held += 1
        held = n_practice + n_checks
        spare, main_groups = order[:held], sorted(order[held:], key=groups.index)

    main = [PlannedItem("main", g[a], g[b]) for g in main_groups for a, b in _pairs_in(g, config.pairs)]

    def one_clip(group: Group) -> ClipSource:
        return group[rng.choice(sorted(used & set(group)))]

    def degraded_pair(kind: str, src: ClipSource) -> PlannedItem:
        if rng.random() < 0.5:
            return PlannedItem(kind, src, src, degrade_a=True, expected="b")
        return PlannedItem(kind, src, src, degrade_b=True, expected="a")

    checks = []
    for i in range(n_checks):
        src = one_clip(spare[i])
        checks.append(PlannedItem("check_identical", src, src, expected="tie") if i % 2 == 0
                      else degraded_pair("check_degraded", src))
    practice = []
    for i, group in enumerate(spare[n_checks:n_checks + n_practice]):
        pairs = _pairs_in(group, config.pairs)
        if i % 2 == 0 or not pairs:
            practice.append(degraded_pair("practice", one_clip(group)))
        else:
            a, b = rng.choice(pairs)
            practice.append(PlannedItem("practice", group[a], group[b]))
    return main + checks + practice


@dataclass
class BuildResult:
    study_id: int
    name: str
    out_dir: Path
    db_url: str
    counts: dict[str, int]
    n_videos: int
    video_size: int
    invites: list[tuple[str, str]]
    settings: media.EncodeSettings
    #: What the build changed about the sources (clips cut or held to the study's length).
    warnings: list[str] = field(default_factory=list)


def _prepare_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and any(out_dir.iterdir()):
        raise InputError(f"{out_dir} exists and is not empty; choose a new folder for the study")
    (out_dir / "media").mkdir(parents=True, exist_ok=True)


def build_study(clips: Sequence[ClipSource], out_dir: str | Path, config: StudyConfig, *,
                db_url: str | None = None, n_raters: int = 0, qp: int = 18,
                check_clips: Sequence[ClipSource] | None = None, jobs: int | None = None,
                progress: bool = True) -> BuildResult:
    """Plan items, encode every served video under an opaque name, and write the study's records.

    Unless ``config.encode`` already fixes the settings, videos use the most common resolution,
    frame rate and length of the sources, with the x264 quantizer ``qp``. ``jobs`` encodes run at once
    (default: the CPU count). If anything fails, the study folder is removed again (the database
    rows are written last, in one transaction).
    """
    config.validate()
    available = methods_of(clips)
    unknown = sorted({m for p in config.pairs for m in p} - set(available))
    if unknown:
        raise InputError(f"unknown method(s) {', '.join(unknown)}; the inputs have "
                         f"{', '.join(available) or 'none'}")
    plan = plan_items(clips, config, check_clips)
    out_dir = Path(out_dir)
    _prepare_out_dir(out_dir)
    engine, Session = open_db(db_url or default_db_url(out_dir))
    try:
        return _build(plan, out_dir, config, Session, n_raters, qp, jobs, progress)
    except BaseException:
        engine.dispose()  # release the SQLite file before removing the folder
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    finally:
        engine.dispose()


def _build(plan: Sequence[PlannedItem], out_dir: Path, config: StudyConfig, Session: sessionmaker,
           n_raters: int, qp: int, jobs: int | None, progress: bool) -> BuildResult:
    from .rating import add_raters  # the invite logic lives with the rater flow

    with Session() as session:
        if session.scalar(select(Study).where(Study.name == config.name)) is not None:
            raise InputError(f"the database already holds a study named {config.name!r}")

    paths = sorted({c.path for it in plan for c in (it.a, it.b)})
    infos = [media.probe(p) for p in paths]
    if not config.encode:
        config.encode = media.common_settings(infos, qp=qp).as_dict()
    settings = media.EncodeSettings.from_dict(config.encode)
    warnings = []
    longer = [(p, i.frames) for p, i in zip(paths, infos) if i.frames > settings.frames]
    shorter = [(p, i.frames) for p, i in zip(paths, infos) if i.frames < settings.frames]
    if longer:
        p, n = longer[0]
        warnings.append(f"{len(longer)} clip(s) are longer than the study's {settings.frames} "
                        f"frames and are cut to them (e.g. {p}: {n} frames); raters see only "
                        "the first frames")
    if shorter:
        p, n = shorter[0]
        warnings.append(f"{len(shorter)} clip(s) are shorter than the study's {settings.frames} "
                        f"frames; their last frame is held (e.g. {p}: {n} frames)")

    # 1. one encode per item and display order, each on its own (no file backs two items).
    videos = []  # (item index, a_on_left, token)
    for i, it in enumerate(plan):
        for a_on_left in (True, False):
            videos.append((i, a_on_left, secrets.token_hex(16)))
    work = out_dir / ".encode"
    work.mkdir(exist_ok=True)

    noise_of: dict[int, float] = {}  # item index -> calibrated noise of its degraded side

    def sides(i: int) -> tuple[media.Side, media.Side]:
        it = plan[i]
        noise = noise_of.get(i, media.DEGRADE_NOISE)
        return (media.Side(it.a.path, it.degrade_a, noise), media.Side(it.b.path, it.degrade_b, noise))

    def encode(job: tuple[int, bool, str]) -> list[int]:
        i, a_on_left, token = job
        a, b = sides(i)
        units = media.encode_pair(*((a, b) if a_on_left else (b, a)), settings)
        (work / f"{token}.h264").write_bytes(b"".join(b"\x00\x00\x00\x01" + u
                                                      for au in units for u in au))
        return [media.sample_size(au) for au in units]

    # Pairs with a degraded side are encoded last: their noise is set so that the pair needs
    # as many coded bytes as the median main pair (with a fixed strong noise they needed ~3x
    # more, which picked them out from the filler lengths of every frame).
    degraded = {i for i, it in enumerate(plan) if it.degrade_a or it.degrade_b}
    first = [v for v in videos if v[0] not in degraded]
    later = [v for v in videos if v[0] in degraded]
    workers = max(1, jobs or os.cpu_count() or 1)
    with ThreadPoolExecutor(workers) as pool:
        bar = tqdm(total=len(videos), desc="encoding pairs", unit="video", disable=not progress)
        sizes_of = {}
        for job, s in zip(first, pool.map(encode, first)):
            sizes_of[job] = s
            bar.update()
        main_totals = sorted(sum(s) for (i, _, _), s in sizes_of.items() if plan[i].kind == "main")
        if main_totals and degraded:
            goal = main_totals[len(main_totals) // 2]
            for i, noise in zip(sorted(degraded), pool.map(
                    lambda i: _matching_noise(sides(i), settings, goal), sorted(degraded))):
                noise_of[i] = noise
        for job, s in zip(later, pool.map(encode, later)):
            sizes_of[job] = s
            bar.update()
        bar.close()
    sizes = [sizes_of[job] for job in videos]

    # 2. every frame padded to the study-wide size of its position; one container for all.
    target = media.padded_sizes(sizes)
    media_dir = out_dir / "media"
    layout = None
    for _, _, token in videos:
        units = media.access_units((work / f"{token}.h264").read_bytes())
        path = media_dir / f"{token}.mp4"
        media.write_padded(units, target, settings.fps, path)
        media.freeze_mtime(path)
        this = media.container_layout(path)
        if layout is not None and this != layout:
            raise media.MediaError(f"{path.name}: container layout differs from the other videos")
        layout = this
    size = (media_dir / f"{videos[0][2]}.mp4").stat().st_size
    if any((media_dir / f"{t}.mp4").stat().st_size != size for _, _, t in videos):
        raise media.MediaError("served videos differ in size after padding")
    shutil.rmtree(work)

    # 3. records.
    with Session.begin() as session:
        study = Study(name=config.name, config_json=config.to_json())
        session.add(study)
        session.flush()
        counts: dict[str, int] = {}
        items: list[Item] = []
        for it in plan:
            counts[it.kind] = counts.get(it.kind, 0) + 1
            sides = [Clip(study_id=study.id, token=secrets.token_hex(16), method=src.method,
                          prompt=src.prompt, seed=src.seed, source=str(src.path.resolve()),
                          degraded=degraded)
                     for src, degraded in ((it.a, it.degrade_a), (it.b, it.degrade_b))]
            session.add_all(sides)
            session.flush()
            item = Item(study_id=study.id, kind=it.kind, prompt=it.a.prompt, seed=it.a.seed,
                        method_a=it.a.method, method_b=it.b.method, clip_a_id=sides[0].id,
                        clip_b_id=sides[1].id, expected=it.expected,
                        target_ratings=config.ratings_per_item if it.kind == "main" else 0)
            session.add(item)
            items.append(item)
        session.flush()
        if config.check_fraction > 0 and config.repeat_checks > 0:
            # One repeat per main item (rows only: it is served with the main item's videos);
            # a rater's queue takes up to repeat_checks of them, for main items it holds.
            for original in [it for it in items if it.kind == "main"]:
                session.add(Item(study_id=study.id, kind="check_repeat", prompt=original.prompt,
                                 seed=original.seed, method_a=original.method_a,
                                 method_b=original.method_b, clip_a_id=original.clip_a_id,
                                 clip_b_id=original.clip_b_id, target_ratings=0,
                                 repeat_of=original.id))
        for i, a_on_left, token in videos:
            session.add(Video(study_id=study.id, item_id=items[i].id, a_on_left=a_on_left,
                              token=token, duration_s=settings.duration))
        study_id = study.id
    invites = add_raters(Session, study_id, n_raters, expires_days=config.invite_days) if n_raters else []
    (out_dir / "study.json").write_text(config.to_json() + "\n", encoding="utf-8")
    write_invites(out_dir, invites)
    db_url = Session.kw["bind"].url.render_as_string(hide_password=True)
    return BuildResult(study_id, config.name, out_dir, db_url, counts, len(videos), size, invites,
                       settings, warnings)


def _matching_noise(pair: tuple[media.Side, media.Side], settings: media.EncodeSettings,
                    goal: int, high: float = 64.0, steps: int = 6) -> float:
    """The noise strength (0 … ``high``) of the degraded side whose pair encodes closest to
    ``goal`` coded bytes (more noise, more bytes: bisection)."""
    def coded(noise: float) -> int:
        a, b = (media.Side(s.path, s.degrade, noise) for s in pair)
        return sum(media.sample_size(au) for au in media.encode_pair(a, b, settings))

    lo, hi = 0.0, high
    best = min(((abs(coded(x) - goal), x) for x in (lo, hi)))
    for _ in range(steps):
        mid = (lo + hi) / 2
        size = coded(mid)
        best = min(best, (abs(size - goal), mid))
        if size < goal:
            lo = mid
        else:
            hi = mid
    return best[1]


def write_invites(out_dir: Path, invites: Sequence[tuple[str, str]]) -> Path:
    """Append rater invites (label, token, link path) to ``invites.csv`` of the study folder."""
    path = Path(out_dir) / "invites.csv"
    new = not path.exists()
    with open(path, "a", encoding="utf-8") as fh:
        if new:
            fh.write("label,token,link\n")
        for label, token in invites:
            fh.write(f"{label},{token},/r/{token}\n")
    return path
