"""LoRA adapters on a Wan 2.1 transformer, through ``peft`` (the library diffusers' own LoRA
loading speaks).

An adapter of rank ``r`` sits on the attention projections (self- and cross-attention ``to_q``,
``to_k``, ``to_v``, ``to_out.0``) and the feed-forward projections (``ffn.net.0.proj``,
``ffn.net.2``) of every block (:data:`TARGETS`); the attention method is untouched, so it trains
under Attn-QAT attention as under any other. On disk an adapter is diffusers' own LoRA file
(``pytorch_lora_weights.safetensors``, written by ``WanPipeline.save_lora_weights``), which
``WanPipeline.load_lora_weights`` reads.

Under bfloat16 autocast the frozen base's linear and convolution weights are cast to bfloat16 at
every use anyway; :func:`frozen_base_to` stores them in bfloat16 once (same numbers, half their
memory), while the adapter stays float32, the master weights the optimizer steps.
"""

from __future__ import annotations

from pathlib import Path

import torch

#: the modules an adapter wraps (peft matches the whole module name)
TARGETS = r"blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)|blocks\.\d+\.ffn\.net\.(0\.proj|2)"
LORA_FILE = "pytorch_lora_weights.safetensors"


def add_lora(transformer, rank: int, alpha: float | None = None, seed: int | None = None) -> None:
    """Wrap :data:`TARGETS` of ``transformer`` with a fresh adapter (B = 0: the model is unchanged
    until it trains); the base weights are frozen, the adapter's trainable.

    ``seed``: draw the adapter's A (peft draws it on the CPU) from this seed, leaving the global
    random state as it was; None draws it from the global random state."""
    import contextlib

    from peft import LoraConfig

    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"--lora-rank must be an integer >= 1, got {rank!r}")
    transformer.requires_grad_(False)
    with torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext():
        if seed is not None:
            torch.default_generator.manual_seed(seed)
        transformer.add_adapter(LoraConfig(r=rank, lora_alpha=float(alpha if alpha else rank),
                                           target_modules=TARGETS, init_lora_weights=True))


#: the modules whose weight and bias bfloat16 autocast casts to bfloat16 before it uses them
#: (``torch.autocast``'s lower-precision ops: ``linear``, ``conv1d/2d/3d``)
AUTOCAST_CAST = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def frozen_base_to(transformer, dtype: torch.dtype = torch.bfloat16) -> int:
    """Store the frozen base's linear and convolution weights and biases (:data:`AUTOCAST_CAST`)
    in ``dtype``, in place; returns the number of values cast.

    Only for a model that runs under ``dtype`` autocast, which casts exactly these parameters to
    ``dtype`` at every use: its forward and backward are then bit for bit the same, the weights
    take half the memory. Left as they are: the adapter (``lora_A``/``lora_B``, float32 trainable
    master weights), anything trainable, and everything autocast runs in float32 or does not cast
    — norms, modulation tables (``scale_shift_table``), buffers, and the modules diffusers keeps in
    float32 (``_keep_in_fp32_modules``: the time embedder). Call it after :func:`add_lora` (peft
    gives a new adapter its base layer's dtype) and before FSDP2 wraps the model."""
    keep = set(getattr(transformer, "_keep_in_fp32_modules", None) or [])
    cast = 0
    for name, module in transformer.named_modules():
        parts = name.split(".")
        if (not isinstance(module, AUTOCAST_CAST) or keep.intersection(parts)
                or any(part.startswith("lora_") for part in parts)):
            continue
        for p in module.parameters(recurse=False):
            if p.requires_grad or p.dtype == dtype or not p.is_floating_point():
                continue
            p.data = p.data.to(dtype)
            cast += p.numel()
    return cast


def save_lora(transformer, folder: str | Path) -> Path:
    """Write the adapter of ``transformer`` as diffusers' LoRA file in ``folder``; returns it."""
    from diffusers import WanPipeline
    from peft.utils import get_peft_model_state_dict

    layers = {k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(transformer).items()}
    # the adapter's config (rank, alpha, targets) goes into the file's metadata, where diffusers'
    # loader reads the scale alpha / rank from; without it, it would assume alpha = rank
    config = transformer.peft_config["default"].to_dict()
    metadata = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
    WanPipeline.save_lora_weights(str(folder), transformer_lora_layers=layers, safe_serialization=True,
                                  transformer_lora_adapter_metadata=metadata)
    return Path(folder) / LORA_FILE


def fuse_lora_file(pipe_like, lora: str | Path) -> None:
    """Load a LoRA file or folder through diffusers (``load_lora_weights``) into the pipeline's
    transformer and fuse it into the weights, leaving a plain transformer."""
    path = Path(lora).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"LoRA adapter not found: {lora}")
    kwargs = {"weight_name": path.name} if path.is_file() else {}
    where = str(path.parent if path.is_file() else path)
    pipe_like.load_lora_weights(where, adapter_name="attnqat", **kwargs)
    pipe_like.fuse_lora(components=["transformer"], lora_scale=1.0)
    pipe_like.unload_lora_weights()


def merge_into(transformer) -> None:
    """Fuse ``transformer``'s adapter into its weights and remove the adapter."""
    transformer.fuse_lora(lora_scale=1.0)
    transformer.unload_lora()
    transformer.requires_grad_(False)


def lora_parameters(transformer) -> dict[str, torch.Tensor]:
    """The adapter's parameters by their names in ``transformer`` (checkpoint keys)."""
    return {k: p for k, p in transformer.named_parameters() if ".lora_" in k}


__all__ = ["AUTOCAST_CAST", "LORA_FILE", "TARGETS", "add_lora", "frozen_base_to", "fuse_lora_file",
           "lora_parameters", "merge_into", "save_lora"]
