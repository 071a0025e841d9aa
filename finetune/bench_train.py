"""``attnqat bench train``: the time and memory of one fine-tuning step of a full-size Wan 2.1
transformer (random weights), per student attention, through the trainer's own step.

Builds the transformer (1.3B or 14B config, float32 master weights, random values: nothing is
downloaded) on the GPU, wraps it exactly as ``attnqat finetune train`` does (:class:`Trainer`:
FSDP2 per block, bf16 autocast, the attention processor, gradient checkpointing; with
``--lora-rank`` the frozen base's linear weights then kept in bfloat16) and times
``--steps`` optimizer steps after ``--warmup`` on random latents and prompt embeddings of the
given clip size (batch 1 per GPU). Runs under ``torchrun`` too: then each GPU holds its shard and
the table is per GPU.

The float32 master weights are drawn on the GPU, also for ``--offload``, where each moves to the
CPU as soon as it is drawn (the 14B model's 14.3 B values take seconds on the GPU and minutes on
the CPU; docs/benchmarks.md, "14B on one GPU"), and the
build, the trainer's set-up (FSDP2, the offload's pinned copies) and every step are logged with
their times. A row that runs out of GPU or host memory ends as one line, ``does not fit: <what ran
out> while <phase>: <the error's first line>``, and a row of the record with ``fits: false`` (exit
status 0: the question was answered); the JSON is rewritten after every row. The host's peak RSS is
given for the whole process and for the timed steps alone.

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
from attnqat.bench_wan import build_random_transformer, model_config, parameter_bytes, parse_resolution
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


GIB = 2**30


def _proc_status_gib(field: str) -> float | None:
    """``VmRSS`` / ``VmHWM`` of this process from /proc (Linux), in GiB; None elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return None


