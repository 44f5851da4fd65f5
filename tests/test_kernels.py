"""Pallas kernels == their jnp references in interpret mode on CPU, and bad input is refused.

Interpret mode is slow on 2 cores, so each kernel is tested over a hand-picked list of cases that
together cover every axis (L and T off the block sizes, several query tiles and new-key blocks,
prefill with ragged prompts and L = 0, H/Hkv in {1, 2, 6, 7}, Dh in {64, 128}, empty and full
cache rows, T = 1, random tree masks, f32 and bf16, split and unsplit, both kernel bodies, both
unembedding layouts) instead of the full product. Each case compiles once. Lowering for cuda and
tpu is in ``test_kernels_lowering.py``.
"""

import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fused_sampler as fs
from pallas_kernels import tree_attention as ta

# f32: the kernel computes what the reference computes up to summation order (full-precision
# dots). bf16: inputs and output are rounded to 8 mantissa bits and P is cast to bf16 for the PV
# matmul, so 2e-2 (abs and rel: outputs are averages of N(0, 1) values and can sit near zero).
TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _rng(*case):
  """A generator seeded by the case itself: fresh inputs per case, reproducible across runs."""
  return np.random.default_rng(zlib.crc32(repr(case).encode()))


# References jitted: one compile per case instead of one per eager op (several times faster here).
attention_ref = ta.tree_attention_reference_jit
sampler_ref = jax.jit(fs.fused_sample_reference, static_argnames=("temperature", "unembed_layout"))


def _tree_mask(rng, b, t):
  """Random trees: each node's parent is an earlier node; mask = ancestor-or-self."""
  mask = np.zeros((b, t, t), bool)
  for i in range(b):
    for j in range(t):
      mask[i, j, j] = True
      if j:
        mask[i, j] |= mask[i, rng.integers(0, j)]
  return mask


def _prefill_mask(rng, b, t):
  """Ragged prompts, right-padded: causal among each row's first n_b tokens, nothing after."""
  n = rng.integers(1, t + 1, size=b)
  n[0] = t
  causal = np.tril(np.ones((t, t), bool))
  valid = np.arange(t)[None, :] < n[:, None]  # [B, T]
  return causal[None] & valid[:, None, :] & valid[:, :, None]


def _attention_inputs(rng, b, t, h, hkv, dh, lc, dtype, kind="tree"):
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dtype)
  q = normal(b, t, h, dh)
  k_cache, v_cache = normal(b, lc, hkv, dh), normal(b, lc, hkv, dh)
  k_new, v_new = normal(b, t, hkv, dh), normal(b, t, hkv, dh)
  if kind == "prefill":
    lengths = np.zeros(b, np.int64)
    mask = _prefill_mask(rng, b, t)
  else:
    lengths = rng.integers(0, lc + 1, size=b)
    lengths[0] = lc  # a full row
    if b > 1:
      lengths[1] = 0  # an empty row
    mask = _tree_mask(rng, b, t)
  return q, k_cache, v_cache, jnp.asarray(lengths, jnp.int32), k_new, v_new, jnp.asarray(mask)


def _upcast(args):
  return tuple(a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args)


