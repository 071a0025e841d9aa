"""HTML of the page's dynamic parts: the synced players with their metric cards and the comparison
view, the per-method progress bars, the run summary, the plan and messages.

Everything here is a pure function of plain data (a :class:`ResultView` and the generation record),
so it is tested without a server. The players' script is ``static/player.js`` (run by the
``gr.HTML`` component's ``js_on_load``); the styles are ``static/app.css``.

Blind mode: the clips are shown in a shuffled order, captioned "Clip A", "Clip B", …, without metric
cards or download links, and their URLs are the random media names of
:class:`attnqat.app.service.AppService` — nothing in the players' HTML names a method until the
labels are revealed.
"""

from __future__ import annotations

import html
import json
import math
import random
import re
import secrets
import string
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import quote

from attnqat import methods as registry
from attnqat.sweep import TABLE_HEADER, SweepResult, table_rows

from .service import FIELD_NAMES, describe_errors
from .service import method_note as _method_note

STATIC = Path(__file__).resolve().parent / "static"
FILE_ROUTE = "gradio_api/file="  # relative: works when the app is mounted below a path


def read_static(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")


def file_url(path: str | Path) -> str:
    """URL under which Gradio serves a file of an allowed/static folder (relative to the page)."""
    return FILE_ROUTE + quote(str(Path(path).resolve()), safe="/")


@dataclass(frozen=True)
class ResultView:
    """What the page shows of one result (kept in the session's ``gr.State``).

    ``order`` is the display order; ``blind`` shuffles and hides labels until ``revealed``.
    """

    run_id: str
    methods: tuple[str, ...]
    media: dict[str, str]          # method → path of the randomly named clip
    files: tuple[str, ...]         # downloads: clips, side_by_side.mp4, record.json
    record: dict[str, Any]
    order: tuple[str, ...] = ()
    blind: bool = False
    revealed: bool = False
    downloads: dict[str, str] | None = None  # method → the clip named by method, prompt, seed
    error_map: str | None = None   # error_map.json of the run, when collected
    render: str = ""               # changes on every state change: the script sets up again

    def with_blind(self, blind: bool, rng: random.Random | None = None) -> "ResultView":
        """Blind on: a new shuffled order, labels hidden. Blind off: the run's order, labelled."""
        if blind:
            order = list(self.methods)
            (rng or random.SystemRandom()).shuffle(order)
            return replace(self, order=tuple(order), blind=True, revealed=False, render=_nonce())
        return replace(self, order=tuple(self.methods), blind=False, revealed=False,
                       render=_nonce())

    def reveal(self) -> "ResultView":
        return replace(self, revealed=True, render=_nonce())

    @property
    def hidden(self) -> bool:
        """Labels hidden now."""
        return self.blind and not self.revealed

    def files_exist(self) -> bool:
        return all(Path(p).is_file() for p in self.media.values())


def _nonce() -> str:
    return secrets.token_hex(6)


# ----------------------------------------------------------------------------------------------
# Formatting
# ----------------------------------------------------------------------------------------------

def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "—"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "—"
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.0f} {unit}"
    return f"{n} B"


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def method_label(record: dict[str, Any], method: str) -> str:
    """The method's name as the record gives it (Attn-QAT's says which weights ran)."""
    entry = record.get("methods", {}).get(method, {})
    return entry.get("label") or registry.label(method)


def method_note(record: dict[str, Any], method: str) -> str:
    """The line under the method's name, as the record's ``qat`` says
    (:func:`app.service.method_note`)."""
    return _method_note(method, record.get("qat"))


