"""Database schema and engine set-up of the blind study.

One SQLAlchemy schema serves every backend: SQLite by default (a ``study.db`` file next to the
study's media, in WAL mode so the rater app can read while a vote is written) and any other
SQLAlchemy URL (Postgres works unchanged). The schema is the record of the study:

* ``studies``      — one row per study, with its declared configuration (JSON);
* ``clips``        — the source of each side of each item (method, prompt, file, degraded); in
                     studies built before side-by-side serving, also the served file (``token``);
* ``items``        — what a rater compares: (prompt, seed, method A, method B), kind and expected
                     answer for check items; the organiser can exclude an item;
* ``videos``       — the served files: one side-by-side video per item and display order;
* ``raters``       — invite tokens; revoked / excluded by the organiser; last activity;
* ``assignments``  — a rater's queue: item, position, whether A is shown on the left, when it was
                     first shown, and when (and why) it was released without a vote;
* ``votes``        — one per assignment (a unique constraint: a vote is never counted twice),
                     with the displayed order, time shown, time voted, seconds from display to
                     vote, the overall answer and the per-criterion answers, both as clicked
                     (left/right/tie) and resolved to the item's methods (a/b/tie), "both are bad"
                     (an overall tie) and the rater's optional comment;
* ``reports``      — problems raters reported (a pair that does not load), for the organiser.

Times are naive UTC (SQLite keeps no time zone). :func:`open_db` brings a database written by an
earlier version up to this schema by adding the missing tables and columns (old rows get the
columns' defaults); nothing is dropped or rewritten.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    false,
    inspect,
    text,
)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship, sessionmaker

#: The per-criterion questions every vote answers besides the overall preference.
CRITERIA: tuple[str, ...] = ("visual_quality", "motion", "text_alignment")
#: What a rater can click, for each criterion; the overall question adds :data:`BOTH_BAD`.
SIDES: tuple[str, ...] = ("left", "right", "tie")
#: The overall answer "both are bad": stored as a tie with ``votes.both_bad`` set.
BOTH_BAD = "both_bad"
#: Item kinds. ``main`` items are the study; checks measure raters; practice is discarded.
#: ``check_repeat`` items show a main item's pair again (its own media, sides swapped) to the
#: rater who has the main item: opposite decisive answers to the two are an inconsistency.
ITEM_KINDS: tuple[str, ...] = ("main", "check_identical", "check_degraded", "check_repeat",
                               "practice")

DB_FILENAME = "study.db"


def utcnow() -> datetime:
    """The current time as naive UTC (what the schema stores)."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


class Base(DeclarativeBase):
    pass


class Study(Base):
    __tablename__ = "studies"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    config_json: Mapped[str] = mapped_column(Text)

    @property
    def config(self) -> dict[str, Any]:
        return json.loads(self.config_json)


class Clip(Base):
    __tablename__ = "clips"

    id: Mapped[int] = mapped_column(primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("studies.id"), index=True)
    token: Mapped[str] = mapped_column(String(64), unique=True, index=True)  # served name, no suffix
    method: Mapped[str] = mapped_column(String(100))
    prompt: Mapped[str] = mapped_column(Text)
    seed: Mapped[int | None] = mapped_column(Integer, nullable=True)
    source: Mapped[str] = mapped_column(Text)  # the original file, for the record
    degraded: Mapped[bool] = mapped_column(Boolean, default=False)


