"""Stage ``eval`` of ``attnqat finetune tiny``: generate one clip per held-out prompt and method
through the project's generation code (:mod:`attnqat.finetune.heldout`), score them with the
procedural judge, and write and print the result."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from attnqat.finetune import heldout
from attnqat.finetune.runlog import device_name, now
from attnqat.finetune.tiny_config import TinyTrainConfig
from attnqat.finetune.tiny_context import Context, log
from attnqat.finetune.tiny_text import binding_signal
from attnqat.wan import load_models


def evaluate(model_dir: Path, cfg: TinyTrainConfig, ctx: Context) -> dict:
    """Score the saved model on the held-out prompts (:mod:`attnqat.finetune.heldout`); returns
    (and writes) the result."""
    ev, dev = cfg.eval, ctx.dev
    t0 = time.perf_counter()
    models = load_models(model_dir, device=dev)
    first = ev.offset
    methods = list(ev.methods)

    def prepare(guidance: float | None) -> heldout.HeldoutInputs:
        return heldout.inputs(models, first, ev.prompts, steps=ev.steps,
                              guidance=guidance, size=ev.size, frames=ev.frames,
                              backend=ev.backend)

    inp = prepare(ev.guidance)
    specs, prompts, s0 = inp.specs, inp.prompts, inp.settings[0]
    tr = models.pipe.transformer
    text_binding = binding_signal(models.pipe.text_encoder, models.pipe.tokenizer, specs,
                                  cfg.t2v.text_len)
    result = {"model": str(model_dir), "date": now(), "device": device_name(dev),
              "prompts": len(prompts), "first_prompt": first,
              "seeds": f"{first}..{first + len(prompts) - 1} (seed i for held-out prompt i)",
              "settings": {"steps": s0.steps, "guidance": s0.guidance, "shift": s0.shift,
                           "height": s0.height, "width": s0.width, "frames": s0.frames,
                           "negative_prompt": s0.negative_prompt, "backend": ev.backend,
                           "fp4_scope": "self", "batch": ev.batch},
              "weights_note": models.info.weights_note, "text_binding": text_binding,
              "methods": {}, "clips": []}
    clips: dict[str, list[np.ndarray]] = {}
    scores: dict[str, list[dict]] = {}
    n_objects = [len(s.objects) for s in specs]
    for m in methods:
        t1 = time.perf_counter()
        clips[m] = heldout.generate_clips(models, tr, inp, m, ev.backend, ev.batch)
        t2 = time.perf_counter()
        scores[m] = heldout.score_all(prompts, clips[m], cfg.run.workers)
        row = heldout.summary_row(scores[m])
        # where the errors are: one-object against two-object prompts
        row["by_objects"] = {str(n): heldout.summary_row([s for s, k in zip(scores[m], n_objects)
                                                          if k == n])
                             for n in sorted(set(n_objects))}
        row.update(generate_s=round(t2 - t1, 2), score_s=round(time.perf_counter() - t2, 2))
        if m != "bf16" and "bf16" in clips:
            sim = heldout.similarity(clips[m], clips["bf16"])
            row.update(psnr_vs_bf16=sim["psnr"], psnr_vs_bf16_median=sim["psnr_median"],
                       identical_to_bf16=sim["identical"], ssim_vs_bf16=sim["ssim"])
        result["methods"][m] = row
        log(f"eval {m}: {len(prompts)} clips generated in {t2 - t1:.1f} s, scored in "
            f"{time.perf_counter() - t2:.1f} s")
    for i, p in enumerate(prompts):
        result["clips"].append({"prompt": p, "seed": first + i, **{
            m: {"colour": scores[m][i]["colour"], "shape": scores[m][i]["shape"],
                "motion": scores[m][i]["motion"], "background": scores[m][i]["background"],
                "all_correct": scores[m][i]["all_correct"],
                "detected": [o.get("detected") for o in scores[m][i]["objects"]]}
            for m in methods}})
    sweep = list(ev.sweep_guidance)
    if sweep:
        result["guidance_sweep_bf16"] = {}
        for g in sweep:
            cg = heldout.generate_clips(models, tr, prepare(g), "bf16", ev.backend, ev.batch)
            result["guidance_sweep_bf16"][str(g)] = heldout.summary_row(
                heldout.score_all(prompts, cg, cfg.run.workers))
    result["seconds"] = round(time.perf_counter() - t0, 1)
    path = ev.json or Path(str(cfg.run.out) + "-eval.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    if ev.samples > 0:
        k = min(ev.samples, len(prompts))
        np.savez_compressed(path.with_name(path.stem + "-samples.npz"), prompts=np.array(prompts[:k]),
                            **{m: np.stack(clips[m][:k]) for m in methods})
    log(format_table(result))
    return result


def format_table(result: dict) -> str:
    """The evaluation result as an aligned text table."""
    cols = ("colour", "shape", "motion", "background", "all_correct")
    lines = [f"held-out prompts: {result['prompts']} ({result['seeds']}); settings "
             + ", ".join(f"{k} {v}" for k, v in result["settings"].items()),
             f"{'method':<10}" + "".join(f"{c:>12}" for c in cols) + f"{'PSNR dB':>10}{'SSIM':>8}"]
    for m, row in result["methods"].items():
        psnr = row.get("psnr_vs_bf16")
        ssim = row.get("ssim_vs_bf16")
        lines.append(f"{m:<10}" + "".join(f"{100 * row[c]:>11.1f}%" for c in cols)
                     + (f"{psnr:>10.2f}" if psnr is not None else f"{'-':>10}")
                     + (f"{ssim:>8.3f}" if ssim is not None else f"{'-':>8}"))
    for m, row in result["methods"].items():
        for n, sub in row.get("by_objects", {}).items():
            lines.append(f"{m + ' ' + n + ' obj':<10}" + "".join(f"{100 * sub[c]:>11.1f}%" for c in cols)
                         + f"   ({sub['clips']} prompts)")
    for g, row in result.get("guidance_sweep_bf16", {}).items():
        lines.append(f"{'bf16 g' + g:<10}" + "".join(f"{100 * row[c]:>11.1f}%" for c in cols))
    if result.get("text_binding") is not None:
        lines.append(f"text binding signal {result['text_binding']:.2e} (prompt states with the two "
                     "motions swapped vs not; 0: the text encoder is order-blind)")
    return "\n".join(lines)
