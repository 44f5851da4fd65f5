"""What ``SpecRoll`` folds into its state after a batch (``Folding.update``, a method of the
object): the calibration and the expected acceptance (from the rows that verified trees), Reflex's
end of batch, the store of earlier responses, the slow path on records drawn from the rollout's
own hidden states; with several processes every figure over every process's rows, and the state
checked equal everywhere."""

from __future__ import annotations

import hashlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from specroll_jax import distributed
from specroll_jax.adaptation import reflex as _reflex
from specroll_jax.adaptation import slow_path as _slow
from specroll_jax.adaptation import store as _store
from specroll_jax.adaptation import trainer_records as _trainer_records
from specroll_jax.adaptation.slow_path import BatchReport
from specroll_jax.engines.results import Rollout, check_nonfinite
from specroll_jax.proposers import MergedReflexStats
from specroll_jax.proposers.ranked import TreeStats
from specroll_jax.rollout import PreparedBatch
from specroll_jax.specroll.report import SpecRollReport
from specroll_jax.specroll.state import (
  Mode,
  Plan,
  ReflexMode,
  SpecRollState,
  place,
)


class Folding:
  """``SpecRoll``'s after-batch methods (mixed into the object; they read its settings)."""

  def update(self, params, state: SpecRollState, batch: PreparedBatch, plan: Plan, out: Rollout,
             spec: Rollout | None, seconds: float, *, seed: int = 0,
             probe_tau: float | None = None, probe_seconds: float = 0.0,
             compile_seconds: float = 0.0,
             step_seconds: float | None = None) -> tuple[SpecRollReport, SpecRollState]:
    """Fold a finished rollout ``out`` of ``batch`` into the state (``spec``: the rollout of the
    rows that verified trees, ``out`` itself or a probe's; None: none did): non-finite rows
    refused or flagged (``on_nonfinite``), the calibration and the expected acceptance from
    ``spec``'s counts, Reflex's end of batch, the store, the slow path on records drawn from
    ``spec``'s hidden states. Returns (the batch's ``SpecRollReport``, the new state)."""
    t0 = time.perf_counter()
    check_nonfinite(out, self.on_nonfinite, stacklevel=4)
    stats = None if spec is None else spec.stats.spec.proposer
    tree = stats.tree if isinstance(stats, MergedReflexStats) else stats
    cal, expected = state.calibration, state.expected
    if isinstance(tree, TreeStats) and cal is not None:
      cal = cal.update(tree.replace(tested=distributed.all_sum(tree.tested),
                                    hit=distributed.all_sum(tree.hit)))
      steps = int(distributed.all_sum(tree.row_steps))
      if steps > 0:  # an exponential average over the batches that verified trees
        e = distributed.all_sum(np.asarray(tree.expected, np.float64)) / steps
        old = np.asarray(expected, np.float64)
        w = self.calibration_decay if old[1:].any() else 0.0
        expected = jnp.asarray(w * old + (1 - w) * e, jnp.float32)
    glob, safety = state.reflex, ()
    if glob is not None:
      if plan.reflex == ReflexMode.ASLEEP:  # (host numpy: no eager op to compile later)
        glob = glob.replace(sleep=np.maximum(np.asarray(glob.sleep) - 1, 0).astype(np.int32))
      elif plan.reflex == ReflexMode.AWAKE and isinstance(stats, MergedReflexStats):
        summed = jax.tree.map(lambda x: jnp.asarray(distributed.all_sum(x)), stats.reflex)
        glob = _reflex.end_batch(self.reflex, glob, summed)
      safety = tuple(float(x) for x in np.asarray(glob.safety))
    store = state.store
    if store is not None:
      ptoks, plens = distributed.all_rows(batch.tokens), distributed.all_rows(batch.lengths)
      store = _store.store_add(store, distributed.all_rows(batch.row_prompt_ids),
                               [ptoks[i, : plens[i]] for i in range(len(plens))],
                               distributed.all_rows(out.tokens),
                               distributed.all_rows(_clean(out).lengths))
    heads, slow, report, counts, events = state.heads, state.slow, None, (), []
    was_learning = slow is not None and int(slow.monitor.learning) > 0
    if slow is not None and spec is not None and spec.hidden is not None:
      # records from the rows that verified trees; the learning's budget: its share of the
      # batches since the last that verified trees
      around = seconds if step_seconds is None else distributed.all_max(step_seconds)
      heads, slow, report = self._slow_path(params, state, batch, _clean(spec), seconds, seed,
                                            float(around) * batches_since_trees(state))
      counts, events = report.records, slow_events(report, was_learning)
    acc = ()
    if spec is not None:  # over every process's rows
      prop = distributed.all_sum(spec.stats.spec.depth_proposed).astype(np.float64)
      hit = distributed.all_sum(spec.stats.spec.depth_accepted)
      acc = tuple(float(x) for x in hit / np.maximum(prop, 1))
      if plan.mode == Mode.PROBE:
        probe_tau = tau(spec)
    gap, next_probe = int(state.probe_gap), int(state.next_probe)
    if plan.mode != Mode.VANILLA:  # measured now: when to measure next where no tree pays
      learning = slow is not None and int(slow.monitor.learning) > 0
      pays = plan.mode == Mode.SPECULATIVE
      gap = self.probe_every if pays or learning else min(
          2 * gap, max(self.probe_max_every, self.probe_every))
      next_probe = int(state.batches) + max(gap, 1)
    new = state.replace(heads=place(heads, self.mesh), reflex=place(glob, self.mesh),
                        slow=place(slow, self.mesh), calibration=cal, expected=expected,
                        store=store, batches=state.batches + 1,
                        next_probe=jnp.int32(next_probe), probe_gap=jnp.int32(gap))
    if jax.process_count() > 1:
      check_same(new)
    nodes = (0,)  # nodes per row in each bucket that ran (the probe's one bucket for a probe)
    if plan.mode != Mode.VANILLA:
      rows = plan.probe_rows
      nodes = tuple(n for _, n in plan.spec.bucket_shapes(rows, plan.proposer.capacity))
    if plan.mode == Mode.SPECULATIVE:
      probe_tau = tau(out) if all(nodes) else tree_tau(out, nodes)
    rep = SpecRollReport(
        batch=int(state.batches), mode=plan.mode, nodes=nodes, tau=tau(out), probe_tau=probe_tau,
        depth_acceptance=acc, expected=tuple(float(x) for x in np.asarray(expected)),
        reflex=plan.reflex, safety=safety, slow=report, records=counts,
        rollout_seconds=float(seconds), probe_seconds=float(probe_seconds),
        host_seconds=time.perf_counter() - t0, compile_seconds=float(compile_seconds),
        choice=plan.choice, events=tuple(events))
    return rep, new

  def draw_records(self, params, state: SpecRollState, batch: PreparedBatch, hidden, tokens,
                   lengths, seed: int):
    """``records_per_batch`` records of the slow path (always that many: one shape for the slow
    path's programs) from a rollout of the batch's first rows
    (``hidden`` [R, M, D], its ``tokens`` and ``lengths``; never more anchors than the R x M the
    rollout can hold): ``trainer_records.from_hidden`` with the candidates coupled as the tree
    ranks them (``params``: the decoder's)."""
    rows, m = tokens.shape
    if self.mesh is None:  # on this process's first device, committed: an engine's outputs and
      # the warm-up's zeros then share one compiled builder. On a mesh the outputs stay where the
      # engine left them (replicating them here dispatches a reshard beside the builder, whose
      # collectives XLA's CPU runtime under jax 0.11 can interleave into a deadlock)
      hidden, tokens, lengths = place((hidden, tokens, lengths))
    key = jax.random.fold_in(jax.random.key(seed), int(state.batches))
    return _trainer_records.from_hidden(
        self.records_reflex(state.heads), self.config, params, state.heads, hidden, tokens,
        lengths, jnp.asarray(batch.lengths[:rows]), sampling=self.sampling, key=key,
        num_anchors=self.records_per_batch, seed=seed,
        sample_ids=batch.sample_ids[:rows])

  def _slow_path(self, params, state: SpecRollState, batch: PreparedBatch, out: Rollout, seconds,
                 seed, step_seconds=None):
    """Records drawn from the anchor hidden states of ``out`` (the rollout of the batch's first
    rows that verified trees: all of them, or a probe's; every process's), then the slow path's
    monitor and refresh (``slow_path.after_batch``); each head's acceptance is its records' hit
    rate (the committed token among its coupled candidates), whatever the tree proposed.
    Returns (heads, slow-path state, ``BatchReport``)."""
    params = self.decoder_params(params)
    recs = self.draw_records(params, state, batch, out.hidden, out.tokens, out.lengths, seed)
    if jax.process_count() > 1:
      recs = jax.tree.map(lambda x: jnp.asarray(
          distributed.all_sum(x) if x.ndim == 1 else distributed.all_concat(x, 1)), recs)
    valid = np.asarray(recs.valid, np.float64)
    hit = np.asarray(recs.hit, np.float64) * valid
    acc = np.where(valid.sum(1) > 0, hit.sum(1) / np.maximum(valid.sum(1), 1), np.nan)
    slow, heads, rep = _slow.after_batch(self.slow, state.slow, self.config, params, state.heads,
                                         recs, jnp.asarray(acc, jnp.float32), float(seconds),
                                         step_seconds)
    if jax.process_count() > 1:  # the refresh's clock as the slowest process measured it
      m = slow.monitor
      slow = slow.replace(monitor=m.replace(**{k: jnp.float32(distributed.all_max(getattr(m, k)))
                                               for k in ("refresh_seconds",
                                                         "last_refresh_seconds")}))
    return heads, slow, rep


