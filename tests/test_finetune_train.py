"""The fine-tuning trainer (attnqat/finetune/train.py) on a small Wan pipeline, CPU, fp32."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from attnqat.finetune import checkpoint as ckpt
from attnqat.finetune import train as T
from finetune_data import RUN, losses, small_model, write_clips

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return small_model(tmp_path_factory.mktemp("ft") / "small-wan")


def train(model: Path, out: Path, *extra: str) -> int:
    return T.main(["--model", str(model), "--out", str(out), *RUN, *extra])


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    full = {k: torch.empty(v) for k, v in _shapes(run).items()}
    ckpt.load_full_state(ckpt.checkpoint_dir(run, step), full)
    return full


def _shapes(run: Path) -> dict[str, tuple]:
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    with init_empty_weights():
        m = WanTransformer3DModel.from_config(json.loads((run / "transformer_config.json").read_text()))
    return {k: tuple(p.shape) for k, p in m.named_parameters()}


@pytest.mark.parametrize("attention,ablation", [("attnqat", None), ("dropin", None), ("bf16", None),
                                                ("attnqat", "d_from_o"), ("attnqat", "p_unquantized")])
def test_a_few_steps_with_each_student_method(model, tmp_path, attention, ablation):
    out = tmp_path / "run"
    args = ["--steps", "2", "--batch-size", "2", "--attention", attention, "--lr", "1e-3",
            "--warmup", "0"] + (["--ablation", ablation] if ablation else [])
    assert train(model, out, *args) == 0
    ls = losses(out)
    assert sorted(ls) == [1, 2] and all(0 < v < 10 for v in ls.values())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["attention"] == attention and cfg["ablation"] == ablation and cfg["precision"] == "auto"
    rec = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()][1]
    assert rec["grad_norm"] > 0 and set(rec["grad_norm_blocks"]) == {"block_00", "block_01", "embed_head"}
    assert rec["tokens_per_s"] > 0 and rec["peak_memory_gib"] > 0
    # the weights moved away from the model's
    from diffusers import WanTransformer3DModel

    base = WanTransformer3DModel.from_pretrained(model, subfolder="transformer", torch_dtype=torch.float32)
    w = _weights(out, 2)
    assert not torch.equal(w["blocks.0.attn1.to_q.weight"], base.blocks[0].attn1.to_q.weight)


def test_the_student_methods_train_differently(model, tmp_path):
    """Same data, seeds and steps: the three students' weights differ after one step, and
    attnqat's ablations differ from attnqat."""
    runs = {}
    for name, extra in {"attnqat": [], "dropin": ["--attention", "dropin"], "bf16": ["--attention", "bf16"],
                        "p1off": ["--ablation", "p_unquantized"]}.items():
        assert train(model, tmp_path / name, "--steps", "1", "--batch-size", "2", "--lr", "1e-2",
                     "--warmup", "0", *extra) == 0
        runs[name] = _weights(tmp_path / name, 1)["blocks.1.attn1.to_v.weight"]
    assert losses(tmp_path / "attnqat")[1] == losses(tmp_path / "p1off")[1]   # same forward
    assert losses(tmp_path / "attnqat")[1] != losses(tmp_path / "bf16")[1]
    for a, b in (("attnqat", "dropin"), ("attnqat", "bf16"), ("attnqat", "p1off")):
        assert not torch.equal(runs[a], runs[b]), (a, b)


def test_loss_falls_on_a_fixed_batch(model):
    """The same two samples (same noise, same noise level) again and again: the loss falls."""
    from attnqat.finetune import distributed
    from attnqat.finetune.encode import Encoder, load_components

    args = T.argparse.Namespace(**{**{k: None for k in vars(_parsed())}, "model": str(model),
                                   "out": "unused", "lr": 3e-3, "warmup": 0, "batch_size": 2,
                                   "device": "cpu"})
    ctx = distributed.init("cpu")
    try:
        cfg = T.resolve_config(args)
        enc = Encoder(load_components(model), ctx.device, cfg.max_sequence_length)
        from attnqat.synthetic import render, spec_at

        specs = [spec_at(0, k) for k in range(2)]
        video = torch.from_numpy(__import__("numpy").stack([render(s, 5, 32) for s in specs]))
        latents, text = enc.latents(video), enc.text([s.caption for s in specs])
        tr = T.Trainer(cfg, T.load_transformer(cfg), ctx, enc.text([""])[0])
        seen = []
        for step in range(30):
            seen.append(float(tr.micro_step(latents, text, torch.tensor([5, 9]))))
            tr.optimizer_step(step)
    finally:
        distributed.shutdown()
    assert sum(seen[-5:]) / 5 < 0.6 * sum(seen[:5]) / 5, seen


