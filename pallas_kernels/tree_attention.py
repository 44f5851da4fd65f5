"""Tree-verify attention: queries = one step's tokens; keys = valid KV cache prefix + step's K/V.

Shapes (dimension legend in ``specroll_jax/__init__.py``):
  q        [B, T, H, Dh]    the step's queries (T = N + 1 tree nodes, a prompt, any chunk)
  k_cache  [B, L, Hkv, Dh]  KV cache; only the first ``cache_lengths[b]`` positions of row b count
  v_cache  [B, L, Hkv, Dh]
  cache_lengths [B] int32
  k_new    [B, T, Hkv, Dh]  the step's own keys/values
  v_new    [B, T, Hkv, Dh]
  tree_mask [B, T, T] bool  query i may attend new key j (ancestor-or-self in a tree; causal chunk)
  -> out   [B, T, H, Dh] in q.dtype

GQA: query head h reads kv head h // (H // Hkv). A query row with no allowed key returns zeros.

Tiling (both bodies). Kv head k and its g = H // Hkv query heads share K/V, so a query tile is
``tq`` tokens x g heads = tq * g rows (row s * g + j: token s of the tile, head k * g + j), at most
``block_q`` rows (128; 64 for f32 on Triton): each K/V byte is read once per (tile, kv head) and
the score tile [rows, block] stays small whatever T is (prefill and long steps included). The grid
runs over (B, Hkv, query tiles, L splits); keys are walked in blocks, first the valid cache prefix
(``block_l``), then the step's own keys (``block_t``) under the tree mask, which is kept at token
granularity [B, T, T] and expanded to rows inside the kernel (a row gather on Triton, a one-hot
matmul on TPU), never materialised per head. Only the partial last block of each walk is masked.
See ``tree_attention_triton.py`` and ``tree_attention_tpu.py`` for the per-backend layout.

Splits of L (flash-decoding; both backends), for few rows over a long cache: S programs share
each (row, kv head, query tile). Row b's ceil(cache_lengths[b] / block_l) valid blocks are dealt
out in order, ceil(blocks / S) per split (``_flash.row_split``), so the split follows each row's
own length; split 0 also walks the step's own keys under the tree mask (the new keys are seen
exactly once). Each split writes its unnormalised partials in f32 (acc [M, Dh], running max m
and sum den [M, 1]) and ``_flash.combine`` merges them exactly in jnp:
out = sum_s e^(m_s - m) acc_s / sum_s e^(m_s - m) den_s with m = max_s m_s; an empty split
(den = 0, acc = 0) drops out, and a query with no allowed key still returns zeros. S = 1 is the
unsplit kernel, which normalises in place.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._backend import resolve_backend
from pallas_kernels._flash import MAX_SPLITS as MAX_NUM_SPLITS
from pallas_kernels._flash import NEG as _NEG
from pallas_kernels._shapes import is_pow2 as _is_pow2
from pallas_kernels.tree_attention_tpu import split_count as _tpu_split_count
from pallas_kernels.tree_attention_tpu import tree_attention_tpu
from pallas_kernels.tree_attention_triton import split_count as _triton_split_count
from pallas_kernels.tree_attention_triton import tree_attention_triton

# Head widths the compiled backends support (power-of-two tiles for Triton; lane-dense for Mosaic).
SUPPORTED_HEAD_DIMS = (64, 128)
# interpret=True also accepts any multiple of 16 up to 256 (the kernel body has no tile rule there).
INTERPRET_HEAD_DIM_MULTIPLE = 16
INTERPRET_MAX_HEAD_DIM = 256
TPU_LANES = 128


def _splits_arg(n, name: str) -> int | None:
  """A num_splits value as None or a Python int in [1, MAX_NUM_SPLITS] (numpy ints accepted,
  bools refused); ValueError naming the argument, the limit and the value."""
  if n is None:
    return None
  if isinstance(n, bool) or not isinstance(n, int | np.integer) or not 1 <= n <= MAX_NUM_SPLITS:
    raise ValueError(f"{name} must be None or an int in [1, {MAX_NUM_SPLITS}], got {n!r}")
  return int(n)


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


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling of the tree-attention kernel. Frozen and hashable (a static jit argument). None fields
  take the backend's default for the dtype and T (``resolve``).

  block_q: query rows per tile (tq tokens x g heads per tile, tq = block_q // g); None: 128, or 64
    for f32 on Triton (half the shared memory per tile).
  block_l: cache positions per block. Triton: a power of two >= 16, None: 128 (64 for f32).
    TPU: a multiple of 128, None: 512 (lowered to the largest multiple of 128 within L).
  block_t: the step's own keys per block (same rules as block_l). None: Triton
    min(block_l, next_pow2(max(T, 16))); TPU min(512, T rounded up to 128).
  num_splits: splits of L run as separate programs and combined afterwards (flash-decoding), an
    int in [1, MAX_NUM_SPLITS]; None picks one from the program count and L (more splits when
    B * Hkv * tiles is small; ``tree_attention``'s ``num_splits`` documents the rule).
  num_warps: Triton warps per program; None: 4 for query tiles up to 64 rows, else 8.
  num_stages: Triton software-pipelining stages.
  """

  block_q: int | None = None
  block_l: int | None = None
  block_t: int | None = None
  num_splits: int | None = None
  num_warps: int | None = None
  num_stages: int = 2

  def __post_init__(self):
    for name in ("block_q", "block_l", "block_t"):
      x = getattr(self, name)
      if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < 8):
        raise ValueError(f"BlockSizes.{name} must be None or an int >= 8, got {x!r}")
    object.__setattr__(self, "num_splits", _splits_arg(self.num_splits, "BlockSizes.num_splits"))
    w = self.num_warps
    if w is not None and (not isinstance(w, int) or w not in (1, 2, 4, 8, 16)):
      raise ValueError(f"BlockSizes.num_warps must be None or one of 1, 2, 4, 8, 16, got {w!r}")
    if not isinstance(self.num_stages, int) or self.num_stages < 1:
      raise ValueError(f"BlockSizes.num_stages must be an int >= 1, got {self.num_stages!r}")

  def resolve(self, backend: str, dtype, t: int) -> BlockSizes:
    """These block sizes with every None tile filled in for ``backend`` ("triton" or "tpu"),
    operand ``dtype`` and T new tokens."""
    f32 = jnp.dtype(dtype) == jnp.float32
    if backend == "triton":
      block_q = self.block_q or (64 if f32 else 128)
      block_l = self.block_l or (64 if f32 else 128)
      block_t = self.block_t or min(block_l, max(16, 1 << (t - 1).bit_length()))
    else:
      block_q = self.block_q or 128
      block_l = self.block_l or 512
      block_t = self.block_t or min(512, -(-t // TPU_LANES) * TPU_LANES)
    return dataclasses.replace(self, block_q=block_q, block_l=block_l, block_t=block_t)

  @classmethod
  def for_backend(cls, backend: str, dtype=jnp.bfloat16, t: int = 1) -> BlockSizes:
    """Production defaults for ``backend``, ``dtype`` and T, resolved."""
    return cls().resolve(resolve_backend(backend, False), dtype, t)


def _check_head_dim(dh: int, backend: str, interpret: bool, what: str = "Dh"):
  if dh in SUPPORTED_HEAD_DIMS:
    return
  if interpret and dh % INTERPRET_HEAD_DIM_MULTIPLE == 0 and 0 < dh <= INTERPRET_MAX_HEAD_DIM:
    return
  raise ValueError(
      f"tree_attention: head width {what}={dh} unsupported on backend {backend!r}: compiled "
      f"kernels support Dh in {SUPPORTED_HEAD_DIMS}; interpret=True also accepts multiples of "
      f"{INTERPRET_HEAD_DIM_MULTIPLE} up to {INTERPRET_MAX_HEAD_DIM}")


def _check_blocks(bs: BlockSizes, backend: str):
  """The backend's tiling rule for resolved block sizes; ValueError naming value and rule."""
  if backend == "triton":
    for name in ("block_q", "block_l", "block_t"):
      x = getattr(bs, name)
      if not _is_pow2(x) or x < 16:
        raise ValueError(f"tree_attention: {name}={x} breaks the Triton rule: block shapes must "
                         "be powers of two >= 16")
  else:
    for name in ("block_l", "block_t"):
      x = getattr(bs, name)
      if x % TPU_LANES:
        raise ValueError(f"tree_attention: {name}={x} breaks the TPU (8, 128) rule: key blocks "
                         f"are the score tile's lane dim, so {name} must be a multiple of 128")


def _validate(q, k_cache, v_cache, cache_lengths, k_new, v_new, tree_mask, backend, interpret):
  """Shape / dtype checks before tracing; raises ValueError naming the value and the rule."""
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


@functools.partial(jax.jit, static_argnames=("scale", "backend", "block_sizes", "interpret"))
def _tree_attention(q, k_cache, v_cache, cache_lengths, k_new, v_new, tree_mask, *, scale, backend,
                    block_sizes, interpret):
  impl = tree_attention_triton if backend == "triton" else tree_attention_tpu
  lens = jnp.clip(cache_lengths.astype(jnp.int32), 0, k_cache.shape[1])
  return impl(q, k_cache, v_cache, lens, k_new, v_new, tree_mask, scale=scale, bs=block_sizes,
              interpret=interpret)


def _with_splits(bs: BlockSizes, num_splits) -> BlockSizes:
  """``bs`` with the ``num_splits`` argument applied; ValueError naming the value and the limit."""
  num_splits = _splits_arg(num_splits, "tree_attention: num_splits")
  if num_splits is None or num_splits == bs.num_splits:
    return bs
  if bs.num_splits is not None:
    raise ValueError(f"tree_attention: num_splits={num_splits} conflicts with "
                     f"block_sizes.num_splits={bs.num_splits}; set one of them")
  return dataclasses.replace(bs, num_splits=num_splits)


def _block_sizes(block_sizes, num_splits) -> BlockSizes:
  bs = BlockSizes() if block_sizes is None else block_sizes
  if not isinstance(bs, BlockSizes):
    raise ValueError(f"tree_attention: block_sizes must be a BlockSizes, got {type(bs).__name__}")
  return _with_splits(bs, num_splits)


def num_splits_for(q_shape, cache_shape, dtype=jnp.bfloat16, *, backend: str = "auto",
                   block_sizes: BlockSizes | None = None, num_splits: int | None = None) -> int:
  """The number of L splits ``tree_attention`` runs for q of ``q_shape`` [B, T, H, Dh] and a cache
  of ``cache_shape`` [B, L, Hkv, Dh] in ``dtype``, with the same ``backend``, ``block_sizes``
  and ``num_splits`` arguments (the automatic choice resolved, the clamp applied). Static: no
  arrays, nothing traced."""
  backend = resolve_backend(backend, False)
  bs = _block_sizes(block_sizes, num_splits).resolve(backend, dtype, q_shape[1])
  count = _triton_split_count if backend == "triton" else _tpu_split_count
  b, t, h, _ = q_shape
  return count(b, t, h, cache_shape[2], cache_shape[1], bs)


def tree_attention(q, k_cache, v_cache, cache_lengths, k_new, v_new, tree_mask, *,
                   interpret: bool = False, scale: float | None = None, backend: str = "auto",
                   block_sizes: BlockSizes | None = None, num_splits: int | None = None):
  """Pallas tree-verify attention; same contract and result as ``tree_attention_reference``.

  Any T >= 1 (a verify step, a long chunk or a whole prompt; L may be 0) and any L: queries are
  tiled by ``block_sizes.block_q`` rows, keys walked in blocks.
  backend: "triton" (GPU), "tpu" (Mosaic) or "auto" (tpu on a TPU default backend, else triton; with
  ``interpret=True`` the chosen body runs in the Pallas interpreter, e.g. on CPU).
  block_sizes: ``BlockSizes``; None fields take ``BlockSizes.resolve``'s defaults.
  num_splits: splits of the cache (L) axis over separate programs, merged exactly afterwards
    (module docstring), for the tail of a batch: few rows, long caches. An int in
    [1, ``MAX_NUM_SPLITS``]; 1 = no split; more splits than the cache has blocks of block_l run
    as one split per block. None = ``block_sizes.num_splits``, and when that is None too the
    backend's choice: on Triton, enough splits that B * Hkv * query tiles * S reaches about two
    waves of an H100/H200 (264 programs; so none at B * Hkv * tiles > 132), at most
    L / (8 * tile rows) so the f32 partials stay under a quarter of the KV bytes read, hence none
    for short caches; on TPU, 2 for a single program (a megacore chip's two TensorCores), else 1.
    ``num_splits_for`` returns the count a call runs. Setting both this and
    ``block_sizes.num_splits`` to different values is an error.
  q, k_new and v_new are cast to the cache dtype for the matmuls (f32 accumulation and softmax;
  f32 operands use full-precision dots); the output is in q.dtype. Cache positions past
  cache_lengths are never used, even if non-finite.
  Raises ValueError (before tracing) on mismatched shapes/heads, unsupported Dh, block sizes that
  break the backend's tiling rule, or num_splits outside [1, MAX_NUM_SPLITS]. Static: scale,
  backend, block_sizes, num_splits, interpret.
  """
  backend = resolve_backend(backend, interpret)
  bs = _block_sizes(block_sizes, num_splits)
  _validate(q, k_cache, v_cache, cache_lengths, k_new, v_new, tree_mask, backend, interpret)
  bs = bs.resolve(backend, k_cache.dtype, q.shape[1])
  _check_blocks(bs, backend)
  scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
  if not math.isfinite(scale):
    raise ValueError(f"tree_attention: scale must be finite, got {scale}")
  return _tree_attention(q, k_cache, v_cache, cache_lengths, k_new, v_new, tree_mask, scale=scale,
                         backend=backend, block_sizes=bs, interpret=bool(interpret))
