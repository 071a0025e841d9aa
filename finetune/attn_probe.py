"""How much 4-bit attention changes each self-attention layer's output inside the model's own
denoising (``attnqat repro --stages probe``).

The clips are denoised with BF16 attention as usual; at the captured steps every self-attention
call is also computed with NVFP4 attention on the *same* queries, keys and values (the PyTorch
reference of the method, so the number does not depend on a kernel), and the relative error
‖O_nvfp4 − O_bf16‖ / ‖O_bf16‖ is recorded per layer. It isolates what a weight set makes of the
attention inputs — whether its queries, keys and values are easier to quantize — from how the rest
of the network responds to the error, which the clip-level outcomes measure.
"""

from __future__ import annotations

import numpy as np
import torch

#: denoising steps (of 20) at which the attention inputs are captured: early, middle and late
CAPTURE_STEPS = (0, 5, 10, 15, 19)


def attention_errors(models, transformer, inp, *, batch: int, steps=CAPTURE_STEPS,
                     method: str = "nvfp4") -> dict:
    """Per-layer mean relative error of ``method`` against BF16 attention over every captured
    self-attention call (all prompts of ``inp``, conditional and unconditional passes); also per
    captured step, averaged over layers. ``transformer`` is left routed to BF16 attention."""
    from attnqat.attention import attention
    from attnqat.metrics import rel_error
    from attnqat.wan import get_processor, set_method

    from . import heldout

    set_method(transformer, "bf16", backend="torch")
    proc = get_processor(transformer)
    n_layers = len(transformer.blocks)
    state = {"step": 0, "calls": 0}
    errs: dict[tuple[int, int], list[float]] = {}

    def observe(q, k, v, out, kind):
        if kind == "self":
            layer = state["calls"] % n_layers
            state["calls"] += 1
            if state["step"] in steps:
                fp4 = attention(q, k, v, method=method, backend="torch")
                errs.setdefault((state["step"], layer), []).append(rel_error(fp4, out))

    s0 = inp.settings[0]

    def on_step(i: int) -> None:   # the step the next transformer call belongs to (0 for a new batch)
        state["step"] = (i + 1) % s0.steps

    proc.observer = observe
    try:
        for _ in heldout.denoise_batches(models, transformer, inp, batch, on_step):
            pass
    finally:
        proc.observer = None
    if not errs:
        raise ValueError(f"no self-attention call captured at steps {steps} of {s0.steps}")
    layers = [float(np.mean([e for (_, l), v in errs.items() if l == layer for e in v]))
              for layer in range(n_layers)]
    by_step = {int(s): float(np.mean([e for (st, _), v in errs.items() if st == s for e in v]))
               for s in sorted({st for st, _ in errs})}
    return {"method": method, "layers": layers, "mean": float(np.mean(layers)), "by_step": by_step,
            "prompts": len(inp.settings), "calls": sum(len(v) for v in errs.values())}
