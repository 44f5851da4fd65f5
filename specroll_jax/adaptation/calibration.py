"""Online calibration of acceptance estimates, carried across rollout batches (docs/design.md,
"One tree from every source").

A ranked proposer labels every node it proposes with a bin (a source's estimate: a head's depth
and probability bin, a lookup source's match length and depth); the engine counts per bin the
nodes that were tested (their parent was accepted) and accepted (``proposers.ranked.TreeStats``).
``Calibration`` keeps exponentially decayed counts and turns them into the table the proposer
scores with: a Beta-smoothed acceptance rate per bin, pulled toward the source's own prior where
few nodes were tested. It is a pytree of arrays (checkpointable) updated on the host between
batches; a new table never recompiles the rollout (it is a traced parameter).
"""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from specroll_jax.proposers.ranked import TreeStats


@flax.struct.dataclass
class Calibration:
  tested: Float[Array, " Nb"]  # decayed count of tested nodes per bin
  hit: Float[Array, " Nb"]  # decayed count of accepted ones
  prior: Float[Array, " Nb"]  # the source's uncalibrated estimate per bin
  strength: float = flax.struct.field(pytree_node=False, default=8.0)  # pseudo-counts of the prior
  decay: float = flax.struct.field(pytree_node=False, default=0.7)  # per batch: tracks drift

  @property
  def num_bins(self) -> int:
    return self.prior.shape[0]

  def table(self) -> np.ndarray:
    """Acceptance probability per bin: (hit + s * prior) / (tested + s)."""
    t, h, p = (np.asarray(x, np.float64) for x in (self.tested, self.hit, self.prior))
    return ((h + self.strength * p) / (t + self.strength)).astype(np.float32)

  def update(self, stats: TreeStats) -> Calibration:
    """Fold one rollout's counts (a ranked proposer's ``TreeStats``: ``tested`` and ``hit`` per
    bin) in; older batches weigh ``decay`` per batch."""
    if not isinstance(stats, TreeStats):
      raise ValueError(f"Calibration.update takes a TreeStats, got {type(stats).__name__}")
    tested, hit = np.asarray(stats.tested, np.float64), np.asarray(stats.hit, np.float64)
    if tested.shape != (self.num_bins,) or hit.shape != (self.num_bins,):
      raise ValueError(f"Calibration has {self.num_bins} bins; got counts of shape "
                       f"{tested.shape} / {hit.shape}")
    if (hit > tested).any() or (hit < 0).any():
      raise ValueError("Calibration.update: hit counts must lie in [0, tested]")
    return self.replace(tested=jnp.asarray(self.decay * np.asarray(self.tested) + tested,
                                           jnp.float32),
                        hit=jnp.asarray(self.decay * np.asarray(self.hit) + hit, jnp.float32))


def init(prior, *, strength: float = 8.0, decay: float = 0.7) -> Calibration:
  """A calibration with no counts yet: ``table()`` is the prior (a proposer's
  ``default_acceptance()``, flattened)."""
  p = np.asarray(prior, np.float32).reshape(-1)
  if p.size == 0 or not np.isfinite(p).all() or (p < 0).any() or (p > 1).any():
    raise ValueError(f"Calibration prior must be probabilities in [0, 1], got {p.size} values in "
                     f"[{p.min() if p.size else None}, {p.max() if p.size else None}]")
  if not strength > 0:
    raise ValueError(f"Calibration strength must be > 0, got {strength}")
  if not 0 <= decay <= 1:
    raise ValueError(f"Calibration decay must be in [0, 1], got {decay}")
  z = jnp.zeros(p.shape, jnp.float32)
  return Calibration(tested=z, hit=z, prior=jnp.asarray(p), strength=float(strength),
                     decay=float(decay))


__all__ = ["Calibration", "init"]
