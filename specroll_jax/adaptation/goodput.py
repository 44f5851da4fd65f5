"""Node budgets chosen by measured goodput (docs/design.md, "Budgets by measured goodput"; the
SmartSpec rule: maximise expected committed tokens per second).

Two measured facts decide how many nodes a bucket verifies:

* cost: the seconds of one engine step for a bucket of R rows with n nodes per row, on this
  machine, model and proposer (the verify forward, the proposal and the bookkeeping), measured once
  at up to six (R, n) points (the plain step, the smallest and the largest tree, at the most and
  the fewest rows), one compiled program each (``measure_cost``, cached on disk keyed by
  everything the timing depends on), and tabulated (``fit_cost``) into a ``CostModel``. On a CPU
  a verify forward is compute-bound and the cost grows with R x (n + 1); on a GPU it is flat up
  to the ridge point, so the same rule grows trees there.
* acceptance: the expected accepted nodes per row-step with the best n candidates, from the
  calibrated estimates of a ranked proposer (``proposers.ranked.TreeStats.expected``), carried
  from the previous batches.

``choose`` gives every bucket the n in the compiled set that maximises (1 + E[accepted | n]) /
cost(R, n); where no tree pays, n = 0 (the plain decode step). Shapes stay static: the choice is a
``SpecConfig(nodes=...)`` made on the host per batch; each distinct choice compiles once.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import platform
import time
from pathlib import Path

import jax
import numpy as np

from specroll_jax.engines import buckets as _buckets
from specroll_jax.engines.config import DecodeSettings, SpecConfig

DEFAULT_NODE_COUNTS = (0, 1, 2, 4, 8)


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Seconds of one engine step per (bucket rows, nodes per row) on one machine.

  rows: measured bucket row counts (descending). node_counts: measured n (0 first).
  seconds[i][j]: one step of a ``rows[i]``-row bucket with ``node_counts[j]`` nodes per row.
  """

  rows: tuple[int, ...]
  node_counts: tuple[int, ...]
  seconds: tuple[tuple[float, ...], ...]
  machine: str = ""

  def __post_init__(self):
    rows, nodes = tuple(int(r) for r in self.rows), tuple(int(n) for n in self.node_counts)
    if not rows or any(r < 1 for r in rows) or list(rows) != sorted(set(rows))[::-1]:
      raise ValueError(f"CostModel.rows must be distinct ints >= 1, descending, got {self.rows}")
    if not nodes or nodes[0] != 0 or list(nodes) != sorted(set(nodes)):
      raise ValueError(f"CostModel.node_counts must start at 0 and ascend, got {self.node_counts}")
    sec = np.asarray(self.seconds, np.float64)
    if sec.shape != (len(rows), len(nodes)):
      raise ValueError(f"CostModel.seconds has shape {sec.shape}, expected ({len(rows)}, "
                       f"{len(nodes)}) (rows x node_counts)")
    if not (np.isfinite(sec).all() and (sec > 0).all()):
      raise ValueError("CostModel.seconds must be finite and > 0")
    object.__setattr__(self, "rows", rows)
    object.__setattr__(self, "node_counts", nodes)
    object.__setattr__(self, "seconds", tuple(tuple(float(x) for x in r) for r in sec))

  def cost(self, rows: int, n: int) -> float:
    """Seconds of a step with ``rows`` rows and ``n`` nodes per row (n measured; rows linearly
    interpolated between measured row counts, extrapolated in proportion beyond them)."""
    if n not in self.node_counts:
      raise ValueError(f"n={n} was not measured (node_counts {self.node_counts})")
    j = self.node_counts.index(n)
    rs = np.asarray(self.rows[::-1], np.float64)
    col = np.asarray([r[j] for r in self.seconds[::-1]], np.float64)
    if rows <= rs[0]:
      return float(col[0] * rows / rs[0]) if len(rs) == 1 else float(
          max(col[0] + (rows - rs[0]) * (col[1] - col[0]) / (rs[1] - rs[0]), col[0] * 0.5))
    if rows >= rs[-1]:
      return float(col[-1] * rows / rs[-1])
    return float(np.interp(rows, rs, col))

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self))

  @classmethod
  def from_json(cls, text: str) -> CostModel:
    d = json.loads(text)
    return cls(rows=tuple(d["rows"]), node_counts=tuple(d["node_counts"]),
               seconds=tuple(tuple(r) for r in d["seconds"]), machine=d.get("machine", ""))


