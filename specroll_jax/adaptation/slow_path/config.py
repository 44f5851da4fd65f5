"""The slow path's settings (``SlowPathConfig``), its modes and the monitor's reasons."""

from __future__ import annotations

import dataclasses
import math

from specroll_jax._fields import check_bool, check_float, check_int

MODES = ("degradation", "scheduled", "every_batch", "off")
SIGNALS = ("tv", "regret")
SELECTIONS = ("firing", "degraded")
VOCABS = ("full", "support")

# Why the monitor decided what it did (Decision.reason indexes this tuple).
REASONS = ("off", "calibrating", "waiting", "healthy", "too_few_records", "degraded", "cooldown",
           "sustained_degradation", "scheduled", "schedule_wait", "over_budget", "every_batch",
           "bootstrap", "learning", "collapse")
_R = {name: i for i, name in enumerate(REASONS)}


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
  signal: the per-record statistic the monitor watches. "tv": the sparse TV between the head and
    the target; a check is degraded when z > z_threshold and the window's acceptance fell at least
    acceptance_drop below the calibration median. "regret": the target mass the tree's
    candidates at the head's depth miss against the target's own top candidates of the same number
    (``records.regret``: acceptance left on the table, from the records' exact p, no sampling
    noise); degraded when z > z_threshold and the window's regret rose at least acceptance_drop
    above the calibration median. It also sees a policy that gets easier to predict while the
    heads stay as they were (their acceptance does not fall, the target's own top mass rises).
  z_threshold, acceptance_drop: see ``signal``.
  patience: consecutive degraded checks before a head fires.
  max_heads: heads refreshed at most per firing (the highest z).
  refresh_selection: which heads a firing refreshes (mode "degradation"): "firing" (default: the
    heads whose degraded checks reached ``patience``) or "degraded" (once any head fires, every
    head degraded at this check is a candidate, so a head that just turned degraded is not left
    for a later firing after the cooldown); the ``max_heads`` highest z either way.
  cooldown_batches: batches after a refresh during which no other refresh fires ("degradation").
  scheduled_min_records, scheduled_min_batches, scheduled_steps, time_budget: mode "scheduled"
    (records summed over heads; budget = cumulative refresh seconds (excluding compilation) plus the
    last refresh's cost, over cumulative rollout seconds).
  degradation_budget: mode "degradation"'s cap on refresh time (0, the default: none). A firing
    head refreshes only while the refresh seconds so far plus the last refresh's fit in this share
    of the rollout seconds so far (``time_budget``'s rule; the first refresh always fits); else
    the decision is "over_budget" and the head keeps its count of degraded checks, so it fires at
    the first degraded check the budget allows. Bounds the refreshes' share of rollout time on any
    machine, at the price of later refreshes where they cost more than the budget earns.
  refresh_steps: optimiser steps per refresh ("degradation", "every_batch"); each step is a full
    batch over the head's training records.
  distill_weight, token_weight, proximal_weight, tv_weight: loss = distill * CE(p on S + tail
    bucket) + token * CE(committed token) + proximal * KL(pre-refresh head || head) on S + tail
    bucket + tv * sparse TV(p, head) on S (what coupled drafts are accepted by).
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
  step_chunks: chunks (of ``chunk_size`` records per head) in one optimiser step; 0 (default) or
    at least the reservoir's chunks: every chunk, a full-batch step. Fewer: minibatch steps over
    fixed strided groups of chunks (step i takes group i mod G, each group spread over the ring,
    so over time), which divides a step's cost by about chunks / step_chunks.
  bootstrap_batches: > 0 starts the run in a learning phase (any mode but "off"): every batch
    with new records refreshes every head that has them, each refresh guarded as usual, before
    the monitor calibrates: heads brought from another task, an earlier policy or a cold start
    are fitted to this target first, where a baseline taken from them would call their error
    normal. The phase runs ``bootstrap_batches`` refreshes and then, with ``learn_gain`` > 0, as
    long as refits still lower the heads' held-out sparse TV by at least ``learn_gain``
    (relative), judged over every ``bootstrap_steps`` optimiser steps of its refreshes (their
    gains compounded: a refresh held to a small budget takes a few steps, and a few steps from a
    cold start move little): learning goes on while a refit pays. A batch without records (one
    whose rollout verified no tree and ran no probe) neither refreshes nor ends the phase. The
    calibration window starts when the phase ends. 0 (default): no bootstrap. bootstrap_steps:
    optimiser steps of a learning refresh (0: ``refresh_steps``; with ``learn_budget``, the
    most).
  learn_gain: the relative held-out TV drop (mean over the refreshed heads, a rolled-back head
    counting 0) that keeps a learning phase going past its first refreshes, and that turns a
    refresh after sustained degradation into a new learning phase (a task shift, a drifting
    policy). 0: phases of exactly ``bootstrap_batches`` refreshes, no new phase.
  learn_budget: a learning refresh's seconds at most this share of the seconds around the
    rollouts since the previous refresh (the caller's step seconds, else the rollout's, times the
    batches since then: where only probes hand out records, a probe's refresh spends the share
    of the batches between probes): its steps are what fits at the last refresh's seconds per
    step (at most ``bootstrap_steps``; where that is no step, a learning refresh past the
    bootstrap waits and its records stay in the reservoir); 0: ``bootstrap_steps`` every time.
  collapse_acceptance: head 1's acceptance (its records' hit rate) below this, over at least
    ``collapse_records`` records, is a collapse (heads of another model, a corrupted head file,
    stale heads after a large policy step): every head with records refreshes at once (reason
    "collapse") and a learning phase starts, whatever the monitor's windows say. 0: off.
  refresh_vocab: the vocabulary the refresh's training steps read. "full" (default): the head's
    softmax over all V tokens (the support's ids plus a tail bucket for the rest). "support":
    the head's softmax over each record's support S alone (at most 2 top + 1 + C ids; the
    record's p is already renormalised on S), so a step needs |S| unembedding rows per record
    instead of the V x D unembedding: V / |S| times less unembedding work (50 on the embedded
    model, 3700 over Qwen's vocabulary; the head's own work stays; docs/benchmarks.md, "The slow
    path's host work"). Mass the head puts off the support is not trained; the guard still
    judges every refresh over the full vocabulary (held-out CE with the tail bucket, and TV), so
    a refresh that moved mass off the support is rolled back.
  """

  mode: str = "degradation"
  reservoir_size: int = 4096
  holdout_fraction: float = 0.1
  calibration_batches: int = 20
  check_every: int = 20
  min_records: int = 1024
  mad_scale: float = 1.4826
  min_scale: float = 0.01
  signal: str = "tv"
  z_threshold: float = 2.5
  acceptance_drop: float = 0.05
  patience: int = 2
  max_heads: int = 2
  refresh_selection: str = "firing"
  cooldown_batches: int = 50
  scheduled_min_records: int = 256
  scheduled_min_batches: int = 8
  scheduled_steps: int = 1
  time_budget: float = 0.015
  degradation_budget: float = 0.0
  refresh_steps: int = 2
  distill_weight: float = 0.7
  token_weight: float = 0.3
  proximal_weight: float = 0.1
  tv_weight: float = 0.0
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
  step_chunks: int = 0
  refresh_vocab: str = "full"
  bootstrap_batches: int = 0
  bootstrap_steps: int = 0
  learn_gain: float = 0.0
  learn_budget: float = 0.0
  collapse_acceptance: float = 0.0
  collapse_records: int = 64

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"SlowPathConfig.mode must be one of {MODES}, got {self.mode!r}")
    if self.refresh_selection not in SELECTIONS:
      raise ValueError(f"SlowPathConfig.refresh_selection must be one of {SELECTIONS}, got "
                       f"{self.refresh_selection!r}")
    if self.refresh_vocab not in VOCABS:
      raise ValueError(f"SlowPathConfig.refresh_vocab must be one of {VOCABS}, got "
                       f"{self.refresh_vocab!r}")
    if self.signal not in SIGNALS:
      raise ValueError(f"SlowPathConfig.signal must be one of {SIGNALS}, got {self.signal!r}")
    check_int(self, "reservoir_size", 2)
    check_float(self, "holdout_fraction", 0.0, 0.5, lo_open=True)
    for name in ("calibration_batches", "check_every", "patience", "max_heads",
                 "scheduled_min_batches", "scheduled_steps", "refresh_steps", "chunk_size"):
      check_int(self, name, 1)
    for name in ("min_records", "cooldown_batches", "scheduled_min_records", "step_chunks",
                 "bootstrap_batches", "bootstrap_steps", "collapse_records"):
      check_int(self, name, 0)
    check_float(self, "learn_gain", 0.0, 1.0)
    check_float(self, "learn_budget", 0.0)
    check_float(self, "collapse_acceptance", 0.0, 1.0)
    check_float(self, "mad_scale", 0.0, lo_open=True)
    check_float(self, "min_scale", 0.0, lo_open=True)
    check_float(self, "z_threshold", -math.inf)
    check_float(self, "acceptance_drop", -1.0, 1.0)
    check_float(self, "time_budget", 0.0)
    check_float(self, "degradation_budget", 0.0)
    for name in ("distill_weight", "token_weight", "proximal_weight", "tv_weight", "weight_decay",
                 "temperature"):
      check_float(self, name, 0.0)
    if self.distill_weight + self.token_weight == 0:
      raise ValueError("SlowPathConfig.distill_weight + token_weight must be > 0, got 0")
    check_float(self, "learning_rate", 0.0, lo_open=True)
    check_float(self, "b1", 0.0, 1.0)
    check_float(self, "b2", 0.0, 1.0)
    check_float(self, "eps", 0.0, lo_open=True)
    check_float(self, "clip_norm", 0.0, lo_open=True)
    check_float(self, "keep_ce_ratio", 0.0, lo_open=True)
    for name in ("guard", "use_correction"):
      check_bool(self, name)

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

  @classmethod
  def for_small_models(cls, **kw) -> SlowPathConfig:
    """:meth:`for_tests`' windows with the settings the GRPO drift replay tuned for the embedded
    2M-parameter model's heads (``experiments/bench_adaptation.py``'s defaults; docs/benchmarks.md,
    "SpecRoll on real GRPO drift"): AdamW at 1e-3 (the default 1e-5 is for the heads of a
    1.5B-parameter model), 1536 records per head of three, 10 steps per refresh, a check every
    batch at z > 0.5 after 6 calibration batches, and a 5% budget for the scheduled mode. Each
    refresh step reads half the reservoir (``step_chunks=2`` of 4 chunks, every other slot), in
    chunks of 384 records (``chunk_size``: fewer, larger matmuls and less per-chunk control flow
    than :meth:`for_tests`' 64; with the support-only objective a chunk's logits are
    [K, 384, 41], not [K, 384, V]). A firing refreshes every head degraded at that check
    (``refresh_selection="degraded"``), so a head one check short of patience does not wait out
    the cooldown. The refresh trains on each record's support alone (``refresh_vocab="support"``;
    docs/benchmarks.md, "The slow path's host work")."""
    base = dict(learning_rate=1e-3, reservoir_size=4608, refresh_steps=10, scheduled_steps=10,
                check_every=1, z_threshold=0.5, calibration_batches=6, time_budget=0.05,
                chunk_size=384, step_chunks=2, refresh_selection="degraded",
                refresh_vocab="support")
    base.update(kw)
    return cls.for_tests(**base)

  @classmethod
  def for_model(cls, config, **kw) -> SlowPathConfig:
    """The slow path for a model of ``config``'s size, as ``SpecRoll`` runs it: the heads learn
    from the start (brought from elsewhere, or fresh) in a learning phase of at least 2
    refreshes that goes on while each refit lowers the held-out TV by 1% or more, each refresh
    within 5% of the step around its rollout (``SpecRoll.generate``'s ``step_seconds``, else the
    rollout's seconds; at most 20 steps); then refreshed on sustained degradation, a refresh
    that pays 1% starting a new phase; head 1's acceptance below 0.02 is
    a collapse that refits at once; the refresh's loss has the TV term (``tv_weight=1``: what
    coupled drafts are accepted by). :meth:`for_small_models` for a model of hidden size below
    512 (the embedded one), the defaults (sized for 1.5B-parameter heads) otherwise."""
    return cls.for_hidden_size(config.hidden_size, **kw)

  @classmethod
  def for_hidden_size(cls, hidden_size: int, **kw) -> SlowPathConfig:
    """:meth:`for_model` of a model whose hidden size is ``hidden_size``."""
    base = dict(bootstrap_batches=2, bootstrap_steps=20, learn_gain=0.01, learn_budget=0.05,
                collapse_acceptance=0.02, tv_weight=1.0)
    base.update(kw)
    if hidden_size < 512:
      return cls.for_small_models(**base)
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
                   "tv_weight",
                   "learning_rate", "b1", "b2", "eps", "weight_decay", "clip_norm",
                   "keep_ce_ratio", "guard", "temperature", "use_correction", "chunk_size",
                   "step_chunks", "refresh_vocab")


