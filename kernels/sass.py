"""The forward kernel's machine code for a GPU architecture, compiled on any machine (no GPU).

Triton compiles for a target it is told (``GPUTarget("cuda", 90, 32)``), and its wheel carries
``ptxas`` and ``nvdisasm``, so the SASS a Hopper or Blackwell GPU would run can be read on the CPU
machine: the instruction mix, the main loop's length (the instructions every thread executes per
key tile), and whether Triton warp-specialized the loop (``ttg.warp_specialize`` in its GPU IR,
``setmaxnreg`` in the PTX). ``attnqat bench kernels --sass ARCH`` prints the table of
:data:`VARIANTS` and, for sm_90, what the hand-scheduled Gluon forward (:mod:`.gluon_fwd`) compiles
to (:func:`gluon_report`); docs/kernels_notes.md records what they showed. :func:`sagebwd_table`
gives the ``sagebwd`` backward launches' shared memory, registers and spills (docs/benchmarks.md).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

#: name → (P quantizer mode, with O' and statistics, WARP_SPEC)
VARIANTS = {
    "no P quantizer": (0, False, False),
    "nvfp4": (1, False, False),
    "nvfp4, warp-specialized loop": (1, False, True),
    "nvfp4 + O' + stats (attnqat)": (1, True, False),
    "sage3 P quantizer": (2, False, False),
}
_INSN = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")
_LABEL = re.compile(r"^\.(L_x_\d+):")
_BRANCH = re.compile(r"BRA(?:\.\w+)*\s.*`\(\.(L_x_\d+)\)")


@dataclass
class Sass:
    num_warps: int
    total: int                      # static instruction count of the kernel
    loop: int                       # instructions of the main loop (the backward branch around the MMAs)
    loop_mix: collections.Counter   # opcode (without modifiers) → count in the loop
    warp_specialize_ops: int        # ttg.warp_specialize ops in the GPU IR (0: not specialized)
    setmaxnreg: int                 # register reallocation between warp groups in the PTX


def compile_forward(arch: int, p_mode: int, need_o2: bool = False, warp_spec: bool = False, *,
                    shape: tuple[int, int, int, int] = (1, 32760, 12, 128), BM: int = 128,
                    num_warps: int = 8, num_stages: int = 3, has_bias: bool = False):
    """``attn_fwd_kernel`` with BF16 operands (formulation 0, BN = 128 keys) compiled for
    ``sm_<arch>`` as the launcher would compile it for contiguous (B, S, H, D) = ``shape`` tensors:
    Triton's JIT specializes integer arguments equal to 1 as constants and marks pointers and
    integers divisible by 16 (which is what lets it prove contiguous, aligned loads), so the same
    is done here from the shape's strides. ``has_bias``: with sage3's correction row (the sage3
    launch). Returns Triton's compiled kernel (``.asm``: ttgir, ptx, cubin)."""
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    from .attention_fwd import attn_fwd_kernel  # noqa: PLC0415
    _check_compiled()
    _, S, H, D = shape
    consts = dict(D=D, BM=BM, BN=128, P_MODE=p_mode, NEED_O2=need_o2, HAS_BIAS=has_bias,
                  STORE_STATS=need_o2, FORMULATION=0, WARP_SPEC=warp_spec)
    pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "O2": "*fp32", "LSE2": "*fp32",
                "M2": "*fp32", "BIAS": "*fp32", "Qc": "*u8", "Qs": "*u8", "Kc": "*u8", "Ks": "*u8",
                "Vc": "*u8", "Vs": "*u8"}
    ints = {"H": H, "Sq": S, "Skv": S, "n_qblk_bias": -(-S // 128) if has_bias else 0}
    for t in "qkvo":   # (B, S, H, D) strides of Q, K, V, O; the packed operands' strides are unused (0)
        ints.update(zip((f"s{t}b", f"s{t}s", f"s{t}h", f"s{t}d"), (S * H * D, H * D, D, 1)))
    typed = {n: (t, True) for n, t in pointers.items()} | {"qk_scale": ("fp32", False)}
    src = ASTSource(fn=attn_fwd_kernel, **_specialize(attn_fwd_kernel.arg_names, consts, typed, ints))
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def _check_compiled() -> None:
    from .quantize import INTERPRET  # noqa: PLC0415

    if INTERPRET:
        raise RuntimeError("TRITON_INTERPRET is set: the kernels are interpreted Python then, "
                           "not compiled; unset it to read their machine code")


def compile_dkdv(arch: int, quant_p: bool, *, shape: tuple[int, int, int, int] = (1, 32760, 12, 128),
                 config: dict | None = None):
    """The backward's dK/dV kernel (:func:`.attention_bwd._bwd_dkdv_kernel`) with its default launch
    (:func:`.attention_bwd.dkdv_config`), compiled for ``sm_<arch>`` as the launcher compiles it for
    contiguous (B, S, H, D) = ``shape`` tensors: ``quant_p`` True is attnqat (the P quantizer on the
    tile), False dropin; ``config``: overrides (``NATURAL``: the tile's orientation). No GPU needed."""
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    from .attention_bwd import _bwd_dkdv_kernel, dkdv_config  # noqa: PLC0415

    _check_compiled()
    _, S, H, D = shape
    cfg = dkdv_config(D, S, quant_p)
    cfg.update(config or {})
    num_warps, num_stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    consts = dict(D=D, QUANT_P=quant_p, **cfg)
    typed = {n: ("*bf16", True) for n in ("Q", "K", "V", "DO", "DK", "DV")}
    typed |= {n: ("*fp32", True) for n in ("LSE2", "M2", "DELTA")}
    typed |= {"qk_scale": ("fp32", False), "sm_scale": ("fp32", False)}
    ints = {"H": H, "Sq": S, "Skv": S}
    for t in ("q", "k", "v", "do", "dk", "dv"):
        ints.update(zip((f"s{t}b", f"s{t}s", f"s{t}h", f"s{t}d"), (S * H * D, H * D, D, 1)))
    src = ASTSource(fn=_bwd_dkdv_kernel, **_specialize(_bwd_dkdv_kernel.arg_names, consts, typed, ints))
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def dkdv_table(arch: int) -> list[dict]:
    """The dK/dV kernel's main loop, per query tile, without the P quantizer (dropin's launch) and
    with it on the transposed 64 × 128 tile and on the untransposed 64 × 64 one (attnqat's
    default): length, length per score against dropin's, and the mix."""
    transposed = dict(BM=64, BN=128, num_warps=8, num_stages=1, NATURAL=False)
    natural = dict(BM=64, BN=64, num_warps=4, num_stages=1, NATURAL=True)
    rows, base = [], None
    for name, quant_p, cfg in (("dK/dV, dropin (no P quantizer), Sᵀ 128x64", False, transposed),
                               ("dK/dV, attnqat, Sᵀ 128x64", True, transposed),
                               ("dK/dV, dropin, S 64x64 (4 warps)", False, natural),
                               ("dK/dV, attnqat, S 64x64 (default)", True, None)):
        k = compile_dkdv(arch, quant_p, config=cfg)
        s = summarize(k)
        scores = (cfg or {}).get("BM", 64) * (cfg or {}).get("BN", 64) / (32 * s.num_warps)
        if base is None or not quant_p:
            base = s.loop
        rows.append(dict(name=name, arch=arch, total=s.total, loop=s.loop, per_score=(s.loop - base) / scores,
                         warps=s.num_warps, warp_specialize_ops=s.warp_specialize_ops,
                         loop_mix=dict(s.loop_mix.most_common(10))))
    return rows


def compile_sagebwd(arch: int, kernel: str, *, shape: tuple[int, int, int, int] = (1, 32760, 12, 128),
                    config: dict | None = None):
    """A ``sagebwd`` backward kernel (:mod:`.sagebwd`) compiled for ``sm_<arch>`` as its launcher
    compiles it for contiguous (B, S, H, D) = ``shape`` self-attention inputs, no GPU needed:
    ``kernel`` "dv", "dk" or "dkdv" (:func:`.sagebwd._dkdv_kernel`'s PART 1, 2, 0), "dq" (the
    recomputing :func:`.sagebwd._dq_kernel`) or "dq_stored"; ``config``: ``num_warps``,
    ``num_stages`` and, for dk/dkdv, ``STORE_DS``."""
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    from . import sagebwd as ks  # noqa: PLC0415

    if kernel not in ("dv", "dk", "dkdv", "dq", "dq_stored"):
        raise ValueError(f"unknown sagebwd kernel {kernel!r}")
    _check_compiled()
    _, S, H, D = shape
    Sp = ks._padded(S)
    cfg = dict(num_warps=8, num_stages=1) | dict(config or {})
    num_warps, num_stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    i8 = ("Q8", "Q8T", "K8", "K8T", "DO8T")
    typed = {n: ("*i8", True) for n in i8} | {"DS8": ("*i8", True)}
    typed |= {n: ("*fp32", True) for n in ("SQ", "SK", "SDO", "LSE2", "DELTA", "SDS", "RS", "KMEAN")}
    typed |= {n: ("*bf16", True) for n in ("V", "DO", "DK", "DV", "DQ")}
    typed |= {"qk": ("fp32", False), "sm_scale": ("fp32", False)}
    ints = {"H": H, "Sq": S, "Skv": S, "Sqp": Sp, "Skp": Sp, "BH0": 0}
    for p in ("sv", "sd", "so"):
        ints.update(zip((f"{p}b", f"{p}s" if p != "sd" else "sds_", f"{p}h", f"{p}d"), (S * H * D, H * D, D, 1)))
    if kernel in ("dv", "dk", "dkdv"):
        fn = ks._dkdv_kernel
        consts = dict(D=D, BM=128, BN=64, PART={"dkdv": 0, "dv": 1, "dk": 2}[kernel],
                      STORE_DS=bool(cfg.pop("STORE_DS", False)))
    elif kernel == "dq":
        fn, consts = ks._dq_kernel, dict(D=D, BM=128, BN=64, CORRECTION=True)
    else:
        fn, consts = ks._dq_stored_kernel, dict(D=D, BM=128, BN=64, CORRECTION=True)
    if cfg:
        raise ValueError(f"unknown options for {kernel}: {sorted(cfg)}")
    src = ASTSource(fn=fn, **_specialize(fn.arg_names, consts, typed, ints))
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


#: (kernel, launch options) rows of :func:`sagebwd_table`: the defaults and what the bench's
#: ``--variants`` times
SAGEBWD_VARIANTS = (
    ("dkdv", dict(num_warps=4, num_stages=1)), ("dkdv", dict(num_warps=8, num_stages=1)),
    ("dv", dict(num_warps=4, num_stages=1)), ("dv", dict(num_warps=4, num_stages=2)),
    ("dv", dict(num_warps=4, num_stages=3)), ("dv", dict(num_warps=8, num_stages=2)),
    ("dk", dict(num_warps=4, num_stages=1)), ("dk", dict(num_warps=8, num_stages=1)),
    ("dk", dict(num_warps=4, num_stages=1, STORE_DS=True)), ("dk", dict(num_warps=8, num_stages=1, STORE_DS=True)),
    ("dkdv", dict(num_warps=8, num_stages=1, STORE_DS=True)),
    ("dq", dict(num_warps=8, num_stages=3)),
    ("dq_stored", dict(num_warps=4, num_stages=3)), ("dq_stored", dict(num_warps=8, num_stages=3)),
    ("dq_stored", dict(num_warps=8, num_stages=4)),
)


def sagebwd_table(arch: int, variants=SAGEBWD_VARIANTS) -> list[dict]:
    """Resources of the ``sagebwd`` backward kernels (:func:`compile_sagebwd`) per variant: shared
    memory (the limit is 227 KiB a block on sm_90), registers, spill instructions, instructions."""
    rows = []
    for kernel, cfg in variants:
        k = compile_sagebwd(arch, kernel, config=cfg)
        _, _, facts = _kernel_facts(k)
        rows.append(dict(kernel=kernel, config=cfg, shared_kib=round(k.metadata.shared / 1024, 1),
                         registers=facts.get("registers"), spill_instructions=facts["spill_instructions"],
                         total=facts["total"]))
    return rows


GLUON_SAGEBWD_LAUNCHES = ("fwd", "dv", "dk", "dk_store", "dq", "dq_stored")


def compile_gluon_sagebwd(arch: int, launch: str, *, shape: tuple[int, int, int, int] = (1, 32760, 12, 128),
                          config: dict | None = None):
    """A launch of the Gluon ``sagebwd`` forward (:mod:`.gluon_sagebwd_fwd`, training: LSE₂ stored)
    or backward (:mod:`.gluon_sagebwd`) compiled for ``sm_<arch>`` as the launchers compile it for
    contiguous (B, S, H, D) = ``shape`` self-attention inputs, no GPU needed: ``launch`` "fwd", "dv",
    "dk", "dk_store" (the dK launch storing dS), "dq" (recomputing) or "dq_stored"; ``config``: its
    options over the module's defaults."""
    import torch  # noqa: PLC0415
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.experimental.gluon._runtime import GluonASTSource  # noqa: PLC0415
    from triton.runtime.jit import mangle_type  # noqa: PLC0415

    from . import gluon_sagebwd as G  # noqa: PLC0415
    from . import gluon_sagebwd_fwd as GF  # noqa: PLC0415
    from .gluon_fwd import tma_descriptor  # noqa: PLC0415

    if launch not in GLUON_SAGEBWD_LAUNCHES:
        raise ValueError(f"unknown Gluon sagebwd launch {launch!r} "
                         f"(one of {', '.join(GLUON_SAGEBWD_LAUNCHES)})")
    _check_gluon()
    _, S, H, D = shape
    Sp = -(-S // 128) * 128

    def i8(rows, cols, box):
        return (mangle_type(G._int8_descriptor(torch.empty(rows, cols, dtype=torch.int8), box)), False)

    def bf16(rows):
        return (mangle_type(tma_descriptor(torch.empty(1, 256, 1, D, dtype=torch.bfloat16), rows)), False)

    out = {"sob": S * H * D, "sos": H * D, "soh": D}
    ints = dict(out, H=H, Sq=S, Skv=S, Sqp=Sp, Skp=Sp, BH0=0)
    ds = i8(4 * Sp, Sp, (G.QUERIES_PER_CTA, G.KEY_STEP))
    if launch == "fwd":
        cfg = dict(GF.CONFIG) | dict(config or {})
        fn = GF.gluon_sagebwd_fwd_kernel
        typed = {"q_desc": i8(H * Sp, D, (128, D)), "k_desc": i8(H * Sp, D, (128, D)),
                 "v_desc": i8(H * D, Sp, (D, 128)), "O": ("*fp32", True), "qk": ("fp32", False)}
        typed |= {n: ("*fp32", True) for n in ("LSE2", "SQ", "SK", "SV")}
        consts = dict(D=D, STAGES=cfg["STAGES"], STORE_LSE=True, CONSUMER_REGS=cfg["CONSUMER_REGS"],
                      LOADER_REGS=cfg["LOADER_REGS"])
        num_warps, maxnreg = 4, cfg["MAXNREG"]
    elif launch.startswith("dv") or launch.startswith("dk"):
        part = 1 if launch == "dv" else 2
        cfg = dict(G.DV_CONFIG if part == 1 else G.DK_CONFIG) | dict(config or {})
        fn = G.gluon_kv_kernel
        typed = {"k_desc": i8(H * Sp, D, (G.KEYS_PER_CTA, D)), "v_desc": bf16(G.KEYS_PER_CTA),
                 "q_desc": i8(H * Sp, D, (G.QUERY_STEP, D)),
                 "b_desc": i8(H * D, Sp, (D, G.QUERY_STEP)) if part == 1 else bf16(G.QUERY_STEP),
                 "c_desc": i8(H * D, Sp, (D, G.QUERY_STEP)), "OUT": ("*bf16", True),
                 "ds_desc": ds if launch == "dk_store" else i8(H * Sp, D, (G.QUERY_STEP, D)),
                 "qk": ("fp32", False), "out_scale": ("fp32", False)}
        typed |= {n: ("*fp32", True) for n in ("SQ", "SK", "SDO", "LSE2", "DELTA", "RS", "SDS")}
        consts = dict(D=D, STAGES=cfg["STAGES"], PART=part, STORE=launch == "dk_store",
                      CONSUMER_REGS=cfg["CONSUMER_REGS"], LOADER_REGS=cfg["LOADER_REGS"])
        num_warps, maxnreg = 4, cfg["MAXNREG"]
    elif launch == "dq":
        cfg = dict(G.DQ_CONFIG) | dict(config or {})
        fn = G.gluon_dq_kernel
        typed = {"q_desc": i8(H * Sp, D, (G.QUERIES_PER_CTA, D)), "do_desc": bf16(G.QUERIES_PER_CTA),
                 "k_desc": i8(H * Sp, D, (G.KEY_STEP, D)), "v_desc": bf16(G.KEY_STEP),
                 "kt_desc": i8(H * D, Sp, (D, G.KEY_STEP)), "DQ": ("*bf16", True),
                 "qk": ("fp32", False), "sm_scale": ("fp32", False)}
        typed |= {n: ("*fp32", True) for n in ("SQ", "SK", "KMEAN", "LSE2", "DELTA")}
        consts = dict(D=D, STAGES=cfg["STAGES"], CORRECTION=True, LOADER_REGS=cfg["LOADER_REGS"])
        num_warps, maxnreg = 8, cfg["MAXNREG"]
    else:
        cfg = dict(G.DQ_CONFIG) | dict(config or {})
        fn = G.gluon_dqs_kernel
        typed = {"ds_desc": ds, "kt_desc": i8(H * D, Sp, (D, G.KEY_STEP)), "DQ": ("*bf16", True),
                 "sm_scale": ("fp32", False)}
        typed |= {n: ("*fp32", True) for n in ("SDS", "SK", "RS", "KMEAN")}
        consts = dict(D=D, STAGES=cfg["STORED_STAGES"], CORRECTION=True, CONSUMER_REGS=240, LOADER_REGS=24)
        num_warps, maxnreg = 4, 168
    ints = {k: v for k, v in ints.items() if k in fn.arg_names}
    src = GluonASTSource(fn=fn, **_specialize(fn.arg_names, consts, typed, ints))
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, maxnreg=maxnreg))


def gluon_sagebwd_facts(kernel) -> dict:
    """What a compiled Gluon ``sagebwd`` launch's SASS shows: shared memory, registers (the launch's
    cap; the partitions move theirs with ``setmaxnreg``), spill instructions, INT8 (IGMMA) and BF16
    (HGMMA) wgmma, and the waits for them. ``serialized``: a wait after every wgmma, which is what
    ptxas emits when it serializes them (its C7514 warning, e.g. when a product issued in an earlier
    iteration of a loop is read while a later one is in flight). ``igmma_register_a``: the INT8 wgmma
    whose A operand is in registers; ``sts``, ``shfl``: shared-memory stores and warp shuffles."""
    text, (ops, _, _, _), facts = _kernel_facts(kernel)
    gmma = sum(o.startswith(("IGMMA", "HGMMA")) for o in ops)
    waits = sum(o.startswith("WARPGROUP.DEPBAR") for o in ops)
    return dict(shared_kib=round(kernel.metadata.shared / 1024, 1), registers=facts.get("registers"),
                spill_instructions=facts["spill_instructions"], igmma=sum(o.startswith("IGMMA") for o in ops),
                hgmma=sum(o.startswith("HGMMA") for o in ops), waits=waits, serialized=waits >= gmma,
                igmma_register_a=len(re.findall(r"IGMMA\S*\s+R\d+,\s*R\d+,", text)),
                sts=sum(o.startswith("STS") for o in ops), shfl=sum(o.startswith("SHFL") for o in ops))


def _specialize(names, consts: dict, typed: dict, ints: dict) -> dict:
    """``signature``, ``constexprs`` and ``attrs`` of a kernel source as Triton's JIT derives them
    from a launch: ``consts`` are constexpr; ``typed`` names get their type (name → (type, marked
    16-divisible)); other arguments are integers (value from ``ints``, 0 when absent) — constexpr
    when equal to 1, otherwise ``i32``, marked 16-divisible when they are."""
    sig, constexprs, attrs = {}, {}, {}
    for i, n in enumerate(names):
        if n in consts:
            sig[n], constexprs[(i,)] = "constexpr", consts[n]
        elif n in typed:
            sig[n] = typed[n][0]
            if typed[n][1]:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif ints.get(n, 0) == 1:
            sig[n], constexprs[(i,)] = "constexpr", 1
        else:
            sig[n] = "i32"
            if ints.get(n, 0) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return dict(signature=sig, constexprs=constexprs, attrs=attrs)


def _cuda_tool(name: str, args: list[str], cubin: bytes) -> str:
    """The output of CUDA binary tool ``name`` (shipped in Triton's wheel) run on a cubin."""
    import triton  # noqa: PLC0415

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *args, f.name], capture_output=True, text=True, check=True).stdout


