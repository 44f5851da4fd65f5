"""Reflex: the gradient-free fast path over the future-token heads (docs/design.md, "Reflex").

Per (row, head k) a fast state m (hidden-sized, f32) turns delayed verifier feedback into a
bounded correction of head k's output hidden state before the shared final norm and unembedding:

    h_k' = h_k + c,   c = r * rms(h_k) * m / rms(m),
    r = safety_k * (r_min,k + (r_max,k - r_min,k) * trust),   so rms(c) <= safety_k r_max,k rms(h_k)

applied only when a conservative alignment gate says past errors predict future ones: on feedback
rounds each head records its prediction (keyed by the target position it predicts, in a ring of
K + 2 slots), and when that position is committed the record matures into a feedback vector g (in
closed form from unembedding rows: no backprop) and one observation of the cosine between the
state's sketch at proposal time and g's sketch. trust and eligibility come from the running lower
confidence bound (LCB) of those cosines (Welford / Chan), the observation count, the accumulated
severity and the state's size. Everything is static-shaped and runs inside the jitted decode loop;
a proposer can only change speed, never the committed tokens. Steps where no row records skip
building records, and steps where no record matures skip the feedback math (``lax.cond``, the
results unchanged); ``ReflexConfig.stride`` > 1 makes feedback rounds rarer where rows are few.

Between rollout batches, ``end_batch`` updates each head's global safety factor from the free
counterfactual (target mass captured by the corrected vs the raw head's candidates).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from specroll_jax import head_kinds
from specroll_jax import heads as _heads
from specroll_jax import records as _records
from specroll_jax import tree as _tree
from specroll_jax._vma import vary_like
from specroll_jax.config import DEFAULT_TOPK
from specroll_jax.models import decoder as _dec
from specroll_jax.proposers.base import Proposer
from specroll_jax.proposers.heads import effective_topk
from specroll_jax.proposers.ranked_heads import RankedHeads
from specroll_jax.sampling import inverse_temperature

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
  apply_corrections: bool = True  # False: records and statistics only (the heads stay static)
  # root-conditioned heads (cond_heads.CondHeads): the tree expands depth by depth from the
  # beams[k-1] best partial paths (proposers.RankedHeads), at most max_nodes nodes
  conditioned: bool = False
  beams: tuple[int, ...] = (1, 2, 2)
  max_nodes: int = 16

  def __post_init__(self):
    k = self.num_heads
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
      raise ValueError(f"ReflexConfig.num_heads must be an int >= 1, got {k!r}")
    if len(tuple(self.topk)) != k or any(not isinstance(t, int) or t < 1 for t in self.topk):
      raise ValueError(f"ReflexConfig.topk must hold num_heads={k} ints >= 1, got {self.topk}")
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
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"ReflexConfig.{name} must be an int >= 1, got {v!r}")
    for name in ("share_group", "record_capacity"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"ReflexConfig.{name} must be an int >= 0, got {v!r}")
    if not isinstance(self.conditioned, bool):
      raise ValueError(f"ReflexConfig.conditioned must be a bool, got {self.conditioned!r}")
    if self.beams[0] != 1 or any(not isinstance(b, int) or b < 1 for b in self.beams):
      raise ValueError(f"ReflexConfig.beams must be ints >= 1 starting at 1, got {self.beams}")
    if isinstance(self.max_nodes, bool) or not isinstance(self.max_nodes, int) or \
        self.max_nodes < 1:
      raise ValueError(f"ReflexConfig.max_nodes must be an int >= 1, got {self.max_nodes!r}")
    if not isinstance(self.apply_corrections, bool):
      raise ValueError(f"ReflexConfig.apply_corrections must be a bool, got "
                       f"{self.apply_corrections!r}")
    if not (0 < self.safety_min <= self.safety_start <= self.safety_max):
      raise ValueError(f"ReflexConfig safety must satisfy 0 < safety_min <= safety_start <= "
                       f"safety_max, got {self.safety_min}, {self.safety_start}, "
                       f"{self.safety_max}")
    for name in ("lcb_scale", "rms_scale", "stride_rows"):
      if not getattr(self, name) > 0:
        raise ValueError(f"ReflexConfig.{name} must be > 0, got {getattr(self, name)!r}")

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


# ----------------------------------------------------------------------------------- state


@flax.struct.dataclass
class ReflexGlobal:
  """Per head, across rollout batches (part of the proposer's parameters)."""

  safety: Float[Array, " K"]
  below: Int[Array, " K"]  # consecutive batches whose gain upper bound was < 0
  above: Int[Array, " K"]  # consecutive batches whose gain lower bound was > 0


@flax.struct.dataclass
class FastState:
  """Fast state and alignment statistics per (row or group, head): leaves [N, K, ...]."""

  m: Float[Array, "N K D"]
  count: Float[Array, "N K"]  # alignment observations (Welford n)
  mean: Float[Array, "N K"]  # running mean of the sketch cosines
  m2: Float[Array, "N K"]  # running sum of squared deviations
  severity: Float[Array, "N K"]  # accumulated severity of matured records


@flax.struct.dataclass
class Pending:
  """Prediction records waiting for their position to be committed: [R, K, S, ...], slot =
  position mod S."""

  position: Int[Array, "R K S"]  # predicted target position; -1 = empty
  hidden: Float[Array, "R K S D"]  # anchor hidden state (the heads' input)
  head: Float[Array, "R K S D"]  # corrected head output h_k' (pre final norm)
  correction: Float[Array, "R K S D"]
  qtop: Int[Array, "R K S T"]  # top ids of the corrected head's logits
  cand: Int[Array, "R K S C"]  # the tree's candidates at depth k (-1 = none)
  corr_top: Int[Array, "R K S C"]  # corrected head's top-k_k (counterfactual), -1 padded
  raw_top: Int[Array, "R K S C"]  # raw head's top-k_k (counterfactual), -1 padded
  sigma: Float[Array, "R K S P"]  # sketch of the fast state at proposal time
  has_sigma: Bool[Array, "R K S"]
  applied: Bool[Array, "R K S"]  # the correction was applied
  path: Int[Array, "R K S K"]  # tokens the head read (root, path above it); -1: any (Medusa)


@flax.struct.dataclass
class ReflexRows:
  """Per-row state (every leaf [R, ...]; compacted with the row)."""

  fast: FastState | None  # None when rows share a group state
  pending: Pending
  steps: Int[Array, " R"]  # verify steps this row took part in (feedback stride)
  proposed: Int[Array, " R"]  # proposals since the last update (for the statistics)
  applied: Int[Array, "R K"]  # corrections applied since the last update (for the statistics)
  ratio_sum: Float[Array, "R K"]
  lcb_sum: Float[Array, "R K"]
  lcb_n: Int[Array, "R K"]
  # root-conditioned heads: expected accepted nodes of the last proposal's best n candidates
  # (n = 0..capacity; ranked by the heads' own probabilities): what goodput weighs
  expected: Float[Array, "R Nr"] | None = None


@flax.struct.dataclass
class ReflexShared:
  """Shared across rows (not compacted)."""

  batch_rows: Int[Array, ""]
  group: FastState | None  # [G groups, K, ...] when share_group > 0
  records: _records.Records | None  # matured records for the slow path


# ------------------------------------------------------------------------------------ math


def _rms(x, axis=-1):
  return jnp.sqrt(jnp.mean(jnp.square(x), axis=axis))


def lcb(fast: FastState, z: float) -> jax.Array:
  """mean - z * stderr of the sketch cosines; -inf with fewer than 2 observations."""
  var = fast.m2 / jnp.maximum(fast.count - 1, 1)
  se = jnp.sqrt(jnp.maximum(var, 0) / jnp.maximum(fast.count, 1))
  return jnp.where(fast.count >= 2, fast.mean - z * se, -jnp.inf)


def gate(cfg: ReflexConfig, fast: FastState, safety):
  """(eligible [.., K], trust, ratio r, lcb) of every (row, head)."""
  rms_m = _rms(fast.m)
  low = lcb(fast, cfg.lcb_z)
  finite = jnp.isfinite(fast.m).all(-1)
  eligible = (cfg.apply_corrections & (low > 0)
              & (fast.count >= jnp.asarray(cfg.min_obs, jnp.float32))
              & (fast.severity >= jnp.asarray(cfg.min_severity, jnp.float32))
              & (rms_m >= cfg.min_state_rms) & finite)
  trust = jnp.sqrt(jnp.clip(low / cfg.lcb_scale, 0, 1) * jnp.clip(rms_m / cfg.rms_scale, 0, 1))
  r_min, r_max = jnp.asarray(cfg.r_min), jnp.asarray(cfg.r_max)
  ratio = safety * (r_min + (r_max - r_min) * trust)
  return eligible, trust, ratio, low


def correction(cfg: ReflexConfig, fast: FastState, safety, h_heads):
  """The bounded correction c [.., K, D] of head outputs ``h_heads`` (exactly 0 where ineligible),
  with (eligible, ratio, lcb)."""
  eligible, _, ratio, low = gate(cfg, fast, safety)
  hf = h_heads.astype(jnp.float32)
  scale = ratio * _rms(hf) / jnp.maximum(_rms(fast.m), _TINY)
  c = jnp.where(eligible[..., None], scale[..., None] * fast.m, 0.0)
  return c, eligible, ratio, low


def corrected_head_states(target, heads, glob: ReflexGlobal, cfg: ReflexConfig, fast: FastState,
                          h):
  """(raw head outputs, corrected outputs in the model dtype, correction, eligible, ratio, lcb).
  Where no correction applies the corrected outputs equal the raw ones bit for bit."""
  z = _heads.head_states(target.config, heads, h)  # [R, K, D] model dtype
  c, eligible, ratio, low = correction(cfg, fast, glob.safety, z)
  zc = jnp.where(eligible[..., None], (z.astype(jnp.float32) + c).astype(z.dtype), z)
  return z, zc, c, eligible, ratio, low


def welford_merge(fast: FastState, count, total, sq) -> FastState:
  """Fold a batch of observations (count, sum, sum of squares per [.., K]) into the running
  statistics (Chan et al.'s parallel form; one observation at a time it is Welford's update)."""
  nb = count.astype(jnp.float32)
  safe = jnp.maximum(nb, 1)
  mean_b = total / safe
  m2_b = jnp.maximum(sq - total * total / safe, 0)
  n = fast.count + nb
  delta = mean_b - fast.mean
  mean = jnp.where(nb > 0, fast.mean + delta * nb / jnp.maximum(n, 1), fast.mean)
  m2 = jnp.where(nb > 0, fast.m2 + m2_b + delta * delta * fast.count * nb / jnp.maximum(n, 1),
                 fast.m2)
  return fast.replace(count=n, mean=mean, m2=m2)


def _first_occurrence(ids):
  """ids [.., U] -> mask of entries >= 0 that do not repeat an earlier entry."""
  u = ids.shape[-1]
  same = ids[..., :, None] == ids[..., None, :]  # [.., U, U]
  earlier = jnp.tril(jnp.ones((u, u), bool), k=-1)
  return (ids >= 0) & ~(same & earlier).any(-1)


def _member(ids, sets):
  """ids [.., U], sets [.., C] (-1 = none) -> ids[u] in sets."""
  return ((ids[..., :, None] == sets[..., None, :]) & (sets[..., None, :] >= 0)).any(-1)


def _unembed_rows(config, params, ids):
  """Unembedding vectors W_v [.., D] of ids [..] (ids clipped into range)."""
  ids = jnp.clip(ids, 0, config.vocab_size - 1)
  w, layout = _dec.unembedding_for_kernel(config, params)
  if layout == "vd":
    return jnp.take(w, ids, axis=0)
  return jnp.moveaxis(jnp.take(w, ids, axis=1), 0, -1)


@flax.struct.dataclass
class Matured:
  """Feedback computed from records (leaves [.., ...] over records)."""

  g: Float[Array, "... D"]  # feedback vector
  tv: Float[Array, "..."]
  out: Float[Array, "..."]  # target mass the candidates missed
  severity: Float[Array, "..."]
  support: Int[Array, "... U"]  # the support S (-1 where not in it)
  p: Float[Array, "... U"]  # target distribution renormalised on S
  p_tail: Float[Array, "..."]  # target mass outside S (full vocabulary)
  gain: Float[Array, "..."]  # p(corrected top-k) - p(raw top-k)


def feedback(cfg: ReflexConfig, target, head_out, ids_q, ids_p, token, cand, corr_top, raw_top,
             path_hidden, lse) -> Matured:
  """Feedback of matured records (docs/design.md, "Feedback from a matured record").

  head_out [.., D]: the corrected head output h_k'; ids_q / ids_p [.., top]: top ids of q and of
  the target's p; token [..]: the committed token; cand / corr_top / raw_top [.., C]; path_hidden
  [.., D]: the target's anchor hidden state of the committed position; lse [..]: logsumexp of the
  target's tempered logits there. Support S = top(q) u top(p) u {token} u C (at most 2 top + 1 + C
  ids), p_S and q_S renormalised on S at the sampling temperature.
  """
  config, params = target.config, target.params
  inv_t = 1.0 if target.sampling.greedy else float(inverse_temperature(
      target.sampling.temperature))
  ids = jnp.concatenate([ids_q, ids_p, token[..., None], corr_top, raw_top], axis=-1)
  first = _first_occurrence(ids)
  in_s = first & (_member(ids, ids_q) | _member(ids, ids_p) | (ids == token[..., None])
                  | _member(ids, cand))
  w_rows = _unembed_rows(config, params, ids).astype(jnp.float32)  # [.., U, D]
  norm_p = _dec.final_norm(config, params, path_hidden).astype(jnp.float32)
  norm_q = _dec.final_norm(config, params, head_out).astype(jnp.float32)
  xp = jnp.einsum("...d,...ud->...u", norm_p, w_rows) * inv_t
  xq = jnp.einsum("...d,...ud->...u", norm_q, w_rows) * inv_t
  p_full = jnp.where(first, jnp.exp(xp - lse[..., None]), 0.0)  # exact target probabilities
  masked = lambda x: jnp.where(in_s, x, -jnp.inf)
  p_s = jnp.where(in_s, jax.nn.softmax(masked(xp), axis=-1), 0.0)
  q_s = jnp.where(in_s, jax.nn.softmax(masked(xq), axis=-1), 0.0)
  tv = 0.5 * jnp.abs(p_s - q_s).sum(-1)
  in_c = first & _member(ids, cand)
  out = jnp.clip(1.0 - (p_full * in_c).sum(-1), 0.0, 1.0)
  # coverage: target mass in top(p) outside the candidates, moved from the weakest candidates
  miss = in_s & _member(ids, ids_p) & ~in_c
  miss_mass = (p_s * miss).sum(-1)
  xq_c = jnp.where(in_c, xq, jnp.inf)
  kth = -jax.lax.top_k(-xq_c, min(cfg.weak, ids.shape[-1]))[0][..., -1:]  # weak-th smallest
  weak = in_c & (xq_c <= kth)
  beta = jnp.where(weak, jax.nn.softmax(jnp.where(weak, xq, -jnp.inf), axis=-1), 0.0)
  beta = jnp.where(weak.any(-1, keepdims=True), beta, 0.0)
  w = (cfg.dist_weight * (p_s - q_s) + cfg.cov_weight * (p_s * miss)
       - cfg.cov_weight * miss_mass[..., None] * beta)
  g = jnp.einsum("...u,...ud->...d", w, w_rows)
  severity = jnp.clip(0.5 * tv + 0.5 * out, 0.0, 1.0)
  gain = (p_full * (first & _member(ids, corr_top))).sum(-1) - (
      p_full * (first & _member(ids, raw_top))).sum(-1)
  p_tail = jnp.clip(1.0 - (p_full * in_s).sum(-1), 0.0, 1.0)
  return Matured(g=g, tv=tv, out=out, severity=severity, support=jnp.where(in_s, ids, -1), p=p_s,
                 p_tail=p_tail, gain=gain)


def end_batch(cfg: ReflexConfig, glob: ReflexGlobal, stats) -> ReflexGlobal:
  """Global safety per head after a rollout batch, from its counterfactual gain statistics
  (``stats`` as summed by the engine: reflex_gain_sum / _sq / _n per head)."""
  n = stats["reflex_gain_n"].astype(jnp.float32)
  mean = stats["reflex_gain_sum"] / jnp.maximum(n, 1)
  var = (stats["reflex_gain_sq"] - n * mean * mean) / jnp.maximum(n - 1, 1)
  se = jnp.sqrt(jnp.maximum(var, 0) / jnp.maximum(n, 1))
  have = n >= 2
  below = jnp.where(have & (mean + cfg.gain_z * se < 0), glob.below + 1, 0)
  above = jnp.where(have & (mean - cfg.gain_z * se > 0), glob.above + 1, 0)
  down, up = below >= cfg.down_after, above >= cfg.up_after
  safety = jnp.where(down, jnp.maximum(glob.safety * cfg.safety_down, cfg.safety_min), glob.safety)
  safety = jnp.where(up, jnp.minimum(safety * cfg.safety_up, cfg.safety_max), safety)
  return ReflexGlobal(safety=safety, below=jnp.where(down, 0, below), above=jnp.where(up, 0, above))


def init_global(cfg: ReflexConfig) -> ReflexGlobal:
  k = cfg.num_heads
  return ReflexGlobal(safety=jnp.full((k,), cfg.safety_start, jnp.float32),
                      below=jnp.zeros((k,), jnp.int32), above=jnp.zeros((k,), jnp.int32))


def _reset(fast: FastState, bad) -> FastState:
  """Zero the state and statistics of the (row, head) pairs where ``bad`` [N, K]."""
  return jax.tree.map(lambda a: jnp.where(bad.reshape(bad.shape + (1,) * (a.ndim - 2)), 0, a),
                      fast)


def _zeros_fast(n: int, k: int, d: int) -> FastState:
  z = jnp.zeros((n, k), jnp.float32)
  return FastState(m=jnp.zeros((n, k, d), jnp.float32), count=z, mean=z, m2=z, severity=z)


class _Matured(NamedTuple):
  """What one step's matured records contribute (``ReflexProposer._mature``): per (row, head)
  observation count / sum / sum of squares, severity added, the fast state's increment dm
  [R, K, D], non-finite feedback, the slow path's records and the per-head statistics."""

  cnt: jax.Array
  tot: jax.Array
  sq: jax.Array
  sev_add: jax.Array
  dm: jax.Array
  bad: jax.Array
  records: _records.Records | None
  stats: dict


# -------------------------------------------------------------------------------- proposer


@dataclasses.dataclass(frozen=True)
class ReflexProposer(Proposer):
  """Future-token heads with Reflex corrections. Parameters: (``heads.Heads``, ``ReflexGlobal``);
  state: (``ReflexRows``, ``ReflexShared``)."""

  config: ReflexConfig = ReflexConfig()

  @property
  def max_depth(self) -> int:
    return self.config.num_heads

  @property
  def ranked(self) -> RankedHeads:
    """The depth-by-depth expansion root-conditioned heads propose with."""
    c = self.config
    return RankedHeads(num_heads=c.num_heads, topk=c.topk, beams=c.beams, max_nodes=c.max_nodes)

  @property
  def capacity(self) -> int:
    if self.config.conditioned:
      return self.ranked.capacity
    total, width = 0, 1
    for k in self.config.topk:
      width *= k
      total += width
    return total

  @property
  def feedback_topm(self) -> int:
    return self.config.top

  def validate(self, config, params) -> None:
    if not isinstance(params, tuple) or len(params) != 2 or \
        not isinstance(params[1], ReflexGlobal):
      raise ValueError("ReflexProposer params must be (heads, reflex.ReflexGlobal), got "
                       f"{type(params).__name__}")
    head_kinds.validate(config, params[0], self.config.num_heads)
    if head_kinds.is_conditioned(params[0]) != self.config.conditioned:
      raise ValueError(f"ReflexConfig.conditioned={self.config.conditioned} but the heads are "
                       f"{type(params[0]).__name__} (root-conditioned heads need "
                       "conditioned=True, Medusa heads False)")
    if params[1].safety.shape != (self.config.num_heads,):
      raise ValueError(f"ReflexGlobal.safety has shape {params[1].safety.shape}, expected "
                       f"({self.config.num_heads},)")

  def split_state(self, state):
    return state

  def join_state(self, rows, shared):
    return rows, shared

  def init(self, target, params, rows):
    cfg = self.config
    r = rows.row.shape[0]
    k, s, d = cfg.num_heads, cfg.slots, target.config.hidden_size
    c, t = cfg.max_candidates, cfg.top
    f = lambda *sh: jnp.zeros((r, k, s) + sh, jnp.float32)
    i = lambda *sh: jnp.full((r, k, s) + sh, -1, jnp.int32)
    pending = Pending(position=i(), hidden=f(d), head=f(d), correction=f(d), qtop=i(t), cand=i(c),
                      corr_top=i(c), raw_top=i(c), sigma=f(cfg.sketch_dim),
                      has_sigma=jnp.zeros((r, k, s), bool), applied=jnp.zeros((r, k, s), bool),
                      path=i(k))
    zk = jnp.zeros((r, k), jnp.int32)
    share = cfg.share_group > 0
    row_state = ReflexRows(fast=None if share else _zeros_fast(r, k, d), pending=pending,
                           steps=jnp.zeros((r,), jnp.int32),
                           proposed=jnp.zeros((r,), jnp.int32), applied=zk,
                           ratio_sum=jnp.zeros((r, k), jnp.float32),
                           lcb_sum=jnp.zeros((r, k), jnp.float32), lcb_n=zk,
                           expected=(jnp.zeros((r, self.capacity + 1), jnp.float32)
                                     if cfg.conditioned else None))
    groups = -(-r // cfg.share_group) if share else 0
    recs = None
    if cfg.record_capacity > 0:
      recs = _records.empty(k, cfg.record_capacity, d, cfg.support_size, c,
                            path=k if cfg.conditioned else 0)
    shared = ReflexShared(batch_rows=jnp.int32(r),
                          group=_zeros_fast(groups, k, d) if share else None, records=recs)
    return row_state, shared

  # -- fast state views (per row, or gathered from the row's group)

  def _view(self, rows: ReflexRows, shared: ReflexShared, row_ids) -> FastState:
    if self.config.share_group > 0:
      g = row_ids // self.config.share_group
      return jax.tree.map(lambda x: x[g], shared.group)
    return rows.fast

  def propose(self, target, params, state, inp, *, num_nodes):
    cfg = self.config
    rows, shared = state
    if num_nodes == 0:
      return _tree.root_only(inp.root), state
    heads, glob = params
    k = cfg.num_heads
    active = inp.budget > 0
    fast = self._view(rows, shared, inp.row)
    expected = None
    if cfg.conditioned:
      tr, z, zc, c, logits, ctx, eligible, ratio, low, expected = self._propose_conditioned(
          target, heads, glob, fast, inp, num_nodes, active)
    else:
      z, zc, c, eligible, ratio, low = corrected_head_states(target, heads, glob, cfg, fast,
                                                             inp.hidden)
      eligible = eligible & active[:, None]
      logits = _dec.logits_from_hidden(target.config, target.params, zc)  # [R, K, V]
      topk = effective_topk(cfg.topk, num_nodes)
      lp = jax.nn.log_softmax(logits[:, : len(topk)], axis=-1)
      tr = _tree.plan(inp.root, lp, inp.budget, num_nodes=num_nodes, topk=topk)
      ctx = jnp.full(z.shape[:2] + (k,), -1, jnp.int32)
    # prediction records, on feedback rounds (skipped, as a whole, when no row records)
    n_active = active.sum()
    stride = jnp.maximum(cfg.stride, jnp.ceil(cfg.stride_rows * n_active / shared.batch_rows)
                         ).astype(jnp.int32)
    rnd = active & (rows.steps % stride == 0)
    if cfg.conditioned:  # heads the tree did not reach (num_nodes < K) record nothing
      rnd_k = rnd[:, None] & (jnp.arange(k) < min(k, num_nodes))[None]
    else:
      rnd_k = jnp.broadcast_to(rnd[:, None], (rnd.shape[0], k))

    def record():
      return self._record(target, fast, inp, tr, z, zc, c, logits, ctx, eligible, rnd, rnd_k,
                          rows.pending)

    pend = jax.lax.cond(rnd_k.any(), record, lambda: rows.pending)
    finite_low = jnp.isfinite(low) & active[:, None]
    rows = rows.replace(pending=pend, steps=rows.steps + active.astype(jnp.int32),
                        proposed=rows.proposed + active.astype(jnp.int32),
                        applied=rows.applied + eligible.astype(jnp.int32),
                        ratio_sum=rows.ratio_sum + jnp.where(eligible, ratio, 0.0),
                        lcb_sum=rows.lcb_sum + jnp.where(finite_low, low, 0.0),
                        lcb_n=rows.lcb_n + finite_low.astype(jnp.int32),
                        expected=(None if expected is None
                                  else jnp.where(active[:, None], expected, 0.0)))
    return tr, (rows, shared)

  def _record(self, target, fast: FastState, inp, tr, z, zc, c, logits, ctx, eligible, rnd,
              rnd_k, pend: Pending) -> Pending:
    """The pending records with each recording (row, head)'s prediction written to its slot."""
    cfg = self.config
    k = cfg.num_heads
    cmax = cfg.max_candidates
    kc = jnp.asarray(cfg.topk)[None, :, None]
    jj = jnp.arange(cmax)[None, None]
    qtop = jax.lax.top_k(logits, cfg.top)[1]
    corr_top = jnp.where(jj < kc, jax.lax.top_k(logits, cmax)[1], -1)
    raw_top = jax.lax.cond(  # the raw head's logits: only when a corrected head is recorded
        (eligible & rnd[:, None]).any(),
        lambda: jnp.where(jj < kc, jax.lax.top_k(_dec.logits_from_hidden(
            target.config, target.params, z), cmax)[1], -1),
        lambda: corr_top)
    ks = jnp.arange(1, k + 1)
    at_depth = tr.valid[:, None, :] & (tr.depth[:, None, :] == ks[None, :, None])  # [R, K, N1]
    present = ((tr.tokens[:, None, None, :] == corr_top[..., None])
               & at_depth[:, :, None, :]).any(-1)
    cand = jnp.where(present, corr_top, -1)
    rms_m = _rms(fast.m)
    sk = (fast.m / jnp.maximum(rms_m, _TINY)[..., None]) @ cfg.sketch(fast.m.shape[-1])
    sigma = sk / jnp.maximum(jnp.linalg.norm(sk, axis=-1, keepdims=True), _TINY)
    has_sigma = (rms_m > 0) & jnp.isfinite(rms_m)
    pos = inp.position[:, None] + ks[None]  # [R, K]: position head k predicts
    slot = pos % cfg.slots
    sel = (jnp.arange(cfg.slots)[None, None] == slot[..., None]) & rnd_k[..., None]  # [R, K, S]
    put = lambda old, new: jnp.where(sel.reshape(sel.shape + (1,) * (old.ndim - 3)),
                                     jnp.expand_dims(new, 2).astype(old.dtype), old)
    hid = jnp.broadcast_to(inp.hidden[:, None].astype(jnp.float32), z.shape)
    return Pending(position=put(pend.position, pos), hidden=put(pend.hidden, hid),
                   head=put(pend.head, zc.astype(jnp.float32)), correction=put(pend.correction, c),
                   qtop=put(pend.qtop, qtop), cand=put(pend.cand, cand),
                   corr_top=put(pend.corr_top, corr_top), raw_top=put(pend.raw_top, raw_top),
                   sigma=put(pend.sigma, sigma), has_sigma=put(pend.has_sigma, has_sigma),
                   applied=put(pend.applied, eligible), path=put(pend.path, ctx))

  def _propose_conditioned(self, target, heads, glob: ReflexGlobal, fast: FastState, inp,
                           num_nodes: int, active):
    """Root-conditioned heads: the ranked depth-by-depth tree with each head's evaluations
    corrected, and the trunk (best path) evaluations padded to K heads for the records."""
    cfg = self.config
    k = cfg.num_heads
    eligible, _, ratio, low = gate(cfg, fast, glob.safety)
    eligible = eligible & active[:, None]
    rms_m = jnp.maximum(_rms(fast.m), _TINY)  # [R, K]

    def bounded(i, zz):  # head i's correction of states zz [R, P, D]
      scale = ratio[:, i, None] * _rms(zz.astype(jnp.float32)) / rms_m[:, i, None]
      return jnp.where(eligible[:, i, None, None], scale[..., None] * fast.m[:, None, i], 0.0)

    def correct(kk, zz):
      c = bounded(kk - 1, zz)
      return jnp.where(eligible[:, kk - 1, None, None],
                       (zz.astype(jnp.float32) + c).astype(zz.dtype), zz)

    rh = self.ranked
    cands, (z, zc, logits, ctx) = rh.expand(target, rh.params(heads), inp.hidden, inp.root,
                                            num_nodes=num_nodes, correct=correct)
    tr, sel = _tree.select(inp.root, cands, inp.budget, num_nodes=num_nodes, max_depth=k,
                           ranks=self.capacity + 1)
    c = jnp.concatenate([bounded(i, z[:, i:i + 1]) for i in range(z.shape[1])], axis=1)
    pad = lambda x, v=0: jnp.pad(x, ((0, 0), (0, k - x.shape[1])) + ((0, 0),) * (x.ndim - 2),
                                 constant_values=v)
    used = jnp.arange(k) < z.shape[1]
    return (tr, pad(z), pad(zc), pad(c), pad(logits), pad(ctx, -1), eligible & used[None],
            ratio, low, sel.expected)

  def update(self, target, params, state, fb):
    cfg = self.config
    rows, shared = state
    pend = rows.pending
    r, k, s = pend.position.shape
    d1 = fb.tokens.shape[1]
    # which records mature now: their position was committed in this step
    j = pend.position - fb.position[:, None, None] - 1
    jc = jnp.clip(j, 0, d1 - 1)
    kept = jnp.take_along_axis(fb.keep, jc.reshape(r, -1), axis=1).reshape(jc.shape)
    due = (pend.position >= 0) & (j >= 0) & (j < fb.path_len[:, None, None]) & kept
    fast = self._view(rows, shared, fb.row)
    n_commit = fb.keep.sum(1).astype(jnp.float32)[:, None, None]  # [R, 1, 1]
    rho = jnp.asarray(cfg.rho, jnp.float32)[None, :, None]  # [1, K, 1]

    def matured():
      return self._mature(target, pend, fb, due, j, jc, n_commit, rho, shared.records)

    def idle():  # nothing matures: what ``matured`` gives then, without computing it
      zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(matured))
      return vary_like(zeros, pend.position, fb.position)._replace(records=shared.records)

    mat = jax.lax.cond(due.any(), matured, idle)
    # m decays once per committed token; a matured record adds at its token's place in order
    m = rho ** n_commit * fast.m + mat.dm
    m = m / jnp.maximum(1.0, _rms(m))[..., None]
    bad_row = ~jnp.isfinite(m).all(-1) | mat.bad  # [R, K]
    if cfg.share_group == 0:
      new = welford_merge(fast, mat.cnt, mat.tot, mat.sq).replace(
          m=m, severity=fast.severity + mat.sev_add)
      bad = bad_row | ~(jnp.isfinite(new.mean) & jnp.isfinite(new.m2))
      rows = rows.replace(fast=_reset(new, bad))
    else:  # a group takes its rows' observations and the mean change of its active rows' m
      gid = fb.row // cfg.share_group
      grp = shared.group
      seg = lambda x: jax.ops.segment_sum(x, gid, num_segments=grp.m.shape[0])
      w = fb.active.astype(jnp.float32)
      gm = grp.m + seg((m - fast.m) * w[:, None, None]) / jnp.maximum(seg(w), 1)[:, None, None]
      gm = gm / jnp.maximum(1.0, _rms(gm))[..., None]
      newg = welford_merge(grp, seg(mat.cnt), seg(mat.tot), seg(mat.sq)).replace(
          m=gm, severity=grp.severity + seg(mat.sev_add))
      badg = (seg(bad_row.astype(jnp.int32)) > 0) | ~(
          jnp.isfinite(newg.m).all(-1) & jnp.isfinite(newg.mean) & jnp.isfinite(newg.m2))
      shared = shared.replace(group=_reset(newg, badg))
      bad = badg[gid] & fb.active[:, None]
    shared = shared.replace(records=mat.records)
    # matured records leave the ring; a finished row drops its pending records
    position = jnp.where(due | fb.done[:, None, None], -1, pend.position)
    per_head = lambda x: x.sum(axis=tuple(i for i in range(x.ndim) if i != 1))
    stats = {
        "reflex_row_head_steps": jnp.broadcast_to(rows.proposed.sum(), (k,)).astype(jnp.int32),
        "reflex_applied": per_head(rows.applied),
        "reflex_ratio_sum": per_head(rows.ratio_sum),
        "reflex_lcb_sum": per_head(rows.lcb_sum),
        "reflex_lcb_n": per_head(rows.lcb_n),
        **mat.stats,
        "reflex_resets": per_head(bad.astype(jnp.int32)),
    }
    if cfg.conditioned:  # expected accepted nodes by tree size, for goodput
      on = (rows.proposed > 0) & fb.active
      stats["reflex_expected"] = jnp.where(on[:, None], rows.expected, 0.0).sum(0)
      stats["reflex_expected_n"] = on.sum().astype(jnp.int32)
    stats = {name: stats[name] for name in self.init_stats()}  # one order, whichever branch
    zk = jnp.zeros_like(rows.applied)
    rows = rows.replace(pending=pend.replace(position=position), applied=zk,
                        proposed=jnp.zeros_like(rows.proposed),
                        ratio_sum=jnp.zeros_like(rows.ratio_sum),
                        lcb_sum=jnp.zeros_like(rows.lcb_sum), lcb_n=zk)
    return (rows, shared), stats

  def _mature(self, target, pend: Pending, fb, due, j, jc, n_commit, rho, records) -> _Matured:
    """What the records that mature in this step contribute (all zeros, and ``records`` as is,
    when none does): the feedback math, the observations, the state's increment and the slow
    path's records."""
    cfg = self.config
    r, k, s = pend.position.shape
    mature = due
    if cfg.conditioned:  # a head's prediction counts only if the path it read was committed
      start = pend.position - jnp.arange(k)[None, :, None] - 1  # the root's position
      at = (start[..., None] + jnp.arange(k)).reshape(r, -1)
      seen = jnp.take_along_axis(fb.history, jnp.clip(at, 0, fb.history.shape[1] - 1), axis=1)
      mature = due & ((pend.path < 0) | (seen.reshape(pend.path.shape) == pend.path)).all(-1)
    take_j = lambda x: jnp.take_along_axis(
        x, jc.reshape((r, -1) + (1,) * (x.ndim - 2)), axis=1).reshape(jc.shape + x.shape[2:])
    token = take_j(fb.tokens)
    mt = feedback(cfg, target, pend.head, pend.qtop, take_j(fb.topm_ids)[..., : cfg.top], token,
                  pend.cand, pend.corr_top, pend.raw_top, take_j(fb.path_hidden),
                  take_j(fb.lse))
    finite = jnp.isfinite(mt.g).all(-1) & jnp.isfinite(mt.severity)
    ok = mature & finite
    use = ok & (mt.severity >= cfg.severity_floor)
    # alignment observations: cosine between the state's sketch then and g's sketch now
    gs = mt.g @ cfg.sketch(mt.g.shape[-1])
    gs = gs / jnp.maximum(jnp.linalg.norm(gs, axis=-1, keepdims=True), _TINY)
    cos = (pend.sigma * gs).sum(-1)
    obs = ok & pend.has_sigma & (jnp.linalg.norm(mt.g, axis=-1) > 0)
    cnt = obs.sum(-1)
    tot = jnp.where(obs, cos, 0.0).sum(-1)
    sq = jnp.where(obs, cos * cos, 0.0).sum(-1)
    sev_add = jnp.where(use, mt.severity, 0.0).sum(-1)
    unit = jnp.where(use[..., None], mt.g / jnp.maximum(_rms(mt.g), _TINY)[..., None], 0.0)
    weight = jnp.where(use, (1 - rho) * mt.severity * rho ** (n_commit - 1 - j), 0.0)
    dm = jnp.einsum("rks,rksd->rkd", weight, unit)
    # records for the slow path
    hit = _member(token[..., None], pend.cand)[..., 0]
    if records is not None:
      kflat = lambda x: jnp.swapaxes(x, 0, 1).reshape((k, r * s) + x.shape[3:])
      batch = _records.Records(
          hidden=kflat(pend.hidden), correction=kflat(pend.correction), support=kflat(mt.support),
          p=kflat(mt.p), p_tail=kflat(mt.p_tail), token=kflat(token), candidates=kflat(pend.cand),
          hit=kflat(hit), tv=kflat(mt.tv), position=kflat(pend.position),
          valid=kflat(ok), count=jnp.zeros((k,), jnp.int32),
          path=kflat(pend.path) if cfg.conditioned else None)
      records = _records.write(records, batch, kflat(ok))
    applied = ok & pend.applied
    per_head = lambda x: x.sum(axis=tuple(i for i in range(x.ndim) if i != 1))
    stats = {
        "reflex_matured": per_head(ok.astype(jnp.int32)),
        "reflex_updates": per_head(use.astype(jnp.int32)),
        "reflex_tv_sum": per_head(jnp.where(ok, mt.tv, 0.0)),
        "reflex_hits": per_head((ok & hit).astype(jnp.int32)),
        "reflex_gain_sum": per_head(jnp.where(applied, mt.gain, 0.0)),
        "reflex_gain_sq": per_head(jnp.where(applied, mt.gain * mt.gain, 0.0)),
        "reflex_gain_n": per_head(applied.astype(jnp.int32)),
    }
    return _Matured(cnt=cnt, tot=tot, sq=sq, sev_add=sev_add, dm=dm,
                    bad=(mature & ~finite).any(-1), records=records, stats=stats)

  def expected_gain(self, state, num_nodes: int):
    rows = state[0]
    if rows.expected is None:
      return None
    return rows.expected[:, min(num_nodes, self.capacity)]

  def init_stats(self):
    k = self.config.num_heads
    zi, zf = jnp.zeros((k,), jnp.int32), jnp.zeros((k,), jnp.float32)
    return {"reflex_row_head_steps": zi, "reflex_applied": zi, "reflex_ratio_sum": zf,
            "reflex_lcb_sum": zf, "reflex_lcb_n": zi, "reflex_matured": zi,
            "reflex_updates": zi, "reflex_tv_sum": zf, "reflex_hits": zi, "reflex_resets": zi,
            "reflex_gain_sum": zf, "reflex_gain_sq": zf, "reflex_gain_n": zi,
            **({"reflex_expected": jnp.zeros((self.capacity + 1,), jnp.float32),
                "reflex_expected_n": jnp.int32(0)} if self.config.conditioned else {})}


def summarize(stats) -> dict:
  """Per-batch Reflex statistics as plain numbers (per head lists)."""
  s = {k: np.asarray(v, np.float64) for k, v in stats.items() if k.startswith("reflex_")}
  if not s:
    return {}
  steps = np.maximum(s["reflex_row_head_steps"], 1)
  applied = s["reflex_applied"]
  lcb_n = np.maximum(s["reflex_lcb_n"], 1)
  mat = np.maximum(s["reflex_matured"], 1)
  out = {
      "correction_rate": (applied / steps).tolist(),
      "mean_ratio": (s["reflex_ratio_sum"] / np.maximum(applied, 1)).tolist(),
      "lcb": np.where(s["reflex_lcb_n"] > 0, s["reflex_lcb_sum"] / lcb_n, math.nan).tolist(),
      "records_matured": s["reflex_matured"].astype(int).tolist(),
      "state_updates": s["reflex_updates"].astype(int).tolist(),
      "mean_tv": (s["reflex_tv_sum"] / mat).tolist(),
      "candidate_hit_rate": (s["reflex_hits"] / mat).tolist(),
      "resets": s["reflex_resets"].astype(int).tolist(),
      "gain_mean": (s["reflex_gain_sum"] / np.maximum(s["reflex_gain_n"], 1)).tolist(),
      "gain_n": s["reflex_gain_n"].astype(int).tolist(),
  }
  return out
