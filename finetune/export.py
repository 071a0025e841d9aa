"""``attnqat finetune export``: a training checkpoint → a diffusers transformer folder.

The folder holds ``config.json`` and ``diffusion_pytorch_model.safetensors`` (bfloat16, with the
modules diffusers keeps in float32 in float32 — what ``from_pretrained`` gives), so
``attnqat generate --qat-transformer DIR``, ``attnqat app --qat-transformer DIR`` and
``WanTransformer3DModel.from_pretrained(DIR)`` load it, and an ``attnqat.json`` record: the
student's attention method and ablation, the steps and samples trained, the data, the base model
and starting weights, the recipe, the final loss and the checkpoint it came from. Its
``qat_weights_note`` is what generate and the app show under the weights.

Reading the checkpoint needs no process group and no GPU: ``torch.distributed.checkpoint`` joins
the shards of any number of ranks. ``--weights ema`` takes the exponential moving average (when
the run kept one; the default then), ``live`` the optimizer's weights.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from attnqat import methods as registry
from attnqat import sidecar

from . import checkpoint as ckpt
from .runlog import now


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", type=Path,
                        help="a run folder (its latest checkpoint) or one checkpoint folder")
    parser.add_argument("--out", required=True, type=Path,
                        help="transformer folder to write (replaced if it exists)")
    parser.add_argument("--weights", choices=("auto", "ema", "live"), default="auto",
                        help="EMA or live weights (auto: the EMA when the run kept one)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="storage dtype (float32 modules stay float32)")
    parser.add_argument("--merge", action="store_true",
                        help="a --lora-rank run: write the base transformer with the adapter fused "
                             "in (a transformer folder) instead of the adapter alone")


def display_model(path: str | None) -> str | None:
    """A model path as the note shows it: the embedded tiny model by name, others as given."""
    from attnqat.tiny import TINY_MODEL_DIR

    if path is None:
        return None
    try:
        if Path(path).resolve() == TINY_MODEL_DIR.resolve():
            return "the embedded tiny model (assets/tiny-wan)"
    except OSError:
        pass
    return str(path)


def note(training: dict) -> str:
    """The one-line ``qat_weights_note`` of an export's ``training`` record."""
    what = registry.get(training["attention"]).finetuned_note
    if training.get("ablation"):
        what += f", ablation {training['ablation']}"
    if training.get("lora_rank"):
        what += f", LoRA rank {training['lora_rank']}"
    start = display_model(training.get("start_weights")) or display_model(training["base_model"])
    return (f"{what}; {training['steps']} steps, {training['samples']} samples of "
            f"{training['data']}, from {start}; {training['weights']} weights; trained by "
            f"`attnqat finetune train` ({training.get('date') or '?'})")


def _adapted_base(cfg: dict, folder: Path, key: str):
    """A LoRA run's base transformer (float32) with the checkpoint's adapter (``key``: model or
    ema) on it. The base is read from the model again in float32, never rounded to the bfloat16
    that training kept it in (attnqat.lora.frozen_base_to): a merge is the original weights plus
    scale · B·A."""
    from dataclasses import fields

    from attnqat.lora import add_lora, lora_parameters

    from .train import TrainConfig, load_transformer

    tc = TrainConfig(**{f.name: cfg[f.name] for f in fields(TrainConfig) if f.name in cfg})
    base = load_transformer(tc)
    add_lora(base, int(cfg["lora_rank"]), cfg.get("lora_alpha"))
    adapter = lora_parameters(base)
    full = {k: torch.empty(p.shape, dtype=torch.float32) for k, p in adapter.items()}
    ckpt.load_full_state(folder, full, key=key)
    with torch.no_grad():
        for k, p in adapter.items():
            p.copy_(full[k])
    return base


