"""What ``SpecRoll.generate`` reports about one batch: typed records of plain host numbers."""

from __future__ import annotations

import dataclasses

from specroll_jax.adaptation.goodput import BucketChoice
from specroll_jax.adaptation.slow_path import BatchReport
from specroll_jax.specroll.state import Mode, ReflexMode


@dataclasses.dataclass(frozen=True)
class SpecRollReport:
  """What one ``SpecRoll.generate`` call did.

  batch: the state's batch counter before it. mode: ``Mode.SPECULATIVE`` (every row verified
  trees), ``VANILLA`` (goodput verified none) or ``PROBE`` (vanilla, and the first groups also
  through the speculative engine to measure acceptance). nodes: nodes per row in each bucket
  the speculative engine ran (its buckets of the batch, or the probe's one; (0,) for a vanilla
  batch). tau:
  committed tokens per row-forward over the batch (1.0 for vanilla rows).
  probe_tau / depth_acceptance: tau and accepted / proposed per depth of the rows that verified
  trees (None / () when none did); where only some buckets verified trees, tau over their
  forwards alone (``fold.tree_tau``). expected: accepted nodes per row-step with the
  best n nodes, after this batch (what goodput weighs). reflex: ``ReflexMode``; safety:
  Reflex's global safety per head. slow: the slow path's ``slow_path.BatchReport`` (None: it did
  not run). records: slow-path records drawn per head. rollout_seconds: the rollout's
  wall-clock (the probe's included), probe_seconds: the probe's share, host_seconds: the host
  work after it, compile_seconds: programs compiled by this call (warm-up), never part of the
  other figures.
  choice: goodput's reasoning per bucket. events: what changed that a person should see, in
  words: a collapse of the heads' acceptance (the slow path refits them), a learning phase
  that starts or ends.
  """

  batch: int
  mode: Mode
  nodes: tuple[int, ...]
  tau: float
  probe_tau: float | None
  depth_acceptance: tuple[float, ...]
  expected: tuple[float, ...]
  reflex: ReflexMode
  safety: tuple[float, ...]
  slow: BatchReport | None
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


__all__ = ["SpecRollReport"]
