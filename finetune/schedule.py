"""Learning-rate schedules and the exponential moving average of weights, shared by the trainers.

Schedules (:func:`lr_factor`, a multiplier of the peak learning rate): a linear warm-up over the
first ``warmup`` steps, then

* ``constant`` — 1 (the published Attn-QAT recipe: constant 1e-6 for Wan 2.1);
* ``cosine`` — half a cosine from 1 down to ``final`` over the rest of the budget;
* ``linear_tail`` — 1, then a linear fall to ``final`` over the last ``decay_frac`` of the budget
  (how the embedded tiny model was trained, ``attnqat finetune tiny``).

``progress`` is the fraction of the budget used (steps, or time for a time-limited run).
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import torch

SCHEDULES = ("constant", "cosine", "linear_tail")


def lr_factor(step: int, progress: float, *, warmup: int = 0, schedule: str = "constant",
              final: float = 0.0, decay_frac: float = 0.0) -> float:
    """The learning-rate multiplier at optimizer step ``step`` (0-based), ``progress`` in [0, 1]."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    f = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
    progress = min(max(progress, 0.0), 1.0)
    if schedule == "cosine":
        f *= final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * progress))
    elif schedule == "linear_tail" and decay_frac > 0 and progress > 1.0 - decay_frac:
        f *= final + (1.0 - final) * max(0.0, 1.0 - progress) / decay_frac
    return f


class EMA:
    """Exponential moving average of named tensors (a model's parameters, or their shards).

    ``shadow[name]`` follows ``params[name]``: after update ``k`` (1-based) it moves a fraction
    ``1 − d`` towards the live value, ``d = min(decay, (1 + k) / (10 + k))`` (a short warm-up, so
    the average is not dominated by the starting weights). Works on the local shards of FSDP2
    ``DTensor`` parameters as on plain tensors; :meth:`state_dict` / :meth:`load_state_dict` carry
    the shadow tensors and the update count.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"the EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.params = dict(params)
        self.shadow = {k: p.detach().clone() for k, p in self.params.items()}
        self.updates = 0

    @staticmethod
    def _local(ts: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        return [t.to_local() if hasattr(t, "to_local") else t for t in ts]

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        d = min(self.decay, (1.0 + self.updates) / (10.0 + self.updates))
        names = list(self.params)
        torch._foreach_lerp_(self._local(self.shadow[k] for k in names),
                             self._local(self.params[k].detach() for k in names), 1.0 - d)

    def state_dict(self) -> dict:
        return {"shadow": dict(self.shadow), "updates": self.updates}

    def load_state_dict(self, state: Mapping) -> None:
        with torch.no_grad():
            for k, t in state["shadow"].items():
                if t is not self.shadow[k]:
                    self.shadow[k].copy_(t)
        self.updates = int(state["updates"])

    @torch.no_grad()
    def copy_to(self, module: torch.nn.Module, prefix: str = "") -> None:
        """Write the averages into ``module``'s parameters of the same names (minus ``prefix``)."""
        own = dict(module.named_parameters())
        for k, t in self.shadow.items():
            if k.startswith(prefix):
                own[k[len(prefix):]].copy_(t)


__all__ = ["EMA", "SCHEDULES", "lr_factor"]