def metric_rows(method: str, entry: dict[str, Any], bf16_run: bool,
                drift: dict[str, Any] | None = None) -> list[tuple[str, str, str]]:
    """(name, value, tooltip) rows of one method's card. PSNR/SSIM are the 4-bit error (against
    BF16 attention with the same weights); Attn-QAT's card adds the fine-tuning ``drift`` (the
    record's ``weights_drift``)."""
    t = entry.get("timings", {})
    share = t.get("attention_share_of_denoising")
    att = fmt_seconds(t.get("attention_s"))
    if share is not None and t.get("attention_s") is not None:
        att += f" ({share:.0%})"
    kind = entry.get("peak_memory_kind")
    mem_tip = ("peak GPU memory allocated during this method" if kind == "cuda_max_memory_allocated"
               else "peak resident memory of the app process so far (on the CPU it cannot be reset "
                    "between methods)")
    has_ref = entry.get("reference") is not None
    if method == registry.REFERENCE:
        psnr = ssim = "reference"
    elif not has_ref and not bf16_run:
        psnr = ssim = "— (BF16 not run)"
    elif entry.get("identical_to_bf16"):
        psnr, ssim = "identical", f"{entry['ssim']:.4f}" if entry.get("ssim") is not None else "1"
    else:
        psnr = f"{entry['psnr']:.2f} dB" if entry.get("psnr") is not None else "—"
        ssim = f"{entry['ssim']:.4f}" if entry.get("ssim") is not None else "—"
    same = ("against the Attn-QAT weights' own BF16 clip (BF16 attention): the 4-bit error, "
            "fine-tuning drift excluded" if _finetuned(method) else
            "against the BF16 clip (the same weights with BF16 attention): the 4-bit error")
    rows = [
        ("Total", fmt_seconds(t.get("total_s")), "denoising plus decoding of this clip (the text "
                                                 "encoding is shared and shown in the summary)"),
        ("Denoising", fmt_seconds(t.get("denoising_s")), "time of the denoising loop"),
        ("Decoding", fmt_seconds(t.get("decoding_s")), "time of the VAE decode"),
        ("Attention", att, "time inside attention calls, and its share of denoising"),
        ("Peak memory", fmt_bytes(entry.get("peak_memory_bytes")), mem_tip),
        ("PSNR vs BF16", psnr, f"peak signal-to-noise ratio {same} (higher is closer)"),
        ("SSIM vs BF16", ssim, f"structural similarity {same} (1 is identical)"),
    ]
    if _finetuned(method) and drift is not None:
        d = "identical" if drift.get("identical") else (
            f"{drift['psnr']:.2f} dB" if drift.get("psnr") is not None else "—")
        if drift.get("ssim") is not None:
            d += f" · SSIM {drift['ssim']:.4f}"
        rows.append(("Drift from base", d, "fine-tuning drift, no 4-bit error in it: the Attn-QAT "
                                           "weights with BF16 attention against the base model's "
                                           "BF16 clip"))
    return rows


def _finetuned(method: str) -> bool:
    """A slot on fine-tuned weights (``attnqat``); False for a name not registered (old records)."""
    return method in registry.names() and registry.uses_finetuned(method)


_IMPL_NAMES = {"sdpa": "PyTorch SDPA", "reference": "the PyTorch reference", "triton": "Triton kernel",
               "gluon": "Gluon kernel", "gluon+triton": "Gluon and Triton kernels",
               "triton+gluon": "Triton and Gluon kernels"}


def receipt_lines(entry: dict[str, Any]) -> list[str]:
    """What the method's attention calls actually ran, one line per kind of call (from the
    record's ``dispatch``, logged by the processor as each call ran)."""
    out = []
    for d in entry.get("dispatch") or []:
        impl = _IMPL_NAMES.get(d.get("implementation"), str(d.get("implementation")))
        if d.get("implementation") == "sdpa" and d.get("detail"):
            impl += f" ({d['detail'].lower()} backend)"
        name = registry.label(d.get("method"))
        out.append(f"{d.get('kind')}-attention: {name} on {impl} · {d.get('dtype')} on "
                   f"{d.get('device')} · {d.get('calls')} calls")
    return out