def training_record(cfg: dict, state: dict, weights: str, folder: Path) -> dict:
    """The ``training`` part of an export's attnqat.json."""
    return {"attention": cfg["attention"], "ablation": cfg.get("ablation"),
            "scope": cfg["scope"], "steps": state["step"], "samples": state["samples"],
            "data": cfg["data"], "base_model": cfg["model"],
            "start_weights": cfg.get("transformer"), "recipe": cfg.get("recipe"),
            "lr": cfg["lr"], "schedule": cfg["schedule"],
            "batch": cfg["batch_size"] * cfg["grad_accum"] * state.get("world", 1),
            "final_loss": state.get("loss"), "date": state.get("date"),
            "weights": weights, "checkpoint": str(folder),
            "lora_rank": cfg.get("lora_rank") or None, "lora_alpha": cfg.get("lora_alpha")}


def _write_folder(out: Path, kind: str, save, cfg: dict, training: dict) -> Path:
    """``save(tmp)`` plus the folder's attnqat.json (sha256 of what ``save`` wrote), written atomically:
    a temporary folder beside ``out`` that replaces it whole, removed on any failure."""
    from attnqat.tiny import _chmod_files, _chmod_like_mkdir

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save(tmp)
        sidecar.write(tmp, sidecar.Sidecar(
            kind=kind, weights=registry.get(cfg["attention"]).finetuned_weights,
            qat_weights_note=note(training), training=training, exported=now(),
            weights_sha256=sidecar.weights_sha256(tmp)))
        _chmod_like_mkdir(tmp)
        _chmod_files(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_adapter(model, cfg: dict, training: dict, out: Path) -> Path:
    """The adapter as diffusers' LoRA file plus an attnqat.json record, written atomically."""
    from attnqat.lora import save_lora

    return _write_folder(out, "attnqat-lora", lambda tmp: save_lora(model, tmp), cfg, training)


def export(run: str | Path, out: str | Path, *, weights: str = "auto",
           dtype: torch.dtype = torch.bfloat16, merge: bool = False) -> Path:
    """Write the transformer folder (module docstring) — for a LoRA run the adapter, or with
    ``merge`` the base with the adapter fused in; returns it."""
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    from attnqat.convert import param_dtype

    folder = ckpt.resolve(run, run)
    state = ckpt.read_state(folder)
    cfg, tcfg = state["config"], state["transformer_config"]
    if weights == "auto":
        weights = "ema" if state.get("ema_updates") else "live"
    if weights == "ema" and not state.get("ema_updates"):
        raise ValueError(f"{folder} holds no EMA weights (the run had --ema 0); use --weights live")
    with init_empty_weights():
        model = WanTransformer3DModel.from_config(tcfg)
    key = "ema" if weights == "ema" else "model"
    if merge and not cfg.get("lora_rank"):
        raise ValueError(f"--merge applies to LoRA runs (--lora-rank); {folder} holds full weights")
    if cfg.get("lora_rank"):
        adapted = _adapted_base(cfg, folder, key)
        if not merge:
            return _write_adapter(adapted, cfg, training_record(cfg, state, weights, folder),
                                  Path(out).resolve())
        from attnqat.lora import merge_into

        merge_into(adapted)
        full = {k: v.float() for k, v in adapted.state_dict().items()}
    else:
        full = {k: torch.empty(p.shape, dtype=torch.float32) for k, p in model.named_parameters()}
        ckpt.load_full_state(folder, full, key=key)
    ready = {k: t.to(param_dtype(model, k, dtype)) for k, t in full.items()}
    model.load_state_dict(ready, strict=False, assign=True)
    return _write_folder(Path(out).resolve(), "attnqat-transformer",
                         lambda tmp: model.save_pretrained(tmp, safe_serialization=True), cfg,
                         training_record(cfg, state, weights, folder))


def run(args: argparse.Namespace) -> int:
    try:
        out = export(args.run, args.out, weights=args.weights, dtype=getattr(torch, args.dtype),
                     merge=args.merge)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        print(f"attnqat finetune export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({sidecar.read(out).qat_weights_note})")
    return 0


__all__ = ["add_arguments", "display_model", "export", "note", "run"]