@dataclasses.dataclass(frozen=True)
class BucketChoice:
  """Why ``choose`` gave a bucket its nodes: its rows, the chosen n, the gate (None: none) and the
  expected tokens per second of every candidate n, as (n, rate) pairs."""

  rows: int
  nodes: int
  gate: float | None
  tokens_per_s: tuple[tuple[int, float], ...]


def choose(cost: CostModel, expected, batch: int, spec: SpecConfig, *, capacity: int,
           margin: float = 0.03, gated: bool = False
           ) -> tuple[SpecConfig, tuple[BucketChoice, ...]]:
  """The ``SpecConfig`` whose ``nodes`` give each bucket of a ``batch``-row batch the measured
  node count n (<= capacity) with the most expected tokens per second, and the reasoning per
  bucket (rows, chosen n, tokens/s of every candidate).

  expected[n]: expected accepted nodes per row-step with the best n candidates (n = 0..; e.g.
  ``TreeStats.expected_per_row_step()``); an n beyond its length is not considered. A tree must
  beat the plain step by ``margin`` (relative) to be chosen.

  gated: decide per step as well. Every bucket gets the n with the most tokens per second among
  n > 0 and a gate at its break-even point, cost(R, n) / cost(R, 0) - 1 expected accepted nodes
  per active row: steps whose proposals promise less run the plain decode step
  (``SpecConfig.gate``). Where even the best tree's average rate loses, the gate still lets the
  steps that pay verify.
  """
  e = np.asarray(expected, np.float64)
  if e.ndim != 1 or e.size < 1:
    raise ValueError(f"expected must be a 1-D array over n = 0.., got shape {e.shape}")
  nodes, gates, why = [], [], []
  kept = dict((i, r) for r, i in _buckets.kept_buckets(batch, spec.bucket_fractions))
  for i in range(len(spec.bucket_fractions)):
    rows = kept.get(i)
    if rows is None:
      nodes.append(0)
      gates.append(None)
      continue
    rate = {}
    for n in cost.node_counts:
      if n <= capacity and n < e.size:
        rate[n] = (1.0 + e[n]) / cost.cost(rows, n)
    if gated and len(rate) > 1:
      best = max((n for n in rate if n > 0), key=rate.get)
      gate = cost.cost(rows, best) / cost.cost(rows, 0) - 1.0
    else:
      best, gate = max(rate, key=rate.get), None
      if best > 0 and rate[best] < rate[0] * (1 + margin):
        best = 0
    nodes.append(best)
    gates.append(gate)
    why.append(BucketChoice(rows=rows, nodes=best, gate=gate,
                            tokens_per_s=tuple((int(k), float(v)) for k, v in rate.items())))
  return dataclasses.replace(spec, nodes=tuple(nodes),
                             gate=tuple(gates) if gated else None), tuple(why)


def measured_points(rows, node_counts) -> tuple[tuple[int, int], ...]:
  """The (rows, n) steps ``measure_cost`` times, one compiled program each: at the most and at
  the fewest rows (one row count when they are equal), the plain step, the smallest tree and the
  largest tree of ``node_counts`` (at most 6 points)."""
  rows, nodes = [int(r) for r in rows], sorted({0, *(int(n) for n in node_counts)})
  trees = [n for n in nodes if n > 0]
  per_row = [0] + ([trees[0]] if trees else []) + ([trees[-1]] if len(trees) > 1 else [])
  return tuple((r, n) for r in sorted({max(rows), min(rows)}, reverse=True) for n in per_row)


