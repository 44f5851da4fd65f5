"""Counter-based sampling noise: the leaf module both the library and the kernels use.

The noise of token ``v`` at absolute position ``t`` of response ``sample_id`` is a pure function of
(seed, sample_id, t, v), computed by a uint32 integer hash that plain jnp and a Pallas kernel
(Triton or Mosaic) compute bit for bit. Hash: the "lowbias32" integer finaliser (C. Wellons,
hash-prospector) chained over the four words. Uniform: the top 23 bits, centred, so u lies strictly
inside (0, 1) and the Gumbel is finite (24 bits would not do: (2^24 - 1) + 0.5 is not a float32 and
rounds to 2^24, so u = 1 and the Gumbel is +inf).

This module imports nothing from ``specroll_jax`` (imports flow one way: the library uses the
kernels, never the reverse).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

SEED_SALT = 0x9E3779B9


def mix32(x):
  """lowbias32 finaliser on uint32 arrays (wrapping multiplies). Works in jnp and inside Pallas."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  x = x ^ (x >> 16)
  return x


def _u32(a):
  """Python ints up to 2**32 wrap like ``astype(uint32)`` does for int32 arrays."""
  if isinstance(a, (int, np.integer)):
    return jnp.uint32(int(a) & 0xFFFFFFFF)
  return jnp.asarray(a).astype(jnp.uint32)


def row_key(seed, sample_id, position):
  """uint32 key of one (seed, sample id, absolute position); broadcasts. Token ids mix in later."""
  h = mix32(_u32(seed) ^ jnp.uint32(SEED_SALT))
  h = mix32(h ^ _u32(sample_id))
  h = mix32(h + jnp.uint32(0x632BE5AB) ^ _u32(position))
  return h


def token_bits(key, token_ids):
  """uint32 noise bits for ``token_ids`` under row key ``key`` (broadcasts)."""
  t = token_ids.astype(jnp.uint32)
  return mix32(key ^ (t * jnp.uint32(0x85EBCA6B) + jnp.uint32(0xC2B2AE35)))


def uniform_from_bits(bits):
  """Top 23 bits -> (k + 0.5) / 2^23 in float32: exactly representable, in [2^-24, 1 - 2^-24].

  k < 2^23 is converted through int32 (bit-identical; Mosaic has no uint32 -> f32 conversion).
  """
  k = (bits >> 9).astype(jnp.int32)
  return (k.astype(jnp.float32) + 0.5) * jnp.float32(1.0 / (1 << 23))


def gumbel_from_bits(bits):
  return -jnp.log(-jnp.log(uniform_from_bits(bits)))


def inverse_temperature(temperature: float) -> np.float32:
  """The one f32 factor 1 / T that every sampling path multiplies logits by (T > 0).

  Dividing by T lowers to an approximate division on some backends (Triton); a multiply by this
  precomputed constant is exact and identical everywhere, so the kernel and the jnp path see the
  same tempered logits.
  """
  if not temperature > 0:
    raise ValueError(f"inverse_temperature: temperature must be > 0, got {temperature!r}")
  return np.float32(1.0 / float(temperature))
