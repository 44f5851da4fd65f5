"""Loops inside a caller's ``jax.shard_map``: a ``lax.while_loop`` carry must have the same
varying-manual-axes type (vma) on entry as the body gives it. The engines' carries start from
constants (counters, buffers) that the body makes depend on the rows, so they are cast up front to
vary over every manual axis the rollout's inputs vary over. Outside shard_map this is a no-op."""

from __future__ import annotations

import jax


def _vma(x) -> frozenset:
  """The manual axes ``x`` varies over (``aval.manual_axis_type.varying`` in jax 0.10, ``.vma`` in
  later releases; empty outside shard_map)."""
  t = jax.typeof(x)
  axes = getattr(t, "vma", None)
  if axes is None:
    axes = getattr(getattr(t, "manual_axis_type", None), "varying", None)
  return frozenset(axes or ())


def vary_like(tree, *refs):
  """``tree`` with every leaf varying over the manual axes any leaf of ``refs`` varies over."""
  axes = frozenset()
  for leaf in jax.tree.leaves(refs):
    if isinstance(leaf, jax.Array) or hasattr(leaf, "aval"):
      axes |= _vma(leaf)
  if not axes:
    return tree

  def cast(x):
    missing = tuple(sorted(axes - _vma(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree)
