"""PyTorch reference of the attention methods against independent formulations: a materialized
(non-online) nvfp4 forward, autograd through surrogate graphs for the Attn-QAT and drop-in
backwards, and exact attention where no quantizer runs."""

import math

import pytest
import torch

from attnqat import attention, fake_quantize_nvfp4
from attnqat import reference as ref
from attnqat.metrics import compare, rel_error

import qkv_data
from qkv_data import bhsd


def make_qkv(B=1, Sq=40, Skv=None, H=2, D=32, outliers=False, seed=0, dtype=torch.float32):
    return qkv_data.make_qkv(B, Sq, Skv or Sq, H, D, outliers, seed, dtype)


def materialized_nvfp4(q, k, v, scale):
    """nvfp4 forward without the online recurrence: S in full, the running maximum after each
    128-key tile from cummax over tile maxima, each tile's P̃ quantized against it, then rescaled
    to the final maximum and normalized by the unquantized sum."""
    qf = fake_quantize_nvfp4(bhsd(q), -1)
    kf = fake_quantize_nvfp4(bhsd(k), -1)
    vf = fake_quantize_nvfp4(bhsd(v), -2)
    s = qf @ kf.transpose(-1, -2) * scale
    Skv = s.shape[-1]
    tiles = list(range(0, Skv, ref.KV_TILE))
    tile_max = torch.stack([s[..., t:t + ref.KV_TILE].amax(-1) for t in tiles], -1)
    running = torch.cummax(tile_max, dim=-1).values
    m_final = running[..., -1:]
    num = 0
    den = 0
    for j, t in enumerate(tiles):
        p = torch.exp(s[..., t:t + ref.KV_TILE] - running[..., j:j + 1])
        w = torch.exp(running[..., j:j + 1] - m_final)
        num = num + w * (fake_quantize_nvfp4(p, -1) @ vf[..., t:t + ref.KV_TILE, :])
        den = den + w * p.sum(-1, keepdim=True)
    return (num / den).transpose(1, 2)


@pytest.mark.parametrize("Sq,Skv", [(40, 40), (200, 300), (33, 129), (130, 7)])
@pytest.mark.parametrize("outliers", [False, True])
def test_nvfp4_forward_equals_materialized_formulation(Sq, Skv, outliers):
    q, k, v = make_qkv(Sq=Sq, Skv=Skv, outliers=outliers, seed=Sq + Skv)
    out = attention(q, k, v, method="nvfp4", backend="torch")
    assert rel_error(out, materialized_nvfp4(q, k, v, 1 / math.sqrt(q.shape[-1]))) < 1e-5


@pytest.mark.parametrize("method", ["nvfp4", "sage3"])
@pytest.mark.parametrize("Sq,Skv", [(40, 40), (260, 300), (5, 129)])
def test_unquantized_algorithm_is_exact_attention(method, Sq, Skv):
    """Tiling, online softmax and (for sage3) the Q/K smoothing with the q̄·Kᵀ correction leave
    exact attention unchanged when no quantizer runs."""
    q, k, v = make_qkv(Sq=Sq, Skv=Skv, outliers=True, seed=7)
    scale = 0.125
    f = ref.fp4_forward(bhsd(q), bhsd(k), bhsd(v), scale, method, quantize=False)
    o, lse = f.o, f.lse
    exact = ref.exact_attention(bhsd(q), bhsd(k), bhsd(v), scale)
    assert rel_error(o, exact) < 1e-5
    s = bhsd(q) @ bhsd(k).transpose(-1, -2) * scale
    if method == "nvfp4":
        assert torch.allclose(lse, torch.logsumexp(s, -1), atol=1e-4)


def test_bf16_method_is_sdpa_and_exact():
    q, k, v = make_qkv(Sq=50, Skv=70, seed=2)
    out = attention(q, k, v, method="bf16")
    exact = ref.exact_attention(bhsd(q), bhsd(k), bhsd(v), q.shape[-1] ** -0.5).transpose(1, 2)
    assert rel_error(out, exact) < 1e-5


