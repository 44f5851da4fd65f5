"""Adaptation at two timescales, carried by the caller from one rollout batch to the next.

``AdaptationState`` holds everything that outlives a rollout batch: the future-token heads (the
slow path's parameters), Reflex's global safety per head, the slow path's monitor, records
reservoir and optimiser state, and a batch counter. It is a pytree of arrays (its settings, an
``AdaptationConfig``, are static), so orbax checkpoints it as is. A custom JAX RL loop does

    state = adaptation.init(AdaptationConfig(), heads)
    for batch in batches:
      out = rollout.generate(config, params, prompts, ..., adaptation=state)
      state = out.adaptation            # out.adaptation_report: what happened, in plain numbers

Inside the rollout Reflex corrects the heads per row (``proposers.ReflexProposer``, math in
``reflex/``); after it, ``after_rollout`` updates the global safety from the batch's
counterfactual gain and hands the matured records and per-depth acceptance to the slow path,
which may refresh the heads (``slow_path/``).
"""

from __future__ import annotations

import dataclasses
import time

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from specroll_jax import head_kinds
from specroll_jax import reflex as _reflex
from specroll_jax import slow_path as _slow
from specroll_jax._fields import check_int, check_type
from specroll_jax.proposers import HeadsProposer, Proposer
from specroll_jax.proposers.reflex_heads import ReflexProposer
from specroll_jax.reflex import ReflexConfig, ReflexGlobal
from specroll_jax.sampling import SamplingConfig
from specroll_jax.slow_path import SlowPathConfig, SlowPathState

RECORD_SOURCES = ("rollout", "trainer")


@dataclasses.dataclass(frozen=True)
class AdaptationConfig:
  """reflex: the fast path's settings (``apply_corrections=False`` keeps the heads static but still
  collects the records the slow path trains on); slow: the slow path's settings (mode "off"
  disables it). With neither corrections nor a slow path the plain static-heads proposer runs."""

  reflex: ReflexConfig = ReflexConfig()
  slow: SlowPathConfig = SlowPathConfig()
  # where the slow path's records come from: "rollout" (Reflex's matured records, written in the
  # decode loop; ``after_rollout`` runs the slow path) or "trainer" (the caller hands records built
  # from the trainer's forward, ``trainer_records``, to :func:`after_trainer`, which runs it; the
  # decode loop then needs no records: ``reflex.record_capacity`` may be 0)
  records: str = "rollout"
  # records="trainer": anchors drawn per batch from the trainer's forward (records per head, at
  # most), for the loops that build them (``grpo.loop.Run``)
  trainer_anchors: int = 512

  def __post_init__(self):
    check_type(self, "reflex", ReflexConfig)
    check_type(self, "slow", SlowPathConfig)
    check_int(self, "trainer_anchors", 1)
    if self.records not in RECORD_SOURCES:
      raise ValueError(f"AdaptationConfig.records must be one of {RECORD_SOURCES}, got "
                       f"{self.records!r}")
    if self.slow.mode != "off" and self.records == "rollout" and self.reflex.sleep_batches > 0:
      raise ValueError(f"AdaptationConfig: reflex.sleep_batches={self.reflex.sleep_batches} with "
                       f"slow path mode {self.slow.mode!r} and records='rollout': a sleeping "
                       "Reflex writes no records (take them from the trainer: records='trainer', "
                       "or keep sleep_batches=0)")
    if (self.slow.mode != "off" and self.records == "rollout"
        and self.reflex.record_capacity == 0):
      raise ValueError(f"AdaptationConfig: slow path mode {self.slow.mode!r} needs records, but "
                       "reflex.record_capacity is 0 (or take them from the trainer: "
                       "records='trainer')")

  @property
  def static_heads(self) -> bool:
    return not self.reflex.apply_corrections and self.slow.mode == "off"

  def for_sampling(self, sampling: SamplingConfig) -> AdaptationConfig:
    """This config with the slow path's temperature set to the rollout's (greedy: 1)."""
    t = 1.0 if sampling.greedy else float(sampling.temperature)
    return dataclasses.replace(self, slow=self.slow.replace(temperature=t))


@flax.struct.dataclass
class AdaptationState:
  heads: object  # heads.Heads or cond_heads.CondHeads
  reflex: ReflexGlobal
  slow: SlowPathState
  batches: Int[Array, ""]
  # root-conditioned heads under Reflex: expected accepted nodes per row-step with the best n
  # candidates (n = 0..capacity), averaged over the batches so far (what goodput.choose weighs);
  # zeros until a batch has measured it (always zeros for Medusa heads)
  expected: Float[Array, " Nr"] = None
  config: AdaptationConfig = flax.struct.field(pytree_node=False, default=AdaptationConfig())


