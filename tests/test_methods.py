"""The registry of attention methods (attnqat/methods.py): one entry reaches the attention entry
point, ``generate``, the app's service layer and the trainer, with no other module edited."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from attnqat import attention
from attnqat import methods as registry
from attnqat.app import service as svc
from attnqat.finetune import train as T
from attnqat.generate import GenerationRequest, generate, parse_methods
from finetune_data import RUN, losses, small_model

CALLS: list[tuple[int, ...]] = []


def _dummy_reference(q, k, v, scale):
    """Plain attention on values scaled by 1/2: visibly not bf16, differentiable, counted."""
    CALLS.append(tuple(q.shape))
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), (0.5 * v).transpose(1, 2),
                                       scale=scale)
    return o.transpose(1, 2)


@pytest.fixture()
def dummy():
    """A method registered only for this test: trainable, offered by generate on the base weights."""
    m = registry.register(registry.AttentionMethod(
        name="halfv", label="Half-V", description="attention on halved values (a test method)",
        trainable=True, four_bit=False, reference=_dummy_reference, generation="base"))
    CALLS.clear()
    try:
        yield m
    finally:
        registry.unregister("halfv")


def test_builtin_methods_and_their_lists():
    assert registry.names() == ("bf16", "nvfp4", "sage3", "attnqat", "dropin", "sagebwd")
    assert registry.generation() == ("bf16", "nvfp4", "sage3", "attnqat", "sagebwd")
    assert registry.trainable() == ("bf16", "attnqat", "dropin", "sagebwd")
    assert registry.inference() == ("bf16", "nvfp4", "sage3", "sagebwd")
    assert registry.four_bit() == ("nvfp4", "sage3", "attnqat", "dropin")
    assert registry.slot_attention("attnqat") == "nvfp4" and registry.uses_finetuned("attnqat")
    assert registry.get("nvfp4").kernel.name == "nvfp4" and registry.get("bf16").kernel is None
    assert registry.get("attnqat").finetuned_weights == "attnqat-finetuned"
    assert registry.by_finetuned_weights("dropin-finetuned").name == "dropin"
    assert registry.get("sagebwd").trainable and not registry.get("sagebwd").four_bit
    assert registry.get("sagebwd").kernel.name == "sagebwd" and registry.label("sagebwd") == "SageBwd (INT8)"


def test_register_refuses_a_taken_name_and_an_unknown_deployment(dummy):
    with pytest.raises(ValueError, match="already registered"):
        registry.register(dummy)
    with pytest.raises(ValueError, match="not registered"):
        registry.register(registry.AttentionMethod(name="other", label="O", description="", trainable=True,
                                                   four_bit=False, reference=_dummy_reference,
                                                   deploys_as="nothing"))
    with pytest.raises(ValueError, match="unknown attention method 'nothing'"):
        registry.get("nothing")


def test_a_registered_method_runs_through_attention(dummy):
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    out = attention(q, k, v, method="halfv")
    ref = attention(q, k, 0.5 * v, method="bf16")
    assert torch.allclose(out, ref, atol=1e-6) and CALLS
    with pytest.raises(RuntimeError, match="cannot run method 'halfv'"):
        attention(q, k, v, method="halfv", backend="triton")   # no kernel: refused, never substituted


def test_a_registered_method_gets_a_receipt_of_what_ran(dummy):
    """The dispatch log (#34's receipts) records what the registry dispatch chose: the method's
    reference, and its kernel with what the kernel noted it ran."""
    import importlib

    from attnqat.kernels import receipt

    att = importlib.import_module("attnqat.attention")
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    with att.dispatch_log() as log:
        attention(q, k, v, method="halfv")
    assert [(e["method"], e["implementation"], e["calls"]) for e in log.entries()] == [("halfv", "reference", 1)]

    def run(q, k, v, scale):
        receipt.note("gluon")
        return _dummy_reference(q, k, v, scale)

    registry.register(dataclasses.replace(dummy, kernel=registry.Kernel(
        "halfv", run=run, unsupported=lambda q, k, v: None)), replace=True)
    with att.dispatch_log() as log:
        out = attention(q, k, v, method="halfv", backend="triton")
    assert torch.equal(out, _dummy_reference(q, k, v, 16 ** -0.5))
    assert [(e["method"], e["implementation"], e["backend"]) for e in log.entries()] == [
        ("halfv", "gluon", "triton")]


def test_a_registered_method_reaches_generate(dummy, tmp_path):
    assert "halfv" in parse_methods("bf16,halfv")
    result = generate(GenerationRequest(prompt="a red ball", methods=("bf16", "halfv"), seed=1, steps=2,
                                        height=32, width=32, frames=5, device="cpu", dtype="float32",
                                        out=tmp_path / "out"), progress=False)
    rec = json.loads((tmp_path / "out" / "record.json").read_text())
    assert list(rec["methods"]) == ["bf16", "halfv"]
    assert rec["methods"]["halfv"]["label"] == "Half-V" and rec["methods"]["halfv"]["video"] == "halfv.mp4"
    assert rec["methods"]["halfv"]["attention_method"] == "halfv"
    assert CALLS, "the dummy reference never ran"
    assert not (result.videos["halfv"] == result.videos["bf16"]).all()


def test_a_registered_method_reaches_the_app_service(dummy):
    from attnqat.wan import load_models

    models = load_models(device="cpu", dtype="float32")
    service = svc.AppService(models, keep=1)
    try:
        assert service.availability()["halfv"] is None
        assert service.label("halfv") == "Half-V"
        assert service.note("halfv") == "attention on halved values (a test method)"
        settings = service.check("a red ball", ["halfv", "bf16"], seed=1, steps=1, resolution="32x32",
                                 frames=5)
        assert settings.methods == ("bf16", "halfv")   # the registry's display order
        run = service.run(settings)
        assert run.record.methods["halfv"].label == "Half-V" and CALLS
    finally:
        service.close()


def test_a_registered_trainable_method_is_a_student_of_the_trainer(dummy, tmp_path):
    model = small_model(tmp_path / "small-wan")
    out = tmp_path / "run"
    assert T.main(["--model", str(model), "--out", str(out), *RUN, "--steps", "1", "--batch-size", "1",
                   "--attention", "halfv", "--warmup", "0"]) == 0
    assert json.loads((out / "config.json").read_text())["attention"] == "halfv"
    assert sorted(losses(out)) == [1] and CALLS
