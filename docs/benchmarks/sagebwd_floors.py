"""Issue 33's floors timed with the tiles the tuning bench picked (device script, CUDA only).

    python3 -P docs/benchmarks/sagebwd_floors.py BENCH_JSON OUT_DIR [--skip kernels,wan,train]

Reads ``best`` from ``python3 -P -m attnqat.kernels.sagebwd_bench --variants --pick --json
BENCH_JSON``, makes it the ``sagebwd`` kernels' defaults in this process (AUTO_FORWARD_SCHEDULE, FWD_CONFIG,
AUTO_SCHEDULE, DKDV_CONFIG, DQ_CONFIG of attnqat.kernels.sagebwd; CONFIG of
attnqat.kernels.gluon_sagebwd_fwd; DV_CONFIG, DK_CONFIG, DQ_CONFIG of attnqat.kernels.gluon_sagebwd; ``{"best": {}}`` keeps the committed ones) and runs, in the same
process, the three rows of docs/benchmarks.md with cuDNN / BF16 beside sagebwd:

    attnqat bench kernels --shapes wan1.3b-480p --methods sdpa-cudnn sagebwd
    attnqat bench wan --config 1.3b --resolutions 480p --methods bf16,sagebwd
    attnqat bench train --config 1.3b --methods bf16,sagebwd

each writing its JSON into OUT_DIR (kernels.json, wan.json, train.json; best.json: the tiles). The
picked tiles become the committed defaults by hand, after the numbers are read.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from attnqat import cli
from attnqat.kernels import sagebwd as ks

RUNS = {
    "kernels": ["bench", "kernels", "--shapes", "wan1.3b-480p", "--methods", "sdpa-cudnn", "sagebwd", "--profile"],
    "wan": ["bench", "wan", "--config", "1.3b", "--resolutions", "480p", "--methods", "bf16,sagebwd"],
    "train": ["bench", "train", "--config", "1.3b", "--methods", "bf16,sagebwd"],
}


def apply(best: dict) -> None:
    """Make ``best`` (a ``sagebwd_attention`` config) the kernels' defaults in this process: the
    forward's and the backward's schedules and the launch options of either schedule."""
    from attnqat.kernels import gluon_sagebwd as gs
    from attnqat.kernels import gluon_sagebwd_fwd as gf

    fwd = dict(best.get("fwd", {}))
    schedule, gluon = fwd.pop("schedule", None), fwd.pop("gluon", None)
    if schedule or gluon is not None or fwd:   # the options given say which, as in ks.forward
        ks.AUTO_FORWARD_SCHEDULE = schedule or ("gluon" if gluon is not None else "triton")
    gf.CONFIG.update(gluon or {})
    ks.FWD_CONFIG.update(fwd)
    for key, table in (("dkdv", ks.DKDV_CONFIG), ("dq", ks.DQ_CONFIG)):
        table.update(best.get(key, {}))
    if "schedule" in best:
        ks.AUTO_SCHEDULE = best["schedule"]
    for key, table in (("dv", gs.DV_CONFIG), ("dk", gs.DK_CONFIG), ("dq", gs.DQ_CONFIG)):
        table.update(best.get("gluon", {}).get(key, {}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench_json", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--skip", default="", help="comma-separated rows not to run (kernels, wan, train)")
    args = ap.parse_args(argv)
    best = json.loads(args.bench_json.read_text()).get("best")
    if best is None:
        print(f"{args.bench_json} has no 'best': run sagebwd_bench with --variants --pick", file=sys.stderr)
        return 2
    apply(best)
    from attnqat.kernels import gluon_sagebwd as gs
    from attnqat.kernels import gluon_sagebwd_fwd as gf
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "best.json").write_text(json.dumps(
        dict(best=best, fwd_schedule=ks.AUTO_FORWARD_SCHEDULE, fwd=ks.FWD_CONFIG, gluon_fwd=gf.CONFIG,
             schedule=ks.AUTO_SCHEDULE, dkdv=ks.DKDV_CONFIG, dq=ks.DQ_CONFIG,
             gluon=dict(dv=gs.DV_CONFIG, dk=gs.DK_CONFIG, dq=gs.DQ_CONFIG)), indent=1) + "\n")
    print(f"sagebwd defaults now: fwd {ks.AUTO_FORWARD_SCHEDULE} {ks.FWD_CONFIG} {gf.CONFIG}  backward schedule {ks.AUTO_SCHEDULE}  dkdv {ks.DKDV_CONFIG}  "
          f"dq {ks.DQ_CONFIG}", flush=True)
    status = 0
    for name, argv_ in RUNS.items():
        if name in args.skip.split(","):
            continue
        t0 = time.time()
        print(f"== attnqat {' '.join(argv_)}", flush=True)
        rc = cli.main([*argv_, "--json", str(args.out / f"{name}.json")])
        print(f"== {name}: status {rc} in {time.time() - t0:.0f} s", flush=True)
        status = status or rc
    return status


if __name__ == "__main__":
    raise SystemExit(main())
