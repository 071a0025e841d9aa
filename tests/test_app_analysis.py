"""The analyses behind the app's round 3 (#34) on the CPU with the tiny model, at small sizes: the
dispatch log behind each panel's receipt (feature 7), the attention-error map and
``attnqat generate --error-map`` (8), the seed sweep's statistics (9)."""

from __future__ import annotations

import importlib
import json
import math

import pytest
import torch

from attnqat.app import player
from attnqat.error_map import ErrorMapObserver
from attnqat.generate import dispatch_fallbacks
from attnqat.sweep import SweepResult, format_table, parse_seeds, summarize

att = importlib.import_module("attnqat.attention")  # attnqat.attention is also the function
PROMPT = "a red circle moves left on a blue background"


def test_the_dispatch_log_records_what_ran():
    q, k, v = (torch.randn(1, 20, 2, 16) for _ in range(3))
    with att.dispatch_log() as log:
        att.attention(q, k, v, method="bf16")
        att.attention(q, k, v, method="nvfp4", backend="torch")
        att.attention(q, k, v, method="nvfp4", backend="torch")
    entries = {(e["method"], e["implementation"]): e for e in log.entries()}
    sdpa = entries[("bf16", "sdpa")]
    # the SDPA backend is the one torch's own dispatcher picks for these inputs
    from torch.nn.attention import SDPBackend

    chosen = SDPBackend(torch._fused_sdp_choice(q.transpose(1, 2), k.transpose(1, 2),
                                                v.transpose(1, 2), None, 0.0, False,
                                                scale=0.25)).name
    assert sdpa["detail"] == chosen and sdpa["calls"] == 1 and sdpa["device"] == "cpu"
    ref = entries[("nvfp4", "reference")]
    assert ref["calls"] == 2 and ref["dtype"] == "float32" and ref["fallback"] is None
    # outside a log nothing is recorded
    att.attention(q, k, v, method="bf16")
    assert sum(e["calls"] for e in log.entries()) == 3


def test_a_fallback_is_a_loud_line_on_the_card():
    dispatch = [{"kind": "self", "method": "nvfp4", "implementation": "reference",
                 "device": "cuda:0", "dtype": "bfloat16", "backend": "auto", "detail": None,
                 "fallback": "head_dim 80 is not supported", "calls": 60}]
    lines = dispatch_fallbacks(dispatch)
    assert lines == ["self-attention nvfp4 ran the reference instead of the kernels (60 calls): "
                     "head_dim 80 is not supported"]
    html = player.render_receipt({"dispatch": dispatch, "fallbacks": lines})
    assert 'role="alert"' in html and "Fell back" in html and "head_dim 80" in html
    quiet = player.render_receipt({"dispatch": [{**dispatch[0], "fallback": None,
                                                 "device": "cpu"}], "fallbacks": []})
    assert "alert" not in quiet and "the PyTorch reference" in quiet and "CUDA GPU" in quiet


def test_the_error_map_observer_measures_relative_error_per_step_and_layer():
    obs = ErrorMapObserver(layers=2, steps=2)
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    ref = att.attention(q, k, v, method="bf16")
    obs(q, k, v, ref, "self")          # step 0, layer 0: exact
    obs(q, k, v, 2 * ref, "self")      # step 0, layer 1: error = ‖ref‖
    obs(q, k, v, ref, "cross")         # not collected (self only)
    obs.next_step()
    obs(q, k, v, ref * 1.5, "self")    # step 1, layer 0
    grid = obs.result()["self"]
    assert grid[0][0] == pytest.approx(0.0, abs=1e-6)
    assert grid[0][1] == pytest.approx(1.0, rel=1e-5)
    assert grid[1][0] == pytest.approx(0.5, rel=1e-5) and grid[1][1] is None


def test_generate_error_map_writes_png_and_json(tmp_path, capsys):
    from attnqat.cli import main

    out = tmp_path / "run"
    rc = main(["generate", "--prompt", PROMPT, "--methods", "bf16,nvfp4", "--height", "32",
               "--width", "32", "--frames", "5", "--steps", "2", "--seed", "3", "--out", str(out),
               "--no-progress", "--device", "cpu", "--error-map"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "attention-error map" in printed and "nvfp4 mean" in printed
    assert (out / "error_map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "error_map.json").read_text())
    assert list(data["methods"]) == ["nvfp4"]  # BF16 has no error against itself
    m = data["methods"]["nvfp4"]
    grid = m["rel_error"]["self"]
    assert len(grid) == 2 == m["steps"] and all(len(row) == m["layers"] for row in grid)
    vals = [x for row in grid for x in row]
    assert all(x is not None and 0 < x < 1 for x in vals)  # 4-bit attention is close, not equal
    record = json.loads((out / "record.json").read_text())
    assert record["error_map"]["json"] == "error_map.json"
    assert record["error_map"]["summary"]["nvfp4"]["mean"] == pytest.approx(sum(vals) / len(vals))


def test_seed_lists_and_sweep_statistics():
    assert parse_seeds("0-2,7") == [0, 1, 2, 7]
    assert parse_seeds(10, 3) == [10, 11, 12]
    for bad, fragment in (("5", "2 to"), ("1,1", "twice"), ("a-b", "cannot read")):
        with pytest.raises(ValueError, match=fragment):
            parse_seeds(bad)
    rows = [{"seed": s, "method": m, "label": m, "psnr": p, "ssim": q, "identical": p is None,
             "score": sc}
            for s, m, p, q, sc in ((0, "bf16", None, None, 0.5), (1, "bf16", None, None, 0.7),
                                   (0, "nvfp4", 20.0, 0.8, 0.4), (1, "nvfp4", None, 1.0, 0.6),
                                   (2, "nvfp4", 30.0, 0.9, 0.5))]
    summ = summarize(rows, ["bf16", "nvfp4"])
    nv = summ["nvfp4"]
    assert nv["psnr"]["n"] == 2 and nv["psnr"]["mean"] == 25.0  # the identical clip is left out
    assert nv["psnr"]["std"] == pytest.approx(math.sqrt(50.0)) and nv["identical"] == 1
    assert nv["ssim"]["mean"] == pytest.approx(0.9) and summ["bf16"]["score"]["mean"] == 0.6
    res = SweepResult(prompt="p", seeds=[0, 1, 2], methods=["bf16", "nvfp4"], rows=rows,
                      summary=summ, score_name="procedural score")
    table = format_table(res)
    assert "25.00 ± 7.07 (1 identical)" in table and "procedural score" in table
    assert "reference" in table.splitlines()[1]


def test_the_kernels_note_the_kernel_they_choose():
    """The receipt's Gluon/Triton comes from the kernels' own decision, noted where it is made."""
    pytest.importorskip("triton")
    from attnqat.kernels import receipt
    from attnqat.kernels.gluon_fwd import choose_schedule
    from attnqat.kernels.gluon_fwd_qat import choose_qat_schedule

    q = torch.randn(1, 16, 1, 64, dtype=torch.bfloat16)
    with receipt.collect() as ran:
        a = choose_schedule(q, q, q, "triton", None)
        b = choose_qat_schedule(q, q, q, None, None)  # head_dim 64: not an auto Gluon size
    assert ran == [a, b] == ["triton", "triton"]
    choose_schedule(q, q, q, "triton", None)  # outside collect: nothing kept, nothing raised
    assert ran == ["triton", "triton"]