def fit_cost(rows, node_counts, measured, machine: str = "") -> CostModel:
  """The ``CostModel`` over the measured row counts x ``node_counts`` from the seconds
  ``measured[(R, n)]`` at the ``measured_points``: at each measured row count, the plain step,
  the smallest and the largest tree as measured, a node count between them on the line through
  its neighbours (a tree's cost is affine in its nodes above a fixed price per step: the proposal,
  the tree's bookkeeping, the tree mask; measured at the tail of a batch on the CPU a 1-node tree
  costs far more than a quarter of a 4-node one's extra, so the smallest tree is measured, not
  extrapolated from 0). ``CostModel.cost`` interpolates in rows between the measured counts. A
  reading that noise put out of order is clamped: a tree never costs less than a smaller one at
  the same rows, and a step at more rows never less than at fewer. So the cost is > 0 and
  non-decreasing in n and in rows."""
  rows = tuple(sorted({int(r) for r in rows}, reverse=True))
  nodes = tuple(sorted({0, *(int(n) for n in node_counts)}))
  points = measured_points(rows, nodes)
  missing = [p for p in points if p not in measured]
  if missing:
    raise ValueError(f"fit_cost needs the seconds at {points}, missing {missing}")
  sec = {p: float(measured[p]) for p in points}
  if not all(np.isfinite(s) and s > 0 for s in sec.values()):
    raise ValueError(f"measured seconds must be finite and > 0, got {sec}")
  kept = tuple(sorted({r for r, _ in points}, reverse=True))
  table = []
  for r in kept:
    xs = sorted(n for rr, n in points if rr == r)
    ys = np.maximum.accumulate([sec[(r, n)] for n in xs])  # never cheaper with more nodes
    table.append([float(np.interp(n, xs, ys)) if n <= xs[-1] else
                  float(ys[-1] + (n - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
                  for n in nodes])
  table = np.asarray(table)
  for i in range(len(kept) - 2, -1, -1):  # more rows never cost less than fewer
    table[i] = np.maximum(table[i], table[i + 1])
  return CostModel(rows=kept, node_counts=nodes, seconds=table.tolist(), machine=machine)


_CACHE_VERSION = 4  # 4: up to 6 points, piecewise (3: per-layer weights outside the programs)


def _cache_key(config, proposer, settings: DecodeSettings, rows, node_counts, prompt_width):
  from specroll_jax import _machine
  key = json.dumps([_CACHE_VERSION, repr(config), repr(proposer), repr(settings), list(rows),
                    list(node_counts), int(prompt_width), jax.__version__,
                    jax.devices()[0].device_kind, _machine.cpu_model(), platform.machine()])
  return hashlib.sha1(key.encode()).hexdigest()[:16]


def _start_or_steps(engine, count, params, proposer_params, state, batch, fresh):
  """The state after the prefill of ``batch`` where ``fresh``, else ``count`` steps of ``state``
  (one program: only the branch taken runs). The result's leaves are strongly typed, as host
  arrays are, so that the state it returns calls the same program again."""
  out = jax.lax.cond(fresh, lambda: engine.start(params, proposer_params, batch),
                     lambda: engine.steps(params, proposer_params, state, batch, count=count))
  return jax.tree.map(lambda x: jax.lax.convert_element_type(x, x.dtype), out)


def measure_cost(config, params, proposer, proposer_params, prompts, prompt_lengths, *,
                 settings: DecodeSettings, rows, node_counts=DEFAULT_NODE_COUNTS, steps: int = 8,
                 repeats: int = 3, cache_dir: Path | str | None = None,
                 progress: bool = True) -> CostModel:
  """The step cost of this proposer over ``rows`` x ``node_counts``, tabulated (``fit_cost``)
  from one engine step timed at each of the ``measured_points``: at most 6 compiled programs, one
  per point (``prompts``: a padded [B, P] array of representative prompts with their
  ``prompt_lengths`` [B], reused cyclically to fill the rows). The first point at a row count
  compiles the prefill and a loop of ``steps`` steps behind a ``lax.cond`` (one call prefills,
  the others run the loop from the state after the prefill); the other point at that row count
  compiles the loop alone and runs it from the same state. Each time is the median of
  ``repeats`` loops, compile and prefill excluded. No other program compiles (the inputs are
  host arrays). Cached as JSON in ``cache_dir`` (default ``<cache>/cost``) under a key of
  everything the timing depends on (model config, proposer settings, decode settings, shapes,
  jax version, device and CPU model)."""
  from specroll_jax import _machine
  from specroll_jax import cache as _cache
  from specroll_jax.engines import PromptBatch, SpecEngine
  from specroll_jax.progress import progress_iter
  rows = tuple(sorted({int(r) for r in rows}, reverse=True))
  node_counts = tuple(sorted({0, *(int(n) for n in node_counts)}))
  prompts = np.asarray(prompts, np.int32)
  key = _cache_key(config, proposer, settings, rows, node_counts, prompts.shape[1])
  folder = Path(cache_dir) if cache_dir is not None else _cache.cache_dir() / "cost"
  file = folder / f"cost-{key}.json"
  if file.exists():
    return CostModel.from_json(file.read_text())
  lengths = np.asarray(prompt_lengths, np.int32)
  if lengths.shape != (len(prompts),) or (lengths < 1).any() or (lengths > prompts.shape[1]).any():
    raise ValueError(f"prompt_lengths must be [{len(prompts)}] ints in [1, {prompts.shape[1]}], "
                     f"got {lengths}")
  # Per-layer weight buffers made once, outside every timed program: a program that slices the
  # stacked weights itself and then loops (``SpecEngine.steps``) copies the slices on every call on
  # the CPU (measured: 0.5B shape, 2 rows, 174 vs 121 ms per plain step), which a rollout pays
  # once. The rollout's per-step cost is what goodput prices.
  from specroll_jax.models import decoder as _dec
  params = jax.block_until_ready(jax.jit(_dec.unstack_layers)(params))
  measured, started = {}, {}  # started: rows -> (batch, the state after the prefill)
  for r, n in progress_iter(measured_points(rows, node_counts), "measure step cost",
                            enabled=progress):
    engine = SpecEngine(config, settings, proposer, SpecConfig(bucket_fractions=(1.0,), nodes=(n,)))
    if r in started:  # the prefill's state does not depend on n: the loop alone
      batch, state = started[r]
      call = functools.partial(jax.jit(functools.partial(engine.steps, count=steps)), params,
                               proposer_params, batch=batch)
    else:
      sel = np.arange(r) % len(prompts)
      batch = PromptBatch(tokens=prompts[sel], lengths=lengths[sel],
                          sample_ids=np.arange(r, dtype=np.int32),
                          eos_ids=np.asarray([-1], np.int32), seed=np.uint32(0))
      shapes = jax.eval_shape(engine.start, params, proposer_params, batch)
      blank = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
      run = jax.jit(functools.partial(_start_or_steps, engine, steps))
      state = run(params, proposer_params, blank, batch=batch, fresh=np.bool_(True))  # compile
      started[r] = batch, state
      call = functools.partial(run, params, proposer_params, batch=batch, fresh=np.bool_(False))
    jax.block_until_ready(call(state))  # compile (the loop alone), warm
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(call(state))
      times.append((time.perf_counter() - t0) / steps)
    measured[(r, n)] = float(np.median(times))
  model = fit_cost(rows, node_counts, measured, machine=_machine.cpu_model())
  folder.mkdir(parents=True, exist_ok=True)
  from specroll_jax.models.hf import atomic_write
  atomic_write(file, lambda tmp: Path(tmp).write_text(model.to_json()))
  return model


__all__ = ["DEFAULT_NODE_COUNTS", "BucketChoice", "CostModel", "choose", "fit_cost",
           "measure_cost", "measured_points"]
