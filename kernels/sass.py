"""The forward kernel's machine code for a GPU architecture, compiled on any machine (no GPU).

Triton compiles for a target it is told (``GPUTarget("cuda", 90, 32)``), and its wheel carries
``ptxas`` and ``nvdisasm``, so the SASS a Hopper or Blackwell GPU would run can be read on the CPU
machine: the instruction mix, the main loop's length (the instructions every thread executes per
key tile), and whether Triton warp-specialized the loop (``ttg.warp_specialize`` in its GPU IR,
``setmaxnreg`` in the PTX). ``attnqat bench kernels --sass ARCH`` prints the table of
:data:`VARIANTS`; docs/kernels_notes.md records what it showed.
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
_INSN = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")
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
                    num_warps: int = 8, num_stages: int = 3):
    """``attn_fwd_kernel`` with BF16 operands (formulation 0, BN = 128 keys) compiled for
    ``sm_<arch>`` as the launcher would compile it for contiguous (B, S, H, D) = ``shape`` tensors:
    Triton's JIT specializes integer arguments equal to 1 as constants and marks pointers and
    integers divisible by 16 (which is what lets it prove contiguous, aligned loads), so the same
    is done here from the shape's strides. Returns Triton's compiled kernel (``.asm``: ttgir, ptx,
    cubin)."""
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    from .attention_fwd import attn_fwd_kernel  # noqa: PLC0415
    from .quantize import INTERPRET  # noqa: PLC0415

    if INTERPRET:
        raise RuntimeError("TRITON_INTERPRET is set: the kernels are interpreted Python then, "
                           "not compiled; unset it to read their machine code")
    B, S, H, D = shape
    consts = dict(D=D, BM=BM, BN=128, P_MODE=p_mode, NEED_O2=need_o2, HAS_BIAS=False,
                  STORE_STATS=need_o2, FORMULATION=0, WARP_SPEC=warp_spec)
    pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "O2": "*fp32", "LSE2": "*fp32",
                "M2": "*fp32", "BIAS": "*fp32", "Qc": "*u8", "Qs": "*u8", "Kc": "*u8", "Ks": "*u8",
                "Vc": "*u8", "Vs": "*u8"}
    ints = {"H": H, "Sq": S, "Skv": S, "n_qblk_bias": 0}
    for t in "qkvo":   # (B, S, H, D) strides of Q, K, V, O; the packed operands' strides are unused (0)
        ints.update(zip((f"s{t}b", f"s{t}s", f"s{t}h", f"s{t}d"), (S * H * D, H * D, D, 1)))
    names = attn_fwd_kernel.arg_names
    sig, constexprs, attrs = {}, {}, {}
    for i, n in enumerate(names):
        value = consts.get(n, ints.get(n, 0))
        if n in consts or (n not in pointers and n != "qk_scale" and value == 1):
            sig[n], constexprs[(i,)] = "constexpr", value
        elif n in pointers:
            sig[n], attrs[(i,)] = pointers[n], [["tt.divisibility", 16]]
        elif n == "qk_scale":
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=attn_fwd_kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def disassemble(cubin: bytes) -> str:
    """``nvdisasm -c`` of a cubin, with the nvdisasm that ships in Triton's wheel."""
    import triton  # noqa: PLC0415

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout


def parse(text: str) -> tuple[list[str], tuple[int, int] | None]:
    """Opcodes in program order, and the main loop as (first, end) indices: of the loops (a branch
    back to an earlier label), the one holding the most matrix-multiply instructions."""
    ops: list[str] = []
    labels: dict[str, int] = {}
    loops: list[tuple[int, int]] = []
    for line in text.splitlines():
        if m := _LABEL.match(line):
            labels[m.group(1)] = len(ops)
        elif m := _INSN.match(line):
            ops.append(m.group(2).split(".")[0])
            b = _BRANCH.search(line)
            if b and b.group(1) in labels:
                loops.append((labels[b.group(1)], len(ops)))
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


__all__ = ["VARIANTS", "Sass", "compile_forward", "disassemble", "parse", "print_table", "summarize", "table"]
