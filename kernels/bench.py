"""``attnqat bench kernels``: time every attention method and PyTorch SDPA at the Wan 2.1 shapes.

Prints one table (ms, TFLOP/s, peak memory) per run and writes JSON. FLOPs are counted as
4·B·H·Sq·Skv·D for a forward and 3.5 times that for forward+backward; every timing includes the
quantization of BF16 inputs. ``--variants`` times the kernel variants the design was chosen from
(tile shapes, the cost of each part of the P quantizer, the three operand formulations) and the
quantize kernel's bandwidth against a device-to-device copy. ``--sass ARCH`` compiles the forward
kernel's variants for a GPU architecture on any machine and counts their instructions
(:mod:`attnqat.kernels.sass`).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from .api import METHODS as KERNEL_METHODS
from .api import TRAINABLE as KERNEL_TRAINABLE

WAN_SHAPES = {
    "wan1.3b-480p": dict(B=1, H=12, Sq=32760, Skv=32760, D=128),
    "wan14b-480p": dict(B=1, H=40, Sq=32760, Skv=32760, D=128),
    "wan1.3b-720p": dict(B=1, H=12, Sq=75600, Skv=75600, D=128),
    "wan-cross": dict(B=1, H=12, Sq=32760, Skv=512, D=128),
}
SDPA = ("sdpa-cudnn", "sdpa-flash")
_SCHEDULES = ("", "-triton", "-gluon")
#: kernels with one schedule (no ``-triton``/``-gluon`` variants): ``sagebwd``, the INT8 trainable
#: attention (:mod:`.sagebwd`, Triton only)
SINGLE_SCHEDULE = ("sagebwd",)
METHODS = SDPA + tuple(f"{m}{s}" for m in KERNEL_METHODS for s in _SCHEDULES) + SINGLE_SCHEDULE
# The kernels' methods (``nvfp4``, ``attnqat``, ...: :data:`.api.METHODS`) are what ``backend="auto"``
# runs (the Gluon kernels on Hopper where they measured faster); ``*-triton`` forces the Triton kernels
# and ``*-gluon`` the Gluon ones (forward and backward), so one run shows what the Gluon schedules buy and
# whether auto's choice at a shape is the faster one. ``published`` (with ``--published-kernel DIR``) is
# the published Attn-QAT Triton training kernel, for scale.
#: methods timed forward + backward too (``dropin`` only so: its forward is attnqat's without O')
BACKWARD_METHODS = SDPA + tuple(f"{m}{s}" for m in KERNEL_TRAINABLE for s in _SCHEDULES) + ("published",) + SINGLE_SCHEDULE
DEFAULT_METHODS = SDPA + KERNEL_METHODS + SINGLE_SCHEDULE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", default=list(WAN_SHAPES), choices=list(WAN_SHAPES),
                        help="shapes to time (B, H, Sq, Skv, D given in the JSON)")
    parser.add_argument("--shape", action="append", default=[], type=parse_shape, metavar="NAME=B,H,SQ,SKV,D",
                        help="a shape of your own, timed after --shapes (repeatable), e.g. d64=1,24,32760,32760,64")
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=list(METHODS),
                        help="methods to time; sdpa-* are PyTorch SDPA in BF16 with one backend; nvfp4, "
                             "sage3, attnqat, dropin are what backend='auto' runs, *-triton the Triton kernels, "
                             "*-gluon the Gluon (Hopper) kernels")
    parser.add_argument("--published-kernel", default=None, metavar="DIR",
                        help="folder holding the published Attn-QAT kernel package (fastvideo_kernel); adds "
                             "its forward and forward+backward as method 'published', for scale")
    parser.add_argument("--no-backward", action="store_true", help="time forwards only")
    parser.add_argument("--profile", action="store_true",
                        help="also record each row's CUDA time per kernel (torch.profiler, mean of 5 calls): "
                             "where a method's time goes, e.g. the attnqat forward and its two backward kernels "
                             "against cuDNN's forward and backward")
    parser.add_argument("--rep-ms", type=float, default=300.0, help="timing budget per measurement (ms)")
    parser.add_argument("--variants", action="store_true",
                        help="also time the kernel variants and the quantize kernel's bandwidth")
    parser.add_argument("--quantize-sweep", action="store_true",
                        help="only sweep the packed quantize kernel's tiles (each checked bit-identical "
                             "to the default) and report bandwidth against a device copy")
    parser.add_argument("--sass", type=int, default=None, metavar="ARCH",
                        help="only compile the forward kernel's variants and the backward's dK/dV kernel "
                             "for sm_ARCH (90: Hopper, 100: Blackwell; on 90 also the Gluon forwards) and "
                             "print their machine-code instruction counts; needs no GPU")
    parser.add_argument("--json", default=None, help="write the results here")


# ----------------------------------------------------------------------------------------------
# Timing helpers
# ----------------------------------------------------------------------------------------------

def _bench(fn, rep_ms: float) -> float:
    """Median milliseconds of ``fn()`` (CUDA events, after warm-up)."""
    import triton.testing  # noqa: PLC0415

    return float(triton.testing.do_bench(fn, warmup=max(25, rep_ms / 4), rep=rep_ms, return_mode="median"))


def _peak_bytes(fn) -> int:
    """Peak device memory allocated while ``fn()`` runs, above what was allocated before."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - base)


