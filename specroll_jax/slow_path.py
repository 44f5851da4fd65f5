"""Slow path: a degradation monitor and a guarded refresh of the future-token heads, run between
rollout batches (docs/design.md, "Slow path").

The rollout loop calls :func:`after_batch` once per rollout batch with the batch's matured
prediction records (``specroll_jax.records``) and the per-head acceptance rates. It

1. merges the records into a bounded reservoir (``reservoir_size // K`` per head, recent first);
2. updates the monitor (:func:`monitor_update`). The first ``calibration_batches`` batches fix a
   robust baseline per head: median and MAD of the per-batch mean sparse TV, median acceptance.
   Then every ``check_every`` batches, each head with >= ``min_records`` records since its last
   check gets the robust z-score of its window's record-weighted TV,
   ``z = (TV - median) / max(mad_scale * MAD, min_scale)``; it is *degraded* when
   ``z > z_threshold`` and its window acceptance is >= ``acceptance_drop`` below the baseline. A
   head fires after ``patience`` consecutive degraded checks; at most ``max_heads`` firing heads
   (highest z) are refreshed, then no refresh fires for ``cooldown_batches`` batches. Modes
   ``scheduled``, ``every_batch`` and ``off`` replace this rule (see ``SlowPathConfig``);
3. refreshes the named heads (:func:`refresh`: one compiled program for every head selection and
   every reservoir content) with AdamW on ``0.7 sparse distillation + 0.3 token CE + 0.1 proximal
   KL`` (heads only, the target is frozen) on the training 90% of the reservoir, and keeps each
   head's update only when the held-out 10% confirm it (:func:`keep_rule`: CE <= 1.01 x before and
   TV lower); otherwise that head's parameters and optimiser state are restored bit for bit.

Extra dimensions: C reservoir records per head, S support ids per record, Kc candidates per record,
Cb calibration batches.
"""

from __future__ import annotations

import dataclasses
import math
import time

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int

from specroll_jax import head_kinds
from specroll_jax import heads as heads_lib
from specroll_jax import records as records_lib
from specroll_jax.heads import Heads
from specroll_jax.models import decoder as _dec
from specroll_jax.models.config import ModelConfig
from specroll_jax.records import Records
from specroll_jax.sampling import MASKED_LOGIT

MODES = ("degradation", "scheduled", "every_batch", "off")

# Why the monitor decided what it did (Decision.reason indexes this tuple).
REASONS = ("off", "calibrating", "waiting", "healthy", "too_few_records", "degraded", "cooldown",
           "sustained_degradation", "scheduled", "schedule_wait", "over_budget", "every_batch")
_R = {name: i for i, name in enumerate(REASONS)}


def _check_int(cfg, name: str, lo: int) -> None:
  v = getattr(cfg, name)
  if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < lo:
    raise ValueError(f"SlowPathConfig.{name} must be an int >= {lo}, got {v!r}")
  object.__setattr__(cfg, name, int(v))