def _parsed():
    p = T.argparse.ArgumentParser()
    T.add_arguments(p)
    return p.parse_args([])


@pytest.mark.subprocess
def test_kill_9_and_resume_gives_bit_identical_later_losses(model, tmp_path):
    steps = ["--steps", "40", "--batch-size", "2", "--checkpoint-every", "4", "--keep", "2"]
    ref = tmp_path / "ref"
    assert train(model, ref, *steps) == 0
    want = losses(ref)
    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "attnqat.finetune.train", "--model", str(model), "--out", str(run),
           *RUN, *steps]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            if (run / "log.jsonl").is_file() and max(losses(run) or [0]) >= 10:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the run never reached step 10")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    killed_at = max(losses(run))
    assert killed_at < 40
    last = ckpt.complete_checkpoints(run)[-1][0]
    assert last % 4 == 0 and last <= killed_at
    assert len(ckpt.complete_checkpoints(run)) <= 2   # --keep 2
    assert train(model, run, "--resume") == 0
    got = losses(run)
    assert sorted(got) == list(range(1, 41))   # the records past the checkpoint were re-made once
    assert [got[s] for s in range(last + 1, 41)] == [want[s] for s in range(last + 1, 41)]
    assert all(got[s] == want[s] for s in got)
    events = [json.loads(x)["event"] for x in (run / "log.jsonl").read_text().splitlines()
              if json.loads(x)["kind"] == "event"]
    assert events[0] == "start" and "resume" in events


@pytest.mark.subprocess
def test_sigterm_saves_a_checkpoint_and_resume_continues(model, tmp_path):
    """SIGTERM to the whole process group (as `timeout` or a scheduler sends it), DataLoader
    workers included: the loop saves a checkpoint and stops."""
    run = tmp_path / "term"
    cmd = [sys.executable, "-m", "attnqat.finetune.train", "--model", str(model), "--out", str(run),
           *RUN, "--workers", "1", "--steps", "400", "--batch-size", "2", "--checkpoint-every", "1000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO, text=True,
                            start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and not ((run / "log.jsonl").is_file() and max(losses(run) or [0]) >= 3):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "stopped by SIGTERM" in out and "--resume" in out
    step = ckpt.complete_checkpoints(run)[-1][0]
    assert 3 <= step < 400 and step == max(losses(run))
    assert train(model, run, "--resume", "--steps", str(step + 2)) == 0   # --steps may grow
    assert max(losses(run)) == step + 2


def test_time_limit_stops_with_a_checkpoint(model, tmp_path, capsys):
    run = tmp_path / "timed"
    assert train(model, run, "--steps", "100000", "--batch-size", "1", "--time-limit", "0.02") == 0
    step = ckpt.complete_checkpoints(run)[-1][0]
    assert 1 <= step < 100000 and "time limit" in capsys.readouterr().out


def test_ema_and_export_load_in_generate(model, tmp_path):
    from attnqat.generate import generate
    from attnqat.wan import load_models

    run = tmp_path / "ema"
    assert train(model, run, "--steps", "3", "--batch-size", "2", "--ema", "0.5", "--lr", "1e-3",
                 "--warmup", "0") == 0
    live, ema = tmp_path / "live", tmp_path / "ema-out"
    from attnqat.finetune.export import export

    export(run, live, weights="live")
    export(run, ema)   # auto: the EMA
    side = json.loads((ema / "attnqat.json").read_text())
    assert side["weights"] == "attnqat-finetuned" and side["training"]["weights"] == "ema"
    assert side["training"]["steps"] == 3 and "Attn-QAT fine-tuned" in side["qat_weights_note"]
    from safetensors.torch import load_file

    a = load_file(str(live / "diffusion_pytorch_model.safetensors"))
    b = load_file(str(ema / "diffusion_pytorch_model.safetensors"))
    assert a["blocks.0.attn1.to_q.weight"].dtype == torch.bfloat16
    assert a["blocks.0.norm2.weight"].dtype == torch.float32   # kept in float32 as diffusers does
    assert not torch.equal(a["blocks.0.attn1.to_q.weight"], b["blocks.0.attn1.to_q.weight"])
    # the live export is the checkpoint's weights, rounded to bfloat16
    w = _weights(run, 3)
    assert torch.equal(a["blocks.0.attn1.to_q.weight"], w["blocks.0.attn1.to_q.weight"].bfloat16())
    models = load_models(model, qat_transformer=ema, device="cpu")
    assert not models.qat_info["identical_to_base"]
    assert models.qat_info["note"] == side["qat_weights_note"]
    res = generate("a red circle moves left on a blue background", methods="bf16,attnqat",
                   models=models, progress=False)
    assert res.videos["attnqat"].shape == (5, 32, 32, 3)
    assert res.record.methods["attnqat"].transformer == "attnqat"


def test_validation_writes_clips_and_procedural_scores(model, tmp_path):
    run = tmp_path / "val"
    assert train(model, run, "--steps", "2", "--batch-size", "1", "--val-every", "2",
                 "--val-prompts", "heldout:2") == 0
    recs = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    val = [r for r in recs if r["kind"] == "val"]
    assert len(val) == 1 and val[0]["step"] == 2 and val[0]["clips"] == 2
    assert all(0.0 <= val[0][k] <= 1.0 for k in ("colour", "shape", "motion", "all_correct"))
    assert sorted(p.name for p in (run / "val" / "step-0000002").iterdir()) == ["00.mp4", "01.mp4"]


def test_config_file_and_flags_and_resume_rules(model, tmp_path, capsys):
    conf = tmp_path / "run.toml"
    conf.write_text('steps = 2\nbatch-size = 1\nlr = 0.001\nattention = "dropin"\n')
    run = tmp_path / "conf"
    assert train(model, run, "--config", str(conf), "--attention", "bf16") == 0
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["steps"] == 2 and cfg["lr"] == 0.001 and cfg["attention"] == "bf16"   # the flag wins
    assert cfg["recipe"].startswith("tiny-wan:") and cfg["weight_decay"] == 0.01   # from the recipe
    # a run folder with checkpoints is not overwritten
    assert train(model, run, "--steps", "2") == 2
    assert "--resume" in capsys.readouterr().err
    # a resumed run keeps its identity
    assert train(model, run, "--resume", "--attention", "attnqat") == 2
    assert "keeps its attention" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"stepz": 3}')
    assert train(model, tmp_path / "x", "--config", str(bad)) == 2
    assert "unknown setting(s) stepz" in capsys.readouterr().err