class Video(Base):
    """A served file: item ``item_id`` side by side, A on the left when ``a_on_left``."""

    __tablename__ = "videos"
    __table_args__ = (UniqueConstraint("item_id", "a_on_left", name="uq_video_item_order"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("studies.id"), index=True)
    item_id: Mapped[int] = mapped_column(ForeignKey("items.id"), index=True)
    a_on_left: Mapped[bool] = mapped_column(Boolean)
    token: Mapped[str] = mapped_column(String(64), unique=True, index=True)  # served name, no suffix
    duration_s: Mapped[float] = mapped_column(Float)


class Item(Base):
    __tablename__ = "items"

    id: Mapped[int] = mapped_column(primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("studies.id"), index=True)
    kind: Mapped[str] = mapped_column(String(20))
    prompt: Mapped[str] = mapped_column(Text)
    seed: Mapped[int | None] = mapped_column(Integer, nullable=True)
    method_a: Mapped[str] = mapped_column(String(100))
    method_b: Mapped[str] = mapped_column(String(100))
    clip_a_id: Mapped[int] = mapped_column(ForeignKey("clips.id"))
    clip_b_id: Mapped[int] = mapped_column(ForeignKey("clips.id"))
    expected: Mapped[str | None] = mapped_column(String(4), nullable=True)  # a / b / tie for checks
    target_ratings: Mapped[int] = mapped_column(Integer)
    excluded: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    exclusion_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: For a ``check_repeat`` item: the main item it repeats (whose videos it is served with).
    repeat_of: Mapped[int | None] = mapped_column(ForeignKey("items.id"), nullable=True)

    clip_a: Mapped[Clip] = relationship(foreign_keys=[clip_a_id])
    clip_b: Mapped[Clip] = relationship(foreign_keys=[clip_b_id])


class Rater(Base):
    __tablename__ = "raters"

    id: Mapped[int] = mapped_column(primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("studies.id"), index=True)
    token: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    label: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    last_seen_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    excluded: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    exclusion_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: The invite stops working after this time (None: never).
    expires_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    #: The crowd platform's worker id (e.g. Prolific's PROLIFIC_PID), from the link's
    #: ``worker_id`` parameter; an invite belongs to the first worker id it was opened with.
    worker_id: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)