def _check_float(cfg, name: str, lo: float, hi: float = math.inf, *, lo_open: bool = False) -> None:
  v = getattr(cfg, name)
  ok = isinstance(v, int | float | np.floating) and not isinstance(v, bool) and math.isfinite(v)
  if not ok or v > hi or v < lo or (lo_open and v == lo):
    lim = f"{'>' if lo_open else '>='} {lo}" + (f" and <= {hi}" if hi < math.inf else "")
    raise ValueError(f"SlowPathConfig.{name} must be a finite number {lim}, got {v!r}")
  object.__setattr__(cfg, name, float(v))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlowPathConfig:
  """Every window, threshold and optimiser setting of the slow path. Frozen and hashable: it is a
  static jit argument. Defaults follow docs/design.md, "Slow path"; ``for_tests`` has CPU-sized
  windows.

  mode: "degradation" (refresh after sustained degradation), "scheduled" (whenever
    ``scheduled_min_records`` records and ``scheduled_min_batches`` batches have passed since the
    last update and the refresh time so far fits in ``time_budget`` of the rollout time: one step
    on the head with the highest TV since the last update), "every_batch" (every head with
    records, every batch; FastGRPO-style) or "off".
  reservoir_size: records kept in total; each of the K heads gets ``reservoir_size // K``.
  holdout_fraction: share of reservoir slots held out of training (fixed, stratified slots) and used
    only to accept or reject a refresh.
  calibration_batches: batches whose per-batch TV and acceptance set each head's baseline.
  check_every: batches between two checks once calibrated.
  min_records: records a head needs since its last check to be checked (fewer: the window grows).
  mad_scale, min_scale: robust scale = max(mad_scale * MAD, min_scale).
  z_threshold, acceptance_drop: degraded when z > z_threshold and acceptance fell by at least
    acceptance_drop from the calibration median.
  patience: consecutive degraded checks before a head fires.
  max_heads: heads refreshed at most per firing (the highest z).
  cooldown_batches: batches after a refresh during which no other refresh fires ("degradation").
  scheduled_min_records, scheduled_min_batches, scheduled_steps, time_budget: mode "scheduled"
    (records summed over heads; budget = cumulative refresh seconds (excluding compilation) plus the
    last refresh's cost, over cumulative rollout seconds).
  refresh_steps: optimiser steps per refresh ("degradation", "every_batch"); each step is a full
    batch over the head's training records.
  distill_weight, token_weight, proximal_weight: loss = distill * CE(p on S + tail bucket) +
    token * CE(committed token) + proximal * KL(pre-refresh head || head) on S + tail bucket.
  learning_rate, b1, b2, eps, weight_decay, clip_norm: optax AdamW after clipping each head's
    gradient to global norm ``clip_norm``; every head has its own optimiser state (and step count).
    Weight decay applies to the heads' W and b, not to their norm scales.
  keep_ce_ratio: a refreshed head is kept when held-out CE <= keep_ce_ratio * before and held-out
    TV went down (``guard``); with ``guard=False`` every refresh is kept.
  temperature: the rollout's sampling temperature (the records' p are at it); 0 (greedy) trains
    the heads' logits at temperature 1.
  use_correction: train the heads with the Reflex correction recorded with each record added to
    their output (False: the raw heads learn to match the target on their own).
  chunk_size: records per head processed together; bounds the [K, chunk, V] logits in memory.
  """

  mode: str = "degradation"
  reservoir_size: int = 4096
  holdout_fraction: float = 0.1
  calibration_batches: int = 20
  check_every: int = 20
  min_records: int = 1024
  mad_scale: float = 1.4826
  min_scale: float = 0.01
  z_threshold: float = 2.5
  acceptance_drop: float = 0.05
  patience: int = 2
  max_heads: int = 2
  cooldown_batches: int = 50
  scheduled_min_records: int = 256
  scheduled_min_batches: int = 8
  scheduled_steps: int = 1
  time_budget: float = 0.015
  refresh_steps: int = 2
  distill_weight: float = 0.7
  token_weight: float = 0.3
  proximal_weight: float = 0.1
  learning_rate: float = 1e-5
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-6
  weight_decay: float = 0.01
  clip_norm: float = 1.0
  keep_ce_ratio: float = 1.01
  guard: bool = True
  temperature: float = 1.0
  use_correction: bool = False
  chunk_size: int = 256

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"SlowPathConfig.mode must be one of {MODES}, got {self.mode!r}")
    _check_int(self, "reservoir_size", 2)
    _check_float(self, "holdout_fraction", 0.0, 0.5, lo_open=True)
    for name in ("calibration_batches", "check_every", "patience", "max_heads",
                 "scheduled_min_batches", "scheduled_steps", "refresh_steps", "chunk_size"):
      _check_int(self, name, 1)
    for name in ("min_records", "cooldown_batches", "scheduled_min_records"):
      _check_int(self, name, 0)
    _check_float(self, "mad_scale", 0.0, lo_open=True)
    _check_float(self, "min_scale", 0.0, lo_open=True)
    _check_float(self, "z_threshold", -math.inf)
    _check_float(self, "acceptance_drop", -1.0, 1.0)
    _check_float(self, "time_budget", 0.0)
    for name in ("distill_weight", "token_weight", "proximal_weight", "weight_decay",
                 "temperature"):
      _check_float(self, name, 0.0)
    if self.distill_weight + self.token_weight == 0:
      raise ValueError("SlowPathConfig.distill_weight + token_weight must be > 0, got 0")
    _check_float(self, "learning_rate", 0.0, lo_open=True)
    _check_float(self, "b1", 0.0, 1.0)
    _check_float(self, "b2", 0.0, 1.0)
    _check_float(self, "eps", 0.0, lo_open=True)
    _check_float(self, "clip_norm", 0.0, lo_open=True)
    _check_float(self, "keep_ce_ratio", 0.0, lo_open=True)
    for name in ("guard", "use_correction"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"SlowPathConfig.{name} must be a bool, got {getattr(self, name)!r}")

  def replace(self, **kw) -> SlowPathConfig:
    return dataclasses.replace(self, **kw)

  @classmethod
  def for_tests(cls, **kw) -> SlowPathConfig:
    """Short windows and a small reservoir for CPU tests (everything else: the defaults)."""
    base = dict(reservoir_size=384, calibration_batches=8, check_every=2, min_records=16,
                cooldown_batches=6, scheduled_min_records=32, scheduled_min_batches=3,
                chunk_size=64)
    base.update(kw)
    return cls(**base)

  def per_head(self, num_heads: int) -> int:
    """Reservoir records per head (C)."""
    return self.reservoir_size // num_heads

  def refresh_settings(self) -> SlowPathConfig:
    """This config with every field the refresh does not read at its default, so that configs
    differing only in mode, windows or thresholds share one compiled refresh program."""
    return SlowPathConfig(**{f: getattr(self, f) for f in _REFRESH_FIELDS})


# The fields ``refresh`` reads (everything else is the monitor's).
_REFRESH_FIELDS = ("holdout_fraction", "distill_weight", "token_weight", "proximal_weight",
                   "learning_rate", "b1", "b2", "eps", "weight_decay", "clip_norm",
                   "keep_ce_ratio", "guard", "temperature", "use_correction", "chunk_size")


# ---------------------------------------------------------------------------------------------
# State


