"""The Gradio page of the comparison app and its API endpoints.

The page is laid out by builders that each return their components by name (:func:`build_header`,
:func:`build_prompt` with the tiny model's prompt builder, :func:`build_controls`,
:func:`build_advanced`, :func:`build_results`, :func:`build_sweep`, :func:`build_history`,
:func:`build_api`); :func:`wire` connects every listener in one place, by those names;
:func:`build_app` does both and :func:`launch` starts the server.

Events that generate share one concurrency group with a limit of 1, so the loaded transformer
serves one request at a time while others wait in Gradio's bounded queue (``queue_size``): the
page's Generate button (a generator: one progress bar per method, then the synced players, metric
cards with their receipts, the attention-error map, downloads, the record and the history), its
seed sweep, and the documented API endpoints ``/generate`` and ``/sweep`` (``gradio_client``).

Inputs are checked first, in a validator that Gradio runs before the request joins the queue, so a
bad input is answered at once with a message on the field it concerns; joining the queue is
serialized so that ``queue_size`` is a hard bound (:func:`bounded_queue`). Stop (enabled only while
something runs) cancels the running or queued generation or sweep.
"""

from __future__ import annotations

import os

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # before gradio is imported: no network requests

import asyncio
import html
import threading
import time
from pathlib import Path
from typing import Any

import gradio as gr

from attnqat import methods as registry
from attnqat.generate import InvalidInput
from attnqat.prompts import model_prompts
from attnqat.sweep import parse_seeds, render_plot
from attnqat.tiny import ASSETS_DIR, TINY_MODEL_DIR
from attnqat.wan import dtype_name

from .player import (IN_FLIGHT, ResultView, in_flight, method_label, read_error_map, read_static,
                     render_error, render_error_map, render_history, render_input_errors,
                     render_notes, render_plan, render_player, render_progress, render_queued,
                     render_stopped, render_summary, render_sweep)
from .service import (FIELDS, AppService, GenerationCancelled, GenerationFailed, RunOutput,
                      describe_errors)

#: Font stacks of installed system fonts (the default theme's fonts are not needed).
SANS = ("Segoe UI", "Roboto", "Helvetica Neue", "Arial", "Liberation Sans", "DejaVu Sans", "sans-serif")
MONO = ("SFMono-Regular", "Menlo", "Consolas", "Liberation Mono", "DejaVu Sans Mono", "monospace")
CONCURRENCY_ID = "generate"
POLL_S = 0.4
IDLE = ('<div class="aq-msg aq-idle">Press Generate: a progress bar per method appears here, then '
        'the clips.</div>')

def theme() -> gr.themes.Base:
    return gr.themes.Default(font=SANS, font_mono=MONO, primary_hue="indigo")


def example_prompts(service: AppService, n: int = 6) -> list[str]:
    """Example prompts the loaded model can answer (:func:`attnqat.prompts.model_prompts`):
    held-out synthetic captions for the tiny model, the natural-language list for real Wan."""
    return model_prompts(service.info)[:n]


def _model_line(service: AppService) -> str:
    info = service.info
    models = service.models
    if info.path is not None and info.path == TINY_MODEL_DIR.resolve():
        name = "the embedded tiny Wan 2.1 model (assets/tiny-wan)"
    else:
        name = str(info.source)
    dev = str(models.device)
    qat = models.qat_info["checkpoint"] if models.qat_info else "not loaded"
    if models.qat_info and Path(qat).is_relative_to(ASSETS_DIR):
        qat = str(Path("assets") / Path(qat).relative_to(ASSETS_DIR))
    if models.qat_info:
        qat = f"{qat} ({service.label('attnqat')})"
    four_bit = ("4-bit attention is emulated by the PyTorch reference on the CPU"
                if models.device.type == "cpu" else "4-bit attention runs the project's kernels")
    return (f"Model: {name} · device: {dev}{' (offloading)' if models.offload else ''} · "
            f"Attn-QAT transformer: {qat} · {four_bit}.")


def precision_line(service: AppService) -> str:
    """Which precision runs, and what the BF16 method means in it."""
    dt = dtype_name(service.models.dtype)
    meaning = ("" if dt == "bfloat16" else
               f" The BF16 method is the reference — attention without quantization — here computed "
               f"in {dt}.")
    return f"Precision: {dt} ({service.models.dtype_reason}).{meaning}"


def _startup_notes(service: AppService) -> list[str]:
    notes = []
    if service.info.weights_note:
        notes.append(f"Model: {service.info.weights_note}")
    if service.models.qat_info and service.models.qat_info.get("note"):
        notes.append(f"{service.label('attnqat')}: {service.models.qat_info['note']}")
    return notes


def _methods_info(service: AppService) -> str:
    blocked = {m: why for m, why in service.availability().items() if why}
    if not blocked:
        return "One clip per method, all from the same noise and prompt embeddings."
    return " ".join(f"{service.label(m)} cannot run here: {why}." for m, why in blocked.items())


def _method_choices(service: AppService) -> list[tuple[str, str]]:
    avail = service.availability()
    return [(f"{service.label(m)} — {service.note(m)}" if avail[m] is None
             else f"{service.label(m)} — unavailable (see below)", m) for m in avail]


