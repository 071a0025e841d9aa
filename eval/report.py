"""``attnqat eval report``: the statistics, figure and exports of a study's votes.

Writes into the output folder:

* ``report.md`` and ``report.html`` — the same content: declared settings, warnings, raters with
  their check accuracy, view times and fast-voter flags, the exclusions applied, and per method
  pair the headline table (overall and per criterion) with intervals, sign test, the declared
  margin test (equivalence or non-inferiority, with the interval that decides it, or "not enough
  data"), position bias and agreement; Δ and its intervals in percentage points;
* ``wtl.png`` and ``wtl.svg`` — stacked win/tie/lose bars;
* ``votes.csv`` and ``votes.json`` — every raw vote (practice and checks included, with their
  kind, the displayed order, both clicked and resolved answers, view time, "both are bad" and
  comment);
* ``results.json`` — the full analysis.
"""

from __future__ import annotations

import argparse
import csv
import html
import io
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from . import plots
from .results import QUESTIONS, VoteRecord, analyze, json_safe, load_reports, load_votes
from .storage import default_db_url, find_study, open_db
from .study import StudyConfig


# --------------------------------------------------------------------------------------------
# A tiny document model rendered both to Markdown and to HTML
# --------------------------------------------------------------------------------------------

@dataclass
class Block:
    kind: str  # h1 h2 h3 p table img
    text: str = ""
    rows: Sequence[Sequence[str]] = ()


