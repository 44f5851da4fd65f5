"""Adaptation through the engine: Reflex corrections and slow-path refreshes between batches never
change a committed token; the adaptation state is carried by ``generate``, compiles once and is
checkpointable by orbax as is (all in one test: one compile of the adaptive engine)."""

import dataclasses

import chex
import jax
import numpy as np
import pytest
from conftest import LONG

from specroll_jax import adaptation as A
from specroll_jax import engines, proposers, reflex, rollout
from specroll_jax import heads as H
from specroll_jax import slow_path as SP
from specroll_jax.checkpoint import Checkpointer
from specroll_jax.rollout import SamplingConfig, SpecConfig

# gates opened wide (a negative LCB z passes almost any alignment) so that corrections really
# happen within a few short rollouts: exactness must hold whatever the proposals are
EAGER = reflex.ReflexConfig(min_obs=(2, 2, 2), min_severity=(0.05, 0.05, 0.05), stride_rows=1.0,
                            lcb_z=-5.0, record_capacity=128)
SPEC = SpecConfig(node_budget=24, bucket_fractions=(1.0, 0.5))


def _config(sampling, mode="every_batch"):
  slow = SP.SlowPathConfig.for_tests(mode=mode, learning_rate=1e-3, guard=False)
  return A.AdaptationConfig(reflex=EAGER, slow=slow).for_sampling(sampling)


@pytest.mark.parametrize("sampling", [
    pytest.param(SamplingConfig(temperature=0.0), marks=LONG),
    pytest.param(SamplingConfig(temperature=0.7, top_p=0.9), marks=LONG),
    pytest.param(SamplingConfig(temperature=1.0, top_k=3), marks=LONG),
    pytest.param(SamplingConfig(temperature=1.0), marks=pytest.mark.slow)], ids=str)
def test_reflex_and_slow_path_never_change_tokens(trained_model, gsm8k_prompts, sampling,
                                                  tmp_path):
  """Three adaptive batches: the vanilla tokens every time, Reflex corrections and slow-path
  refreshes really happen, new heads and safety do not recompile, the state checkpoints as is."""
  config, params, tok = trained_model
  prompts = gsm8k_prompts[:8]
  heads = H.init(jax.random.key(4), config, 3, scale=0.05)
  state = A.init(_config(sampling), heads)
  corrected = refreshed = 0
  sizes = []
  free = np.asarray(rollout.generate(config, params, prompts, sampling=sampling, max_new_tokens=40,
                                     eos_ids=[]).tokens)
  eos = sorted({*tok.eos_ids, int(free[0, 12]), int(free[3, 25])})  # tokens met mid-response
  for batch in range(3):
    kw = dict(sampling=sampling, max_new_tokens=40, seed=batch, eos_ids=eos,
              sample_ids=np.arange(8) + 8 * batch)
    ref = rollout.generate(config, params, prompts, **kw)
    out = rollout.generate(config, params, prompts, spec=SPEC, adaptation=state, **kw)
    sizes.append(engines._spec_call._cache_size())
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=1e-5)
    lens = np.asarray(ref.lengths)
    assert lens.min() < 40  # EOS inside trees: some rows end early
    assert int(np.asarray(out.stats.spec.bucket_forwards)[1]) > 0  # compacted into bucket 2
    rep = out.adaptation_report
    corrected += sum(rep.reflex.correction_rate) > 0
    refreshed += len(rep.slow.heads) > 0
    new = out.adaptation
    assert int(new.batches) == batch + 1
    if rep.slow.kept:
      assert any(not np.array_equal(np.asarray(a), np.asarray(b))
                 for a, b in zip(jax.tree.leaves(state.heads), jax.tree.leaves(new.heads),
                                 strict=True))
    state = new
    if sampling.top_k:  # the records' p is the restricted target's: at most top_k ids carry mass
      res = state.slow.reservoir
      valid = np.asarray(res.valid)
      held = (np.asarray(res.p) > 0).sum(-1)[valid]
      assert valid.sum() > 0 and held.max() <= sampling.top_k
      assert (np.asarray(res.support)[valid] >= 0).sum(-1).max() > sampling.top_k
  assert corrected > 0 and refreshed > 0  # both paths really acted between and inside batches
  assert sizes[1] == sizes[0] and sizes[2] == sizes[0]  # new heads / safety: no recompile
  with Checkpointer(tmp_path / "ckpt", async_save=False) as ck:
    ck.save(3, state, {"batch": 3})
    back, meta = ck.restore(like=state)
  assert meta["batch"] == 3 and back.config == state.config
  chex.assert_trees_all_equal(state, back)  # same structure, types, shapes, dtypes and values


