"""Sparse speculation trees with static shapes (DESIGN.md, "One speculative step", step 2).

The candidate tree is the product tree of the heads' per-depth top-k candidates (k_1, ..., k_K): a
node
at depth d is (parent at depth d-1, one of head d's top-k_d tokens); its score is the cumulative
log-probability along its path. The planner

  1. reserves the trunk (the top-1 of every head, chained) first, so deep heads are never starved;
  2. fills the rest of the row's node budget n with the highest-scoring nodes among children of
  nodes
     already in the tree.

Because a child's score is its parent's plus a log-probability (<= 0, and made strictly negative),
greedy best-first expansion picks exactly the n highest-scoring nodes, and sorting them by score
puts
every parent before its children: the tree is prefix-closed and topologically ordered by
construction, with no duplicate (parent, token) (a head's top-k tokens are distinct).
Node 0 is the root (the target's already-sampled next token, depth 0).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

_TRUNK_BONUS = 1e6  # f32 spacing 0.0625 here: trunk keys stay distinct per depth
_MIN_STEP = 1e-3  # every edge lowers the score by at least this (strict parent > child order)


@flax.struct.dataclass
class Tree:
  tokens: Int[Array, "R N1"]  # node tokens, node 0 = root
  depth: Int[Array, "R N1"]  # root 0
  parent: Int[Array, "R N1"]  # index of the parent node; -1 for the root
  mask: Bool[Array, "R N1 N1"]  # mask[i, j]: j is an ancestor of i or i itself
  valid: Bool[Array, "R N1"]  # node is part of the tree (within the row's budget)
  slot: Int[Array, "R N1"]  # index in the candidate product tree (-1 for the root)


@functools.cache
def candidate_tree(topk: tuple[int, ...]):
  """Static layout of the product tree, in breadth-first order (numpy, root excluded).

  Returns (depth [P], parent [P] (-1 = root), cand [P] candidate index at its depth,
  ancestor-or-self [P+1, P+1] with the root at index 0, trunk [P] bool).
  """
  depth, parent, cand = [], [], []
  prev = [-1]
  for d, k in enumerate(topk, start=1):
    cur = []
    for p in prev:
      for c in range(k):
        depth.append(d)
        parent.append(p)
        cand.append(c)
        cur.append(len(depth) - 1)
    prev = cur
  depth, parent, cand = np.array(depth), np.array(parent), np.array(cand)
  n = len(depth)
  anc = np.eye(n + 1, dtype=bool)
  anc[:, 0] = True
  for i in range(n):  # parents precede children in BFS order
    if parent[i] >= 0:
      anc[i + 1] |= anc[parent[i] + 1]
  trunk = np.zeros(n, bool)
  node = -1
  for d in range(len(topk)):
    node = int(np.flatnonzero((depth == d + 1) & (parent == node) & (cand == 0))[0])
    trunk[node] = True
  return depth, parent, cand, anc, trunk


def plan(root: Int[Array, " R"], head_logprobs: Float[Array, "R K V"], budget: Int[Array, " R"], *,
         num_nodes: int, topk: tuple[int, ...]) -> Tree:
  """Build each row's tree of at most ``num_nodes`` nodes (static) of which ``budget[r]`` are valid.

  head_logprobs[r, k-1] is head k's log-distribution over the token at depth k.
  """
  r = root.shape[0]
  k_heads = len(topk)
  depth_p, parent_p, cand_p, anc_p, trunk_p = candidate_tree(topk)
  n_cand = len(depth_p)
  if num_nodes > n_cand:
    raise ValueError(f"num_nodes={num_nodes} exceeds the candidate tree's {n_cand} nodes for "
                     f"topk={topk}")
  if head_logprobs.shape[1] < k_heads:
    raise ValueError(f"head_logprobs has {head_logprobs.shape[1]} heads, topk needs {k_heads}")
  # Per depth: top-k candidates of head d.
  cand_lp, cand_tok = [], []
  for d, k in enumerate(topk):
    v, i = jax.lax.top_k(head_logprobs[:, d].astype(jnp.float32), k)
    cand_lp.append(v)
    cand_tok.append(i)
  score = jnp.zeros((r, n_cand), jnp.float32)
  tok = jnp.zeros((r, n_cand), jnp.int32)
  for d in range(1, k_heads + 1):
    idx = np.flatnonzero(depth_p == d)
    step = jnp.minimum(cand_lp[d - 1][:, cand_p[idx]], -_MIN_STEP)
    par = parent_p[idx]
    base = jnp.zeros((r, len(idx))) if d == 1 else score[:, par]
    score = score.at[:, idx].set(base + step)
    tok = tok.at[:, idx].set(cand_tok[d - 1][:, cand_p[idx]])
  key = jnp.where(trunk_p[None], _TRUNK_BONUS - depth_p[None].astype(jnp.float32), score)
  if num_nodes == 0:
    sel = jnp.zeros((r, 0), jnp.int32)
  else:
    _, sel = jax.lax.top_k(key, num_nodes)  # [R, N], descending: parents before children
  n1 = num_nodes + 1
  valid = jnp.concatenate([jnp.ones((r, 1), bool),
                           jnp.arange(num_nodes)[None] < budget[:, None]], axis=1)
  slot = jnp.concatenate([jnp.full((r, 1), -1, jnp.int32), sel.astype(jnp.int32)], axis=1)
  tokens = jnp.concatenate([root[:, None].astype(jnp.int32),
                            jnp.take_along_axis(tok, sel, axis=1)], axis=1)
  depth = jnp.concatenate([jnp.zeros((r, 1), jnp.int32),
                           jnp.asarray(depth_p, jnp.int32)[sel]], axis=1)
  # Parent index within the tree: position of the parent's slot among the selected nodes.
  pos_in_tree = jnp.zeros((r, n_cand + 1), jnp.int32).at[
      jnp.arange(r)[:, None], sel + 1].set(jnp.arange(1, n1, dtype=jnp.int32)[None])
  parent = jnp.concatenate(
      [jnp.full((r, 1), -1, jnp.int32),
       jnp.take_along_axis(pos_in_tree, jnp.asarray(parent_p + 1, jnp.int32)[sel], axis=1)],
      axis=1)
  ext = slot + 1  # rows/cols of anc_p
  mask = jnp.asarray(anc_p)[ext[:, :, None], ext[:, None, :]]
  mask = mask & valid[:, None, :] & valid[:, :, None]
  mask = mask | jnp.eye(n1, dtype=bool)[None]
  return Tree(tokens=tokens, depth=depth, parent=parent, mask=mask, valid=valid, slot=slot)


def accept(tree: Tree, target_tokens: Int[Array, "R N1"], max_depth: int):
  """Exact acceptance: node n is accepted iff its parent is and token(n) == the target's sample at
  the parent. Returns (accepted [R, N1] bool, path [R, max_depth + 1] node index at each depth of
  the
  accepted path, path_len [R] = D + 1)."""
  r, n1 = tree.tokens.shape
  par = jnp.maximum(tree.parent, 0)
  match = tree.valid & (tree.tokens == jnp.take_along_axis(target_tokens, par, axis=1))
  is_root = jnp.arange(n1)[None] == 0
  acc = jnp.broadcast_to(is_root, (r, n1))
  for _ in range(max_depth):  # depth of the tree bounds the propagation
    acc = is_root | (match & jnp.take_along_axis(acc, par, axis=1))
  d_all = jnp.arange(max_depth + 1)
  on_depth = acc[:, None, :] & (tree.depth[:, None, :] == d_all[None, :, None])  # [R, D1, N1]
  path = jnp.argmax(on_depth, axis=-1).astype(jnp.int32)
  path_len = on_depth.any(-1).sum(-1).astype(jnp.int32)
  return acc, path, path_len
