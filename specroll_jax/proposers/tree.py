"""Speculation trees with static shapes (docs/design.md, "One speculative step", steps 2 and 4).

A ``Tree`` holds, per row, node 0 = the root (the target's already-sampled next token, depth 0) and
N more nodes, each with a parent, a depth and a validity bit; ``mask`` is the ancestor-or-self
relation the verify forward attends with. Any proposer may build one; this module has the builders
the library's proposers use:

* ``plan``: the heads' sparse tree. The candidate tree is the product tree of the heads' per-depth
  top-k candidates (k_1, ..., k_K): a node at depth d is (parent at depth d-1, one of head d's
  top-k_d tokens); its score is the cumulative log-probability along its path. The planner reserves
  the trunk (the top-1 of every head, chained) first, so deep heads are never starved, then fills
  the rest of the row's node budget with the highest-scoring nodes among children of nodes already
  in the tree. A child's score is its parent's plus a log-probability (<= 0, made strictly
  negative), so greedy best-first expansion picks exactly the n highest-scoring nodes, and sorting
  them by score puts every parent before its children: the tree is prefix-closed and
  topologically ordered by construction, with no duplicate (parent, token).
* ``chain``: a single path (e.g. prompt-lookup continuations).
* ``select``: the best distinct candidate paths of any sources (``Candidates``) by estimated
  acceptance, within the row's budget (duplicate paths merged).

``accept`` is exact verification: a node is accepted iff its parent is and its token equals the
target's own sample at the parent.

Priority order: the builders keep nodes in an order where dropping valid nodes from the end keeps
the tree prefix-closed (a node's children come after it).

Why one module: ``Tree``'s rules, the builders that keep them (``plan``, ``chain``, ``select``),
``sanitize`` that restores them and ``accept`` that relies on them are one contract; split apart,
each half would restate the other's invariants.
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
  """One speculation tree per row: what ``Proposer.propose`` returns (the rules live here only).

  **Shapes** (checked at trace time by ``proposers.contract.check_tree``; R = the rows of the
  ``ProposeInput``, N = the static ``num_nodes`` the engine asked for, N1 = N + 1):

  ============  ==============  ======  ==============================================
  field         shape           dtype   meaning
  ============  ==============  ======  ==============================================
  ``tokens``    [R, N1]         int32   each node's token
  ``depth``     [R, N1]         int32   its depth (root 0)
  ``parent``    [R, N1]         int32   index of its parent node (root -1)
  ``valid``     [R, N1]         bool    the node is part of the tree
  ``mask``      [R, N1, N1]     bool    mask[r, i, j]: j is i or an ancestor of i
  ============  ==============  ======  ==============================================

  The node axis is exactly N1: never more nodes than ``num_nodes``; a smaller tree gets invalid
  nodes appended with ``pad``. Any node order is accepted, but the library's builders keep
  parents before their children.

  **Rules on values.** The engine cannot check these at trace time; it enforces 1-5 on every
  step instead (``sanitize``), so breaking one costs speed, never exactness.

  1. Node 0 is the root: ``tokens[:, 0] = ProposeInput.root``, ``depth[:, 0] = 0``,
     ``parent[:, 0] = -1``, ``valid[:, 0] = True``, and row 0 of ``mask`` holds only [0, 0].
     The verify forward runs the root at position L and commits its K/V.
  2. ``mask`` is the ancestor-or-self relation of the valid nodes. ``mask[r, i, j]`` is True iff
     i == j, or i and j are valid and j is an ancestor of i (the root is an ancestor of every
     valid node). The diagonal is always True, so an invalid node attends only the cache and
     itself. ``ancestor_mask(parent, valid, max_depth)`` derives it from the parents. A node that
     attends anything else is verified in the wrong context.
  3. A valid node i > 0 has ``depth[i] = depth[parent[i]] + 1``. It is run at position
     L + depth[i], and the committed path is read off by depth.
  4. Prefix-closed validity: a valid node's parent is valid. A node under an invalid parent is
     never accepted, so it only wastes a slot. Every ``parent`` lies in [-1, N]; -1 is for the
     root and, if you like, for invalid nodes.
  5. Depth: valid nodes have 1 <= depth <= ``Proposer.max_depth``. Deeper nodes are never
     accepted (the acceptance walk takes ``max_depth`` hops).
  6. Budget: at most ``ProposeInput.budget[r]`` valid nodes besides the root. The engine gives
     every active row ``budget = num_nodes`` and every finished row 0. The shape rule already caps
     active rows; a finished row's valid nodes are verified by the forward that runs for every
     slot anyway, and emit nothing.
  7. Every token, invalid nodes' included, is a vocabulary id in [0, vocab_size); use 0 for
     unused nodes. Invalid nodes still go through the embedding lookup, and an id >= vocab_size
     embeds as NaN. Attention then spreads the NaN over the row (0 * NaN), and the row stops,
     flagged as non-finite (``generate`` raises FloatingPointError by default).
  8. Duplicates: two valid children of one node with the same token are allowed and stay exact
     (they see the same context, so the target samples the same token at both). They waste a
     node, and ``Feedback.path`` then holds the lowest-index accepted node at each depth, which
     need not be the parent of the next path node. The library's builders never duplicate.

  Exactness would depend on rules 1-3, which ``sanitize`` enforces; a row that breaks rule 7
  stops early; rules 4-6 and 8 only decide speed. The builders here (``chain``, ``plan``,
  ``select``, ``root_only``, ``pad``) keep rules 1-6 and 8. For rule 7, ``chain`` uses the tokens
  it is given.
  """

  tokens: Int[Array, "R N1"]  # node tokens, node 0 = root
  depth: Int[Array, "R N1"]  # root 0
  parent: Int[Array, "R N1"]  # index of the parent node; -1 for the root
  mask: Bool[Array, "R N1 N1"]  # mask[i, j]: j is an ancestor of i or i itself (valid nodes)
  valid: Bool[Array, "R N1"]  # node is part of the tree (within the row's budget)

  @property
  def num_nodes(self) -> int:
    """N: nodes besides the root (static)."""
    return self.tokens.shape[1] - 1


def root_only(root: Int[Array, " R"]) -> Tree:
  """The tree of a step with no proposal: the root alone (N = 0)."""
  r = root.shape[0]
  z = jnp.zeros((r, 1), jnp.int32)
  return Tree(tokens=root[:, None].astype(jnp.int32), depth=z, parent=z - 1,
              mask=jnp.ones((r, 1, 1), bool), valid=jnp.ones((r, 1), bool))


def pad(tr: Tree, num_nodes: int) -> Tree:
  """``tr`` with invalid nodes appended up to ``num_nodes`` nodes (root excluded)."""
  extra = num_nodes - tr.num_nodes
  if extra <= 0:
    return tr
  r = tr.tokens.shape[0]
  grow = lambda a, v: jnp.concatenate([a, jnp.full((r, extra), v, a.dtype)], axis=1)
  n1 = num_nodes + 1
  mask = jnp.zeros((r, n1, n1), bool).at[:, : tr.num_nodes + 1, : tr.num_nodes + 1].set(tr.mask)
  return Tree(tokens=grow(tr.tokens, 0), depth=grow(tr.depth, 0), parent=grow(tr.parent, -1),
              valid=grow(tr.valid, False), mask=mask | jnp.eye(n1, dtype=bool)[None])


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
         num_nodes: int, topk: tuple[int, ...], keys: Float[Array, "R K V"] | None = None) -> Tree:
  """Build each row's tree of ``num_nodes`` nodes (static) of which the first ``budget[r]`` are
  valid (a row with budget 0 has the root alone).

  head_logprobs[r, k-1] is head k's log-distribution over the token at depth k. When every topk
  entry is 1 the tree is the trunk alone and any per-head scores with the same argmax will do
  (e.g. raw logits: no log-softmax needed). ``keys`` (None: ``head_logprobs``) rank each depth's
  candidates, e.g. coupled to the target's noise (``sampling.draft_keys``); a candidate's score
  is still its log-probability (-inf keys: excluded tokens, scored last).
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
    lp = head_logprobs[:, d].astype(jnp.float32)
    if keys is None:
      v, i = jax.lax.top_k(lp, k)
    else:
      kv, i = jax.lax.top_k(keys[:, d].astype(jnp.float32), k)
      v = jnp.where(jnp.isfinite(kv), jnp.take_along_axis(lp, i, axis=1), -1e9)
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
    return root_only(root)
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
  return Tree(tokens=tokens, depth=depth, parent=parent, mask=mask, valid=valid)


