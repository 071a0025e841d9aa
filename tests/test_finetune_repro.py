"""``attnqat repro`` (attnqat/finetune/repro.py): a CPU smoke run of every stage with two tiny steps."""

from __future__ import annotations

import json

import pytest

from attnqat.finetune import repro as R
from finetune_data import small_model


def test_repro_help_names_the_stages(capsys):
    from attnqat.cli import main

    with pytest.raises(SystemExit) as e:
        main(["repro", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--stages" in out and "--eval-offset" in out and "--runs" in out


def test_paired_comparison_counts_discordant_clips():
    a = [True] * 30 + [False] * 10 + [True] * 5
    b = [True] * 30 + [True] * 10 + [False] * 5
    pr = R.paired(a, b)
    assert pr["only_a"] == 5 and pr["only_b"] == 10 and pr["n"] == 45
    assert pr["diff"] == pytest.approx(-5 / 45) and pr["lo"] < pr["diff"] < pr["hi"]
    from scipy.stats import binomtest

    assert pr["p"] == pytest.approx(binomtest(5, 15, 0.5).pvalue)
    same = R.paired([True, False] * 10, [True, False] * 10)
    assert same["diff"] == 0 and same["p"] == 1.0 and same["lo"] == same["hi"] == 0


def test_cost_difference_pairs_the_four_outcomes_of_a_prompt():
    # A loses 2 of 10 clips to 4-bit attention, B loses 5: A's cost is 3 points smaller
    a_bf16 = [True] * 8 + [False] * 2
    a_fp4 = [True] * 6 + [False] * 4
    b_bf16 = [True] * 10
    b_fp4 = [True] * 5 + [False] * 5
    c = R.cost_difference(a_fp4, a_bf16, b_fp4, b_bf16)
    assert c["cost_a"] == pytest.approx(-0.2) and c["cost_b"] == pytest.approx(-0.5)
    assert c["diff"] == pytest.approx(0.3) and c["lo"] <= c["diff"] <= c["hi"] and c["n"] == 10
    # the same weights twice: no difference, and an interval of zero width
    same = R.cost_difference(a_fp4, a_bf16, a_fp4, a_bf16)
    assert same["diff"] == same["lo"] == same["hi"] == 0
    with pytest.raises(ValueError):
        R.cost_difference(a_fp4, a_bf16[:5], b_fp4, b_bf16)


def test_attention_probe_measures_the_method_against_bf16_and_restores_the_processor(tmp_path):
    from attnqat.finetune import heldout
    from attnqat.finetune.attn_probe import attention_errors
    from attnqat.wan import get_processor, load_models

    models = load_models(small_model(tmp_path / "small-wan"), device="cpu")
    inp = heldout.inputs(models, 5, 2, steps=4)
    tr = models.pipe.transformer
    same = attention_errors(models, tr, inp, batch=2, steps=(0, 3), method="bf16")
    assert same["mean"] == 0 and len(same["layers"]) == len(tr.blocks) and sorted(same["by_step"]) == [0, 3]
    fp4 = attention_errors(models, tr, inp, batch=2, steps=(0, 3))
    assert 0 < fp4["mean"] < 1 and fp4["calls"] == same["calls"]
    assert "_attend" not in vars(get_processor(tr)) and get_processor(tr).method == "bf16"
    assert get_processor(tr).observer is None
    with pytest.raises(ValueError, match="no self-attention call"):
        attention_errors(models, tr, inp, batch=2, steps=(7,))


@pytest.mark.slow
def test_every_stage_on_the_cpu_with_two_steps(tmp_path):
    model = small_model(tmp_path / "small-wan")
    work, doc, ship = tmp_path / "work", tmp_path / "docs" / "repro.md", tmp_path / "qat"
    args = ["--work", str(work), "--model", str(model), "--runs", "attnqat,bf16,p2off", "--steps", "2",
            "--batch-size", "2", "--warmup", "0", "--eval-prompts", "3", "--eval-offset", "5",
            "--eval-batch", "3", "--workers", "0", "--device", "cpu", "--doc", str(doc),
            "--ship-to", str(ship)]
    assert R.main([*args, "--probe-prompts", "2", "--stages", "train,eval,probe,report,ship"]) == 0
    assert sorted(p.name for p in (work / "export").iterdir()) == ["attnqat", "bf16", "p2off"]
    evals = sorted(p.stem for p in (work / "eval").iterdir())
    assert evals == sorted(["base-bf16", "base-nvfp4", "base-sage3", "qat-nvfp4", "qat-bf16",
                            "control-bf16", "control-nvfp4", "p2off-nvfp4"])
    rec = json.loads((work / "eval" / "qat-nvfp4.json").read_text())
    assert rec["seeds"] == [5, 6, 7] and len(rec["clips"]) == 3
    assert rec["weights_record"]["training"]["steps"] == 2
    assert rec["similarity_to_base_bf16"]["ssim"] <= 1.0
    text = doc.read_text()
    assert "| Attn-QAT, NVFP4 attention |" in text and "McNemar" in text and "repro_curves.png" in text
    assert "## Robustness to 4-bit attention" in text and "| Attn-QAT | BF16 control |" in text
    # the same-training comparison: 4-bit attention deployed against none anywhere
    assert "| Attn-QAT, NVFP4 attention | BF16 control, BF16 attention |" in text
    assert "QAT-NVFP4 against the BF16 control with BF16 attention" in text
    probe = json.loads((work / "probe.json").read_text())
    assert sorted(probe["weights"]) == ["attnqat", "base", "bf16", "p2off"]
    for r in probe["weights"].values():   # NVFP4 attention changes every layer's output, not wildly
        assert r["prompts"] == 2 and all(0 < e < 1 for e in r["layers"]) and r["calls"] > 0
    assert "## 4-bit attention inside the model" in text
    assert "attnqat finetune train" in text and "--ablation d_from_o" in text
    assert (doc.parent / "repro_curves.png").stat().st_size > 10_000
    side = json.loads((ship / "attnqat.json").read_text())
    assert side["weights"] == "attnqat-finetuned" and "evaluation" in side
    # a second call continues: nothing is trained or evaluated again
    before = (work / "eval" / "qat-nvfp4.json").stat().st_mtime_ns
    assert R.main([*args, "--stages", "train,eval"]) == 0
    assert (work / "eval" / "qat-nvfp4.json").stat().st_mtime_ns == before
    # --configs evaluates only the named configurations, against the cached base BF16 clips
    (work / "eval" / "base-sage3.json").unlink()
    (work / "eval" / "control-nvfp4.json").unlink()
    cached = sorted((work / "cache").glob("base-bf16-5-3-*.npy"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    assert R.main([*args, "--stages", "eval", "--configs", "base-sage3"]) == 0
    assert (work / "eval" / "base-sage3.json").is_file()
    assert not (work / "eval" / "control-nvfp4.json").exists()
    assert cached[0].stat().st_mtime_ns == stamp
    assert R.main([*args, "--stages", "eval", "--configs", "base-sage3,nonsense"]) == 2
    # --start-from continues the study: each run starts from its own export, and the report says so
    work2, doc2 = tmp_path / "work2", tmp_path / "docs2" / "repro.md"
    more = [*args[:1], str(work2), *args[2:], "--start-from", str(work), "--seed", "1"]
    more[more.index("--doc") + 1] = str(doc2)
    assert R.main([*more, "--runs", "attnqat,dropin", "--stages", "train"]) == 2   # dropin has no export
    assert R.main([*more, "--runs", "attnqat", "--stages", "train,eval,report",
                   "--configs", "base-bf16,qat-nvfp4"]) == 0
    side = json.loads((work2 / "export" / "attnqat" / "attnqat.json").read_text())
    assert side["training"]["start_weights"] == str(work / "export" / "attnqat")
    text = doc2.read_text()
    assert "continuation" in text and "--transformer" in text and "--start-from" in text


def test_clip_size_reaches_training_and_evaluation_and_is_not_mixed(tmp_path):
    """--size/--frames: the runs train and the evaluation generates at that size; a work folder
    evaluated at one size refuses another; bad sizes are refused before any work."""
    model = small_model(tmp_path / "small-wan")
    work = tmp_path / "work"
    args = ["--work", str(work), "--model", str(model), "--runs", "attnqat", "--steps", "1",
            "--batch-size", "1", "--warmup", "0", "--eval-prompts", "2", "--eval-offset", "5",
            "--eval-batch", "2", "--workers", "0", "--device", "cpu", "--doc", str(tmp_path / "r.md")]
    assert R.main([*args, "--size", "20"]) == 2 and R.main([*args, "--frames", "6"]) == 2
    assert not work.exists()
    big = [*args, "--size", "48", "--frames", "9"]
    assert R.main([*big, "--stages", "train,eval", "--configs", "base-bf16,qat-nvfp4"]) == 0
    cfg = json.loads((work / "runs" / "attnqat" / "config.json").read_text())
    assert (cfg["height"], cfg["width"], cfg["frames"]) == (48, 48, 9)
    for c in ("base-bf16", "qat-nvfp4"):
        s = json.loads((work / "eval" / f"{c}.json").read_text())["settings"]
        assert (s["height"], s["width"], s["frames"]) == (48, 48, 9)
    assert len(list((work / "cache").glob("base-bf16-5-2-*-48x48x9-*.npy"))) == 1
    # the model's own size (32 x 32, 5 frames) in the same folder: refused, nothing written
    assert R.main([*args, "--stages", "eval", "--configs", "base-nvfp4"]) == 2
    assert R.main([*args, "--size", "32", "--stages", "eval", "--configs", "base-nvfp4"]) == 2
    assert not (work / "eval" / "base-nvfp4.json").exists()
