"""Prompt lookup (n-gram copy; "prompt lookup decoding") as a proposer.

``PromptLookup`` finds the latest earlier occurrence of the row's last n committed tokens (the root
included; n from ``max_ngram`` down to ``min_ngram``, longest first) in the row's own prompt +
response and proposes the tokens that followed it as a chain. No FLOPs, no parameters: GSM8K
solutions copy numbers and phrases from the question. Per-row state: the chain it proposed last and
an adaptive chain length (one more than the prefix of its last chain that the target then sampled,
within [min_chain, max_chain]), so a row whose copies keep failing proposes short chains and leaves
the budget to other proposers. (``Merged`` puts the heads and the group-aware lookup in one tree,
every candidate ranked by its calibrated acceptance.)
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax.numpy as jnp
from jaxtyping import Array, Int

from specroll_jax._fields import check_int
from specroll_jax.engines.results import Summed
from specroll_jax.proposers import tree as _tree
from specroll_jax.proposers.base import Proposer
from specroll_jax.proposers.group_lookup import find_continuations, own_suffix


@flax.struct.dataclass
class LookupStats(Summed):
  """Prompt lookup's statistics of a rollout (summed over steps: ``combine``)."""

  rows: Int[Array, ""]  # row-steps that proposed a chain
  tokens: Int[Array, ""]  # chain tokens proposed
  matched: Int[Array, ""]  # chain tokens the target committed


@flax.struct.dataclass
class LookupState:
  chain: Int[Array, "R C"]  # the chain proposed last (token for position L + 1 + j), -1 unused
  chain_len: Int[Array, " R"]  # its length (0: no match / not proposed)
  want: Int[Array, " R"]  # adaptive chain length for the next proposal


def find_continuation(history: Int[Array, "R S"], position: Int[Array, " R"], *,
                      max_ngram: int, min_ngram: int, max_chain: int):
  """The tokens that followed the latest earlier occurrence of each row's last n tokens.

  history[r, p] is the token at position p (-1 unknown), ``position`` the last known position L.
  Returns (tokens [R, max_chain], length [R]): the continuation of the longest n with a match (n in
  [min_ngram, max_ngram]); only known tokens (positions <= L) are returned, length 0 for no match.
  """
  suffix, known = own_suffix(history, position, max_ngram)  # the group lookup's own search
  tokens, length, _ = find_continuations(history[:, None], (position + 1)[:, None], suffix, known,
                                         max_ngram=max_ngram, min_ngram=min_ngram,
                                         max_chain=max_chain)
  return tokens[:, 0], length[:, 0]


@dataclasses.dataclass(frozen=True)
class PromptLookup(Proposer):
  """n-gram copy from the row's own prompt + response. Parameters: none (pass ())."""

  max_ngram: int = 3
  min_ngram: int = 1
  max_chain: int = 6
  min_chain: int = 1

  def __post_init__(self):
    for name in ("max_ngram", "min_ngram", "max_chain", "min_chain"):
      check_int(self, name, 1, owner="PromptLookup")
    if self.min_ngram > self.max_ngram:
      raise ValueError(f"PromptLookup.min_ngram={self.min_ngram} exceeds max_ngram="
                       f"{self.max_ngram}")
    if self.min_chain > self.max_chain:
      raise ValueError(f"PromptLookup.min_chain={self.min_chain} exceeds max_chain="
                       f"{self.max_chain}")

  @property
  def max_depth(self) -> int:
    return self.max_chain

  @property
  def capacity(self) -> int:
    return self.max_chain

  def validate(self, config, params) -> None:
    if params not in ((), None):
      raise ValueError(f"PromptLookup has no parameters; pass () (got {type(params).__name__})")

  def init(self, target, params, rows):
    r = rows.row.shape[0]
    return LookupState(chain=jnp.full((r, self.max_chain), -1, jnp.int32),
                       chain_len=jnp.zeros((r,), jnp.int32),
                       want=jnp.full((r,), self.max_chain, jnp.int32))

  def chain_for(self, state: LookupState, inp):
    """(tokens [R, max_chain], length [R]) this proposer wants to verify for each row."""
    tokens, length = find_continuation(inp.history, inp.position, max_ngram=self.max_ngram,
                                       min_ngram=self.min_ngram, max_chain=self.max_chain)
    length = jnp.minimum(jnp.minimum(length, state.want), inp.budget)
    j = jnp.arange(self.max_chain)[None]
    return jnp.where(j < length[:, None], tokens, -1), length

  def propose(self, target, params, state, inp, *, num_nodes):
    if num_nodes == 0:
      return _tree.root_only(inp.root), state
    tokens, length = self.chain_for(state, inp)
    length = jnp.minimum(length, num_nodes)
    tr = _tree.chain(inp.root, tokens, length, num_nodes=num_nodes)
    return tr, state.replace(chain=tokens, chain_len=length)

  def update(self, target, params, state, fb):
    c = self.max_chain
    j = jnp.arange(c)[None]
    hit = (state.chain == fb.tokens[:, :c]) & fb.keep[:, :c] & (j < state.chain_len[:, None])
    matched = jnp.cumprod(hit, axis=1).sum(1).astype(jnp.int32)
    proposed = fb.active & (state.chain_len > 0)
    want = jnp.where(proposed, jnp.clip(matched + 1, self.min_chain, self.max_chain), state.want)
    stats = LookupStats(rows=proposed.sum().astype(jnp.int32),
                        tokens=jnp.where(proposed, state.chain_len, 0).sum().astype(jnp.int32),
                        matched=jnp.where(proposed, matched, 0).sum().astype(jnp.int32))
    return state.replace(want=want, chain_len=jnp.zeros_like(state.chain_len)), stats

  def init_stats(self) -> LookupStats:
    z = jnp.int32(0)
    return LookupStats(rows=z, tokens=z, matched=z)

