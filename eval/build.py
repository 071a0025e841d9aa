"""``attnqat eval build``: make a blind study from generated clips (or sample a prompt list).

Two uses:

* ``attnqat eval build OUTPUTS… --out STUDY`` — items from ``attnqat generate`` folders (searched
  recursively for ``record.json``) or CSV manifests (``prompt,seed,method,path``), opaque
  side-by-side media, the database, rater invites (see :mod:`attnqat.eval.study`);
* ``attnqat eval build --sample N --write-prompts FILE [--prompt-file LIST]`` — draw N prompts
  reproducibly (``--seed``) from a prompt list (default: the project's ``assets/prompts.txt``) to
  feed to generation.

With inputs, ``--sample N`` keeps N prompts drawn from those the inputs have (restricted to
``--prompt-file`` when it is given).
"""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

from attnqat import methods as registry

from .media import MediaError
from .sources import InputError, load_sources, methods_of, read_prompts, sample_prompts
from .study import StudyConfig, add_margin_arguments, build_study, parse_pairs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="*", type=Path,
                        help="folders written by `attnqat generate` (searched recursively for "
                             "record.json) and/or CSV manifests with columns prompt,seed,method,path")
    parser.add_argument("--out", type=Path, default=None,
                        help="new (or empty) folder for the study: media/, study.db, study.json, "
                             "invites.csv")
    parser.add_argument("--name", default=None, help="study name; if omitted, the --out folder's name")
    parser.add_argument("--db", default=None,
                        help="SQLAlchemy database URL (e.g. postgresql://user@host/db); if "
                             "omitted, the SQLite file OUT/study.db in WAL mode")
    parser.add_argument("--reference", default=registry.REFERENCE,
                        help="reference method; without --pairs every other method is compared "
                             "with it")
    parser.add_argument("--pairs", default=None,
                        help="comma-separated METHOD_A:METHOD_B pairs (A is the method under "
                             "test; wins are A's), e.g. attnqat:bf16,nvfp4:bf16")
    parser.add_argument("--ratings-per-item", type=int, default=3,
                        help="ratings each main item should get (k); raters are given items that "
                             "have fewer")
    parser.add_argument("--items-per-rater", type=int, default=0,
                        help="main items per rater queue (0: every item that still needs ratings)")
    parser.add_argument("--check-fraction", type=float, default=0.1,
                        help="check items as a share of main items (at least 2; identical pairs "
                             "expecting a tie, degraded pairs expecting the clean side); 0 "
                             "disables")
    parser.add_argument("--practice", type=int, default=2,
                        help="practice items every rater does first (never counted)")
    parser.add_argument("--check-inputs", nargs="+", type=Path, default=None, metavar="INPUT",
                        help="generation folders or CSV manifests used only for check and "
                             "practice items (their prompts must not be in the study); if "
                             "omitted, that many prompts of the inputs are set aside for them")
    add_margin_arguments(parser)  # declared here, before any vote
    parser.add_argument("--min-check-accuracy", type=float, default=0.7,
                        help="exclusion rule: raters below this check-item accuracy are excluded "
                             "before the headline numbers")
    parser.add_argument("--min-checks", type=int, default=1,
                        help="exclusion rule: only raters with at least this many answered check "
                             "items can be excluded")
    parser.add_argument("--required-checks", type=int, default=2,
                        help="exclusion rule: raters who answered fewer check items than this are "
                             "excluded (a reported check counts as a wrong answer); each rater's "
                             "queue holds at least this many checks")
    parser.add_argument("--repeat-checks", type=int, default=2,
                        help="main items each rater sees twice, sides swapped (a consistency "
                             "check: opposite answers count as a failed check); 0 disables")
    parser.add_argument("--n-boot", type=int, default=2000,
                        help="bootstrap resamples (of prompts) for the report's intervals")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed for item sampling, check items, prompt sampling and the bootstrap")
    parser.add_argument("--release-after", type=float, default=120.0, metavar="MINUTES",
                        help="give the open items of a rater inactive this long back to the pool "
                             "(0: never); a rater who returns gets back what nobody took")
    parser.add_argument("--min-view", type=float, default=1.0, metavar="PLAYS",
                        help="the server refuses a vote until the pair has been on screen this "
                             "many times its length (0: no minimum)")
    parser.add_argument("--fast-vote-margin", type=float, default=3.0, metavar="SECONDS",
                        help="a vote less than this many seconds after one play-through is fast; "
                             "raters with mostly fast votes are flagged in the report")
    parser.add_argument("--invite-days", type=float, default=30.0, metavar="DAYS",
                        help="invite links stop working this many days after they are made (0: "
                             "never)")
    parser.add_argument("--crowd-raters", type=int, default=0, metavar="N",
                        help="crowd platforms (Prolific, MTurk): make a study link "
                             "/c/CROWD_TOKEN?worker_id=ID that creates one rater per worker id, "
                             "at most N (0: no crowd link)")
    parser.add_argument("--completion-code", default=None,
                        help="code shown to raters who finish (crowd platforms' completion "
                             "code); if omitted, a random one")
    parser.add_argument("--completion-url", default="",
                        help="link shown with the completion code, e.g. "
                             "https://app.prolific.com/submissions/complete?cc=CODE")
    parser.add_argument("--raters", type=int, default=0,
                        help="rater invites to create now (more can be added in the admin view)")
    parser.add_argument("--qp", type=int, default=18,
                        help="x264 quantizer of the served videos (0 lossless … 51), the same for "
                             "every pair; every frame is then padded to one size")
    parser.add_argument("--jobs", type=int, default=None,
                        help="encodes to run at once (default: the number of CPUs)")
    parser.add_argument("--prompt-file", type=Path, default=None,
                        help="prompt list, one per line (e.g. VBench all_dimension.txt); if "
                             "omitted, --write-prompts uses the prompts that fit --model")
    parser.add_argument("--model", default=None,
                        help="with --write-prompts and no --prompt-file: the model the study's clips "
                             "will come from; the embedded tiny model (default) gets held-out "
                             "synthetic captions it was trained to draw, a real Wan model the "
                             "natural-language list assets/prompts.txt")
    parser.add_argument("--sample", type=int, default=None,
                        help="draw this many prompts reproducibly (with --seed)")
    parser.add_argument("--write-prompts", type=Path, default=None,
                        help="only write the --sample'd prompts to this file and exit")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _fail(message: str) -> int:
    print(f"attnqat eval build: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    try:
        if args.write_prompts is not None:
            if args.sample is None:
                return _fail("--write-prompts needs --sample N")
            if args.prompt_file is not None:
                pool = read_prompts(args.prompt_file)
            else:
                from attnqat.prompts import model_prompts, prompt_list_name
                from attnqat.wan import ModelLoadError

                try:
                    pool = model_prompts(args.model)
                except ModelLoadError as exc:
                    return _fail(str(exc))
                print(f"prompts from {prompt_list_name(args.model)}")
            chosen = sample_prompts(pool, args.sample, args.seed)
            args.write_prompts.write_text("\n".join(chosen) + "\n", encoding="utf-8")
            print(f"wrote {len(chosen)} prompts to {args.write_prompts}")
            return 0
        if args.out is None:
            return _fail("--out STUDY_FOLDER is required")
        clips = load_sources(args.inputs)
        check_clips = load_sources(args.check_inputs) if args.check_inputs else None
        if args.sample is not None:
            prompts = list(dict.fromkeys(c.prompt for c in clips))
            if args.prompt_file is not None:
                allowed = set(read_prompts(args.prompt_file))
                prompts = [p for p in prompts if p in allowed]
            keep = set(sample_prompts(prompts, args.sample, args.seed))
            clips = [c for c in clips if c.prompt in keep]
        pairs = parse_pairs(args.pairs, methods_of(clips), args.reference)
        config = StudyConfig(
            name=args.name or args.out.resolve().name, pairs=pairs,
            ratings_per_item=args.ratings_per_item, items_per_rater=args.items_per_rater,
            check_fraction=args.check_fraction, practice_items=args.practice,
            equivalence_margin=args.equivalence_margin, test=args.test, alpha=args.alpha,
            min_prompts=args.min_prompts, min_check_accuracy=args.min_check_accuracy,
            min_checks=args.min_checks, required_checks=args.required_checks,
            repeat_checks=args.repeat_checks,
            n_boot=args.n_boot, seed=args.seed,
            release_after_minutes=args.release_after, min_view_factor=args.min_view,
            fast_vote_margin=args.fast_vote_margin, invite_days=args.invite_days,
            crowd_raters=args.crowd_raters,
            crowd_token=secrets.token_urlsafe(16) if args.crowd_raters else "",
            completion_code=args.completion_code or secrets.token_hex(4).upper(),
            completion_url=args.completion_url)
        if args.raters < 0:
            return _fail("--raters must be 0 or positive")
        if not 0 <= args.qp <= 51:
            return _fail("--qp must be in 0 … 51")
        result = build_study(clips, args.out, config, db_url=args.db, n_raters=args.raters,
                             qp=args.qp, check_clips=check_clips, jobs=args.jobs,
                             progress=not args.quiet)
    except (InputError, MediaError) as exc:
        return _fail(str(exc))
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(result.counts.items()))
    st = result.settings
    print(f"study {result.name!r} in {result.out_dir}: {counts} items; {result.n_videos} "
          f"side-by-side videos ({st.pair_size[0]}x{st.pair_size[1]}, {st.frames} frames at "
          f"{st.fps:g} fps) of {result.video_size} bytes each")
    if config.crowd_raters:
        print(f"crowd link (up to {config.crowd_raters} workers): "
              f"/c/{config.crowd_token}?worker_id=WORKER_ID on the rater app; completion code "
              f"{config.completion_code}")
    for warning in result.warnings:
        print(f"warning: {warning}")
    print(f"database: {result.db_url}")
    if result.invites:
        print(f"{len(result.invites)} rater invites in {result.out_dir / 'invites.csv'} "
              "(links are /r/TOKEN on the rater app)")
    else:
        print("no rater invites yet: use --raters N, or create them in the admin view")
    return 0
