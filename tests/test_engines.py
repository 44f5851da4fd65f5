"""The engines as objects: frozen, hashable static settings, one typed ``PromptBatch``, the same
tokens as ``generate`` and as each other, traceable inside a caller's jit, one compile per equal
engine, and bad settings refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specroll_jax import engines, rollout
from specroll_jax.engines import executables
from specroll_jax.heads import medusa as H
from specroll_jax.proposers import HeadsProposer
from specroll_jax.sampling import SamplingConfig

PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12]]
NEW = 12
SAMPLING = SamplingConfig(temperature=1.0)
SPEC = rollout.SpecConfig(node_budget=8, bucket_fractions=(1.0, 0.5))


@pytest.fixture(scope="module")
def setup(random_model):
  config, params = random_model
  prepared = rollout.prepare_batch(config, PROMPTS, max_new_tokens=NEW, eos_ids=[],
                                   sample_ids=np.arange(4) * 5)
  batch = prepared.device(7)
  van = engines.VanillaEngine.build(config, sampling=SAMPLING, max_new_tokens=NEW,
                                    cache_length=prepared.cache_length, kernels="reference")
  spec = engines.SpecEngine.build(config, proposer=HeadsProposer(), sampling=SAMPLING,
                                  max_new_tokens=NEW, cache_length=prepared.cache_length,
                                  spec=SPEC, kernels="reference")
  heads = H.init(jax.random.key(1), config, 3, scale=0.05)
  ref = rollout.generate(config, params, PROMPTS, sampling=SAMPLING, max_new_tokens=NEW, seed=7,
                         eos_ids=[], sample_ids=np.arange(4) * 5,
                         options=rollout.DecodeOptions(kernels="reference"))
  return config, params, heads, batch, van, spec, ref


def test_engines_give_generates_tokens(setup):
  _, params, heads, batch, van, spec, ref = setup
  a = van.jit(params, batch)
  b = spec.jit(params, heads, batch)
  for out in (a, b):
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=1e-5)
  assert int(np.asarray(b.stats.target_forwards)) <= int(np.asarray(a.stats.target_forwards))
  assert spec.vanilla() == van


def test_engine_inside_a_user_jit_and_one_compile_per_equal_engine(setup):
  config, params, heads, batch, van, spec, ref = setup

  @jax.jit
  def reward(params, batch):
    out = van(params, batch)  # the engine object is a closure constant: static
    return (out.tokens % 2 == 0).sum(1)  # (the speculative engine in a user jit: test_traceable)

  np.testing.assert_array_equal(np.asarray(reward(params, batch)),
                                (np.asarray(ref.tokens) % 2 == 0).sum(1))
  van.jit(params, batch)
  before = executables.programs()
  twin = engines.VanillaEngine(config, van.settings)  # equal settings: equal, same hash
  assert twin == van and hash(twin) == hash(van)
  twin.jit(params, batch)
  assert executables.programs() == before


def test_prompt_batch_is_a_pytree_and_checks_the_seed(setup):
  config, *_ = setup
  prepared = rollout.prepare_batch(config, PROMPTS, max_new_tokens=NEW)
  batch = prepared.device(3)
  leaves = jax.tree.leaves(batch)
  assert len(leaves) == 5 and batch.seed.dtype == jnp.uint32
  moved = jax.tree.map(lambda x: x + 0, batch)
  assert isinstance(moved, engines.PromptBatch)
  with pytest.raises(ValueError, match=r"seed must be an int in \[0, 4294967295\], got -1"):
    prepared.device(-1)


def test_bad_engine_settings_are_refused_by_name(setup):
  config, *_ = setup
  with pytest.raises(ValueError, match="SpecEngine.proposer must be a specroll_jax.proposers"):
    engines.SpecEngine(config, setup[4].settings, proposer="heads")
  with pytest.raises(ValueError, match="DecodeSettings.max_new_tokens must be an int >= 1, got 0"):
    engines.VanillaEngine.build(config, max_new_tokens=0, cache_length=8)
  with pytest.raises(ValueError, match="VanillaEngine.config must be a ModelConfig"):
    engines.VanillaEngine({"vocab_size": 64}, setup[4].settings)
