"""One tree from candidate paths of several sources (``tree.select``): the best distinct paths by
score, duplicates merged, prefix-closed in priority order, within each row's budget; against a
plain-Python reference. Shapes are fixed (one compile); hypothesis varies the values only."""

import jax
import jax.numpy as jnp
import numpy as np
from conftest import ancestor_closure
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specroll_jax.proposers import tree as T

R, CHAINS, DP, N, RANKS = 4, 5, 4, 6, 9
M = CHAINS * DP
_select = jax.jit(T.select, static_argnames=("num_nodes", "max_depth", "ranks"))


def _chains_to_candidates(tokens, lengths, steps):
  """Every prefix of every chain is a candidate; score = cumulative sum of (negative) steps."""
  paths = np.full((R, M, DP), -1, np.int32)
  depth = np.zeros((R, M), np.int32)
  score = np.zeros((R, M), np.float32)
  for r in range(R):
    for c in range(CHAINS):
      for d in range(DP):
        m = c * DP + d
        if d < lengths[r, c]:
          paths[r, m, : d + 1] = tokens[r, c, : d + 1]
          depth[r, m] = d + 1
          score[r, m] = steps[r, c, : d + 1].sum()
  return paths, depth, score


def _reference(paths, depth, score, budget):
  """{path: probability} of the nodes a row should get."""
  best = {}
  for m in range(M):
    if depth[m] >= 1:
      p = tuple(int(t) for t in paths[m, : depth[m]])
      best[p] = max(best.get(p, -np.inf), float(score[m]))
  eff = {}
  for p in sorted(best, key=len):
    if len(p) == 1:
      eff[p] = best[p]
    elif p[:-1] in eff:
      eff[p] = min(best[p], eff[p[:-1]] - 1e-3)
  order = sorted(eff, key=lambda p: -eff[p])
  return {p: np.exp(eff[p]) for p in order[: min(budget, N)]}, sorted(eff.values(), reverse=True)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31 - 1))
def test_select_takes_the_best_distinct_paths(seed):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 3, size=(R, CHAINS, DP))  # small vocab: many shared prefixes
  lengths = rng.integers(0, DP + 1, size=(R, CHAINS))
  steps = -rng.exponential(1.0, size=(R, CHAINS, DP)) - 1e-2
  paths, depth, score = _chains_to_candidates(tokens, lengths, steps)
  budget = rng.integers(0, N + 2, size=R)
  root = rng.integers(0, 3, size=R)
  bins = rng.integers(0, 7, size=(R, M)).astype(np.int32)
  cands = T.Candidates(paths=jnp.asarray(paths), depth=jnp.asarray(depth),
                       score=jnp.asarray(score), bin=jnp.asarray(bins))
  tree, sel = _select(jnp.asarray(root), cands, jnp.asarray(budget), num_nodes=N, max_depth=DP,
                      ranks=RANKS)
  tok, dep, par, val = (np.asarray(x) for x in (tree.tokens, tree.depth, tree.parent, tree.valid))
  prob, expected = np.asarray(sel.prob), np.asarray(sel.expected)
  for r in range(R):
    want, effs = _reference(paths[r], depth[r], score[r], int(budget[r]))
    got = {}
    for i in range(1, N + 1):
      if not val[r, i]:
        continue
      assert val[r, par[r, i]] and par[r, i] < i  # prefix-closed, parents first
      assert dep[r, i] == dep[r, par[r, i]] + 1
      p = (int(tok[r, i]),) if par[r, i] == 0 else None
      j, chain = i, []
      while j > 0:
        chain.append(int(tok[r, j]))
        j = int(par[r, j])
      p = tuple(chain[::-1])
      assert p not in got, "duplicate path"
      got[p] = prob[r, i]
    assert set(got) == set(want)
    for p in got:
      np.testing.assert_allclose(got[p], want[p], rtol=1e-5)
    assert list(np.flatnonzero(val[r, 1:])) == list(range(len(want)))  # valid nodes come first
    np.testing.assert_array_equal(np.asarray(tree.mask)[r], ancestor_closure(par[r], val[r]))
    probs = np.exp(np.array(effs))
    want_exp = [probs[:n].sum() for n in range(RANKS)]
    np.testing.assert_allclose(expected[r], want_exp, rtol=1e-5, atol=1e-6)


def test_node_outcomes_counts_tested_nodes_per_bin():
  # root -> a(1) -> b(2); root -> c(3). accepted: root, a. b is tested (parent a accepted) and
  # missed, c tested and missed.
  tree = T.Tree(tokens=jnp.array([[9, 1, 2, 3]]), depth=jnp.array([[0, 1, 2, 1]]),
                parent=jnp.array([[-1, 0, 1, 0]]), valid=jnp.ones((1, 4), bool),
                mask=jnp.ones((1, 4, 4), bool))
  accepted = jnp.array([[True, True, False, False]])
  bins = jnp.array([[-1, 0, 1, 1]])
  tested, hit = T.node_outcomes(tree, accepted, bins, 3, jnp.array([True]))
  np.testing.assert_array_equal(tested, [1, 2, 0])
  np.testing.assert_array_equal(hit, [1, 0, 0])
  tested, hit = T.node_outcomes(tree, accepted, bins, 3, jnp.array([False]))
  assert int(tested.sum()) == 0
