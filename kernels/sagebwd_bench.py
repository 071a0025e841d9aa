"""Tuning bench of the ``sagebwd`` kernels against cuDNN BF16 SDPA in one process (CUDA only).

    python -m attnqat.kernels.sagebwd_bench [--variants [--gluon-only] [--pick]] [--profile] [--clocks] [--json PATH]

Times, at the Wan 2.1 1.3B 480p shape (B=1, H=12, S=32,760, D=128; random BF16 inputs): cuDNN's
forward and forward+backward, then sagebwd's (quantization included), each twice (the spread is
the noise), and prints the ratios. ``--profile``: CUDA time per kernel (torch.profiler), and each
Gluon backward launch timed alone (:data:`LAUNCH_VARIANTS`). ``--clocks``: the SM clock, board power
and throttle reasons nvidia-smi reports while each cuDNN and sagebwd timing runs (:mod:`.clocks`;
on an H200 both run at the power cap, at different clocks: docs/benchmarks.md).
``--variants``: the forward's two schedules, the tile configurations (warps, pipeline stages,
forward query tile) of each kernel,
and dQ from stored dS codes (``dq: stored``), each checked against the default's output before it
is timed (the backward rows time the whole backward), and the Gluon backward's launch options
(``bwd`` rows; ``--gluon-only``: those alone, without the Triton kernels' tiles). ``--pick``: then
the combinations of the fastest rows (the split's best dV and dK launch options with the best recomputing dQ; with the best
stored-dS dQ), each checked and timed the same way, and the fastest forward and backward overall as
``best`` in the JSON (``docs/benchmarks/sagebwd_floors.py`` times the floors with them). The rows
that go into docs/benchmarks.md come from ``attnqat bench kernels``; this is how the defaults are
chosen.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

from .bench import _bench, _kernel_times, _sdpa, fwd_flops
from . import clocks as kc
from . import sagebwd as ks

SHAPE = dict(B=1, H=12, S=32760, D=128)


def _inputs(seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    B, H, S, D = SHAPE["B"], SHAPE["H"], SHAPE["S"], SHAPE["D"]
    return [torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]


#: a variant row counts for --pick only this close to the default's output (relative L2; the
#: variants are bit-identical but for stored dS's row sums, added in another order, and the two
#: schedules' dQ: their exponentials are compiled apart, so a dS code moves by one now and then,
#: 2e-4 on an H200)
PICK_TOLERANCE = 5e-3


def backward_config(key: str, cfg: dict) -> dict:
    """The backward ``config`` a variant row timed: its Triton kernel's options, or all of them (the
    Triton schedule), or a whole backward configuration (``bwd``)."""
    if key == "bwd":   # a whole backward configuration (the schedule, Gluon launch options)
        return cfg
    return {"schedule": "triton", **(cfg if key in ("dkdv+dq", "combo") else {key: cfg})}


def _fastest(rows, pred):
    ok = [r for r in rows if "ms" in r and r["err_vs_default"] <= PICK_TOLERANCE and pred(r)]
    return min(ok, key=lambda r: min(r["ms"])) if ok else None


def combinations(rows) -> list[dict]:
    """Backward configurations made of the fastest variant rows' options, not timed yet: the split
    with its best dV and dK launch options and the best recomputing dQ; and the same dV launch
    options with the best split stored-dS row (the dV launch stores nothing)."""
    default = _fastest(rows, lambda r: r["kernel"] == "dq" and r["config"] == {})
    if default is None:
        return []
    t0 = min(default["ms"])
    launch = {}
    for part in ("dv", "dk"):
        r = _fastest(rows, lambda r, p=part: r["kernel"] == "dkdv" and p in r["config"])
        if r is not None and min(r["ms"]) < t0:
            launch[part] = r["config"][part]
    dq = _fastest(rows, lambda r: r["kernel"] == "dq")
    out = [{"dkdv": {"split": True, **launch}, "dq": dq["config"]}]
    stored = _fastest(rows, lambda r: r["kernel"] == "dkdv+dq" and r["config"]["dkdv"].get("split"))
    if stored is not None and "dv" in launch:
        cfg = copy.deepcopy(stored["config"])
        cfg["dkdv"]["dv"] = launch["dv"]
        out.append(cfg)
    return [c for c in out if all(c != r.get("config") for r in rows)]


def pick(rows) -> dict:
    """The fastest forward and backward rows' configurations, as one ``sagebwd_attention`` config
    (``{}`` where the default was fastest or nothing was timed)."""
    fwd = _fastest(rows, lambda r: r["kernel"] == "fwd")
    bwd = _fastest(rows, lambda r: r["kernel"] != "fwd")
    best = {"fwd": fwd["config"]} if fwd is not None else {}
    if bwd is not None:
        best.update(backward_config(bwd["kernel"], bwd["config"]))
    return best


#: Gluon launches timed one by one with --profile (kernels/gluon_sagebwd.py): (label, launch, backward
#: options). The stored-dS dQ launch alone reads whatever the buffers hold (a timing, not a result).
LAUNCH_VARIANTS = (
    ("dV", "dv", {}), ("dK", "dk", {"dq": {"stored": False}}), ("dK storing dS", "dk", {}),
    ("dQ from stored dS", "dq", {}), ("dQ recomputing", "dq", {"dq": {"stored": False}}),
)


def _gluon_launch_times(q, k, v, do, rep_ms: float) -> dict:
    """ms of each Gluon backward launch alone (the forward's state and dO's quantization made once),
    for the :data:`LAUNCH_VARIANTS`; {} where the Gluon backward cannot run here."""
    from . import gluon_sagebwd as gs

    if gs.gluon_sagebwd_unsupported(v, do) is not None:
        return {}
    scale = q.shape[-1] ** -0.5
    with torch.no_grad():
        o32, st = ks.forward(q, k, v, scale, training=True)
        _, do8t, sdo, delta = ks.quantize(do, 128, normal=False, transposed=True, o32=o32)
    outs = [torch.empty_like(x) for x in (q, k, v)]
    times = {}
    for label, launch, config in LAUNCH_VARIANTS:
        run = lambda: gs.gluon_backward(v, do, st, do8t, sdo, delta, *outs, scale=scale, config=config,
                                        launches=(launch,))
        times[label] = min(_bench(run, rep_ms) for _ in range(2))
        print(f"gluon launch {label:24s} {times[label]:8.3f} ms", flush=True)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--pick", action="store_true", help="with --variants: time the best rows' "
                    "combinations and record the fastest configuration as 'best'")
    ap.add_argument("--profile", action="store_true", help="CUDA time per kernel, and each Gluon "
                    "backward launch timed alone")
    ap.add_argument("--gluon-only", action="store_true", help="with --variants: leave out the Triton "
                    "kernels' tile variants")
    ap.add_argument("--rep-ms", type=float, default=400.0)
    ap.add_argument("--fwd", action="append", default=[], help="extra forward config as JSON")
    ap.add_argument("--dkdv", action="append", default=[], help="extra dK/dV config as JSON")
    ap.add_argument("--dq", action="append", default=[], help="extra dQ config as JSON")
    ap.add_argument("--clocks", action="store_true", help="sample the SM clock, power and throttle "
                    "reasons (nvidia-smi) while each cuDNN and sagebwd timing runs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    q, k, v, do = _inputs()
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    flops = fwd_flops(SHAPE["B"], SHAPE["H"], SHAPE["S"], SHAPE["S"], SHAPE["D"])
    out = {"shape": SHAPE, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "rows": []}

    def step_of(fn):
        def step():
            for t in (qg, kg, vg):
                t.grad = None
            fn(qg, kg, vg).backward(do)
        return step

    cudnn = _sdpa("sdpa-cudnn")

    def sage(config=None):
        return lambda a, b, c: ks.sagebwd_attention(a, b, c, config=config)

    rows = out["rows"]

    gpu = kc.smi_id() if args.clocks else None

    def timed(fn, seen):
        """_bench(fn), with the clocks while it runs appended to ``seen`` (--clocks)."""
        if gpu is None:
            return _bench(fn, args.rep_ms)
        with kc.ClockSampler(gpu) as clk:
            ms = _bench(fn, args.rep_ms)
        if clk.summary is None:
            print(f"--clocks: {clk.unavailable}", flush=True)
        seen.append(clk.summary)
        return ms

    def record(name, fn, backward=True):
        row = dict(name=name, clocks_fwd=[], clocks_fwdbwd=[])
        with torch.no_grad():
            f = [timed(lambda: fn(q, k, v), row["clocks_fwd"]) for _ in range(2)]
        b = [timed(step_of(fn), row["clocks_fwdbwd"]) for _ in range(2)] if backward else [float("nan")] * 2
        rows.append(dict(row, fwd_ms=f, fwdbwd_ms=b))
        print(f"{name:44s} fwd {min(f):8.3f} ms ({f[0]:.3f}/{f[1]:.3f})  fwd+bwd {min(b):8.3f} ms "
              f"({b[0]:.3f}/{b[1]:.3f})", flush=True)
        for key in ("clocks_fwd", "clocks_fwdbwd") if gpu is not None else ():
            print(f"    {key[7:]:8s} " + " | ".join(kc.describe(x) for x in row[key]), flush=True)

    record("cudnn", cudnn)
    record("sagebwd default", sage())
    base = {"cudnn": rows[0], "sage": rows[1]}

    if args.profile:
        out["gluon_launches"] = _gluon_launch_times(q, k, v, do, args.rep_ms)
        with torch.no_grad():
            out["profile_fwd"] = _kernel_times(lambda: sage()(q, k, v))
        out["profile_fwdbwd"] = _kernel_times(step_of(sage()))
        out["profile_cudnn_fwdbwd"] = _kernel_times(step_of(cudnn))
        for key in ("profile_fwd", "profile_fwdbwd", "profile_cudnn_fwdbwd"):
            print(key)
            for name, ms in list(out[key].items())[:8]:
                print(f"    {ms:8.3f} ms  {name[:100]}")

    variants = []
    if args.variants:
        # the defaults, timed as the variants are: forward; the Triton backward; the default backward
        variants += [("fwd", {}), ("dq", {}), ("bwd", {})]
        # the forward's schedules (kernels/gluon_sagebwd_fwd.py): the Triton kernel; Gluon ring depths
        variants += [("fwd", {"schedule": "triton"}), ("fwd", {"gluon": {"STAGES": 2}}),
                     ("fwd", {"gluon": {"STAGES": 3}})]
        # the Gluon launches' options (kernels/gluon_sagebwd.py): ring depths, dQ recomputing instead
        # of from stored dS, the stored codes' chunk size
        for part, opt in (("dv", {"STAGES": 3}), ("dv", {"side_stream": False}), ("dk", {"STAGES": 1}),
                          ("dq", {"stored": False}), ("dq", {"STORED_STAGES": 2}), ("dq", {"chunk_bytes": 16 << 30})):
            variants.append(("bwd", {"schedule": "gluon", "gluon": {part: opt}}))
    if args.variants and not args.gluon_only:
        for bm, w, st in ((128, 8, 3), (128, 8, 4), (64, 4, 2), (64, 4, 4), (64, 8, 3)):
            variants.append(("fwd", dict(BM=bm, num_warps=w, num_stages=st)))
        variants.append(("dkdv", dict(split=False, num_warps=4, num_stages=1)))   # 2 stages: 346 KiB of shared memory
        variants.append(("dkdv", dict(split=False, num_warps=8, num_stages=1)))
        # the split's launches apart (shared memory and spills per launch: kernels/sass.py
        # sagebwd_table): the dV launch fits 2-3 stages, the dK launch 1
        for w, st in ((4, 2), (4, 3), (8, 2)):
            variants.append(("dkdv", dict(split=True, dv=dict(num_warps=w, num_stages=st))))
        variants.append(("dkdv", dict(split=True, dk=dict(num_warps=8, num_stages=1))))
        for w, st in ((8, 2), (8, 4)):
            variants.append(("dq", dict(num_warps=w, num_stages=st)))
        # dQ from the dS codes the dK launch stores (no S, P, dP recomputed for dQ)
        for w, st, dk_w in ((8, 3, 4), (8, 3, 8), (8, 4, 8)):
            variants.append(("dkdv+dq", dict(dkdv=dict(split=True, dk=dict(num_warps=dk_w, num_stages=1)),
                                             dq=dict(stored=True, num_warps=w, num_stages=st))))
        # one pass over the scores: dV, dK and the stored dS from one launch (it spills most)
        variants.append(("dkdv+dq", dict(dkdv=dict(split=False, num_warps=8, num_stages=1),
                                         dq=dict(stored=True, num_warps=8, num_stages=3))))
    for key in ("fwd", "dkdv", "dq"):
        for text in getattr(args, key):
            variants.append((key, json.loads(text)))
    with torch.no_grad():
        o_ref, st_ref = ks.forward(q, k, v, 128 ** -0.5, training=True)
    g_ref = ks.backward(q, k, v, o_ref, do, st_ref, 128 ** -0.5)

    def time_variant(key, cfg):
        name = f"{key} {cfg}"
        try:
            if key == "fwd":
                with torch.no_grad():
                    o, _ = ks.forward(q, k, v, 128 ** -0.5, training=True, config=cfg)
                err = ((o - o_ref).norm() / o_ref.norm()).item()
                with torch.no_grad():
                    f = [_bench(lambda: ks.forward(q, k, v, 128 ** -0.5, training=False, config=cfg), args.rep_ms)
                         for _ in range(2)]
            else:
                bcfg = backward_config(key, cfg)
                g = ks.backward(q, k, v, o_ref, do, st_ref, 128 ** -0.5, config=bcfg)
                err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(g, g_ref))
                f = [_bench(lambda: ks.backward(q, k, v, o_ref, do, st_ref, 128 ** -0.5, config=bcfg),
                            args.rep_ms) for _ in range(2)]
            rows.append(dict(name=name, kernel=key, config=cfg, ms=f, err_vs_default=err))
            print(f"{name:60s} {min(f):8.3f} ms ({f[0]:.3f}/{f[1]:.3f})  err vs default {err:.1e}", flush=True)
        except Exception as exc:  # one failing configuration must not lose the table
            rows.append(dict(name=name, error=f"{type(exc).__name__}: {exc}"[:300]))
            print(f"{name:60s} ERROR {type(exc).__name__}: {str(exc)[:150]}", flush=True)
        torch.cuda.empty_cache()

    for key, cfg in variants:
        time_variant(key, cfg)
    if args.pick:
        for cfg in combinations(rows):
            time_variant("combo", cfg)
        out["best"] = pick(rows)
        print(f"best: {json.dumps(out['best'])}", flush=True)

    c, s = base["cudnn"], base["sage"]
    print("\nsummary (min of two timings), Wan 1.3B 480p B=1 H=12 S=32760 D=128, "
          f"{out['gpu']}, torch {torch.__version__}")
    print(f"  cuDNN   fwd {min(c['fwd_ms']):7.2f} ms ({flops / min(c['fwd_ms']) * 1e-9:5.0f} TFLOP/s)   "
          f"fwd+bwd {min(c['fwdbwd_ms']):7.2f} ms ({3.5 * flops / min(c['fwdbwd_ms']) * 1e-9:5.0f})")
    print(f"  sagebwd fwd {min(s['fwd_ms']):7.2f} ms ({flops / min(s['fwd_ms']) * 1e-9:5.0f} TOPS)      "
          f"fwd+bwd {min(s['fwdbwd_ms']):7.2f} ms ({3.5 * flops / min(s['fwdbwd_ms']) * 1e-9:5.0f})")
    print(f"  ratio   fwd {min(s['fwd_ms']) / min(c['fwd_ms']):.3f}x   fwd+bwd "
          f"{min(s['fwdbwd_ms']) / min(c['fwdbwd_ms']):.3f}x")
    if gpu is not None:   # the second timings (the first one's samples also cover compilation at idle clocks)
        print(f"  second timings: fwd {s['fwd_ms'][1] / c['fwd_ms'][1]:.3f}x   fwd+bwd "
              f"{s['fwdbwd_ms'][1] / c['fwdbwd_ms'][1]:.3f}x, at these clocks:")
        for label, row in (("cuDNN  ", c), ("sagebwd", s)):
            print(f"  clocks {label} fwd: {kc.describe(row['clocks_fwd'][-1])};  "
                  f"fwd+bwd: {kc.describe(row['clocks_fwdbwd'][-1])}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
