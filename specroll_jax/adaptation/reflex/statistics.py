"""Reflex's gate and statistics: the alignment LCB, the bounded correction, Welford / Chan
merges, the global safety update between batches and the host summary."""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from specroll_jax.adaptation.reflex.config import _TINY, ReflexConfig
from specroll_jax.adaptation.reflex.state import FastState, ReflexGlobal
from specroll_jax.engines.results import Summed
from specroll_jax.heads import medusa as _heads


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


@flax.struct.dataclass
class ReflexStats(Summed):
  """Reflex's per-head statistics of a rollout (leaves [K]; summed over steps by the engine:
  ``combine``). ``expected`` / ``expected_n`` only with root-conditioned heads (None otherwise)."""

  row_head_steps: Int[Array, " K"]  # (row, step) pairs that proposed, per head
  applied: Int[Array, " K"]  # corrections applied
  ratio_sum: Float[Array, " K"]  # sum of the applied correction ratios
  lcb_sum: Float[Array, " K"]
  lcb_n: Int[Array, " K"]
  matured: Int[Array, " K"]  # records matured
  updates: Int[Array, " K"]  # fast-state updates
  tv_sum: Float[Array, " K"]  # sum of the matured records' sparse TV
  hits: Int[Array, " K"]  # matured records whose committed token was a candidate
  resets: Int[Array, " K"]  # fast states reset (non-finite)
  gain_sum: Float[Array, " K"]  # counterfactual gain of applied corrections: sum, squares, n
  gain_sq: Float[Array, " K"]
  gain_n: Int[Array, " K"]
  expected: Float[Array, " Nr"] | None = None  # expected accepted nodes by tree size (goodput)
  expected_n: Int[Array, ""] | None = None

  @staticmethod
  def zeros(num_heads: int, ranks: int | None = None) -> ReflexStats:
    """Zeros for ``num_heads`` heads; ``ranks`` (capacity + 1) for root-conditioned heads."""
    zi, zf = jnp.zeros((num_heads,), jnp.int32), jnp.zeros((num_heads,), jnp.float32)
    cond = {} if ranks is None else {"expected": jnp.zeros((ranks,), jnp.float32),
                                     "expected_n": jnp.int32(0)}
    return ReflexStats(row_head_steps=zi, applied=zi, ratio_sum=zf, lcb_sum=zf, lcb_n=zi,
                       matured=zi, updates=zi, tv_sum=zf, hits=zi, resets=zi, gain_sum=zf,
                       gain_sq=zf, gain_n=zi, **cond)


def end_batch(cfg: ReflexConfig, glob: ReflexGlobal, stats: ReflexStats) -> ReflexGlobal:
  """Global safety per head after an awake rollout batch, from its counterfactual gain statistics
  (``stats`` as summed by the engine: gain_sum / gain_sq / gain_n per head), and the batches to
  sleep next: 0 when some head's gain lower bound was > 0 (its corrections paid), else
  ``cfg.sleep_batches`` after a paid batch (or none yet) and twice the last sleep after an unpaid
  one, at most ``cfg.sleep_max_batches`` (never below ``sleep_batches``)."""
  n = stats.gain_n.astype(jnp.float32)
  mean = stats.gain_sum / jnp.maximum(n, 1)
  var = (stats.gain_sq - n * mean * mean) / jnp.maximum(n - 1, 1)
  se = jnp.sqrt(jnp.maximum(var, 0) / jnp.maximum(n, 1))
  have = n >= 2
  below = jnp.where(have & (mean + cfg.gain_z * se < 0), glob.below + 1, 0)
  above = jnp.where(have & (mean - cfg.gain_z * se > 0), glob.above + 1, 0)
  down, up = below >= cfg.down_after, above >= cfg.up_after
  safety = jnp.where(down, jnp.maximum(glob.safety * cfg.safety_down, cfg.safety_min), glob.safety)
  safety = jnp.where(up, jnp.minimum(safety * cfg.safety_up, cfg.safety_max), safety)
  paid = (have & (mean - cfg.gain_z * se > 0)).any()
  base = cfg.sleep_batches
  longest = max(cfg.sleep_max_batches, base)
  unpaid = jnp.where(glob.nap > 0, jnp.minimum(2 * glob.nap, longest), base)
  sleep = jnp.where(paid, 0, unpaid).astype(jnp.int32)
  return ReflexGlobal(safety=safety, below=jnp.where(down, 0, below), above=jnp.where(up, 0, above),
                      sleep=sleep, nap=sleep)



@dataclasses.dataclass(frozen=True)
class ReflexSummary:
  """One batch of Reflex in plain numbers. asleep: the plain heads proposed (Reflex slept);
  sleep_left: batches it sleeps after this one. Per head (empty while asleep): correction_rate
  (corrected row-steps / row-steps), mean_ratio (the applied corrections' mean ratio), lcb (the
  lower confidence bound's mean; NaN where none was computed), records_matured, state_updates,
  mean_tv (TV between corrected and plain distributions over matured records),
  candidate_hit_rate, resets, gain_mean / gain_n (the measured gain of corrections and its
  count)."""

  asleep: bool
  sleep_left: int
  correction_rate: tuple[float, ...] = ()
  mean_ratio: tuple[float, ...] = ()
  lcb: tuple[float, ...] = ()
  records_matured: tuple[int, ...] = ()
  state_updates: tuple[int, ...] = ()
  mean_tv: tuple[float, ...] = ()
  candidate_hit_rate: tuple[float, ...] = ()
  resets: tuple[int, ...] = ()
  gain_mean: tuple[float, ...] = ()
  gain_n: tuple[int, ...] = ()

  def to_dict(self) -> dict:
    """Plain values for a JSON line."""
    return dataclasses.asdict(self)


def summarize(stats: ReflexStats | None, *, asleep: bool = False,
              sleep_left: int = 0) -> ReflexSummary:
  """Per-batch Reflex statistics as plain numbers (per head; empty without statistics)."""
  if not isinstance(stats, ReflexStats):
    return ReflexSummary(asleep=asleep, sleep_left=sleep_left)
  s = {f.name: np.asarray(getattr(stats, f.name), np.float64)
       for f in dataclasses.fields(stats) if getattr(stats, f.name) is not None}
  steps = np.maximum(s["row_head_steps"], 1)
  applied = s["applied"]
  lcb_n = np.maximum(s["lcb_n"], 1)
  mat = np.maximum(s["matured"], 1)
  fl = lambda x: tuple(float(v) for v in x)
  ints = lambda x: tuple(int(v) for v in x)
  return ReflexSummary(
      asleep=asleep, sleep_left=sleep_left, correction_rate=fl(applied / steps),
      mean_ratio=fl(s["ratio_sum"] / np.maximum(applied, 1)),
      lcb=fl(np.where(s["lcb_n"] > 0, s["lcb_sum"] / lcb_n, math.nan)),
      records_matured=ints(s["matured"]), state_updates=ints(s["updates"]),
      mean_tv=fl(s["tv_sum"] / mat), candidate_hit_rate=fl(s["hits"] / mat),
      resets=ints(s["resets"]), gain_mean=fl(s["gain_sum"] / np.maximum(s["gain_n"], 1)),
      gain_n=ints(s["gain_n"]))
