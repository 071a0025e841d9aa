"""``attnqat repro``: the Attn-QAT paper's three claims, measured on the embedded tiny model.

Claims (arXiv 2603.00040), at small scale: (1) naive 4-bit attention degrades a BF16-trained
model; (2) fine-tuning with Attn-QAT recovers the quality without SageAttention3's outlier
heuristics; (3) fine-tuning with a drop-in 4-bit forward and an ordinary backward is unstable.

Stages (``--stages``, any subset, in this order; each continues what an earlier call left):

``train``
    Fine-tunes the shipped base with ``attnqat finetune train`` once per run of :data:`RUNS` — the
    same data (the synthetic stream, training split), seed, step budget and recipe for all, VAE
    and text encoder frozen; only the student attention differs — then exports each run
    (``attnqat finetune export``, EMA weights when ``--ema`` > 0). A run with checkpoints resumes;
    a finished one is skipped. With ``--start-from WORK`` each run starts from its own export of an
    earlier study instead of the base (a continuation: fresh optimizer state and warm-up).
``eval``
    Generates one clip per held-out prompt (``--eval-offset`` … ``+ --eval-prompts``; prompt ``i``
    with seed ``i``; prompts the runs never chose anything with) for every configuration of
    :data:`CONFIGS` whose run exists, scores it procedurally and measures PSNR/SSIM against the
    base model's BF16 clip of the same prompt and seed (:mod:`attnqat.finetune.heldout`). One JSON
    per configuration in ``WORK/eval``; configurations already there are kept.
``probe``
    For the base and every exported run, how much NVFP4 attention changes each self-attention
    layer's output while the model denoises ``--probe-prompts`` held-out prompts
    (:mod:`attnqat.finetune.attn_probe`; PyTorch reference, CPU-sized): ``WORK/probe.json``.
``report``
    Rates with 95 % Wilson intervals, paired comparisons (exact McNemar test on the clips
    all-correct; the difference with a paired bootstrap interval over prompts), the runs' loss
    and gradient-norm curves as PNG, written to ``--doc`` (default ``docs/repro.md``) with the
    commands that made every number.
``ship``
    Copies the ``attnqat`` run's export to ``--ship-to`` (default ``assets/tiny-wan-qat``) with its
    provenance: the run, the evaluation's headline numbers, the report.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from attnqat import methods as registry
from attnqat.convert import load_wan_transformer
from attnqat.eval.stats import sign_test, wilson_interval
from attnqat.family import for_folder as family_for
from attnqat.tiny import TINY_MODEL_DIR, TINY_QAT_DIR
from attnqat.wan import load_models

from . import checkpoint as ckpt
from . import heldout
from . import train as T
from .attn_probe import CAPTURE_STEPS, attention_errors
from .export import export, note
from .plot import plot_runs
from .runlog import device_name, now, read_log

STAGES = ("train", "eval", "probe", "report", "ship")
#: run name → (student attention, ablation, label)
RUNS: dict[str, tuple[str, str | None, str]] = {
    "attnqat": ("attnqat", None, "Attn-QAT"),
    "bf16": ("bf16", None, "BF16 control"),
    "dropin": ("dropin", None, "drop-in FP4 (ordinary backward)"),
    "p2off": ("attnqat", "d_from_o", "Attn-QAT, principle 2 off (D from O)"),
    "p1off": ("attnqat", "p_unquantized", "Attn-QAT, principle 1 off (P not re-quantized)"),
}
#: configuration → (weights: "base" or a run, attention at inference, label). The base model runs
#: every inference method of the registry (:func:`attnqat.methods.inference`); the fine-tuned runs
#: deploy the attention their student method deploys as.
CONFIGS: dict[str, tuple[str, str, str]] = {
    **{f"base-{m}": ("base", m, f"base, {registry.label(m)} attention") for m in registry.inference()},
    "qat-nvfp4": ("attnqat", "nvfp4", "Attn-QAT, NVFP4 attention"),
    "qat-bf16": ("attnqat", "bf16", "Attn-QAT, BF16 attention"),
    "control-bf16": ("bf16", "bf16", "BF16 control, BF16 attention"),
    "control-nvfp4": ("bf16", "nvfp4", "BF16 control, NVFP4 attention"),
    "dropin-nvfp4": ("dropin", "nvfp4", "drop-in, NVFP4 attention"),
    "p2off-nvfp4": ("p2off", "nvfp4", "principle 2 off, NVFP4 attention"),
    "p1off-nvfp4": ("p1off", "nvfp4", "principle 1 off, NVFP4 attention"),
}
#: paired comparisons of the report (A, B): A's all-correct rate minus B's
#: (the base model with each other 4-bit inference method of the registry is compared, as sage3 is, with
#: base-bf16 and with qat-nvfp4)
_OTHER_BASE = [f"base-{m}" for m in registry.inference() if registry.get(m).four_bit and m != "nvfp4"]
PAIRS = (("qat-nvfp4", "base-bf16"), ("qat-nvfp4", "base-nvfp4"), ("qat-nvfp4", "control-nvfp4"),
         ("qat-nvfp4", "control-bf16"),
         ("base-nvfp4", "base-bf16"), ("control-nvfp4", "base-bf16"),
         *((c, p) for b in _OTHER_BASE for c, p in ((b, "base-bf16"), ("qat-nvfp4", b))),
         ("qat-nvfp4", "qat-bf16"), ("qat-bf16", "base-bf16"),
         ("control-bf16", "base-bf16"), ("control-nvfp4", "control-bf16"),
         ("dropin-nvfp4", "base-bf16"), ("p2off-nvfp4", "base-bf16"), ("p1off-nvfp4", "base-bf16"))
#: the 4-bit cost of a weight set is its NVFP4 configuration minus its BF16 one; Attn-QAT's is
#: compared with the control's and the base's (claim 2 is that QAT makes the weights robust to it)
COSTS = (("qat", "control"), ("qat", "base"))
WEIGHTS = {"qat": "Attn-QAT", "control": "BF16 control", "base": "base"}
ATTRS = ("colour", "shape", "motion")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--work", type=Path, default=Path("runs/repro"),
                        help="working folder: runs/, export/, eval/ (continued across calls)")
    parser.add_argument("--stages", default="train,eval,report",
                        help=f"comma-separated stages, in order: {', '.join(STAGES)}")
    parser.add_argument("--runs", default=",".join(RUNS),
                        help=f"the fine-tuning runs to train and evaluate: {', '.join(RUNS)}")
    parser.add_argument("--model", default=str(TINY_MODEL_DIR), help="the base pipeline")
    parser.add_argument("--steps", type=int, default=1200, help="optimizer steps of every run")
    parser.add_argument("--batch-size", type=int, default=32, help="clips per step")
    parser.add_argument("--lr", type=float, default=1e-5,
                        help="AdamW learning rate (constant; 2e-5 for 600 steps moved the BF16 "
                             "control 3.5 points off the base: docs/repro/v2.md)")
    parser.add_argument("--warmup", type=int, default=50, help="linear warm-up steps")
    parser.add_argument("--ema", type=float, default=0.998, help="EMA decay of the exported weights (0: live weights)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data stream and the noise")
    parser.add_argument("--start-from", type=Path, default=None, metavar="WORK",
                        help="continue an earlier study: every run starts from its own export in "
                             "WORK/export/RUN instead of the base (fresh optimizer and warm-up; use "
                             "another --seed for fresh samples); unset: from the base")
    parser.add_argument("--size", type=int, default=None,
                        help="clip height and width, a multiple of 16, for training and evaluation "
                             "alike (more tokens per clip: 4-bit attention loses more); unset: "
                             "the model's")
    parser.add_argument("--frames", type=int, default=None,
                        help="frames per clip, 4k+1, for training and evaluation; unset: the model's")
    parser.add_argument("--two-objects", type=float, default=0.8,
                        help="share of two-object clips in the training stream (the base model's "
                             "last training runs used 0.8)")
    parser.add_argument("--configs", default="",
                        help="the configurations the eval stage evaluates (comma-separated, of "
                             f"{', '.join(CONFIGS)}; default: every one whose weights exist), e.g. "
                             "to split them over processes sharing one GPU")
    parser.add_argument("--eval-prompts", type=int, default=800,
                        help="held-out prompts scored (800 give a paired interval of about ±3 "
                             "points; with 200 it is ±5.5, wider than the ±5-point target)")
    parser.add_argument("--eval-offset", type=int, default=100,
                        help="first held-out prompt (0-99 chose the base model's checkpoint)")
    parser.add_argument("--eval-batch", type=int, default=200, help="prompts denoised together")
    parser.add_argument("--probe-prompts", type=int, default=16,
                        help="held-out prompts (from --eval-offset) of the probe stage, which measures "
                             "per layer how much NVFP4 attention changes each weight set's "
                             "self-attention outputs (PyTorch reference; runs on the CPU)")
    parser.add_argument("--eval-backend", choices=("auto", "torch", "triton"), default="auto",
                        help="attention kernels at inference")
    parser.add_argument("--workers", type=int, default=8,
                        help="DataLoader workers rendering clips; processes scoring clips")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="progress bars of the training runs")
    parser.add_argument("--time-limit", type=float, default=0.0,
                        help="minutes for the train stage (runs stop with a checkpoint and resume "
                             "on the next call; 0: none)")
    parser.add_argument("--doc", type=Path, default=Path("docs/repro.md"), help="report to write")
    parser.add_argument("--notes", type=Path, default=None,
                        help="a Markdown file the report includes after its header (how the runs "
                             "were executed, what was tried before, the interpretation)")
    parser.add_argument("--figures", type=Path, default=None,
                        help="folder of the report's PNG curves (default: beside --doc)")
    parser.add_argument("--ship-to", type=Path, default=TINY_QAT_DIR,
                        help="where the ship stage puts the Attn-QAT transformer")


def log(msg: str) -> None:
    print(f"[repro] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------
# Train


def _start_weights(args, name: str) -> Path:
    """Where run ``name`` starts from under ``--start-from``: that study's export of the run."""
    return args.start_from / "export" / name


