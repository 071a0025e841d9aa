"""``attnqat repro``: the Attn-QAT paper's three claims, measured on the embedded tiny model.

Claims (arXiv 2603.00040), at small scale: (1) naive 4-bit attention degrades a BF16-trained
model; (2) fine-tuning with Attn-QAT recovers the quality without SageAttention3's outlier
heuristics; (3) fine-tuning with a drop-in 4-bit forward and an ordinary backward is unstable.

Evaluation discipline (docs/repro.md): held-out prompts 0-899 are the development set, 900-1399
the confirmatory set (evaluated once, only after ``docs/repro/protocol.md`` is committed), prompts
from 1400 on are never evaluated; the eval and probe stages refuse a range that breaks this
(:func:`attnqat.finetune.heldout.check_prompt_range`) before any work.

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
    and gradient-norm curves as PNG, written to ``--doc`` (default ``WORK/report.md``) with the
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
from .heldout import PROJECT_ROOT, PROTOCOL, PromptRangeError, check_prompt_range
from .plot import plot_runs
from .runlog import device_name, now, read_log, read_record_text, record_file

STAGES = ("train", "eval", "probe", "report", "ship")
#: run name → (student attention, ablation, label)
RUNS: dict[str, tuple[str, str | None, str]] = {
    "attnqat": ("attnqat", None, "Attn-QAT"),
    "bf16": ("bf16", None, "BF16 control"),
    "dropin": ("dropin", None, "drop-in FP4 (ordinary backward)"),
    "p2off": ("attnqat", "d_from_o", "Attn-QAT, principle 2 off (D from O)"),
    "p1off": ("attnqat", "p_unquantized", "Attn-QAT, principle 1 off (P not re-quantized)"),
    "qad": ("attnqat", None, "Attn-QAT, distillation objective"),
    **{f"qad-lora{r}": ("attnqat", None, f"Attn-QAT, distillation objective, LoRA rank {r}")
       for r in (8, 32, 128)},
    "sagebwd": ("sagebwd", None, "SageBwd (INT8) fine-tuning"),
}
#: the runs `--runs` names when not given (the LoRA and SageBwd runs are asked for by name)
DEFAULT_RUNS = ("attnqat", "bf16", "dropin", "p2off", "p1off", "qad")
#: the training objective of a run (``attnqat finetune train --objective``); unnamed runs: flow
RUN_OBJECTIVE: dict[str, str] = {"qad": "distill", **{f"qad-lora{r}": "distill" for r in (8, 32, 128)}}
#: LoRA runs: their rank (``--lora-rank``); exported with the adapter merged into the base
RUN_LORA: dict[str, int] = {f"qad-lora{r}": r for r in (8, 32, 128)}
#: configuration → (weights: "base" or a run, attention at inference, label)
CONFIGS: dict[str, tuple[str, str, str]] = {
    **{f"base-{m}": ("base", m, f"base, {registry.label(m)} attention") for m in registry.inference()},
    "qat-nvfp4": ("attnqat", "nvfp4", "Attn-QAT, NVFP4 attention"),
    "qat-bf16": ("attnqat", "bf16", "Attn-QAT, BF16 attention"),
    "control-bf16": ("bf16", "bf16", "BF16 control, BF16 attention"),
    "control-nvfp4": ("bf16", "nvfp4", "BF16 control, NVFP4 attention"),
    "dropin-nvfp4": ("dropin", "nvfp4", "drop-in, NVFP4 attention"),
    "p2off-nvfp4": ("p2off", "nvfp4", "principle 2 off, NVFP4 attention"),
    "p1off-nvfp4": ("p1off", "nvfp4", "principle 1 off, NVFP4 attention"),
    "qad-nvfp4": ("qad", "nvfp4", "Attn-QAT (distill), NVFP4 attention"),
    "qad-bf16": ("qad", "bf16", "Attn-QAT (distill), BF16 attention"),
    **{f"qad-lora{r}-{m}": (f"qad-lora{r}", m, f"Attn-QAT (distill) LoRA r{r}, {registry.label(m)} attention")
       for r in (8, 32, 128) for m in ("nvfp4", "bf16")},
    **{f"sbwd-{m}": ("sagebwd", m, f"SageBwd fine-tuned, {registry.label(m)} attention")
       for m in ("sagebwd", "nvfp4", "bf16")},
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
         ("dropin-nvfp4", "base-bf16"), ("p2off-nvfp4", "base-bf16"), ("p1off-nvfp4", "base-bf16"),
         ("qad-nvfp4", "base-bf16"), ("qad-nvfp4", "base-nvfp4"), ("qad-nvfp4", "qat-nvfp4"),
         ("qad-nvfp4", "qad-bf16"),
         # how much of full fine-tuning's NVFP4 recovery LoRA keeps (issue 37), per rank
         *((f"qad-lora{r}-nvfp4", b) for r in (8, 32, 128) for b in ("base-nvfp4", "qad-nvfp4")),
         # SageBwd fine-tuning with its own INT8 attention and with NVFP4 (SageAttention3 Table 5);
         # INT8 attention's own cost to the base first
         ("base-sagebwd", "base-bf16"), ("sbwd-sagebwd", "base-bf16"), ("sbwd-sagebwd", "base-sagebwd"), ("sbwd-nvfp4", "base-nvfp4"),
         ("sbwd-nvfp4", "qat-nvfp4"), ("sbwd-nvfp4", "control-nvfp4"), ("sbwd-bf16", "control-bf16"))
#: docs/repro/protocol.md §6: H1's equivalence margin (all-correct rate) and the family-wise α of H2–H5
MARGIN, ALPHA = 0.03, 0.05
#: the 4-bit cost of a weight set is its NVFP4 configuration minus its BF16 one; Attn-QAT's is
#: compared with the control's and the base's (claim 2 is that QAT makes the weights robust to it)
COSTS = (("qat", "control"), ("qat", "base"), ("qad", "control"), ("qad", "base"))
WEIGHTS = {"qat": "Attn-QAT", "control": "BF16 control", "base": "base", "qad": "Attn-QAT (distill)"}
ATTRS = ("colour", "shape", "motion")


def add_arguments(parser: argparse.ArgumentParser) -> None:

    parser.add_argument("--work", type=Path, default=Path("runs/repro"),
                        help="working folder: runs/, export/, eval/ (continued across calls)")
    parser.add_argument("--stages", default="train,eval,report",
                        help=f"comma-separated stages, in order: {', '.join(STAGES)}")
    parser.add_argument("--runs", default=",".join(DEFAULT_RUNS),
                        help=f"the fine-tuning runs to train and evaluate: {', '.join(RUNS)} (default: "
                             f"{','.join(DEFAULT_RUNS)})")
    parser.add_argument("--model", default=str(TINY_MODEL_DIR), help="the base pipeline")
    parser.add_argument("--steps", type=int, default=1200, help="optimizer steps of every run")
    parser.add_argument("--batch-size", type=int, default=32, help="clips per step")
    parser.add_argument("--lr", type=float, default=1e-5,
                        help="AdamW learning rate (constant; 2e-5 for 600 steps moved the BF16 "
                             "control 3.5 points off the base: docs/repro/v2.md)")
    parser.add_argument("--lora-lr", type=float, default=None,
                        help="learning rate of the LoRA runs (qad-lora8/32/128); unset: 5 × --lr "
                             "(1e-4 at 2e-5: an adapter of a few thousandths of the weights moves "
                             "less per step, and LoRA is commonly trained several times faster; "
                             "docs/finetune.md, LoRA)")
    parser.add_argument("--warmup", type=int, default=50, help="linear warm-up steps")
    parser.add_argument("--ema", type=float, default=0.998, help="EMA decay of the exported weights (0: live weights)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data stream and the noise")
    parser.add_argument("--seeds", default=None,
                        help="training seeds, comma-separated (e.g. 0,1,2): every run is trained once "
                             "per seed (runs/RUN-sSEED, export/RUN-sSEED) and every configuration "
                             "evaluated per seed; the report shows the spread across seeds next to "
                             "the prompt intervals. Unset: the one --seed, names without a suffix")
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
    parser.add_argument("--doc", type=Path, default=None,
                        help="report to write (default: WORK/report.md; docs/repro.md is written by hand)")
    parser.add_argument("--notes", type=Path, default=None,
                        help="a Markdown file the report includes after its header (how the runs "
                             "were executed, what was tried before, the interpretation)")
    parser.add_argument("--figures", type=Path, default=None,
                        help="folder of the report's PNG curves (default: beside --doc)")
    parser.add_argument("--ship-to", type=Path, default=TINY_QAT_DIR,
                        help="where the ship stage puts the Attn-QAT transformer")
    parser.add_argument("--ship-run", choices=("attnqat", "qad"), default="attnqat",
                        help="the run whose seed-0 export the ship stage ships (the protocol's candidate: "
                             "qad, docs/repro/protocol.md §9)")


def log(msg: str) -> None:
    print(f"[repro] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------
# Train


def seed_list(args) -> list[int]:
    """The training seeds: ``--seeds``, or the one ``--seed``."""
    if getattr(args, "seeds", None) is None:
        return [args.seed]
    return [int(s) for s in str(args.seeds).split(",") if s.strip()]


def run_key(args, name: str, seed: int) -> str:
    """The folder name of run ``name`` trained with ``seed`` (``runs/KEY``, ``export/KEY``):
    ``NAME-sSEED`` under ``--seeds``, the bare name otherwise (the studies before seeds)."""
    return name if getattr(args, "seeds", None) is None else f"{name}-s{seed}"


def units(args, runs: list[str]) -> list[tuple[str, int, str]]:
    """(run, seed, key) of every run × seed, runs first."""
    return [(r, s, run_key(args, r, s)) for r in runs for s in seed_list(args)]


def _start_weights(args, name: str, seed: int | None = None) -> Path:
    """Where run ``name`` starts from under ``--start-from``: that study's export of the run (of
    the same seed when that study has one per seed)."""
    if seed is not None and (args.start_from / "export" / f"{name}-s{seed}").is_dir():
        return args.start_from / "export" / f"{name}-s{seed}"
    return args.start_from / "export" / name


def lora_lr(args) -> float:
    """The learning rate of the LoRA runs: ``--lora-lr``, by default 5 × ``--lr``."""
    return args.lora_lr if getattr(args, "lora_lr", None) is not None else 5 * args.lr


def train_args(args, name: str, seed: int | None = None) -> list[str]:
    """The ``attnqat finetune train`` arguments of run ``name`` with training ``seed`` (default
    ``--seed``)."""
    attention, ablation, _ = RUNS[name]
    seed = args.seed if seed is None else seed
    out = args.work / "runs" / run_key(args, name, seed)
    lr = lora_lr(args) if name in RUN_LORA else args.lr
    a = ["--model", _shown(args.model), "--data", "synthetic", "--out", _shown(out), "--attention", attention,
         "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--lr", str(lr),
         "--warmup", str(args.warmup), "--schedule", "constant", "--ema", str(args.ema),
         "--seed", str(seed), "--two-objects", str(args.two_objects),
         "--workers", str(args.workers), "--device", args.device,
         "--checkpoint-every", str(max(1, args.steps // 4)), "--keep", "1"]
    if not args.progress:
        a.append("--no-progress")
    if ablation:
        a += ["--ablation", ablation, "--backend", "torch"]
    if name in RUN_OBJECTIVE:
        a += ["--objective", RUN_OBJECTIVE[name]]
    if name in RUN_LORA:
        a += ["--lora-rank", str(RUN_LORA[name])]
    if args.start_from is not None:
        a += ["--transformer", _shown(_start_weights(args, name, seed))]
    if args.size is not None:
        a += ["--height", str(args.size), "--width", str(args.size)]
    if args.frames is not None:
        a += ["--frames", str(args.frames)]
    return a


def stage_train(args, runs: list[str]) -> int:

    t0 = time.perf_counter()
    if args.start_from is not None:
        missing = [str(_start_weights(args, r, s)) for r, s, _ in units(args, runs)
                   if not (_start_weights(args, r, s) / "attnqat.json").is_file()]
        if missing:
            log(f"--start-from: no export in {', '.join(missing)}")
            return 2
    for run_name, seed, name in units(args, runs):
        out = args.work / "runs" / name
        done = ckpt.complete_checkpoints(out)
        if not (done and done[-1][0] >= args.steps):
            a = train_args(args, run_name, seed)
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
            export(out, dst, merge=run_name in RUN_LORA)   # LoRA: the base with the adapter fused in
            log(f"exported {name} to {dst}")
    return 0


# ----------------------------------------------------------------------------------------------
# Eval


def _jsonable(x):
    """``x`` with numpy scalars and arrays, tuples and non-finite floats made JSON-safe (None)."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return [_jsonable(v) for v in x.tolist()]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def _clip_record(score: dict, vs_base: tuple | None, vs_own: tuple | None) -> dict:
    """One clip of an evaluation record: every output of the procedural scorer (detected colours,
    shapes, motions per object, the object count, background, temporal measures, the quality
    score; the caption is in the record's ``prompts``), and PSNR/SSIM against the base's BF16
    clip and against the same weights' BF16 clip (None where the clip is that reference; a PSNR
    of None beside an SSIM means identical clips)."""
    rec = _jsonable({k: v for k, v in score.items() if k != "caption"})
    rec["all_correct"] = bool(score["all_correct"])
    rec["background"] = bool(score["background"])
    for o in rec["objects"]:
        for a in ATTRS:
            o[a] = bool(o[a])
    for name, pair in (("base_bf16", vs_base), ("own_bf16", vs_own)):
        rec[f"psnr_vs_{name}"] = None if pair is None or not np.isfinite(pair[0]) else float(pair[0])
        rec[f"ssim_vs_{name}"] = None if pair is None else float(pair[1])
    return rec


