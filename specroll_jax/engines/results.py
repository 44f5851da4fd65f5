"""What a rollout returns: ``Rollout`` (tokens, lengths, logprobs, optional hidden states) with its
``RolloutStats``; the speculative engine adds ``SpecStats``. Typed pytrees, so the traceable
entries return them from inside a caller's ``jit`` / ``shard_map`` unchanged."""

from __future__ import annotations

import warnings

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PyTree


class Summed:
  """Statistics that add up leaf by leaf (a proposer's, summed over the steps of a rollout by the
  engine): ``a.combine(b)`` is the statistics of both."""

  def combine(self, other):
    return jax.tree.map(jnp.add, self, other)


@flax.struct.dataclass
class SpecStats:
  """Counters of the speculative engine (sums over all verify forwards and rows)."""

  depth_proposed: Int[Array, " Kd"]  # row-steps whose tree reached depth k (k = 1..max depth)
  depth_accepted: Int[Array, " Kd"]  # row-steps whose accepted path reached depth k
  nodes_verified: Int[Array, ""]  # tree nodes (root excluded) verified in all row-steps
  active_trace: Int[Array, " F"]  # active rows at verify forward f (f < target_forwards; 0 after)
  bucket_forwards: Int[Array, " S"]  # verify forwards run in each (rows, N) bucket
  skipped: Int[Array, ""] = 0  # gated steps (``SpecConfig.gate``) that ran the plain decode step
  bucket_row_forwards: Int[Array, " S"] | None = None  # active rows summed over each bucket's
  #                                                      forwards
  bucket_tokens: Int[Array, " S"] | None = None  # tokens committed in each bucket
  proposer: PyTree | None = None  # the proposer's own statistics (``Proposer.update``), summed


@flax.struct.dataclass
class RolloutStats:
  target_forwards: Int[Array, ""]  # decode / verify forwards after the prefill (batch steps)
  row_forwards: Int[Array, ""]  # rows taking part, summed over those forwards and the prefill
  tokens: Int[Array, ""]  # committed response tokens in all rows
  nonfinite: Bool[Array, " B"]  # row stopped because its logits held NaN/inf
  spec: SpecStats | None = None  # speculative engine only

  @property
  def forwards(self) -> int:
    """Target forwards of the rollout including the prefill: ``target_forwards + 1`` (what every
    report and metrics line calls "forwards")."""
    return int(self.target_forwards) + 1

  @property
  def tokens_per_forward(self) -> float:
    """tau: committed tokens per row-forward (1.0 for vanilla)."""
    return float(self.tokens) / max(int(self.row_forwards), 1)

  @property
  def head_proposed(self):
    """Row-steps whose tree reached depth k (empty for the vanilla engine)."""
    return np.zeros((0,), np.int64) if self.spec is None else self.spec.depth_proposed

  @property
  def head_accepted(self):
    return np.zeros((0,), np.int64) if self.spec is None else self.spec.depth_accepted

  @property
  def nodes_verified(self):
    return 0 if self.spec is None else self.spec.nodes_verified

  @property
  def active_trace(self):
    """Active rows at each verify forward (speculative engine; trimmed to target_forwards)."""
    if self.spec is None:
      return None
    return np.asarray(self.spec.active_trace)[: max(int(self.target_forwards), 1)]

  @property
  def head_acceptance(self) -> np.ndarray:
    """Accepted / proposed per depth (empty for the vanilla engine)."""
    p = np.asarray(self.head_proposed, np.float64)
    return np.asarray(self.head_accepted, np.float64) / np.maximum(p, 1)


@flax.struct.dataclass
class Rollout:
  tokens: Int[Array, "B M"]  # response tokens; pad_id after each row's end
  lengths: Int[Array, " B"]  # response length (an EOS, when sampled, is included)
  logprobs: Float[Array, "B M"]  # logprob of each token under the sampling distribution, 0 after
  stats: RolloutStats
  hidden: Float[Array, "B M D"] | None = None  # pre-norm hidden at the anchor before token j
  proposer_state: PyTree | None = None  # the proposer's shared (not per-row) state at the end

  def decode(self, tokenizer, *, keep_eos: bool = False) -> list[str]:
    """Each row's response as text (cut at its length; a sampled EOS dropped unless
    ``keep_eos``)."""
    toks, lens = np.asarray(self.tokens), np.asarray(self.lengths)
    eos = set(tokenizer.eos_ids)
    rows = []
    for t, n in zip(toks, lens, strict=True):
      row = t[: int(n)]
      if not keep_eos and len(row) and int(row[-1]) in eos:
        row = row[:-1]
      rows.append(row)
    return tokenizer.decode_batch(rows)


def check_nonfinite(out: Rollout, on_nonfinite: str, stacklevel: int = 2) -> None:
  """The rows of ``out`` whose logits turned NaN/inf (they were stopped, never sampled): with
  ``on_nonfinite="raise"`` a FloatingPointError naming them, with "flag" a RuntimeWarning
  (``stacklevel`` counted from the caller)."""
  nf = np.asarray(out.stats.nonfinite)
  if nf.any():
    msg = f"non-finite logits in rows {np.flatnonzero(nf).tolist()}; those rows were stopped"
    if on_nonfinite == "raise":
      raise FloatingPointError(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=stacklevel + 1)