def render_receipt(entry: dict[str, Any]) -> str:
    """The panel's receipt: which kernel ran, in which precision, on which device, and a loud
    warning for anything that fell back."""
    lines = receipt_lines(entry)
    if not lines:
        return '<div class="aq-receipt aq-sub">Receipt: not recorded in this result.</div>'
    items = "".join(f"<li>{_esc(x)}</li>" for x in lines)
    warn = ""
    fallbacks = entry.get("fallbacks") or []
    if fallbacks:
        warn = ('<div class="aq-fallback" role="alert"><b>⚠ Fell back:</b> '
                + " ".join(_esc(f) for f in fallbacks) + "</div>")
    cpu_4bit = [d for d in entry.get("dispatch") or []
                if d.get("implementation") == "reference" and not d.get("fallback")
                and str(d.get("device", "")).startswith("cpu")]
    note = ('<div class="aq-sub">4-bit attention on the CPU is the PyTorch reference: the same '
            'numbers as the kernels, not their speed (the kernels need a CUDA GPU).</div>'
            if cpu_4bit else "")
    return (f'<details class="aq-receipt" {"open" if fallbacks else ""}>'
            f'<summary>Receipt: what ran{" — FELL BACK" if fallbacks else ""}</summary>'
            f'{warn}<ul>{items}</ul>{note}</details>')


# ----------------------------------------------------------------------------------------------
# The players
# ----------------------------------------------------------------------------------------------

_ZOOMS = (1, 2, 4, 8)


def _compare_html(names: Sequence[str], srcs: Sequence[str], aspect: str) -> str:
    """The enlarged comparison of two clips: one drawn over the other, a split slider between them
    and a zoom (``player.js`` keeps both in step with the row of players)."""
    right = 1 if len(names) > 1 else 0

    def opts(chosen: int) -> str:  # player.js sets each menu to the clip drawn (data-right)
        return "".join(f'<option value="{i}">{_esc(n)}</option>' for i, n in enumerate(names))

    zooms = "".join(f'<option value="{z}">{z}×</option>' for z in _ZOOMS)
    return (
        '<div class="aq-compare">'
        '<div class="aq-compare-controls">'
        f'<label>Left <select class="aq-cmp-left">{opts(0)}</select></label>'
        f'<label>Right <select class="aq-cmp-right">{opts(right)}</select></label>'
        '<label>Split <input type="range" class="aq-split" min="0" max="100" value="50"></label>'
        f'<label>Zoom <select class="aq-zoom">{zooms}</select></label>'
        '<span class="aq-sub">Drag the split to wipe between the two clips; with zoom, the view '
        'follows the mouse.</span></div>'
        f'<div class="aq-stage" data-right="{right}" style="--aq-aspect: {_esc(aspect)}">'
        f'<video class="aq-cmp-video aq-cmp-b" src="{_esc(srcs[right])}" muted playsinline '
        'preload="auto" disablepictureinpicture></video>'
        f'<video class="aq-cmp-video aq-cmp-a" src="{_esc(srcs[0])}" muted playsinline '
        'preload="auto" disablepictureinpicture></video>'
        '<div class="aq-split-line"></div></div></div>')