def accept(tree: Tree, target_tokens: Int[Array, "R N1"], max_depth: int):
  """Exact acceptance: node n is accepted iff its parent is and token(n) == the target's sample at
  the parent. Returns (accepted [R, N1] bool, path [R, max_depth + 1] node index at each depth of
  the accepted path, path_len [R] = D + 1). ``max_depth`` bounds the depth of every valid node."""
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


def ancestor_mask(parent: Int[Array, "R N1"], valid: Bool[Array, "R N1"],
                  max_depth: int) -> Bool[Array, "R N1 N1"]:
  """mask[r, i, j]: valid j is an ancestor of valid i or i itself (diagonal for every node).

  ``max_depth`` bounds the depth of every valid node (the walk up the parents takes that many hops).
  """
  r, n1 = parent.shape
  eye = jnp.eye(n1, dtype=bool)[None]
  mask = jnp.broadcast_to(eye, (r, n1, n1))
  cur = parent
  for _ in range(max_depth):
    mask = mask | jax.nn.one_hot(cur, n1, dtype=bool)  # cur = -1 adds nothing
    cur = jnp.where(cur >= 0, jnp.take_along_axis(parent, jnp.maximum(cur, 0), axis=1), -1)
  return (mask & valid[:, None, :] & valid[:, :, None]) | eye



