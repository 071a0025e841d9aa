"""Test configuration shared by every test module.

On a machine without CUDA the Triton kernels run through Triton's interpreter. ``TRITON_INTERPRET``
is read when a kernel is decorated, so it is set here, before any test imports ``attnqat.kernels``.
"""

import os


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
