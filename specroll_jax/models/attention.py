"""Attention dispatch: the Pallas tree-attention kernel on GPU/TPU, the jnp reference on CPU.

``impl``: "auto" (kernel on gpu/tpu backends, reference elsewhere), "reference", "pallas" (compiled
kernel; GPU/TPU only) or "pallas_interpret" (the kernel in interpret mode, for CPU tests).
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels import tree_attention as _ta

IMPLS = ("auto", "reference", "pallas", "pallas_interpret")


def resolve(impl: str) -> str:
  if impl not in IMPLS:
    raise ValueError(f"attn_impl must be one of {IMPLS}, got {impl!r}")
  if impl == "auto":
    return "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "reference"
  return impl


def get(impl: str):
  impl = resolve(impl)
  if impl == "reference":
    return _ta.tree_attention_reference
  return functools.partial(_ta.tree_attention, interpret=impl == "pallas_interpret")
