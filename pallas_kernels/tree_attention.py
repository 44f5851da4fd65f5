"""Tree-verify attention: queries = one step's tokens; keys = valid KV cache prefix + step's K/V.

Shapes (dimension legend in ``specroll_jax/__init__.py``):
  q        [B, T, H, Dh]    the step's queries (T = N + 1 tree nodes, or any chunk of new tokens)
  k_cache  [B, L, Hkv, Dh]  KV cache; only the first ``cache_lengths[b]`` positions of row b count
  v_cache  [B, L, Hkv, Dh]
  cache_lengths [B] int32
  k_new    [B, T, Hkv, Dh]  the step's own keys/values
  v_new    [B, T, Hkv, Dh]
  tree_mask [B, T, T] bool  query i may attend new key j (ancestor-or-self in a tree; causal chunk)
  -> out   [B, T, H, Dh] in q.dtype

GQA: query head h reads kv head h // (H // Hkv). A query row with no allowed key returns zeros.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels._shapes import is_pow2 as _is_pow2
from pallas_kernels._shapes import next_pow2 as _next_pow2
from pallas_kernels._shapes import round_up as _round_up

_NEG = -1e30


def tree_attention_reference(q, k_cache, v_cache, cache_lengths, k_new, v_new, tree_mask, *,
                             scale: float | None = None):
  """Plain-jnp tree attention, computed in float32 (the kernel's reference; CPU production path)."""
  b, t, h, dh = q.shape
  hkv = k_cache.shape[2]
  g = h // hkv
  scale = dh ** -0.5 if scale is None else scale
  f32 = jnp.float32
  qg = q.astype(f32).reshape(b, t, hkv, g, dh)
  s_cache = jnp.einsum("btkgd,blkd->bkgtl", qg, k_cache.astype(f32)) * scale
  s_new = jnp.einsum("btkgd,bskd->bkgts", qg, k_new.astype(f32)) * scale
  valid_cache = jnp.arange(k_cache.shape[1])[None, :] < cache_lengths[:, None]  # [B, L]
  s_cache = jnp.where(valid_cache[:, None, None, None, :], s_cache, _NEG)
  s_new = jnp.where(tree_mask[:, None, None, :, :], s_new, _NEG)
  s = jnp.concatenate([s_cache, s_new], axis=-1)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - m)
  allowed = jnp.concatenate(
      [jnp.broadcast_to(valid_cache[:, None, None, None, :], s_cache.shape),
       jnp.broadcast_to(tree_mask[:, None, None, :, :], s_new.shape)], axis=-1)
  p = jnp.where(allowed, p, 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom == 0, 1.0, denom)
  lc = k_cache.shape[1]
  out = (jnp.einsum("bkgtl,blkd->btkgd", p[..., :lc], v_cache.astype(f32))
         + jnp.einsum("bkgts,bskd->btkgd", p[..., lc:], v_new.astype(f32)))
  return out.reshape(b, t, h, dh).astype(q.dtype)


tree_attention_reference_jit = jax.jit(tree_attention_reference, static_argnames=("scale",))


# --------------------------------------------------------------------------------------------------
# Pallas kernel
# --------------------------------------------------------------------------------------------------
#
# Layout. Kv head k and its g = H // Hkv query heads form one tile of M = T * g query rows (row
# r = t * g + j is query token t, head k * g + j): each cache byte is read once per (row, kv head).
#
# Triton (GPU): grid (B, Hkv, S). Program (b, k, s) loops (fori_loop, dynamic trip count) over the
#   cache blocks of split s that lie below cache_lengths[b]; blocks past the length are never read.
#   The cache is read in place from its [B, L, Hkv, Dh] layout (strided block), no copy. When L is
#   not a multiple of block_l the last block is shifted back to end at L and its already-seen rows
#   are masked, so no read goes out of bounds. Split 0 also folds in the T new keys (tree mask).
# Mosaic (TPU): grid (B, S, blocks per split), the last axis a sequential reduction; the cache is
#   viewed as [B, L, Hkv * Dh] (free reshape) so a [block_l, Hkv * Dh] block obeys the (8, 128)
#   rule and is one contiguous DMA; all kv heads are handled per program. cache_lengths is
#   scalar-prefetched and clamps the block index, so blocks past the length repeat the previous
#   index (no DMA) and their compute is skipped.
# S > 1 (split over L, for small B * Hkv): each split writes its unnormalised (acc, m, den) in f32
#   and a jnp step combines them (flash-decoding).
#
# Masked scores are -1e30 (finite) and masked probabilities are forced to 0, so a row with no
# allowed key ends with den = 0 and acc = 0 and returns zeros, never NaN.