def disassemble(cubin: bytes) -> str:
    """``nvdisasm -c`` of a cubin, with the nvdisasm that ships in Triton's wheel."""
    return _cuda_tool("nvdisasm", ["-c"], cubin)


def _scan(text: str):
    """A disassembly's instructions in program order: (opcodes with their modifiers, the listing
    lines, label → index of the next instruction, loops as (first, end) indices of a branch back
    to an earlier label)."""
    ops: list[str] = []
    lines: list[str] = []
    labels: dict[str, int] = {}
    loops: list[tuple[int, int]] = []
    for line in text.splitlines():
        if m := _LABEL.match(line):
            labels[m.group(1)] = len(ops)
        elif m := _INSN.match(line):
            ops.append(m.group(2))
            lines.append(line)
            b = _BRANCH.search(line)
            if b and b.group(1) in labels:
                loops.append((labels[b.group(1)], len(ops)))
    return ops, lines, labels, loops


def parse(text: str) -> tuple[list[str], tuple[int, int] | None]:
    """Opcodes (without modifiers) in program order, and the main loop as (first, end) indices:
    of the loops, the one holding the most matrix-multiply instructions."""
    ops, _, _, loops = _scan(text)
    ops = [op.split(".")[0] for op in ops]
    mma = lambda r: sum(op in ("HGMMA", "HMMA", "UTCHMMA", "UTCQMMA", "UTCOMMA") for op in ops[r[0]:r[1]])  # noqa: E731
    loops = [r for r in loops if mma(r)]
    return ops, (max(loops, key=mma) if loops else None)


