"""``attnqat eval serve``: the rater web app (FastAPI + one small HTML/JS page) and admin view.

Every URL and byte a rater sees is under this module's control: the page knows videos only as
``/media/<32 hex>.mp4`` (random per study), the API speaks only of "left", "right" and "tie",
and the study's name (which may name methods) is shown only to the admin.

HTTP JSON API (errors are ``{"error": "..."}`` with the status in brackets, malformed requests
included):

Rater (``TOKEN`` = invite token; unknown or withdrawn tokens get [403]):

* ``GET  /api/r/TOKEN/state``   → ``{"stage", "progress", "questions", "practice_items",
  "load_timeout", "max_comment"}``; stage is ``instructions`` | ``practice`` | ``rating`` |
  ``done`` | ``full``;
* ``POST /api/r/TOKEN/start``   → fixes the rater's queue (idempotent), returns the state;
* ``GET  /api/r/TOKEN/current`` → ``{"done": false, "assignment", "prompt", "video",
  "duration", "practice", "progress"}`` for the first open item (time shown recorded on first
  display; studies built before side-by-side serving give ``"left"`` and ``"right"`` instead of
  ``"video"``) or ``{"done": true, "progress"}``; [409] before ``start``;
* ``POST /api/r/TOKEN/vote``    ``{"assignment", "overall", "criteria": {"visual_quality",
  "motion", "text_alignment"}, "comment"}``: overall ``left`` | ``right`` | ``tie`` |
  ``both_bad``, criteria ``left`` | ``right`` | ``tie``, comment optional → ``{"ok": true,
  "progress"}``; [403] not this rater's, [409] already voted, never shown or released,
  [425] before the pair could have played through (``"wait_seconds"`` says how long), [422]
  malformed;
* ``POST /api/r/TOKEN/report``  ``{"assignment", "reason": "not_loading" | "other",
  "comment"}`` → ``{"ok": true, "progress"}``: the pair is skipped and the report kept for the
  organiser.

Media and pages: ``GET /media/NAME.mp4`` (only names of this study's videos, from its media
folder; Range requests supported; no ETag or Last-Modified), ``GET /r/TOKEN`` (rater page;
``?worker_id=ID`` ties the invite to a crowd worker), ``GET /c/CROWD_TOKEN?worker_id=ID`` (the
crowd study link: one rater per worker id, redirected to their page), ``GET /`` (enter a code),
``GET /healthz``. Request bodies over :data:`MAX_BODY_BYTES` get [413].

Admin (HTTP basic auth, any user name, the admin password): ``GET /admin`` (page),
``GET /admin/api/progress``, ``GET /admin/api/results``, ``GET /admin/api/votes``,
``GET /admin/api/export/votes.csv`` | ``votes.json`` | ``results.json`` (downloads),
``POST /admin/api/invites`` ``{"count": n}`` (1 … 500), ``POST /admin/api/raters/LABEL/release``,
``…/revoke``, ``…/exclude`` ``{"excluded": bool, "reason"}``,
``POST /admin/api/items/ID/exclude`` ``{"excluded": bool, "reason"}``. Every admin POST must
come from this origin (``Origin``/``Referer``/``Sec-Fetch-Site``), carry the CSRF token of
``GET /admin/api/csrf`` (also in the admin page) in ``X-CSRF-Token`` and, with a body, be JSON
(403 / 415 otherwise); ``excluded`` is required (an empty body is 422, never an exclusion).
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import sys
from dataclasses import dataclass, field
from urllib.parse import urlsplit
from importlib import resources
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.security import HTTPBasic, HTTPBasicCredentials
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import sessionmaker
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import rating
from .storage import CRITERIA, Clip, Item, Video, default_db_url, find_study, open_db
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
#: Seconds the rater page waits for a pair to load before it offers "try again" / "skip".
DEFAULT_LOAD_TIMEOUT = 30.0
#: Largest request body the server reads (a vote with a 2,000-character comment is < 10 KiB).
MAX_BODY_BYTES = 64 * 1024


class BodyTooLarge(HTTPException):
    def __init__(self) -> None:
        super().__init__(413, f"request body larger than {MAX_BODY_BYTES} bytes")


class BodyLimit:
    """ASGI middleware: a request whose body is over ``limit`` bytes gets 413 — at once when its
    Content-Length says so, else as soon as that many bytes arrived (never read whole)."""

    def __init__(self, app, limit: int = MAX_BODY_BYTES) -> None:  # noqa: ANN001 - ASGI app
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            response = JSONResponse({"error": f"request body larger than {self.limit} bytes"},
                                    status_code=413, headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        received = 0

        async def limited():  # noqa: ANN202
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge()
            return message

        await self.app(scope, limited, send)


def _package_dir(name: str) -> Path:
    return Path(str(resources.files("attnqat.eval").joinpath(name)))


def _template(name: str) -> str:
    return (_package_dir("templates") / name).read_text(encoding="utf-8")


BASIC_AUTH = HTTPBasic(realm="study admin")


class VoteIn(BaseModel):
    assignment: str = Field(max_length=64)
    overall: str = Field(max_length=16)
    criteria: dict[str, str]
    comment: str | None = Field(default=None, max_length=rating.MAX_COMMENT)


class ReportIn(BaseModel):
    assignment: str = Field(max_length=64)
    reason: str = Field(max_length=40)
    comment: str | None = Field(default=None, max_length=rating.MAX_COMMENT)


class InvitesIn(BaseModel):
    count: int = Field(ge=1, le=rating.MAX_INVITES)
    #: Days until the new links stop working (None: the study's ``invite_days``; 0: never).
    days: float | None = Field(default=None, ge=0, le=3650)


class ExcludeIn(BaseModel):
    excluded: bool  # required: an empty or partial body must never exclude
    reason: str | None = Field(default=None, max_length=rating.MAX_COMMENT)


#: The header that carries the admin page's CSRF token on every state-changing admin request.
CSRF_HEADER = "X-CSRF-Token"


#: Names crowd platforms give the worker id in a study link (Prolific, MTurk, generic).
WORKER_PARAMETERS = ("worker_id", "PROLIFIC_PID", "workerId")


def _worker_id(request: Request) -> str | None:
    for name in WORKER_PARAMETERS:
        value = request.query_params.get(name)
        if value:
            return value
    return None


def _validation_message(exc: RequestValidationError) -> str:
    """One readable line from pydantic's errors, e.g. ``count: Input should be less than or
    equal to 500``."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "request"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


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
    load_timeout: float = DEFAULT_LOAD_TIMEOUT
    #: Sent with the admin page; every state-changing admin request must echo it in
    #: :data:`CSRF_HEADER` (a form or a simple request from another origin cannot set a header).
    csrf_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))