def train_args(args, name: str) -> list[str]:
    """The ``attnqat finetune train`` arguments of run ``name``."""
    attention, ablation, _ = RUNS[name]
    out = args.work / "runs" / name
    a = ["--model", _shown(args.model), "--data", "synthetic", "--out", _shown(out), "--attention", attention,
         "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
         "--warmup", str(args.warmup), "--schedule", "constant", "--ema", str(args.ema),
         "--seed", str(args.seed), "--two-objects", str(args.two_objects),
         "--workers", str(args.workers), "--device", args.device,
         "--checkpoint-every", str(max(1, args.steps // 4)), "--keep", "1"]
    if not args.progress:
        a.append("--no-progress")
    if ablation:
        a += ["--ablation", ablation, "--backend", "torch"]
    if args.start_from is not None:
        a += ["--transformer", _shown(_start_weights(args, name))]
    if args.size is not None:
        a += ["--height", str(args.size), "--width", str(args.size)]
    if args.frames is not None:
        a += ["--frames", str(args.frames)]
    return a


def stage_train(args, runs: list[str]) -> int:
    t0 = time.perf_counter()
    if args.start_from is not None:
        missing = [str(_start_weights(args, r)) for r in runs
                   if not (_start_weights(args, r) / "attnqat.json").is_file()]
        if missing:
            log(f"--start-from: no export in {', '.join(missing)}")
            return 2
    for name in runs:
        out = args.work / "runs" / name
        done = ckpt.complete_checkpoints(out)
        if not (done and done[-1][0] >= args.steps):
            a = train_args(args, name)
            if done:
                a.append("--resume")
            if args.time_limit > 0:
                left = args.time_limit - (time.perf_counter() - t0) / 60
                if left <= 0.2:
                    log(f"time limit reached before run {name}; continue with the same command")
                    return 0
                a += ["--time-limit", f"{left:.2f}"]
            log(f"run {name}: attnqat finetune train {shlex.join(a)}")
            parser = argparse.ArgumentParser()
            T.add_arguments(parser)
            rc = T.run(parser.parse_args(a))
            if rc not in (0,):
                log(f"run {name} stopped with status {rc}")
                if rc == T.EXIT_NONFINITE:
                    continue   # a diverged run is a result (claim 3); nothing to export
                return rc
            done = ckpt.complete_checkpoints(out)
            if not done or done[-1][0] < args.steps:
                log(f"run {name} paused at step {done[-1][0] if done else 0}; continue with the "
                    "same command")
                return 0
        dst = args.work / "export" / name
        if not (dst / "attnqat.json").is_file() or \
                json.loads((dst / "attnqat.json").read_text())["training"]["steps"] < args.steps:
            export(out, dst)
            log(f"exported {name} to {dst}")
    return 0


# ----------------------------------------------------------------------------------------------
# Eval


def _clip_record(score: dict) -> dict:
    return {"all_correct": bool(score["all_correct"]), "background": bool(score["background"]),
            "objects": [{a: bool(o[a]) for a in ATTRS} for o in score["objects"]]}


def stage_eval(args, runs: list[str], configs: list[str]) -> int:
    folder = args.work / "eval"
    folder.mkdir(parents=True, exist_ok=True)
    wanted = configs or list(CONFIGS)
    todo = [c for c, (w, _, _) in CONFIGS.items() if c in wanted and (w == "base" or w in runs)
            and not (folder / f"{c}.json").is_file()]
    missing = [c for c in todo if CONFIGS[c][0] != "base"
               and not (args.work / "export" / CONFIGS[c][0] / "attnqat.json").is_file()]
    if missing:
        log(f"no exported weights for {', '.join(missing)} (run the train stage first); skipped")
        todo = [c for c in todo if c not in missing]
    asked = {"height": args.size, "width": args.size, "frames": args.frames}
    done = {f: json.loads(f.read_text())["settings"] for f in sorted(folder.glob("*.json"))}
    if (bad := _other_clip_size(done, asked)) is not None:
        return bad
    if not todo:
        log("every configuration is evaluated already")
        return 0
    models = load_models(args.model, device=args.device)
    inp = heldout.inputs(models, args.eval_offset, args.eval_prompts, size=args.size, frames=args.frames,
                         backend=args.eval_backend)
    if (bad := _other_clip_size(done, {k: getattr(inp.settings[0], k) for k in asked})) is not None:
        return bad
    base_bf16 = _base_reference(args, models, inp)
    for c in todo:
        weights, method, _ = CONFIGS[c]
        t1 = time.perf_counter()
        tr = _transformer(args, models, weights)
        clips = base_bf16 if c == "base-bf16" else heldout.generate_clips(
            models, tr, inp, method, args.eval_backend, args.eval_batch)
        t2 = time.perf_counter()
        scores = heldout.score_all(inp.prompts, clips, args.workers)
        rec = {"config": c, "weights": weights, "attention": method, "date": now(),
               "device": device_name(models.device),
               "backend": args.eval_backend, "first_prompt": args.eval_offset,
               "prompts": inp.prompts, "seeds": [s.seed for s in inp.settings],
               "settings": _settings(inp),
               "summary": heldout.summary_row(scores),
               "similarity_to_base_bf16": None if c == "base-bf16" else heldout.similarity(clips, base_bf16, args.workers),
               "clips": [_clip_record(s) for s in scores],
               "generate_s": round(t2 - t1, 1), "score_s": round(time.perf_counter() - t2, 1)}
        if weights != "base":
            rec["weights_record"] = json.loads((args.work / "export" / weights / "attnqat.json").read_text())
        (folder / f"{c}.json").write_text(json.dumps(rec, indent=1) + "\n")
        log(f"{c}: all-correct {rec['summary']['all_correct']:.3f} ({t2 - t1:.1f} s generating, "
            f"{rec['score_s']} s scoring)")
        if weights != "base":
            del tr
    return 0


def stage_probe(args, runs: list[str]) -> int:
    """``WORK/probe.json``: :func:`attn_probe.attention_errors` of the base and of every run whose
    export exists, on the first ``--probe-prompts`` held-out prompts at the study's clip size
    (weight sets already in the file are kept)."""
    out = args.work / "probe.json"
    rec = json.loads(out.read_text()) if out.is_file() else {}
    todo = [w for w in ("base", *runs) if w not in rec.get("weights", {})
            and (w == "base" or (args.work / "export" / w / "attnqat.json").is_file())]
    if not todo:
        log("probe: every weight set is probed already")
        return 0
    models = load_models(args.model, device=args.device)
    inp = heldout.inputs(models, args.eval_offset, args.probe_prompts, size=args.size, frames=args.frames,
                         backend="torch")
    settings = _settings(inp)
    if rec and rec["settings"] != settings:
        log(f"{out} was made at other settings ({rec['settings']}); use another --work")
        return 2
    rec.update(settings=settings, first_prompt=args.eval_offset, capture_steps=list(CAPTURE_STEPS))
    for w in todo:
        t0 = time.perf_counter()
        tr = _transformer(args, models, w)
        rec.setdefault("weights", {})[w] = attention_errors(models, tr, inp, batch=args.eval_batch)
        rec["date"], rec["device"] = now(), device_name(models.device)
        out.write_text(json.dumps(rec, indent=1) + "\n")
        log(f"probe {w}: NVFP4 attention off BF16 by {rec['weights'][w]['mean']:.4f} (mean over layers; "
            f"{time.perf_counter() - t0:.1f} s)")
    return 0


def _settings(inp) -> dict:
    """The generation settings every prompt of a held-out input set shares, as the records keep them."""
    return {k: getattr(inp.settings[0], k) for k in ("steps", "guidance", "shift", "height", "width", "frames")}


def _transformer(args, models, weights: str):
    """The transformer of weight set ``weights``: the loaded base's, or a run's export."""
    if weights == "base":
        return models.pipe.transformer
    return load_wan_transformer(args.work / "export" / weights, config=dict(models.pipe.transformer.config),
                                dtype=models.pipe.transformer.dtype, device=models.device)[0]


def _other_clip_size(done: dict[Path, dict], want: dict) -> int | None:
    """2 (after saying which) when an evaluation already made (file → its settings) was made at
    another clip size than ``want`` (None values: not asked, not compared); None when they agree."""
    for f, got in done.items():
        diff = [f"{k} {got[k]} (there) vs {v}" for k, v in want.items() if v is not None and got[k] != v]
        if diff:
            log(f"{f} was evaluated at another clip size ({', '.join(diff)}); use another --work")
            return 2
    return None


def _base_reference(args, models, inp) -> list[np.ndarray]:
    """The base model's BF16 clips of the held-out prompts (what every configuration's PSNR/SSIM is
    measured against), generated once per work folder, model and prompt range and kept in
    ``WORK/cache`` (``*.npy``, uint8), so that later calls and parallel eval processes load them."""
    model = hashlib.sha1(str(Path(args.model).resolve()).encode()).hexdigest()[:8]
    s = inp.settings[0]
    cache = args.work / "cache" / (f"base-bf16-{args.eval_offset}-{args.eval_prompts}-"
                                   f"{args.eval_backend}-{s.height}x{s.width}x{s.frames}-{model}.npy")
    if cache.is_file():
        clips = list(np.load(cache))
        log(f"base BF16 reference clips: {len(clips)} from {cache}")
        return clips
    t0 = time.perf_counter()
    clips = heldout.generate_clips(models, models.pipe.transformer, inp, "bf16",
                                   args.eval_backend, args.eval_batch)
    log(f"base BF16 reference clips: {len(clips)} in {time.perf_counter() - t0:.1f} s")
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:          # np.save on a path would append ".npy" to the temp name
        np.save(f, np.stack(clips))
    tmp.replace(cache)
    return clips


# ----------------------------------------------------------------------------------------------
# Report


def _rate(k: int, n: int) -> str:
    lo, hi = wilson_interval(k, n)
    return f"{100 * k / n:.1f} % [{100 * lo:.1f}, {100 * hi:.1f}]"


def paired(a: list[bool], b: list[bool], n_boot: int = 10000, seed: int = 0) -> dict:
    """All-correct of A against B on the same prompts and seeds: the difference of the rates,
    its 95 % paired-bootstrap interval (resampling prompts), and the exact McNemar test (two-sided
    binomial test of the discordant pairs)."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape or not len(x):
        raise ValueError("paired comparison of unequal or empty outcome lists")
    only_a, only_b = int(((x == 1) & (y == 0)).sum()), int(((x == 0) & (y == 1)).sum())
    lo, hi = _bootstrap(x - y, n_boot, seed)
    p = sign_test(only_a, only_b) if only_a + only_b else 1.0   # McNemar = sign test of the discordant
    return {"diff": float(x.mean() - y.mean()), "lo": lo, "hi": hi, "only_a": only_a, "only_b": only_b,
            "p": p, "n": len(x)}


def _bootstrap(d: np.ndarray, n_boot: int, seed: int) -> tuple[float, float]:
    """95 % interval of the mean of per-prompt values ``d`` (prompts resampled with replacement)."""
    idx = np.random.default_rng(seed).integers(0, len(d), size=(n_boot, len(d)))
    boot = d[idx].mean(axis=1)
    return float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))


def cost_difference(a_fp4: list[bool], a_bf16: list[bool], b_fp4: list[bool], b_bf16: list[bool],
                    n_boot: int = 10000, seed: int = 0) -> dict:
    """The 4-bit cost of weight set A (its all-correct rate with NVFP4 attention minus with BF16)
    minus that of B, on the same prompts and seeds, with a 95 % paired-bootstrap interval
    (resampling prompts, the four outcomes of a prompt together). Positive: A loses less to
    4-bit attention than B does."""
    x = [np.asarray(o, dtype=float) for o in (a_fp4, a_bf16, b_fp4, b_bf16)]
    if len({len(o) for o in x}) != 1 or not len(x[0]):
        raise ValueError("cost difference of unequal or empty outcome lists")
    d = (x[0] - x[1]) - (x[2] - x[3])
    lo, hi = _bootstrap(d, n_boot, seed)
    return {"cost_a": float((x[0] - x[1]).mean()), "cost_b": float((x[2] - x[3]).mean()),
            "diff": float(d.mean()), "lo": lo, "hi": hi, "n": len(d)}


def _p(p: float, eq: str = "") -> str:
    """A p-value as the report prints it: three decimals, or "< 0.001"."""
    return "< 0.001" if p < 0.001 else f"{eq}{p:.3f}"


def _stability(recs: list[dict], clip: float) -> dict:
    g = np.array([r["grad_norm"] for r in recs])
    loss = np.array([r["loss"] for r in recs])
    tail = max(1, len(loss) // 10)
    return {"steps": len(recs), "loss_first": float(loss[:tail].mean()), "loss_last": float(loss[-tail:].mean()),
            "grad_median": float(np.median(g)), "grad_max": float(g.max()),
            "clipped": int((g > clip).sum()), "nonfinite": not bool(np.isfinite(loss).all())}


def _report_header(args, ev: dict, run_dirs: dict, command: str) -> tuple[list[str], dict | None]:
    """The report's opening: how it was made, the evaluation and the fine-tuning runs."""
    lines = ["# Attn-QAT on the embedded tiny model: the paper's claims, measured", "",
             f"Written by `{command}` on {now()[:10]} (every number below comes from it; the "
             "training and evaluation stages can run in several calls, each continuing the last)."]
    e0 = ev["base-bf16"]
    s = e0["settings"]
    n = len(e0["clips"])
    lines += ["", f"Evaluation: held-out prompts {e0['first_prompt']}–{e0['first_prompt'] + n - 1} "
              f"(prompt i with seed i; colour × shape × motion triples never shown in training), "
              f"{s['width']} × {s['height']}, "
              f"{s['frames']} frames, {s['steps']} steps, guidance {s['guidance']}, shift {s['shift']}, "
              f"attention backend `{e0['backend']}`, scored by the procedural judge "
              f"(`attnqat eval score`), on {e0['device']}."]
    if args.notes is not None:
        lines += ["", args.notes.read_text().strip()]
    cfg0 = None
    if run_dirs:
        cfg0 = json.loads((next(iter(run_dirs.values())) / "config.json").read_text())
        start = (f"`{_shown(cfg0['model'])}`" if not cfg0.get("transformer") else
                 f"each run's own earlier export (`{_shown(Path(cfg0['transformer']).parent)}/RUN`: "
                 "a continuation with a fresh optimizer and warm-up)")
        lines += ["", f"Fine-tuning (every run the same but for the student attention): from "
                  f"{start}, {cfg0['width']} × {cfg0['height']} clips of {cfg0['frames']} frames, "
                  f"the synthetic shapes stream (training split, seed {cfg0['seed']}, "
                  f"{cfg0.get('two_objects') if cfg0.get('two_objects') is not None else 0.5:.0%} two-object clips), "
                  f"{cfg0['steps']} steps of batch {cfg0['batch_size']}, AdamW lr {cfg0['lr']} "
                  f"({cfg0['schedule']}, {cfg0['warmup']} warm-up steps), weight decay "
                  f"{cfg0['weight_decay']}, clipping {cfg0['grad_clip']}, caption dropout "
                  f"{cfg0['caption_dropout']}, flow shift {cfg0['shift']}, EMA {cfg0['ema']} "
                  f"(the exported weights), self-attention quantized, VAE and text encoder frozen. "
                  "Each run is `attnqat finetune train` with:", ""]
        for r in run_dirs:
            lines.append(f"- {RUNS[r][2]}: `attnqat finetune train {shlex.join(train_args(args, r))}`")
    return lines, cfg0


def _report_quality(ev: dict) -> list[str]:
    """The quality table, one row per configuration."""
    lines: list[str] = []
    lines += ["", "## Quality", "",
              "Object-level rates for colour, shape and motion (one- and two-object prompts); clip-level "
              "rate of clips with everything right; 95 % Wilson intervals in brackets. PSNR and SSIM "
              "against the base model's BF16 clip of the same prompt and seed.", "",
              "| configuration | colour | shape | motion | all correct | PSNR vs base BF16 | SSIM |",
              "|---|---|---|---|---|---|---|"]
    for c, rec in ev.items():
        objs = [o for clip in rec["clips"] for o in clip["objects"]]
        allc = sum(clip["all_correct"] for clip in rec["clips"])
        sim = rec["similarity_to_base_bf16"]
        psnr = "–" if sim is None or sim["psnr"] is None else f"{sim['psnr']:.2f} dB"
        ssim = "–" if sim is None else f"{sim['ssim']:.3f}"
        lines.append(f"| {CONFIGS[c][2]} | " + " | ".join(_rate(sum(o[a] for o in objs), len(objs))
                                                        for a in ATTRS)
                     + f" | {_rate(allc, len(rec['clips']))} | {psnr} | {ssim} |")
    return lines


def _report_pairs(ev: dict) -> tuple[list[str], dict]:
    """The paired comparisons of :data:`PAIRS` that both ran."""
    lines: list[str] = []
    lines += ["", "## Paired comparisons", "",
              "All-correct rate of A minus B on the same prompts and seeds; 95 % paired-bootstrap "
              "interval (10,000 resamples of the prompts); exact McNemar test on the clips only one "
              "of the two gets right.", "",
              "| A | B | A − B (points) | 95 % interval | only A right | only B right | McNemar p |",
              "|---|---|---|---|---|---|---|"]
    verdicts = {}
    for a, b in PAIRS:
        if a in ev and b in ev:
            pr = paired([c["all_correct"] for c in ev[a]["clips"]], [c["all_correct"] for c in ev[b]["clips"]])
            verdicts[(a, b)] = pr
            lines.append(f"| {CONFIGS[a][2]} | {CONFIGS[b][2]} | {100 * pr['diff']:+.1f} | "
                         f"[{100 * pr['lo']:+.1f}, {100 * pr['hi']:+.1f}] | {pr['only_a']} | "
                         f"{pr['only_b']} | {_p(pr['p'])} |")
    return lines, verdicts


def _report_costs(ev: dict) -> tuple[list[str], dict]:
    """The 4-bit cost of each weight set, paired across :data:`COSTS`."""
    lines: list[str] = []
    costs = {}
    for a, b in COSTS:
        cfgs = [f"{a}-nvfp4", f"{a}-bf16", f"{b}-nvfp4", f"{b}-bf16"]
        if all(c in ev for c in cfgs):
            costs[(a, b)] = cost_difference(*[[c["all_correct"] for c in ev[x]["clips"]] for x in cfgs])
    if costs:
        lines += ["", "## Robustness to 4-bit attention", "",
                  "A weight set's 4-bit cost: its all-correct rate with NVFP4 attention minus with BF16 "
                  "attention. The difference of two costs is paired over prompts (the four clips of a "
                  "prompt resampled together, 10,000 times); positive: the first loses less.", "",
                  "| weights A | weights B | cost of A (points) | cost of B | A − B | 95 % interval |",
                  "|---|---|---|---|---|---|"]
        for (a, b), c in costs.items():
            lines.append(f"| {WEIGHTS[a]} | {WEIGHTS[b]} | {100 * c['cost_a']:+.1f} | {100 * c['cost_b']:+.1f} | "
                         f"{100 * c['diff']:+.1f} | [{100 * c['lo']:+.1f}, {100 * c['hi']:+.1f}] |")
    return lines, costs


def _report_probe(args) -> list[str]:
    """The attention probe's table (``WORK/probe.json``), when it ran."""
    lines: list[str] = []
    probe = json.loads((args.work / "probe.json").read_text()) if (args.work / "probe.json").is_file() else None
    if probe:
        ps = probe["settings"]
        names = {"base": "base", **{r: RUNS[r][2] for r in RUNS}}
        lines += ["", "## 4-bit attention inside the model", "",
                  f"Each self-attention layer's output with NVFP4 attention against BF16 attention on the "
                  f"same queries, keys and values (relative error ‖Δ‖/‖O‖, PyTorch reference), captured "
                  f"while denoising the first {next(iter(probe['weights'].values()))['prompts']} held-out "
                  f"prompts ({ps['width']} × {ps['height']}, {ps['frames']} frames) at steps "
                  f"{', '.join(str(s) for s in probe['capture_steps'])} of {ps['steps']}: how hard each "
                  "weight set's attention inputs are to quantize (`attnqat repro --stages probe`).", "",
                  "| weights | mean over layers | first layer | last layer | worst layer | first / last step |",
                  "|---|---|---|---|---|---|"]
        for w, r in probe["weights"].items():
            st = list(r["by_step"].values())
            lines.append(f"| {names.get(w, w)} | {r['mean']:.4f} | {r['layers'][0]:.4f} | {r['layers'][-1]:.4f} | "
                         f"{max(r['layers']):.4f} (layer {int(np.argmax(r['layers']))}) | "
                         f"{st[0]:.4f} / {st[-1]:.4f} |")
    return lines


def _report_target(verdicts: dict, costs: dict) -> list[str]:
    """The verdicts against the target."""
    lines: list[str] = []
    lines += ["", "## Against the target", ""]
    q = verdicts.get(("qat-nvfp4", "base-bf16"))
    if q is not None:
        within = -0.05 <= q["lo"] and q["hi"] <= 0.05
        lines.append(f"- QAT-NVFP4 against base-BF16: {100 * q['diff']:+.1f} points "
                     f"[{100 * q['lo']:+.1f}, {100 * q['hi']:+.1f}], McNemar p {_p(q['p'], '= ')}: the test "
                     f"{'does not reject' if q['p'] >= 0.05 else 'rejects'} equality; the interval "
                     f"{'lies' if within else 'does not lie'} within ±5 points"
                     + (" (it lies above: the fine-tuned weights are better than the base here, so the "
                        "comparison with the BF16 control below is the one that isolates 4-bit attention)."
                        if q["lo"] > 0 else "."))
    for b, against in (("base-nvfp4", "base-NVFP4"),
                       ("control-nvfp4", "the BF16 control with NVFP4 attention (what the extra training "
                                         "alone gives)"),
                       ("control-bf16", "the BF16 control with BF16 attention (the same fine-tuning, BF16 "
                                        "attention in training and inference)")):
        v = verdicts.get(("qat-nvfp4", b))
        if v is not None:
            lines.append(f"- QAT-NVFP4 against {against}: {100 * v['diff']:+.1f} points "
                         f"[{100 * v['lo']:+.1f}, {100 * v['hi']:+.1f}], p {_p(v['p'], '= ')}.")
    c = costs.get(("qat", "control"))
    if c is not None:
        lines.append(f"- Attn-QAT's own 4-bit cost against the BF16 control's (what training with 4-bit "
                     f"attention buys in robustness): {100 * c['cost_a']:+.1f} against "
                     f"{100 * c['cost_b']:+.1f} points, difference {100 * c['diff']:+.1f} "
                     f"[{100 * c['lo']:+.1f}, {100 * c['hi']:+.1f}].")
    return lines


def _report_training(args, run_dirs: dict, cfg0: dict | None, figs: Path) -> list[str]:
    """The training curves and the stability table of the runs."""
    lines: list[str] = []
    if run_dirs:
        curves = figs / "repro_curves.png"
        plot_runs(list(run_dirs.values()), curves, labels=[RUNS[r][2] for r in run_dirs], smooth=25,
                  title="fine-tuning runs of the tiny model")
        lines += ["", "## Training", "", f"![loss and gradient norm of every run]({_rel(curves, args.doc)})", "",
                  "| run | steps | loss, first 10 % | loss, last 10 % | median gradient norm | max | "
                  "steps clipped | non-finite |", "|---|---|---|---|---|---|---|---|"]
        for r, d in run_dirs.items():
            st = _stability(read_log(d), cfg0["grad_clip"])
            lines.append(f"| {RUNS[r][2]} | {st['steps']} | {st['loss_first']:.4f} | {st['loss_last']:.4f} | "
                         f"{st['grad_median']:.3f} | {st['grad_max']:.3f} | {st['clipped']} | "
                         f"{'yes' if st['nonfinite'] else 'no'} |")
        if "dropin" in run_dirs and "attnqat" in run_dirs:
            dropin = figs / "repro_dropin.png"
            plot_runs([run_dirs["attnqat"], run_dirs["dropin"]], dropin,
                      labels=[RUNS["attnqat"][2], RUNS["dropin"][2]], smooth=25,
                      title="Attn-QAT against drop-in FP4 fine-tuning")
            lines += ["", f"![Attn-QAT against drop-in]({_rel(dropin, args.doc)})"]
    return lines


def stage_report(args, runs: list[str], command: str) -> int:
    ev = {c: json.loads((args.work / "eval" / f"{c}.json").read_text())
          for c in CONFIGS if (args.work / "eval" / f"{c}.json").is_file()}
    if "base-bf16" not in ev:
        log("nothing to report: run the eval stage first")
        return 2
    figs = args.figures or args.doc.parent
    figs.mkdir(parents=True, exist_ok=True)
    run_dirs = {r: args.work / "runs" / r for r in runs if (args.work / "runs" / r / "log.jsonl").is_file()}
    lines, cfg0 = _report_header(args, ev, run_dirs, command)
    lines += _report_quality(ev)
    pair_lines, verdicts = _report_pairs(ev)
    cost_lines, costs = _report_costs(ev)
    lines += pair_lines + cost_lines + _report_probe(args) + _report_target(verdicts, costs)
    lines += _report_training(args, run_dirs, cfg0, figs)
    args.doc.parent.mkdir(parents=True, exist_ok=True)
    args.doc.write_text("\n".join(lines) + "\n")
    (args.work / "report.json").write_text(json.dumps(
        {"date": now(), "command": command, "pairs": {f"{a} vs {b}": v for (a, b), v in verdicts.items()},
         "cost_differences": {f"{a} vs {b}": v for (a, b), v in costs.items()},
         "summaries": {c: r["summary"] for c, r in ev.items()}}, indent=1) + "\n")
    log(f"wrote {args.doc}")
    return 0




def _rel(path: Path, doc: Path) -> str:
    import os

    return Path(os.path.relpath(path.resolve(), doc.resolve().parent)).as_posix()


# ----------------------------------------------------------------------------------------------
# Ship


def stage_ship(args) -> int:
    src = args.work / "export" / "attnqat"
    if not (src / "attnqat.json").is_file():
        log(f"nothing to ship: {src} holds no exported Attn-QAT transformer")
        return 2
    record = json.loads((src / "attnqat.json").read_text())
    report = args.work / "report.json"
    if report.is_file():
        rep = json.loads(report.read_text())
        record["evaluation"] = {"report": str(args.doc), "summaries": rep["summaries"],
                                "pairs": rep["pairs"], "command": rep["command"]}

    record["qat_weights_note"] = (note(record["training"]) + "; the embedded model's Attn-QAT "
                                  f"weights, evaluated in {_shown(args.doc)}")
    dst = args.ship_to
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    (tmp / "attnqat.json").write_text(json.dumps(record, indent=1) + "\n")
    if dst.exists():
        shutil.rmtree(dst)
    tmp.rename(dst)
    log(f"shipped {src} to {dst}")
    return 0


# ----------------------------------------------------------------------------------------------


def _shown(path) -> str:
    """A path relative to the current folder when it lies inside it (as a user would type it)."""
    import os

    p = Path(path).resolve()
    try:
        return Path(os.path.relpath(p)).as_posix() if p.is_relative_to(Path.cwd()) else str(path)
    except ValueError:
        return str(path)


def command_line(args: argparse.Namespace) -> str:
    """The repro command with every setting that shapes the numbers spelled out."""
    a = ["--work", _shown(args.work), "--runs", args.runs, "--model", _shown(args.model), "--steps",
         str(args.steps), "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--warmup",
         str(args.warmup), "--ema", str(args.ema), "--seed", str(args.seed), "--two-objects",
         str(args.two_objects)]
    if args.start_from is not None:
        a += ["--start-from", _shown(args.start_from)]
    if args.size is not None:
        a += ["--size", str(args.size)]
    if args.frames is not None:
        a += ["--frames", str(args.frames)]
    a += ["--eval-prompts", str(args.eval_prompts), "--eval-offset", str(args.eval_offset),
          "--eval-batch", str(args.eval_batch), "--eval-backend", args.eval_backend, "--doc", _shown(args.doc)]
    return "attnqat repro " + shlex.join(a)


def run(args: argparse.Namespace) -> int:
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = ([s for s in stages if s not in STAGES] + [r for r in runs if r not in RUNS]
           + [c for c in configs if c not in CONFIGS])
    if bad:
        print(f"attnqat repro: unknown stage(s), run(s) or configuration(s) {', '.join(bad)}; "
              f"stages: {', '.join(STAGES)}; runs: {', '.join(RUNS)}; configurations: "
              f"{', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    if (args.steps < 1 or args.batch_size < 1 or args.eval_prompts < 1 or args.probe_prompts < 1
            or args.eval_offset < 0):
        print("attnqat repro: --steps, --batch-size, --eval-prompts and --probe-prompts must be >= 1, "
              "--eval-offset >= 0",
              file=sys.stderr)
        return 2
    try:
        family_for(args.model).check_clip(args.size, args.size, args.frames,
                                          names={"height": "--size", "width": "--size", "frames": "--frames"})
    except ValueError as exc:
        print(f"attnqat repro: {exc}", file=sys.stderr)
        return 2
    command = command_line(args)
    for stage in stages:
        rc = {"train": lambda: stage_train(args, runs), "eval": lambda: stage_eval(args, runs, configs),
              "probe": lambda: stage_probe(args, runs), "report": lambda: stage_report(args, runs, command),
              "ship": lambda: stage_ship(args)}[stage]()
        if rc:
            return rc
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnqat repro", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
