"""The attention methods as operators registered with PyTorch (attnqat/ops.py): fake
implementations for tracing, a registered backward, and torch.compile of a Wan block that gives the
eager result."""

from __future__ import annotations

import pytest
import torch

from attnqat import attention
from attnqat.tiny import TINY_MODEL_DIR
from attnqat.wan import install_attention


def test_the_ops_are_registered_and_their_fakes_give_the_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.empty(2, 40, 3, 16), torch.empty(2, 24, 3, 16), torch.empty(2, 24, 3, 16)
        assert torch.ops.attnqat.fp4_attention(q, k, v, 0.25, "sage3").shape == (2, 40, 3, 16)
        out = torch.ops.attnqat.fp4_train_forward(q, k, v, 0.25, "attnqat", None)
        assert [tuple(t.shape) for t in out] == [(2, 40, 3, 16), (2, 3, 40, 16), (2, 3, 24, 16), (2, 3, 24, 16),
                                                 (2, 3, 40, 16), (2, 3, 40), (2, 3, 40)]
    for name in ("fp4_attention", "fp4_train_forward"):
        torch.library.opcheck(getattr(torch.ops.attnqat, name).default,
                              (torch.randn(1, 20, 2, 16), torch.randn(1, 20, 2, 16), torch.randn(1, 20, 2, 16), 0.25,
                               *(("nvfp4",) if name == "fp4_attention" else ("attnqat", None))),
                              test_utils=("test_schema", "test_faketensor"))


def test_the_registered_backward_is_the_methods(monkeypatch):
    q, k, v = (torch.randn(1, 24, 2, 16, requires_grad=True) for _ in range(3))
    out = attention(q, k, v, method="attnqat", backend="torch")
    out.square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def _tiny_block_and_inputs():
    from diffusers import WanTransformer3DModel

    tr = WanTransformer3DModel.from_pretrained(TINY_MODEL_DIR, subfolder="transformer", torch_dtype=torch.float32)
    tr.eval()
    seen = {}
    tr.blocks[0].register_forward_pre_hook(lambda mod, args: seen.setdefault("args", args))
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, tr.config.in_channels, 2, 16, 16, generator=g)
    text = torch.randn(1, 8, tr.config.text_dim, generator=g)
    with torch.no_grad():
        tr(hidden_states=latents, timestep=torch.tensor([500]), encoder_hidden_states=text, return_dict=False)
    return tr, seen["args"]


@pytest.mark.slow   # torch.compile (inductor, C++ on the CPU): about 10 s per method on a quiet 2-core machine
@pytest.mark.parametrize("method", ["nvfp4", "attnqat"])
def test_a_compiled_wan_block_with_4bit_attention_gives_the_eager_result(method):
    tr, args = _tiny_block_and_inputs()
    install_attention(tr, method, fp4_scope="all", backend="torch", timing=False)
    block = tr.blocks[0]
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    with torch.no_grad():
        eager = block(*args)
        got = compiled(*args)
    assert eager.shape == args[0].shape
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method,ablation", [("attnqat", None), ("attnqat", "d_from_o"), ("dropin", None)])
def test_one_head_float32_outputs_alias_nothing(method, ablation):
    """With one head the transposed output is contiguous already: the op must still copy it."""
    q, k, v = (torch.randn(1, 20, 1, 16, requires_grad=True) for _ in range(3))
    out = attention(q, k, v, method=method, backend="torch", ablation=ablation)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
