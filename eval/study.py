"""Building a blind study: items from generated clips, opaque re-encoded media, the database.

A study folder holds:

* ``media/<32 hex>.mp4`` — every clip a rater can see, under a random name, re-encoded with the
  study's one set of settings and padded to one byte size (:mod:`attnqat.eval.media`); each side
  of each item has its own copy, so a clip shared by two comparisons is not recognisable by URL;
* ``study.db`` — the SQLite database (unless another SQLAlchemy URL is given), the only place that
  maps clips to methods;
* ``study.json`` — the declared configuration (margin, exclusion rule, …) for people to read;
* ``invites.csv`` — rater invite tokens and links.

Items are (prompt, seed, method A, method B) for each requested pair, where A is the method under
test and B the reference. About ``check_fraction`` of the main items are added as check items,
alternating an identical pair (expected answer: tie) and a pair where one side is clearly degraded
(expected: the clean side). ``practice_items`` practice items (one degraded pair first, so the
first practice has an obvious answer) are shown to every rater before the queue and never counted.
"""

from __future__ import annotations

import json
import random
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import sessionmaker
from tqdm.auto import tqdm

from . import media
from .sources import ClipSource, InputError, methods_of
from .storage import CRITERIA, Clip, Item, Study, default_db_url, open_db


@dataclass
class StudyConfig:
    """What a study declares before any vote. Stored with the study; the report obeys it."""

    name: str
    pairs: list[tuple[str, str]]
    ratings_per_item: int = 3
    items_per_rater: int = 0  # 0: every main item that still needs ratings
    check_fraction: float = 0.1
    practice_items: int = 2
    #: TOST margin δ on the net preference Δ = win share − lose share (Δ ∈ [−1, 1]), tested on
    #: per-prompt means: "equivalent" means −δ < Δ < δ at level ``alpha``.
    equivalence_margin: float = 0.1
    alpha: float = 0.05
    confidence: float = 0.95
    #: Exclusion rule, applied before the headline numbers: a rater with at least ``min_checks``
    #: answered check items and an accuracy below ``min_check_accuracy`` is excluded.
    min_check_accuracy: float = 0.7
    min_checks: int = 1
    n_boot: int = 2000
    seed: int = 0
    criteria: list[str] = field(default_factory=lambda: list(CRITERIA))
    encode: dict = field(default_factory=dict)

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
        if not 0 < self.alpha < 0.5:
            raise InputError("--alpha must be in (0, 0.5)")
        if not 0 <= self.min_check_accuracy <= 1:
            raise InputError("--min-check-accuracy must be in [0, 1]")

    def to_json(self) -> str:
        d = asdict(self)
        d["pairs"] = [list(p) for p in self.pairs]
        return json.dumps(d, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> StudyConfig:
        d = dict(d)
        d["pairs"] = [tuple(p) for p in d.get("pairs", [])]
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in known})


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


def plan_items(clips: Sequence[ClipSource], config: StudyConfig) -> list[PlannedItem]:
    """Main, check and practice items (in that order), reproducible from ``config.seed``."""
    rng = random.Random(config.seed)
    groups: dict[tuple[str, int | None], dict[str, ClipSource]] = {}
    for c in clips:
        groups.setdefault(c.group, {})[c.method] = c
    main: list[PlannedItem] = []
    for members in groups.values():
        for a, b in config.pairs:
            if a in members and b in members:
                main.append(PlannedItem("main", members[a], members[b]))
    if not main:
        raise InputError("empty study: no prompt has clips for both methods of any pair "
                         f"({', '.join(f'{a}:{b}' for a, b in config.pairs)})")
    used = [m for m in dict.fromkeys(x for p in config.pairs for x in p)]
    pool = [src for members in groups.values() for m, src in members.items() if m in used]

    def degraded_pair(kind: str) -> PlannedItem:
        src = rng.choice(pool)
        if rng.random() < 0.5:
            return PlannedItem(kind, src, src, degrade_a=True, expected="b")
        return PlannedItem(kind, src, src, degrade_b=True, expected="a")

    checks: list[PlannedItem] = []
    n_checks = 0 if config.check_fraction <= 0 else max(2, round(config.check_fraction * len(main)))
    for i in range(n_checks):
        if i % 2 == 0:
            src = rng.choice(pool)
            checks.append(PlannedItem("check_identical", src, src, expected="tie"))
        else:
            checks.append(degraded_pair("check_degraded"))
    practice: list[PlannedItem] = []
    for i in range(config.practice_items):
        if i % 2 == 0:
            practice.append(degraded_pair("practice"))
        else:
            item = rng.choice(main)
            practice.append(PlannedItem("practice", item.a, item.b))
    return main + checks + practice


@dataclass
class BuildResult:
    study_id: int
    name: str
    out_dir: Path
    db_url: str
    counts: dict[str, int]
    n_clips: int
    clip_size: int
    invites: list[tuple[str, str]]


