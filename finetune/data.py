"""Training data: three sources behind one interface, and the order a run reads them in.

Sources (:func:`open_source` picks one from ``--data``):

``VideoFolder``
    Captioned videos: a folder of clips, each with a caption file of the same stem (``clip.mp4`` +
    ``clip.txt``; mp4, webm, mov, mkv, avi, gif, m4v), or a CSV / JSONL manifest whose rows name a
    video (``path``, ``video`` or ``file``; relative to the manifest) and its ``caption`` (or
    ``text``/``prompt``), or a JSON list of such objects (the ``captions.json`` that ``attnqat
    finetune data`` writes; a folder holding one and no .txt captions reads it). Clips are
    decoded on demand: the first ``frames`` frames (every ``stride``-th) after resampling to the
    model's frame rate (``--fps``), scaled to cover the training resolution and center-cropped
    (:func:`attnqat.video.read_clip`).
``SyntheticShapes``
    The project's synthetic shapes stream (:mod:`attnqat.synthetic`, training split: no held-out
    colour × shape × motion triple), endless, rendered on demand.
``LatentCache``
    A folder written by ``attnqat finetune cache`` (:mod:`attnqat.finetune.cache`): VAE latents
    (normalized as the pipeline expects) and prompt embeddings, so training needs neither the VAE
    nor the text encoder.

Every source has a ``size`` (None: endless), a ``description`` and ``load(index)``, which maps an
item index to an :class:`Item`: pixels and a caption (the first two, encoded
on the training device by :class:`Encoder`) or latents and embeddings (the cache).

Order (:class:`DataOrder`): global sample ``g`` of a run is item ``perm_e[g mod n]`` of epoch
``e = g div n``, each epoch a fresh permutation drawn from the run's seed (the synthetic stream is
endless: sample ``g`` is item ``g``). A training step reads the global samples
``step·G … step·G + G − 1`` (``G`` the global batch); rank ``r`` of ``W`` takes its slice. The data
position of a checkpoint is therefore one number, and a run resumed on a different number of GPUs
reads the same samples.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".mkv", ".avi", ".gif", ".m4v")
CACHE_MANIFEST = "cache.json"
CAPTIONS_JSON = "captions.json"   # the index `attnqat finetune data` writes beside its clips


class DataError(ValueError):
    """Training data that cannot be used; the message names the file and what is wrong."""


@dataclass
class Item:
    """One training sample: ``video`` (T, H, W, 3) uint8 and ``caption``, or ``latents``
    (C, T', H', W') and ``text`` (tokens, text_dim) embeddings of the caption's real tokens."""

    name: str
    caption: str | None = None
    video: np.ndarray | None = None
    latents: torch.Tensor | None = None
    text: torch.Tensor | None = None


# ----------------------------------------------------------------------------------------------
# Captioned videos


def _manifest_rows(path: Path) -> list[dict]:
    try:
        if path.suffix.lower() == ".csv":
            with path.open(newline="") as f:
                return list(csv.DictReader(f))
        if path.suffix.lower() == ".json":
            try:
                rows = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: not valid JSON ({exc.msg})") from exc
            if not isinstance(rows, list):
                raise DataError(f"{path}: a .json manifest must hold a list of objects")
            return rows
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}, line {n}: not a JSON object ({exc.msg})") from exc
        return rows
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"cannot read the manifest {path}: {exc}") from exc


def _pick(row: dict, keys: Sequence[str]) -> str | None:
    for k in keys:
        v = row.get(k)
        if isinstance(v, str) and v.strip():
            return v.strip()
    return None


def list_videos(data: str | Path) -> list[tuple[str, Path, str]]:
    """``(name, video path, caption)`` for a folder of captioned clips or a CSV / JSONL manifest.

    Raises:
        DataError: the folder or manifest is missing, empty, or names videos without captions or
            captions without videos (every problem listed).
    """
    p = Path(data).expanduser()
    if not p.exists():
        raise DataError(f"training data not found: {data} (expected a folder of clips with "
                        "caption files, a .csv or .jsonl manifest, a cache folder from `attnqat "
                        "finetune cache`, or 'synthetic')")
    items: list[tuple[str, Path, str]] = []
    problems: list[str] = []
    if p.is_dir() and (p / CAPTIONS_JSON).is_file() and not any(p.glob("*.txt")):
        p = p / CAPTIONS_JSON   # a folder written by `attnqat finetune data`
    if p.is_file():
        if p.suffix.lower() not in (".csv", ".jsonl", ".json"):
            raise DataError(f"{p}: a manifest must be a .csv, .jsonl or .json file")
        for n, row in enumerate(_manifest_rows(p), 1):
            if not isinstance(row, dict):
                problems.append(f"row {n} is not an object")
                continue
            video = _pick(row, ("path", "video", "file"))
            caption = _pick(row, ("caption", "text", "prompt"))
            if video is None or caption is None:
                problems.append(f"row {n} lacks a {'video path' if video is None else 'caption'}")
                continue
            vp = (p.parent / video) if not Path(video).is_absolute() else Path(video)
            if not vp.is_file():
                problems.append(f"row {n}: {video} does not exist")
                continue
            items.append((video, vp, caption))
    else:
        videos = sorted(f for f in p.rglob("*") if f.suffix.lower() in VIDEO_SUFFIXES and f.is_file())
        for v in videos:
            txt = v.with_suffix(".txt")
            caption = txt.read_text(errors="replace").strip() if txt.is_file() else ""
            if not caption:
                problems.append(f"{v.relative_to(p)} has no caption ({txt.name} "
                                f"{'is empty' if txt.is_file() else 'missing'})")
                continue
            items.append((str(v.relative_to(p)), v, caption))
    if problems:
        shown = "; ".join(problems[:10]) + (f"; … ({len(problems) - 10} more)" if len(problems) > 10 else "")
        raise DataError(f"{p}: {len(problems)} problem(s) in the training data: {shown}")
    if not items:
        raise DataError(f"{p} holds no videos (looked for {', '.join(VIDEO_SUFFIXES)} files "
                        "with a caption .txt beside each)")
    return items


class VideoFolder:
    """Captioned videos decoded on demand at the training size (module docstring)."""

    def __init__(self, data: str | Path, *, frames: int, height: int, width: int,
                 stride: int = 1, fps: float | None = None) -> None:
        self.items = list_videos(data)
        self.frames, self.height, self.width, self.stride, self.fps = frames, height, width, stride, fps
        self.size = len(self.items)
        self.description = (f"videos {data} ({self.size} clips, "
                            + (f"resampled to {fps:g} fps)" if fps else "frame for frame)"))

    def load(self, index: int) -> Item:
        """Raises :class:`DataError` naming the clip if it cannot be decoded at this size."""
        from attnqat.video import read_clip

        name, path, caption = self.items[index]
        try:
            video = read_clip(path, self.frames, self.height, self.width, stride=self.stride,
                              fps=self.fps)
        except (OSError, ValueError) as exc:
            raise DataError(f"clip {name}: {exc}") from exc
        return Item(name=name, caption=caption, video=video)


class SyntheticShapes:
    """The synthetic shapes training stream, endless (module docstring)."""

    def __init__(self, *, frames: int, height: int, width: int, seed: int = 0,
                 two_objects: float | None = None) -> None:
        self.frames, self.height, self.width, self.seed = frames, height, width, seed
        self.weights = None if two_objects is None else (1.0 - two_objects, two_objects)
        self.size = None   # endless
        self.description = (f"synthetic shapes (training split, stream seed {seed}"
                            + (f", {two_objects:.0%} two-object clips)" if two_objects is not None else ")"))

    def load(self, index: int) -> Item:
        from attnqat.synthetic import render, spec_at

        spec = spec_at(self.seed, index, "train", object_weights=self.weights)
        return Item(name=f"synthetic/{self.seed}/{index}", caption=spec.caption,
                    video=render(spec, self.frames, (self.height, self.width)))


# ----------------------------------------------------------------------------------------------
# The latent cache


def read_cache_manifest(folder: str | Path) -> dict:
    path = Path(folder) / CACHE_MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{folder} is not a latent cache ({CACHE_MANIFEST} missing; write one "
                        "with `attnqat finetune cache`)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc


class LatentCache:
    """Latents and prompt embeddings written by ``attnqat finetune cache``."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.meta = read_cache_manifest(self.folder)
        self.entries: list[tuple[str, str, int]] = []   # (name, shard file, row)
        for shard in self.meta.get("shards", []):
            for row, name in enumerate(shard["names"]):
                self.entries.append((name, shard["file"], row))
        if not self.entries:
            raise DataError(f"the latent cache {self.folder} holds no clips")
        self._open: dict[str, object] = {}
        self.size = len(self.entries)
        self.description = f"latent cache {folder} ({self.size} clips)"

    def _shard(self, file: str):
        from safetensors import safe_open

        if file not in self._open:
            try:
                self._open[file] = safe_open(str(self.folder / file), framework="pt", device="cpu")
            except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError
                raise DataError(f"cannot read cache shard {self.folder / file}: {exc}") from exc
        return self._open[file]

    def load(self, index: int) -> Item:
        name, file, row = self.entries[index]
        f = self._shard(file)
        offsets = f.get_slice("text_offsets")[row:row + 2].tolist()
        return Item(name=name, latents=f.get_slice("latents")[row:row + 1][0].float(),
                    text=f.get_slice("text")[offsets[0]:offsets[1]].float())

    def empty_text(self) -> torch.Tensor:
        """The embeddings of the empty prompt (caption dropout), (tokens, text_dim)."""
        from safetensors.torch import load_file

        return load_file(str(self.folder / self.meta["empty_prompt"]))["text"].float()

    def __getstate__(self) -> dict:   # DataLoader workers open their own shard handles
        state = dict(self.__dict__)
        state["_open"] = {}
        return state


def open_source(data: str, *, frames: int, height: int, width: int, stride: int = 1,
                seed: int = 0, two_objects: float | None = None, fps: float | None = None):
    """The source ``--data`` names: ``synthetic``, a cache folder, a clip folder or a manifest
    (``two_objects``: the synthetic stream's share of two-object clips; None: its own, a half;
    ``fps``: the rate clips are resampled to, None or 0 frame for frame)."""
    if data == "synthetic":
        return SyntheticShapes(frames=frames, height=height, width=width, seed=seed,
                               two_objects=two_objects)
    if two_objects is not None:
        raise DataError("--two-objects applies to --data synthetic only")
    p = Path(data).expanduser()
    if p.is_dir() and (p / CACHE_MANIFEST).is_file():
        return LatentCache(p)
    return VideoFolder(p, frames=frames, height=height, width=width, stride=stride, fps=fps or None)


def data_fingerprint(source) -> str:
    """A hash of what a source holds (names, file sizes; for a cache, its shards' clips), so that a
    resumed run notices data that changed under it. The synthetic stream: its description."""
    import hashlib

    h = hashlib.sha256(type(source).__name__.encode())
    if isinstance(source, VideoFolder):
        for name, path, caption in source.items:
            h.update(f"{name}\0{path.stat().st_size}\0{caption}\n".encode())
    elif isinstance(source, LatentCache):
        for name, file, row in source.entries:
            h.update(f"{name}\0{file}\0{row}\n".encode())
    else:
        h.update(source.description.encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# Order and batching


def mix_seed(*xs: int) -> int:
    """A 63-bit seed from integers (splitmix64 steps), so nearby inputs give unrelated seeds."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (int(x) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def sample_seed(seed: int, sample: int) -> int:
    """Seed of the random draws (noise level, noise, caption dropout) of global sample
    ``sample``: the same on any number of GPUs, and after a resume."""
    return mix_seed(seed, 0x51, sample)


class DataOrder:
    """Global sample index → item index (module docstring). ``n`` None: an endless source."""

    def __init__(self, n: int | None, seed: int) -> None:
        self.n, self.seed = n, seed
        self._perm: tuple[int, torch.Tensor] | None = None

    def item(self, g: int) -> int:
        if self.n is None:
            return g
        epoch, pos = divmod(g, self.n)
        if self._perm is None or self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(mix_seed(self.seed, 0xDA7A, epoch))
            self._perm = (epoch, torch.randperm(self.n, generator=gen))
        return int(self._perm[1][pos])

    def epoch(self, g: int) -> float | None:
        """Epochs read after ``g`` samples (None for an endless source)."""
        return None if self.n is None else g / self.n


class RankSamples(torch.utils.data.IterableDataset):
    """The items one rank reads, in order, from global sample ``start``: per step, the global
    samples ``step·G + micro·(W·b) + rank·b + j`` for micro-batch ``micro`` of ``accum`` and
    ``j < b``. Yields micro-batches, lists of ``(global sample, Item)``; DataLoader worker ``w``
    of ``n`` loads the micro-batches ``m ≡ w (mod n)`` and the loader hands them back in order,
    so the stream is the same whatever the number of workers."""

    def __init__(self, source, order: DataOrder, *, start: int, batch: int, rank: int,
                 world: int, accum: int = 1) -> None:
        self.source, self.order, self.start = source, order, start
        self.batch, self.rank, self.world, self.accum = batch, rank, world, accum

    def global_samples(self) -> Iterator[int]:
        g_batch = self.batch * self.world * self.accum
        step = self.start // g_batch
        if self.start % g_batch:
            raise ValueError(f"data position {self.start} is not a multiple of the global batch "
                             f"{g_batch}")
        while True:
            for micro in range(self.accum):
                base = step * g_batch + micro * self.batch * self.world + self.rank * self.batch
                yield from range(base, base + self.batch)
            step += 1

    def __iter__(self) -> Iterator[list[tuple[int, Item]]]:
        info = torch.utils.data.get_worker_info()
        n, w = (info.num_workers, info.id) if info is not None else (1, 0)
        samples = self.global_samples()
        m = 0
        while True:
            chunk = [next(samples) for _ in range(self.batch)]
            if m % n == w:
                try:
                    yield [(g, self.source.load(self.order.item(g))) for g in chunk]
                except DataError as exc:   # handed over as the batch; Batches raises it
                    yield exc
                    return
            m += 1


def collate(batch: list[tuple[int, Item]] | DataError) -> dict | DataError:
    """Items → ``{"samples": (B,) int64, "names", and "video" (B, T, H, W, 3) uint8 + "captions",
    or "latents" (B, C, T', H', W') + "text" (list of (tokens, D))}``; a :class:`DataError`
    passes through."""
    if isinstance(batch, DataError):
        return batch
    samples = torch.tensor([g for g, _ in batch], dtype=torch.long)
    items = [it for _, it in batch]
    out: dict = {"samples": samples, "names": [it.name for it in items]}
    if items[0].latents is not None:
        out["latents"] = torch.stack([it.latents for it in items])
        out["text"] = [it.text for it in items]
    else:
        out["video"] = torch.from_numpy(np.stack([it.video for it in items]))
        out["captions"] = [it.caption for it in items]
    return out


# DataLoader workers and stop signals. SIGTERM / SIGINT sent to the whole process group
# (``timeout``, a scheduler, Ctrl-C) must reach the training loop, which saves a checkpoint first,
# and not kill the workers under it; so a worker ignores them, until the main process shuts its
# loader down (:meth:`Batches.close`, or the interpreter exiting after a crash), when they end it.
# Without that last part a crashed run never exits: multiprocessing's exit handler SIGTERMs the
# workers and waits for them forever.

_OPEN_FLAGS: list = []   # the "shutting down" flags of the loaders not yet closed


def _release_workers_at_exit() -> None:
    """Registered with atexit after multiprocessing's own exit handler, so it runs before it."""
    for flag in _OPEN_FLAGS:
        flag.value = True


def _worker_obeys_stop_signals_only_when_released(flag, _worker_id: int) -> None:
    import os
    import signal

    def handle(_signum, _frame) -> None:
        if flag.value:
            os._exit(0)   # the main process is shutting the loader down; exit code 0: not a failure

    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)


class Batches:
    """Endless micro-batches (:func:`collate`) of one rank, read by DataLoader workers that end
    with the loader: :meth:`close` (also on leaving a ``with`` block) stops them within seconds,
    whatever they are doing. A clip that cannot be read raises its :class:`DataError` here, as the
    one line the worker wrote, not wrapped in the worker's traceback."""

    def __init__(self, ds: "RankSamples", workers: int) -> None:
        import atexit
        import ctypes
        import functools
        import multiprocessing

        self._flag = None
        init = None
        if workers:
            self._flag = multiprocessing.RawValue(ctypes.c_bool, False)
            if not _OPEN_FLAGS:
                atexit.unregister(_release_workers_at_exit)
                atexit.register(_release_workers_at_exit)
            _OPEN_FLAGS.append(self._flag)
            init = functools.partial(_worker_obeys_stop_signals_only_when_released, self._flag)
        self._it = iter(torch.utils.data.DataLoader(
            ds, batch_size=None, collate_fn=collate, num_workers=workers,
            prefetch_factor=4 if workers else None, persistent_workers=False, worker_init_fn=init))

    def __iter__(self) -> "Batches":
        return self

    def __next__(self) -> dict:
        if self._it is None:
            raise RuntimeError("the data loader is closed")
        batch = next(self._it)
        if isinstance(batch, DataError):
            raise batch
        return batch

    def close(self) -> None:
        """Stop the workers: ask each to finish (torch's own shutdown, a few seconds at most),
        then SIGTERM, which they now obey, then SIGKILL what is left."""
        it, self._it = self._it, None
        if it is None or self._flag is None:
            return
        self._flag.value = True
        try:
            it._shutdown_workers()
        finally:
            for w in getattr(it, "_workers", ()):
                if w.is_alive():
                    w.kill()
                    w.join(timeout=5)
            _OPEN_FLAGS.remove(self._flag)

    def __enter__(self) -> "Batches":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def loader(source, order: DataOrder, *, start: int, batch: int, rank: int, world: int,
           accum: int = 1, workers: int = 0) -> Batches:
    """Endless micro-batches (:func:`collate`) of one rank from global sample ``start``; close
    it (:meth:`Batches.close`) when done, also after a crash."""
    ds = RankSamples(source, order, start=start, batch=batch, rank=rank, world=world, accum=accum)
    return Batches(ds, workers)


def pad_text(texts: list[torch.Tensor], length: int) -> torch.Tensor:
    """Prompt embeddings of the real tokens → (B, length, D), zeros after them (as the Wan
    pipeline pads its prompt embeddings)."""
    d = texts[0].shape[-1]
    out = torch.zeros(len(texts), length, d, dtype=texts[0].dtype)
    for i, t in enumerate(texts):
        n = min(t.shape[0], length)
        out[i, :n] = t[:n]
    return out


__all__ = ["Batches", "CACHE_MANIFEST", "DataError", "DataOrder", "Item", "LatentCache", "RankSamples",
           "SyntheticShapes", "VIDEO_SUFFIXES", "VideoFolder", "collate", "data_fingerprint",
           "list_videos", "loader",
           "open_source", "pad_text", "read_cache_manifest", "sample_seed"]
