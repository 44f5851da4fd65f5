"""Fused unembed + Gumbel-max sampling + logsumexp: the sampled token and its logprob per row,
without writing the [R, V] logits to memory.

Shapes (dimension legend in ``specroll_jax/__init__.py``):
  hidden     [R, D]  final-normed hidden states (the caller applies the final norm)
  unembed    [D, V]  output projection (``unembed_layout="dv"``, the default), or
             [V, D]  with ``unembed_layout="vd"``: a tied embedding table used as is, D contracted
                     on both sides (no transpose, no copy)
  seed       []      uint32/int scalar
  sample_ids [R] int32, positions [R] int32   noise coordinates (``specroll_jax.sampling``)
  -> tokens [R] int32, logprobs [R] f32

For each row, with x = logits / T (T > 0) or x = logits (T = 0, greedy), the token is
argmax_v (x_v + Gumbel(seed, sample_id, position, v)) (greedy: argmax_v x_v), lowest id on ties like
``jnp.argmax``, and the logprob is x_tok - logsumexp(x): exactly ``sampling.sample`` with a plain
(no top-k / top-p) ``SamplingConfig``. The noise is computed in-kernel by the same functions
(``row_key``, ``token_bits``, ``gumbel_from_bits``), so it is bit-identical to the jnp path.

Kernel: a tile of rows x a tile of vocab per step, logits = hidden_tile @ unembed_tile in f32
accumulation, then an online max of x + g with argmax tracking and an online logsumexp of x.
Vocab tiles are spread over S splits (separate programs, for parallelism when R is small); each
split writes (best key, its id, its x, running max, running sum) per row; a jnp step combines them.
Triton: grid (row tiles, S), each program loops over its vocab tiles and over D in block_d chunks.
Mosaic: grid (row tiles, S, tiles per split) with the vocab axis a sequential reduction, whole D per
step; row tiles are multiples of 8 sublanes (16 for 16-bit dtypes) and the scoped VMEM limit is
passed explicitly. f32 operands use full-precision dots (Triton would otherwise use TF32), and both
paths temper by the same precomputed f32 factor ``counter_hash.inverse_temperature(T)``, so the
kernel and the reference pick the same tokens. Non-finite logits make the row's logprob non-finite
(check ``jnp.isfinite(logprobs)``).

Files: this module (contract, reference, block sizes, validation), ``fused_sampler_triton`` and
``fused_sampler_tpu`` (the kernels, as ``tree_attention_triton`` / ``_tpu``), ``_sampler_math``
(the tile math both share) and ``_backend`` (the backend rule every kernel uses).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels._backend import BACKENDS, resolve_backend
from pallas_kernels._sampler_math import BIG_ID, NEG, contract, finish
from pallas_kernels._shapes import float_arg as _float_arg
from pallas_kernels._shapes import int_arg as _int_arg
from pallas_kernels._shapes import is_pow2 as _is_pow2
from pallas_kernels._shapes import next_pow2 as _next_pow2
from pallas_kernels._shapes import round_up as _round_up
from pallas_kernels.counter_hash import gumbel_from_bits, inverse_temperature, row_key, token_bits
from pallas_kernels.fused_sampler_tpu import TPU_LANES as _TPU_LANES
from pallas_kernels.fused_sampler_tpu import _fused_sample_tpu
from pallas_kernels.fused_sampler_triton import _fused_sample_triton

_TPU_VMEM_BUDGET = 12 << 20  # double-buffered blocks; under the 16 MiB default scoped VMEM of v5e
LAYOUTS = ("dv", "vd")

__all__ = ["BACKENDS", "LAYOUTS", "BlockSizes", "finish", "fused_sample", "fused_sample_partials",
           "fused_sample_reference", "merge_shards"]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling of the fused sampler. Frozen and hashable (a static jit argument).

  block_r: rows per tile; None: Triton min(max(16, next_pow2(R)), 128) (64 for f32), TPU
    min(round_up(R, 8 or 16 for 16-bit dtypes), 256). The unembed is streamed once per row tile:
    large R wants big tiles.
  block_v: vocab ids per tile (Triton: power of two >= 16; TPU: multiple of 128); None: 128 on
    Triton; on TPU the widest of 512, 256, 128 whose double-buffered blocks fit 12 MiB of VMEM.
  block_d: D chunk per matmul step (Triton only; power of two >= 16 dividing D); None: the largest
    of 128, 64, 32, 16 dividing D (at most 64 for f32, so f32 tiles fit shared memory).
  num_splits: vocab splits run as separate programs; None: enough for ~2 waves of an H200 on Triton,
    1 (2 for a single row tile) on TPU.
  num_warps / num_stages: Triton launch parameters (num_warps None: 4 for block_r <= 32, else 8).
  """

  block_r: int | None = None
  block_v: int | None = None
  block_d: int | None = None
  num_splits: int | None = None
  num_warps: int | None = None
  num_stages: int = 3

  def __post_init__(self):
    for name in ("block_r", "block_v", "block_d", "num_splits"):
      object.__setattr__(self, name, _int_arg(getattr(self, name),
                                              f"fused_sampler.BlockSizes.{name}", 1, optional=True))
    w = self.num_warps
    if w is not None and w not in (1, 2, 4, 8, 16):
      raise ValueError(f"fused_sampler.BlockSizes.num_warps must be None or 1/2/4/8/16, got {w!r}")
    object.__setattr__(self, "num_stages", _int_arg(
        self.num_stages, "fused_sampler.BlockSizes.num_stages", 1))



