"""Triton kernels against the PyTorch reference of the same method (DESIGN.md §3.4).

Small shapes: on a machine without CUDA these run through the Triton interpreter (tests/conftest.py
sets TRITON_INTERPRET=1), on a GPU machine on the GPU. Real sizes are in test_kernels_gpu.py.

Codes and scales: bit-identical. Outputs and gradients: ‖Δ‖/‖ref‖ < 1e-2 with bfloat16/float16
outputs. With float32 outputs under the interpreter (no MMA reordering, IEEE exp) almost every row of
the nvfp4 and sage3 forwards agrees with the reference to float32 rounding: the P quantizer makes
the reference's decisions except where P̃/s lies within a few float32 units of a rounding threshold
(the kernel scales by an approximate reciprocal).
"""

import math

import pytest
import torch

import attnqat
from attnqat import reference as ref
from attnqat.metrics import rel_error

import qkv_data
from qkv_data import bhsd

kernels = pytest.importorskip("attnqat.kernels")
from attnqat.kernels import attention_fwd as F  # noqa: E402
from attnqat.kernels import quantize as kq  # noqa: E402
from attnqat.kernels import sage3 as ks  # noqa: E402

# On the CPU every kernel here runs through the Triton interpreter (kept out of `make test-fast`).
pytestmark = pytest.mark.interpreter

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERP = kernels.interpreting()
TOL = 1e-2


def make_qkv(B=1, Sq=40, Skv=None, H=2, D=64, outliers=False, seed=0, dtype=torch.bfloat16):
    q, k, v = qkv_data.make_qkv(B, Sq, Skv or Sq, H, D, outliers, seed)
    return q.to(DEV, dtype), k.to(DEV, dtype), v.to(DEV, dtype)


def ref_forward(q, k, v, method, need_o_prime=False):
    return ref.fp4_forward(bhsd(q), bhsd(k), bhsd(v), q.shape[-1] ** -0.5, method, need_o_prime=need_o_prime)


# ---------------------------------------------------------------------------------------------
# Quantize/pack kernel: bit identity
# ---------------------------------------------------------------------------------------------

