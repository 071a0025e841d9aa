"""Pixels and captions → what the Wan transformer trains on: normalized VAE latents and prompt
embeddings, computed exactly as the diffusers pipeline does at inference.

* Latents: the VAE posterior's mean (its mode; deterministic, so a cached latent and one computed
  during training are the same) of the clip in [−1, 1], normalized per channel with the VAE
  config's ``latents_mean`` / ``latents_std``, the inverse of what ``WanPipeline`` applies before
  decoding.
* Prompt embeddings: ``WanPipeline.encode_prompt`` (the same text cleaning and tokenization),
  ``max_sequence_length`` rows, zeros after the real tokens. The empty prompt's embeddings are what
  caption dropout trains on (the pipeline's default negative prompt is empty).

The text encoder runs in bfloat16 and the VAE in float32, the dtypes generation loads them in.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class Components:
    """The frozen parts of a Wan pipeline a trainer may need (any of them None when not loaded)."""

    tokenizer: Any = None
    text_encoder: Any = None
    vae: Any = None
    scheduler: Any = None


def load_components(model: str | Path, *, text: bool = True, vae: bool = True,
                    text_dtype: torch.dtype = torch.bfloat16) -> Components:
    """Tokenizer, text encoder, VAE and scheduler of a diffusers Wan pipeline folder (or hub id), on
    the CPU, frozen; the transformer is not loaded.

    Raises:
        attnqat.wan.ModelLoadError: the model cannot be found or read.
    """
    from diffusers import AutoencoderKLWan, WanPipeline
    from transformers import AutoTokenizer, UMT5EncoderModel

    from attnqat.wan import ModelLoadError, _dtype_kwarg, _hf_dtype_kwarg, _quiet_loading, model_info

    info = model_info(model)
    where = str(info.path) if info.path is not None else info.source
    local = {"local_files_only": True} if info.path is not None else {}
    out = Components()
    try:
        with _quiet_loading():
            sched_cls = WanPipeline.load_config(where, **local)["scheduler"][1]
            import diffusers

            out.scheduler = getattr(diffusers, sched_cls).from_pretrained(where, subfolder="scheduler",
                                                                          **local)
            if text:
                out.tokenizer = AutoTokenizer.from_pretrained(where, subfolder="tokenizer", **local)
                out.text_encoder = UMT5EncoderModel.from_pretrained(
                    where, subfolder="text_encoder", **_hf_dtype_kwarg(text_dtype), **local)
            if vae:
                out.vae = AutoencoderKLWan.from_pretrained(where, subfolder="vae",
                                                           **_dtype_kwarg(torch.float32), **local)
    except Exception as exc:  # noqa: BLE001 - one clear message
        raise ModelLoadError(f"could not load the Wan pipeline parts from {info.source}: "
                             f"{type(exc).__name__}: {exc}") from exc
    for m in (out.text_encoder, out.vae):
        if m is not None:
            m.eval().requires_grad_(False)
    return out


def latent_norm(vae, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ``(mean, std)`` of the VAE latents, shaped (1, C, 1, 1, 1)."""
    c = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32, device=device).view(1, c, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, dtype=torch.float32, device=device).view(1, c, 1, 1, 1)
    return mean, std


class Encoder:
    """Encodes clips and captions on ``device`` (module docstring)."""

    def __init__(self, parts: Components, device: torch.device, max_sequence_length: int) -> None:
        from diffusers import WanPipeline

        self.device = device
        self.max_sequence_length = max_sequence_length
        self.vae = parts.vae.to(device) if parts.vae is not None else None
        self.text_encoder = parts.text_encoder.to(device) if parts.text_encoder is not None else None
        self._pipe = WanPipeline(tokenizer=parts.tokenizer, text_encoder=self.text_encoder,
                                 vae=self.vae, scheduler=parts.scheduler)
        if self.vae is not None:
            self.mean, self.std = latent_norm(self.vae, device)

    #: pixel values (frames × height × width × 3) the VAE encodes at once: whole batches of the tiny
    #: model's 33 × 128 × 128 clips, one full-size 81 × 480 × 832 clip at a time
    CHUNK_VALUES = 1 << 26

    @torch.no_grad()
    def latents(self, video: torch.Tensor) -> torch.Tensor:
        """(B, T, H, W, 3) uint8 clips → (B, C, T', H', W') normalized latents (float32), as many
        clips at a time through the VAE as :data:`CHUNK_VALUES` allows."""
        if self.vae is None:
            raise RuntimeError("this encoder was made without a VAE")
        chunk = max(1, self.CHUNK_VALUES // max(1, video[0].numel()))
        out = []
        for i in range(0, video.shape[0], chunk):
            x = video[i:i + chunk].to(self.device).permute(0, 4, 1, 2, 3).float().div(127.5).sub(1.0)
            z = self.vae.encode(x.to(self.vae.dtype)).latent_dist.mode().float()
            out.append((z - self.mean) / self.std)
        return torch.cat(out)

    @torch.no_grad()
    def text(self, captions: list[str]) -> torch.Tensor:
        """Prompt embeddings (B, max_sequence_length, D) in float32, zeros after the real tokens."""
        if self.text_encoder is None:
            raise RuntimeError("this encoder was made without a text encoder")
        pe, _ = self._pipe.encode_prompt(prompt=list(captions), do_classifier_free_guidance=False,
                                         num_videos_per_prompt=1,
                                         max_sequence_length=self.max_sequence_length,
                                         device=self.device)
        return pe.float()


def real_tokens(text: torch.Tensor) -> list[torch.Tensor]:
    """(B, L, D) padded embeddings → the rows of the real tokens of each prompt (the padding rows
    are exactly zero)."""
    out = []
    for t in text:
        nz = (t != 0).any(dim=-1).nonzero()
        out.append(t[: int(nz.max()) + 1] if len(nz) else t[:0])
    return out


__all__ = ["Components", "Encoder", "latent_norm", "load_components", "real_tokens"]