def parse_shape(text: str) -> tuple[str, dict]:
    """``NAME=B,H,SQ,SKV,D`` (``--shape``) → (NAME, {B, H, Sq, Skv, D})."""
    name, sep, dims = text.partition("=")
    parts = dims.split(",")
    if not sep or not name or len(parts) != 5 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=B,H,SQ,SKV,D with five positive integers")
    if name in WAN_SHAPES:
        raise argparse.ArgumentTypeError(f"{name!r} is a built-in shape (--shapes); pick another name")
    return name, dict(zip(("B", "H", "Sq", "Skv", "D"), (int(p) for p in parts)))


def _inputs(B, H, Sq, Skv, D, dtype=torch.bfloat16, grad=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, Skv, H, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, Skv, H, D, device="cuda", dtype=dtype, generator=g)
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def fwd_flops(B, H, Sq, Skv, D) -> float:
    return 4.0 * B * H * Sq * Skv * D


def _sdpa(backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    backend = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION}[backend_name]

    def f(q, k, v):
        with sdpa_kernel(backend):
            o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                 v.transpose(1, 2))
        return o.transpose(1, 2)
    return f


def published_attention(folder):
    """The published Attn-QAT Triton training kernel (FastVideo's ``attn_qat_train``, imported from
    ``folder``, a copy of its source supplied at run time; not part of this project) as a function
    of (B, S, H, D) tensors with the settings of FastVideo's ``ATTN_QAT_TRAIN`` backend: QAT
    forward, fake-quantized P in the backward, high-precision O for D, no smoothing, no global
    scales. Differentiable. Used for scale by the kernel and training benchmarks."""
    import importlib  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    folder = str(Path(folder).resolve())
    if not (Path(folder) / "fastvideo_kernel").is_dir():
        raise FileNotFoundError(f"{folder} holds no fastvideo_kernel package")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    mod = importlib.import_module("fastvideo_kernel.triton_kernels.attn_qat_train")

    def attention(q, k, v, softmax_scale=None):
        scale = softmax_scale or q.shape[-1] ** -0.5
        qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        o = mod.attention(qb, kb, vb, False, scale, True, False, True, True, False, True, True,
                          False, False, False)
        return o.transpose(1, 2)
    return attention


def _method_fn(method: str, published: str | None = None):
    from attnqat import kernels  # noqa: PLC0415  (this package: its entry points, patchable in tests)

    if method.startswith("sdpa"):
        return _sdpa(method)
    if method == "published":
        return published_attention(published)
    if method == "sagebwd":
        return lambda q, k, v: kernels.sagebwd_attention(q, k, v)
    base, _, schedule = method.partition("-")
    return lambda q, k, v: kernels.triton_attention(q, k, v, method=base, schedule=schedule or None)


# ----------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------

