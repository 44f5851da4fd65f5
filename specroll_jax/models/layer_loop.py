"""How the decoder runs its layers (``LayerLoop``): unrolled over per-layer weight slices or a
``lax.scan`` over the stacked weights, for forwards without a cache and for steps over one; the
policy in force when a function is traced (``layer_loop``; ``SPECROLL_LAYER_LOOP`` at import)."""

from __future__ import annotations

import contextlib
import dataclasses
import os

LAYER_LOOPS = ("unroll", "scan")


@dataclasses.dataclass(frozen=True)
class LayerLoop:
  """How the decoder runs its layers: "unroll" (per-layer weight slices) or "scan" (``lax.scan``
  over the stacked weights).

  full: forwards without a KV cache (``prefill``, ``forward``, the trainer's log-probs); each runs
  once per program, so the scan's per-layer weight copy is small next to the work on T tokens.
  cached: the layout ``init_cache`` makes, and with it the loop of every step over that cache
  (``append_step``, tree verification): "unroll" per-layer buffers, "scan" one stacked buffer.
  """

  full: str = "scan"
  cached: str = "unroll"

  def __post_init__(self):
    for name in ("full", "cached"):
      v = getattr(self, name)
      if v not in LAYER_LOOPS:
        raise ValueError(f"LayerLoop.{name} must be one of {LAYER_LOOPS}, got {v!r}")

  @classmethod
  def resolve(cls, loop: str | LayerLoop) -> LayerLoop:
    """A ``LayerLoop`` from "unroll" / "scan" (both parts alike) or a ``LayerLoop`` (as is)."""
    if isinstance(loop, LayerLoop):
      return loop
    if loop not in LAYER_LOOPS:
      raise ValueError(f"layer loop must be one of {LAYER_LOOPS} or a LayerLoop, got {loop!r}")
    return cls(full=loop, cached=loop)


def _from_environment() -> LayerLoop:
  name = os.environ.get("SPECROLL_LAYER_LOOP")
  if not name:
    return LayerLoop()
  if name not in LAYER_LOOPS:
    raise ValueError(f"SPECROLL_LAYER_LOOP must be one of {LAYER_LOOPS} or unset, got {name!r}")
  return LayerLoop.resolve(name)


_POLICY = [_from_environment()]


def layer_loop_policy() -> LayerLoop:
  """The current policy (``SPECROLL_LAYER_LOOP=unroll|scan`` sets both parts at import)."""
  return _POLICY[0]


@contextlib.contextmanager
def layer_loop(loop: str | LayerLoop):
  """Trace under another policy inside the ``with`` block. A program already compiled keeps the
  loop it was traced with (``jax.jit`` caches by static arguments, not by this policy)."""
  previous = _POLICY[0]
  _POLICY[0] = LayerLoop.resolve(loop)
  try:
    yield _POLICY[0]
  finally:
    _POLICY[0] = previous


__all__ = ["LAYER_LOOPS", "LayerLoop", "layer_loop", "layer_loop_policy"]
