"""The Gluon kernels for Hopper: the ``nvfp4``/``sage3`` forward (kernels/gluon_fwd.py), the
``attnqat`` training forward (kernels/gluon_fwd_qat.py) and the backward's dK/dV and dQ kernels
(kernels/gluon_bwd.py).

CPU: the kernel compiled for sm_90 (no GPU needed) and the machine-code facts that make it worth
having over the Triton kernel — tensor-core work issued asynchronously with the PV product in
flight during the softmax, no spills, register reallocation between the partitions, the P
quantizer's rounding present, fewer instructions per key tile than the Triton kernel's loop.
GPU (``pytest -m gpu``, Hopper only): outputs against the Triton forward on the same pre-quantized
operands and against the PyTorch reference of the method, with test_kernels_gpu.py's tolerance;
the attnqat forward's O, O', LSE₂, m₂ and the dK/dV and dQ kernels' gradients against the Triton
kernels', bit for bit.
"""

import pytest
import torch
from attnqat.kernels import gluon_bwd as GB
from attnqat.kernels import gluon_fwd as G
from attnqat.kernels import gluon_fwd_qat as GQ

from attnqat import reference as ref

TOL = 1e-2   # test_kernels_gpu.py's tolerance for the Triton forward against the reference


# ----------------------------------------------------------------------------------------------
# CPU: machine code for sm_90
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def report(sass90):
    """The kernel compiled for sm_90 in a child process without the Triton interpreter that the
    other CPU tests use: ``attnqat bench kernels --sass 90``, run once for this module and
    test_kernels_sass.py (tests/conftest.py)."""
    if G.GLUON_IMPORT_ERROR is not None:
        pytest.skip(f"no Gluon in this triton: {G.GLUON_IMPORT_ERROR}")
    res, data = sass90
    assert "gluon nvfp4 D=128 consumer 1:" in res.stdout
    assert "gluon sage3 D=128 consumer 1:" in res.stdout
    assert "gluon attnqat D=128 consumer 1:" in res.stdout
    assert "gluon dK/dV D=128 consumer 1:" in res.stdout
    assert "gluon dQ D=128 consumer 1:" in res.stdout
    return {int(d): f for d, f in data["gluon"].items()}


@pytest.fixture(params=[(128, "nvfp4"), (64, "nvfp4"), (128, "sage3"), (64, "sage3")],
                ids=lambda p: f"{p[1]}-d{p[0]}")
def facts(request, report):
    D, method = request.param
    f = report[D] if method == "nvfp4" else report[D]["sage3"]
    assert "error" not in f, f"the Gluon {method} forward does not compile for sm_90 under triton {report[D]['triton']}"
    return D, method, f


@pytest.mark.subprocess
def test_two_consumer_loops_issue_both_products_asynchronously(facts):
    D, method, f = facts
    loops = f["consumer_loops"]
    assert len(loops) == 2, "one key loop per consumer warpgroup"
    for lp in loops:
        # S_j (D/16 k-steps; sage3: one more, its correction row) and PV_{j-1} (128 keys / 16) per
        # tile, issued as asynchronous wgmma (sage3: S in two calls)
        extra = method == "sage3"
        assert lp["hgmma"] == D // 16 + extra + 128 // 16
        assert lp["warpgroup_arrive"] == 2 + extra
        # two waits per tile (PV_{j-2} at the top, S_j before the softmax): ptxas did not serialize
        # the pipeline (a serialized one waits after every HGMMA)
        assert lp["waits"] == 2
        # PV_{j-1} stays in flight while the softmax and the quantizer of tile j run
        assert lp["last_hgmma"] < lp["first_ex2"]
        assert lp["waits_after_first_ex2"] == 0


@pytest.mark.subprocess
def test_no_spills_and_registers_handed_to_the_consumers(facts):
    *_, f = facts
    assert f["spill_instructions"] == 0
    # 3 warpgroups at 168 registers; the producer gives back to 24, the consumers take 240
    assert f["registers"] == G.CONFIG["MAXNREG"]
    assert G.CONFIG["CONSUMER_REGS"] in f["setmaxnreg"] and G.CONFIG["LOADER_REGS"] in f["setmaxnreg"]
    assert f["max_register_index"] < G.CONFIG["CONSUMER_REGS"]


@pytest.mark.subprocess
def test_p_quantizer_is_the_triton_kernels(facts):
    """The E4M3 scale and the E2M1 rounding of 64 scores per thread: 2 FFMA with the E2M1 magic
    constant per score, one exponent mask per score and per block scale, one MUFU.RCP per block
    (sage3's two-level quantizer has the same counts: its reciprocal is of the block maximum)."""
    *_, f = facts
    for lp in f["consumer_loops"]:
        assert lp["e2m1_magic_ffma"] == 128
        assert lp["exponent_mask_lop3"] == 64 + 16
        assert lp["rcp"] == 16


@pytest.mark.subprocess
def test_fewer_instructions_per_key_tile_than_the_triton_kernel(facts):
    """Per full 128-key tile each consumer thread holds the 64 scores a thread of the 8-warp Triton
    kernel holds; the Gluon loop (the mask block is branched over on full tiles) must not be longer
    than the Triton kernel's loop of the same method (sage3: with its correction row) compiled with
    the same Triton for the same head_dim."""
    *_, f = facts
    for lp in f["consumer_loops"]:
        assert lp["mask_block"] > 0
        assert lp["per_full_tile"] < f["triton_loop"]


def _two_consumer_loops(report, D, key, loops, kernel):
    """The compiled kernel's facts and its consumer loops (``loops``: the facts key), asserting that
    it compiled for sm_90 and that each of the two consumer warpgroups has one loop."""
    f = report[D][key]
    assert "error" not in f, f"the Gluon {kernel} does not compile for sm_90: {f.get('error')}"
    assert len(f[loops]) == 2, "one loop per consumer warpgroup"
    return f, f[loops]


