"""The Gradio page of the comparison app and its API endpoint.

:func:`build_app` lays out the page around an :class:`~attnqat.app.service.AppService`;
:func:`launch` starts the server. Two events generate, and they share one concurrency group with a
limit of 1, so the loaded transformer serves one request at a time while others wait in Gradio's
bounded queue (``queue_size``):

* the page's Generate button (a generator: it streams one progress bar per method, then the synced
  players, metric cards, downloads and the record);
* ``/generate``, the documented API endpoint (``gradio_client``), with plain typed inputs and the
  record plus file paths as outputs.

Both check their inputs first, in a validator that Gradio runs before the request joins the queue,
so a bad input is answered at once with a message on the field it concerns; joining the queue is
serialized so that ``queue_size`` is a hard bound (:func:`bounded_queue`). The page also has a Stop
button (it cancels the running or queued generation), a "Reuse this seed" button, and a line in the
Advanced accordion that says what will run.
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

from attnqat.generate import InvalidInput
from attnqat.prompts import model_prompts
from attnqat.tiny import ASSETS_DIR, TINY_MODEL_DIR
from attnqat.wan import dtype_name

from .player import (ResultView, read_static, render_error, render_input_errors, render_notes,
                     render_plan, render_player, render_progress, render_queued, render_summary)
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


def build_app(service: AppService, *, queue_size: int = 8) -> gr.Blocks:
    """The page and the ``/generate`` API of ``service`` (call :func:`launch` to serve it)."""
    if queue_size < 1:
        raise ValueError(f"queue_size must be at least 1, got {queue_size}")
    # Clips, side-by-sides and records are served from the output root as they are, never copied.
    gr.set_static_paths([str(service.root)])
    d = service.defaults
    presets = service.resolution_presets()
    default_res = presets[0][1]
    available = service.available_methods()
    startup_notes = _startup_notes(service)

    with gr.Blocks(title="attnqat · 4-bit attention side by side", analytics_enabled=False,
                   fill_width=True) as demo:
        gr.HTML(
            '<div class="aq-header"><h1>Wan 2.1 with 4-bit attention, side by side</h1>'
            "<p>One prompt, one seed, one clip per attention method: BF16 (the reference), naive "
            "NVFP4, SageAttention3 and Attn-QAT. Timings, memory and PSNR/SSIM against BF16 are "
            f"shown under each clip.</p><p>{html.escape(_model_line(service))}</p>"
            f'<p id="aq-precision">{html.escape(precision_line(service))}</p></div>'
            + render_notes(startup_notes), elem_id="aq-header")

        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                prompt = gr.Textbox(label="Prompt", lines=2, max_lines=6, elem_id="aq-prompt",
                                    placeholder="Describe the clip, e.g. "
                                                "“a red circle moves left on a blue background”")
                gr.Examples(examples=[[p] for p in example_prompts(service)], inputs=[prompt],
                            label="Example prompts", examples_per_page=6)
            with gr.Column(scale=2):
                methods = gr.CheckboxGroup(choices=_method_choices(service), value=available,
                                           label="Attention methods", info=_methods_info(service),
                                           elem_id="aq-methods")
                with gr.Row():
                    blind = gr.Checkbox(label="Blind mode", value=False, elem_id="aq-blind",
                                        info="Shuffle the clips and hide their labels until you "
                                             "reveal them.")
                    run_btn = gr.Button("Generate", variant="primary", elem_id="aq-generate",
                                        scale=2)
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="aq-stop", scale=1)

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
                resolution = gr.Dropdown(choices=presets, value=default_res, allow_custom_value=True,
                                         label="Resolution (width × height)",
                                         info="Presets for this model; type WxH for another "
                                              "(multiples of 16).", elem_id="aq-resolution")
                frames = gr.Number(label="Frames (4k+1)", value=int(d["frames"]), precision=None,
                                   step=4, elem_id="aq-frames")
                fp4_scope = gr.Radio([("Self-attention (published recipe)", "self"),
                                      ("Self- and cross-attention", "all")], value="self",
                                     label="4-bit attention in", elem_id="aq-scope")
            negative = gr.Textbox(label="Negative prompt", value=d.get("negative_prompt", ""),
                                  lines=1, max_lines=4, elem_id="aq-negative",
                                  placeholder="Optional; used by classifier-free guidance")
            plan = gr.HTML("", elem_id="aq-plan")

        status = gr.HTML(IDLE, elem_id="aq-status", min_height=40)
        player = gr.HTML("", js_on_load=read_static("player.js"), elem_id="aq-player")
        with gr.Row():
            reveal = gr.Button("Reveal labels", visible=False, elem_id="aq-reveal", scale=0,
                               min_width=180)
        with gr.Row():
            files = gr.File(label="Downloads: each clip, the labelled side-by-side, the record",
                            file_count="multiple", interactive=False, visible=False,
                            elem_id="aq-files")
            with gr.Accordion("Record (record.json)", open=False, visible=False,
                              elem_id="aq-record-box") as record_box:
                record = gr.JSON(label="Record (record.json)", show_label=False, elem_id="aq-record")
        view_state = gr.State(None)

        # The API endpoint: plain inputs without UI bounds or rounding (numbers reach the one
        # validation as they were sent; it explains bad values).
        with gr.Column(visible=False):
            a_prompt = gr.Textbox(label="prompt")
            a_methods = gr.Dropdown(choices=list(service.availability()), value=available,
                                    multiselect=True, allow_custom_value=True, label="methods")
            a_seed = gr.Number(value=-1, precision=None, label="seed")
            a_steps = gr.Number(value=int(d["steps"]), precision=None, label="steps")
            a_guidance = gr.Number(value=float(d["guidance"]), precision=None, label="guidance")
            a_shift = gr.Number(value=float(d["shift"]), precision=None, label="shift")
            a_resolution = gr.Textbox(value=default_res, label="resolution")
            a_frames = gr.Number(value=int(d["frames"]), precision=None, label="frames")
            a_negative = gr.Textbox(value=d.get("negative_prompt", ""), label="negative_prompt")
            a_scope = gr.Dropdown(choices=["self", "all"], value="self", allow_custom_value=True,
                                  label="fp4_scope")
            a_record = gr.JSON(label="record")
            a_clips = gr.File(file_count="multiple", label="clips")
            a_sbs = gr.File(label="side_by_side")
            a_record_file = gr.File(label="record_file")
            a_button = gr.Button("generate")

        form = [prompt, methods, seed, steps, guidance, shift, resolution, frames, negative,
                fp4_scope]
        ui_inputs = [*form, blind, view_state]
        ui_outputs = [status, player, files, record, record_box, seed_used, reveal, view_state]

        def view_outputs(view: ResultView | None):
            hidden = view is None or view.hidden
            return (render_player(view),
                    gr.update(value=list(view.files) if view and not hidden else None,
                              visible=bool(view) and not hidden),
                    gr.update(value=view.record if view and not hidden else None),
                    gr.update(visible=bool(view) and not hidden),
                    gr.update(visible=bool(view) and view.hidden))

        def failure(message: str, title: str):
            return (render_error(message, title), "", gr.update(value=None, visible=False),
                    gr.update(value=None), gr.update(visible=False), gr.skip(),
                    gr.update(visible=False), None)

        def to_view(out: RunOutput, blind_on: bool) -> ResultView:
            files = tuple(str(p) for p in out.clips.values()) + (str(out.side_by_side),
                                                                 str(out.record_path))
            view = ResultView(run_id=out.run_id, methods=tuple(out.clips), files=files,
                              media={m: str(p) for m, p in out.media.items()},
                              record=out.record.to_dict())
            return view.with_blind(bool(blind_on))

        def validate_ui(*values):
            return _validations(service, values, extra=len(ui_inputs) - len(FIELDS))

        def input_status(*values):
            """The same check, summarised in the status box (fields in the closed Advanced
            accordion would hide their own messages); a valid request is said to be queued."""
            errors = service.field_errors(*values[:len(FIELDS)])
            return render_input_errors(errors) if errors else render_queued()

        def show_plan(*values):
            """What Generate will run with these settings (the prompt is checked on Generate)."""
            values = ("…", *values[1:len(FIELDS)])
            try:
                settings = service.check(*values)
            except InvalidInput as exc:
                return render_plan(None, service, exc.errors)
            return render_plan(settings, service)

        def generate_ui(prompt_v, methods_v, seed_v, steps_v, guidance_v, shift_v, res_v, frames_v,
                        negative_v, scope_v, blind_v, _view):
            """Generate from the page: progress bars while it runs, then the results."""
            try:
                settings = service.check(prompt_v, methods_v, seed_v, steps_v, guidance_v, shift_v,
                                         res_v, frames_v, negative_v, scope_v)
            except InvalidInput as exc:
                yield (render_input_errors(exc.errors), *failure("", "")[1:])
                return
            progress = service.new_progress(settings)
            cancel = threading.Event()
            box: dict[str, Any] = {}

            def work() -> None:
                try:
                    box["out"] = service.run(settings, progress=progress, cancel=cancel)
                except BaseException as exc:  # noqa: BLE001 - reported in the page
                    box["err"] = exc

            worker = threading.Thread(target=work, name="attnqat-app-generate", daemon=True)
            worker.start()
            try:
                snap = progress.snapshot()
                yield (render_progress(snap, progress.describe(snap)), "",
                       gr.update(value=None, visible=False), gr.update(value=None),
                       gr.update(visible=False), gr.skip(), gr.update(visible=False), None)
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
            if isinstance(err, GenerationFailed):
                yield failure(str(err), "Generation failed")
                return
            if err is not None:
                yield failure(f"{type(err).__name__}: {err}", "Generation failed")
                return
            out: RunOutput = box["out"]
            view = to_view(out, blind_v)
            player_html, files_u, record_u, box_u, reveal_u = view_outputs(view)
            yield (render_summary(view.record, out.seconds, skip_notes=startup_notes),
                   player_html, files_u, record_u, box_u, str(out.record.seed), reveal_u, view)

        def set_blind(blind_v, view: ResultView | None):
            if view is None:  # nothing shown yet (or a generation is running)
                return (gr.skip(),) * 6
            view = view.with_blind(bool(blind_v))
            return (*view_outputs(view), view)

        def do_reveal(view: ResultView | None):
            if view is None:
                return (gr.skip(),) * 6
            view = view.reveal()
            return (*view_outputs(view), view)

        def sync_blind(blind_v, view: ResultView | None):
            """Blind mode switched while generating: apply the box's current state."""
            if view is None or view.blind == bool(blind_v):
                return (gr.skip(),) * 6
            return set_blind(blind_v, view)

        view_targets = [player, files, record, record_box, reveal, view_state]
        generate_events = []
        for trigger in (run_btn.click, prompt.submit):
            trigger(input_status, inputs=ui_inputs, outputs=[status], queue=False,
                    api_visibility="private", show_progress="hidden")
            event = trigger(generate_ui, inputs=ui_inputs, outputs=ui_outputs, validator=validate_ui,
                            concurrency_limit=1, concurrency_id=CONCURRENCY_ID,
                            api_visibility="private", show_progress="full",
                            show_progress_on=[status])
            generate_events.append(event)
            event.then(sync_blind, inputs=[blind, view_state], outputs=view_targets, queue=False,
                       api_visibility="private", show_progress="hidden")
        stop_btn.click(lambda: render_error("the generation was stopped; nothing was kept.",
                                            "Stopped"),
                       outputs=[status], cancels=generate_events, queue=False,
                       api_visibility="private", show_progress="hidden")
        reuse.click(lambda used: used if used else gr.skip(), inputs=[seed_used], outputs=[seed],
                    queue=False, api_visibility="private", show_progress="hidden")
        gr.on([c.change for c in form[1:]] + [demo.load], show_plan, inputs=form, outputs=[plan],
              queue=False, api_visibility="private", show_progress="hidden")
        blind.change(set_blind, inputs=[blind, view_state], outputs=view_targets, queue=False,
                     api_visibility="private", show_progress="hidden")
        reveal.click(do_reveal, inputs=[view_state], outputs=view_targets, queue=False,
                     api_visibility="private", show_progress="hidden")

        def api_generate(prompt: str, methods: list[str], seed: int, steps: int, guidance: float,
                         shift: float, resolution: str, frames: int, negative_prompt: str,
                         fp4_scope: str, progress=gr.Progress()):
            """Generate one clip per method. Returns the record (timings, memory, PSNR/SSIM, the
            seed used, the precision that ran), the clips in method order, the labelled
            side-by-side and record.json."""
            try:
                settings = service.check(prompt, methods, seed, steps, guidance, shift, resolution,
                                         frames, negative_prompt, fp4_scope)
            except InvalidInput as exc:
                raise gr.Error(describe_errors(exc.errors), title="Invalid input") from exc
            prog = service.new_progress(settings)
            prog.listeners.append(_Throttle(progress))
            try:
                out = service.run(settings, progress=prog)
            except (GenerationFailed, GenerationCancelled) as exc:
                raise gr.Error(str(exc), title="Generation failed") from exc
            return (out.record.to_dict(), [str(p) for p in out.clips.values()],
                    str(out.side_by_side), str(out.record_path))

        def validate_api(*values):
            return _validations(service, values, extra=0)

        a_button.click(api_generate,
                       inputs=[a_prompt, a_methods, a_seed, a_steps, a_guidance, a_shift,
                               a_resolution, a_frames, a_negative, a_scope],
                       outputs=[a_record, a_clips, a_sbs, a_record_file], api_name="generate",
                       validator=validate_api, concurrency_limit=1, concurrency_id=CONCURRENCY_ID)

    demo.queue(max_size=queue_size, default_concurrency_limit=1)
    bounded_queue(demo)
    return demo


def launch(demo: gr.Blocks, service: AppService, *, host: str = "127.0.0.1", port: int = 7860,
           auth: tuple[str, str] | None = None, block: bool = True, quiet: bool = False):
    """Serve ``demo`` on ``host:port`` (no share link, no analytics, system fonts)."""
    return demo.launch(server_name=host, server_port=port, auth=auth, share=False,
                       prevent_thread_lock=not block, quiet=quiet, show_error=True, ssr_mode=False,
                       allowed_paths=[str(service.root)], theme=theme(), css=read_static("app.css"),
                       auth_message="attnqat comparison app: sign in." if auth else None)


__all__ = ["CONCURRENCY_ID", "build_app", "example_prompts", "launch", "theme"]
