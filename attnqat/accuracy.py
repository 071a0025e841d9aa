"""``attnqat bench accuracy``: how far the 4-bit attention methods land from exact attention.

For each input kind (random, outlier-heavy) it runs ``nvfp4`` and ``sage3`` and reports cosine
similarity, relative L1 and RMSE against exact float32 attention of the same inputs (the BF16
method's math, computed in float32 so the reference itself carries no rounding). Numbers are
reported, never asserted: 4-bit attention is not expected to equal BF16.

``--sagebwd`` adds the per-tensor table of the trainable INT8 method (:mod:`attnqat.sagebwd`): P, O,
dS, dQ, dK, dV of its PyTorch reference (the definition; the kernels match it to rounding) against
exact float32 attention and its exact gradients for one random output gradient dO, as cosine
similarity and relative L2 (‖Δ‖/‖exact‖); dQ also without the smoothing correction, the measured
reason for that choice (docs/numerics.md).

Input kinds:
  random    q, k, v ~ N(0, 1)
  outliers  heavy-tailed Student-t (ν = 2, clipped at ±60) for q, k, v, plus a per-channel offset
            on K of 8·N(0, 1), the channel-wise bias real DiT keys show and SageAttention smooths
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

import torch

from . import methods as registry
from .attention import attention
from .metrics import compare
from .reference import exact_attention

KINDS = ("random", "outliers")
#: the 4-bit inference methods of the registry (``nvfp4``, ``sage3``)
DEFAULT_METHODS = tuple(m for m in registry.inference() if registry.get(m).four_bit)


def student_t2(shape, generator: torch.Generator) -> torch.Tensor:
    """Student-t samples with ν = 2: z / sqrt(χ²₂ / 2), where χ²₂ / 2 = −log U is exponential."""
    z = torch.randn(shape, generator=generator)
    u = torch.rand(shape, generator=generator).clamp_min(1e-12)
    return z / torch.sqrt(-torch.log(u))


def make_inputs(kind: str, B: int, S: int, H: int, D: int, seed: int, device, dtype=torch.bfloat16):
    """(q, k, v) in (B, S, H, D) for an input kind of :data:`KINDS`, reproducible from ``seed``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    if kind == "random":
        q, k, v = (torch.randn(B, S, H, D, generator=g) for _ in range(3))
    elif kind == "outliers":
        q, k, v = (student_t2((B, S, H, D), g).clamp(-60, 60) for _ in range(3))
        k = k + 8.0 * torch.randn(1, 1, H, D, generator=g)
    else:
        raise ValueError(f"unknown input kind {kind!r}; expected one of {', '.join(KINDS)}")
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))


def measure(kinds=KINDS, methods=DEFAULT_METHODS, B=1, S=1024, H=4, D=128, seed=0,
            device="cpu", backend="auto") -> list[dict]:
    rows = []
    for kind in kinds:
        q, k, v = make_inputs(kind, B, S, H, D, seed, device)
        exact = exact_attention(*(x.transpose(1, 2) for x in (q, k, v)), D ** -0.5).transpose(1, 2)
        for method in (registry.REFERENCE, *methods):
            t0 = time.perf_counter()
            with torch.no_grad():
                out = attention(q, k, v, method=method, backend=backend)
            if out.is_cuda:
                torch.cuda.synchronize()
            rows.append({"input": kind, "method": method, **compare(out, exact),
                         "seconds": time.perf_counter() - t0})
    return rows


SAGEBWD_TENSORS = ("P", "O", "dS", "dQ", "dK", "dV")


def measure_sagebwd(kinds=KINDS, B=1, S=1024, H=4, D=128, seed=0, device="cpu") -> list[dict]:
    """Per-tensor accuracy of ``sagebwd`` against exact attention (float64 on the same bf16 inputs):
    one row per (input kind, tensor) with cosine and relative L2. P and dS are dense S×S here
    (small shapes only)."""
    from . import sagebwd as sb  # noqa: PLC0415

    rows = []
    for kind in kinds:
        q, k, v = make_inputs(kind, B, S, H, D, seed, device)
        g = torch.Generator(device="cpu").manual_seed(seed + 1)
        do = torch.randn(B, S, H, D, generator=g).to(device=device, dtype=q.dtype)
        scale = D ** -0.5
        # exact, float64, (B, H, S, ·)
        qd, kd, vd, dod = (x.transpose(1, 2).double() for x in (q, k, v, do))
        p = torch.softmax(qd @ kd.transpose(-1, -2) * scale, -1)
        o = p @ vd
        dp = dod @ vd.transpose(-1, -2)
        ds = p * (dp - (dod * o).sum(-1, keepdim=True))
        exact = {"P": p, "O": o, "dS": ds, "dQ": ds @ kd * scale, "dK": ds.transpose(-1, -2) @ qd * scale,
                 "dV": p.transpose(-1, -2) @ dod}
        col: dict = {}
        fwd = sb.forward(q, k, v, scale, collect=col)
        dq, dk, dv = sb.backward(fwd, q, k, v, do, scale, collect=col)
        dq_nc = sb.backward(fwd, q, k, v, do, scale, smoothing_correction=False)[0]
        got = {"P": col["p"], "O": fwd.o, "dS": col["ds"], "dQ": dq.transpose(1, 2), "dK": dk.transpose(1, 2),
               "dV": dv.transpose(1, 2), "dQ (no smoothing correction)": dq_nc.transpose(1, 2)}
        for name, x in got.items():
            ref = exact[name.split(" ")[0]]
            c = compare(x, ref)
            rel_l2 = ((x.double() - ref).norm() / ref.norm()).item()
            rows.append({"input": kind, "tensor": name, "cosine": c["cosine"], "rel_l2": rel_l2})
    return rows