@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.subprocess
def test_dkdv_query_loops_keep_the_products_asynchronous(report, D):
    """The dK/dV kernel, one query loop per consumer warpgroup: per 64-query block S_i and dP_i
    (D/16 k-steps each) and dV, dK (4 k-steps of 16 queries each) as asynchronous wgmma with two
    waits (S_i, then dP_i: a loop ptxas serialized waits after every HGMMA); few spill instructions
    in the loop at D = 128, where dK, dV, S and dP fill 192 of the 240 registers (1 and 5 per
    consumer with Triton 3.6's ptxas, 18 and 14 with 3.9's, of ~850 instructions), none at D = 64."""
    f, loops = _two_consumer_loops(report, D, "dkdv", "query_loops", "dK/dV kernel")
    for lp in loops:
        assert lp["hgmma"] == 2 * D // 16 + 8
        assert lp["waits"] == 2
        assert lp["spill_instructions"] <= (24 if D == 128 else 0)
        assert lp["ex2"] >= 32, "32 scores per thread and block"
    assert f["registers"] == GB.CONFIG["MAXNREG"]
    assert GB.CONFIG["CONSUMER_REGS"] in f["setmaxnreg"] and GB.CONFIG["LOADER_REGS"] in f["setmaxnreg"]


@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.subprocess
def test_dq_key_loops_overlap_the_exponentials_with_dp(report, D):
    """The dQ kernel, one key loop per consumer warpgroup: per 64-key block S_j and dP_j (D/16
    k-steps each) and dQ (4 k-steps) as asynchronous wgmma with two waits, the one for dP after the
    first exponential (the exponentials overlap dP), no spills."""
    f, loops = _two_consumer_loops(report, D, "dq", "key_loops", "dQ kernel")
    for lp in loops:
        assert lp["hgmma"] == 2 * D // 16 + 4
        assert lp["waits"] == 2 and lp["waits_after_first_ex2"] == 1
        assert lp["spill_instructions"] == 0
        assert lp["ex2"] >= 32, "32 scores per thread and block"
    assert f["registers"] == GB.DQ_CONFIG["MAXNREG"]


@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.subprocess
def test_attnqat_forward_loops_wait_once_per_tile(report, D):
    """The attnqat forward, one key loop per consumer warpgroup: per tile S_j (D/16 k-steps), PV_{j-1}
    and ΔV_{j-1} (8 each) issued as asynchronous wgmma and waited for with one wait before the
    softmax (a loop ptxas serialized waits after every HGMMA — what a register P̃ᶠ operand did);
    the P quantizer's rounding present; few spill instructions in the loop (O, O' and S take 192 of
    the 240 registers at D = 128: 9 and 3 per consumer with Triton 3.6's ptxas, 30 and 27 with
    3.9's, of ~1,400 per tile; at D = 64 none and 2-3)."""
    f, loops = _two_consumer_loops(report, D, "attnqat", "consumer_loops", "attnqat forward")
    for lp in loops:
        assert lp["hgmma"] == D // 16 + 16
        assert lp["waits"] == 1
        assert lp["last_hgmma"] < lp["first_ex2"] and lp["waits_after_first_ex2"] == 0
        assert lp["e2m1_magic_ffma"] == 128 and lp["rcp"] == 16
        assert lp["spill_instructions"] <= (40 if D == 128 else 8)
    assert f["registers"] == G.CONFIG["MAXNREG"]
    assert G.CONFIG["CONSUMER_REGS"] in f["setmaxnreg"] and G.CONFIG["LOADER_REGS"] in f["setmaxnreg"]


@pytest.mark.parametrize("method", ["nvfp4", "sage3", "attnqat"])
@pytest.mark.subprocess
def test_block_maxima_of_s_first_at_head_dim_128(report, method):
    """At D = 128 the forwards take the row maximum and P̃'s 16-key block maxima from S's block
    maxima (kernels/gluon_fwd.py ``_softmax_tile``): per tile and consumer, one more exponential per
    row and block (2 rows × 8 blocks = 16 MUFU) and fewer maximum operations than the two separate
    reductions the D = 64 build keeps (the softmax's arithmetic does not depend on D)."""
    mufu, fmnmx = {}, {}
    for D in (128, 64):
        f = report[D] if method == "nvfp4" else report[D][method]
        assert "error" not in f, f"the Gluon {method} forward does not compile for sm_90: {f.get('error')}"
        mufu[D] = {lp["mix"]["MUFU"] for lp in f["consumer_loops"]}
        fmnmx[D] = {lp["mix"]["FMNMX"] for lp in f["consumer_loops"]}
        assert len(mufu[D]) == 1 and len(fmnmx[D]) == 1, "both consumers run the same softmax"
    assert mufu[128].pop() == mufu[64].pop() + 16
    assert fmnmx[128].pop() < fmnmx[64].pop()


def test_attnqat_forward_schedule_choice_on_the_cpu():
    """Off Hopper the attnqat forward is the Triton kernel; an explicit "gluon" says why it cannot
    run; at head_dim 64 (where the Gluon kernel measured slower) the default is the Triton kernel."""
    from attnqat import kernels as K

    q = torch.zeros(1, 128, 1, 128, dtype=torch.bfloat16)
    assert GQ.choose_qat_schedule(q, q, q, None, None) == "triton"
    assert GQ.choose_qat_schedule(q[..., :64], q[..., :64], q[..., :64], None, None) == "triton"
    with pytest.raises(ValueError, match="cannot run these inputs: q is on cpu"):
        GQ.choose_qat_schedule(q, q, q, "gluon", None)
    with pytest.raises(ValueError, match="schedule must be one of"):
        GQ.choose_qat_schedule(q, q, q, "cudnn", None)
    with pytest.raises(ValueError, match="schedule must be one of"):
        K.triton_attention(q, q, q, "attnqat", schedule="cudnn")
    with pytest.raises(RuntimeError, match="gluon_attnqat_forward cannot run"):
        GQ.gluon_attnqat_forward(q, q, q, sm_scale=0.125)


