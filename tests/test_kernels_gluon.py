"""The Gluon ``nvfp4`` forward for Hopper (kernels/gluon_fwd.py).

CPU: the kernel compiled for sm_90 (no GPU needed) and the machine-code facts that make it worth
having over the Triton kernel — tensor-core work issued asynchronously with the PV product in
flight during the softmax, no spills, register reallocation between the partitions, the P
quantizer's rounding present, fewer instructions per key tile than the Triton kernel's loop.
GPU (``pytest -m gpu``, Hopper only): outputs against the Triton forward on the same pre-quantized
operands and against the PyTorch reference of the method, with test_kernels_gpu.py's tolerance.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from attnqat.kernels import gluon_fwd as G

from attnqat import reference as ref

TOL = 1e-2   # test_kernels_gpu.py's tolerance for the Triton forward against the reference


# ----------------------------------------------------------------------------------------------
# CPU: machine code for sm_90
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The kernel compiled for sm_90 in a child process without the Triton interpreter that the
    other CPU tests use (as test_kernels_sass.py does): ``attnqat bench kernels --sass 90``."""
    if G.GLUON_IMPORT_ERROR is not None:
        pytest.skip(f"no Gluon in this triton: {G.GLUON_IMPORT_ERROR}")
    out = tmp_path_factory.mktemp("gluon") / "sass.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "attnqat.cli", "bench", "kernels", "--sass", "90",
                          "--json", str(out)],
                         cwd=out.parent, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "gluon nvfp4 D=128 consumer 1:" in res.stdout
    return {int(d): f for d, f in json.loads(out.read_text())["gluon"].items()}


@pytest.fixture(params=[128, 64], ids=["d128", "d64"])
def facts(request, report):
    f = report[request.param]
    assert "error" not in f, f"the Gluon forward does not compile for sm_90 under triton {f['triton']}"
    return request.param, f


def test_two_consumer_loops_issue_both_products_asynchronously(facts):
    D, f = facts
    loops = f["consumer_loops"]
    assert len(loops) == 2, "one key loop per consumer warpgroup"
    for lp in loops:
        # S_j (D/16 k-steps) and PV_{j-1} (128 keys / 16) per tile, as two wgmma groups
        assert lp["hgmma"] == D // 16 + 128 // 16
        assert lp["warpgroup_arrive"] == 2
        # two waits per tile (PV_{j-2} at the top, S_j before the softmax): ptxas did not serialize
        # the pipeline (a serialized one waits after every HGMMA)
        assert lp["waits"] == 2
        # PV_{j-1} stays in flight while the softmax and the quantizer of tile j run
        assert lp["last_hgmma"] < lp["first_ex2"]
        assert lp["waits_after_first_ex2"] == 0


def test_no_spills_and_registers_handed_to_the_consumers(facts):
    _, f = facts
    assert f["spill_instructions"] == 0
    # 3 warpgroups at 168 registers; the producer gives back to 24, the consumers take 240
    assert f["registers"] == G.CONFIG["MAXNREG"]
    assert G.CONFIG["CONSUMER_REGS"] in f["setmaxnreg"] and G.CONFIG["LOADER_REGS"] in f["setmaxnreg"]
    assert f["max_register_index"] < G.CONFIG["CONSUMER_REGS"]


def test_p_quantizer_is_the_triton_kernels(facts):
    """The E4M3 scale and the E2M1 rounding of 64 scores per thread: 2 FFMA with the E2M1 magic
    constant per score, one exponent mask per score and per block scale, one MUFU.RCP per block."""
    _, f = facts
    for lp in f["consumer_loops"]:
        assert lp["e2m1_magic_ffma"] == 128
        assert lp["exponent_mask_lop3"] == 64 + 16
        assert lp["rcp"] == 16


def test_fewer_instructions_per_key_tile_than_the_triton_kernel(facts):
    """Per full 128-key tile each consumer thread holds the 64 scores a thread of the 8-warp Triton
    kernel holds; the Gluon loop (the mask block is branched over on full tiles) must not be longer
    than the Triton kernel's loop compiled with the same Triton for the same head_dim."""
    _, f = facts
    for lp in f["consumer_loops"]:
        assert lp["mask_block"] > 0
        assert lp["per_full_tile"] < f["triton_loop"]


def test_launcher_refuses_without_a_hopper_gpu():
    q = torch.zeros(1, 128, 1, 64, dtype=torch.bfloat16)
    if G.gluon_unavailable() is None:
        pytest.skip("a Hopper GPU is present")
    with pytest.raises(RuntimeError, match="cannot run"):
        G.gluon_attention_forward(q, q, q, sm_scale=0.125)


