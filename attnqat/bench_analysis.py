"""What the app's analyses cost at real Wan size: ``python -m attnqat.bench_analysis``.

Builds the Wan 2.1 1.3B transformer with random weights on the GPU
(:func:`attnqat.bench_wan.build_random_transformer`; no weights are downloaded) and times, at
480×832 with 81 frames (32,760 self-attention tokens, 512 text tokens):

* one transformer forward per method with ``backend="auto"`` — a seed sweep's denoising step is
  two of them per method (classifier-free guidance), so a sweep costs
  seeds × steps × 2 × this per method, plus the text encoding and one VAE decode per clip;
* the same forward of each 4-bit method with the attention-error map's observer on
  (:class:`attnqat.error_map.ErrorMapObserver`: one BF16 attention and two norms per call);
* the receipts: what each method's calls actually ran (:func:`attnqat.attention.dispatch_log`).

Prints a table last and writes ``--json``. Random weights: the times are real, the error values
only show that the map is finite at this size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from . import methods as registry
from .bench_wan import TEXT_TOKENS, build_random_transformer, model_config
from .error_map import ErrorMapObserver, summarize
from .wan import set_method

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnqat.bench_analysis", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=("1.3b", "14b", "tiny"), default="1.3b")
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--methods", default=",".join(m for m in registry.generation()
                                                 if not registry.uses_finetuned(m)),
                   help="comma-separated methods (default: those the base weights generate with)")
    p.add_argument("--iters", type=int, default=2, help="timed forwards per case (after 1 warm-up)")
    p.add_argument("--json", default="bench_analysis.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and args.config != "tiny":
        print("bench_analysis: error: the 1.3b/14b configs need a CUDA GPU", file=sys.stderr)
        return 2

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    model = build_random_transformer(model_config(args.config), dev)
    cfg = model.config
    print(f"built {args.config} on {dev} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    lat_t, lat_h, lat_w = (args.frames - 1) // 4 + 1, args.height // 8, args.width // 8
    tokens = lat_t * (lat_h // cfg.patch_size[1]) * (lat_w // cfg.patch_size[2])
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, cfg.in_channels, lat_t, lat_h, lat_w, generator=gen).to(dev, model.dtype)
    text = torch.randn(1, TEXT_TOKENS, cfg.text_dim, generator=gen).to(dev, model.dtype)
    ts = torch.tensor([500.0], device=dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def forward_times(n: int) -> list[float]:
        out = []
        for _ in range(n):
            sync()
            t1 = time.perf_counter()
            model(hidden_states=x, timestep=ts, encoder_hidden_states=text, return_dict=False)
            sync()
            out.append(time.perf_counter() - t1)
        return out

    rows, maps = [], {}
    with torch.inference_mode():
        for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
            proc = set_method(model, method, fp4_scope="self", backend="auto")
            forward_times(1)  # warm-up (kernel compilation)
            proc.reset_stats()
            plain = forward_times(args.iters)
            dispatch = proc.stats()["dispatch"]
            row = {"method": method, "forward_s": statistics.median(plain), "forward_all_s": plain,
                   "dispatch": dispatch}
            if method != registry.REFERENCE:
                obs = ErrorMapObserver(len(model.blocks), args.iters + 1)
                proc.observer = obs
                try:
                    forward_times(1)
                    obs.next_step()
                    mapped = []
                    for _ in range(args.iters):
                        mapped += forward_times(1)
                        obs.next_step()
                finally:
                    proc.observer = None
                row["forward_with_error_map_s"] = statistics.median(mapped)
                row["error_map_overhead"] = row["forward_with_error_map_s"] / row["forward_s"] - 1
                maps[method] = {"rel_error": obs.result(), "layers": obs.layers,
                                "steps": obs.steps}
            rows.append(row)
    summary = summarize(maps)
    for r in rows:
        if r["method"] in summary:
            r["error_map_mean"] = summary[r["method"]]["mean"]
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    result = {"benchmark": "app_analyses", "config": args.config, "gpu": gpu,
              "height": args.height, "width": args.width, "frames": args.frames,
              "tokens": tokens, "text_tokens": TEXT_TOKENS, "torch": torch.__version__,
              "rows": rows}
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{gpu}, Wan {args.config} random weights, {args.width}x{args.height}x{args.frames} "
          f"({tokens} tokens), one transformer forward (a sweep step is 2 per method):")
    print(f"{'method':>6} {'forward':>9} {'+ error map':>12} {'overhead':>9}  what ran (self / cross)")
    for r in rows:
        ran = " / ".join(f"{d['implementation']}{'(' + d['detail'] + ')' if d.get('detail') else ''}"
                         f"{' FELL BACK: ' + d['fallback'] if d.get('fallback') else ''}"
                         for d in r["dispatch"])
        em = r.get("forward_with_error_map_s")
        print(f"{r['method']:>6} {r['forward_s'] * 1000:>7.0f}ms "
              f"{(f'{em * 1000:.0f}ms') if em else '-':>12} "
              f"{(format(r['error_map_overhead'], '+.0%')) if em else '-':>9}  {ran}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
