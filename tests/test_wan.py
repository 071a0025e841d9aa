"""Attention routing through diffusers' processors, devices and model loading (attnqat/wan.py)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

import attnqat.wan as wan
from attnqat.tiny import TINY_MODEL_DIR, TINY_QAT_DIR, TinyWanConfig, _transformer_config

LAYERS = TinyWanConfig().num_layers


@pytest.fixture()
def transformer():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(**_transformer_config(TinyWanConfig())).eval()


def inputs(dtype=torch.float32, text_len=7):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 2, 8, 8, generator=g).to(dtype)   # 2 * 4 * 4 = 32 video tokens
    e = torch.randn(1, text_len, TinyWanConfig().text_d_model, generator=g).to(dtype)
    return x, torch.tensor([400.0]), e


def forward(model, x, t, e):
    return model(hidden_states=x, timestep=t, encoder_hidden_states=e, return_dict=False)[0]


@pytest.fixture()
def spy(monkeypatch):
    """Record every call that reaches attnqat.attention from the processor; fail if diffusers'
    own attention dispatch is used."""
    import diffusers.models.transformers.transformer_wan as tw

    calls = []
    real = wan.attention

    def recording(q, k, v, method="bf16", softmax_scale=None, backend="auto"):
        calls.append((method, q.shape[1], k.shape[1]))
        return real(q, k, v, method=method, softmax_scale=softmax_scale, backend=backend)

    def forbidden(*a, **kw):
        raise AssertionError("diffusers' attention dispatch was called")

    monkeypatch.setattr(wan, "attention", recording)
    monkeypatch.setattr(tw, "dispatch_attention_fn", forbidden)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_method_reproduces_diffusers_bit_exactly(transformer, dtype):
    m = transformer.to(dtype)
    x, t, e = inputs(dtype)
    with torch.no_grad():
        ref = forward(m, x, t, e)
        wan.install_attention(m, "bf16")
        out = forward(m, x, t, e)
    assert torch.equal(ref, out)


def test_every_self_attention_call_is_routed(transformer, spy):
    x, t, e = inputs()
    proc = wan.install_attention(transformer, "nvfp4")
    with torch.no_grad():
        forward(transformer, x, t, e)
        forward(transformer, x, t, e)
    self_calls = [c for c in spy if c[2] == 32]
    cross_calls = [c for c in spy if c[2] == 7]
    assert len(self_calls) == 2 * LAYERS and len(cross_calls) == 2 * LAYERS
    assert {c[0] for c in self_calls} == {"nvfp4"}
    assert {c[0] for c in cross_calls} == {"bf16"}  # default scope: cross-attention stays bf16
    assert proc.stats()["calls"] == {"self": 2 * LAYERS, "cross": 2 * LAYERS}
    assert proc.stats()["calls_by_method"] == {"self:nvfp4": 2 * LAYERS, "cross:bf16": 2 * LAYERS}
    assert proc.stats()["attention_s"] > 0


def test_cross_attention_only_when_asked(transformer, spy):
    x, t, e = inputs()
    wan.set_method(transformer, "sage3", fp4_scope="all")
    with torch.no_grad():
        forward(transformer, x, t, e)
    assert [c[0] for c in spy] == ["sage3"] * (2 * LAYERS)
    spy.clear()
    wan.set_method(transformer, "sage3", fp4_scope="self")
    with torch.no_grad():
        forward(transformer, x, t, e)
    assert sorted(c[0] for c in spy) == ["bf16"] * LAYERS + ["sage3"] * LAYERS


def test_nvfp4_differs_from_bf16_and_switching_is_cheap(transformer):
    x, t, e = inputs(torch.bfloat16)
    m = transformer.to(torch.bfloat16)
    ptrs = [p.data_ptr() for p in m.parameters()]
    with torch.no_grad():
        p1 = wan.set_method(m, "bf16")
        a = forward(m, x, t, e)
        p2 = wan.set_method(m, "nvfp4")
        b = forward(m, x, t, e)
        wan.set_method(m, "bf16")
        c = forward(m, x, t, e)
    assert p1 is p2 and wan.get_processor(m) is p1
    assert [p.data_ptr() for p in m.parameters()] == ptrs
    assert torch.isfinite(b).all()
    assert not torch.equal(a, b)
    assert torch.equal(a, c)


def test_method_state_belongs_to_each_transformer(transformer):
    from diffusers import WanTransformer3DModel

    other = WanTransformer3DModel.from_config(transformer.config).eval()
    other.load_state_dict(transformer.state_dict())
    x, t, e = inputs()
    with torch.no_grad():
        wan.set_method(transformer, "bf16")
        wan.set_method(other, "nvfp4")
        a, b = forward(transformer, x, t, e), forward(other, x, t, e)
        wan.uninstall_attention(transformer)
        ref = forward(transformer, x, t, e)
    assert torch.equal(a, ref) and not torch.equal(a, b)
    assert wan.get_processor(transformer) is None and wan.get_processor(other).method == "nvfp4"


def test_training_with_gradient_checkpointing(transformer):
    """Gradient checkpointing re-runs attention in the backward: the counts double and the
    gradients match a run without checkpointing (the forward is deterministic)."""
    x, t, e = inputs()
    proc = wan.install_attention(transformer, "attnqat")
    transformer.train()
    forward(transformer, x, t, e).square().mean().backward()
    plain = {n: p.grad.clone() for n, p in transformer.named_parameters() if p.grad is not None}
    transformer.zero_grad(set_to_none=True)
    proc.reset_stats()
    transformer.enable_gradient_checkpointing()
    forward(transformer, x, t, e).square().mean().backward()
    assert proc.stats()["calls"]["self"] == 2 * LAYERS  # forward + recomputation
    for n, p in transformer.named_parameters():
        if n in plain:
            assert torch.isfinite(p.grad).all()
            assert torch.allclose(p.grad, plain[n], rtol=1e-4, atol=1e-6), n


def test_an_ablation_reaches_the_attnqat_calls_only(transformer):
    """With ablation p_unquantized the self-attention (attnqat) calls take dV from P itself: the
    value projection's gradient changes, the query's does not (dQ is Attn-QAT's either way)."""
    x, t, e = inputs()
    transformer.train()
    grads = {}
    for ablation in (None, "p_unquantized"):
        proc = wan.install_attention(transformer, "attnqat", timing=False, ablation=ablation)
        assert proc.ablation == ablation
        transformer.zero_grad(set_to_none=True)
        forward(transformer, x, t, e).square().mean().backward()
        grads[ablation] = {n: p.grad.clone() for n, p in transformer.named_parameters()
                           if p.grad is not None}
    last = f"blocks.{LAYERS - 1}.attn1"
    assert not torch.equal(grads[None][f"{last}.to_v.weight"], grads["p_unquantized"][f"{last}.to_v.weight"])
    assert torch.equal(grads[None][f"{last}.to_q.weight"], grads["p_unquantized"][f"{last}.to_q.weight"])
    assert "ablation='p_unquantized'" in repr(proc)
    with pytest.raises(ValueError, match="unknown Attn-QAT ablation"):
        wan.install_attention(transformer, "attnqat", ablation="d_from_x")


def test_processor_rejects_bad_settings(transformer):
    with pytest.raises(ValueError, match="unknown attention method"):
        wan.set_method(transformer, "fp8")
    with pytest.raises(ValueError, match="fp4 scope"):
        wan.install_attention(transformer, "nvfp4", fp4_scope="cross")


def test_resolve_device():
    assert wan.resolve_device("cpu") == torch.device("cpu")
    assert wan.resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="unknown device"):
        wan.resolve_device("tpu9")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            wan.resolve_device("cuda")


