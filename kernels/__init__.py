"""Triton kernels (installed as ``attnqat.kernels``).

Contract with :func:`attnqat.attention` (backend ``"triton"`` / ``"auto"``):

* ``triton_unsupported(q, k, v, method) -> str | None`` — None when the kernels can run these inputs,
  else a sentence saying why not (the caller falls back to the PyTorch reference of the same method).
* ``triton_attention(q, k, v, method, softmax_scale) -> Tensor`` — (B, Sq, H, D) in q's dtype,
  differentiable for ``attnqat`` and ``dropin``.
"""