def _prepare_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and any(out_dir.iterdir()):
        raise InputError(f"{out_dir} exists and is not empty; choose a new folder for the study")
    (out_dir / "media").mkdir(parents=True, exist_ok=True)


def build_study(clips: Sequence[ClipSource], out_dir: str | Path, config: StudyConfig, *,
                db_url: str | None = None, n_raters: int = 0, crf: int = 18,
                progress: bool = True) -> BuildResult:
    """Plan items, re-encode every clip under an opaque name, and write the study's records.

    Unless ``config.encode`` already fixes the settings, clips are encoded at the most common
    resolution and frame rate of the sources, with x264 quality ``crf``. If anything fails, the
    study folder is removed again (the database rows are written last, in one transaction).
    """
    config.validate()
    available = methods_of(clips)
    unknown = sorted({m for p in config.pairs for m in p} - set(available))
    if unknown:
        raise InputError(f"unknown method(s) {', '.join(unknown)}; the inputs have "
                         f"{', '.join(available) or 'none'}")
    plan = plan_items(clips, config)
    out_dir = Path(out_dir)
    _prepare_out_dir(out_dir)
    engine, Session = open_db(db_url or default_db_url(out_dir))
    try:
        return _build(plan, out_dir, config, Session, n_raters, crf, progress)
    except BaseException:
        engine.dispose()  # release the SQLite file before removing the folder
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    finally:
        engine.dispose()


def _build(plan: Sequence[PlannedItem], out_dir: Path, config: StudyConfig, Session: sessionmaker,
           n_raters: int, crf: int, progress: bool) -> BuildResult:
    from .rating import add_raters  # the invite logic lives with the rater flow

    with Session() as session:
        if session.scalar(select(Study).where(Study.name == config.name)) is not None:
            raise InputError(f"the database already holds a study named {config.name!r}")

    # 1. one encoding per distinct (source, degraded) — in random order, so that file creation
    #    order says nothing either.
    jobs = sorted({(it.a.path, it.degrade_a) for it in plan} | {(it.b.path, it.degrade_b) for it in plan})
    if not config.encode:
        infos = [media.probe(p) for p in sorted({p for p, _ in jobs})]
        config.encode = media.common_settings(infos, crf=crf).as_dict()
    settings = media.EncodeSettings(**config.encode)
    work = out_dir / ".encode"
    work.mkdir(exist_ok=True)
    random.Random(config.seed + 1).shuffle(jobs)
    encoded: dict[tuple[Path, bool], Path] = {}
    for n, (src, degrade) in enumerate(tqdm(jobs, desc="re-encoding clips", unit="clip",
                                            disable=not progress)):
        dst = work / f"{n}.mp4"
        media.encode(src, dst, settings, degrade=degrade)
        encoded[(src, degrade)] = dst

    # 2. one opaque copy per item side, all padded to one size.
    sides: list[tuple[int, str, ClipSource, bool, str]] = []  # (item index, side, src, degraded, token)
    for i, it in enumerate(plan):
        sides.append((i, "a", it.a, it.degrade_a, secrets.token_hex(16)))
        sides.append((i, "b", it.b, it.degrade_b, secrets.token_hex(16)))
    media_dir = out_dir / "media"
    for _, _, src, degrade, token in sides:
        shutil.copyfile(encoded[(src.path, degrade)], media_dir / f"{token}.mp4")
    size = media.padded_size([(media_dir / f"{s[4]}.mp4").stat().st_size for s in sides])
    for s in sides:
        path = media_dir / f"{s[4]}.mp4"
        media.pad_to_size(path, size)
        media.freeze_mtime(path)
    shutil.rmtree(work)

    # 3. records.
    with Session.begin() as session:
        study = Study(name=config.name, config_json=config.to_json())
        session.add(study)
        session.flush()
        clip_rows: dict[tuple[int, str], Clip] = {}
        for i, side, src, degrade, token in sides:
            row = Clip(study_id=study.id, token=token, method=src.method, prompt=src.prompt,
                       seed=src.seed, source=str(src.path.resolve()), degraded=degrade)
            session.add(row)
            clip_rows[(i, side)] = row
        session.flush()
        counts: dict[str, int] = {}
        for i, it in enumerate(plan):
            counts[it.kind] = counts.get(it.kind, 0) + 1
            session.add(Item(
                study_id=study.id, kind=it.kind, prompt=it.a.prompt, seed=it.a.seed,
                method_a=it.a.method, method_b=it.b.method, clip_a_id=clip_rows[(i, "a")].id,
                clip_b_id=clip_rows[(i, "b")].id, expected=it.expected,
                target_ratings=config.ratings_per_item if it.kind == "main" else 0))
        study_id = study.id
    invites = add_raters(Session, study_id, n_raters) if n_raters else []
    (out_dir / "study.json").write_text(config.to_json() + "\n", encoding="utf-8")
    write_invites(out_dir, invites)
    db_url = Session.kw["bind"].url.render_as_string(hide_password=True)
    return BuildResult(study_id, config.name, out_dir, db_url, counts, len(sides), size, invites)


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
