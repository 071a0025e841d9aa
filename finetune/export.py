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
    start = display_model(training.get("start_weights")) or display_model(training["base_model"])
    return (f"{what}; {training['steps']} steps, {training['samples']} samples of "
            f"{training['data']}, from {start}; {training['weights']} weights; trained by "
            f"`attnqat finetune train` ({training.get('date') or '?'})")


def export(run: str | Path, out: str | Path, *, weights: str = "auto",
           dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the transformer folder (module docstring); returns it."""
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    from attnqat.convert import param_dtype
    from attnqat.tiny import _chmod_files, _chmod_like_mkdir

    folder = ckpt.resolve(run, run)
    state = ckpt.read_state(folder)
    cfg, tcfg = state["config"], state["transformer_config"]
    if weights == "auto":
        weights = "ema" if state.get("ema_updates") else "live"
    if weights == "ema" and not state.get("ema_updates"):
        raise ValueError(f"{folder} holds no EMA weights (the run had --ema 0); use --weights live")
    with init_empty_weights():
        model = WanTransformer3DModel.from_config(tcfg)
    full = {k: torch.empty(p.shape, dtype=torch.float32) for k, p in model.named_parameters()}
    ckpt.load_full_state(folder, full, key="ema" if weights == "ema" else "model")
    ready = {k: t.to(param_dtype(model, k, dtype)) for k, t in full.items()}
    model.load_state_dict(ready, strict=False, assign=True)
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        training = {"attention": cfg["attention"], "ablation": cfg.get("ablation"),
                         "scope": cfg["scope"], "steps": state["step"], "samples": state["samples"],
                         "data": cfg["data"], "base_model": cfg["model"],
                         "start_weights": cfg.get("transformer"), "recipe": cfg.get("recipe"),
                         "lr": cfg["lr"], "schedule": cfg["schedule"],
                         "batch": cfg["batch_size"] * cfg["grad_accum"] * state.get("world", 1),
                         "final_loss": state.get("loss"), "date": state.get("date"),
                         "weights": weights, "checkpoint": str(folder)}
        sidecar.write(tmp, sidecar.Sidecar(
            kind="attnqat-transformer", weights=registry.get(cfg["attention"]).finetuned_weights,
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


def run(args: argparse.Namespace) -> int:
    try:
        out = export(args.run, args.out, weights=args.weights, dtype=getattr(torch, args.dtype))
    except (FileNotFoundError, ValueError, KeyError) as exc:
        print(f"attnqat finetune export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({sidecar.read(out).qat_weights_note})")
    return 0


__all__ = ["add_arguments", "display_model", "export", "note", "run"]
