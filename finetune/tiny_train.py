"""Train the embedded tiny Wan 2.1 model on the synthetic shapes data: ``attnqat finetune tiny``.

This module is the command (:func:`run`); each job has its own module: the options and the typed
configuration (:mod:`~attnqat.finetune.tiny_config`), the run's clock, budgets and log
(:mod:`~attnqat.finetune.tiny_context`), the text side (:mod:`~attnqat.finetune.tiny_text`), the
model folders (:mod:`~attnqat.finetune.tiny_models`) and one module per stage
(:mod:`~attnqat.finetune.tiny_vae`, :mod:`~attnqat.finetune.tiny_t2v`,
:mod:`~attnqat.finetune.tiny_eval`). The clips come from the synthetic stream and its renderer
(:class:`attnqat.synthetic.SpecStream`, :func:`attnqat.synthetic.render_batch`, on the device).

Stages (``--stages``, run in this order; any subset):

``vae``
    Train the ``AutoencoderKLWan`` of :class:`attnqat.tiny.TinyWanConfig` on synthetic clips:
    L1 + L2 reconstruction (pixels of the objects weighted up) of the posterior mean plus a small
    KL term (``--vae-sample`` decodes a posterior sample instead). Then measure the per-channel
    mean and standard deviation of the latents over ``--stats-clips`` clips of ``--frames`` frames
    and write them into the VAE config (``latents_mean`` / ``latents_std``, which the pipeline
    uses to de-normalize before decoding). ``--vae-train decoder`` trains the decoder alone: the
    encoder, the latent statistics and what the transformer has learned stay valid.
``t2v``
    Freeze the VAE; train the UMT5 text encoder and the ``WanTransformer3DModel`` jointly with
    rectified-flow matching on normalized latents: ``x_t = (1 - σ) x0 + σ ε``, target ``ε - x0``,
    timestep ``1000 σ``, ``σ = s u / (1 + (s - 1) u)`` with ``u`` uniform and ``s`` the flow shift
    (as Wan's scheduler spaces its sigmas). Captions are replaced by the empty prompt (what the
    pipeline's default negative prompt encodes) with probability ``--caption-dropout``, so
    classifier-free guidance works. AdamW, linear warm-up, linear decay over the last part of the
    budget, bf16 autocast on CUDA, an exponential moving average (EMA) of the weights, which is
    what gets saved. The objective, the schedule, the EMA and the run log (``--log-dir``) are the
    ones ``attnqat finetune train`` uses (:mod:`attnqat.finetune.objective`,
    :mod:`~attnqat.finetune.schedule`, :mod:`~attnqat.finetune.runlog`); what is this module's own
    is the tiny model: the VAE stage, the text encoder trained jointly, the pool of latents. Latents come from a pool on the device: ``--pool`` clips are rendered and
    encoded first, then every ``--fresh-every`` steps ``--fresh`` new clips replace the oldest,
    and each step trains on ``--batch-size`` latents drawn from the pool at random.
    ``--two-objects`` sets the share of two-object clips (the stream's default is half);
    ``--grow-layers N`` deepens a resumed transformer without changing its function
    (:func:`~attnqat.finetune.tiny_models.grow_transformer`); ``--compile`` runs the transformer through ``torch.compile``.
``eval``
    Generate one clip per held-out prompt (:func:`attnqat.synthetic.heldout_prompts`,
    prompt ``i`` with seed ``i``; ``--eval-offset K`` starts at prompt ``K``) for each method
    through the project's generation code
    (:func:`attnqat.wan.load_models`, :func:`attnqat.generate.encode_prompts`,
    :func:`~attnqat.generate.initial_latents`, :func:`~attnqat.generate.denoise`,
    :func:`~attnqat.generate.decode`; prompts are denoised in batches), score them with
    :func:`attnqat.eval.procedural.score_clip`, and report colour, shape and motion accuracy per
    method plus PSNR/SSIM of the 4-bit methods against BF16, and whether the text encoder's states
    tell two-object captions with swapped motions apart
    (:func:`~attnqat.finetune.tiny_text.binding_signal`). Writes a JSON
    file and prints a table.
``export``
    Write ``--out`` (and ``--qat-out``) from ``--resume`` without training.

Budgets are in minutes (``--vae-minutes``, ``--t2v-minutes``) and/or steps (``--vae-steps``,
``--t2v-steps``): a stage stops at whichever comes first. ``--time-limit-minutes`` bounds the whole
process (training is cut short to leave ``--reserve-minutes`` for saving and evaluation).
``--resume DIR`` continues from a saved model folder: the weights only (the EMA weights, which
are what is saved). Unlike the fine-tuning trainer's checkpoints (:mod:`attnqat.finetune.checkpoint`:
model, optimizer, EMA, random states, data position), these saves are the shipped model folder
itself, small enough to carry between time-limited GPU calls. The optimizer restarts with a fresh state and a new warm-up: its state (twice
the float32 weights) is not saved, so that a checkpoint is the model folder itself and stays small
enough to carry between runs of a time-limited machine. The step counts of every run are kept in the
folder's ``attnqat.json`` (``training``).

Usage (``docs/tiny_model.md`` gives the runs that made the shipped model)::

    python -m attnqat.finetune.tiny_train --stages vae,t2v,eval --vae-minutes 15 \\
        --t2v-minutes 30 --out assets/tiny-wan --qat-out assets/tiny-wan-qat
"""


from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from attnqat import tiny
from attnqat.finetune.runlog import RunLog, device_name, now
from attnqat.finetune.tiny_config import (TEXT_SEQ_LEN, TinyTrainConfig, add_arguments,
                                          problem)
