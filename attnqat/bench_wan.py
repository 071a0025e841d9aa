"""``attnqat bench wan``: one full-size Wan 2.1 transformer forward per attention method.

Builds the Wan 2.1 T2V transformer (1.3B or 14B config) with random BF16 weights directly on the GPU
(nothing is downloaded), feeds it random latents, a timestep and random 512-token text embeddings,
and times one forward pass per attention method after warm-up. The attention processor measures the
time spent inside the attention calls (CUDA events), which gives the attention share of a step.

Shapes: 480p is 480×832, 720p is 720×1280; with 81 frames the latent is (16, 21, H/8, W/8), i.e.
32,760 self-attention tokens at 480p and 75,600 at 720p (DESIGN.md §4). ``--config tiny`` runs the
embedded tiny model's transformer shape on any device (used by the CPU tests).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import torch

from . import methods as registry
from .convert import param_dtype
from .family import WAN21_T2V
from .generate import versions
from .tiny import TinyWanConfig, _transformer_config
from .wan import resolve_device, set_method

#: Wan 2.1 text-to-video transformer configs (diffusers' WanTransformer3DModel arguments).
CONFIGS: dict[str, dict[str, Any]] = {
    "1.3b": dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128,
                 in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960,
                 num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6),
    "14b": dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128,
                in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824,
                num_layers=40, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6),
}
RESOLUTIONS = {"480p": (480, 832), "720p": (720, 1280)}
DEFAULT_RESOLUTIONS = {"1.3b": "480p,720p", "14b": "480p", "tiny": "128x128"}
#: the inference methods of the registry (``bf16``, ``nvfp4``, ``sage3``: a training method's forward
#: is the one it deploys as)
BENCH_METHODS = registry.inference()
TEXT_TOKENS = 512


def model_config(name: str) -> dict[str, Any]:
    """The transformer config of ``1.3b``, ``14b`` or ``tiny`` (the embedded model's shape)."""
    if name == "tiny":
        return _transformer_config(TinyWanConfig())
    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; expected 1.3b, 14b or tiny")
    return dict(CONFIGS[name])


def parse_resolution(text: str) -> tuple[str, int, int]:
    """``480p`` / ``720p`` / ``HxW`` → (label, height, width); sizes must be multiples of 16."""
    t = text.strip().lower()
    if t in RESOLUTIONS:
        h, w = RESOLUTIONS[t]
        return t, h, w
    try:
        h_s, w_s = t.split("x")
        h, w = int(h_s), int(w_s)
    except ValueError:
        raise ValueError(f"resolution {text!r} is not 480p, 720p or HxW") from None
    why = WAN21_T2V.side_error(h) or WAN21_T2V.side_error(w)
    if why:
        raise ValueError(f"resolution {text!r}: height and width: {why}")
    return f"{h}x{w}", h, w


def build_random_transformer(config: dict[str, Any], device: torch.device,
                             dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                             home: torch.device | None = None):
    """A ``WanTransformer3DModel`` with random weights, built on the meta device and materialized
    parameter by parameter on ``device``.

    Parameters are ``dtype`` except the modules diffusers keeps in float32. Linear and conv
    weights ~ N(0, 0.02²), biases 0, norm weights 1, modulation tables ~ N(0, 1/dim) — enough to
    keep activations finite through every layer; the values do not matter for timing. They are
    drawn from one generator on ``device`` seeded with ``seed``, in parameter order: the same
    weights for the same seed, config and kind of device.

    ``home``: where the parameters end up (default ``device``). Each is drawn on ``device`` and
    moved there at once, so a model too big for the GPU can be drawn on the GPU (fast) and kept in
    CPU memory (a CPU draw of 14 B values takes minutes) — the GPU holds one parameter at a time.
    The buffers (RoPE tables) are built normally, on the CPU, and moved to ``home``.
    """
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    home = device if home is None else torch.device(home)
    with init_empty_weights():  # parameters on the meta device, buffers (RoPE tables) real
        model = WanTransformer3DModel(**config)
    gen = torch.Generator(device=device).manual_seed(seed)
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    for name, p in list(model.named_parameters()):
        parts = name.split(".")
        dt = param_dtype(model, name, dtype)
        t = torch.empty(p.shape, dtype=dt, device=device)
        if parts[-1] == "bias":
            t.zero_()
        elif parts[-1] == "scale_shift_table":
            t.normal_(0.0, dim ** -0.5, generator=gen)
        elif any("norm" in x for x in parts[:-1]):
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        owner = model.get_submodule(".".join(parts[:-1])) if len(parts) > 1 else model
        setattr(owner, parts[-1], torch.nn.Parameter(t.to(home), requires_grad=False))
    model.to(home)
    model.eval()
    return model


def parameter_bytes(config: dict[str, Any], dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes the parameters of :func:`build_random_transformer`'s model take in ``dtype``
    (counted on the meta device: nothing is allocated)."""
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    with init_empty_weights():
        model = WanTransformer3DModel(**config)
    return sum(p.numel() * torch.empty((), dtype=param_dtype(model, n, dtype)).element_size()
               for n, p in model.named_parameters())


def bench_forward(model, *, height: int, width: int, frames: int, methods: Sequence[str],
                  warmup: int = 1, iters: int = 3, fp4_scope: str = "self", backend: str = "auto",
                  seed: int = 0, log=None) -> list[dict[str, Any]]:
    """Time one transformer forward per method at the given clip size.

    Returns one row per method: forward time (median and all), attention time per forward and its
    share, and the self-attention sequence length.
    """
    dev = next(model.parameters()).device
    dtype = model.dtype
    cfg = model.config
    lat_t, lat_h, lat_w = (frames - 1) // 4 + 1, height // 8, width // 8
    tokens = lat_t * (lat_h // cfg.patch_size[1]) * (lat_w // cfg.patch_size[2])
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(1, cfg.in_channels, lat_t, lat_h, lat_w, generator=gen).to(dev, dtype)
    text = torch.randn(1, TEXT_TOKENS, cfg.text_dim, generator=gen).to(dev, dtype)
    t = torch.tensor([500.0], device=dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    rows = []
    for method in methods:
        proc = set_method(model, method, fp4_scope=fp4_scope, backend=backend)
        with torch.inference_mode():
            for _ in range(warmup):
                model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)
            sync()
            proc.reset_stats()
            times = []
            out = None
            for _ in range(iters):
                sync()
                t0 = time.perf_counter()
                out = model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
                sync()
                times.append(time.perf_counter() - t0)
        stats = proc.stats()
        fwd = statistics.median(times)
        attn = stats["attention_s"] / iters
        row = {"method": method, "height": height, "width": width, "frames": frames,
               "tokens": tokens, "forward_s": fwd, "forward_all_s": times,
               "attention_s": attn, "attention_share": attn / (sum(times) / iters),
               "attention_calls_per_forward": {k: v // iters for k, v in stats["calls"].items()},
               "output_finite": bool(torch.isfinite(out).all()) if out is not None else None}
        rows.append(row)
        if log:
            log(f"{method:>6} {height}x{width}x{frames}: forward {fwd * 1000:.1f} ms, attention "
                f"{attn * 1000:.1f} ms ({row['attention_share']:.0%})")
    base = next((r["forward_s"] for r in rows if r["method"] == "bf16"), None)
    for r in rows:
        r["vs_bf16"] = (r["forward_s"] / base) if base else None
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of :func:`bench_forward` rows."""
    head = (f"{'resolution':>11} {'frames':>6} {'tokens':>7} {'method':>7} {'forward ms':>11} "
            f"{'attention ms':>13} {'attn share':>10} {'vs bf16':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        vs = f"{r['vs_bf16']:.2f}x" if r.get("vs_bf16") else "-"
        lines.append(f"{r['height']:>5}x{r['width']:<5} {r['frames']:>6} {r['tokens']:>7} "
                     f"{r['method']:>7} {r['forward_s'] * 1000:>11.1f} {r['attention_s'] * 1000:>13.1f} "
                     f"{r['attention_share']:>10.0%} {vs:>8}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``attnqat bench wan``."""
    parser.add_argument("--config", choices=("1.3b", "14b", "tiny"), default="1.3b",
                        help="transformer size: Wan 2.1 T2V 1.3B or 14B (GPU), or the embedded tiny "
                             "model's shape (any device)")
    parser.add_argument("--resolutions", default=None,
                        help="comma-separated 480p, 720p or HxW (None: 480p,720p for 1.3b; 480p for "
                             "14b; 128x128 for tiny)")
    parser.add_argument("--frames", type=int, default=None, help="frames, 4k+1 (None: 81; 33 for tiny)")
    parser.add_argument("--methods", default=",".join(BENCH_METHODS),
                        help=f"comma-separated attention methods to time ({', '.join(registry.inference())})")
    parser.add_argument("--fp4-scope", choices=("self", "all"), default="self",
                        help="self: 4-bit self-attention only; all: cross-attention too")
    parser.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto",
                        help="attention implementation (see attnqat.attention)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed forwards per method first")
    parser.add_argument("--iters", type=int, default=3, help="timed forwards per method (median reported)")
    parser.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu (cpu only with --config tiny)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    parser.add_argument("--json", type=Path, default=None,
                        help="write the results here (None: runs/bench_wan_<config>.json)")


def run(args: argparse.Namespace) -> int:
    """Build, time, print the table, write JSON."""
    def fail(msg: str) -> int:
        print(f"attnqat bench wan: error: {msg}", file=sys.stderr)
        return 2

    try:
        dev = resolve_device(args.device)
        res = [parse_resolution(r) for r in (args.resolutions or DEFAULT_RESOLUTIONS[args.config]).split(",") if r.strip()]
    except ValueError as exc:
        return fail(str(exc))
    frames = args.frames if args.frames is not None else (33 if args.config == "tiny" else 81)
    why = WAN21_T2V.frames_error(frames)
    if why:
        return fail(f"--frames: {why}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in registry.inference()]
    if bad or not methods:
        return fail(f"--methods must be some of {', '.join(registry.inference())}, got {args.methods!r}")
    if args.iters < 1 or args.warmup < 0:
        return fail("--iters must be ≥ 1 and --warmup ≥ 0")
    if dev.type != "cuda" and args.config != "tiny":
        return fail(f"the {args.config} config needs a CUDA GPU (random weights are built on it); "
                    "use --config tiny on the CPU")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    config = model_config(args.config)
    t0 = time.perf_counter()
    model = build_random_transformer(config, dev, seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"built the {args.config} transformer ({n_params / 1e9:.2f} B parameters) on {dev} in "
        f"{time.perf_counter() - t0:.1f} s")
    rows = []
    for _label, h, w in res:
        rows += bench_forward(model, height=h, width=w, frames=frames, methods=methods,
                              warmup=args.warmup, iters=args.iters, fp4_scope=args.fp4_scope,
                              backend=args.backend, seed=args.seed, log=log)
    print(format_table(rows))

    result = {"benchmark": "wan_transformer_forward", "config": args.config,
              "transformer_config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()},
              "parameters": n_params, "dtype": "bfloat16", "device": str(dev),
              "fp4_scope": args.fp4_scope, "backend": args.backend, "warmup": args.warmup,
              "iters": args.iters, "text_tokens": TEXT_TOKENS, "versions": versions(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "rows": rows}
    out = args.json or Path("runs") / f"bench_wan_{args.config}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