def render_player(view: ResultView | None) -> str:
    """The row of synced players with their controls, and the comparison view (empty string when
    there is nothing to show)."""
    if view is None:
        return ""
    if not view.files_exist():
        return ('<div class="aq-player aq-gone"><p class="aq-player-msg">This result is no longer '
                'on the server (the app keeps only the most recent results). Generate again.</p>'
                '</div>')
    order = view.order or view.methods
    hidden = view.hidden
    rec_methods = view.record.get("methods", {})
    settings = view.record.get("settings", {})
    fps = float(settings.get("fps") or 16)
    nframes = int(settings.get("frames") or 1)
    aspect = f"{int(settings.get('width') or 1)} / {int(settings.get('height') or 1)}"
    bf16_run = registry.REFERENCE in rec_methods
    figures = []
    names: list[str] = []  # as the comparison view offers them
    srcs: list[str] = []
    for i, method in enumerate(order):
        src = file_url(view.media[method])
        srcs.append(src)
        video = (f'<video class="aq-main" src="{_esc(src)}" muted playsinline preload="auto" '
                 f'disablepictureinpicture></video>')
        if hidden:
            letter = string.ascii_uppercase[i]
            names.append(f"Clip {letter}")
            figures.append(f'<figure class="aq-clip"><figcaption class="aq-label">'
                           f'<b>Clip {letter}</b></figcaption>{video}</figure>')
            continue
        label = method_label(view.record, method)
        names.append(label)
        rows = "".join(f'<dt title="{_esc(tip)}">{_esc(k)}</dt><dd>{_esc(v)}</dd>'
                       for k, v, tip in metric_rows(method, rec_methods.get(method, {}), bf16_run,
                                                    view.record.get("weights_drift")))
        dl = (view.downloads or {}).get(method)
        name = Path(dl).name if dl else f"{method}.mp4"
        dl_src = file_url(dl) if dl else src
        figures.append(
            f'<figure class="aq-clip" data-method="{_esc(method)}">'
            f'<figcaption class="aq-label"><b>{_esc(label)}</b>'
            f'<span>{_esc(method_note(view.record, method))}</span></figcaption>{video}'
            f'<dl class="aq-card">{rows}</dl>{render_receipt(rec_methods.get(method, {}))}'
            f'<a class="aq-dl" href="{_esc(dl_src)}" download="{_esc(name)}">Download {_esc(name)}</a>'
            f'</figure>')
    note = ("Blind mode: the clips are shuffled and unlabelled. Press “Reveal labels” to see which "
            "is which." if hidden else
            ("Revealed: the clips stay in their blind order." if view.blind else ""))
    which = ("" if hidden or not view.record.get("comparison_note") else
             f'<p class="aq-sub aq-which">{_esc(view.record["comparison_note"])}</p>')
    cols = len(order)
    controls = (
        '<div class="aq-controls"><button type="button" class="aq-toggle">Pause</button>'
        '<button type="button" class="aq-restart">Restart</button>'
        '<button type="button" class="aq-prev" title="previous frame (pauses)">◀ frame</button>'
        '<button type="button" class="aq-next" title="next frame (pauses)">frame ▶</button>'
        f'<input type="range" class="aq-scrub" min="0" max="{nframes - 1}" value="0" step="1" '
        'aria-label="frame">'
        f'<span class="aq-frame">frame 1/{nframes}</span>'
        f'<span class="aq-player-msg">{_esc(note)}</span></div>')
    return (f'<div class="aq-player" data-count="{cols}" data-blind="{"yes" if hidden else "no"}" '
            f'data-render="{_esc(view.render or view.run_id)}" '
            f'data-fps="{fps:g}" data-frames="{nframes}" style="--aq-cols: {cols}">'
            f'{controls}<div class="aq-row">{"".join(figures)}</div>{which}'
            f'{_compare_html(names, srcs, aspect) if cols > 1 else ""}</div>')


# ----------------------------------------------------------------------------------------------
# Progress, summary, messages
# ----------------------------------------------------------------------------------------------

_STATE_TEXT = {"waiting": "waiting", "denoising": "step {step}/{steps}", "decoding": "decoding",
               "done": "done"}


def _eta(seconds: float | None, rough: bool = False) -> str:
    if seconds is None:
        return "estimating time left…"
    if seconds < 1:
        return "almost done"
    return f"about {seconds:.0f} s left" + (
        " (a guess: an attention method still to run has not been timed yet)" if rough else "")


#: the class of every message a request shows before its last word (queued, progress); a box that
#: still holds one after the request has ended was stopped (:func:`in_flight`)
IN_FLIGHT = "aq-inflight"


