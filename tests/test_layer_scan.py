"""The layer scan (``layer_loop.LayerLoop``) computes what the unrolled layers compute: the same
logits, hidden states and K/V from ``forward`` / ``step`` / ``prefill`` / ``append_step``
(stacked and per-layer caches alike), the same rollout tokens from both engines, and the scanned
decode step writes its carried cache in place."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specroll_jax import engines, rollout
from specroll_jax.heads import medusa as H
from specroll_jax.models import decoder, layer_loop
from specroll_jax.proposers import HeadsProposer
from specroll_jax.sampling import SamplingConfig

UNROLL = layer_loop.LayerLoop(full="unroll", cached="unroll")
SCAN = layer_loop.LayerLoop(full="scan", cached="scan")
# Same ops, but XLA fuses the scan body and the unrolled layers differently (rope products may
# become FMAs in one and not the other): values agree to float rounding, not bit for bit.
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def model(random_model):
  """The shared tiny random model (2 layers)."""
  return random_model


def _perturbed(params):
  """Every leaf plus a different deterministic ripple (unit norms and zero biases would hide a
  layer mix-up); traced inside each program, cheaply (no random-number code to compile)."""
  leaves, treedef = jax.tree.flatten(params)
  ripple = lambda x, i: 0.1 * jnp.sin(jnp.arange(x.size, dtype=x.dtype).reshape(x.shape) * 0.7
                                      + i).astype(x.dtype)
  return jax.tree.unflatten(treedef, [x + ripple(x, i) for i, x in enumerate(leaves)])


def _decode(model, loop):
  """Everything the decoder returns on one small problem, traced afresh under ``loop``."""
  config, params = model
  tokens = jax.random.randint(jax.random.key(2), (3, 9), 0, config.vocab_size)
  lengths = jnp.array([6, 2, 4], jnp.int32)

  def run(params):
    params = _perturbed(params)
    out = {"forward": decoder.forward(config, params, tokens)}
    cache = decoder.init_cache(config, 3, 16)
    cache, out["prefill_logits"], out["prefill_hidden"] = decoder.prefill(
        config, params, tokens[:, :6], lengths, cache)
    # a verify-like step: 3 new tokens, the third a sibling of the second
    mask = jnp.broadcast_to(jnp.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool), (3, 3, 3))
    pos = cache.lengths[:, None] + jnp.array([0, 1, 1])
    st = decoder.step(config, params, tokens[:, 6:9], pos, cache, mask)
    out.update(step_logits=st.logits, step_k=st.k_new, step_v=st.v_new)
    p = decoder.unstack_layers(params)
    for j in range(2):  # a two-token then a one-token append with one slot dropped
      t = 2 - j
      slots = cache.lengths[:, None] + jnp.arange(t)
      slots = slots.at[1, 0].set(-1) if j == 1 else slots
      h, cache = decoder.append_step(config, p, tokens[:, 6 + j:6 + j + t], cache, slots)
      cache = cache.replace(lengths=cache.lengths + t)
      out[f"append_hidden{j}"] = h
    out["cache_k"], out["cache_v"] = cache.stacked()
    out["stacked"] = jnp.asarray(cache.is_stacked)
    return out

  with layer_loop.layer_loop(loop):
    return jax.device_get(jax.jit(run)(params))


def test_layer_loop_policy_and_bad_names(model):
  config = model[0]
  before = layer_loop.layer_loop_policy()
  with layer_loop.layer_loop("scan") as p:
    assert p == SCAN == layer_loop.layer_loop_policy()
    assert decoder.init_cache(config, 2, 8).is_stacked
  assert layer_loop.layer_loop_policy() == before
  with pytest.raises(ValueError, match=r"LayerLoop.full must be one of .*'unrolled'"):
    layer_loop.LayerLoop(full="unrolled")
  with pytest.raises(ValueError, match=r"layer loop must be one of .*'both'"):
    layer_loop.LayerLoop.resolve("both")
  with pytest.raises(ValueError, match=r"layout must be one of .*'stacked'"):
    decoder.init_cache(config, 2, 8, layout="stacked")


def test_scan_gives_the_unrolled_outputs(model):
  ref, got = _decode(model, UNROLL), _decode(model, SCAN)
  assert not ref.pop("stacked") and got.pop("stacked")
  for key in ref:
    np.testing.assert_allclose(got[key], ref[key], **TOL, err_msg=key)
  # the dropped slot (row 1, second append) stays zero in both layouts
  assert not np.any(got["cache_k"][:, 1, 4]) and not np.any(ref["cache_k"][:, 1, 4])


def test_stacked_cache_rows_and_writes(model):
  c = model[0]
  with layer_loop.layer_loop("scan"):
    cache = decoder.init_cache(c, 3, 5)
  per_layer = decoder.init_cache(c, 3, 5, layout="unroll")
  assert cache.k.shape == (3, c.num_layers, 5, c.num_kv_heads, c.head_dim)
  assert cache.max_length == per_layer.max_length == 5
  k_new = jax.random.normal(jax.random.key(3), (c.num_layers, 3, 2, c.num_kv_heads, c.head_dim))
  slots = jnp.array([[0, 1], [-1, 4], [5, 2]])
  a = decoder.write_cache(cache, k_new, 2 * k_new, slots)
  b = decoder.write_cache(per_layer, k_new, 2 * k_new, slots)
  for x, y in zip(a.stacked(), b.stacked(), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  rows = jnp.array([2, 0])
  np.testing.assert_array_equal(np.asarray(a.take_rows(rows).stacked()[1]),
                                np.asarray(b.take_rows(rows).stacked()[1]))


@pytest.mark.slow
def test_speculative_rollout_under_scan_gives_the_unrolled_vanilla_tokens(model):
  config, params = model
  prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12]]
  sampling = SamplingConfig(temperature=1.0)
  prepared = rollout.prepare_batch(config, prompts, max_new_tokens=10, eos_ids=[],
                                   sample_ids=np.arange(4) * 3)
  batch = prepared.device(5)
  kw = dict(sampling=sampling, max_new_tokens=10, cache_length=prepared.cache_length,
            kernels="reference")
  van = engines.VanillaEngine.build(config, bucket_fractions=(1.0,), **kw)
  # 2 nodes per row in the first bucket (verify), the plain decode step (N = 0) in the second, and
  # the stacked cache compacted between them
  spec = engines.SpecEngine.build(config, proposer=HeadsProposer(), spec=rollout.SpecConfig(
      bucket_fractions=(1.0, 0.5), nodes=(2, 0)), **kw)
  heads = H.init(jax.random.key(4), config, 3, scale=0.05)
  with layer_loop.layer_loop(UNROLL):
    ref = jax.jit(lambda p, b: van(_perturbed(p), b))(params, batch)
  with layer_loop.layer_loop(SCAN):
    out = jax.jit(lambda p, h, b: spec(_perturbed(p), h, b))(params, heads, batch)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
  np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
  np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=1e-4)


def test_scanned_decode_updates_the_carried_cache_in_place(model):
  config, params = model
  """The scan body writes the new K/V into the stacked cache it carries before reading the layer
  (read-then-write made XLA copy the whole cache in every layer of every step)."""
  with layer_loop.layer_loop("scan"):
    cache = decoder.init_cache(config, 4, 32)

    def loop(params, cache):
      def body(_, c):
        _, c = decoder.append_step(config, params, jnp.zeros((4, 1), jnp.int32), c,
                                   c.lengths[:, None])
        return c.replace(lengths=c.lengths + 1)
      return jax.lax.fori_loop(0, 4, body, cache)

    hlo = jax.jit(loop).lower(params, cache).compile().as_text()
  shape = "f32[" + ",".join(map(str, cache.k.shape)) + "]"
  copies = [ln for ln in hlo.splitlines() if re.search(rf"= {re.escape(shape)}\S* copy\(", ln)]
  assert len(copies) <= 2, copies  # at most the entry copies of the two (not donated) inputs
