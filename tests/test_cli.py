"""The command line: help texts, the accuracy benchmark end to end, clear errors."""

import json
import subprocess
import sys

import pytest

from attnqat import cli


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in ["generate", "app", "bench", "eval", "finetune"]:
        assert name in out


def test_group_without_command_prints_its_help(capsys):
    assert cli.main(["bench"]) == 2
    out = capsys.readouterr().out
    assert "accuracy" in out and "kernels" in out and "wan" in out


def test_every_registered_module_has_the_command_contract():
    import importlib
    for cmd in cli.COMMANDS + [c for _, cmds in cli.GROUPS.values() for c in cmds]:
        try:
            mod = importlib.import_module(cmd.module)
        except ModuleNotFoundError:
            continue  # not part of this build yet; main() says so (tested below)
        assert callable(getattr(mod, "add_arguments")) and callable(getattr(mod, "run")), cmd.module


def test_accuracy_benchmark_prints_table_and_writes_json(tmp_path, capsys):
    out_json = tmp_path / "acc.json"
    rc = cli.main(["bench", "accuracy", "--seq", "128", "--heads", "2", "--head-dim", "64",
                   "--json", str(out_json)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "nvfp4" in printed and "sage3" in printed and "cosine" in printed
    data = json.loads(out_json.read_text())
    rows = {(r["input"], r["method"]): r for r in data["rows"]}
    assert set(rows) == {(i, m) for i in ("random", "outliers") for m in ("bf16", "nvfp4", "sage3")}
    for (inp, m), r in rows.items():
        if m == "bf16":
            assert r["cosine"] > 0.9999
        else:
            assert 0.5 < r["cosine"] < 0.9999 and r["rel_l1"] > 1e-3
    assert data["settings"]["seq"] == 128


def test_accuracy_benchmark_rejects_unknown_method():
    with pytest.raises(SystemExit, match="not a 4-bit method: fp8"):
        cli.main(["bench", "accuracy", "--methods", "nvfp4,fp8"])


@pytest.mark.parametrize("args, message", [
    (["--seq", "0"], "--seq must be at least 1, got 0"),
    (["--seq", "-5"], "--seq must be at least 1, got -5"),
    (["--heads", "0"], "--heads must be at least 1"),
    (["--head-dim", "20"], "--head-dim must be a positive multiple of 16"),
    (["--json", "/proc/no/such.json"], "cannot be written"),
    (["--json", "."], "is a folder"),
])
def test_accuracy_benchmark_refuses_bad_options_before_any_work(monkeypatch, args, message):
    import attnqat.accuracy as acc

    def no_work(*a, **k):
        raise AssertionError("the benchmark ran before its options were checked")

    monkeypatch.setattr(acc, "measure", no_work)
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "accuracy", *args])
    text = str(info.value.code)
    assert text.startswith("attnqat bench accuracy: error: ") and message in text
    assert "\n" not in text  # one line, no traceback


def test_accuracy_benchmark_writes_json_by_default(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "accuracy", "--seq", "32", "--heads", "1", "--head-dim", "32",
                     "--methods", "nvfp4"]) == 0
    data = json.loads((tmp_path / "runs" / "bench_accuracy.json").read_text())
    assert {r["method"] for r in data["rows"]} == {"bf16", "nvfp4"} and data["settings"]["seq"] == 32
    assert "wrote runs/bench_accuracy.json" in capsys.readouterr().out


@pytest.mark.subprocess
def test_console_script_runs_as_a_process():
    r = subprocess.run([sys.executable, "-m", "attnqat.cli", "bench", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "accuracy" in r.stdout


def test_command_whose_module_is_absent_says_not_implemented(monkeypatch, capsys):
    fake = cli.Command("future", "attnqat.no_such_module", "a command of a later version")
    monkeypatch.setattr(cli, "COMMANDS", cli.COMMANDS + [fake])
    assert cli.main(["future"]) == 2
    assert "not implemented yet" in capsys.readouterr().err


def test_only_the_command_being_parsed_imports_its_module(monkeypatch):
    """`attnqat repro --stages report` parses repro alone: the word "report" used to import `eval
    report` and its database modules too, which the GPU machine lacks (the study's report stage
    failed there, 2026-11-28)."""
    loaded = []
    monkeypatch.setattr(cli, "_load", lambda cmd: loaded.append(cmd.module))
    for argv, want in ((["repro", "--stages", "report"], ["attnqat.finetune.repro"]),
                       (["eval", "report", "--help"], ["attnqat.eval.report"]),
                       (["bench", "train", "--json", "wan"], ["attnqat.finetune.bench_train"]),
                       (["finetune", "--help"], [])):
        loaded.clear()
        cli._ARGV[:] = argv
        cli.build_parser()
        assert loaded == want, argv


def test_kernel_benchmark_method_names_pick_the_schedule(monkeypatch):
    """``-triton`` / ``-gluon`` force a schedule, a bare name is what backend='auto' runs."""
    from attnqat import kernels
    from attnqat.kernels import bench
    seen = []
    monkeypatch.setattr(kernels, "triton_attention", lambda q, k, v, method, schedule=None: seen.append((method, schedule)))
    for m in ("nvfp4", "nvfp4-triton", "sage3-gluon", "attnqat-gluon", "dropin-triton"):
        bench._method_fn(m)(None, None, None)
    assert seen == [("nvfp4", None), ("nvfp4", "triton"), ("sage3", "gluon"), ("attnqat", "gluon"), ("dropin", "triton")]
    assert {m.partition("-")[0] for m in bench.METHODS if not m.startswith("sdpa")} == {"nvfp4", "sage3", "attnqat", "dropin",
                                                                                     "sagebwd"}
    # sagebwd has one kernel and its own entry point
    monkeypatch.setattr(kernels, "sagebwd_attention", lambda q, k, v: seen.append(("sagebwd", None)))
    bench._method_fn("sagebwd")(None, None, None)
    assert seen[-1] == ("sagebwd", None)


def test_kernel_benchmark_takes_shapes_of_ones_own(capsys):
    from attnqat.kernels import bench
    assert bench.parse_shape("d64=1,24,32760,32760,64") == ("d64", dict(B=1, H=24, Sq=32760, Skv=32760, D=64))
    for bad, message in [("d64=1,24,3", "five positive integers"), ("1,2,3,4,5", "five positive integers"),
                         ("x=1,0,3,4,5", "five positive integers"), ("wan-cross=1,2,3,4,5", "built-in shape")]:
        with pytest.raises(SystemExit):
            cli.main(["bench", "kernels", "--shape", bad])
        assert message in capsys.readouterr().err
    assert cli.main(["bench", "kernels", "--shape", "a=1,1,8,8,64", "--shape", "a=1,2,8,8,64"]) == 2
    assert "--shape names must differ" in capsys.readouterr().err