def _validations(service: AppService, values: tuple[Any, ...], extra: int) -> list[dict]:
    errors = service.field_errors(*values[:len(FIELDS)])
    out = [gr.validate(name not in errors, errors.get(name, "")) for name in FIELDS]
    return out + [gr.validate(True, "") for _ in range(extra)]


class _Throttle:
    """Calls ``fn(progress)`` at most every ``every`` seconds (and when the text changes)."""

    def __init__(self, fn, every: float = 0.25):
        self.fn, self.every, self.last, self.text = fn, every, 0.0, None

    def __call__(self, progress) -> None:
        snap = progress.snapshot()
        text = progress.describe(snap)
        now = time.monotonic()
        if text != self.text or now - self.last >= self.every:
            self.text, self.last = text, now
            eta = snap["eta_s"]
            self.fn(snap["fraction"], desc=text if eta is None else f"{text} · about {eta:.0f} s left")


def bounded_queue(demo: gr.Blocks) -> None:
    """Make ``demo.queue(max_size=...)`` a hard bound.

    Gradio checks the queue's length when a request arrives and appends the request only after its
    validator has run; requests that arrive together all pass the check before any of them is
    appended (``--queue-size 8`` let 12 simultaneous clients in). Joining the queue is therefore
    made one step at a time: the check, the validator and the append of one request finish before
    the next request is looked at. Validators are input checks of a few milliseconds.
    """
    queue = demo._queue
    push = queue.push
    lock = asyncio.Lock()

    async def push_one_at_a_time(*args, **kwargs):
        async with lock:
            return await push(*args, **kwargs)

    queue.push = push_one_at_a_time


def whole_number(**kwargs) -> gr.Number:
    """A number box that the API page types as an integer, while the value still reaches the one
    validation as it was sent (``precision=0`` would round 2.5 steps to 2 before it is checked).
    (The methods are set on the instance: a subclass of a gradio component makes gradio write a
    ``.pyi`` file beside this module.)"""
    box = gr.Number(precision=None, **kwargs)
    box.api_info = lambda: {"type": "integer"}
    example = int(box.value) if isinstance(box.value, (int, float)) else 0
    box.example_payload = box.example_value = lambda: example
    return box


def example_text(example: str, **kwargs) -> gr.Textbox:
    """A text box whose example on the API page is ``example`` (not gradio's "Hello!!")."""
    box = gr.Textbox(**kwargs)
    box.example_payload = box.example_value = lambda: example
    return box


# ----------------------------------------------------------------------------------------------
# Builders: each lays out one part of the page and returns its components by name
# ----------------------------------------------------------------------------------------------

def build_header(service: AppService, startup_notes: list[str]) -> dict[str, Any]:
    header = gr.HTML(
        '<div class="aq-header"><h1>Wan 2.1 with 4-bit attention, side by side</h1>'
        "<p>One prompt, one seed, one clip per attention method: BF16 (the reference), naive "
        "NVFP4, SageAttention3 and Attn-QAT. Under each clip: timings, memory, the 4-bit error "
        "(PSNR/SSIM against BF16 attention with the same weights) and a receipt of what ran."
        f"</p><p>{html.escape(_model_line(service))}</p>"
        f'<p id="aq-precision">{html.escape(precision_line(service))}</p></div>'
        + render_notes(startup_notes), elem_id="aq-header")
    return {"header": header}


def build_prompt_builder(service: AppService) -> dict[str, Any]:
    """The tiny model's prompt builder: what it can draw, as menus (one or two objects)."""
    from attnqat import synthetic as syn

    motions = [(syn.MOTION_PHRASE[m], m) for m in syn.MOTIONS]
    with gr.Accordion("Prompt builder: what the embedded tiny model can draw", open=True,
                      elem_id="aq-builder", elem_classes=["aq-builder"]):
        gr.Markdown("It was trained on coloured shapes that move over a plain background only; "
                    "any other word is ignored. Pick one or two objects:")
        with gr.Row():
            c1 = gr.Dropdown(list(syn.COLOURS), value="red", label="Colour", elem_id="aq-b-colour1")
            s1 = gr.Dropdown(list(syn.SHAPES), value="circle", label="Shape", elem_id="aq-b-shape1")
            m1 = gr.Dropdown(motions, value="left", label="Motion", elem_id="aq-b-motion1")
        two = gr.Checkbox(label="A second object", value=False, elem_id="aq-b-two")
        with gr.Row():
            c2 = gr.Dropdown(list(syn.COLOURS), value="yellow", label="Colour (2nd)",
                             elem_id="aq-b-colour2")
            s2 = gr.Dropdown(list(syn.SHAPES), value="square", label="Shape (2nd)",
                             elem_id="aq-b-shape2")
            m2 = gr.Dropdown(motions, value="up", label="Motion (2nd)", elem_id="aq-b-motion2")
        with gr.Row():
            bg = gr.Dropdown(list(syn.BACKGROUNDS), value="blue", label="Background",
                             elem_id="aq-b-background")
            use = gr.Button("Use this prompt", size="sm", elem_id="aq-b-use")
    return {"b_colour1": c1, "b_shape1": s1, "b_motion1": m1, "b_two": two, "b_colour2": c2,
            "b_shape2": s2, "b_motion2": m2, "b_background": bg, "b_use": use}