@flax.struct.dataclass
class MonitorState:
  batches: Int[Array, ""]  # rollout batches observed
  calib_tv: Float[Array, "Cb K"]  # per-batch mean TV while calibrating (NaN: no records)
  calib_acc: Float[Array, "Cb K"]  # per-batch acceptance while calibrating (NaN: unknown)
  tv_median: Float[Array, " K"]  # calibration median of the per-batch TV (NaN until calibrated)
  tv_mad: Float[Array, " K"]  # its median absolute deviation
  acc_baseline: Float[Array, " K"]  # calibration median acceptance
  window_tv: Float[Array, " K"]  # sum of records * TV since the head's last check
  window_n: Float[Array, " K"]  # records since the head's last check
  window_acc: Float[Array, " K"]  # sum of acceptance over batches since the head's last check
  window_acc_n: Float[Array, " K"]  # batches with a known acceptance in that window
  consecutive: Int[Array, " K"]  # consecutive degraded checks
  z: Float[Array, " K"]  # the head's last robust z (NaN: never checked)
  cooldown: Int[Array, ""]  # batches left before another refresh may fire
  last_update: Int[Array, ""]  # value of ``batches`` at the last refresh decision (0: none)
  since_tv: Float[Array, " K"]  # sum of records * TV since the last refresh decision
  since_n: Float[Array, " K"]  # records since the last refresh decision
  rollout_seconds: Float[Array, ""]  # cumulative rollout wall-clock
  refresh_seconds: Float[Array, ""]  # cumulative refresh wall-clock (compilation excluded)
  last_refresh_seconds: Float[Array, ""]  # the latest refresh's wall-clock


@flax.struct.dataclass
class SlowPathState:
  """Everything the slow path carries across rollout batches; arrays only (orbax-saveable)."""

  reservoir: Records  # leaves [K, C, ...]
  monitor: MonitorState
  opt_state: optax.OptState  # per-head optax AdamW state: every leaf has a leading K axis
  tried: Int[Array, " K"]  # refreshes attempted per head
  kept: Int[Array, " K"]  # ... kept (held-out check passed)
  rolled_back: Int[Array, " K"]  # ... rolled back (parameters and optimiser state restored)


@flax.struct.dataclass
class Decision:
  refresh: Bool[Array, " K"]  # heads to refresh now
  steps: Int[Array, ""]  # optimiser steps for this refresh
  reason: Int[Array, ""]  # index into REASONS
  checked: Bool[Array, " K"]  # heads checked this batch
  degraded: Bool[Array, " K"]  # heads found degraded this batch
  z: Float[Array, " K"]  # the monitor's latest z per head


@flax.struct.dataclass
class Evaluation:
  ce: Float[Array, " K"]  # sparse distillation CE (p on S + tail bucket); NaN: no records
  tv: Float[Array, " K"]  # sparse TV between the target and the head renormalised on S
  token_ce: Float[Array, " K"]  # CE of the committed token (full vocabulary)
  n: Float[Array, " K"]  # records evaluated


@flax.struct.dataclass
class RefreshResult:
  trained: Bool[Array, " K"]  # selected heads that had training records
  keep: Bool[Array, " K"]  # trained heads whose update was kept
  before: Evaluation  # held-out, before the refresh
  after: Evaluation  # held-out, after the refresh (of the trained parameters, kept or not)
  loss: Float[Array, " K"]  # training loss per head at the first step
  n_train: Float[Array, " K"]


def optimizer(cfg: SlowPathConfig) -> optax.GradientTransformation:
  """The per-head AdamW (applied to one head's parameters; ``init`` vmaps it over K). Gradients are
  clipped to global norm ``cfg.clip_norm`` per head before it (a stateless step kept out of the
  chain: orbax cannot save a state tree that starts with an empty node)."""
  def decay_mask(p):  # decay the weight matrices and biases, not the norm scales
    if head_kinds.is_conditioned(p):
      return p.replace(norm_h=False, norm_e=False, w_h=True, w_e=True, b=True, w_o=True)
    return p.replace(norm=False, w=True, b=True)

  return optax.adamw(cfg.learning_rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                     weight_decay=cfg.weight_decay, mask=decay_mask)


def monitor_init(cfg: SlowPathConfig, num_heads: int) -> MonitorState:
  k, f32 = num_heads, jnp.float32
  zeros, nan = jnp.zeros((k,), f32), jnp.full((k,), jnp.nan, f32)
  calib = jnp.full((cfg.calibration_batches, k), jnp.nan, f32)
  scalar = lambda dt: jnp.zeros((), dt)
  return MonitorState(
      batches=scalar(jnp.int32), calib_tv=calib, calib_acc=calib, tv_median=nan, tv_mad=nan,
      acc_baseline=nan, window_tv=zeros, window_n=zeros, window_acc=zeros, window_acc_n=zeros,
      consecutive=jnp.zeros((k,), jnp.int32), z=nan, cooldown=scalar(jnp.int32),
      last_update=scalar(jnp.int32), since_tv=zeros, since_n=zeros, rollout_seconds=scalar(f32),
      refresh_seconds=scalar(f32), last_refresh_seconds=scalar(f32))