def open_study(study_dir: str | Path, db_url: str | None = None, name: str | None = None,
               admin_password: str | None = None, *, release_after: float | None = None,
               min_view: float | None = None, load_timeout: float | None = None) -> StudyServer:
    """Connect to a built study (raises LookupError/FileNotFoundError with a clear message).

    ``release_after`` (minutes) and ``min_view`` (play-throughs) override the study's declared
    values for this server; ``load_timeout`` (seconds) is how long the page waits for a pair.
    """
    study_dir = Path(study_dir).resolve()
    media_dir = study_dir / "media"
    if not media_dir.is_dir():
        raise FileNotFoundError(f"{study_dir} has no media/ folder (is it a study folder?)")
    if db_url is None and not (study_dir / "study.db").is_file():
        raise FileNotFoundError(f"{study_dir} has no study.db (give --db for another database)")
    _, Session = open_db(db_url or default_db_url(study_dir))
    with Session() as session:
        study = find_study(session, name)
        config = StudyConfig.from_dict(study.config)
        if release_after is not None:
            config.release_after_minutes = release_after
        if min_view is not None:
            config.min_view_factor = min_view
        server = StudyServer(Session, study.id, study.name, config, study_dir, media_dir,
                             admin_password or secrets.token_urlsafe(12),
                             DEFAULT_LOAD_TIMEOUT if load_timeout is None else load_timeout)
    return server