def built_prompt(c1, s1, m1, two, c2, s2, m2, bg) -> str:
    """The caption the builder's menus describe (:func:`attnqat.synthetic.caption_of`)."""
    from attnqat.synthetic import ClipSpec, ObjectSpec, caption_of

    objects = [ObjectSpec(c1, s1, m1)] + ([ObjectSpec(c2, s2, m2)] if two else [])
    return caption_of(ClipSpec(tuple(objects), bg))


def build_prompt(service: AppService) -> dict[str, Any]:
    tiny = service.vocabulary() is not None
    example = example_prompts(service, 1)[0] if example_prompts(service, 1) else ""
    prompt = gr.Textbox(label="Prompt", lines=2, max_lines=6, elem_id="aq-prompt",
                        placeholder=f"Describe the clip, e.g. “{example}”")
    warning = gr.HTML("", elem_id="aq-prompt-warning")
    out = {"prompt": prompt, "prompt_warning": warning}
    if tiny:
        out.update(build_prompt_builder(service))
    gr.Examples(examples=[[p] for p in example_prompts(service)], inputs=[prompt],
                label="Example prompts" + ("" if tiny else " (natural language, as Wan is used)"),
                examples_per_page=6)
    return out


def build_controls(service: AppService) -> dict[str, Any]:
    methods = gr.CheckboxGroup(choices=_method_choices(service), value=service.available_methods(),
                               label="Attention methods", info=_methods_info(service),
                               elem_id="aq-methods")
    with gr.Row():
        blind = gr.Checkbox(label="Blind mode", value=False, elem_id="aq-blind",
                            info="Shuffle the clips and hide their labels until you reveal them.")
        run_btn = gr.Button("Generate", variant="primary", elem_id="aq-generate", scale=2)
        # grey and disabled while nothing runs; red while a generation or sweep can be stopped
        stop_btn = gr.Button("Stop", variant="secondary", interactive=False, elem_id="aq-stop",
                             scale=1)
    return {"methods": methods, "blind": blind, "run_btn": run_btn, "stop_btn": stop_btn}


def build_advanced(service: AppService) -> dict[str, Any]:
    d = service.defaults
    presets = service.resolution_presets()
    with gr.Accordion("Advanced", open=False, elem_id="aq-advanced"):
        with gr.Row():
            seed = gr.Textbox(label="Seed (−1 = random)", value="-1", elem_id="aq-seed",
                              info="0 to 2^63−1, taken exactly as typed")
            with gr.Column(min_width=160):
                seed_used = gr.Textbox(label="Seed used last", value="", placeholder="—",
                                       interactive=False, elem_id="aq-seed-used")
                reuse = gr.Button("Reuse this seed", size="sm", elem_id="aq-reuse-seed")
            steps = gr.Number(label="Denoising steps", value=int(d["steps"]), precision=None,
                              step=1, elem_id="aq-steps")
            guidance = gr.Number(label="Guidance (≤ 1: off)", value=float(d["guidance"]),
                                 precision=None, step=0.5, elem_id="aq-guidance")
            shift = gr.Number(label="Flow shift", value=float(d["shift"]), precision=None,
                              step=0.5, elem_id="aq-shift")
        with gr.Row():
            resolution = gr.Dropdown(choices=presets, value=presets[0][1], allow_custom_value=True,
                                     label="Resolution (width × height)",
                                     info="Presets for this model; type WxH for another "
                                          "(multiples of 16).", elem_id="aq-resolution")
            frames = gr.Number(label="Frames (4k+1)", value=int(d["frames"]), precision=None,
                               step=4, elem_id="aq-frames")
            fp4_scope = gr.Radio([("Self-attention (published recipe)", "self"),
                                  ("Self- and cross-attention", "all")], value="self",
                                 label="4-bit attention in", elem_id="aq-scope")
        with gr.Row():
            negative = gr.Textbox(label="Negative prompt", value=d.get("negative_prompt", ""),
                                  lines=1, max_lines=4, elem_id="aq-negative", scale=3,
                                  placeholder="Optional; used by classifier-free guidance")
            error_map = gr.Checkbox(label="Attention-error map", value=False,
                                    elem_id="aq-errmap-on", scale=2,
                                    info="Also measure each 4-bit method's attention error "
                                         "against BF16 attention on the same inputs, per layer × "
                                         "step (one extra BF16 attention per call).")
        plan = gr.HTML("", elem_id="aq-plan")
    return {"seed": seed, "seed_used": seed_used, "reuse": reuse, "steps": steps,
            "guidance": guidance, "shift": shift, "resolution": resolution, "frames": frames,
            "fp4_scope": fp4_scope, "negative": negative, "error_map": error_map, "plan": plan}


