"""``sagebwd`` kernels at real sizes on a CUDA GPU (``pytest -m gpu``), against the PyTorch reference
(attnqat/sagebwd.py) running on the same GPU. Wan 2.1 1.3B 480p self-attention: B=1, S=32,760,
H=12, D=128; cross-attention 32,760 queries × 512 keys."""

import pytest
import torch

from attnqat import sagebwd as sb
from attnqat.metrics import rel_error

import qkv_data

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

S = 32760


def make_qkv(B, Sq, Skv, H, D, outliers=False, seed=0):
    return qkv_data.make_qkv(B, Sq, Skv, H, D, outliers, seed, torch.bfloat16, device="cuda")


@pytest.mark.parametrize("outliers", [False, True], ids=["randn", "outliers"])
def test_wan_forward_quantization_bit_identical_and_output_close(outliers):
    from attnqat.kernels import sagebwd as ks

    q, k, v = make_qkv(1, S, S, 12, 128, outliers=outliers, seed=1)
    o, st = ks.forward(q, k, v, 128 ** -0.5, training=True)
    fwd = sb.forward(q, k, v, 128 ** -0.5)
    qt = fwd.quant
    assert torch.equal(st["q8"], qt.q8) and torch.equal(st["q8t"], qt.q8.transpose(2, 3))
    assert torch.equal(st["k8"], qt.k8) and torch.equal(st["k8t"], qt.k8.transpose(2, 3))
    assert torch.equal(st["v8t"], qt.v8.transpose(2, 3))
    for name in ("sq", "sk", "sv", "kmean"):
        assert torch.equal(st[name], getattr(qt, name)), name
    err = rel_error(sb._bhsd(o), fwd.o)
    assert err < 1e-3, err
    assert (st["lse2"][:, :, :S] - fwd.lse2).abs().max() < 1e-3


def test_t_bit_identical_on_the_gpu():
    from attnqat.kernels import sagebwd as ks

    q, k, v = make_qkv(2, 1000, 1500, 3, 128, outliers=True, seed=2)
    _, st = ks.forward(q, k, v, 0.09, training=True, store_t=True)
    qt = sb.quantize_qkv(q, k, v)
    Sqp, Skp = qt.q8.shape[2], qt.k8.shape[2]
    t = torch.cat([sb._t_tile(qt.q8.float(), sb._row_scales(qt, 0, Sqp), qt, k0, k0 + 128, 1500, 0.09 * sb.LOG2E)
                   for k0 in range(0, Skp, 128)], -1)
    assert torch.equal(st["t"], t)


@pytest.mark.parametrize("schedule", ["triton", "gluon"])
@pytest.mark.parametrize("case", ["self-randn", "self-outliers", "cross-randn"])
def test_wan_length_backward_close_to_reference(case, schedule):
    from attnqat.kernels import sagebwd as ks

    if schedule == "gluon":
        _gluon_or_skip()

    Skv = 512 if case.startswith("cross") else S
    H = 12 if case.startswith("cross") else 2
    q, k, v = make_qkv(1, S, Skv, H, 128, outliers=case.endswith("outliers"), seed=3)
    do = make_qkv(1, S, S, H, 128, seed=4)[0]
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    o = ks.sagebwd_attention(qr, kr, vr, config={"schedule": schedule})
    o.backward(do)
    # dQ from the stored dS codes against the recomputing kernel: on the GPU the two orientations of
    # dP = dO·Vᵀ accumulate in other orders, so a dS code can move by one where dP − D cancels
    o32, st = ks.forward(q, k, v, 128 ** -0.5, training=True)
    recomputed = ks.backward(q, k, v, o32, do, st, 128 ** -0.5, config={"schedule": "triton"})
    from_stored = ks.backward(q, k, v, o32, do, st, 128 ** -0.5, config={"schedule": "triton", "dq": {"stored": True}})
    for got, want, tol in zip(from_stored, recomputed, (5e-3, 1e-5, 1e-5)):
        assert rel_error(got, want) < tol
    fwd = sb.forward(q, k, v, 128 ** -0.5)
    assert rel_error(o, sb._bhsd(fwd.o)) < 1e-2
    rq, rk, rv = sb.backward(fwd, q, k, v, do, 128 ** -0.5)
    for got, want, name in ((qr.grad, rq, "dq"), (kr.grad, rk, "dk"), (vr.grad, rv, "dv")):
        assert torch.isfinite(got).all(), name
        err = rel_error(got, want)
        assert err < 1e-2, (name, err)


def _gluon_or_skip():
    from attnqat.kernels.gluon_fwd import gluon_unavailable

    why = gluon_unavailable()
    if why is not None:
        pytest.skip(why)


