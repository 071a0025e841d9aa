"""LoRA fine-tuning (attnqat/lora.py, --lora-rank in finetune/train.py, export, generate --lora):
trained on the CPU with Attn-QAT attention and the default data workers, exported as diffusers'
LoRA file, loaded by diffusers' own load_lora_weights, and generated with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnqat.finetune import checkpoint as ckpt
from attnqat.finetune import train as T
from finetune_data import losses, small_model

FLAGS = ["--device", "cpu", "--no-tensorboard", "--no-progress"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return small_model(tmp_path_factory.mktemp("lora") / "small-wan")


@pytest.fixture(scope="module")
def run(model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora-run") / "run"
    assert T.main(["--model", str(model), "--out", str(out), *FLAGS, "--steps", "4", "--batch-size", "2",
                   "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2", "--warmup", "0",
                   "--checkpoint-every", "2"]) == 0
    return out


def test_lora_trains_only_the_adapter_and_checkpoints_only_it(model, run):
    import torch.distributed.checkpoint as dcp

    assert sorted(losses(run)) == [1, 2, 3, 4]
    keys = list(dcp.FileSystemReader(str(ckpt.checkpoint_dir(run, 4))).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("model.")]
    # q, k, v, out of both attentions and the two FFN projections, A and B, in each of 2 blocks
    assert len(model_keys) == 2 * (8 + 2) * 2 and all(".lora_" in k for k in model_keys)
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["lora_rank"] == 4 and cfg["lora_alpha"] == 8
    # resumes (the base comes from the model, the adapter from the checkpoint)
    assert T.main(["--out", str(run), "--resume", *FLAGS, "--steps", "5"]) == 0
    assert max(losses(run)) == 5


def test_export_is_read_by_diffusers_and_generates(model, run, tmp_path):
    from diffusers import WanPipeline, WanTransformer3DModel
    from safetensors.torch import load_file

    from attnqat.finetune.export import export
    from attnqat.generate import generate
    from attnqat.lora import LORA_FILE

    adapter = export(run, tmp_path / "adapter")
    side = json.loads((adapter / "attnqat.json").read_text())
    assert side["kind"] == "attnqat-lora" and side["training"]["lora_rank"] == 4
    assert "LoRA rank 4" in side["qat_weights_note"]
    lora = load_file(str(adapter / LORA_FILE))
    assert all(k.startswith("transformer.blocks.") and ".lora_" in k for k in lora)
    # diffusers' own loader: base + (alpha / rank) · B A on every targeted projection
    pipe = WanPipeline.from_pretrained(model, dtype=torch.float32)
    base = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    pipe.load_lora_weights(str(adapter))
    pipe.fuse_lora()
    fused = pipe.transformer.state_dict()
    name = "blocks.1.ffn.net.2"
    a, b = lora[f"transformer.{name}.lora_A.weight"], lora[f"transformer.{name}.lora_B.weight"]
    got = fused.get(f"{name}.base_layer.weight", fused.get(f"{name}.weight"))
    assert torch.allclose(got, base[f"{name}.weight"] + 2.0 * b.float() @ a.float(), atol=1e-6)
    assert not torch.equal(got, base[f"{name}.weight"])   # the adapter trained (B left zero)
    # the merged export holds the same weights (bfloat16)
    merged = export(run, tmp_path / "merged", merge=True)
    m = WanTransformer3DModel.from_pretrained(merged, dtype=torch.float32)
    assert torch.allclose(m.state_dict()[f"{name}.weight"], got.bfloat16().float())
    # generate --lora
    out = tmp_path / "gen"
    from attnqat.cli import main as cli

    assert cli(["generate", "--prompt", "a red circle moves left on a blue background", "--model", str(model),
                     "--lora", str(adapter), "--methods", "bf16,attnqat", "--device", "cpu",
                     "--out", str(out), "--no-progress"]) == 0
    rec = json.loads((out / "record.json").read_text())
    assert rec["methods"]["attnqat"]["label"] == "Attn-QAT fine-tuned" and (out / "attnqat.mp4").is_file()
    res = generate("a red circle moves left on a blue background", model=str(model),
                   qat_transformer=merged, methods="attnqat", device="cpu", progress=False, seed=0)
    via_lora = generate("a red circle moves left on a blue background", model=str(model),
                        qat_transformer=adapter, methods="attnqat", device="cpu", progress=False, seed=0)
    diff = (res.videos["attnqat"].astype(float) - via_lora.videos["attnqat"].astype(float))
    assert abs(diff).mean() < 2.0   # the merged (bfloat16) and the fused adapter: one model


def test_lora_settings_are_checked(model, tmp_path, capsys):
    assert T.main(["--model", str(model), "--out", str(tmp_path / "x"), *FLAGS, "--lora-alpha", "4"]) == 2
    assert "--lora-alpha must be > 0 and needs --lora-rank" in capsys.readouterr().err
    assert T.main(["--model", str(model), "--out", str(tmp_path / "y"), *FLAGS, "--lora-rank", "-1"]) == 2
    assert "--lora-rank must be an integer >= 0" in capsys.readouterr().err