def build_results() -> dict[str, Any]:
    status = gr.HTML(IDLE, elem_id="aq-status", min_height=40)
    player = gr.HTML("", js_on_load=read_static("player.js"), elem_id="aq-player")
    with gr.Row():
        reveal = gr.Button("Reveal labels", visible=False, elem_id="aq-reveal", scale=0,
                           min_width=180)
    errmap = gr.HTML("", elem_id="aq-errmap")
    with gr.Row():
        files = gr.File(label="Downloads: each clip, the labelled side-by-side, the record",
                        file_count="multiple", interactive=False, visible=False,
                        elem_id="aq-files")
        with gr.Accordion("Record (record.json)", open=False, visible=False,
                          elem_id="aq-record-box") as record_box:
            record = gr.JSON(label="Record (record.json)", show_label=False, elem_id="aq-record")
    return {"status": status, "player": player, "reveal": reveal, "errmap": errmap,
            "files": files, "record_box": record_box, "record": record,
            "view_state": gr.State(None)}


def build_sweep() -> dict[str, Any]:
    with gr.Accordion("Seed sweep: one prompt × N seeds, every method", open=False,
                      elem_id="aq-sweep-box"):
        gr.Markdown("One seed says little. This runs the prompt and settings above once per seed "
                    "and shows each method's 4-bit error (and, with the tiny model, the procedural "
                    "score of each clip against the prompt): mean and spread.")
        with gr.Row():
            n = gr.Number(label="Seeds", value=4, precision=None, step=1, elem_id="aq-sweep-n",
                          minimum=2, maximum=16)
            first = gr.Textbox(label="First seed", value="0", elem_id="aq-sweep-first")
            run = gr.Button("Run the sweep", elem_id="aq-sweep-run")
        out = gr.HTML("", elem_id="aq-sweep-out")
        plot = gr.Image(label="Per seed (dots) and mean ± std", type="filepath", visible=False,
                        interactive=False, elem_id="aq-sweep-plot")
    return {"sweep_n": n, "sweep_first": first, "sweep_run": run, "sweep_out": out,
            "sweep_plot": plot}


def build_history() -> dict[str, Any]:
    with gr.Accordion("History: this session's last generations", open=False,
                      elem_id="aq-history-box"):
        listing = gr.HTML(render_history([]), elem_id="aq-history")
        with gr.Row():
            pick = gr.Dropdown(choices=[], value=None, label="Generation", elem_id="aq-history-pick",
                               scale=3)
            open_btn = gr.Button("Open again", size="sm", elem_id="aq-history-open", scale=1)
            load_btn = gr.Button("Load its settings", size="sm", elem_id="aq-history-load",
                                 scale=1)
    return {"history": gr.State([]), "history_html": listing, "history_pick": pick,
            "history_open": open_btn, "history_load": load_btn}


def build_api(service: AppService) -> dict[str, Any]:
    """The hidden inputs and outputs of the ``/generate`` and ``/sweep`` endpoints: plain types
    without UI bounds or rounding (numbers reach the one validation as they were sent)."""
    d = service.defaults
    example = (example_prompts(service, 1) or ["a red circle moves left on a blue background"])[0]
    with gr.Column(visible=False):
        c = {
            "a_prompt": example_text(example, label="prompt"),
            "a_methods": gr.Dropdown(choices=list(service.availability()),
                                     value=service.available_methods(), multiselect=True,
                                     allow_custom_value=True, label="methods"),
            "a_seed": whole_number(value=-1, label="seed"),
            "a_steps": whole_number(value=int(d["steps"]), label="steps"),
            "a_guidance": gr.Number(value=float(d["guidance"]), precision=None, label="guidance"),
            "a_shift": gr.Number(value=float(d["shift"]), precision=None, label="shift"),
            "a_resolution": example_text(service.resolution_presets()[0][1],
                                         value=service.resolution_presets()[0][1],
                                         label="resolution"),
            "a_frames": whole_number(value=int(d["frames"]), label="frames"),
            "a_negative": example_text("", value=d.get("negative_prompt", ""),
                                       label="negative_prompt"),
            "a_scope": gr.Dropdown(choices=["self", "all"], value="self", allow_custom_value=True,
                                   label="fp4_scope"),
            "a_error_map": gr.Checkbox(value=False, label="error_map"),
            "a_seeds": example_text("0-3", value="0-3", label="seeds"),
            "a_record": gr.JSON(label="record"),
            "a_clips": gr.File(file_count="multiple", label="clips"),
            "a_sbs": gr.File(label="side_by_side"),
            "a_record_file": gr.File(label="record_file"),
            "a_sweep": gr.JSON(label="sweep"),
            "a_sweep_plot": gr.File(label="sweep_plot"),
            "a_button": gr.Button("generate"),
            "a_sweep_button": gr.Button("sweep"),
        }
    return c


# ----------------------------------------------------------------------------------------------
# The page: builders laid out, then every listener wired in one place, by name
# ----------------------------------------------------------------------------------------------