def init(cfg: SlowPathConfig, heads: Heads, *, support_size: int,
         num_candidates: int) -> SlowPathState:
  """A fresh state for ``heads``: empty reservoir of ``cfg.per_head(K)`` records per head with
  ``support_size`` support ids and ``num_candidates`` candidates each (the record producer's
  shapes), an uncalibrated monitor, a per-head AdamW state, zero counters."""
  if not isinstance(cfg, SlowPathConfig):
    raise ValueError(f"cfg must be a SlowPathConfig, got {type(cfg).__name__}")
  if not isinstance(heads, head_kinds.KINDS):
    raise ValueError(f"heads must be heads.Heads or cond_heads.CondHeads, got "
                     f"{type(heads).__name__}")
  for name, v in (("support_size", support_size), ("num_candidates", num_candidates)):
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
      raise ValueError(f"{name} must be an int >= 1, got {v!r}")
  k = heads.num_heads
  c = cfg.per_head(k)
  need = math.ceil(1 / cfg.holdout_fraction) + 1
  if c < need:
    raise ValueError(
        f"SlowPathConfig.reservoir_size={cfg.reservoir_size} gives {c} records per head for {k} "
        f"heads; holdout_fraction={cfg.holdout_fraction} needs at least {need} per head "
        f"(reservoir_size >= {need * k})")
  reservoir = records_lib.empty(k, c, heads.hidden_size, int(support_size), int(num_candidates),
                                path=k if head_kinds.is_conditioned(heads) else 0)
  ints = jnp.zeros((k,), jnp.int32)
  return SlowPathState(reservoir=reservoir, monitor=monitor_init(cfg, k),
                       opt_state=jax.vmap(optimizer(cfg).init)(heads), tried=ints, kept=ints,
                       rolled_back=ints)


# ---------------------------------------------------------------------------------------------
# Monitor


def batch_stats(batch: Records) -> tuple[Float[Array, " K"], Float[Array, " K"]]:
  """(mean TV of the batch buffer's valid records [K] (NaN: none), records matured [K]). The
  count is ``batch.count``: a per-batch ring that wrapped still counts every matured record."""
  v = batch.valid.astype(jnp.float32)
  n_valid = v.sum(1)
  tv = jnp.where(n_valid > 0, (batch.tv * v).sum(1) / jnp.maximum(n_valid, 1), jnp.nan)
  return tv, batch.count.astype(jnp.float32)


def monitor_update(cfg: SlowPathConfig, m: MonitorState, tv: Float[Array, " K"],
                   acceptance: Float[Array, " K"], records: Float[Array, " K"],
                   rollout_seconds: Float[Array, ""]) -> tuple[MonitorState, Decision]:
  """One rollout batch: per head its mean sparse TV, acceptance rate (NaN: unknown) and number of
  matured records. Pure (``cfg`` static); returns the new monitor and the decision."""
  f32 = jnp.float32
  k = tv.shape[0]
  n = jnp.where(jnp.isfinite(tv), records.astype(f32), 0.0)
  tv0 = jnp.where(n > 0, tv, 0.0)
  acc_known = jnp.isfinite(acceptance)
  acc0 = jnp.where(acc_known, acceptance, 0.0)
  nb = cfg.calibration_batches
  b = m.batches + 1  # batches observed, this one included
  calibrating = b <= nb
  row = jnp.minimum(b - 1, nb - 1)
  calib_tv = jnp.where(calibrating, m.calib_tv.at[row].set(jnp.where(n > 0, tv, jnp.nan)),
                       m.calib_tv)
  calib_acc = jnp.where(calibrating,
                        m.calib_acc.at[row].set(jnp.where(acc_known, acceptance, jnp.nan)),
                        m.calib_acc)
  med = jnp.nanmedian(calib_tv, axis=0)
  mad = jnp.nanmedian(jnp.abs(calib_tv - med), axis=0)
  done = b == nb
  tv_median = jnp.where(done, med, m.tv_median)
  tv_mad = jnp.where(done, mad, m.tv_mad)
  acc_baseline = jnp.where(done, jnp.nanmedian(calib_acc, axis=0), m.acc_baseline)

  post = ~calibrating
  window_tv = m.window_tv + jnp.where(post, tv0 * n, 0.0)
  window_n = m.window_n + jnp.where(post, n, 0.0)
  window_acc = m.window_acc + jnp.where(post, acc0, 0.0)
  window_acc_n = m.window_acc_n + jnp.where(post & acc_known, 1.0, 0.0)
  is_check = post & ((b - nb) % cfg.check_every == 0)
  checked = is_check & (window_n >= max(cfg.min_records, 1))
  scale = jnp.maximum(cfg.mad_scale * tv_mad, cfg.min_scale)
  z_now = (window_tv / jnp.maximum(window_n, 1.0) - tv_median) / scale
  acc_now = jnp.where(window_acc_n > 0, window_acc / jnp.maximum(window_acc_n, 1.0), jnp.nan)
  degraded = checked & (z_now > cfg.z_threshold) & (acc_baseline - acc_now >= cfg.acceptance_drop)
  consecutive = jnp.where(checked, jnp.where(degraded, m.consecutive + 1, 0), m.consecutive)
  z = jnp.where(checked, z_now, m.z)
  reset = lambda x: jnp.where(checked, 0.0, x)
  since_tv, since_n = m.since_tv + tv0 * n, m.since_n + n
  cooldown = jnp.maximum(m.cooldown - 1, 0)
  rollout_total = m.rollout_seconds + jnp.asarray(rollout_seconds, f32)

  no = jnp.zeros((k,), bool)
  steps = cfg.refresh_steps
  if cfg.mode == "off":
    refresh, reason = no, jnp.int32(_R["off"])
  elif cfg.mode == "every_batch":
    refresh, reason = ~no, jnp.int32(_R["every_batch"])
  elif cfg.mode == "scheduled":
    steps = cfg.scheduled_steps
    due = (since_n.sum() >= cfg.scheduled_min_records) & (
        b - m.last_update >= cfg.scheduled_min_batches) & (since_n.sum() > 0)
    in_budget = (m.refresh_seconds + m.last_refresh_seconds
                 <= cfg.time_budget * rollout_total)
    fire = due & in_budget
    worst = jnp.argmax(jnp.where(since_n > 0, since_tv / jnp.maximum(since_n, 1.0), -jnp.inf))
    refresh = (jnp.arange(k) == worst) & fire
    reason = jnp.where(fire, _R["scheduled"],
                       jnp.where(due, _R["over_budget"], _R["schedule_wait"])).astype(jnp.int32)
  else:
    firing = degraded & (consecutive >= cfg.patience)
    can = cooldown == 0
    score = jnp.where(firing, z_now, -jnp.inf)
    rank = jnp.zeros((k,), jnp.int32).at[jnp.argsort(-score)].set(jnp.arange(k, dtype=jnp.int32))
    refresh = firing & (rank < cfg.max_heads) & can
    reason = jnp.select(
        [calibrating, ~is_check, firing.any() & can, firing.any(), degraded.any(), checked.any()],
        [_R["calibrating"], _R["waiting"], _R["sustained_degradation"], _R["cooldown"],
         _R["degraded"], _R["healthy"]], _R["too_few_records"]).astype(jnp.int32)
    consecutive = jnp.where(refresh, 0, consecutive)
    cooldown = jnp.where(refresh.any(), cfg.cooldown_batches, cooldown)

  fired = refresh.any()
  monitor = MonitorState(
      batches=b, calib_tv=calib_tv, calib_acc=calib_acc, tv_median=tv_median, tv_mad=tv_mad,
      acc_baseline=acc_baseline, window_tv=reset(window_tv), window_n=reset(window_n),
      window_acc=reset(window_acc), window_acc_n=reset(window_acc_n), consecutive=consecutive,
      z=z, cooldown=cooldown.astype(jnp.int32),
      last_update=jnp.where(fired, b, m.last_update).astype(jnp.int32),
      since_tv=jnp.where(fired, 0.0, since_tv), since_n=jnp.where(fired, 0.0, since_n),
      rollout_seconds=rollout_total, refresh_seconds=m.refresh_seconds,
      last_refresh_seconds=m.last_refresh_seconds)
  return monitor, Decision(refresh=refresh, steps=jnp.int32(steps), reason=reason,
                           checked=checked, degraded=degraded, z=z)


