"""``attnqat bench train``: the time and memory of one fine-tuning step of a full-size Wan 2.1
transformer (random weights), per student attention, through the trainer's own step.

Builds the transformer (1.3B or 14B config, float32 master weights, random values: nothing is
downloaded) on the GPU, wraps it exactly as ``attnqat finetune train`` does (:class:`Trainer`:
FSDP2 per block, bf16 autocast, the attention processor, gradient checkpointing) and times
``--steps`` optimizer steps after ``--warmup`` on random latents and prompt embeddings of the
given clip size (batch 1 per GPU). Runs under ``torchrun`` too: then each GPU holds its shard and
the table is per GPU.

``--published-kernel DIR`` adds a row ``published``: the ``attnqat`` student with its attention
calls sent to the published Attn-QAT Triton training kernel (FastVideo's
``fastvideo_kernel.triton_kernels.attn_qat_train.attention``, imported from ``DIR``, which the
user supplies; nothing of it ships with this project), for scale.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from attnqat import methods as registry
from attnqat import wan
from attnqat.bench_wan import build_random_transformer, model_config, parse_resolution
from attnqat.family import WAN21_T2V
from attnqat.generate import versions

from . import distributed
from .runlog import now
from .train import Trainer, TrainConfig, tokens_per_sample

#: the trainable methods of the registry (the trainer's students)
METHODS = registry.trainable()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", choices=("1.3b", "14b", "tiny"), default="1.3b",
                        help="transformer size (tiny: the embedded model's shape, any device)")
    parser.add_argument("--resolution", default="480p", help="480p, 720p or HxW")
    parser.add_argument("--frames", type=int, default=81, help="frames, 4k+1")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated student attentions ({', '.join(METHODS)})")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per method")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction,
                        default=True, help="recompute each block in the backward")
    parser.add_argument("--offload", action="store_true",
                        help="FSDP2 CPU offload (weights, gradients, optimizer state in CPU memory)")
    parser.add_argument("--optimizer", choices=("adamw", "adamw8bit"), default="adamw",
                        help="the trainer's optimizer (adamw8bit: 8-bit moments)")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="train a LoRA adapter of this rank instead of all weights (0: full)")
    parser.add_argument("--published-kernel", type=Path, default=None,
                        help="folder holding the published fastvideo_kernel package; adds a row")
    parser.add_argument("--device", default="auto", help="auto | cuda | cpu (cpu: --config tiny)")
    parser.add_argument("--sp", type=int, default=1,
                        help="Ulysses sequence parallelism under torchrun: each clip's tokens over "
                             "this many GPUs (attnqat/finetune/mesh.py); 1: data parallel [1]")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")


@contextlib.contextmanager
def _published_attention(folder: Path):
    """Route the processor's ``attnqat`` calls to the published kernel (bench only)."""
    # the kernel benchmark module imports triton: only when the published kernel is asked for
    from attnqat.kernels.bench import published_attention  # noqa: PLC0415

    published = published_attention(folder)
    real = wan.attention

    def routed(q, k, v, method="bf16", softmax_scale=None, backend="auto", **kw):
        if method != "attnqat":
            return real(q, k, v, method=method, softmax_scale=softmax_scale, backend=backend, **kw)
        return published(q, k, v, softmax_scale)

    wan.attention = routed
    try:
        yield
    finally:
        wan.attention = real


