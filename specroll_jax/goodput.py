"""Node budgets chosen by measured goodput (docs/design.md, "Budgets by measured goodput"; the
SmartSpec rule: maximise expected committed tokens per second).

Two measured facts decide how many nodes a bucket verifies:

* cost: the seconds of one engine step for a bucket of R rows with n nodes per row, on this
  machine, model and proposer (the verify forward, the proposal and the bookkeeping), measured once
  (``measure_cost``, cached on disk keyed by everything the timing depends on) into a
  ``CostModel``. On a CPU a verify forward is compute-bound and the cost grows with R x (n + 1);
  on a GPU it is flat up to the ridge point, so the same rule grows trees there.
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
import jax.numpy as jnp
import numpy as np

from specroll_jax import buckets as _buckets
from specroll_jax.config import DecodeSettings, SpecConfig

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


def _cache_key(config, proposer, settings: DecodeSettings, rows, node_counts, prompt_width):
  from specroll_jax import _machine
  key = json.dumps([repr(config), repr(proposer), repr(settings), list(rows), list(node_counts),
                    int(prompt_width), jax.__version__, jax.devices()[0].device_kind,
                    _machine.cpu_model(), platform.machine()])
  return hashlib.sha1(key.encode()).hexdigest()[:16]


def measure_cost(config, params, proposer, proposer_params, prompts, prompt_lengths, *,
                 settings: DecodeSettings, rows, node_counts=DEFAULT_NODE_COUNTS, steps: int = 8,
                 repeats: int = 3, cache_dir: Path | str | None = None,
                 progress: bool = True) -> CostModel:
  """Time one engine step for every (rows, n) with this proposer (``prompts``: a padded [B, P]
  array of representative prompts with their ``prompt_lengths`` [B], reused cyclically to fill
  ``rows``), median of ``repeats``
  timed loops of ``steps`` steps each, compile excluded. Cached as JSON in ``cache_dir``
  (default ``<cache>/cost``) under a key of everything the timing depends on (model config,
  proposer settings, decode settings, shapes, jax version, device and CPU model)."""
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
  table = np.zeros((len(rows), len(node_counts)))
  grid = [(i, j) for i in range(len(rows)) for j in range(len(node_counts))]
  started = {}  # rows -> (batch, the state after the prefill): the same for every n
  for i, j in progress_iter(grid, "measure step cost", enabled=progress):
    r, n = rows[i], node_counts[j]
    engine = SpecEngine(config, settings, proposer, SpecConfig(bucket_fractions=(1.0,), nodes=(n,)))
    if r not in started:
      sel = np.arange(r) % len(prompts)
      batch = PromptBatch(tokens=jnp.asarray(prompts[sel]), lengths=jnp.asarray(lengths[sel]),
                          sample_ids=jnp.arange(r, dtype=jnp.int32),
                          eos_ids=jnp.asarray([-1], jnp.int32), seed=jnp.uint32(0))
      started[r] = batch, jax.jit(engine.start)(params, proposer_params, batch)
    batch, state = started[r]
    loop = jax.jit(functools.partial(engine.steps, count=steps))
    jax.block_until_ready(loop(params, proposer_params, state, batch))  # compile
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(loop(params, proposer_params, state, batch))
      times.append((time.perf_counter() - t0) / steps)
    table[i, j] = float(np.median(times))
  from specroll_jax import _machine
  model = CostModel(rows=rows, node_counts=node_counts, seconds=tuple(map(tuple, table)),
                    machine=_machine.cpu_model())
  folder.mkdir(parents=True, exist_ok=True)
  from specroll_jax.models.hf import atomic_write
  atomic_write(file, lambda tmp: Path(tmp).write_text(model.to_json()))
  return model


__all__ = ["DEFAULT_NODE_COUNTS", "BucketChoice", "CostModel", "choose", "measure_cost"]
