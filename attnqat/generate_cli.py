"""``attnqat generate``: one clip per attention method, a labelled side-by-side and a JSON record.

See :mod:`attnqat.generate` for what each method runs and ``docs/generate.md`` for the output.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path

from . import methods as registry
from .convert import CheckpointError
from .generate import MAX_SEED, GenerationError, InvalidInput, generate
from .request import GenerationRequest
from .wan import DEFAULT_MODEL, DTYPE_CHOICES, ModelLoadError


def _default_out() -> str:
    return str(Path("outputs") / f"generate-{datetime.now().strftime('%Y%m%d-%H%M%S')}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``attnqat generate`` (their defaults marked None come from the loaded model)."""
    parser.add_argument("--prompt", required=True, help="text prompt")
    parser.add_argument("--negative-prompt", default=None,
                        help="negative prompt for classifier-free guidance (None: the model's default "
                             "— none for the tiny model, Wan's own negative prompt for Wan 2.1)")
    offered = [registry.get(m) for m in registry.generation()]
    parser.add_argument("--methods", default=",".join(m.name for m in offered),
                        help="comma-separated methods: " + ", ".join(
                            f"{m.name} ({m.label}: {m.description})" for m in offered))
    parser.add_argument("--seed", type=int, default=-1,
                        help=f"seed of the initial noise, shared by all methods: 0 to {MAX_SEED}, or -1 "
                             "for a random one (printed and recorded), as in the app")
    parser.add_argument("--steps", type=int, default=None,
                        help="denoising steps (None: the model's default; tiny 20, Wan 50)")
    parser.add_argument("--guidance", type=float, default=None,
                        help="classifier-free guidance scale; ≤ 1 disables it (None: the model's "
                             "default, 5)")
    parser.add_argument("--shift", type=float, default=None,
                        help="flow shift of the UniPC scheduler (None: the model's default; Wan: 3 "
                             "below 720p, 5 at 720p)")
    parser.add_argument("--height", type=int, default=None,
                        help="frame height, a multiple of 16 (None: the model's default; tiny 128, Wan 480)")
    parser.add_argument("--width", type=int, default=None,
                        help="frame width, a multiple of 16 (None: the model's default; tiny 128, Wan 832)")
    parser.add_argument("--frames", type=int, default=None,
                        help="frames per clip, 4k+1 (None: the model's default; tiny 33, Wan 81)")
    parser.add_argument("--fps", type=float, default=None,
                        help="frame rate of the mp4 files (None: the model's default, 16)")
    parser.add_argument("--model", default=None,
                        help="Wan 2.1 text-to-video pipeline in diffusers format: a local folder "
                             "(works offline) or a hub id (None: the embedded tiny model)")
    parser.add_argument("--qat-transformer", default=None,
                        help="Attn-QAT transformer for the attnqat method: a diffusers transformer "
                             "folder or one .safetensors file (diffusers, FastVideo or original Wan "
                             "names). None: the one the model folder names (the tiny model has one)")
    parser.add_argument("--lora", default=None,
                        help="a LoRA adapter (the folder or pytorch_lora_weights.safetensors that "
                             "`attnqat finetune export` writes for a --lora-rank run): fused into "
                             "the base transformer, it is the attnqat method's weights; instead of "
                             "--qat-transformer")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="compute dtype of the transformer and text encoder: auto picks what the "
                             "device runs natively (bfloat16 on CUDA and on CPUs with BF16 "
                             "instructions, float32 on other CPUs); the bf16 method is attention "
                             "without quantization in either")
    parser.add_argument("--out", default=None,
                        help="output folder (None: outputs/generate-<date>-<time>); written only "
                             "when everything succeeded")
    parser.add_argument("--overwrite", action="store_true",
                        help="allow a non-empty --out; the files generate writes are replaced")
    parser.add_argument("--fp4-scope", choices=("self", "all"), default="self",
                        help="self: 4-bit self-attention, cross-attention in BF16 (the published "
                             "recipe); all: cross-attention 4-bit too")
    parser.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto",
                        help="attention implementation: Triton kernels on CUDA where they apply "
                             "(auto), the PyTorch reference (torch), or 4-bit kernels only (triton: "
                             "CUDA, bfloat16, no bf16 method, --fp4-scope all)")
    parser.add_argument("--offload", action="store_true",
                        help="keep models on the CPU and move each to the GPU only while it runs "
                             "(for GPUs with little memory)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for PyTorch (None: PyTorch's default, one per core; on a "
                             "CPU shared with other work, 1 is often much faster)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    parser.add_argument("--sp", type=int, default=1,
                        help="Ulysses sequence parallelism over N processes (one per GPU): launch "
                             "with `torchrun --nproc-per-node N -m attnqat.cli generate --sp N …`; "
                             "every method gives the one-GPU clip, rank 0 writes the outputs [1]")
    parser.add_argument("--error-map", action="store_true",
                        help="also measure each 4-bit method's attention error against BF16 "
                             "attention on the same inputs, per layer x denoising step, and write "
                             "error_map.json and error_map.png (a heatmap); adds one BF16 "
                             "attention per attention call to the 4-bit methods' time")


def option(field: str | None) -> str:
    """The command-line option of a :func:`attnqat.generate.generate` parameter."""
    return "--" + field.replace("_", "-") if field else ""