def build_app(service: AppService, *, queue_size: int = 8, history: int = 10) -> gr.Blocks:
    """The page and the ``/generate`` and ``/sweep`` API of ``service`` (call :func:`launch` to
    serve it). ``history``: generations listed in each session's History."""
    if queue_size < 1:
        raise ValueError(f"queue_size must be at least 1, got {queue_size}")
    # Clips, side-by-sides and records are served from the output root as they are, never copied.
    gr.set_static_paths([str(service.root)])
    startup_notes = _startup_notes(service)
    c: dict[str, Any] = {}
    with gr.Blocks(title="attnqat · 4-bit attention side by side", analytics_enabled=False,
                   fill_width=True) as demo:
        c.update(build_header(service, startup_notes))
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                c.update(build_prompt(service))
            with gr.Column(scale=2):
                c.update(build_controls(service))
        c.update(build_advanced(service))
        c.update(build_results())
        c.update(build_sweep())
        c.update(build_history())
        c.update(build_api(service))
        wire(demo, service, c, startup_notes=startup_notes, history=history)
    demo.queue(max_size=queue_size, default_concurrency_limit=1)
    bounded_queue(demo)
    return demo


FORM = ("prompt", "methods", "seed", "steps", "guidance", "shift", "resolution", "frames",
        "negative", "fp4_scope")  # the page's fields of FIELDS, in that order


#: listeners that only update the page: no queue, no API endpoint, no progress shown
QUIET = dict(queue=False, api_visibility="private", show_progress="hidden")
#: Stop while a request is queued or running, and otherwise
STOP_BUSY = {"interactive": True, "variant": "stop"}
STOP_IDLE = {"interactive": False, "variant": "secondary"}
#: the components a result view fills (what :func:`view_outputs` returns, then the view itself)
VIEW_TARGETS = ("player", "files", "record", "record_box", "reveal", "view_state")
#: what a generation from the page fills
UI_OUTPUTS = ("status", "player", "files", "record", "record_box", "seed_used", "reveal", "view_state",
              "errmap", "history", "history_html", "history_pick")


def run_in_thread(fn):
    """Run ``fn(cancel)`` in a worker thread; returns ``(worker, cancel, box)``: ``box`` gets
    ``"out"`` (the result) or ``"err"`` (the exception). Stop (or the page going away) sets
    ``cancel``."""
    cancel = threading.Event()
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["out"] = fn(cancel)
        except BaseException as exc:  # noqa: BLE001 - reported in the page
            box["err"] = exc

    worker = threading.Thread(target=work, name="attnqat-app-generate", daemon=True)
    worker.start()
    return worker, cancel, box


def view_outputs(view: ResultView | None):
    """Player, files, record, record box and Reveal for a result view (None: nothing shown)."""
    hidden = view is None or view.hidden
    return (render_player(view),
            gr.update(value=list(view.files) if view and not hidden else None,
                      visible=bool(view) and not hidden),
            gr.update(value=view.record if view and not hidden else None),
            gr.update(visible=bool(view) and not hidden),
            gr.update(visible=bool(view) and view.hidden))


def errmap_html(view: ResultView | None) -> str:
    if view is None or view.hidden:
        return ""
    labels = {m: method_label(view.record, m) for m in view.methods}
    return render_error_map(read_error_map(view.error_map), labels)


def failure(message: str, title: str):
    """:data:`UI_OUTPUTS` of a generation that failed: the message, every result cleared."""
    return (render_error(message, title), "", gr.update(value=None, visible=False),
            gr.update(value=None), gr.update(visible=False), gr.skip(),
            gr.update(visible=False), None, "", gr.skip(), gr.skip(), gr.skip())


def to_view(out: RunOutput, blind_on: bool) -> ResultView:
    files = tuple(str(p) for p in out.clips.values()) + (str(out.side_by_side), str(out.record_path))
    em_json = out.folder / "error_map.json"
    if em_json.is_file():
        files += (str(out.folder / "error_map.png"), str(em_json))
    view = ResultView(run_id=out.run_id, methods=tuple(out.clips), files=files,
                      media={m: str(p) for m, p in out.media.items()},
                      record=out.record.to_dict(),
                      downloads={m: str(p) for m, p in (out.downloads or {}).items()},
                      error_map=str(em_json) if em_json.is_file() else None)
    return view.with_blind(bool(blind_on))


def history_entry(out: RunOutput, view: ResultView, values: tuple) -> dict[str, Any]:
    settings = dict(zip(FORM, values))
    return {"settings": settings, "seed": out.record.seed, "view": view,
            "labels": [method_label(view.record, m) for m in view.methods],
            "when": time.strftime("%H:%M:%S")}


def history_outputs(entries: list[dict[str, Any]]):
    choices = [(f"{i + 1}. {e['settings']['prompt'][:50]} · seed {e['seed']}", i)
               for i, e in enumerate(entries)]
    return (entries, render_history(entries), gr.update(choices=choices, value=0 if entries else None))


def set_blind(blind_v, view: ResultView | None):
    if view is None:  # nothing shown yet (or a generation is running)
        return (gr.skip(),) * 7
    view = view.with_blind(bool(blind_v))
    return (*view_outputs(view), view, errmap_html(view))


def do_reveal(view: ResultView | None):
    if view is None:
        return (gr.skip(),) * 7
    view = view.reveal()
    return (*view_outputs(view), view, errmap_html(view))