def test_schedule_choice_on_the_cpu():
    """Without a Hopper GPU the nvfp4 forward's default schedule is the Triton kernel; asking for
    the Gluon one says why it cannot run rather than running the other kernel."""
    from attnqat import kernels as K

    q = torch.zeros(1, 128, 1, 64, dtype=torch.bfloat16)
    assert K._schedule(q, q, q, None, None) == "triton"
    assert K._schedule(q, q, q, "triton", None) == "triton"
    with pytest.raises(ValueError, match="cannot run these inputs: q is on cpu"):
        K._schedule(q, q, q, "gluon", None)
    with pytest.raises(ValueError, match="schedule must be one of"):
        K._schedule(q, q, q, "cudnn", None)
    with pytest.raises(ValueError, match="formulation 0 only"):
        K.nvfp4_forward(q, q, q, 0.125, formulation=1, schedule="gluon")
    with pytest.raises(ValueError, match="schedule must be one of"):   # checked for every formulation
        K.nvfp4_forward(q, q, q, 0.125, formulation=1, schedule="cudnn")
    with pytest.raises(ValueError, match="'nvfp4' only"):
        K.triton_attention(q, q, q, "sage3", schedule="gluon")


# ----------------------------------------------------------------------------------------------
# GPU (Hopper): numerics
# ----------------------------------------------------------------------------------------------

def _is_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper (sm_90) GPU")


def _operands(B, Sq, Skv, H, D, outliers, seed):
    import qkv_data
    from attnqat.kernels.quantize import fake_quantize_nvfp4

    q, k, v = qkv_data.make_qkv(B, Sq, Skv, H, D, outliers, seed, torch.bfloat16, device="cuda")
    return (q, k, v), (fake_quantize_nvfp4(q, -1), fake_quantize_nvfp4(k, -1), fake_quantize_nvfp4(v, 1))


SHAPES = [dict(B=2, Sq=1000, Skv=1000, H=3, D=64),      # ragged tiles, two batch elements (TMA zero fill)
          dict(B=1, Sq=4100, Skv=4100, H=2, D=128),
          dict(B=1, Sq=300, Skv=77, H=2, D=128),        # a single, ragged key tile
          dict(B=1, Sq=513, Skv=2000, H=2, D=64)]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"b{s['B']}q{s['Sq']}k{s['Skv']}d{s['D']}")
@pytest.mark.parametrize("outliers", [False, True], ids=["randn", "outliers"])
def test_matches_triton_and_reference(shape, outliers):
    from attnqat.kernels.attention_fwd import P_NVFP4, attention_forward
    from qkv_data import bhsd

    from attnqat.metrics import rel_error

    B, Sq, Skv, H, D = (shape[k] for k in ("B", "Sq", "Skv", "H", "D"))
    (q, k, v), (qf, kf, vf) = _operands(B, Sq, Skv, H, D, outliers, seed=5)
    scale = D ** -0.5
    with torch.no_grad():
        got = G.gluon_attention_forward(qf, kf, vf, sm_scale=scale)
        tri = attention_forward(qf, kf, vf, sm_scale=scale, p_mode=P_NVFP4)[0]
    assert got.shape == tri.shape and got.dtype == torch.bfloat16
    assert torch.isfinite(got.float()).all()
    assert rel_error(got, tri) < 1e-3, "the same arithmetic as the Triton kernel"
    want = ref.fp4_forward(bhsd(q), bhsd(k), bhsd(v), scale, "nvfp4").o.transpose(1, 2)
    assert rel_error(got, want) < TOL


@pytest.mark.gpu
@needs_hopper
def test_bit_identical_to_triton_kernel():
    """Same wgmma instruction shape and K order, same thread ↔ element map, the same floating-point
    operations in the same order: the outputs are expected to agree bit for bit. A failure here
    (with test_matches_triton_and_reference passing) means some rounding differs — worth knowing
    before the kernel replaces the Triton one."""
    from attnqat.kernels.attention_fwd import P_NVFP4, attention_forward

    _, (qf, kf, vf) = _operands(1, 1000, 1000, 2, 128, True, seed=6)
    with torch.no_grad():
        got = G.gluon_attention_forward(qf, kf, vf, sm_scale=128 ** -0.5)
        tri = attention_forward(qf, kf, vf, sm_scale=128 ** -0.5, p_mode=P_NVFP4)[0]
    assert torch.equal(got, tri), f"{(got != tri).float().mean().item():.3%} of the outputs differ"


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("outliers", [False, True], ids=["randn", "outliers"])
def test_wan_shape(outliers):
    """Wan 2.1 1.3B 480p (S = 32,760: 255 full key tiles and one of 120 keys), compared on the rows
    test_kernels_gpu.py compares."""
    from attnqat.kernels.attention_fwd import P_NVFP4, attention_forward
    from qkv_data import bhsd

    from attnqat.metrics import rel_error

    B, S, H, D = 1, 32760, 12, 128
    (q, k, v), (qf, kf, vf) = _operands(B, S, S, H, D, outliers, seed=2)
    with torch.no_grad():
        got = G.gluon_attention_forward(qf, kf, vf, sm_scale=D ** -0.5)
        tri = attention_forward(qf, kf, vf, sm_scale=D ** -0.5, p_mode=P_NVFP4)[0]
    assert torch.isfinite(got.float()).all()
    assert rel_error(got, tri) < 1e-3
    last = (S - 1) // 128 * 128
    for rows in (slice(0, 256), slice(last, S)):
        want = ref.fp4_forward(bhsd(q[:, rows]), bhsd(k), bhsd(v), D ** -0.5, "nvfp4").o.transpose(1, 2)
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