def format_sagebwd_table(rows: list[dict]) -> str:
    head = f"{'input':<9} {'tensor':<29} {'cosine':>9} {'rel L2':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['input']:<9} {r['tensor']:<29} {r['cosine']:>9.5f} {r['rel_l2']:>9.4f}")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    head = f"{'input':<9} {'method':<7} {'cosine':>9} {'rel L1':>9} {'RMSE':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['input']:<9} {r['method']:<7} {r['cosine']:>9.5f} {r['rel_l1']:>9.4f} {r['rmse']:>10.3e}")
    return "\n".join(lines)


def default_json() -> Path:
    return Path("runs") / "bench_accuracy.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq", type=int, default=1024, help="sequence length (queries = keys), at least 1")
    parser.add_argument("--heads", type=int, default=4, help="number of heads, at least 1")
    parser.add_argument("--head-dim", type=int, default=128,
                        help="head dimension, a positive multiple of 16 (NVFP4 blocks are 16 wide)")
    parser.add_argument("--batch", type=int, default=1, help="batch size, at least 1")
    parser.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help="comma-separated 4-bit methods to compare with bf16 ("
                             f"{', '.join(registry.four_bit())})")
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda if available)")
    parser.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"),
                        help="attention backend for the 4-bit methods")
    parser.add_argument("--sagebwd", action="store_true",
                        help="also the per-tensor accuracy (P, O, dS, dQ, dK, dV) of sagebwd, the trainable "
                             "INT8 method, against exact attention and its gradients (its PyTorch reference; "
                             "dense S×S tensors: keep --seq small)")
    parser.add_argument("--json", metavar="PATH", type=Path, default=None,
                        help=f"write the rows and settings to this JSON file (None: {default_json()})")


def _fail(message: str) -> SystemExit:
    return SystemExit(f"attnqat bench accuracy: error: {message}")


def _check_writable(path: Path) -> None:
    """Refuse an output file that cannot be written, before any work starts: its folder is
    created and the file opened for appending (a file that did not exist is removed again)."""
    if path.is_dir():
        raise _fail(f"--json {path} is a folder; give a file name")
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as exc:
        raise _fail(f"--json {path} cannot be written: {exc.strerror or exc}") from None
    if not existed:
        path.unlink()


def run(args: argparse.Namespace) -> int:
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    four_bit = registry.four_bit()
    bad = [m for m in methods if m not in four_bit]
    if bad or not methods:
        raise _fail(f"not a 4-bit method: {', '.join(bad) or '(none given)'} "
                    f"(expected {', '.join(four_bit[:-1])} or {four_bit[-1]})")
    for name, value in (("--seq", args.seq), ("--heads", args.heads), ("--batch", args.batch)):
        if value < 1:
            raise _fail(f"{name} must be at least 1, got {value}")
    if args.head_dim < 16 or args.head_dim % 16:
        raise _fail(f"--head-dim must be a positive multiple of 16, got {args.head_dim}")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise _fail("--device cuda was asked for, but CUDA is not available here")
    if device != "cpu" and not device.startswith("cuda"):
        raise _fail(f"--device must be cpu, cuda, cuda:N or auto, got {args.device}")
    if args.backend == "triton" and not device.startswith("cuda"):
        raise _fail("--backend triton needs a CUDA GPU (the kernels run on CUDA tensors); use "
                    "--backend auto or torch")
    out = args.json or default_json()
    _check_writable(out)
    rows = measure(methods=methods, B=args.batch, S=args.seq, H=args.heads, D=args.head_dim,
                   seed=args.seed, device=device, backend=args.backend)
    settings = {"batch": args.batch, "seq": args.seq, "heads": args.heads, "head_dim": args.head_dim,
                "seed": args.seed, "device": device, "backend": args.backend, "dtype": "bfloat16",
                "reference": "exact float32 attention", "date": date.today().isoformat(),
                "torch": torch.__version__, "machine": platform.machine(),
                "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None}
    print(f"B={args.batch} S={args.seq} H={args.heads} D={args.head_dim}, inputs bf16, device {device}; "
          "against exact float32 attention")
    print(format_table(rows))
    result = {"settings": settings, "rows": rows}
    if args.sagebwd:
        srows = measure_sagebwd(B=args.batch, S=args.seq, H=args.heads, D=args.head_dim, seed=args.seed,
                                device=device)
        print("\nsagebwd (INT8, PyTorch reference) per tensor, against exact attention and its gradients "
              "(one random dO):")
        print(format_sagebwd_table(srows))
        result["sagebwd_tensors"] = srows
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
