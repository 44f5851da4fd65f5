"""Tree attention, Pallas Mosaic body (TPU). Called by ``tree_attention.tree_attention``.

Layout. The caches are viewed as [B, L, Hkv * Dh] (a free reshape) and read in lane groups of
W = max(Dh, 128) lanes (W = Hkv * Dh when that is narrower or not lane aligned): kv head k lives in
group k // hpg at lane offset (k % hpg) * Dh, hpg = W // Dh heads per group. The wrapper places
each query tile at its head's lane offset inside a zero row of W lanes, so q @ k_group^T contracts
over the whole group and the zeros remove the neighbour head: the kernel never slices lanes at an
offset (unsupported or slow at Dh = 64). The output tile is [M, W] and the wrapper keeps the
head's lanes. With Dh = 128 there is no waste; with Dh = 64 each program reads its neighbour's
K/V too (2x bytes), accepted for the small models that use it.

Grid (B, Hkv, query tiles, S, bps + n_kb), the last axis a sequential reduction: steps
[0, bps) walk this split's share of the row's valid cache blocks of block_l (the row's
ceil(cache_lengths[b] / block_l) blocks dealt out in order, ceil(blocks / S) per split,
``_flash.row_split``; bps is that share for a full row). cache_lengths is scalar-prefetched and
clamps the block index, so steps past the share repeat the previous index: no DMA, compute
skipped;
steps [bps, bps + n_kb) walk the step's new keys in blocks of block_t (split 0 only), padded to
a multiple of 128 lanes. Only the partial last cache block is masked (select on scores and V
rows, masks built from full 2-D iotas). The tree mask arrives at token granularity, bf16
[B, n_q, tqm, T'] (tqm = tq rounded to 16 sublanes), and is expanded to the tile's rows by a
one-hot [M, tqm] x [tqm, block_t] matmul (exact for 0/1 values), no reshape or gather.
Row tiles are multiples of 8 sublanes (16 for 16-bit dtypes). VMEM: the scoped limit is passed
explicitly (``vmem_limit_bytes``), sized from the double-buffered blocks, scratch and temporaries.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _flash

LANES = 128
VMEM_FLOOR = 16 << 20  # the v5e default scoped limit; we never ask for less
VMEM_CAP = 48 << 20  # below the 64 MiB physical VMEM of a v7x TensorCore


def lane_group(hkv: int, dh: int):
  """(W, hpg): lanes per K/V block and kv heads per lane group."""
  if dh % LANES == 0:
    return dh, 1
  if LANES % dh == 0 and (hkv * dh) % LANES == 0:
    return LANES, LANES // dh
  return hkv * dh, hkv


def vmem_bytes(rows, w, block_l, block_t, tqm, itemsize, split_out):
  """Scoped VMEM the kernel needs: double-buffered blocks + scratch + f32 temporaries."""
  blocks = (rows * w + 2 * block_l * w + 2 * block_t * w) * itemsize + tqm * block_t * 2
  blocks += rows * (w + 2 * LANES) * 4 if split_out else rows * w * itemsize
  scratch = rows * (w + 2 * LANES) * 4
  widest = max(block_l, block_t)
  temps = 4 * rows * widest * 4 + rows * tqm * 2 + 2 * rows * w * 4  # s, p, masks; E; pv, acc
  return 2 * blocks + scratch + temps


def _kernel(lens_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, mask_ref, *refs, scale, g, tq, bps,
            splits, block_l, cache_len, split_out, precision):
  # lens_ref [B] (SMEM); q_ref [M, W]; k_ref, v_ref [block_l, W]; kn_ref, vn_ref [block_t, W];
  # mask_ref [tqm, block_t] bf16; outputs, then scratch m_sc, l_sc [M, 128], acc_sc [M, W] f32.
  if split_out:
    acc_ref, m_ref, l_ref, m_sc, l_sc, acc_sc = refs
  else:
    o_ref, m_sc, l_sc, acc_sc = refs
  b_id, s_id, j = pl.program_id(0), pl.program_id(3), pl.program_id(4)
  rows, w = q_ref.shape
  length = jnp.minimum(lens_ref[b_id], cache_len)

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, _flash.NEG, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  def update(k, v, allowed):
    m, den, acc = _flash.online_update(q_ref[...], k, v, allowed, m_sc[:, :1], l_sc[:, :1],
                                       acc_sc[...], scale=scale, precision=precision)
    m_sc[...] = jnp.broadcast_to(m, m_sc.shape)
    l_sc[...] = jnp.broadcast_to(den, l_sc.shape)
    acc_sc[...] = acc

  share = _flash.row_split(length, splits, block_l)  # this row's blocks per split (<= bps)
  start = (s_id * share + j) * block_l
  in_cache = (j < share) & (start < length)

  @pl.when(in_cache & (start + block_l <= length))
  def _full_block():
    update(k_ref[...], v_ref[...], None)

  @pl.when(in_cache & (start + block_l > length))
  def _partial_block():  # rows past the length (or past L: unspecified data) never contribute
    v_ok = start + lax.broadcasted_iota(jnp.int32, (block_l, w), 0) < length
    v = jnp.where(v_ok, v_ref[...], jnp.zeros((block_l, w), v_ref.dtype))
    key_ok = start + lax.broadcasted_iota(jnp.int32, (rows, block_l), 1) < length
    update(k_ref[...], v, key_ok)

  @pl.when((j >= bps) & (s_id == 0))
  def _new_keys():
    mask = mask_ref[...]  # [tqm, block_t], 1 = allowed
    if tq == 1:
      allowed = jnp.broadcast_to(mask.astype(jnp.float32) > 0.5, (rows, mask.shape[1]))
    else:
      r = lax.broadcasted_iota(jnp.int32, (rows, mask.shape[0]), 0)
      c = lax.broadcasted_iota(jnp.int32, (rows, mask.shape[0]), 1)
      one_hot = (r >= c * g) & (r < c * g + g)  # row r -> token r // g
      expand = jnp.where(one_hot, 1.0, 0.0).astype(mask.dtype)
      allowed = jnp.dot(expand, mask, preferred_element_type=jnp.float32) > 0.5
    update(kn_ref[...], vn_ref[...], allowed)  # padded keys: zero K/V, zero mask columns

  @pl.when(j == pl.num_programs(4) - 1)
  def _finish():
    if split_out:
      acc_ref[...] = acc_sc[...]
      m_ref[...] = m_sc[...]
      l_ref[...] = l_sc[...]
    else:
      o_ref[...] = _flash.normalise(acc_sc[...], l_sc[:, :1]).astype(o_ref.dtype)


def _geometry(b, t, h, hkv, lc, bs, row_multiple=8):
  """(tq, n_q, rows, block_l, blocks per split, splits) for resolved block sizes ``bs``."""
  tq, n_q, rows = _flash.query_tiling(t, h // hkv, bs.block_q, pow2=False,
                                      row_multiple=row_multiple)
  cache_len = max(lc, LANES)  # a cache shorter than 128 rows is padded to 128
  block_l = min(bs.block_l, cache_len // LANES * LANES)
  n_tiles = -(-cache_len // block_l)
  splits = bs.num_splits if bs.num_splits is not None else (1 if b * hkv * n_q > 1 else 2)
  bps, splits = _flash.split_geometry(n_tiles, splits)
  return tq, n_q, rows, block_l, bps, splits


def split_count(b, t, h, hkv, lc, bs) -> int:
  """How many splits of L the Mosaic body runs for q [B, T, H, Dh], a cache of L = ``lc`` and
  resolved block sizes ``bs`` (``bs.num_splits``, or when None 2 for a single program (both
  TensorCores of a megacore chip) and 1 otherwise; clamped to the cache blocks and
  ``_flash.MAX_SPLITS``)."""
  return _geometry(b, t, h, hkv, lc, bs)[-1]


def tree_attention_tpu(q, k_cache, v_cache, lens, k_new, v_new, tree_mask, *, scale, bs,
                       interpret):
  """Same contract as ``tree_attention``; ``bs`` is resolved (no None tiles). lens clipped to L."""
  b, t, h, dh = q.shape
  lc, hkv = k_cache.shape[1], k_cache.shape[2]
  g = h // hkv
  dtype = k_cache.dtype
  itemsize = jnp.dtype(dtype).itemsize
  tq, n_q, rows, block_l, bps, splits = _geometry(b, t, h, hkv, lc, bs,
                                                  row_multiple=16 if itemsize == 2 else 8)
  split_out = splits > 1
  w, hpg = lane_group(hkv, dh)

  # Cache viewed [B, L, Hkv * Dh]; a cache shorter than 128 rows (tiny models, prefill L = 0) is
  # padded to 128 so every block is lane dense; block_l is the largest multiple of 128 that fits.
  kc, vc = k_cache.reshape(b, lc, hkv * dh), v_cache.reshape(b, lc, hkv * dh)
  if lc < LANES:
    kc = jnp.pad(kc, ((0, 0), (0, LANES - lc), (0, 0)))
    vc = jnp.pad(vc, ((0, 0), (0, LANES - lc), (0, 0)))
  cache_len = kc.shape[1]

  block_t = bs.block_t
  n_kb = -(-t // block_t)
  tkp = n_kb * block_t
  kn = jnp.pad(k_new.astype(dtype).reshape(b, t, hkv * dh), ((0, 0), (0, tkp - t), (0, 0)))
  vn = jnp.pad(v_new.astype(dtype).reshape(b, t, hkv * dh), ((0, 0), (0, tkp - t), (0, 0)))
  tqm = 1 if tq == 1 else -(-tq // 16) * 16
  mask = _flash.tile_mask(tree_mask, tq, n_q, tkp, jnp.bfloat16, tile_rows=tqm)

  qr = _flash.tile_queries(q.astype(dtype), hkv, tq, n_q, rows)  # [B, Hkv, n_q, M, Dh]
  if w != dh:  # head k's queries at lane offset (k % hpg) * Dh of a zero W-lane row
    qr = jnp.stack([jnp.pad(qr[:, k], ((0, 0),) * 3 + (((k % hpg) * dh, w - (k % hpg + 1) * dh),))
                    for k in range(hkv)], axis=1)

  def cache_map(i, k, qi, s, j, lens_ref):
    length = jnp.minimum(lens_ref[i], lc)
    last = jnp.maximum(lax.div(length + (block_l - 1), block_l) - 1, 0)
    share = jnp.maximum(_flash.row_split(length, splits, block_l), 1)
    return i, jnp.minimum(s * share + jnp.minimum(j, share - 1), last), lax.div(k, hpg)

  def new_block(s, j):  # held at 0 outside split 0 and during the cache steps: no extra DMA
    return jnp.where(s == 0, jnp.clip(j - bps, 0, n_kb - 1), 0)

  new_map = lambda i, k, qi, s, j, lens_ref: (i, new_block(s, j), lax.div(k, hpg))
  in_specs = [
      pl.BlockSpec((None, None, None, rows, w), lambda i, k, qi, s, j, lens_ref: (i, k, qi, 0, 0)),
      pl.BlockSpec((None, block_l, w), cache_map),
      pl.BlockSpec((None, block_l, w), cache_map),
      pl.BlockSpec((None, block_t, w), new_map),
      pl.BlockSpec((None, block_t, w), new_map),
      pl.BlockSpec((None, None, tqm, block_t),
                   lambda i, k, qi, s, j, lens_ref: (i, qi, 0, new_block(s, j))),
  ]
  if split_out:
    part_map = lambda i, k, qi, s, j, lens_ref: (i, k, qi, s, 0, 0)
    out_shape = [jax.ShapeDtypeStruct((b, hkv, n_q, splits, rows, width), jnp.float32)
                 for width in (w, LANES, LANES)]
    out_specs = [pl.BlockSpec((None, None, None, None, rows, width), part_map)
                 for width in (w, LANES, LANES)]
  else:
    out_shape = [jax.ShapeDtypeStruct((b, hkv, n_q, rows, w), q.dtype)]
    out_specs = [pl.BlockSpec((None, None, None, rows, w),
                              lambda i, k, qi, s, j, lens_ref: (i, k, qi, 0, 0))]
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(b, hkv, n_q, splits, bps + n_kb),
      in_specs=in_specs,
      out_specs=out_specs,
      scratch_shapes=[pltpu.VMEM((rows, LANES), jnp.float32),
                      pltpu.VMEM((rows, LANES), jnp.float32),
                      pltpu.VMEM((rows, w), jnp.float32)],
  )
  need = vmem_bytes(rows, w, block_l, block_t, tqm, itemsize, split_out)
  kernel = functools.partial(_kernel, scale=scale, g=g, tq=tq, bps=bps, splits=splits,
                             block_l=block_l, cache_len=cache_len, split_out=split_out,
                             precision=_flash.dot_precision(dtype))
  outs = pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel",) * 4 + ("arbitrary",),
          vmem_limit_bytes=int(min(max(need * 3 // 2, VMEM_FLOOR), VMEM_CAP))),
      interpret=interpret,
      name="tree_attention_tpu",
  )(lens, qr, kc, vc, kn, vn, mask)
  if split_out:
    acc, m, den = outs
    out = _flash.combine(acc, m[..., :1], den[..., :1], split_axis=3).astype(q.dtype)
  else:
    out = outs[0]
  if w != dh:  # keep each head's own lanes
    out = jnp.stack([out[:, k, ..., (k % hpg) * dh:(k % hpg + 1) * dh] for k in range(hkv)],
                    axis=1)
  return _flash.untile_queries(out, t, g, tq)
