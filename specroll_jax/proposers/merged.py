"""One tree from every source (docs/design.md, "One tree from every source"): the heads'
candidates (``RankedHeads``, Medusa or root-conditioned) and the group-aware lookup's
(``GroupLookup``: own text, siblings, earlier responses) in one candidate list, duplicates merged,
the best by calibrated acceptance kept within each row's budget (EAGLE-2-style). Calibration bins:
the heads' first, then the lookup's (offset by ``heads.num_bins``).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import numpy as np

from specroll_jax._fields import check_int
from specroll_jax.adaptation.reflex.config import ReflexConfig
from specroll_jax.adaptation.reflex.state import ReflexGlobal, ReflexRows, ReflexShared
from specroll_jax.adaptation.reflex.statistics import ReflexStats
from specroll_jax.engines.results import Summed
from specroll_jax.heads import kinds as head_kinds
from specroll_jax.proposers import tree as _tree
from specroll_jax.proposers.base import Proposer, RowsShared
from specroll_jax.proposers.group_lookup import GroupLookup, LookupContext, LookupShared
from specroll_jax.proposers.ranked import (
  RankedProposer,
  RankedRows,
  TreeStats,
  ranked_after_propose,
  ranked_update,
)
from specroll_jax.proposers.ranked_heads import HeadsParams, RankedHeads
from specroll_jax.proposers.reflex_heads import ReflexParams, ReflexProposer


@flax.struct.dataclass
class MergedParams:
  """Parameters of ``Merged``: the heads with their calibrated table (``HeadsParams``) and the
  lookup's per-batch context (``LookupContext``)."""

  heads: HeadsParams
  lookup: LookupContext


@dataclasses.dataclass(frozen=True)
class Merged(RankedProposer):
  """Heads + group-aware lookup in one ranked tree. Parameters: ``MergedParams``
  (``Merged.params``). max_nodes: the most nodes a row's tree holds."""

  heads: RankedHeads = RankedHeads()
  lookup: GroupLookup = GroupLookup()
  max_nodes: int = 16

  def __post_init__(self):
    if not isinstance(self.heads, RankedHeads) or not isinstance(self.lookup, GroupLookup):
      raise ValueError("Merged takes a RankedHeads and a GroupLookup, got "
                       f"{type(self.heads).__name__}, {type(self.lookup).__name__}")
    check_int(self, "max_nodes", 1, owner="Merged")

  @property
  def max_depth(self) -> int:
    return max(self.heads.max_depth, self.lookup.max_depth)

  @property
  def capacity(self) -> int:
    return min(self.max_nodes, self.heads.capacity + self.lookup.capacity)

  @property
  def num_bins(self) -> int:
    return self.heads.num_bins + self.lookup.num_bins

  def default_acceptance(self) -> np.ndarray:
    """Both sources' prior tables, flattened in bin order."""
    return np.concatenate([self.heads.default_acceptance().ravel(),
                           self.lookup.default_acceptance().ravel()])

  def params(self, heads, acceptance=None, group_ids=None, prior=None) -> MergedParams:
    """``MergedParams`` from the heads, one flat table over all bins (or the
    priors), and the lookup's per-batch context."""
    acc = self.default_acceptance() if acceptance is None else np.asarray(acceptance)
    if acc.shape != (self.num_bins,):
      raise ValueError(f"Merged acceptance must have shape ({self.num_bins},) (heads bins + lookup "
                       f"bins), got {acc.shape}")
    nh = self.heads.num_bins
    return MergedParams(
        heads=self.heads.params(heads, acc[:nh].reshape(self.heads.num_heads,
                                                        self.heads.depth_bins)),
        lookup=self.lookup.context(acc[nh:].reshape(self.lookup.acceptance_shape), group_ids,
                                   prior))

  def validate(self, config, params) -> None:
    if not isinstance(params, MergedParams):
      raise ValueError("Merged params must be a MergedParams (Merged.params(...)), got "
                       f"{type(params).__name__}")
    self.heads.validate(config, params.heads)
    self.lookup.validate(config, params.lookup)

  def validate_batch(self, config, params, prompt_tokens, prompt_lengths, sample_ids) -> None:
    self.lookup.validate_batch(config, params.lookup, prompt_tokens, prompt_lengths, sample_ids)

  def init_shared(self, target, params, rows):
    return self.lookup.init_shared(target, params.lookup, rows)

  def candidates(self, target, params, shared, inp, *, num_nodes: int):
    ch, _ = self.heads.candidates(target, params.heads, (), inp, num_nodes=num_nodes)
    cl, found = self.lookup.candidates(target, params.lookup, shared, inp, num_nodes=num_nodes)
    cl = cl.replace(bin=cl.bin + self.heads.num_bins)
    return _tree.concat_candidates(ch, cl), found


