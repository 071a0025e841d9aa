"""``attnqat finetune cache``: encode captioned videos once, so training needs no VAE or text encoder.

Each clip is resampled to the model's frame rate (``--fps``; Wan: 16, so 24-30 fps footage does not
teach motion too fast) and decoded at the training size (the first ``--frames`` frames, every
``--stride``-th, scaled to cover ``--height`` × ``--width`` and center-cropped; ``--frames`` must be
4k+1), encoded to normalized VAE latents and its caption to prompt embeddings
(:mod:`attnqat.finetune.encode`), and written into safetensors shards of ``--shard-size`` clips:

``cache.json``
    settings (model, size, frames, stride, fps, dtypes, latent shape, text width, ``max_sequence_length``),
    the shards with the names, captions and source frame rates of their clips, and the clips
    skipped with the reason.
``shard-NNNNN.safetensors``
    ``latents`` (N, C, T', H', W'), ``text`` (the real-token rows of every caption, concatenated)
    and ``text_offsets`` (N + 1) into it.
``empty.safetensors``
    ``text``: the empty prompt's embeddings, which caption dropout trains on.

A shard is written under a temporary name and renamed, and the manifest replaced, only once it is
complete, so an interrupted run loses at most the clips of its unfinished shard: run the same
command again and it continues with the clips not cached yet (with other settings it refuses, naming
them). A clip that cannot be decoded, is too short, or encodes to non-finite latents is skipped,
named and counted, never fatal; skipped clips are tried again on the next run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from attnqat.family import WAN21_T2V, ModelFamily
from attnqat.video import probe_header, read_clip
from attnqat.wan import DEFAULT_MODEL, ModelLoadError, model_info, resolve_device

from .data import CACHE_MANIFEST, DataError, list_videos
from .encode import Encoder, load_components, real_tokens
from .runlog import now

SETTINGS = ("model", "height", "width", "frames", "stride", "fps", "latent_dtype", "max_sequence_length")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True,
                        help="a folder of videos with same-named .txt captions, or a .csv / .jsonl "
                             "manifest of video path and caption")
    parser.add_argument("--out", required=True, type=Path, help="cache folder (created or continued)")
    parser.add_argument("--model", default=None,
                        help="diffusers Wan 2.1 pipeline folder or hub id whose VAE and text encoder "
                             "encode the clips (default: the embedded tiny model)")
    parser.add_argument("--height", type=int, default=None, help="training height (default: the model's)")
    parser.add_argument("--width", type=int, default=None, help="training width (default: the model's)")
    parser.add_argument("--frames", type=int, default=None,
                        help="frames per clip, 4k+1 (default: the model's)")
    parser.add_argument("--stride", type=int, default=1, help="take every N-th frame of the source")
    parser.add_argument("--fps", type=float, default=None,
                        help="resample every clip to this frame rate before taking --frames (0: "
                             "frame for frame, whatever the clip's rate) [the model's: Wan 16]")
    parser.add_argument("--shard-size", type=int, default=64, help="clips per shard file")
    parser.add_argument("--latent-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="storage dtype of the latents (bfloat16 halves the cache)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def _save_shard(folder: Path, file: str, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    tmp = folder / (file + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    umask = os.umask(0)   # safetensors writes 0600; a shared cache needs the usual file mode
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, folder / file)


def check_size(height: int, width: int, frames: int, stride: int = 1, family: ModelFamily = WAN21_T2V) -> None:
    """Refuse sizes the model family's VAE and patches cannot take (Wan 2.1: multiples of 16,
    4k+1 frames): :meth:`attnqat.family.ModelFamily.check_clip`'s one line."""
    try:
        family.check_clip(height, width, frames)
    except ValueError as exc:
        raise DataError(str(exc)) from None
    if stride < 1:
        raise DataError(f"stride must be >= 1, got {stride}")


def _open_manifest(out: Path, settings: dict) -> dict:
    """The manifest of the cache in ``out`` (a new one if there is none); an existing cache made with
    other settings is refused."""
    manifest_path = out / CACHE_MANIFEST
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        diff = [f"{k} {manifest.get(k)!r} (cache) vs {settings[k]!r} (now)" for k in SETTINGS
                if manifest.get(k) != settings[k]]
        if diff:
            raise DataError(f"{out} is a cache made with other settings: {'; '.join(diff)}; use "
                            "another --out or the same settings")
        return manifest
    out.mkdir(parents=True, exist_ok=True)
    return {"version": 1, **settings, "created": now(), "shards": [], "skipped": []}


def _flush(out: Path, manifest: dict, buf: list, store: torch.dtype) -> None:
    """Write the buffered clips as the next shard, record it in the manifest, empty ``buf``."""
    if not buf:
        return
    file = f"shard-{len(manifest['shards']):05d}.safetensors"
    texts = [t for _, _, _, t, _ in buf]
    offsets = torch.tensor([0] + [t.shape[0] for t in texts]).cumsum(0)
    _save_shard(out, file, {"latents": torch.stack([z for _, _, z, _, _ in buf]).to(store),
                            "text": torch.cat(texts).to(torch.bfloat16),
                            "text_offsets": offsets})
    manifest["shards"].append({"file": file, "names": [n for n, _, _, _, _ in buf],
                               "captions": [c for _, c, _, _, _ in buf],
                               "source_fps": [r for *_, r in buf]})
    manifest["latent_shape"] = list(buf[0][2].shape)
    manifest["text_dim"] = int(texts[0].shape[-1])
    manifest["updated"] = now()
    _write_json(out / CACHE_MANIFEST, manifest)
    buf.clear()