def summarize(kernel) -> Sass:
    ops, loop = parse(disassemble(kernel.asm["cubin"]))
    body = ops[loop[0]:loop[1]] if loop else []
    return Sass(num_warps=kernel.metadata.num_warps, total=len(ops), loop=len(body),
                loop_mix=collections.Counter(body),
                warp_specialize_ops=kernel.asm["ttgir"].count("ttg.warp_specialize"),
                setmaxnreg=kernel.asm["ptx"].count("setmaxnreg"))


def table(arch: int, variants: dict = VARIANTS) -> list[dict]:
    """One row per variant: loop length, per-score cost against the first variant, the mix."""
    rows, base = [], None
    for name, (mode, o2, ws) in variants.items():
        s = summarize(compile_forward(arch, mode, o2, ws))
        scores = 128 * 128 / (32 * s.num_warps)          # P elements per thread per key tile
        base = s.loop if base is None else base
        rows.append(dict(name=name, arch=arch, total=s.total, loop=s.loop,
                         per_score=(s.loop - base) / scores, warps=s.num_warps,
                         warp_specialize_ops=s.warp_specialize_ops, setmaxnreg=s.setmaxnreg,
                         loop_mix=dict(s.loop_mix.most_common(8))))
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'variant':32s} {'arch':>5} {'total':>6} {'loop':>5} {'+/score':>8} {'warps':>5} "
          f"{'WS ops':>6}  loop mix")
    for r in rows:
        mix = " ".join(f"{k}:{v}" for k, v in r["loop_mix"].items())
        print(f"{r['name']:32s} sm_{r['arch']:<2} {r['total']:>6} {r['loop']:>5} {r['per_score']:>8.2f} "
              f"{r['warps']:>5} {r['warp_specialize_ops']:>6}  {mix}")