def test_chunking_does_not_change_results(monkeypatch):
    q, k, v = make_qkv(B=2, Sq=300, Skv=260, H=2, D=16, seed=3)
    full = {m: attention(q, k, v, method=m, backend="torch") for m in ("nvfp4", "sage3")}
    monkeypatch.setattr(ref, "_FWD_BUDGET", 128 * 2 * 2 * 128)  # forces 128-query chunks
    for m, o in full.items():
        assert torch.equal(attention(q, k, v, method=m, backend="torch"), o)


# ---------------------------------------------------------------------------------------------
# Gradients: explicit backward formulas vs autograd through surrogate graphs
# ---------------------------------------------------------------------------------------------

def ste(x, fx):
    """Straight-through: value fx, gradient of the identity to x."""
    return x + (fx - x).detach()


def attnqat_surrogate_grads(q, k, v, do, scale):
    """Autograd through a materialized surrogate whose VALUE is the FP4 output and whose gradient
    reaches V through Pᶠ (P fake-quantized relative to its row maximum, then normalized) and S
    through the unquantized P, with D = rowsum(dO ∘ O') and O' = P Vᶠ."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    qf = ste(bhsd(q), fake_quantize_nvfp4(bhsd(q).detach(), -1))
    kf = ste(bhsd(k), fake_quantize_nvfp4(bhsd(k).detach(), -1))
    vf = ste(bhsd(v), fake_quantize_nvfp4(bhsd(v).detach(), -2))
    s = qf @ kf.transpose(-1, -2) * scale
    p = torch.softmax(s, dim=-1)
    e = torch.exp(s.detach() - s.detach().amax(-1, keepdim=True))
    pf = fake_quantize_nvfp4(e, -1) / e.sum(-1, keepdim=True)
    through_pf = pf @ vf
    through_p = p @ vf.detach()
    value = materialized_nvfp4(q.detach(), k.detach(), v.detach(), scale).transpose(1, 2)
    out = through_pf + (through_p - through_p.detach()) + (value - through_pf).detach()
    (out * bhsd(do)).sum().backward()
    return out.transpose(1, 2), q.grad, k.grad, v.grad


def dropin_surrogate_grads(q, k, v, do, scale):
    """The ordinary FlashAttention backward fed with the FP4 O and LSE, via autograd of
    L = Σ dO ∘ (P V) − Σ_rows D·rowsum(P), P = exp(S·scale − LSE_fp4), D = rowsum(dO ∘ O_fp4)."""
    lse = ref.fp4_forward(bhsd(q), bhsd(k), bhsd(v), scale, "nvfp4").lse
    o_fp4 = materialized_nvfp4(q, k, v, scale).transpose(1, 2)
    d_row = (bhsd(do) * o_fp4).sum(-1, keepdim=True)
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    p = torch.exp(bhsd(q) @ bhsd(k).transpose(-1, -2) * scale - lse[..., None])
    loss = (bhsd(do) * (p @ bhsd(v))).sum() - (d_row * p.sum(-1, keepdim=True)).sum()
    loss.backward()
    return q.grad, k.grad, v.grad


CASES = [dict(Sq=48, Skv=48), dict(Sq=150, Skv=290), dict(Sq=37, Skv=131, D=20)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("outliers", [False, True])
def test_attnqat_backward_equals_surrogate_autograd(case, outliers):
    q, k, v = make_qkv(outliers=outliers, seed=11, **case)
    do = torch.randn_like(q)
    scale = q.shape[-1] ** -0.5
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = attention(qq, kk, vv, method="attnqat", backend="torch")
    out.backward(do)
    s_out, s_dq, s_dk, s_dv = attnqat_surrogate_grads(q, k, v, do, scale)
    assert rel_error(out, s_out) < 1e-5
    for ours, theirs in ((qq.grad, s_dq), (kk.grad, s_dk), (vv.grad, s_dv)):
        assert rel_error(ours, theirs) < 1e-4


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("outliers", [False, True])
def test_dropin_backward_equals_flash_backward_fed_fp4_o_and_lse(case, outliers):
    q, k, v = make_qkv(outliers=outliers, seed=12, **case)
    do = torch.randn_like(q)
    scale = q.shape[-1] ** -0.5
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = attention(qq, kk, vv, method="dropin", backend="torch")
    assert torch.equal(out.detach(), attention(q, k, v, method="nvfp4", backend="torch"))
    out.backward(do)
    s_dq, s_dk, s_dv = dropin_surrogate_grads(q, k, v, do, scale)
    for ours, theirs in ((qq.grad, s_dq), (kk.grad, s_dk), (vv.grad, s_dv)):
        assert rel_error(ours, theirs) < 1e-4


def _materialized_attnqat_parts(q, k, v, do, scale):
    """Qᶠ, Kᶠ, Vᶠ, P (normalized, from Qᶠ Kᶠᵀ), the 4-bit O and O' = P Vᶠ, (B, H, S, D) layout."""
    qf, kf, vf = (fake_quantize_nvfp4(bhsd(t), d) for t, d in ((q, -1), (k, -1), (v, -2)))
    p = torch.softmax(qf @ kf.transpose(-1, -2) * scale, dim=-1)
    return qf, kf, vf, p, bhsd(materialized_nvfp4(q, k, v, scale)), p @ vf