def _md_text(text: object) -> str:
    """Text for Markdown, where raw HTML would be rendered: ``&`` and ``<`` escaped (names,
    prompts and exclusion reasons come from raters, organisers and imported files)."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;")


def _md(blocks: Sequence[Block]) -> str:
    out = []
    for b in blocks:
        if b.kind in ("h1", "h2", "h3"):
            out.append("#" * int(b.kind[1]) + " " + _md_text(b.text))
        elif b.kind == "p":
            out.append(_md_text(b.text))
        elif b.kind == "img":
            out.append(f"![{b.text}]({b.text})")
        elif b.kind == "table":
            header, *body = b.rows
            out.append("| " + " | ".join(_md_text(c) for c in header) + " |")
            out.append("|" + "|".join("---" for _ in header) + "|")
            out.extend("| " + " | ".join(_md_text(c).replace("|", "\\|") for c in r) + " |"
                       for r in body)
        out.append("")
    return "\n".join(out)


def _html(blocks: Sequence[Block], title: str) -> str:
    body = []
    for b in blocks:
        if b.kind in ("h1", "h2", "h3", "p"):
            body.append(f"<{b.kind}>{html.escape(b.text)}</{b.kind}>")
        elif b.kind == "img":
            body.append(f'<img src="{html.escape(b.text)}" alt="win tie lose chart">')
        elif b.kind == "table":
            header, *rows = b.rows
            head = "".join(f"<th>{html.escape(str(c))}</th>" for c in header)
            trs = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>"
                          for r in rows)
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{trs}</tbody></table>")
    style = ("body{font-family:sans-serif;max-width:70em;margin:2em auto;padding:0 1em}"
             "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;"
             "padding:.2em .5em;text-align:right}td:first-child,th:first-child{text-align:left}"
             "img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n")


NO_DATA = "no data"


def _missing(x: float | None) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _pct(x: float | None) -> str:
    return NO_DATA if _missing(x) else f"{100 * x:.1f}%"


def _ci(ci: Sequence[float], fmt: str = ".1f", unit: str = "") -> str:
    lo, hi = ci
    if _missing(lo) or _missing(hi):
        return NO_DATA
    return f"[{100 * lo:{fmt}}, {100 * hi:{fmt}}]{unit}"


def _pp(x: float | None) -> str:
    """A net preference in percentage points (Δ ∈ [−1, 1] → [−100, +100] pp)."""
    return NO_DATA if _missing(x) else f"{100 * x:+.1f} pp"


def _pp_ci(ci: Sequence[float]) -> str:
    """An interval of Δ in percentage points (see :func:`_pp`)."""
    return _ci(ci, "+.1f", " pp")


def _num(x: float | None, fmt: str = ".3f") -> str:
    return NO_DATA if _missing(x) else format(x, fmt)


def _decision(mt: dict) -> str:
    """The margin test in one cell: verdict, the deciding interval against the margin, p."""
    interval = _pp_ci((mt["ci_low"], mt["ci_high"]))
    bound = f"±{100 * mt['margin']:.0f} pp" if mt["test"] == "equivalence" else \
        f"> −{100 * mt['margin']:.0f} pp"
    if interval == NO_DATA:
        return f"{mt['verdict']}"
    holm = "" if _missing(mt.get("p_holm")) else f", Holm p = {_num(mt['p_holm'], '.4f')}"
    return f"{mt['verdict']}: {interval} vs {bound}, p = {_num(mt['p'], '.4f')}{holm}"


def verdict_line(pair: str, summary: dict) -> str:
    """One line per comparison for the terminal: counts, Δ with the deciding interval, verdict."""
    c, mt = summary["counts"], summary["margin_test"]
    conf = 1 - 2 * mt["alpha"]
    return (f"{pair}: {c['win']} win / {c['tie']} tie / {c['lose']} lose; "
            f"Δ = {_pp(summary['net_preference']['estimate'])}, {conf:.0%} interval "
            f"{_pp_ci((mt['ci_low'], mt['ci_high']))}; {mt['test']} within "
            f"{100 * mt['margin']:.0f} pp: {mt['verdict']}"
            + (f" (p = {_num(mt['p'], '.4f')})" if not _missing(mt["p"]) else
               f" ({mt['note']})" if mt["note"] else ""))


def report_blocks(analysis: dict) -> list[Block]:
    """The report's content (see the module docstring)."""
    cfg = analysis["config"]
    conf = cfg["confidence"]
    test = cfg.get("test", "equivalence")
    decide = 1 - 2 * cfg["alpha"]
    b: list[Block] = [Block("h1", f"Blind study: {analysis['study']}")]
    claim = ("−δ < Δ < δ (two one-sided tests)" if test == "equivalence"
             else "Δ > −δ (one-sided)")
    b.append(Block("p", (
        f"Declared before the study: pairs {', '.join(f'{a} vs {b_}' for a, b_ in cfg['pairs'])}; "
        f"{cfg['ratings_per_item']} rating(s) per item; {test} test of {claim} on the net "
        f"preference Δ = win share − lose share, margin δ = {100 * cfg['equivalence_margin']:.0f} "
        f"percentage points (pp), score tests for paired win/tie/lose data (Tango, with a "
        f"continuity correction; variance inflated by the prompt-clustered design effect where "
        f"raters share a prompt) at α = {cfg['alpha']}, decided by the {decide:.0%} score "
        f"interval; at least {cfg.get('min_prompts', 2)} prompts for a verdict; "
        f"intervals {conf:.0%}, bootstrap {cfg['n_boot']} resamples of prompts (seed "
        f"{cfg['seed']}). Win/lose are from method A's view (A is the first method of each pair). "
        "Δ and all its intervals are in percentage points.")))
    if analysis.get("warnings"):
        b.append(Block("h2", "Warnings"))
        b.extend(Block("p", f"⚠ {w}") for w in analysis["warnings"])
    organiser = analysis.get("excluded_by_organiser", {"raters": {}, "items": {}})
    extra = [f"{r} ({why})" for r, why in organiser["raters"].items()]
    extra += [f"item {i} ({why})" for i, why in organiser["items"].items()]
    b.append(Block("p", f"Exclusion rule: {analysis['exclusion_rule']}. Excluded: "
                        f"{', '.join(analysis['excluded_raters']) or 'none'}. Excluded by the "
                        f"organiser: {', '.join(extra) or 'none'}. Votes on main items: "
                        f"{analysis['n_votes']['main']} ({analysis['n_votes']['main_after_exclusion']} "
                        "after exclusion)."))
    b.append(Block("h2", "Raters"))
    rows = [["rater", "main votes", "check items", "check accuracy", "median view time",
             "fast voter", "excluded"]]
    for name, r in sorted(analysis["raters"].items()):
        excluded = "yes (too few checks)" if r.get("too_few_checks") else \
            "yes (checks)" if r["excluded"] else \
            "yes (organiser)" if r.get("excluded_by_organiser") else "no"
        view = r.get("median_view_seconds")
        rows.append([name, str(r["main_votes"]), f"{r['checks_correct']}/{r['checks_answered']}",
                     _pct(r["check_accuracy"]), NO_DATA if view is None else f"{view:.1f} s",
                     "yes" if r.get("fast") else "no", excluded])
    b.append(Block("table", rows=rows))
    mult = analysis.get("multiplicity")
    if mult and mult["tests"]:
        b.append(Block("p", (
            f"Multiplicity: the study makes {mult['tests']} margin test(s) with a verdict ({mult['family']}). "
            "Each verdict is at level α for its own comparison; the Holm-adjusted p (Holm p) "
            "says which verdicts hold for the whole family at the same α.")))
    b.append(Block("h2", "Results (after exclusion)"))
    ranking = analysis.get("ranking")
    if ranking and "error" in ranking:
        b.append(Block("p", f"⚠ no Bradley–Terry ranking: {ranking['error']}"))
    elif ranking and ranking["methods"]:
        b.append(Block("h3", "Ranking of all methods (Bradley–Terry)"))
        b.append(Block("p", (
            f"Bradley–Terry scores from every overall vote after exclusion (ties half a win "
            f"to each side), in Elo-like points (+400 = 10× the odds of being preferred), "
            + (f"{ranking['anchor']} fixed at 1000" if ranking["anchor"] else "mean 1000")
            + f"; {conf:.0%} intervals from {ranking['n_boot']} prompt-bootstrap refits. Beside "
            "the pairwise tables below, not instead of them: the ranking is descriptive and "
            "makes no margin claim.")))
        rows = [["rank", "method", "score", f"{conf:.0%} interval"]]
        for name, m in ranking["methods"].items():
            lo, hi = m["interval"]
            rows.append([str(m["rank"]), name, f"{m['score']:.0f}",
                         NO_DATA if _missing(lo) else f"[{lo:.0f}, {hi:.0f}]"])
        b.append(Block("table", rows=rows))
    b.append(Block("img", "wtl.png"))
    for pair, data in analysis["pairs"].items():
        b.append(Block("h3", pair))
        rows = [["question", "votes", "prompts", "win", "tie", "lose", "decisive win rate",
                 "sign test p", "Δ", f"Δ prompt bootstrap {conf:.0%}",
                 f"{test} ({decide:.0%} score interval of Δ)", "left share (decisive)", "position p",
                 "α (ordinal)"]]
        notes = []
        for q in QUESTIONS:
            s = data["questions"][q]
            sh, dec, mt, pos = s["shares"], s["decisive"], s["margin_test"], s["position_bias"]
            if s["n_votes"] == 0:
                rows.append([q, "0", "0", *[NO_DATA] * 11])
                continue
            tie = f"{sh['tie']['count']} ({_pct(sh['tie']['share'])})"
            if q == "overall" and s.get("both_bad"):
                tie += f", {s['both_bad']} both bad"
            rows.append([
                q, str(s["n_votes"]), str(s["n_prompts"]),
                f"{sh['win']['count']} ({_pct(sh['win']['share'])})", tie,
                f"{sh['lose']['count']} ({_pct(sh['lose']['share'])})",
                f"{_pct(dec['win_rate'])} {_ci(dec['wilson'])}" if dec["n"] else NO_DATA,
                _num(dec["sign_test_p"], ".4f"),
                _pp(s["net_preference"]["estimate"]),
                _pp_ci(s["net_preference"]["bootstrap"]),
                _decision(mt),
                _pct(pos["left_share"]), _num(pos["p"], ".4f"),
                _num(s["krippendorff_alpha_ordinal"]),
            ])
            notes += [f"{q}: {w}" for w in s.get("warnings", [])]
        b.append(Block("table", rows=rows))
        b.extend(Block("p", f"⚠ {n}") for n in notes)
        rows = [["question", "outcome", "share", f"Wilson {conf:.0%}", f"prompt bootstrap {conf:.0%}"]]
        for q in QUESTIONS:
            for o, v in data["questions"][q]["shares"].items():
                rows.append([q, o, _pct(v["share"]), _ci(v["wilson"]), _ci(v["bootstrap"])])
        b.append(Block("table", rows=rows))
        before = data["before_exclusion"]["overall"]
        b.append(Block("p", f"Before exclusion (overall): {before['win']} win / {before['tie']} "
                            f"tie / {before['lose']} lose."))
    b.append(Block("p", (
        "Reading the table: the sign test asks whether one method is preferred (ties dropped); a "
        "large p is not evidence of equality. The margin test decides on Δ: "
        f"'equivalent' means its {decide:.0%} score interval lies inside (−δ, δ) (both one-sided "
        "tests reject |Δ| ≥ δ); 'non-inferior' means its lower end is above −δ. 'Not enough "
        "data' means too few prompts for any verdict. 'Both bad' "
        "answers count as ties. The position test checks that left and right were picked "
        "equally often among decisive votes.")))
    return b