def init(config: AdaptationConfig, heads) -> AdaptationState:
  """A fresh adaptation state around ``heads`` (fitted or initial)."""
  if not isinstance(config, AdaptationConfig):
    raise ValueError(f"config must be an AdaptationConfig, got {type(config).__name__}")
  if not isinstance(heads, head_kinds.KINDS):
    raise ValueError(f"heads must be heads.Heads or cond_heads.CondHeads, got "
                     f"{type(heads).__name__}")
  if head_kinds.is_conditioned(heads) != config.reflex.conditioned:  # follow the heads' family
    config = dataclasses.replace(config, reflex=dataclasses.replace(
        config.reflex, conditioned=head_kinds.is_conditioned(heads)))
  if heads.num_heads != config.reflex.num_heads:
    raise ValueError(f"heads has {heads.num_heads} heads but ReflexConfig.num_heads is "
                     f"{config.reflex.num_heads}")
  r = config.reflex
  slow = _slow.init(config.slow, heads, support_size=r.support_size,
                    num_candidates=r.max_candidates)
  ranks = ReflexProposer(r).capacity + 1  # (orbax saves no empty array: Medusa keeps zeros)
  return AdaptationState(heads=heads, reflex=_reflex.init_global(r), slow=slow,
                         batches=jnp.int32(0), expected=jnp.zeros((ranks,), jnp.float32),
                         config=config)


def asleep(state: AdaptationState) -> bool:
  """Whether Reflex sleeps in the next rollout batch (``ReflexConfig.sleep_batches``): the plain
  heads propose, with no Reflex work in the decode loop."""
  return not state.config.static_heads and int(state.reflex.sleep) > 0


def heads_proposer(config: AdaptationConfig, heads) -> tuple[Proposer, object]:
  """(proposer, its parameters) of the plain ``heads`` under ``config.reflex``'s tree settings,
  as a batch with Reflex off or asleep proposes: ``RankedHeads`` (``ReflexProposer.ranked``) for
  root-conditioned heads, ``HeadsProposer`` for Medusa heads (the heads' family decides)."""
  if not isinstance(heads, head_kinds.KINDS):
    raise ValueError(f"heads must be heads.Heads or cond_heads.CondHeads, got "
                     f"{type(heads).__name__}")
  r = config.reflex
  if head_kinds.is_conditioned(heads):
    rh = ReflexProposer(r).ranked
    return rh, rh.params(heads)
  return HeadsProposer(num_heads=r.num_heads, topk=r.topk), heads


def proposer(state: AdaptationState) -> tuple[Proposer, object]:
  """(proposer, its parameters) for the next rollout batch: the plain heads when Reflex is off or
  asleep (:func:`heads_proposer`), else Reflex over them."""
  cfg = state.config
  if cfg.static_heads or asleep(state):
    return heads_proposer(cfg, state.heads)
  prop = ReflexProposer(cfg.reflex)
  return prop, prop.params(state.heads, state.reflex)


@dataclasses.dataclass(frozen=True)
class AdaptationReport:
  """One batch of the adaptation, in plain numbers: batch (the state's counter before it),
  rollout_seconds, head_acceptance (accepted / proposed per depth; NaN where nothing was
  proposed), reflex (``reflex.ReflexSummary``; None with static heads), expected_by_nodes
  (accepted nodes per row-step by node count, this batch's; () when none), safety (Reflex's
  global safety per head after the batch), slow (the slow path's ``slow_path.BatchReport``; None
  when it did not run) and adaptation_seconds (the host work of this call)."""

  batch: int
  rollout_seconds: float
  head_acceptance: tuple[float, ...]
  reflex: _reflex.ReflexSummary | None = None
  expected_by_nodes: tuple[float, ...] = ()
  safety: tuple[float, ...] = ()
  slow: _slow.BatchReport | None = None
  adaptation_seconds: float = 0.0

  def to_dict(self) -> dict:
    """Plain values for a JSON line."""
    return dataclasses.asdict(self)


