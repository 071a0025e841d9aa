"""Machine code of the forward kernel for Hopper, compiled on the CPU (attnqat/kernels/sass.py)."""

from __future__ import annotations

import os

import pytest

from attnqat.kernels import sass

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0020*/                   FMNMX R2, R3, R4, !PT ;
        /*0030*/               @P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0040*/                   FADD R5, R5, R6 ;
        /*0050*/              @!P1 BRA `(.L_x_2) ;
        /*0060*/                   EXIT ;
"""


def test_parse_finds_the_loop_around_the_matrix_multiplies():
    ops, loop = sass.parse(LISTING)
    assert ops == ["MOV", "HGMMA", "FMNMX", "BRA", "FADD", "BRA", "EXIT"]
    assert loop == (1, 4)   # the FADD loop holds no MMA


@pytest.mark.subprocess
def test_hopper_machine_code_of_the_quantizers(sass90):
    """Compiled for sm_90 without a GPU (the interpreter that the other tests use is switched off
    in the child process; tests/conftest.py runs it once for this module and
    test_kernels_gluon.py): the P quantizer lengthens the key loop by a plausible few instructions
    per score, the attnqat forward by more."""
    res, data = sass90
    rows = {r["name"]: r for r in data["rows"]}
    assert list(rows) == list(sass.VARIANTS)
    base, q, o2 = rows["no P quantizer"], rows["nvfp4"], rows["nvfp4 + O' + stats (attnqat)"]
    assert base["per_score"] == 0 and base["loop"] > 100
    assert 4 < q["per_score"] < 30 and o2["per_score"] > q["per_score"]
    assert rows["sage3 P quantizer"]["per_score"] > 4
    assert "no P quantizer" in res.stdout
    # the backward's dK/dV loop: the P quantizer on the transposed tile costs more per score than
    # the forward's (2 scores per thread and 16-key block instead of 4, one more shuffle level);
    # on the untransposed tile (attnqat's default) less
    dropin_t, attnqat_t, dropin_n, attnqat_n = data["dkdv"]
    assert dropin_t["per_score"] == dropin_n["per_score"] == 0 and dropin_t["loop"] > 100
    assert attnqat_t["per_score"] > q["per_score"]
    assert attnqat_t["loop_mix"].get("SHFL", 0) > dropin_t["loop_mix"].get("SHFL", 0)
    assert 0 < attnqat_n["per_score"] < attnqat_t["per_score"]


@pytest.mark.subprocess
@pytest.mark.slow
def test_sagebwd_backward_resources_for_hopper():
    """The sagebwd backward's launches compiled for sm_90 without a GPU (a child process without
    the interpreter): the split's dV launch fits three pipeline stages in the 227 KiB a block may
    use, and dQ from stored dS compiles with no spills (docs/benchmarks.md, "The backward's
    structure")."""
    import json
    import subprocess
    import sys

    code = ("import json; from attnqat.kernels import sass; print(json.dumps(sass.sagebwd_table(90, ("
            "('dv', dict(num_warps=4, num_stages=3)), ('dk', dict(num_warps=8, num_stages=1, STORE_DS=True)),"
            " ('dq_stored', dict(num_warps=8, num_stages=3))))))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    dv, dk, dq = json.loads(res.stdout.strip().splitlines()[-1])
    assert dv["shared_kib"] <= 227 and dv["spill_instructions"] == 0
    assert dk["kernel"] == "dk" and dk["config"]["STORE_DS"] and dk["total"] > dv["total"]
    assert dq["spill_instructions"] == 0 and dq["total"] < dk["total"]
    with pytest.raises(ValueError, match="unknown sagebwd kernel"):
        sass.compile_sagebwd(90, "dx")


@pytest.mark.subprocess
@pytest.mark.slow
def test_gluon_sagebwd_launches_for_hopper():
    """The Gluon sagebwd forward's and backward's default launches (kernels/gluon_sagebwd_fwd.py,
    kernels/gluon_sagebwd.py) compiled for sm_90 without a GPU (a child process without the
    interpreter): each fits the 227 KiB of shared memory a block may use, keeps its INT8 and BF16
    wgmma asynchronous (no wait after every one: ptxas serializes them when a product of an earlier
    loop iteration is read while a later one runs), and the forward, dV and stored-dS dQ launches
    have no spills. The dV launch reads P's codes from registers (an INT8 wgmma with a register A
    operand) and stores nothing of them to shared memory: the layout change of ``_a_operand`` moves
    no data (its shared tile took 64 stores a warp)."""
    import json
    import subprocess
    import sys

    code = ("import json; from attnqat.kernels import sass; print(json.dumps({l: sass.gluon_sagebwd_facts("
            "sass.compile_gluon_sagebwd(90, l)) for l in ('fwd', 'dv', 'dk_store', 'dq_stored')}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    facts = json.loads(res.stdout.strip().splitlines()[-1])
    for launch, f in facts.items():
        assert f["shared_kib"] <= 227 and not f["serialized"] and f["igmma"] > 0, (launch, f)
    assert all(facts[launch]["spill_instructions"] == 0 for launch in ("fwd", "dv", "dq_stored"))
    assert facts["dk_store"]["hgmma"] > 0 and facts["dv"]["hgmma"] == facts["fwd"]["hgmma"] == 0   # dP in BF16
    assert facts["dv"]["igmma_register_a"] > 0 and facts["dv"]["sts"] < 16, facts["dv"]
    with pytest.raises(ValueError, match="unknown Gluon sagebwd launch"):
        sass.compile_gluon_sagebwd(90, "dx")


def test_interpreted_kernels_cannot_be_disassembled():
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("runs only under the Triton interpreter")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        sass.compile_forward(90, 1)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        sass.compile_dkdv(90, True)