def sanitize(tr: Tree, root: Int[Array, " R"], max_depth: int) -> Tree:
  """The tree the engine verifies, whatever a proposer returned: rules 1-5 of ``Tree`` enforced.
  Node 0 becomes the root (its token, depth 0, parent -1, valid); a node stays valid only if it
  reaches the root within ``max_depth`` hops through valid nodes with in-range parents; the depth
  of every valid node is recounted from its parents and ``mask`` rebuilt with ``ancestor_mask``.
  A tree that keeps the rules comes back with the same valid nodes, depths and mask bits (invalid
  nodes keep their tokens, depths and parents, and attend only themselves); one that breaks them
  gets a slower rollout, never a different one. A few [R, N1] gathers per step."""
  r, n1 = tr.tokens.shape
  idx = jnp.arange(n1, dtype=jnp.int32)[None]
  is_root = idx == 0
  in_range = (tr.parent >= 0) & (tr.parent < n1) & (tr.parent != idx)
  par = jnp.where(in_range, tr.parent, 0)
  valid = jnp.where(is_root, True, tr.valid & in_range)
  too_deep = jnp.int32(max_depth + 1)
  d = jnp.where(is_root, 0, too_deep).astype(jnp.int32)
  for _ in range(max_depth):  # after k rounds, nodes up to depth k have their depth
    pd = jnp.take_along_axis(d, par, axis=1)
    pv = jnp.take_along_axis(valid, par, axis=1)
    d = jnp.where(is_root, 0, jnp.where(valid & pv, jnp.minimum(pd + 1, too_deep), too_deep))
  valid = valid & (d <= max_depth)
  parent = jnp.where(is_root, -1, tr.parent)
  return Tree(tokens=jnp.where(is_root, root[:, None].astype(tr.tokens.dtype), tr.tokens),
              depth=jnp.where(valid, d, tr.depth).astype(tr.depth.dtype), parent=parent,
              mask=ancestor_mask(jnp.where(valid & ~is_root, par, -1), valid, max_depth),
              valid=valid)


def chain(root: Int[Array, " R"], tokens: Int[Array, "R C"], length: Int[Array, " R"], *,
          num_nodes: int) -> Tree:
  """A path root -> tokens[0] -> ... -> tokens[length - 1], cut to ``num_nodes`` nodes (static);
  nodes past the row's length are invalid. Node j + 1 holds tokens[j] at depth j + 1."""
  r, c = tokens.shape
  n1 = num_nodes + 1
  if num_nodes == 0:
    return root_only(root)
  pad = max(num_nodes - c, 0)
  toks = jnp.pad(tokens[:, :num_nodes].astype(jnp.int32), ((0, 0), (0, pad)))
  j = jnp.arange(n1)
  depth = jnp.broadcast_to(jnp.minimum(j, c), (r, n1)).astype(jnp.int32)
  valid = j[None] <= jnp.minimum(length, c)[:, None]
  parent = jnp.broadcast_to(j - 1, (r, n1)).astype(jnp.int32)
  mask = (j[None, :, None] >= j[None, None, :]) & valid[:, None, :] & valid[:, :, None]
  mask = mask | jnp.eye(n1, dtype=bool)[None]
  return Tree(tokens=jnp.concatenate([root[:, None].astype(jnp.int32), toks], axis=1),
              depth=depth, parent=parent, mask=mask, valid=valid)


# ---------------------------------------------------------------------------------------------
# Candidates from any source, ranked by expected acceptance (one tree per row)


