"""Which kernels the engine runs, resolved once at the public entry into a frozen static object.

``Kernels.resolve("auto" | "reference" | "pallas" | "pallas_interpret")`` decides, once, which
attention the decoder uses (the Pallas tree-attention kernel or its jnp reference), which sampler
(the fused unembed + Gumbel-max Pallas kernel or the jnp path) and whether Pallas runs in interpret
mode. The result is hashable and passed down as a static argument; nothing below re-reads a string.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from pallas_kernels import tree_attention as _ta
from specroll_jax._fields import check_bool

CHOICES = ("auto", "reference", "pallas", "pallas_interpret")
_IMPLS = ("reference", "pallas")
_ACCELERATORS = ("gpu", "cuda", "rocm", "tpu")


@dataclasses.dataclass(frozen=True)
class Kernels:
  """attention / sampler: "reference" (plain jnp) or "pallas"; interpret: run Pallas kernels in
  the interpreter (CPU tests). The fused sampler is used only for plain sampling (no top-k/top-p);
  other configurations take the jnp sampler whatever ``sampler`` says."""

  attention: str = "reference"
  sampler: str = "reference"
  interpret: bool = False

  def __post_init__(self):
    for name in ("attention", "sampler"):
      v = getattr(self, name)
      if v not in _IMPLS:
        raise ValueError(f"Kernels.{name} must be one of {_IMPLS}, got {v!r}")
    check_bool(self, "interpret")

  @classmethod
  def resolve(cls, kernels: str | Kernels = "auto") -> Kernels:
    """A ``Kernels`` from a choice name (or a ``Kernels``, returned as is).

    "auto": the Pallas kernels on a GPU/TPU default backend, the jnp references elsewhere.
    """
    if isinstance(kernels, Kernels):
      return kernels
    if not isinstance(kernels, str) or kernels not in CHOICES:
      raise ValueError(f"kernels must be one of {CHOICES} or a Kernels, got {kernels!r}")
    if kernels == "auto":
      kernels = "pallas" if jax.default_backend() in _ACCELERATORS else "reference"
    if kernels == "reference":
      return cls()
    return cls(attention="pallas", sampler="pallas", interpret=kernels == "pallas_interpret")

  @property
  def attention_fn(self):
    """tree attention with the contract of ``pallas_kernels.tree_attention``."""
    if self.attention == "reference":
      return _ta.tree_attention_reference
    return functools.partial(_ta.tree_attention, interpret=self.interpret)


REFERENCE = Kernels()