def test_adaptation_argument_checks(trained_model):
  config, params, _ = trained_model
  heads = H.init(jax.random.key(5), config, 3)
  state = A.init(_config(SamplingConfig(temperature=0.7)), heads)
  with pytest.raises(ValueError, match="does not match the sampling temperature"):
    rollout.generate(config, params, [[1, 2]], max_new_tokens=4, adaptation=state,
                     sampling=SamplingConfig(temperature=1.0))
  with pytest.raises(ValueError, match="brings its own proposer"):
    rollout.generate(config, params, [[1, 2]], max_new_tokens=4, adaptation=state, heads=heads,
                     sampling=SamplingConfig(temperature=0.7))
  with pytest.raises(ValueError, match="heads has 2 heads but ReflexConfig.num_heads is 3"):
    A.init(A.AdaptationConfig(), H.init(jax.random.key(5), config, 2))
  with pytest.raises(ValueError, match="needs records"):
    A.AdaptationConfig(reflex=reflex.ReflexConfig(record_capacity=0))


@pytest.mark.slow  # the deprecated adaptation= path (tests/test_specroll.py: the object)
def test_a_sleeping_reflex_proposes_with_the_plain_heads(trained_model, gsm8k_prompts):
  """ReflexConfig.sleep_batches: while ``reflex.sleep`` > 0 the plain heads propose (no Reflex in
  the decode loop), the committed tokens stay the vanilla ones, each sleeping batch counts the
  sleep down, and the batch after it is awake again (a probe). A sleeping Reflex writes no
  records, so it needs records from the trainer (or no slow path)."""
  config, params, _ = trained_model
  heads = H.init(jax.random.key(6), config, 3, scale=0.05)
  sampling = SamplingConfig(temperature=1.0)
  sleepy = reflex.ReflexConfig(sleep_batches=2, record_capacity=0)
  with pytest.raises(ValueError, match="a sleeping Reflex writes no records"):
    A.AdaptationConfig(reflex=dataclasses.replace(sleepy, record_capacity=64),
                       slow=SP.SlowPathConfig.for_tests(mode="degradation"))
  ac = A.AdaptationConfig(reflex=sleepy, slow=SP.SlowPathConfig(mode="off"))
  state = A.init(ac, heads)
  assert not A.asleep(state) and isinstance(A.proposer(state)[0], proposers.ReflexProposer)
  state = state.replace(reflex=state.reflex.replace(sleep=jax.numpy.int32(2)))
  prop, pp = A.proposer(state)
  assert A.asleep(state) and type(prop) is proposers.HeadsProposer and pp is state.heads
  prompts = gsm8k_prompts[:4]
  kw = dict(sampling=sampling, max_new_tokens=16, eos_ids=[], sample_ids=np.arange(4))
  ref = rollout.generate(config, params, prompts, **kw)
  spec = SpecConfig(node_budget=8, bucket_fractions=(1.0,))
  for left in (1, 0):
    out = rollout.generate(config, params, prompts, spec=spec, adaptation=state, **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert out.adaptation_report.reflex == reflex.ReflexSummary(asleep=True, sleep_left=left)
    assert out.stats.tokens_per_forward > 1.0  # the heads really proposed
    state = out.adaptation
    assert int(state.reflex.sleep) == left
  assert int(state.batches) == 2 and not A.asleep(state)  # the next batch is a probe, awake
  assert isinstance(A.proposer(state)[0], proposers.ReflexProposer)