def create_app(server: StudyServer) -> FastAPI:
    """The FastAPI application for one study: the rater's pages and API, the clips, the organiser's
    admin page and API."""
    app = FastAPI(title="Video comparison", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    app.mount("/static", StaticFiles(directory=_package_dir("static")), name="static")
    _add_hooks(app)
    _add_pages(app, server)
    _add_rater_api(app, server)
    _add_media_route(app, server)
    admin, admin_write = _admin_dependencies(server)
    _add_admin_routes(app, server, admin)
    _add_admin_actions(app, server, admin_write)
    return app


def _add_hooks(app: FastAPI) -> None:
    """Security headers on every response; every refusal and error as one JSON ``{"error"}``."""
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
        body = {"error": exc.message}
        if isinstance(exc, rating.TooEarly):
            body["wait_seconds"] = round(exc.wait_seconds, 2)
        return JSONResponse(body, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def malformed(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": _validation_message(exc)}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(LookupError)
    async def not_found(_request: Request, exc: LookupError) -> JSONResponse:
        return JSONResponse({"error": str(exc.args[0] if exc.args else exc)}, status_code=404)


def _add_pages(app: FastAPI, server: StudyServer) -> None:
    """The landing page, a rater's page, the crowd link, the health check."""
    Session, study_id, config = server.Session, server.study_id, server.config
    pages = {n: _template(n) for n in ("rater.html", "landing.html", "refused.html")}

    @app.get("/", response_class=HTMLResponse)
    def landing() -> HTMLResponse:
        return HTMLResponse(pages["landing.html"])

    @app.get("/r/{token}", response_class=HTMLResponse)
    def rater_page(token: str, request: Request) -> HTMLResponse:
        worker = _worker_id(request)
        with Session.begin() as session:
            try:
                rater = rating.get_rater(session, study_id, token)
                if worker is not None:
                    rating.claim_for_worker(rater, worker)
            except rating.RatingError:
                return HTMLResponse(pages["refused.html"], status_code=403)
        return HTMLResponse(pages["rater.html"])

    @app.get("/c/{crowd}")
    def crowd_link(crowd: str, request: Request) -> Response:
        """The study link of a crowd platform: one rater per worker id, then their page."""
        if not config.crowd_raters or not secrets.compare_digest(crowd.encode(),
                                                                 config.crowd_token.encode()):
            raise HTTPException(404, "not found")
        worker = _worker_id(request)
        if worker is None:
            raise HTTPException(400, "worker_id: the link needs ?worker_id=YOUR_WORKER_ID")
        token = rating.crowd_rater(Session, study_id, worker, config.crowd_raters,
                                   config.invite_days)
        return RedirectResponse(f"/r/{token}", status_code=303)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}



def _add_rater_api(app: FastAPI, server: StudyServer) -> None:
    """The rater API: state, start, the current pair, votes and problem reports."""
    Session, study_id, config = server.Session, server.study_id, server.config
    media_root = server.media_dir.resolve()
    questions = [{"key": q, "text": QUESTION_TEXT[q]} for q in ("overall", *CRITERIA)]
    with Session() as session:
        n_practice = len(list(session.scalars(
            select(Item.id).where(Item.study_id == study_id, Item.kind == "practice",
                                  Item.excluded.is_(False)))))

    def completion(stage: str) -> dict:
        """The completion code (and link) for raters who finished, for crowd platforms."""
        if stage not in ("done", "released") or not config.completion_code:
            return {}
        return {"completion_code": config.completion_code,
                "completion_url": config.completion_url or None}

    def state_of(session, rater) -> dict:  # noqa: ANN001
        stage = rating.stage(session, rater)
        return {"stage": stage, "progress": rating.progress(session, rater),
                "questions": questions, "practice_items": n_practice,
                "load_timeout": server.load_timeout, "max_comment": rating.MAX_COMMENT,
                **completion(stage)}

    @app.get("/api/r/{token}/state")
    def state(token: str) -> dict:
        with Session.begin() as session:
            return state_of(session, rating.get_rater(session, study_id, token, touch=True))

    @app.post("/api/r/{token}/start")
    def start(token: str) -> dict:
        rating.start(Session, study_id, token,
                     release_after_minutes=config.release_after_minutes)
        return state(token)

    @app.get("/api/r/{token}/current")
    def current(token: str) -> dict:
        with Session.begin() as session:
            rater = rating.get_rater(session, study_id, token, touch=True)
            assignment = rating.current(session, rater)
            if assignment is None:
                stage = rating.stage(session, rater)
                return {"done": True, "stage": stage, "progress": rating.progress(session, rater),
                        **completion(stage)}
            item = assignment.item
            shown = rating.served_media(session, assignment, media_root)
            return {"done": False, "assignment": assignment.token, "prompt": item.prompt,
                    **shown, "practice": item.kind == "practice",
                    "progress": rating.progress(session, rater)}

    def progress_of(token: str) -> dict:
        with Session() as session:
            return {"ok": True,
                    "progress": rating.progress(session, rating.get_rater(session, study_id, token))}

    @app.post("/api/r/{token}/vote")
    def vote(token: str, body: VoteIn) -> dict:
        with Session.begin() as session:
            rater = rating.get_rater(session, study_id, token, touch=True)
            rating.record_vote(session, rater, body.assignment, body.overall, body.criteria,
                               body.comment, min_view_factor=config.min_view_factor,
                               media_dir=media_root)
        return progress_of(token)

    @app.post("/api/r/{token}/report")
    def report(token: str, body: ReportIn) -> dict:
        with Session.begin() as session:
            rater = rating.get_rater(session, study_id, token, touch=True)
            rating.report_problem(session, rater, body.assignment, body.reason, body.comment)
        return progress_of(token)


def _add_media_route(app: FastAPI, server: StudyServer) -> None:
    """The clips of the study, under their random names only."""
    Session, study_id = server.Session, server.study_id
    media_root = server.media_dir.resolve()

    @app.get("/media/{name}")
    def clip(name: str) -> FileResponse:
        if not MEDIA_NAME.fullmatch(name):
            raise HTTPException(404, "not found")
        token = name[:-4]
        with Session() as session:
            known = session.scalar(select(Video.id).where(Video.token == token,
                                                          Video.study_id == study_id))
            if known is None:  # a study built before side-by-side serving
                known = session.scalar(select(Clip.id).where(Clip.token == token,
                                                             Clip.study_id == study_id))
        path = (media_root / name).resolve()
        if known is None or path.parent != media_root or not path.is_file():
            raise HTTPException(404, "not found")
        response = FileResponse(path, media_type="video/mp4", stat_result=os.stat(path))
        for header in ("etag", "last-modified"):
            del response.headers[header]
        response.headers["Cache-Control"] = "private, max-age=3600"
        return response


def _admin_dependencies(server: StudyServer):
    """``(admin, admin_write)``: the FastAPI dependencies of the organiser's routes — the admin
    password, and for state-changing requests the same-origin and CSRF checks too."""

    def admin(credentials: HTTPBasicCredentials = Depends(BASIC_AUTH)) -> None:  # noqa: B008
        if not secrets.compare_digest(credentials.password.encode(), server.admin_password.encode()):
            raise HTTPException(401, "wrong password", headers={"WWW-Authenticate": "Basic"})

    def admin_write(request: Request, _auth: None = Depends(admin)) -> None:  # noqa: B008
        """A state-changing admin request: from this origin, carrying the CSRF token, with a
        JSON body (if any). The browser sends the organiser's basic-auth password with any
        request to this server, a form on another site's page included; these checks refuse
        what such a page can send."""
        host = request.headers.get("host", "")
        if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
            raise HTTPException(403, "cross-origin request refused")
        for header in ("origin", "referer"):
            value = request.headers.get(header)
            if value and value != "null" and urlsplit(value).netloc != host:
                raise HTTPException(403, "cross-origin request refused")
            if value == "null":
                raise HTTPException(403, "cross-origin request refused")
        token = request.headers.get(CSRF_HEADER, "")
        if not secrets.compare_digest(token.encode(), server.csrf_token.encode()):
            raise HTTPException(403, f"missing or wrong CSRF token (the {CSRF_HEADER} header; "
                                     "GET /admin/api/csrf gives it)")
        length = request.headers.get("content-length")
        if length not in (None, "0") and not request.headers.get("content-type", "").startswith(
                "application/json"):
            raise HTTPException(415, "the body must be JSON (Content-Type: application/json)")

    return admin, admin_write


def _add_admin_routes(app: FastAPI, server: StudyServer, admin) -> None:  # noqa: ANN001
    """The organiser's page and read API (progress, results, votes, exports) behind the admin
    password (the dependency ``admin``)."""
    Session, study_id, config = server.Session, server.study_id, server.config
    admin_html = _template("admin.html")

    @app.get("/admin", response_class=HTMLResponse, dependencies=[Depends(admin)])
    def admin_page() -> HTMLResponse:
        return HTMLResponse(admin_html.replace("{{CSRF_TOKEN}}", server.csrf_token))

    @app.get("/admin/api/csrf", dependencies=[Depends(admin)])
    def admin_csrf() -> dict:
        return {"header": CSRF_HEADER, "token": server.csrf_token}

    # The analysis needs scipy; imported on first use so the rater app starts faster.
    @app.get("/admin/api/progress", dependencies=[Depends(admin)])
    def admin_progress() -> dict:
        from .results import progress_tables

        with Session() as session:
            return {"study": server.name, "invite_limit": rating.MAX_INVITES,
                    **progress_tables(session, study_id, config)}

    def analysis() -> dict:
        from .results import analyze, json_safe, load_reports, load_votes

        with Session() as session:
            votes = load_votes(session, study_id)
            reports = load_reports(session, study_id)
        return json_safe(analyze(votes, config, reports))

    @app.get("/admin/api/results", dependencies=[Depends(admin)])
    def admin_results() -> dict:
        return analysis()

    def vote_rows() -> list[dict]:
        from .results import load_votes

        with Session() as session:
            return [v.flat() for v in load_votes(session, study_id)]

    @app.get("/admin/api/votes", dependencies=[Depends(admin)])
    def admin_votes() -> list[dict]:
        return vote_rows()

    @app.get("/admin/api/export/{name}", dependencies=[Depends(admin)])
    def admin_export(name: str) -> Response:
        import json

        from .report import votes_csv

        if name == "votes.csv":
            body, kind = votes_csv(vote_rows()), "text/csv; charset=utf-8"
        elif name == "votes.json":
            body, kind = json.dumps(vote_rows(), indent=1, ensure_ascii=False), "application/json"
        elif name == "results.json":
            body, kind = json.dumps(analysis(), indent=1, ensure_ascii=False), "application/json"
        else:
            raise HTTPException(404, "exports: votes.csv, votes.json, results.json")
        return Response(body, media_type=kind, headers={
            "Content-Disposition": f'attachment; filename="{name}"'})


def _add_admin_actions(app: FastAPI, server: StudyServer, admin_write) -> None:  # noqa: ANN001
    """The organiser's writes: invites, a rater released, revoked or excluded, an item excluded."""
    Session, study_id, config = server.Session, server.study_id, server.config

    @app.post("/admin/api/invites", dependencies=[Depends(admin_write)])
    def admin_invites(body: InvitesIn) -> dict:
        days = config.invite_days if body.days is None else body.days
        invites = rating.add_raters(Session, study_id, body.count, expires_days=days)
        write_invites(server.study_dir, invites)
        return {"invites": [{"label": label, "token": token, "link": f"/r/{token}"}
                            for label, token in invites]}

    @app.post("/admin/api/raters/{label}/{action}", dependencies=[Depends(admin_write)])
    def admin_rater(label: str, action: str, body: ExcludeIn | None = None) -> dict:
        with Session.begin() as session:
            rater = rating.find_rater(session, study_id, label)
            if action == "release":
                released = rating.release_assignments(session, rater, "released")
            elif action == "revoke":
                released = rating.revoke_rater(session, rater)
            elif action == "exclude":
                if body is None:
                    raise HTTPException(422, 'excluded: a JSON body {"excluded": true|false, '
                                             '"reason": …} is required')
                rating.set_rater_excluded(rater, body.excluded, body.reason)
                released = 0
            else:
                raise HTTPException(404, "rater actions: release, revoke, exclude")
            return {"ok": True, "rater": label, "released": released,
                    "revoked": rater.revoked_at is not None, "excluded": rater.excluded}

    @app.post("/admin/api/items/{item_id}/exclude", dependencies=[Depends(admin_write)])
    def admin_item(item_id: int, body: ExcludeIn) -> dict:
        with Session.begin() as session:
            item = rating.find_item(session, study_id, item_id)
            released = rating.set_item_excluded(session, item, body.excluded, body.reason)
            return {"ok": True, "item": item_id, "excluded": item.excluded, "released": released}


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
    parser.add_argument("--release-after", type=float, default=None, metavar="MINUTES",
                        help="give an inactive rater's open items back to the pool after this "
                             "many minutes (0: never); if omitted, the study's declared value")
    parser.add_argument("--min-view", type=float, default=None, metavar="PLAYS",
                        help="refuse votes until the pair has been on screen this many times its "
                             "length (0: no minimum); if omitted, the study's declared value")
    parser.add_argument("--load-timeout", type=float, default=DEFAULT_LOAD_TIMEOUT,
                        metavar="SECONDS",
                        help="seconds the rater page waits for a pair to load before offering "
                             "'try again' and 'report and skip'")
    parser.add_argument("--log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug"],
                        help="server log level")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    password = args.admin_password or os.environ.get("ATTNQAT_ADMIN_PASSWORD")
    try:
        for option, value in (("--release-after", args.release_after),
                              ("--min-view", args.min_view)):
            if value is not None and value < 0:
                raise ValueError(f"{option} must be 0 or positive")
        if args.load_timeout <= 0:
            raise ValueError("--load-timeout must be positive")
        server = open_study(args.study, args.db, args.name, password,
                            release_after=args.release_after, min_view=args.min_view,
                            load_timeout=args.load_timeout)
    except (LookupError, FileNotFoundError, ValueError) as exc:
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