def _reset_host_peak() -> bool:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS (Linux ``clear_refs`` 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _lifetime_host_peak_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB -> GiB


def host_memory_gib() -> dict[str, float | None]:
    """The host's memory (``MemTotal``) and this process's cgroup limit (None: no limit)."""
    total = limit = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    for f in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            v = Path(f).read_text().strip()
        except OSError:
            continue
        if v.isdigit() and int(v) < 2**60:
            limit = int(v) / GIB
        break
    return {"host_memory_gib": total, "cgroup_limit_gib": limit}


def out_of_memory(exc: BaseException) -> str | None:
    """What ran out, when ``exc`` is an out-of-memory error (GPU or host); else None."""
    text = str(exc)
    if isinstance(exc, torch.OutOfMemoryError):
        return "GPU out of memory"
    if isinstance(exc, MemoryError) or "DefaultCPUAllocator" in text or "can't allocate memory" in text:
        return "host out of memory"
    if isinstance(exc, RuntimeError) and "out of memory" in text.lower():
        # cudaHostAlloc (pinned host memory) and the GPU both report "CUDA error: out of memory"
        return "out of memory (GPU or pinned host memory)"
    return None


def _first_line(exc: BaseException, limit: int = 240) -> str:
    line = next((x.strip() for x in str(exc).splitlines() if x.strip()), type(exc).__name__)
    return line if len(line) <= limit else line[:limit - 3] + "..."


def bench_method(method: str, config: dict, ctx, *, height: int, width: int, frames: int,
                 steps: int, warmup: int, checkpointing: bool, published: Path | None = None,
                 offload: bool = False, optimizer: str = "adamw", lora_rank: int = 0,
                 status: dict | None = None, log=None) -> dict[str, Any]:
    """Time the trainer's optimizer step for one student attention; returns one row.

    ``status`` (a dict) receives the phase the row is in (``status["phase"]``) and the build and
    trainer set-up times as they are measured, so a caller that catches an out-of-memory error
    can say where it happened; ``log`` (a callable) gets one line per phase."""
    status = {} if status is None else status
    dev = ctx.device

    def phase(text: str) -> None:
        status["phase"] = text
        if log is not None:
            log(text)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    student = "attnqat" if method == "published" else method
    cfg = TrainConfig(out="", attention=student, batch_size=1, steps=10**6, lr=1e-6, warmup=0,
                      schedule="constant", weight_decay=0.01, grad_clip=1.0, ema=0.0,
                      caption_dropout=0.1, sigma_sampling="uniform", shift=1.0,
                      gradient_checkpointing=checkpointing, precision="auto", offload=offload,
                      optimizer=optimizer, lora_rank=lora_rank)
    # The float32 master weights are drawn on the GPU (a CPU draw of 14 B values takes minutes).
    # Offloaded, the trainer gets them in CPU memory, as `finetune train --offload` does: each is
    # moved there as soon as it is drawn (the GPU holds one at a time).
    home = torch.device("cpu") if offload else dev
    size = parameter_bytes(config, torch.float32)
    status["weights_built_on"] = str(home)
    count = f"{size / 4e9:.2f} B" if size >= 4e8 else f"{size / 4e6:.1f} M"
    mem = f"{size / GIB:.1f} GiB" if size >= GIB else f"{size / 2**20:.0f} MiB"
    phase(f"building the model ({count} parameters, {mem} in float32, drawn on {dev}, kept on {home})")
    t0 = time.perf_counter()
    model = build_random_transformer(config, dev, dtype=torch.float32, seed=0, home=home)
    sync()
    status["build_s"] = time.perf_counter() - t0
    if log is not None:
        log(f"built in {status['build_s']:.1f} s")
    lat = (config["in_channels"], (frames - 1) // 4 + 1, height // 8, width // 8)
    gen = torch.Generator(device="cpu").manual_seed(1 + ctx.data_rank)   # an sp group: one clip
    latents = torch.randn(1, *lat, generator=gen).to(dev)
    text = torch.randn(1, 512, config["text_dim"], generator=gen).to(dev)
    phase("setting up the trainer (" + (f"LoRA rank {lora_rank}, " if lora_rank else "")
          + "FSDP2" + (" CPU offload" if offload else "") + ", optimizer)")
    t0 = time.perf_counter()
    trainer = Trainer(cfg, model, ctx, torch.zeros(512, config["text_dim"]))
    if dev.type == "cuda":
        sync()
        torch.cuda.empty_cache()
        status["gpu_allocated_after_setup_gib"] = torch.cuda.memory_allocated(dev) / GIB
    status["trainer_setup_s"] = time.perf_counter() - t0
    # LoRA under bf16 autocast: the frozen base's linear weights are kept in bfloat16 (Trainer)
    status["lora_base_dtype"] = ("bfloat16" if trainer.base_bf16 else "float32") if lora_rank else None
    if log is not None:
        log(f"trainer set up in {status['trainer_setup_s']:.1f} s"
            + (f"; frozen base's linear weights in {status['lora_base_dtype']}" if lora_rank else ""))
    routing = _published_attention(published) if method == "published" else contextlib.nullcontext()
    times, losses = [], []
    host_reset = False
    with routing:
        for i in range(warmup + steps):
            if i == warmup:
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(dev)
                host_reset = _reset_host_peak()
            name = f"warm-up step {i + 1}" if i < warmup else f"timed step {i - warmup + 1}"
            sync()
            t0 = time.perf_counter()
            phase(f"{name}: forward and backward")
            losses.append(float(trainer.micro_step(latents, text, torch.tensor([i * ctx.data_world + ctx.data_rank]))))
            phase(f"{name}: optimizer step")
            trainer.optimizer_step(i)
            sync()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            if log is not None:
                log(f"{name}: {time.perf_counter() - t0:.2f} s, loss {losses[-1]:.4f}")
    peak = torch.cuda.max_memory_allocated(dev) / GIB if dev.type == "cuda" else None
    host_peak = _lifetime_host_peak_gib()
    tokens = tokens_per_sample(config, lat) // ctx.sp   # each GPU of an sp group: 1/sp of the clip
    step = statistics.median(times)
    row = {"method": method, "fits": True, "step_s": step, "step_all_s": times,
           "peak_memory_gib": peak,
           "tokens_per_step_per_gpu": tokens, "tokens_per_s_per_gpu": tokens / step,
           "losses": losses, "loss_finite": all(map(lambda x: x == x and abs(x) != float("inf"), losses)),
           "parameters": trainer.parameters, "precision": trainer.precision,
           "gradient_checkpointing": checkpointing, "offload": offload, "optimizer": optimizer,
           "lora_rank": lora_rank, "host_peak_rss_gib": host_peak,
           # the peak RSS over the timed steps only (None where /proc cannot reset it)
           "host_steps_peak_rss_gib": _proc_status_gib("VmHWM") if host_reset else None,
           **{k: v for k, v in status.items() if k != "phase"}}
    del trainer, model, latents, text
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def not_fit_row(method: str, why: str, exc: BaseException, status: dict, device: torch.device, *,
                offload: bool, optimizer: str, lora_rank: int) -> dict[str, Any]:
    """The row of a method whose step ran out of memory: one line saying what ran out where."""
    where = status.get("phase", "starting")
    gpu = None
    if device.type == "cuda":
        gpu = {"peak_memory_gib": torch.cuda.max_memory_allocated(device) / GIB,
               "gpu_memory_gib": torch.cuda.get_device_properties(device).total_memory / GIB}
    return {"method": method, "fits": False,
            "does_not_fit": f"{why} while {where}: {_first_line(exc)}",
            "phase": where, "step_s": None, "peak_memory_gib": None, **(gpu or {}),
            "host_peak_rss_gib": _lifetime_host_peak_gib(), "offload": offload,
            "optimizer": optimizer, "lora_rank": lora_rank,
            **{k: v for k, v in status.items() if k != "phase"}}


def summary(config: str, row: dict) -> str:
    """One line per row: config, method, mode, then step time and peaks, or why it did not fit."""
    mode = (f"LoRA r{row['lora_rank']}" if row.get("lora_rank") else "full") + \
        f", {row['optimizer']}, " + ("offload" if row.get("offload") else "no offload")
    head = f"{config} {row['method']} ({mode})"
    if not row.get("fits", True):
        return f"{head}: does not fit: {row['does_not_fit']}"
    gpu = f"{row['peak_memory_gib']:.1f} GiB" if row["peak_memory_gib"] is not None else "-"
    steps = row.get("host_steps_peak_rss_gib")
    host = f"{row['host_peak_rss_gib']:.1f} GiB" + (f" ({steps:.1f} GiB in the timed steps)"
                                                      if steps is not None else "")
    return f"{head}: step {row['step_s']:.2f} s, GPU peak {gpu}, host peak RSS {host}"


def format_rows(rows: list[dict], world: int) -> str:
    base = next((r["step_s"] for r in rows if r["method"] == "bf16" and r.get("fits", True)), None)
    head = f"{'method':>10} {'step s':>8} {'vs bf16':>8} {'tokens/s/GPU':>13} {'peak GiB/GPU':>13} {'GPUs':>5}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if not r.get("fits", True):
            lines.append(f"{r['method']:>10} does not fit: {r['does_not_fit']}")
            continue
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
    from attnqat.cli import invocation

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
        rows: list[dict] = []
        start = time.perf_counter()
        dev = ctx.device
        head = {"benchmark": "wan_transformer_training_step", "config": args.config,
                "height": h, "width": w, "frames": args.frames, "batch_per_gpu": 1,
                "gpus": ctx.world, "sp": ctx.sp, "warmup": args.warmup, "steps": args.steps,
                "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                "gpu_memory_gib": (torch.cuda.get_device_properties(dev).total_memory / GIB
                                   if dev.type == "cuda" else None),
                **host_memory_gib(), "command": invocation(),
                "versions": versions(), "date": now()}

        def record() -> None:   # after every row: a later row's crash keeps the earlier ones
            if ctx.is_main and args.json is not None:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps({**head, "rows": rows}, indent=1) + "\n")

        for m in methods:
            def log(text: str, m=m) -> None:
                if ctx.is_main:
                    print(f"bench train [{time.perf_counter() - start:.1f} s] {m}: {text}",
                          file=sys.stderr, flush=True)

            status: dict = {}
            try:
                row = bench_method(m, config, ctx, height=h, width=w, frames=args.frames,
                                   steps=args.steps, warmup=args.warmup,
                                   checkpointing=args.gradient_checkpointing,
                                   published=args.published_kernel, offload=args.offload,
                                   optimizer=args.optimizer, lora_rank=args.lora_rank,
                                   status=status, log=log)
            except Exception as exc:   # noqa: BLE001 - only out-of-memory errors are kept
                why = out_of_memory(exc)
                if why is None or ctx.world > 1:   # several processes: the others would hang
                    raise
                row = not_fit_row(m, why, exc, status, dev, offload=args.offload,
                                  optimizer=args.optimizer, lora_rank=args.lora_rank)
            if not row["fits"]:   # out of the except block: its frames (the model) are released
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            if ctx.is_main:
                if row["fits"]:
                    log(f"losses {[round(x, 4) for x in row['losses']]}")
                print(summary(args.config, row), flush=True)
            record()
        if ctx.is_main:
            print(format_rows(rows, ctx.world))
            if args.json is not None:
                print(f"wrote {args.json}")
        return 0
    finally:
        distributed.shutdown()


__all__ = ["METHODS", "add_arguments", "bench_method", "format_rows", "host_memory_gib", "not_fit_row",
           "out_of_memory", "run", "summary"]