@pytest.mark.parametrize("outliers", [False, True])
def test_ablation_d_from_o_takes_d_from_the_4bit_output(outliers):
    """Principle 2 off: D = rowsum(dO ∘ O) with the 4-bit O; dV is Attn-QAT's (D does not enter it)."""
    q, k, v = make_qkv(Sq=150, Skv=290, outliers=outliers, seed=21)
    do = torch.randn_like(q)
    scale = q.shape[-1] ** -0.5
    grads = {}
    for ablation in (None, "d_from_o"):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = attention(qq, kk, vv, method="attnqat", backend="torch", ablation=ablation)
        assert torch.equal(out.detach(), attention(q, k, v, method="nvfp4", backend="torch"))
        out.backward(do)
        grads[ablation] = (qq.grad, kk.grad, vv.grad)
    qf, kf, vf, p, o4, _ = _materialized_attnqat_parts(q, k, v, do, scale)
    dob = bhsd(do)
    ds = p * (dob @ vf.transpose(-1, -2) - (dob * o4).sum(-1, keepdim=True))
    assert rel_error(grads["d_from_o"][0], (ds @ kf * scale).transpose(1, 2)) < 1e-4
    assert rel_error(grads["d_from_o"][1], (ds.transpose(-1, -2) @ qf * scale).transpose(1, 2)) < 1e-4
    assert torch.equal(grads["d_from_o"][2], grads[None][2])
    assert rel_error(grads["d_from_o"][0], grads[None][0]) > 1e-3


@pytest.mark.parametrize("outliers", [False, True])
def test_ablation_p_unquantized_takes_dv_from_p_itself(outliers):
    """Principle 1 off: dV = Pᵀ dO with P not re-quantized; dQ, dK are Attn-QAT's."""
    q, k, v = make_qkv(Sq=150, Skv=290, outliers=outliers, seed=22)
    do = torch.randn_like(q)
    scale = q.shape[-1] ** -0.5
    grads = {}
    for ablation in (None, "p_unquantized"):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        attention(qq, kk, vv, method="attnqat", backend="torch", ablation=ablation).backward(do)
        grads[ablation] = (qq.grad, kk.grad, vv.grad)
    _, _, _, p, _, _ = _materialized_attnqat_parts(q, k, v, do, scale)
    want_dv = (p.transpose(-1, -2) @ bhsd(do)).transpose(1, 2)
    assert rel_error(grads["p_unquantized"][2], want_dv) < 1e-4
    assert rel_error(grads[None][2], want_dv) > 1e-3   # the full method re-quantizes P
    for i in (0, 1):
        assert torch.equal(grads["p_unquantized"][i], grads[None][i])


def test_ablations_are_checked():
    q, k, v = make_qkv(Sq=20, seed=1)
    with pytest.raises(ValueError, match="unknown Attn-QAT ablation"):
        attention(q, k, v, method="attnqat", ablation="d_from_q")
    with pytest.raises(ValueError, match="applies to method 'attnqat' only"):
        attention(q, k, v, method="dropin", ablation="d_from_o")
    with pytest.raises(RuntimeError, match="PyTorch reference only"):
        attention(q, k, v, method="attnqat", backend="triton", ablation="p_unquantized")