def compile_gluon_forward(arch: int = 90, *, shape: tuple[int, int, int, int] = (1, 32760, 12, 128),
                          config: dict | None = None, method: str = "nvfp4"):
    """The Gluon forward (:func:`.gluon_fwd.gluon_attn_fwd_kernel`, or with ``method="sage3"``
    :func:`.gluon_fwd.gluon_sage3_fwd_kernel`) compiled for ``sm_<arch>`` as its launcher would
    compile it for contiguous (B, S, H, D) = ``shape`` tensors (the descriptor types are what
    Triton's JIT derives from host ``TensorDescriptor``s; integer arguments divisible by 16 are
    marked so). No GPU needed. Returns Triton's compiled kernel (``.asm``: ttgir, ptx, cubin)."""
    import torch  # noqa: PLC0415
    from triton.runtime.jit import mangle_type  # noqa: PLC0415

    from . import gluon_fwd as G  # noqa: PLC0415

    _check_gluon()

    cfg = dict(G.CONFIG)
    cfg.update(config or {})
    _, S, H, D = shape
    # a host descriptor over a small CPU tensor of the same head_dim gives the argument's type string
    desc_ty = mangle_type(G.tma_descriptor(torch.empty(1, G.BLOCK_N, 1, D, dtype=torch.bfloat16)))
    consts = dict(D=D, STAGES=cfg["STAGES"], CONSUMER_REGS=cfg["CONSUMER_REGS"],
                  LOADER_REGS=cfg["LOADER_REGS"])
    ints = dict(sob=S * H * D, sos=H * D, soh=D, H=H, Sq=S, Skv=S)
    typed = {"q_desc": (desc_ty, False), "k_desc": (desc_ty, False), "v_desc": (desc_ty, False),
             "O": ("*bf16", True), "qk_scale": ("fp32", False)}
    if method == "attnqat":
        from .gluon_fwd_qat import gluon_attnqat_fwd_kernel as fn  # noqa: PLC0415

        typed |= {n: ("*fp32", True) for n in ("O2", "LSE2", "M2")}
    else:
        fn = dict(nvfp4=G.gluon_attn_fwd_kernel, sage3=G.gluon_sage3_fwd_kernel)[method]
    if method == "sage3":
        typed["b_desc"] = (mangle_type(G.bias_descriptor(torch.empty(1, G.BIAS_PARTS, G.BLOCK_N,
                                                                     dtype=torch.bfloat16))), False)
    return _compile_gluon(fn, arch, consts, typed, ints, cfg["MAXNREG"])


