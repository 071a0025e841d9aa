"""Test configuration shared by every test module.

On a machine without CUDA the Triton kernels run through Triton's interpreter. ``TRITON_INTERPRET``
is read when a kernel is decorated, so it is set here, before any test imports ``attnqat.kernels``.
"""

import json
import os
import subprocess
import sys

import pytest


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Servers and commands that tests start as `python -m attnqat.cli ...` run from the repository
# root, where `-m` would put the source folder attnqat/ in front of a regular (non-editable)
# install; PYTHONSAFEPATH (Python 3.11+, as `python -P`) keeps it out. An editable install is
# found either way.
os.environ["PYTHONSAFEPATH"] = "1"


def _attnqat_location():
    """Where ``attnqat`` is imported from, and whether it is the whole installed namespace."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("attnqat")
    where = Path(spec.origin).parent if spec and spec.origin else None
    complete = importlib.util.find_spec("attnqat.app") is not None if spec else False
    return where, complete


def pytest_configure(config):
    import pytest

    where, complete = _attnqat_location()
    if where is not None and not complete:
        raise pytest.UsageError(
            f"attnqat is imported from {where}, the source folder, which lacks attnqat.app, "
            "attnqat.eval, ... (they live in app/, eval/, ... and exist only in an installed "
            "package). With a regular (non-editable) install, run the tests from the repository "
            "root as `pytest` or `python -P -m pytest`: `python -m pytest` puts the current "
            "folder first on sys.path.")


def pytest_report_header(config):
    where, _ = _attnqat_location()
    return f"attnqat: {where}"


@pytest.fixture(scope="session")
def sass90(tmp_path_factory):
    """``attnqat bench kernels --sass 90 --json FILE``, run once per session (under pytest-xdist
    once per worker that runs a test reading it; it compiles every kernel for sm_90, the slowest
    step of the suite on a cold Triton cache) in a child process without the Triton
    interpreter that the other CPU tests use; test_kernels_sass.py and test_kernels_gluon.py read
    it. Returns the finished process (its ``stdout``) and the JSON it wrote."""
    import fcntl

    # under pytest-xdist the workers share the base temp folder's parent: the first to get the
    # lock compiles, the others wait and read its result (on a cold Triton cache, as on CI, the
    # compile takes minutes: two workers compiling the same kernels at once doubled it)
    shared = tmp_path_factory.getbasetemp().parent
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        shared = tmp_path_factory.mktemp("sass90")
    out, log = shared / "sass90.json", shared / "sass90.out"
    with open(shared / "sass90.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.is_file():
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            res = subprocess.run([sys.executable, "-m", "attnqat.cli", "bench", "kernels", "--sass", "90",
                                  "--json", str(out) + ".tmp"], cwd=shared, env=env, capture_output=True,
                                 text=True, timeout=900, check=False)
            assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
            log.write_text(res.stdout)
            os.replace(str(out) + ".tmp", out)
    return subprocess.CompletedProcess(["attnqat", "bench", "kernels", "--sass", "90"], 0,
                                       log.read_text(), ""), json.loads(out.read_text())