def after_rollout(state: AdaptationState, model_config, params, rollout,
                  rollout_seconds: float) -> tuple[AdaptationState, AdaptationReport]:
  """The state for the next batch, and an ``AdaptationReport`` of this batch: Reflex statistics
  (correction rate, mean ratio, LCB, resets, records matured, ...), safety per head, the slow
  path's decision / refresh (kept or rolled back, seconds) and the host seconds spent here."""
  t0 = time.perf_counter()
  cfg = state.config
  stats = rollout.stats.spec.proposer if rollout.stats.spec is not None else None
  acc = np.asarray(rollout.stats.head_acceptance, np.float64)
  proposed = np.asarray(rollout.stats.head_proposed)
  acc = np.where(proposed > 0, acc, np.nan)
  glob, heads, slow = state.reflex, state.heads, state.slow
  expected = state.expected
  summary, by_nodes, slow_report = None, (), None
  if asleep(state):  # the plain heads proposed: nothing of Reflex's to fold in
    summary = _reflex.summarize(None, asleep=True, sleep_left=int(glob.sleep) - 1)
    glob = glob.replace(sleep=glob.sleep - 1)
  elif not cfg.static_heads:
    glob = _reflex.end_batch(cfg.reflex, glob, stats)
    summary = _reflex.summarize(stats, sleep_left=int(glob.sleep))
    n = int(stats.expected_n) if stats.expected_n is not None else 0
    if n > 0:  # a running mean over batches (equal weights: the estimates are calibrated)
      e = np.asarray(stats.expected, np.float64) / n
      b = int(state.batches)
      expected = jnp.asarray((np.asarray(expected) * b + e) / (b + 1), jnp.float32)
      by_nodes = tuple(float(x) for x in e)
  if cfg.slow.mode != "off" and cfg.records == "rollout":
    records = rollout.proposer_state.records
    slow, heads, slow_report = _slow.after_batch(cfg.slow, slow, model_config, params, heads,
                                                 records, jnp.asarray(acc, jnp.float32),
                                                 float(rollout_seconds))
  jax.block_until_ready(jax.tree.leaves(heads))
  report = AdaptationReport(
      batch=int(state.batches), rollout_seconds=float(rollout_seconds),
      head_acceptance=tuple(float(a) for a in acc), reflex=summary, expected_by_nodes=by_nodes,
      safety=tuple(float(x) for x in np.asarray(glob.safety)), slow=slow_report,
      adaptation_seconds=time.perf_counter() - t0)
  return state.replace(heads=heads, reflex=glob, slow=slow, batches=state.batches + 1,
                       expected=expected), report


def after_trainer(state: AdaptationState, model_config, params, records,
                  rollout_report: AdaptationReport) -> tuple[AdaptationState, AdaptationReport]:
  """The slow path's step for ``AdaptationConfig.records == "trainer"``: after the rollout
  (``after_rollout``, which ran Reflex's end of batch) and the trainer's forward of it, merge
  ``records`` (``trainer_records.from_hidden`` / ``from_rollout`` of that batch, under the policy
  that rolled it out) into the reservoir, update the monitor with the batch's head acceptance and
  rollout seconds (from ``rollout_report``, the batch's ``Rollout.adaptation_report``) and refresh
  the heads it names. Returns (state, report): ``rollout_report`` with the slow path's
  ``BatchReport`` (``slow``) and the host seconds spent here (``adaptation_seconds``)."""
  t0 = time.perf_counter()
  if not isinstance(state, AdaptationState):
    raise ValueError(f"state must be an AdaptationState, got {type(state).__name__}")
  cfg = state.config
  if cfg.records != "trainer":
    raise ValueError(f"after_trainer needs AdaptationConfig.records='trainer', got "
                     f"{cfg.records!r} (with 'rollout' the rollout's own records are used)")
  if cfg.slow.mode == "off":
    raise ValueError("after_trainer: the slow path is off (SlowPathConfig.mode='off'): "
                     "nothing takes the records")
  if not isinstance(rollout_report, AdaptationReport):
    raise ValueError("rollout_report must be the batch's Rollout.adaptation_report (an "
                     f"AdaptationReport), got {type(rollout_report).__name__}")
  acc = np.asarray(rollout_report.head_acceptance, np.float32)
  slow, heads, report = _slow.after_batch(cfg.slow, state.slow, model_config, params, state.heads,
                                          records, jnp.asarray(acc),
                                          float(rollout_report.rollout_seconds))
  jax.block_until_ready(jax.tree.leaves(heads))
  return state.replace(heads=heads, slow=slow), dataclasses.replace(
      rollout_report, slow=report, adaptation_seconds=time.perf_counter() - t0)
