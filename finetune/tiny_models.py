"""The tiny model's folders for ``attnqat finetune tiny``: load one to train on (float32, CPU),
deepen its transformer without changing its function, save the trained pipeline (and the Attn-QAT
slot as a marked copy) with its sidecar, and the EMA copies of the trained modules that are
saved."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import torch

from attnqat import tiny
from attnqat.sidecar import Sidecar
from attnqat.sidecar import read as read_sidecar
from attnqat.finetune.schedule import EMA
from attnqat.wan import _quiet_loading


def _config_from(record: Sidecar) -> tiny.TinyWanConfig:
    fields = {k: v for k, v in record.config.items() if k in tiny.TinyWanConfig.__dataclass_fields__}
    cfg = tiny.TinyWanConfig(**fields)
    if record.defaults:
        cfg = replace(cfg, defaults=dict(record.defaults))
    return cfg


def load_for_training(folder: Path):
    """A saved tiny pipeline in float32 on the CPU, its config and its sidecar."""
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    folder = Path(folder)
    record = read_sidecar(folder)
    if record is None:
        raise FileNotFoundError(f"{folder} has no {tiny.SIDECAR}: not a saved tiny pipeline")
    with _quiet_loading():
        vae = AutoencoderKLWan.from_pretrained(folder, subfolder="vae", local_files_only=True)
        te = UMT5EncoderModel.from_pretrained(folder, subfolder="text_encoder", local_files_only=True)
        tr = WanTransformer3DModel.from_pretrained(folder, subfolder="transformer",
                                                   local_files_only=True)
        pipe = WanPipeline.from_pretrained(folder, vae=vae, text_encoder=te, transformer=tr,
                                           local_files_only=True)
    for m in (pipe.vae, pipe.text_encoder, pipe.transformer):
        m.float()
    return pipe, _config_from(record), record.to_dict()


def grow_transformer(transformer, layers: int) -> list[int]:
    """Deepen a ``WanTransformer3DModel`` in place to ``layers`` blocks without changing what it
    computes: after some existing blocks (evenly spread; after every one when doubling) insert a
    copy of that block whose self-attention, cross-attention and feed-forward output projections
    are zero, so the copy adds nothing to the residual stream until training moves them. Returns
    the indices (in the new stack) of the inserted blocks."""
    blocks = transformer.blocks
    depth = len(blocks)
    if not depth < layers <= 2 * depth:
        raise ValueError(f"--grow-layers must be in {depth + 1}..{2 * depth} for a transformer of "
                         f"{depth} blocks (grow in several runs for more), got {layers}")
    extra = layers - depth
    after = {int((j + 0.5) * depth / extra) for j in range(extra)}   # distinct: extra <= depth
    new_blocks, inserted = [], []
    for i, block in enumerate(blocks):
        new_blocks.append(block)
        if i in after:
            twin = copy.deepcopy(block)
            for lin in (twin.attn1.to_out[0], twin.attn2.to_out[0], twin.ffn.net[-1]):
                torch.nn.init.zeros_(lin.weight)
                if lin.bias is not None:
                    torch.nn.init.zeros_(lin.bias)
            inserted.append(len(new_blocks))
            new_blocks.append(twin)
    transformer.blocks = torch.nn.ModuleList(new_blocks)
    transformer.register_to_config(num_layers=layers)
    return inserted


def weights_note(state: dict) -> str:
    v, t = state.get("vae", {}), state.get("t2v", {})
    runs = state.get("runs", [])
    last = runs[-1] if runs else {}
    return (f"trained on the synthetic shapes data (attnqat.synthetic, training split: no "
            f"held-out colour x shape x motion triple is ever shown) by `attnqat finetune tiny`: "
            f"VAE {v.get('steps', 0)} steps ({v.get('clips', 0)} clips), text encoder and "
            f"transformer {t.get('steps', 0)} steps ({t.get('samples', 0)} latents drawn from "
            f"{t.get('clips', 0)} clips), {len(runs)} run(s), last on {last.get('date', '?')} on "
            f"{last.get('device', '?')}; see docs/tiny_model.md")


def save_model(pipe, out: Path, qat_out: Path | None, cfg: tiny.TinyWanConfig, state: dict,
               seed: int) -> None:
    """Write the pipeline (its transformer and text encoder being the weights to ship) with a
    sidecar saying it is trained, and optionally the Attn-QAT slot as a copy of the transformer."""
    note = weights_note(state)
    sidecar = Sidecar(kind="tiny-wan", weights="trained", seed=seed, weights_note=note,
                      defaults=dict(cfg.defaults), config=tiny.config_dict(cfg), training=state)
    qat_note = ("BASE weights: a copy of the trained tiny transformer (" + note.split(" by ")[0] +
                "); Attn-QAT fine-tuning has not been run on it yet, so the attnqat clip shows "
                "plain NVFP4 attention on the base model")
    with _quiet_loading():
        tiny.save_pipeline(pipe, out, qat_out, sidecar=sidecar,
                           qat_sidecar=tiny.copy_of_base_sidecar(seed, qat_note))


def ema_of(modules: list[torch.nn.Module], decay: float) -> EMA:
    """The shared :class:`attnqat.finetune.schedule.EMA` over several modules' parameters, named
    ``"<module index>.<parameter name>"``."""
    return EMA({f"{i}.{n}": p for i, m in enumerate(modules) for n, p in m.named_parameters()}, decay)


def averaged(modules: list[torch.nn.Module], ema: EMA | None) -> list[torch.nn.Module]:
    """Copies of ``modules`` holding the EMA weights (the modules themselves without an EMA)."""
    if ema is None:
        return modules
    out = []
    for i, m in enumerate(modules):
        c = copy.deepcopy(m).eval().requires_grad_(False)
        c._compiled_call_impl = None   # a copy to save, not to run compiled
        ema.copy_to(c, prefix=f"{i}.")
        out.append(c)
    return out
