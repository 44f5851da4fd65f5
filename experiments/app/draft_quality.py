"""Teacher-forced draft quality of future-token heads on the target's own rollouts, per depth,
deterministic or coupled to the target's noise (docs/design.md, "Drafts coupled to the noise").

For every anchor j of a rollout (the hidden state whose unembedding gave response token j, the
root), head k reads the true path (tokens j..j+k-1 for root-conditioned heads, the anchor alone
for Medusa heads) and ranks its candidates for token j + k with ``sampling.draft_keys`` at that
token's absolute position. A depth-k hit at n candidates: the sampled token is among the first n.
Along the true path this is exactly what a tree with n candidates under every accepted node
would accept, so ``chain_tau`` (1 + the expected accepted depth) is that tree's tau. Per (depth,
rank, probability bin) the counts say how likely a candidate of that rank and head probability is
to be the target's sample: what a calibration table learns online.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specroll_jax import sampling as _sampling
from specroll_jax._fields import int_arg
from specroll_jax.heads import conditioned as _cond
from specroll_jax.heads import medusa as _heads
from specroll_jax.proposers.ranked_heads import q_bin


@dataclasses.dataclass(frozen=True)
class DepthHits:
  """Teacher-forced draft quality over ``anchors`` anchors. hit[k][n - 1]: the share of anchors
  with a token at depth k + 1 whose token is among head k + 1's first n candidates (n = 1..top).
  chain_tau[n - 1]: 1 + the expected accepted depth of n candidates per depth along the true path.
  tested / accepted [K, top, Q]: per depth, candidate rank and half-octave bin of the candidate's
  head probability q (``proposers.ranked_heads.q_bin``), the candidates and the ones that were the
  sampled token."""

  anchors: int
  top: int
  coupled: bool
  hit: tuple[tuple[float, ...], ...]
  chain_tau: tuple[float, ...]
  tested: np.ndarray
  accepted: np.ndarray

  def acceptance(self) -> np.ndarray:
    """accepted / tested per (depth, rank, bin); NaN where nothing was tested."""
    t = self.tested.astype(np.float64)
    return np.where(t > 0, self.accepted / np.maximum(t, 1), np.nan)

  def to_dict(self) -> dict:
    """Plain values for a JSON file (the counts as nested lists)."""
    return {"anchors": self.anchors, "top": self.top, "coupled": self.coupled,
            "hit": [list(h) for h in self.hit], "chain_tau": list(self.chain_tau),
            "tested": self.tested.tolist(), "accepted": self.accepted.tolist()}


def _head_logits(config, params, heads, h, ctx):
  """[A, K, V] logits of every head at anchors h [A, D] along the true path ctx [A, K]."""
  if isinstance(heads, _cond.CondHeads):
    return _cond.apply(config, params, heads, h, ctx)
  return _heads.apply(config, params, heads, h)


def depth_hits(config, params, heads, tokens, lengths, hidden, prompt_lengths, sample_ids, seed, *,
               sampling: _sampling.SamplingConfig, coupled: bool, top: int = 4,
               q_bins: int = 12, batch: int = 512) -> DepthHits:
  """Teacher-forced depth hits of ``heads`` (root-conditioned or Medusa) on rollouts at
  ``sampling``: tokens [B, M], lengths [B], hidden [B, M, D] (``return_hidden``), each row's
  prompt length [B] and sample id [B], and the rollout's ``seed`` (the noise coordinates)."""
  top = int_arg(top, "top", 1)
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  hidden = np.asarray(hidden)
  plens, sids = np.asarray(prompt_lengths), np.asarray(sample_ids)
  for name, x in (("lengths", lengths), ("prompt_lengths", plens), ("sample_ids", sids)):
    if x.shape != tokens.shape[:1]:
      raise ValueError(f"{name} has shape {x.shape}, expected ({tokens.shape[0]},) (one per row "
                       f"of tokens {tokens.shape})")
  if hidden.shape[:2] != tokens.shape:
    raise ValueError(f"hidden has shape {hidden.shape}, expected {tokens.shape} + (D,)")
  k = heads.num_heads
  b, m = tokens.shape
  anchor, ctx, _, labels, mask = _cond.training_examples(tokens, lengths, k)
  if len(anchor) == 0:
    raise ValueError("depth_hits: the rollouts hold no anchor with a label (all lengths <= 1)")
  flat = hidden.reshape(-1, hidden.shape[-1])
  row, j = anchor // m, anchor % m
  # absolute position of token j + d: prompt length + j + d
  pos = (plens[row] + j)[:, None] + np.arange(1, k + 1)[None]
  sid = sids[row]

  @jax.jit
  def chunk(h, c, lab, p, s):
    logits = _head_logits(config, params, heads, h, c)  # [A, K, V]
    keys, lq = _sampling.draft_keys(logits, sampling, seed, s[:, None], p, coupled=coupled)
    _, ids = jax.lax.top_k(keys, top)  # [A, K, top]
    return ids == lab[..., None], q_bin(jnp.exp(jnp.take_along_axis(lq, ids, axis=-1)), q_bins)

  hits, bins = [], []
  for i in range(0, len(anchor), batch):
    s = slice(i, i + batch)
    hh, bb = chunk(jnp.asarray(flat[anchor[s]]), jnp.asarray(ctx[s]), jnp.asarray(labels[s]),
                   jnp.asarray(pos[s], jnp.int32), jnp.asarray(sid[s], jnp.int32))
    hits.append(np.asarray(hh))
    bins.append(np.asarray(bb))
  hit, qb = np.concatenate(hits), np.concatenate(bins)  # [A, K, top]
  cum = np.cumsum(hit, axis=-1) > 0  # [A, K, n]: within the first n
  share = tuple(tuple(float(cum[mask[:, d], d, n].mean()) if mask[:, d].any() else float("nan")
                      for n in range(top)) for d in range(k))
  along = np.cumprod(cum & mask[..., None], axis=1)  # [A, K, n]: every depth up to k hit
  tau = tuple(float(1.0 + along[..., n].sum(1).mean()) for n in range(top))
  tested = np.zeros((k, top, q_bins), np.int64)
  accepted = np.zeros((k, top, q_bins), np.int64)
  for d in range(k):
    for r in range(top):
      on = mask[:, d]
      tested[d, r] = np.bincount(qb[on, d, r], minlength=q_bins)
      accepted[d, r] = np.bincount(qb[on & hit[:, d, r], d, r], minlength=q_bins)
  return DepthHits(anchors=int(len(anchor)), top=top, coupled=coupled, hit=share, chain_tau=tau,
                   tested=tested, accepted=accepted)


__all__ = ["DepthHits", "depth_hits"]
