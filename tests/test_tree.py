"""Sparse speculation trees (docs/design.md, "One speculative step", steps 2 and 4): properties of
``plan`` checked against independent numpy references, chains and the root-only tree, the heads
proposer's trimmed candidate set (same tree as the full one), and exact acceptance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ancestor_closure
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specroll_jax.proposers import tree as tree_mod
from specroll_jax.proposers.static_heads import effective_topk
from specroll_jax.proposers.tree import Tree, accept, plan

_plan = jax.jit(plan, static_argnames=("num_nodes", "topk"))
_accept = jax.jit(accept, static_argnames=("max_depth",))

V = 8
R = 3
_MIN_STEP = tree_mod._MIN_STEP  # every edge lowers the score by at least this


def capacity(topk):
  total, width = 0, 1
  for k in topk:
    width *= k
    total += width
  return total


# A fixed grid of static shapes (topk, N): each is one compile; hypothesis varies the values.
SHAPES = [((4, 3, 2), 0), ((4, 3, 2), 3), ((4, 3, 2), 9), ((4, 3, 2), 40), ((2, 2), 4),
          ((1, 1, 1), 3), ((3,), 3), ((1, 4, 2, 2), 12), ((2, 1, 3), 5)]


@st.composite
def plan_inputs(draw):
  topk, n = draw(st.sampled_from(SHAPES))
  budget = draw(st.lists(st.integers(0, n), min_size=R, max_size=R))
  seed = draw(st.integers(0, 2**31 - 1))
  return topk, n, np.array(budget, np.int32), seed


def _head_logprobs(seed, k_heads):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(R, k_heads, V)) * rng.uniform(0.5, 3.0)
  lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return lp.astype(np.float32), rng.integers(0, 1000, size=R).astype(np.int32)


def _reference_candidates(lp, topk):
  """Every node of the product tree as (path of candidate indices) -> (token, score), in float64."""
  lp = lp.astype(np.float64)
  order = [np.argsort(-lp[d])[:k] for d, k in enumerate(topk)]  # head d+1's top-k tokens
  cands = {}
  frontier = [((), 0.0)]
  for d, k in enumerate(topk):
    nxt = []
    for path, score in frontier:
      for c in range(k):
        tok = int(order[d][c])
        s = score + min(lp[d, tok], -_MIN_STEP)
        cands[path + (c,)] = (tok, s)
        nxt.append((path + (c,), s))
    frontier = nxt
  return cands, order


def _node_paths(tree_np, r):
  """Per valid node of row r: the tuple of tokens on its path from the root (root excluded)."""
  tokens, parent, valid = tree_np["tokens"][r], tree_np["parent"][r], tree_np["valid"][r]
  out = {0: ()}
  for i in range(1, len(tokens)):
    if valid[i]:
      out[i] = out[int(parent[i])] + (int(tokens[i]),)  # parents precede children (checked)
  return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan_inputs())
def test_plan_properties(args):
  topk, n, budget, seed = args
  k_heads = len(topk)
  lp, root = _head_logprobs(seed, k_heads)
  tree = _plan(jnp.asarray(root), jnp.asarray(lp), jnp.asarray(budget), num_nodes=n, topk=topk)
  t = {f: np.asarray(getattr(tree, f)) for f in ("tokens", "depth", "parent", "mask", "valid")}
  n1 = n + 1
  for f in ("tokens", "depth", "parent", "valid"):
    assert t[f].shape == (R, n1), f
  assert t["mask"].shape == (R, n1, n1)

  for r in range(R):
    tokens, depth, parent, valid = t["tokens"][r], t["depth"][r], t["parent"][r], t["valid"][r]
    cands, order = _reference_candidates(lp[r], topk)
    n_eff = min(int(budget[r]), n)

    # root
    assert valid[0] and parent[0] == -1 and depth[0] == 0 and tokens[0] == root[r]
    # budget respected; valid nodes are a prefix
    assert valid.sum() - 1 == n_eff
    np.testing.assert_array_equal(valid[1:], np.arange(n) < n_eff)

    # prefix-closed and topologically ordered, depth = parent depth + 1
    for i in range(1, n1):
      if valid[i]:
        p = int(parent[i])
        assert 0 <= p < i and valid[p], (r, i, p)
        assert depth[i] == depth[p] + 1
        assert 1 <= depth[i] <= k_heads

    # tokens at depth d are among head d's top-k_d; no duplicate (parent, token)
    pairs = set()
    for i in range(1, n1):
      if valid[i]:
        assert tokens[i] in order[depth[i] - 1], (r, i)
        pairs.add((int(parent[i]), int(tokens[i])))
    assert len(pairs) == n_eff

    # ancestor mask == reflexive transitive closure of parent (valid); invalid: diagonal only
    np.testing.assert_array_equal(t["mask"][r], ancestor_closure(parent, valid))

    # map tree nodes to candidate-tree paths (token paths are unique: top-k tokens are distinct)
    by_tokens = {}
    for path, (_, _) in cands.items():
      toks = tuple(int(order[d][c]) for d, c in enumerate(path))
      by_tokens[toks] = path
    paths = _node_paths(t, r)
    chosen = {by_tokens[toks] for i, toks in paths.items() if i > 0}
    assert len(chosen) == n_eff

    # trunk (the chain of top-1 candidates) is reserved first
    trunk = [(0,) * d for d in range(1, k_heads + 1)]
    if n_eff >= k_heads:
      assert set(trunk) <= chosen
      trunk_tokens = tuple(int(order[d][0]) for d in range(k_heads))
      assert trunk_tokens in paths.values()
    else:
      assert chosen == set(trunk[:n_eff])

    # greedy optimality: the non-trunk nodes are the best-scoring ones. Every non-chosen child of
    # a chosen node (or of the root) scores no higher than any chosen non-trunk node.
    if n_eff > k_heads:
      chosen_scores = [cands[p][1] for p in chosen if p not in trunk]
      frontier = [p for p in cands if p not in chosen and (len(p) == 1 or p[:-1] in chosen)]
      if frontier:
        assert min(chosen_scores) >= max(cands[p][1] for p in frontier) - 1e-5
      # equivalently: the chosen non-trunk set is the top (n_eff - K) of all non-trunk candidates
      rest = sorted((s for p, (_, s) in cands.items() if p not in trunk), reverse=True)
      np.testing.assert_allclose(sorted(chosen_scores, reverse=True), rest[:n_eff - k_heads],
                                 atol=1e-5)


def test_plan_rejects_too_many_nodes():
  with pytest.raises(ValueError, match="num_nodes=7"):
    plan(jnp.zeros((1,), jnp.int32), jnp.zeros((1, 2, V)), jnp.zeros((1,), jnp.int32),
         num_nodes=7, topk=(2, 2))


def test_candidate_tree_layout():
  depth, parent, cand, anc, trunk = tree_mod.candidate_tree((3, 2))
  assert len(depth) == 3 + 6
  np.testing.assert_array_equal(depth, [1, 1, 1, 2, 2, 2, 2, 2, 2])
  np.testing.assert_array_equal(parent, [-1, -1, -1, 0, 0, 1, 1, 2, 2])
  np.testing.assert_array_equal(cand, [0, 1, 2, 0, 1, 0, 1, 0, 1])
  np.testing.assert_array_equal(trunk, [1, 0, 0, 1, 0, 0, 0, 0, 0])
  assert anc[0].sum() == 1 and anc[:, 0].all()
  assert anc[5 + 1, 1 + 1] and not anc[5 + 1, 0 + 1] and anc[5 + 1, 5 + 1]


# --- accept ---------------------------------------------------------------------------------------


def _hand_tree():
  """Two rows of the same shape (N = 6):

      0 (root, tok 10)
      +-- 1 (tok 11) +-- 3 (tok 13) -- 5 (tok 15)
      |              +-- 4 (tok 14)
      +-- 2 (tok 12) -- 6 (tok 16)

  Row 1 has only nodes 0..4 valid.
  """
  tokens = np.array([[10, 11, 12, 13, 14, 15, 16]] * 2, np.int32)
  parent = np.array([[-1, 0, 0, 1, 1, 3, 2]] * 2, np.int32)
  depth = np.array([[0, 1, 1, 2, 2, 3, 2]] * 2, np.int32)
  valid = np.array([[1] * 7, [1, 1, 1, 1, 1, 0, 0]], bool)
  mask = np.zeros((2, 7, 7), bool)
  for r in range(2):
    for i in range(7):
      mask[r, i, i] = True
      if valid[r, i]:
        j = i
        while j >= 0:
          mask[r, i, j] = True
          j = parent[r, j]
  return Tree(tokens=jnp.asarray(tokens), depth=jnp.asarray(depth), parent=jnp.asarray(parent),
              mask=jnp.asarray(mask), valid=jnp.asarray(valid))


@pytest.mark.parametrize("target,want_path", [
    # target_tokens[n] = the target's sample at node n (its prediction for the next position)
    ([11, 13, 99, 15, 99, 99, 99], [0, 1, 3, 5]),  # full depth-3 path
    ([11, 14, 99, 99, 99, 99, 99], [0, 1, 4]),  # branch 4 at depth 2
    ([12, 99, 16, 99, 99, 99, 99], [0, 2, 6]),  # the other subtree
    ([11, 99, 16, 99, 99, 99, 99], [0, 1]),  # node 6 matches its parent's sample, parent rejected
    ([99, 13, 16, 15, 99, 99, 99], [0]),  # nothing matches at depth 1
    ([10, 10, 10, 10, 10, 10, 10], [0]),  # the root's own token is never a child match
])
def test_accept_hand_tree(target, want_path):
  tree = _hand_tree()
  tgt = jnp.asarray(np.array([target, target], np.int32))
  acc, path, path_len = _accept(tree, tgt, max_depth=3)
  acc, path, path_len = np.asarray(acc), np.asarray(path), np.asarray(path_len)
  # row 0: full tree
  assert path_len[0] == len(want_path)
  np.testing.assert_array_equal(path[0, :len(want_path)], want_path)
  assert set(np.flatnonzero(acc[0]).tolist()) == set(want_path)
  # row 1: nodes 5 and 6 are invalid, so paths through them stop before them
  want1 = [n for n in want_path if n < 5]
  assert path_len[1] == len(want1)
  np.testing.assert_array_equal(path[1, :len(want1)], want1)
  assert set(np.flatnonzero(acc[1]).tolist()) == set(want1)


def test_accept_planned_tree():
  """On a planned tree, the target sampling exactly a chosen node's path accepts that path."""
  topk = (3, 2, 2)
  lp, root = _head_logprobs(7, len(topk))
  tree = _plan(jnp.asarray(root), jnp.asarray(lp), jnp.asarray([10, 10, 4], np.int32),
               num_nodes=10, topk=topk)
  tokens, parent = np.asarray(tree.tokens), np.asarray(tree.parent)
  valid, depth = np.asarray(tree.valid), np.asarray(tree.depth)
  for r in range(R):
    deepest = max((i for i in range(11) if valid[r, i]), key=lambda i: (depth[r, i], -i))
    chain = [deepest]
    while chain[-1] != 0:
      chain.append(int(parent[r, chain[-1]]))
    chain = chain[::-1]
    target = np.full((R, 11), 999, np.int32)  # 999 is outside the vocab: never matches
    for a, b in zip(chain[:-1], chain[1:], strict=True):
      target[r, a] = tokens[r, b]
    _, path, path_len = _accept(tree, jnp.asarray(target), max_depth=len(topk))
    path, path_len = np.asarray(path), np.asarray(path_len)
    assert path_len[r] == len(chain)
    np.testing.assert_array_equal(path[r, :len(chain)], chain)
    others = [q for q in range(R) if q != r]
    np.testing.assert_array_equal(path_len[others], 1)  # nothing matches: root only
    np.testing.assert_array_equal(path[others, 0], 0)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_accept_matches_reference(seed):
  """Random targets over a tiny vocab (many matches) against a numpy walk down the tree."""
  topk = (3, 2, 2)
  rng = np.random.default_rng(seed)
  lp = np.log(rng.dirichlet(np.ones(4), size=(R, 3))).astype(np.float32)
  budget = rng.integers(0, 13, size=R).astype(np.int32)
  tree = _plan(jnp.zeros((R,), jnp.int32), jnp.asarray(lp), jnp.asarray(budget), num_nodes=12,
               topk=topk)
  target = rng.integers(0, 4, size=(R, 13)).astype(np.int32)
  _, path, path_len = _accept(tree, jnp.asarray(target), max_depth=3)
  tokens, parent, valid = np.asarray(tree.tokens), np.asarray(tree.parent), np.asarray(tree.valid)
  for r in range(R):
    want = [0]
    while True:  # the child of the last accepted node whose token is the target's sample there
      kids = [i for i in range(13) if valid[r, i] and parent[r, i] == want[-1]
              and tokens[r, i] == target[r, want[-1]]]
      assert len(kids) <= 1  # no duplicate (parent, token)
      if not kids:
        break
      want.append(kids[0])
    assert int(path_len[r]) == len(want)
    np.testing.assert_array_equal(np.asarray(path)[r, :len(want)], want)


