"""Processes, devices and sharding: one code path from one CPU process to many GPUs.

Every run holds a process group, also a single process (a world of one, on an in-memory store), so
the model is always wrapped the same way and checkpoints are always
``torch.distributed.checkpoint`` folders that resume on any number of processes:

* started by ``torchrun`` (``WORLD_SIZE`` etc. in the environment): one process per GPU
  (``cuda:LOCAL_RANK``, NCCL), or CPU processes with gloo when CUDA is unavailable or
  ``--device cpu`` is asked for;
* started plainly: a world of one on ``--device``.

Sharding (:func:`shard_transformer`): FSDP2, ``fully_shard`` on every ``WanTransformerBlock`` (the
unit diffusers lists in ``_no_split_modules``), then on the root for the remaining parameters
(patch embedding, condition embedder, output head). Master weights, gradients and optimizer state
are float32 and sharded. In ``bf16`` precision the blocks gather their parameters as bfloat16
(``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``, inputs not cast: the
timestep embedding and RoPE tables stay float32) and the forward runs under bfloat16 autocast;
the root's small parameters are gathered in float32. In ``fp32`` precision nothing is cast.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

PRECISIONS = ("bf16", "fp32")


@dataclass
class DistContext:
    """Where this process stands: ``rank`` of ``world``, its ``device``, the 1-D device ``mesh``."""

    rank: int
    world: int
    device: torch.device
    backend: str
    mesh: object
    launched: bool   # started by torchrun (else a world of one made here)
    sp: int = 1            # Ulysses degree and group (finetune/mesh.py); replicas of HSDP
    sp_group: object = None
    replicate: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """Which share of the data this rank reads (the ranks of one sp group read the same)."""
        return self.rank // self.sp

    @property
    def data_world(self) -> int:
        return self.world // self.sp


def init(device: str = "auto") -> DistContext:
    """Join (torchrun) or create (single process) the process group; see the module docstring."""
    from torch.distributed.device_mesh import init_device_mesh

    from attnqat.wan import resolve_device

    launched = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    if launched:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        want = str(device)
        if want == "auto":
            want = "cuda" if torch.cuda.is_available() else "cpu"
        if want.startswith("cuda"):
            dev = resolve_device(f"cuda:{local}")
            torch.cuda.set_device(dev)
        else:
            dev = resolve_device("cpu")
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend, device_id=dev if dev.type == "cuda" else None)
    else:
        dev = resolve_device(device)
        if dev.type == "cuda":
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(dev)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(dev.type, (world,))
    return DistContext(rank=rank, world=world, device=dev, backend=backend, mesh=mesh,
                       launched=launched)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def shard_transformer(transformer: torch.nn.Module, ctx: DistContext, precision: str,
                      offload: bool = False) -> None:
    """Apply FSDP2 to a ``WanTransformer3DModel`` in place (module docstring). The parameters must
    be float32 (the master weights) and on ``ctx.device``, or with ``offload`` on the CPU, where
    FSDP2's ``CPUOffloadPolicy`` keeps them, their gradients and the optimizer state."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {', '.join(PRECISIONS)}")
    if precision == "bf16":
        blocks = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                      cast_forward_inputs=False)
    else:
        blocks = MixedPrecisionPolicy()
    root = MixedPrecisionPolicy(reduce_dtype=torch.float32) if precision == "bf16" else MixedPrecisionPolicy()
    where = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") if offload else OffloadPolicy()
    for block in transformer.blocks:
        fully_shard(block, mesh=ctx.mesh, mp_policy=blocks, offload_policy=where)
    fully_shard(transformer, mesh=ctx.mesh, mp_policy=root, offload_policy=where)


def all_sum(values: list[float] | torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum a small float vector over the ranks (float64 on the device)."""
    t = torch.as_tensor(values, dtype=torch.float64, device=ctx.device).clone()
    if ctx.world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_max(values: list[float] | torch.Tensor, ctx: DistContext) -> torch.Tensor:
    t = torch.as_tensor(values, dtype=torch.float64, device=ctx.device).clone()
    if ctx.world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def barrier(ctx: DistContext) -> None:
    if ctx.world > 1:
        dist.barrier()


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a ``DTensor``, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


__all__ = ["DistContext", "PRECISIONS", "all_max", "all_sum", "barrier", "init", "local",
           "shard_transformer", "shutdown"]