def test_model_info(tmp_path):
    info = wan.model_info()
    assert info.kind == "tiny-wan" and info.defaults["height"] == 128 and info.defaults["frames"] == 33
    assert info.qat_transformer == TINY_QAT_DIR.resolve()
    with pytest.raises(wan.ModelLoadError, match="model folder not found"):
        wan.model_info(tmp_path / "missing")
    with pytest.raises(wan.ModelLoadError, match="model_index.json is missing"):
        wan.model_info(tmp_path)
    hub = wan.model_info("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")  # nothing fetched yet
    assert hub.path is None and hub.defaults["height"] == 480 and hub.defaults["frames"] == 81
    # Wan's own negative prompt for Wan; none for the tiny model (its text encoder never saw it)
    assert hub.defaults["negative_prompt"] == wan.WAN_NEGATIVE_PROMPT and info.defaults["negative_prompt"] == ""
    assert wan.default_shift(480, 832) == 3.0 and wan.default_shift(720, 1280) == 5.0


@pytest.fixture(scope="module")
def models():
    return wan.load_models(qat_transformer="auto", device="cpu")


def test_load_models_dtypes_and_shared_components(models):
    pipe = models.pipe
    from diffusers import WanPipeline

    native, _ = wan.resolve_dtype("auto", "cpu")
    assert isinstance(pipe, WanPipeline)
    assert models.dtype == native and models.dtype_reason
    assert pipe.transformer.dtype == native
    assert pipe.transformer.blocks[0].attn1.to_q.weight.dtype == native
    assert pipe.transformer.scale_shift_table.dtype == torch.float32  # kept fp32 as diffusers does
    assert pipe.vae.dtype == torch.float32
    assert pipe.text_encoder.dtype == native
    qat = models.qat_transformer
    assert qat is not None and qat is not pipe.transformer
    assert qat.blocks[0].attn1.to_q.weight.dtype == native
    assert models.transformer_for("attnqat") is qat and models.transformer_for("sage3") is pipe.transformer
    assert models.qat_info["scheme"] == "diffusers"
    # the shipped Attn-QAT weights (docs/repro.md) are fine-tuned, not a copy of the base
    assert models.qat_info["identical_to_base"] is False and models.qat_info["fine_tuned"] is True
    assert models.qat_info["label"] == wan.QAT_LABEL_FINE_TUNED
    assert models.qat_info["note"].startswith("Attn-QAT fine-tuned")
    assert "path" not in models.qat_info  # API clients take a dict with "path" for a file