@flax.struct.dataclass
class Candidates:
  """Candidate nodes of one or more sources, each given by its whole path (docs/design.md,
  "One tree from every source").

  Candidate m of row r is the path root -> paths[r, m, 0] -> ... -> paths[r, m, depth - 1]; its
  score is the log of the estimated probability that the whole path is accepted (so a node scores
  below its parent). depth 0 means "no candidate". ``bin`` names the estimate the score came from
  (a source's calibration bin, for the acceptance statistics); -1 for none. A source's candidates
  must be prefix-closed: every proper prefix of a candidate path is a candidate too (of this or
  another source).
  """

  paths: Int[Array, "R M Dp"]
  depth: Int[Array, "R M"]
  score: Float[Array, "R M"]
  bin: Int[Array, "R M"]

  @property
  def size(self) -> int:
    return self.paths.shape[1]


def concat_candidates(*cands: Candidates) -> Candidates:
  """One candidate list from several sources (path widths padded to the widest)."""
  dp = max(c.paths.shape[2] for c in cands)
  pad = lambda p: jnp.pad(p, ((0, 0), (0, 0), (0, dp - p.shape[2])), constant_values=-1)
  return Candidates(paths=jnp.concatenate([pad(c.paths) for c in cands], axis=1),
                    depth=jnp.concatenate([c.depth for c in cands], axis=1),
                    score=jnp.concatenate([c.score for c in cands], axis=1),
                    bin=jnp.concatenate([c.bin for c in cands], axis=1))


@flax.struct.dataclass
class Selection:
  """What ``select`` chose besides the tree."""

  bin: Int[Array, "R N1"]  # calibration bin of each node (-1: root / invalid)
  prob: Float[Array, "R N1"]  # estimated probability that the node is accepted (root 1)
  expected: Float[Array, "R Nc"]  # expected accepted nodes with the best n candidates, n = 0..Nc-1


