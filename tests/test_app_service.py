"""The comparison app's service and HTML, without a server: input checks, availability, request
folders and their cleanup, progress, failures, blind rendering, the command line."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import threading

import pytest
import torch

from attnqat.app import player, service as svc
from attnqat.app.cli import parse_auth
from attnqat.cli import main as cli_main
from attnqat.generate import InvalidInput, StepEvent
from attnqat.video import probe_mp4
from attnqat.wan import load_models

LABELS = ("bf16", "nvfp4", "sage3", "attnqat", "BF16", "NVFP4", "SageAttention3", "Attn-QAT")
SMALL = dict(seed=3, steps=2, resolution="32x48", frames=5)


@pytest.fixture(scope="module")
def models():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield load_models(qat_transformer="auto", device="cpu")
    finally:
        torch.set_num_threads(threads)


@pytest.fixture()
def service(models, tmp_path):
    s = svc.AppService(models, output_dir=tmp_path / "out", keep=2)
    yield s
    s.close()


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------

def test_parse_resolution_accepts_width_by_height_forms():
    assert svc.parse_resolution("832x480") == (832, 480)  # width × height, as Wan writes it
    assert svc.parse_resolution(" 224 × 128 ") == (224, 128)
    assert svc.parse_resolution("64*32 (quick)") == (64, 32)
    for bad in ("", "480", "axb", "480x", None, 480):
        with pytest.raises(ValueError, match="width×height"):
            svc.parse_resolution(bad)


def test_defaults_are_the_models_and_every_preset_is_valid(service):
    req = service.check("a red circle moves left", ["bf16"])
    d = service.info.defaults
    assert (req.height, req.width, req.frames, req.steps) == (d["height"], d["width"], d["frames"],
                                                              d["steps"])
    assert req.seed == -1 and req.fp4_scope == "self" and req.methods == ("bf16",)
    assert req.dtype == str(service.models.dtype).removeprefix("torch.")
    presets = service.resolution_presets()
    assert presets[0][1] == f"{d['width']}x{d['height']}"  # the model's default comes first
    for _label, value in presets:
        assert service.check("x", ["bf16"], resolution=value).width == int(value.split("x")[0])


@pytest.mark.parametrize("field,value,fragment", [
    ("prompt", "   ", "enter a prompt"),
    ("methods", [], "at least one method"),
    ("methods", ["bf16", "fp8"], "unknown method"),
    ("methods", ["bf16", "bf16"], "more than once"),
    ("seed", -2, "−1 for a random seed"),
    ("seed", "abc", "integer"),
    ("steps", 0, "from 1 to"),
    ("steps", 2.5, "whole number"),
    ("steps", 10_000, "from 1 to"),
    ("guidance", -1, "≥ 0"),
    ("steps", "", None),  # empty: the model's default
    ("seed", 2 ** 64, "2^63−1"),
    ("seed", "12abc", "integer"),
    ("shift", 0, "above 0"),
    ("resolution", "100x100", "multiple of 16"),
    ("resolution", "32x4096", "multiple of 16 from 16 to"),
    ("resolution", "big", "width×height"),
    ("frames", 6, "4k+1"),
    ("frames", 0, "4k+1"),
    ("frames", 85, "4k+1"),
    ("negative_prompt", 3, "text"),
    ("fp4_scope", "cross", "one of self, all"),
])
def test_each_invalid_input_is_reported_on_its_field(service, field, value, fragment):
    values = dict(prompt="a red circle", methods=["bf16", "nvfp4"], **SMALL)
    values[field] = value
    if fragment is None:
        assert service.check(**values).steps == service.defaults["steps"]
        return
    with pytest.raises(InvalidInput) as info:
        service.check(**values)
    assert list(info.value.errors) == [field]
    assert fragment in info.value.errors[field]
    assert svc.FIELD_NAMES[field] in svc.describe_errors(info.value.errors)


def test_inputs_are_accepted_exactly_as_typed(service):
    big = 2 ** 63 - 1
    assert service.check("x", ["bf16"], seed=str(big)).seed == big  # the page's text field
    assert service.check("x", ["bf16"], seed=big).seed == big        # the API's number
    assert service.check("x", ["bf16"], seed=f" {2 ** 53 + 1} ").seed == 2 ** 53 + 1  # not rounded
    assert service.check("x", ["bf16"], seed="").seed == -1
    s = service.check("x", ["bf16"], steps=3.0, frames="9", guidance="4.5")
    assert (s.steps, s.frames, s.guidance) == (3, 9, 4.5)


def test_several_invalid_inputs_are_reported_together(service):
    errors = service.field_errors("", [], -1, 0, 5, 3, "7x7", 2, "", "self")
    assert set(errors) == {"prompt", "methods", "steps", "resolution", "frames"}
    assert service.field_errors("ok", ["bf16"], -1, 2, 5, 3, "32x32", 5, "", "self") == {}


def test_attnqat_without_qat_weights_is_unavailable_with_the_reason(models, tmp_path):
    no_qat = dataclasses.replace(models, qat_transformer=None, qat_info=None)
    s = svc.AppService(no_qat, output_dir=tmp_path / "o")
    why = s.availability()["attnqat"]
    assert why is not None and "--qat-transformer" in why
    assert s.available_methods() == ["bf16", "nvfp4", "sage3", "sagebwd"]
    with pytest.raises(InvalidInput) as info:
        s.check("x", ["bf16", "attnqat"], **SMALL)
    assert "Attn-QAT cannot run" in info.value.errors["methods"]
    assert "--qat-transformer" in info.value.errors["methods"]


def test_page_shows_an_unavailable_method_with_its_reason(models, tmp_path):
    import gradio as gr

    from attnqat.app.ui import build_app

    no_qat = dataclasses.replace(models, qat_transformer=None, qat_info=None)
    s = svc.AppService(no_qat, output_dir=tmp_path / "o")
    demo = build_app(s)
    (group,) = [b for b in demo.blocks.values()
                if isinstance(b, gr.CheckboxGroup) and b.elem_id == "aq-methods"]
    labels = dict((v, label) for label, v in group.choices)
    assert list(labels) == ["bf16", "nvfp4", "sage3", "attnqat", "sagebwd"]  # still listed
    assert "unavailable" in labels["attnqat"] and "unavailable" not in labels["bf16"]
    assert "Attn-QAT cannot run here" in group.info and "--qat-transformer" in group.info
    assert group.value == ["bf16", "nvfp4", "sage3", "sagebwd"]
    # the page states which precision runs and what the BF16 method means in it
    header = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "aq-header")
    assert f"Precision: {str(models.dtype).removeprefix('torch.')}" in header.value
    (endpoint,) = [d for d in demo.fns.values() if d.api_name == "generate"]
    assert endpoint.concurrency_limit == 1 and demo._queue.max_size == 8
    ui_events = [d for d in demo.fns.values() if d.fn is not None and d.fn.__name__ == "generate_ui"]
    assert ui_events and all(d.concurrency_id == endpoint.concurrency_id for d in ui_events)


def test_a_stopped_request_ends_on_stopped_even_when_a_progress_update_lands_after_stop(service):
    """Stop's message and the stopped stream's last progress update race in the page (it cancels
    the stream and runs Stop side by side; seen in CI: the box froze at "step 11/100"). What runs
    after each generation and sweep has ended replaces a box still showing the request in flight
    with Stopped, and leaves a request's last word (result, failure, Stopped) alone."""
    import gradio as gr

    from attnqat.app.ui import build_app

    demo = build_app(service)
    by_id = {b.elem_id: b for b in demo.blocks.values() if getattr(b, "elem_id", None)}
    status, stop = by_id["aq-status"], by_id["aq-stop"]
    runs = [d for d in demo.fns.values() if d.fn is not None and d.fn.__name__ in ("generate_ui", "sweep_ui")]
    assert len(runs) == 3  # Generate, Enter in the prompt, the seed sweep
    for run in runs:
        box = run.outputs[0]
        (after,) = [d for d in demo.fns.values()
                    if d.trigger_after == run._id and d.inputs == [box] and d.outputs == [box, stop]]
        assert not after.trigger_only_on_success  # runs when the request was cancelled too
        for shown in (player.render_progress(_snapshot(), "BF16 · step 11/100"), player.render_queued(),
                      '<div class="aq-msg aq-idle aq-inflight">Seed 1 of 3 (seed 0)</div>'):
            word, button = after.fn(shown)
            assert "Stopped" in word and button["interactive"] is False
        for last in (player.render_stopped(), player.render_error("boom"),
                     player.render_input_errors({"prompt": "empty"}), "<div>summary</div>", "",
                     player.render_error('a prompt <div class="aq-inflight"> quoted')):
            word, _ = after.fn(last)
            assert word is gr.skip() or word == gr.skip()
    assert status is runs[0].outputs[0]


