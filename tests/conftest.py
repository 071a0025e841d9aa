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