def test_attnqat_and_dropin_gradients_differ_and_bf16_inputs_work():
    q, k, v = make_qkv(Sq=64, Skv=64, seed=13, dtype=torch.bfloat16)
    do = torch.randn_like(q)
    grads = {}
    for m in ("attnqat", "dropin", "bf16"):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        o = attention(qq, kk, vv, method=m)
        assert o.dtype == torch.bfloat16
        o.backward(do)
        assert qq.grad.dtype == torch.bfloat16 and torch.isfinite(qq.grad.float()).all()
        grads[m] = (qq.grad, kk.grad, vv.grad)
    # Attn-QAT's dV goes through the quantized P: it differs from the drop-in's unquantized dV
    assert rel_error(grads["attnqat"][2], grads["dropin"][2]) > 1e-3
    # and both approximate the exact gradient
    for m in ("attnqat", "dropin"):
        assert compare(grads[m][2], grads["bf16"][2])["cosine"] > 0.9


@pytest.mark.parametrize("S", [512, 2048])
def test_backward_p_quantizer_tracks_forward_and_normalized_one_underflows(S):
    """Backs the measured figures and the decision in attnqat/reference.py's docstring."""
    q, k, v = make_qkv(B=1, Sq=S, H=2, D=64, seed=21)
    r = ref.forward_backward_p_mismatch(bhsd(q), bhsd(k), bhsd(v))
    assert 0 < r["row_max"] < 0.75 * r["fwd_quant_error"]
    assert r["normalized"] > 0.3 and r["zeros_normalized"] > 0.5  # E4M3 scale underflow
    q, k, v = make_qkv(B=1, Sq=S, H=2, D=64, outliers=True, seed=21)
    r = ref.forward_backward_p_mismatch(bhsd(q), bhsd(k), bhsd(v))
    assert 0 < r["row_max"] < 0.3 * r["fwd_quant_error"]


def test_inference_methods_refuse_gradients_loudly():
    q, k, v = make_qkv(seed=1)
    q.requires_grad_(True)
    for m in ("nvfp4", "sage3"):
        with pytest.raises(RuntimeError, match="inference-only"):
            attention(q, k, v, method=m)
        with torch.no_grad():
            assert attention(q, k, v, method=m).shape == q.shape


# ---------------------------------------------------------------------------------------------
# sage3 vs nvfp4
# ---------------------------------------------------------------------------------------------

def test_sage3_beats_nvfp4_on_outlier_heavy_k():
    q, k, v = make_qkv(B=1, Sq=256, Skv=256, H=4, D=64, outliers=True, seed=5)
    exact = attention(q, k, v, method="bf16")
    nv = attention(q, k, v, method="nvfp4")
    sg = attention(q, k, v, method="sage3")
    assert rel_error(sg, nv) > 1e-2  # they really differ
    assert rel_error(sg, exact) < rel_error(nv, exact)
    assert compare(sg, exact)["cosine"] > compare(nv, exact)["cosine"]


def test_sage3_p_quantizer_uses_unrounded_scale_then_rounds():
    # one block: max maps to 2688/… ; level-2 scale amax/6 unrounded for the division
    p = torch.zeros(16)
    p[0] = 1.0
    p[1] = 0.3
    out = ref.quantize_p_sage3(p)
    s_unrounded = 2688.0 / 6  # 448: exactly representable
    assert out[0].item() == pytest.approx(6 * 448 / 2688)
    code1 = round(0.3 * 2688 / s_unrounded * 2) / 2  # 1.8 → 2.0 on the 0.5 grid
    assert out[1].item() == pytest.approx(2.0 * 448 / 2688)
    assert code1 == 2.0
    # a block whose unrounded scale is not E4M3: the max element still gets code 6
    p2 = torch.zeros(16)
    p2[0] = 0.1234
    out2 = ref.quantize_p_sage3(p2)
    s = 0.1234 * 2688 / 6
    from attnqat.nvfp4 import e4m3_round
    assert out2[0].item() == pytest.approx(6 * e4m3_round(torch.tensor(s)).item() / 2688, rel=1e-6)