_IN_FLIGHT_TAG = re.compile(r'\s*<div class="[^"]*\b' + IN_FLIGHT + r'\b')


def in_flight(html_text: str | None) -> bool:
    """Whether a status box's HTML is a queued or progress message, not a request's last word
    (the class is read from the message's own first tag: a prompt quoted in a result cannot
    pass for it)."""
    return bool(_IN_FLIGHT_TAG.match(html_text or ""))


def render_progress(snapshot: dict[str, Any], headline: str) -> str:
    """One bar per method (denoising steps, then decoding) under a headline with the elapsed time
    and an estimate of the time left."""
    rows = []
    for row in snapshot["methods"]:
        pct = max(0.0, min(1.0, row["fraction"])) * 100
        state = row["state"]
        text = _STATE_TEXT[state].format(step=min(row["step"] + 1, row["steps"]), steps=row["steps"])
        t = row.get("timings")
        if state == "done" and t is not None:
            text = f"done in {fmt_seconds(t.total_s)}"
        label = row.get("label") or registry.label(row["method"])
        rows.append(
            f'<div class="aq-prow" data-method="{_esc(row["method"])}" data-state="{state}">'
            f'<span class="aq-pname">{_esc(label)}</span>'
            f'<div class="aq-bar" role="progressbar" aria-label="{_esc(label)}" '
            f'aria-valuemin="0" aria-valuemax="100" aria-valuenow="{pct:.0f}">'
            f'<div style="width: {pct:.1f}%"></div></div>'
            f'<span class="aq-pstate">{_esc(text)}</span></div>')
    return (f'<div class="aq-progress {IN_FLIGHT}" data-phase="{_esc(snapshot["phase"])}">'
            f'<div class="aq-progress-head">{_esc(headline)} · {snapshot["elapsed_s"]:.1f} s · '
            f'<span class="aq-eta">{_esc(_eta(snapshot.get("eta_s"), snapshot.get("eta_rough", False)))}'
            '</span></div>'
            f'{"".join(rows)}</div>')


def render_queued() -> str:
    return (f'<div class="aq-msg aq-idle aq-queued {IN_FLIGHT}">Queued: the generation starts as soon '
            'as the one before it has finished (the position in the queue is shown here while it '
            'waits).</div>')


def render_stopped(what: str = "generation") -> str:
    return render_error(f"the {what} was stopped; nothing was kept.", "Stopped")


def render_plan(settings, service, errors: dict[str, str] | None = None) -> str:
    """What a press of Generate will run with the inputs as they are now (``settings`` from
    :meth:`AppService.check`), or what is wrong with them."""
    if settings is None:
        items = describe_errors(errors or {})
        return f'<div class="aq-plan aq-sub"><b>Will not run:</b> {_esc(items)}</div>'
    calls = settings.transformer_calls_per_method
    cfg = (f"guidance {settings.guidance:g}: 2 transformer calls per step"
           if settings.guidance > 1 else f"guidance {settings.guidance:g}: no classifier-free guidance")
    seed = "a random seed" if settings.seed < 0 else f"seed {settings.seed}"
    scope = {"self": "self-attention", "all": "self- and cross-attention"}[settings.fp4_scope]
    four_bit = ("the PyTorch reference" if settings.device == "cpu" else
                {"auto": "the Triton kernels where they apply", "torch": "the PyTorch reference",
                 "triton": "the Triton kernels"}[settings.backend])
    names = ", ".join(service.label(m) for m in settings.methods)
    return (f'<div class="aq-plan aq-sub"><b>Will run:</b> {_esc(names)} · '
            f"{settings.width}×{settings.height} (width×height), {settings.frames} frames at "
            f"{settings.fps:g} fps · {settings.steps} steps ({_esc(cfg)}; {calls} calls per method) "
            f"· shift {settings.shift:g} · {_esc(seed)} · {_esc(settings.dtype)} on "
            f"{_esc(settings.device)} · 4-bit {_esc(scope)} by {_esc(four_bit)}"
            + (f' · negative prompt “{_esc(settings.negative_prompt[:40])}'
               f'{"…" if len(settings.negative_prompt) > 40 else ""}”' if settings.negative_prompt
               else " · no negative prompt")
            + "</div>")


