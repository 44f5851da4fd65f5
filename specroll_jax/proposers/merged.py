"""One tree from every source (docs/design.md, "One tree from every source"): the heads'
candidates (``RankedHeads``, Medusa or root-conditioned) and the group-aware lookup's
(``GroupLookup``: own text, siblings, earlier responses) in one candidate list, duplicates merged,
the best by calibrated acceptance kept within each row's budget (EAGLE-2-style). Calibration bins:
the heads' first, then the lookup's (offset by ``heads.num_bins``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specroll_jax import tree as _tree
from specroll_jax.proposers.group_lookup import GroupLookup, LookupContext
from specroll_jax.proposers.ranked import RankedProposer
from specroll_jax.proposers.ranked_heads import HeadsParams, RankedHeads


@dataclasses.dataclass(frozen=True)
class Merged(RankedProposer):
  """Heads + group-aware lookup in one ranked tree. Parameters: (``HeadsParams``,
  ``LookupContext``). max_nodes: the most nodes a row's tree holds."""

  heads: RankedHeads = RankedHeads()
  lookup: GroupLookup = GroupLookup()
  max_nodes: int = 16

  def __post_init__(self):
    if not isinstance(self.heads, RankedHeads) or not isinstance(self.lookup, GroupLookup):
      raise ValueError("Merged takes a RankedHeads and a GroupLookup, got "
                       f"{type(self.heads).__name__}, {type(self.lookup).__name__}")
    if isinstance(self.max_nodes, bool) or not isinstance(self.max_nodes, int) or \
        self.max_nodes < 1:
      raise ValueError(f"Merged.max_nodes must be an int >= 1, got {self.max_nodes!r}")

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

  def params(self, heads, acceptance=None, group_ids=None, prior=None):
    """(HeadsParams, LookupContext) from the heads, one flat table over all bins (or the
    priors), and the lookup's per-batch context."""
    acc = self.default_acceptance() if acceptance is None else np.asarray(acceptance)
    if acc.shape != (self.num_bins,):
      raise ValueError(f"Merged acceptance must have shape ({self.num_bins},) (heads bins + lookup "
                       f"bins), got {acc.shape}")
    nh = self.heads.num_bins
    return (self.heads.params(heads, acc[:nh].reshape(self.heads.num_heads, self.heads.q_bins)),
            self.lookup.context(acc[nh:].reshape(self.lookup.acceptance_shape), group_ids, prior))

  def validate(self, config, params) -> None:
    if not isinstance(params, tuple) or len(params) != 2 or not isinstance(
        params[0], HeadsParams) or not isinstance(params[1], LookupContext):
      raise ValueError("Merged params must be (HeadsParams, LookupContext) (Merged.params(...)), "
                       f"got {type(params).__name__}")
    self.heads.validate(config, params[0])
    self.lookup.validate(config, params[1])

  def validate_batch(self, config, params, prompt_tokens, prompt_lengths, sample_ids) -> None:
    self.lookup.validate_batch(config, params[1], prompt_tokens, prompt_lengths, sample_ids)

  def init_shared(self, target, params, rows):
    return self.lookup.init_shared(target, params[1], rows)

  def candidates(self, target, params, shared, inp, *, num_nodes: int):
    ch, _ = self.heads.candidates(target, params[0], (), inp, num_nodes=num_nodes)
    cl, found = self.lookup.candidates(target, params[1], shared, inp, num_nodes=num_nodes)
    cl = cl.replace(bin=cl.bin + self.heads.num_bins)
    return _tree.concat_candidates(ch, cl), found


__all__ = ["Merged"]