def sync_blind(blind_v, view: ResultView | None):
    """Blind mode switched while generating: apply the box's current state."""
    if view is None or view.blind == bool(blind_v):
        return (gr.skip(),) * 7
    return set_blind(blind_v, view)


def load_settings(index, entries):
    entries = list(entries or [])
    if index is None or not isinstance(index, int) or not 0 <= index < len(entries):
        return (gr.skip(),) * len(FORM)
    st = dict(entries[index]["settings"])
    st["seed"] = str(entries[index]["seed"])  # the seed that ran, so it reproduces
    return tuple(st[k] for k in FORM)


def after_run(box_html, what: str = "generation"):
    """Once a request has ended (finished, failed or stopped): Stop goes idle, and a box that
    still shows the request as queued or in progress says it was stopped. Stop's own message
    can be overwritten by a progress update the stopped stream had already sent (the page
    cancels the stream and runs Stop side by side); this runs after the page has closed the
    stream, so its word is the last."""
    return (render_stopped(what) if in_flight(box_html) else gr.skip()), gr.update(**STOP_IDLE)


def wire(demo: gr.Blocks, service: AppService, c: dict[str, Any], *,
         startup_notes: list[str], history: int) -> None:
    """Every listener of the page, on the components of the builders (``c``, by name)."""
    generate_events = wire_generate(service, c, startup_notes=startup_notes, history=history)
    sweep_event = wire_sweep(service, c)
    c["stop_btn"].click(lambda: (render_stopped(), gr.update(**STOP_IDLE)),
                        outputs=[c["status"], c["stop_btn"]], cancels=[*generate_events, sweep_event],
                        **QUIET)
    wire_view(demo, service, c, startup_notes=startup_notes)
    wire_api(service, c)


def wire_generate(service: AppService, c: dict[str, Any], *, startup_notes: list[str],
                  history: int) -> list:
    """Generate (the button and Enter in the prompt): the status box's check, then the queued
    generation with its progress; returns the two generation events (Stop cancels them)."""
    form = [c[k] for k in FORM]
    ui_inputs = [*form, c["blind"], c["view_state"], c["error_map"], c["history"]]
    ui_outputs = [c[k] for k in UI_OUTPUTS]
    view_targets = [c[k] for k in VIEW_TARGETS]

    def validate_ui(*values):
        return _validations(service, values, extra=len(ui_inputs) - len(FIELDS))

    def input_status(*values):
        """The same check, summarised in the status box (fields in the closed Advanced
        accordion would hide their own messages); a valid request is said to be queued."""
        errors = service.field_errors(*values[:len(FIELDS)])
        return render_input_errors(errors) if errors else render_queued()

    def generate_ui(*values):
        """Generate from the page: progress bars while it runs, then the results."""
        (*fields, blind_v, _view, error_map_v, entries) = values
        try:
            settings = service.check(*fields)
        except InvalidInput as exc:
            yield (render_input_errors(exc.errors), *failure("", "")[1:])
            return
        progress = service.new_progress(settings)
        worker, cancel, box = run_in_thread(
            lambda cancel: service.run(settings, progress=progress, cancel=cancel,
                                       error_map=bool(error_map_v)))
        try:
            snap = progress.snapshot()
            yield (render_progress(snap, progress.describe(snap)), "",
                   gr.update(value=None, visible=False), gr.update(value=None),
                   gr.update(visible=False), gr.skip(), gr.update(visible=False), None, "",
                   gr.skip(), gr.skip(), gr.skip())
            while worker.is_alive():
                worker.join(POLL_S)
                if worker.is_alive():
                    snap = progress.snapshot()
                    yield (render_progress(snap, progress.describe(snap)),
                           *[gr.skip()] * (len(ui_outputs) - 1))
        finally:
            if worker.is_alive():  # Stop, or the page went away: stop at the next step
                cancel.set()
        err = box.get("err")
        if err is not None:
            yield failure(str(err) if isinstance(err, GenerationFailed) else f"{type(err).__name__}: {err}",
                          "Generation failed")
            return
        out: RunOutput = box["out"]
        view = to_view(out, blind_v)
        player_html, files_u, record_u, box_u, reveal_u = view_outputs(view)
        entries = ([history_entry(out, view, tuple(fields[:1]) + (list(fields[1]),)
                                  + tuple(fields[2:]))] + list(entries or []))[:history]
        yield (render_summary(view.record, out.seconds, skip_notes=startup_notes),
               player_html, files_u, record_u, box_u, str(out.record.seed), reveal_u, view,
               errmap_html(view), *history_outputs(entries))

    events = []
    for trigger in (c["run_btn"].click, c["prompt"].submit):
        trigger(input_status, inputs=ui_inputs, outputs=[c["status"]], **QUIET)
        trigger(lambda: gr.update(**STOP_BUSY), outputs=[c["stop_btn"]], **QUIET)
        event = trigger(generate_ui, inputs=ui_inputs, outputs=ui_outputs, validator=validate_ui,
                        concurrency_limit=1, concurrency_id=CONCURRENCY_ID,
                        api_visibility="private", show_progress="full",
                        show_progress_on=[c["status"]])
        events.append(event)
        event.then(sync_blind, inputs=[c["blind"], c["view_state"]],
                   outputs=view_targets + [c["errmap"]], **QUIET)
        event.then(after_run, inputs=[c["status"]], outputs=[c["status"], c["stop_btn"]], **QUIET)
    return events