# ---------------------------------------------------------------------------------------------
# Refresh


def holdout_slots(cfg: SlowPathConfig, capacity: int) -> np.ndarray:
  """[C] bool: the reservoir slots held out of training (every 1/holdout_fraction-th slot; ring
  slots hold consecutive records, so the held-out set is a stratified sample over time)."""
  j = np.arange(capacity)
  return np.floor((j + 1) * cfg.holdout_fraction) > np.floor(j * cfg.holdout_fraction)


def _chunks(cfg: SlowPathConfig, capacity: int) -> tuple[np.ndarray, np.ndarray]:
  cs = min(cfg.chunk_size, capacity)
  nc = -(-capacity // cs)
  idx = np.arange(nc * cs).reshape(nc, cs)
  return np.minimum(idx, capacity - 1), idx < capacity


def _log_probs(cfg, model_config, params, heads, rec: Records):
  """Head log-probs on a chunk (leaves [K, c, ...]): on the support [K, c, S] (0 where unused),
  of the tail bucket (everything off the support) [K, c], of the committed token [K, c].
  Root-conditioned heads read each record's path (``rec.path``)."""
  if head_kinds.is_conditioned(heads):
    z = jnp.stack([head_kinds.output_states(model_config, params, heads, i, rec.hidden[i],
                                            rec.path[i]) for i in range(heads.num_heads)])
  else:
    one = lambda hd, h: heads_lib.head_states(
        model_config, hd.replace(norm=hd.norm[None], w=hd.w[None], b=hd.b[None]), h)[..., 0, :]
    z = jax.vmap(one)(heads, rec.hidden)  # [K, c, D]
  if cfg.use_correction:
    z = z + rec.correction.astype(z.dtype)
  inv_t = 1.0 / cfg.temperature if cfg.temperature > 0 else 1.0
  logits = _dec.logits_from_hidden(model_config, params, z) * inv_t  # [K, c, V] f32
  v = logits.shape[-1]
  lse = jax.nn.logsumexp(logits, axis=-1)
  used = rec.support >= 0
  lq_s = jnp.take_along_axis(logits, jnp.where(used, rec.support, 0), -1) - lse[..., None]
  kk, cc = np.ix_(np.arange(logits.shape[0]), np.arange(logits.shape[1]))
  on_s = jnp.zeros(logits.shape, bool).at[kk[..., None], cc[..., None],
                                          jnp.where(used, rec.support, v)].set(True, mode="drop")
  lse_tail = jax.nn.logsumexp(jnp.where(on_s, MASKED_LOGIT, logits), axis=-1)
  lq_tail = jnp.maximum(lse_tail - lse, -100.0)
  tok = jnp.take_along_axis(logits, jnp.maximum(rec.token, 0)[..., None], -1)[..., 0] - lse
  return jnp.where(used, lq_s, 0.0), lq_tail, tok


def _terms(rec: Records, lq_s, lq_tail, lq_tok):
  """Per record [K, c]: sparse distillation CE, sparse TV, token CE."""
  used = rec.support >= 0
  p_s = jnp.where(used, rec.p, 0.0) * (1.0 - rec.p_tail)[..., None]
  ce = -(p_s * lq_s).sum(-1) - rec.p_tail * lq_tail
  q = jnp.where(used, jnp.exp(lq_s - jax.nn.logsumexp(jnp.where(used, lq_s, -jnp.inf), -1,
                                                      keepdims=True)), 0.0)
  tv = 0.5 * jnp.abs(jnp.where(used, rec.p, 0.0) - q).sum(-1)
  return ce, tv, -lq_tok


def _take(rec: Records, idx) -> Records:
  return jax.tree.map(lambda x: jnp.take(x, idx, axis=1) if x.ndim >= 2 else x, rec)


def _forward(cfg, model_config, params, heads: Heads, reservoir: Records, select, keep_terms):
  """Chunked forward of all heads over the reservoir: the Evaluation over ``select`` (and valid)
  and, with ``keep_terms``, the log-probs on the support and tail per chunk ([nc, K, cs, ...])."""
  idx, inside = _chunks(cfg, reservoir.capacity)

  def body(acc, xs):
    i, ok = xs
    rec = _take(reservoir, i)
    w = (jnp.take(select, i, axis=1) & rec.valid & ok).astype(jnp.float32)
    lq_s, lq_tail, lq_tok = _log_probs(cfg, model_config, params, heads, rec)
    ce, tv, tok = _terms(rec, lq_s, lq_tail, lq_tok)
    acc = jax.tree.map(jnp.add, acc, ((ce * w).sum(1), (tv * w).sum(1), (tok * w).sum(1),
                                      w.sum(1)))
    return acc, ((lq_s, lq_tail) if keep_terms else None)

  zeros = jnp.zeros((reservoir.num_heads,), jnp.float32)
  (ce, tv, tok, n), terms = jax.lax.scan(body, (zeros,) * 4, (jnp.asarray(idx),
                                                               jnp.asarray(inside)))
  mean = lambda s: jnp.where(n > 0, s / jnp.maximum(n, 1.0), jnp.nan)
  return Evaluation(ce=mean(ce), tv=mean(tv), token_ce=mean(tok), n=n), terms


def evaluate(cfg: SlowPathConfig, model_config: ModelConfig, params, heads: Heads,
             reservoir: Records, select: Bool[Array, "K C"]) -> Evaluation:
  """Mean sparse CE, sparse TV and token CE per head over the records where ``select`` and valid
  (NaN for a head without such records)."""
  return _forward(cfg, model_config, params, heads, reservoir, select, False)[0]


def keep_rule(cfg: SlowPathConfig, trained: Bool[Array, " K"], before: Evaluation,
              after: Evaluation) -> Bool[Array, " K"]:
  """Keep a trained head when held-out CE <= keep_ce_ratio x before and held-out TV went down
  (every trained head when ``cfg.guard`` is off). NaN (no held-out records) rolls back."""
  if not cfg.guard:
    return trained
  return trained & (after.ce <= cfg.keep_ce_ratio * before.ce) & (after.tv < before.tv)


def _select(mask: Bool[Array, " K"], new, old):
  """Per head (leading K axis of every leaf): ``new`` where mask, else ``old`` bit for bit."""
  return jax.tree.map(lambda a, b: jnp.where(mask.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
                      new, old)


def refresh(cfg: SlowPathConfig, model_config: ModelConfig, params, heads: Heads,
            opt_state: optax.OptState, reservoir: Records, mask: Bool[Array, " K"],
            num_steps: Int[Array, ""]) -> tuple[Heads, optax.OptState, RefreshResult]:
  """Train the heads in ``mask`` for ``num_steps`` full-batch AdamW steps on the reservoir's
  training records, then keep or roll back each one by :func:`keep_rule` on the held-out records.

  ``cfg`` and ``model_config`` are static (``cfg.refresh_settings()`` gives the same result with
  fewer distinct programs); ``mask`` and ``num_steps`` are traced, so one compiled
  program serves every head selection, step count and reservoir content (shapes are fixed by the
  reservoir capacity). All K heads are evaluated (the selection is a mask). Heads outside ``mask``,
  and rolled-back heads, come back with their input parameters and optimiser state bit for bit.
  The target ``params`` are only read (final norm and unembedding).
  """
  tx, clip = optimizer(cfg), optax.clip_by_global_norm(cfg.clip_norm)
  c = reservoir.capacity
  held = jnp.asarray(holdout_slots(cfg, c))[None] & reservoir.valid  # [K, C]
  train = ~held & reservoir.valid
  n_train = train.sum(1).astype(jnp.float32)
  trained = mask & (n_train > 0)
  # held-out evaluation before, and the pre-refresh head on every record (proximal term)
  before, old = _forward(cfg, model_config, params, heads, reservoir, held, True)
  idx, inside = _chunks(cfg, c)
  xs = (jnp.asarray(idx), jnp.asarray(inside))
  weight = jnp.where(trained, 1.0 / jnp.maximum(n_train, 1.0), 0.0)  # [K]

  def chunk_loss(hd, rec, w, lo_s, lo_tail):
    lq_s, lq_tail, lq_tok = _log_probs(cfg, model_config, params, hd, rec)
    ce, _, tok = _terms(rec, lq_s, lq_tail, lq_tok)
    used = rec.support >= 0
    kl = (jnp.where(used, jnp.exp(lo_s) * (lo_s - lq_s), 0.0).sum(-1)
          + jnp.exp(lo_tail) * (lo_tail - lq_tail))
    per = cfg.distill_weight * ce + cfg.token_weight * tok + cfg.proximal_weight * kl
    per_head = (per * w).sum(1) * weight  # [K]
    return per_head.sum(), per_head

  def grads(hd):
    def body(acc, x):
      i, ok, lo_s, lo_tail = x
      rec = _take(reservoir, i)
      w = (jnp.take(train, i, axis=1) & ok).astype(jnp.float32)
      (_, per_head), g = jax.value_and_grad(chunk_loss, has_aux=True)(hd, rec, w, lo_s, lo_tail)
      return jax.tree.map(jnp.add, acc, (g, per_head)), None

    zero = (jax.tree.map(jnp.zeros_like, hd), jnp.zeros((hd.num_heads,), jnp.float32))
    return jax.lax.scan(body, zero, xs + old)[0]

  def step(i, carry):
    hd, opt, first_loss = carry
    g, loss = grads(hd)
    g = jax.vmap(lambda x: clip.update(x, optax.EmptyState())[0])(g)
    upd, new_opt = jax.vmap(tx.update)(g, opt, hd)
    new_hd = optax.apply_updates(hd, upd)
    first_loss = jnp.where(i == 0, loss, first_loss)
    return _select(trained, new_hd, hd), _select(trained, new_opt, opt), first_loss

  nan = jnp.full((heads.num_heads,), jnp.nan, jnp.float32)
  new_heads, new_opt, loss = jax.lax.fori_loop(0, num_steps, step, (heads, opt_state, nan))
  after = evaluate(cfg, model_config, params, new_heads, reservoir, held)
  keep = keep_rule(cfg, trained, before, after)
  return (_select(keep, new_heads, heads), _select(keep, new_opt, opt_state),
          RefreshResult(trained=trained, keep=keep, before=before, after=after,
                        loss=jnp.where(trained, loss, jnp.nan), n_train=n_train))


refresh_jit = jax.jit(refresh, static_argnums=(0, 1))

# Compiled refresh programs, keyed by static arguments and argument signature, so that
# ``after_batch`` can time compilation apart from the run (see ``refresh_compiles``).
_COMPILED: dict = {}


def refresh_compiles() -> int:
  """How many refresh programs :func:`after_batch` has compiled in this process."""
  return len(_COMPILED)


def _compiled_refresh(cfg, model_config, args) -> tuple[object, float]:
  leaves, treedef = jax.tree.flatten(args)
  key = (cfg, model_config, treedef, tuple(
      (x.shape, x.dtype, getattr(x, "sharding", None), getattr(x, "weak_type", False))
      for x in leaves))
  if key in _COMPILED:
    return _COMPILED[key], 0.0
  t0 = time.perf_counter()
  _COMPILED[key] = refresh_jit.lower(cfg, model_config, *args).compile()
  return _COMPILED[key], time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# Host entry


def _observe(cfg, state: SlowPathState, batch: Records, acceptance, rollout_seconds):
  tv, n = batch_stats(batch)
  reservoir = records_lib.merge(state.reservoir, batch)
  monitor, decision = monitor_update(cfg, state.monitor, tv, acceptance, n, rollout_seconds)
  return state.replace(reservoir=reservoir, monitor=monitor), decision, tv, n


_observe_jit = jax.jit(_observe, static_argnums=0)


def _commit(state: SlowPathState, res: RefreshResult, seconds):
  m = state.monitor
  seconds = jnp.asarray(seconds, jnp.float32)
  i32 = lambda x: x.astype(jnp.int32)
  return state.replace(
      tried=state.tried + i32(res.trained), kept=state.kept + i32(res.keep),
      rolled_back=state.rolled_back + i32(res.trained & ~res.keep),
      monitor=m.replace(refresh_seconds=m.refresh_seconds + seconds, last_refresh_seconds=seconds))


_commit_jit = jax.jit(_commit)


def _check_inputs(cfg, state, model_config, heads, batch, acceptance, rollout_seconds):
  if not isinstance(cfg, SlowPathConfig):
    raise ValueError(f"cfg must be a SlowPathConfig, got {type(cfg).__name__}")
  if not isinstance(state, SlowPathState):
    raise ValueError(f"state must be a SlowPathState (slow_path.init), got {type(state).__name__}")
  head_kinds.validate(model_config, heads, state.reservoir.num_heads)
  if state.monitor.calib_tv.shape[0] != cfg.calibration_batches:
    raise ValueError(
        f"state was made for calibration_batches={state.monitor.calib_tv.shape[0]}, but "
        f"cfg.calibration_batches={cfg.calibration_batches}")
  if state.reservoir.capacity != cfg.per_head(heads.num_heads):
    raise ValueError(
        f"state's reservoir holds {state.reservoir.capacity} records per head, but "
        f"cfg.reservoir_size={cfg.reservoir_size} gives {cfg.per_head(heads.num_heads)}")
  if not isinstance(batch, Records):
    raise ValueError(f"batch_records must be a specroll_jax.records.Records, got "
                     f"{type(batch).__name__}")
  r = state.reservoir
  for name in ("hidden", "support", "candidates"):
    want, got = getattr(r, name).shape, getattr(batch, name).shape
    if got[0] != want[0] or got[2:] != want[2:]:
      raise ValueError(
          f"batch_records.{name} has shape {got}; the reservoir needs [K={want[0]}, any, "
          f"{', '.join(map(str, want[2:]))}]")
  acc = np.asarray(acceptance, np.float32)
  if acc.shape != (heads.num_heads,):
    raise ValueError(f"head_acceptance must have shape ({heads.num_heads},), got {acc.shape}")
  finite = acc[np.isfinite(acc)]
  if np.isinf(acc).any() or ((finite < 0) | (finite > 1)).any():
    raise ValueError(f"head_acceptance must lie in [0, 1] (NaN: unknown), got {acc.tolist()}")
  s = float(rollout_seconds)
  if not math.isfinite(s) or s < 0:
    raise ValueError(f"rollout_seconds must be a finite number >= 0, got {rollout_seconds!r}")
  return acc, np.float32(s)


def after_batch(cfg: SlowPathConfig, state: SlowPathState, model_config: ModelConfig, params,
                heads: Heads, batch_records: Records, head_acceptance: Float[Array, " K"],
                rollout_seconds: float) -> tuple[SlowPathState, Heads, dict]:
  """The rollout loop's call between two batches: merge the batch's records (its own buffer, a
  fresh ``records.empty`` per batch) into the reservoir, update the monitor, and refresh the heads
  the decision names. Returns (state, heads, report); ``report`` holds plain Python values:
  batch, mode, decision (a REASONS name), per-head z / batch TV / acceptance / records, the heads
  refreshed, kept and rolled back, their held-out CE and TV before and after, refresh_seconds
  (wall-clock of the run) and compile_seconds (when this call compiled the refresh program).
  Nothing is donated: the input state and heads stay valid.

  Typical loop (``records`` [K, *, ...] and ``acceptance`` [K] are what the rollout's proposer
  collected for this batch)::

    state = slow_path.init(cfg, heads, support_size=S, num_candidates=Kc)
    for prompts in batches:
      t0 = time.perf_counter()
      records, acceptance = ...  # rollout of ``prompts`` with ``heads``
      state, heads, report = slow_path.after_batch(cfg, state, model_config, params, heads,
                                                   records, acceptance, time.perf_counter() - t0)
  """
  acc, secs = _check_inputs(cfg, state, model_config, heads, batch_records, head_acceptance,
                            rollout_seconds)
  state, decision, tv, n = _observe_jit(cfg, state, batch_records, jnp.asarray(acc), secs)
  d, tv, n = jax.device_get((decision, tv, n))
  fl = lambda x: [float(v) for v in np.asarray(x)]
  report = {"batch": int(jax.device_get(state.monitor.batches)), "mode": cfg.mode,
            "decision": REASONS[int(d.reason)], "steps": int(d.steps) if d.refresh.any() else 0,
            "z": fl(d.z), "tv": fl(tv),
            "acceptance": fl(acc), "records": [int(v) for v in n], "heads": [], "kept": [],
            "rolled_back": [], "ce_before": [], "ce_after": [], "tv_before": [], "tv_after": [],
            "refresh_seconds": 0.0, "compile_seconds": 0.0}
  if not d.refresh.any():
    return state, heads, report
  args = (params, heads, state.opt_state, state.reservoir, jnp.asarray(d.refresh),
          jnp.asarray(d.steps, jnp.int32))
  compiled, compile_s = _compiled_refresh(cfg.refresh_settings(), model_config, args)
  t0 = time.perf_counter()
  new_heads, opt_state, res = jax.block_until_ready(compiled(*args))
  seconds = time.perf_counter() - t0
  state = _commit_jit(state.replace(opt_state=opt_state), res, np.float32(seconds))
  r = jax.device_get(res)
  ks = [int(k) for k in np.flatnonzero(r.trained)]
  report.update(
      heads=ks, kept=[k for k in ks if r.keep[k]], rolled_back=[k for k in ks if not r.keep[k]],
      ce_before=[float(r.before.ce[k]) for k in ks], ce_after=[float(r.after.ce[k]) for k in ks],
      tv_before=[float(r.before.tv[k]) for k in ks], tv_after=[float(r.after.tv[k]) for k in ks],
      refresh_seconds=seconds, compile_seconds=compile_s)
  return state, new_heads, report


__all__ = ["MODES", "REASONS", "Decision", "Evaluation", "MonitorState", "RefreshResult",
           "SlowPathConfig", "SlowPathState", "after_batch", "batch_stats", "evaluate",
           "holdout_slots", "init", "keep_rule", "monitor_init", "monitor_update", "optimizer",
           "refresh", "refresh_compiles", "refresh_jit"]