def select(root: Int[Array, " R"], cands: Candidates, budget: Int[Array, " R"], *,
           num_nodes: int, max_depth: int, ranks: int = 0) -> tuple[Tree, Selection]:
  """Each row's tree: its ``num_nodes`` (static) best distinct candidate paths by score, the first
  ``budget[r]`` of them valid.

  Duplicates (the same path from several sources, or twice from one) are merged into one node
  that keeps the highest score and its bin. Scores are made strictly decreasing along every path
  (a node never outranks its parent), so the best n nodes are prefix-closed for every n and the
  nodes come in priority order (parents first). ``ranks`` > 0 also returns, in
  ``Selection.expected``, the expected number of accepted nodes when a row takes its best
  n = 0..ranks - 1 candidates (the sum of their estimated path probabilities): what the goodput
  rule weighs against the cost of a bigger tree.
  """
  r, m, dp = cands.paths.shape
  if max_depth < 1:
    raise ValueError(f"max_depth must be >= 1, got {max_depth}")
  depth = jnp.where(jnp.isfinite(cands.score), jnp.clip(cands.depth, 0, min(dp, max_depth)), 0)
  live = depth >= 1
  # pe[r, i, j]: length of the common prefix of the paths of i and j
  eq = cands.paths[:, :, None, :] == cands.paths[:, None, :, :]  # [R, M, M, Dp]
  pe = jnp.cumprod(eq, axis=-1).sum(-1)
  same = live[:, :, None] & live[:, None, :] & (depth[:, :, None] == depth[:, None, :]) & (
      pe >= depth[:, :, None])
  idx = jnp.arange(m)
  si, sj = cands.score[:, :, None], cands.score[:, None, :]
  dominated = same & ((sj > si) | ((sj == si) & (idx[None, None, :] < idx[None, :, None])))
  keep = live & ~dominated.any(-1)
  # parent: the kept candidate one shorter on the same path (the root for depth 1)
  is_parent = (keep[:, None, :] & (depth[:, None, :] == depth[:, :, None] - 1)
               & (pe >= depth[:, :, None] - 1))
  parent = jnp.where(depth == 1, -1, jnp.argmax(is_parent, axis=-1)).astype(jnp.int32)
  keep = keep & (is_parent.any(-1) | (depth == 1))
  for _ in range(max_depth - 1):  # a node whose ancestor is missing goes too (not prefix-closed)
    keep = keep & ((depth == 1) | jnp.take_along_axis(keep, jnp.maximum(parent, 0), axis=1))
  # strictly decreasing scores along paths, parents first
  score = jnp.where(keep, cands.score, -jnp.inf)
  for _ in range(max_depth - 1):
    up = jnp.take_along_axis(score, jnp.maximum(parent, 0), axis=1)
    score = jnp.where(keep & (parent >= 0), jnp.minimum(score, up - _MIN_STEP), score)
  k = min(num_nodes, m)
  top, sel = jax.lax.top_k(score, max(k, 1))
  top, sel = top[:, :k], sel[:, :k].astype(jnp.int32)
  ok = jnp.isfinite(top) & (jnp.arange(k)[None] < budget[:, None])
  # node index of each selected candidate's parent (0 = root)
  pos = jnp.zeros((r, m), jnp.int32).at[jnp.arange(r)[:, None], sel].set(
      jnp.arange(1, k + 1, dtype=jnp.int32)[None])
  par_c = jnp.take_along_axis(parent, sel, axis=1)
  par = jnp.where(par_c >= 0, jnp.take_along_axis(pos, jnp.maximum(par_c, 0), axis=1), 0)
  d_sel = jnp.take_along_axis(depth, sel, axis=1)
  path_sel = jnp.take_along_axis(cands.paths, sel[:, :, None], axis=1)  # [R, k, Dp]
  tok = jnp.take_along_axis(path_sel, jnp.maximum(d_sel - 1, 0)[:, :, None], axis=2)[..., 0]
  pad = num_nodes - k
  padc = lambda a, v: jnp.pad(a, ((0, 0), (0, pad)), constant_values=v)
  one = jnp.ones((r, 1), bool)
  valid = jnp.concatenate([one, padc(ok, False)], axis=1)
  tokens = jnp.concatenate([root[:, None].astype(jnp.int32),
                            padc(jnp.where(ok, tok, 0).astype(jnp.int32), 0)], axis=1)
  depth_n = jnp.concatenate([jnp.zeros((r, 1), jnp.int32), padc(jnp.where(ok, d_sel, 0), 0)],
                            axis=1)
  parent_n = jnp.concatenate([jnp.full((r, 1), -1, jnp.int32),
                              padc(jnp.where(ok, par, 0).astype(jnp.int32), 0)], axis=1)
  tree = Tree(tokens=tokens, depth=depth_n, parent=parent_n, valid=valid,
              mask=ancestor_mask(parent_n, valid, max_depth))
  bins = jnp.concatenate([jnp.full((r, 1), -1, jnp.int32),
                          padc(jnp.where(ok, jnp.take_along_axis(cands.bin, sel, axis=1), -1), -1)],
                         axis=1)
  prob = jnp.concatenate([jnp.ones((r, 1)), padc(jnp.where(ok, jnp.exp(top), 0.0), 0.0)], axis=1)
  expected = jnp.zeros((r, 0))
  if ranks > 0:
    kk = min(ranks - 1, m)
    best = jax.lax.top_k(score, max(kk, 1))[0][:, :kk]
    cum = jnp.cumsum(jnp.where(jnp.isfinite(best), jnp.exp(best), 0.0), axis=1)
    cum = jnp.concatenate([jnp.zeros((r, 1)), cum], axis=1)
    if ranks - 1 > kk:  # fewer candidates than ranks: the sum stays at its last value
      cum = jnp.concatenate([cum, jnp.repeat(cum[:, -1:], ranks - 1 - kk, axis=1)], axis=1)
    expected = cum
  return tree, Selection(bin=bins, prob=prob, expected=expected)


def node_outcomes(tree: Tree, accepted: Bool[Array, "R N1"], bins: Int[Array, "R N1"],
                  num_bins: int, active: Bool[Array, " R"]):
  """Per calibration bin: (tested [num_bins], hit [num_bins]) over this step's valid non-root
  nodes whose parent was accepted (so the node's own token was tested against the target's
  sample), hit = the node was accepted. What an acceptance estimate is calibrated from."""
  par_acc = jnp.take_along_axis(accepted, jnp.maximum(tree.parent, 0), axis=1)
  tested = tree.valid & (jnp.arange(tree.tokens.shape[1])[None] > 0) & par_acc & (bins >= 0) & (
      active[:, None])
  hit = tested & accepted
  b = jnp.clip(bins, 0, num_bins - 1).reshape(-1)
  count = lambda w: jax.ops.segment_sum(w.reshape(-1).astype(jnp.int32), b, num_segments=num_bins)
  return count(tested), count(hit)