class Assignment(Base):
    __tablename__ = "assignments"
    __table_args__ = (
        UniqueConstraint("rater_id", "item_id", name="uq_assignment_rater_item"),
        UniqueConstraint("rater_id", "position", name="uq_assignment_rater_position"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    token: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    rater_id: Mapped[int] = mapped_column(ForeignKey("raters.id"), index=True)
    item_id: Mapped[int] = mapped_column(ForeignKey("items.id"), index=True)
    position: Mapped[int] = mapped_column(Integer)
    a_on_left: Mapped[bool] = mapped_column(Boolean)
    shown_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    #: Set when the assignment left the queue without a vote; the reason is one of
    #: ``inactive`` (no activity for the study's release time), ``released`` / ``revoked`` /
    #: ``excluded`` (organiser actions), ``broken`` (the rater reported the pair).
    released_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    release_reason: Mapped[str | None] = mapped_column(String(20), nullable=True)

    item: Mapped[Item] = relationship()
    rater: Mapped[Rater] = relationship()


class Vote(Base):
    __tablename__ = "votes"

    id: Mapped[int] = mapped_column(primary_key=True)
    assignment_id: Mapped[int] = mapped_column(ForeignKey("assignments.id"), unique=True)
    rater_id: Mapped[int] = mapped_column(ForeignKey("raters.id"), index=True)
    item_id: Mapped[int] = mapped_column(ForeignKey("items.id"), index=True)
    left_is_a: Mapped[bool] = mapped_column(Boolean)
    shown_at: Mapped[datetime] = mapped_column(DateTime)
    voted_at: Mapped[datetime] = mapped_column(DateTime)
    overall_side: Mapped[str] = mapped_column(String(5))
    overall: Mapped[str] = mapped_column(String(4))
    visual_quality_side: Mapped[str] = mapped_column(String(5))
    visual_quality: Mapped[str] = mapped_column(String(4))
    motion_side: Mapped[str] = mapped_column(String(5))
    motion: Mapped[str] = mapped_column(String(4))
    text_alignment_side: Mapped[str] = mapped_column(String(5))
    text_alignment: Mapped[str] = mapped_column(String(4))
    both_bad: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    comment: Mapped[str | None] = mapped_column(Text, nullable=True)
    view_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)

    assignment: Mapped[Assignment] = relationship()


class Report(Base):
    """A problem a rater reported with an item (e.g. the videos do not load)."""

    __tablename__ = "reports"

    id: Mapped[int] = mapped_column(primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("studies.id"), index=True)
    assignment_id: Mapped[int] = mapped_column(ForeignKey("assignments.id"), index=True)
    rater_id: Mapped[int] = mapped_column(ForeignKey("raters.id"), index=True)
    item_id: Mapped[int] = mapped_column(ForeignKey("items.id"), index=True)
    reason: Mapped[str] = mapped_column(String(40))
    comment: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


def default_db_url(study_dir: str | Path) -> str:
    """The SQLite URL of a study folder's own database file."""
    return f"sqlite:///{Path(study_dir).resolve() / DB_FILENAME}"


def make_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite gets WAL mode, a busy timeout and serialized writes.

    pysqlite's own transaction handling starts transactions late (at the first write), so two
    requests could both read "item not yet voted" and then both write. SQLAlchemy's documented
    recipe hands BEGIN to SQLAlchemy; ``BEGIN IMMEDIATE`` takes the write lock up front, so each
    transaction of the rater app sees the database as of its start and writers queue (up to the
    busy timeout) instead of failing. Other backends use their default isolation.
    """
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True)
    engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:  # noqa: ANN001 - DB-API object
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        if ":memory:" not in url and url not in ("sqlite://", "sqlite:///"):
            cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:  # noqa: ANN001 - SQLAlchemy connection
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def init_db(engine: Engine) -> None:
    """Create the tables that do not exist yet and add the columns an older version lacked."""
    Base.metadata.create_all(engine)
    upgrade_schema(engine)


def missing_columns(engine: Engine) -> list[tuple[str, str]]:
    """(table, column) of this schema that the database's existing tables lack."""
    present = inspect(engine)
    out = []
    for table in Base.metadata.sorted_tables:
        if not present.has_table(table.name):
            continue
        have = {c["name"] for c in present.get_columns(table.name)}
        out += [(table.name, c.name) for c in table.columns if c.name not in have]
    return out


def upgrade_schema(engine: Engine) -> list[tuple[str, str]]:
    """Add the columns of this schema that an older database lacks (``ALTER TABLE … ADD
    COLUMN``, nullable or with the column's server default); returns what was added. Every
    column added since the first release is nullable or has a server default, so old rows stay
    valid. Safe to run concurrently: a column another process added meanwhile is skipped."""
    added = []
    for table_name, column_name in missing_columns(engine):
        column = Base.metadata.tables[table_name].columns[column_name]
        ddl = (f"ALTER TABLE {table_name} ADD COLUMN {column_name} "
               f"{column.type.compile(dialect=engine.dialect)}")
        if column.server_default is not None:
            default = column.server_default.arg
            default = default.compile(dialect=engine.dialect) if hasattr(default, "compile") else default
            ddl += f" DEFAULT {default}"
        try:
            with engine.begin() as conn:
                conn.execute(text(ddl))
        except Exception:  # noqa: BLE001 - added by a concurrent process? then it is there now
            if (table_name, column_name) in missing_columns(engine):
                raise
            continue
        added.append((table_name, column_name))
    return added


def session_factory(engine: Engine) -> sessionmaker:
    """Sessions that keep loaded attributes after commit (handy for returning rows)."""
    return sessionmaker(engine, expire_on_commit=False)


def open_db(url: str) -> tuple[Engine, sessionmaker]:
    """Engine (tables created) and session factory for ``url``."""
    engine = make_engine(url)
    init_db(engine)
    return engine, session_factory(engine)


def find_study(session, name: str | None = None) -> Study:  # noqa: ANN001 - Session
    """The study called ``name``, or the only study of the database when ``name`` is None."""
    from sqlalchemy import select

    studies = list(session.scalars(select(Study).order_by(Study.id)))
    if name is not None:
        for study in studies:
            if study.name == name:
                return study
        raise LookupError(f"no study named {name!r} in this database "
                          f"(studies: {', '.join(s.name for s in studies) or 'none'})")
    if not studies:
        raise LookupError("this database holds no study; build one with `attnqat eval build`")
    if len(studies) > 1:
        raise LookupError("this database holds several studies; choose one with --name "
                          f"({', '.join(s.name for s in studies)})")
    return studies[0]