@pytest.mark.parametrize("extra,message", [
    (["--data", "/no/such/folder"], "training data not found"),
    (["--height", "40"], "multiples of 16"),
    (["--frames", "6"], "4k+1"),
    (["--ablation", "d_from_o", "--attention", "dropin"], "attnqat only"),
    (["--ablation", "p_unquantized", "--backend", "triton"], "PyTorch reference"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--resume"], "no complete checkpoint"),
])
def test_bad_input_gets_one_clear_error(model, tmp_path, capsys, extra, message):
    out = tmp_path / "bad"
    if extra == ["--resume"]:
        out.mkdir()
        (out / "config.json").write_text(json.dumps({"model": str(model)}))
    assert train(model, out, "--steps", "1", *extra) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_unknown_method_is_refused_by_the_command_line(model, tmp_path, capsys):
    from attnqat.cli import main

    with pytest.raises(SystemExit) as e:
        main(["finetune", "train", "--model", str(model), "--out", str(tmp_path / "r"),
              "--attention", "fp8"])
    assert e.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err


def test_corrupt_clip_in_a_training_folder_is_named(model, tmp_path, capsys):
    data = tmp_path / "clips"
    write_clips(data, 2)
    (data / "clip01.mp4").write_bytes(b"not a video" * 50)
    assert train(model, tmp_path / "r", "--data", str(data), "--steps", "2", "--batch-size", "2") == 2
    err = capsys.readouterr().err
    assert "clip01.mp4" in err and "not a readable video" in err and "Traceback" not in err


def test_plot_draws_several_runs(model, tmp_path):
    from attnqat.finetune.plot import plot_runs

    for name in ("a", "b"):
        assert train(model, tmp_path / name, "--steps", "3", "--batch-size", "1",
                     *(["--attention", "dropin"] if name == "b" else [])) == 0
    png = plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "curves.png", smooth=2)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    with pytest.raises(ValueError, match="label"):
        plot_runs([tmp_path / "a"], tmp_path / "x.png", labels=["one", "two"])