BACKENDS = ("auto", "triton", "tpu")
# Head widths the compiled backends support (power-of-two tiles for Triton; lane-dense for Mosaic).
SUPPORTED_HEAD_DIMS = (64, 128)
# interpret=True also accepts any multiple of 16 up to 256 (the kernel body has no tile rule there).
INTERPRET_HEAD_DIM_MULTIPLE = 16
INTERPRET_MAX_HEAD_DIM = 256
_GPU_TARGET_PROGRAMS = 264  # ~2 waves of an H100/H200 (132 SMs): the auto split aims for this many
_TPU_LANES = 128


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling of the tree-attention kernel. Frozen and hashable (a static jit argument).

  block_l: cache positions per block (Triton: a power of two >= 16; TPU: a multiple of 128).
  num_splits: splits of L run as separate programs and combined afterwards (flash-decoding);
    None picks one from B * Hkv and L (more splits when B * Hkv is small).
  num_warps: Triton warps per program; None: 4 for query tiles up to 64 rows, else 8.
  num_stages: Triton software-pipelining stages.
  """

  block_l: int = 128
  num_splits: int | None = None
  num_warps: int | None = None
  num_stages: int = 2

  def __post_init__(self):
    if not isinstance(self.block_l, int) or self.block_l < 8:
      raise ValueError(f"BlockSizes.block_l must be an int >= 8, got {self.block_l!r}")
    n = self.num_splits
    if n is not None and (not isinstance(n, int) or n < 1):
      raise ValueError(f"BlockSizes.num_splits must be None or an int >= 1, got {n!r}")
    w = self.num_warps
    if w is not None and (not isinstance(w, int) or w not in (1, 2, 4, 8, 16)):
      raise ValueError(f"BlockSizes.num_warps must be None or one of 1, 2, 4, 8, 16, got {w!r}")
    if not isinstance(self.num_stages, int) or self.num_stages < 1:
      raise ValueError(f"BlockSizes.num_stages must be an int >= 1, got {self.num_stages!r}")

  @classmethod
  def for_backend(cls, backend: str) -> BlockSizes:
    """Production defaults: block_l 128 on GPU (Triton), 512 on TPU (lane-dense, fewer steps)."""
    return cls(block_l=512) if backend == "tpu" else cls()


def resolve_backend(backend: str, interpret: bool) -> str:
  """"auto" -> "tpu" on a TPU default backend, else "triton" (the body interpret=True runs)."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if backend == "auto":
    backend = "tpu" if jax.default_backend() == "tpu" else "triton"
  return backend


def _check_head_dim(dh: int, backend: str, interpret: bool, what: str = "Dh"):
  if dh in SUPPORTED_HEAD_DIMS:
    return
  if interpret and dh % INTERPRET_HEAD_DIM_MULTIPLE == 0 and 0 < dh <= INTERPRET_MAX_HEAD_DIM:
    return
  raise ValueError(
      f"tree_attention: head width {what}={dh} unsupported on backend {backend!r}: compiled "
      f"kernels support Dh in {SUPPORTED_HEAD_DIMS}; interpret=True also accepts multiples of "
      f"{INTERPRET_HEAD_DIM_MULTIPLE} up to {INTERPRET_MAX_HEAD_DIM}")