# (B, T, H, Hkv, Dh, L, dtype, backend, BlockSizes kwargs, inputs kind)
ATTENTION_CASES = [
    (2, 5, 4, 2, 64, 80, jnp.float32, "triton", dict(block_l=32, num_splits=1), "tree"),
    (2, 5, 4, 2, 64, 80, jnp.float32, "triton", dict(block_l=16, num_splits=3), "tree"),  # split
    (3, 1, 7, 1, 64, 37, jnp.float32, "triton", dict(block_l=16), "tree"),  # MQA g = 7, T = 1
    (2, 4, 2, 2, 128, 64, jnp.float32, "triton", dict(block_l=32, num_splits=2), "tree"),  # g = 1
    (2, 6, 14, 2, 128, 50, jnp.bfloat16, "triton", dict(block_l=16), "tree"),  # g = 7, bf16
    (2, 3, 4, 4, 64, 9, jnp.bfloat16, "triton", {}, "tree"),  # L < block_l, default blocks
    # Long steps: several query tiles (tq = 16 // g), several new-key blocks, partial last ones.
    (2, 21, 12, 2, 64, 40, jnp.float32, "triton", dict(block_q=16, block_l=16, block_t=16), "tree"),
    (3, 37, 4, 2, 64, 0, jnp.float32, "triton", dict(block_q=32, block_t=16), "prefill"),  # L = 0
    (2, 45, 12, 2, 128, 24, jnp.bfloat16, "triton", dict(block_q=64, block_t=32), "prefill"),
    (2, 5, 4, 2, 64, 200, jnp.float32, "tpu", dict(block_l=128, num_splits=1), "tree"),
    (1, 4, 14, 2, 128, 200, jnp.bfloat16, "tpu", dict(block_l=128, num_splits=2), "tree"),
    (2, 1, 7, 1, 64, 70, jnp.float32, "tpu", {}, "tree"),  # L < 128 (padded), T = 1
    (2, 9, 8, 4, 64, 130, jnp.float32, "tpu", dict(block_q=16), "tree"),  # Dh 64: 2 heads a group
    (3, 37, 4, 2, 64, 0, jnp.float32, "tpu", dict(block_q=32), "prefill"),  # L = 0, 3 tiles
    (2, 150, 12, 2, 128, 0, jnp.bfloat16, "tpu", dict(block_q=64, block_t=128), "prefill"),
]


