"""The traceable entries run inside a caller's ``jax.jit`` and ``jax.shard_map``: on 4 CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``, in a subprocess) every shard runs its own
bucketed loops and the result equals the unsharded rollout, token for token."""

import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_on_cpu_devices

from specroll_jax import rollout
from specroll_jax.heads import medusa as H
from specroll_jax.kernels import Kernels
from specroll_jax.proposers import HeadsProposer

ROOT = Path(__file__).resolve().parents[1]


def test_speculative_rollout_inside_user_jit(random_model):
  """A caller's jitted function: rollout + a reward written in jnp, one compiled program."""
  config, params = random_model
  hd = H.init(jax.random.key(1), config, 3, scale=0.05)
  prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12]]
  batch = rollout.prepare_batch(config, prompts, max_new_tokens=12, eos_ids=[])
  settings = rollout.DecodeSettings(sampling=rollout.SamplingConfig(temperature=1.0),
                                    max_new_tokens=12, cache_length=batch.cache_length,
                                    kernels=Kernels.resolve("reference"))
  spec = rollout.SpecConfig(node_budget=8, bucket_fractions=(1.0, 0.5))

  @jax.jit
  def step(params, heads, tokens, lengths, sids, seed):
    out = rollout.speculative_rollout(config, params, HeadsProposer(), heads, tokens, lengths,
                                      sids, jnp.asarray([-1]), seed, settings=settings, spec=spec)
    reward = (out.tokens % 2 == 0).sum(1)  # a reward on token ids, in jnp
    return out.tokens, out.lengths, reward

  toks, lens, reward = step(params, hd, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths),
                            jnp.asarray(batch.sample_ids), jnp.uint32(7))
  ref = rollout.generate(config, params, prompts, max_new_tokens=12, seed=7, eos_ids=[])
  np.testing.assert_array_equal(np.asarray(toks), np.asarray(ref.tokens))
  np.testing.assert_array_equal(np.asarray(reward), (np.asarray(ref.tokens) % 2 == 0).sum(1))


_SHARDED = textwrap.dedent("""
    import functools, json, os, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from specroll_jax import models, rollout
    from specroll_jax.heads import medusa as H
    from specroll_jax.adaptation import reflex
    from specroll_jax.kernels import Kernels
    from specroll_jax.proposers import Merged, ReflexProposer
    assert jax.device_count() == 4, jax.devices()
    config = models.ModelConfig.tiny(vocab_size=64, max_position_embeddings=128)
    params = models.init_params(jax.random.key(0), config)
    hd = H.init(jax.random.key(1), config, 3, scale=0.05)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, rng.integers(2, 9)).tolist() for _ in range(16)]
    eos = [5, 9]  # frequent ids in a 64-token vocab: ragged lengths, compaction per shard
    batch = rollout.prepare_batch(config, prompts, max_new_tokens=24, eos_ids=eos,
                                  sample_ids=np.arange(16) * 3)
    settings = rollout.DecodeSettings(sampling=rollout.SamplingConfig(temperature=1.0),
                                      max_new_tokens=24, cache_length=batch.cache_length,
                                      kernels=Kernels.resolve("reference"))
    spec = rollout.SpecConfig(node_budget=8, bucket_fractions=(1.0, 0.5, 0.25))
    prop = Merged()  # the heads and the row's own-text lookup in one ranked tree
    mesh = Mesh(np.array(jax.devices()), ("data",))
    args = [jnp.asarray(a) for a in (batch.tokens, batch.lengths, batch.sample_ids)]
    eos_a = jnp.asarray(batch.eos_ids)

    def spec_fn(params, pp, tokens, lengths, sids, prop=prop):
      out = rollout.speculative_rollout(config, params, prop, pp, tokens, lengths, sids, eos_a,
                                        jnp.uint32(3), settings=settings, spec=spec)
      return out.tokens, out.lengths, out.logprobs
    # Reflex with its records buffer (its conds' branches must agree on what varies per shard)
    rcfg = reflex.ReflexConfig(record_capacity=64)
    reflex_fn = functools.partial(spec_fn, prop=ReflexProposer(rcfg))

    def van_fn(params, tokens, lengths, sids):
      out = rollout.vanilla_rollout(config, params, tokens, lengths, sids, eos_a, jnp.uint32(3),
                                    settings=settings)
      return out.tokens, out.lengths, out.logprobs

    d = P("data")
    sharded_spec = jax.jit(jax.shard_map(spec_fn, mesh=mesh, in_specs=(P(), P(), d, d, d),
                                         out_specs=(d, d, d)))
    sharded_van = jax.jit(jax.shard_map(van_fn, mesh=mesh, in_specs=(P(), d, d, d),
                                        out_specs=(d, d, d)))
    sharded_reflex = jax.jit(jax.shard_map(reflex_fn, mesh=mesh, in_specs=(P(), P(), d, d, d),
                                           out_specs=(d, d, d)))
    a = sharded_spec(params, prop.params(hd), *args)
    c = sharded_reflex(params, ReflexProposer(rcfg).params(hd, reflex.init_global(rcfg)), *args)
    b = sharded_van(params, *args)
    ref = rollout.generate(config, params, prompts, max_new_tokens=24, seed=3, eos_ids=eos,
                           sample_ids=np.arange(16) * 3)
    res = {}
    for name, got in (("spec", a), ("vanilla", b), ("reflex", c)):
      res[name] = {"tokens": bool((np.asarray(got[0]) == np.asarray(ref.tokens)).all()),
                   "lengths": bool((np.asarray(got[1]) == np.asarray(ref.lengths)).all()),
                   "logprob_gap": float(np.abs(np.asarray(got[2]) - ref.logprobs).max())}
    res["lengths"] = np.asarray(ref.lengths).tolist()
    print("RESULT " + json.dumps(res))
""")


@pytest.mark.slow  # a 4-device subprocess
def test_rollouts_under_shard_map_on_4_devices(tmp_path):
  res = run_on_cpu_devices(tmp_path, _SHARDED)
  lens = np.array(res["lengths"])
  assert lens.min() < 24 and lens.max() == 24  # ragged: shards loop for different counts
  for name in ("spec", "vanilla", "reflex"):
    assert res[name]["tokens"] and res[name]["lengths"], res
    assert res[name]["logprob_gap"] <= 1e-5, res

