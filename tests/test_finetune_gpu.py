"""The trainer on a CUDA GPU: bf16 autocast, FSDP2 bfloat16 parameter gathering and the Triton
kernels (``pytest -m gpu``)."""

from __future__ import annotations

import json

import pytest
import torch

from attnqat.finetune import train as T
from finetune_data import losses, small_model

pytestmark = pytest.mark.gpu

GPU = ["--device", "cuda", "--workers", "0", "--no-tensorboard", "--no-progress"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return small_model(tmp_path_factory.mktemp("ftg") / "small-wan")


@pytest.mark.parametrize("attention", ["attnqat", "dropin", "bf16"])
def test_triton_kernels_train_as_the_reference_does(model, tmp_path, attention):
    """Three steps in bf16 on the Triton kernels and on the PyTorch reference of the same method:
    the losses agree to bf16 accumulation noise (the numerics are the same definition)."""
    runs = {}
    for backend in ("triton", "torch"):
        out = tmp_path / backend
        assert T.main(["--model", str(model), "--out", str(out), *GPU, "--steps", "3",
                       "--batch-size", "4", "--lr", "1e-3", "--warmup", "0", "--attention", attention,
                       "--backend", backend, "--precision", "bf16"]) == 0
        runs[backend] = losses(out)
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["backend"] == backend
    for s in (1, 2, 3):
        assert runs["triton"][s] == pytest.approx(runs["torch"][s], rel=2e-2)


def test_an_ablation_runs_on_cuda_through_the_reference(model, tmp_path):
    out = tmp_path / "abl"
    assert T.main(["--model", str(model), "--out", str(out), *GPU, "--steps", "2", "--batch-size", "2",
                   "--ablation", "d_from_o"]) == 0
    assert all(0 < v < 10 for v in losses(out).values())