@flax.struct.dataclass
class MergedReflexParams:
  """Parameters of ``MergedReflex``: the heads with their calibrated table (``HeadsParams``), the
  lookup's per-batch context and Reflex's global safety per head."""

  heads: HeadsParams
  lookup: LookupContext
  reflex: ReflexGlobal


@flax.struct.dataclass
class MergedReflexRows:
  """``MergedReflex``'s per-row state: the ranked tree's (``RankedRows``) and Reflex's
  (``ReflexRows``). Unpacks as ``ranked, reflex``."""

  ranked: RankedRows
  reflex: ReflexRows

  def __iter__(self):
    return iter((self.ranked, self.reflex))


@flax.struct.dataclass
class MergedReflexShared:
  """``MergedReflex``'s shared state: the lookup's (``LookupShared``) and Reflex's
  (``ReflexShared``). Unpacks as ``lookup, reflex``."""

  lookup: LookupShared
  reflex: ReflexShared

  def __iter__(self):
    return iter((self.lookup, self.reflex))


def _state(ranked, rrows, lshared, rshared) -> RowsShared:
  return RowsShared(rows=MergedReflexRows(ranked=ranked, reflex=rrows),
                    shared=MergedReflexShared(lookup=lshared, reflex=rshared))


@flax.struct.dataclass
class MergedReflexStats(Summed):
  """What a ``MergedReflex`` rollout counts: the ranked tree's per-bin outcomes (calibration,
  goodput) and Reflex's per-head statistics."""

  tree: TreeStats
  reflex: ReflexStats