def _validate(q, k_cache, v_cache, cache_lengths, k_new, v_new, tree_mask, backend, interpret,
              bs: BlockSizes):
  """Shape / dtype / block-rule checks before tracing; raises ValueError naming value and rule."""
  if q.ndim != 4:
    raise ValueError(f"tree_attention: q must be [B, T, H, Dh], got shape {q.shape}")
  b, t, h, dh = q.shape
  if k_cache.ndim != 4 or k_cache.shape[0] != b or k_cache.shape[3] != dh:
    raise ValueError(f"tree_attention: k_cache must be [B={b}, L, Hkv, Dh={dh}], got "
                     f"{k_cache.shape}")
  if v_cache.shape != k_cache.shape:
    raise ValueError(f"tree_attention: v_cache shape {v_cache.shape} != k_cache shape "
                     f"{k_cache.shape}")
  hkv = k_cache.shape[2]
  if hkv < 1 or h % hkv != 0:
    raise ValueError(f"tree_attention: query heads H={h} must be a multiple of kv heads Hkv={hkv} "
                     f"(GQA; q {q.shape}, k_cache {k_cache.shape})")
  if t < 1:
    raise ValueError(f"tree_attention: need T >= 1 new tokens, got q shape {q.shape}")
  if k_new.shape != (b, t, hkv, dh):
    raise ValueError(f"tree_attention: k_new must be [B, T, Hkv, Dh]={(b, t, hkv, dh)}, got "
                     f"{k_new.shape}")
  if v_new.shape != k_new.shape:
    raise ValueError(f"tree_attention: v_new shape {v_new.shape} != k_new shape {k_new.shape}")
  if tree_mask.shape != (b, t, t):
    raise ValueError(f"tree_attention: tree_mask must be [B, T, T]={(b, t, t)}, got "
                     f"{tree_mask.shape}")
  if not (tree_mask.dtype == jnp.bool_ or jnp.issubdtype(tree_mask.dtype, jnp.integer)):
    raise ValueError(f"tree_attention: tree_mask must be bool, got {tree_mask.dtype}")
  if cache_lengths.shape != (b,) or not jnp.issubdtype(cache_lengths.dtype, jnp.integer):
    raise ValueError(f"tree_attention: cache_lengths must be integer [B]={(b,)}, got "
                     f"{cache_lengths.dtype}{list(cache_lengths.shape)}")
  for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new),
                  ("v_new", v_new)):
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
      raise ValueError(f"tree_attention: {name} dtype must be float32/bfloat16/float16, got "
                       f"{x.dtype}")
  if v_cache.dtype != k_cache.dtype:
    raise ValueError(f"tree_attention: k_cache dtype {k_cache.dtype} != v_cache dtype "
                     f"{v_cache.dtype}")
  _check_head_dim(dh, backend, interpret)
  if backend == "triton" and (not _is_pow2(bs.block_l) or bs.block_l < 16):
    raise ValueError(f"tree_attention: block_l={bs.block_l} breaks the Triton rule: block shapes "
                     "must be powers of two >= 16")
  if backend == "tpu" and bs.block_l % _TPU_LANES != 0:
    raise ValueError(f"tree_attention: block_l={bs.block_l} breaks the TPU (8, 128) rule: the "
                     "cache block's L dim is the score tile's lane dim, so it must be a multiple "
                     "of 128")


def _online_update(q, k, v, allowed, m, den, acc, scale):
  """One flash-attention step. q [M, Dh]; k, v [n, Dh]; allowed bool broadcastable to [M, n];
  m, den [M, 1] f32; acc [M, Dh] f32. Disallowed keys get score -1e30 and probability exactly 0."""
  s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
  s = jnp.where(allowed, s, _NEG)
  m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
  alpha = jnp.exp(m - m_new)
  p = jnp.where(allowed, jnp.exp(s - m_new), 0.0)
  den_new = alpha * den + jnp.sum(p, axis=1, keepdims=True)
  pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                       preferred_element_type=jnp.float32)
  return m_new, den_new, alpha * acc + pv


def _normalise(acc, den):
  return acc / jnp.where(den == 0.0, 1.0, den)


# -------------------------------------------- Triton --------------------------------------------

