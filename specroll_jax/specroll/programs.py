"""The programs ``SpecRoll`` runs (``Programs``, mixed into the object): the plan of a batch
(proposer, Reflex awake or asleep, goodput's nodes per bucket or a probe), the engines and their
arguments, the warm-up that compiles every program a batch shape can run, and the machine's
measured step cost."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from specroll_jax import distributed
from specroll_jax.adaptation import goodput as _goodput
from specroll_jax.adaptation import store as _store
from specroll_jax.engines import SpecEngine, VanillaEngine
from specroll_jax.engines import buckets as _buckets
from specroll_jax.engines import executables as _exe
from specroll_jax.engines.config import DecodeSettings, SpecConfig
from specroll_jax.proposers import MergedReflex
from specroll_jax.rollout import PreparedBatch
from specroll_jax.specroll.state import (
  Mapped,
  Mode,
  Plan,
  ReflexMode,
  SpecRollState,
  with_table,
)


class Programs:
  """``SpecRoll``'s planning and compiling methods (they read the object's settings)."""

  def plan(self, state: SpecRollState, batch: PreparedBatch, *, probe: bool | None = None,
           reflex: str | None = None, trees: bool = False) -> Plan:
    """How the next batch runs: the proposer (Reflex awake, asleep or off), the nodes per bucket
    (goodput's choice or ``spec``'s budget) and whether it probes (``probe`` / ``reflex``
    override the state's answer; ``trees``: a speculative plan with goodput's program whatever
    the choice: what ``warmup`` compiles)."""
    has_reflex = self.has_reflex(state)
    if reflex is None:
      reflex = (ReflexMode.OFF if not has_reflex else ReflexMode.ASLEEP
                if int(state.reflex.sleep) > 0 else ReflexMode.AWAKE)
    reflex = ReflexMode(reflex)
    prop = self._ranked(state.heads, reflex == ReflexMode.AWAKE)
    n = len(batch)
    if self.budget == "fixed":
      return Plan(mode=Mode.SPECULATIVE, spec=self.spec, proposer=prop, probe_rows=n,
                  reflex=reflex)
    expected = np.asarray(state.expected, np.float64)
    choice, spec = (), None
    cost = self.cost
    counts = self._counts(cost, n, prop)
    if trees:
      nodes = tuple(max(c) for c in counts)
      return Plan(mode=Mode.SPECULATIVE, spec=dataclasses.replace(self.spec, nodes=nodes),
                  proposer=prop, probe_rows=n, reflex=reflex, counts=counts)
    if expected[1:].any() and cost is not None:
      spec, choice = _goodput.choose(cost, expected, n, self.spec, capacity=prop.capacity)
      nodes = distributed.from_process0(np.asarray(spec.nodes, np.int32))  # one choice for all
      spec = dataclasses.replace(spec, nodes=tuple(int(x) for x in nodes))
    if spec is not None and any(spec.nodes):
      return Plan(mode=Mode.SPECULATIVE, spec=spec, proposer=prop, probe_rows=n, reflex=reflex,
                  choice=choice, counts=counts)
    if probe is None:
      probe = self.probe_every > 0 and int(state.batches) >= int(state.next_probe)
    if not probe:
      return Plan(mode=Mode.VANILLA, spec=spec, proposer=None, probe_rows=0,
                  reflex=ReflexMode.IDLE if has_reflex else ReflexMode.OFF, choice=choice)
    rows = min(n, self.probe_groups * self.group_size)
    fixed = SpecConfig(bucket_fractions=(1.0,), nodes=(min(self.probe_nodes, prop.capacity),))
    return Plan(mode=Mode.PROBE, spec=fixed, proposer=prop, probe_rows=rows, reflex=reflex,
                choice=choice)

  def proposer_params(self, state: SpecRollState, batch: PreparedBatch, plan: Plan, rows=None):
    """The parameters ``plan.proposer`` takes for ``batch`` (rows ``rows``: a slice, or all)."""
    prop = plan.proposer
    sel = slice(None) if rows is None else rows
    if self.proposer is not None:
      return state.proposer_params if state.calibration is None else with_table(
          state.proposer_params, state.calibration.table())
    table = state.calibration.table()
    prior = None
    if state.store is not None:
      prior = _store.store_context(state.store, batch.row_prompt_ids[sel], batch.row_prompts(sel),
                                   vocab_size=self.config.vocab_size)
    heads = state.heads
    if heads is None:
      return self.lookup.context(table.reshape(self.lookup.acceptance_shape), prior=prior)
    if isinstance(prop, MergedReflex):
      return prop.params(heads, state.reflex, table, prior=prior)
    if self.lookup is None:  # the heads alone (no prior to take)
      return prop.params(heads, table)
    return prop.params(heads, table, prior=prior)

  def engine(self, plan: Plan, rows: PreparedBatch, *, speculative: bool):
    """The engine object a plan runs on ``rows`` (traceable inside a caller's jit). A program
    that verifies trees (the whole batch's in speculative mode, a probe's) hands out its anchor
    hidden states when the slow path draws records from them; the vanilla one does not (where
    goodput verifies no tree the heads learn no more than the probes measure). Goodput's program
    (``plan.counts`` set) takes each bucket's node count as a fourth argument:
    ``engine(params, proposer_params, batch, np.asarray(plan.spec.nodes, np.int32))``."""
    hidden = self._records_on() and speculative
    settings = DecodeSettings(sampling=self.sampling, max_new_tokens=self.max_new_tokens,
                              cache_length=rows.cache_length,
                              kernels=self.kernels_resolved, return_hidden=hidden)
    engine = (SpecEngine(self.config, settings, plan.proposer, self._engine_spec(plan))
              if speculative else VanillaEngine(self.config, settings))
    return engine if self.params_from is None else Mapped(engine, self.params_from)

  def decoder_params(self, params):
    """The decoder's parameter tree of the ``params`` a caller passes (``params_from``, eagerly)."""
    return params if self.params_from is None else self.params_from(params)

  def _choices(self, plan: Plan) -> bool:
    """Whether ``plan`` runs goodput's program: every bucket switches at run time between the
    counts it could choose (``plan.counts``), so no choice of goodput's compiles a program of
    its own."""
    return plan.counts is not None

  def _engine_spec(self, plan: Plan) -> SpecConfig:
    if self._choices(plan):
      return dataclasses.replace(plan.spec, nodes=None, gate=None, choices=plan.counts)
    return plan.spec

  def _counts(self, cost: _goodput.CostModel | None, rows: int,
              prop) -> tuple[tuple[int, ...], ...]:
    """Per bucket fraction, the ``cost_nodes`` counts goodput could ever choose for a batch of
    ``rows`` rows on this machine (0, and each count whose tree would pay were every node
    accepted; every count before the cost is measured): what goodput's program compiles."""
    fractions = self.spec.bucket_fractions
    allowed = tuple(c for c in self.cost_nodes if c <= prop.capacity)
    if cost is None:
      return (allowed,) * len(fractions)
    out = [(0,)] * len(fractions)
    allowed = tuple(c for c in allowed if c in cost.node_counts)  # what it can price
    for r, i in _buckets.kept_buckets(rows, fractions):
      plain = 1.0 / cost.cost(r, 0)
      out[i] = tuple(c for c in allowed if c == 0 or (1.0 + c) / cost.cost(r, c) > plain)
    return tuple(out)

  def _records_on(self) -> bool:
    return self.proposer is None and self.slow.mode != "off"

  def _calls(self, params, batch: PreparedBatch, state, plan: Plan, seed: int):
    """(engine, its arguments) of every program ``plan`` runs: the whole batch's, then a
    probe's (its first rows through the speculative engine; their tokens are the same)."""
    rows = batch
    if plan.mode == Mode.SPECULATIVE:
      pp = self.proposer_params(state, batch, plan)
      plan.proposer.validate_batch(self.config, pp, rows.tokens, rows.lengths, rows.sample_ids)
      args = (params, self._on_mesh(pp), self._device(rows, seed))
      if self._choices(plan):  # goodput's counts, given at run time
        args += (np.asarray(plan.spec.nodes, np.int32),)
      return [(self.engine(plan, rows, speculative=True), args)]
    calls = [(self.engine(plan, rows, speculative=False), (params, self._device(rows, seed)))]
    if plan.mode == Mode.PROBE:
      head = rows.head(plan.probe_rows)
      pp = self.proposer_params(state, batch, plan, slice(0, plan.probe_rows))
      plan.proposer.validate_batch(self.config, pp, head.tokens, head.lengths, head.sample_ids)
      calls.append((self.engine(plan, head, speculative=True),
                     (params, self._on_mesh(pp), self._device(head, seed))))
    return calls

  def warmup(self, params, batch: PreparedBatch, state: SpecRollState) -> float:
    """Compile every rollout program a batch of this shape can run on this machine (the vanilla
    one, the probes with Reflex awake and asleep, goodput's speculative program where a tree
    could pay at all on this machine, or the fixed budget's), without running any. Returns the
    compile seconds. ``generate`` calls it on a state's first batch, so later batches of the same
    shape compile nothing, whatever goodput chooses."""
    t0 = _exe.compile_seconds()
    params = self.place_params(params)
    states = ((ReflexMode.AWAKE, ReflexMode.ASLEEP) if self.has_reflex(state)
              else (ReflexMode.OFF,))
    plans = [self.plan(state, batch, reflex=r) for r in states]  # (Reflex falls asleep later)
    if self.budget == "goodput":
      plans += [self.plan(state, batch, probe=False)]
      plans += [self.plan(state, batch, probe=True, reflex=r) for r in states]
      if self._trees_can_pay(state, batch):
        plans += [self.plan(state, batch, reflex=r, trees=True) for r in states]
    warm = 0.0
    for plan in plans:
      for engine, args in self._calls(params, batch, state, plan, 0):
        _exe.compiled(engine, *args)
        if isinstance(engine, SpecEngine) and engine.settings.return_hidden:
          warm += self._warm_records(params, batch, state, args[2].tokens.shape[0])
    return _exe.compile_seconds() - t0 + warm

  def _warm_records(self, params, batch: PreparedBatch, state: SpecRollState, rows: int) -> float:
    """Compile the slow path's record builder for a rollout of ``rows`` rows (on zeros: what a
    batch that verifies trees on them hands it); returns the seconds."""
    if state.slow is None:
      return 0.0
    t0 = time.perf_counter()
    m, d = self.max_new_tokens, self.config.hidden_size
    zeros = lambda *sh: np.zeros(sh, np.int32)
    jax.block_until_ready(self.draw_records(
        self.decoder_params(params), state, batch,
        jnp.zeros((rows, m, d), self.config.jnp_dtype), zeros(rows, m), zeros(rows), 0).valid)
    return time.perf_counter() - t0

  def _trees_can_pay(self, state: SpecRollState, batch: PreparedBatch) -> bool:
    """Whether goodput could give any bucket of this batch a tree on this machine (with every
    node accepted: ``_counts``)."""
    return any(max(c) > 0 for c in self._counts(self.cost, len(batch),
                                                self._ranked(state.heads, False)))

  def measure_cost(self, params, state: SpecRollState, batch: PreparedBatch) -> _goodput.CostModel:
    """The step cost of this machine for the batch's largest and smallest bucket rows x
    ``cost_nodes`` (cached on disk per machine, model, proposer and shapes:
    ``goodput.measure_cost``); process 0's in every process."""
    prop = self._ranked(state.heads, False)
    plan = Plan(mode=Mode.SPECULATIVE, spec=self.spec, proposer=prop, probe_rows=len(batch),
                reflex=ReflexMode.OFF)
    pp = self.proposer_params(state, batch, plan)
    kept = self.spec.bucket_shapes(len(batch), prop.capacity)
    rows = tuple(sorted({kept[0][0], kept[-1][0]}, reverse=True))
    settings = DecodeSettings(sampling=self.sampling, max_new_tokens=self.max_new_tokens,
                              cache_length=batch.cache_length,
                              kernels=self.kernels_resolved)
    cost = _goodput.measure_cost(self.config, self.decoder_params(params), prop, pp, batch.tokens,
                                 batch.lengths, settings=settings,
                                 rows=rows, node_counts=self.cost_nodes, progress=False)
    sec = distributed.from_process0(np.asarray(cost.seconds, np.float64))
    return dataclasses.replace(cost, seconds=tuple(map(tuple, sec.tolist())))


__all__ = ["Programs"]
