"""``attnqat generate --sp N`` under torchrun: the denoising loop sequence-parallel over N processes.

Launched as ``torchrun --nproc-per-node N -m attnqat.cli generate --sp N …`` (one process per GPU,
NCCL; gloo on CPUs). Every process loads the whole pipeline, encodes the prompt and draws the same
noise (a random seed is drawn on rank 0 and sent to the others); each transformer call then keeps
``S/N`` tokens per rank and runs attention on the whole sequence for ``H/N`` heads
(:mod:`attnqat.parallel`), so every method gives the clip one GPU gives. Rank 0 writes the outputs
and prints the summary; the other ranks write nothing.
"""

from __future__ import annotations

import os
import secrets
import sys
from typing import Any


def _fail(msg: str) -> int:
    print(f"attnqat generate: error: {msg}", file=sys.stderr)
    return 2


def init(sp: int, device: str) -> tuple[Any, Any]:
    """Join torchrun's process group; returns (torch.device, SPGroup of the whole world)."""
    import torch
    import torch.distributed as dist

    from .parallel import SPGroup
    from .wan import resolve_device

    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        raise ValueError(f"--sp {sp} needs {sp} processes: launch with `torchrun --nproc-per-node "
                         f"{sp} -m attnqat.cli generate --sp {sp} …`")
    world = int(os.environ["WORLD_SIZE"])
    if world != sp:
        raise ValueError(f"--sp {sp} but torchrun started {world} processes (they must be equal)")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    want = "cuda" if device == "auto" and torch.cuda.is_available() else device
    dev = resolve_device(f"cuda:{local}") if want.startswith("cuda") else resolve_device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                device_id=dev if dev.type == "cuda" else None)
    return dev, SPGroup.of(dist.group.WORLD)


def shared_seed(seed: int, group, device) -> int:
    """``seed``, or for −1 one drawn on rank 0 and sent to every rank."""
    import torch
    import torch.distributed as dist

    from .generate import RANDOM_SEED_BOUND

    if seed >= 0:
        return seed
    t = torch.tensor([secrets.randbelow(RANDOM_SEED_BOUND) if dist.get_rank() == 0 else 0],
                     dtype=torch.int64, device=device)
    dist.broadcast(t, src=0, group=group.group)
    return int(t.item())


def run(args) -> int:
    """``attnqat generate`` with ``--sp`` > 1 (see :func:`attnqat.generate_cli.run`)."""
    import torch.distributed as dist

    from . import generate_cli
    from .convert import CheckpointError
    from .generate import GenerationError, generate
    from .parallel import SequenceParallelError, check_tokens, enable_sequence_parallel
    from .wan import DEFAULT_MODEL, ModelLoadError, install_attention, load_models

    try:
        dev, g = init(args.sp, args.device)
    except ValueError as exc:
        return _fail(str(exc))
    main = g.rank == 0
    try:
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        log = (lambda m: print(m, file=sys.stderr, flush=True)) if main else None
        try:
            from .generate import resolve_settings

            settings, _ = resolve_settings(
                args.prompt, negative_prompt=args.negative_prompt, methods=args.methods,
                seed=args.seed, steps=args.steps, guidance=args.guidance, shift=args.shift,
                height=args.height, width=args.width, frames=args.frames, fps=args.fps,
                model=args.model or DEFAULT_MODEL, qat_transformer=args.qat_transformer,
                device=str(dev), dtype=args.dtype, fp4_scope=args.fp4_scope, backend=args.backend,
                offload=args.offload, out=None, overwrite=args.overwrite)
            models = load_models(settings.model, qat_transformer=settings.qat_transformer,
                                 device=dev, offload=settings.offload, dtype=settings.dtype)
            pipe = models.pipe
            lat = ((settings.frames - 1) // pipe.vae_scale_factor_temporal + 1,
                   settings.height // pipe.vae_scale_factor_spatial,
                   settings.width // pipe.vae_scale_factor_spatial)
            pt, ph, pw = pipe.transformer.config.patch_size
            check_tokens((lat[0] // pt) * (lat[1] // ph) * (lat[2] // pw), g.size,
                         f" ({lat[0] // pt} latent frames × {lat[1] // ph} × {lat[2] // pw})")
            for t in (pipe.transformer, models.qat_transformer):
                if t is not None:
                    install_attention(t, "bf16", fp4_scope=settings.fp4_scope, backend=settings.backend)
                    enable_sequence_parallel(t, g)
            seed = shared_seed(args.seed, g, dev)
            out = (args.out or generate_cli._default_out()) if main else None
            result = generate(
                args.prompt, negative_prompt=args.negative_prompt, methods=args.methods, seed=seed,
                steps=args.steps, guidance=args.guidance, shift=args.shift, height=args.height,
                width=args.width, frames=args.frames, fps=args.fps, model=args.model or DEFAULT_MODEL,
                device=str(dev), dtype=args.dtype, out=out, fp4_scope=args.fp4_scope,
                backend=args.backend, offload=args.offload, overwrite=args.overwrite,
                progress=main and not args.no_progress, models=models, log=log)
        except (GenerationError, ModelLoadError, CheckpointError, SequenceParallelError) as exc:
            if main:
                lines = ([str(exc)] if isinstance(exc, SequenceParallelError)
                         else generate_cli.error_lines(exc))
                for line in lines:
                    print(f"attnqat generate: error: {line}", file=sys.stderr)
            return 2
        if main:
            print(f"sequence parallel: {g.size} processes, each 1/{g.size} of the tokens and of "
                  "the heads in attention")
            generate_cli.summary(result)
        return 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
