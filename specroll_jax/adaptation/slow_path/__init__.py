"""Slow path: a degradation monitor and a guarded refresh of the future-token heads, run between
rollout batches (docs/design.md, "Slow path").

The rollout loop calls :func:`after_batch` once per rollout batch with the batch's matured
prediction records (``specroll_jax.adaptation.records``) and the per-head acceptance rates. It

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

Modules: ``config`` (``SlowPathConfig``, modes, reasons), ``state`` (the state structs),
``monitor`` (baselines, windows, the refresh decision), ``retrain`` (the guarded head refresh and
its bounded compile cache); this package's ``init`` and ``after_batch`` are the host entry.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from specroll_jax._fields import float_arg, int_arg
from specroll_jax.adaptation import records as records_lib
from specroll_jax.adaptation.records import Records
from specroll_jax.adaptation.slow_path.config import (
  _R,
  MODES,
  REASONS,
  SELECTIONS,
  SIGNALS,
  VOCABS,
  SlowPathConfig,
)
from specroll_jax.adaptation.slow_path.monitor import batch_stats, monitor_init, monitor_update
from specroll_jax.adaptation.slow_path.retrain import (
  _compiled_refresh,
  evaluate,
  holdout_slots,
  keep_rule,
  optimizer,
  refresh,
  refresh_compiles,
  refresh_jit,
  step_groups,
)
from specroll_jax.adaptation.slow_path.state import (
  Decision,
  Evaluation,
  MonitorState,
  RefreshResult,
  SlowPathState,
)
from specroll_jax.heads import kinds as head_kinds
from specroll_jax.heads.medusa import Heads
from specroll_jax.models.config import ModelConfig


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
  support_size = int_arg(support_size, "support_size", 1)
  num_candidates = int_arg(num_candidates, "num_candidates", 1)
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
# Host entry


def _observe(cfg, state: SlowPathState, batch: Records, acceptance, rollout_seconds,
             step_seconds):
  tv, n = batch_stats(batch, cfg.signal)
  reservoir = records_lib.merge(state.reservoir, batch)
  monitor, decision = monitor_update(cfg, state.monitor, tv, acceptance, n, rollout_seconds,
                                     step_seconds)
  return state.replace(reservoir=reservoir, monitor=monitor), decision, tv, n


_observe_jit = jax.jit(_observe, static_argnums=0)


def _placed_like(new, old):
  """``new`` with every leaf whose counterpart in ``old`` is committed to a device placed on that
  leaf's sharding: the refresh's outputs come back uncommitted, and a state (or heads) that
  changes placement makes the next jitted call on it (the monitor, the rollout) compile again."""
  def place(x, ref):
    if isinstance(ref, jax.Array) and ref.committed and (
        not x.committed or x.sharding != ref.sharding):
      return jax.device_put(x, ref.sharding)
    return x
  return jax.tree.map(place, new, old)


_LEARN = tuple(_R[k] for k in ("bootstrap", "learning", "collapse"))


def refresh_gain(r: RefreshResult) -> float:
  """A refresh's relative held-out TV drop, averaged over the heads it trained (a rolled-back
  head counts 0; NaN-free): what decides whether learning goes on."""
  trained, keep = np.asarray(r.trained, bool), np.asarray(r.keep, bool)
  if not trained.any():
    return 0.0
  before, after = np.asarray(r.before.tv, np.float64), np.asarray(r.after.tv, np.float64)
  ok = trained & keep & np.isfinite(before) & np.isfinite(after) & (before > 0)
  gain = np.where(ok, 1.0 - after / np.where(ok, before, 1.0), 0.0)
  return float(gain[trained].mean())


def _learn_after(cfg: SlowPathConfig, m: MonitorState, reason: int, steps: int,
                 gain: float) -> MonitorState:
  """The learning phase after a refresh of ``steps`` steps whose decision was ``reason`` and
  whose held-out gain was ``gain`` (host numbers): a phase goes on for its first refreshes
  (``bootstrap_batches`` in the first phase, 1 in later ones) and then while refits pay: the
  verdict falls once the phase's refreshes since the last one hold at least ``bootstrap_steps``
  optimiser steps (a refresh held to a small budget takes a few), and learning goes on when
  together they lowered the held-out TV by ``learn_gain`` (relative, compounded). A refresh
  after sustained degradation that pays ``learn_gain`` starts a new phase."""
  n = int(m.learn_refreshes) + 1
  learning, phases, count = int(m.learning), int(m.phases), int(m.learn_refreshes)
  window, keep = int(m.verdict_steps), float(m.verdict_keep)
  if reason in _LEARN:
    least = cfg.bootstrap_batches if phases == 1 and reason != _R["collapse"] else 1
    window, keep = window + int(steps), keep * (1.0 - float(gain))
    judged = window >= (cfg.bootstrap_steps or cfg.refresh_steps)
    pays = cfg.learn_gain > 0 and 1.0 - keep >= cfg.learn_gain
    learning = int(n < least or (cfg.learn_gain > 0 and (pays or not judged)))
    count = n
    if judged or not learning:
      window, keep = 0, 1.0
  elif reason == _R["sustained_degradation"] and cfg.learn_gain > 0 and gain >= cfg.learn_gain:
    learning, phases, count, window, keep = 1, phases + 1, 0, 0, 1.0  # a task shift, a drift
  i32 = lambda v: jnp.asarray(np.int32(v))
  return m.replace(learning=i32(learning), phases=i32(phases), learn_refreshes=i32(count),
                   last_refresh_steps=i32(steps), verdict_steps=i32(window),
                   verdict_keep=jnp.asarray(np.float32(keep)))


def _commit(state: SlowPathState, r: RefreshResult, seconds: float) -> SlowPathState:
  """The refresh's counters and seconds into the state, on the host (``r``: the refresh's result
  fetched with ``jax.device_get``): a handful of scalars, so no program to compile inside the
  timed part of the loop (a jitted commit compiled at the first refresh). The new leaves are
  uncommitted; ``after_batch`` places them like the old ones (``_placed_like``)."""
  m = state.monitor
  trained, keep = np.asarray(r.trained, bool), np.asarray(r.keep, bool)
  add = lambda x, y: jnp.asarray(np.asarray(x) + y.astype(np.int32))
  f32 = lambda v: jnp.asarray(np.float32(v))
  return state.replace(
      tried=add(state.tried, trained), kept=add(state.kept, keep),
      rolled_back=add(state.rolled_back, trained & ~keep),
      monitor=m.replace(refresh_seconds=f32(np.asarray(m.refresh_seconds) + seconds),
                        last_refresh_seconds=f32(seconds)))


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
    raise ValueError(f"batch_records must be a specroll_jax.adaptation.records.Records, got "
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
  return acc, np.float32(float_arg(float(rollout_seconds), "rollout_seconds", 0))


@dataclasses.dataclass(frozen=True)
class BatchReport:
  """What ``after_batch`` did for one batch, in plain Python values: the monitor's batch count,
  mode and signal; its decision (a ``REASONS`` name) and the refresh steps it granted; per head
  the signal's z-score, the batch's mean signal (``tv``: the configured signal's value), the
  acceptance and the records merged; the heads refreshed, kept and rolled back, their held-out CE
  and TV before and after; refresh_seconds (the run's wall-clock) and compile_seconds (when this
  call compiled the refresh program); gain: the refresh's relative held-out TV drop
  (``refresh_gain``; None without a refresh); learning: a learning phase goes on after this
  batch (``SlowPathConfig.bootstrap_batches``, ``learn_gain``)."""

  batch: int
  mode: str
  signal: str
  decision: str
  steps: int
  z: tuple[float, ...]
  tv: tuple[float, ...]
  acceptance: tuple[float, ...]
  records: tuple[int, ...]
  heads: tuple[int, ...] = ()
  kept: tuple[int, ...] = ()
  rolled_back: tuple[int, ...] = ()
  ce_before: tuple[float, ...] = ()
  ce_after: tuple[float, ...] = ()
  tv_before: tuple[float, ...] = ()
  tv_after: tuple[float, ...] = ()
  refresh_seconds: float = 0.0
  compile_seconds: float = 0.0
  gain: float | None = None
  learning: bool = False

  def to_dict(self) -> dict:
    """Plain values for a JSON line."""
    return dataclasses.asdict(self)


def after_batch(cfg: SlowPathConfig, state: SlowPathState, model_config: ModelConfig, params,
                heads: Heads, batch_records: Records, head_acceptance: Float[Array, " K"],
                rollout_seconds: float, step_seconds: float | None = None
                ) -> tuple[SlowPathState, Heads, BatchReport]:
  """The rollout loop's call between two batches: merge the batch's records (its own buffer, a
  fresh ``records.empty`` per batch) into the reservoir, update the monitor, and refresh the heads
  the decision names. Returns (state, heads, report), a ``BatchReport`` of plain Python values.
  Nothing is donated: the input state and heads stay valid. ``step_seconds``: the seconds of
  the step around this rollout (a GRPO step: rollout, rewards, update), what bounds a learning
  refresh (``SlowPathConfig.learn_budget``); None: the rollout's.

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
  step = secs if step_seconds is None else np.float32(
      float_arg(float(step_seconds), "step_seconds", 0))
  state, decision, tv, n = _observe_jit(cfg, state, batch_records, jnp.asarray(acc), secs, step)
  d, tv, n = jax.device_get((decision, tv, n))
  fl = lambda x: tuple(float(v) for v in np.asarray(x))
  report = BatchReport(batch=int(jax.device_get(state.monitor.batches)), mode=cfg.mode,
                       signal=cfg.signal, decision=REASONS[int(d.reason)],
                       steps=int(d.steps) if d.refresh.any() else 0, z=fl(d.z), tv=fl(tv),
                       acceptance=fl(acc), records=tuple(int(v) for v in n),
                       learning=bool(int(state.monitor.learning)))
  if not d.refresh.any():
    return state, heads, report
  args = (params, heads, state.opt_state, state.reservoir, jnp.asarray(d.refresh),
          jnp.asarray(d.steps, jnp.int32))
  compiled, compile_s = _compiled_refresh(cfg.refresh_settings(), model_config, args)
  t0 = time.perf_counter()
  new_heads, opt_state, res = jax.block_until_ready(compiled(*args))
  seconds = time.perf_counter() - t0
  r = jax.device_get(res)
  new = _commit(state.replace(opt_state=opt_state), r, seconds)
  new = new.replace(monitor=_learn_after(cfg, new.monitor, int(d.reason), int(d.steps),
                                         refresh_gain(r)))
  state = _placed_like(new, state)
  new_heads = _placed_like(new_heads, heads)
  ks = tuple(int(k) for k in np.flatnonzero(r.trained))
  pick = lambda x: tuple(float(x[k]) for k in ks)
  report = dataclasses.replace(
      report, heads=ks, kept=tuple(k for k in ks if r.keep[k]),
      rolled_back=tuple(k for k in ks if not r.keep[k]), ce_before=pick(r.before.ce),
      ce_after=pick(r.after.ce), tv_before=pick(r.before.tv), tv_after=pick(r.after.tv),
      refresh_seconds=seconds, compile_seconds=compile_s, gain=refresh_gain(r),
      learning=bool(int(state.monitor.learning)))
  return state, new_heads, report


__all__ = ["MODES", "REASONS", "SELECTIONS", "SIGNALS", "VOCABS", "BatchReport", "Decision",
           "Evaluation", "MonitorState", "RefreshResult", "SlowPathConfig", "SlowPathState",
           "after_batch", "batch_stats", "evaluate", "holdout_slots", "init", "keep_rule",
           "refresh_gain",
           "monitor_init", "monitor_update", "optimizer", "refresh", "refresh_compiles",
           "refresh_jit", "step_groups"]