def _snapshot() -> dict:
    p = svc.Progress(["bf16"], steps=100)
    p.on_step(StepEvent("denoising", "bf16", 10, 100, ("bf16",), 0.0, None))
    return p.snapshot()


# ----------------------------------------------------------------------------------------------
# Generation, folders, failures
# ----------------------------------------------------------------------------------------------

def test_run_writes_a_request_folder_and_randomly_named_media(service):
    req = service.check("a red circle moves left", ["nvfp4", "bf16"], **SMALL)
    progress = service.new_progress(req)
    snaps = []
    progress.listeners.append(lambda p: snaps.append(p.snapshot()))
    out = service.run(req, progress=progress)
    assert out.folder.parent == service.runs_root
    assert list(out.clips) == ["bf16", "nvfp4"]  # shown in the project's method order
    assert out.record.seed == 3 and out.record.settings["steps"] == 2
    assert json.loads(out.record_path.read_text()) == out.record.to_dict()
    for m, clip in out.clips.items():
        media = out.media[m]
        assert media.parent.parent == service.media_root
        assert not any(lab.lower() in str(media.relative_to(service.root)).lower() for lab in LABELS)
        assert media.read_bytes() == clip.read_bytes()
        info = probe_mp4(media)
        assert (info["frames"], info["width"], info["height"]) == (5, 32, 48)
    # Progress went through every step of both methods and ended done.
    final = progress.snapshot()
    assert final["phase"] == "done" and final["fraction"] == 1.0
    assert [r["state"] for r in final["methods"]] == ["done", "done"]
    seen = {(r["method"], r["state"]) for s in snaps for r in s["methods"]}
    assert {("bf16", "denoising"), ("nvfp4", "denoising"), ("nvfp4", "decoding")} <= seen


