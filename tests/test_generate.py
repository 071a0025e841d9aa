"""End-to-end generation on the embedded tiny pipeline (attnqat/generate.py, attnqat/generate_cli.py)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import attnqat.generate as gen
from attnqat import video, wan
from attnqat.cli import main
from attnqat.record import GenerationRecord
from attnqat.tiny import TINY_MODEL_DIR, TINY_QAT_DIR, TinyWanConfig

SMALL = dict(height=32, width=32, frames=5, steps=2, seed=0)
PROMPT = "a red circle moves left on a blue background"


@pytest.fixture(scope="module")
def models():
    return wan.load_models(qat_transformer="auto", device="cpu")


def test_cli_every_method_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["generate", "--prompt", PROMPT, "--negative-prompt", "blurry", "--height", "32",
               "--width", "48", "--frames", "5", "--steps", "2", "--fps", "8", "--seed", "7",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Attn-QAT fine-tuned" in printed and "docs/repro.md" in printed  # which weights ran
    assert f"wrote {out}" in printed
    names = sorted(p.name for p in out.iterdir())
    assert names == ["attnqat.mp4", "bf16.mp4", "nvfp4.mp4", "record.json", "sage3.mp4", "sagebwd.mp4",
                     "side_by_side.mp4"]
    rec = json.loads((out / "record.json").read_text())
    assert rec["prompt"] == PROMPT and rec["negative_prompt"] == "blurry" and rec["seed"] == 7
    assert rec["settings"]["methods"] == ["bf16", "nvfp4", "sage3", "attnqat", "sagebwd"]
    assert rec["settings"]["fp4_scope"] == "self"
    assert rec["side_by_side"] == "side_by_side.mp4"
    assert rec["versions"]["torch"] == torch.__version__
    assert rec["qat_weights_note"].startswith("Attn-QAT fine-tuned")
    # which precision ran, and which Attn-QAT weights (the shipped fine-tuned ones: said in the label)
    assert rec["precision"]["dtype"] == wan.dtype_name(wan.resolve_dtype("auto", "cpu")[0])
    assert rec["precision"]["reason"] and rec["settings"]["dtype"] == rec["precision"]["dtype"]
    assert rec["qat"]["label"] == wan.QAT_LABEL_FINE_TUNED and rec["qat"]["fine_tuned"] is True
    assert rec["methods"]["attnqat"]["label"] == wan.QAT_LABEL_FINE_TUNED
    assert GenerationRecord.from_dict(rec).to_dict() == rec  # the typed record reads it back
    for m, d in rec["methods"].items():
        assert d["video"] == f"{m}.mp4"
        assert video.probe_mp4(out / d["video"]) == {"frames": 5, "height": 32, "width": 48, "fps": 8.0}
        t = d["timings"]
        assert t["denoising_s"] > 0 and t["decoding_s"] > 0 and t["text_encoding_s"] > 0
        assert t["total_s"] == pytest.approx(t["denoising_s"] + t["decoding_s"])
        assert 0 < t["attention_s"] < t["denoising_s"]
        assert d["attention_calls"]["self"] == 2 * 2 * TinyWanConfig().num_layers  # steps x cfg x layers
        assert d["peak_memory_bytes"] > 0
        if m == "bf16":
            assert d["psnr"] is None and d["ssim"] is None
        else:
            assert d["psnr"] is not None and d["psnr"] > 0 and 0 < d["ssim"] <= 1
    assert rec["methods"]["attnqat"]["transformer"] == "attnqat"
    assert rec["methods"]["attnqat"]["attention_method"] == "nvfp4"
    sbs = video.probe_mp4(out / "side_by_side.mp4")
    assert sbs["frames"] == 5 and sbs["width"] == 5 * 48 + 4 * video.GAP and sbs["height"] > 32


def test_same_noise_same_embeddings_and_text_encoded_once(models, monkeypatch):
    calls = []
    hook = models.pipe.text_encoder.register_forward_hook(lambda *a: calls.append(1))
    seen = []
    real_denoise = gen.denoise

    def spy(transformer, sched, latents, pe, ne, **kw):
        seen.append((latents.clone(), pe.clone(), ne.clone()))
        return real_denoise(transformer, sched, latents, pe, ne, **kw)

    monkeypatch.setattr(gen, "denoise", spy)
    try:
        res = gen.generate(PROMPT, models=models, progress=False, **SMALL)
    finally:
        hook.remove()
    assert len(calls) == 2  # prompt and negative prompt, once for all five methods
    # five methods, plus the Attn-QAT weights with BF16 attention: the reference of Attn-QAT's
    # 4-bit error (#34), from the same noise and embeddings too
    assert len(seen) == 5 + 1
    for lat, pe, ne in seen[1:]:
        assert torch.equal(lat, seen[0][0]) and torch.equal(pe, seen[0][1]) and torch.equal(ne, seen[0][2])
    assert torch.equal(res.initial_latents, seen[0][0])
    v = res.videos
    assert set(v) == {"bf16", "nvfp4", "sage3", "attnqat", "sagebwd"}
    assert not np.array_equal(v["bf16"], v["nvfp4"])
    # the same attention on other (the Attn-QAT fine-tuned) weights
    assert res.record.methods["attnqat"].attention_method == "nvfp4"
    assert not np.array_equal(v["nvfp4"], v["attnqat"])


def test_bf16_equals_the_diffusers_pipeline(models):
    """Our loop is WanPipeline's: with the same latents and embeddings the frames are identical."""
    res = gen.generate(PROMPT, methods="bf16", models=models, progress=False, guidance=4.0, **SMALL)
    pipe = models.pipe
    wan.set_method(pipe.transformer, "bf16")
    # the prompt padding is the model's (its sidecar's max_sequence_length), as in generate
    pe, ne = gen.encode_prompts(models, PROMPT, "", 4.0, res.record.settings["max_sequence_length"])
    pipe.scheduler = gen._make_scheduler(pipe.scheduler, 3.0)
    frames = pipe(prompt_embeds=pe, negative_prompt_embeds=ne, latents=res.initial_latents,
                  guidance_scale=4.0, num_inference_steps=2, height=32, width=32, num_frames=5,
                  output_type="np").frames
    assert np.array_equal(video.to_uint8_frames(frames), res.videos["bf16"])


