"""Pallas kernels == their jnp references (interpret mode on CPU), lowering for cuda/tpu, bad input.

Interpret mode is slow on 2 cores, so each kernel is tested over a hand-picked list of cases that
together cover every axis (L and T off the block size, H/Hkv in {1, 2, 7}, Dh in {64, 128}, empty
and full cache rows, T = 1, random tree masks, f32 and bf16, split and unsplit, both kernel bodies)
instead of the full product. Each case compiles once.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fused_sampler as fs
from pallas_kernels import tree_attention as ta
from specroll_jax.models import attention as attn_dispatch

# f32: the kernel computes what the reference computes up to summation order. bf16: inputs and
# output are rounded to 8 mantissa bits and P is cast to bf16 for the PV matmul, so 2e-2 (abs and
# rel: outputs are averages of N(0, 1) values and can sit near zero).
TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}

TRITON_CALL = "__gpu$xla.gpu.triton"


def _rng(*case):
  """A generator seeded by the case itself: fresh inputs per case, reproducible across runs."""
  return np.random.default_rng(zlib.crc32(repr(case).encode()))


# References jitted: one compile per case instead of one per eager op (several times faster here).
attention_ref = ta.tree_attention_reference_jit
sampler_ref = jax.jit(fs.fused_sample_reference, static_argnames="temperature")


def _attention_inputs(rng, b, t, h, hkv, dh, lc, dtype):
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dtype)
  q = normal(b, t, h, dh)
  k_cache, v_cache = normal(b, lc, hkv, dh), normal(b, lc, hkv, dh)
  k_new, v_new = normal(b, t, hkv, dh), normal(b, t, hkv, dh)
  lengths = rng.integers(0, lc + 1, size=b)
  lengths[0] = lc  # a full row
  if b > 1:
    lengths[1] = 0  # an empty row
  # Random tree: each node's parent is an earlier node; mask = ancestor-or-self (includes diagonal).
  mask = np.zeros((b, t, t), bool)
  for i in range(b):
    for j in range(t):
      mask[i, j, j] = True
      if j:
        mask[i, j] |= mask[i, rng.integers(0, j)]
  return q, k_cache, v_cache, jnp.asarray(lengths, jnp.int32), k_new, v_new, jnp.asarray(mask)


def _upcast(args):
  return tuple(a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args)


# (B, T, H, Hkv, Dh, L, dtype, backend, block_l, num_splits)
ATTENTION_CASES = [
    (2, 5, 4, 2, 64, 80, jnp.float32, "triton", 32, 1),  # L, T off the block; one split
    (2, 5, 4, 2, 64, 80, jnp.float32, "triton", 16, 3),  # split over L + combine
    (3, 1, 7, 1, 64, 37, jnp.float32, "triton", 16, None),  # H/Hkv = 7 (MQA), T = 1 (root only)
    (2, 4, 2, 2, 128, 64, jnp.float32, "triton", 32, 2),  # H/Hkv = 1, Dh = 128
    (2, 6, 14, 2, 128, 50, jnp.bfloat16, "triton", 16, None),  # H/Hkv = 7 in bf16
    (2, 3, 4, 4, 64, 9, jnp.bfloat16, "triton", 128, None),  # L < block_l (pad), default blocks
    (2, 5, 4, 2, 64, 200, jnp.float32, "tpu", 128, 1),  # Mosaic body: partial last block
    (1, 4, 14, 2, 128, 200, jnp.bfloat16, "tpu", 128, 2),  # Mosaic body, split, bf16
    (2, 1, 7, 1, 64, 70, jnp.float32, "tpu", 128, None),  # Mosaic body, L < block_l, T = 1
]


class TestTreeAttention:

  @pytest.mark.parametrize("b,t,h,hkv,dh,lc,dtype,backend,block_l,splits", ATTENTION_CASES)
  def test_matches_reference(self, b, t, h, hkv, dh, lc, dtype, backend, block_l, splits):
    rng = _rng(b, t, h, hkv, dh, lc, dtype, backend, block_l, splits)
    args = _attention_inputs(rng, b, t, h, hkv, dh, lc, dtype)
    bs = ta.BlockSizes(block_l=block_l, num_splits=splits)
    out = ta.tree_attention(*args, interpret=True, backend=backend, block_sizes=bs)
    ref = attention_ref(*_upcast(args))
    assert out.shape == (b, t, h, dh) and out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), **TOL[dtype])

  @pytest.mark.parametrize("backend,splits", [("triton", 2), ("tpu", 1)])
  def test_fully_masked_row_is_zero_not_nan(self, backend, splits):
    rng = np.random.default_rng(7)
    q, kc, vc, lengths, kn, vn, mask = _attention_inputs(rng, 2, 3, 4, 2, 64, 40, jnp.float32)
    lengths = lengths.at[1].set(0)
    mask = mask.at[1, 2, :].set(False)  # row 1, query 2: no cache and no tree key
    bs = ta.BlockSizes(block_l=128 if backend == "tpu" else 16, num_splits=splits)
    out = ta.tree_attention(q, kc, vc, lengths, kn, vn, mask, interpret=True, backend=backend,
                            block_sizes=bs)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out[1, 2]), 0.0)
    ref = attention_ref(q, kc, vc, lengths, kn, vn, mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **TOL[jnp.float32])

  def test_dispatch_uses_the_kernel_signature(self):
    # Same shapes and (default) block sizes as an ATTENTION_CASES entry: reuses its compile.
    args = _attention_inputs(np.random.default_rng(3), 2, 3, 4, 4, 64, 9, jnp.bfloat16)
    out = attn_dispatch.get("pallas_interpret")(*args)
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(attention_ref(*_upcast(args))), **TOL[jnp.bfloat16])

  @pytest.mark.parametrize("backend,platform,marker", [("triton", "cuda", TRITON_CALL),
                                                       ("tpu", "tpu", "tpu_custom_call")])
  def test_lowers_with_production_block_sizes(self, backend, platform, marker):
    # Qwen2.5-1.5B layout (H=12, Hkv=2, Dh=128), bf16, L off the block size, T = 8 tree nodes.
    b, t, h, hkv, dh, lc = 4, 8, 12, 2, 128, 1000
    sds = jax.ShapeDtypeStruct
    specs = (sds((b, t, h, dh), jnp.bfloat16), sds((b, lc, hkv, dh), jnp.bfloat16),
             sds((b, lc, hkv, dh), jnp.bfloat16), sds((b,), jnp.int32),
             sds((b, t, hkv, dh), jnp.bfloat16), sds((b, t, hkv, dh), jnp.bfloat16),
             sds((b, t, t), jnp.bool_))
    f = lambda *a: ta.tree_attention(*a, backend=backend)
    exported = jax.export.export(
        jax.jit(f), platforms=[platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*specs)
    assert marker in exported.mlir_module()

  @pytest.mark.parametrize("change,match", [
      (dict(h=6, hkv=4), r"H=6 must be a multiple of kv heads Hkv=4"),
      (dict(v_len=32), r"v_cache shape .* != k_cache shape"),
      (dict(dh=96), r"Dh=96 unsupported"),
      (dict(block_l=48), r"block_l=48 breaks the Triton rule"),
      (dict(block_l=64, backend="tpu"), r"block_l=64 breaks the TPU \(8, 128\) rule"),
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
    bs = ta.BlockSizes(block_l=change.get("block_l", 128))
    with pytest.raises(ValueError, match=match):
      ta.tree_attention(q, kc, vc, lengths, kn, vn, mask, interpret=False,
                        backend=change.get("backend", "triton"), block_sizes=bs)

  def test_block_sizes_validate(self):
    with pytest.raises(ValueError, match="num_warps"):
      ta.BlockSizes(num_warps=3)
    with pytest.raises(ValueError, match="num_splits"):
      ta.BlockSizes(num_splits=0)


# (R, D, V, temperature, dtype, backend, block_v, num_splits)
SAMPLER_CASES = [
    (10, 64, 300, 1.0, jnp.float32, "triton", 64, None),  # V off the tile, auto splits
    (10, 64, 300, 0.7, jnp.float32, "triton", 128, 1),  # one split: all tiles in one program
    (10, 64, 300, 0.0, jnp.float32, "triton", 128, 2),  # greedy
    (20, 48, 50, 0.7, jnp.float32, "triton", 128, None),  # V < tile, D not a power of two
    (9, 64, 300, 1.0, jnp.bfloat16, "triton", 64, 3),  # bf16 inputs, f32 accumulation
    (12, 64, 1000, 0.7, jnp.float32, "tpu", 256, 2),  # Mosaic body, partial last tile
    (5, 64, 700, 0.0, jnp.float32, "tpu", 128, None),  # Mosaic body, greedy
]


def _sampler_inputs(rng, r, d, v, dtype):
  hidden = jnp.asarray(rng.standard_normal((r, d)), jnp.float32).astype(dtype)
  unembed = jnp.asarray(rng.standard_normal((d, v)) * 0.3, jnp.float32).astype(dtype)
  sample_ids = jnp.asarray(rng.integers(0, 10_000, size=r), jnp.int32)
  positions = jnp.asarray(rng.integers(0, 4_096, size=r), jnp.int32)
  return hidden, unembed, sample_ids, positions


class TestFusedSampler:

  @pytest.mark.parametrize("r,d,v,temp,dtype,backend,block_v,splits", SAMPLER_CASES)
  def test_matches_reference(self, r, d, v, temp, dtype, backend, block_v, splits):
    rng = _rng(r, d, v, temp, dtype, backend, block_v, splits)
    hidden, unembed, sids, pos = _sampler_inputs(rng, r, d, v, dtype)
    seed = np.uint32(rng.integers(0, 2**32, dtype=np.uint64))
    bs = fs.BlockSizes(block_v=block_v, num_splits=splits)
    tok, lp = fs.fused_sample(hidden, unembed, seed, sids, pos, temperature=temp,
                              block_sizes=bs, backend=backend, interpret=True)
    ref_tok, ref_lp = sampler_ref(hidden, unembed, seed, sids, pos, temperature=temp)
    assert tok.dtype == jnp.int32 and lp.dtype == jnp.float32 and tok.shape == (r,)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(ref_tok))
    np.testing.assert_allclose(np.asarray(lp), np.asarray(ref_lp), atol=1e-5, rtol=1e-5)

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

  @pytest.mark.parametrize("backend,platform,marker", [("triton", "cuda", TRITON_CALL),
                                                       ("tpu", "tpu", "tpu_custom_call")])
  @pytest.mark.parametrize("temp", [0.0, 1.0])
  def test_lowers_with_production_block_sizes(self, backend, platform, marker, temp):
    r, d, v = 16, 1536, 151936  # Qwen2.5-1.5B unembed
    sds = jax.ShapeDtypeStruct
    specs = (sds((r, d), jnp.bfloat16), sds((d, v), jnp.bfloat16), sds((), jnp.uint32),
             sds((r,), jnp.int32), sds((r,), jnp.int32))
    f = lambda *a: fs.fused_sample(*a, temperature=temp, backend=backend)
    exported = jax.export.export(
        jax.jit(f), platforms=[platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*specs)
    assert marker in exported.mlir_module()

  @pytest.mark.parametrize("change,match", [
      (dict(d_w=32), r"same D"),
      (dict(temperature=-1.0), r"temperature must be a finite number >= 0"),
      (dict(temperature=float("nan")), r"temperature must be a finite number >= 0"),
      (dict(ids_r=3), r"sample_ids must be integer \[R\]"),
      (dict(block_v=100), r"block_v=100 breaks the Triton rule"),
      (dict(block_v=64, backend="tpu"), r"block_v=64 breaks the TPU \(8, 128\) rule"),
      (dict(block_d=48), r"block_d=48 breaks the Triton rule"),
      (dict(d=40), r"D=40 must be a multiple of 16 on Triton"),
  ])
  def test_bad_input_raises(self, change, match):
    r, d, v = 8, change.get("d", 64), 256
    hidden = jnp.ones((r, d), jnp.float32)
    unembed = jnp.ones((change.get("d_w", d), v), jnp.float32)
    sids = jnp.zeros((change.get("ids_r", r),), jnp.int32)
    pos = jnp.zeros((r,), jnp.int32)
    bs = fs.BlockSizes(block_v=change.get("block_v"), block_d=change.get("block_d"))
    with pytest.raises(ValueError, match=match):
      fs.fused_sample(hidden, unembed, 0, sids, pos, temperature=change.get("temperature", 1.0),
                      block_sizes=bs, backend=change.get("backend", "triton"), interpret=False)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_with_kernels_equals_references(random_model, temperature):
  """Speculative (and vanilla) rollouts with the Pallas kernels forced on (interpret mode) give the
  same tokens as with the jnp references."""
  import jax

  from specroll_jax import heads as H
  from specroll_jax import rollout

  config, params = random_model
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [3, 3]]
  hd = H.init(jax.random.key(1), config, 3, scale=0.05)
  cfg = rollout.SamplingConfig(temperature=temperature)
  spec = rollout.SpecConfig(node_budget=16, bucket_fractions=(1.0,))
  kw = dict(sampling=cfg, max_new_tokens=8, seed=3, eos_ids=[])
  ref = rollout.generate(config, params, prompts, kernels="reference", **kw)
  for spec_kw in ({}, {"spec": spec, "heads": hd}):
    got = rollout.generate(config, params, prompts, kernels="pallas_interpret", **spec_kw, **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(ref.logprobs), atol=1e-5)