def _kernel_times(fn, calls: int = 5) -> dict:
    """{kernel name: mean CUDA milliseconds per call of ``fn``}, largest first (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {e.key: e.self_device_time_total / (1e3 * calls) for e in prof.key_averages()
             if e.self_device_time_total > 0}
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def time_method(method: str, shape: dict, backward: bool, rep_ms: float, published: str | None = None,
                profile: bool = False) -> dict:
    B, H, Sq, Skv, D = (shape[k] for k in ("B", "H", "Sq", "Skv", "D"))
    fn = _method_fn(method, published)
    flops = fwd_flops(B, H, Sq, Skv, D)
    if not backward:
        q, k, v = _inputs(B, H, Sq, Skv, D)
        with torch.no_grad():
            ms = _bench(lambda: fn(q, k, v), rep_ms)
            peak = _peak_bytes(lambda: fn(q, k, v))
            kernels_ms = _kernel_times(lambda: fn(q, k, v)) if profile else None
        del q, k, v
        return dict(pass_="forward", ms=ms, tflops=flops / ms * 1e-9, peak_bytes=peak,
                    **({"kernels_ms": kernels_ms} if profile else {}))
    q, k, v = _inputs(B, H, Sq, Skv, D, grad=True)
    do = torch.randn_like(q)

    def step():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(do)
    ms = _bench(step, rep_ms)
    peak = _peak_bytes(step)
    kernels_ms = _kernel_times(step) if profile else None
    del q, k, v, do
    return dict(pass_="forward+backward", ms=ms, tflops=3.5 * flops / ms * 1e-9, peak_bytes=peak,
                **({"kernels_ms": kernels_ms} if profile else {}))


def run_table(shapes, methods, backward: bool, rep_ms: float, published: str | None = None,
              profile: bool = False) -> list[dict]:
    """One row per (shape, method, pass). ``shapes``: names of :data:`WAN_SHAPES` or (name, dims) pairs."""
    rows = []
    methods = list(methods) + (["published"] if published else [])
    for sname in shapes:
        sname, shape = sname if isinstance(sname, tuple) else (sname, WAN_SHAPES[sname])
        for method in methods:
            passes = [False]
            if backward and method in BACKWARD_METHODS:
                passes.append(True)
            if method.startswith("dropin"):
                passes = [True] if backward else []
            for bw in passes:
                row = dict(shape=sname, **shape, method=method)
                try:
                    row.update(time_method(method, shape, bw, rep_ms, published, profile))
                except Exception as exc:  # report and go on: one failure must not lose the table
                    row.update(pass_="forward+backward" if bw else "forward", error=f"{type(exc).__name__}: {exc}")
                torch.cuda.empty_cache()
                rows.append(row)
                _print_row(row)
    return rows


def _print_row(r: dict) -> None:
    if "error" in r:
        print(f"{r['shape']:14s} {r['method']:12s} {r['pass_']:17s} ERROR {r['error'][:80]}", flush=True)
    else:
        print(f"{r['shape']:14s} {r['method']:12s} {r['pass_']:17s} {r['ms']:9.2f} ms {r['tflops']:7.1f} TFLOP/s "
              f"{r['peak_bytes'] / 2**30:7.2f} GiB", flush=True)
        for name, ms in list(r.get("kernels_ms", {}).items())[:6]:
            print(f"    {ms:9.2f} ms  {name[:90]}", flush=True)


# ----------------------------------------------------------------------------------------------
# Variants (how the design was chosen)
# ----------------------------------------------------------------------------------------------

def _copy_gbps(rep_ms: float) -> float:
    """Device-to-device copy bandwidth (bytes read + written) of a 256 MiB buffer, GB/s."""
    big = torch.empty(256 << 20, device="cuda", dtype=torch.uint8)
    big2 = torch.empty_like(big)
    return 2 * big.numel() / _bench(lambda: big2.copy_(big), rep_ms) * 1e-6


def time_quantize(rep_ms: float) -> list[dict]:
    """Quantize kernel bandwidth (bytes read + written) at the Wan 1.3B shape vs a device copy."""
    from . import quantize as kq  # noqa: PLC0415

    B, S, H, D = 1, 32760, 12, 128
    x = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    copy_bw = _copy_gbps(rep_ms)
    rows = [dict(name="device copy 256 MiB", ms=2 * (256 << 20) / copy_bw * 1e-6, gbps=copy_bw, pct=100.0)]
    cases = [
        ("Q along head_dim -> packed", lambda: kq.quantize_nvfp4(x, -1), 2 * n + n // 2 + n // 16),
        ("V along tokens -> packed", lambda: kq.quantize_nvfp4(x, 1), 2 * n + n // 2 + n // 16),
        ("Q along head_dim -> bf16 values", lambda: kq.fake_quantize_nvfp4(x, -1), 4 * n),
        ("V along tokens -> bf16 values", lambda: kq.fake_quantize_nvfp4(x, 1), 4 * n),
    ]
    for tile in ((32, 128, 4, 1), (64, 128, 8, 1)):
        cases.append((f"Q along head_dim -> bf16, tile {tile}",
                      lambda tile=tile: kq._launch(x, -1, False, torch.bfloat16, tile=tile), 4 * n))
    for tile in ((512, 16, 4, 1), (64, 16, 1, 4), (64, 16, 1, 2), (128, 16, 2, 2)):
        cases.append((f"V along tokens -> packed, tile {tile}",
                      lambda tile=tile: kq._launch(x, 1, True, None, tile=tile), 2 * n + n // 2 + n // 16))
        cases.append((f"V along tokens -> bf16, tile {tile}",
                      lambda tile=tile: kq._launch(x, 1, False, torch.bfloat16, tile=tile), 4 * n))
    for name, fn, nbytes in cases:
        ms = min(_bench(fn, rep_ms), _bench(fn, rep_ms))  # timed twice: the spread is noise
        bw = nbytes / ms * 1e-6
        rows.append(dict(name=name, ms=ms, gbps=bw, pct=100.0 * bw / copy_bw))
    for r in rows:
        print(f"  {r['name']:36s} {r['ms'] * 1e3:8.1f} us {r['gbps']:8.0f} GB/s {r['pct']:6.1f}% of copy", flush=True)
    return rows


def sweep_quantize_tiles(rep_ms: float) -> dict:
    """Every packed-quantize tile (rows, positions, warps, sub-tiles) at the Wan 1.3B shape,
    checked bit-identical to the default tile before it is timed; bandwidth as a share of a copy."""
    import itertools  # noqa: PLC0415

    from . import quantize as kq  # noqa: PLC0415

    x = torch.randn(1, 32760, 12, 128, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    copy_bw = _copy_gbps(rep_ms)
    nbytes = 2 * n + n // 2 + n // 16
    tiles = {1: [(tr, 16, w, s) for tr, w, s in itertools.product((64, 128, 256, 512), (1, 2, 4), (1, 2))],
             -1: [(tr, 128, w, 1) for tr, w in itertools.product((16, 32, 64), (2, 4, 8))]}
    rows, best = [], {}
    for d, cands in tiles.items():
        ref = kq.quantize_nvfp4(x, d)
        for tile in cands:
            _, codes, scales, _ = kq._launch(x, d, True, None, tile=tile)
            same = torch.equal(codes, ref.codes) and torch.equal(scales, ref.scales.view(torch.uint8))
            ms = _bench(lambda tile=tile: kq._launch(x, d, True, None, tile=tile), rep_ms)
            pct = 100.0 * nbytes / ms * 1e-6 / copy_bw
            rows.append(dict(dim=d, tile=list(tile), us=ms * 1e3, pct=pct, identical=same))
            print(f"  dim {d:2d} tile {tile}  {ms * 1e3:7.1f} us  {pct:5.1f}% of copy  identical={same}", flush=True)
            if same and pct > best.get(d, {}).get("pct", 0.0):
                best[d] = dict(tile=list(tile), pct=pct)
    print(f"  best: {best}  (copy {copy_bw:.0f} GB/s)", flush=True)
    return dict(copy_gbps=copy_bw, rows=rows, best=best)


def time_variants(rep_ms: float, shape: dict | None = None) -> list[dict]:
    """Forward variants at one shape: plain online softmax (no P quantizer), each part of the P
    quantizer alone, the full quantizer, tile configurations and the three operand formulations."""
    from . import attention_fwd as F  # noqa: PLC0415
    from . import quantize as kq  # noqa: PLC0415

    shape = shape or WAN_SHAPES["wan1.3b-480p"]
    B, H, Sq, Skv, D = (shape[k] for k in ("B", "H", "Sq", "Skv", "D"))
    q, k, v = _inputs(B, H, Sq, Skv, D)
    qf, kf, vf = kq.fake_quantize_nvfp4(q, -1), kq.fake_quantize_nvfp4(k, -1), kq.fake_quantize_nvfp4(v, 1)
    packed = (kq.quantize_nvfp4(q, -1), kq.quantize_nvfp4(k, -1), kq.quantize_nvfp4(v, 1))
    from .sage3 import sage3_prepare  # noqa: PLC0415
    bias = sage3_prepare(q, k, v)[3]
    parts = sage3_prepare(q, k, v, bias_parts=True)[3]
    prep_ms = _bench(lambda: sage3_prepare(q, k, v), rep_ms / 3)
    print(f"  {'sage3 preparation (means, bias, quantize)':48s} {prep_ms:8.2f} ms", flush=True)
    flops = fwd_flops(B, H, Sq, Skv, D)
    scale = D ** -0.5
    rows = []
    s2, s3 = dict(BM=128, num_warps=8, num_stages=2), dict(BM=128, num_warps=8, num_stages=3)
    from .gluon_fwd import gluon_attention_forward  # noqa: PLC0415
    from .gluon_fwd_qat import gluon_attnqat_forward  # noqa: PLC0415

    def fwd(**kw):
        return lambda: F.attention_forward(qf, kf, vf, sm_scale=scale, **kw)

    cases = [
        ("no P quantizer           BM128/w8/s3", fwd(p_mode=F.P_NONE, config=s3)),
        ("block max + scale only   BM128/w8/s3", fwd(p_mode=F.P_AMAX_ONLY, config=s3)),
        ("element rounding only    BM128/w8/s3", fwd(p_mode=F.P_ROUND_ONLY, config=s3)),
        ("nvfp4                    BM128/w8/s2", fwd(p_mode=F.P_NVFP4, config=s2)),
        ("nvfp4                    BM128/w8/s3", fwd(p_mode=F.P_NVFP4, config=s3), True),
        ("nvfp4 + O' + stats       BM128/w8/s3", fwd(p_mode=F.P_NVFP4, need_o2=True, store_stats=True,
                                                  config=s3), True),
        ("sage3 P quantizer        BM128/w8/s3", fwd(p_mode=F.P_SAGE3, config=s3)),
        ("sage3 P quantizer + bias BM128/w8/s3", fwd(p_mode=F.P_SAGE3, config=s3, bias=bias)),
        ("packed, dequant in regs  BM128/w8/s3", fwd(p_mode=F.P_NVFP4, packed=packed, formulation=1,
                                                  config=s3), True),
        # Triton's warp specialization of the key loop (a compile error is reported as the row)
        ("nvfp4 warp-specialized   BM128/w8/s3", fwd(p_mode=F.P_NVFP4, config=dict(s3, WARP_SPEC=True)), True),
        ("nvfp4 warp-specialized   BM128/w4/s3", fwd(p_mode=F.P_NVFP4, config=dict(s3, num_warps=4,
                                                                                WARP_SPEC=True)), True),
        ("nvfp4 + O' + stats, w-s  BM128/w8/s3", fwd(p_mode=F.P_NVFP4, need_o2=True, store_stats=True,
                                                  config=dict(s3, WARP_SPEC=True)), True),
        # the hand-scheduled Gluon forward (producer warp, two ping-pong consumer warpgroups; Hopper)
        ("gluon nvfp4 ping-pong    BM128/2 WG/s2",
         lambda: (gluon_attention_forward(qf, kf, vf, sm_scale=scale),), True),
        ("gluon nvfp4 ping-pong    BM128/2 WG/s3",
         lambda: (gluon_attention_forward(qf, kf, vf, sm_scale=scale, config=dict(STAGES=3)),), True),
        ("gluon attnqat fwd + O'   BM128/2 WG/s2",
         lambda: gluon_attnqat_forward(qf, kf, vf, sm_scale=scale), True),
        # sage3 on sage3_prepare's operands (the preparation is timed above)
        ("gluon sage3 ping-pong    BM128/2 WG/s2",
         lambda: (gluon_attention_forward(qf, kf, vf, sm_scale=scale, p_mode=F.P_SAGE3, bias=parts),)),
    ]
    from attnqat import reference as ref  # noqa: PLC0415
    for case in cases:
        name, fn, check = case[0], case[1], len(case) > 2
        row = dict(name=name.strip())
        try:
            o = fn()[0]
            ms = _bench(fn, rep_ms)
            row.update(ms=ms, tflops=flops / ms * 1e-9)
            if check:
                # correctness at this size: 256 query rows of head 0 against the chunked reference
                qs = slice(0, 256)
                f = ref.fp4_forward(q[:, qs, :1].transpose(1, 2).float(), k[:, :, :1].transpose(1, 2).float(),
                                    v[:, :, :1].transpose(1, 2).float(), scale, "nvfp4")
                err = (o[:, qs, :1].float() - f.o.transpose(1, 2)).norm() / f.o.norm()
                row["rel_err"] = float(err)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
        if "error" in row:
            print(f"  {row['name']:48s} ERROR {row['error'][:120]}", flush=True)
        else:
            extra = f"  rel.err {row['rel_err']:.2e}" if "rel_err" in row else ""
            print(f"  {row['name']:48s} {row['ms']:8.2f} ms {row['tflops']:7.1f} TFLOP/s{extra}", flush=True)
        torch.cuda.empty_cache()
    return rows


def time_backward_variants(rep_ms: float, shape: dict | None = None) -> list[dict]:
    """The attnqat backward alone (D, dK/dV, dQ launches) under several tile configurations, and
    the dropin backward (no P quantizer) for what the quantizer costs."""
    from . import attention_bwd as Bw  # noqa: PLC0415
    from . import attention_fwd as F  # noqa: PLC0415
    from . import quantize as kq  # noqa: PLC0415

    shape = shape or WAN_SHAPES["wan1.3b-480p"]
    B, H, Sq, Skv, D = (shape[k] for k in ("B", "H", "Sq", "Skv", "D"))
    q, k, v = _inputs(B, H, Sq, Skv, D)
    qf, kf, vf = kq.fake_quantize_nvfp4(q, -1), kq.fake_quantize_nvfp4(k, -1), kq.fake_quantize_nvfp4(v, 1)
    _, o2, lse2, m2 = F.attention_forward(qf, kf, vf, sm_scale=D ** -0.5, need_o2=True, store_stats=True)
    do = torch.randn_like(q)
    flops = 2.5 * fwd_flops(B, H, Sq, Skv, D)
    rows = []
    dkdv = [dict(BM=64, BN=128, num_warps=8, num_stages=1, NATURAL=False),
            dict(BM=64, BN=128, num_warps=8, num_stages=2, NATURAL=False)]
    dq = [dict(BM=128, BN=64, num_warps=8, num_stages=2), dict(BM=64, BN=128, num_warps=4, num_stages=2)]
    # the untransposed dK/dV tile (S [queries, keys]: the forward's quantizer; Pᶠ and dS as
    # shared-memory operands): attnqat's default is 64 × 64 on 4 warps
    natural = dict(BM=64, BN=64, num_warps=4, num_stages=1, NATURAL=True)
    dkdv += [dict(BM=128, BN=64, num_warps=8, num_stages=1, NATURAL=True),
             dict(BM=64, BN=64, num_warps=4, num_stages=2, NATURAL=True)]
    # the default dK/dV and dQ kernels are the Gluon ones on Hopper (dQ: at D = 128); a "dkdv" or
    # "dq" override selects the Triton kernel
    cases = [("attnqat default (Gluon dK/dV and dQ on Hopper)", True, None),
             ("attnqat Triton dK/dV, default tiles", True, dict(dkdv={})),
             ("attnqat Gluon dK/dV, 3-slot ring", True, dict(gluon=dict(STAGES=3))),
             ("attnqat Gluon dK/dV, Triton dQ", True, dict(dq={})),
             ("attnqat Gluon dQ, 3-slot ring", True, dict(gluon_dq=dict(STAGES=3)))]
    cases += [(f"dkdv {c}", True, dict(dkdv=c)) for c in dkdv] + [(f"dq {c}", True, dict(dq=c)) for c in dq]
    cases += [("dropin (no P quantizer) default", False, None),
              ("dropin (no P quantizer) Triton dK/dV", False, dict(dkdv={})),
              ("dropin (no P quantizer), dkdv untransposed 64x64", False, dict(dkdv=natural))]
    for name, quant_p, cfg in cases:
        row = dict(name=name)
        # attnqat recomputes from the quantized operands and quantizes P; dropin from the inputs
        ops = (qf, kf, vf, o2, do, lse2, m2) if quant_p else (q, k, v, o2, do, lse2, None)
        try:
            fn = lambda ops=ops, quant_p=quant_p, cfg=cfg: Bw.attention_backward(  # noqa: E731
                *ops, sm_scale=D ** -0.5, quant_p=quant_p, config=cfg)
            ms = _bench(fn, rep_ms)
            row.update(ms=ms, tflops=flops / ms * 1e-9)
            print(f"  {name:72s} {ms:8.2f} ms {row['tflops']:7.1f} TFLOP/s (2.5x fwd flops)", flush=True)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"  {name:72s} ERROR {row['error'][:120]}", flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def _versions() -> dict:
    import triton  # noqa: PLC0415

    return dict(torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()))


def run(args: argparse.Namespace) -> int:
    if args.sass is not None:
        from . import sass  # noqa: PLC0415

        rows = sass.table(args.sass)
        sass.print_table(rows)
        dkdv = sass.dkdv_table(args.sass)
        sass.print_table(dkdv)
        gluon = sass.gluon_report(args.sass) if args.sass == 90 else None   # the Gluon kernel is Hopper's
        if gluon is not None:
            sass.print_gluon(gluon)
        if args.json:
            import triton  # noqa: PLC0415

            with open(args.json, "w") as fh:
                json.dump(dict(date=time.strftime("%Y-%m-%d"), triton=triton.__version__, rows=rows,
                               dkdv=dkdv, gluon=gluon), fh, indent=1)
        return 0
    names = [name for name, _ in args.shape]
    if len(set(names)) < len(names):
        print(f"attnqat bench kernels: --shape names must differ, got {names}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("attnqat bench kernels: needs a CUDA GPU (none is visible)", file=sys.stderr)
        return 2
    result = dict(date=time.strftime("%Y-%m-%d"), command=" ".join(["attnqat"] + sys.argv[1:]),
                  versions=_versions(), flops="4*B*H*Sq*Skv*D forward; 3.5x for forward+backward",
                  shapes={**{k: WAN_SHAPES[k] for k in args.shapes}, **dict(args.shape)})
    print(f"# {result['versions']['gpu']}  torch {torch.__version__}  triton {result['versions']['triton']}", flush=True)
    if args.quantize_sweep:
        result["quantize_sweep"] = sweep_quantize_tiles(30.0)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=1)
        return 0
    if args.variants:
        print("## quantize kernel", flush=True)
        result["quantize"] = time_quantize(args.rep_ms / 3)
        print("## forward variants (wan1.3b-480p)", flush=True)
        result["variants"] = time_variants(args.rep_ms)
        print("## backward variants (wan1.3b-480p)", flush=True)
        result["backward_variants"] = time_backward_variants(args.rep_ms)
    print("## methods", flush=True)
    result["rows"] = run_table(list(args.shapes) + list(args.shape), args.methods, not args.no_backward, args.rep_ms,
                               args.published_kernel, args.profile)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    print("\n| shape | method | pass | ms | TFLOP/s | peak GiB |\n|---|---|---|---|---|---|")
    for r in result["rows"]:
        if "error" in r:
            print(f"| {r['shape']} | {r['method']} | {r['pass_']} | error | | |")
        else:
            print(f"| {r['shape']} | {r['method']} | {r['pass_']} | {r['ms']:.2f} | {r['tflops']:.0f} | "
                  f"{r['peak_bytes'] / 2**30:.2f} |")
    return 0


if __name__ == "__main__":  # pragma: no cover
    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(run(p.parse_args()))