def test_dkdv_schedule_choice_on_the_cpu():
    """Off Hopper the dK/dV and dQ kernels are the Triton ones; asking for the Gluon ones says why
    they cannot run; a Triton tile override selects the Triton kernel."""
    from attnqat.kernels.attention_bwd import choose_dkdv_schedule

    q = torch.zeros(1, 128, 1, 64, dtype=torch.bfloat16)
    assert choose_dkdv_schedule(q, q, q, q, None, None) == "triton"
    assert choose_dkdv_schedule(q, q, q, q, None, dict(dkdv=dict(BM=64))) == "triton"
    with pytest.raises(ValueError, match="cannot run these inputs: q must be a 4-D bfloat16 CUDA tensor"):
        choose_dkdv_schedule(q, q, q, q, "gluon", None)
    assert choose_dkdv_schedule(q, q, q, q, None, None, "dq") == "triton"
    with pytest.raises(ValueError, match="Gluon dQ kernel cannot run these inputs"):
        choose_dkdv_schedule(q, q, q, q, "gluon", None, "dq")
    with pytest.raises(RuntimeError, match="gluon_dq cannot run"):
        GB.gluon_dq(q, q, q, q, q, None, None, sm_scale=0.125)
    with pytest.raises(ValueError, match="schedule must be one of"):
        choose_dkdv_schedule(q, q, q, q, "cudnn", None)
    with pytest.raises(RuntimeError, match="gluon_dkdv cannot run"):
        GB.gluon_dkdv(q, q, q, q, q, q, None, None, None, sm_scale=0.125, quant_p=True)


def test_launcher_refuses_without_a_hopper_gpu():
    q = torch.zeros(1, 128, 1, 64, dtype=torch.bfloat16)
    if G.gluon_unavailable() is None:
        pytest.skip("a Hopper GPU is present")
    with pytest.raises(RuntimeError, match="cannot run"):
        G.gluon_attention_forward(q, q, q, sm_scale=0.125)


def test_schedule_choice_on_the_cpu():
    """Without a Hopper GPU the default schedule is the Triton kernel; asking for the Gluon one says
    why it cannot run rather than running the other kernel."""
    from attnqat import kernels as K

    q = torch.zeros(1, 128, 1, 64, dtype=torch.bfloat16)
    assert G.choose_schedule(q, q, q, None, None) == "triton"
    assert G.choose_schedule(q, q, q, "triton", None) == "triton"
    with pytest.raises(ValueError, match="cannot run these inputs: q is on cpu"):
        G.choose_schedule(q, q, q, "gluon", None)
    with pytest.raises(ValueError, match="schedule must be one of"):
        G.choose_schedule(q, q, q, "cudnn", None)
    with pytest.raises(ValueError, match="formulation 0 only"):
        K.nvfp4_forward(q, q, q, 0.125, formulation=1, schedule="gluon")
    with pytest.raises(ValueError, match="schedule must be one of"):   # checked for every formulation
        K.nvfp4_forward(q, q, q, 0.125, formulation=1, schedule="cudnn")


@pytest.mark.interpreter
def test_sage3_schedule_argument():
    """``sage3_forward``'s ``schedule`` has ``nvfp4_forward``'s semantics: an unknown name and a
    "gluon" that cannot run (float16 operands here, on any machine) raise ValueError naming why;
    "triton" and, off Hopper, the default give the Triton kernel's result."""
    import qkv_data
    from attnqat.kernels import sage3 as S3

    dev = "cuda" if torch.cuda.is_available() else "cpu"   # on the CPU: the Triton interpreter
    q, k, v = qkv_data.make_qkv(1, 130, 140, 1, 64, False, 3, torch.bfloat16, device=dev)
    with pytest.raises(ValueError, match="schedule must be one of"):
        S3.sage3_forward(q, k, v, 0.125, schedule="cudnn")
    with pytest.raises(ValueError, match="cannot run these inputs: q is torch.float16"):
        S3.sage3_forward(q.half(), k.half(), v.half(), 0.125, schedule="gluon")
    with torch.no_grad():
        tri = S3.sage3_forward(q, k, v, 0.125, schedule="triton")
        assert torch.equal(S3.sage3_forward(q, k, v, 0.125, config=dict(BM=128)), tri)   # tiles: Triton's
        if not _is_hopper():
            with pytest.raises(ValueError, match="cannot run these inputs"):
                S3.sage3_forward(q, k, v, 0.125, schedule="gluon")
            assert torch.equal(S3.sage3_forward(q, k, v, 0.125), tri)