def _triton_kernel(len_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, mask_ref, *out_refs, scale,
                   block_l, split_len, cache_len, split_out):
  # len_ref []; q_ref [M, Dh]; k_ref, v_ref [L, Dh]; kn_ref, vn_ref [Tn, Dh]; mask_ref [M, Tn] int32
  # out: o_ref [M, Dh] (one split) or acc_ref [M, Dh], m_ref [M, 1], l_ref [M, 1] (f32 partials)
  s_id = pl.program_id(2)
  length = len_ref[()]
  q = q_ref[...]
  mp, dh = q.shape
  lo = s_id * split_len
  hi = jnp.minimum(jnp.minimum(length, lo + split_len), cache_len)
  n_blocks = lax.div(jnp.maximum(hi - lo, 0) + (block_l - 1), block_l)  # operands >= 0

  def body(j, carry):
    m, den, acc = carry
    start = lo + j * block_l
    ld = jnp.minimum(start, cache_len - block_l)  # last block shifted back inside [0, L)
    pos = ld + lax.broadcasted_iota(jnp.int32, (1, block_l), 1)
    ok = (pos >= start) & (pos < hi)  # [1, block_l] key mask for the scores
    pos_col = ld + lax.broadcasted_iota(jnp.int32, (block_l, 1), 0)
    k = k_ref[pl.ds(ld, block_l), :]
    v = v_ref[pl.ds(ld, block_l), :]
    v = jnp.where((pos_col >= start) & (pos_col < hi), v, jnp.zeros_like(v))
    return _online_update(q, k, v, ok, m, den, acc, scale)

  m = jnp.full((mp, 1), _NEG, jnp.float32)
  den = jnp.zeros((mp, 1), jnp.float32)
  acc = jnp.zeros((mp, dh), jnp.float32)
  m, den, acc = lax.fori_loop(0, n_blocks, body, (m, den, acc))
  # The step's own keys, under the tree mask (folded into split 0 only).
  allowed = (mask_ref[...] != 0) & (s_id == 0)
  m, den, acc = _online_update(q, kn_ref[...], vn_ref[...], allowed, m, den, acc, scale)
  if split_out:
    acc_ref, m_ref, l_ref = out_refs
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = den
  else:
    (o_ref,) = out_refs
    o_ref[...] = _normalise(acc, den).astype(o_ref.dtype)


