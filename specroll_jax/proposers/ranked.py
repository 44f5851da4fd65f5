"""Proposers that rank candidate nodes by estimated acceptance (docs/design.md, "One tree from
every source, ranked by expected acceptance").

A ranked proposer produces ``tree.Candidates`` (whole paths with a score = log of the estimated
probability that the path is accepted, and the calibration bin each estimate came from); the base
class here turns them into the row's tree with ``tree.select`` (the best distinct paths, merged
duplicates, within the row's budget) and, after the verify forward, counts per bin how many of its
nodes were tested (the parent was accepted) and accepted: ``TreeStats``, summed over the rollout.
A caller folds those counts into a ``calibration.Calibration`` and passes the calibrated table
back in the proposer's parameters for the next batch, so estimates track the target as it drifts.
``TreeStats.expected`` (the expected accepted nodes of a row's best n candidates, for every n up to
the capacity) is what ``goodput`` weighs against the measured cost of verifying n nodes.
"""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from specroll_jax.engines.results import Summed
from specroll_jax.proposers import tree as _tree
from specroll_jax.proposers.base import Proposer, RowsShared

NUM_FOUND = 3  # lookup sources (own, sibling, prior) whose hits ``TreeStats.found`` counts


@flax.struct.dataclass
class TreeStats(Summed):
  """Summed over a rollout: the counts a calibration table learns from, and what goodput needs."""

  tested: Int[Array, " Nb"]  # nodes per bin whose parent was accepted
  hit: Int[Array, " Nb"]  # ... and that were accepted themselves
  expected: Float[Array, " Nr"]  # sum over row-steps of the expected accepted nodes with n nodes
  row_steps: Int[Array, ""]  # row-steps that proposed
  found: Int[Array, " S"]  # row-steps where a lookup source had a continuation

  @staticmethod
  def zeros(num_bins: int, ranks: int) -> TreeStats:
    return TreeStats(tested=jnp.zeros((num_bins,), jnp.int32),
                     hit=jnp.zeros((num_bins,), jnp.int32),
                     expected=jnp.zeros((ranks,), jnp.float32), row_steps=jnp.int32(0),
                     found=jnp.zeros((NUM_FOUND,), jnp.int32))

  def acceptance(self):
    """Measured acceptance per bin (hit / tested; NaN where nothing was tested)."""
    import numpy as np
    t = np.asarray(self.tested, np.float64)
    return np.where(t > 0, np.asarray(self.hit, np.float64) / np.maximum(t, 1), np.nan)

  def expected_per_row_step(self):
    """Mean expected accepted nodes per row-step with the best n nodes, n = 0..ranks-1."""
    import numpy as np
    return np.asarray(self.expected, np.float64) / max(int(self.row_steps), 1)


@flax.struct.dataclass
class RankedRows:
  """Per-row state of a ranked proposer (compacted with the row)."""

  bins: Int[Array, "R N1"]  # calibration bin of each node of the last tree (-1: none)
  expected: Float[Array, "R Nr"]  # expected accepted nodes of the last tree's best n candidates
  proposed: Bool[Array, " R"]  # the row proposed since the last update
  found: Bool[Array, "R S"]  # which lookup sources had a continuation for it

  @staticmethod
  def zeros(rows: int, capacity: int) -> RankedRows:
    return RankedRows(bins=jnp.full((rows, capacity + 1), -1, jnp.int32),
                      expected=jnp.zeros((rows, capacity + 1), jnp.float32),
                      proposed=jnp.zeros((rows,), bool),
                      found=jnp.zeros((rows, NUM_FOUND), bool))


class RankedProposer(Proposer):
  """Base of proposers that rank candidates (a mixin for frozen dataclasses). Subclasses define
  ``num_bins``, ``capacity``, ``max_depth`` and ``candidates``; state is (``RankedRows``, the
  subclass's shared state), or (``RankedRows``, its own per-row extra, shared) via the hooks."""

  @property
  def num_bins(self) -> int:
    raise NotImplementedError

  def candidates(self, target, params, shared, inp, *, num_nodes: int):
    """(tree.Candidates, found [R, NUM_FOUND] bool) for every row."""
    raise NotImplementedError

  def init_shared(self, target, params, rows):
    return ()

  def init(self, target, params, rows):
    return RowsShared(rows=RankedRows.zeros(rows.row.shape[0], self.capacity),
                      shared=self.init_shared(target, params, rows))

  def split_state(self, state):
    return state.rows, state.shared

  def join_state(self, rows, shared):
    return RowsShared(rows=rows, shared=shared)

  def propose(self, target, params, state, inp, *, num_nodes):
    rows, shared = state
    if num_nodes == 0:
      return _tree.root_only(inp.root), state
    cands, found = self.candidates(target, params, shared, inp, num_nodes=num_nodes)
    tr, sel = _tree.select(inp.root, cands, inp.budget, num_nodes=num_nodes,
                           max_depth=self.max_depth, ranks=self.capacity + 1)
    return tr, RowsShared(rows=ranked_after_propose(rows, sel, found, inp.budget, num_nodes),
                          shared=shared)

  def update(self, target, params, state, fb):
    rows, shared = state
    rows, stats = ranked_update(rows, fb, self.num_bins)
    return RowsShared(rows=rows, shared=shared), stats

  def expected_gain(self, state, num_nodes: int):
    return state.rows.expected[:, min(num_nodes, self.capacity)]

  def init_stats(self):
    return TreeStats.zeros(self.num_bins, self.capacity + 1)


def ranked_after_propose(rows: RankedRows, sel: _tree.Selection, found, budget,
                         num_nodes: int) -> RankedRows:
  """A ranked proposer's per-row bookkeeping after ``tree.select`` chose a tree of ``num_nodes``
  nodes: each node's bin, the expected accepted nodes by tree size, the lookup sources found."""
  active = budget > 0
  return rows.replace(bins=jnp.full_like(rows.bins, -1).at[:, : num_nodes + 1].set(sel.bin),
                      expected=jnp.where(active[:, None], sel.expected, 0.0),
                      found=found & active[:, None], proposed=active)


def ranked_update(rows: RankedRows, fb, num_bins: int) -> tuple[RankedRows, TreeStats]:
  """(rows, this step's ``TreeStats``) after the verify forward decided ``fb``: per bin the nodes
  tested (parent accepted) and accepted, and the expected accepted nodes of the rows that
  proposed."""
  n1 = fb.tree.tokens.shape[1]
  tested, hit = _tree.node_outcomes(fb.tree, fb.accepted, rows.bins[:, :n1], num_bins, fb.active)
  on = rows.proposed & fb.active
  stats = TreeStats(tested=tested, hit=hit,
                    expected=jnp.where(on[:, None], rows.expected, 0.0).sum(0),
                    row_steps=on.sum().astype(jnp.int32),
                    found=(rows.found & on[:, None]).sum(0).astype(jnp.int32))
  return rows.replace(proposed=jnp.zeros_like(rows.proposed)), stats


def log_table(table, bins):
  """log of a calibration table's probabilities at ``bins`` (clipped away from 0 and 1)."""
  return jnp.log(jnp.clip(jnp.take(table, bins), 1e-6, 1.0 - 1e-6))