def wire_sweep(service: AppService, c: dict[str, Any]):
    """The seed sweep (the generations' queue, one request at a time); returns its event."""

    def sweep_ui(*values):
        fields, n, first = values[:len(FORM)], values[len(FORM)], values[len(FORM) + 1]
        try:
            settings = service.check(*fields)
            seeds = parse_seeds(first, n)
        except InvalidInput as exc:
            yield render_input_errors(exc.errors), gr.update(visible=False)
            return
        except ValueError as exc:
            yield render_input_errors({"seeds": str(exc)}), gr.update(visible=False)
            return
        where = {"i": 0, "ev": None}

        def on_step(i, ev):
            where["i"], where["ev"] = i, ev

        worker, cancel, box = run_in_thread(
            lambda cancel: service.sweep(settings, seeds, on_step=on_step, cancel=cancel))
        try:
            while worker.is_alive():
                ev = where["ev"]
                step = (f" · {registry.label(ev.method)} step {ev.step}/{ev.steps}"
                        if ev is not None and ev.method else "")
                yield (f'<div class="aq-msg aq-idle {IN_FLIGHT}">Seed {where["i"] + 1} of {len(seeds)} '
                       f'(seed {seeds[where["i"]]}){html.escape(step)}</div>', gr.skip())
                worker.join(POLL_S * 2)
        finally:
            if worker.is_alive():
                cancel.set()
        if "err" in box:
            yield render_error(str(box["err"]), "Sweep failed"), gr.update(visible=False)
            return
        res = box["out"]
        folder = service.sweeps_folder()
        (folder / "sweep.json").write_text(res.to_json(), encoding="utf-8")
        png = render_plot(res, folder / "sweep.png")
        yield render_sweep(res.to_dict()), gr.update(value=str(png), visible=True)

    event = c["sweep_run"].click(
        sweep_ui, inputs=[*(c[k] for k in FORM), c["sweep_n"], c["sweep_first"]],
        outputs=[c["sweep_out"], c["sweep_plot"]],
        concurrency_limit=1, concurrency_id=CONCURRENCY_ID, api_visibility="private")
    c["sweep_run"].click(lambda: gr.update(**STOP_BUSY), outputs=[c["stop_btn"]], **QUIET)
    event.then(lambda box: after_run(box, "sweep"), inputs=[c["sweep_out"]],
               outputs=[c["sweep_out"], c["stop_btn"]], **QUIET)
    return event


def wire_view(demo: gr.Blocks, service: AppService, c: dict[str, Any], *,
              startup_notes: list[str]) -> None:
    """Everything that needs no generation: the plan line, Blind and Reveal, the history, the
    seed reuse, the prompt's warning and the prompt builder."""
    form = [c[k] for k in FORM]
    view_out = [c[k] for k in VIEW_TARGETS] + [c["errmap"]]

    def show_plan(*values):
        """What Generate will run with these settings (the prompt is checked on Generate)."""
        values = ("…", *values[1:len(FIELDS)])
        try:
            settings = service.check(*values)
        except InvalidInput as exc:
            return render_plan(None, service, exc.errors)
        return render_plan(settings, service)

    def open_again(index, entries, blind_v):
        entries = list(entries or [])
        if index is None or not isinstance(index, int) or not 0 <= index < len(entries):
            return (render_error("choose a generation in the list first.", "Nothing to open"),
                    *(gr.skip(),) * 7)
        view = entries[index]["view"].with_blind(bool(blind_v))
        if not view.files_exist():
            return (render_error("the server no longer keeps this result (it keeps the most "
                                 "recent ones); load its settings and generate again.",
                                 "Result removed"), *(gr.skip(),) * 7)
        return (render_summary(view.record, None, skip_notes=startup_notes), *view_outputs(view),
                view, errmap_html(view))

    c["reuse"].click(lambda used: used if used else gr.skip(), inputs=[c["seed_used"]],
                     outputs=[c["seed"]], **QUIET)
    gr.on([f.change for f in form[1:]] + [demo.load], show_plan, inputs=form, outputs=[c["plan"]],
          **QUIET)
    c["blind"].change(set_blind, inputs=[c["blind"], c["view_state"]], outputs=view_out, **QUIET)
    c["reveal"].click(do_reveal, inputs=[c["view_state"]], outputs=view_out, **QUIET)
    c["history_open"].click(open_again, inputs=[c["history_pick"], c["history"], c["blind"]],
                            outputs=[c["status"], *view_out], **QUIET)
    c["history_load"].click(load_settings, inputs=[c["history_pick"], c["history"]],
                            outputs=form, **QUIET)
    c["prompt"].change(lambda p: (f'<div class="aq-warn" role="status">{html.escape(w)}</div>'
                                  if (w := service.prompt_warning(p)) else ""),
                       inputs=[c["prompt"]], outputs=[c["prompt_warning"]], **QUIET)
    if "b_use" in c:
        parts = [c[k] for k in ("b_colour1", "b_shape1", "b_motion1", "b_two", "b_colour2",
                                "b_shape2", "b_motion2", "b_background")]
        c["b_use"].click(built_prompt, inputs=parts, outputs=[c["prompt"]], **QUIET)