def render_error(message: str, title: str = "Generation failed") -> str:
    return (f'<div class="aq-msg aq-error" role="alert"><b>{_esc(title)}.</b> {_esc(message)}'
            '<br><span class="aq-sub">The app is ready for the next request.</span></div>')


def render_input_errors(errors: dict[str, str]) -> str:
    """Invalid inputs, one line per field (``errors`` as in :class:`~attnqat.generate.InvalidInput`)."""
    items = "".join(f"<li><b>{_esc(FIELD_NAMES.get(k, k))}</b>: {_esc(v)}</li>"
                    for k, v in errors.items())
    return (f'<div class="aq-msg aq-error" role="alert"><b>Check the inputs.</b><ul>{items}</ul>'
            '<span class="aq-sub">Nothing was generated; fix the fields above and generate '
            'again.</span></div>')


_ISO = re.compile(r"(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2})(?::\d{2}(?:\.\d+)?)?(?:\+00:00|Z)?")
_BIG = re.compile(r"(?<![\d.,:-])(\d{4,})(?![\d.,:-])")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def humanize_note(note: str) -> str:
    """A weights note for people: timestamps as dates (``2026-11-23T02:31:58+00:00`` →
    ``23 Nov 2026``), counts with thousands separators (``7192832`` → ``7,192,832``)."""
    def date(m: re.Match) -> str:
        y, mo, d = int(m.group(1)), int(m.group(2)), int(m.group(3))
        return f"{d} {_MONTHS[mo - 1]} {y}" if 1 <= mo <= 12 else m.group(0)

    text = _ISO.sub(date, note)
    return _BIG.sub(lambda m: f"{int(m.group(1)):,}" if not (1900 <= int(m.group(1)) <= 2100)
                    else m.group(1), text)


def note_parts(text: str) -> list[str]:
    """``"Model: what: details"`` → [head, what, details], split at the first two ``": "`` that
    are not inside parentheses; fewer parts when there are fewer."""
    out, depth, start, i = [], 0, 0, 0
    while i < len(text) and len(out) < 2:
        ch = text[i]
        depth += ch == "("
        depth -= ch == ")" and depth > 0
        if depth == 0 and text.startswith(": ", i):
            out.append(text[start:i])
            start = i + 2
            i += 1
        i += 1
    return out + [text[start:]]


def render_notes(notes: Sequence[str]) -> str:
    """The notes on the weights, for people (:func:`humanize_note`), the first sentence of each
    shown and the rest in a fold."""
    notes = [n for n in notes if n]
    if not notes:
        return ""
    items = []
    for n in notes:
        parts = note_parts(humanize_note(n))
        if len(parts) == 3:  # "Model: what they are: the counts and dates"
            head, what, rest = parts
            items.append(f"<li>{_esc(head)}: <b>{_esc(what)}</b>"
                         f"<details><summary>details</summary>{_esc(rest)}</details></li>")
        else:
            items.append(f"<li>{_esc(': '.join(parts))}</li>")
    return (f'<div class="aq-msg aq-note"><b>About these weights</b><ul>{"".join(items)}</ul>'
            "</div>")


def record_notes(record: dict[str, Any]) -> list[str]:
    """The record's notes on the weights, model first."""
    out = []
    if record.get("model_weights_note"):
        out.append(f"Model: {record['model_weights_note']}")
    if record.get("qat_weights_note"):
        out.append(f"{method_label(record, 'attnqat')}: {record['qat_weights_note']}")
    return out


