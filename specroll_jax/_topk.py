"""``lax.top_k`` whose outputs may be sliced, and several top-k id lists from one top-k.

XLA's CPU compiler turns ``lax.top_k`` (a sort followed by a slice of its first k entries) into its
``TopK`` custom call only while the slice is used as it is. A further slice of the outputs (a
shorter prefix, the k-th value) is folded into that slice, the pattern no longer matches, and the
whole last axis is sorted, a cost that grows with the vocabulary (docs/benchmarks.md, "Top-k on
the CPU": ``experiments/bench_rollout.py --top-k 50``). An optimization barrier between the top-k
and its users keeps the pattern. That is jax 0.10's XLA (the line ``pip install jax`` gives on
Python 3.11); jax 0.11.2's keeps a sliced top-k a TopK. There, and on a GPU or TPU (whose top-k is
its own kernel), the barrier only keeps the outputs from fusing into their users (not timed).
"""

from __future__ import annotations

import jax


def top_k(x, k: int):
  """(values, ids) of the ``k`` largest entries of ``x`` along its last axis, as ``lax.top_k``
  (sorted, value descending, the lower index first among equals); the outputs may be sliced or
  indexed without the whole axis being sorted on a CPU."""
  values, ids = jax.lax.top_k(x, k)
  # one barrier per output: a barrier over both takes the TopK's tuple itself once XLA folds
  # tuple(gte 0, gte 1) back into it, and XLA's TopkDecomposer (which runs on sharded programs)
  # then fails a check on a TopK user that is not a get-tuple-element, killing the process
  return jax.lax.optimization_barrier(values), jax.lax.optimization_barrier(ids)


def top_ids(x, *ks: int) -> tuple:
  """The ids of the ``k`` largest entries of ``x`` along its last axis, for each ``k`` in
  ``ks``, from one top-k at the largest ``k``: its ids are sorted, so each shorter list is a
  prefix of the longest and equals ``lax.top_k(x, k)[1]`` exactly."""
  ids = top_k(x, max(ks))[1]
  return tuple(ids[..., :k] for k in ks)