def _kernel_facts(kernel):
    """A compiled kernel's disassembly, its :func:`_scan`, and the kernel-wide facts: instruction
    count, spill instructions (LDL/STL), the ``setmaxnreg`` values in the PTX, registers (cuobjdump)."""
    text = disassemble(kernel.asm["cubin"])
    scan = _scan(text)
    facts = dict(total=len(scan[0]), spill_instructions=sum(o.startswith(("LDL", "STL")) for o in scan[0]),
                 setmaxnreg=[int(v) for v in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                                        kernel.asm["ptx"])])
    if m := re.search(r"REG:(\d+)", _cuda_tool("cuobjdump", ["-res-usage"], kernel.asm["cubin"])):
        facts["registers"] = int(m.group(1))
    return text, scan, facts


def gluon_facts(kernel, head_dim: int, s_steps: int | None = None, pv_steps: int = 8) -> dict:
    """What the compiled Gluon forward's SASS shows: per consumer key loop (the innermost backward
    branch around HGMMA and exponentials: S_j = D/16 and PV_{j-1} = 8 HGMMA), its static length, the
    length of the ragged-tile mask block it branches over (so ``loop - mask`` instructions run per
    full tile), whether every HGMMA is issued before the softmax's first exponential with no wgmma
    wait after the exponentials start (PV in flight during the softmax), and the quantizer's
    rounding instructions; for the kernel, spills (LDL/STL), registers (cuobjdump) and the
    ``setmaxnreg`` values in the PTX. ``s_steps``: k-steps of S per tile (default head_dim/16; the
    sage3 kernel has one more, its correction row); ``pv_steps``: k-steps of the products with V
    (8; the attnqat forward's PV and ΔV: 16)."""
    text, (ops, lines, labels, loops), facts = _kernel_facts(kernel)
    facts["consumer_loops"] = []
    facts["max_register_index"] = max((int(r) for r in re.findall(r"\bR(\d+)\b", text)), default=-1)
    for a, e in loops:
        body = ops[a:e]
        # a key loop issues S_j (head_dim/16 k-steps) and PV_{j-1} (128/16); the mbarrier spin
        # loops' retry branches back into earlier code make larger spans, which hold more
        if sum(o.startswith("HGMMA") for o in body) != (s_steps or head_dim // 16) + pv_steps or "MUFU.EX2" not in body:
            continue
        ex2 = [i for i, o in enumerate(body) if o == "MUFU.EX2"]
        hg = [i for i, o in enumerate(body) if o.startswith("HGMMA")]
        waits = [i for i, o in enumerate(body) if o.startswith("WARPGROUP.DEPBAR")]
        # the mask block: a forward branch inside the loop over the FSEL …, -INF selects
        mask = 0
        for i in range(a, e):
            b = _BRANCH.search(lines[i])
            if b and b.group(1) in labels and i < labels[b.group(1)] <= e:
                skipped = lines[i + 1:labels[b.group(1)]]
                if sum("FSEL" in s and "-INF" in s for s in skipped) >= 32:
                    mask = len(skipped) + 1
        facts["consumer_loops"].append(dict(
            loop=len(body), mask_block=mask, per_full_tile=len(body) - mask,
            hgmma=len(hg), warpgroup_arrive=sum(o == "WARPGROUP.ARRIVE" for o in body),
            waits=len(waits), last_hgmma=max(hg), first_ex2=min(ex2), last_ex2=max(ex2),
            waits_after_first_ex2=sum(w > min(ex2) for w in waits),
            e2m1_magic_ffma=sum("6291456" in s for s in lines[a:e]),
            exponent_mask_lop3=sum("0x7f800000" in s for s in lines[a:e]),
            rcp=sum(o == "MUFU.RCP" for o in body),
            spill_instructions=sum(o.startswith(("LDL", "STL")) for o in body),
            mix=dict(collections.Counter(o.split(".")[0] for o in body).most_common(12))))
    return facts


def _check_gluon() -> None:
    import triton  # noqa: PLC0415

    from .gluon_fwd import GLUON_IMPORT_ERROR  # noqa: PLC0415

    if GLUON_IMPORT_ERROR is not None:
        raise RuntimeError(f"triton {triton.__version__} has no usable Gluon ({GLUON_IMPORT_ERROR})")
    _check_compiled()


def _compile_gluon(fn, arch: int, consts: dict, typed: dict, ints: dict, maxnreg: int):
    """Gluon kernel ``fn`` compiled for ``sm_<arch>`` (4 warps in the default partition) from its
    launch's argument types (:func:`_specialize`)."""
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.experimental.gluon._runtime import GluonASTSource  # noqa: PLC0415

    src = GluonASTSource(fn=fn, **_specialize(fn.arg_names, consts, typed, ints))
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4, maxnreg=maxnreg))