class TestTreeAttention:

  @pytest.mark.parametrize("b,t,h,hkv,dh,lc,dtype,backend,blocks,kind", ATTENTION_CASES)
  def test_matches_reference(self, b, t, h, hkv, dh, lc, dtype, backend, blocks, kind):
    rng = _rng(b, t, h, hkv, dh, lc, dtype, backend, blocks, kind)
    args = _attention_inputs(rng, b, t, h, hkv, dh, lc, dtype, kind)
    out = ta.tree_attention(*args, interpret=True, backend=backend,
                            block_sizes=ta.BlockSizes(**blocks))
    ref = attention_ref(*_upcast(args))
    assert out.shape == (b, t, h, dh) and out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), **TOL[dtype])

  @pytest.mark.parametrize("backend,splits", [("triton", 2), ("tpu", 1)])
  def test_fully_masked_row_is_zero_not_nan(self, backend, splits):
    rng = np.random.default_rng(7)
    q, kc, vc, lengths, kn, vn, mask = _attention_inputs(rng, 2, 3, 4, 2, 64, 40, jnp.float32)
    lengths = lengths.at[1].set(0)
    mask = mask.at[1, 2, :].set(False)  # row 1, query 2: no cache and no tree key
    kc = kc.at[:, 39].set(jnp.nan)  # past every length: must never be read into the result
    lengths = lengths.at[0].set(39)
    bs = ta.BlockSizes(block_l=128 if backend == "tpu" else 16, num_splits=splits)
    out = ta.tree_attention(q, kc, vc, lengths, kn, vn, mask, interpret=True, backend=backend,
                            block_sizes=bs)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out[1, 2]), 0.0)
    ref = attention_ref(q, jnp.nan_to_num(kc), vc, lengths, kn, vn, mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **TOL[jnp.float32])

  def test_tpu_body_under_the_tpu_interpreter(self):
    # The Mosaic body under pltpu.InterpretParams (TPU semantics: DMAs, scalar prefetch, scratch
    # kept across the sequential grid axis), with splits, a partial block and two query tiles.
    from jax.experimental.pallas import tpu as pltpu

    from pallas_kernels.tree_attention_tpu import tree_attention_tpu
    args = _attention_inputs(np.random.default_rng(5), 1, 6, 4, 2, 128, 300, jnp.float32)
    bs = ta.BlockSizes(block_q=8, block_l=128, num_splits=2).resolve("tpu", jnp.float32, 6)
    f = lambda *a: tree_attention_tpu(*a, scale=128 ** -0.5, bs=bs,
                                      interpret=pltpu.InterpretParams())
    out = jax.jit(f)(*args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(attention_ref(*args)),
                               **TOL[jnp.float32])

  @pytest.mark.parametrize("change,match", [
      (dict(h=6, hkv=4), r"H=6 must be a multiple of kv heads Hkv=4"),
      (dict(v_len=32), r"v_cache shape .* != k_cache shape"),
      (dict(dh=96), r"Dh=96 unsupported"),
      (dict(block_l=48), r"block_l=48 breaks the Triton rule"),
      (dict(block_q=24), r"block_q=24 breaks the Triton rule"),
      (dict(block_t=96), r"block_t=96 breaks the Triton rule"),
      (dict(block_l=64, backend="tpu"), r"block_l=64 breaks the TPU \(8, 128\) rule"),
      (dict(block_t=64, backend="tpu"), r"block_t=64 breaks the TPU \(8, 128\) rule"),
      (dict(mask_t=3), r"tree_mask must be \[B, T, T\]"),
      (dict(lengths_b=3), r"cache_lengths must be integer \[B\]"),
  ])
  def test_bad_input_raises(self, change, match):
    h, hkv, dh = change.get("h", 4), change.get("hkv", 2), change.get("dh", 64)
    b, t, lc = 2, 4, 40
    z = lambda *s: jnp.ones(s, jnp.float32)
    q, kc, vc = z(b, t, h, dh), z(b, lc, hkv, dh), z(b, change.get("v_len", lc), hkv, dh)
    kn = vn = z(b, t, hkv, dh)
    mt = change.get("mask_t", t)
    mask = jnp.ones((b, mt, mt), bool)
    lengths = jnp.zeros((change.get("lengths_b", b),), jnp.int32)
    bs = ta.BlockSizes(**{k: change[k] for k in ("block_q", "block_l", "block_t") if k in change})
    with pytest.raises(ValueError, match=match):
      ta.tree_attention(q, kc, vc, lengths, kn, vn, mask, interpret=False,
                        backend=change.get("backend", "triton"), block_sizes=bs)

  def test_block_sizes_validate_and_resolve(self):
    with pytest.raises(ValueError, match="num_warps"):
      ta.BlockSizes(num_warps=3)
    with pytest.raises(ValueError, match="num_splits"):
      ta.BlockSizes(num_splits=0)
    with pytest.raises(ValueError, match="block_q"):
      ta.BlockSizes(block_q=4)
    # f32 tiles are half the 16-bit ones on Triton (shared memory); TPU keeps lane-dense blocks.
    assert ta.BlockSizes.for_backend("triton", jnp.bfloat16, 13) == ta.BlockSizes(
        block_q=128, block_l=128, block_t=16)
    assert ta.BlockSizes.for_backend("triton", jnp.float32, 2048) == ta.BlockSizes(
        block_q=64, block_l=64, block_t=64)
    assert ta.BlockSizes.for_backend("tpu", jnp.bfloat16, 13) == ta.BlockSizes(
        block_q=128, block_l=512, block_t=128)
    assert ta.BlockSizes(block_l=256).resolve("tpu", jnp.float32, 2048).block_t == 512


# Splits of L through the public ``num_splits`` (backend, T, L, block_l, num_splits, lengths, want):
# each row's valid blocks are dealt out over the splits, so these rows cover a full row whose
# last split is partial (L off the block and the chunk), a row shorter than one block, an empty
# row and a row that leaves the last split(s) empty; split 0 also holds the T new keys.
SPLIT_CASES = [
    ("triton", 8, 100, 16, 3, (100, 9, 0, 61), 3),  # 7 blocks: 3 + 3 + 1
    ("triton", 1, 185, 16, 4, (185, 0, 5, 70), 4),  # T = 1; 12 blocks: 3 x 4, the last partial
    ("tpu", 8, 300, 128, 3, (300, 0, 100, 200), 3),  # Mosaic: one 128-block per split
]


