"""Ulysses sequence parallelism for Wan's transformer: the sequence split over ``sp`` ranks, an
all-to-all to heads around every attention call.

Outside attention every layer of a Wan block works token by token (projections, RMSNorm across
heads, RoPE, the feed-forward, the modulation), so each of the ``sp`` ranks of a sequence-parallel
group keeps ``S/sp`` tokens of every clip. Around each attention call
(:class:`attnqat.wan.AttnQATProcessor` with ``sp_group`` set):

* self-attention: Q, K, V go from (B, S/sp, H, D) to (B, S, H/sp, D) by one all-to-all each
  (:func:`seq_to_heads`), the project's unchanged :func:`attnqat.attention` runs on the whole
  sequence for this rank's heads, and the output comes back to (B, S/sp, H, D)
  (:func:`heads_to_seq`);
* cross-attention: only the queries (and the output) move; the text keys and values are the same on
  every rank (the prompt is not split), so each rank takes its heads' slice of them.

Every method computes each head on its own and quantizes in blocks that lie inside one head (along
head_dim, along keys, along query tokens of the whole sequence), so a rank that holds whole heads
over the whole sequence computes exactly what one GPU computes (docs/numerics.md, "Sequence
parallelism").

The transformer's input is split after the patch embedding and its output gathered before the
unpatchify (:func:`enable_sequence_parallel`, forward hooks at the three places diffusers' own
``WanTransformer3DModel._cp_plan`` names: the RoPE tables, the first block's input, ``proj_out``'s
output). Why the project does not use diffusers' context-parallel machinery: docs/numerics.md.

Autograd: the backward of :func:`seq_to_heads` is :func:`heads_to_seq` and the other way round;
the backward of the output gather keeps this rank's slice of the gradient. Every rank of a group
computes the same loss from the same gathered output, and the parameter gradients of the group's
ranks are partial sums over their tokens (and heads): their SUM over the group is the one-GPU
gradient (:func:`sp_loss_scale` says how training makes FSDP's average come out as that sum).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class SequenceParallelError(ValueError):
    """A shape or setting that sequence parallelism cannot split; the message says which."""


@dataclass
class SPGroup:
    """A sequence-parallel process group: ``size`` ranks, this one at ``rank`` in it."""

    group: Any
    size: int
    rank: int

    @classmethod
    def of(cls, group: Any) -> "SPGroup":
        return cls(group=group, size=dist.get_world_size(group), rank=dist.get_rank(group))


def check_heads(heads: int, sp: int) -> None:
    """``sp`` must divide the number of attention heads."""
    if sp < 1:
        raise SequenceParallelError(f"--sp must be at least 1, got {sp}")
    if heads % sp:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise SequenceParallelError(
            f"--sp {sp} does not divide the transformer's {heads} attention heads; choose one of "
            f"{', '.join(map(str, divisors))}")


def check_tokens(tokens: int, sp: int, where: str = "") -> None:
    """``sp`` must divide the number of tokens (no padding: a padded key would change attention)."""
    if tokens % sp:
        raise SequenceParallelError(
            f"the sequence of {tokens} tokens{where} does not split evenly over --sp {sp}: choose "
            f"frames/height/width whose token count (latent frames × height/16 × width/16) is a "
            f"multiple of {sp} (padding is not done: an extra key would change every method's "
            "attention)")


# ----------------------------------------------------------------------------------------------
# Collectives with their backward


def _a2a(x: torch.Tensor, group: Any) -> torch.Tensor:
    """all_to_all_single over dim 0 (chunk i goes to rank i); gloo and NCCL."""
    out = torch.empty_like(x)
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":   # gloo moves bytes: same result
        dist.all_to_all_single(out.view(torch.int16), x.view(torch.int16), group=group)
    else:
        dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, g: SPGroup) -> torch.Tensor:
    b, s, h, d = x.shape
    parts = x.reshape(b, s, g.size, h // g.size, d).permute(2, 0, 1, 3, 4).contiguous()
    got = _a2a(parts, g.group)                      # got[j]: rank j's tokens, this rank's heads
    return got.permute(1, 0, 2, 3, 4).reshape(b, g.size * s, h // g.size, d)


def _heads_to_seq(x: torch.Tensor, g: SPGroup) -> torch.Tensor:
    b, s, h, d = x.shape
    parts = x.reshape(b, g.size, s // g.size, h, d).permute(1, 0, 2, 3, 4).contiguous()
    got = _a2a(parts, g.group)                      # got[j]: this rank's tokens, rank j's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, s // g.size, g.size * h, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _seq_to_heads(x, g)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.g), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _heads_to_seq(x, g)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.g), None


class _Gather(torch.autograd.Function):
    """All-gather along ``dim``; backward: this rank's slice of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, x, g, dim):
        ctx.g, ctx.dim = g, dim
        parts = [torch.empty_like(x) for _ in range(g.size)]
        src = x.contiguous()
        if src.dtype == torch.bfloat16 and src.device.type == "cpu":
            dist.all_gather([p.view(torch.int16) for p in parts], src.view(torch.int16), group=g.group)
        else:
            dist.all_gather(parts, src, group=g.group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.g.size, dim=ctx.dim)[ctx.g.rank].contiguous(), None, None