def _gluon_bwd_types(D: int, q_rows: int, k_rows: int) -> dict:
    """Argument types of the backward Gluon kernels' descriptors (Q/dO boxes of ``q_rows`` rows,
    K/V of ``k_rows``) and scales, as Triton's JIT derives them from the launchers' host objects."""
    import torch  # noqa: PLC0415
    from triton.runtime.jit import mangle_type  # noqa: PLC0415

    from .gluon_fwd import tma_descriptor  # noqa: PLC0415

    t = torch.empty(1, max(q_rows, k_rows), 1, D, dtype=torch.bfloat16)
    q_ty, k_ty = (mangle_type(tma_descriptor(t, rows)) for rows in (q_rows, k_rows))
    return {"q_desc": (q_ty, False), "do_desc": (q_ty, False), "k_desc": (k_ty, False), "v_desc": (k_ty, False),
            "qk_scale": ("fp32", False), "sm_scale": ("fp32", False)}


def compile_gluon_dkdv(arch: int = 90, *, shape: tuple[int, int, int, int] = (1, 32760, 12, 128),
                       config: dict | None = None, quant_p: bool = True):
    """The Gluon dK/dV kernel (:func:`.gluon_bwd.gluon_dkdv_kernel`; ``quant_p``: attnqat, else
    dropin) compiled for ``sm_<arch>`` as :func:`.gluon_bwd.gluon_dkdv` compiles it for contiguous
    (B, S, H, D) = ``shape`` tensors. No GPU needed."""
    from . import gluon_bwd as GB  # noqa: PLC0415

    _check_gluon()

    cfg = dict(GB.CONFIG)
    cfg.update(config or {})
    _, S, H, D = shape
    consts = dict(D=D, STAGES=cfg["STAGES"], QUANT_P=quant_p, CONSUMER_REGS=cfg["CONSUMER_REGS"],
                  LOADER_REGS=cfg["LOADER_REGS"])
    ints = dict(sdkb=S * H * D, sdks=H * D, sdkh=D, sdvb=S * H * D, sdvs=H * D, sdvh=D, H=H, Sq=S, Skv=S)
    typed = _gluon_bwd_types(D, GB.QUERY_BLOCK, GB.KEYS_PER_CTA)
    typed |= {n: ("*bf16", True) for n in ("DK", "DV")} | {n: ("*fp32", True) for n in ("LSE2", "M2", "DELTA")}
    return _compile_gluon(GB.gluon_dkdv_kernel, arch, consts, typed, ints, cfg["MAXNREG"])


