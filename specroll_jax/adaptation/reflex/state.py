"""Reflex's state: per-head globals, the fast state per row (or group), prediction records
waiting to mature, and their constructors."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from specroll_jax.adaptation import records as _records
from specroll_jax.adaptation.reflex.config import ReflexConfig


@flax.struct.dataclass
class ReflexGlobal:
  """Per head, across rollout batches (part of the proposer's parameters)."""

  safety: Float[Array, " K"]
  below: Int[Array, " K"]  # consecutive batches whose gain upper bound was < 0
  above: Int[Array, " K"]  # consecutive batches whose gain lower bound was > 0
  sleep: Int[Array, ""]  # batches left to sleep (``ReflexConfig.sleep_batches``; 0: awake)
  # the length of the last sleep since the last batch whose corrections paid (0: none), which
  # the next sleep doubles (``ReflexConfig.sleep_max_batches``)
  nap: Int[Array, ""]


@flax.struct.dataclass
class FastState:
  """Fast state and alignment statistics per (row or group, head): leaves [Rg, K, ...] (Rg: rows,
  or groups when rows share a state)."""

  m: Float[Array, "Rg K D"]
  count: Float[Array, "Rg K"]  # alignment observations (Welford n)
  mean: Float[Array, "Rg K"]  # running mean of the sketch cosines
  m2: Float[Array, "Rg K"]  # running sum of squared deviations
  severity: Float[Array, "Rg K"]  # accumulated severity of matured records


@flax.struct.dataclass
class Pending:
  """Prediction records waiting for their position to be committed: [R, K, S, ...], slot =
  position mod S."""

  position: Int[Array, "R K S"]  # predicted target position; -1 = empty
  hidden: Float[Array, "R K S D"]  # anchor hidden state (the heads' input)
  head: Float[Array, "R K S D"]  # corrected head output h_k' (pre final norm)
  correction: Float[Array, "R K S D"]
  qtop: Int[Array, "R K S Tq"]  # top ids of the corrected head's logits
  cand: Int[Array, "R K S C"]  # the tree's candidates at depth k (-1 = none)
  corr_top: Int[Array, "R K S C"]  # corrected head's top-k_k (counterfactual), -1 padded
  raw_top: Int[Array, "R K S C"]  # raw head's top-k_k (counterfactual), -1 padded
  sigma: Float[Array, "R K S P"]  # sketch of the fast state at proposal time
  has_sigma: Bool[Array, "R K S"]
  applied: Bool[Array, "R K S"]  # the correction was applied
  path: Int[Array, "R K S K"]  # tokens the head read (root, path above it); -1: any (Medusa)


@flax.struct.dataclass
class ReflexRows:
  """Per-row state (every leaf [R, ...]; compacted with the row)."""

  fast: FastState | None  # None when rows share a group state
  pending: Pending
  steps: Int[Array, " R"]  # verify steps this row took part in (feedback stride)
  proposed: Int[Array, " R"]  # proposals since the last update (for the statistics)
  applied: Int[Array, "R K"]  # corrections applied since the last update (for the statistics)
  ratio_sum: Float[Array, "R K"]
  lcb_sum: Float[Array, "R K"]
  lcb_n: Int[Array, "R K"]
  # root-conditioned heads: expected accepted nodes of the last proposal's best n candidates
  # (n = 0..capacity; ranked by the heads' own probabilities): what goodput weighs
  expected: Float[Array, "R Nr"] | None = None


@flax.struct.dataclass
class ReflexShared:
  """Shared across rows (not compacted)."""

  batch_rows: Int[Array, ""]
  group: FastState | None  # [G groups, K, ...] when share_group > 0
  records: _records.Records | None  # matured records for the slow path



def init_global(cfg: ReflexConfig) -> ReflexGlobal:
  k = cfg.num_heads
  return ReflexGlobal(safety=jnp.full((k,), cfg.safety_start, jnp.float32),
                      below=jnp.zeros((k,), jnp.int32), above=jnp.zeros((k,), jnp.int32),
                      sleep=jnp.int32(0), nap=jnp.int32(0))


def _reset(fast: FastState, bad) -> FastState:
  """Zero the state and statistics of the (row, head) pairs where ``bad`` [N, K]."""
  return jax.tree.map(lambda a: jnp.where(bad.reshape(bad.shape + (1,) * (a.ndim - 2)), 0, a),
                      fast)


def _zeros_fast(n: int, k: int, d: int) -> FastState:
  z = jnp.zeros((n, k), jnp.float32)
  return FastState(m=jnp.zeros((n, k, d), jnp.float32), count=z, mean=z, m2=z, severity=z)

