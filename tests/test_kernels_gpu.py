"""Triton kernels at real sizes on a CUDA GPU (``pytest -m gpu``), against the PyTorch reference of
the same method running on the GPU. Wan 2.1 1.3B 480p self-attention: B=1, S=32,760, H=12, D=128."""

import math
import warnings

import pytest
import torch

import attnqat
from attnqat import reference as ref
from attnqat.metrics import rel_error

import qkv_data
from qkv_data import bhsd

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = 1e-2
WAN = dict(B=1, S=32760, H=12, D=128)


def make_qkv(B, Sq, Skv, H, D, outliers=False, seed=0, dtype=torch.bfloat16):
    return qkv_data.make_qkv(B, Sq, Skv, H, D, outliers, seed, dtype, device="cuda")


@pytest.mark.parametrize("outliers", [False, True], ids=["randn", "outliers"])
def test_quantize_wan_shape_bit_identical(outliers):
    from attnqat.kernels import quantize as kq

    q, _, v = make_qkv(1, WAN["S"], 16, WAN["H"], WAN["D"], outliers=outliers, seed=1)
    q[0, 5, 3, 7] = float("nan")
    q[0, 77, 1, 100] = float("inf")
    for x, dim in ((q, -1), (v, 1), (q, 1)):
        want = attnqat.quantize_nvfp4(x, dim)
        got = kq.quantize_nvfp4(x, dim)
        assert torch.equal(got.codes, want.codes)
        assert torch.equal(got.scales.view(torch.uint8), want.scales.view(torch.uint8))
        fake = kq.fake_quantize_nvfp4(x, dim)
        assert torch.equal(torch.nan_to_num(fake, 0.0), torch.nan_to_num(attnqat.fake_quantize_nvfp4(x, dim), 0.0))


def _rows(S):
    """Query rows compared against the reference: the first two 128-query blocks and the ragged
    last block (sage3's query smoothing is per 128-query block, so blocks are kept whole)."""
    last = (S - 1) // 128 * 128
    return [slice(0, 256), slice(last, S)]


@pytest.mark.parametrize("method", ["nvfp4", "sage3"])
@pytest.mark.parametrize("outliers", [False, True], ids=["randn", "outliers"])
def test_inference_forward_wan_shape(method, outliers):
    B, S, H, D = WAN.values()
    q, k, v = make_qkv(B, S, S, H, D, outliers=outliers, seed=2)
    with torch.no_grad():
        out = attnqat.attention(q, k, v, method=method, backend="triton")
    assert torch.isfinite(out.float()).all()
    for rows in _rows(S):
        want = ref.fp4_forward(bhsd(q[:, rows]), bhsd(k), bhsd(v), D ** -0.5, method).o.transpose(1, 2)
        assert rel_error(out[:, rows], want) < TOL


def test_cross_attention_wan_shape():
    q, k, v = make_qkv(1, 32760, 512, 12, 128, seed=3)
    for method in ("nvfp4", "sage3"):
        with torch.no_grad():
            out = attnqat.attention(q, k, v, method=method, backend="triton")
        want = ref.fp4_forward(bhsd(q[:, :512]), bhsd(k), bhsd(v), 128 ** -0.5, method).o.transpose(1, 2)
        assert rel_error(out[:, :512], want) < TOL


@pytest.mark.parametrize("method", ["attnqat", "dropin"])
@pytest.mark.parametrize("shape", [dict(Sq=4100, Skv=4100, D=128), dict(Sq=2000, Skv=3001, D=64),
                                   dict(Sq=32760, Skv=32760, D=128)], ids=["4100", "2000x3001d64", "wan-h2"])
@pytest.mark.parametrize("outliers", [False, True], ids=["randn", "outliers"])
def test_training_gradients(method, shape, outliers):
    if shape["Sq"] == 32760 and outliers:
        pytest.skip("one Wan-length case per method is enough")
    q, k, v = make_qkv(1, shape["Sq"], shape["Skv"], 2, shape["D"], outliers=outliers, seed=4)
    do = torch.randn_like(q)
    res = {}
    for backend in ("triton", "torch"):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = attnqat.attention(qq, kk, vv, method=method, backend=backend)
        out.backward(do)
        res[backend] = (out, qq.grad, kk.grad, vv.grad)
        del qq, kk, vv
    for name, a, b in zip(("o", "dq", "dk", "dv"), res["triton"], res["torch"]):
        assert torch.isfinite(a.float()).all(), name
        assert rel_error(a, b) < TOL, name


def test_packed_formulations_wan_shape():
    from attnqat import kernels

    B, S, H, D = WAN.values()
    q, k, v = make_qkv(B, S, S, H, D, seed=5)
    want = ref.fp4_forward(bhsd(q[:, :256]), bhsd(k), bhsd(v), D ** -0.5, "nvfp4").o.transpose(1, 2)
    for f in (1, 2) if torch.cuda.get_device_capability()[0] >= 10 else (1,):
        with torch.no_grad():
            out = kernels.triton_attention(q, k, v, method="nvfp4", formulation=f)
        assert rel_error(out[:, :256], want) < TOL, f"formulation {f}"


@pytest.mark.parametrize("method", ["nvfp4", "attnqat"])
def test_auto_falls_back_to_the_same_method_with_one_warning(method):
    # head_dim 96 has no kernel: auto must run the PyTorch reference of the SAME method
    q, k, v = make_qkv(1, 300, 300, 2, 96, seed=6)
    attnqat.attention.__globals__["_warned"].clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            a = attnqat.attention(q, k, v, method=method, backend="auto")
            attnqat.attention(q, k, v, method=method, backend="auto")
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "head_dim 96" in msgs[0] and method in msgs[0]
    with torch.no_grad():
        assert torch.equal(a, attnqat.attention(q, k, v, method=method, backend="torch"))
    with pytest.raises(RuntimeError, match="backend='triton' cannot run"):
        attnqat.attention(q, k, v, method=method, backend="triton")


def test_auto_uses_the_kernels_when_supported_and_views_work():
    base = torch.randn(1, 2, 1000, 128, device="cuda", dtype=torch.float16)
    q = base.transpose(1, 2)
    with torch.no_grad():
        a = attnqat.attention(q, q, q, method="nvfp4", backend="auto")
        b = attnqat.attention(q, q, q, method="nvfp4", backend="triton")
        c = attnqat.attention(q, q, q, method="nvfp4", backend="torch")
    assert torch.equal(a, b)
    assert rel_error(a, c) < TOL
    assert math.isfinite(rel_error(a, c))