# --------------------------------------------------------------------------------------------
# Exports and the command
# --------------------------------------------------------------------------------------------

#: A spreadsheet reads a cell that starts with one of these as a formula.
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: object) -> object:
    """A text cell made safe for spreadsheets: one that would start a formula gets a leading
    apostrophe (shown as text; ``attnqat eval import`` takes it off again)."""
    if isinstance(value, str) and value.startswith(FORMULA_START):
        return "'" + value
    return value


def votes_csv(rows: Sequence[dict]) -> str:
    """Flat vote rows (:meth:`VoteRecord.flat`) as CSV text, text cells formula-safe."""
    fields = list(rows[0]) if rows else list(VoteRecord.__dataclass_fields__)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: csv_cell(v) for k, v in row.items()} for row in rows)
    return buffer.getvalue()


def export_votes(votes: Sequence[VoteRecord], out_dir: Path) -> tuple[Path, Path]:
    """``votes.csv`` and ``votes.json``: one flat row per vote."""
    rows = [v.flat() for v in votes]
    csv_path, json_path = out_dir / "votes.csv", out_dir / "votes.json"
    csv_path.write_text(votes_csv(rows), encoding="utf-8")
    json_path.write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return csv_path, json_path


def write_report(analysis: dict, votes: Sequence[VoteRecord], out_dir: str | Path) -> dict[str, Path]:
    """Write every output of the report into ``out_dir``; returns them by name."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png, svg = plots.plot_wtl(plots.wtl_rows(analysis), out_dir / "wtl",
                              title=f"{analysis['study']}: win / tie / lose")
    blocks = report_blocks(analysis)
    md = out_dir / "report.md"
    md.write_text(_md(blocks), encoding="utf-8")
    page = out_dir / "report.html"
    page.write_text(_html(blocks, f"Blind study: {analysis['study']}"), encoding="utf-8")
    csv_path, json_path = export_votes(votes, out_dir)
    results = out_dir / "results.json"
    results.write_text(json.dumps(json_safe(analysis), indent=1, ensure_ascii=False) + "\n",
                       encoding="utf-8")
    return {"png": png, "svg": svg, "markdown": md, "html": page, "csv": csv_path,
            "json": json_path, "results": results}


def load_analysis(db_url: str, name: str | None = None, n_boot: int | None = None
                  ) -> tuple[dict, list[VoteRecord]]:
    """Votes and analysis of the study ``name`` (or the only one) in the database at ``db_url``."""
    engine, Session = open_db(db_url)
    try:
        with Session() as session:
            study = find_study(session, name)
            config = StudyConfig.from_dict(study.config)
            if n_boot is not None:
                config.n_boot = n_boot
            votes = load_votes(session, study.id)
            reports = load_reports(session, study.id)
    finally:
        engine.dispose()
    return analyze(votes, config, reports), votes


def print_summary(analysis: dict) -> None:
    """The overall verdict of each comparison and every warning, for the terminal."""
    for pair, data in analysis["pairs"].items():
        overall = data["questions"]["overall"]
        print("  " + verdict_line(pair, overall))
        for w in overall.get("warnings", []):
            print(f"    warning: {w}")
    ranking = analysis.get("ranking")
    if ranking and ranking.get("methods"):
        print("  Bradley–Terry ranking: " + ", ".join(
            f"{name} {m['score']:.0f} [{m['interval'][0]:.0f}, {m['interval'][1]:.0f}]"
            if not _missing(m["interval"][0]) else f"{name} {m['score']:.0f}"
            for name, m in ranking["methods"].items()))
    for w in analysis.get("warnings", []):
        print(f"  warning: {w}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--study", type=Path, default=None,
                        help="study folder made by `attnqat eval build` (its study.db is read "
                             "unless --db is given)")
    parser.add_argument("--db", default=None,
                        help="SQLAlchemy database URL of the study (e.g. postgresql://…); if "
                             "omitted, sqlite:///STUDY/study.db")
    parser.add_argument("--name", default=None,
                        help="study name, needed only when the database holds several studies")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder; if omitted, STUDY/report (./report with --db only)")
    parser.add_argument("--n-boot", type=int, default=None,
                        help="bootstrap resamples of prompts; if omitted, the study's declared value")


def run(args: argparse.Namespace) -> int:
    if args.study is None and args.db is None:
        print("attnqat eval report: give --study DIR or --db URL", file=sys.stderr)
        return 2
    if args.study is not None and args.db is None and not (args.study / "study.db").is_file():
        print(f"attnqat eval report: {args.study} has no study.db (is it a study folder?)",
              file=sys.stderr)
        return 2
    db_url = args.db or default_db_url(args.study)
    try:
        analysis, votes = load_analysis(db_url, args.name, args.n_boot)
    except LookupError as exc:
        print(f"attnqat eval report: {exc}", file=sys.stderr)
        return 2
    out = args.out or ((args.study / "report") if args.study is not None else Path("report"))
    paths = write_report(analysis, votes, out)
    n = analysis["n_votes"]
    print(f"{n['all']} votes ({n['main']} on main items, {n['main_after_exclusion']} after "
          f"excluding {len(analysis['excluded_raters'])} rater(s))")
    print_summary(analysis)
    print(f"report: {paths['markdown']}  figure: {paths['png']}")
    return 0