def eval_items(args, runs: list[str], configs: list[str]) -> list[tuple[str, int | None, str, str]]:
    """(configuration, training seed or None, weights key, record name) of every evaluation the
    eval stage owes: the base's configurations once, a run's once per seed."""
    wanted = configs or list(CONFIGS)
    out = []
    for c, (w, _, _) in CONFIGS.items():
        if c not in wanted:
            continue
        if w == "base":
            out.append((c, None, "base", c))
        elif w in runs:
            for s in seed_list(args):
                key = run_key(args, w, s)
                out.append((c, None if key == w else s, key, c if key == w else f"{c}-s{s}"))
    return out


def weights_sha256(args, models, key: str) -> dict[str, str]:
    """sha256 of every safetensors file of weight set ``key`` (the base transformer's, or the
    export's), by file name."""
    if key == "base":
        info = getattr(models, "info", None)
        root = Path(args.model) if Path(args.model).is_dir() else getattr(info, "path", None)
        folder = None if root is None else Path(root) / "transformer"
    else:
        folder = args.work / "export" / key
    if folder is None or not folder.is_dir():
        return {}
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
        out[f.name] = h.hexdigest()
    return out


def stage_eval(args, runs: list[str], configs: list[str]) -> int:
    folder = args.work / "eval"
    folder.mkdir(parents=True, exist_ok=True)
    todo = [it for it in eval_items(args, runs, configs) if record_file(folder / f"{it[3]}.json") is None]
    missing = [it[3] for it in todo if it[2] != "base"
               and not (args.work / "export" / it[2] / "attnqat.json").is_file()]
    if missing:
        log(f"no exported weights for {', '.join(missing)} (run the train stage first); skipped")
        todo = [it for it in todo if it[3] not in missing]
    asked = {"height": args.size, "width": args.size, "frames": args.frames}
    done = {f: json.loads(read_record_text(f))["settings"] for f in _eval_files(folder)}
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
    role = heldout.check_prompt_range(args.eval_offset, args.eval_prompts)
    protocol = heldout.protocol_committed()[1] if role == "confirmatory" else None
    base_sha = weights_sha256(args, models, "base")
    base_bf16 = _bf16_reference(args, models, inp, "base", models.pipe.transformer, base_sha)
    for c, seed, key, name in todo:
        _, method, _ = CONFIGS[c]
        t1 = time.perf_counter()
        sha = base_sha if key == "base" else weights_sha256(args, models, key)
        tr = _transformer(args, models, key)
        own = base_bf16 if key == "base" else _bf16_reference(args, models, inp, key, tr, sha)
        clips = own if method == "bf16" else heldout.generate_clips(
            models, tr, inp, method, args.eval_backend, args.eval_batch)
        t2 = time.perf_counter()
        scores = heldout.score_all(inp.prompts, clips, args.workers)
        vs_base = None if c == "base-bf16" else heldout.pairwise_similarity(clips, base_bf16, args.workers)
        vs_own = None if method == "bf16" else (
            vs_base if key == "base" else heldout.pairwise_similarity(clips, own, args.workers))
        rec = {"config": c, "weights": key, "run": CONFIGS[c][0], "seed": seed, "attention": method,
               "weights_sha256": sha, "prompt_set": role, "protocol_commit": protocol, "date": now(),
               "device": device_name(models.device),
               "backend": args.eval_backend, "first_prompt": args.eval_offset,
               "prompts": inp.prompts, "seeds": [s.seed for s in inp.settings],
               "settings": _settings(inp),
               "summary": heldout.summary_row(scores),
               "similarity_to_base_bf16": None if vs_base is None else heldout.summarize_similarity(vs_base),
               "similarity_to_own_bf16": None if vs_own is None else heldout.summarize_similarity(vs_own),
               "clips": [_clip_record(s, None if vs_base is None else vs_base[i],
                                      None if vs_own is None else vs_own[i]) for i, s in enumerate(scores)],
               "generate_s": round(t2 - t1, 1), "score_s": round(time.perf_counter() - t2, 1)}
        if key != "base":
            rec["weights_record"] = json.loads((args.work / "export" / key / "attnqat.json").read_text())
        (folder / f"{name}.json").write_text(json.dumps(rec, indent=1) + "\n")
        log(f"{name}: all-correct {rec['summary']['all_correct']:.3f} ({t2 - t1:.1f} s generating, "
            f"{rec['score_s']} s scoring)")
        if key != "base":
            del tr
    return 0