def _auto_splits_gpu(b, hkv, n_tiles, lc, mp):
  """Enough splits for ~2 waves of programs, but the f32 partials each split writes and the
  combine reads back (2 * S * M * Dh * 4 bytes per (b, kv head)) stay <= 1/4 of the KV bytes read
  (L * Dh * 2 * 2 bytes in bf16): S <= L / (8 M)."""
  want = max(1, _GPU_TARGET_PROGRAMS // max(b * hkv, 1))
  return max(1, min(want, n_tiles, lc // (8 * mp)))


def _split_geometry(n_tiles, num_splits):
  """Tiles per split and the effective split count (every split owns >= 1 tile)."""
  s = max(1, min(num_splits, n_tiles))
  tps = -(-n_tiles // s)
  return tps, -(-n_tiles // tps)


def _tree_attention_triton(qr, k_cache, v_cache, lens, kn, vn, mask, *, scale, bs, interpret,
                           out_dtype):
  # qr [B, Hkv, M, Dh]; caches [B, L, Hkv, Dh]; kn, vn [B, Tn, Hkv, Dh]; mask [B, M, Tn] int32
  b, hkv, mp, dh = qr.shape
  lc = k_cache.shape[1]
  tn = kn.shape[1]
  n_tiles = -(-lc // bs.block_l)
  splits = bs.num_splits
  if splits is None:
    splits = _auto_splits_gpu(b, hkv, n_tiles, lc, mp)
  tps, splits = _split_geometry(n_tiles, splits)
  split_out = splits > 1
  num_warps = bs.num_warps if bs.num_warps is not None else (4 if mp <= 64 else 8)
  kernel = functools.partial(_triton_kernel, scale=scale, block_l=bs.block_l,
                             split_len=tps * bs.block_l, cache_len=lc, split_out=split_out)
  in_specs = [
      pl.BlockSpec((None,), lambda i, k, s: (i,)),
      pl.BlockSpec((None, None, mp, dh), lambda i, k, s: (i, k, 0, 0)),
      pl.BlockSpec((None, lc, None, dh), lambda i, k, s: (i, 0, k, 0)),
      pl.BlockSpec((None, lc, None, dh), lambda i, k, s: (i, 0, k, 0)),
      pl.BlockSpec((None, tn, None, dh), lambda i, k, s: (i, 0, k, 0)),
      pl.BlockSpec((None, tn, None, dh), lambda i, k, s: (i, 0, k, 0)),
      pl.BlockSpec((None, mp, tn), lambda i, k, s: (i, 0, 0)),
  ]
  if split_out:
    out_shape = [jax.ShapeDtypeStruct((b, hkv, splits, mp, dh), jnp.float32),
                 jax.ShapeDtypeStruct((b, hkv, splits, mp, 1), jnp.float32),
                 jax.ShapeDtypeStruct((b, hkv, splits, mp, 1), jnp.float32)]
    out_specs = [pl.BlockSpec((None, None, None, mp, dh), lambda i, k, s: (i, k, s, 0, 0)),
                 pl.BlockSpec((None, None, None, mp, 1), lambda i, k, s: (i, k, s, 0, 0)),
                 pl.BlockSpec((None, None, None, mp, 1), lambda i, k, s: (i, k, s, 0, 0))]
  else:
    out_shape = [jax.ShapeDtypeStruct((b, hkv, mp, dh), out_dtype)]
    out_specs = [pl.BlockSpec((None, None, mp, dh), lambda i, k, s: (i, k, 0, 0))]
  outs = pl.pallas_call(
      kernel,
      grid=(b, hkv, splits),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=bs.num_stages),
      interpret=interpret,
      name="tree_attention_triton",
  )(lens, qr, k_cache, v_cache, kn, vn, mask)
  if split_out:
    return _combine(*outs, split_axis=2).astype(out_dtype)
  return outs[0]


def _combine(acc, m, den, *, split_axis):
  """Flash-decoding combine of split partials acc [.., S, M, Dh], m, den [.., S, M, 1]."""
  m_max = jnp.max(m, axis=split_axis, keepdims=True)
  w = jnp.exp(m - m_max)  # all-masked splits have den = 0, acc = 0 whatever w is
  den_tot = jnp.sum(w * den, axis=split_axis)
  acc_tot = jnp.sum(w * acc, axis=split_axis)
  return _normalise(acc_tot, den_tot)


# -------------------------------------------- Mosaic --------------------------------------------

def _tpu_kernel(len_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, mask_ref, *refs, scale, hkv, dh,
                block_l, bps, cache_len, split_out):
  # len_ref [B] (SMEM); q_ref [Hkv, M, Dh]; k_ref, v_ref [block_l, Hkv*Dh]; kn_ref, vn_ref
  # [T, Hkv*Dh]; mask_ref [M, T] int32; outputs then scratch m_sc, l_sc [Hkv, M, 128], acc_sc
  # [Hkv, M, Dh]. Grid (B, S, bps): the last axis walks this split's cache blocks.
  if split_out:
    acc_ref, m_ref, l_ref, m_sc, l_sc, acc_sc = refs
  else:
    o_ref, m_sc, l_sc, acc_sc = refs
  b_id, s_id, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  length = len_ref[b_id]

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, _NEG, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  start = (s_id * bps + j) * block_l
  hi = jnp.minimum(length, cache_len)

  def step(k_of, v_of, allowed, v_ok):
    for h in range(hkv):
      k = k_of(h)
      v = v_of(h)
      if v_ok is not None:
        v = jnp.where(v_ok, v, jnp.zeros_like(v))
      m, den, acc = _online_update(q_ref[h], k, v, allowed, m_sc[h][:, :1], l_sc[h][:, :1],
                                 acc_sc[h], scale)
      m_sc[h] = jnp.broadcast_to(m, m_sc.shape[1:])
      l_sc[h] = jnp.broadcast_to(den, l_sc.shape[1:])
      acc_sc[h] = acc

  @pl.when(start < hi)
  def _cache_block():
    pos = start + lax.broadcasted_iota(jnp.int32, (1, block_l), 1)
    ok = pos < hi
    v_ok = (start + lax.broadcasted_iota(jnp.int32, (block_l, 1), 0)) < hi
    step(lambda h: k_ref[:, h * dh:(h + 1) * dh], lambda h: v_ref[:, h * dh:(h + 1) * dh], ok, v_ok)

  @pl.when(j == bps - 1)
  def _finish():
    @pl.when(s_id == 0)
    def _new_tokens():
      allowed = mask_ref[...] != 0
      step(lambda h: kn_ref[:, h * dh:(h + 1) * dh], lambda h: vn_ref[:, h * dh:(h + 1) * dh],
           allowed, None)

    if split_out:
      acc_ref[...] = acc_sc[...]
      m_ref[...] = m_sc[...]
      l_ref[...] = l_sc[...]
    else:
      for h in range(hkv):
        o_ref[h] = _normalise(acc_sc[h], l_sc[h][:, :1]).astype(o_ref.dtype)


def _tree_attention_tpu(qr, k_cache, v_cache, lens, k_new, v_new, mask, *, scale, bs, interpret,
                        out_dtype):
  # qr [B, Hkv, M, Dh]; caches [B, L, Hkv, Dh]; k_new, v_new [B, T, Hkv, Dh]; mask [B, M, T] int32
  b, hkv, mp, dh = qr.shape
  lc = k_cache.shape[1]
  t = k_new.shape[1]
  block_l = bs.block_l if lc > bs.block_l else lc  # a block equal to the full dim is always legal
  n_tiles = -(-lc // block_l)
  splits = bs.num_splits if bs.num_splits is not None else (1 if b > 1 else 2)
  bps, splits = _split_geometry(n_tiles, splits)
  split_out = splits > 1
  kc = k_cache.reshape(b, lc, hkv * dh)
  vc = v_cache.reshape(b, lc, hkv * dh)
  kn = k_new.reshape(b, t, hkv * dh)
  vn = v_new.reshape(b, t, hkv * dh)

  def cache_map(i, s, j, lens_ref):
    last = jnp.maximum(lax.div(jnp.minimum(lens_ref[i], lc) + (block_l - 1), block_l) - 1, 0)
    return i, jnp.minimum(s * bps + j, last), 0

  in_specs = [
      pl.BlockSpec((None, hkv, mp, dh), lambda i, s, j, lens_ref: (i, 0, 0, 0)),
      pl.BlockSpec((None, block_l, hkv * dh), cache_map),
      pl.BlockSpec((None, block_l, hkv * dh), cache_map),
      pl.BlockSpec((None, t, hkv * dh), lambda i, s, j, lens_ref: (i, 0, 0)),
      pl.BlockSpec((None, t, hkv * dh), lambda i, s, j, lens_ref: (i, 0, 0)),
      pl.BlockSpec((None, mp, t), lambda i, s, j, lens_ref: (i, 0, 0)),
  ]
  if split_out:
    out_shape = [jax.ShapeDtypeStruct((b, splits, hkv, mp, dh), jnp.float32),
                 jax.ShapeDtypeStruct((b, splits, hkv, mp, _TPU_LANES), jnp.float32),
                 jax.ShapeDtypeStruct((b, splits, hkv, mp, _TPU_LANES), jnp.float32)]
    out_specs = [
        pl.BlockSpec((None, None, hkv, mp, dh), lambda i, s, j, lens_ref: (i, s, 0, 0, 0)),
        pl.BlockSpec((None, None, hkv, mp, _TPU_LANES), lambda i, s, j, lens_ref: (i, s, 0, 0, 0)),
        pl.BlockSpec((None, None, hkv, mp, _TPU_LANES), lambda i, s, j, lens_ref: (i, s, 0, 0, 0)),
    ]
  else:
    out_shape = [jax.ShapeDtypeStruct((b, hkv, mp, dh), out_dtype)]
    out_specs = [pl.BlockSpec((None, hkv, mp, dh), lambda i, s, j, lens_ref: (i, 0, 0, 0))]
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(b, splits, bps),
      in_specs=in_specs,
      out_specs=out_specs,
      scratch_shapes=[pltpu.VMEM((hkv, mp, _TPU_LANES), jnp.float32),
                      pltpu.VMEM((hkv, mp, _TPU_LANES), jnp.float32),
                      pltpu.VMEM((hkv, mp, dh), jnp.float32)],
  )
  kernel = functools.partial(_tpu_kernel, scale=scale, hkv=hkv, dh=dh, block_l=block_l, bps=bps,
                             cache_len=lc, split_out=split_out)
  outs = pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name="tree_attention_tpu",
  )(lens, qr, kc, vc, kn, vn, mask)
  if split_out:
    acc, m, den = outs
    return _combine(acc, m[..., :1], den[..., :1], split_axis=1).astype(out_dtype)
  return outs[0]


# -------------------------------------------- wrapper -------------------------------------------

@functools.partial(jax.jit, static_argnames=("scale", "backend", "block_sizes", "interpret"))
def _tree_attention(q, k_cache, v_cache, cache_lengths, k_new, v_new, tree_mask, *, scale, backend,
                    block_sizes, interpret):
  b, t, h, dh = q.shape
  lc, hkv = k_cache.shape[1], k_cache.shape[2]
  g = h // hkv
  rows = t * g
  kv_dtype = k_cache.dtype
  if backend == "triton":
    mp = max(16, _next_pow2(rows))  # tl.dot needs power-of-two tiles with M, N, K >= 16
    tn = max(16, _next_pow2(t))
    lpad = max(block_sizes.block_l - lc, 0)  # only tiny caches (L < block_l) are padded
  else:
    mp = _round_up(rows, 8)  # sublane multiple
    tn = _round_up(t, 8)  # new keys padded too (Mosaic mis-lowers a K=1 contraction)
    lpad = 0 if lc > 0 else 8
  # q [B, T, H, Dh] -> [B, Hkv, T * g, Dh] (row t * g + j = token t, head k * g + j), rows padded.
  qr = q.reshape(b, t, hkv, g, dh).transpose(0, 2, 1, 3, 4).reshape(b, hkv, rows, dh)
  qr = jnp.pad(qr.astype(kv_dtype), ((0, 0), (0, 0), (0, mp - rows), (0, 0)))
  mask = jnp.repeat(tree_mask != 0, g, axis=1)  # [B, T * g, T]
  mask = jnp.pad(mask, ((0, 0), (0, mp - rows), (0, tn - t))).astype(jnp.int32)
  kn = jnp.pad(k_new.astype(kv_dtype), ((0, 0), (0, tn - t), (0, 0), (0, 0)))
  vn = jnp.pad(v_new.astype(kv_dtype), ((0, 0), (0, tn - t), (0, 0), (0, 0)))
  if lpad:
    k_cache = jnp.pad(k_cache, ((0, 0), (0, lpad), (0, 0), (0, 0)))
    v_cache = jnp.pad(v_cache, ((0, 0), (0, lpad), (0, 0), (0, 0)))
  lens = jnp.clip(cache_lengths.astype(jnp.int32), 0, lc)
  impl = _tree_attention_triton if backend == "triton" else _tree_attention_tpu
  out = impl(qr, k_cache, v_cache, lens, kn, vn, mask, scale=scale, bs=block_sizes,
             interpret=interpret, out_dtype=q.dtype)  # [B, Hkv, M, Dh]
  out = out[:, :, :rows].reshape(b, hkv, t, g, dh).transpose(0, 2, 1, 3, 4)
  return out.reshape(b, t, h, dh)


def tree_attention(q, k_cache, v_cache, cache_lengths, k_new, v_new, tree_mask, *,
                   interpret: bool = False, scale: float | None = None, backend: str = "auto",
                   block_sizes: BlockSizes | None = None):
  """Pallas tree-verify attention; same contract and result as ``tree_attention_reference``.

  backend: "triton" (GPU), "tpu" (Mosaic) or "auto" (tpu on a TPU default backend, else triton; with
  ``interpret=True`` the chosen body runs in the Pallas interpreter, e.g. on CPU).
  block_sizes: ``BlockSizes``; None picks ``BlockSizes.for_backend(backend)``.
  q, k_new and v_new are cast to the cache dtype for the matmuls (f32 accumulation and softmax);
  the output is in q.dtype. Cache positions past cache_lengths are never used, even if non-finite.
  Raises ValueError (before tracing) on mismatched shapes/heads, unsupported Dh or block sizes that
  break the backend's tiling rule. Static: scale, backend, block_sizes, interpret.
  """
  backend = resolve_backend(backend, interpret)
  bs = BlockSizes.for_backend(backend) if block_sizes is None else block_sizes
  if not isinstance(bs, BlockSizes):
    raise ValueError(f"tree_attention: block_sizes must be a BlockSizes, got {type(bs).__name__}")
  _validate(q, k_cache, v_cache, cache_lengths, k_new, v_new, tree_mask, backend, interpret, bs)
  scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
  if not math.isfinite(scale):
    raise ValueError(f"tree_attention: scale must be finite, got {scale}")
  return _tree_attention(q, k_cache, v_cache, cache_lengths, k_new, v_new, tree_mask, scale=scale,
                         backend=backend, block_sizes=bs, interpret=bool(interpret))
