"""The fused sampler on GPU (Pallas Triton): grid (row tiles, splits); each program loops over its
vocab tiles and over D in block_d chunks (``fused_sampler`` has the contract)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels._flash import dot_precision as _dot_precision
from pallas_kernels._sampler_math import contract, init_carry, merge, tile_update
from pallas_kernels._shapes import cdiv as _cdiv
from pallas_kernels.counter_hash import row_key

_GPU_TARGET_PROGRAMS = 264  # ~2 waves of an H100/H200 (132 SMs)


def _triton_kernel(seed_ref, sid_ref, pos_ref, off_ref, h_ref, w_ref, *out_refs, temperature, vocab,
                   v_read, block_v, block_d, tiles_per_split, n_tiles, layout, precision):
  # seed_ref, sid_ref, pos_ref, off_ref [r, 1]; h_ref [r, D]; w_ref [D, Vp] or [Vp, D] (whole);
  # out_refs 5 x [r, 1]
  s_id = pl.program_id(1)
  rows, d_model = h_ref.shape
  key = row_key(seed_ref[...], sid_ref[...], pos_ref[...])  # uint32 [r, 1]
  t_lo = s_id * tiles_per_split
  n_local = jnp.minimum(tiles_per_split, n_tiles - t_lo)
  iota = lax.broadcasted_iota(jnp.int32, (1, block_v), 1)

  def vocab_tile(j, carry):
    start = (t_lo + j) * block_v
    ld = jnp.minimum(start, v_read - block_v)  # last tile shifted back to end inside the array
    ids = ld + iota
    ok = (ids >= start) & (ids < vocab)  # not seen in the previous tile, not padding
    ids = ids + off_ref[...]  # global ids (a vocabulary shard's offset): the noise's coordinate

    def d_chunk(c, acc):
      d0 = pl.multiple_of(c * block_d, block_d)
      h = h_ref[:, pl.ds(d0, block_d)]
      if layout == "dv":
        w = w_ref[pl.ds(d0, block_d), pl.ds(ld, block_v)]
      else:
        w = w_ref[pl.ds(ld, block_v), pl.ds(d0, block_d)]
      return acc + lax.dot_general(h, w, contract(layout), preferred_element_type=jnp.float32,
                                   precision=precision)

    logits = lax.fori_loop(0, d_model // block_d, d_chunk,
                           jnp.zeros((rows, block_v), jnp.float32))
    return tile_update(logits, ids, ok, key, carry, temperature)

  carry = lax.fori_loop(0, n_local, vocab_tile, init_carry(rows))
  for ref, val in zip(out_refs, carry, strict=True):
    ref[...] = val


def _fused_sample_triton(seeds, sids, pos, offs, hidden, unembed, *, temperature, bs, interpret,
                         layout):
  rp, d_model = hidden.shape
  vocab = unembed.shape[1 if layout == "dv" else 0]
  block_r, block_v = bs.block_r, bs.block_v
  block_d = bs.block_d
  if block_d is None:
    widest = 64 if unembed.dtype == jnp.float32 else 128
    block_d = next((c for c in (128, 64, 32, 16) if c <= widest and d_model % c == 0), d_model)
  if vocab < block_v:  # tiny vocab: pad the (small) unembed; padded ids are masked via `vocab`
    pad_v = (0, block_v - vocab)
    unembed = jnp.pad(unembed, ((0, 0), pad_v) if layout == "dv" else (pad_v, (0, 0)))
  v_read = max(vocab, block_v)
  n_tiles = _cdiv(vocab, block_v)
  row_tiles = rp // block_r
  splits = bs.num_splits
  if splits is None:
    splits = max(1, _GPU_TARGET_PROGRAMS // row_tiles)
  splits = max(1, min(splits, n_tiles))
  tps = _cdiv(n_tiles, splits)
  splits = _cdiv(n_tiles, tps)
  num_warps = bs.num_warps if bs.num_warps is not None else (4 if block_r <= 32 else 8)
  kernel = functools.partial(_triton_kernel, temperature=temperature, vocab=vocab,
                             v_read=v_read, block_v=block_v, block_d=block_d, tiles_per_split=tps,
                             n_tiles=n_tiles, layout=layout,
                             precision=_dot_precision(unembed.dtype))
  row_spec = pl.BlockSpec((block_r, 1), lambda i, s: (i, 0))
  out_spec = pl.BlockSpec((None, block_r, 1), lambda i, s: (s, i, 0))
  f32, i32 = jnp.float32, jnp.int32
  out_shape = [jax.ShapeDtypeStruct((splits, rp, 1), dt) for dt in (f32, i32, f32, f32, f32)]
  outs = pl.pallas_call(
      kernel,
      grid=(row_tiles, splits),
      in_specs=[row_spec, row_spec, row_spec, row_spec,
                pl.BlockSpec((block_r, d_model), lambda i, s: (i, 0)),
                pl.BlockSpec(unembed.shape, lambda i, s: (0, 0))],
      out_specs=[out_spec] * 5,
      out_shape=out_shape,
      compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=bs.num_stages),
      interpret=interpret,
      name="fused_sample_triton",
  )(seeds, sids, pos, offs, hidden, unembed)
  return merge(*outs)