def _clean(r: Rollout | None) -> Rollout | None:
  """``r`` with its flagged (non-finite) rows emptied: nothing to learn from (no response, no
  anchor, no NaN left)."""
  if r is None or not np.asarray(r.stats.nonfinite).any():
    return r
  bad = r.stats.nonfinite
  hidden = None if r.hidden is None else jnp.where(bad[:, None, None], 0, r.hidden)
  return r.replace(lengths=jnp.where(bad, 0, r.lengths), hidden=hidden)


def slow_events(slow: BatchReport, was_learning: bool) -> list[str]:
  """What the slow path did that a person should see, in words (``SpecRollReport.events``)."""
  events = []
  gain = "" if slow.gain is None else f" (the refit lowered held-out TV by {slow.gain:.1%})"
  if slow.decision == "collapse":
    head1 = float(np.nan_to_num(slow.acceptance[0])) if slow.acceptance else 0.0
    events.append(f"collapse: head 1 accepted {head1:.3f} of its records: every head "
                  "is refitted and learns again" + gain)
  elif slow.learning and not was_learning:
    events.append("learning phase starts" + gain)
  if was_learning and not slow.learning:
    events.append("learning phase ends" + gain)
  return events


def batches_since_trees(state: SpecRollState) -> int:
  """The batches since the last that verified trees (a probe's or goodput's), this one included:
  1 when that was the previous batch (or there was none); the gap between probes where only
  probes verify trees (``next_probe`` is that batch plus ``probe_gap``, at least 1)."""
  b = int(state.batches)
  last = int(state.next_probe) - max(int(state.probe_gap), 1)
  return max(1, min(b - last, b + 1))


