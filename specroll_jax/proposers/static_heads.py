"""Static future-token heads as a proposer (Medusa-style; docs/design.md, "Medusa heads and
tree.plan").

Parameters: ``specroll_jax.heads.medusa.Heads``. Per-row state: none. ``propose`` runs only the
heads and candidates the bucket's node count N can use: with the trunk reserved first, a tree of N
nodes reaches depth min(K, N), and at each depth a parent has at most 1 + N - min(K, N) children in
the tree (the trunk takes min(K, N) nodes), so head k is evaluated only when k <= N and its top-k is
cut to that many candidates. The tree is exactly the one the full candidate set would give. """

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specroll_jax import sampling as _sampling
from specroll_jax._fields import check_bool, check_int, int_tuple
from specroll_jax.engines.config import DEFAULT_TOPK
from specroll_jax.heads import medusa as _heads
from specroll_jax.models import decoder as _dec
from specroll_jax.proposers import tree as _tree
from specroll_jax.proposers.base import Proposer, coupled_with


def effective_topk(topk: tuple[int, ...], num_nodes: int) -> tuple[int, ...]:
  """The per-depth candidate counts a tree of ``num_nodes`` nodes can use (see module docstring)."""
  depth = min(len(topk), num_nodes)
  return tuple(min(k, 1 + num_nodes - depth) for k in topk[:depth])


def head_logits(target, heads: _heads.Heads, h, num_heads: int):
  """Logits [R, num_heads, V] of the first ``num_heads`` heads only."""
  sub = jax.tree.map(lambda a: a[:num_heads], heads)
  return _dec.logits_from_hidden(target.config, target.params,
                                 _heads.head_states(target.config, sub, h))


@dataclasses.dataclass(frozen=True)
class HeadsProposer(Proposer):
  """K future-token heads; ``topk[k-1]`` candidates at depth k (the tree of ``tree.plan``), ranked
  coupled to the target's noise (``coupled``: ``sampling.draft_keys``; False: by the heads'
  probabilities)."""

  num_heads: int = 3
  topk: tuple[int, ...] = DEFAULT_TOPK
  coupled: bool = True

  def __post_init__(self):
    k = check_int(self, "num_heads", 1, owner="HeadsProposer")
    check_bool(self, "coupled", owner="HeadsProposer")
    object.__setattr__(self, "topk", int_tuple(self.topk, "HeadsProposer.topk", 1, length=k,
                                               count=f"num_heads={k}"))

  @property
  def max_depth(self) -> int:
    return self.num_heads

  @property
  def capacity(self) -> int:
    total, width = 0, 1
    for k in self.topk:
      width *= k
      total += width
    return total

  def validate(self, config, params) -> None:
    _heads.validate(config, params, self.num_heads)

  def propose(self, target, params, state, inp, *, num_nodes):
    if num_nodes == 0:
      return _tree.root_only(inp.root), state
    topk = effective_topk(self.topk, num_nodes)
    logits = head_logits(target, params, inp.hidden, len(topk))
    return plan_heads(target, logits, inp, num_nodes=num_nodes, topk=topk,
                      coupled=self.coupled), state


def plan_heads(target, logits, inp, *, num_nodes: int, topk: tuple[int, ...], coupled: bool):
  """``tree.plan`` of Medusa heads' logits [R, K', V] (head k guesses position L + k): coupled
  (T > 0), candidates ranked by ``sampling.draft_keys`` at each head's position; otherwise by the
  heads' probabilities (with every topk 1, by the raw logits: the same argmax)."""
  if coupled_with(target, inp, coupled, "HeadsProposer"):
    k = jnp.arange(1, logits.shape[1] + 1)[None]
    keys, lq = _sampling.draft_keys(logits, target.sampling, inp.seed[:, None],
                                    inp.sample_ids[:, None], inp.position[:, None] + k,
                                    coupled=True)
    return _tree.plan(inp.root, lq, inp.budget, num_nodes=num_nodes, topk=topk, keys=keys)
  if max(topk) > 1:  # scores matter: cumulative log-probabilities
    logits = jax.nn.log_softmax(logits, axis=-1)
  return _tree.plan(inp.root, logits, inp.budget, num_nodes=num_nodes, topk=topk)


__all__ = ["HeadsProposer", "effective_topk", "head_logits", "plan_heads"]