def model_fps(defaults: dict) -> float:
    """The frame rate a model generates at (its defaults' ``fps``; Wan 2.1: 16)."""
    return float(defaults.get("fps", 16))


def check_fps(fps: float) -> float:
    """``--fps``: a positive frame rate, or 0 for frame for frame."""
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps >= 0 or fps == float("inf"):
        raise DataError(f"--fps must be a frame rate > 0, or 0 (frame for frame), got {fps!r}")
    return float(fps)


def build_cache(data: str | Path, out: str | Path, *, model: str | None = None,
                height: int | None = None, width: int | None = None, frames: int | None = None,
                stride: int = 1, fps: float | None = None, shard_size: int = 64,
                latent_dtype: str = "bfloat16", device: str = "auto", progress: bool = True,
                log=print) -> dict:
    """Encode the clips of ``data`` into the cache folder ``out`` (module docstring); returns the
    manifest.

    Raises:
        DataError: bad data, sizes, or an existing cache made with other settings.
        attnqat.wan.ModelLoadError: the model cannot be loaded.
    """
    from tqdm.auto import tqdm

    model = model or DEFAULT_MODEL
    info = model_info(model)
    d = info.defaults
    height, width = height or d["height"], width or d["width"]
    frames = frames or d["frames"]
    check_size(height, width, frames, stride, info.family)
    fps = model_fps(d) if fps is None else check_fps(fps)
    if shard_size < 1:
        raise DataError(f"--shard-size must be >= 1, got {shard_size}")
    clips = list_videos(data)
    out = Path(out)
    settings = {"model": info.source, "height": height, "width": width, "frames": frames,
                "stride": stride, "fps": fps, "latent_dtype": latent_dtype,
                "max_sequence_length": int(d.get("max_sequence_length", 512))}
    manifest_path = out / CACHE_MANIFEST
    manifest = _open_manifest(out, settings)
    done = {n for s in manifest["shards"] for n in s["names"]}
    todo = [c for c in clips if c[0] not in done]
    manifest["skipped"] = []
    dev = resolve_device(device)
    parts = load_components(model)
    enc = Encoder(parts, dev, settings["max_sequence_length"])
    if "empty_prompt" not in manifest:
        _save_shard(out, "empty.safetensors",
                    {"text": real_tokens(enc.text([""]))[0].to(torch.bfloat16).cpu()})
        manifest["empty_prompt"] = "empty.safetensors"
    store = getattr(torch, latent_dtype)
    log(f"cache {out}: {len(clips)} clips in {data}, {len(done)} already cached, {len(todo)} to "
        f"encode at {width}x{height}, {frames} frames (stride {stride}, "
        + (f"resampled to {fps:g} fps" if fps else "frame for frame") + f") on {dev}")
    buf: list[tuple[str, str, torch.Tensor, torch.Tensor, float]] = []

    def flush() -> None:
        _flush(out, manifest, buf, store)

    t0 = time.perf_counter()
    bar = tqdm(todo, desc="cache", unit="clip", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    for name, path, caption in bar:
        try:
            video = torch.from_numpy(read_clip(path, frames, height, width, stride=stride,
                                               fps=fps or None))
            source_fps = probe_header(path)["fps"]   # a readable clip's header
        except (OSError, ValueError) as exc:
            manifest["skipped"].append({"name": name, "reason": str(exc)})
            bar.write(f"skipped {name}: {exc}")
            continue
        z = enc.latents(video.unsqueeze(0))[0]
        if not torch.isfinite(z).all():
            manifest["skipped"].append({"name": name, "reason": "the VAE latents are not finite"})
            bar.write(f"skipped {name}: the VAE latents are not finite")
            continue
        text = real_tokens(enc.text([caption]))[0]
        buf.append((name, caption, z.cpu(), text.cpu(), source_fps))
        if len(buf) >= shard_size:
            flush()
    bar.close()
    flush()
    manifest["updated"] = now()
    _write_json(manifest_path, manifest)
    cached = sum(len(s["names"]) for s in manifest["shards"])
    log(f"cached {cached} clips in {len(manifest['shards'])} shard(s) ({time.perf_counter() - t0:.1f} s"
        f" this run); skipped {len(manifest['skipped'])}"
        + "".join(f"\n  skipped {s['name']}: {s['reason']}" for s in manifest["skipped"]))
    return manifest


def run(args: argparse.Namespace) -> int:
    try:
        build_cache(args.data, args.out, model=args.model, height=args.height, width=args.width,
                    frames=args.frames, stride=args.stride, fps=args.fps, shard_size=args.shard_size,
                    latent_dtype=args.latent_dtype, device=args.device,
                    progress=not args.no_progress)
    except (DataError, ModelLoadError, ValueError) as exc:
        print(f"attnqat finetune cache: {exc}", file=sys.stderr)
        return 2
    return 0


__all__ = ["add_arguments", "build_cache", "check_fps", "check_size", "model_fps", "run"]
