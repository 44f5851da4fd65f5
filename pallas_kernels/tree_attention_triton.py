"""Tree attention, Pallas Triton body (GPU). Called by ``tree_attention.tree_attention``.

Grid (B, Hkv, query tiles, S). Program (b, k, i, s) holds query tile i of kv head k (rows
[M, Dh], see ``_flash.query_tiling``) and walks, with dynamic trip counts:
  1. split s's share of row b's valid cache: the row's ceil(cache_lengths[b] / block_l) blocks
     dealt out in order, ceil(blocks / S) per split (``_flash.row_split``: the split follows the
     row's own length, so a short row in a long cache still spreads over the splits), read in
     place from the [B, L, Hkv, Dh] layout (a strided [L, Dh] view, no copy): full blocks
     unmasked, then the one partial block with masked loads (rows past the length are never
     read) and a masked score tile;
  2. split 0 only: the step's own keys in blocks of block_t, also read in place (a partial last
     block is shifted back to end at T and its already-seen columns masked), under the tree mask.
     The mask stays at token granularity [B, n_q, tq, T'] int8 and each row gathers its token's
     mask row (row r -> token r // g); blocks where the whole tile is masked (the future of a
     causal prefill) are skipped.
S > 1 (flash-decoding, for small B * Hkv * tiles): each split writes unnormalised (acc, m, den)
in f32 and ``_flash.combine`` merges them exactly (an empty split has den = 0, acc = 0 and drops
out). S = 1 normalises in the kernel. f32 operands use full-precision (IEEE) dots, not TF32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels import _flash

_GPU_TARGET_PROGRAMS = 264  # ~2 waves of an H100/H200 (132 SMs): the auto split aims for this many


def _kernel(len_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, mask_ref, *out_refs, scale, g, tq,
            block_l, block_t, splits, cache_len, t_new, split_out, precision):
  # len_ref []; q_ref [M, Dh]; k_ref, v_ref [L, Dh]; kn_ref, vn_ref [T, Dh]; mask_ref [tq, T'] int8
  # out: o_ref [M, Dh], or acc_ref [M, Dh], m_ref [M, 1], l_ref [M, 1] (f32 split partials)
  s_id = pl.program_id(3)
  q = q_ref[...]
  rows, dh = q.shape
  update = functools.partial(_flash.online_update, q, scale=scale, precision=precision)

  # 1. Cache keys [lo, hi) of this split: this row's blocks dealt out over the splits.
  length = jnp.minimum(len_ref[()], cache_len)
  split_len = _flash.row_split(length, splits, block_l) * block_l
  lo = s_id * split_len
  hi = jnp.minimum(length, lo + split_len)
  n_keys = jnp.maximum(hi - lo, 0)
  n_full = lax.div(n_keys, block_l)

  def full_block(j, carry):
    start = pl.multiple_of(lo + j * block_l, block_l)
    return update(k_ref[pl.ds(start, block_l), :], v_ref[pl.ds(start, block_l), :], None, *carry)

  def cache_tail(carry):  # the one partial block: masked loads, rows past hi are never read
    start = pl.multiple_of(lo + n_full * block_l, block_l)
    row_ok = start + lax.broadcasted_iota(jnp.int32, (block_l, dh), 0) < hi
    k = pl_triton.load(k_ref.at[pl.ds(start, block_l), :], mask=row_ok, other=0.0)
    v = pl_triton.load(v_ref.at[pl.ds(start, block_l), :], mask=row_ok, other=0.0)
    key_ok = start + lax.broadcasted_iota(jnp.int32, (rows, block_l), 1) < hi
    return update(k, v, key_ok, *carry)

  carry = _flash.init_state(rows, dh)
  if cache_len >= block_l:  # else no block is ever full (and a full-block read is out of bounds)
    carry = lax.fori_loop(0, n_full, full_block, carry)
  carry = lax.cond(n_full * block_l < n_keys, cache_tail, lambda c: c, carry)

  # 2. The step's own keys under the tree mask (split 0 only); t_new >= block_t (wrapper pads).
  tok = jnp.minimum(lax.broadcasted_iota(jnp.int32, (rows,), 0) // g, tq - 1)  # row -> token

  def new_block(c0, carry, seen=0):
    allowed = mask_ref[tok, pl.ds(c0, block_t)] != 0  # [M, block_t]: each row's token's mask row
    if seen:  # the last block, shifted back to end at t_new: drop the columns already seen
      allowed &= c0 + lax.broadcasted_iota(jnp.int32, (rows, block_t), 1) >= seen
    any_allowed = jnp.max(jnp.max(allowed.astype(jnp.int32), axis=1), axis=0) > 0
    go = lambda c: update(kn_ref[pl.ds(c0, block_t), :], vn_ref[pl.ds(c0, block_t), :], allowed,
                          *c)
    return lax.cond(any_allowed, go, lambda c: c, carry)  # skip fully masked blocks

  n_new_full = t_new // block_t
  # Trip count n_new_full on split 0, else 0, in int32 arithmetic: a jnp.where of two Python ints
  # here lowers (jax 0.10-0.11 Triton) to an i1 select, and the scf.for then fails to verify on
  # the device ("lowerBound, upperBound, step have same type").
  n_new_blocks = n_new_full * (1 - jnp.minimum(s_id, 1))
  carry = lax.fori_loop(
      0, n_new_blocks,
      lambda j, c: new_block(pl.multiple_of(j * block_t, block_t), c), carry)
  if t_new % block_t:
    carry = lax.cond(s_id == 0,
                     lambda c: new_block(t_new - block_t, c, seen=n_new_full * block_t),
                     lambda c: c, carry)

  m, den, acc = carry
  if split_out:
    acc_ref, m_ref, l_ref = out_refs
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = den
  else:
    (o_ref,) = out_refs
    o_ref[...] = _flash.normalise(acc, den).astype(o_ref.dtype)


def _auto_splits(programs, n_tiles, lc, rows):
  """Enough splits for ~2 waves of programs, but the f32 partials each split writes and the
  combine reads back (2 * S * M * Dh * 4 bytes per tile) stay <= 1/4 of the KV bytes read
  (L * Dh * 2 * 2 bytes in bf16): S <= L / (8 M)."""
  want = max(1, _GPU_TARGET_PROGRAMS // max(programs, 1))
  return max(1, min(want, n_tiles, lc // (8 * rows)))


def _geometry(b, t, h, hkv, lc, bs):
  """(tq, n_q, rows, cache_len, tiles per split, splits) for resolved block sizes ``bs``."""
  g = h // hkv
  tq, n_q, rows = _flash.query_tiling(t, g, bs.block_q, pow2=True)
  cache_len = lc if lc else bs.block_l  # L = 0: one dummy block (never read)
  n_tiles = -(-cache_len // bs.block_l)
  splits = bs.num_splits
  if splits is None:
    splits = _auto_splits(b * hkv * n_q, n_tiles, lc, rows)
  tps, splits = _flash.split_geometry(n_tiles, splits)
  return tq, n_q, rows, cache_len, tps, splits


def split_count(b, t, h, hkv, lc, bs) -> int:
  """How many splits of L the Triton body runs for q [B, T, H, Dh], a cache of L = ``lc`` and
  resolved block sizes ``bs`` (``bs.num_splits``, or the automatic choice when None, clamped to
  the cache blocks and ``_flash.MAX_SPLITS``)."""
  return _geometry(b, t, h, hkv, lc, bs)[-1]


def tree_attention_triton(q, k_cache, v_cache, lens, k_new, v_new, tree_mask, *, scale, bs,
                          interpret):
  """Same contract as ``tree_attention``; ``bs`` is resolved (no None tiles). lens clipped to L."""
  b, t, h, dh = q.shape
  lc, hkv = k_cache.shape[1], k_cache.shape[2]
  g = h // hkv
  dtype = k_cache.dtype
  tq, n_q, rows, cache_len, _, splits = _geometry(b, t, h, hkv, lc, bs)
  block_l, block_t = bs.block_l, bs.block_t
  n_kb = -(-t // block_t)
  qr = _flash.tile_queries(q.astype(dtype), hkv, tq, n_q, rows)  # [B, Hkv, n_q, M, Dh]
  mask = _flash.tile_mask(tree_mask, tq, n_q, n_kb * block_t, jnp.int8)  # [B, n_q, tq, T']
  kn, vn = k_new.astype(dtype), v_new.astype(dtype)  # read in place: no copy when dtypes match
  if t < block_t:  # fewer new keys than one block (small steps): pad them to one block
    kn = jnp.pad(kn, ((0, 0), (0, block_t - t), (0, 0), (0, 0)))
    vn = jnp.pad(vn, ((0, 0), (0, block_t - t), (0, 0), (0, 0)))
  t_new = kn.shape[1]
  if lc == 0:  # a zero-length cache (prefill): one dummy block, never read (lens are 0)
    k_cache = v_cache = jnp.zeros((b, cache_len, hkv, dh), dtype)
  split_out = splits > 1
  num_warps = bs.num_warps if bs.num_warps is not None else (4 if rows <= 64 else 8)
  kernel = functools.partial(
      _kernel, scale=scale, g=g, tq=tq, block_l=block_l, block_t=block_t,
      splits=splits, cache_len=cache_len, t_new=t_new, split_out=split_out,
      precision=_flash.dot_precision(dtype))
  in_specs = [
      pl.BlockSpec((None,), lambda i, k, j, s: (i,)),
      pl.BlockSpec((None, None, None, rows, dh), lambda i, k, j, s: (i, k, j, 0, 0)),
      pl.BlockSpec((None, cache_len, None, dh), lambda i, k, j, s: (i, 0, k, 0)),
      pl.BlockSpec((None, cache_len, None, dh), lambda i, k, j, s: (i, 0, k, 0)),
      pl.BlockSpec((None, t_new, None, dh), lambda i, k, j, s: (i, 0, k, 0)),
      pl.BlockSpec((None, t_new, None, dh), lambda i, k, j, s: (i, 0, k, 0)),
      pl.BlockSpec((None, None, tq, n_kb * block_t), lambda i, k, j, s: (i, j, 0, 0)),
  ]
  if split_out:
    part = lambda w: pl.BlockSpec((None, None, None, None, rows, w),
                                  lambda i, k, j, s: (i, k, j, s, 0, 0))
    out_shape = [jax.ShapeDtypeStruct((b, hkv, n_q, splits, rows, w), jnp.float32)
                 for w in (dh, 1, 1)]
    out_specs = [part(dh), part(1), part(1)]
  else:
    out_shape = [jax.ShapeDtypeStruct((b, hkv, n_q, rows, dh), q.dtype)]
    out_specs = [pl.BlockSpec((None, None, None, rows, dh), lambda i, k, j, s: (i, k, j, 0, 0))]
  outs = pl.pallas_call(
      kernel,
      grid=(b, hkv, n_q, splits),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=bs.num_stages),
      interpret=interpret,
      name="tree_attention_triton",
  )(lens, qr, k_cache, v_cache, kn, vn, mask)
  if split_out:
    out = _flash.combine(*outs, split_axis=3).astype(q.dtype)
  else:
    out = outs[0]
  return _flash.untile_queries(out, t, g, tq)
