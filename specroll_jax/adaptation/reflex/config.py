"""Reflex's constants (docs/design.md, "Reflex")."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specroll_jax._fields import check_bool, check_float, check_int, int_tuple
from specroll_jax.engines.config import DEFAULT_TOPK

_TINY = 1e-12


def _per_head(values: tuple, k: int) -> tuple:
  """A per-head tuple cut or extended (repeating its last entry) to k heads."""
  values = tuple(values)
  return (values + (values[-1],) * k)[:k]


@dataclasses.dataclass(frozen=True)
class ReflexConfig:
  """Every Reflex constant, with the defaults of docs/design.md, "Reflex" (the method authors'
  public code). Per-head tuples are cut or extended (repeating the last entry) to ``num_heads``."""

  num_heads: int = 3
  topk: tuple[int, ...] = DEFAULT_TOPK  # tree candidates per depth (as the static heads)
  r_min: tuple[float, ...] = (0.010, 0.005, 0.005)  # correction ratio range per head
  r_max: tuple[float, ...] = (0.030, 0.015, 0.010)
  rho: tuple[float, ...] = (0.85, 0.90, 0.95)  # fast-state decay per committed token
  min_obs: tuple[int, ...] = (8, 32, 64)  # alignment observations before a head may correct
  min_severity: tuple[float, ...] = (2.0, 4.0, 4.0)  # accumulated severity before correcting
  min_state_rms: float = 0.005  # rms(m) below this: no correction
  lcb_z: float = 1.0  # LCB = mean - lcb_z * stderr of the sketch cosines
  lcb_scale: float = 0.10  # trust = sqrt(clip(LCB / lcb_scale) * clip(rms(m) / rms_scale))
  rms_scale: float = 0.03
  sketch_dim: int = 24  # columns of the fixed random projection P (D x 24, unit columns)
  sketch_seed: int = 0
  top: int = 16  # top ids of q and of p in the support (and the engine's top-m feedback)
  dist_weight: float = 0.25  # g = dist_weight * dist + cov_weight * cov
  cov_weight: float = 1.0
  weak: int = 2  # weakest candidates the coverage term moves mass away from
  severity_floor: float = 0.02  # a matured record updates m only when its severity >= this
  stride_rows: float = 4.0  # feedback every max(stride, ceil(stride_rows * active / batch)) steps
  stride: int = 1  # least steps between feedback rounds (1: the row-adaptive stride alone).
  #                  Whatever the stride, a step where no row records skips building records and
  #                  one where none matures skips the feedback math (lax.cond; same results)
  safety_start: float = 1.0  # global safety per head, in [safety_min, safety_max]
  safety_min: float = 0.125
  safety_max: float = 1.0
  safety_down: float = 0.5  # x when the gain's upper bound < 0 for down_after batches in a row
  safety_up: float = 1.25  # x when the gain's lower bound > 0 for up_after batches in a row
  down_after: int = 2
  up_after: int = 3
  gain_z: float = 1.96  # 95% bounds of the per-batch mean gain
  share_group: int = 0  # G > 0: rows r // G share one fast state (a GRPO group); 0: per row
  record_capacity: int = 512  # matured records kept per head per rollout for the slow path
  # batches Reflex sleeps after an awake batch in which its corrections did not pay (no head's
  # counterfactual gain significantly > 0 at gain_z, or fewer than 2 corrections measured): the
  # plain heads propose then, with no in-loop cost, and the batch after the sleep is awake again
  # (a probe). 0: never sleeps. A sleeping Reflex writes no records, so it sleeps only when the
  # slow path takes none from the decode loop (AdaptationConfig.records="trainer", or the slow
  # path off).
  sleep_batches: int = 0
  # backoff: each further awake batch that did not pay doubles the sleep after it, from
  # sleep_batches up to sleep_max_batches (a paid batch starts over); 0 (or <= sleep_batches):
  # every sleep is sleep_batches. Where the corrections never pay, the probes then cost
  # O(log) batches, not one batch in sleep_batches + 1.
  sleep_max_batches: int = 0
  apply_corrections: bool = True  # False: records and statistics only (the heads stay static)
  # root-conditioned heads (cond_heads.CondHeads): the tree expands depth by depth from the
  # beams[k-1] best partial paths (proposers.RankedHeads), at most max_nodes nodes
  conditioned: bool = False
  beams: tuple[int, ...] = (1, 2, 2)
  max_nodes: int = 16
  # the tree's candidates ranked coupled to the target's own noise (sampling.draft_keys); False:
  # by the heads' probabilities (proposers.RankedHeads.coupled)
  coupled: bool = True

  def __post_init__(self):
    k = check_int(self, "num_heads", 1)
    object.__setattr__(self, "topk", int_tuple(self.topk, "ReflexConfig.topk", 1, length=k,
                                               count=f"num_heads={k}"))
    for name in ("topk", "r_min", "r_max", "rho", "min_obs", "min_severity", "beams"):
      v = tuple(getattr(self, name))
      if not v:
        raise ValueError(f"ReflexConfig.{name} must not be empty")
      object.__setattr__(self, name, _per_head(v, k))
    if any(not (0 <= a <= b) for a, b in zip(self.r_min, self.r_max, strict=True)):
      raise ValueError(f"ReflexConfig.r_min {self.r_min} and r_max {self.r_max} must satisfy "
                       "0 <= r_min <= r_max per head")
    if any(not (0 < r < 1) for r in self.rho):
      raise ValueError(f"ReflexConfig.rho must lie in (0, 1), got {self.rho}")
    for name in ("sketch_dim", "top", "weak", "down_after", "up_after", "stride"):
      check_int(self, name, 1)
    for name in ("share_group", "record_capacity", "sleep_batches", "sleep_max_batches"):
      check_int(self, name, 0)
    check_bool(self, "conditioned")
    check_bool(self, "coupled")
    object.__setattr__(self, "beams", int_tuple(self.beams, "ReflexConfig.beams", 1))
    if self.beams[0] != 1:
      raise ValueError(f"ReflexConfig.beams must start at 1, got {self.beams}")
    check_int(self, "max_nodes", 1)
    check_bool(self, "apply_corrections")
    if not (0 < self.safety_min <= self.safety_start <= self.safety_max):
      raise ValueError(f"ReflexConfig safety must satisfy 0 < safety_min <= safety_start <= "
                       f"safety_max, got {self.safety_min}, {self.safety_start}, "
                       f"{self.safety_max}")
    for name in ("lcb_scale", "rms_scale", "stride_rows"):
      check_float(self, name, 0, lo_open=True, allow_inf=True)

  @property
  def slots(self) -> int:
    """Ring slots per (row, head): K + 2 (a row advances at least one position per step)."""
    return self.num_heads + 2

  @property
  def max_candidates(self) -> int:
    return max(self.topk)

  @property
  def support_size(self) -> int:
    """Entries of a record's support list: top(q), top(p), the token, corrected and raw top-k."""
    return 2 * self.top + 1 + 2 * self.max_candidates

  def sketch(self, d: int) -> jax.Array:
    """The fixed random projection P [D, sketch_dim] with unit columns."""
    p = jax.random.normal(jax.random.key(self.sketch_seed), (d, self.sketch_dim), jnp.float32)
    return p / jnp.linalg.norm(p, axis=0, keepdims=True)