def wire_api(service: AppService, c: dict[str, Any]) -> None:
    """The documented endpoints ``/generate`` and ``/sweep`` (gradio_client)."""

    def api_generate(prompt: str, methods: list[str], seed: int, steps: int, guidance: float,
                     shift: float, resolution: str, frames: int, negative_prompt: str,
                     fp4_scope: str, error_map: bool = False, progress=gr.Progress()):
        """Generate one clip per method. Returns the record (timings, memory, the 4-bit error
        and the fine-tuning drift, the receipts of what ran, the seed used, the precision), the
        clips in method order, the labelled side-by-side and record.json."""
        try:
            settings = service.check(prompt, methods, seed, steps, guidance, shift, resolution,
                                     frames, negative_prompt, fp4_scope)
        except InvalidInput as exc:
            raise gr.Error(describe_errors(exc.errors), title="Invalid input") from exc
        if not isinstance(error_map, bool):
            raise gr.Error(f"error_map: true or false, got {error_map!r}", title="Invalid input")
        prog = service.new_progress(settings)
        prog.listeners.append(_Throttle(progress))
        try:
            out = service.run(settings, progress=prog, error_map=error_map)
        except (GenerationFailed, GenerationCancelled) as exc:
            raise gr.Error(str(exc), title="Generation failed") from exc
        return (out.record.to_dict(), [str(p) for p in out.clips.values()],
                str(out.side_by_side), str(out.record_path))

    def api_sweep(prompt: str, methods: list[str], seeds: str, steps: int, guidance: float,
                  shift: float, resolution: str, frames: int, negative_prompt: str,
                  fp4_scope: str):
        """Seed sweep: the prompt once per seed (``seeds``: "0,1,2" or "0-7"), every method.
        Returns the summary (per method: PSNR/SSIM vs BF16 — the 4-bit error — and, for the tiny
        model, the procedural score, each with n, mean, std, min, max; and every row) and the
        plot (PNG)."""
        try:
            settings = service.check(prompt, methods, 0, steps, guidance, shift, resolution,
                                     frames, negative_prompt, fp4_scope)
        except InvalidInput as exc:
            raise gr.Error(describe_errors(exc.errors), title="Invalid input") from exc
        try:
            seed_list = parse_seeds(seeds)
        except ValueError as exc:
            raise gr.Error(f"seeds: {exc}", title="Invalid input") from exc
        try:
            res = service.sweep(settings, seed_list)
        except (GenerationFailed, GenerationCancelled) as exc:
            raise gr.Error(str(exc), title="Sweep failed") from exc
        folder = service.sweeps_folder()
        (folder / "sweep.json").write_text(res.to_json(), encoding="utf-8")
        return res.to_dict(), str(render_plot(res, folder / "sweep.png"))

    def validate_api(*values):
        return _validations(service, values, extra=len(values) - len(FIELDS))

    def validate_sweep(*values):
        vals = (values[0], values[1], 0, *values[3:])
        return _validations(service, vals, extra=0)

    api_fields = [c[k] for k in ("a_prompt", "a_methods", "a_seed", "a_steps", "a_guidance",
                                 "a_shift", "a_resolution", "a_frames", "a_negative", "a_scope")]
    c["a_button"].click(api_generate, inputs=[*api_fields, c["a_error_map"]],
                        outputs=[c["a_record"], c["a_clips"], c["a_sbs"], c["a_record_file"]],
                        api_name="generate", validator=validate_api, concurrency_limit=1,
                        concurrency_id=CONCURRENCY_ID)
    sweep_fields = list(api_fields)
    sweep_fields[2] = c["a_seeds"]
    c["a_sweep_button"].click(api_sweep, inputs=sweep_fields,
                              outputs=[c["a_sweep"], c["a_sweep_plot"]], api_name="sweep",
                              validator=validate_sweep, concurrency_limit=1,
                              concurrency_id=CONCURRENCY_ID)


def launch(demo: gr.Blocks, service: AppService, *, host: str = "127.0.0.1", port: int = 7860,
           auth: tuple[str, str] | None = None, block: bool = True, quiet: bool = False):
    """Serve ``demo`` on ``host:port`` (no share link, no analytics, system fonts)."""
    return demo.launch(server_name=host, server_port=port, auth=auth, share=False,
                       prevent_thread_lock=not block, quiet=quiet, show_error=True, ssr_mode=False,
                       allowed_paths=[str(service.root)], theme=theme(), css=read_static("app.css"),
                       auth_message="attnqat comparison app: sign in." if auth else None)


__all__ = ["CONCURRENCY_ID", "build_app", "built_prompt",
           "example_prompts", "example_text", "launch", "theme", "whole_number", "wire"]