def fused_sample_reference(hidden, unembed, seed, sample_ids, positions, *, temperature: float,
                           unembed_layout: str = "dv", vocab_offset: int = 0):
  """Plain jnp: f32 logits ``hidden @ unembed`` (D contracted on both sides for the [V, D]
  layout, no transpose), tempered by ``inverse_temperature(T)`` (T > 0), Gumbel-max with the
  counter-based noise (lowest id on ties), logprob = x_tok - logsumexp(x).
  Equal to ``specroll_jax.sampling.sample`` with a plain config (tested there)."""
  if unembed_layout not in LAYOUTS:
    raise ValueError(f"fused_sample_reference: unembed_layout must be one of {LAYOUTS}, got "
                     f"{unembed_layout!r}")
  logits = lax.dot_general(hidden.astype(jnp.float32), unembed.astype(jnp.float32),
                           contract(unembed_layout), precision=lax.Precision.HIGHEST)
  x = logits * inverse_temperature(temperature) if temperature > 0 else logits
  z = x
  if temperature > 0:
    key = row_key(seed, sample_ids, positions)[:, None]
    ids = jnp.arange(x.shape[-1], dtype=jnp.uint32) + jnp.uint32(vocab_offset)
    z = x + gumbel_from_bits(token_bits(key, ids))
  m = jnp.max(z, axis=-1, keepdims=True)
  iota = lax.broadcasted_iota(jnp.int32, z.shape, 1)
  tokens = jnp.min(jnp.where(z == m, iota, z.shape[-1]), axis=-1)
  tokens = jnp.where(tokens == z.shape[-1], 0, tokens).astype(jnp.int32)
  lse = jax.nn.logsumexp(x, axis=-1)
  logprobs = jnp.take_along_axis(x, tokens[:, None], axis=-1)[:, 0] - lse
  return tokens + vocab_offset, logprobs


# -------------------------------------------- wrapper ---------------------------------------------