@pytest.mark.interpreter
@pytest.mark.parametrize("Skv", [140, 77, 256])
def test_sage3_correction_parts_hold_the_float32_row(Skv):
    """The Gluon kernel's form of sage3's correction: per (batch, head, query block) three bf16
    rows hi, mid, lo whose sum is the float32 row the Triton kernel adds (float32's 24 bits in
    3 × 8: exact up to the last part's rounding, under 2^-24 of the value), zeros on the padded keys
    (Skv rounded up to 8: TMA row strides are multiples of 16 bytes)."""
    import qkv_data
    from attnqat.kernels import sage3 as S3

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    B, Sq, H = 2, 200, 3
    q, k, v = qkv_data.make_qkv(B, Sq, Skv, H, 64, True, 11, torch.bfloat16, device=dev)
    *ops, f32 = S3.sage3_prepare(q, k, v)
    *ops_p, parts = S3.sage3_prepare(q, k, v, bias_parts=True)
    for a, b in zip(ops, ops_p):
        assert torch.equal(a, b)
    assert parts.dtype == torch.bfloat16 and parts.is_contiguous()
    assert tuple(parts.shape) == G.bias_parts_shape(B, H, Sq, Skv) == (B * H * 2, 3, -(-Skv // 8) * 8)
    total = parts.double().sum(dim=1)                                  # (B·H·nb, Skv')
    want = f32.double().reshape(B * H * 2, Skv)
    assert (total[:, Skv:] == 0).all()
    err = (total[:, :Skv] - want).abs()
    assert (err <= want.abs() * 2.0 ** -24).all(), f"max error {err.max().item():.3e}"
    assert want.abs().max() > 1.0, "outlier-heavy inputs give a correction far from zero"


def test_launcher_checks_the_method_and_bias():
    """nvfp4 takes no correction; sage3 needs it in the parts form; each mismatch is named in one
    sentence (the check takes CPU tensors: any machine)."""
    from attnqat.kernels.attention_fwd import P_NVFP4, P_SAGE3

    q = torch.zeros(1, 200, 2, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 300, 2, 64, dtype=torch.bfloat16)
    parts = torch.zeros(G.bias_parts_shape(1, 2, 200, 300), dtype=torch.bfloat16)
    assert parts.shape == (4, 3, 304)
    why = G._bias_unsupported
    assert why(q, k, P_NVFP4, None) is None and why(q, k, P_SAGE3, parts) is None
    assert "neither nvfp4 (1) nor sage3 (2)" in why(q, k, 0, None)
    assert "takes no bias" in why(q, k, P_NVFP4, parts)
    assert "needs its correction as bf16 parts" in why(q, k, P_SAGE3, None)
    assert "got torch.float32 (1, 2, 2, 300)" in why(q, k, P_SAGE3, torch.zeros(1, 2, 2, 300))
    assert "must be contiguous" in why(q, k, P_SAGE3, torch.zeros(4, 304, 3, dtype=torch.bfloat16).transpose(1, 2))
    if G.gluon_unavailable() is not None:
        with pytest.raises(RuntimeError, match="cannot run"):
            G.gluon_attention_forward(q, k, k, sm_scale=0.125, p_mode=P_SAGE3, bias=parts)


# ----------------------------------------------------------------------------------------------
# GPU (Hopper): numerics
# ----------------------------------------------------------------------------------------------

def _is_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper (sm_90) GPU")


@pytest.mark.gpu
@needs_hopper
def test_exp2_is_monotone_over_every_float():
    """What the forwards' block maxima rest on (kernels/gluon_fwd.py ``_softmax_tile``: P̃'s block
    maximum taken as exp2 of S's): the exponential the kernels compile to (``ex2.approx.ftz.f32``)
    never decreases from one float32 to the next, over every non-NaN float32 from −∞ to +∞."""
    import triton
    import triton.language as tl

    @triton.jit
    def decreasing_steps(out, TOTAL, NNEG, BLOCK: tl.constexpr):
        # ordered index i → float bits: i < NNEG walks −∞ … −0, then +0 … +∞
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        ok = i + 1 < TOTAL
        b0 = tl.where(i < NNEG, 0xFF800000 - i, i - NNEG)
        b1 = tl.where(i + 1 < NNEG, 0xFF800000 - (i + 1), i + 1 - NNEG)
        y0 = tl.exp2(b0.to(tl.uint32).to(tl.float32, bitcast=True))
        y1 = tl.exp2(b1.to(tl.uint32).to(tl.float32, bitcast=True))
        tl.atomic_add(out, tl.sum((ok & (y1 < y0)).to(tl.int64)))
        tl.atomic_add(out + 1, tl.sum(ok.to(tl.int64)))

    nneg = 0xFF800000 - 0x80000000 + 1          # −∞ … −0
    total = 2 * nneg                               # and +0 … +∞
    res = torch.zeros(2, dtype=torch.int64, device="cuda")
    compiled = decreasing_steps[(triton.cdiv(total, 4096),)](res, total, nneg, BLOCK=4096)
    assert "ex2.approx.ftz.f32" in compiled.asm["ptx"], "not the exponential the Gluon kernels use"
    assert res[1].item() == total - 1, "every neighbouring pair checked"
    assert res[0].item() == 0


def _operands(B, Sq, Skv, H, D, outliers, seed, method="nvfp4"):
    """Random or outlier-heavy bf16 (B, S, H, D) q, k, v on the GPU and the operands the two
    kernels take for ``method``: nvfp4 (Qᶠ, Kᶠ, Vᶠ) for both; sage3 :func:`sage3_prepare`'s
    (Q_sᶠ, K_sᶠ, Vᶠ) with the correction as float32 (Triton) and as bf16 parts (Gluon)."""
    import qkv_data
    from attnqat.kernels.quantize import fake_quantize_nvfp4
    from attnqat.kernels.sage3 import sage3_prepare

    q, k, v = qkv_data.make_qkv(B, Sq, Skv, H, D, outliers, seed, torch.bfloat16, device="cuda")
    if method == "sage3":
        *ops, f32 = sage3_prepare(q, k, v)
        return (q, k, v), (*ops, f32, sage3_prepare(q, k, v, bias_parts=True)[3])
    return (q, k, v), (fake_quantize_nvfp4(q, -1), fake_quantize_nvfp4(k, -1), fake_quantize_nvfp4(v, 1))


def _both_kernels(prepared, scale, method):
    """(Gluon, Triton) outputs of ``method`` on the same prepared operands."""
    from attnqat.kernels.attention_fwd import P_NVFP4, P_SAGE3, attention_forward

    qf, kf, vf, *bias = prepared
    with torch.no_grad():
        if method == "sage3":
            f32, parts = bias
            return (G.gluon_attention_forward(qf, kf, vf, sm_scale=scale, p_mode=P_SAGE3, bias=parts),
                    attention_forward(qf, kf, vf, sm_scale=scale, p_mode=P_SAGE3, bias=f32)[0])
        return (G.gluon_attention_forward(qf, kf, vf, sm_scale=scale),
                attention_forward(qf, kf, vf, sm_scale=scale, p_mode=P_NVFP4)[0])


METHODS = ["nvfp4", "sage3"]
SHAPES = [dict(B=2, Sq=1000, Skv=1000, H=3, D=64),      # ragged tiles, two batch elements (TMA zero fill)
          dict(B=1, Sq=4100, Skv=4100, H=2, D=128),
          dict(B=1, Sq=300, Skv=77, H=2, D=128),        # a single, ragged key tile
          dict(B=1, Sq=513, Skv=2000, H=2, D=64)]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"b{s['B']}q{s['Sq']}k{s['Skv']}d{s['D']}")
@pytest.mark.parametrize("outliers", [False, True], ids=["randn", "outliers"])
@pytest.mark.parametrize("method", METHODS)
def test_matches_triton_and_reference(method, shape, outliers):
    """nvfp4: the same arithmetic as the Triton kernel; sage3: the same but the correction row added
    by the tensor core (its rounding, not FADD's) — within 1e-3 of the Triton kernel either way."""
    from qkv_data import bhsd

    from attnqat.metrics import rel_error

    B, Sq, Skv, H, D = (shape[k] for k in ("B", "Sq", "Skv", "H", "D"))
    (q, k, v), prepared = _operands(B, Sq, Skv, H, D, outliers, seed=5, method=method)
    scale = D ** -0.5
    got, tri = _both_kernels(prepared, scale, method)
    assert got.shape == tri.shape and got.dtype == torch.bfloat16
    assert torch.isfinite(got.float()).all()
    assert rel_error(got, tri) < 1e-3, "the same arithmetic as the Triton kernel"
    want = ref.fp4_forward(bhsd(q), bhsd(k), bhsd(v), scale, method).o.transpose(1, 2)
    assert rel_error(got, want) < TOL


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("shape", [(1, 1000, 1000, 2, 128), (1, 300, 77, 2, 64)], ids=["k1000d128", "k77d64"])
def test_bit_identical_to_triton_kernel(shape):
    """Same wgmma instruction shape and K order, same thread ↔ element map, the same floating-point
    operations in the same order: the nvfp4 outputs are expected to agree bit for bit. A failure
    here (with test_matches_triton_and_reference passing) means some rounding differs."""
    _, prepared = _operands(*shape, True, seed=6)
    got, tri = _both_kernels(prepared, shape[-1] ** -0.5, "nvfp4")
    assert torch.equal(got, tri), f"{(got != tri).float().mean().item():.3%} of the outputs differ"


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("shape", [(1, 1000, 1000, 2, 128), (1, 300, 77, 2, 64), (1, 128, 384, 1, 128)],
                         ids=["k1000d128", "k77d64", "k384d128"])
def test_sage3_with_a_zero_correction_is_bit_identical(shape):
    """With the correction row zeroed the sage3 kernels differ in nothing but their schedule (the
    extra k-step adds exact zeros): the two-level P quantizer, its 2688× scaled P̃ᶠ across key
    tiles and the epilogue must agree bit for bit with the Triton kernel's."""
    _, (qf, kf, vf, f32, parts) = _operands(*shape, True, seed=9, method="sage3")
    got, tri = _both_kernels((qf, kf, vf, torch.zeros_like(f32), torch.zeros_like(parts)),
                             shape[-1] ** -0.5, "sage3")
    assert torch.equal(got, tri), f"{(got != tri).float().mean().item():.3%} of the outputs differ"


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("outliers", [False, True], ids=["randn", "outliers"])
@pytest.mark.parametrize("method", METHODS)
def test_wan_shape(method, outliers):
    """Wan 2.1 1.3B 480p (S = 32,760: 255 full key tiles and one of 120 keys), compared on the rows
    test_kernels_gpu.py compares (whole 128-query blocks: sage3 smooths Q per block)."""
    from qkv_data import bhsd

    from attnqat.metrics import rel_error

    B, S, H, D = 1, 32760, 12, 128
    (q, k, v), prepared = _operands(B, S, S, H, D, outliers, seed=2, method=method)
    got, tri = _both_kernels(prepared, D ** -0.5, method)
    del prepared
    assert torch.isfinite(got.float()).all()
    assert rel_error(got, tri) < 1e-3
    last = (S - 1) // 128 * 128
    for rows in (slice(0, 256), slice(last, S)):
        want = ref.fp4_forward(bhsd(q[:, rows]), bhsd(k), bhsd(v), D ** -0.5, method).o.transpose(1, 2)
        assert rel_error(got[:, rows], want) < TOL


@pytest.mark.gpu
@needs_hopper
def test_rejects_what_tma_cannot_address():
    q = torch.zeros(1, 256, 2, 64, device="cuda", dtype=torch.bfloat16)
    strided = torch.zeros(1, 256, 2, 128, device="cuda", dtype=torch.bfloat16)[..., ::2]  # head_dim stride 2
    with pytest.raises(RuntimeError, match="TMA"):
        G.gluon_attention_forward(q, strided, q, sm_scale=0.125)


@pytest.mark.gpu
@needs_hopper
def test_auto_backend_runs_the_gluon_kernel(monkeypatch):
    """``attnqat.attention(..., "nvfp4")`` with ``backend="auto"`` runs the Gluon kernel on Hopper
    for bf16 inputs — bit-identical to the Triton schedule — and the Triton kernel for float16
    (which the Gluon kernel does not take)."""
    from attnqat import attention
    from attnqat import kernels as K

    calls = []
    real = G.gluon_attention_forward
    monkeypatch.setattr(G, "gluon_attention_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    (q, k, v), _ = _operands(1, 700, 700, 2, 128, True, seed=7)
    with torch.no_grad():
        auto = attention(q, k, v, "nvfp4", backend="auto")
        assert len(calls) == 1, "backend='auto' did not run the Gluon kernel on this Hopper GPU"
        tri = K.triton_attention(q, k, v, "nvfp4", schedule="triton")
        assert len(calls) == 1
        assert torch.equal(auto, tri)
        half = attention(q.half(), k.half(), v.half(), "nvfp4", backend="auto")
    assert len(calls) == 1, "float16 inputs must take the Triton kernel"
    assert half.dtype == torch.float16 and torch.isfinite(half.float()).all()


@pytest.mark.gpu
@needs_hopper
def test_sage3_default_schedule_runs_the_gluon_kernel(monkeypatch):
    """``attnqat.attention(..., "sage3")`` with ``backend="auto"`` runs the Gluon kernel on Hopper for
    bf16 inputs (within 1e-3 of ``schedule="triton"``), and the Triton kernel for float16 and for a
    Triton tile override."""
    from attnqat.kernels import sage3 as S3
    from attnqat.kernels.attention_fwd import P_SAGE3

    from attnqat import attention
    from attnqat.metrics import rel_error

    calls = []
    real = G.gluon_attention_forward
    monkeypatch.setattr(G, "gluon_attention_forward",
                        lambda *a, **kw: calls.append(kw.get("p_mode")) or real(*a, **kw))
    (q, k, v), _ = _operands(1, 700, 700, 2, 128, True, seed=8)
    scale = q.shape[-1] ** -0.5   # the scale triton_attention computes
    with torch.no_grad():
        auto = attention(q, k, v, "sage3", backend="auto")
        assert calls == [P_SAGE3], "backend='auto' did not run the Gluon sage3 kernel on this Hopper GPU"
        tri = S3.sage3_forward(q, k, v, scale, schedule="triton")
        assert rel_error(auto, tri) < 1e-3
        assert torch.equal(S3.sage3_forward(q, k, v, scale, schedule="gluon"), auto)
        assert len(calls) == 2
        S3.sage3_forward(q, k, v, scale, config=dict(BM=128))
        half = attention(q.half(), k.half(), v.half(), "sage3", backend="auto")
    assert len(calls) == 2, "float16 inputs and tile overrides must take the Triton kernel"
    assert half.dtype == torch.float16 and torch.isfinite(half.float()).all()


# ----------------------------------------------------------------------------------------------
# GPU (Hopper): the dK/dV kernel
# ----------------------------------------------------------------------------------------------

def _backward_operands(B, Sq, Skv, H, D, outliers, seed, method):
    """What ``attention_backward`` takes for ``method`` (attnqat: the quantized operands, O', the
    statistics; dropin: the inputs) from one Triton forward, and a random dO."""
    import qkv_data
    from attnqat.kernels import attention_fwd as F
    from attnqat.kernels.quantize import fake_quantize_nvfp4

    q, k, v = qkv_data.make_qkv(B, Sq, Skv, H, D, outliers, seed, torch.bfloat16, device="cuda")
    qf, kf, vf = fake_quantize_nvfp4(q, -1), fake_quantize_nvfp4(k, -1), fake_quantize_nvfp4(v, 1)
    _, o2, lse2, m2 = F.attention_forward(qf, kf, vf, sm_scale=D ** -0.5, need_o2=True, store_stats=True)
    do = torch.randn(q.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed + 1)).to(q.dtype)
    if method == "attnqat":
        return (qf, kf, vf, o2, do, lse2, m2)
    return (q, k, v, o2, do, lse2, None)


def _assert_bit_identical(names, got, want, where=""):
    """Each of ``got`` finite and equal bit for bit to its counterpart in ``want``."""
    for name, a, b in zip(names, got, want):
        assert torch.isfinite(a.float()).all(), name
        assert torch.equal(a, b), f"{name}: {(a != b).float().mean().item():.3%} differ{where}"


BWD_SHAPES = [(1, 128, 128, 1, 128),      # one block of each
              (2, 150, 200, 2, 64),       # ragged query and key blocks, two batch elements
              (1, 1000, 300, 3, 128),     # a ragged second warpgroup (keys 256..299)
              (1, 64, 1000, 2, 128),      # a single query block
              (2, 333, 129, 2, 128),      # one key past a CTA
              (1, 4096, 4096, 4, 64)]


def _backward_cases(test):
    """A GPU (Hopper) test over BWD_SHAPES × randn / outlier-heavy inputs × attnqat / dropin."""
    for mark in (pytest.mark.parametrize("method", ["attnqat", "dropin"]),
                 pytest.mark.parametrize("outliers", [False, True], ids=["randn", "outliers"]),
                 pytest.mark.parametrize("shape", BWD_SHAPES, ids=lambda s: "b{}q{}k{}h{}d{}".format(*s)),
                 needs_hopper, pytest.mark.gpu):
        test = mark(test)
    return test


@_backward_cases
def test_dkdv_bit_identical_to_the_triton_kernel(method, shape, outliers):
    """The same P, Pᶠ and dS as the Triton kernel's untransposed tile (same accumulator layout, same
    quantizer) and the same tensor-core sums: dK and dV agree bit for bit (dQ: the same kernel),
    with a 2- and a 3-slot ring."""
    from attnqat.kernels.attention_bwd import attention_backward

    ops = _backward_operands(*shape, outliers, seed=21, method=method)
    scale = shape[-1] ** -0.5
    want = attention_backward(*ops, sm_scale=scale, quant_p=method == "attnqat", schedule="triton")
    for stages in (2, 3):
        got = attention_backward(*ops, sm_scale=scale, quant_p=method == "attnqat", schedule="gluon",
                                 config=dict(gluon=dict(STAGES=stages)))
        _assert_bit_identical(("dq", "dk", "dv"), got, want, f" (STAGES={stages})")


@pytest.mark.gpu
@needs_hopper
def test_dkdv_wan_shape_bit_identical():
    """Wan 2.1 1.3B 480p (32,760 queries and keys: 511 full query blocks and one of 56 rows, 255
    full key CTAs and one of 120 keys), attnqat on outlier-heavy inputs."""
    from attnqat.kernels.attention_bwd import attention_backward

    ops = _backward_operands(1, 32760, 32760, 12, 128, True, seed=22, method="attnqat")
    want = attention_backward(*ops, sm_scale=128 ** -0.5, quant_p=True, schedule="triton")
    got = attention_backward(*ops, sm_scale=128 ** -0.5, quant_p=True, schedule="gluon")
    _assert_bit_identical(("dq", "dk", "dv"), got, want)


@pytest.mark.gpu
@needs_hopper
def test_dq_on_a_second_stream_gives_the_serial_gradients(monkeypatch):
    """With ``OVERLAP_DQ`` the dQ kernel runs on a second stream beside the dK/dV kernel: the
    caller's stream waits for it (dq, copied on the caller's stream right after the call, is
    complete) and dQ, dK, dV are those of the serial order bit for bit, three calls in a row."""
    from attnqat.kernels import attention_bwd as Bw

    ops = _backward_operands(1, 8192, 8192, 4, 128, True, seed=25, method="attnqat")
    monkeypatch.setattr(Bw, "OVERLAP_DQ", False)
    want = Bw.attention_backward(*ops, sm_scale=128 ** -0.5, quant_p=True)
    monkeypatch.setattr(Bw, "OVERLAP_DQ", True)
    used = []
    real = Bw._side_stream
    monkeypatch.setattr(Bw, "_side_stream", lambda device: used.append(device) or real(device))
    for _ in range(3):
        got = tuple(t.clone() for t in Bw.attention_backward(*ops, sm_scale=128 ** -0.5, quant_p=True))
        _assert_bit_identical(("dq", "dk", "dv"), got, want)
    assert len(used) == 3, "the dQ kernel did not run on the second stream"


@pytest.mark.gpu
@needs_hopper
def test_training_backward_runs_the_gluon_dkdv_kernel(monkeypatch):
    """``attnqat.attention(..., "attnqat")`` (and dropin) with ``backend="auto"`` compute dK, dV with
    the Gluon kernel on Hopper for bf16 inputs and with the Triton kernel for float16, for a Triton
    tile override and for a dO that TMA cannot address; an explicit "gluon" there raises."""
    from attnqat import attention
    from attnqat.kernels import attention_bwd as Bw

    calls = []
    real = GB.gluon_dkdv
    monkeypatch.setattr(GB, "gluon_dkdv", lambda *a, **kw: calls.append(kw["quant_p"]) or real(*a, **kw))
    (q, k, v), _ = _operands(1, 700, 700, 2, 128, True, seed=23)
    for method in ("attnqat", "dropin"):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        attention(qq, kk, vv, method, backend="auto").float().square().sum().backward()
        assert torch.isfinite(kk.grad.float()).all() and torch.isfinite(vv.grad.float()).all()
    assert calls == [True, False], "backend='auto' did not run the Gluon dK/dV kernel on this Hopper GPU"
    qh, kh, vh = (t.half().requires_grad_(True) for t in (q, k, v))
    attention(qh, kh, vh, "attnqat", backend="auto").float().sum().backward()
    ops = _backward_operands(1, 300, 300, 2, 128, False, seed=24, method="attnqat")
    Bw.attention_backward(*ops, sm_scale=0.1, quant_p=True, config=dict(dkdv=dict(BM=64)))
    qf, kf, vf, o2, do, lse2, m2 = ops
    strided_do = torch.zeros(*do.shape[:3], 2 * do.shape[3], device="cuda", dtype=do.dtype)[..., ::2]
    strided_do.copy_(do)
    got = Bw.attention_backward(qf, kf, vf, o2, strided_do, lse2, m2, sm_scale=0.1, quant_p=True)
    assert calls == [True, False], "float16, a tile override and a strided dO must take the Triton kernel"
    want = Bw.attention_backward(*ops, sm_scale=0.1, quant_p=True, schedule="triton")
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="not TMA-addressable"):
        Bw.attention_backward(qf, kf, vf, o2, strided_do, lse2, m2, sm_scale=0.1, quant_p=True, schedule="gluon")