def test_random_seed_is_drawn_and_recorded(service):
    out = service.run(service.check("x", ["bf16"], **{**SMALL, "seed": -1}))
    assert isinstance(out.record.seed, int) and out.record.seed >= 0


def test_only_the_most_recent_results_are_kept(service):
    stray = service.root / "runs" / "mine"  # a folder the app did not make stays
    stray.mkdir()
    outs = [service.run(service.check(f"p{i}", ["bf16"], **SMALL)) for i in range(3)]
    runs = sorted(p.name for p in service.runs_root.iterdir() if p.name != "mine")
    media = sorted(p.name for p in service.media_root.iterdir())
    assert runs == sorted(o.run_id for o in outs[1:])  # keep=2: the first one is gone
    assert len(media) == 2 and not any(outs[0].media[m].exists() for m in outs[0].media)
    assert stray.is_dir()


def test_out_of_memory_inside_generation_gives_a_clear_message_then_recovers(models, tmp_path):
    s = svc.AppService(models, output_dir=tmp_path / "o", fault=svc.Fault.parse("oom@sage3"))
    req = s.check("x", ["bf16", "sage3"], **{**SMALL, "resolution": "32x32"})
    with pytest.raises(svc.GenerationFailed) as info:
        s.run(req)
    msg = str(info.value)
    assert msg.startswith("Out of memory while generating with sage3 at 32×32×5")
    assert "fewer frames" in msg and "smaller resolution" in msg
    assert list(s.runs_root.iterdir()) == [] and list(s.media_root.iterdir()) == []
    out = s.run(s.check("x", ["bf16", "nvfp4"], **SMALL))  # the next request works
    assert set(out.clips) == {"bf16", "nvfp4"}
    # any other exception is reported with the method it happened in
    s.fault = svc.Fault.parse("error@nvfp4")
    with pytest.raises(svc.GenerationFailed, match=r"^Generation failed with nvfp4 at 32×48×5: "
                                                   r"RuntimeError: simulated failure"):
        s.run(s.check("x", ["bf16", "nvfp4"], **SMALL))


