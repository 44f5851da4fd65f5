"""The fused sampler's tile math, shared by its Triton and Mosaic kernels: fold a tile of logits
into a running Gumbel-max and logsumexp, and combine per-split partials."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.counter_hash import gumbel_from_bits, inverse_temperature, token_bits

NEG = -1e30
BIG_ID = 2**31 - 1


def contract(layout: str):
  """dot_general dimension numbers of hidden [R, D] with the unembed in ``layout``."""
  return (((1,), (0,) if layout == "dv" else (1,)), ((), ()))


def tile_update(logits, ids, ok, key, carry, temperature):
  """Fold one [r, v] tile of f32 logits into the per-row running state.

  ids int32 [1, v] token ids; ok bool [1, v] real, not-yet-seen ids; key uint32 [r, 1] row keys.
  carry = (best_z, best_id, best_x, m, den), each [r, 1]: the best perturbed value x + g so far, its
  token id and its x, and the running max / sum of exp for logsumexp(x).
  """
  best_z, best_id, best_x, m, den = carry
  x = logits * inverse_temperature(temperature) if temperature > 0 else logits
  if temperature > 0:
    z = x + gumbel_from_bits(token_bits(key, ids))
  else:
    z = x
  z = jnp.where(ok, z, NEG)
  xm = jnp.where(ok, x, NEG)
  tile_z = jnp.max(z, axis=1, keepdims=True)
  tile_id = jnp.min(jnp.where(z == tile_z, ids, BIG_ID), axis=1, keepdims=True)  # lowest id wins
  tile_x = jnp.max(jnp.where(ids == tile_id, xm, NEG), axis=1, keepdims=True)
  better = tile_z > best_z  # strict: tiles arrive in increasing id order, so earlier ids keep ties
  best_z = jnp.where(better, tile_z, best_z)
  best_id = jnp.where(better, tile_id, best_id)
  best_x = jnp.where(better, tile_x, best_x)
  m_new = jnp.maximum(m, jnp.max(xm, axis=1, keepdims=True))
  p = jnp.where(ok, jnp.exp(xm - m_new), 0.0)
  den = den * jnp.exp(m - m_new) + jnp.sum(p, axis=1, keepdims=True)
  return best_z, best_id, best_x, m_new, den


def init_carry(rows):
  neg = jnp.full((rows, 1), NEG, jnp.float32)
  return neg, jnp.zeros((rows, 1), jnp.int32), neg, neg, jnp.zeros((rows, 1), jnp.float32)


def merge(best_z, best_id, best_x, m, den):
  """Merge per-split partials [S, R, 1] into one partial per row: five [R] arrays (best perturbed
  value, its id (lowest on ties), its x, max of x, sum of exp(x - max)). Vocabulary shards merge
  the same way across devices (``finish`` then gives the token and logprob)."""
  z = jnp.max(best_z, axis=0, keepdims=True)
  tok = jnp.min(jnp.where(best_z == z, best_id, BIG_ID), axis=0, keepdims=True)
  x_tok = jnp.max(jnp.where((best_id == tok) & (best_z == z), best_x, NEG), axis=0)
  m_max = lax.optimization_barrier(jnp.max(m, axis=0, keepdims=True))  # as in _flash.combine
  den = jnp.sum(den * jnp.exp(m - m_max), axis=0)
  return z[0, :, 0], tok[0, :, 0], x_tok[:, 0], m_max[0, :, 0], den[:, 0]


def finish(best_z, best_id, best_x, m, den):
  """(tokens [R] int32, logprobs [R] f32) of merged partials."""
  del best_z
  return best_id, best_x - (m + jnp.log(den))


def combine(*partials):
  """Combine per-split partials [S, R, 1] -> (tokens [R] int32, logprobs [R] f32)."""
  return finish(*merge(*partials))