def test_chain_and_root_only():
  root = jnp.array([5, 6, 7])
  toks = jnp.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
  tr = tree_mod.chain(root, toks, jnp.array([3, 1, 0]), num_nodes=4)
  valid = np.asarray(tr.valid)
  np.testing.assert_array_equal(valid, [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
  np.testing.assert_array_equal(np.asarray(tr.tokens)[0, :4], [5, 1, 2, 3])
  np.testing.assert_array_equal(np.asarray(tr.parent)[0, :4], [-1, 0, 1, 2])
  for r in range(3):
    np.testing.assert_array_equal(np.asarray(tr.mask)[r],
                                  ancestor_closure(np.asarray(tr.parent)[r], valid[r]))
  ro = tree_mod.root_only(root)
  assert ro.num_nodes == 0 and np.asarray(ro.valid).all()


EFFECTIVE_SHAPES = [((4, 3, 2), 1), ((4, 3, 2), 2), ((4, 3, 2), 5), ((4, 3, 2), 40), ((2, 2), 3),
                    ((1, 4, 2), 6), ((3, 3, 3, 3), 7)]  # fixed static shapes (one compile each)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(EFFECTIVE_SHAPES), st.integers(0, 2**31 - 1))
def test_effective_topk_gives_the_same_tree(shape, seed):
  topk, n = shape
  eff = effective_topk(topk, n)
  assert len(eff) == min(len(topk), n) and all(1 <= e <= k for e, k in zip(eff, topk, strict=False))
  rng = np.random.default_rng(seed)
  lp = np.log(rng.dirichlet(np.ones(V), size=(R, len(topk)))).astype(np.float32)
  budget = jnp.full((R,), n, jnp.int32)
  full = _plan(jnp.zeros((R,), jnp.int32), jnp.asarray(lp), budget, num_nodes=n, topk=topk)
  cut = _plan(jnp.zeros((R,), jnp.int32), jnp.asarray(lp[:, : len(eff)]), budget, num_nodes=n,
              topk=eff)
  fields = ("tokens", "parent", "valid")
  full_np = {f: np.asarray(getattr(full, f)) for f in fields}
  cut_np = {f: np.asarray(getattr(cut, f)) for f in fields}
  for r in range(R):
    assert set(_node_paths(full_np, r).values()) == set(_node_paths(cut_np, r).values())
