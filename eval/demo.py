"""Try a study without a GPU: synthetic generation outputs and a loopback server process.

:func:`write_demo_outputs` writes folders in the format of ``attnqat generate`` (``record.json``
and ``<method>.mp4``): a small moving square per prompt, each method adding a little noise of its
own, so the methods differ slightly the way 4-bit attention does. :class:`LocalServer` runs
``attnqat eval serve`` in a child process on 127.0.0.1 (the tests kill and restart it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from attnqat.video import write_mp4

#: noise added to each method's demo clips (a stand-in for its quality); any other method gets
#: :data:`OTHER_NOISE`
DEMO_NOISE = {"bf16": 0.0, "attnqat": 6.0, "nvfp4": 18.0}
OTHER_NOISE = 10.0


def synthetic_frames(index: int, n_frames: int = 17, size: int = 64, noise: float = 0.0,
                     seed: int = 0) -> np.ndarray:
    """(n_frames, size, size, 3) uint8: a coloured square moving over a gradient; ``index``
    varies colour and path, ``noise`` adds Gaussian noise (same ``seed`` → same frames)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size]
    background = np.stack([x * 255 // size, y * 255 // size, np.full_like(x, 60 + 40 * (index % 4))],
                          axis=-1).astype(np.float32)
    colour = np.array([(97 * index) % 256, (151 * index + 80) % 256, 220], dtype=np.float32)
    frames = []
    side = size // 4
    for t in range(n_frames):
        f = background.copy()
        cx = int((t / max(1, n_frames - 1)) * (size - side))
        cy = int((size - side) / 2 + (size / 5) * np.sin(t / 3 + index))
        f[cy:cy + side, cx:cx + side] = colour
        if noise:
            f += rng.normal(0, noise, f.shape)
        frames.append(np.clip(f, 0, 255).astype(np.uint8))
    return np.stack(frames)


def write_demo_outputs(root: str | Path, prompts: Sequence[str],
                       methods: Sequence[str] = ("bf16", "attnqat"), seed: int = 0,
                       n_frames: int = 17, size: int = 64) -> list[Path]:
    """One ``attnqat generate``-style folder per prompt under ``root``; returns the folders."""
    root = Path(root)
    folders = []
    for i, prompt in enumerate(prompts):
        folder = root / f"prompt_{i:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        record = {"prompt": prompt, "negative_prompt": "", "seed": seed + i,
                  "settings": {"frames": n_frames, "height": size, "width": size, "fps": 8},
                  "versions": {}, "methods": {}, "side_by_side": None}
        for m, method in enumerate(methods):
            frames = synthetic_frames(i, n_frames, size, DEMO_NOISE.get(method, OTHER_NOISE),
                                      seed=1000 * i + m)
            write_mp4(frames, folder / f"{method}.mp4", fps=8, crf=16)
            record["methods"][method] = {"video": f"{method}.mp4", "timings": {},
                                         "peak_memory_bytes": None, "psnr": None, "ssim": None}
        (folder / "record.json").write_text(json.dumps(record, indent=2), encoding="utf-8")
        folders.append(folder)
    return folders


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """``attnqat eval serve`` for a study folder, in a child process on 127.0.0.1."""

    def __init__(self, study_dir: str | Path, admin_password: str = "admin-secret",
                 port: int | None = None, log_path: str | Path | None = None,
                 db_url: str | None = None, name: str | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        self.study_dir = Path(study_dir)
        self.extra_args = list(extra_args)
        self.db_url = db_url
        self.name = name
        self.admin_password = admin_password
        self.port = port or free_port()
        self.log_path = Path(log_path) if log_path else self.study_dir.parent / f"server-{self.port}.log"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> LocalServer:
        """Start the server and wait until it answers ``/healthz``."""
        import httpx

        env = {**os.environ, "ATTNQAT_ADMIN_PASSWORD": self.admin_password}
        command = [sys.executable, "-m", "attnqat.cli", "eval", "serve", "--study",
                   str(self.study_dir), "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--db", self.db_url] if self.db_url else []
        command += ["--name", self.name] if self.name else []
        command += self.extra_args
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"server did not start within {timeout} s; see {self.log_path}")

    def kill(self) -> None:
        """Kill the server at once (SIGKILL): no shutdown, no flush."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> None:
        """Stop the server politely (SIGTERM, then SIGKILL after 10 s)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
