"""``attnqat app``: the Gradio comparison app (see ``docs/app.md``).

Loads the model once (the embedded tiny model unless ``--model`` names a Wan 2.1 folder), then
serves the page and the ``/generate`` API on ``--host:--port``. No share link, no analytics, no
fonts or scripts from elsewhere: it works on a machine without network.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import time

from attnqat.wan import DTYPE_CHOICES

AUTH_ENV = "ATTNQAT_APP_AUTH"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``attnqat app``."""
    parser.add_argument("--model", default=None,
                        help="Wan 2.1 text-to-video pipeline in diffusers format: a local folder "
                             "(works offline) or a hub id (None: the embedded tiny model)")
    parser.add_argument("--qat-transformer", default=None,
                        help="Attn-QAT transformer for the Attn-QAT method: a diffusers transformer "
                             "folder or one .safetensors file (diffusers, FastVideo or original Wan "
                             "names). None: the one the model folder names, if any (the tiny model "
                             "has one); without one, Attn-QAT is shown as unavailable")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="compute dtype of the transformer and text encoder: auto picks what the "
                             "device runs natively (bfloat16 on CUDA and on CPUs with BF16 "
                             "instructions, float32 on other CPUs); the page says which runs")
    parser.add_argument("--offload", action="store_true",
                        help="keep models on the CPU and move each to the GPU only while it runs "
                             "(for GPUs with little memory)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0 to accept other machines; then also "
                             "set --auth)")
    parser.add_argument("--port", type=int, default=7860, help="port to listen on")
    parser.add_argument("--auth", default=None, metavar="USER:PASS",
                        help=f"require this user name and password (or set {AUTH_ENV}=USER:PASS "
                             "to keep the password off the command line)")
    parser.add_argument("--output-dir", default=None,
                        help="folder for the generated clips, one sub-folder per request (None: a "
                             "new folder in the system temp dir, removed when the app stops)")
    parser.add_argument("--keep", type=int, default=20,
                        help="number of recent results kept in --output-dir; older ones are deleted")
    parser.add_argument("--queue-size", type=int, default=8,
                        help="requests that may wait while one generates; more are refused with "
                             "'queue is full'")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for PyTorch (None: PyTorch's default; on a shared CPU, 1 "
                             "or 2 is often faster)")


def parse_auth(value: str | None) -> tuple[str, str] | None:
    """``"user:pass"`` → ("user", "pass"); None stays None. Raises ValueError when malformed."""
    if value is None:
        return None
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        raise ValueError("--auth must be USER:PASS with a non-empty user name and password")
    return user, password


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on now, or None (checked before the model loads)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"cannot resolve --host {host}: {exc.strerror or exc}"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            return (f"cannot listen on {host}:{port} ({exc.strerror or exc}); another program may "
                    "be using it: choose another port with --port N")
    return None


def _fault():
    from .service import FAULT_ENV, Fault

    return Fault.parse(os.environ.get(FAULT_ENV))


def run(args: argparse.Namespace) -> int:
    """Load the model, build the page, serve until interrupted. Returns the exit code."""
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"

    def fail(msg: str) -> int:
        print(f"attnqat app: error: {msg}", file=sys.stderr)
        return 2

    try:
        auth = parse_auth(args.auth if args.auth is not None else os.environ.get(AUTH_ENV))
        fault = _fault()
    except ValueError as exc:
        return fail(str(exc))
    if not 0 < args.port < 65536:
        return fail(f"--port must be from 1 to 65535, got {args.port}")
    if args.keep < 1:
        return fail(f"--keep must be at least 1, got {args.keep}")
    if args.queue_size < 1:
        return fail(f"--queue-size must be at least 1, got {args.queue_size}")
    if args.threads is not None and args.threads < 1:
        return fail(f"--threads must be at least 1, got {args.threads}")
    problem = port_problem(args.host, args.port)
    if problem:
        return fail(problem)
    if args.host not in ("127.0.0.1", "localhost", "::1") and auth is None:
        print(f"attnqat app: warning: listening on {args.host} without --auth; anyone who can "
              "reach this address can use the GPU", file=sys.stderr)

    import torch

    from attnqat.convert import CheckpointError
    from attnqat.wan import ModelLoadError

    from .service import load_service

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if fault is not None:
        print(f"attnqat app: testing hook active: {fault.kind} will be raised inside generation"
              f"{' of ' + fault.method if fault.method else ''}", file=sys.stderr)

    def log(msg: str) -> None:
        print(f"attnqat app: {msg}", file=sys.stderr, flush=True)

    log("loading the model …")
    try:
        service = load_service(args.model, qat_transformer=args.qat_transformer or "auto",
                               device=args.device, dtype=args.dtype, offload=args.offload,
                               output_dir=args.output_dir, keep=args.keep, fault=fault, log=log)
    except (ModelLoadError, CheckpointError, ValueError) as exc:
        return fail(str(exc))
    from .ui import build_app, launch

    def stop(_signum, _frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once is enough
        raise KeyboardInterrupt  # Gradio closes the server; the finally below removes temp outputs

    signal.signal(signal.SIGTERM, stop)
    atexit.register(service.close)  # also when a second interruption cuts the finally short
    try:
        demo = build_app(service, queue_size=args.queue_size)
        log(f"outputs in {service.root} (keeping the {service.keep} most recent)")
        for m, why in service.availability().items():
            if why:
                log(f"{m} is unavailable: {why}")
        try:
            launch(demo, service, host=args.host, port=args.port, auth=auth, block=False,
                   quiet=True)
        except OSError:
            return fail(f"cannot listen on {args.host}:{args.port}: the port is in use or not "
                        "allowed here; choose another one with --port N")
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        log(f"serving on http://{host}:{args.port}/ (Ctrl+C stops it)")
        try:
            while demo.is_running:
                time.sleep(0.2)
        except KeyboardInterrupt:
            log("stopping")
        finally:
            demo.close()
    finally:
        service.close()
    return 0
