"""``attnqat finetune train --objective flow|distill`` on a small Wan pipeline (CPU, fp32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnqat.finetune import train as T
from finetune_data import RUN, losses, small_model


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return small_model(tmp_path_factory.mktemp("obj") / "small-wan")


def _train(model: Path, out: Path, *extra: str) -> dict[int, float]:
    assert T.main(["--model", str(model), "--out", str(out), *RUN, "--steps", "3", "--batch-size", "2",
                   "--lr", "1e-3", "--warmup", "0", *extra]) == 0
    return losses(out)


def test_distill_targets_the_frozen_start_with_bf16_attention(model, tmp_path):
    # a BF16 student distilled from its own BF16 start: the first loss is exactly zero (the teacher
    # is the student before any step), and so is the first gradient
    bf16 = _train(model, tmp_path / "bf16", "--attention", "bf16", "--objective", "distill")
    assert bf16[1] == 0.0
    recs = [json.loads(x) for x in (tmp_path / "bf16" / "log.jsonl").read_text().splitlines()]
    assert next(r for r in recs if r["kind"] == "train" and r["step"] == 1)["grad_norm"] == 0.0
    # a 4-bit student: the target is the BF16 teacher, so the loss is the 4-bit error alone,
    # far below the flow objective's on the same samples, and nonzero
    qad = _train(model, tmp_path / "qad", "--attention", "attnqat", "--objective", "distill")
    flow = _train(model, tmp_path / "flow", "--attention", "attnqat", "--objective", "flow")
    assert 0.0 < qad[1] < 0.1 * flow[1]
    assert json.loads((tmp_path / "qad" / "config.json").read_text())["objective"] == "distill"
    assert json.loads((tmp_path / "flow" / "config.json").read_text())["objective"] == "flow"
    # the teacher stays the starting weights: the distilled student moved, the loss stays small
    assert all(0.0 < v < 0.1 * flow[1] for v in qad.values())


def test_distill_teacher_is_a_frozen_bf16_copy(model):
    from diffusers import WanTransformer3DModel

    from attnqat.finetune.objective import distill_target, make_teacher, predict
    from attnqat.wan import get_processor, install_attention

    tr = WanTransformer3DModel.from_pretrained(model, subfolder="transformer", torch_dtype=torch.float32)
    install_attention(tr, "attnqat", backend="torch", timing=False)
    teacher = make_teacher(tr, backend="torch")
    assert get_processor(teacher).method == "bf16" and get_processor(tr).method == "attnqat"
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training
    cfg = tr.config
    x = torch.randn(1, cfg.in_channels, 2, 4, 4)
    t = torch.tensor([500.0])
    text = torch.randn(1, 8, cfg.text_dim)
    target = distill_target(teacher, x, t, text)
    assert target.dtype == torch.float32 and not target.requires_grad
    with torch.no_grad():
        install_attention(tr, "bf16", backend="torch", timing=False)
        assert torch.equal(predict(tr, x, t, text).float(), target)   # same weights, same attention
    with torch.no_grad():   # changing the student does not change the teacher
        next(tr.parameters()).add_(1.0)
    assert torch.equal(distill_target(teacher, x, t, text), target)


def test_unknown_objective_is_refused(model, tmp_path, capsys):
    with pytest.raises(SystemExit):
        T.main(["--model", str(model), "--out", str(tmp_path / "x"), *RUN, "--objective", "kd"])
    assert "--objective" in capsys.readouterr().err
