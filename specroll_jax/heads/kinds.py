"""The two head families behind one small interface, for the code that works with either
(Reflex, the slow path, adaptation, pipelines): Medusa heads (``heads.Heads``: head k reads the
anchor hidden state) and root-conditioned heads (``cond_heads.CondHeads``: head k also reads the
root and the path above depth k). Both have ``num_heads``, ``hidden_size`` and ``vocab_size`` and a
leading K axis on every parameter leaf (so per-head optimiser states and masks work alike)."""

from __future__ import annotations

import jax

from specroll_jax.heads import conditioned as _cond
from specroll_jax.heads import medusa as _heads

KINDS = (_heads.Heads, _cond.CondHeads)


def is_conditioned(heads) -> bool:
  return isinstance(heads, _cond.CondHeads)


def validate(config, heads, num_heads: int | None = None) -> None:
  """ValueError unless ``heads`` are heads of either family that fit ``config``."""
  if is_conditioned(heads):
    _cond.validate(config, heads, num_heads)
  elif isinstance(heads, _heads.Heads):
    _heads.validate(config, heads, num_heads)
  else:
    raise ValueError(f"heads must be heads.Heads or cond_heads.CondHeads, got "
                     f"{type(heads).__name__}")


def output_states(config, params, heads, i: int, h, path):
  """Head ``i``'s (0-based, static) output states [..., D] at anchors ``h`` [..., D]; ``path``
  [..., >= i + 1] holds the root and the path tokens (read by root-conditioned heads only)."""
  if is_conditioned(heads):
    return _cond.head_state(config, params, heads, i + 1, h, path)
  sub = jax.tree.map(lambda a: a[i:i + 1], heads)
  return _heads.head_states(config, sub, h)[..., 0, :]


def load(path):
  """Heads of either family from a safetensors file written by its ``save``."""
  return _cond.load(path) if _cond.is_file(path) else _heads.load(path)


__all__ = ["KINDS", "is_conditioned", "load", "output_states", "validate"]
