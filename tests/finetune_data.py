"""A small Wan pipeline and captioned clips for the fine-tuning tests (CPU, seconds)."""

from __future__ import annotations

import json
from pathlib import Path

from attnqat import synthetic, tiny
from attnqat.video import write_mp4

#: small enough to train a few steps in well under a second on the CPU; two blocks so that
#: per-block gradient norms and FSDP2 block units are exercised
SMALL = {"num_attention_heads": 1, "num_layers": 2, "ffn_dim": 64, "text_d_model": 32,
         "text_layers": 1, "text_heads": 2, "text_d_ff": 64, "vae_base_dim": 4}
DEFAULTS = {"height": 32, "width": 32, "frames": 5, "fps": 16, "steps": 2, "guidance": 5.0,
            "shift": 3.0, "max_sequence_length": 16}
#: flags every test run shares: fp32 on the CPU, no workers, no TensorBoard, no progress bar
RUN = ["--device", "cpu", "--workers", "0", "--no-tensorboard", "--no-progress"]


def small_model(folder: Path, seed: int = 0) -> Path:
    """Save a randomly initialized small tiny-wan pipeline (32 × 32, 5 frames) to ``folder``."""
    cfg = tiny.TinyWanConfig(**SMALL, defaults=DEFAULTS)
    pipe = tiny.build_tiny_pipeline(seed, cfg)
    tiny.save_pipeline(pipe, folder, sidecar={"kind": "tiny-wan", "weights": "random-init",
                                              "seed": seed, "defaults": DEFAULTS,
                                              "config": tiny.config_dict(cfg)})
    return folder


def write_clips(folder: Path, n: int, *, frames: int = 9, size: int = 48, seed: int = 3) -> list[str]:
    """``n`` synthetic clips as mp4 + .txt caption in ``folder``; returns the captions."""
    folder.mkdir(parents=True, exist_ok=True)
    captions = []
    for k in range(n):
        spec = synthetic.spec_at(seed, k)
        write_mp4(synthetic.render(spec, frames, size), folder / f"clip{k:02d}.mp4", 16)
        (folder / f"clip{k:02d}.txt").write_text(spec.caption + "\n")
        captions.append(spec.caption)
    return captions


def losses(run: Path) -> dict[int, float]:
    """step → loss of a run's log."""
    out = {}
    for line in (run / "log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "train":
            out[rec["step"]] = rec["loss"]
    return out
