"""Pieces shared by the Triton and Mosaic tree-attention bodies: the online-softmax (flash
attention) step, the split combine, and the query / mask tiling.

Masked scores are -1e30 (finite, not -inf) and masked probabilities are forced to exactly 0, so a
row with no allowed key ends with den = 0 and acc = 0 and normalises to zeros, never NaN.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

NEG = -1e30


def dot_precision(dtype):
  """Full precision for f32 operands (Triton would otherwise round them to TF32); None (the
  backend default, exact products with f32 accumulation) for 16-bit operands."""
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def online_update(q, k, v, allowed, m, den, acc, *, scale, precision):
  """One flash-attention step over a block of n keys.

  q [M, W]; k, v [n, W]; allowed: None (every key allowed: no select at all) or bool
  broadcastable to [M, n]; m, den [M, 1] f32; acc [M, W] f32. Returns the new (m, den, acc).
  """
  s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                      precision=precision) * scale
  if allowed is not None:
    s = jnp.where(allowed, s, NEG)
  m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
  alpha = jnp.exp(m - m_new)
  p = jnp.exp(s - m_new)
  if allowed is not None:
    p = jnp.where(allowed, p, 0.0)
  den_new = alpha * den + jnp.sum(p, axis=1, keepdims=True)
  pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                       preferred_element_type=jnp.float32, precision=precision)
  return m_new, den_new, alpha * acc + pv


def init_state(rows: int, width: int):
  """(m, den, acc) before the first key: m = -1e30, den = 0, acc = 0."""
  return (jnp.full((rows, 1), NEG, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
          jnp.zeros((rows, width), jnp.float32))


def normalise(acc, den):
  return acc / jnp.where(den == 0.0, 1.0, den)


def combine(acc, m, den, *, split_axis: int):
  """Flash-decoding combine of split partials: acc [..., S, M, W], m and den [..., S, M, 1].

  The optimization barrier on the max is the one jax's own decode attention uses against NaNs
  appearing after JIT (b/389925439). All-masked splits have den = 0 and acc = 0 whatever their
  weight, so they drop out.
  """
  m_max = lax.optimization_barrier(jnp.max(m, axis=split_axis, keepdims=True))
  w = jnp.exp(m - m_max)
  den_tot = jnp.sum(w * den, axis=split_axis)
  acc_tot = jnp.sum(w * acc, axis=split_axis)
  return normalise(acc_tot, den_tot)


# ------------------------------------------ query tiling ------------------------------------------

def query_tiling(t: int, g: int, block_q: int, *, pow2: bool, row_multiple: int = 8):
  """(tq, n_q, rows): tq tokens x g heads per tile (tq * g <= block_q unless g alone exceeds it),
  n_q tiles covering T (tq balanced so the last tile is not mostly padding), and the padded row
  count of a tile: the next power of two >= 16 (Triton ``tl.dot``) or a multiple of
  ``row_multiple`` (TPU sublanes: 8 for 32-bit, 16 for 16-bit dtypes)."""
  tq = max(1, min(block_q // g, t))
  n_q = -(-t // tq)
  tq = -(-t // n_q)
  rows = tq * g
  if pow2:
    rows = max(16, 1 << (rows - 1).bit_length())
  else:
    rows = -(-rows // row_multiple) * row_multiple
  return tq, n_q, rows


def tile_queries(q, hkv: int, tq: int, n_q: int, rows: int):
  """q [B, T, H, Dh] -> [B, Hkv, n_q, rows, Dh]: row s * g + j of tile i is token i * tq + s,
  head k * g + j; padding tokens and rows are zeros."""
  b, t, h, dh = q.shape
  g = h // hkv
  q = jnp.pad(q, ((0, 0), (0, n_q * tq - t), (0, 0), (0, 0)))
  q = q.reshape(b, n_q, tq, hkv, g, dh).transpose(0, 3, 1, 2, 4, 5).reshape(b, hkv, n_q, tq * g, dh)
  return jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, rows - tq * g), (0, 0)))


def untile_queries(out, t: int, g: int, tq: int):
  """Inverse of ``tile_queries``: [B, Hkv, n_q, rows, Dh] -> [B, T, H, Dh]."""
  b, hkv, n_q, _, dh = out.shape
  out = out[:, :, :, :tq * g].reshape(b, hkv, n_q, tq, g, dh).transpose(0, 2, 3, 1, 4, 5)
  return out.reshape(b, n_q * tq, hkv * g, dh)[:, :t]


def tile_mask(tree_mask, tq: int, n_q: int, cols: int, dtype, tile_rows: int | None = None):
  """tree_mask [B, T, T] -> [B, n_q, tile_rows, cols] in ``dtype`` (1 allowed, 0 not): tile i holds
  the mask rows of its tq tokens (then zero rows up to tile_rows, default tq); key columns are
  zero-padded to ``cols``. Token granularity: never repeated per head."""
  b, t, _ = tree_mask.shape
  m = jnp.pad(tree_mask != 0, ((0, 0), (0, n_q * tq - t), (0, cols - t)))
  m = m.reshape(b, n_q, tq, cols)
  if tile_rows is not None and tile_rows > tq:
    m = jnp.pad(m, ((0, 0), (0, 0), (0, tile_rows - tq), (0, 0)))
  return m.astype(dtype)


# Most splits of L one call runs: bounds the f32 partials (S x the output, in f32) and the grid.
MAX_SPLITS = 256


def split_geometry(n_tiles: int, num_splits: int):
  """(tiles per split, split count) for a cache of ``n_tiles`` blocks: at most ``MAX_SPLITS``
  splits, each owning >= 1 block of the full cache (static: the grid's split axis)."""
  s = max(1, min(num_splits, n_tiles, MAX_SPLITS))
  tps = -(-n_tiles // s)
  return tps, -(-n_tiles // tps)


def row_split(length, splits: int, block: int):
  """Cache blocks per split for one row with ``length`` valid positions (traced int32): its
  ceil(length / block) blocks dealt out in order, ceil(blocks / splits) to each split, so the
  work follows the row's own length, not L (the last splits may get fewer blocks or none). With
  one split, that one split walks every valid block. ``splits`` and ``block`` are static."""
  n_blocks = lax.div(length + (block - 1), block)
  return lax.div(n_blocks + (splits - 1), splits)