def test_a_cancelled_request_stops_and_leaves_nothing(service):
    cancel = threading.Event()
    req = service.check("x", ["bf16", "nvfp4"], **SMALL)
    progress = service.new_progress(req)
    progress.listeners.append(lambda p: cancel.set() if p.snapshot()["fraction"] > 0 else None)
    with pytest.raises(svc.GenerationCancelled):
        service.run(req, progress=progress, cancel=cancel)
    assert list(service.runs_root.iterdir()) == []


def test_fault_spec_parsing():
    assert svc.Fault.parse(None) is None and svc.Fault.parse(" ") is None
    assert svc.Fault.parse("oom") == svc.Fault("oom", None)
    assert svc.Fault.parse("error@bf16") == svc.Fault("error", "bf16")
    for bad in ("boom", "oom@fp8"):
        with pytest.raises(ValueError, match=svc.FAULT_ENV):
            svc.Fault.parse(bad)
    assert isinstance(svc.Fault("oom").exception("bf16"), torch.OutOfMemoryError)


def test_progress_follows_the_step_events_with_an_estimate_of_the_time_left():
    from attnqat.record import Timings

    p = svc.Progress(["bf16", "nvfp4"], steps=2, labels={"bf16": "BF16", "nvfp4": "NVFP4"})
    assert p.describe().startswith("waiting")

    def ev(phase, method, step, timings=None):
        p.on_step(StepEvent(phase, method, step, 2, ("bf16", "nvfp4"), 0.0, timings))

    ev("text", None, 0)
    assert p.describe() == "encoding the prompt" and p.snapshot()["eta_s"] is None
    ev("denoising", "bf16", 0)
    assert p.describe() == "BF16 · step 1/2"
    ev("denoising", "bf16", 1)
    snap = p.snapshot()
    assert snap["eta_s"] is not None and snap["eta_s"] >= 0  # one step timed
    assert [r["state"] for r in snap["methods"]] == ["denoising", "waiting"]
    ev("denoising", "bf16", 2)
    ev("decoding", "bf16", 2)
    assert p.describe() == "BF16 · decoding"
    ev("done", "bf16", 2, Timings(denoising_s=2.0, decoding_s=1.0, total_s=3.0))
    ev("denoising", "nvfp4", 0)
    snap = p.snapshot()
    assert [r["state"] for r in snap["methods"]] == ["done", "denoising"]
    assert snap["eta_s"] == pytest.approx(2 * 1.0 + 1.0)  # 2 steps at 1 s, one decode of 1 s
    assert p.current_method() == "nvfp4"
    for i in (1, 2):
        ev("denoising", "nvfp4", i)
    ev("decoding", "nvfp4", 2)
    ev("done", "nvfp4", 2, Timings(denoising_s=2.0, decoding_s=1.0, total_s=3.0))
    assert p.snapshot()["fraction"] == 1.0 and p.describe() == "writing the videos"
    html = player.render_progress(p.snapshot(), p.describe())
    assert "done in 3.00 s" in html


def test_the_estimate_costs_4bit_steps_by_their_own_timing_not_bf16s():
    """#34 defect 6: a 4-bit method still to run is costed by 4-bit timings (measured in this
    generation, else the ratio the app measured before), and flagged as a guess without either."""
    from attnqat.record import Timings

    def run(cost_ratio):
        p = svc.Progress(["bf16", "nvfp4", "sage3"], steps=4, cost_ratio=cost_ratio)

        def ev(phase, method, step, timings=None):
            p.on_step(StepEvent(phase, method, step, 4, ("bf16", "nvfp4", "sage3"), 0.0, timings))

        ev("text", None, 0)
        ev("denoising", "bf16", 0)
        ev("done", "bf16", 4, Timings(denoising_s=4.0, decoding_s=1.0, total_s=5.0))
        ev("denoising", "nvfp4", 0)
        return p, ev

    p, ev = run({"bf16": 1.0, "nvfp4": 3.0, "sage3": 4.0})
    snap = p.snapshot()  # BF16 ran at 1 s/step; NVFP4 ~3 s, SageAttention3 ~4 s from before
    assert snap["eta_s"] == pytest.approx(4 * 3.0 + 1.0 + 4 * 4.0 + 1.0) and not snap["eta_rough"]
    assert "a guess" not in player.render_progress(snap, p.describe())
    p, ev = run(None)  # nothing known about 4-bit steps yet: a guess, and said to be one
    snap = p.snapshot()
    assert snap["eta_rough"]
    ev("done", "nvfp4", 4, Timings(denoising_s=12.0, decoding_s=1.0, total_s=13.0))
    ev("denoising", "sage3", 0)
    snap = p.snapshot()  # SageAttention3 has no timing of its own yet: NVFP4's is closer, not BF16's
    assert snap["eta_rough"] and snap["eta_s"] == pytest.approx(4 * 3.0 + 1.0)