# ----------------------------------------------------------------------------------------------
# GPU (Hopper): the attnqat forward
# ----------------------------------------------------------------------------------------------

def _qat_forwards(B, Sq, Skv, H, D, outliers, seed):
    """(Gluon, Triton) attnqat forwards — (O, O', LSE₂, m₂) each — on the same quantized operands."""
    from attnqat.kernels.attention_fwd import attention_forward

    _, (qf, kf, vf) = _operands(B, Sq, Skv, H, D, outliers, seed)
    with torch.no_grad():
        return (GQ.gluon_attnqat_forward(qf, kf, vf, sm_scale=D ** -0.5),
                attention_forward(qf, kf, vf, sm_scale=D ** -0.5, need_o2=True, store_stats=True))


def _assert_same_forward(got, want):
    for name, a, b in zip(("O", "O'", "LSE2", "m2"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
    _assert_bit_identical(("O", "O'", "LSE2", "m2"), got, want)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("shape", SHAPES + [dict(B=1, Sq=128, Skv=128, H=1, D=128)],
                         ids=lambda s: f"b{s['B']}q{s['Sq']}k{s['Skv']}d{s['D']}")
@pytest.mark.parametrize("outliers", [False, True], ids=["randn", "outliers"])
def test_attnqat_forward_bit_identical_to_the_triton_kernel(shape, outliers):
    """The same softmax, quantizer and difference product as the Triton kernel with ``need_o2`` and
    ``store_stats`` on the same accumulator layout: O, O', LSE₂ and m₂ agree bit for bit (ragged
    and single key tiles, two batch elements, D 64 and 128)."""
    _assert_same_forward(*_qat_forwards(*(shape[k] for k in ("B", "Sq", "Skv", "H", "D")), outliers, seed=31))


@pytest.mark.gpu
@needs_hopper
def test_attnqat_forward_wan_shape_bit_identical():
    """Wan 2.1 1.3B 480p (32,760 queries and keys: 255 full key tiles and one of 120 keys, a last
    query block of 120 rows), outlier-heavy inputs."""
    _assert_same_forward(*_qat_forwards(1, 32760, 32760, 12, 128, True, seed=32))


@pytest.mark.gpu
@needs_hopper
def test_training_forward_runs_the_gluon_attnqat_kernel(monkeypatch):
    """``attnqat`` with the default schedule runs the Gluon forward on Hopper for bf16 inputs at
    head_dim 128 — output and gradients bit-identical to ``schedule="triton"`` — and the Triton
    forward at head_dim 64, for float16 and for a Triton tile override; an explicit "gluon" runs it
    at head_dim 64 too."""
    from attnqat import attention
    from attnqat import kernels as K

    calls = []
    real = GQ.gluon_attnqat_forward
    monkeypatch.setattr(GQ, "gluon_attnqat_forward", lambda *a, **kw: calls.append(a[0].shape[-1]) or real(*a, **kw))
    (q, k, v), _ = _operands(1, 700, 700, 2, 128, True, seed=33)
    runs = {}
    for schedule in (None, "triton"):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        o = K.triton_attention(qq, kk, vv, "attnqat", schedule=schedule)
        o.float().square().sum().backward()
        runs[schedule] = (o, qq.grad, kk.grad, vv.grad)
    assert calls == [128], "the default schedule did not run the Gluon attnqat forward on this Hopper GPU"
    _assert_bit_identical(("o", "dq", "dk", "dv"), runs[None], runs["triton"])
    q64, k64, v64 = (t[..., :64].contiguous() for t in (q, k, v))
    with torch.no_grad():
        attention(q64, k64, v64, "attnqat", backend="auto")
        attention(q.half(), k.half(), v.half(), "attnqat", backend="auto")
        K.triton_attention(q, k, v, "attnqat", config=dict(fwd=dict(BM=128)))
        assert calls == [128], "head_dim 64, float16 and a tile override must take the Triton forward"
        K.triton_attention(q64, k64, v64, "attnqat", schedule="gluon")
    assert calls == [128, 64]


# ----------------------------------------------------------------------------------------------
# GPU (Hopper): the dQ kernel
# ----------------------------------------------------------------------------------------------

@_backward_cases
def test_dq_bit_identical_to_the_triton_kernel(method, shape, outliers):
    """The Triton dQ kernel's P, dS and 64-key k-steps on the same accumulator layout: dQ agrees bit
    for bit, with 3- and 4-slot rings (dK/dV from the Triton kernel in both, so the launch is the
    only difference)."""
    from attnqat.kernels.attention_bwd import attention_backward

    ops = _backward_operands(*shape, outliers, seed=41, method=method)
    kw = dict(sm_scale=shape[-1] ** -0.5, quant_p=method == "attnqat")
    want = attention_backward(*ops, **kw, schedule="triton")
    for stages in (3, 4):
        got = attention_backward(*ops, **kw, schedule="gluon", config=dict(dkdv={}, gluon_dq=dict(STAGES=stages)))
        _assert_bit_identical(("dq", "dk", "dv"), got, want, f" (STAGES={stages})")


@pytest.mark.gpu
@needs_hopper
def test_training_backward_runs_the_gluon_dq_kernel(monkeypatch):
    """The default schedule computes dQ with the Gluon kernel on Hopper for bf16 operands at head_dim
    128, and with the Triton kernel at head_dim 64 and for a "dq" tile override; an explicit "gluon"
    runs it at head_dim 64 too."""
    from attnqat.kernels.attention_bwd import attention_backward

    calls = []
    real = GB.gluon_dq
    monkeypatch.setattr(GB, "gluon_dq", lambda *a, **kw: calls.append(a[0].shape[-1]) or real(*a, **kw))
    ops128 = _backward_operands(1, 300, 300, 2, 128, True, seed=42, method="attnqat")
    ops64 = _backward_operands(1, 300, 300, 2, 64, True, seed=43, method="attnqat")
    got = attention_backward(*ops128, sm_scale=0.1, quant_p=True)
    assert calls == [128], "the default schedule did not run the Gluon dQ kernel on this Hopper GPU"
    attention_backward(*ops128, sm_scale=0.1, quant_p=True, config=dict(dq=dict(BM=128)))
    attention_backward(*ops64, sm_scale=0.1, quant_p=True)
    assert calls == [128], "head_dim 64 and a dq tile override must take the Triton dQ kernel"
    attention_backward(*ops64, sm_scale=0.1, quant_p=True, schedule="gluon")
    assert calls == [128, 64]
    want = attention_backward(*ops128, sm_scale=0.1, quant_p=True, schedule="triton")
    assert all(torch.equal(a, b) for a, b in zip(got, want))
