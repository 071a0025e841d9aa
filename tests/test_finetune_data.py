"""Training data (attnqat/finetune/data.py), the latent cache (cache.py) and the encoder (encode.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from attnqat.finetune import checkpoint as ckpt
from attnqat.finetune import data as D
from attnqat.finetune import train as T
from attnqat.finetune.cache import build_cache
from finetune_data import RUN, losses, small_model, write_clips


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return small_model(tmp_path_factory.mktemp("ftd") / "small-wan")


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("clips") / "videos"
    write_clips(folder, 6)
    return folder


def test_folder_and_manifests_list_the_same_clips(tmp_path, clips):
    items = D.list_videos(clips)
    assert [n for n, _, _ in items] == [f"clip{k:02d}.mp4" for k in range(6)]
    rows = [{"path": f"videos/clip{k:02d}.mp4", "caption": c} for k, (_, _, c) in enumerate(items)]
    jsonl = clips.parent / "m.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    csv = clips.parent / "m.csv"
    csv.write_text("video,text\n" + "".join(f"{r['path']},\"{r['caption']}\"\n" for r in rows))
    for manifest in (jsonl, csv):
        got = D.list_videos(manifest)
        assert [c for _, _, c in got] == [c for _, _, c in items]
        assert [p.resolve() for _, p, _ in got] == [p.resolve() for _, p, _ in items]


def test_bad_data_is_refused_with_every_problem_named(tmp_path, clips):
    with pytest.raises(D.DataError, match="not found"):
        D.list_videos(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(D.DataError, match="holds no videos"):
        D.list_videos(tmp_path / "empty")
    odd = tmp_path / "odd"
    write_clips(odd, 2)
    (odd / "clip01.txt").unlink()
    with pytest.raises(D.DataError, match=r"clip01.mp4 has no caption \(clip01.txt missing\)"):
        D.list_videos(odd)
    m = tmp_path / "m.jsonl"
    m.write_text('{"path": "nowhere.mp4", "caption": "x"}\n{"caption": "y"}\n')
    with pytest.raises(D.DataError, match="2 problem.*nowhere.mp4 does not exist.*row 2 lacks a video"):
        D.list_videos(m)


def test_video_folder_decodes_at_the_training_size(clips):
    src = D.VideoFolder(clips, frames=5, height=32, width=32)
    item = src.load(2)
    assert item.video.shape == (5, 32, 32, 3) and item.video.dtype == np.uint8
    assert item.caption == (clips / "clip02.txt").read_text().strip()
    with pytest.raises(D.DataError, match="clip00.mp4.*fewer than the 13"):
        D.VideoFolder(clips, frames=13, height=32, width=32).load(0)


def test_data_order_is_a_permutation_per_epoch_and_independent_of_the_split():
    order = D.DataOrder(7, seed=1)
    first = [order.item(g) for g in range(7)]
    second = [order.item(g) for g in range(7, 14)]
    assert sorted(first) == sorted(second) == list(range(7)) and first != second
    assert D.DataOrder(None, 1).item(123) == 123
    # two ranks of batch 2 read together what one rank of batch 4 reads, step by step
    src = type("S", (), {"load": staticmethod(lambda i: D.Item(name=str(i)))})()
    one = D.RankSamples(src, order, start=4, batch=4, rank=0, world=1)
    two = [D.RankSamples(src, order, start=4, batch=2, rank=r, world=2) for r in (0, 1)]
    it1, it2 = iter(one), [iter(r) for r in two]
    first = [g for g, _ in next(it1)]
    assert first == [4, 5, 6, 7] == [g for r in it2 for g, _ in next(r)]
    for _ in range(3):
        assert [g for g, _ in next(it1)] == [g for r in it2 for g, _ in next(r)]
    with pytest.raises(ValueError, match="not a multiple"):
        next(iter(D.RankSamples(src, order, start=3, batch=2, rank=0, world=1)))


def test_loader_gives_the_same_batches_with_workers(clips):
    src = D.VideoFolder(clips, frames=5, height=32, width=32)
    order = D.DataOrder(src.size, seed=0)
    a = D.loader(src, order, start=0, batch=2, rank=0, world=1, workers=0)
    b = D.loader(src, order, start=0, batch=2, rank=0, world=1, workers=2)
    with b:
        for _ in range(4):
            x, y = next(a), next(b)
            assert x["names"] == y["names"] and torch.equal(x["video"], y["video"])
            assert x["samples"].tolist() == y["samples"].tolist()


def test_cache_resumes_skips_corrupt_clips_and_holds_what_the_encoder_gives(model, tmp_path, clips, capsys):
    from attnqat.finetune.encode import Encoder, load_components

    data = tmp_path / "videos"
    data.mkdir()
    for k in range(3):   # a first part of the data
        for ext in (".mp4", ".txt"):
            (data / f"clip{k:02d}{ext}").write_bytes((clips / f"clip{k:02d}{ext}").read_bytes())
    cache = tmp_path / "cache"
    m1 = build_cache(data, cache, model=str(model), shard_size=2, latent_dtype="float32", progress=False)
    assert [s["names"] for s in m1["shards"]] == [["clip00.mp4", "clip01.mp4"], ["clip02.mp4"]]
    for k in range(3, 6):   # more clips arrive, one of them corrupt
        for ext in (".mp4", ".txt"):
            (data / f"clip{k:02d}{ext}").write_bytes((clips / f"clip{k:02d}{ext}").read_bytes())
    (data / "clip04.mp4").write_bytes(b"\x00garbage" * 100)
    capsys.readouterr()
    m2 = build_cache(data, cache, model=str(model), shard_size=2, latent_dtype="float32", progress=False)
    out = capsys.readouterr().out
    assert "3 already cached, 3 to encode" in out and "skipped 1" in out and "clip04.mp4" in out
    assert [s["names"] for s in m2["shards"]][2:] == [["clip03.mp4", "clip05.mp4"]]
    assert m2["skipped"][0]["name"] == "clip04.mp4" and "not a readable video" in m2["skipped"][0]["reason"]
    # what is cached is what the encoder computes
    src = D.LatentCache(cache)
    assert src.size == 5
    item = src.load(3)
    assert item.name == "clip03.mp4" and item.latents.shape == (16, 2, 4, 4)
    enc = Encoder(load_components(model), torch.device("cpu"), 16)
    video = torch.from_numpy(D.VideoFolder(data, frames=5, height=32, width=32).load(3).video)[None]
    assert torch.equal(item.latents, enc.latents(video)[0])
    text = enc.text([(data / "clip03.txt").read_text().strip()])
    assert torch.equal(D.pad_text([item.text], 16)[0], text[0].bfloat16().float())
    assert torch.equal(D.pad_text([src.empty_text()], 16)[0], enc.text([""])[0].bfloat16().float())
    # other settings are refused, naming them
    with pytest.raises(D.DataError, match="frames 5 .cache. vs 9"):
        build_cache(data, cache, model=str(model), frames=9, latent_dtype="float32", progress=False)


@pytest.mark.slow
def test_training_from_the_cache_equals_training_from_the_clips(model, tmp_path, clips):
    """Same clips, same order, same noise: the cached latents and embeddings give the losses the
    on-the-fly encoding gives (float32 latents; embeddings are bfloat16 either way)."""
    cache = tmp_path / "cache"
    build_cache(clips, cache, model=str(model), latent_dtype="float32", progress=False)
    steps = ["--steps", "4", "--batch-size", "2", "--lr", "1e-3", "--warmup", "0"]
    assert T.main(["--model", str(model), "--out", str(tmp_path / "raw"), "--data", str(clips),
                   *RUN, *steps]) == 0
    assert T.main(["--model", str(model), "--out", str(tmp_path / "cached"), "--data", str(cache),
                   *RUN, *steps]) == 0
    raw, cached = losses(tmp_path / "raw"), losses(tmp_path / "cached")
    assert sorted(raw) == [1, 2, 3, 4]
    for s in raw:
        assert cached[s] == pytest.approx(raw[s], rel=1e-5)


@pytest.mark.slow
def test_a_planted_nan_stops_the_run_and_keeps_the_checkpoint(model, tmp_path, clips, capsys):
    from safetensors.torch import load_file, save_file

    cache = tmp_path / "cache"
    build_cache(clips, cache, model=str(model), shard_size=8, latent_dtype="float32", progress=False)
    order = D.DataOrder(6, seed=0)
    victim = order.item(4)   # global sample 4: the first sample of step 3 at batch 2
    shard = cache / "shard-00000.safetensors"
    t = load_file(str(shard))
    t["latents"][victim, 0, 0, 0, 0] = float("nan")
    save_file(t, str(shard))
    run = tmp_path / "nan"
    capsys.readouterr()
    rc = T.main(["--model", str(model), "--out", str(run), "--data", str(cache), *RUN,
                 "--steps", "6", "--batch-size", "2", "--checkpoint-every", "2"])
    assert rc == T.EXIT_NONFINITE
    captured = capsys.readouterr()
    assert "non-finite loss (nan) at step 3" in captured.out
    assert f"clip{victim:02d}.mp4" in captured.err
    assert [s for s, _ in ckpt.complete_checkpoints(run)] == [2]
    assert sorted(losses(run)) == [1, 2]
    state = ckpt.read_state(ckpt.checkpoint_dir(run, 2))
    assert state["step"] == 2 and state["samples"] == 4
    full = {"blocks.0.attn1.to_q.weight": torch.empty(64, 64)}
    ckpt.load_full_state(ckpt.checkpoint_dir(run, 2), full)
    assert torch.isfinite(full["blocks.0.attn1.to_q.weight"]).all()


def _counter_clip(path: Path, fps: float, n: int = 40, caption: str = "a grey square") -> Path:
    """A clip whose frame i is uniformly grey at level 5·i, so a frame's source index is readable."""
    from attnqat.video import write_mp4

    frames = np.stack([np.full((32, 32, 3), 5 * i, np.uint8) for i in range(n)])
    write_mp4(frames, path, fps, crf=0)
    path.with_suffix(".txt").write_text(caption + "\n")
    return path


