"""``attnqat repro`` (attnqat/finetune/repro.py): a CPU smoke run of every stage with two tiny steps."""

from __future__ import annotations

import argparse
import json
import subprocess

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
    assert evals == sorted(["base-bf16", "base-nvfp4", "base-sage3", "base-sagebwd", "qat-nvfp4", "qat-bf16",
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


def _git(root, *a):
    subprocess.run(["git", "-C", str(root), *a], check=True, capture_output=True)


def _git_out(root, *a):
    return subprocess.run(["git", "-C", str(root), *a], check=True, capture_output=True).stdout


def test_prompt_ranges_follow_the_evaluation_discipline(tmp_path, monkeypatch, capsys):
    """Prompts >= 1400 are never evaluated; 900-1399 only once docs/repro/protocol.md is committed
    (and unmodified); 0-899 always. Refused before any work, in one line."""
    from attnqat.finetune import heldout as H

    root = tmp_path / "repo"
    (root / "docs" / "repro").mkdir(parents=True)
    monkeypatch.setattr(H, "PROJECT_ROOT", root)
    assert H.check_prompt_range(0, 900) == "development" and H.check_prompt_range(100, 800) == "development"
    for first, n in ((1400, 1), (1300, 101), (0, 1401), (1399, 2)):
        with pytest.raises(H.PromptRangeError, match="never evaluated"):
            H.check_prompt_range(first, n)
    # no protocol, then no git checkout, then uncommitted, then committed, then modified
    with pytest.raises(H.PromptRangeError, match="does not exist"):
        H.check_prompt_range(900, 500)
    (root / H.PROTOCOL).write_text("# protocol\n")
    with pytest.raises(H.PromptRangeError, match="not a git checkout"):
        H.check_prompt_range(899, 2)
    _git(root, "init", "-q")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "start")
    with pytest.raises(H.PromptRangeError, match="not committed"):
        H.check_prompt_range(900, 500)
    _git(root, "add", H.PROTOCOL)
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "protocol")
    assert H.check_prompt_range(900, 500) == "confirmatory"
    with pytest.raises(H.PromptRangeError, match="never evaluated"):
        H.check_prompt_range(900, 501)
    (root / H.PROTOCOL).write_text("# protocol, changed after the fact\n")
    with pytest.raises(H.PromptRangeError, match="uncommitted changes"):
        H.check_prompt_range(950, 10)
    # a copy of the tree without .git (the lent GPU's): the committed blob is named in the environment
    copy = tmp_path / "copy"
    (copy / "docs" / "repro").mkdir(parents=True)
    (copy / H.PROTOCOL).write_bytes(_git_out(root, "show", f"HEAD:{H.PROTOCOL}"))
    blob = _git_out(root, "rev-parse", f"HEAD:{H.PROTOCOL}").decode().strip()
    assert H.git_blob_id((copy / H.PROTOCOL).read_bytes()) == blob
    monkeypatch.setattr(H, "PROJECT_ROOT", copy)
    with pytest.raises(H.PromptRangeError, match="not a git checkout"):
        H.check_prompt_range(900, 500)
    monkeypatch.setenv(H.PROTOCOL_ENV, f"abc123 {blob}")
    assert H.check_prompt_range(900, 500) == "confirmatory"
    assert H.protocol_committed(copy) == (True, f"abc123 (blob {blob}, named in {H.PROTOCOL_ENV})")
    (copy / H.PROTOCOL).write_text("# protocol, changed after the fact\n")
    with pytest.raises(H.PromptRangeError, match="differs from the committed copy"):
        H.check_prompt_range(900, 500)
    monkeypatch.delenv(H.PROTOCOL_ENV)
    # the command refuses before touching the work folder, with one line naming the rule
    monkeypatch.setattr(H, "PROJECT_ROOT", tmp_path / "nowhere")
    work = tmp_path / "work"
    base = ["--work", str(work), "--model", "unused", "--runs", "attnqat", "--device", "cpu"]
    capsys.readouterr()
    assert R.main([*base, "--stages", "eval", "--eval-offset", "1400", "--eval-prompts", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "1400" in err and "never evaluated" in err
    assert R.main([*base, "--stages", "probe", "--eval-offset", "890", "--probe-prompts", "16"]) == 2
    assert "confirmatory" in capsys.readouterr().err
    assert R.main([*base, "--stages", "eval", "--eval-offset", "100", "--eval-prompts", "1300"]) == 2
    assert not work.exists()
    # the generation path itself refuses too (attnqat finetune tiny's eval goes through it)
    with pytest.raises(H.PromptRangeError):
        H.inputs(None, 1400, 1)


def test_sign_flip_is_mcnemar_on_binary_outcomes_and_holm_adjusts():
    from scipy.stats import binomtest

    a = [1] * 20 + [0] * 7 + [1] * 3 + [0] * 10
    b = [1] * 20 + [1] * 7 + [0] * 3 + [0] * 10
    d = [x - y for x, y in zip(a, b)]
    assert R.sign_flip_p(d) == pytest.approx(binomtest(3, 10, 0.5).pvalue)
    # seed means: a clear shift is significant, no shift is not
    rng = __import__("numpy").random.default_rng(1)
    assert R.sign_flip_p(rng.choice([0, 1 / 3, 2 / 3], 200) + 0.0) < 0.001
    assert R.sign_flip_p(rng.choice([-1 / 3, 1 / 3], 200)) > 0.01
    pr = R.paired([1 / 3, 2 / 3, 1.0, 0.0], [0, 1, 1, 0], level=0.90)
    assert pr["test"] == "sign-flip" and pr["level"] == 0.90 and pr["only_a"] == 1 and pr["only_b"] == 1
    adj = R.holm({"a": 0.01, "b": 0.04, "c": 0.03})
    assert adj == pytest.approx({"a": 0.03, "c": 0.06, "b": 0.06})
    w = R.won_back([0.8] * 50, [0.7] * 50, [0.9] * 50)
    assert w["share"] == pytest.approx(0.5) and w["loss"] == pytest.approx(0.2)


@pytest.mark.slow   # 5-7 s on the 2-core machine (docs/development.md, Tests)
def test_seeds_records_and_report(tmp_path):
    """--seeds: every run trained and evaluated per seed; each record keeps every scorer output,
    PSNR/SSIM against the base's and the own weights' BF16 clips and the weights' sha256; the
    report shows the spread across seeds and the protocol's endpoints."""
    import hashlib

    model = small_model(tmp_path / "small-wan")
    work = tmp_path / "work"
    args = ["--work", str(work), "--model", str(model), "--runs", "attnqat,bf16,qad", "--seeds", "0,1",
            "--steps", "1", "--batch-size", "1", "--warmup", "0", "--eval-prompts", "3",
            "--eval-offset", "5", "--eval-batch", "3", "--workers", "0", "--device", "cpu",
            "--doc", str(tmp_path / "r.md")]
    assert R.main([*args[:-2], "--seeds", "0,0"]) == 2
    assert R.main([*args, "--stages", "train,eval,report"]) == 0
    assert sorted(p.name for p in (work / "export").iterdir()) == [
        "attnqat-s0", "attnqat-s1", "bf16-s0", "bf16-s1", "qad-s0", "qad-s1"]
    cfg = json.loads((work / "runs" / "qad-s1" / "config.json").read_text())
    assert cfg["objective"] == "distill" and cfg["seed"] == 1 and cfg["attention"] == "attnqat"
    assert json.loads((work / "runs" / "attnqat-s1" / "config.json").read_text())["objective"] == "flow"
    names = sorted(p.stem for p in (work / "eval").iterdir())
    assert "qat-nvfp4-s0" in names and "qat-nvfp4-s1" in names and "base-nvfp4" in names
    assert "qad-bf16-s1" in names and "base-nvfp4-s0" not in names
    rec = json.loads((work / "eval" / "qat-nvfp4-s1.json").read_text())
    assert rec["seed"] == 1 and rec["weights"] == "attnqat-s1" and rec["prompt_set"] == "development"
    sha = hashlib.sha256((work / "export" / "attnqat-s1" / "diffusion_pytorch_model.safetensors")
                         .read_bytes()).hexdigest()
    assert rec["weights_sha256"] == {"diffusion_pytorch_model.safetensors": sha}
    base = json.loads((work / "eval" / "base-bf16.json").read_text())
    assert set(base["weights_sha256"]) and base["similarity_to_base_bf16"] is None
    for clip in rec["clips"]:   # every scorer output, and both references
        for k in ("objects", "count", "n_detected", "quality", "prompt_score", "temporal", "cleanliness",
                  "detected_background", "all_correct"):
            assert k in clip, k
        assert all("stated" in o and "detected" in o and "colour" in o for o in clip["objects"])
        assert clip["ssim_vs_base_bf16"] <= 1 and clip["ssim_vs_own_bf16"] <= 1
    own = json.loads((work / "eval" / "qat-bf16-s1.json").read_text())
    assert own["similarity_to_own_bf16"] is None and own["clips"][0]["ssim_vs_own_bf16"] is None
    assert rec["similarity_to_own_bf16"]["ssim"] <= 1
    text = (tmp_path / "r.md").read_text()
    assert "across seeds" in text and "(2 seeds)" in text and "## The protocol's endpoints" in text
    assert "## Quality score: NVFP4 loss won back" in text and "Attn-QAT (distill)" in text
    assert "--objective distill" in text and "(seed 1)" in text
    assert "## Against the target" in text and "Attn-QAT (distill): the protocol's target" in text
    rep = json.loads((work / "report.json").read_text())
    spread = rep["seed_spreads"]["qat-nvfp4 vs base-bf16"]
    assert sorted(spread["by_seed"]) == ["0", "1"] and spread["min"] <= spread["max"]
    assert "primary" in rep["endpoints"]["qat"] and rep["endpoints"]["qat"]["primary"]["level"] == 0.90
    assert "H2 vs naive NVFP4" in rep["endpoints"]["qat"]["secondary"]
    # H5's control: the BF16 control run for flow Attn-QAT, the base for the distillation run (protocol §9)
    assert "H5 4-bit cost vs the control's" in rep["endpoints"]["qat"]["secondary"]
    assert "H5 4-bit cost vs the base's" in rep["endpoints"]["qad"]["secondary"]
    assert all("p_holm" in v for v in rep["endpoints"]["qat"]["secondary"].values())
    # the pooled per-prompt outcome is the mean over the seeds
    s0 = [c["all_correct"] for c in json.loads((work / "eval" / "qat-nvfp4-s0.json").read_text())["clips"]]
    s1 = [c["all_correct"] for c in rec["clips"]]
    recs = R.load_evals(work)["qat-nvfp4"]
    assert list(R.outcomes(recs)) == pytest.approx([(a + b) / 2 for a, b in zip(s0, s1)])
    # docs/repro keeps its records gzipped (the tree must stay under the device tool's 64 MiB):
    # the report reads a gzipped copy of the work folder to the same numbers
    import gzip
    import shutil

    from attnqat.finetune.runlog import read_log
    gz = tmp_path / "gz"
    shutil.copytree(work, gz)
    for f in [*gz.glob("eval/*.json"), *gz.glob("runs/*/log.jsonl")]:
        f.with_name(f.name + ".gz").write_bytes(gzip.compress(f.read_bytes()))
        f.unlink()
    assert list(R.outcomes(R.load_evals(gz)["qat-nvfp4"])) == list(R.outcomes(recs))
    run = next(d for d in (work / "runs").iterdir() if (d / "log.jsonl").is_file())
    assert read_log(gz / "runs" / run.name) == read_log(run) != []


def test_readme_repro_table_matches_the_report_json():
    """Every number of the README's repro table (the one after a ``<!-- repro-table: JSON -->``
    marker) is the report JSON's, rounded as the report rounds it."""
    import re
    from pathlib import Path

    from attnqat.eval.stats import wilson_interval

    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text()
    marks = list(re.finditer(r"<!-- repro-table: (\S+) -->\n((?:\|.*\|\n)+)", text))
    assert marks, "the README's repro table lost its <!-- repro-table: JSON --> marker"
    labels = {lab: c for c, (_, _, lab) in R.CONFIGS.items()}
    checked = 0
    for m in marks:
        rep = json.loads((root / m.group(1)).read_text())
        rows = [r.strip("|").split("|") for r in m.group(2).strip().splitlines()[2:]]
        for cells in rows:
            cells = [c.strip().replace("−", "-") for c in cells]
            label = re.sub(r"\s*\((shipped|\d seeds)\)$", "", cells[0].replace("**", ""))
            assert label in labels, f"README row {label!r} names no configuration"
            c = labels[label]
            # a configuration of several training seeds: its clips pooled over the seeds
            per = [rep["summaries"][c]] if c in rep["summaries"] else \
                [v for key, v in rep["summaries"].items() if re.fullmatch(re.escape(c) + r"-s\d+", key)]
            assert per, c
            k = sum(round(s["all_correct"] * s["clips"]) for s in per)
            n = sum(s["clips"] for s in per)
            lo, hi = wilson_interval(k, n)
            assert cells[1].replace("**", "") == f"{100 * k / n:.1f} % [{100 * lo:.1f}, {100 * hi:.1f}]", c
            if c == "base-bf16":
                assert cells[2] == ""
                continue
            pr = rep["pairs"][f"{c} vs base-bf16"]
            want = f"{100 * pr['diff']:+.1f} [{100 * pr['lo']:+.1f}, {100 * pr['hi']:+.1f}], p {R._p(pr['p'], '= ')}"
            assert cells[2].replace("-0.0", "+0.0") == want.replace("-0.0", "+0.0"), c
            checked += 1
    assert checked >= 3


def test_lora_and_sagebwd_runs(tmp_path):
    """The LoRA runs (issue 37: distillation with --lora-rank R, exported merged) and the SageBwd run
    (issue 33: evaluated with its own INT8 attention and with NVFP4) train, export and evaluate like
    any run; the default --runs leaves them out."""
    from attnqat.sidecar import read

    assert "qad-lora8" not in R.DEFAULT_RUNS and "sagebwd" not in R.DEFAULT_RUNS
    model = small_model(tmp_path / "small-wan")
    work = tmp_path / "work"
    args = ["--work", str(work), "--model", str(model), "--runs", "qad-lora8,sagebwd", "--steps", "1",
            "--batch-size", "1", "--warmup", "0", "--eval-prompts", "2", "--eval-offset", "5",
            "--eval-batch", "2", "--workers", "0", "--device", "cpu", "--doc", str(tmp_path / "r.md"),
            "--configs", "base-bf16,base-nvfp4,qad-lora8-nvfp4,sbwd-sagebwd,sbwd-nvfp4"]
    assert R.main([*args, "--stages", "train,eval,report"]) == 0
    cfg = json.loads((work / "runs" / "qad-lora8" / "config.json").read_text())
    assert cfg["lora_rank"] == 8 and cfg["objective"] == "distill"
    sbwd = json.loads((work / "runs" / "sagebwd" / "config.json").read_text())
    assert sbwd["attention"] == "sagebwd"
    # the LoRA runs train at --lora-lr, by default 5 × --lr; the others at --lr
    assert cfg["lr"] == pytest.approx(5 * sbwd["lr"])
    parsed = argparse.ArgumentParser()
    R.add_arguments(parsed)
    ns = parsed.parse_args(["--runs", "qad-lora8", "--lr", "2e-5", "--lora-lr", "3e-4", "--doc", "r.md"])
    a = R.train_args(ns, "qad-lora8")
    assert float(a[a.index("--lr") + 1]) == 3e-4
    assert f"--lora-lr {3e-4}" in R.command_line(ns)
    # the LoRA export is a whole transformer (the adapter merged), which the eval stage loads
    assert (work / "export" / "qad-lora8" / "diffusion_pytorch_model.safetensors").is_file()
    assert read(work / "export" / "qad-lora8").training["lora_rank"] == 8
    recs = {p.name.removesuffix(".json"): json.loads(p.read_text()) for p in (work / "eval").iterdir()}
    assert recs["sbwd-sagebwd"]["attention"] == "sagebwd" and recs["sbwd-nvfp4"]["attention"] == "nvfp4"
    assert recs["qad-lora8-nvfp4"]["weights"] == "qad-lora8"
    rep = json.loads((work / "report.json").read_text())
    assert {"qad-lora8-nvfp4 vs base-nvfp4", "sbwd-nvfp4 vs base-nvfp4"} <= set(rep["pairs"])