def seq_to_heads(x: torch.Tensor, g: SPGroup) -> torch.Tensor:
    """(B, S/sp, H, D) → (B, S, H/sp, D): every token of this rank's heads."""
    check_heads(x.shape[2], g.size)
    return _SeqToHeads.apply(x, g)


def heads_to_seq(x: torch.Tensor, g: SPGroup) -> torch.Tensor:
    """(B, S, H/sp, D) → (B, S/sp, H, D), the inverse of :func:`seq_to_heads`."""
    check_tokens(x.shape[1], g.size)
    return _HeadsToSeq.apply(x, g)


def gather_seq(x: torch.Tensor, g: SPGroup, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's slice (autograd: backward keeps this rank's slice)."""
    return _Gather.apply(x, g, dim)


def split_seq(x: torch.Tensor, g: SPGroup, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous slice of ``dim`` (plain slicing: its backward is zeros elsewhere)."""
    check_tokens(x.shape[dim], g.size)
    return x.chunk(g.size, dim=dim)[g.rank]


def heads_slice(x: torch.Tensor, g: SPGroup) -> torch.Tensor:
    """This rank's heads of a (B, L, H, D) tensor that every rank holds whole (the text keys)."""
    check_heads(x.shape[2], g.size)
    return x.chunk(g.size, dim=2)[g.rank]


def ulysses_attention(attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str,
                      g: SPGroup) -> torch.Tensor:
    """``attend(q, k, v, kind)`` on the whole sequence for this rank's heads; in and out
    (B, S/sp, H, D). Cross-attention (``kind == "cross"``) moves only the queries: ``k``/``v`` are
    the text, whole on every rank."""
    qh = seq_to_heads(q, g)
    if kind == "self":
        kh, vh = seq_to_heads(k, g), seq_to_heads(v, g)
    else:
        kh, vh = heads_slice(k, g), heads_slice(v, g)
    out = attend(qh, kh, vh, kind)
    return heads_to_seq(out.contiguous(), g)


# ----------------------------------------------------------------------------------------------
# The transformer


class SequenceParallel:
    """Handle of :func:`enable_sequence_parallel`; :meth:`remove` undoes it."""

    def __init__(self, transformer: torch.nn.Module, g: SPGroup, handles: list, proc) -> None:
        self.transformer, self.group, self._handles, self._proc = transformer, g, handles, proc

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._proc is not None:
            self._proc.sp_group = None


def enable_sequence_parallel(transformer: torch.nn.Module, group: Any) -> SequenceParallel:
    """Run a diffusers ``WanTransformer3DModel`` sequence-parallel over ``group``.

    The :class:`attnqat.wan.AttnQATProcessor` must be installed (it does the all-to-all; any other
    processor would attend over this rank's tokens only, so that is refused). Forward hooks split
    the RoPE tables and the first block's input along the sequence and gather ``proj_out``'s
    output, so the model's output is the whole clip on every rank of the group. A group of one is
    allowed (nothing is split).
    """
    from .wan import get_processor

    proc = get_processor(transformer)
    if proc is None:
        raise SequenceParallelError("sequence parallelism needs the project's attention processor "
                                    "(attnqat.wan.install_attention) on the transformer")
    g = group if isinstance(group, SPGroup) else SPGroup.of(group)
    cfg = transformer.config
    check_heads(cfg.num_attention_heads, g.size)
    pt, ph, pw = cfg.patch_size

    def rope_hook(_mod, args, out):
        (x,) = args[:1]
        _, _, f, h, w = x.shape
        check_tokens((f // pt) * (h // ph) * (w // pw), g.size,
                     f" ({f // pt} latent frames × {h // ph} × {w // pw})")
        return tuple(split_seq(t, g, 1) for t in out)

    def first_block_hook(_mod, args, kwargs):
        if args:
            return (split_seq(args[0], g, 1), *args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = split_seq(kwargs["hidden_states"], g, 1)
        return args, kwargs

    def out_hook(_mod, _args, out):
        return gather_seq(out, g, 1)

    handles = [transformer.rope.register_forward_hook(rope_hook),
               transformer.blocks[0].register_forward_pre_hook(first_block_hook, with_kwargs=True),
               transformer.proj_out.register_forward_hook(out_hook)]
    proc.sp_group = g
    return SequenceParallel(transformer, g, handles, proc)


def sp_loss_scale(sp: int) -> float:
    """What training multiplies the loss by under sequence parallelism.

    FSDP averages the gradients over all ``world`` ranks, the ``sp`` ranks of a group included; a
    group's ranks hold partial sums of ONE gradient (their sum is the gradient), so the average over
    ``world`` is the data-parallel average divided by ``sp``. Scaling the loss by ``sp`` undoes that.
    """
    return float(sp)


__all__ = ["SPGroup", "SequenceParallel", "SequenceParallelError", "check_heads", "check_tokens",
           "enable_sequence_parallel", "gather_seq", "heads_slice", "heads_to_seq", "seq_to_heads",
           "sp_loss_scale", "split_seq", "ulysses_attention"]