def _source_index(video: np.ndarray) -> list[int]:
    return [round(float(f.mean()) / 5) for f in video]


@pytest.mark.parametrize("rate,want", [(32, [0, 2, 4, 6, 8]), (8, [0, 0, 1, 1, 2]), (16, [0, 1, 2, 3, 4])])
def test_clips_are_resampled_to_the_model_frame_rate(tmp_path, rate, want):
    """A 32 fps clip read for a 16 fps model takes every second frame, an 8 fps clip shows each
    frame twice: the motion per second is the source's."""
    folder = tmp_path / "v"
    folder.mkdir()
    _counter_clip(folder / "c.mp4", rate)
    src = D.open_source(str(folder), frames=5, height=32, width=32, fps=16)
    assert _source_index(src.load(0).video) == want and "resampled to 16 fps" in src.description
    native = D.open_source(str(folder), frames=5, height=32, width=32, fps=0)
    assert _source_index(native.load(0).video) == [0, 1, 2, 3, 4]


def test_cache_records_frame_rates_and_training_takes_its_sizes(model, tmp_path, capsys):
    """The cache resamples to the model's 16 fps and records each clip's own rate; a run on it
    needs no sizes repeated, and one asking for other sizes or another rate is refused."""
    data = tmp_path / "v"
    data.mkdir()
    for k, rate in enumerate((8, 24, 30)):
        _counter_clip(data / f"c{k}.mp4", rate, caption=f"clip {k}")
    cache = tmp_path / "cache"
    m = build_cache(data, cache, model=str(model), latent_dtype="float32", progress=False)
    assert m["fps"] == 16.0 and m["shards"][0]["source_fps"] == [8.0, 24.0, 30.0]
    with pytest.raises(D.DataError, match="fps 16.0 .cache. vs 0.0"):
        build_cache(data, cache, model=str(model), fps=0, latent_dtype="float32", progress=False)
    run = ["--model", str(model), "--data", str(cache), "--device", "cpu", "--no-tensorboard",
           "--no-progress", "--steps", "1", "--batch-size", "1"]
    assert T.main([*run, "--out", str(tmp_path / "r")]) == 0   # default workers, sizes from the cache
    cfg = json.loads((tmp_path / "r" / "config.json").read_text())
    assert (cfg["height"], cfg["width"], cfg["frames"], cfg["fps"]) == (32, 32, 5, 16.0)
    capsys.readouterr()
    assert T.main([*run, "--out", str(tmp_path / "r2"), "--fps", "24"]) == 2
    assert "fps 16.0 (cache) vs 24.0 (run)" in capsys.readouterr().err


def test_the_folder_finetune_data_writes_is_training_data(model, tmp_path):
    """`attnqat finetune data` writes clips and a captions.json index: cache and train read it;
    cache shards get the usual file mode."""
    import os
    import stat

    from attnqat.cli import main

    folder = tmp_path / "shapes"
    assert main(["finetune", "data", "--out", str(folder), "--n", "3", "--frames", "9", "--size", "32"]) == 0
    assert (folder / "captions.json").is_file() and not list(folder.glob("*.txt"))
    items = D.list_videos(folder)
    assert [n for n, _, _ in items] == ["train_00000.mp4", "train_00001.mp4", "train_00002.mp4"]
    cache = tmp_path / "cache"
    build_cache(folder, cache, model=str(model), progress=False)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((cache / "shard-00000.safetensors").stat().st_mode) == 0o666 & ~umask
    assert T.main(["--model", str(model), "--out", str(tmp_path / "r"), "--data", str(folder),
                   "--device", "cpu", "--no-tensorboard", "--no-progress", "--steps", "1",
                   "--batch-size", "1"]) == 0
