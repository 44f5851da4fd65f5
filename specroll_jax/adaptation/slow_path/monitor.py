"""The degradation monitor: robust per-head baselines, windows of record-weighted sparse TV and
acceptance, and the decision whether (and which heads) to refresh (docs/design.md, "Slow path")."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from specroll_jax.adaptation import records as records_lib
from specroll_jax.adaptation.records import Records
from specroll_jax.adaptation.slow_path.config import _R, SlowPathConfig
from specroll_jax.adaptation.slow_path.state import Decision, MonitorState


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
      refresh_seconds=scalar(f32), last_refresh_seconds=scalar(f32),
      last_refresh_steps=scalar(jnp.int32),
      learning=jnp.int32(1 if cfg.bootstrap_batches > 0 and cfg.mode != "off" else 0),
      learn_refreshes=scalar(jnp.int32), learn_end=scalar(jnp.int32),
      verdict_steps=scalar(jnp.int32), verdict_keep=jnp.ones((), f32),
      phases=jnp.int32(1 if cfg.bootstrap_batches > 0 and cfg.mode != "off" else 0))



def batch_stats(batch: Records, signal: str = "tv"
                ) -> tuple[Float[Array, " K"], Float[Array, " K"]]:
  """(mean of the monitor's per-record statistic over the batch buffer's valid records [K] (NaN:
  none): the sparse TV, or with ``signal="regret"`` ``records.regret``; records matured [K]). The
  count is ``batch.count``: a per-batch ring that wrapped still counts every matured record."""
  v = batch.valid.astype(jnp.float32)
  n_valid = v.sum(1)
  x = batch.tv if signal == "tv" else records_lib.regret(batch)
  stat = jnp.where(n_valid > 0, (x * v).sum(1) / jnp.maximum(n_valid, 1), jnp.nan)
  return stat, batch.count.astype(jnp.float32)


def monitor_update(cfg: SlowPathConfig, m: MonitorState, tv: Float[Array, " K"],
                   acceptance: Float[Array, " K"], records: Float[Array, " K"],
                   rollout_seconds: Float[Array, ""], step_seconds=None
                   ) -> tuple[MonitorState, Decision]:
  """One rollout batch: per head its mean sparse TV, acceptance rate (NaN: unknown) and number of
  matured records; ``step_seconds``: the seconds of the step around the rollout that bound a
  learning refresh (``learn_budget``; None: the rollout's). Pure (``cfg`` static); returns the
  new monitor and the decision."""
  f32 = jnp.float32
  k = tv.shape[0]
  n = jnp.where(jnp.isfinite(tv), records.astype(f32), 0.0)
  tv0 = jnp.where(n > 0, tv, 0.0)
  acc_known = jnp.isfinite(acceptance)
  acc0 = jnp.where(acc_known, acceptance, 0.0)
  nb = cfg.calibration_batches
  b = m.batches + 1  # batches observed, this one included
  # a collapse: head 1's acceptance near nothing over enough records (refit now, then learn)
  collapsed = jnp.bool_(False)
  if cfg.collapse_acceptance > 0 and cfg.mode != "off":
    collapsed = (acc_known[0] & (acceptance[0] < cfg.collapse_acceptance)
                 & (records[0] >= cfg.collapse_records))
  enter = collapsed & (m.learning == 0)  # a collapse starts a new learning phase
  booting = (m.learning > 0) | collapsed  # a learning phase: the heads are fitted to the target
  learn_end = jnp.where(booting, b, m.learn_end)
  bc = b - learn_end  # batches since the learning phase: the calibration's clock
  calibrating = bc <= nb
  row = jnp.clip(bc - 1, 0, nb - 1)
  record = calibrating & ~booting
  calib_tv = jnp.where(record, m.calib_tv.at[row].set(jnp.where(n > 0, tv, jnp.nan)),
                       m.calib_tv)
  calib_acc = jnp.where(record,
                        m.calib_acc.at[row].set(jnp.where(acc_known, acceptance, jnp.nan)),
                        m.calib_acc)
  med = jnp.nanmedian(calib_tv, axis=0)
  mad = jnp.nanmedian(jnp.abs(calib_tv - med), axis=0)
  done = bc == nb
  tv_median = jnp.where(done, med, m.tv_median)
  tv_mad = jnp.where(done, mad, m.tv_mad)
  acc_baseline = jnp.where(done, jnp.nanmedian(calib_acc, axis=0), m.acc_baseline)

  post = ~calibrating
  window_tv = m.window_tv + jnp.where(post, tv0 * n, 0.0)
  window_n = m.window_n + jnp.where(post, n, 0.0)
  window_acc = m.window_acc + jnp.where(post, acc0, 0.0)
  window_acc_n = m.window_acc_n + jnp.where(post & acc_known, 1.0, 0.0)
  is_check = post & ((bc - nb) % cfg.check_every == 0)
  checked = is_check & (window_n >= max(cfg.min_records, 1))
  scale = jnp.maximum(cfg.mad_scale * tv_mad, cfg.min_scale)
  rise = window_tv / jnp.maximum(window_n, 1.0) - tv_median  # the window's signal over baseline
  z_now = rise / scale
  acc_now = jnp.where(window_acc_n > 0, window_acc / jnp.maximum(window_acc_n, 1.0), jnp.nan)
  if cfg.signal == "tv":  # the heads' acceptance fell
    worse = acc_baseline - acc_now >= cfg.acceptance_drop
  else:  # the acceptance the heads leave on the table rose
    worse = rise >= cfg.acceptance_drop
  degraded = checked & (z_now > cfg.z_threshold) & worse
  consecutive = jnp.where(checked, jnp.where(degraded, m.consecutive + 1, 0), m.consecutive)
  z = jnp.where(checked, z_now, m.z)
  reset = lambda x: jnp.where(checked, 0.0, x)
  since_tv, since_n = m.since_tv + tv0 * n, m.since_n + n
  cooldown = jnp.maximum(m.cooldown - 1, 0)
  rollout_total = m.rollout_seconds + jnp.asarray(rollout_seconds, f32)

  no = jnp.zeros((k,), bool)

  def within_budget(share):  # the refresh seconds so far plus the last refresh's fit in the share
    return m.refresh_seconds + m.last_refresh_seconds <= share * rollout_total

  steps = cfg.refresh_steps
  if cfg.mode == "off":
    refresh, reason = no, jnp.int32(_R["off"])
  elif cfg.mode == "every_batch":
    refresh, reason = ~no, jnp.int32(_R["every_batch"])
  elif cfg.mode == "scheduled":
    steps = cfg.scheduled_steps
    due = (since_n.sum() >= cfg.scheduled_min_records) & (
        b - m.last_update >= cfg.scheduled_min_batches) & (since_n.sum() > 0)
    fire = due & within_budget(cfg.time_budget)
    worst = jnp.argmax(jnp.where(since_n > 0, since_tv / jnp.maximum(since_n, 1.0), -jnp.inf))
    refresh = (jnp.arange(k) == worst) & fire
    reason = jnp.where(fire, _R["scheduled"],
                       jnp.where(due, _R["over_budget"], _R["schedule_wait"])).astype(jnp.int32)
  else:
    firing = degraded & (consecutive >= cfg.patience)
    cool = cooldown == 0
    can = cool & (within_budget(cfg.degradation_budget) if cfg.degradation_budget > 0 else True)
    pool = firing if cfg.refresh_selection == "firing" else degraded  # who a firing refreshes
    score = jnp.where(pool, z_now, -jnp.inf)
    rank = jnp.zeros((k,), jnp.int32).at[jnp.argsort(-score)].set(jnp.arange(k, dtype=jnp.int32))
    refresh = pool & (rank < cfg.max_heads) & can & firing.any()
    reason = jnp.select(
        [calibrating, ~is_check, firing.any() & can, firing.any() & cool, firing.any(),
         degraded.any(), checked.any()],
        [_R["calibrating"], _R["waiting"], _R["sustained_degradation"], _R["over_budget"],
         _R["cooldown"], _R["degraded"], _R["healthy"]], _R["too_few_records"]).astype(jnp.int32)
    consecutive = jnp.where(refresh, 0, consecutive)
    cooldown = jnp.where(refresh.any(), cfg.cooldown_batches, cooldown)

  if cfg.mode != "off":  # a learning phase: every head with records, each batch
    refresh = jnp.where(booting, since_n > 0, refresh)
    first = (m.phases == 1) & (m.learn_refreshes < cfg.bootstrap_batches) & ~enter
    learn_reason = jnp.where(enter, _R["collapse"],
                             jnp.where(first, _R["bootstrap"], _R["learning"]))
    reason = jnp.where(booting, learn_reason, reason).astype(jnp.int32)
    most = cfg.bootstrap_steps or cfg.refresh_steps
    learn_steps = jnp.int32(most)
    if cfg.learn_budget > 0:  # what fits in the budget at the last refresh's seconds per step
      # (a refresh also reads the reservoir about twice to evaluate: counted as 2 steps)
      per_step = m.last_refresh_seconds / (m.last_refresh_steps + 2).astype(f32)
      around = rollout_seconds if step_seconds is None else step_seconds
      fit = jnp.floor(cfg.learn_budget * jnp.asarray(around, f32)
                      / jnp.maximum(per_step, 1e-9)) - 2
      learn_steps = jnp.where(m.last_refresh_steps > 0, jnp.clip(fit, 1, most),
                              1).astype(jnp.int32)
      # a learning refresh whose budget holds no step waits (its records stay in the reservoir);
      # the bootstrap's refreshes, a collapse's and the first (which times a step) run anyway
      afford = (fit >= 1) | (m.last_refresh_steps == 0) | first | enter
      refresh = jnp.where(booting, refresh & afford, refresh)
    steps = jnp.where(booting, learn_steps, steps)
  fired = refresh.any()
  monitor = MonitorState(
      batches=b, calib_tv=calib_tv, calib_acc=calib_acc, tv_median=tv_median, tv_mad=tv_mad,
      acc_baseline=acc_baseline, window_tv=reset(window_tv), window_n=reset(window_n),
      window_acc=reset(window_acc), window_acc_n=reset(window_acc_n), consecutive=consecutive,
      z=z, cooldown=cooldown.astype(jnp.int32),
      last_update=jnp.where(fired, b, m.last_update).astype(jnp.int32),
      since_tv=jnp.where(fired, 0.0, since_tv), since_n=jnp.where(fired, 0.0, since_n),
      rollout_seconds=rollout_total, refresh_seconds=m.refresh_seconds,
      last_refresh_seconds=m.last_refresh_seconds, last_refresh_steps=m.last_refresh_steps,
      learning=jnp.where(booting, 1, m.learning).astype(jnp.int32),
      learn_refreshes=jnp.where(enter, 0, m.learn_refreshes).astype(jnp.int32),
      learn_end=learn_end.astype(jnp.int32),
      verdict_steps=jnp.where(enter, 0, m.verdict_steps).astype(jnp.int32),
      verdict_keep=jnp.where(enter, 1.0, m.verdict_keep).astype(f32),
      phases=(m.phases + enter).astype(jnp.int32))
  return monitor, Decision(refresh=refresh, steps=jnp.asarray(steps, jnp.int32), reason=reason,
                           checked=checked, degraded=degraded, z=z)