def error_lines(exc: Exception) -> list[str]:
    """One line per problem, each naming its option (``--frames: 4k+1 frames …``)."""
    if isinstance(exc, InvalidInput):
        return [f"{option(k)}: {v}" for k, v in exc.errors.items()]
    if isinstance(exc, GenerationError) and exc.field:
        return [f"{option(exc.field)}: {exc.message}"]
    return [str(exc)]


def request_from(args: argparse.Namespace) -> GenerationRequest:
    """The :class:`~attnqat.request.GenerationRequest` of the parsed options: every option whose
    name is a request field (``--fp4-scope`` → ``fp4_scope``), ``--out`` defaulting to a new folder."""
    values = {name: getattr(args, name) for name in GenerationRequest.field_names() if hasattr(args, name)}
    values["model"] = values.get("model") or DEFAULT_MODEL
    values["out"] = values.get("out") or _default_out()
    if getattr(args, "lora", None) is not None:   # an adapter goes where fine-tuned weights go
        values["qat_transformer"] = args.lora
    return GenerationRequest(**values)


def run(args: argparse.Namespace) -> int:
    """Validate, load, generate, write; print a summary. Returns the exit code."""
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.threads is not None:
        if args.threads < 1:
            print(f"attnqat generate: error: --threads: at least 1, got {args.threads}", file=sys.stderr)
            return 2
    if args.sp != 1:
        if args.sp < 1:
            print(f"attnqat generate: error: --sp: at least 1, got {args.sp}", file=sys.stderr)
            return 2
        from .generate_sp import run as run_sp

        return run_sp(args)
        import torch

        torch.set_num_threads(args.threads)
    if args.lora is not None and args.qat_transformer is not None:
        print("attnqat generate: error: --lora: give it or --qat-transformer, not both", file=sys.stderr)
        return 2
    try:
        result = generate(request_from(args), progress=not args.no_progress, log=log)
    except (GenerationError, ModelLoadError, CheckpointError) as exc:
        for line in error_lines(exc):
            print(f"attnqat generate: error: {line}", file=sys.stderr)
        return 2
    summary(result)
    return 0


def summary(result) -> None:
    """Print the settings, the per-method table and where the outputs went."""
    rec = result.record
    s = rec.settings
    print(f"{s['width']}x{s['height']} (width x height), {s['frames']} frames at {s['fps']:g} fps, "
          f"{s['steps']} steps, guidance {s['guidance']:g}, shift {s['shift']:g}, seed {rec.seed}, "
          f"device {s['device']}, {rec.precision.dtype} ({rec.precision.reason})")
    if rec.model_weights_note:
        print(f"model: {rec.model_weights_note}")
    print(f"text encoding: {rec.text_encoding_s:.2f} s (once, shared by all methods)")
    print(f"{'method':>8} {'denoise s':>10} {'attention s':>12} {'decode s':>9} {'total s':>8} "
          f"{'PSNR dB':>8} {'SSIM':>7}  (4-bit error: vs BF16 attention, same weights)")
    for m, d in rec.methods.items():
        t = d.timings
        if d.psnr is not None:
            ps = f"{d.psnr:.2f}"
        else:
            ps = "=bf16" if d.identical_to_bf16 else "-"
        ss = f"{d.ssim:.4f}" if d.ssim is not None else "-"
        att = f"{t.attention_s:.2f}" if t.attention_s is not None else "-"
        print(f"{m:>8} {t.denoising_s:>10.2f} {att:>12} {t.decoding_s:>9.2f} {t.total_s:>8.2f} "
              f"{ps:>8} {ss:>7}")
    finetuned = [m for m in rec.methods if m in registry.names() and registry.uses_finetuned(m)]
    for name, d in rec.references.items():
        t = d.timings
        print(f"{name}: the reference of {', '.join(finetuned) or 'the fine-tuned weights'}'s 4-bit "
              f"error ({d.label}); denoise {t.denoising_s or 0:.2f} s, decode {t.decoding_s or 0:.2f} s")
    if rec.weights_drift is not None:
        w = rec.weights_drift
        ps = "identical" if w["identical"] else f"{w['psnr']:.2f} dB"
        print(f"fine-tuning drift (Attn-QAT weights vs base, both BF16 attention): PSNR {ps}, "
              f"SSIM {w['ssim']:.4f}")
    for m in finetuned:
        q = rec.methods[m]
        if q.ssim_vs_base_bf16 is not None:
            ps = "identical" if q.psnr_vs_base_bf16 is None else f"{q.psnr_vs_base_bf16:.2f} dB"
            print(f"{m} vs the base model's BF16 clip (4-bit error + drift): PSNR {ps}, "
                  f"SSIM {q.ssim_vs_base_bf16:.4f}")
    if rec.comparison_note:
        print(rec.comparison_note)
    if rec.error_map:
        print("attention-error map (self-attention, relative error vs BF16 attention on the same "
              "inputs):")
        for m, v in rec.error_map["summary"].items():
            print(f"{m:>8} mean {v['mean']:.4f}  max {v['max']:.4f}  first step "
                  f"{v['first_step_mean']:.4f}  last step {v['last_step_mean']:.4f}")
        print(f"wrote {rec.error_map.get('json')} and {rec.error_map.get('png')}")
    if rec.qat is not None:
        print(f"attnqat: {rec.qat.label}")
    if rec.qat_weights_note:
        print(f"note: {rec.qat_weights_note}")
    print(f"wrote {result.out}")
