"""The engine's use of the kernels: a tied embedding reaches the fused sampler as the [V, D] table
itself, so the decode loop never transposes (copies) the embedding."""

import re

import jax
import jax.numpy as jnp

from specroll_jax import rollout
from specroll_jax.kernels import Kernels


def _transposes_to(text: str, shape: tuple[int, ...]) -> int:
  pat = r"stablehlo\.transpose.*->\s*tensor<" + "x".join(map(str, shape)) + r"xf32>"
  return len(re.findall(pat, text))


def test_decode_loop_does_not_transpose_a_tied_embedding(random_model):
  config, params = random_model
  assert config.tie_word_embeddings
  d, v = config.hidden_size, config.vocab_size
  batch = rollout.prepare_batch(config, [[1, 2, 3], [4, 5]], max_new_tokens=4, eos_ids=[])
  args = (jnp.asarray(batch.tokens), jnp.asarray(batch.lengths), jnp.asarray(batch.sample_ids),
          jnp.asarray(batch.eos_ids), jnp.uint32(0))

  def lowered(kernels):
    settings = rollout.DecodeSettings(sampling=rollout.SamplingConfig(), max_new_tokens=4,
                                      cache_length=batch.cache_length, kernels=kernels)
    f = jax.jit(rollout.vanilla_rollout, static_argnames=("config", "settings"))
    return f.lower(config, params, *args, settings=settings).as_text()

  for name in ("pallas_interpret", "reference"):
    assert _transposes_to(lowered(Kernels.resolve(name)), (d, v)) == 0, name
  # the check can fail: contracting with ``embedding.T`` shows up as a transpose
  emb = params["embed"]["embedding"]
  bad = jax.jit(lambda h: jnp.einsum("bd,dv->bv", h, emb.T)).lower(jnp.zeros((2, d))).as_text()
  assert _transposes_to(bad, (d, v)) > 0