def _resolve_blocks(bs: BlockSizes, backend: str, interpret: bool, r: int, d_model: int,
                    itemsize: int) -> BlockSizes:
  """Fill None fields with the backend's defaults and check the backend's tiling rule."""
  if backend == "triton":
    widest_r = 64 if itemsize == 4 else 128  # f32 tiles: half, to fit shared memory
    block_r = bs.block_r if bs.block_r is not None else min(max(16, _next_pow2(r)), widest_r)
    block_v = bs.block_v if bs.block_v is not None else 128
    for name, val in (("block_r", block_r), ("block_v", block_v)):
      if not _is_pow2(val) or val < 16:
        raise ValueError(f"fused_sample: {name}={val} breaks the Triton rule: block shapes must be "
                         "powers of two >= 16")
    block_d = bs.block_d
    if block_d is None and not interpret and d_model % 16 != 0:
      raise ValueError(f"fused_sample: D={d_model} must be a multiple of 16 on Triton (D is "
                       "tiled in power-of-two chunks)")
    if block_d is not None and (not _is_pow2(block_d) or block_d < 16 or d_model % block_d):
      raise ValueError(f"fused_sample: block_d={block_d} breaks the Triton rule: a power of two "
                       f">= 16 that divides D={d_model}")
  else:
    sublanes = 16 if itemsize == 2 else 8  # 16-bit dtypes pack two rows per sublane
    block_r = bs.block_r if bs.block_r is not None else min(_round_up(r, sublanes), 256)
    block_v = bs.block_v
    if block_v is None:  # widest tile whose double-buffered hidden + unembed blocks fit 12 MiB
      fits = lambda bv: 2 * (block_r + bv) * d_model * itemsize <= _TPU_VMEM_BUDGET
      block_v = next((bv for bv in (512, 256) if fits(bv)), 128)
    if block_r % sublanes:
      raise ValueError(f"fused_sample: block_r={block_r} breaks the TPU (8, 128) rule: rows are "
                       f"the sublane dim, so block_r must be a multiple of {sublanes} for "
                       f"{8 * itemsize}-bit operands")
    if block_v % _TPU_LANES:
      raise ValueError(f"fused_sample: block_v={block_v} breaks the TPU (8, 128) rule: vocab ids "
                       "are the lane dim, so block_v must be a multiple of 128")
    block_d = None
  return dataclasses.replace(bs, block_r=block_r, block_v=block_v, block_d=block_d)


@functools.partial(jax.jit, static_argnames=("temperature", "backend", "block_sizes", "interpret",
                                             "layout"))
def _fused_partials(hidden, unembed, seed, sample_ids, positions, vocab_offset, *, temperature,
                    backend, block_sizes, interpret, layout):
  r = hidden.shape[0]
  rp = _round_up(r, block_sizes.block_r)
  pad = lambda a: jnp.pad(a, ((0, rp - r),) + ((0, 0),) * (a.ndim - 1))
  hidden = pad(hidden.astype(unembed.dtype))
  seeds = jnp.broadcast_to(jnp.asarray(seed).astype(jnp.uint32), (rp, 1))
  offs = jnp.broadcast_to(jnp.asarray(vocab_offset).astype(jnp.int32), (rp, 1))
  sids = pad(sample_ids.astype(jnp.int32)[:, None])
  pos = pad(positions.astype(jnp.int32)[:, None])
  impl = _fused_sample_triton if backend == "triton" else _fused_sample_tpu
  parts = impl(seeds, sids, pos, offs, hidden, unembed, temperature=temperature,
               bs=block_sizes, interpret=interpret, layout=layout)
  return tuple(p[:r] for p in parts)


def fused_sample(hidden, unembed, seed, sample_ids, positions, *, temperature: float,
                 block_sizes: BlockSizes | None = None, backend: str = "auto",
                 interpret: bool = False, unembed_layout: str = "dv"):
  """Sample one token per row from softmax((hidden @ unembed) / temperature) with counter-based
  Gumbel noise; returns (tokens int32 [R], logprobs f32 [R]) equal to ``fused_sample_reference``.

  unembed_layout: "dv" (unembed [D, V]) or "vd" (unembed [V, D], e.g. a tied embedding table
  passed as is: D is contracted on both sides, nothing is transposed or copied).

  temperature: static; 0 means greedy (logprob under softmax(logits)). backend: "triton", "tpu" or
  "auto" (see ``_backend.resolve_backend``); ``interpret=True`` runs the body in the Pallas
  interpreter (CPU tests). Raises ValueError before tracing on bad shapes, dtypes, temperature or
  block sizes that break the backend's tiling rule.
  """
  return finish(*fused_sample_partials(
      hidden, unembed, seed, sample_ids, positions, temperature=temperature,
      block_sizes=block_sizes, backend=backend, interpret=interpret,
      unembed_layout=unembed_layout))


