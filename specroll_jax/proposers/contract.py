"""Trace-time checks of what a proposer returns (the contract of ``base.Proposer`` and ``Tree``).

The speculative engine calls these where it calls the proposer (``speculative.init_state`` and
``speculative.spec_step``). They read only static shapes and dtypes, so they run once per trace and
cost nothing at run time. A violation raises ``ValueError`` naming the proposer class, the method,
the field, and the expected and the actual shape/dtype, instead of a broadcasting error deep in
attention or an ``IndexError`` in compaction.

What they cannot see are the rules on values (a valid node's parent is valid, the mask is the
ancestor relation, depths agree with the parents, tokens lie in the vocabulary): those are listed
in the ``Tree`` docstring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from specroll_jax._fields import int_arg
from specroll_jax.proposers.tree import Tree


def _name(proposer) -> str:
  return type(proposer).__name__


def _fmt(shape, dtype) -> str:
  return f"{tuple(shape)} {np.dtype(dtype).name}"


def _leaf_sd(x):
  """(shape, dtype) of a pytree leaf (array, tracer or Python scalar)."""
  return tuple(jnp.shape(x)), jnp.result_type(x)


def check_properties(proposer, vocab_size: int) -> None:
  """The static settings the engine sizes its buffers with: ``max_depth`` and ``capacity`` ints
  >= 0, ``feedback_topm`` an int in [0, vocab_size]."""
  name = _name(proposer)
  for attr in ("max_depth", "capacity", "feedback_topm"):
    int_arg(getattr(proposer, attr), f"{name}.{attr}", 0)
  if proposer.feedback_topm > vocab_size:
    raise ValueError(f"{name}.feedback_topm={proposer.feedback_topm} exceeds the model's "
                     f"vocab_size {vocab_size}")


def check_rows_state(proposer, method: str, rows_state: PyTree, rows: int) -> None:
  """Every leaf of the per-row part of a state (``split_state(state)[0]``) has a leading rows
  axis of ``rows``: the engine compacts it with its row."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(rows_state)[0]:
    shape, dtype = _leaf_sd(leaf)
    if not shape or shape[0] != rows:
      field = "state" + jax.tree_util.keystr(path)
      raise ValueError(
          f"{_name(proposer)}.{method} returned per-row state leaf {field} of shape "
          f"{_fmt(shape, dtype)}; every leaf of the per-row state (split_state(state)[0]) needs "
          f"a leading rows axis of {rows} (expected ({rows}, ...)). State shared across rows "
          "goes in the shared part (override split_state / join_state)")


def _short(treedef) -> str:
  s = str(treedef)
  return s if len(s) <= 300 else s[:297] + "..."


def check_same_state(proposer, method: str, got: PyTree, want: PyTree) -> None:
  """``got`` has the tree structure, shapes and dtypes of ``want`` (the state a step started
  with: the rollout's loop carries it from step to step)."""
  name = _name(proposer)
  gdef, wdef = jax.tree.structure(got), jax.tree.structure(want)
  if gdef != wdef:
    raise ValueError(
        f"{name}.{method} returned a state whose tree structure differs from the state the step "
        f"started with (it must keep structure, shapes and dtypes): expected {_short(wdef)}, got "
        f"{_short(gdef)}")
  wl = jax.tree_util.tree_flatten_with_path(want)[0]
  for (path, w), g in zip(wl, jax.tree.leaves(got), strict=True):
    (ws, wd), (gs, gd) = _leaf_sd(w), _leaf_sd(g)
    if ws != gs or wd != gd:
      field = "state" + jax.tree_util.keystr(path)
      raise ValueError(
          f"{name}.{method} returned state leaf {field} of {_fmt(gs, gd)}; expected "
          f"{_fmt(ws, wd)} as in the state the step started with (a proposer's state keeps its "
          "structure, shapes and dtypes from step to step)")


def check_step_state(proposer, start: PyTree, proposed: PyTree, updated: PyTree) -> None:
  """``update``'s state (``updated``) keeps the structure, shapes and dtypes of the state the step
  started with (``start``); when it does not and ``propose``'s state (``proposed``) already
  differed, the error names ``propose``."""
  try:
    check_same_state(proposer, "update", updated, start)
  except ValueError:
    check_same_state(proposer, "propose", proposed, start)
    raise