from attnqat.finetune.tiny_context import Clock, Context, log
from attnqat.finetune.tiny_eval import evaluate
from attnqat.finetune.tiny_models import grow_transformer, load_for_training, save_model
from attnqat.finetune.tiny_t2v import train_t2v
from attnqat.finetune.tiny_vae import latent_stats, train_vae
from attnqat.wan import resolve_device

__all__ = ["add_arguments", "run", "main"]


def _refuse(message: str) -> int:
    """Report a bad argument or state on stderr; the command's exit status 2."""
    print(f"attnqat finetune tiny: {message}", file=sys.stderr)
    return 2


class _Refused(Exception):
    """An option the loaded model refuses (the message says which)."""


def _model(cfg: TinyTrainConfig):
    """The pipeline to train (resumed or new, grown if asked), its TinyWanConfig and the
    training state so far."""
    r = cfg.run
    if r.resume is not None:
        pipe, model_cfg, sidecar = load_for_training(r.resume)
        state = copy.deepcopy(sidecar.get("training", {}))
        done = {k: state.get(k, {}).get("steps", 0) for k in ("vae", "t2v")}
        log(f"resumed from {r.resume}: {done['vae']} VAE steps, {done['t2v']} t2v steps")
    else:
        model_cfg = replace(tiny.TinyWanConfig(), **r.config)
        pipe = tiny.build_tiny_pipeline(r.seed, model_cfg)
        state = {}
    layers = cfg.t2v.grow_layers
    if layers:
        try:
            inserted = grow_transformer(pipe.transformer, layers)
        except ValueError as e:
            raise _Refused(str(e)) from None
        model_cfg = replace(model_cfg, num_layers=layers)
        log(f"transformer grown to {layers} blocks (new, zero-output blocks at {inserted})")
    if r.defaults:
        model_cfg = replace(model_cfg, defaults={**model_cfg.defaults, **r.defaults})
    return pipe, model_cfg, state


def run(args: argparse.Namespace) -> int:
    try:
        cfg = TinyTrainConfig.from_args(args)
    except ValueError as e:
        return _refuse(str(e))
    clock = Clock(cfg.run.time_limit_minutes, cfg.run.reserve_minutes)
    message = problem(cfg)
    if message:
        return _refuse(message)
    r, stages = cfg.run, cfg.run.stages
    dev = resolve_device(r.device)
    runlog = RunLog(r.log_dir) if r.log_dir else None
    torch.manual_seed(r.seed)
    np.random.seed(r.seed)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True   # fixed shapes: the VAE's 3-D convolutions gain
    try:
        pipe, model_cfg, state = _model(cfg)
    except _Refused as e:
        return _refuse(str(e))
    # the padded length of the prompt embeddings, as the pipeline will pad them at inference
    ctx = Context(dev, clock, runlog, int(model_cfg.defaults.get("max_sequence_length", TEXT_SEQ_LEN)))
    if cfg.t2v.text_len > ctx.seq_len:
        return _refuse(f"--text-len {cfg.t2v.text_len} exceeds the model's max_sequence_length "
                       f"{ctx.seq_len}")
    run_rec = {"date": now(), "device": device_name(dev), "stages": list(stages),
               "command": "attnqat finetune tiny " + shlex.join(sys.argv[1:])
               if sys.argv and not sys.argv[0].endswith("pytest") else None}
    state.setdefault("runs", [])
    n_runs = len(state["runs"])
    log(f"device {run_rec['device']}; stages {', '.join(stages)}; "
        f"config {json.dumps(tiny.config_dict(model_cfg))}")

    trained = False
    training = "vae" in stages or "t2v" in stages
    if "vae" in stages:
        run_rec["vae"] = {}
        train_vae(pipe, cfg, ctx, state, run_rec["vae"])
        if cfg.vae.train == "all":   # a frozen encoder keeps its latent statistics
            latent_stats(pipe, cfg, ctx, state)
        trained = True
    to_save = [pipe.text_encoder, pipe.transformer]

    def save(modules: list[torch.nn.Module]) -> None:
        from diffusers import WanPipeline

        out_pipe = WanPipeline(tokenizer=pipe.tokenizer, text_encoder=modules[0], vae=pipe.vae,
                               scheduler=pipe.scheduler, transformer=modules[1])
        if training:   # an export adds no run
            state["runs"] = state["runs"][:n_runs] + [dict(run_rec, seconds=round(clock.elapsed(), 1))]
        save_model(out_pipe, r.out, r.qat_out, model_cfg, state, r.seed)
        log(f"saved {r.out}" + (f" and {r.qat_out}" if r.qat_out else "")
            + f" (t {clock.elapsed():.0f}s)")

    if "t2v" in stages:
        run_rec["t2v"] = {}
        to_save = train_t2v(pipe, cfg, ctx, state, save, run_rec["t2v"])
        trained = True
    if trained or "export" in stages:
        save(to_save)
    if "eval" in stages:
        if not (Path(r.out) / "model_index.json").is_file():
            return _refuse(f"nothing to evaluate at {r.out}")
        evaluate(Path(r.out), cfg, ctx)
    log(f"done in {clock.elapsed():.0f} s")
    if runlog is not None:
        runlog.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attnqat.finetune.tiny_train",
        description="Train the embedded tiny Wan 2.1 model (VAE, text encoder, transformer) on the "
                    "synthetic shapes data, save it in diffusers format and score it on the "
                    "held-out prompts.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