def fused_sample_partials(hidden, unembed, seed, sample_ids, positions, *, temperature: float,
                          vocab_offset=0, block_sizes: BlockSizes | None = None,
                          backend: str = "auto", interpret: bool = False,
                          unembed_layout: str = "dv"):
  """The fused sampler over one slice of the vocabulary: ``unembed`` holds the columns (rows for
  "vd") of token ids ``vocab_offset`` .. ``vocab_offset + V - 1`` (a vocabulary-sharded
  unembedding's shard; ``vocab_offset`` may be traced, e.g. ``lax.axis_index`` times V). Returns
  five [R] arrays per row (best x + noise, its global id, its x, max x, sum exp(x - max)) that
  ``merge_shards`` combines across slices into exactly the token one device samples over the
  whole vocabulary (the noise of a token is that of its global id; lowest id on ties); ``finish``
  turns one (merged) partial into (tokens, logprobs). Arguments as ``fused_sample``."""
  backend = resolve_backend(backend, interpret)
  t = _float_arg(temperature, "fused_sample: temperature", 0)
  if unembed_layout not in LAYOUTS:
    raise ValueError(f"fused_sample: unembed_layout must be one of {LAYOUTS}, got "
                     f"{unembed_layout!r}")
  d_axis = 0 if unembed_layout == "dv" else 1
  if hidden.ndim != 2 or unembed.ndim != 2 or hidden.shape[1] != unembed.shape[d_axis]:
    want = "[D, V]" if unembed_layout == "dv" else "[V, D]"
    raise ValueError(f"fused_sample: need hidden [R, D] and unembed {want} "
                     f"(unembed_layout={unembed_layout!r}) with the same D, got hidden "
                     f"{hidden.shape}, unembed {unembed.shape}")
  r, d_model = hidden.shape
  vocab = unembed.shape[1 - d_axis]
  if r < 1 or d_model < 1 or vocab < 1:
    raise ValueError(f"fused_sample: R, D, V must be >= 1, got hidden {hidden.shape}, unembed "
                     f"{unembed.shape}")
  for name, x in (("hidden", hidden), ("unembed", unembed)):
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
      raise ValueError(f"fused_sample: {name} dtype must be float32/bfloat16/float16, got "
                       f"{x.dtype}")
  for name, x in (("sample_ids", sample_ids), ("positions", positions)):
    if x.shape != (r,) or not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"fused_sample: {name} must be integer [R]={(r,)}, got "
                       f"{x.dtype}{list(x.shape)}")
  if jnp.ndim(seed) != 0:
    raise ValueError(f"fused_sample: seed must be a scalar, got shape {jnp.shape(seed)}")
  if isinstance(seed, int):  # same uint32 bits as sampling.row_key's astype(uint32), up to 2**32
    seed = np.uint32(seed & 0xFFFFFFFF)
  bs = BlockSizes() if block_sizes is None else block_sizes
  if not isinstance(bs, BlockSizes):
    raise ValueError(f"fused_sample: block_sizes must be a fused_sampler.BlockSizes, got "
                     f"{type(bs).__name__}")
  bs = _resolve_blocks(bs, backend, interpret, r, d_model, jnp.dtype(unembed.dtype).itemsize)
  if jnp.ndim(vocab_offset) != 0:
    raise ValueError(f"fused_sample: vocab_offset must be a scalar, got shape "
                     f"{jnp.shape(vocab_offset)}")
  return _fused_partials(hidden, unembed, seed, sample_ids, positions, vocab_offset,
                         temperature=float(t), backend=backend, block_sizes=bs,
                         interpret=bool(interpret), layout=unembed_layout)


def merge_shards(partials, axis_name):
  """Merge ``fused_sample_partials`` of vocabulary shards across the mapped axis ``axis_name``
  (inside ``shard_map``): the largest perturbed value wins, the lowest global id on ties (the
  single-device rule), and the logsumexp combines every shard's (max, sum). Returns the merged
  partial (invariant over the axis); ``finish`` gives (tokens, logprobs)."""
  z, ids, x, m, den = partials
  best = lax.pmax(z, axis_name)
  tok = lax.pmin(jnp.where(z == best, ids, BIG_ID), axis_name)
  x_tok = lax.pmax(jnp.where((ids == tok) & (z == best), x, NEG), axis_name)
  m_max = lax.pmax(m, axis_name)
  den = lax.psum(den * jnp.exp(m - m_max), axis_name)
  return best, tok, x_tok, m_max, den