class TestSplits:

  @pytest.mark.parametrize("backend,t,lc,block_l,splits,lengths,want", SPLIT_CASES)
  def test_split_matches_reference(self, backend, t, lc, block_l, splits, lengths, want):
    b, h, hkv, dh = len(lengths), 4, 2, 64
    rng = _rng("split", backend, t, lc, block_l, splits, lengths)
    q, kc, vc, _, kn, vn, mask = _attention_inputs(rng, b, t, h, hkv, dh, lc, jnp.float32)
    lens = jnp.asarray(lengths, jnp.int32)
    bs = ta.BlockSizes(block_l=block_l)
    assert ta.num_splits_for(q.shape, kc.shape, jnp.float32, backend=backend, block_sizes=bs,
                             num_splits=splits) == want
    out = ta.tree_attention(q, kc, vc, lens, kn, vn, mask, interpret=True, backend=backend,
                            block_sizes=bs, num_splits=splits)
    ref = attention_ref(q, kc, vc, lens, kn, vn, mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **TOL[jnp.float32])

  def test_automatic_choice(self):
    # Triton: splits while B * Hkv * tiles is under ~2 waves of 132 SMs and L is long enough.
    qwen = lambda b, t, lc, **kw: ta.num_splits_for((b, t, 12, 128), (b, lc, 2, 128),
                                                    backend="triton", **kw)
    assert qwen(16, 1, 4096) == qwen(16, 8, 4096) == 8  # 32 programs
    assert qwen(64, 1, 4096) == 2 and qwen(256, 8, 4096) == 1
    assert qwen(16, 1, 128) == 1  # a short cache: the partials would outweigh the keys
    assert qwen(16, 1, 4096, num_splits=1) == 1  # no split
    assert qwen(16, 1, 4096, num_splits=64) == 32  # clamped to the 32 cache blocks of 128
    assert qwen(1, 1, 1 << 16) == 128  # 2 programs x 128 splits of 4 blocks
    one_program = ta.num_splits_for((1, 1, 8, 128), (1, 1 << 16, 1, 128), backend="triton")
    assert one_program == ta.MAX_NUM_SPLITS  # 264 wanted, capped
    # TPU: only a single program is split (over a megacore chip's two TensorCores).
    tpu = lambda b, hkv: ta.num_splits_for((b, 1, 4, 128), (b, 4096, hkv, 128), backend="tpu")
    assert tpu(1, 1) == 2 and tpu(2, 1) == tpu(1, 2) == 1

  @pytest.mark.parametrize("n", [0, -1, ta.MAX_NUM_SPLITS + 1, True, 2.0, "4"])
  def test_num_splits_out_of_range_raises(self, n):
    q, kc, vc, lens, kn, vn, mask = _attention_inputs(np.random.default_rng(3), 2, 3, 4, 2, 64, 40,
                                                      jnp.float32)
    match = rf"tree_attention: num_splits must be None or an int in \[1, 256\], got {n!r}"
    with pytest.raises(ValueError, match=match):
      ta.tree_attention(q, kc, vc, lens, kn, vn, mask, backend="triton", num_splits=n)
    with pytest.raises(ValueError, match=r"BlockSizes.num_splits must be .* \[1, 256\]"):
      ta.BlockSizes(num_splits=n)
    with pytest.raises(ValueError, match=r"conflicts with block_sizes.num_splits=2"):
      ta.tree_attention(q, kc, vc, lens, kn, vn, mask, backend="triton", num_splits=4,
                        block_sizes=ta.BlockSizes(num_splits=2))

  @pytest.mark.parametrize("platform", ["cuda", "tpu"])
  def test_split_lowers_at_the_tail_shape(self, platform):
    # B = 16 rows of Qwen2.5-1.5B heads over a 4096 cache, an 8-node tree, 16 splits.
    from pallas_kernels import lowering
    sds = jax.ShapeDtypeStruct
    b, t, lc, bf = 16, 8, 4096, jnp.bfloat16
    specs = (sds((b, t, 12, 128), bf), sds((b, lc, 2, 128), bf), sds((b, lc, 2, 128), bf),
             sds((b,), jnp.int32), sds((b, t, 2, 128), bf), sds((b, t, 2, 128), bf),
             sds((b, t, t), jnp.bool_))
    backend = "triton" if platform == "cuda" else "tpu"
    f = lambda *a: ta.tree_attention(*a, backend=backend, num_splits=16)
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated")
      lowering.lowers(f, specs, platform)