@dataclasses.dataclass(frozen=True)
class MergedReflex(Proposer):
  """``Merged`` with Reflex corrections on the heads: root-conditioned heads (corrected per row by
  the fast path, docs/design.md "Reflex") and the group-aware lookup in one tree ranked by
  calibrated acceptance. The heads' tree settings (topk, beams, max_nodes) are ``merged.heads``'s;
  ``reflex`` holds every other Reflex constant (its tree fields are overwritten to match).
  Parameters: ``MergedReflexParams``; state: ``RowsShared(MergedReflexRows, MergedReflexShared)``;
  statistics: ``MergedReflexStats``.

  With Reflex asleep or off, ``Merged`` with the same ``merged`` settings proposes the same tree
  from uncorrected heads; both count the same ``TreeStats``."""

  merged: Merged = Merged()
  reflex: ReflexConfig = ReflexConfig(conditioned=True)

  def __post_init__(self):
    if not isinstance(self.merged, Merged):
      raise ValueError(f"MergedReflex.merged must be a Merged, got {type(self.merged).__name__}")
    if not isinstance(self.reflex, ReflexConfig):
      raise ValueError(f"MergedReflex.reflex must be a ReflexConfig, got "
                       f"{type(self.reflex).__name__}")
    h = self.merged.heads
    object.__setattr__(self, "reflex", dataclasses.replace(
        self.reflex, num_heads=h.num_heads, topk=h.topk, beams=h.beams, max_nodes=h.max_nodes,
        conditioned=True, coupled=h.coupled))

  @property
  def inner(self) -> ReflexProposer:
    return ReflexProposer(self.reflex)

  @property
  def max_depth(self) -> int:
    return self.merged.max_depth

  @property
  def capacity(self) -> int:
    return self.merged.capacity

  @property
  def feedback_topm(self) -> int:
    return self.reflex.top

  def params(self, heads, glob: ReflexGlobal, acceptance=None, group_ids=None,
             prior=None) -> MergedReflexParams:
    mp = self.merged.params(heads, acceptance, group_ids, prior)
    return MergedReflexParams(heads=mp.heads, lookup=mp.lookup, reflex=glob)

  def validate(self, config, params) -> None:
    if not isinstance(params, MergedReflexParams):
      raise ValueError(f"MergedReflex params must be a MergedReflexParams (MergedReflex.params("
                       f"...)), got {type(params).__name__}")
    self.merged.validate(config, MergedParams(heads=params.heads, lookup=params.lookup))
    if not head_kinds.is_conditioned(params.heads.heads):
      raise ValueError("MergedReflex needs root-conditioned heads (cond_heads.CondHeads), got "
                       f"{type(params.heads.heads).__name__}")
    self.inner.validate(config, _inner_params(params))

  def validate_batch(self, config, params, prompt_tokens, prompt_lengths, sample_ids) -> None:
    self.merged.lookup.validate_batch(config, params.lookup, prompt_tokens, prompt_lengths,
                                      sample_ids)

  def init(self, target, params, rows):
    rrows, rshared = self.inner.init(target, _inner_params(params), rows)
    ranked = RankedRows.zeros(rows.row.shape[0], self.capacity)
    lshared = self.merged.lookup.init_shared(target, params.lookup, rows)
    return _state(ranked, rrows, lshared, rshared)

  def split_state(self, state):
    return state.rows, state.shared

  def join_state(self, rows, shared):
    return RowsShared(rows=rows, shared=shared)

  def propose(self, target, params, state, inp, *, num_nodes):
    (ranked, rrows), (lshared, rshared) = state
    if num_nodes == 0:
      return _tree.root_only(inp.root), state
    heads = self.merged.heads
    cl, found = self.merged.lookup.candidates(target, params.lookup, lshared, inp,
                                              num_nodes=num_nodes)
    cl = cl.replace(bin=cl.bin + heads.num_bins)
    table = params.heads.acceptance.reshape(-1)
    tr, (rrows, rshared), sel = self.inner.propose_with(
        target, _inner_params(params), RowsShared(rows=rrows, shared=rshared), inp,
        num_nodes=num_nodes, table=table, extra=cl, ranks=self.capacity + 1)
    ranked = ranked_after_propose(ranked, sel, found, inp.budget, num_nodes)
    return tr, _state(ranked, rrows, lshared, rshared)

  def update(self, target, params, state, fb):
    (ranked, rrows), (lshared, rshared) = state
    (rrows, rshared), rstats = self.inner.update(target, _inner_params(params),
                                                 RowsShared(rows=rrows, shared=rshared), fb)
    ranked, tstats = ranked_update(ranked, fb, self.merged.num_bins)
    return _state(ranked, rrows, lshared, rshared), MergedReflexStats(tree=tstats, reflex=rstats)

  def expected_gain(self, state, num_nodes: int):
    return state.rows.ranked.expected[:, min(num_nodes, self.capacity)]

  def init_stats(self) -> MergedReflexStats:
    return MergedReflexStats(tree=TreeStats.zeros(self.merged.num_bins, self.capacity + 1),
                             reflex=self.inner.init_stats())


def _inner_params(params: MergedReflexParams) -> ReflexParams:
  """The inner ``ReflexProposer``'s parameters: the heads and Reflex's global state."""
  return ReflexParams(heads=params.heads.heads, reflex=params.reflex)


__all__ = ["Merged", "MergedParams", "MergedReflex", "MergedReflexParams", "MergedReflexRows",
           "MergedReflexShared", "MergedReflexStats"]