def bench_method(method: str, config: dict, ctx, *, height: int, width: int, frames: int,
                 steps: int, warmup: int, checkpointing: bool, published: Path | None = None,
                 offload: bool = False, optimizer: str = "adamw", lora_rank: int = 0
                 ) -> dict[str, Any]:
    """Time the trainer's optimizer step for one student attention; returns one row."""
    student = "attnqat" if method == "published" else method
    cfg = TrainConfig(out="", attention=student, batch_size=1, steps=10**6, lr=1e-6, warmup=0,
                      schedule="constant", weight_decay=0.01, grad_clip=1.0, ema=0.0,
                      caption_dropout=0.1, sigma_sampling="uniform", shift=1.0,
                      gradient_checkpointing=checkpointing, precision="auto", offload=offload,
                      optimizer=optimizer, lora_rank=lora_rank)
    dev = ctx.device
    model = build_random_transformer(config, torch.device("cpu") if offload else dev,
                                     dtype=torch.float32, seed=0)
    lat = (config["in_channels"], (frames - 1) // 4 + 1, height // 8, width // 8)
    gen = torch.Generator(device="cpu").manual_seed(1 + ctx.data_rank)   # an sp group: one clip
    latents = torch.randn(1, *lat, generator=gen).to(dev)
    text = torch.randn(1, 512, config["text_dim"], generator=gen).to(dev)
    trainer = Trainer(cfg, model, ctx, torch.zeros(512, config["text_dim"]))
    routing = _published_attention(published) if method == "published" else contextlib.nullcontext()
    times, losses = [], []

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    with routing:
        for i in range(warmup + steps):
            if i == warmup and dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            sync()
            t0 = time.perf_counter()
            losses.append(float(trainer.micro_step(latents, text, torch.tensor([i * ctx.data_world + ctx.data_rank]))))
            trainer.optimizer_step(i)
            sync()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    import resource

    host_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # GiB, this process
    tokens = tokens_per_sample(config, lat) // ctx.sp   # each GPU of an sp group: 1/sp of the clip
    step = statistics.median(times)
    row = {"method": method, "step_s": step, "step_all_s": times, "peak_memory_gib": peak,
           "tokens_per_step_per_gpu": tokens, "tokens_per_s_per_gpu": tokens / step,
           "losses": losses, "loss_finite": all(map(lambda x: x == x and abs(x) != float("inf"), losses)),
           "parameters": trainer.parameters, "precision": trainer.precision,
           "gradient_checkpointing": checkpointing, "offload": offload, "optimizer": optimizer,
           "lora_rank": lora_rank, "host_peak_rss_gib": host_peak}
    del trainer, model, latents, text
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def format_rows(rows: list[dict], world: int) -> str:
    base = next((r["step_s"] for r in rows if r["method"] == "bf16"), None)
    head = f"{'method':>10} {'step s':>8} {'vs bf16':>8} {'tokens/s/GPU':>13} {'peak GiB/GPU':>13} {'GPUs':>5}"
    lines = [head, "-" * len(head)]
    for r in rows:
        vs = f"{r['step_s'] / base:.2f}x" if base else "-"
        peak = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
        lines.append(f"{r['method']:>10} {r['step_s']:>8.3f} {vs:>8} {r['tokens_per_s_per_gpu']:>13.0f} "
                     f"{peak:>13} {world:>5}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    def fail(msg: str) -> int:
        print(f"attnqat bench train: error: {msg}", file=sys.stderr)
        return 2

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        return fail(f"--methods must be some of {', '.join(METHODS)}, got {args.methods!r}")
    why = WAN21_T2V.frames_error(args.frames)
    if why:
        return fail(f"--frames: {why}")
    if args.steps < 1 or args.warmup < 0:
        return fail("--steps must be >= 1 and --warmup >= 0")
    try:
        _, h, w = parse_resolution(args.resolution)
    except ValueError as exc:
        return fail(str(exc))
    if args.published_kernel is not None:
        if not (args.published_kernel / "fastvideo_kernel").is_dir():
            return fail(f"--published-kernel {args.published_kernel} holds no fastvideo_kernel package")
        methods.append("published")
    from . import mesh

    try:
        ctx = mesh.setup(distributed.init(args.device), args.sp, 1)
    except ValueError as exc:
        distributed.shutdown()
        return fail(str(exc))
    try:
        if ctx.device.type != "cuda" and args.config != "tiny":
            return fail(f"the {args.config} config needs a CUDA GPU; use --config tiny on the CPU")
        config = model_config(args.config)
        rows = []
        for m in methods:
            row = bench_method(m, config, ctx, height=h, width=w, frames=args.frames,
                               steps=args.steps, warmup=args.warmup,
                               checkpointing=args.gradient_checkpointing,
                               published=args.published_kernel, offload=args.offload,
                               optimizer=args.optimizer, lora_rank=args.lora_rank)
            rows.append(row)
            if ctx.is_main:
                print(f"{m}: step {row['step_s']:.3f} s, peak {row['peak_memory_gib']} GiB (host RSS "
                      f"{row['host_peak_rss_gib']:.1f} GiB), losses "
                      f"{[round(x, 4) for x in row['losses']]}", file=sys.stderr, flush=True)
        if ctx.is_main:
            print(format_rows(rows, ctx.world))
            out = {"benchmark": "wan_transformer_training_step", "config": args.config,
                   "height": h, "width": w, "frames": args.frames, "batch_per_gpu": 1,
                   "gpus": ctx.world, "sp": ctx.sp, "warmup": args.warmup, "steps": args.steps,
                   "device": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu",
                   "versions": versions(), "date": now(),
                   "rows": rows}
            if args.json is not None:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(out, indent=1) + "\n")
                print(f"wrote {args.json}")
        return 0
    finally:
        distributed.shutdown()


__all__ = ["METHODS", "add_arguments", "bench_method", "format_rows", "run"]