# (R, D, V, temperature, dtype, backend, block_v, num_splits, unembed_layout)
SAMPLER_CASES = [
    (10, 64, 300, 1.0, jnp.float32, "triton", 64, None, "dv"),  # V off the tile, auto splits
    (10, 64, 300, 0.7, jnp.float32, "triton", 128, 1, "dv"),  # one split: every tile, one program
    (10, 64, 300, 0.0, jnp.float32, "triton", 128, 2, "dv"),  # greedy
    (20, 48, 50, 0.7, jnp.float32, "triton", 128, None, "dv"),  # V < tile, D not a power of two
    (9, 64, 300, 1.0, jnp.bfloat16, "triton", 64, 3, "dv"),  # bf16 inputs, f32 accumulation
    (10, 64, 300, 1.3, jnp.float32, "triton", 64, 2, "vd"),  # [V, D] unembedding (tied)
    (20, 48, 50, 0.0, jnp.bfloat16, "triton", None, None, "vd"),
    (12, 64, 1000, 0.7, jnp.float32, "tpu", 256, 2, "dv"),  # Mosaic body, partial last tile
    (5, 64, 700, 0.0, jnp.float32, "tpu", 128, None, "dv"),  # Mosaic body, greedy
    (12, 64, 1000, 1.3, jnp.bfloat16, "tpu", 256, None, "vd"),  # Mosaic, [V, D], 16-row tiles
    (7, 32, 60, 1.0, jnp.float32, "tpu", None, None, "vd"),  # V < 128 (padded to one tile)
]


def _sampler_inputs(rng, r, d, v, dtype, layout="dv"):
  hidden = jnp.asarray(rng.standard_normal((r, d)), jnp.float32).astype(dtype)
  unembed = jnp.asarray(rng.standard_normal((d, v)) * 0.3, jnp.float32).astype(dtype)
  if layout == "vd":
    unembed = jnp.asarray(unembed.T)  # a real [V, D] array, as an embedding table is
  sample_ids = jnp.asarray(rng.integers(0, 10_000, size=r), jnp.int32)
  positions = jnp.asarray(rng.integers(0, 4_096, size=r), jnp.int32)
  return hidden, unembed, sample_ids, positions


