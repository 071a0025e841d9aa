"""``attnqat eval serve``: the rater web app (FastAPI + one small HTML/JS page) and admin view.

Every URL and byte a rater sees is under this module's control: the page knows clips only as
``/media/<32 hex>.mp4`` (random per study), the API speaks only of "left", "right" and "tie",
and the study's name (which may name methods) is shown only to the admin.

HTTP JSON API (errors are ``{"error": "..."}`` with the status in brackets):

Rater (``TOKEN`` = invite token; unknown tokens get [403]):

* ``GET  /api/r/TOKEN/state``   → ``{"stage", "progress", "questions"}``; stage is
  ``instructions`` | ``practice`` | ``rating`` | ``done`` | ``full``;
* ``POST /api/r/TOKEN/start``   → fixes the rater's queue (idempotent), returns the state;
* ``GET  /api/r/TOKEN/current`` → ``{"done": false, "assignment", "prompt", "left", "right",
  "practice", "progress"}`` for the first unvoted item (time shown recorded on first display) or
  ``{"done": true, "progress"}``; [409] before ``start``;
* ``POST /api/r/TOKEN/vote``    ``{"assignment", "overall", "criteria": {"visual_quality",
  "motion", "text_alignment"}}`` with values ``left`` | ``right`` | ``tie`` → ``{"ok": true,
  "progress"}``; [403] the assignment is not this rater's, [409] already voted or never shown,
  [422] malformed answers.

Media and pages: ``GET /media/NAME.mp4`` (only names of this study's clips, from its media folder;
Range requests supported; no ETag or Last-Modified), ``GET /r/TOKEN`` (rater page), ``GET /``
(enter a code), ``GET /healthz``.

Admin (HTTP basic auth, any user name, the admin password): ``GET /admin`` (page),
``GET /admin/api/progress``, ``GET /admin/api/results``, ``GET /admin/api/votes``,
``POST /admin/api/invites`` ``{"count": n}``.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from fastapi.security import HTTPBasic, HTTPBasicCredentials
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import sessionmaker

from . import rating
from .storage import CRITERIA, Clip, default_db_url, find_study, open_db
from .study import StudyConfig, write_invites

MEDIA_NAME = re.compile(r"[0-9a-f]{32}\.mp4")
QUESTION_TEXT = {
    "overall": "Overall, which video is better?",
    "visual_quality": "Visual quality: which looks better (sharper, fewer artefacts)?",
    "motion": "Motion: which moves more naturally and smoothly?",
    "text_alignment": "Text alignment: which matches the description better?",
}
SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
}


def _package_dir(name: str) -> Path:
    return Path(str(resources.files("attnqat.eval").joinpath(name)))


def _template(name: str) -> str:
    return (_package_dir("templates") / name).read_text(encoding="utf-8")


BASIC_AUTH = HTTPBasic(realm="study admin")


class VoteIn(BaseModel):
    assignment: str = Field(max_length=64)
    overall: str = Field(max_length=8)
    criteria: dict[str, str]


class InvitesIn(BaseModel):
    count: int = Field(ge=1, le=1000)


@dataclass
class StudyServer:
    """What the app serves: one study of one database, and its media folder."""

    Session: sessionmaker
    study_id: int
    name: str
    config: StudyConfig
    study_dir: Path
    media_dir: Path
    admin_password: str


def open_study(study_dir: str | Path, db_url: str | None = None, name: str | None = None,
               admin_password: str | None = None) -> StudyServer:
    """Connect to a built study (raises LookupError/FileNotFoundError with a clear message)."""
    study_dir = Path(study_dir).resolve()
    media_dir = study_dir / "media"
    if not media_dir.is_dir():
        raise FileNotFoundError(f"{study_dir} has no media/ folder (is it a study folder?)")
    if db_url is None and not (study_dir / "study.db").is_file():
        raise FileNotFoundError(f"{study_dir} has no study.db (give --db for another database)")
    _, Session = open_db(db_url or default_db_url(study_dir))
    with Session() as session:
        study = find_study(session, name)
        server = StudyServer(Session, study.id, study.name, StudyConfig.from_dict(study.config),
                             study_dir, media_dir, admin_password or secrets.token_urlsafe(12))
    return server


def create_app(server: StudyServer) -> FastAPI:
    """The FastAPI application for one study."""
    app = FastAPI(title="Video comparison", docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=_package_dir("static")), name="static")
    Session, study_id = server.Session, server.study_id
    media_root = server.media_dir.resolve()
    pages = {n: _template(n) for n in ("rater.html", "landing.html", "refused.html", "admin.html")}
    questions = [{"key": q, "text": QUESTION_TEXT[q]} for q in ("overall", *CRITERIA)]

    @app.middleware("http")
    async def headers(request: Request, call_next):  # noqa: ANN001, ANN202 - Starlette hook
        response = await call_next(request)
        for key, value in SECURITY_HEADERS.items():
            response.headers.setdefault(key, value)
        if not request.url.path.startswith(("/media/", "/static/")):
            response.headers["Cache-Control"] = "no-store"
        return response

    @app.exception_handler(rating.RatingError)
    async def refused(_request: Request, exc: rating.RatingError) -> JSONResponse:
        return JSONResponse({"error": exc.message}, status_code=exc.status)

    def admin(credentials: HTTPBasicCredentials = Depends(BASIC_AUTH)) -> None:  # noqa: B008
        if not secrets.compare_digest(credentials.password.encode(), server.admin_password.encode()):
            raise HTTPException(401, "wrong password", headers={"WWW-Authenticate": "Basic"})

    # --- pages -------------------------------------------------------------------------------
    @app.get("/", response_class=HTMLResponse)
    def landing() -> HTMLResponse:
        return HTMLResponse(pages["landing.html"])

    @app.get("/r/{token}", response_class=HTMLResponse)
    def rater_page(token: str) -> HTMLResponse:
        with Session() as session:
            try:
                rating.get_rater(session, study_id, token)
            except rating.UnknownRater:
                return HTMLResponse(pages["refused.html"], status_code=403)
        return HTMLResponse(pages["rater.html"])

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    # --- rater API ---------------------------------------------------------------------------
    def state_of(session, rater) -> dict:  # noqa: ANN001
        return {"stage": rating.stage(session, rater), "progress": rating.progress(session, rater),
                "questions": questions}

    @app.get("/api/r/{token}/state")
    def state(token: str) -> dict:
        with Session.begin() as session:
            return state_of(session, rating.get_rater(session, study_id, token))

    @app.post("/api/r/{token}/start")
    def start(token: str) -> dict:
        rating.start(Session, study_id, token)
        return state(token)

    @app.get("/api/r/{token}/current")
    def current(token: str) -> dict:
        with Session.begin() as session:
            rater = rating.get_rater(session, study_id, token)
            assignment = rating.current(session, rater)
            if assignment is None:
                return {"done": True, "progress": rating.progress(session, rater)}
            item = assignment.item
            left, right = ((item.clip_a, item.clip_b) if assignment.a_on_left
                           else (item.clip_b, item.clip_a))
            return {"done": False, "assignment": assignment.token, "prompt": item.prompt,
                    "left": f"/media/{left.token}.mp4", "right": f"/media/{right.token}.mp4",
                    "practice": item.kind == "practice",
                    "progress": rating.progress(session, rater)}

    @app.post("/api/r/{token}/vote")
    def vote(token: str, body: VoteIn) -> dict:
        with Session.begin() as session:
            rater = rating.get_rater(session, study_id, token)
            rating.record_vote(session, rater, body.assignment, body.overall, body.criteria)
        with Session() as session:
            rater = rating.get_rater(session, study_id, token)
            return {"ok": True, "progress": rating.progress(session, rater)}

    # --- media -------------------------------------------------------------------------------
    @app.get("/media/{name}")
    def clip(name: str) -> FileResponse:
        if not MEDIA_NAME.fullmatch(name):
            raise HTTPException(404, "not found")
        with Session() as session:
            known = session.scalar(select(Clip.id).where(Clip.token == name[:-4],
                                                         Clip.study_id == study_id))
        path = (media_root / name).resolve()
        if known is None or path.parent != media_root or not path.is_file():
            raise HTTPException(404, "not found")
        response = FileResponse(path, media_type="video/mp4", stat_result=os.stat(path))
        for header in ("etag", "last-modified"):
            del response.headers[header]
        response.headers["Cache-Control"] = "private, max-age=3600"
        return response

    # --- admin -------------------------------------------------------------------------------
    @app.get("/admin", response_class=HTMLResponse, dependencies=[Depends(admin)])
    def admin_page() -> HTMLResponse:
        return HTMLResponse(pages["admin.html"])

    # The analysis needs scipy; imported on first use so the rater app starts faster.
    @app.get("/admin/api/progress", dependencies=[Depends(admin)])
    def admin_progress() -> dict:
        from .results import progress_tables

        with Session() as session:
            return {"study": server.name, **progress_tables(session, study_id)}

    @app.get("/admin/api/results", dependencies=[Depends(admin)])
    def admin_results() -> dict:
        from .results import analyze, json_safe, load_votes

        with Session() as session:
            votes = load_votes(session, study_id)
        return json_safe(analyze(votes, server.config))

    @app.get("/admin/api/votes", dependencies=[Depends(admin)])
    def admin_votes() -> list[dict]:
        from .results import load_votes

        with Session() as session:
            return [v.flat() for v in load_votes(session, study_id)]

    @app.post("/admin/api/invites", dependencies=[Depends(admin)])
    def admin_invites(body: InvitesIn) -> dict:
        invites = rating.add_raters(Session, study_id, body.count)
        write_invites(server.study_dir, invites)
        return {"invites": [{"label": label, "token": token, "link": f"/r/{token}"}
                            for label, token in invites]}

    return app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--study", type=Path, required=True,
                        help="study folder made by `attnqat eval build` (clips are served from its "
                             "media/ folder only)")
    parser.add_argument("--db", default=None,
                        help="SQLAlchemy database URL; if omitted, sqlite:///STUDY/study.db")
    parser.add_argument("--name", default=None,
                        help="study name, needed only when the database holds several studies")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0 to accept raters from other machines)")
    parser.add_argument("--port", type=int, default=7870, help="port to listen on")
    parser.add_argument("--admin-password", default=None,
                        help="password of the /admin view; if omitted, $ATTNQAT_ADMIN_PASSWORD, "
                             "else a random one printed at start")
    parser.add_argument("--log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug"],
                        help="server log level")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    password = args.admin_password or os.environ.get("ATTNQAT_ADMIN_PASSWORD")
    try:
        server = open_study(args.study, args.db, args.name, password)
    except (LookupError, FileNotFoundError) as exc:
        print(f"attnqat eval serve: {exc}", file=sys.stderr)
        return 2
    app = create_app(server)
    shown_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    print(f"study {server.name!r}: raters open http://{shown_host}:{args.port}/r/TOKEN "
          f"(tokens in {server.study_dir / 'invites.csv'})")
    print(f"admin: http://{shown_host}:{args.port}/admin", end="")
    print("" if password else f" (password: {server.admin_password})")
    sys.stdout.flush()
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0