def compile_gluon_dq(arch: int = 90, *, shape: tuple[int, int, int, int] = (1, 32760, 12, 128),
                     config: dict | None = None):
    """The Gluon dQ kernel (:func:`.gluon_bwd.gluon_dq_kernel`) compiled for ``sm_<arch>`` as
    :func:`.gluon_bwd.gluon_dq` compiles it for contiguous (B, S, H, D) = ``shape`` tensors."""
    from . import gluon_bwd as GB  # noqa: PLC0415

    _check_gluon()

    cfg = dict(GB.DQ_CONFIG)
    cfg.update(config or {})
    _, S, H, D = shape
    consts = dict(D=D, STAGES=cfg["STAGES"], CONSUMER_REGS=cfg["CONSUMER_REGS"], LOADER_REGS=cfg["LOADER_REGS"])
    ints = dict(sdqb=S * H * D, sdqs=H * D, sdqh=D, H=H, Sq=S, Skv=S)
    typed = _gluon_bwd_types(D, GB.QUERIES_PER_CTA, GB.KEY_BLOCK)
    typed |= {"DQ": ("*bf16", True), "LSE2": ("*fp32", True), "DELTA": ("*fp32", True)}
    return _compile_gluon(GB.gluon_dq_kernel, arch, consts, typed, ints, cfg["MAXNREG"])


def _innermost_loops(ops, loops, hgmma: int) -> list[tuple[int, int]]:
    """The backward kernels' consumer loops among :func:`_scan`'s backward-branch spans: those with
    ``hgmma`` HGMMA and exponentials, the shortest disjoint ones (an mbarrier wait's out-of-line
    retry jumps back across a loop and makes larger, overlapping spans), in program order."""
    spans = [(a, e) for a, e in loops
             if sum(o.startswith("HGMMA") for o in ops[a:e]) == hgmma and "MUFU.EX2" in ops[a:e]]
    kept = []
    for a, e in sorted(spans, key=lambda ae: ae[1] - ae[0]):
        if all(e <= a2 or e2 <= a for a2, e2 in kept):
            kept.append((a, e))
    return sorted(kept)