class TestFusedSampler:

  @pytest.mark.parametrize("r,d,v,temp,dtype,backend,block_v,splits,layout", SAMPLER_CASES)
  def test_matches_reference(self, r, d, v, temp, dtype, backend, block_v, splits, layout):
    rng = _rng(r, d, v, temp, dtype, backend, block_v, splits, layout)
    hidden, unembed, sids, pos = _sampler_inputs(rng, r, d, v, dtype, layout)
    seed = np.uint32(rng.integers(0, 2**32, dtype=np.uint64))
    bs = fs.BlockSizes(block_v=block_v, num_splits=splits)
    tok, lp = fs.fused_sample(hidden, unembed, seed, sids, pos, temperature=temp,
                              block_sizes=bs, backend=backend, interpret=True,
                              unembed_layout=layout)
    ref_tok, ref_lp = sampler_ref(hidden, unembed, seed, sids, pos, temperature=temp,
                                  unembed_layout=layout)
    assert tok.dtype == jnp.int32 and lp.dtype == jnp.float32 and tok.shape == (r,)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(ref_tok))
    np.testing.assert_allclose(np.asarray(lp), np.asarray(ref_lp), atol=1e-5, rtol=1e-5)

  @pytest.mark.parametrize("backend", ["triton", "tpu"])
  @pytest.mark.parametrize("temp", [0.7, 1.3])
  def test_same_tokens_as_reference_over_many_rows(self, backend, temp):
    # T != 1 near-ties: both paths temper by the same f32 1/T and use full-precision f32 dots,
    # so over 512 rows and a 2048 vocabulary every token agrees (and the layouts agree too).
    rng = _rng("many rows", backend, temp)
    hidden, unembed, sids, pos = _sampler_inputs(rng, 512, 64, 2048, jnp.float32)
    seed = np.uint32(12345)
    bs = fs.BlockSizes(block_v=512 if backend == "tpu" else 256, block_r=128 if backend == "tpu"
                       else 64, block_d=64 if backend == "triton" else None, num_splits=1)
    ref_tok, ref_lp = sampler_ref(hidden, unembed, seed, sids, pos, temperature=temp)
    for layout, w in (("dv", unembed), ("vd", jnp.asarray(unembed.T))):
      tok, lp = fs.fused_sample(hidden, w, seed, sids, pos, temperature=temp, block_sizes=bs,
                                backend=backend, interpret=True, unembed_layout=layout)
      np.testing.assert_array_equal(np.asarray(tok), np.asarray(ref_tok))
      np.testing.assert_allclose(np.asarray(lp), np.asarray(ref_lp), atol=1e-5, rtol=1e-5)

  @pytest.mark.parametrize("backend", ["triton", "tpu"])
  @pytest.mark.parametrize("layout", ["dv", "vd"])
  def test_vocabulary_slice_at_an_offset(self, backend, layout):
    # a vocabulary shard: its columns are ids offset .. offset + V - 1, its noise theirs
    rng = _rng("offset", backend, layout)
    hidden, unembed, sids, pos = _sampler_inputs(rng, 12, 32, 300, jnp.float32, layout)
    offset = 1200
    parts = fs.fused_sample_partials(hidden, unembed, 5, sids, pos, temperature=1.0,
                                     vocab_offset=jnp.int32(offset), backend=backend,
                                     interpret=True, unembed_layout=layout)
    tok, lp = fs.finish(*parts)
    ref_tok, ref_lp = fs.fused_sample_reference(hidden, unembed, 5, sids, pos, temperature=1.0,
                                                unembed_layout=layout, vocab_offset=offset)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(ref_tok))
    assert (np.asarray(tok) >= offset).all() and (np.asarray(tok) < offset + 300).all()
    np.testing.assert_allclose(np.asarray(lp), np.asarray(ref_lp), atol=1e-5, rtol=1e-5)
    unshifted = fs.fused_sample(hidden, unembed, 5, sids, pos, temperature=1.0, backend=backend,
                                interpret=True, unembed_layout=layout)[0]
    assert (np.asarray(unshifted) + offset != np.asarray(tok)).any()  # the noise moved with it

  def test_reference_layouts_agree(self):
    hidden, unembed, sids, pos = _sampler_inputs(np.random.default_rng(2), 64, 32, 500,
                                                 jnp.float32)
    a = sampler_ref(hidden, unembed, 9, sids, pos, temperature=0.7)
    b = sampler_ref(hidden, jnp.asarray(unembed.T), 9, sids, pos, temperature=0.7,
                    unembed_layout="vd")
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
    np.testing.assert_allclose(np.asarray(a[1]), np.asarray(b[1]), atol=1e-6)

  @pytest.mark.parametrize("backend", ["triton", "tpu"])
  def test_greedy_tie_takes_lowest_id(self, backend):
    rng = np.random.default_rng(11)
    hidden, unembed, sids, pos = _sampler_inputs(rng, 6, 32, 400, jnp.float32)
    hidden = jnp.abs(hidden)
    unembed = unembed.at[:, 70].set(5.0).at[:, 290].set(5.0)  # equal top logits, other splits
    bs = fs.BlockSizes(block_v=128, num_splits=3)
    tok, _ = fs.fused_sample(hidden, unembed, 0, sids, pos, temperature=0.0, block_sizes=bs,
                             backend=backend, interpret=True)
    np.testing.assert_array_equal(np.asarray(tok), 70)

  @pytest.mark.parametrize("change,match", [
      (dict(d_w=32), r"same D"),
      (dict(d_w=32, layout="vd"), r"unembed \[V, D\] \(unembed_layout='vd'\) with the same D"),
      (dict(layout="dV"), r"unembed_layout must be one of \('dv', 'vd'\), got 'dV'"),
      (dict(temperature=-1.0), r"temperature must be a finite number >= 0"),
      (dict(temperature=float("nan")), r"temperature must be a finite number >= 0"),
      (dict(ids_r=3), r"sample_ids must be integer \[R\]"),
      (dict(block_v=100), r"block_v=100 breaks the Triton rule"),
      (dict(block_v=64, backend="tpu"), r"block_v=64 breaks the TPU \(8, 128\) rule"),
      (dict(block_r=8, backend="tpu", dtype=jnp.bfloat16), r"block_r=8 .* multiple of 16"),
      (dict(block_d=48), r"block_d=48 breaks the Triton rule"),
      (dict(d=40), r"D=40 must be a multiple of 16 on Triton"),
  ])
  def test_bad_input_raises(self, change, match):
    r, d, v = 8, change.get("d", 64), 256
    dtype = change.get("dtype", jnp.float32)
    hidden = jnp.ones((r, d), dtype)
    shape = (change.get("d_w", d), v)
    unembed = jnp.ones(shape if change.get("layout", "dv") != "vd" else shape[::-1], dtype)
    sids = jnp.zeros((change.get("ids_r", r),), jnp.int32)
    pos = jnp.zeros((r,), jnp.int32)
    bs = fs.BlockSizes(block_v=change.get("block_v"), block_d=change.get("block_d"),
                       block_r=change.get("block_r"))
    with pytest.raises(ValueError, match=match):
      fs.fused_sample(hidden, unembed, 0, sids, pos, temperature=change.get("temperature", 1.0),
                      block_sizes=bs, backend=change.get("backend", "triton"), interpret=False,
                      unembed_layout=change.get("layout", "dv"))


@pytest.mark.slow  # about 17 s (30 s on the CI class) of interpret-mode compiles; each kernel's
# own reference tests stay in the fast suite
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_with_kernels_equals_references(random_model, temperature):
  """Speculative (and vanilla) rollouts with the Pallas kernels forced on (interpret mode) give the
  same tokens as with the jnp references (through the engine's public entry point only)."""
  from specroll_jax import rollout
  from specroll_jax.heads import medusa as H

  config, params = random_model
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [3, 3]]
  hd = H.init(jax.random.key(1), config, 3, scale=0.05)
  cfg = rollout.SamplingConfig(temperature=temperature)
  spec = rollout.SpecConfig(node_budget=16, bucket_fractions=(1.0,))
  kw = dict(sampling=cfg, max_new_tokens=8, seed=3, eos_ids=[])
  ref = rollout.generate(config, params, prompts,
                         options=rollout.DecodeOptions(kernels="reference"), **kw)
  pallas = rollout.DecodeOptions(kernels="pallas_interpret")
  for speculation in (None, rollout.Speculation.of_heads(hd, spec)):
    got = rollout.generate(config, params, prompts, options=pallas, speculation=speculation,
                           **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(ref.logprobs), atol=1e-5)