def check_stats(proposer, stats: PyTree, like: PyTree) -> None:
  """``update``'s statistics add onto ``init_stats()`` without changing its shapes or dtypes."""
  name = _name(proposer)
  gdef, wdef = jax.tree.structure(stats), jax.tree.structure(like)
  if gdef != wdef:
    raise ValueError(
        f"{name}.update returned statistics whose tree structure differs from "
        f"{name}.init_stats(): expected {_short(wdef)}, got {_short(gdef)}")
  for (path, w), g in zip(jax.tree_util.tree_flatten_with_path(like)[0], jax.tree.leaves(stats),
                          strict=True):
    (ws, wd), (gs, gd) = _leaf_sd(w), _leaf_sd(g)
    try:
      ok = np.broadcast_shapes(ws, gs) == ws and jnp.result_type(w, g) == wd
    except ValueError:
      ok = False
    if not ok:
      field = "stats" + jax.tree_util.keystr(path)
      raise ValueError(
          f"{name}.update returned statistic {field} of {_fmt(gs, gd)}; init_stats() has "
          f"{_fmt(ws, wd)} (the engine adds them up; statistics have no rows axis)")


def _pair(proposer, method: str, out) -> tuple:
  if not isinstance(out, tuple) or len(out) != 2:
    what = "(Tree, state)" if method == "propose" else "(state, statistics)"
    raise ValueError(f"{_name(proposer)}.{method} must return a pair {what}, got "
                     f"{type(out).__name__}")
  return out


def check_propose_output(proposer, out, rows: int, num_nodes: int) -> tuple[Tree, PyTree]:
  """(tree, state) of ``propose``'s return value, its tree checked by ``check_tree``."""
  tr, state = _pair(proposer, "propose", out)
  check_tree(proposer, tr, rows, num_nodes)
  return tr, state


def check_update_output(proposer, out) -> tuple[PyTree, PyTree]:
  return _pair(proposer, "update", out)


def check_tree(proposer, tree, rows: int, num_nodes: int) -> None:
  """``tree`` is a ``Tree`` of ``rows`` rows and ``num_nodes`` + 1 nodes (node 0 = the root) with
  the shapes and dtypes ``Tree`` documents."""
  name = _name(proposer)
  if not isinstance(tree, Tree):
    raise ValueError(f"{name}.propose must return (specroll_jax.proposers.Tree, state), got a "
                     f"{type(tree).__name__} as the tree")
  # a proposer that proposes nodes reaches depth 1 at least
  int_arg(proposer.max_depth, f"{name}.max_depth (num_nodes={num_nodes})", 1)
  n1 = num_nodes + 1
  want = {"tokens": ((rows, n1), jnp.int32), "depth": ((rows, n1), jnp.int32),
          "parent": ((rows, n1), jnp.int32), "valid": ((rows, n1), jnp.bool_),
          "mask": ((rows, n1, n1), jnp.bool_)}
  for field, (shape, dtype) in want.items():
    x = getattr(tree, field)
    if x is None or not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise ValueError(f"{name}.propose returned Tree.{field} = {type(x).__name__}; expected an "
                       f"array of {_fmt(shape, dtype)}")
    if tuple(x.shape) != shape or x.dtype != dtype:
      axes = "[rows, num_nodes + 1, num_nodes + 1]" if field == "mask" else "[rows, num_nodes + 1]"
      hint = ""
      if len(x.shape) >= 2 and x.shape[1] != n1:
        hint = (f"; the node axis must be num_nodes + 1 = {n1} (node 0 = the root): never more "
                "nodes than num_nodes, and tree.pad appends invalid ones to a smaller tree")
      raise ValueError(
          f"{name}.propose returned Tree.{field} of {_fmt(x.shape, x.dtype)}; expected "
          f"{_fmt(shape, dtype)} ({axes} with rows={rows}, num_nodes={num_nodes}){hint}")


def check_gain(proposer, gain, rows: int) -> None:
  """``expected_gain`` returns None or one number per row."""
  if gain is None:
    return
  shape, dtype = _leaf_sd(gain)
  if shape != (rows,) or not jnp.issubdtype(dtype, jnp.number):
    raise ValueError(f"{_name(proposer)}.expected_gain returned {_fmt(shape, dtype)}; expected "
                     f"({rows},) numbers (or None)")