def render_summary(record: dict[str, Any], seconds: float | None = None,
                   skip_notes: Sequence[str] = ()) -> str:
    """The settings actually used (seed and precision included), then the record's notes on the
    weights (those not in ``skip_notes``, i.e. not already on the page)."""
    s = record.get("settings", {})
    scope = {"self": "self-attention", "all": "self- and cross-attention"}.get(s.get("fp4_scope"),
                                                                             s.get("fp4_scope"))
    precision = (record.get("precision") or {}).get("dtype") or s.get("dtype")
    parts = [f"seed <b>{_esc(record.get('seed'))}</b>",
             f"{_esc(s.get('width'))}×{_esc(s.get('height'))}",
             f"{_esc(s.get('frames'))} frames at {float(s.get('fps', 0)):g} fps",
             f"{_esc(s.get('steps'))} steps", f"guidance {float(s.get('guidance', 0)):g}",
             f"shift {float(s.get('shift', 0)):g}", f"4-bit {_esc(scope)}",
             f"{_esc(precision)} on {_esc(s.get('device'))}"]
    if record.get("text_encoding_s") is not None:
        parts.append(f"text encoding {fmt_seconds(record['text_encoding_s'])} (shared)")
    if seconds is not None:
        parts.append(f"done in {seconds:.1f} s")
    n = len(record.get("methods", {}))
    head = f'<div class="aq-msg aq-ok"><b>Generated {n} clip{"s" if n != 1 else ""}</b> · ' + \
        " · ".join(parts) + "</div>"
    return head + render_notes([n for n in record_notes(record) if n not in skip_notes])


# ----------------------------------------------------------------------------------------------
# The error map, the seed sweep, the history
# ----------------------------------------------------------------------------------------------

def _heat(x: float | None, lo: float, hi: float) -> str:
    """A colour for ``x`` on a log scale from ``lo`` (dark) to ``hi`` (bright)."""

    if x is None or x <= 0:
        return "#ddd"
    t = 0.0 if hi <= lo else (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))
    t = max(0.0, min(1.0, t))
    stops = ((0.0, (20, 12, 50)), (0.35, (120, 30, 110)), (0.7, (230, 90, 70)), (1.0, (252, 240, 160)))
    for (t0, c0), (t1, c1) in zip(stops, stops[1:]):
        if t <= t1:
            f = (t - t0) / (t1 - t0)
            return "#" + "".join(f"{round(a + (b - a) * f):02x}" for a, b in zip(c0, c1))
    return "#fcf0a0"


def render_error_map(data: dict[str, Any] | None, labels: dict[str, str] | None = None,
                     kind: str = "self") -> str:
    """The attention-error map (``error_map.json`` as a dict) as one heatmap per 4-bit method:
    layers down, denoising steps across, one shared log colour scale; each cell's title gives
    its value."""
    if not data or not data.get("methods"):
        return ""
    maps = data["methods"]
    vals = [x for m in maps.values() for row in m["rel_error"].get(kind, []) for x in row
            if x is not None and x > 0]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    panels = []
    for method, m in maps.items():
        grid = m["rel_error"].get(kind)
        if not grid:
            continue
        steps, layers = len(grid), len(grid[0]) if grid else 0
        cells = []
        for layer in range(layers):
            for step in range(steps):
                x = grid[step][layer]
                tip = f"layer {layer}, step {step + 1}: " + ("—" if x is None else f"{x:.4f}")
                cells.append(f'<i style="background:{_heat(x, lo, hi)}" title="{_esc(tip)}"></i>')
        summ = (data.get("summary") or {}).get(method, {})
        mean = f" · mean {summ['mean']:.4f}" if summ.get("mean") is not None else ""
        panels.append(
            f'<figure class="aq-heat" data-method="{_esc(method)}" data-steps="{steps}" '
            f'data-layers="{layers}"><figcaption><b>{_esc((labels or {}).get(method, method))}'
            f'</b>{_esc(mean)}</figcaption><div class="aq-heat-grid" '
            f'style="grid-template-columns: repeat({steps}, 1fr)">{"".join(cells)}</div>'
            f'<div class="aq-sub">layers 0–{layers - 1} down, steps 1–{steps} across</div></figure>')
    legend = (f'<div class="aq-heat-legend aq-sub"><span style="background:{_heat(lo, lo, hi)}">'
              f'</span> {lo:.3g} … <span style="background:{_heat(hi, lo, hi)}"></span> {hi:.3g} '
              f'(log scale)</div>')
    return (f'<div class="aq-errmap"><b>Attention-error map</b> <span class="aq-sub">'
            f'{_esc(kind)}-attention: ‖O<sub>4-bit</sub> − O<sub>BF16</sub>‖ / ‖O<sub>BF16</sub>‖ '
            f'on the same q, k, v, per layer × denoising step. Where 4-bit attention departs from '
            f'BF16, and where Attn-QAT changes it.</span><div class="aq-heat-row">'
            f'{"".join(panels)}</div>{legend}</div>')


