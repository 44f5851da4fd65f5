"""Exact target verification of a speculation tree (docs/design.md, "One speculative step", steps
3-5).

One target forward on [root + nodes] at positions L + depth with the ancestor mask; the target's own
sample at every node (counter-based noise at that node's next position, so it is the token vanilla
decoding would sample there); acceptance of the deepest node whose whole path matches. The committed
tokens of a step are the target's samples along the accepted path: token j = sample at path node j,
j = 0..D (its first D equal the accepted nodes' tokens; the last is the next root).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from specroll_jax import sampling as _sampling
from specroll_jax.kernels import REFERENCE, Kernels
from specroll_jax.models import decoder as _dec
from specroll_jax.proposers.tree import Tree, accept


@flax.struct.dataclass
class VerifyResult:
  tokens: Int[Array, "R D1"]  # committed tokens, valid for j < path_len
  logprobs: Float[Array, "R D1"]  # their logprobs under the sampling distribution
  nonfinite: Bool[Array, "R D1"]  # the logits that sampled token j held NaN/inf
  path: Int[Array, "R D1"]  # node index of the accepted path at each depth
  path_len: Int[Array, " R"]  # D + 1
  hidden: Float[Array, "R D1 D"]  # pre-norm hidden at each path node (anchor of token j)
  k_path: Float[Array, "Ly R D1 Hkv Dh"]  # K/V of the path nodes, to commit at L + j
  v_path: Float[Array, "Ly R D1 Hkv Dh"]
  target_tokens: Int[Array, "R N1"]  # the target's sample at every node (for adaptation)
  accepted: Bool[Array, "R N1"]
  # with topm > 0: the sampling distribution at each path node (its top-m ids and log-probs,
  # the logsumexp of its tempered, restricted logits and the smallest logit the restriction
  # allows: ``sampling.allowed_floor``)
  topm_ids: Int[Array, "R D1 M"] | None = None
  topm_logprobs: Float[Array, "R D1 M"] | None = None
  lse: Float[Array, "R D1"] | None = None
  floor: Float[Array, "R D1"] | None = None


def path_distribution(x_path, topm: int, sampling: _sampling.SamplingConfig):
  """(top-m ids, their log-probs, logsumexp, allowed floor) of sampling-distribution logits
  x [..., V] (``allowed_logits`` under ``sampling``)."""
  lse = jax.nn.logsumexp(x_path, axis=-1)
  top_x, ids = jax.lax.top_k(x_path, topm)
  return ids, top_x - lse[..., None], lse, _sampling.allowed_floor(x_path, sampling)


def verify(config, params, tree: Tree, cache: _dec.KVCache, seed, sample_ids: Int[Array, " R"],
           sampling: _sampling.SamplingConfig, *, max_depth: int,
           kernels: Kernels = REFERENCE, topm: int = 0) -> VerifyResult:
  """Run the verify forward for ``tree`` over ``cache`` (not modified) and accept exactly.
  ``max_depth`` (static) bounds the depth of every valid node; path arrays have max_depth + 1.
  ``topm`` > 0 also returns the sampling distribution's top-m at the path nodes: taken from the
  logits the sampler computed anyway on the jnp path, from one unembedding of the path nodes
  after the fused kernel (which writes no logits)."""
  positions = cache.lengths[:, None] + tree.depth
  out = _dec.step(config, params, tree.tokens, positions, cache, tree.mask, kernels=kernels,
                  compute_logits=False)
  logits = None
  if topm > 0 and not _sampling.uses_fused_sampler(sampling, kernels):
    logits = _dec.logits_from_hidden(config, params, out.hidden)  # [R, N1, V], needed anyway
    tgt, lp, nf = _sampling.sample(logits, seed, sample_ids[:, None], positions + 1, sampling)
  else:
    tgt, lp, nf = _sampling.sample_from_hidden(config, params, out.hidden, seed,
                                               sample_ids[:, None], positions + 1, sampling,
                                               kernels)
  acc, path, path_len = accept(tree, tgt, max_depth)
  take = lambda x: jnp.take_along_axis(x, path, axis=1)
  hidden = jnp.take_along_axis(out.hidden, path[:, :, None], axis=1)
  dist = (None, None, None, None)
  if topm > 0:
    if logits is None:
      logits_path = _dec.logits_from_hidden(config, params, hidden)
    else:
      logits_path = jnp.take_along_axis(logits, path[:, :, None], axis=1)
    dist = path_distribution(_sampling.allowed_logits(logits_path, sampling), topm, sampling)
  kv_idx = path[None, :, :, None, None]
  return VerifyResult(tokens=take(tgt), logprobs=take(lp), nonfinite=take(nf), path=path,
                      path_len=path_len, hidden=hidden,
                      k_path=jnp.take_along_axis(out.k_new, kv_idx, axis=2),
                      v_path=jnp.take_along_axis(out.v_new, kv_idx, axis=2),
                      target_tokens=tgt, accepted=acc, topm_ids=dist[0], topm_logprobs=dist[1],
                      lse=dist[2], floor=dist[3])