def test_unknown_words_and_file_name_slugs():
    assert svc.unknown_words("A red fox, trots LEFT", {"a", "red", "left"}) == ["fox", "trots"]
    assert svc.slug("A red circle: moves LEFT!") == "a-red-circle-moves-left"
    long = svc.slug("word " * 30)
    assert len(long) <= 60 and not long.endswith("-") and long.endswith("word")


# ----------------------------------------------------------------------------------------------
# HTML
# ----------------------------------------------------------------------------------------------

def _view(service) -> player.ResultView:
    out = service.run(service.check("a red circle", ["bf16", "nvfp4", "sage3", "attnqat"], **SMALL))
    return player.ResultView(run_id=out.run_id, methods=tuple(out.clips),
                             media={m: str(p) for m, p in out.media.items()},
                             files=tuple(str(p) for p in out.clips.values()),
                             record=out.record.to_dict())


def test_blind_player_names_no_method_until_revealed(service):
    view = _view(service)
    labelled = player.render_player(view.with_blind(False))
    for m in view.methods:
        assert f'data-method="{m}"' in labelled and f"{m}.mp4" in labelled
    assert "PSNR vs BF16" in labelled and "dB" in labelled
    # Attn-QAT's card says which weights ran (the shipped Attn-QAT fine-tuned weights)
    assert "Attn-QAT fine-tuned" in labelled and "base weights copy" not in labelled
    # frame stepping, the scrub bar and the comparison view come with the players
    for cls in ("aq-prev", "aq-next", "aq-scrub", "aq-stage", "aq-split", "aq-zoom"):
        assert f'class="{cls}' in labelled
    blind = view.with_blind(True, rng=random.Random(1))
    assert sorted(blind.order) == sorted(view.methods) and blind.hidden
    html = player.render_player(blind)
    assert not any(lab in html for lab in LABELS), "a method name leaked into the blind player"
    assert re.findall(r"<b>Clip ([A-D])</b>", html) == ["A", "B", "C", "D"]
    # the comparison view offers the same letters
    assert re.findall(r'<option value="\d">Clip ([A-D])</option>', html) == ["A", "B", "C", "D"] * 2
    assert "PSNR" not in html and "download=" not in html
    # every clip is there, in the shuffled order
    srcs = re.findall(r'<video class="aq-main" src="([^"]+)"', html)
    assert srcs == [player.file_url(view.media[m]) for m in blind.order]
    shown = player.render_player(blind.reveal())
    labels = re.findall(r'data-method="([a-z0-9]+)"', shown)
    assert labels == list(blind.order)  # revealed in the same (blind) order


def test_player_says_when_the_result_was_removed(service):
    view = _view(service)
    for p in view.media.values():
        player.Path(p).unlink()
    assert "no longer on the server" in player.render_player(view)


def test_attnqat_is_labelled_by_the_weights_it_runs(service, models):
    from attnqat.app.ui import _method_choices

    labels = dict((v, label) for label, v in _method_choices(service))
    assert labels["attnqat"] == f"Attn-QAT fine-tuned — {svc.QAT_NOTE_FINE_TUNED}"   # the shipped weights
    copy = dataclasses.replace(models, qat_info={**models.qat_info, "fine_tuned": False,
                                                 "identical_to_base": True,
                                                 "label": "Attn-QAT (base weights copy — not fine-tuned)"})
    s = svc.AppService(copy, output_dir=service.root / "t")
    labels = dict((v, label) for label, v in _method_choices(s))
    assert labels["attnqat"].startswith("Attn-QAT (base weights copy — not fine-tuned)")


