"""What a stage of ``attnqat finetune tiny`` gets besides its options: the device, the clock and
the budgets it keeps, the run log, and the prompt length of the model being trained."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from attnqat.finetune.runlog import RunLog


class Clock:
    """Seconds since the process started its work, and the process-wide deadline."""

    def __init__(self, limit_minutes: float = 0.0, reserve_minutes: float = 0.0) -> None:
        self.t0 = time.perf_counter()
        self.limit = limit_minutes * 60.0
        self.reserve = reserve_minutes * 60.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left_for_training(self) -> float:
        """Seconds training may still use (inf without a limit)."""
        if self.limit <= 0:
            return math.inf
        return self.limit - self.reserve - self.elapsed()


class Budget:
    """Steps and/or seconds; ``progress`` is the larger of the two fractions used."""

    def __init__(self, steps: int, minutes: float, clock: Clock) -> None:
        self.steps, self.seconds, self.clock = steps, minutes * 60.0, clock
        self.t0 = time.perf_counter()
        limit = clock.left_for_training()
        if math.isfinite(limit):
            self.seconds = min(self.seconds, limit) if self.seconds > 0 else limit
        if self.steps <= 0 and self.seconds <= 0 and not math.isfinite(limit):
            raise ValueError("a training stage needs a budget: give its --*-steps or --*-minutes")

    def progress(self, step: int) -> float:
        p = step / self.steps if self.steps > 0 else 0.0
        if self.seconds > 0 or math.isfinite(self.clock.left_for_training()):
            p = max(p, (time.perf_counter() - self.t0) / max(self.seconds, 1e-9))
        return p

    def done(self, step: int) -> bool:
        return self.progress(step) >= 1.0


@dataclass
class Context:
    """The run's state shared by the stages."""

    dev: torch.device
    clock: Clock
    runlog: RunLog | None
    seq_len: int      # rows of the prompt embeddings, as the pipeline pads them at inference


def log(msg: str) -> None:
    print(msg, flush=True)


def autocast(dev: torch.device):
    """bf16 autocast on CUDA; a no-op elsewhere."""
    return torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
