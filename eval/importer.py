"""``attnqat eval import``: analyse votes collected elsewhere exactly like a study's own votes.

Input: a CSV file, one row per vote or per group of identical votes (``count``). Columns (names
are case-insensitive; only ``overall`` is required):

* ``overall`` (or ``outcome``): ``a`` / ``win``, ``b`` / ``lose``, ``tie``, ``both_bad`` (a tie
  saying neither is good), from method A's point of view;
* ``visual_quality``, ``motion``, ``text_alignment``: the same, for the criteria (optional; empty
  cells are unanswered);
* ``method_a``, ``method_b``: the pair (or give ``--pair A:B`` for every row);
* ``prompt`` (and ``seed``): what the bootstrap and the clustered margin test group by. Without it,
  every vote counts as a prompt of its own — the design of a study with one vote per prompt,
  like the paper's 16 / 64 / 19 over 99 prompts;
* ``rater``: who voted (agreement and the check rule need it; without it every vote is a rater
  of its own);
* ``kind`` (``main``, ``check_identical``, ``check_degraded``, ``practice``) and ``expected``
  (``a`` / ``b`` / ``tie``, for checks);
* ``left_is_a`` (true / false): the displayed order, for the position-bias test;
* ``count`` (a positive whole number), ``comment``, ``view_seconds``.

The ``votes.csv`` that ``attnqat eval report`` writes is accepted as it is. The result is the same
report (``report.md``, ``report.html``, figure, ``results.json``, ``votes.csv``) in ``--out``;
nothing is written when a row is wrong, and the error names the line.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from .results import QUESTIONS, VoteRecord, analyze
from .sources import InputError
from .storage import ITEM_KINDS
from .study import StudyConfig, add_margin_arguments, parse_pairs

ANSWERS = {"a": "a", "win": "a", "w": "a", "b": "b", "lose": "b", "loss": "b", "l": "b",
           "tie": "tie", "t": "tie", "same": "tie", "draw": "tie",
           "both_bad": "both_bad", "both bad": "both_bad", "bad": "both_bad"}
TRUE, FALSE = {"true", "1", "yes", "y"}, {"false", "0", "no", "n"}


def _answer(value: str, where: str, column: str) -> str | None:
    value = value.strip().lower()
    if not value:
        return None
    if value not in ANSWERS:
        raise InputError(f"{where}: {column} {value!r} is not one of a/win, b/lose, tie, both_bad")
    return ANSWERS[value]


def read_votes(path: str | Path, pair: tuple[str, str] | None = None) -> list[VoteRecord]:
    """The votes of a CSV file (see the module docstring); raises :class:`InputError` naming the
    line of the first bad row."""
    path = Path(path)
    try:
        fh = open(path, newline="", encoding="utf-8-sig")
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc}") from exc
    with fh:
        reader = csv.DictReader(fh)
        columns = {(c or "").strip().lower(): c for c in reader.fieldnames or ()}
        if "overall" not in columns and "outcome" in columns:
            columns["overall"] = columns["outcome"]
        if "overall" not in columns:
            raise InputError(f"{path}: no 'overall' (or 'outcome') column; the header is "
                             f"{', '.join(reader.fieldnames or ()) or 'empty'}")
        if pair is None and not {"method_a", "method_b"} <= set(columns):
            raise InputError(f"{path}: no method_a/method_b columns; give --pair A:B")
        votes: list[VoteRecord] = []
        units: dict[tuple, int] = {}
        for line, raw in enumerate(reader, start=2):
            where = f"{path}:{line}"

            def get(name: str, default: str = "") -> str:
                key = columns.get(name)
                value = raw.get(key) if key is not None else None
                if value is None:
                    return default
                value = str(value)
                if value[:1] == "'" and value[1:2] in ("=", "+", "-", "@", "\t", "\r"):
                    value = value[1:]  # our export's formula guard
                return value.strip()

            answers, both_bad = {}, False
            for q in QUESTIONS:
                value = _answer(get(q), where, q)
                if value is None:
                    continue
                if value == "both_bad":
                    if q != "overall":
                        raise InputError(f"{where}: both_bad answers only the overall question")
                    value, both_bad = "tie", True
                answers[q] = value
            if "overall" not in answers:
                raise InputError(f"{where}: the overall answer is empty")
            method_a = get("method_a") or (pair[0] if pair else "")
            method_b = get("method_b") or (pair[1] if pair else "")
            if not method_a or not method_b:
                raise InputError(f"{where}: empty method_a or method_b (or give --pair A:B)")
            if pair and (method_a, method_b) != pair:
                continue
            kind = get("kind", "main") or "main"
            if kind not in ITEM_KINDS:
                raise InputError(f"{where}: kind {kind!r} is not one of {', '.join(ITEM_KINDS)}")
            expected = get("expected").lower() or None
            if kind.startswith("check") and expected not in ("a", "b", "tie"):
                raise InputError(f"{where}: a check needs expected a, b or tie")
            count_text = get("count", "1") or "1"
            try:
                count = int(count_text)
            except ValueError:
                raise InputError(f"{where}: count {count_text!r} is not a whole number") from None
            if count < 1:
                raise InputError(f"{where}: count must be at least 1, not {count}")
            left_text = get("left_is_a").lower()
            if left_text and left_text not in TRUE | FALSE:
                raise InputError(f"{where}: left_is_a {left_text!r} is not true or false")
            left_is_a = None if not left_text else left_text in TRUE
            seed_text = get("seed")
            try:
                seed = int(seed_text) if seed_text else None
                view = float(get("view_seconds")) if get("view_seconds") else None
            except ValueError:
                raise InputError(f"{where}: seed or view_seconds is not a number") from None
            for k in range(count):
                n = len(votes) + 1
                prompt = get("prompt") or f"vote-{n}"
                rater = get("rater") or f"voter-{n}"
                unit = (prompt, seed, method_a, method_b, kind)
                item_id = units.setdefault(unit, len(units) + 1)
                sides = {}
                if left_is_a is not None:
                    sides = {q: ("tie" if a == "tie" else "left" if (a == "a") == left_is_a else "right")
                             for q, a in answers.items()}
                    if both_bad:
                        sides["overall"] = "both_bad"
                left, right = (method_a, method_b) if left_is_a else (method_b, method_a)
                votes.append(VoteRecord(
                    n, rater, item_id, kind, prompt, seed, method_a, method_b, expected,
                    left if left_is_a is not None else None,
                    right if left_is_a is not None else None, left_is_a, None, None,
                    dict(answers), sides, both_bad, get("comment") or None, view,
                    worker_id=get("worker_id") or None))
    if not votes:
        raise InputError(f"{path}: no votes" + (f" for the pair {pair[0]}:{pair[1]}" if pair else ""))
    return votes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("csv", type=Path, help="votes collected elsewhere (columns: see docs/eval.md)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder for the report; if omitted, CSV_STEM-report next to "
                             "the CSV file")
    parser.add_argument("--pair", default=None,
                        help="METHOD_A:METHOD_B for rows without method columns (or to keep only "
                             "that pair)")
    parser.add_argument("--name", default=None,
                        help="name shown in the report; if omitted, the CSV file's stem")
    add_margin_arguments(parser)
    parser.add_argument("--min-check-accuracy", type=float, default=0.7,
                        help="exclusion rule: raters below this check accuracy are excluded")
    parser.add_argument("--min-checks", type=int, default=1,
                        help="exclusion rule: only raters with this many answered checks can be "
                             "excluded")
    parser.add_argument("--n-boot", type=int, default=2000, help="bootstrap resamples of prompts")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed")


def run(args: argparse.Namespace) -> int:
    from .report import print_summary, write_report

    try:
        pair = None
        if args.pair:
            pairs = parse_pairs(args.pair, args.pair.replace(",", ":").split(":"), "")
            if len(pairs) != 1:
                raise InputError("--pair takes one METHOD_A:METHOD_B")
            pair = pairs[0]
        votes = read_votes(args.csv, pair)
        pairs = list(dict.fromkeys((v.method_a, v.method_b) for v in votes if v.kind == "main"))
        if not pairs:
            raise InputError(f"{args.csv}: no votes on main items")
        config = StudyConfig(name=args.name or args.csv.stem, pairs=pairs,
                             equivalence_margin=args.equivalence_margin, test=args.test,
                             alpha=args.alpha, min_prompts=args.min_prompts,
                             min_check_accuracy=args.min_check_accuracy,
                             min_checks=args.min_checks, n_boot=args.n_boot, seed=args.seed,
                             ratings_per_item=1, check_fraction=0, practice_items=0)
        config.validate()
    except (InputError, ValueError) as exc:
        print(f"attnqat eval import: {exc}", file=sys.stderr)
        return 2
    analysis = analyze(votes, config)
    out = args.out or args.csv.with_name(f"{args.csv.stem}-report")
    paths = write_report(analysis, votes, out)
    print(f"{len(votes)} votes ({analysis['n_votes']['main']} on main items) from {args.csv}")
    print_summary(analysis)
    print(f"report: {paths['markdown']}")
    return 0
