"""Reflex's closed-form feedback from a matured prediction record (docs/design.md, "Feedback
from a matured record"): no backprop, unembedding rows only."""

from __future__ import annotations

from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from specroll_jax import _topk
from specroll_jax.adaptation import records as _records
from specroll_jax.adaptation.records import member as _member
from specroll_jax.adaptation.reflex.config import ReflexConfig
from specroll_jax.models import decoder as _dec
from specroll_jax.sampling import inverse_temperature


def _first_occurrence(ids):
  """ids [.., U] -> mask of entries >= 0 that do not repeat an earlier entry."""
  u = ids.shape[-1]
  same = ids[..., :, None] == ids[..., None, :]  # [.., U, U]
  earlier = jnp.tril(jnp.ones((u, u), bool), k=-1)
  return (ids >= 0) & ~(same & earlier).any(-1)


@flax.struct.dataclass
class Matured:
  """Feedback computed from records (leaves [.., ...] over records)."""

  g: Float[Array, "... D"]  # feedback vector
  tv: Float[Array, "..."]
  out: Float[Array, "..."]  # target mass the candidates missed
  severity: Float[Array, "..."]
  support: Int[Array, "... U"]  # the support S (-1 where not in it)
  p: Float[Array, "... U"]  # target distribution renormalised on S
  p_tail: Float[Array, "..."]  # target mass outside S (full vocabulary)
  gain: Float[Array, "..."]  # p(corrected top-k) - p(raw top-k)


def feedback(cfg: ReflexConfig, target, head_out, ids_q, ids_p, token, cand, corr_top, raw_top,
             path_hidden, lse, floor=None) -> Matured:
  """Feedback of matured records (docs/design.md, "Feedback from a matured record").

  head_out [.., D]: the corrected head output h_k'; ids_q / ids_p [.., top]: top ids of q and of
  the target's p; token [..]: the committed token; cand / corr_top / raw_top [.., C]; path_hidden
  [.., D]: the target's anchor hidden state of the committed position; lse [..]: logsumexp of the
  target's tempered (top-k/top-p restricted) logits there; floor [..]: the smallest tempered logit
  that restriction allows (``sampling.allowed_floor``; None or -inf: every token): an id below it
  has target probability 0, though it may sit on S (the head's top ids, its candidates, the
  padding of a top-m wider than the allowed set). Support S = top(q) u top(p) u {token} u C (at
  most 2 top + 1 + C ids), p_S and q_S renormalised on S at the sampling temperature.
  """
  config, params = target.config, target.params
  inv_t = 1.0 if target.sampling.greedy else float(inverse_temperature(
      target.sampling.temperature))
  ids = jnp.concatenate([ids_q, ids_p, token[..., None], corr_top, raw_top], axis=-1)
  first = _first_occurrence(ids)
  in_s = first & (_member(ids, ids_q) | _member(ids, ids_p) | (ids == token[..., None])
                  | _member(ids, cand))
  w_rows = _dec.unembedding_rows(config, params, ids).astype(jnp.float32)  # [.., U, D]
  norm_p = _dec.final_norm(config, params, path_hidden).astype(jnp.float32)
  norm_q = _dec.final_norm(config, params, head_out).astype(jnp.float32)
  xp = jnp.einsum("...d,...ud->...u", norm_p, w_rows) * inv_t
  xq = jnp.einsum("...d,...ud->...u", norm_q, w_rows) * inv_t
  allowed = first
  if floor is not None:  # the restriction's floor, less a rounding margin: xp is recomputed here
    allowed = first & (xp >= (floor - 1e-5 * (1.0 + jnp.abs(floor)))[..., None])
  p_full = jnp.where(allowed, jnp.exp(xp - lse[..., None]), 0.0)  # exact target probabilities
  on_s = lambda m, x: jnp.where(m, jax.nn.softmax(jnp.where(m, x, -jnp.inf), axis=-1), 0.0)
  p_s = on_s(in_s & allowed, xp)  # the target's p renormalised on its allowed ids in S
  q_s = on_s(in_s, xq)
  tv = 0.5 * jnp.abs(p_s - q_s).sum(-1)
  in_c = first & _member(ids, cand)
  out = jnp.clip(1.0 - (p_full * in_c).sum(-1), 0.0, 1.0)
  # coverage: target mass in top(p) outside the candidates, moved from the weakest candidates
  miss = in_s & _member(ids, ids_p) & ~in_c
  miss_mass = (p_s * miss).sum(-1)
  xq_c = jnp.where(in_c, xq, jnp.inf)
  kth = -_topk.top_k(-xq_c, min(cfg.weak, ids.shape[-1]))[0][..., -1:]  # weak-th smallest
  weak = in_c & (xq_c <= kth)
  beta = jnp.where(weak, jax.nn.softmax(jnp.where(weak, xq, -jnp.inf), axis=-1), 0.0)
  beta = jnp.where(weak.any(-1, keepdims=True), beta, 0.0)
  w = (cfg.dist_weight * (p_s - q_s) + cfg.cov_weight * (p_s * miss)
       - cfg.cov_weight * miss_mass[..., None] * beta)
  g = jnp.einsum("...u,...ud->...d", w, w_rows)
  severity = jnp.clip(0.5 * tv + 0.5 * out, 0.0, 1.0)
  gain = (p_full * (first & _member(ids, corr_top))).sum(-1) - (
      p_full * (first & _member(ids, raw_top))).sum(-1)
  p_tail = jnp.clip(1.0 - (p_full * in_s).sum(-1), 0.0, 1.0)
  return Matured(g=g, tv=tv, out=out, severity=severity, support=jnp.where(in_s, ids, -1), p=p_s,
                 p_tail=p_tail, gain=gain)


class _Matured(NamedTuple):
  """What one step's matured records contribute (``ReflexProposer._mature``): per (row, head)
  observation count / sum / sum of squares, severity added, the fast state's increment dm
  [R, K, D], non-finite feedback, the slow path's records and the per-head statistics."""

  cnt: jax.Array
  tot: jax.Array
  sq: jax.Array
  sev_add: jax.Array
  dm: jax.Array
  bad: jax.Array
  records: _records.Records | None
  stats: object  # ReflexStats (the matured records' fields)