def test_fp4_scope_all_changes_the_output(models):
    a = gen.generate(PROMPT, methods="nvfp4", models=models, progress=False, **SMALL)
    b = gen.generate(PROMPT, methods="nvfp4", models=models, progress=False, fp4_scope="all", **SMALL)
    assert not np.array_equal(a.videos["nvfp4"], b.videos["nvfp4"])
    assert b.record.settings["fp4_scope"] == "all"


def test_save_load_round_trip_reproduces_outputs(models, tmp_path):
    base = tmp_path / "copy"
    models.pipe.save_pretrained(base)
    shutil.copy(TINY_MODEL_DIR / "attnqat.json", base / "attnqat.json")
    models.qat_transformer.save_pretrained(tmp_path / "tiny-wan-qat")
    again = wan.load_models(base, qat_transformer=tmp_path / "tiny-wan-qat", device="cpu")
    a = gen.generate(PROMPT, models=models, progress=False, methods="bf16,attnqat", **SMALL)
    b = gen.generate(PROMPT, models=again, progress=False, methods="bf16,attnqat", **SMALL)
    for m in ("bf16", "attnqat"):
        assert np.array_equal(a.videos[m], b.videos[m])


@pytest.mark.slow
def test_default_tiny_size(tmp_path, models):
    res = gen.generate(PROMPT, methods="bf16", models=models, progress=False, out=tmp_path / "o")
    s = res.record.settings
    assert (s["height"], s["width"], s["frames"], s["fps"], s["steps"]) == (128, 128, 33, 16.0, 20)
    assert video.probe_mp4(tmp_path / "o" / "bf16.mp4") == {"frames": 33, "height": 128, "width": 128,
                                                            "fps": 16.0}