@pytest.mark.parametrize("case", ["wan-randn", "wan-outliers", "cross", "ragged-d64", "no-correction"])
def test_gluon_backward_matches_the_triton_one(case):
    """The Gluon launches compute the Triton kernels' quantities from the same codes and scales. dV
    and dK bit for bit (on an H200 in every call since 2026-11-28; a D = rowsum(dO ∘ O) computed by a
    differently compiled quantization pass moved 0.03 % of dK's elements once, which this catches);
    dQ not: its exponentials and fused multiply-adds are compiled apart, so a dS code can move by
    one (dQ 1e-4 to 2e-4 from the Triton kernel's, 99.6 % of its elements bit for bit)."""
    from attnqat.kernels import sagebwd as ks

    _gluon_or_skip()
    B, Sq, Skv, H, D, outliers = {
        "wan-randn": (1, S, S, 2, 128, False), "wan-outliers": (1, S, S, 2, 128, True),
        "cross": (1, S, 512, 4, 128, False), "ragged-d64": (2, 1000, 1500, 3, 64, True),
        "no-correction": (1, 4000, 3000, 2, 128, True)}[case]
    q, k, v = make_qkv(B, Sq, Skv, H, D, outliers=outliers, seed=5)
    do = make_qkv(B, Sq, Sq, H, D, seed=6)[0]
    scale = D ** -0.5
    o32, st = ks.forward(q, k, v, scale, training=True)
    corr = case != "no-correction"
    tri = ks.backward(q, k, v, o32, do, st, scale, config={"schedule": "triton"}, smoothing_correction=corr)
    glu = ks.backward(q, k, v, o32, do, st, scale, config={"schedule": "gluon"}, smoothing_correction=corr)
    for got, want, name, tol in zip(glu, tri, ("dq", "dk", "dv"), (1e-3, 5e-3, 1e-3)):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.isfinite(got).all(), name
        err = rel_error(got, want)
        same = (got == want).float().mean().item()
        print(f"{case} {name}: rel error {err:.2e}, bit-identical share {same:.4f}")
        assert err < tol, (name, err)
        assert name == "dq" or same == 1.0, (name, same)


@pytest.mark.parametrize("case", ["wan", "ragged-d64-chunks"])
def test_gluon_stored_ds_dq_matches_the_recomputing_one(case):
    """dQ from the dS codes, scales and row sums the dK launch stores (``"dq": {"stored": True}``)
    against the dQ launch that recomputes them (the same blocks, compiled apart: a code can move by
    one, as against the Triton kernels; on an H200, 2026-11-28, 1.4e-4 at the Wan length); dK and dV
    do not change. ``chunk_bytes`` small enough for three chunks of two (batch, head) pairs in the
    ragged case."""
    from attnqat.kernels import sagebwd as ks

    _gluon_or_skip()
    B, Sq, Skv, H, D, chunk = {"wan": (1, S, S, 2, 128, None),
                               "ragged-d64-chunks": (2, 1000, 1500, 3, 64, 2 * 1024 * 1536)}[case]
    q, k, v = make_qkv(B, Sq, Skv, H, D, outliers=True, seed=7)
    do = make_qkv(B, Sq, Sq, H, D, seed=8)[0]
    scale = D ** -0.5
    o32, st = ks.forward(q, k, v, scale, training=True)
    base = ks.backward(q, k, v, o32, do, st, scale, config={"schedule": "gluon", "gluon": {"dq": {"stored": False}}})
    dq_cfg = {"stored": True} | ({"chunk_bytes": chunk} if chunk else {})
    stored = ks.backward(q, k, v, o32, do, st, scale, config={"schedule": "gluon", "gluon": {"dq": dq_cfg}})
    for got, want, name in zip(stored, base, ("dq", "dk", "dv")):
        err = rel_error(got, want)
        print(f"{case} {name}: rel error {err:.2e}, bit-identical share {(got == want).float().mean().item():.4f}")
        assert err < (1e-3 if name == "dq" else 1e-7), (name, err)


@pytest.mark.parametrize("case", ["wan-randn", "wan-outliers", "cross", "ragged-d64", "short-keys", "inference"])
def test_gluon_forward_matches_the_triton_one(case):
    """The Gluon forward (kernels/gluon_sagebwd_fwd.py) computes the Triton kernel's O and LSE₂ from
    the same codes and scales, operation for operation; its exponentials and fused multiply-adds are
    compiled apart and its row sums may visit the keys in another order, so a P̃ code can move by one.
    ``short-keys``: fewer keys than one tile (the masked prologue); ``inference``: no LSE₂, O in
    bfloat16."""
    from attnqat.kernels import sagebwd as ks

    _gluon_or_skip()
    B, Sq, Skv, H, D, outliers = {
        "wan-randn": (1, S, S, 2, 128, False), "wan-outliers": (1, S, S, 2, 128, True),
        "cross": (1, S, 512, 4, 128, False), "ragged-d64": (2, 1000, 1500, 3, 64, True),
        "short-keys": (2, 700, 77, 3, 128, True), "inference": (1, 5000, 4100, 2, 128, True)}[case]
    q, k, v = make_qkv(B, Sq, Skv, H, D, outliers=outliers, seed=9)
    training = case != "inference"
    scale = D ** -0.5
    from attnqat.kernels import receipt

    o_t, st_t = ks.forward(q, k, v, scale, training=training, config={"schedule": "triton"})
    with receipt.collect() as ran:   # the default on Hopper, noted for the app's kernel label
        o_g, st_g = ks.forward(q, k, v, scale, training=training)
    assert ran == ["gluon"]
    assert o_g.dtype == o_t.dtype == (torch.float32 if training else q.dtype) and o_g.shape == o_t.shape
    assert torch.isfinite(o_g).all()
    err = rel_error(o_g.float(), o_t.float())
    same = (o_g == o_t).float().mean().item()
    print(f"{case} O: rel error {err:.2e}, bit-identical share {same:.4f}")
    assert err < 1e-3, err
    if training:
        lse_t, lse_g = st_t["lse2"], st_g["lse2"]
        assert torch.equal(lse_g[:, :, Sq:], lse_t[:, :, Sq:])   # padded queries: +inf
        diff = (lse_g[:, :, :Sq] - lse_t[:, :, :Sq]).abs().max().item()
        print(f"{case} LSE2: max difference {diff:.2e}")
        assert diff < 1e-4, diff
    else:
        assert st_g["lse2"] is None
