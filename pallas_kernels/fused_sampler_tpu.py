"""The fused sampler on TPU (Pallas Mosaic): grid (row tiles, splits, tiles per split) with the
vocab axis a sequential reduction and whole D per step (``fused_sampler`` has the contract)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._flash import dot_precision as _dot_precision
from pallas_kernels._sampler_math import contract, init_carry, merge, tile_update
from pallas_kernels._shapes import cdiv as _cdiv
from pallas_kernels.counter_hash import row_key

TPU_LANES = 128
_TPU_VMEM_CAP = 48 << 20  # below the 64 MiB physical VMEM of a v7x TensorCore


def _tpu_kernel(seed_ref, sid_ref, pos_ref, off_ref, h_ref, w_ref, *refs, temperature, vocab,
                block_v, tiles_per_split, n_tiles, layout, precision):
  # seed_ref, sid_ref, pos_ref, off_ref [r, 1]; h_ref [r, D]; w_ref [D, block_v] ("dv") or
  # [block_v, D] ("vd"); 5 outputs [r, 128] then
  # 5 scratch [r, 128] (state broadcast over lanes). Grid (row tiles, S, tiles per split).
  outs, scratch = refs[:5], refs[5:]
  s_id, j = pl.program_id(1), pl.program_id(2)
  tile = s_id * tiles_per_split + j

  @pl.when(j == 0)
  def _init():
    for ref, val in zip(scratch, init_carry(h_ref.shape[0]), strict=True):
      ref[...] = jnp.broadcast_to(val, ref.shape)

  @pl.when(tile < n_tiles)
  def _step():
    key = row_key(seed_ref[...], sid_ref[...], pos_ref[...])
    logits = lax.dot_general(h_ref[...], w_ref[...], contract(layout),
                             preferred_element_type=jnp.float32, precision=precision)
    ids = tile * block_v + lax.broadcasted_iota(jnp.int32, logits.shape, 1)  # full 2-D iota
    ok = ids < vocab  # the partial last block's padding holds garbage: masked by select
    ids = ids + off_ref[...]  # global ids (a vocabulary shard's offset): the noise's coordinate
    carry = tuple(ref[...][:, :1] for ref in scratch)
    new = tile_update(logits, ids, ok, key, carry, temperature)
    for ref, val in zip(scratch, new, strict=True):
      ref[...] = jnp.broadcast_to(val, ref.shape)

  @pl.when(j == tiles_per_split - 1)
  def _finish():
    for o, sc in zip(outs, scratch, strict=True):
      o[...] = sc[...]


def _fused_sample_tpu(seeds, sids, pos, offs, hidden, unembed, *, temperature, bs, interpret,
                      layout):
  rp, d_model = hidden.shape
  vocab = unembed.shape[1 if layout == "dv" else 0]
  block_r = bs.block_r
  if vocab < TPU_LANES:  # tiny vocab: pad the (small) unembed to one lane-dense tile
    pad_v = (0, TPU_LANES - vocab)
    unembed = jnp.pad(unembed, ((0, 0), pad_v) if layout == "dv" else (pad_v, (0, 0)))
  v_arr = unembed.shape[1 if layout == "dv" else 0]
  block_v = min(bs.block_v, v_arr // TPU_LANES * TPU_LANES)  # multiple of 128, within V
  n_tiles = _cdiv(vocab, block_v)
  row_tiles = rp // block_r
  splits = bs.num_splits if bs.num_splits is not None else (2 if row_tiles == 1 else 1)
  splits = max(1, min(splits, n_tiles))
  tps = _cdiv(n_tiles, splits)
  splits = _cdiv(n_tiles, tps)
  kernel = functools.partial(_tpu_kernel, temperature=temperature, vocab=vocab, block_v=block_v,
                             tiles_per_split=tps, n_tiles=n_tiles, layout=layout,
                             precision=_dot_precision(unembed.dtype))
  w_tile = lambda i, s, j: jnp.minimum(s * tps + j, n_tiles - 1)
  if layout == "dv":
    w_spec = pl.BlockSpec((d_model, block_v), lambda i, s, j: (0, w_tile(i, s, j)))
  else:
    w_spec = pl.BlockSpec((block_v, d_model), lambda i, s, j: (w_tile(i, s, j), 0))
  itemsize = unembed.dtype.itemsize
  need = (2 * (block_r * d_model + block_v * d_model) * itemsize  # double-buffered inputs
          + 2 * 2 * 5 * block_r * TPU_LANES * 4  # outputs and scratch
          + 8 * block_r * block_v * 4)  # f32 temporaries: logits, x, z, noise, masks
  row_spec = pl.BlockSpec((block_r, 1), lambda i, s, j: (i, 0))
  out_spec = pl.BlockSpec((None, block_r, TPU_LANES), lambda i, s, j: (s, i, 0))
  f32, i32 = jnp.float32, jnp.int32
  dts = (f32, i32, f32, f32, f32)
  outs = pl.pallas_call(
      kernel,
      grid=(row_tiles, splits, tps),
      in_specs=[row_spec, row_spec, row_spec, row_spec,
                pl.BlockSpec((block_r, d_model), lambda i, s, j: (i, 0)),
                w_spec],
      out_specs=[out_spec] * 5,
      out_shape=[jax.ShapeDtypeStruct((splits, rp, TPU_LANES), dt) for dt in dts],
      scratch_shapes=[pltpu.VMEM((block_r, TPU_LANES), dt) for dt in dts],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary"),
          vmem_limit_bytes=int(min(max(need * 3 // 2, 16 << 20), _TPU_VMEM_CAP))),
      interpret=interpret,
      name="fused_sample_tpu",
  )(seeds, sids, pos, offs, hidden, unembed)
  return merge(*(o[..., :1] for o in outs))