def gluon_dkdv_facts(kernel, head_dim: int) -> dict:
    """What the compiled Gluon dK/dV kernel's SASS shows: per consumer query loop (the conditional
    branch back around S_i and dP_i (head_dim/16 k-steps each), dV and dK (64 queries / 16 k-steps each) and the
    exponentials) its length, HGMMA, wgmma waits (2 when ptxas kept the products asynchronous: S_i,
    then dP_i; a serialized loop waits after every HGMMA) and spill instructions; for the kernel,
    registers, spills and the ``setmaxnreg`` values."""
    _, (ops, _, _, loops), facts = _kernel_facts(kernel)
    facts["query_loops"] = []
    per_block = 2 * (head_dim // 16) + 2 * (64 // 16)
    for a, e in _innermost_loops(ops, loops, per_block):
        body = ops[a:e]
        facts["query_loops"].append(dict(
            loop=len(body), hgmma=per_block, waits=sum(o.startswith("WARPGROUP.DEPBAR") for o in body),
            spill_instructions=sum(o.startswith(("LDL", "STL")) for o in body),
            ex2=sum(o == "MUFU.EX2" for o in body),
            mix=dict(collections.Counter(o.split(".")[0] for o in body).most_common(12))))
    return facts


def gluon_dq_facts(kernel, head_dim: int) -> dict:
    """What the compiled Gluon dQ kernel's SASS shows: per consumer key loop (the conditional branch
    back around S_j and dP_j (head_dim/16 k-steps each), dQ (64 keys / 16 k-steps) and the
    exponentials) its length, HGMMA, wgmma waits and whether the wait for dP comes after the first
    exponential (the exponentials overlap dP), spill instructions; kernel-wide facts as
    :func:`gluon_dkdv_facts`."""
    _, (ops, _, _, loops), facts = _kernel_facts(kernel)
    facts["key_loops"] = []
    per_block = 2 * (head_dim // 16) + 64 // 16
    for a, e in _innermost_loops(ops, loops, per_block):
        body = ops[a:e]
        waits = [i for i, o in enumerate(body) if o.startswith("WARPGROUP.DEPBAR")]
        first_ex2 = body.index("MUFU.EX2")
        facts["key_loops"].append(dict(
            loop=len(body), hgmma=per_block, waits=len(waits), waits_after_first_ex2=sum(w > first_ex2 for w in waits),
            spill_instructions=sum(o.startswith(("LDL", "STL")) for o in body),
            ex2=sum(o == "MUFU.EX2" for o in body)))
    return facts


def gluon_report(arch: int = 90, head_dims: tuple[int, ...] = (64, 128)) -> dict:
    """{head_dim: :func:`gluon_facts` of the Gluon nvfp4 forward, plus ``sage3``: the same facts of
    the Gluon sage3 forward (one more k-step of S per tile, its correction row), ``attnqat``: of
    the Gluon attnqat forward (PV and ΔV: 16 k-steps), ``dq``: :func:`gluon_dq_facts` of the Gluon
    dQ kernel, ``dkdv``:
    :func:`gluon_dkdv_facts` of the attnqat dK/dV kernel (its ``triton_loop``: the Triton dK/dV
    kernel's default loop, per 64 × 64 tile on 4 warps); ``triton_loop``: the
    key loop length of the Triton kernel of the same method (sage3: with its correction row)
    compiled with the same Triton}; a kernel that does not compile reports ``error``. No GPU needed."""
    import triton  # noqa: PLC0415

    report = {}
    for D in head_dims:
        facts = {}
        for method in ("nvfp4", "sage3", "attnqat"):
            try:
                f = gluon_facts(compile_gluon_forward(arch, shape=(1, 32760, 12, D), method=method), D,
                                D // 16 + (method == "sage3"), 16 if method == "attnqat" else 8)
            except Exception as exc:  # noqa: BLE001 - reported
                f = dict(error=f"{type(exc).__name__}: {exc}")
            if "error" not in f:
                sage3 = method == "sage3"
                f["triton_loop"] = summarize(compile_forward(arch, 2 if sage3 else 1, shape=(1, 32760, 12, D),
                                                             has_bias=sage3, need_o2=method == "attnqat")).loop
            facts.update(f) if method == "nvfp4" else facts.update({method: f})
        try:
            facts["dkdv"] = gluon_dkdv_facts(compile_gluon_dkdv(arch, shape=(1, 32760, 12, D)), D)
            facts["dkdv"]["triton_loop"] = summarize(compile_dkdv(arch, True, shape=(1, 32760, 12, D))).loop
        except Exception as exc:  # noqa: BLE001 - reported
            facts["dkdv"] = dict(error=f"{type(exc).__name__}: {exc}")
        try:
            facts["dq"] = gluon_dq_facts(compile_gluon_dq(arch, shape=(1, 32760, 12, D)), D)
        except Exception as exc:  # noqa: BLE001 - reported
            facts["dq"] = dict(error=f"{type(exc).__name__}: {exc}")
        facts["triton"] = triton.__version__
        report[D] = facts
    return report


def print_gluon(report: dict) -> None:
    """One line per head_dim, kernel and consumer of :func:`gluon_report`: its loop's length against
    the Triton kernel's loop of the same method, the wgmma groups and waits, registers and spills."""
    for D, facts in report.items():
        for method, f in (("nvfp4", facts), ("sage3", facts.get("sage3", {})), ("attnqat", facts.get("attnqat", {}))):
            if "error" in f:
                print(f"gluon {method} D={D}: does not compile under triton {facts['triton']}: {f['error'][:200]}")
                continue
            for i, lp in enumerate(f.get("consumer_loops", [])):
                print(f"gluon {method} D={D} consumer {i}: {lp['per_full_tile']} instructions per full key "
                      f"tile (Triton {method} loop {f['triton_loop']}), {lp['hgmma']} HGMMA, {lp['waits']} "
                      f"waits ({lp['waits_after_first_ex2']} after the first exponential), "
                      f"{f['registers']} registers, {lp['spill_instructions']} spill instructions in the loop "
                      f"({f['spill_instructions']} in the kernel), setmaxnreg {f['setmaxnreg']}")
        for name, key, loops, what in (("dK/dV", "dkdv", "query_loops", "per 64 x 64 block (Triton dK/dV loop {triton_loop} "
                                        "per 64 x 64 tile)"),
                                       ("dQ", "dq", "key_loops", "per 64 x 64 block")):
            f = facts.get(key, {})
            if "error" in f:
                print(f"gluon {name} D={D}: does not compile under triton {facts['triton']}: {f['error'][:200]}")
                continue
            for i, lp in enumerate(f.get(loops, [])):
                after = f" ({lp['waits_after_first_ex2']} after the first exponential)" if "waits_after_first_ex2" in lp else ""
                print(f"gluon {name} D={D} consumer {i}: {lp['loop']} instructions {what.format(**f)}, "
                      f"{lp['hgmma']} HGMMA, {lp['waits']} waits{after}, {lp['spill_instructions']} spill "
                      f"instructions in the loop ({f['spill_instructions']} in the kernel), {f['registers']} "
                      f"registers, setmaxnreg {f['setmaxnreg']}")


__all__ = ["VARIANTS", "Sass", "compile_dkdv", "compile_forward", "dkdv_table", "compile_gluon_dkdv",
           "compile_gluon_forward", "compile_gluon_dq", "disassemble", "gluon_dkdv_facts", "gluon_dq_facts", "gluon_facts", "gluon_report", "parse", "print_gluon", "print_table", "summarize", "table"]