def tree_tau(out: Rollout, nodes) -> float | None:
  """Committed tokens per row-forward in the buckets that verified trees (``nodes``: each
  bucket's nodes per row), over every process's rows; None when none did."""
  sp = out.stats.spec
  on = np.asarray(nodes) > 0
  if sp is None or sp.bucket_tokens is None or not on.any():
    return None
  tok = np.asarray(distributed.all_sum(sp.bucket_tokens), np.float64)[on].sum()
  rf = np.asarray(distributed.all_sum(sp.bucket_row_forwards), np.float64)[on].sum()
  return float(tok / rf) if rf > 0 else None


def tau(out: Rollout) -> float:
  """Committed tokens per row-forward over every process's rows."""
  st = out.stats
  return float(distributed.all_sum(st.tokens)) / max(float(distributed.all_sum(
      st.row_forwards)), 1.0)


def check_same(state: SpecRollState) -> None:
  """RuntimeError unless every process holds the same state (what all-reduced statistics and
  shared records guarantee; a bug here would silently split the processes' proposals)."""
  d = hashlib.blake2b(digest_size=8)
  for x in jax.tree.leaves(state):
    d.update(np.ascontiguousarray(np.asarray(x)).tobytes())
  mine = np.frombuffer(d.digest(), np.int32).copy()
  every = np.asarray(distributed.all_rows(mine[None]))
  if not (every == mine[None]).all():
    raise RuntimeError("SpecRoll's state differs between processes after this batch")


__all__ = ["Folding", "batches_since_trees", "check_same", "slow_events", "tau", "tree_tau"]
