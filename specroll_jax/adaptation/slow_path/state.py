"""The slow path's state (reservoir, monitor, optimiser state, counters) and what the monitor
and a refresh return."""

from __future__ import annotations

import flax.struct
import optax
from jaxtyping import Array, Bool, Float, Int

from specroll_jax.adaptation.records import Records


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
  last_refresh_steps: Int[Array, ""]  # ... and its optimiser steps
  learning: Int[Array, ""]  # 1 in a learning phase (SlowPathConfig.bootstrap_batches)
  learn_refreshes: Int[Array, ""]  # refreshes of the current (or last) learning phase
  phases: Int[Array, ""]  # learning phases begun (the first is the bootstrap)
  learn_end: Int[Array, ""]  # ``batches`` when the last learning phase ended (the calibration's
  #                           clock starts there)
  verdict_steps: Int[Array, ""]  # a learning phase's optimiser steps since its last verdict
  verdict_keep: Float[Array, ""]  # ... and the held-out TV they kept (product of 1 - gain)


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
  before: Evaluation  # held-out, before the refresh (NaN for heads not trained)
  after: Evaluation  # held-out, after the refresh (of the trained parameters, kept or not)
  loss: Float[Array, " K"]  # training loss per head at the first step
  n_train: Float[Array, " K"]