@pytest.fixture()
def no_loading(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("a model was loaded before the inputs were validated")

    monkeypatch.setattr(gen, "load_models", fail)


@pytest.mark.parametrize("kwargs, field, message", [
    (dict(height=100), "height", "a multiple of 16"),
    (dict(width=40), "width", "a multiple of 16"),
    (dict(frames=32), "frames", "4k+1"),
    (dict(frames=0), "frames", "4k+1"),
    (dict(steps=0), "steps", "a whole number of steps from 1"),
    (dict(steps=-3), "steps", "a whole number of steps from 1"),
    (dict(steps=2.5), "steps", "a whole number"),
    (dict(steps="ten"), "steps", "a whole number"),
    (dict(seed=-2), "seed", "−1 for a random seed"),
    (dict(seed=2 ** 63), "seed", "2^63−1"),
    (dict(seed=2.0 ** 60), "seed", "an integer"),  # a float this large has lost digits
    (dict(seed="abc"), "seed", "an integer"),
    (dict(methods="bf16,fp8"), "methods", "unknown method"),
    (dict(methods="bf16,bf16"), "methods", "more than once"),
    (dict(methods=""), "methods", "at least one method"),
    (dict(guidance=-1.0), "guidance", "≥ 0"),
    (dict(fps=0), "fps", "above 0"),
    (dict(dtype="float16"), "dtype", "unknown dtype"),
    (dict(qat_transformer="/no/such/qat"), "qat_transformer", "does not exist"),
    (dict(backend="triton", methods="nvfp4", fp4_scope="all"), "backend", "CUDA"),
])
def test_bad_input_is_refused_before_loading(tmp_path, no_loading, kwargs, field, message):
    out = tmp_path / "out"
    with pytest.raises(gen.InvalidInput) as info:
        gen.generate(PROMPT, out=out, progress=False, **kwargs)
    assert list(info.value.errors) == [field] and message in info.value.errors[field]
    assert info.value.field == field
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_every_invalid_input_is_reported_at_once(no_loading):
    with pytest.raises(gen.InvalidInput) as info:
        gen.resolve_settings(" ", methods="fp8", seed="x", steps=0, height=20, frames=2)
    assert list(info.value.errors) == ["prompt", "methods", "seed", "steps", "height", "frames"]


def test_numbers_are_taken_exactly_as_given(no_loading):
    s, _ = gen.resolve_settings(PROMPT, seed=str(gen.MAX_SEED), steps="3", frames=9.0, guidance="4.5")
    assert s.seed == 2 ** 63 - 1 and s.steps == 3 and s.frames == 9 and s.guidance == 4.5
    s, _ = gen.resolve_settings(PROMPT, seed=gen.MAX_SEED)
    assert s.seed == gen.MAX_SEED  # the largest seed is accepted, not rounded
    assert gen.resolve_settings(PROMPT, seed=" \u22121 ")[0].seed == -1  # a typed minus sign


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_triton_backend_is_refused_with_one_reason_before_loading(no_loading, capsys, tmp_path):
    rc = main(["generate", "--prompt", PROMPT, "--backend", "triton", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("attnqat generate: error: --backend: the Triton kernels need a CUDA GPU")


def test_threads_must_be_positive(no_loading, capsys, tmp_path):
    rc = main(["generate", "--prompt", PROMPT, "--threads", "0", "--out", str(tmp_path / "o")])
    assert rc == 2 and capsys.readouterr().err.strip() == \
        "attnqat generate: error: --threads: at least 1, got 0"


def test_triton_backend_rules():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert "CUDA" in gen._check_backend("triton", ["nvfp4"], "all", cpu, torch.bfloat16)
    assert "bfloat16" in gen._check_backend("triton", ["nvfp4"], "all", cuda, torch.float32)
    assert gen._check_backend("triton", ["nvfp4", "sage3"], "all", cuda, torch.bfloat16) is None
    # plain attention (the bf16 slot, cross-attention under scope self) runs SDPA: the defaults work
    assert gen._check_backend("triton", list(gen.GENERATION_METHODS), "self", cuda, torch.bfloat16) is None
    assert gen._check_backend("triton", ["bf16"], "self", cpu, torch.float32) is None
    assert gen._check_backend("auto", ["bf16"], "self", cpu, torch.float32) is None


def test_random_seed_is_drawn_once_and_recorded(models):
    a = gen.generate(PROMPT, methods="bf16,nvfp4", models=models, progress=False,
                     **{**SMALL, "seed": -1})
    seed = a.record.seed
    assert isinstance(seed, int) and 0 <= seed < gen.RANDOM_SEED_BOUND
    b = gen.generate(PROMPT, methods="bf16", models=models, progress=False, **{**SMALL, "seed": seed})
    assert np.array_equal(a.videos["bf16"], b.videos["bf16"])  # the recorded seed reproduces it


def test_step_callback_reports_every_step_and_can_stop(models):
    events = []
    res = gen.generate(PROMPT, methods="bf16,nvfp4", models=models, progress=False,
                       on_step=events.append, **SMALL)
    phases = [(e.phase, e.method, e.step) for e in events]
    expected = [("text", None, 0)]
    for m in ("bf16", "nvfp4"):
        expected += [("denoising", m, i) for i in range(SMALL["steps"] + 1)]
        expected += [("decoding", m, SMALL["steps"]), ("done", m, SMALL["steps"])]
    assert phases == expected
    done = [e for e in events if e.phase == "done"]
    assert [e.timings for e in done] == [res.record.methods[m].timings for m in ("bf16", "nvfp4")]
    assert all(b.elapsed_s >= a.elapsed_s for a, b in zip(events, events[1:]))

    class Stop(Exception):
        pass

    def stop_after_first_step(event):
        if event.phase == "denoising" and event.step == 1:
            raise Stop

    with pytest.raises(Stop):
        gen.generate(PROMPT, methods="bf16", models=models, progress=False,
                     on_step=stop_after_first_step, **SMALL)


def test_loaded_models_fix_the_dtype(models):
    other = "float32" if models.dtype == torch.bfloat16 else "bfloat16"
    with pytest.raises(gen.InvalidInput) as info:
        gen.generate(PROMPT, models=models, dtype=other, progress=False, **SMALL)
    assert "dtype" in info.value.errors


def test_attnqat_without_qat_weights(tmp_path, no_loading):
    model = tmp_path / "real-like"
    shutil.copytree(TINY_MODEL_DIR, model)
    (model / "attnqat.json").unlink()  # a plain diffusers folder names no Attn-QAT transformer
    with pytest.raises(gen.InvalidInput, match="needs Attn-QAT weights"):
        gen.generate(PROMPT, model=model, out=tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()


def test_missing_model_and_cuda_without_cuda(tmp_path, no_loading, capsys):
    rc = main(["generate", "--prompt", PROMPT, "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert rc == 2 and "model folder not found" in capsys.readouterr().err
    if not torch.cuda.is_available():
        rc = main(["generate", "--prompt", PROMPT, "--device", "cuda", "--out", str(tmp_path / "o")])
        assert rc == 2 and "CUDA is not available" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_corrupted_model_leaves_nothing(tmp_path, capsys):
    model = tmp_path / "tiny"
    shutil.copytree(TINY_MODEL_DIR, model)
    f = model / "vae" / "diffusion_pytorch_model.safetensors"
    f.write_bytes(f.read_bytes()[:2000])
    rc = main(["generate", "--prompt", PROMPT, "--model", str(model), "--qat-transformer",
               str(TINY_QAT_DIR), "--out", str(tmp_path / "o"), "--no-progress", "--height", "32",
               "--width", "32", "--frames", "5", "--steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "could not load the Wan pipeline" in err and "vae" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


def test_corrupted_qat_file_is_reported(tmp_path, capsys):
    bad = tmp_path / "qat.safetensors"
    bad.write_bytes((TINY_QAT_DIR / "diffusion_pytorch_model.safetensors").read_bytes()[:3000])
    rc = main(["generate", "--prompt", PROMPT, "--qat-transformer", str(bad), "--out",
               str(tmp_path / "o"), "--no-progress", "--height", "32", "--width", "32",
               "--frames", "5", "--steps", "1"])
    assert rc == 2 and "corrupted or not a safetensors file" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_failure_while_writing_leaves_no_partial_output(tmp_path, models, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(gen.vid, "side_by_side", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        gen.generate(PROMPT, methods="bf16,nvfp4", models=models, progress=False,
                     out=tmp_path / "o", **SMALL)
    assert list(tmp_path.iterdir()) == []


def test_existing_output_folder(tmp_path, models):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(gen.GenerationError, match="not empty"):
        gen.generate(PROMPT, methods="bf16", models=models, progress=False, out=out, **SMALL)
    gen.generate(PROMPT, methods="bf16,nvfp4", models=models, progress=False, out=out,
                 overwrite=True, **SMALL)
    gen.generate(PROMPT, methods="bf16", models=models, progress=False, out=out, overwrite=True, **SMALL)
    # the earlier run's nvfp4 clip is gone, the user's own file stays
    assert sorted(p.name for p in out.iterdir()) == ["bf16.mp4", "keep.txt", "record.json", "side_by_side.mp4"]


def test_offload_path_gives_the_same_clips(models):
    offloaded = wan.load_models(qat_transformer="auto", device="cpu", offload=True)
    assert offloaded.offload
    a = gen.generate(PROMPT, models=models, progress=False, methods="bf16,attnqat", **SMALL)
    b = gen.generate(PROMPT, models=offloaded, progress=False, methods="bf16,attnqat", **SMALL)
    for m in ("bf16", "attnqat"):
        assert np.array_equal(a.videos[m], b.videos[m])
    assert b.record.settings["offload"] is True and a.record.settings["offload"] is False
