"""The ``attnqat`` command line.

Each subcommand lives in the module that owns its feature; this file only knows where to find it.
A feature module exposes two functions:

* ``add_arguments(parser: argparse.ArgumentParser) -> None`` — declares its options;
* ``run(args: argparse.Namespace) -> int`` — does the work and returns the exit code.

Modules are imported lazily, so ``attnqat --help`` stays fast and a missing optional dependency of
one feature never breaks the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    module: str  # module exposing add_arguments() and run()
    help: str


# Top-level commands. Commands with sub-commands (``bench``, ``eval``, ``finetune``) list them below.
COMMANDS: list[Command] = [
    Command("generate", "attnqat.generate_cli",
            "generate one Wan 2.1 clip per attention method (same seed, same prompt embeddings), "
            "a labelled side-by-side mp4 and a JSON record of timings and PSNR/SSIM"),
    Command("app", "attnqat.app.cli",
            "launch the Gradio comparison app (embedded tiny model by default; no GPU, no network)"),
    Command("repro", "attnqat.finetune.repro",
            "the Attn-QAT study on the embedded tiny model: fine-tune with Attn-QAT, BF16, drop-in "
            "FP4 and the two ablations (per training seed), evaluate on held-out development prompts, "
            "write a report (GPU; docs/repro.md)"),
]

GROUPS: dict[str, tuple[str, list[Command]]] = {
    "bench": ("benchmarks that print a table and write JSON", [
        Command("accuracy", "attnqat.accuracy",
                "accuracy of the 4-bit attention methods against BF16 (cosine, relative L1, RMSE) "
                "on random and outlier-heavy inputs"),
        Command("kernels", "attnqat.kernels.bench",
                "time every attention method and PyTorch SDPA at the Wan 2.1 shapes (GPU)"),
        Command("wan", "attnqat.bench_wan",
                "time one full-size Wan 2.1 transformer forward per attention method (GPU, random weights)"),
        Command("train", "attnqat.finetune.bench_train",
                "time one fine-tuning step of a full-size Wan 2.1 transformer per student attention "
                "(GPU, random weights; torchrun for several GPUs)"),
    ]),
    "eval": ("blind win-tie-lose human study and automatic scores", [
        Command("build", "attnqat.eval.build", "build a blind study from generated clips"),
        Command("serve", "attnqat.eval.serve", "serve the rater web app for a study"),
        Command("report", "attnqat.eval.report", "statistics, plots and exports of a study's votes"),
        Command("plan", "attnqat.eval.plan",
                "prompts a study needs for its equivalence / non-inferiority test (power)"),
        Command("import", "attnqat.eval.importer",
                "analyse votes collected elsewhere (CSV, e.g. published counts) like a study's"),
        Command("score", "attnqat.eval.procedural",
                "score clips of the synthetic shapes benchmark against their captions (colour, "
                "shape, motion, temporal consistency, cleanliness); --validate measures the scorer"),
    ]),
    "finetune": ("Attn-QAT fine-tuning and the project's own tiny model", [
        Command("train", "attnqat.finetune.train",
                "fine-tune a Wan 2.1 transformer with Attn-QAT (or drop-in FP4, or BF16) attention "
                "on captioned videos, a latent cache or the synthetic shapes; one GPU or many "
                "(torchrun), resumable checkpoints"),
        Command("cache", "attnqat.finetune.cache",
                "encode captioned videos once into VAE latents and prompt embeddings (safetensors "
                "shards; resumable; bad clips skipped and listed)"),
        Command("export", "attnqat.finetune.export",
                "write a training checkpoint as a diffusers transformer folder that generate and "
                "the app load (--qat-transformer)"),
        Command("plot", "attnqat.finetune.plot",
                "draw the loss and gradient-norm curves of training runs in one PNG"),
        Command("data", "attnqat.synthetic",
                "write sample clips (mp4) and captions of the synthetic shapes data set, from the "
                "training stream or the fixed held-out prompts"),
        Command("tiny", "attnqat.finetune.tiny_train",
                "train the embedded tiny model (VAE, text encoder, transformer) on the synthetic "
                "shapes data, and score it on the held-out prompts (GPU for training)"),
    ]),
}


def _load(cmd: Command):
    try:
        return importlib.import_module(cmd.module)
    except ModuleNotFoundError as exc:
        if exc.name and (cmd.module == exc.name or cmd.module.startswith(exc.name + ".")):
            return None  # the feature is not part of this build yet
        raise


def _add(subparsers, cmd: Command, group: str | None = None) -> None:
    parser = subparsers.add_parser(cmd.name, help=cmd.help, description=cmd.help,
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.set_defaults(_command=cmd)
    module = _load(cmd) if _wants(cmd, group) else None
    if module is not None:
        module.add_arguments(parser)


_ARGV: list[str] = []


def invocation() -> list[str]:
    """The command line :func:`main` is running (``attnqat`` and its arguments), for records."""
    return ["attnqat", *_ARGV]


def _wants(cmd: Command, group: str | None = None) -> bool:
    """Import a feature module only when its command is the one being parsed: ``attnqat NAME`` or
    ``attnqat GROUP NAME``. An argument that only looks like a command's name (``repro --stages
    report``) imports nothing more: that loaded ``eval report`` and its database modules."""
    return _ARGV[:2] == [group, cmd.name] if group else _ARGV[:1] == [cmd.name]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnqat",
        description="4-bit (NVFP4) attention for Wan 2.1 video generation: BF16, NVFP4, "
                    "SageAttention3 and Attn-QAT side by side; Attn-QAT fine-tuning; blind human "
                    "evaluation. Run `attnqat COMMAND --help` for the options of a command.",
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    for cmd in COMMANDS:
        _add(sub, cmd)
    for group, (help_text, commands) in GROUPS.items():
        gp = sub.add_parser(group, help=help_text, description=help_text)
        gsub = gp.add_subparsers(title=f"{group} commands", metavar="COMMAND")
        gp.set_defaults(_group_parser=gp)
        for cmd in commands:
            _add(gsub, cmd, group)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _ARGV[:] = argv
    parser = build_parser()
    args = parser.parse_args(argv)
    cmd: Command | None = getattr(args, "_command", None)
    if cmd is None:
        (getattr(args, "_group_parser", None) or parser).print_help()
        return 2
    module = _load(cmd)
    if module is None:
        print(f"attnqat: `{cmd.name}` is not implemented yet in this version.", file=sys.stderr)
        return 2
    return int(module.run(args) or 0)


if __name__ == "__main__":
    # `python -m attnqat.cli` runs this file as __main__, a second copy of the module: run the
    # package's own, so that what records read from it (invocation()) is what this run parsed
    from attnqat.cli import main as _package_main

    sys.exit(_package_main())
