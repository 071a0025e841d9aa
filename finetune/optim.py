"""A memory-lean AdamW: the moments of every matrix in 8 bits (2 bytes a parameter instead of 8).

:class:`AdamW8bit` is AdamW (decoupled weight decay, bias correction) whose state per matrix
parameter is

* ``m_q`` int8 and ``m_scale`` float32: the first moment, linear in blocks of :data:`BLOCK` values
  along the last dimension, each block scaled by its largest magnitude;
* ``v_q`` uint8 and ``v_scale`` float32: the *square root* of the second moment, likewise (the
  root halves the moment's dynamic range in the log domain, which a linear 8-bit code needs).

Each step dequantizes a parameter's moments to float32, updates them exactly as AdamW does, applies
the update and quantizes them back with **stochastic rounding**: the second moment moves by
(1 − β2) = 0.1 % a step, below an 8-bit code's resolution, and rounding to nearest would freeze it;
rounded stochastically, its expectation follows the float32 moment. Vectors (biases, norms: a
negligible share of the parameters) keep float32 moments.

The states are laid out like their parameter along dimension 0 (blocks run along the last
dimension), so under FSDP2 they are DTensors sharded as the parameter is and
``torch.distributed.checkpoint`` saves and re-shards them like AdamW's.
"""

from __future__ import annotations

import math

import torch

BLOCK = 128


def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` (rows, cols) as (rows, nblocks, BLOCK), zero-padded; and the padding."""
    rows, cols = x.shape
    pad = (-cols) % BLOCK
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(rows, -1, BLOCK), pad


def quantize(x: torch.Tensor, signed: bool, gen: torch.Generator | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) float32 → (codes (rows, cols) int8/uint8, scales (rows, nblocks)), stochastic
    rounding."""
    rows, cols = x.shape
    b, _ = _blocks(x)
    top = 127.0 if signed else 255.0
    scale = b.abs().amax(dim=-1).clamp_min(1e-30) / top
    y = b / scale.unsqueeze(-1)
    noise = torch.rand(y.shape, generator=gen, device=y.device, dtype=y.dtype)
    q = torch.floor(y + noise).clamp_(-top if signed else 0.0, top)
    q = q.view(rows, -1)[:, :cols].to(torch.int8 if signed else torch.uint8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    b, _ = _blocks(q.float())
    return (b * scale.unsqueeze(-1)).view(rows, -1)[:, :cols]


def _like(param: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` (laid out like the local shard of ``param`` along dim 0) as a DTensor sharded as
    ``param`` is, or itself when ``param`` is a plain tensor. ``t`` stays where it is: under FSDP2's
    CPU offload the parameter's shard is in CPU memory on a CUDA mesh, and so is its state
    (``DTensor.from_local`` would move it to the mesh's device; FSDP2 builds its own DTensors
    this way too)."""
    if not hasattr(param, "to_local"):
        return t
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    shape = torch.Size((param.shape[0], *t.shape[1:]))
    meta = TensorMeta(shape, torch.empty(shape, device="meta").stride(), t.dtype)
    return DTensor(t, DTensorSpec(param.device_mesh, tuple(param.placements), tensor_meta=meta),
                   requires_grad=False)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class AdamW8bit(torch.optim.Optimizer):
    """AdamW with 8-bit moments for matrices (module docstring). Same arguments as
    ``torch.optim.AdamW`` (no amsgrad)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, seed: int = 0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._seed = seed

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for gi, group in enumerate(self.param_groups):
            b1, b2 = group["betas"]
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                g = _local(p.grad).float()
                w = _local(p)
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    if w.dim() >= 2 and w.numel() > 0:
                        rows = w.shape[0]
                        nb = math.ceil(w[0].numel() / BLOCK)
                        z8 = torch.zeros(rows, w[0].numel(), dtype=torch.int8, device=w.device)
                        zs = torch.zeros(rows, nb, dtype=torch.float32, device=w.device)
                        st["m_q"], st["m_scale"] = _like(p, z8), _like(p, zs)
                        st["v_q"], st["v_scale"] = _like(p, z8.to(torch.uint8)), _like(p, zs.clone())
                    else:
                        st["m"] = _like(p, torch.zeros_like(w, dtype=torch.float32))
                        st["v"] = _like(p, torch.zeros_like(w, dtype=torch.float32))
                st["step"] += 1
                t = float(st["step"])
                if "m_q" in st:
                    shape = w.shape
                    g2 = g.reshape(shape[0], -1)
                    m = dequantize(_local(st["m_q"]), _local(st["m_scale"]))
                    v = dequantize(_local(st["v_q"]), _local(st["v_scale"])).square_()
                else:
                    g2, m, v = g, _local(st["m"]), _local(st["v"])
                m.mul_(b1).add_(g2, alpha=1 - b1)
                v.mul_(b2).addcmul_(g2, g2, value=1 - b2)
                denom = (v / (1 - b2 ** t)).sqrt_().add_(group["eps"])
                update = (m / (1 - b1 ** t)) / denom
                if group["weight_decay"]:
                    w.mul_(1 - group["lr"] * group["weight_decay"])
                w.add_(update.view(w.shape).to(w.dtype), alpha=-group["lr"])
                if "m_q" in st:
                    # the rounding noise of (step, parameter): the same after a resume
                    gen = torch.Generator(device=w.device).manual_seed(
                        hash((self._seed, int(t), gi, pi)) & 0x7FFFFFFF)
                    for name, val, signed in (("m", m, True), ("v", v.sqrt_(), False)):
                        q, s = quantize(val, signed, gen)
                        _local(st[f"{name}_q"]).copy_(q)
                        _local(st[f"{name}_scale"]).copy_(s)
        return loss

    def state_bytes(self) -> int:
        """Bytes the optimizer state holds on this rank."""
        return sum(_local(v).numel() * _local(v).element_size()
                   for st in self.state.values() for v in st.values() if torch.is_tensor(v))


__all__ = ["AdamW8bit", "BLOCK", "dequantize", "quantize"]
