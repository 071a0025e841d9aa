"""Worker processes of tests/test_parallel.py (module level so that torch.multiprocessing can
spawn them): each rank computes the one-process result itself, then the sequence-parallel one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

#: a small Wan transformer with 4 heads (sp 2 and 4 divide them) and head_dim 32 (two FP4 blocks)
CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=16,
              out_channels=16, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
              cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
#: (batch, channels, latent frames, height, width): 2 × 8 × 8 = 128 tokens
LATENT = (2, 16, 2, 16, 16)
TEXT = (2, 12, 32)


def init(rank: int, world: int, store_path: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def model(seed: int = 0):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(**CONFIG).float()


def inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(LATENT, generator=g)
    text = torch.randn(TEXT, generator=g)
    t = torch.tensor([300.0, 700.0])
    target = torch.randn(LATENT, generator=g)
    return x, t, text, target


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def forward_backward(rank: int, world: int, store_path: str, out_path: str,
                     cases: list[tuple[str, str, bool]]) -> None:
    """sp = ``world`` against sp = 1 for each (method, fp4 scope, backward) of ``cases``; rank 0
    writes {"method/scope": {"out": rel, "grads": max rel, ...}}."""
    init(rank, world, store_path)
    try:
        every = {f"{m}/{sc}": _case(m, sc, bw) for m, sc, bw in cases}
        if rank == 0:
            Path(out_path).write_text(json.dumps(every))
    finally:
        dist.destroy_process_group()


def _case(method: str, scope: str, backward: bool) -> dict:
    from attnqat.parallel import enable_sequence_parallel
    from attnqat.wan import install_attention

    x, t, text, target = inputs()
    results = {}
    ref = model()
    install_attention(ref, method, fp4_scope=scope, backend="torch", timing=False)
    ref.requires_grad_(backward)
    with torch.set_grad_enabled(backward):
        y_ref = ref(x, t, text, return_dict=False)[0]
        if backward:
            ((y_ref - target) ** 2).mean().backward()
    sp = model()
    proc = install_attention(sp, method, fp4_scope=scope, backend="torch", timing=False)
    handle = enable_sequence_parallel(sp, dist.group.WORLD)
    seen = set()
    proc.observer = lambda q, k, v, o, kind: seen.add((kind, tuple(q.shape), tuple(k.shape)))
    sp.requires_grad_(backward)
    with torch.set_grad_enabled(backward):
        y = sp(x, t, text, return_dict=False)[0]
        if backward:
            ((y - target) ** 2).mean().backward()
    results["out"] = rel(y.detach(), y_ref.detach())
    results["calls"] = dict(proc.calls)
    results["seen"] = sorted(seen)
    proc.observer = None
    if backward:
        worst, name = 0.0, ""
        for (n, p), (_, q) in zip(sp.named_parameters(), ref.named_parameters()):
            gsum = p.grad.clone()
            dist.all_reduce(gsum)          # the group's partial gradients sum to the gradient
            r = rel(gsum, q.grad)
            if r > worst:
                worst, name = r, n
        results["grads"] = worst
        results["worst"] = name
    handle.remove()
    y1 = sp(x, t, text, return_dict=False)[0]     # removed: the one-process model again
    results["removed"] = rel(y1.detach(), y_ref.detach())
    return results