def render_sweep(result: dict[str, Any] | None) -> str:
    """A seed sweep's summary (:meth:`attnqat.sweep.SweepResult.to_dict`) as a table."""
    if not result:
        return ""
    res = SweepResult(prompt=result["prompt"], seeds=result["seeds"], methods=result["methods"],
                      rows=result["rows"], summary=result["summary"],
                      score_name=result.get("score_name"))
    head = "".join(f"<th>{_esc(h)}</th>" for h in TABLE_HEADER)
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in row) + "</tr>"
                   for row in table_rows(res))
    seeds = ", ".join(map(str, result["seeds"]))
    secs = f" in {result['seconds']:.1f} s" if result.get("seconds") else ""
    score = (f" Score: {_esc(result['score_name'])}." if result.get("score_name") else "")
    return (f'<div class="aq-sweep"><b>Seed sweep</b> <span class="aq-sub">“{_esc(result["prompt"])}”'
            f', {len(result["seeds"])} seeds ({_esc(seeds)}){_esc(secs)}: mean ± sample standard '
            f'deviation. PSNR/SSIM are the 4-bit error (vs BF16 attention, same weights).{score}'
            f'</span><table class="aq-sweep-table"><thead><tr>{head}</tr></thead><tbody>{body}'
            f'</tbody></table></div>')


def render_history(entries: Sequence[dict[str, Any]]) -> str:
    """The session's recent generations, newest first, with their settings."""
    if not entries:
        return '<div class="aq-sub">No generation yet in this session.</div>'
    rows = []
    for i, e in enumerate(entries):
        s = e["settings"]
        rows.append(
            f'<li data-index="{i}"><b>{i + 1}.</b> “{_esc(s["prompt"][:80])}” · seed '
            f'{_esc(e.get("seed"))} · {_esc(", ".join(e.get("labels", [])))} · '
            f'{_esc(s.get("resolution"))}, {_esc(s.get("frames"))} frames, {_esc(s.get("steps"))} '
            f'steps · {_esc(e.get("when", ""))}</li>')
    return f'<ol class="aq-history">{"".join(rows)}</ol>'


def read_error_map(path: str | None) -> dict[str, Any] | None:
    """``error_map.json`` of a run, or None when there is none (or it was removed)."""
    if not path or not Path(path).is_file():
        return None
    return json.loads(Path(path).read_text(encoding="utf-8"))


__all__ = ["ResultView", "file_url", "fmt_bytes", "fmt_seconds", "method_label", "metric_rows",
           "humanize_note", "read_error_map", "read_static", "receipt_lines", "render_error_map",
           "render_history", "render_sweep", "record_notes", "render_receipt", "render_error", "render_input_errors", "render_notes",
           "render_plan", "render_player", "render_progress", "render_queued", "render_stopped",
           "render_summary", "IN_FLIGHT", "in_flight"]
