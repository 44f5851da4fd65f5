"""Tree builders beyond ``plan``: chains, the ancestor mask, grafting a chain onto a planned tree
within the budget, and the heads proposer's trimmed candidate set (same tree as the full one)."""

import jax
import jax.numpy as jnp
import numpy as np
from conftest import ancestor_closure
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specroll_jax import tree as T
from specroll_jax.proposers.heads import effective_topk

R, V = 3, 6
_plan = jax.jit(T.plan, static_argnames=("num_nodes", "topk"))
_merge = jax.jit(T.merge_chain, static_argnames=("max_depth",))


def _capacity(topk):
  total, width = 0, 1
  for k in topk:
    width *= k
    total += width
  return total


def _paths(tokens, parent, valid):
  """{node: token path from the root (root excluded)} of the valid nodes of one row."""
  out = {0: ()}
  pending = [i for i in range(1, len(tokens)) if valid[i]]
  while pending:  # parents may come after children in a merged tree
    rest = []
    for i in pending:
      if int(parent[i]) in out:
        out[i] = out[int(parent[i])] + (int(tokens[i]),)
      else:
        rest.append(i)
    assert len(rest) < len(pending), "a valid node's parent is not valid"
    pending = rest
  return out


def test_chain_and_root_only():
  root = jnp.array([5, 6, 7])
  toks = jnp.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
  tr = T.chain(root, toks, jnp.array([3, 1, 0]), num_nodes=4)
  valid = np.asarray(tr.valid)
  np.testing.assert_array_equal(valid, [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
  np.testing.assert_array_equal(np.asarray(tr.tokens)[0, :4], [5, 1, 2, 3])
  np.testing.assert_array_equal(np.asarray(tr.parent)[0, :4], [-1, 0, 1, 2])
  for r in range(3):
    np.testing.assert_array_equal(np.asarray(tr.mask)[r],
                                  ancestor_closure(np.asarray(tr.parent)[r], valid[r]))
  ro = T.root_only(root)
  assert ro.num_nodes == 0 and np.asarray(ro.valid).all()


# Fixed grids of static shapes (each one compile); hypothesis varies the values.
MERGE_SHAPES = [((3, 2), 4, 3), ((3, 2), 9, 5), ((1, 1, 1), 3, 4), ((2, 2, 2), 6, 1), ((3,), 2, 5),
                ((2, 3), 8, 2)]  # (topk, N, chain length C)
EFFECTIVE_SHAPES = [((4, 3, 2), 1), ((4, 3, 2), 2), ((4, 3, 2), 5), ((4, 3, 2), 40), ((2, 2), 3),
                    ((1, 4, 2), 6), ((3, 3, 3, 3), 7)]


@st.composite
def merge_inputs(draw):
  topk, n, c = draw(st.sampled_from(MERGE_SHAPES))
  budget = draw(st.lists(st.integers(0, n), min_size=R, max_size=R))
  kinds = draw(st.lists(st.sampled_from(["tree_path", "prefix_then_new", "random"]),
                        min_size=R, max_size=R))
  lengths = draw(st.lists(st.integers(0, c), min_size=R, max_size=R))
  seed = draw(st.integers(0, 2**31 - 1))
  return topk, n, np.array(budget, np.int32), c, kinds, np.array(lengths, np.int32), seed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(merge_inputs())
def test_merge_chain_properties(args):
  topk, n, budget, c, kinds, lengths, seed = args
  rng = np.random.default_rng(seed)
  lp = np.log(rng.dirichlet(np.ones(V), size=(R, len(topk)))).astype(np.float32)
  tr = _plan(jnp.zeros((R,), jnp.int32), jnp.asarray(lp), jnp.asarray(budget), num_nodes=n,
             topk=topk)
  t = {f: np.asarray(getattr(tr, f)) for f in ("tokens", "parent", "valid")}
  chains = np.full((R, c), -1, np.int32)
  for r in range(R):
    paths = list(_paths(t["tokens"][r], t["parent"][r], t["valid"][r]).values())
    deepest = max(paths, key=len)
    if kinds[r] == "tree_path":
      seq = list(deepest)
    elif kinds[r] == "prefix_then_new":
      seq = list(deepest[: len(deepest) // 2])
    else:
      seq = []
    seq += rng.integers(0, V + 3, size=c).tolist()  # ids >= V never occur in the tree
    chains[r] = seq[:c]
  max_depth = max(len(topk), c)
  out = _merge(tr, jnp.asarray(chains), jnp.asarray(lengths), jnp.asarray(budget),
               max_depth=max_depth)
  o = {f: np.asarray(getattr(out, f)) for f in ("tokens", "parent", "valid", "depth", "mask")}
  assert o["tokens"].shape == (R, n + 1)
  for r in range(R):
    valid, parent, depth = o["valid"][r], o["parent"][r], o["depth"][r]
    before = _paths(t["tokens"][r], t["parent"][r], t["valid"][r])
    after = _paths(o["tokens"][r], parent, valid)
    n_before = int(t["valid"][r].sum()) - 1
    want_chain = tuple(int(x) for x in chains[r, : min(lengths[r], budget[r])])
    shared = 0
    while shared < len(want_chain) and want_chain[: shared + 1] in before.values():
      shared += 1
    # within budget, and exactly as many nodes as fit
    assert int(valid.sum()) - 1 == min(n_before + len(want_chain) - shared, int(budget[r]))
    # prefix-closed with consistent depths, no duplicate path, nothing invented
    for i in range(1, n + 1):
      if valid[i]:
        assert valid[parent[i]] and depth[i] == depth[parent[i]] + 1 and depth[i] <= max_depth
    assert len(set(after.values())) == len(after)
    chain_prefixes = {want_chain[:k] for k in range(len(want_chain) + 1)}
    assert set(after.values()) <= set(before.values()) | chain_prefixes
    # the chain (cut to the budget) is in the tree as one path
    assert want_chain in after.values()
    # the ancestor mask is the closure of the new parents
    np.testing.assert_array_equal(o["mask"][r], ancestor_closure(parent, valid))


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
  for r in range(R):
    a = _paths(*(np.asarray(getattr(full, f))[r] for f in ("tokens", "parent", "valid")))
    b = _paths(*(np.asarray(getattr(cut, f))[r] for f in ("tokens", "parent", "valid")))
    assert set(a.values()) == set(b.values())