def test_the_plan_says_what_will_run(service):
    settings = service.check("x", ["bf16", "sage3"], seed="5", steps=3, resolution="64x32",
                             frames=9, guidance=5)
    html = player.render_plan(settings, service)
    for part in ("BF16, SageAttention3", "64×32 (width×height), 9 frames", "3 steps",
                 "6 calls per method", "seed 5", f"{settings.dtype} on cpu", "PyTorch reference"):
        assert part in html, part
    errors = service.field_errors("x", ["bf16"], -1, 0, 5, 3, "64x32", 9, "", "self")
    assert "Will not run" in player.render_plan(None, service, errors) and "Steps" in \
        player.render_plan(None, service, errors)


def test_summary_shows_the_seed_and_the_records_notes():
    record = {"seed": 42, "settings": {"height": 32, "width": 48, "frames": 5, "fps": 16,
                                       "steps": 2, "guidance": 5, "shift": 3,
                                       "fp4_scope": "self", "device": "cpu"},
              "methods": {"bf16": {}}, "model_weights_note": "random <weights>",
              "qat_weights_note": None}
    html = player.render_summary(record, 1.5)
    assert "seed <b>42</b>" in html and "48×32" in html and "random &lt;weights&gt;" in html
    assert "random" not in player.render_summary(record, skip_notes=["Model: random <weights>"])


def test_metric_rows_of_identical_and_missing_reference():
    entry = {"timings": {"denoising_s": 2.0, "attention_s": 0.5,
                         "attention_share_of_denoising": 0.25},
             "peak_memory_bytes": 3 * 2 ** 30, "psnr": None, "ssim": 1.0, "identical_to_bf16": True}
    rows = {k: v for k, v, _ in player.metric_rows("attnqat", entry, bf16_run=True)}
    assert rows == {"Total": "—", "Denoising": "2.00 s", "Decoding": "—",
                    "Attention": "500 ms (25%)", "Peak memory": "3.00 GiB",
                    "PSNR vs BF16": "identical", "SSIM vs BF16": "1.0000"}
    rows = {k: v for k, v, _ in player.metric_rows("nvfp4", entry, bf16_run=False)}
    assert rows["PSNR vs BF16"].startswith("—")


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

def test_app_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["app", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for opt in ("--model", "--qat-transformer", "--host", "--port", "--auth", "--device",
                "--dtype", "--offload", "--output-dir", "--keep", "--queue-size", "--threads"):
        assert opt in text
    assert "127.0.0.1" in text and "7860" in text


def test_bad_options_are_refused_before_loading(capsys, monkeypatch):
    monkeypatch.delenv("ATTNQAT_APP_AUTH", raising=False)
    assert cli_main(["app", "--auth", "nopassword"]) == 2
    assert "--auth must be USER:PASS" in capsys.readouterr().err
    assert cli_main(["app", "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err
    assert cli_main(["app", "--keep", "0"]) == 2
    capsys.readouterr()
    import socket

    with socket.socket() as busy:  # a port another program listens on: one line, before loading
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setattr(svc, "load_service", lambda *a, **k: pytest.fail("loaded the model"))
        assert cli_main(["app", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot listen on 127.0.0.1:{port}" in err[0] and "--port N" in err[0]
    assert "share" not in err[0] and "GRADIO_SERVER_PORT" not in err[0]
    monkeypatch.setenv(svc.FAULT_ENV, "explode")
    assert cli_main(["app"]) == 2
    assert svc.FAULT_ENV in capsys.readouterr().err


def test_parse_auth():
    assert parse_auth(None) is None
    assert parse_auth("ann:s3:cret") == ("ann", "s3:cret")
    for bad in ("ann", ":pw", "ann:"):
        with pytest.raises(ValueError):
            parse_auth(bad)


def test_example_prompts_fit_the_loaded_model():
    """The tiny model is offered held-out synthetic captions (it draws nothing else); a real Wan
    model the natural-language list."""
    from types import SimpleNamespace

    from attnqat.app.ui import example_prompts
    from attnqat.prompts import natural_prompts
    from attnqat.synthetic import heldout_prompts, parse_caption
    from attnqat.wan import model_info

    tiny = example_prompts(SimpleNamespace(info=model_info()))
    assert tiny == heldout_prompts(106)[100:] and all(parse_caption(p) for p in tiny)
    wan = example_prompts(SimpleNamespace(info=model_info("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")))
    assert wan == natural_prompts()[:6] and not any(p in heldout_prompts(300) for p in wan)
