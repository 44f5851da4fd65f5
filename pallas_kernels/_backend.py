"""Which Pallas backend a kernel lowers to: one rule for every kernel in this package."""

from __future__ import annotations

import jax

BACKENDS = ("auto", "triton", "tpu")


def resolve_backend(backend: str, interpret: bool) -> str:
  """"auto" -> "tpu" on a TPU default backend, else "triton" (the body interpret=True runs)."""
  del interpret  # the choice does not depend on it; kept for callers
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if backend == "auto":
    backend = "tpu" if jax.default_backend() == "tpu" else "triton"
  return backend
