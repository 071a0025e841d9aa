"""The device mesh of a fine-tuning run: replicate × shard × sp (HSDP and Ulysses sequence
parallelism), set up on top of :func:`attnqat.finetune.distributed.init`.

``world = replicate × shards × sp`` ranks, laid out as ``rank = (r · shards + s) · sp + p``:

* the ``sp`` consecutive ranks of one sequence-parallel group hold the same clips and draw the same
  noise (they share a data rank, ``rank // sp``), each keeping ``S/sp`` tokens of every clip
  (:mod:`attnqat.parallel`);
* FSDP2 ``fully_shard`` runs on the mesh ``(replicate, shards · sp)``: parameters, gradients and
  optimizer state are sharded over the ``shards · sp`` ranks of a replica (the ranks of an sp group
  are in one shard group, as DeepSpeed-Ulysses and FastVideo lay them out) and replicated over the
  ``replicate`` replicas (HSDP: the gradient reduce-scatter inside a replica, an all-reduce across
  replicas — one machine per replica keeps the big traffic on NVLink). With ``replicate == 1`` it is
  the plain 1-D FSDP of one machine;
* global batch = replicas × shards × per-GPU batch × accumulation (the sp ranks add no clips).

FSDP averages gradients over every rank; the sp ranks of a group hold partial sums of one clip's
gradient, so training multiplies the loss by ``sp`` (:func:`attnqat.parallel.sp_loss_scale`).
DCP checkpoints hold whole tensors by name, so a run resumes on any mesh whose global batch divides
its data position.
"""

from __future__ import annotations

import argparse

from .distributed import DistContext


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("several GPUs (under torchrun)")
    g.add_argument("--sp", type=int, help="Ulysses sequence-parallel degree: each clip's tokens split "
                   "over this many GPUs, which share data and noise; divides the heads (1.3B: 12, "
                   "14B: 40) and the token count [1]")
    g.add_argument("--replicate", type=int, help="HSDP replicas (e.g. one per machine): the model "
                   "is sharded inside a replica and replicated across replicas [1]")


def setup(ctx: DistContext, sp: int | None, replicate: int | None) -> DistContext:
    """Check the degrees against the world and put the FSDP mesh and the sp group on ``ctx``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from attnqat.parallel import SPGroup

    sp, replicate = sp or 1, replicate or 1
    for name, v in (("--sp", sp), ("--replicate", replicate)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if ctx.world % (sp * replicate):
        raise ValueError(f"--replicate {replicate} × --sp {sp} does not divide the {ctx.world} "
                         "processes (world = replicate × shards × sp)")
    if sp == 1 and replicate == 1:
        return ctx
    shard_sp = ctx.world // replicate
    if replicate > 1:
        ctx.mesh = init_device_mesh(ctx.device.type, (replicate, shard_sp),
                                    mesh_dim_names=("replicate", "shard"))
    if sp > 1:
        mesh = init_device_mesh(ctx.device.type, (ctx.world // sp, sp), mesh_dim_names=("data", "sp"))
        ctx.sp_group = SPGroup(group=mesh.get_group("sp"), size=sp, rank=ctx.rank % sp)
        assert dist.get_rank(ctx.sp_group.group) == ctx.sp_group.rank
    ctx.sp, ctx.replicate = sp, replicate
    return ctx


def describe(ctx: DistContext, batch_size: int, grad_accum: int) -> str:
    """One line: the mesh and how the global batch is made."""
    shards = ctx.world // (ctx.replicate * ctx.sp)
    gb = ctx.replicate * shards * batch_size * grad_accum
    return (f"mesh: {ctx.world} process(es) = replicate {ctx.replicate} × shard {shards} × sp "
            f"{ctx.sp}; global batch {gb} = {ctx.replicate} replica(s) × {shards} shard(s) × "
            f"{batch_size} per GPU × {grad_accum} accumulation")


def apply_sp(model, ctx: DistContext) -> None:
    """Sequence parallelism on the student transformer when ``--sp`` > 1 (processor installed)."""
    if ctx.sp > 1:
        from attnqat.parallel import enable_sequence_parallel

        enable_sequence_parallel(model, ctx.sp_group)


__all__ = ["add_arguments", "apply_sp", "describe", "setup"]
