"""``attnqat bench accuracy``: how far the 4-bit attention methods land from exact attention.

For each input kind (random, outlier-heavy) it runs ``nvfp4`` and ``sage3`` and reports cosine
similarity, relative L1 and RMSE against exact float32 attention of the same inputs (the BF16
method's math, computed in float32 so the reference itself carries no rounding). Numbers are
reported, never asserted: 4-bit attention is not expected to equal BF16.

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

import torch

from .attention import attention
from .metrics import compare
from .reference import exact_attention

KINDS = ("random", "outliers")
DEFAULT_METHODS = ("nvfp4", "sage3")


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
        for method in ("bf16", *methods):
            t0 = time.perf_counter()
            with torch.no_grad():
                out = attention(q, k, v, method=method, backend=backend)
            if out.is_cuda:
                torch.cuda.synchronize()
            rows.append({"input": kind, "method": method, **compare(out, exact),
                         "seconds": time.perf_counter() - t0})
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"{'input':<9} {'method':<7} {'cosine':>9} {'rel L1':>9} {'RMSE':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['input']:<9} {r['method']:<7} {r['cosine']:>9.5f} {r['rel_l1']:>9.4f} {r['rmse']:>10.3e}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq", type=int, default=1024, help="sequence length (queries = keys)")
    parser.add_argument("--heads", type=int, default=4, help="number of heads")
    parser.add_argument("--head-dim", type=int, default=128, help="head dimension")
    parser.add_argument("--batch", type=int, default=1, help="batch size")
    parser.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help="comma-separated 4-bit methods to compare with bf16 (nvfp4, sage3)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda if available)")
    parser.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"),
                        help="attention backend for the 4-bit methods")
    parser.add_argument("--json", metavar="PATH", help="also write the rows and settings to this JSON file")


def run(args: argparse.Namespace) -> int:
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    bad = [m for m in methods if m not in ("nvfp4", "sage3", "attnqat", "dropin")]
    if bad:
        raise SystemExit(f"attnqat bench accuracy: not a 4-bit method: {', '.join(bad)} "
                         "(expected nvfp4, sage3, attnqat or dropin)")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("attnqat bench accuracy: --device cuda was asked for, but CUDA is not available here")
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "rows": rows}, f, indent=2)
    return 0