def stage_probe(args, runs: list[str]) -> int:
    """``WORK/probe.json``: :func:`attn_probe.attention_errors` of the base and of every run whose
    export exists, on the first ``--probe-prompts`` held-out prompts at the study's clip size
    (weight sets already in the file are kept)."""


    out = args.work / "probe.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rec = json.loads(out.read_text()) if out.is_file() else {}
    todo = [w for w in ("base", *(k for _, _, k in units(args, runs))) if w not in rec.get("weights", {})
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


def _bf16_reference(args, models, inp, key: str, transformer, sha: dict[str, str]) -> list[np.ndarray]:
    """Weight set ``key``'s BF16 clips of the held-out prompts (the base's: what every
    configuration's PSNR/SSIM is measured against; a run's: what its 4-bit clips are compared with),
    generated once per work folder, weights, model and prompt range and kept in ``WORK/cache``
    (``*.npy``, uint8), so that later calls and parallel eval processes load them."""

    model = hashlib.sha1(str(Path(args.model).resolve()).encode()).hexdigest()[:8]
    s = inp.settings[0]
    tag = "" if key == "base" else "-" + (next(iter(sha.values()))[:8] if sha else "nosha")
    cache = args.work / "cache" / (f"{key}-bf16-{args.eval_offset}-{args.eval_prompts}-"
                                   f"{args.eval_backend}-{s.height}x{s.width}x{s.frames}-{model}{tag}.npy")
    if cache.is_file():
        clips = list(np.load(cache))
        log(f"{key} BF16 reference clips: {len(clips)} from {cache}")
        return clips
    t0 = time.perf_counter()
    clips = heldout.generate_clips(models, transformer, inp, "bf16", args.eval_backend, args.eval_batch)
    log(f"{key} BF16 reference clips: {len(clips)} in {time.perf_counter() - t0:.1f} s")
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


def paired(a, b, n_boot: int = 10000, seed: int = 0, level: float = 0.95) -> dict:
    """A against B on the same prompts and seeds (per-prompt outcomes: all-correct as 0/1, or its
    mean over training seeds): the difference of the means, its paired-bootstrap interval at
    ``level`` (resampling prompts), and a two-sided p — the exact McNemar test (binomial test of
    the discordant pairs) when both are 0/1, else the sign-flip permutation test of the per-prompt
    differences (:func:`sign_flip_p`, of which McNemar's exact test is the 0/1 case).
    ``only_a``/``only_b``: prompts where A / B is ahead."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape or not len(x):
        raise ValueError("paired comparison of unequal or empty outcome lists")
    d = x - y
    only_a, only_b = int((d > 0).sum()), int((d < 0).sum())
    lo, hi = _bootstrap(d, n_boot, seed, level)
    return {"diff": float(d.mean()), "lo": lo, "hi": hi, "level": level, "only_a": only_a,
            "only_b": only_b, "p": sign_flip_p(d), "n": len(x),
            "test": "mcnemar" if _binary(x) and _binary(y) else "sign-flip"}


def _binary(x: np.ndarray) -> bool:
    return bool(np.isin(x, (0.0, 1.0)).all())


def sign_flip_p(d, n_perm: int = 100000, seed: int = 0) -> float:
    """Two-sided p of the paired sign-flip test of per-prompt differences ``d``: under no
    difference each prompt's sign is a fair coin. Differences in {−1, 0, 1} (two 0/1 outcomes):
    exact, the binomial test of the discordant pairs (McNemar's exact test); otherwise
    ``n_perm`` random sign flips (the observed one counted)."""

    d = np.asarray(d, dtype=float)
    d = d[d != 0]
    if not len(d):
        return 1.0
    if np.isin(d, (-1.0, 1.0)).all():
        return float(sign_test(int((d > 0).sum()), int((d < 0).sum())))
    obs = abs(d.sum())
    rng = np.random.default_rng(seed)
    hits = 0
    for i in range(0, n_perm, 10000):
        m = min(10000, n_perm - i)
        s = rng.integers(0, 2, size=(m, len(d))) * 2 - 1
        hits += int((np.abs(s @ d) >= obs - 1e-9).sum())
    return (hits + 1) / (n_perm + 1)


def holm(pvalues: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjusted p-values (family-wise error control) of a named family."""
    names = sorted(pvalues, key=lambda k: pvalues[k])
    m, out, running = len(names), {}, 0.0
    for i, k in enumerate(names):
        running = max(running, min(1.0, (m - i) * pvalues[k]))
        out[k] = running
    return out


def _bootstrap(d: np.ndarray, n_boot: int, seed: int, level: float = 0.95) -> tuple[float, float]:
    """``level`` interval of the mean of per-prompt values ``d`` (prompts resampled with replacement)."""
    idx = np.random.default_rng(seed).integers(0, len(d), size=(n_boot, len(d)))
    boot = d[idx].mean(axis=1)
    a = (1 - level) / 2
    return float(np.quantile(boot, a)), float(np.quantile(boot, 1 - a))


def won_back(q_fp4, q_base_fp4, q_base_bf16, n_boot: int = 10000, seed: int = 0) -> dict:
    """Share of the base's NVFP4 loss of a per-prompt score (the quality score) that a weight set
    with NVFP4 attention wins back, R = (mean q_fp4 − mean q_base_fp4) / (mean q_base_bf16 − mean
    q_base_fp4), with its 95 % paired-bootstrap interval and the one-sided bootstrap p of R ≤ ½."""
    x = [np.asarray(v, dtype=float) for v in (q_fp4, q_base_fp4, q_base_bf16)]
    if len({len(v) for v in x}) != 1 or not len(x[0]):
        raise ValueError("won-back share of unequal or empty score lists")
    idx = np.random.default_rng(seed).integers(0, len(x[0]), size=(n_boot, len(x[0])))
    m = [v[idx].mean(axis=1) for v in x]
    with np.errstate(divide="ignore", invalid="ignore"):
        boot = (m[0] - m[1]) / (m[2] - m[1])
    loss = float(x[2].mean() - x[1].mean())
    r = float((x[0].mean() - x[1].mean()) / loss) if loss else float("nan")
    boot = boot[np.isfinite(boot)]
    return {"share": r, "lo": float(np.quantile(boot, 0.025)), "hi": float(np.quantile(boot, 0.975)),
            "p_at_most_half": float((boot <= 0.5).mean()), "loss": loss, "n": len(x[0])}


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
            "diff": float(d.mean()), "lo": lo, "hi": hi, "n": len(d), "p": sign_flip_p(d)}


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


def _eval_files(folder: Path) -> list[Path]:
    """A folder's evaluation records, plain (``NAME.json``) or gzipped (``NAME.json.gz``)."""
    return sorted([*folder.glob("*.json"), *folder.glob("*.json.gz")]) if folder.is_dir() else []


def load_evals(work: Path) -> dict[str, list[dict]]:
    """Every evaluation record of ``WORK/eval``, by configuration (in :data:`CONFIGS` order), a
    configuration's records sorted by training seed (one record: no seeds, or the base)."""
    by: dict[str, list[dict]] = {}
    for f in _eval_files(work / "eval"):
        rec = json.loads(read_record_text(f))
        if rec.get("config") in CONFIGS:
            by.setdefault(rec["config"], []).append(rec)
    return {c: sorted(by[c], key=lambda r: -1 if r.get("seed") is None else r["seed"])
            for c in CONFIGS if c in by}


def outcomes(recs: list[dict], field: str = "all_correct") -> np.ndarray | None:
    """Per-prompt ``field`` of a configuration's records, averaged over its training seeds (None
    when a record lacks the field, e.g. ``quality`` in records made before it was kept)."""
    try:
        return np.mean([[float(c[field]) for c in r["clips"]] for r in recs], axis=0)
    except KeyError:
        return None


def seed_spread(recs_a: list[dict], recs_b: list[dict], field: str = "all_correct") -> dict | None:
    """Each training seed's own difference of mean ``field``: A's seed s against B's seed s when
    both have seeds, else every seed of the one against the other's one record. The differences by
    seed, min, max and standard deviation; None when neither side has several seeds."""
    if max(len(recs_a), len(recs_b)) < 2:
        return None

    def mean(r: dict) -> float:
        return float(np.mean([float(c[field]) for c in r["clips"]]))

    diffs = {}
    if len(recs_a) > 1 and len(recs_b) > 1:
        bs = {r.get("seed"): r for r in recs_b}
        for ra in recs_a:
            if (rb := bs.get(ra.get("seed"))) is not None:
                diffs[str(ra.get("seed"))] = mean(ra) - mean(rb)
    elif len(recs_a) > 1:
        diffs = {str(ra.get("seed")): mean(ra) - mean(recs_b[0]) for ra in recs_a}
    else:
        diffs = {str(rb.get("seed")): mean(recs_a[0]) - mean(rb) for rb in recs_b}
    if not diffs:
        return None
    v = np.array(list(diffs.values()))
    return {"by_seed": diffs, "min": float(v.min()), "max": float(v.max()),
            "sd": float(v.std(ddof=1)) if len(v) > 1 else 0.0}


def same_weights(recs_a: list[dict], recs_b: list[dict]) -> tuple[list[dict], list[dict]]:
    """Two configurations of one weight set (its NVFP4 and BF16 records, say) restricted to the
    training seeds both have, so that each seed's weights are compared with themselves."""
    common = {r.get("seed") for r in recs_a} & {r.get("seed") for r in recs_b}
    return [r for r in recs_a if r.get("seed") in common], [r for r in recs_b if r.get("seed") in common]


def _spread(s: dict | None) -> str:
    if s is None:
        return "–"
    return (f"{100 * s['min']:+.1f} … {100 * s['max']:+.1f} (sd {100 * s['sd']:.1f}, "
            f"{len(s['by_seed'])} seeds)")


def _label(c: str, recs: list[dict]) -> str:
    n = len(recs)
    return CONFIGS[c][2] + (f" ({n} seeds)" if n > 1 else "")


def _report_header(args, ev: dict, run_dirs: dict, command: str, role: str) -> tuple[list[str], dict | None]:
    """The report's title, how it was made, the evaluation and the fine-tuning settings; and the
    first run's config (None without runs)."""
    e0 = ev["base-bf16"][0]
    s = e0["settings"]
    n = len(e0["clips"])
    first = e0["first_prompt"]
    seeds = sorted({r.get("seed") for recs in ev.values() for r in recs if r.get("seed") is not None})
    lines = ["# Attn-QAT on the embedded tiny model", "",
             f"Written by `{command}` on {now()[:10]} (every number below comes from it; the "
             "training and evaluation stages can run in several calls, each continuing the last)."]
    lines += ["", f"Evaluation: held-out prompts {first}–{first + n - 1} ({role}; prompt i with seed i; "
              f"colour × shape × motion triples never shown in training), "
              f"{s['width']} × {s['height']}, "
              f"{s['frames']} frames, {s['steps']} steps, guidance {s['guidance']}, shift {s['shift']}, "
              f"attention backend `{e0['backend']}`, scored by the procedural judge "
              f"(`attnqat eval score`), on {e0['device']}. Training seeds: "
              f"{', '.join(map(str, seeds)) if seeds else 'one (' + str(args.seed) + ')'}; a configuration "
              "of several seeds is scored per prompt by the mean over its seeds."]
    if args.notes is not None:
        lines += ["", args.notes.read_text().strip()]
    if not run_dirs:
        return lines, None
    cfg0 = json.loads((next(iter(run_dirs.values()))[2] / "config.json").read_text())
    start = (f"`{_shown(cfg0['model'])}`" if not cfg0.get("transformer") else
             f"each run's own earlier export (`{_shown(Path(cfg0['transformer']).parent)}/RUN`: "
             "a continuation with a fresh optimizer and warm-up)")
    lines += ["", f"Fine-tuning (every run the same but for the student attention and the objective): from "
              f"{start}, {cfg0['width']} × {cfg0['height']} clips of {cfg0['frames']} frames, "
              f"the synthetic shapes stream (training split, "
              f"{cfg0.get('two_objects') if cfg0.get('two_objects') is not None else 0.5:.0%} two-object clips), "
              f"{cfg0['steps']} steps of batch {cfg0['batch_size']}, AdamW lr {cfg0['lr']} "
              f"({cfg0['schedule']}, {cfg0['warmup']} warm-up steps), weight decay "
              f"{cfg0['weight_decay']}, clipping {cfg0['grad_clip']}, caption dropout "
              f"{cfg0['caption_dropout']}, flow shift {cfg0['shift']}, EMA {cfg0['ema']} "
              f"(the exported weights), self-attention quantized, VAE and text encoder frozen. "
              "Each run is `attnqat finetune train` with:", ""]
    for k, (r, sd, _) in run_dirs.items():
        lines.append(f"- {RUNS[r][2]}{'' if k == r else f' (seed {sd})'}: "
                     f"`attnqat finetune train {shlex.join(train_args(args, r, sd))}`")
    return lines, cfg0


def _quality_section(ev: dict) -> list[str]:
    """Per configuration: attribute rates, all-correct rate, quality score, PSNR/SSIM."""
    lines = ["", "## Quality", "",
             "Object-level rates for colour, shape and motion (one- and two-object prompts); clip-level "
             "rate of clips with everything right, pooled over training seeds; 95 % Wilson intervals in "
             "brackets (of the pooled clips: with several seeds the spread across seeds is the honest "
             "width, shown beside it); the scorer's mean quality score; PSNR and SSIM against the base "
             "model's BF16 clip of the same prompt and seed, and PSNR against the same weights' BF16 clip.",
             "", "| configuration | colour | shape | motion | all correct | across seeds | quality | "
             "PSNR vs base BF16 | SSIM | PSNR vs own BF16 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c, recs in ev.items():
        objs = [o for r in recs for clip in r["clips"] for o in clip["objects"]]
        allc = sum(clip["all_correct"] for r in recs for clip in r["clips"])
        nclips = sum(len(r["clips"]) for r in recs)
        per = [r["summary"]["all_correct"] for r in recs]
        across = "–" if len(recs) < 2 else f"{100 * min(per):.1f} – {100 * max(per):.1f} %"
        qual = np.mean([r["summary"].get("quality", np.nan) for r in recs])
        sims = [r.get("similarity_to_base_bf16") for r in recs]
        ps = [x["psnr"] for x in sims if x and x.get("psnr") is not None]
        psnr = f"{np.mean(ps):.2f} dB" if ps else "–"
        ssim = f"{np.mean([x['ssim'] for x in sims if x]):.3f}" if any(sims) else "–"
        own = [x["psnr"] for r in recs if (x := r.get("similarity_to_own_bf16")) and x.get("psnr") is not None]
        psnr_own = f"{np.mean(own):.2f} dB" if own else "–"
        lines.append(f"| {_label(c, recs)} | " + " | ".join(_rate(sum(o[a] for o in objs), len(objs))
                                                        for a in ATTRS)
                     + f" | {_rate(allc, nclips)} | {across} | "
                     + ("–" if np.isnan(qual) else f"{qual:.3f}") + f" | {psnr} | {ssim} | {psnr_own} |")
    return lines


def _paired_section(ev: dict) -> tuple[list[str], dict, dict]:
    """The :data:`PAIRS` both of whose configurations were evaluated: lines, paired results, spreads."""
    lines = ["", "## Paired comparisons", "",
             "All-correct rate of A minus B on the same prompts and seeds (a configuration of several "
             "training seeds: the per-prompt mean over them); 95 % paired-bootstrap interval (10,000 "
             "resamples of the prompts); two-sided p: exact McNemar test on the clips only one of the two "
             "gets right (one seed each), or its sign-flip permutation form on seed means. Beside it, "
             "each training seed's own difference: the spread across seeds.", "",
             "| A | B | A − B (points) | 95 % interval | A ahead | B ahead | p | across seeds |",
             "|---|---|---|---|---|---|---|---|"]
    verdicts, spreads = {}, {}
    for a, b in PAIRS:
        if a in ev and b in ev:
            ra, rb = ev[a], ev[b]
            if CONFIGS[a][0] == CONFIGS[b][0]:   # one weight set: each seed against itself
                ra, rb = same_weights(ra, rb)
                if not ra:
                    continue
            pr = paired(outcomes(ra), outcomes(rb))
            verdicts[(a, b)] = pr
            spreads[(a, b)] = seed_spread(ra, rb)
            lines.append(f"| {_label(a, ra)} | {_label(b, rb)} | {100 * pr['diff']:+.1f} | "
                         f"[{100 * pr['lo']:+.1f}, {100 * pr['hi']:+.1f}] | {pr['only_a']} | "
                         f"{pr['only_b']} | {_p(pr['p'])} | {_spread(spreads[(a, b)])} |")
    return lines, verdicts, spreads


def _costs_section(ev: dict) -> tuple[list[str], dict]:
    """The :data:`COSTS` (a weight set's 4-bit cost against another's) that can be computed."""
    costs = {}
    for a, b in COSTS:
        cfgs = [f"{a}-nvfp4", f"{a}-bf16", f"{b}-nvfp4", f"{b}-bf16"]
        if all(c in ev for c in cfgs):
            a4, a16 = same_weights(ev[cfgs[0]], ev[cfgs[1]])
            b4, b16 = same_weights(ev[cfgs[2]], ev[cfgs[3]])
            if not (a4 and b4):
                continue
            costs[(a, b)] = cost_difference(*[outcomes(x) for x in (a4, a16, b4, b16)])
            costs[(a, b)]["seed_costs"] = {"a": seed_spread(a4, a16), "b": seed_spread(b4, b16)}
            costs[(a, b)]["seeds"] = {"a": [r.get("seed") for r in a4], "b": [r.get("seed") for r in b4]}
    if not costs:
        return [], costs
    lines = ["", "## Robustness to 4-bit attention", "",
             "A weight set's 4-bit cost: its all-correct rate with NVFP4 attention minus with BF16 "
             "attention. The difference of two costs is paired over prompts (the four clips of a "
             "prompt resampled together, 10,000 times); positive: the first loses less. Beside each "
             "cost, its spread across training seeds.", "",
             "| weights A | weights B | cost of A (points) | cost of B | A − B | 95 % interval | p | "
             "A's cost across seeds | B's |", "|---|---|---|---|---|---|---|---|---|"]
    for (a, b), c in costs.items():
        lines.append(f"| {WEIGHTS[a]} | {WEIGHTS[b]} | {100 * c['cost_a']:+.1f} | {100 * c['cost_b']:+.1f} | "
                     f"{100 * c['diff']:+.1f} | [{100 * c['lo']:+.1f}, {100 * c['hi']:+.1f}] | {_p(c['p'])} | "
                     f"{_spread(c['seed_costs']['a'])} | {_spread(c['seed_costs']['b'])} |")
    return lines, costs


def _won_back_section(ev: dict) -> tuple[list[str], dict]:
    """The share of the base's NVFP4 quality-score loss each configuration wins back."""
    shares = {}
    qb, qb16 = outcomes(ev["base-nvfp4"], "quality") if "base-nvfp4" in ev else None, outcomes(ev["base-bf16"], "quality")
    if qb is not None and qb16 is not None:
        for c in ("qat-nvfp4", "qad-nvfp4", *(f"qad-lora{r}-nvfp4" for r in (8, 32, 128)),
                  "control-nvfp4", "sbwd-nvfp4", "base-sage3"):
            if c in ev and (q := outcomes(ev[c], "quality")) is not None:
                shares[c] = won_back(q, qb, qb16)
    if not shares:
        return [], shares
    lines = ["", "## Quality score: NVFP4 loss won back", "",
             "The scorer's quality score (blur, noise, stray pixels, flicker: what the all-correct rate "
             "cannot see) averaged over prompts. The base loses "
             f"{next(iter(shares.values()))['loss']:.3f} of it to NVFP4 attention; the share of that loss "
             "a configuration wins back, with its 95 % paired-bootstrap interval and the one-sided "
             "bootstrap p of a share ≤ ½.", "",
             "| configuration | share won back | 95 % interval | p (share ≤ ½) |", "|---|---|---|---|"]
    for c, w in shares.items():
        lines.append(f"| {_label(c, ev[c])} | {100 * w['share']:.0f} % | [{100 * w['lo']:.0f}, "
                     f"{100 * w['hi']:.0f}] % | {_p(w['p_at_most_half'])} |")
    return lines, shares


def _probe_section(args) -> list[str]:
    """The per-layer NVFP4 error probe's table (``WORK/probe.json``), if the probe stage ran."""
    if not (args.work / "probe.json").is_file():
        return []
    probe = json.loads((args.work / "probe.json").read_text())
    if not probe:
        return []
    ps = probe["settings"]
    names = {"base": "base", **{r: RUNS[r][2] for r in RUNS},
             **{k: f"{RUNS[r][2]} (seed {sd})" for r, sd, k in units(args, list(RUNS)) if k != r}}
    lines = ["", "## 4-bit attention inside the model", "",
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


def _endpoints_section(args, ev: dict, endpoints: dict, role: str) -> list[str]:
    """The protocol's primary and Holm-adjusted secondary endpoints, per arm."""
    commits = sorted({r["protocol_commit"] for recs in ev.values() for r in recs if r.get("protocol_commit")})
    status = (f"confirmatory: every record was made under the protocol of commit {', '.join(commits)}"
              if role.startswith("confirmatory") and commits else
              "on development prompts these are exploratory, whatever they show")
    lines = ["", "## The protocol's endpoints", "",
             f"As {_protocol_link(args.doc)} names them ({status}). Primary: Attn-QAT in NVFP4 "
             "against the base in BF16, 90 % paired interval inside ±3 points. Secondary family, Holm-adjusted: "
             "H2 above naive NVFP4, H3 at least half of the quality score's NVFP4 loss won back, H4 against "
             "SageAttention3, H5 a smaller 4-bit cost than the BF16 control's (for the distillation run: "
             "than the base's, protocol §9).", ""]
    for arm, e in endpoints.items():
        pr = e.get("primary")
        if pr is not None:
            lines.append(f"- {WEIGHTS[arm]}, primary: {100 * pr['diff']:+.1f} points, 90 % interval "
                         f"[{100 * pr['lo']:+.1f}, {100 * pr['hi']:+.1f}]: "
                         + ("inside ±3 — supported." if pr["supported"] else "not inside ±3 — not supported."))
        for h, v in e.get("secondary", {}).items():
            lines.append(f"- {WEIGHTS[arm]}, {h}: {v['what']}; p {_p(v['p'], '= ')}, Holm-adjusted "
                         f"{_p(v['p_holm'], '= ')}: {'shown' if v['shown'] else 'not shown'}.")
    return lines


def _target_section(endpoints: dict, verdicts: dict, costs: dict) -> list[str]:
    """Each arm against the protocol's target, and Attn-QAT's headline comparisons."""
    target = []
    for arm, e in endpoints.items():
        pr, sec = e.get("primary"), e.get("secondary", {})
        h1 = pr is not None and pr["supported"]
        shown = [h for h in ("H2", "H3") if any(k.startswith(h) and v["shown"] for k, v in sec.items())]
        target.append(f"- {WEIGHTS[arm]}: the protocol's target (H1 supported, H2 and H3 shown after Holm) is "
                      + ("met." if h1 and shown == ["H2", "H3"] else
                         f"not met (H1 {'supported' if h1 else 'not supported'}; shown: "
                         f"{', '.join(shown) or 'neither H2 nor H3'})."))
    q = verdicts.get(("qat-nvfp4", "base-bf16"))
    if q is not None:
        within = -0.05 <= q["lo"] and q["hi"] <= 0.05
        target.append(f"- QAT-NVFP4 against base-BF16: {100 * q['diff']:+.1f} points "
                      f"[{100 * q['lo']:+.1f}, {100 * q['hi']:+.1f}], p {_p(q['p'], '= ')}: the test "
                      f"{'does not reject' if q['p'] >= 0.05 else 'rejects'} equality; the 95 % interval "
                      f"{'lies' if within else 'does not lie'} within ±5 points.")
    for b, against in (("base-nvfp4", "base-NVFP4"),
                       ("control-nvfp4", "the BF16 control with NVFP4 attention (what the extra training "
                                         "alone gives)"),
                       ("control-bf16", "the BF16 control with BF16 attention (the same fine-tuning, BF16 "
                                        "attention in training and inference)")):
        v = verdicts.get(("qat-nvfp4", b))
        if v is not None:
            target.append(f"- QAT-NVFP4 against {against}: {100 * v['diff']:+.1f} points "
                          f"[{100 * v['lo']:+.1f}, {100 * v['hi']:+.1f}], p {_p(v['p'], '= ')}.")
    c = costs.get(("qat", "control"))
    if c is not None:
        target.append(f"- Attn-QAT's own 4-bit cost against the BF16 control's (what training with 4-bit "
                      f"attention buys in robustness): {100 * c['cost_a']:+.1f} against "
                      f"{100 * c['cost_b']:+.1f} points, difference {100 * c['diff']:+.1f} "
                      f"[{100 * c['lo']:+.1f}, {100 * c['hi']:+.1f}].")
    return ["", "## Against the target", "", *target] if target else []


def _training_section(args, run_dirs: dict, cfg0: dict, figs: Path) -> list[str]:
    """The runs' curves (PNG beside the report) and their stability table."""
    curves = figs / "repro_curves.png"
    labels = {k: RUNS[r][2] + ("" if k == r else f" (seed {sd})") for k, (r, sd, _) in run_dirs.items()}
    plot_runs([d for _, _, d in run_dirs.values()], curves, labels=list(labels.values()), smooth=25,
              title="fine-tuning runs of the tiny model")
    lines = ["", "## Training", "", f"![loss and gradient norm of every run]({_rel(curves, args.doc)})", "",
             "| run | steps | loss, first 10 % | loss, last 10 % | median gradient norm | max | "
             "steps clipped | non-finite |", "|---|---|---|---|---|---|---|---|"]
    for k, (r, sd, d) in run_dirs.items():
        st = _stability(read_log(d), cfg0["grad_clip"])
        lines.append(f"| {labels[k]} | {st['steps']} | {st['loss_first']:.4f} | {st['loss_last']:.4f} | "
                     f"{st['grad_median']:.3f} | {st['grad_max']:.3f} | {st['clipped']} | "
                     f"{'yes' if st['nonfinite'] else 'no'} |")
    if "dropin" in run_dirs and "attnqat" in run_dirs:
        dropin = figs / "repro_dropin.png"
        plot_runs([run_dirs["attnqat"][2], run_dirs["dropin"][2]], dropin,
                  labels=[RUNS["attnqat"][2], RUNS["dropin"][2]], smooth=25,
                  title="Attn-QAT against drop-in FP4 fine-tuning")
        lines += ["", f"![Attn-QAT against drop-in]({_rel(dropin, args.doc)})"]
    return lines


def stage_report(args, runs: list[str], command: str) -> int:
    """Write ``args.doc`` (Markdown, its curves beside it or in ``args.figures``) and
    ``WORK/report.json`` from the evaluation records and the runs' logs."""
    ev = load_evals(args.work)
    if "base-bf16" not in ev:
        log("nothing to report: run the eval stage first")
        return 2
    figs = args.figures or args.doc.parent
    figs.mkdir(parents=True, exist_ok=True)
    run_dirs = {k: (r, s, args.work / "runs" / k) for r, s, k in units(args, runs)
                if record_file(args.work / "runs" / k / "log.jsonl")}
    e0 = ev["base-bf16"][0]
    first, last = e0["first_prompt"], e0["first_prompt"] + len(e0["clips"]) - 1
    role = ("confirmatory (evaluated once, after docs/repro/protocol.md)" if last >= 900 else
            "development — exploratory: these prompts may have chosen settings")
    lines, cfg0 = _report_header(args, ev, run_dirs, command, role)
    lines += _quality_section(ev)
    paired_lines, verdicts, spreads = _paired_section(ev)
    costs_lines, costs = _costs_section(ev)
    won_lines, shares = _won_back_section(ev)
    lines += paired_lines + costs_lines + won_lines + _probe_section(args)
    endpoints = protocol_endpoints(ev, verdicts, costs, shares)
    lines += _endpoints_section(args, ev, endpoints, role) + _target_section(endpoints, verdicts, costs)
    if run_dirs:
        lines += _training_section(args, run_dirs, cfg0, figs)
    args.doc.parent.mkdir(parents=True, exist_ok=True)
    args.doc.write_text("\n".join(lines) + "\n")
    (args.work / "report.json").write_text(json.dumps(_jsonable(
        {"date": now(), "command": command, "prompts": [first, last], "prompt_set": role,
         "pairs": {f"{a} vs {b}": v for (a, b), v in verdicts.items()},
         "seed_spreads": {f"{a} vs {b}": v for (a, b), v in spreads.items() if v is not None},
         "cost_differences": {f"{a} vs {b}": v for (a, b), v in costs.items()},
         "won_back": shares, "endpoints": endpoints,
         "summaries": {(c if r.get("seed") is None else f"{c}-s{r['seed']}"): r["summary"]
                       for c, recs in ev.items() for r in recs},
         "weights_sha256": {(c if r.get("seed") is None else f"{c}-s{r['seed']}"): r.get("weights_sha256")
                            for c, recs in ev.items() for r in recs}}), indent=1) + "\n")
    log(f"wrote {args.doc}")
    return 0


def _protocol_link(doc: Path) -> str:
    """docs/repro/protocol.md as a Markdown link from ``doc`` when both lie in the project, else
    its path."""

    proto = PROJECT_ROOT / PROTOCOL
    if Path(doc).resolve().is_relative_to(PROJECT_ROOT):
        return f"[{PROTOCOL}]({_rel(proto, doc)})"
    return f"`{PROTOCOL}`"


def protocol_endpoints(ev: dict, verdicts: dict, costs: dict, shares: dict) -> dict:
    """docs/repro/protocol.md's endpoints for each 4-bit fine-tuned arm present (``qat``; ``qad``):
    the primary (NVFP4 against the base in BF16, 90 % paired interval) and the secondary family
    H2–H5 with Holm-adjusted p (only the members that could be computed enter the family). H5's
    control is the BF16 control run for ``qat`` and the base for ``qad`` (protocol §9)."""
    out = {}
    for arm in ("qat", "qad"):
        a = f"{arm}-nvfp4"
        if a not in ev or "base-bf16" not in ev:
            continue
        e = {"primary": paired(outcomes(ev[a]), outcomes(ev["base-bf16"]), level=0.90)}
        e["primary"]["supported"] = bool(-MARGIN <= e["primary"]["lo"] and e["primary"]["hi"] <= MARGIN)
        sec = {}
        if (v := verdicts.get((a, "base-nvfp4"))) is None and "base-nvfp4" in ev:
            v = paired(outcomes(ev[a]), outcomes(ev["base-nvfp4"]))
        if v is not None:
            sec["H2 vs naive NVFP4"] = {"what": f"{100 * v['diff']:+.1f} points [{100 * v['lo']:+.1f}, "
                                                f"{100 * v['hi']:+.1f}]", "p": v["p"]}
        if (w := shares.get(a)) is not None:
            sec["H3 quality-score loss won back"] = {"what": f"{100 * w['share']:.0f} % [{100 * w['lo']:.0f}, "
                                                             f"{100 * w['hi']:.0f}] (H0: ≤ 50 %)",
                                                     "p": w["p_at_most_half"]}
        if "base-sage3" in ev:
            v = paired(outcomes(ev[a]), outcomes(ev["base-sage3"]))
            sec["H4 vs SageAttention3"] = {"what": f"{100 * v['diff']:+.1f} points [{100 * v['lo']:+.1f}, "
                                                   f"{100 * v['hi']:+.1f}]", "p": v["p"]}
        # protocol §9: a distillation run's BF16 control would be its own teacher, the base
        ctrl = "base" if arm == "qad" else "control"
        if (c := costs.get((arm, ctrl))) is not None:
            sec[f"H5 4-bit cost vs the {'base' if ctrl == 'base' else 'control'}'s"] = {"what": f"{100 * c['cost_a']:+.1f} vs {100 * c['cost_b']:+.1f} "
                                                             f"points, difference {100 * c['diff']:+.1f} "
                                                             f"[{100 * c['lo']:+.1f}, {100 * c['hi']:+.1f}]",
                                                     "p": c["p"]}
        adj = holm({h: v["p"] for h, v in sec.items()})
        for h in sec:
            sec[h]["p_holm"] = adj[h]
            sec[h]["shown"] = bool(adj[h] < ALPHA)
        e["secondary"] = sec
        out[arm] = e
    return out


def _rel(path: Path, doc: Path) -> str:
    import os

    return Path(os.path.relpath(path.resolve(), doc.resolve().parent)).as_posix()


# ----------------------------------------------------------------------------------------------
# Ship


def stage_ship(args) -> int:
    if getattr(args, "seeds", None) is not None and 0 not in seed_list(args):
        log("ship: the protocol ships the seed-0 Attn-QAT export; --seeds has no 0")
        return 2
    src = args.work / "export" / run_key(args, args.ship_run, 0)
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
    record["protocol"] = "docs/repro/protocol.md"
    record["weights_sha256"] = weights_sha256(args, None, run_key(args, args.ship_run, 0))
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
    if getattr(args, "seeds", None) is not None:
        a += ["--seeds", str(args.seeds)]
    if any(r.strip() in RUN_LORA for r in args.runs.split(",")):
        a += ["--lora-lr", str(lora_lr(args))]
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
        seeds = seed_list(args)
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        print(f"attnqat repro: --seeds must be distinct non-negative integers, comma-separated, got "
              f"{args.seeds!r}", file=sys.stderr)
        return 2
    try:
        family_for(args.model).check_clip(args.size, args.size, args.frames,
                                          names={"height": "--size", "width": "--size", "frames": "--frames"})
    except ValueError as exc:
        print(f"attnqat repro: {exc}", file=sys.stderr)
        return 2

    try:   # the evaluation discipline (docs/repro.md), before any work
        if "eval" in stages:
            check_prompt_range(args.eval_offset, args.eval_prompts)
        if "probe" in stages:
            check_prompt_range(args.eval_offset, args.probe_prompts)
    except PromptRangeError as exc:
        print(f"attnqat repro: {exc}", file=sys.stderr)
        return 2
    if args.doc is None:
        args.doc = args.work / "report.md"
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