@pytest.mark.slow
def test_bench_train_times_every_student_through_the_trainer(tmp_path, capsys):
    from attnqat.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "train", "--config", "tiny", "--resolution", "32x32", "--frames", "5",
                 "--steps", "1", "--warmup", "1", "--device", "cpu", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert [r["method"] for r in rec["rows"]] == ["bf16", "attnqat", "dropin", "sagebwd"]
    for r in rec["rows"]:
        assert r["step_s"] > 0 and r["loss_finite"] and len(r["losses"]) == 2
        assert r["tokens_per_step_per_gpu"] == 2 * (32 // 16) ** 2 and r["precision"] == "fp32"
    # the three students share the forward of their first (warm-up) step
    assert rec["rows"][1]["losses"][0] == rec["rows"][2]["losses"][0] != rec["rows"][0]["losses"][0]
    assert "vs bf16" in capsys.readouterr().out
    assert main(["bench", "train", "--config", "tiny", "--methods", "fp8", "--device", "cpu"]) == 2


@pytest.mark.parametrize("scheme", ["fastvideo", "wan"])
def test_start_weights_in_another_naming_scheme(model, tmp_path, scheme):
    """The model's own transformer saved under FastVideo's or original Wan's names (with a wrapper
    prefix) trains exactly as the model's transformer does."""
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    from attnqat.convert import from_diffusers

    tr = WanTransformer3DModel.from_pretrained(model, subfolder="transformer")
    renamed = {"model." + k: v.contiguous() for k, v in from_diffusers(tr.state_dict(), scheme).items()}
    assert "model.blocks.0.attn1.to_q.weight" not in renamed
    path = tmp_path / f"{scheme}.safetensors"
    save_file(renamed, str(path))
    common = ["--steps", "2", "--batch-size", "2", "--lr", "1e-3", "--warmup", "0"]
    assert train(model, tmp_path / "own", *common) == 0
    assert train(model, tmp_path / "other", *common, "--transformer", str(path)) == 0
    assert losses(tmp_path / "other") == losses(tmp_path / "own")
    assert json.loads((tmp_path / "other" / "config.json").read_text())["transformer"] == str(path)


def test_weights_trained_without_attnqat_are_never_labelled_attnqat(model, tmp_path):
    """The BF16 control's and the drop-in ablation's exports, loaded in the Attn-QAT slot, say what
    they are."""
    from attnqat import wan
    from attnqat.finetune.export import export

    for attention in ("bf16", "dropin"):
        run = tmp_path / attention
        assert train(model, run, "--steps", "1", "--batch-size", "1", "--attention", attention,
                     "--lr", "1e-3", "--warmup", "0") == 0
        out = export(run, tmp_path / f"{attention}-out")
        m = wan.load_models(model, qat_transformer=out, device="cpu")
        kind = wan.FINETUNED_WEIGHTS[attention]
        assert m.qat_info["fine_tuned"] is False and m.qat_info["identical_to_base"] is False
        assert m.qat_info["label"] == wan.QAT_LABEL_NOT_ATTNQAT[kind]
        assert m.qat_info["label"].startswith("not Attn-QAT") and "not Attn-QAT" in m.qat_info["note"]
    # the side-by-side band says so too (for the last, the drop-in ablation)
    from attnqat import generate as G

    bands = []
    real = G.vid.side_by_side
    G.vid.side_by_side = lambda videos, *a, **k: (bands.extend(videos), real(videos, *a, **k))[1]
    try:
        G.generate("a red circle moves left on a blue background", methods="bf16,attnqat",
                   models=m, progress=False, out=tmp_path / "gen")
    finally:
        G.vid.side_by_side = real
    # the page's names (#34): BF16 by its label, the Attn-QAT slot by what its weights are
    assert bands == ["BF16", wan.QAT_LABEL_NOT_ATTNQAT["dropin-finetuned"]]


def test_validation_uses_the_negative_prompt_generate_uses(model, tmp_path, monkeypatch):
    """A model whose defaults carry a negative prompt (real Wan: Wan's own) is validated against
    it, as `generate` would render; caption dropout still trains on the empty prompt."""
    import shutil

    from attnqat.finetune.encode import Encoder, load_components

    neg_model = tmp_path / "neg-model"
    shutil.copytree(model, neg_model)
    side = json.loads((neg_model / "attnqat.json").read_text())
    side["defaults"]["negative_prompt"] = "blurry, static"
    (neg_model / "attnqat.json").write_text(json.dumps(side))
    seen = {}
    real = T.Validator.__init__

    def spy(self, cfg, parts, prompts, prompt_text, negative_text, *a):
        seen["negative"] = negative_text
        real(self, cfg, parts, prompts, prompt_text, negative_text, *a)

    monkeypatch.setattr(T.Validator, "__init__", spy)
    assert T.main(["--model", str(neg_model), "--out", str(tmp_path / "r"), "--device", "cpu",
                   "--no-tensorboard", "--no-progress", "--steps", "1", "--batch-size", "1",
                   "--val-every", "1", "--val-prompts", "heldout:1"]) == 0
    enc = Encoder(load_components(neg_model), torch.device("cpu"), 16)
    assert torch.equal(seen["negative"], enc.text(["blurry, static"])[0])
    assert not torch.equal(seen["negative"], enc.text([""])[0])
