"""What ``SpecRoll.generate`` reports about one batch: typed records of plain host numbers."""

from __future__ import annotations

import dataclasses

from specroll_jax.goodput import BucketChoice


@dataclasses.dataclass(frozen=True)
class SlowReport:
  """The slow path after one batch: the monitor's decision (``slow_path.REASONS``), the heads
  refreshed, kept and rolled back, the refresh's seconds (its compile apart), its relative
  held-out TV drop (gain; None without a refresh) and whether a learning phase goes on."""

  decision: str
  heads: tuple[int, ...] = ()
  kept: tuple[int, ...] = ()
  rolled_back: tuple[int, ...] = ()
  refresh_seconds: float = 0.0
  compile_seconds: float = 0.0
  gain: float | None = None
  learning: bool = False
  acceptance: float = 0.0  # head 1's records' hit rate this batch


@dataclasses.dataclass(frozen=True)
class SpecRollReport:
  """What one ``SpecRoll.generate`` call did.

  batch: the state's batch counter before it. mode: "speculative" (every row verified trees),
  "vanilla" (goodput verified none) or "probe" (vanilla, and the first groups also through the
  speculative engine to measure acceptance). nodes: nodes per row in each bucket the speculative
  engine ran (its buckets of the batch, or the probe's one; (0,) for a vanilla batch). tau:
  committed tokens per row-forward over the batch (1.0 for vanilla rows).
  probe_tau / depth_acceptance: tau and accepted / proposed per depth of the rows that verified
  trees (None / () when none did); where only some buckets verified trees, tau over their
  forwards alone (``specroll_fold.tree_tau``). expected: accepted nodes per row-step with the
  best n nodes, after this batch (what goodput weighs). reflex: "awake", "asleep", "idle" (no
  tree this batch) or "off"; safety: Reflex's global safety per head. slow: the slow path's
  report (None: off). records: slow-path records drawn per head. rollout_seconds: the rollout's
  wall-clock (the probe's included), probe_seconds: the probe's share, host_seconds: the host
  work after it, compile_seconds: programs compiled by this call (warm-up), never part of the
  other figures.
  choice: goodput's reasoning per bucket. events: what changed that a person should see, in
  words: a collapse of the heads' acceptance (the slow path refits them), a learning phase
  that starts or ends.
  """

  batch: int
  mode: str
  nodes: tuple[int, ...]
  tau: float
  probe_tau: float | None
  depth_acceptance: tuple[float, ...]
  expected: tuple[float, ...]
  reflex: str
  safety: tuple[float, ...]
  slow: SlowReport | None
  records: tuple[int, ...]
  rollout_seconds: float
  probe_seconds: float
  host_seconds: float
  compile_seconds: float
  choice: tuple[BucketChoice, ...] = ()
  events: tuple[str, ...] = ()

  def to_dict(self) -> dict:
    """Plain values for a metrics line (JSON)."""
    return dataclasses.asdict(self)


def describe(sr, state) -> str:
  """One line for a ``SpecRoll`` object ``sr`` and its state: what proposes, how budgets are
  chosen, what adapts."""
  heads = None if state.adaptation is None else state.adaptation.heads
  if sr.proposer is not None:
    what = f"{type(sr.proposer).__name__} (custom)"
  else:
    parts = [] if heads is None else [f"{type(heads).__name__} heads"]
    if sr.lookup is not None:
      parts.append(f"group lookup (G = {sr.group_size}, own text, siblings"
                   + (", earlier responses)" if state.store is not None else ")"))
    what = " + ".join(parts) + " in one tree ranked by calibrated acceptance"
  budget = (f"goodput budgets from this machine's measured cost (probe every "
            f"{sr.probe_every}..{max(sr.probe_every, sr.probe_max_every)} batches where none "
            "pays)" if sr.budget == "goodput"
            else f"fixed budget ({sr.spec.node_budget} nodes per forward)")
  adapt = []
  if sr._has_reflex(state):
    adapt.append(f"Reflex (sleeps {sr.reflex.sleep_batches}..{sr.reflex.sleep_max_batches}"
                 " batches when unpaid)")
  if state.adaptation is not None and sr.slow.mode != "off":
    learn = (f"learning while a refit lowers held-out TV by {sr.slow.learn_gain:.1%}"
             if sr.slow.learn_gain > 0 else f"bootstrap {sr.slow.bootstrap_batches} refreshes")
    adapt.append(f"slow path {sr.slow.mode} ({learn}, {sr.records_per_batch} records per batch "
                 "from the rows that verify trees)")
  return (f"SpecRoll: {what}; {budget}; buckets {sr.spec.bucket_fractions}; adaptation: "
          + (", ".join(adapt) or "none"))


__all__ = ["SlowReport", "SpecRollReport", "describe"]