def test_explicit_dtypes_are_loaded_as_asked():
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        m = wan.load_models(device="cpu", dtype=name)
        assert m.dtype == dtype and m.dtype_reason == "asked for"
        assert m.pipe.transformer.dtype == dtype and m.pipe.text_encoder.dtype == dtype
        assert m.pipe.vae.dtype == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        wan.resolve_dtype("float16", "cpu")


def _cpu(monkeypatch, capability: str, bf16: bool, amx: bool = False):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)


def test_dtype_follows_what_the_cpu_runs_natively(monkeypatch):
    _cpu(monkeypatch, "AVX2", bf16=False)                    # e.g. an AVX2-only EPYC
    dtype, why = wan.resolve_dtype("auto", "cpu")
    assert dtype == torch.float32 and "no BF16 instructions" in why
    _cpu(monkeypatch, "AVX512", bf16=True)                   # AVX512-BF16
    assert wan.resolve_dtype("auto", "cpu")[0] == torch.bfloat16
    _cpu(monkeypatch, "AVX512", bf16=False, amx=True)        # AMX
    assert wan.resolve_dtype("auto", "cpu")[0] == torch.bfloat16
    _cpu(monkeypatch, "AVX2", bf16=True)                     # ATEN_CPU_CAPABILITY=avx2
    assert wan.resolve_dtype("auto", "cpu")[0] == torch.float32
    _cpu(monkeypatch, "AVX512", bf16=True)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")         # oneDNN capped below BF16
    dtype, why = wan.resolve_dtype("auto", "cpu")
    assert dtype == torch.float32 and "ONEDNN_MAX_CPU_ISA" in why
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert wan.resolve_dtype("auto", "cpu")[0] == torch.bfloat16
    assert wan.resolve_dtype("float32", "cpu") == (torch.float32, "asked for")


def test_dtype_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert wan.resolve_dtype("auto", "cuda")[0] == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert wan.resolve_dtype("auto", "cuda")[0] == torch.float32


def test_vae_convolutions_run_through_onednn_with_the_same_result(models):
    from attnqat.generate import decode

    vae = models.pipe.vae
    convs = [m for m in vae.modules() if isinstance(m, torch.nn.Conv3d)]
    assert convs and all("_conv_forward" in vars(m) for m in convs)  # every one rerouted
    conv = convs[len(convs) // 2]
    x = torch.randn(1, conv.in_channels, 3, 18, 18)
    with torch.no_grad():
        fast = conv._conv_forward(x, conv.weight, conv.bias)
        slow = torch.nn.Conv3d._conv_forward(conv, x, conv.weight, conv.bias)
    assert fast.shape == slow.shape and torch.allclose(fast, slow, rtol=1e-4, atol=1e-5)
    assert torch.equal(conv._conv_forward(x, conv.weight, conv.bias).detach(), slow)  # autograd:
    # PyTorch's own path
    z = torch.randn(1, 16, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    frames_fast = decode(models, z)
    saved = {m: vars(m).pop("_conv_forward") for m in convs}
    try:
        frames_slow = decode(models, z)
    finally:
        for m, f in saved.items():
            m._conv_forward = f
    diff = np.abs(frames_fast.astype(int) - frames_slow.astype(int))
    assert frames_fast.shape == frames_slow.shape == (9, 64, 64, 3)
    assert diff.max() <= 1 and diff.mean() < 0.01  # summation order only


def test_a_fine_tuned_qat_checkpoint_is_labelled_so(tmp_path, models):
    from safetensors.torch import save_file

    sd = {k: v.clone() for k, v in models.pipe.transformer.state_dict().items()}
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "copy.safetensors"))
    m = wan.load_models(qat_transformer=tmp_path / "copy.safetensors", device="cpu")
    assert m.qat_info["identical_to_base"] is True and m.qat_info["fine_tuned"] is False
    assert m.qat_info["label"] == wan.QAT_LABEL_BASE_COPY
    assert "identical to the base" in m.qat_info["note"]
    key = next(k for k in sd if k.endswith("attn1.to_q.weight"))
    sd[key] = sd[key] + 0.01
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "tuned.safetensors"))
    m = wan.load_models(qat_transformer=tmp_path / "tuned.safetensors", device="cpu")
    assert m.qat_info["fine_tuned"] is True and m.qat_info["identical_to_base"] is False
    assert m.qat_info["label"] == wan.QAT_LABEL_FINE_TUNED


def test_corrupted_model_file_gives_a_clear_error(tmp_path):
    bad = tmp_path / "tiny"
    shutil.copytree(TINY_MODEL_DIR, bad)
    f = bad / "transformer" / "diffusion_pytorch_model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(wan.ModelLoadError, match="could not load the Wan pipeline"):
        wan.load_pipeline(bad, device="cpu")
