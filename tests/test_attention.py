"""The public entry point: input validation, dtypes, shapes, backends."""

import pytest
import torch

import attnqat
from attnqat import attention


def qkv(B=1, Sq=20, Skv=None, H=2, D=16, dtype=torch.float32):
    Skv = Skv or Sq
    return (torch.randn(B, Sq, H, D, dtype=dtype), torch.randn(B, Skv, H, D, dtype=dtype),
            torch.randn(B, Skv, H, D, dtype=dtype))


@pytest.mark.parametrize("method", attnqat.METHODS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_method_and_dtype_shape_and_cross_attention(method, dtype):
    q, k, v = qkv(Sq=24, Skv=40, dtype=dtype)
    with torch.no_grad():
        out = attention(q, k, v, method=method)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out.float()).all()


def test_fp4_methods_differ_from_bf16():
    q, k, v = qkv(Sq=64)
    exact = attention(q, k, v)
    for m in attnqat.FP4_METHODS:
        with torch.no_grad():
            assert not torch.allclose(attention(q, k, v, method=m), exact, atol=1e-4)


def test_non_contiguous_views_are_accepted():
    base = torch.randn(1, 2, 30, 16)
    q = base.transpose(1, 2)  # (1, 30, 2, 16) non-contiguous
    assert not q.is_contiguous()
    with torch.no_grad():
        assert torch.equal(attention(q, q, q, method="nvfp4"), attention(q.contiguous(), q.contiguous(),
                                                                         q.contiguous(), method="nvfp4"))


def test_softmax_scale_is_used():
    q, k, v = qkv()
    a = attention(q, k, v, softmax_scale=0.05)
    b = attention(q * 0.05 * 4, k, v)  # D=16 → default scale 1/4
    assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("bad,match", [
    (dict(q=torch.randn(2, 3, 4)), "4 dimensions"),
    (dict(k=torch.randn(1, 20, 3, 16)), "number of heads"),
    (dict(v=torch.randn(1, 20, 2, 8)), "head_dim"),
    (dict(v=torch.randn(1, 21, 2, 16)), "same sequence length"),
    (dict(k=torch.randn(2, 20, 2, 16)), "batch sizes"),
    (dict(q=torch.randint(0, 3, (1, 20, 2, 16))), "floating"),
    (dict(q=torch.randn(1, 20, 2, 16, dtype=torch.float64)), "unsupported dtype"),
    (dict(q=torch.randn(1, 20, 2, 16, dtype=torch.bfloat16)), "one dtype"),
    (dict(method="fp8"), "unknown attention method"),
    (dict(backend="cuda"), "unknown backend"),
    (dict(softmax_scale=-1.0), "positive finite"),
    (dict(q=[1, 2]), "torch.Tensor"),
    (dict(q=torch.randn(1, 0, 2, 16)), "empty"),
])
def test_bad_input_errors_name_what_was_expected(bad, match):
    q, k, v = qkv()
    args = dict(q=q, k=k, v=v, method="bf16", softmax_scale=None, backend="auto")
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        attention(**args)


def test_triton_backend_on_cpu_is_a_clear_error_not_a_silent_fallback():
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="backend='triton' cannot run"):
        attention(q, k, v, method="nvfp4", backend="triton")