def assert_same_quantization(x, dim):
    want = attnqat.quantize_nvfp4(x, dim)
    got, values = kq.quantize_nvfp4_both(x, dim)
    assert got.codes.shape == want.codes.shape and got.scales.shape == want.scales.shape
    assert got.codes.dtype == torch.uint8 and got.scales.dtype == torch.float8_e4m3fn
    assert torch.equal(got.codes, want.codes)
    assert torch.equal(got.scales.view(torch.uint8), want.scales.view(torch.uint8))
    assert got.dim == want.dim and got.shape == want.shape
    fake = attnqat.fake_quantize_nvfp4(x, dim)
    assert values.shape == x.shape and values.dtype == x.dtype
    assert torch.equal(torch.isnan(values), torch.isnan(fake))
    assert torch.equal(torch.nan_to_num(values, 0.0), torch.nan_to_num(fake, 0.0))
    # the dequantized values carry the sign of zero that the codes carry (-0 for code 0b1000)
    finite = ~torch.isnan(fake)
    assert torch.equal(torch.signbit(values[finite]), torch.signbit(fake[finite]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_random_every_axis_bit_identical(dtype):
    g = torch.Generator().manual_seed(1)
    # log-normal magnitudes over a wide range: many scales, subnormal and saturated ones included
    x = torch.randn(2, 37, 3, 64, generator=g) * torch.exp(3 * torch.randn(2, 37, 3, 64, generator=g))
    x = x.clamp(-6e4, 6e4).to(DEV, dtype)
    for dim in range(4):
        assert_same_quantization(x, dim)


def test_quantize_v_along_tokens_from_strided_views():
    g = torch.Generator().manual_seed(2)
    store = torch.randn(2, 3, 50, 64, generator=g).to(DEV, torch.bfloat16)   # (B, H, S, D) storage
    v = store.transpose(1, 2)                                                 # (B, S, H, D) view
    assert not v.is_contiguous()
    assert_same_quantization(v, 1)     # V along tokens, read in place
    assert_same_quantization(v, -1)    # and along head_dim
    sliced = torch.randn(1, 40, 4, 128, generator=g).to(DEV, torch.float16)[:, 3:33, 1:3, ::2]
    assert_same_quantization(sliced, 1)
    assert_same_quantization(sliced, 3)


def test_quantize_edge_cases_bit_identical():
    x = torch.randn(8, 48) * 1e-3
    x[0, 3] = float("nan")                       # NaN block → NaN scale, codes 0
    x[1, 20] = float("inf")
    x[1, 40] = -float("inf")
    x[2, :16] = 0.0                              # zero block
    x[3, 5] = -1e-9                              # small negative → code 0b1000
    x[3, 6] = -0.0                               # -0.0 → code 0b1000 too
    x[4] = torch.randn(48) * 1e6                 # saturating scales (amax/6 > 448)
    x[5] = torch.randn(48) * 2.0 ** -12          # E4M3-subnormal scales
    x[6] = torch.randn(48) * 2.0 ** -20          # scales that round to zero
    base = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x[7, :16] = torch.cat([base, -base])         # every E2M1 tie, block scale exactly 1
    x[7, 16:32] = torch.cat([base, -base]) * 3.0
    x[7, 32:48] = 448 * 6 * torch.linspace(-1, 1, 16)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(DEV, dt)
        assert_same_quantization(xd, -1)
        assert_same_quantization(xd, 0)


def test_quantize_scale_rounding_ties():
    """amax/6 exactly halfway between two E4M3 values, normal and subnormal: ties go to even."""
    e4m3 = torch.tensor([2.0 ** -9 * i for i in range(1, 8)] + [2.0 ** e * (1 + m / 8) for e in range(-6, 9)
                                                                  for m in range(8)])
    e4m3 = e4m3[e4m3 <= 448]
    mids = (e4m3[:-1] + e4m3[1:]) / 2
    x = torch.zeros(len(mids), 16)
    x[:, 0] = mids * 6
    x[:, 1] = -mids * 4.9
    assert_same_quantization(x.to(DEV), -1)


def test_quantize_ragged_lengths_pad_with_zero_codes():
    g = torch.Generator().manual_seed(3)
    for L in (1, 15, 17, 33, 130):
        x = torch.randn(3, L, generator=g).to(DEV)
        assert_same_quantization(x, -1)
        assert_same_quantization(x.t(), 0)


@pytest.mark.parametrize("outliers", [False, True], ids=["randn", "outliers"])
def test_quantize_with_a_shift_bit_identical_in_both_row_layouts(outliers):
    """sage3's smoothing inside the quantize kernel: x − shift (float32, one shift row per group of
    tokens) quantized along head_dim is the reference's fake quantization of the float32
    difference, bit for bit, whether a program's rows are the heads of a token (the GPU's layout)
    or the tokens of a head (the interpreter's default)."""
    q, k, _ = make_qkv(B=2, Sq=70, H=3, D=64, outliers=outliers, seed=31)
    g = torch.Generator().manual_seed(32)
    for x, group in ((q, 16), (k, k.shape[1])):       # query-block means, the key mean
        n = -(-x.shape[1] // group)
        shift = (torch.randn(2, n, 3, 64, generator=g) * (4.0 if outliers else 0.5)).to(DEV)
        full = shift.repeat_interleave(group, dim=1)[:, :x.shape[1]]
        want = attnqat.fake_quantize_nvfp4(x.float() - full, -1).to(x.dtype)
        for rows in ("tokens", "heads"):
            _, _, _, got = kq._launch(x, -1, packed=False, dequant_dtype=x.dtype, shift=shift,
                                      shift_group=group, shift_rows=rows)
            assert got.dtype == x.dtype and torch.equal(got, want), rows
    with pytest.raises(ValueError, match="shift_rows"):
        kq._launch(q, -1, packed=False, dequant_dtype=q.dtype, shift=shift, shift_group=1, shift_rows="x")


def test_quantize_rejects_what_it_cannot_take():
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        kq.quantize_nvfp4(torch.zeros(4, 16, dtype=torch.float64, device=DEV))
    with pytest.raises(ValueError, match="1- to 4-dimensional"):
        kq.quantize_nvfp4(torch.zeros(1, 2, 2, 2, 16, device=DEV))
    with pytest.raises(ValueError, match="empty"):
        kq.quantize_nvfp4(torch.zeros(0, 16, device=DEV))


# ---------------------------------------------------------------------------------------------
# Forward kernels against the reference of the same method
# ---------------------------------------------------------------------------------------------

SHAPES = [
    dict(Sq=128, Skv=128),   # exact tiles
    dict(Sq=200, Skv=300),   # ragged last query tile, ragged last key tile and 16-key block
    dict(Sq=130, Skv=7),     # cross-attention, a single partial 16-key block
    dict(Sq=33, Skv=260),    # cross-attention, longer keys
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s['Sq']}x{s['Skv']}")
@pytest.mark.parametrize("outliers", [False, True], ids=["randn", "outliers"])
@pytest.mark.parametrize("method", ["nvfp4", "sage3"])
def test_inference_forward_matches_reference(method, shape, outliers):
    q, k, v = make_qkv(H=2, D=64, outliers=outliers, seed=shape["Sq"] + shape["Skv"], **shape)
    want = ref_forward(q, k, v, method).o.transpose(1, 2)
    # float32 output isolates the kernel's arithmetic from the final rounding
    if method == "nvfp4":
        qf, kf, vf = kq.fake_quantize_nvfp4(q, -1), kq.fake_quantize_nvfp4(k, -1), kq.fake_quantize_nvfp4(v, 1)
        o32 = F.attention_forward(qf, kf, vf, sm_scale=q.shape[-1] ** -0.5, p_mode=F.P_NVFP4,
                                  out_dtype=torch.float32)[0]
    else:
        qf, kf, vf, bias = ks.sage3_prepare(q, k, v)
        o32 = F.attention_forward(qf, kf, vf, sm_scale=q.shape[-1] ** -0.5, p_mode=F.P_SAGE3, bias=bias,
                                  out_dtype=torch.float32)[0]
    assert rel_error(o32, want) < TOL
    if INTERP:
        # identical P decisions in ≥ 98% of rows (sage3's q̄·K_sᵀ is float32-accurate to ~2^-17)
        row_err = (o32 - want).norm(dim=-1) / want.norm(dim=-1)
        assert (row_err > (1e-5 if method == "nvfp4" else 1e-4)).float().mean() < 0.02
    with torch.no_grad():
        out = kernels.triton_attention(q, k, v, method=method)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_error(out, want) < TOL


def test_warp_specialized_key_loop_computes_the_same():
    """WARP_SPEC (a benchmark variant) changes the schedule, not the arithmetic: O, O', the row
    statistics equal the default launch's bit for bit, and O matches the reference. On a GPU whose
    Triton cannot warp-specialize the loop the test says so and skips."""
    q, k, v = make_qkv(Sq=150, Skv=290, H=2, D=64, seed=21)
    qf, kf, vf = kq.fake_quantize_nvfp4(q, -1), kq.fake_quantize_nvfp4(k, -1), kq.fake_quantize_nvfp4(v, 1)
    kw = dict(sm_scale=q.shape[-1] ** -0.5, p_mode=F.P_NVFP4, need_o2=True, store_stats=True)
    base = F.attention_forward(qf, kf, vf, **kw)
    try:
        ws = F.attention_forward(qf, kf, vf, **kw, config=dict(WARP_SPEC=True))
    except Exception as exc:  # a compile error on a GPU is the measured answer, not a failure
        if INTERP:
            raise
        pytest.skip(f"Triton cannot warp-specialize the key loop here: {type(exc).__name__}: {exc}")
    for a, b in zip(base, ws):
        assert torch.equal(a, b)
    assert rel_error(ws[0], ref_forward(q, k, v, "nvfp4").o.transpose(1, 2)) < TOL


def test_attnqat_forward_outputs_o_prime_lse_and_row_max():
    q, k, v = make_qkv(Sq=150, Skv=290, H=2, D=64, seed=4)
    qf, kf, vf = kq.fake_quantize_nvfp4(q, -1), kq.fake_quantize_nvfp4(k, -1), kq.fake_quantize_nvfp4(v, 1)
    o, o2, lse2, m2 = F.attention_forward(qf, kf, vf, sm_scale=0.125, p_mode=F.P_NVFP4, need_o2=True,
                                          store_stats=True, out_dtype=torch.float32)
    want = ref_forward(q, k, v, "nvfp4", need_o_prime=True)
    assert rel_error(o, want.o.transpose(1, 2)) < (1e-5 if INTERP else TOL)
    assert rel_error(o2, want.o_prime.transpose(1, 2)) < TOL   # P̃ enters the MMA in bfloat16
    ln2 = math.log(2.0)
    assert torch.allclose(lse2 * ln2, want.lse, atol=1e-4, rtol=1e-5)
    assert torch.allclose(m2 * ln2, want.row_max, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("D,dtype", [(128, torch.float16), (128, torch.bfloat16), (64, torch.float16)])
def test_head_dims_and_dtypes(D, dtype):
    q, k, v = make_qkv(Sq=70, Skv=140, H=1, D=D, seed=5, dtype=dtype)
    for method in ("nvfp4", "sage3"):
        with torch.no_grad():
            out = kernels.triton_attention(q, k, v, method=method)
        assert out.dtype == dtype
        assert rel_error(out, ref_forward(q, k, v, method).o.transpose(1, 2)) < TOL


def test_non_contiguous_views_and_batches():
    g = torch.Generator().manual_seed(6)
    store = torch.randn(3, 2, 2, 150, 64, generator=g).to(DEV, torch.bfloat16)  # (q|k|v, B, H, S, D)
    q, k, v = (store[i].transpose(1, 2) for i in range(3))                      # (B, S, H, D) views
    assert not q.is_contiguous()
    for method in ("nvfp4", "sage3"):
        with torch.no_grad():
            a = kernels.triton_attention(q, k, v, method=method)
            b = kernels.triton_attention(q.contiguous(), k.contiguous(), v.contiguous(), method=method)
        assert torch.equal(a, b)


def test_softmax_scale_is_used():
    q, k, v = make_qkv(Sq=64, Skv=64, H=1, seed=7)
    with torch.no_grad():
        out = kernels.triton_attention(q, k, v, method="nvfp4", softmax_scale=0.05)
    want = ref.fp4_forward(bhsd(q), bhsd(k), bhsd(v), 0.05, "nvfp4").o.transpose(1, 2)
    assert rel_error(out, want) < TOL


def test_dot_scaled_formulation_needs_fp4_tensor_cores():
    q, k, v = make_qkv(Sq=64, Skv=64, H=1, D=64, seed=8)
    if DEV == "cuda" and torch.cuda.get_device_capability()[0] >= 10:
        with torch.no_grad():
            out = kernels.triton_attention(q, k, v, method="nvfp4", formulation=2)
        assert rel_error(out, ref_forward(q, k, v, "nvfp4").o.transpose(1, 2)) < TOL
    else:
        with pytest.raises(ValueError, match="FP4 tensor cores"):
            kernels.triton_attention(q, k, v, method="nvfp4", formulation=2)


def test_packed_formulation_dequantized_in_registers():
    """Formulation 1 reads packed codes and E4M3 scales and dequantizes tiles in registers."""
    q, k, v = make_qkv(Sq=130, Skv=200, H=1, D=64, seed=9)
    want = ref_forward(q, k, v, "nvfp4").o.transpose(1, 2)
    with torch.no_grad():
        out = kernels.triton_attention(q, k, v, method="nvfp4", formulation=1)
    assert rel_error(out, want) < TOL


# ---------------------------------------------------------------------------------------------
# Training methods: gradients against the reference backward
# ---------------------------------------------------------------------------------------------

GRAD_CASES = [dict(Sq=128, Skv=128, D=64), dict(Sq=150, Skv=290, D=64), dict(Sq=37, Skv=131, D=128)]


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: f"{c['Sq']}x{c['Skv']}d{c['D']}")
@pytest.mark.parametrize("outliers", [False, True], ids=["randn", "outliers"])
@pytest.mark.parametrize("method", ["attnqat", "dropin"])
def test_training_forward_and_gradients_match_reference(method, case, outliers):
    q, k, v = make_qkv(H=2, outliers=outliers, seed=11, **case)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(12)).to(DEV, q.dtype)
    grads = {}
    for backend in ("triton", "torch"):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        if backend == "triton":
            out = kernels.triton_attention(qq, kk, vv, method=method)
        else:
            out = attnqat.attention(qq, kk, vv, method=method, backend="torch")
        out.backward(do)
        grads[backend] = (out, qq.grad, kk.grad, vv.grad)
    for name, got, want in zip(("o", "dq", "dk", "dv"), grads["triton"], grads["torch"]):
        assert got.dtype == q.dtype and got.shape == want.shape
        assert rel_error(got, want) < TOL, name


@pytest.mark.parametrize("quant_p", [True, False], ids=["attnqat", "dropin"])
def test_dkdv_tile_orientations_compute_the_same(quant_p):
    """The dK/dV kernel's two orientations — S [queries, keys] with dKᵀ, dVᵀ accumulated (attnqat's
    default) and Sᵀ [keys, queries] (dropin's) — quantize the same P̃ blocks with the same
    arithmetic: their gradients agree to the float32 summation order (on an H100 bit for bit),
    ragged query and key tiles included."""
    from attnqat.kernels.attention_bwd import attention_backward

    q, k, v = make_qkv(Sq=150, Skv=200, H=2, D=64, outliers=True, seed=14)
    qf, kf, vf = kq.fake_quantize_nvfp4(q, -1), kq.fake_quantize_nvfp4(k, -1), kq.fake_quantize_nvfp4(v, 1)
    _, o2, lse2, m2 = F.attention_forward(qf, kf, vf, sm_scale=0.125, need_o2=True, store_stats=True)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(15)).to(DEV, q.dtype)
    ops = (qf, kf, vf, o2, do, lse2, m2 if quant_p else None)
    grads = {nat: attention_backward(*ops, sm_scale=0.125, quant_p=quant_p, config=dict(dkdv=dict(
        NATURAL=nat, BM=64, BN=64 if nat else 128, num_warps=4 if nat else 8, num_stages=1)))
        for nat in (True, False)}
    assert torch.equal(grads[True][0], grads[False][0]), "dQ comes from the same dQ kernel"
    for name, a, b in zip(("dk", "dv"), grads[True][1:], grads[False][1:]):
        assert rel_error(a, b) < 1e-4, name


def test_attnqat_and_dropin_backwards_differ():
    q, k, v = make_qkv(Sq=128, Skv=128, H=1, seed=13)
    do = torch.randn_like(q)
    dv = {}
    for method in ("attnqat", "dropin"):
        vv = v.clone().requires_grad_(True)
        kernels.triton_attention(q, k, vv, method=method).backward(do)
        dv[method] = vv.grad
    assert rel_error(dv["attnqat"], dv["dropin"]) > 1e-3


@pytest.mark.parametrize("method", ["attnqat", "dropin"])
def test_the_training_op_is_registered_with_a_fake_that_matches(method):
    """torch.compile meets ``attnqat::triton_fp4_train_forward``: its schema and its fake
    implementation (shapes, dtypes, strides of all seven outputs) agree with the kernels' outputs."""
    q, k, v = make_qkv(Sq=40, Skv=24, H=2, seed=5)
    torch.library.opcheck(torch.ops.attnqat.triton_fp4_train_forward.default,
                          (q, k, v, 0.125, method, None, None), test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------
# Boundaries: what the kernels refuse, and how
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad,match", [
    (dict(D=96), "head_dim 96 is not supported"),
    (dict(dtype=torch.float32), "bfloat16 or float16"),
    (dict(method="bf16"), "no Triton kernel"),
    (dict(method="fp8"), "no Triton kernel"),
])
def test_unsupported_inputs_give_a_clear_error(bad, match):
    q, k, v = make_qkv(Sq=20, Skv=20, H=1, D=bad.get("D", 64), dtype=bad.get("dtype", torch.bfloat16))
    method = bad.get("method", "nvfp4")
    why = kernels.triton_unsupported(q, k, v, method)
    assert why is not None
    if DEV == "cuda":
        assert match in why
    with pytest.raises(ValueError, match=match):
        kernels.triton_attention(q, k, v, method=method)


def test_cpu_tensors_are_refused_by_the_public_contract():
    q, k, v = (t.cpu() for t in make_qkv(Sq=20, H=1))
    assert "CUDA" in kernels.triton_unsupported(q, k, v, "nvfp4")


def test_inference_methods_refuse_gradients():
    q, k, v = make_qkv(Sq=20, H=1)
    q.requires_grad_(True)
    for method in ("nvfp4", "sage3"):
        with pytest.raises(RuntimeError, match="inference-only"):
            kernels.triton_attention(q, k, v, method=method)


def test_kernels_quantize_p_against_the_reference_key_tile():
    assert ref.KV_TILE == 128 and F.KV_TILE == 128 and ks.SAGE_Q_BLOCK == 128
