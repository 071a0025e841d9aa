"""The full-size Wan transformer benchmark, run on the CPU with the tiny shape (attnqat/bench_wan.py)."""

from __future__ import annotations

import json

import pytest
import torch

from attnqat import bench_wan
from attnqat.cli import main


@pytest.mark.slow
def test_tiny_benchmark_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "wan", "--config", "tiny", "--resolutions", "32x48,64x32", "--frames", "5",
               "--iters", "2", "--device", "cpu", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "forward ms" in printed and "attn share" in printed
    res = json.loads(out.read_text())
    assert res["config"] == "tiny" and res["dtype"] == "bfloat16"
    rows = res["rows"]
    assert [(r["height"], r["width"], r["method"]) for r in rows] == [
        (h, w, m) for h, w in ((32, 48), (64, 32)) for m in ("bf16", "nvfp4", "sage3", "sagebwd")]
    layers = res["transformer_config"]["num_layers"]
    for r in rows:
        assert r["tokens"] == 2 * (r["height"] // 16) * (r["width"] // 16)
        assert r["attention_calls_per_forward"] == {"self": layers, "cross": layers}
        assert len(r["forward_all_s"]) == 2 and r["forward_s"] > 0
        assert 0 < r["attention_share"] < 1
        assert r["output_finite"] is True
        assert r["vs_bf16"] == pytest.approx(r["forward_s"] / next(
            x["forward_s"] for x in rows if x["method"] == "bf16" and x["height"] == r["height"]))


def test_full_size_configs_are_wan_2_1():
    c13, c14 = bench_wan.model_config("1.3b"), bench_wan.model_config("14b")
    assert (c13["num_layers"], c13["num_attention_heads"], c13["attention_head_dim"], c13["ffn_dim"]) == (30, 12, 128, 8960)
    assert (c14["num_layers"], c14["num_attention_heads"], c14["attention_head_dim"], c14["ffn_dim"]) == (40, 40, 128, 13824)
    for c in (c13, c14):
        assert (c["text_dim"], c["in_channels"], c["out_channels"], c["freq_dim"], tuple(c["patch_size"])) == \
            (4096, 16, 16, 256, (1, 2, 2))
    # 480p, 81 frames: latent 21 x 60 x 104, 32,760 tokens after the 1x2x2 patches
    assert 21 * (480 // 16) * (832 // 16) == 32760


def test_random_transformer_dtypes_and_parameter_count():
    from diffusers import WanTransformer3DModel

    cfg = bench_wan.model_config("tiny")
    model = bench_wan.build_random_transformer(cfg, torch.device("cpu"))
    assert model.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert model.blocks[0].scale_shift_table.dtype == torch.float32
    assert model.blocks[0].norm2.weight.dtype == torch.float32
    assert all(p.device.type == "cpu" for p in model.parameters())
    ref = WanTransformer3DModel(**cfg)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    assert torch.equal(model.rope.freqs_cos, ref.rope.freqs_cos)  # buffers built normally


def test_bad_arguments(capsys):
    assert main(["bench", "wan", "--config", "tiny", "--resolutions", "100x100", "--device", "cpu"]) == 2
    assert "multiples of 16" in capsys.readouterr().err
    assert main(["bench", "wan", "--config", "tiny", "--methods", "bf16,attnqat", "--device", "cpu"]) == 2
    assert "--methods" in capsys.readouterr().err
    assert main(["bench", "wan", "--config", "1.3b", "--device", "cpu"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert main(["bench", "wan", "--config", "tiny", "--frames", "8", "--device", "cpu"]) == 2
    assert bench_wan.parse_resolution("720p") == ("720p", 720, 1280)
